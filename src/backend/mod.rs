//! Backends compute; everything else (queueing, batching, splitting) is the library's.
//!
//! A [`Backend`] makes [`ModelInstance`]s; each instance is driven by exactly one worker
//! thread and sees one [`Batch`] at a time. Backends never see requests, callbacks or
//! queues, and never hold a library lock while they run.

pub mod builtin;
pub mod decoupled;
pub mod gpu_instance;

use crate::config::ModelConfig;
use crate::request::{Request, Shape};
use crate::status::{Error, Result};
use crate::tensor::{count_bytes_elements, element_count, shape_string, DataType, TensorData};
use std::sync::Arc;

pub trait Backend: Send + Sync {
    /// Creates one instance; `gpu` is the device id or -1 for the CPU.
    fn create_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        index: u32,
        gpu: i32,
    ) -> Result<Box<dyn ModelInstance>>;

    /// Creates one instance of one version; backends that read model files from the
    /// version's folder override this. The default calls [`Backend::create_instance`].
    fn create_version_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        at: &InstancePlace<'_>,
    ) -> Result<Box<dyn ModelInstance>> {
        self.create_instance(config, at.index, at.gpu)
    }

    /// Whether instances of this backend can run on a GPU (KIND_GPU); none of the
    /// built-in backends can yet.
    fn runs_on_gpu(&self) -> bool {
        false
    }

    /// Whether KIND_AUTO instances go to a GPU when one is usable (falling back to the
    /// CPU, with a log line, when the model cannot run there). Custom backends decide
    /// their own placement, so for them KIND_AUTO is the CPU.
    fn auto_prefers_gpu(&self) -> bool {
        false
    }

    /// Whether its GPU instances manage the device themselves (ONNX Runtime's CUDA
    /// provider): they take host inputs and give host outputs, and the library neither
    /// binds a context for them nor moves their data.
    fn manages_device(&self) -> bool {
        false
    }
}

/// Where an instance runs and what it serves.
#[derive(Clone, Copy, Debug)]
pub struct InstancePlace<'a> {
    /// The instance's index among the version's instances.
    pub index: u32,
    /// The device id, or -1 for the CPU.
    pub gpu: i32,
    pub version: i64,
    /// The model's folder (the version's files are in `<model_dir>/<version>/`); every
    /// file of it is opened through it.
    pub model_dir: Option<&'a crate::folder::Folder>,
}

pub trait ModelInstance: Send {
    /// Runs one batch. An error fails every request of the batch; per-row errors go
    /// through [`Batch::set_row_error`].
    fn execute(&mut self, batch: &mut Batch) -> Result<()>;

    /// The GPU this instance runs on (None: the CPU). A GPU instance gets its batches
    /// with the rows of several requests not yet concatenated (`Batch::assemble_gathered`).
    fn device(&self) -> Option<i32> {
        None
    }

    /// For instances whose work completes asynchronously (GPU instances): starts the
    /// batch and returns what finishes it, so that the next batch can start while this
    /// one completes (double buffering). None: the instance only has `execute`.
    fn begin(&mut self, batch: &mut Batch) -> Option<Result<Box<dyn Completion>>> {
        let _ = batch;
        None
    }

    /// The GPU data-path statistics of an instance on a GPU (None: on the CPU).
    fn gpu_stats(&self) -> Option<Arc<crate::stats::GpuInstanceStats>> {
        None
    }
}

/// The rest of a batch started with [`ModelInstance::begin`]; `complete` may run on
/// another thread than `begin` did.
pub trait Completion: Send {
    /// Waits for the batch's work and leaves its outputs in the batch; an error fails
    /// every request of the batch.
    fn complete(self: Box<Self>, batch: &mut Batch) -> Result<()>;
}

/// Where a batched input's bytes are.
enum InputSource {
    /// The batch has one request: its tensor is used in place (no copy).
    Request { request: usize, input: usize },
    /// Rows of several requests concatenated along dim 0.
    Assembled(Vec<u8>),
    /// Rows of several requests (request, input) not yet concatenated: a GPU instance
    /// gathers them straight into pinned memory (see `gpu_instance`).
    Gather(Vec<(u32, u32)>),
}

pub struct BatchInput {
    pub name: Arc<str>,
    pub c_name: Arc<std::ffi::CString>,
    pub dtype: DataType,
    pub shape: Shape,
    source: InputSource,
}

pub struct BatchOutput {
    pub name: Arc<str>,
    pub dtype: DataType,
    pub shape: Shape,
    /// The bytes in host memory (empty when the output only lives on the device).
    pub data: OutputBytes,
    /// The output in device memory (GPU instances), shared by the responses that asked
    /// for device memory.
    pub device: Option<Arc<crate::cuda::DeviceBuf>>,
}

/// A batch output's bytes in host memory.
pub enum OutputBytes {
    /// Written by a backend on the host, or copied out of page-locked memory.
    Owned(Vec<u8>),
    /// The page-locked buffer a GPU instance copied the output down into, lent to the
    /// responses, which read their windows of it in place.
    Pinned(crate::cuda::PinnedBuf),
}

impl OutputBytes {
    /// The bytes as a buffer the responses' windows share.
    pub fn into_shared(self) -> crate::tensor::SharedBytes {
        match self {
            OutputBytes::Owned(v) => Arc::new(v),
            OutputBytes::Pinned(p) => Arc::new(p),
        }
    }
}

impl std::ops::Deref for OutputBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            OutputBytes::Owned(v) => v,
            OutputBytes::Pinned(p) => p.as_slice(),
        }
    }
}

impl std::ops::DerefMut for OutputBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            OutputBytes::Owned(v) => v,
            OutputBytes::Pinned(p) => p.as_mut_slice(),
        }
    }
}

/// One execution's worth of requests, their batched inputs and the outputs the backend
/// writes.
pub struct Batch {
    pub requests: Vec<Box<Request>>,
    /// The first row of each request (padding rows belong to no request).
    pub first_rows: Vec<u32>,
    /// Rows in this execution (sum of the requests' batch sizes).
    pub size: u32,
    pub inputs: Vec<BatchInput>,
    pub outputs: Vec<BatchOutput>,
    /// (row, error) pairs set by the backend.
    pub row_errors: Vec<(u32, Error)>,
    pub config: Arc<ModelConfig>,
    /// Message a custom backend gave for a failed execute.
    pub error_message: Option<String>,
    /// Device, stream and device buffers while a GPU instance runs the batch.
    pub gpu: Option<gpu_instance::BatchGpu>,
    /// The senders a decoupled backend took, by request (empty: none taken).
    pub senders: Vec<Option<Arc<decoupled::Sender>>>,
}

impl Batch {
    /// Assembles the batched inputs. The scheduler has already checked that the requests
    /// can be concatenated (same non-batch shapes unless ragged batching is allowed).
    /// On failure nothing ran and the requests come back with the error.
    pub fn assemble(
        config: Arc<ModelConfig>,
        c_names: &[Arc<std::ffi::CString>],
        requests: Vec<Box<Request>>,
    ) -> std::result::Result<Batch, (Error, Vec<Box<Request>>)> {
        let mut first_rows = Vec::with_capacity(requests.len());
        let mut size = 0u32;
        for r in &requests {
            first_rows.push(size);
            size += r.batch_size;
        }
        Self::assemble_rows(config, c_names, requests, first_rows, size)
    }

    /// Like [`Batch::assemble`], but the rows of several requests are not concatenated:
    /// a GPU instance gathers them into pinned memory itself.
    pub fn assemble_gathered(
        config: Arc<ModelConfig>,
        c_names: &[Arc<std::ffi::CString>],
        requests: Vec<Box<Request>>,
    ) -> std::result::Result<Batch, (Error, Vec<Box<Request>>)> {
        let mut first_rows = Vec::with_capacity(requests.len());
        let mut size = 0u32;
        for r in &requests {
            first_rows.push(size);
            size += r.batch_size;
        }
        match Self::batch_inputs(&config, c_names, &requests, None, size, true) {
            Ok(inputs) => Ok(Batch::new(config, requests, first_rows, size, inputs)),
            Err(e) => Err((e, requests)),
        }
    }

    fn new(
        config: Arc<ModelConfig>,
        requests: Vec<Box<Request>>,
        first_rows: Vec<u32>,
        size: u32,
        inputs: Vec<BatchInput>,
    ) -> Batch {
        Batch {
            requests,
            first_rows,
            size,
            inputs,
            outputs: Vec::new(),
            row_errors: Vec::new(),
            config,
            error_message: None,
            gpu: None,
            senders: Vec::new(),
        }
    }

    /// The first row and the row count of request `index`.
    pub fn request_rows(&self, index: u32) -> Result<(u32, u32)> {
        match (
            self.requests.get(index as usize),
            self.first_rows.get(index as usize),
        ) {
            (Some(r), Some(&first)) => Ok((first, r.batch_size)),
            _ => Err(self.request_out_of_range(index)),
        }
    }

    /// Input `name` of request `index` alone, as that request gave it.
    pub fn request_input(&self, index: u32, name: &str) -> Result<&crate::tensor::Tensor> {
        let r =
            (self.requests.get(index as usize)).ok_or_else(|| self.request_out_of_range(index))?;
        r.input(name).ok_or_else(|| {
            Error::not_found(format!(
                "model '{}': request index {index} has no input '{name}'",
                self.config.name
            ))
        })
    }

    fn request_out_of_range(&self, index: u32) -> Error {
        Error::invalid(format!(
            "request index {index} is out of range: the batch has {} requests",
            self.requests.len()
        ))
    }

    /// Takes the response sender of request `index` (decoupled models): the backend
    /// answers that request itself, and the library does not when the batch ends.
    pub fn take_sender(&mut self, index: u32) -> Result<Arc<decoupled::Sender>> {
        let cfg = &self.config;
        if !cfg.decoupled {
            return Err(Error::invalid(format!(
                "model '{}' is not decoupled: its requests are answered from the batch's outputs (set model_transaction_policy {{ decoupled: true }} to send responses apart)",
                cfg.name
            )));
        }
        let i = index as usize;
        let Some(req) = self.requests.get(i) else {
            return Err(self.request_out_of_range(index));
        };
        if self.senders.len() < self.requests.len() {
            self.senders.resize(self.requests.len(), None);
        }
        if self.senders[i].is_some() {
            return Err(Error::invalid(format!(
                "the response sender of request index {index} was already taken"
            )));
        }
        let s = Arc::new(decoupled::Sender::new(
            req.id,
            req.correlation_id.clone(),
            req.requested_outputs.clone(),
            cfg.clone(),
        ));
        self.senders[i] = Some(s.clone());
        Ok(s)
    }

    /// Like [`Batch::assemble`], with each request (of batch size 1) at a given row and
    /// zero-filled padding rows elsewhere (sequence batching's empty slots).
    pub fn assemble_rows(
        config: Arc<ModelConfig>,
        c_names: &[Arc<std::ffi::CString>],
        requests: Vec<Box<Request>>,
        first_rows: Vec<u32>,
        size: u32,
    ) -> std::result::Result<Batch, (Error, Vec<Box<Request>>)> {
        let padded = requests.iter().map(|r| r.batch_size).sum::<u32>() != size;
        let rows = if padded {
            Some(first_rows.as_slice())
        } else {
            None
        };
        match Self::batch_inputs(&config, c_names, &requests, rows, size, false) {
            Ok(inputs) => Ok(Batch::new(config, requests, first_rows, size, inputs)),
            Err(e) => Err((e, requests)),
        }
    }

    /// Adds an input the library computes (sequence controls, implicit state).
    pub(crate) fn push_input(
        &mut self,
        name: Arc<str>,
        c_name: Arc<std::ffi::CString>,
        dtype: DataType,
        shape: Shape,
        data: Vec<u8>,
    ) {
        self.inputs.push(BatchInput {
            name,
            c_name,
            dtype,
            shape,
            source: InputSource::Assembled(data),
        });
    }

    /// The batched inputs; `rows` (first row of each request, padded batches only) places
    /// requests among zero-filled padding rows.
    fn batch_inputs(
        config: &Arc<ModelConfig>,
        c_names: &[Arc<std::ffi::CString>],
        requests: &[Box<Request>],
        rows: Option<&[u32]>,
        size: u32,
        gather: bool,
    ) -> Result<Vec<BatchInput>> {
        let mut inputs = Vec::with_capacity(config.inputs.len());
        for (ci, tc) in config.inputs.iter().enumerate() {
            let first = match requests
                .first()
                .and_then(|r| r.inputs.iter().position(|t| t.name == tc.name))
            {
                Some(i) => i,
                None => continue, // an optional input absent from this batch
            };
            let missing = |r: &Request| {
                Error::internal(format!(
                    "model '{}': input '{}' missing from request {} of a batch",
                    config.name, tc.name, r.id
                ))
            };
            let source = if let Some(rows) = rows {
                // One row per request; padding rows are zeros shaped like the first
                // request's (a zero BYTES element is the empty string).
                let t0 = &requests[0].inputs[first];
                let pad_len = if tc.data_type == DataType::Bytes {
                    let skip = usize::from(config.max_batch_size > 0);
                    element_count(&t0.shape[skip.min(t0.shape.len())..]).unwrap_or(0) * 4
                } else {
                    t0.data.len()
                };
                let mut buf = try_buffer(pad_len.saturating_mul(size as usize), config, &tc.name)?;
                let mut next = 0usize;
                for row in 0..size {
                    match rows.get(next) {
                        Some(&r) if r == row => {
                            let req = &requests[next];
                            let t = req.input(&tc.name).ok_or_else(|| missing(req))?;
                            buf.extend_from_slice(t.data.as_slice());
                            next += 1;
                        }
                        _ => buf.resize(buf.len() + pad_len, 0),
                    }
                }
                InputSource::Assembled(buf)
            } else if requests.len() == 1 {
                InputSource::Request {
                    request: 0,
                    input: first,
                }
            } else if gather {
                let mut pieces = Vec::with_capacity(requests.len());
                for (ri, r) in requests.iter().enumerate() {
                    let ii = r
                        .inputs
                        .iter()
                        .position(|t| t.name == tc.name)
                        .ok_or_else(|| missing(r))?;
                    pieces.push((ri as u32, ii as u32));
                }
                InputSource::Gather(pieces)
            } else {
                let total: usize = requests
                    .iter()
                    .map(|r| r.input(&tc.name).map_or(0, |t| t.data.len()))
                    .sum();
                let mut buf = try_buffer(total, config, &tc.name)?;
                for r in requests {
                    let t = r.input(&tc.name).ok_or_else(|| missing(r))?;
                    buf.extend_from_slice(t.data.as_slice());
                }
                InputSource::Assembled(buf)
            };
            let t0 = &requests[0].inputs[first];
            let mut shape: Shape = t0.shape.clone();
            if requests.len() > 1 || rows.is_some() {
                if tc.allow_ragged_batch {
                    // Ragged rows are handed over flattened: [total elements].
                    let mut n: i64 = requests
                        .iter()
                        .filter_map(|r| r.input(&tc.name))
                        .map(|t| t.shape.iter().product::<i64>())
                        .sum();
                    // Padding rows repeat the first request's element count.
                    let pad_rows = size as i64 - requests.len() as i64;
                    if rows.is_some() && pad_rows > 0 {
                        n += pad_rows * t0.shape.iter().product::<i64>();
                    }
                    shape = Shape::from_slice(&[n]);
                } else if config.max_batch_size > 0 {
                    if let Some(d0) = shape.first_mut() {
                        *d0 = size as i64;
                    }
                }
            }
            if let (Some(r), false) = (&tc.reshape, tc.allow_ragged_batch) {
                shape = crate::request::checks::reshaped(config, &tc.name, &shape, r)?;
            }
            inputs.push(BatchInput {
                name: tc.name.clone(),
                c_name: c_names[ci].clone(),
                dtype: tc.data_type,
                shape,
                source,
            });
        }
        for b in &config.batch_inputs {
            let (data, shape) = batch_input_values(config, b, requests)?;
            for t in &b.targets {
                inputs.push(BatchInput {
                    name: t.clone(),
                    c_name: Arc::new(std::ffi::CString::new(&**t).unwrap_or_default()),
                    dtype: b.data_type,
                    shape: Shape::from_slice(&shape),
                    source: InputSource::Assembled(data.clone()),
                });
            }
        }
        Ok(inputs)
    }

    /// The input's bytes in host memory. Empty for the inputs of a GPU instance's batch,
    /// which are in device memory (`gpu`).
    pub fn input_data<'a>(&'a self, input: &'a BatchInput) -> &'a [u8] {
        match &input.source {
            InputSource::Request { request, input } => {
                self.requests[*request].inputs[*input].data.as_slice()
            }
            InputSource::Assembled(v) => v,
            InputSource::Gather(_) => &[],
        }
    }

    /// The input's length in bytes, wherever its pieces are.
    pub fn input_len(&self, input: &BatchInput) -> usize {
        match &input.source {
            InputSource::Assembled(v) => v.len(),
            _ => self.input_pieces(input).iter().map(|p| p.len()).sum(),
        }
    }

    /// The host pieces or device pieces that make up an input, in row order.
    pub(crate) fn input_pieces<'a>(&'a self, input: &'a BatchInput) -> Vec<&'a TensorData> {
        match &input.source {
            InputSource::Request { request, input } => {
                vec![&self.requests[*request].inputs[*input].data]
            }
            InputSource::Assembled(_) => Vec::new(),
            InputSource::Gather(p) => p
                .iter()
                .map(|&(r, i)| &self.requests[r as usize].inputs[i as usize].data)
                .collect(),
        }
    }

    /// The input's bytes when the library assembled them (padded or computed inputs).
    pub(crate) fn assembled(input: &BatchInput) -> Option<&[u8]> {
        match &input.source {
            InputSource::Assembled(v) => Some(v),
            _ => None,
        }
    }

    pub fn input(&self, name: &str) -> Option<(&BatchInput, &[u8])> {
        let i = self.inputs.iter().find(|i| &*i.name == name)?;
        Some((i, self.input_data(i)))
    }

    /// Allocates the batched output `name` (datatype from the config) and returns its
    /// bytes for the backend to fill. `byte_size` is required for BYTES outputs.
    pub fn alloc_output(
        &mut self,
        name: &str,
        shape: &[i64],
        byte_size: Option<usize>,
    ) -> Result<&mut [u8]> {
        let (tname, dtype, bytes) = self.output_spec(name, shape, byte_size)?;
        let data = zeroed_output(&self.config, name, bytes)?;
        self.outputs.push(BatchOutput {
            name: tname,
            dtype,
            shape: Shape::from_slice(shape),
            data: OutputBytes::Owned(data),
            device: None,
        });
        let last = self.outputs.len() - 1;
        Ok(&mut self.outputs[last].data[..])
    }

    /// Checks an output about to be allocated: its name (model output or implicit state
    /// output), that it is not allocated yet, its shape and byte size. Returns the
    /// shared name, the datatype and the byte size.
    pub(crate) fn output_spec(
        &self,
        name: &str,
        shape: &[i64],
        byte_size: Option<usize>,
    ) -> Result<(Arc<str>, DataType, usize)> {
        let cfg = &self.config;
        // A model output, or the output of an implicit state (sequence batching).
        let (tname, dtype, dims): (Arc<str>, DataType, &[i64]) = match cfg.output(name) {
            // The model computes in `reshape` when it has one.
            Some(tc) => (
                tc.name.clone(),
                tc.data_type,
                tc.reshape.as_deref().unwrap_or(&tc.dims),
            ),
            None => match cfg
                .sequence_batching
                .as_ref()
                .and_then(|q| q.state_by_output(name))
            {
                Some(st) => (st.output_name.clone(), st.data_type, &st.dims),
                None => {
                    return Err(Error::invalid(format!(
                        "model '{}' has no output '{name}'",
                        cfg.name
                    )))
                }
            },
        };
        if self.outputs.iter().any(|o| &*o.name == name) {
            return Err(Error::invalid(format!(
                "output '{name}' of model '{}' was already allocated in this batch",
                cfg.name
            )));
        }
        let elems = output_elements(cfg, name, shape)?;
        if cfg.batch_output_source(name).is_some() {
            // Scattered back by its source input's shapes: any shape holding the
            // requests' elements (checked when the batch is split).
            let bytes = output_bytes(cfg, name, dtype, shape, elems, byte_size)?;
            return Ok((tname, dtype, bytes));
        }
        if cfg.max_batch_size > 0 && shape.first().copied() != Some(self.size as i64) {
            return Err(Error::invalid(format!(
                "output '{name}' of model '{}': dim 0 of shape {} must be the batch size {}",
                cfg.name,
                shape_string(shape),
                self.size
            )));
        }
        check_output_dims(cfg, name, shape, dims)?;
        let bytes = output_bytes(cfg, name, dtype, shape, elems, byte_size)?;
        Ok((tname, dtype, bytes))
    }

    /// Allocates output `output` with the shape of input `input` and copies the input's
    /// bytes into it (the identity computation, without an intermediate copy).
    pub fn copy_input_to_output(&mut self, input: usize, output: &str) -> Result<()> {
        let i = &self.inputs[input];
        let shape = i.shape.clone();
        let len = self.input_data(i).len();
        self.alloc_output(output, &shape, Some(len))?;
        let src = match &self.inputs[input].source {
            InputSource::Request { request, input } => {
                self.requests[*request].inputs[*input].data.as_slice()
            }
            InputSource::Assembled(v) => v.as_slice(),
            InputSource::Gather(_) => &[],
        };
        if let Some(out) = self.outputs.last_mut() {
            out.data.copy_from_slice(src);
        }
        Ok(())
    }

    pub fn set_row_error(&mut self, row: u32, err: Error) -> Result<()> {
        if row >= self.size {
            return Err(Error::invalid(format!(
                "row {row} is out of range: the batch has {} rows",
                self.size
            )));
        }
        self.row_errors.push((row, err));
        Ok(())
    }

    /// Checks a finished BYTES output before it is split.
    pub(crate) fn check_bytes_output(out: &BatchOutput) -> Result<usize> {
        count_bytes_elements(&out.data).map_err(|e| e.context(format!("output '{}'", out.name)))
    }
}

/// The values and shape of a `batch_input` for a batch of `requests` (Triton's kinds:
/// see [`crate::config::BatchInputKind`]).
fn batch_input_values(
    config: &ModelConfig,
    b: &crate::config::BatchInputConfig,
    requests: &[Box<Request>],
) -> Result<(Vec<u8>, Vec<i64>)> {
    use crate::config::BatchInputKind as K;
    let mut shapes: Vec<(&[i64], u32)> = Vec::with_capacity(requests.len());
    for r in requests {
        let t = r.input(&b.source).ok_or_else(|| {
            Error::invalid(format!(
                "model '{}': request {} has no input '{}', which batch input '{}' describes",
                config.name, r.id, b.source, b.targets[0]
            ))
        })?;
        shapes.push((&t.shape, r.batch_size));
    }
    let counts: Vec<i64> = shapes.iter().map(|(s, _)| s.iter().product()).collect();
    let running = |start: Vec<i64>| {
        counts.iter().fold(start, |mut acc, c| {
            acc.push(acc.last().copied().unwrap_or(0) + c);
            acc
        })
    };
    let items = || -> Vec<i64> {
        let mut v = Vec::new();
        for (s, rows) in &shapes {
            for _ in 0..*rows {
                v.extend_from_slice(&s[1.min(s.len())..]);
            }
        }
        v
    };
    let rank = shapes.first().map_or(0, |(s, _)| s.len().saturating_sub(1)) as i64;
    let rows: i64 = shapes.iter().map(|(_, r)| i64::from(*r)).sum();
    let (values, shape): (Vec<i64>, Vec<i64>) = match b.kind {
        K::ElementCount => (counts.clone(), vec![counts.len() as i64]),
        K::AccumulatedElementCount => (running(Vec::new()), vec![counts.len() as i64]),
        K::AccumulatedElementCountWithZero => (running(vec![0]), vec![counts.len() as i64 + 1]),
        K::MaxElementCountAsShape => {
            let max = counts.iter().copied().max().unwrap_or(0);
            (vec![0; max.max(0) as usize], vec![max])
        }
        K::ItemShape => (items(), vec![rows, rank]),
        K::ItemShapeFlatten => (items(), vec![rows * rank]),
    };
    let mut data = Vec::with_capacity(values.len() * b.data_type.byte_size());
    for v in values {
        match b.data_type {
            DataType::Int64 => data.extend_from_slice(&v.to_le_bytes()),
            DataType::Fp32 => data.extend_from_slice(&(v as f32).to_le_bytes()),
            _ => data.extend_from_slice(
                &(v.clamp(i32::MIN.into(), i32::MAX.into()) as i32).to_le_bytes(),
            ),
        }
    }
    Ok((data, shape))
}

/// Checks an output's shape against the config's dims (after the batch dim when the
/// model batches; -1 matches any size).
pub(crate) fn check_output_dims(
    cfg: &ModelConfig,
    name: &str,
    shape: &[i64],
    dims: &[i64],
) -> Result<()> {
    let own = &shape[usize::from(cfg.max_batch_size > 0).min(shape.len())..];
    let fits = (cfg.max_batch_size == 0 || !shape.is_empty())
        && own.len() == dims.len()
        && own
            .iter()
            .zip(dims)
            .all(|(&got, &want)| want == -1 || got == want);
    if fits {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "output '{name}' of model '{}': shape {} does not match the config's dims {}{}",
        cfg.name,
        shape_string(shape),
        shape_string(dims),
        if cfg.max_batch_size > 0 {
            " after the batch dim"
        } else {
            ""
        }
    )))
}

/// The element count of an output's shape, or INVALID_ARGUMENT for a negative or
/// overflowing one.
pub(crate) fn output_elements(cfg: &ModelConfig, name: &str, shape: &[i64]) -> Result<usize> {
    element_count(shape).ok_or_else(|| {
        Error::invalid(format!(
            "output '{name}' of model '{}': invalid shape {}",
            cfg.name,
            shape_string(shape)
        ))
    })
}

/// A zeroed buffer of `bytes` for output `name`, or RESOURCE_EXHAUSTED.
pub(crate) fn zeroed_output(cfg: &ModelConfig, name: &str, bytes: usize) -> Result<Vec<u8>> {
    crate::tensor::try_zeroed(bytes).ok_or_else(|| {
        Error::exhausted(format!(
            "output '{name}' of model '{}': cannot allocate {bytes} bytes",
            cfg.name
        ))
    })
}

/// The byte size of an output of `elems` elements: given for BYTES outputs (required),
/// checked against the shape for the others.
pub(crate) fn output_bytes(
    cfg: &ModelConfig,
    name: &str,
    dtype: DataType,
    shape: &[i64],
    elems: usize,
    byte_size: Option<usize>,
) -> Result<usize> {
    if dtype == DataType::Bytes {
        return byte_size.ok_or_else(|| {
            Error::invalid(format!(
                "output '{name}' of model '{}' is BYTES: give its byte size",
                cfg.name
            ))
        });
    }
    let b = elems
        .checked_mul(dtype.byte_size())
        .ok_or_else(|| Error::invalid(format!("output '{name}': size overflows")))?;
    match byte_size {
        Some(bs) if bs != b => Err(Error::invalid(format!(
            "output '{name}' of model '{}': byte size {bs} does not match shape {} of {}",
            cfg.name,
            shape_string(shape),
            dtype.as_str()
        ))),
        _ => Ok(b),
    }
}

/// Sleeps for `us` microseconds of simulated compute with good precision: the OS sleep
/// overshoots (by up to about 100 us on virtual machines), so the last 200 us are spun.
pub fn simulate_compute(us: u64) {
    if us == 0 {
        return;
    }
    let start = std::time::Instant::now();
    let total = std::time::Duration::from_micros(us);
    let spin = std::time::Duration::from_micros(500);
    if total > spin {
        std::thread::sleep(total - spin);
    }
    while start.elapsed() < total {
        std::hint::spin_loop();
    }
}

/// An empty buffer with room for `bytes` (a batched input), or RESOURCE_EXHAUSTED.
fn try_buffer(bytes: usize, config: &ModelConfig, input: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    buf.try_reserve_exact(bytes).map_err(|_| {
        Error::exhausted(format!(
            "model '{}': cannot allocate {bytes} bytes for batched input '{input}'",
            config.name
        ))
    })?;
    Ok(buf)
}
