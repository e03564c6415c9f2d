//! Checks of requests against a model's configuration: input names, datatypes, shapes
//! and sizes when an input is added, and completeness and batch size at enqueue.

use super::Request;
use crate::config::{ModelConfig, TensorConfig};
use crate::status::{Error, Result};
use crate::tensor::{count_bytes_elements, element_count, shape_string, DataType, Shape};
use smallvec::SmallVec;
use std::sync::Arc;

pub type ShapeKey = SmallVec<[i64; 8]>;

/// The bytes of an input being checked: in host memory, or in device memory (only its
/// length is known on the host).
#[derive(Clone, Copy)]
pub enum InputBytes<'a> {
    Host(&'a [u8]),
    Device(usize),
}

impl<'a> InputBytes<'a> {
    pub fn of(data: &'a crate::tensor::TensorData) -> InputBytes<'a> {
        match data.device() {
            Some(d) => InputBytes::Device(d.len),
            None => InputBytes::Host(data.as_slice()),
        }
    }
    fn len(&self) -> usize {
        match self {
            InputBytes::Host(b) => b.len(),
            InputBytes::Device(n) => *n,
        }
    }
}

/// The one rule for a version number a caller names: -1 (the latest) or a version >= 1.
pub fn check_version(model: &str, version: i64) -> Result<()> {
    if version == 0 || version < -1 {
        return Err(Error::invalid(format!(
            "model '{model}': version {version} is invalid (use -1 for the latest, or a version >= 1)"
        )));
    }
    Ok(())
}

/// Checks one input against the config; returns the config's shared name for it.
pub fn check_input(
    config: &ModelConfig,
    name: &str,
    dtype: DataType,
    shape: &[i64],
    data: InputBytes<'_>,
) -> Result<Arc<str>> {
    let m = &config.name;
    let tc = config.input(name).ok_or_else(|| {
        let known: Vec<&str> = config.inputs.iter().map(|t| &*t.name).collect();
        Error::invalid(format!(
            "model '{m}' has no input '{name}' (inputs: {})",
            known.join(", ")
        ))
    })?;
    if dtype != tc.data_type {
        return Err(Error::invalid(format!(
            "input '{name}' of model '{m}': expected datatype {}, got {}",
            tc.data_type.as_str(),
            dtype.as_str()
        )));
    }
    check_shape(config, tc, shape)?;
    check_bytes(m, name, dtype, shape, data)?;
    Ok(tc.name.clone())
}

fn check_shape(config: &ModelConfig, tc: &TensorConfig, shape: &[i64]) -> Result<()> {
    let m = &config.name;
    let name = &tc.name;
    let (batch, dims) = if config.max_batch_size > 0 {
        match shape.split_first() {
            Some((b, rest)) => (Some(*b), rest),
            None => {
                return Err(Error::invalid(format!(
                    "input '{name}' of model '{m}': shape {} has no batch dimension (expected [batch{}])",
                    shape_string(shape),
                    tc.dims.iter().map(|d| format!(",{d}")).collect::<String>()
                )))
            }
        }
    } else {
        (None, shape)
    };
    if let Some(b) = batch {
        if b < 1 || b > config.max_batch_size as i64 {
            return Err(Error::invalid(format!(
                "input '{name}' of model '{m}': batch size {b} is out of range 1..={}",
                config.max_batch_size
            )));
        }
    }
    let matches = dims.len() == tc.dims.len()
        && dims
            .iter()
            .zip(&tc.dims)
            .all(|(&d, &want)| d >= 0 && (want == -1 || d == want));
    if !matches {
        let want = if config.max_batch_size > 0 {
            format!(
                "[-1{}]",
                tc.dims.iter().map(|d| format!(",{d}")).collect::<String>()
            )
        } else {
            shape_string(&tc.dims)
        };
        return Err(Error::invalid(format!(
            "input '{name}' of model '{m}': shape {} does not match the model's {want}",
            shape_string(shape)
        )));
    }
    Ok(())
}

fn check_bytes(
    m: &str,
    name: &str,
    dtype: DataType,
    shape: &[i64],
    data: InputBytes<'_>,
) -> Result<()> {
    let elems = element_count(shape).ok_or_else(|| {
        Error::invalid(format!(
            "input '{name}' of model '{m}': invalid shape {}",
            shape_string(shape)
        ))
    })?;
    if dtype == DataType::Bytes {
        let InputBytes::Host(data) = data else {
            return Err(Error::invalid(format!(
                "input '{name}' of model '{m}': BYTES inputs must be in host memory"
            )));
        };
        let n = count_bytes_elements(data)
            .map_err(|e| e.context(format!("input '{name}' of model '{m}'")))?;
        if n != elems {
            return Err(Error::invalid(format!(
                "input '{name}' of model '{m}': expected {elems} BYTES elements (shape {}), got {n}",
                shape_string(shape)
            )));
        }
        return Ok(());
    }
    let want = elems.checked_mul(dtype.byte_size()).ok_or_else(|| {
        Error::invalid(format!(
            "input '{name}' of model '{m}': shape {} is too large",
            shape_string(shape)
        ))
    })?;
    if data.len() != want {
        return Err(Error::invalid(format!(
            "input '{name}' of model '{m}': expected {want} bytes ({elems} elements of {} for shape {}), got {}",
            dtype.as_str(),
            shape_string(shape),
            data.len()
        )));
    }
    Ok(())
}

/// Completes the checks at enqueue: every required input present, inputs that were added
/// before the model (or this version of it) was known are checked, the batch size is the
/// same for all inputs, requested outputs exist, reshapes applied. Returns the key that
/// decides which requests may share a batch (None: any, ragged).
pub fn prepare(config: &Arc<ModelConfig>, req: &mut Request) -> Result<Option<ShapeKey>> {
    let m = &config.name;
    let checked = req
        .checked_against
        .as_ref()
        .is_some_and(|c| Arc::ptr_eq(c, config));
    if !checked {
        for t in &mut req.inputs {
            t.name = check_input(config, &t.name, t.dtype, &t.shape, InputBytes::of(&t.data))?;
        }
    }
    for tc in &config.inputs {
        let n = req.inputs.iter().filter(|t| t.name == tc.name).count();
        if n == 0 && !tc.optional {
            return Err(Error::invalid(format!(
                "model '{m}': required input '{}' is missing",
                tc.name
            )));
        }
        if n > 1 {
            return Err(Error::invalid(format!(
                "model '{m}': input '{}' was given {n} times",
                tc.name
            )));
        }
    }
    for o in &req.requested_outputs {
        if config.output(o).is_none() {
            return Err(Error::invalid(format!(
                "unexpected inference output '{o}' for model '{m}': it has no output '{o}'"
            )));
        }
    }
    req.batch_size = 1;
    let mut key = ShapeKey::new();
    if config.max_batch_size > 0 {
        let mut batch: Option<(i64, &str)> = None;
        for t in &req.inputs {
            let b = t.shape.first().copied().unwrap_or(1);
            match batch {
                None => batch = Some((b, &t.name)),
                Some((b0, n0)) if b0 != b => {
                    return Err(Error::invalid(format!(
                    "model '{m}': inputs disagree on the batch size: '{n0}' has {b0}, '{}' has {b}",
                    t.name
                )))
                }
                _ => {}
            }
        }
        req.batch_size = batch.map_or(1, |(b, _)| b as u32);
    }
    // Inputs in config order, so that the key does not depend on the order they were added.
    // Markers: -2 starts an input, -3 an absent optional input, -4 a ragged input (any
    // shape batches with any other).
    for tc in &config.inputs {
        key.push(-2);
        match req.inputs.iter().find(|t| t.name == tc.name) {
            Some(_) if tc.allow_ragged_batch => key.push(-4),
            Some(t) => {
                let skip = usize::from(config.max_batch_size > 0);
                key.extend(t.shape.iter().skip(skip).copied());
            }
            None => key.push(-3),
        }
    }
    // Reshapes are applied when the batch is assembled (a request may still move to a
    // replacing version with another config); here they are only checked.
    for t in &req.inputs {
        if let Some(r) = config.input(&t.name).and_then(|tc| tc.reshape.as_ref()) {
            reshaped(config, &t.name, &t.shape, r)?;
        }
    }
    Ok(Some(key))
}

/// The shape the model expects for an input (`reshape`), keeping the batch dimension.
pub fn reshaped(config: &ModelConfig, name: &str, shape: &[i64], reshape: &[i64]) -> Result<Shape> {
    let skip = usize::from(config.max_batch_size > 0).min(shape.len());
    let elems: i64 = shape.iter().skip(skip).product();
    let known: i64 = reshape.iter().filter(|&&d| d != -1).product();
    let wild = reshape.iter().filter(|&&d| d == -1).count();
    let fill = match wild {
        0 if known == elems => 0,
        1 if known > 0 && elems % known == 0 => elems / known,
        _ => {
            return Err(Error::invalid(format!(
                "input '{name}' of model '{}': shape {} cannot be reshaped to {}",
                config.name,
                shape_string(shape),
                shape_string(reshape)
            )))
        }
    };
    let mut out: Shape = shape.iter().take(skip).copied().collect();
    out.extend(reshape.iter().map(|&d| if d == -1 { fill } else { d }));
    Ok(out)
}
