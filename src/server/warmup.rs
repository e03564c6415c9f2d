//! `model_warmup`, as Triton runs it: every instance of a version executes each sample
//! `count` times before the version serves; a sample that fails fails the load, naming
//! it. The samples' data (zeros, random values, or a file under `<model_dir>/warmup/`)
//! is made once per version.

use crate::backend::{Batch, ModelInstance};
use crate::config::{ModelConfig, Warmup, WarmupData};
use crate::folder::Folder;
use crate::request::{Request, Shape};
use crate::scheduler::c_name;
use crate::status::{Error, Result};
use crate::tensor::{DataType, Tensor, TensorData};
use std::ffi::CString;
use std::sync::Arc;

/// One input of a sample, ready to copy into requests.
struct Ready {
    name: Arc<str>,
    dtype: DataType,
    /// With the batch dimension when the model batches.
    shape: Shape,
    data: Vec<u8>,
}

/// Runs every warmup sample of `config` on each of `instances`.
pub(super) fn run(
    config: &Arc<ModelConfig>,
    instances: &mut [Box<dyn ModelInstance>],
    dir: Option<&Folder>,
) -> Result<()> {
    if config.warmup.is_empty() {
        return Ok(());
    }
    let m = &config.name;
    let in_names: Vec<Arc<CString>> = config.inputs.iter().map(|t| c_name(&t.name)).collect();
    for (i, w) in config.warmup.iter().enumerate() {
        let what = |e: Error| e.context(format!("model '{m}': warmup sample '{}'", w.name));
        let inputs = prepare(config, w, i, dir).map_err(what)?;
        for (k, instance) in instances.iter_mut().enumerate() {
            for _ in 0..w.count {
                execute(config, &in_names, w, &inputs, instance.as_mut())
                    .map_err(|e| what(e.context(format!("instance {k}"))))?;
            }
        }
    }
    Ok(())
}

/// The sample's inputs, with their data.
fn prepare(
    config: &ModelConfig,
    w: &Warmup,
    index: usize,
    dir: Option<&Folder>,
) -> Result<Vec<Ready>> {
    let batched = config.max_batch_size > 0;
    let rows = if batched { w.batch_size as usize } else { 1 };
    // A fixed seed per sample: the same data on every load.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (index as u64 + 1);
    let mut out = Vec::with_capacity(w.inputs.len());
    for x in &w.inputs {
        let elements = rows * x.dims.iter().product::<i64>() as usize;
        let mut shape = Shape::new();
        if batched {
            shape.push(rows as i64);
        }
        shape.extend_from_slice(&x.dims);
        let size = x.data_type.byte_size();
        let data = match &x.data {
            // BYTES: every element an empty string (its 4-byte length, 0).
            WarmupData::Zero if x.data_type == DataType::Bytes => vec![0u8; 4 * elements],
            WarmupData::Zero => vec![0u8; size * elements],
            WarmupData::Random => random(x.data_type, elements, &mut rng),
            WarmupData::File(f) => {
                let folder = dir
                    .and_then(|d| {
                        d.folder_if_any("warmup", "its warmup folder")
                            .ok()
                            .flatten()
                    })
                    .ok_or_else(|| {
                        Error::not_found(format!(
                            "input '{}': input_data_file '{f}': the model has no 'warmup' folder",
                            x.name
                        ))
                    })?;
                let bytes = folder.read(f, &format!("input '{}'", x.name))?;
                if size > 0 && bytes.len() != size * elements {
                    return Err(Error::invalid(format!(
                        "input '{}': input_data_file '{f}' has {} bytes; {} {} x {rows} rows needs {}",
                        x.name,
                        bytes.len(),
                        x.data_type.as_str(),
                        crate::tensor::shape_string(&x.dims),
                        size * elements
                    )));
                }
                bytes
            }
        };
        out.push(Ready {
            name: x.name.clone(),
            dtype: x.data_type,
            shape,
            data,
        });
    }
    Ok(out)
}

/// `n` random elements of `dtype`: floats uniform in [-1, 1), booleans 0 or 1, integers
/// any bits.
fn random(dtype: DataType, n: usize, rng: &mut u64) -> Vec<u8> {
    fn next(rng: &mut u64) -> u64 {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    }
    let unit = |rng: &mut u64| (next(rng) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    let mut out = Vec::with_capacity(n * dtype.byte_size());
    for _ in 0..n {
        match dtype {
            DataType::Fp32 => out.extend_from_slice(&unit(rng).to_le_bytes()),
            DataType::Fp64 => out.extend_from_slice(&f64::from(unit(rng)).to_le_bytes()),
            DataType::Fp16 => out.extend_from_slice(&half::f16::from_f32(unit(rng)).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f32(unit(rng)).to_le_bytes()),
            DataType::Bool => out.push((next(rng) & 1) as u8),
            other => out.extend_from_slice(&next(rng).to_le_bytes()[..other.byte_size()]),
        }
    }
    out
}

/// One execution of the sample on `instance`.
fn execute(
    config: &Arc<ModelConfig>,
    in_names: &[Arc<CString>],
    w: &Warmup,
    inputs: &[Ready],
    instance: &mut dyn ModelInstance,
) -> Result<()> {
    let mut req = Request::boxed(&config.name, -1, None);
    req.batch_size = if config.max_batch_size > 0 {
        w.batch_size
    } else {
        1
    };
    let mut extra = Vec::new();
    for x in inputs {
        if config.input(&x.name).is_some() {
            req.inputs.push(Tensor {
                name: x.name.clone(),
                dtype: x.dtype,
                shape: x.shape.clone(),
                data: TensorData::Owned(x.data.clone()),
            });
        } else {
            extra.push(x); // a sequence control or state input
        }
    }
    let requests = vec![req];
    let assembled = if instance.device().is_some() {
        Batch::assemble_gathered(config.clone(), in_names, requests)
    } else {
        Batch::assemble(config.clone(), in_names, requests)
    };
    let mut batch = assembled.map_err(|(e, requests)| {
        requests
            .into_iter()
            .for_each(crate::request::pool::recycle_request);
        e
    })?;
    for x in extra {
        let c_name = Arc::new(CString::new(x.name.as_bytes()).unwrap_or_default());
        batch.push_input(
            x.name.clone(),
            c_name,
            x.dtype,
            x.shape.clone(),
            x.data.clone(),
        );
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        instance.execute(&mut batch)
    }))
    .unwrap_or_else(|panic| {
        Err(Error::internal(format!(
            "the backend panicked: {}",
            crate::status::panic_message(&*panic)
        )))
    });
    result?;
    if let Some((row, e)) = batch.row_errors.first() {
        return Err(e.clone().context(format!("row {row}")));
    }
    Ok(())
}
