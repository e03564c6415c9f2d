//! What the tool sends: the model's inputs as its config declares them, filled with
//! zeros, random values or perf_analyzer's JSON input-data file.

use crate::capi::{self, Req};
use base64::Engine as _;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::CString;

/// One input tensor of the model, from its config.
#[derive(Clone, Debug)]
pub struct InputSpec {
    pub name: String,
    pub dt: u32,
    /// Element size in bytes; 0 for BYTES.
    pub size: usize,
    pub type_name: String,
    /// Dims without the batch dim (-1: variable).
    pub dims: Vec<i64>,
    pub optional: bool,
}

/// What the tool needs to know of a model, read from its (completed) config.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub name: String,
    pub max_batch_size: i64,
    pub inputs: Vec<InputSpec>,
    pub sequence: bool,
    pub decoupled: bool,
    /// A generative model (in-flight batching backends): requests stream tokens.
    pub generative: bool,
    /// An ensemble's composing models, in step order (each once).
    pub composing: Vec<String>,
}

impl ModelInfo {
    pub fn from_config(name: &str, cfg: &Value) -> Result<ModelInfo, String> {
        let mut inputs = Vec::new();
        for i in cfg["input"].as_array().into_iter().flatten() {
            let n = i["name"].as_str().unwrap_or_default().to_owned();
            let t = i["data_type"].as_str().unwrap_or("TYPE_INVALID").to_owned();
            let (dt, size, type_name) = capi::datatype(&t).ok_or_else(|| {
                format!("model '{name}': input '{n}' has data type {t}, which the tool cannot fill")
            })?;
            // An input reshaped in the config is sent in its declared dims.
            let dims = i["dims"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| d.as_i64().unwrap_or(-1))
                .collect();
            inputs.push(InputSpec {
                name: n,
                dt,
                size,
                type_name,
                dims,
                optional: i["optional"].as_bool().unwrap_or(false),
            });
        }
        let backend = cfg["backend"].as_str().unwrap_or_default();
        let platform = cfg["platform"].as_str().unwrap_or_default();
        let decoupled = cfg["model_transaction_policy"]["decoupled"]
            .as_bool()
            .unwrap_or(false);
        let mut composing: Vec<String> = Vec::new();
        for st in cfg["ensemble_scheduling"]["step"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(m) = st["model_name"].as_str() {
                if !composing.iter().any(|c| c == m) {
                    composing.push(m.to_owned());
                }
            }
        }
        Ok(ModelInfo {
            name: name.to_owned(),
            composing,
            max_batch_size: cfg["max_batch_size"].as_i64().unwrap_or(0),
            inputs,
            sequence: cfg.get("sequence_batching").is_some_and(|v| !v.is_null()),
            decoupled,
            generative: matches!(backend, "gpt2" | "llama") || matches!(platform, "gpt2" | "llama"),
        })
    }
}

/// One tensor ready to send: its full shape (with the batch dim) and bytes.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: CString,
    pub dt: u32,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

/// The inputs of one request.
pub type Step = Vec<Tensor>;

/// What the tool sends: streams of steps. A model without sequences uses the steps of
/// every stream in turn; a sequence model sends a stream's steps as one sequence.
#[derive(Clone, Debug)]
pub struct DataSet {
    pub streams: Vec<Vec<Step>>,
}

impl DataSet {
    /// (stream, step) of every step of every stream, in order: the requests of a model
    /// without sequences take them in turn.
    pub fn flat(&self) -> Vec<(usize, usize)> {
        self.streams
            .iter()
            .enumerate()
            .flat_map(|(i, s)| (0..s.len()).map(move |j| (i, j)))
            .collect()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    Zero,
    Random,
    File(std::path::PathBuf),
}

/// `NAME:d1,d2,...` (dims without the batch dim).
pub fn parse_shape(s: &str) -> Result<(String, Vec<i64>), String> {
    let (name, dims) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("--shape '{s}': expected NAME:d1,d2,..."))?;
    if name.is_empty() {
        return Err(format!("--shape '{s}': the input name is empty"));
    }
    let dims = dims
        .split(',')
        .map(|d| {
            d.trim()
                .parse::<i64>()
                .ok()
                .filter(|&v| v >= 0)
                .ok_or_else(|| format!("--shape '{s}': '{d}' is not a dimension (a number >= 0)"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((name.to_owned(), dims))
}

pub struct Fill<'a> {
    pub model: &'a ModelInfo,
    pub shapes: &'a BTreeMap<String, Vec<i64>>,
    pub batch_size: i64,
    pub string_length: usize,
}

impl Fill<'_> {
    fn check_batch(&self) -> Result<(), String> {
        let m = self.model;
        if self.batch_size < 1 {
            return Err("--batch-size must be at least 1".into());
        }
        if m.max_batch_size == 0 && self.batch_size != 1 {
            return Err(format!(
                "model '{}' does not batch (max_batch_size 0): --batch-size must be 1",
                m.name
            ));
        }
        if m.max_batch_size > 0 && self.batch_size > m.max_batch_size {
            return Err(format!(
                "--batch-size {} exceeds model '{}''s max_batch_size {}",
                self.batch_size, m.name, m.max_batch_size
            ));
        }
        for name in self.shapes.keys() {
            if !m.inputs.iter().any(|i| &i.name == name) {
                return Err(format!(
                    "--shape names '{name}', which is not an input of model '{}' (inputs: {})",
                    m.name,
                    m.inputs
                        .iter()
                        .map(|i| i.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        Ok(())
    }

    /// Refuses a tensor of more than 1 GiB a request (or whose size overflows).
    fn check_size(&self, spec: &InputSpec, dims: &[i64]) -> Result<(), String> {
        let per_element = if spec.size == 0 {
            4 + self.string_length
        } else {
            spec.size
        };
        let bytes = dims
            .iter()
            .chain([&self.batch_size])
            .try_fold(per_element as u64, |acc, &d| {
                acc.checked_mul(d.max(0) as u64)
            });
        match bytes {
            Some(b) if b <= 1 << 30 => Ok(()),
            _ => Err(format!(
                "input '{}' of model '{}' with dims {dims:?} and batch size {} is over 1 GiB a request",
                spec.name, self.model.name, self.batch_size
            )),
        }
    }

    /// The dims of `spec` (without the batch dim): `--shape` where given, else the
    /// config's, which must then be fixed.
    fn dims(&self, spec: &InputSpec) -> Result<Vec<i64>, String> {
        let d = self.given_dims(spec)?;
        self.check_size(spec, &d)?;
        Ok(d)
    }

    fn given_dims(&self, spec: &InputSpec) -> Result<Vec<i64>, String> {
        if let Some(d) = self.shapes.get(&spec.name) {
            if d.len() != spec.dims.len()
                || d.iter().zip(&spec.dims).any(|(&g, &c)| c >= 0 && g != c)
            {
                return Err(format!(
                    "--shape {}:{} does not fit the dims {:?} of input '{}' of model '{}'",
                    spec.name,
                    d.iter()
                        .map(|v| v.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    spec.dims,
                    spec.name,
                    self.model.name
                ));
            }
            return Ok(d.clone());
        }
        if spec.dims.iter().any(|&d| d < 0) {
            return Err(format!(
                "input '{}' of model '{}' has variable dims {:?}: give its shape with --shape {}:d1,d2,...",
                spec.name, self.model.name, spec.dims, spec.name
            ));
        }
        Ok(spec.dims.clone())
    }

    /// One row's `data` repeated for every row of the batch, as `spec`'s tensor.
    fn batched(&self, spec: &InputSpec, dims: &[i64], row: &[u8]) -> Result<Tensor, String> {
        Ok(Tensor {
            name: c_name(&spec.name)?,
            dt: spec.dt,
            shape: self.full_shape(dims),
            data: row.repeat(self.batch_size as usize),
        })
    }

    fn full_shape(&self, dims: &[i64]) -> Vec<i64> {
        let mut s = Vec::with_capacity(dims.len() + 1);
        if self.model.max_batch_size > 0 {
            s.push(self.batch_size);
        }
        s.extend_from_slice(dims);
        s
    }

    /// The inputs sent: required ones always, optional ones when `--shape` names them.
    fn sent(&self) -> impl Iterator<Item = &InputSpec> {
        self.model
            .inputs
            .iter()
            .filter(|i| !i.optional || self.shapes.contains_key(&i.name))
    }

    /// Zeros or random values for every input.
    pub fn synthetic(&self, random: bool, seed: u64) -> Result<DataSet, String> {
        self.check_batch()?;
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut step = Vec::new();
        for spec in self.sent() {
            let dims = self.dims(spec)?;
            let shape = self.full_shape(&dims);
            let n: i64 = shape.iter().product();
            let n = n as usize;
            let data = if spec.size == 0 {
                let mut d = Vec::with_capacity(n * (4 + self.string_length));
                for _ in 0..n {
                    d.extend_from_slice(&(self.string_length as u32).to_le_bytes());
                    for _ in 0..self.string_length {
                        d.push(if random {
                            rng.alphanumeric() as u8
                        } else {
                            b'0'
                        });
                    }
                }
                d
            } else if random {
                random_values(spec, n, &mut rng)
            } else {
                vec![0u8; n * spec.size]
            };
            step.push(Tensor {
                name: c_name(&spec.name)?,
                dt: spec.dt,
                shape,
                data,
            });
        }
        Ok(DataSet {
            streams: vec![vec![step]],
        })
    }

    /// perf_analyzer's input-data JSON: `{"data": [STEP, ...]}` or, for sequences,
    /// `{"data": [[STEP, ...], ...]}` (one list per stream), where a STEP maps input
    /// names to a flat list of values, `{"content": [...], "shape": [...]}` or
    /// `{"b64": "..."}`.
    pub fn json(&self, text: &str, file: &str) -> Result<DataSet, String> {
        self.check_batch()?;
        let v: Value = serde_json::from_str(text).map_err(|e| format!("{file}: not JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or_else(|| format!("{file}: expected an object with a \"data\" list"))?;
        for k in obj.keys() {
            if k != "data" {
                return Err(format!(
                    "{file}: key \"{k}\" is not supported (only \"data\"; validation_data is not checked by this tool)"
                ));
            }
        }
        let data = obj["data"]
            .as_array()
            .ok_or_else(|| format!("{file}: \"data\" must be a list"))?;
        if data.is_empty() {
            return Err(format!("{file}: \"data\" is empty"));
        }
        let nested = data.iter().all(|d| d.is_array());
        if !nested && data.iter().any(|d| d.is_array()) {
            return Err(format!(
                "{file}: \"data\" mixes streams (lists) and steps (objects)"
            ));
        }
        let mut streams = Vec::new();
        if nested {
            for (si, s) in data.iter().enumerate() {
                let mut steps = Vec::new();
                for (ti, t) in s.as_array().into_iter().flatten().enumerate() {
                    steps.push(self.json_step(t, &format!("{file}: data[{si}][{ti}]"))?);
                }
                if steps.is_empty() {
                    return Err(format!("{file}: data[{si}] is an empty stream"));
                }
                streams.push(steps);
            }
        } else {
            let mut steps = Vec::new();
            for (ti, t) in data.iter().enumerate() {
                steps.push(self.json_step(t, &format!("{file}: data[{ti}]"))?);
            }
            streams.push(steps);
        }
        Ok(DataSet { streams })
    }

    /// perf_analyzer's folder of binary files: for each input a file of its name holding
    /// one request row's raw bytes (a BYTES input: the file is one element).
    pub fn directory(&self, dir: &std::path::Path) -> Result<DataSet, String> {
        self.check_batch()?;
        let mut step = Vec::new();
        for spec in &self.model.inputs {
            let f = dir.join(&spec.name);
            if !f.is_file() {
                if spec.optional && !self.shapes.contains_key(&spec.name) {
                    continue;
                }
                return Err(format!(
                    "--input-data '{}': no file '{}' for input '{}'",
                    dir.display(),
                    spec.name,
                    spec.name
                ));
            }
            let raw = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
            let data = if spec.size == 0 {
                let mut d = (raw.len() as u32).to_le_bytes().to_vec();
                d.extend_from_slice(&raw);
                d
            } else {
                raw
            };
            let dims = self.dims(spec)?;
            let per_row = dims.iter().product::<i64>() as usize;
            let expected = if spec.size == 0 {
                data.len()
            } else {
                per_row * spec.size
            };
            if spec.size == 0 && per_row != 1 {
                return Err(format!(
                    "{}: a BYTES input read from a file is one element, but its shape {dims:?} holds {per_row}",
                    f.display()
                ));
            }
            if data.len() != expected {
                return Err(format!(
                    "{}: {} bytes, but shape {dims:?} of {} takes {expected}",
                    f.display(),
                    data.len(),
                    spec.type_name
                ));
            }
            step.push(self.batched(spec, &dims, &data)?);
        }
        Ok(DataSet {
            streams: vec![vec![step]],
        })
    }

    fn json_step(&self, v: &Value, at: &str) -> Result<Step, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| format!("{at}: expected an object of input names"))?;
        for k in obj.keys() {
            if !self.model.inputs.iter().any(|i| &i.name == k) {
                return Err(format!(
                    "{at}: '{k}' is not an input of model '{}'",
                    self.model.name
                ));
            }
        }
        let mut step = Vec::new();
        for spec in &self.model.inputs {
            let Some(val) = obj.get(&spec.name) else {
                if spec.optional {
                    continue;
                }
                return Err(format!("{at}: input '{}' is missing", spec.name));
            };
            let at = format!("{at}.{}", spec.name);
            let (content, shape) = match val {
                Value::Object(o) => {
                    if let Some(b) = o.get("b64") {
                        let s = b
                            .as_str()
                            .ok_or_else(|| format!("{at}: b64 must be a string"))?;
                        let bytes = base64::engine::general_purpose::STANDARD
                            .decode(s)
                            .map_err(|e| format!("{at}: b64: {e}"))?;
                        (Content::Raw(bytes), o.get("shape"))
                    } else {
                        let c = o
                            .get("content")
                            .ok_or_else(|| format!("{at}: expected \"content\" or \"b64\""))?;
                        (Content::Values(c), o.get("shape"))
                    }
                }
                other => (Content::Values(other), None),
            };
            let dims = match shape {
                Some(s) => s
                    .as_array()
                    .ok_or_else(|| format!("{at}: shape must be a list"))?
                    .iter()
                    .map(|d| {
                        d.as_i64()
                            .filter(|&x| x >= 0)
                            .ok_or_else(|| format!("{at}: bad dim {d}"))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                None => self.dims(spec)?,
            };
            if dims.len() != spec.dims.len()
                || dims.iter().zip(&spec.dims).any(|(&g, &c)| c >= 0 && g != c)
            {
                return Err(format!(
                    "{at}: shape {dims:?} does not fit the config's dims {:?}",
                    spec.dims
                ));
            }
            self.check_size(spec, &dims)
                .map_err(|e| format!("{at}: {e}"))?;
            let per_row: i64 = dims.iter().product();
            let data = match content {
                Content::Raw(b) => b,
                Content::Values(v) => encode_values(spec, v, &at)?,
            };
            let expected = per_row as usize;
            let got = data
                .len()
                .checked_div(spec.size)
                .unwrap_or_else(|| count_strings(&data));
            if spec.size != 0 && data.len() % spec.size != 0 {
                return Err(format!(
                    "{at}: {} bytes is not a whole number of {}",
                    data.len(),
                    spec.type_name
                ));
            }
            if got != expected {
                return Err(format!(
                    "{at}: {got} values for shape {dims:?} ({expected} expected)"
                ));
            }
            step.push(self.batched(spec, &dims, &data)?);
        }
        Ok(step)
    }
}

enum Content<'a> {
    Values(&'a Value),
    Raw(Vec<u8>),
}

fn c_name(n: &str) -> Result<CString, String> {
    CString::new(n).map_err(|_| format!("input name '{n}' holds a NUL byte"))
}

fn count_strings(mut d: &[u8]) -> usize {
    let mut n = 0;
    while d.len() >= 4 {
        let l = u32::from_le_bytes([d[0], d[1], d[2], d[3]]) as usize;
        if d.len() < 4 + l {
            break;
        }
        d = &d[4 + l..];
        n += 1;
    }
    n
}

fn flatten<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| flatten(x, out)),
        x => out.push(x),
    }
}

/// JSON values in the input's datatype, as little-endian bytes (BYTES: length-prefixed).
fn encode_values(spec: &InputSpec, v: &Value, at: &str) -> Result<Vec<u8>, String> {
    let mut vals = Vec::new();
    flatten(v, &mut vals);
    let mut out = Vec::with_capacity(vals.len() * spec.size.max(4));
    for x in vals {
        let bad = || format!("{at}: {x} is not a {} value", spec.type_name);
        match spec.type_name.as_str() {
            "BYTES" => {
                let s = x.as_str().ok_or_else(bad)?;
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            "BOOL" => out.push(x.as_bool().ok_or_else(bad)? as u8),
            "FP32" => out.extend_from_slice(&(x.as_f64().ok_or_else(bad)? as f32).to_le_bytes()),
            "FP64" => out.extend_from_slice(&x.as_f64().ok_or_else(bad)?.to_le_bytes()),
            "FP16" => out
                .extend_from_slice(&half::f16::from_f64(x.as_f64().ok_or_else(bad)?).to_le_bytes()),
            "BF16" => out.extend_from_slice(
                &half::bf16::from_f64(x.as_f64().ok_or_else(bad)?).to_le_bytes(),
            ),
            t => {
                let i = x
                    .as_i64()
                    .or_else(|| x.as_u64().map(|u| u as i64))
                    .ok_or_else(bad)?;
                let (lo, hi): (i128, i128) = match t {
                    "INT8" => (i8::MIN.into(), i8::MAX.into()),
                    "INT16" => (i16::MIN.into(), i16::MAX.into()),
                    "INT32" => (i32::MIN.into(), i32::MAX.into()),
                    "INT64" => (i64::MIN.into(), i64::MAX.into()),
                    "UINT8" => (0, u8::MAX.into()),
                    "UINT16" => (0, u16::MAX.into()),
                    "UINT32" => (0, u32::MAX.into()),
                    _ => (0, u64::MAX.into()),
                };
                let wide = x.as_u64().map(i128::from).unwrap_or(i128::from(i));
                if wide < lo || wide > hi {
                    return Err(format!("{at}: {x} is out of range for {t}"));
                }
                out.extend_from_slice(&wide.to_le_bytes()[..spec.size]);
            }
        }
    }
    Ok(out)
}

/// Random values: floats uniform in [0, 1), integers uniform in [0, 127] (valid indices
/// and token ids for small tables), booleans either way.
fn random_values(spec: &InputSpec, n: usize, rng: &mut fastrand::Rng) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * spec.size);
    for _ in 0..n {
        match spec.type_name.as_str() {
            "BOOL" => out.push(rng.bool() as u8),
            "FP32" => out.extend_from_slice(&rng.f32().to_le_bytes()),
            "FP64" => out.extend_from_slice(&rng.f64().to_le_bytes()),
            "FP16" => out.extend_from_slice(&half::f16::from_f32(rng.f32()).to_le_bytes()),
            "BF16" => out.extend_from_slice(&half::bf16::from_f32(rng.f32()).to_le_bytes()),
            _ => out.extend_from_slice(&u64::from(rng.u8(0..128)).to_le_bytes()[..spec.size]),
        }
    }
    out
}

/// Builds a request of `step`'s inputs.
pub fn build(server: &capi::Server, model: &str, step: &Step) -> Result<Req, String> {
    let mut r = server.request(model)?;
    for t in step {
        r.input(&t.name, t.dt, &t.shape, &t.data)?;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(dims: &[i64], t: &str, mbs: i64) -> ModelInfo {
        let (dt, size, type_name) = capi::datatype(t).unwrap();
        ModelInfo {
            name: "m".into(),
            max_batch_size: mbs,
            inputs: vec![InputSpec {
                name: "X".into(),
                dt,
                size,
                type_name,
                dims: dims.to_vec(),
                optional: false,
            }],
            sequence: false,
            decoupled: false,
            generative: false,
            composing: Vec::new(),
        }
    }

    #[test]
    fn shapes_parse_and_refuse() {
        assert_eq!(parse_shape("IN:2,3").unwrap(), ("IN".into(), vec![2, 3]));
        assert_eq!(parse_shape("a:b:4").unwrap(), ("a:b".into(), vec![4]));
        assert!(parse_shape("IN").unwrap_err().contains("NAME:d1"));
        assert!(parse_shape("IN:2,x").unwrap_err().contains("'x'"));
        assert!(parse_shape("IN:-1").is_err());
    }

    #[test]
    fn synthetic_inputs_take_batch_and_shape() {
        let m = model(&[-1, 4], "FP32", 8);
        let mut shapes = BTreeMap::new();
        let f = fill(&m, &shapes, 2, 4);
        assert!(f.synthetic(false, 1).unwrap_err().contains("--shape X:"));
        shapes.insert("X".to_owned(), vec![3, 4]);
        let f = fill(&m, &shapes, 2, 4);
        let d = f.synthetic(true, 1).unwrap();
        let t = &d.streams[0][0][0];
        assert_eq!(t.shape, vec![2, 3, 4]);
        assert_eq!(t.data.len(), 2 * 3 * 4 * 4);
        let vals = f32s(&t.data);
        assert!(vals.iter().all(|v| (0.0..1.0).contains(v)));
        let f = fill(&m, &shapes, 9, 4);
        assert!(f
            .synthetic(false, 1)
            .unwrap_err()
            .contains("max_batch_size 8"));
        shapes.insert("X".to_owned(), vec![3, 5]);
        let f = fill(&m, &shapes, 1, 4);
        assert!(f.synthetic(false, 1).unwrap_err().contains("does not fit"));
        shapes.insert("X".to_owned(), vec![4294967296, 4]);
        let f = fill(&m, &shapes, 1, 4);
        assert!(f.synthetic(false, 1).unwrap_err().contains("over 1 GiB"));
    }

    fn fill<'a>(
        model: &'a ModelInfo,
        shapes: &'a BTreeMap<String, Vec<i64>>,
        batch_size: i64,
        string_length: usize,
    ) -> Fill<'a> {
        Fill {
            model,
            shapes,
            batch_size,
            string_length,
        }
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        assert_eq!(b.len() % 4, 0);
        b.chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn json_input_data_in_perf_analyzer_layout() {
        let m = model(&[2], "INT32", 0);
        let shapes = BTreeMap::new();
        let f = fill(&m, &shapes, 1, 4);
        let d = f
            .json(
                r#"{"data": [{"X": [1, 2]}, {"X": {"content": [3, 4], "shape": [2]}}]}"#,
                "f.json",
            )
            .unwrap();
        assert_eq!(d.streams.len(), 1);
        assert_eq!(d.streams[0].len(), 2);
        assert_eq!(d.streams[0][1][0].data, [3, 0, 0, 0, 4, 0, 0, 0]);
        let d = f
            .json(
                r#"{"data": [[{"X": [1, 2]}], [{"X": [5, 6]}, {"X": [7, 8]}]]}"#,
                "f.json",
            )
            .unwrap();
        assert_eq!(d.streams.len(), 2);
        assert_eq!(d.streams[1].len(), 2);
        let b64 = base64::engine::general_purpose::STANDARD.encode([9u8, 0, 0, 0, 10, 0, 0, 0]);
        let d = f
            .json(
                &format!(r#"{{"data": [{{"X": {{"b64": "{b64}"}}}}]}}"#),
                "f.json",
            )
            .unwrap();
        assert_eq!(d.streams[0][0][0].data[4], 10);
        for (bad, want) in [
            ("nope", "not JSON"),
            (r#"{"data": []}"#, "empty"),
            (r#"{"data": [{"Y": [1, 2]}]}"#, "'Y' is not an input"),
            (r#"{"data": [{"X": [1, 2, 3]}]}"#, "3 values"),
            (r#"{"data": [{"X": [1, "a"]}]}"#, "not a INT32"),
            (r#"{"data": [{"X": [1, 3000000000]}]}"#, "out of range"),
            (r#"{"data": [{}]}"#, "'X' is missing"),
            (
                r#"{"data": [{"X": [1, 2]}], "validation_data": []}"#,
                "validation_data",
            ),
        ] {
            let e = f.json(bad, "f.json").unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
            assert!(e.starts_with("f.json"), "{e}");
        }
    }

    #[test]
    fn a_folder_holds_one_raw_file_per_input() {
        let m = model(&[2], "INT32", 4);
        let shapes = BTreeMap::new();
        let f = fill(&m, &shapes, 2, 4);
        let dir = std::env::temp_dir().join(format!("infer-perf-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(f.directory(&dir).unwrap_err().contains("no file 'X'"));
        std::fs::write(dir.join("X"), [1u8, 0, 0, 0, 2, 0, 0]).unwrap();
        assert!(f.directory(&dir).unwrap_err().contains("7 bytes"));
        std::fs::write(dir.join("X"), [1u8, 0, 0, 0, 2, 0, 0, 0]).unwrap();
        let d = f.directory(&dir).unwrap();
        let t = &d.streams[0][0][0];
        assert_eq!(t.shape, vec![2, 2]);
        assert_eq!(t.data.len(), 16);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn strings_are_length_prefixed() {
        let m = model(&[2], "STRING", 0);
        let shapes = BTreeMap::new();
        let f = fill(&m, &shapes, 1, 3);
        let d = f.synthetic(true, 7).unwrap();
        assert_eq!(count_strings(&d.streams[0][0][0].data), 2);
        assert_eq!(d.streams[0][0][0].data.len(), 2 * (4 + 3));
        let d = f.json(r#"{"data": [{"X": ["ab", ""]}]}"#, "f").unwrap();
        assert_eq!(
            d.streams[0][0][0].data,
            [2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0]
        );
    }
}
