//! The GPU executor for ONNX graphs: an instance on a GPU reads the graph itself, plans
//! it per set of input shapes (kernels of kernels.cu compiled with NVRTC, GEMMs through
//! cuBLAS, intermediates in one arena whose space is reused), and runs the plan on the
//! instance's stream. It is the inner instance of a [`crate::backend::gpu_instance::GpuInstance`],
//! which moves inputs and outputs between host and device.
//!
//! Operators: see [`SUPPORTED`]. Shape computations (Shape, Gather, Concat, ... on
//! constants and shapes) run on the host while planning. A model with any other operator
//! fails to load with the operator named.
//!
//! Value inputs: a graph input that the planner must read (a Reshape's shape, a Slice's
//! starts, a Resize's scales, directly or through host-evaluated operators) is found the
//! first time planning needs it. From then on its values are read on the host for every
//! batch and are part of the plan's key, so each distinct value gets its own plan.

pub mod fuse;
pub mod host;
pub mod kargs;
pub mod kernels;
pub mod ops;
pub mod plan;

use crate::backend::{Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::cuda::driver::{Context, DevicePtr};
use crate::cuda::DeviceBuf;
use crate::onnx::graph::{self, Dt, Graph};
use crate::status::{Error, Result};
use plan::{Buf, Consts, Plan, PlanKey, Planner, Ptr, Step};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The operators the executor runs on the device (besides those it evaluates on the
/// host while planning).
pub const SUPPORTED: &[&str] = &[
    "Abs",
    "Acos",
    "Acosh",
    "Add",
    "And",
    "ArgMax",
    "ArgMin",
    "Asin",
    "Asinh",
    "Atan",
    "Atanh",
    "Attention",
    "AveragePool",
    "BatchNormalization",
    "BitShift",
    "BitwiseAnd",
    "BitwiseNot",
    "BitwiseOr",
    "BitwiseXor",
    "BlackmanWindow",
    "Cast",
    "CastLike",
    "Ceil",
    "Celu",
    "Clip",
    "Concat",
    "Conv",
    "ConvTranspose",
    "Cos",
    "Cosh",
    "CumSum",
    "DepthToSpace",
    "DequantizeLinear",
    "Div",
    "Dropout",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "EyeLike",
    "Flatten",
    "Floor",
    "Gather",
    "GatherElements",
    "GatherND",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "Greater",
    "GreaterOrEqual",
    "GroupNormalization",
    "HammingWindow",
    "HannWindow",
    "HardSigmoid",
    "HardSwish",
    "Hardmax",
    "Identity",
    "InstanceNormalization",
    "IsInf",
    "IsNaN",
    "LayerNormalization",
    "LeakyRelu",
    "Less",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "LpNormalization",
    "LpPool",
    "MatMul",
    "Max",
    "MaxPool",
    "Mean",
    "MeanVarianceNormalization",
    "Min",
    "Mish",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "OneHot",
    "Or",
    "PRelu",
    "Pad",
    "Pow",
    "QuantizeLinear",
    "RMSNormalization",
    "Reciprocal",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "Reshape",
    "Resize",
    "RotaryEmbedding",
    "Round",
    "Scatter",
    "ScatterElements",
    "ScatterND",
    "Selu",
    "Shape",
    "Shrink",
    "Sigmoid",
    "Sign",
    "Sin",
    "Sinh",
    "Slice",
    "Softmax",
    "Softplus",
    "Softsign",
    "SpaceToDepth",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Swish",
    "Tan",
    "Tanh",
    "ThresholdedRelu",
    "Tile",
    "TopK",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Where",
    "Xor",
];

/// Plans kept per instance (one per set of input shapes seen).
const MAX_PLANS: usize = 64;

/// The most elements a value input (one the planner reads) may have.
const MAX_VALUE_ELEMENTS: usize = 4096;

/// Operators only evaluated on the host (constants and shape computations).
const HOST_ONLY: &[&str] = &["Constant", "ConstantOfShape", "Range", "Size"];

/// The graph of `file`, read once for all the instances that load it while it is
/// unchanged (same length and modification time): instances of a model share one copy of
/// its host-side constants.
pub fn shared_graph(file: &Path, what: &str) -> Result<Arc<Graph>> {
    type Key = (std::path::PathBuf, u64, Option<std::time::SystemTime>);
    static GRAPHS: std::sync::OnceLock<parking_lot::Mutex<HashMap<Key, std::sync::Weak<Graph>>>> =
        std::sync::OnceLock::new();
    let meta = std::fs::metadata(file).ok();
    let key: Key = (
        file.to_path_buf(),
        meta.as_ref().map_or(0, |m| m.len()),
        meta.and_then(|m| m.modified().ok()),
    );
    let graphs = GRAPHS.get_or_init(Default::default);
    if let Some(g) = graphs.lock().get(&key).and_then(std::sync::Weak::upgrade) {
        return Ok(g);
    }
    // Read without the lock (other models load meanwhile); two instances racing on one
    // file may each read it, and the last one is kept.
    let g = Arc::new(load_graph(file, what)?);
    let mut map = graphs.lock();
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(key, Arc::downgrade(&g));
    Ok(g)
}

/// Reads and checks a graph for the GPU: every operator known, BatchNormalization after
/// Conv folded.
pub fn load_graph(file: &Path, what: &str) -> Result<Graph> {
    let mut g = Graph::read(file, what)?;
    if let Some(n) = g
        .nodes
        .iter()
        .find(|n| !SUPPORTED.contains(&n.op.as_str()) && !HOST_ONLY.contains(&n.op.as_str()))
    {
        return Err(Error::unsupported(format!(
            "{what}: {}: operator {} is not supported by the GPU executor (supported: {})",
            n.label(),
            n.op,
            SUPPORTED.join(", ")
        )));
    }
    for n in &g.nodes {
        plan::check_node(n, g.opset).map_err(|e| e.context(what))?;
    }
    if let Some(n) = g
        .nodes
        .iter()
        .find(|n| !n.inputs.is_empty() && n.op == "Constant")
    {
        return Err(Error::invalid(format!(
            "{what}: {}: a Constant with inputs",
            n.label()
        )));
    }
    plan::fold_batchnorm_into_conv(&mut g);
    Ok(g)
}

/// What a model's config asks of the executor: its `parameters` (`allow_tf32`,
/// `precision`, `cuda_graph_max_batch`) and, where those are not given, Triton's
/// `optimization` settings that carry over: `cuda { graphs: true }` (CUDA graphs for the
/// batch sizes of `graph_spec`, else for every batch size) and the `tensorrt` GPU
/// accelerator's `precision_mode` (FP32 or FP16).
#[derive(Debug, PartialEq)]
struct Options {
    tf32: bool,
    precision: Option<Dt>,
    graph_max_batch: i64,
}

impl Options {
    fn of(config: &ModelConfig, what: &str) -> Result<Options> {
        let json: serde_json::Value = serde_json::from_str(&config.json).unwrap_or_default();
        let opt = &json["optimization"];
        let param = |key: &str| config.parameters.get(key).map(|v| v.trim().to_owned());
        let tf32 = param("allow_tf32").is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        // precision: the parameter, else TensorRT's precision_mode.
        let trt_mode = opt["execution_accelerators"]["gpu_execution_accelerator"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["name"].as_str() == Some("tensorrt"))
            .find_map(|a| {
                a["parameters"]["precision_mode"]
                    .as_str()
                    .map(str::to_owned)
            });
        let precision = match (param("precision"), trt_mode) {
            (Some(v), _) => match v.to_ascii_uppercase().as_str() {
                "FP32" => None,
                "FP16" => Some(Dt::F16),
                "BF16" => Some(Dt::BF16),
                _ => {
                    return Err(Error::invalid(format!(
                        "{what}: parameter 'precision' is '{v}'; FP32, FP16 or BF16 are supported"
                    )))
                }
            },
            (None, Some(m)) => match m.to_ascii_uppercase().as_str() {
                "FP32" => None,
                "FP16" => Some(Dt::F16),
                _ => {
                    return Err(Error::unsupported(format!(
                        "{what}: the tensorrt accelerator's precision_mode '{m}' is not supported by the GPU executor (FP32 or FP16)"
                    )))
                }
            },
            (None, None) => None,
        };
        let graph_max_batch = match param("cuda_graph_max_batch") {
            Some(v) => v.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                Error::invalid(format!(
                    "{what}: parameter 'cuda_graph_max_batch' is '{v}'; a batch size (0: no CUDA graphs) is needed"
                ))
            })?,
            None if opt["cuda"]["graphs"].as_bool() == Some(true) => {
                let spec_max = opt["cuda"]["graph_spec"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|g| g["batch_size"].as_i64())
                    .max();
                match spec_max {
                    Some(b) if b > 0 => b,
                    // Without batch sizes (or a model that does not batch): every batch.
                    _ => i64::from(config.max_batch_size.max(1)),
                }
            }
            None => 0,
        };
        Ok(Options {
            tf32,
            precision,
            graph_max_batch,
        })
    }
}

/// One instance of an ONNX model on one GPU.
pub struct OnnxGpuInstance {
    graph: Arc<Graph>,
    config: Arc<ModelConfig>,
    ctx: Arc<Context>,
    module: Arc<kernels::Kernels>,
    /// Made at load (so that a missing cuBLAS fails the load, not every request), on the
    /// stream of `blas_stream` once a batch has given it.
    blas: crate::cuda::cublas::Blas,
    blas_stream: Option<usize>,
    /// FP16 or BF16: FLOAT tensors computed in that type (config parameter `precision`).
    precision: Option<Dt>,
    consts: Consts,
    /// Per graph input: whether the planner reads its values (see the module's notes).
    value_inputs: Vec<bool>,
    plans: HashMap<PlanKey, Arc<Plan>>,
    arena: Option<DeviceBuf>,
    what: String,
    /// Plans for batches of at most this many rows run as CUDA graphs (0: never).
    graph_max_batch: i64,
    graphs: HashMap<PlanKey, GraphEntry>,
}

/// A plan's CUDA graph: captured on the plan's second run (the first warms cuBLAS up),
/// with fixed input and output slots that each run copies in and out of.
enum GraphEntry {
    /// Runs so far without a graph.
    Warming(u32),
    Ready {
        graph: crate::cuda::graph::CudaGraph,
        inputs: Vec<crate::cuda::driver::DeviceMem>,
        outputs: Vec<Option<crate::cuda::driver::DeviceMem>>,
        /// The arena the graph was captured with (a new arena means a new capture).
        arena: DevicePtr,
    },
    /// Capture failed: the plan runs without a graph.
    Failed,
}

impl OnnxGpuInstance {
    /// An instance of `graph` (from [`shared_graph`], checked against the config by the
    /// caller): compiles (or finds) the kernels for the device, and plans the graph once
    /// for a batch of one so that anything it cannot run fails the load. The device's
    /// context must be bound.
    pub fn new(
        config: &Arc<ModelConfig>,
        graph: Arc<Graph>,
        device: i32,
        what: &str,
    ) -> Result<OnnxGpuInstance> {
        let info = crate::cuda::GpuState::for_mode(crate::cuda::GpuMode::Auto)
            .runtime()
            .and_then(|r| r.devices.get(device as usize).cloned())
            .ok_or_else(|| Error::unavailable(format!("{what}: GPU {device} is not usable")))?;
        // What this machine's CUDA cannot give the executor (a context, NVRTC that
        // compiles the kernels, a module the driver loads, a cuBLAS handle) is found here,
        // at load, and is UNAVAILABLE: KIND_GPU fails naming it, KIND_AUTO serves the
        // model on the CPU instead.
        let unusable = |e: Error| match e.code {
            crate::status::Code::Internal => Error::unavailable(format!(
                "{what}: the GPU executor cannot run on GPU {device}: {}",
                e.message
            )),
            _ => e.context(format!("{what} on GPU {device}")),
        };
        let ctx = crate::cuda::context(device).map_err(unusable)?;
        let module = kernels::kernels(&ctx, info.compute_capability).map_err(unusable)?;
        let opts = Options::of(config, what)?;
        let (tf32, precision) = (opts.tf32, opts.precision);
        // On the legacy stream until the first batch gives the instance's stream.
        let mut blas =
            crate::cuda::cublas::Blas::new(std::ptr::null_mut(), tf32).map_err(unusable)?;
        if opts.graph_max_batch > 0 {
            // GEMMs captured into CUDA graphs run on a workspace of the handle's own, of
            // the size cuBLAS's notes give (32 MiB from Hopper on, 4 MiB before).
            let bytes = if info.compute_capability.0 >= 9 {
                32
            } else {
                4
            } << 20;
            let mem = crate::cuda::driver::DeviceMem::alloc(&ctx, bytes)
                .map_err(|e| e.context(format!("{what}: cuBLAS workspace for CUDA graphs")))?;
            blas.use_workspace(mem).map_err(unusable)?;
        }
        let mut inst = OnnxGpuInstance {
            graph,
            precision,
            config: config.clone(),
            consts: Consts::new(&ctx),
            value_inputs: Vec::new(),
            ctx,
            module,
            blas,
            blas_stream: None,
            plans: HashMap::new(),
            arena: None,
            what: what.to_owned(),
            graph_max_batch: opts.graph_max_batch,
            graphs: HashMap::new(),
        };
        inst.value_inputs = vec![false; inst.graph.inputs.len()];
        let (inputs, invented) = inst.sample_inputs()?;
        let probe = PlanKey {
            inputs,
            values: Vec::new(),
        };
        match inst.plan_for(probe) {
            Ok(_) => {}
            // Planning needs values that requests bring: the first batch plans the rest.
            Err((_, true)) => {}
            // A shape the sample made up (1 for each variable dim) that the graph cannot
            // take (a pooling window larger than the made-up image): the first batch
            // plans with its real shapes. Unsupported operators were refused when the
            // graph was read.
            Err((e, false)) if invented && e.code == crate::status::Code::InvalidArgument => {}
            Err((e, false)) => return Err(e),
        }
        Ok(inst)
    }

    /// The graph inputs behind `names`: those reached by walking back from each name
    /// through the nodes that produce it (not through Shape and Size, which only need a
    /// shape, nor to the type-giving input of CastLike).
    fn inputs_behind(&self, names: &[String]) -> Vec<usize> {
        let producer: HashMap<&str, &graph::Node> = self
            .graph
            .nodes
            .iter()
            .flat_map(|n| n.outputs.iter().map(move |o| (o.as_str(), n)))
            .collect();
        let mut found = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut todo: Vec<&str> = names.iter().map(String::as_str).collect();
        while let Some(name) = todo.pop() {
            if name.is_empty() || !seen.insert(name) {
                continue;
            }
            if let Some(k) = self.graph.inputs.iter().position(|i| i.name == name) {
                found.push(k);
            } else if let Some(n) = producer.get(name) {
                match n.op.as_str() {
                    "Shape" | "Size" => {}
                    // Only the first input's values matter; the second gives a type.
                    "CastLike" => todo.extend(n.input(0)),
                    _ => todo.extend(n.inputs.iter().map(String::as_str)),
                }
            }
        }
        found.sort_unstable();
        found
    }

    /// The plan's key for `batch`: input types and shapes, and the values of the value
    /// inputs (read on the host: from the request, or copied down from device memory).
    fn key_of(&self, batch: &Batch) -> Result<PlanKey> {
        let mut key = PlanKey {
            inputs: Vec::with_capacity(self.graph.inputs.len()),
            values: Vec::new(),
        };
        for (k, io) in self.graph.inputs.iter().enumerate() {
            let Some(bi) = batch.inputs.iter().find(|b| *b.name == io.name) else {
                return Err(Error::invalid(format!(
                    "{}: input '{}' is missing from the batch (optional inputs are not supported on the GPU)",
                    self.what, io.name
                )));
            };
            let dt = Dt::from_library(bi.dtype).ok_or_else(|| {
                Error::unsupported(format!(
                    "{}: input '{}' of type {} on the GPU",
                    self.what,
                    io.name,
                    bi.dtype.as_str()
                ))
            })?;
            if self.value_inputs.get(k).copied().unwrap_or(false) {
                key.values.push((k, self.values_of(batch, bi, dt)?));
            }
            key.inputs.push((dt, bi.shape.to_vec()));
        }
        Ok(key)
    }

    /// The values of value input `bi` as f64 bit patterns.
    fn values_of(
        &self,
        batch: &Batch,
        bi: &crate::backend::BatchInput,
        dt: Dt,
    ) -> Result<Vec<u64>> {
        let n = bi
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
            .unwrap_or(usize::MAX);
        if n > MAX_VALUE_ELEMENTS {
            return Err(Error::unsupported(format!(
                "{}: input '{}' sets shapes or operator parameters, so the GPU executor reads it while planning; it has {n} elements, and at most {MAX_VALUE_ELEMENTS} are supported",
                self.what, bi.name
            )));
        }
        let mut bytes = Vec::with_capacity(n * dt.size());
        match Batch::assembled(bi) {
            Some(v) => bytes.extend_from_slice(v),
            None => {
                for piece in batch.input_pieces(bi) {
                    match piece.device() {
                        Some(d) => {
                            let at = bytes.len();
                            bytes.resize(at + piece.len(), 0);
                            // SAFETY: the request's device memory holds `piece.len()`
                            // bytes and stays valid while the request lives; the
                            // instance's context is bound.
                            unsafe {
                                crate::cuda::driver::copy_to_host_now(&mut bytes[at..], d.ptr)?
                            };
                        }
                        None => bytes.extend_from_slice(piece.as_slice()),
                    }
                }
            }
        }
        let t = graph::HostTensor::from_bytes(dt, &bi.shape, &bytes).ok_or_else(|| {
            Error::invalid(format!(
                "{}: input '{}' has {} bytes for shape {:?} of {}",
                self.what,
                bi.name,
                bytes.len(),
                &bi.shape[..],
                dt.name()
            ))
        })?;
        Ok(t.data.iter().map(|v| v.to_bits()).collect())
    }

    /// Input types and shapes of a batch of one (symbolic dims as 1).
    /// Also says whether a dim other than the batch dimension was made up (a variable
    /// dim given 1).
    fn sample_inputs(&self) -> Result<(Vec<plan::InputKey>, bool)> {
        let batching = self.config.max_batch_size > 0;
        let mut invented = false;
        let inputs = self
            .graph
            .inputs
            .iter()
            .map(|io| {
                let tc = self.config.input(&io.name);
                let dt = tc
                    .and_then(|t| Dt::from_library(t.data_type))
                    .or(io.dt)
                    .ok_or_else(|| {
                        Error::unsupported(format!(
                            "{}: input '{}' has a type the GPU executor does not support",
                            self.what, io.name
                        ))
                    })?;
                let mut shape: Vec<i64> = match tc {
                    Some(t) => {
                        let mut s = if batching { vec![1] } else { Vec::new() };
                        s.extend(t.reshape.clone().unwrap_or_else(|| t.dims.clone()));
                        s
                    }
                    None => io.dims.clone().unwrap_or_default(),
                };
                let skip = usize::from(batching && tc.is_some());
                for (k, d) in shape.iter_mut().enumerate() {
                    if *d < 0 {
                        *d = 1;
                        invented |= k >= skip;
                    }
                }
                Ok((dt, shape))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((inputs, invented))
    }

    /// The plan for `key`, made on first use. On failure, the error and whether planning
    /// found value inputs not known before (marked now: a new key can be read).
    fn plan_for(&mut self, key: PlanKey) -> std::result::Result<Arc<Plan>, (Error, bool)> {
        if let Some(p) = self.plans.get(&key) {
            return Ok(p.clone());
        }
        self.ctx.bind().map_err(|e| (e, false))?;
        if self.plans.len() >= MAX_PLANS {
            // Inputs of ever new shapes: start over rather than grow without bound
            // (plans keep their constants alive; graphs their slots).
            self.plans.clear();
            self.graphs.clear();
        }
        let graph = self.graph.clone();
        let mut planner = Planner::new(&graph, &mut self.consts, self.precision);
        let plan = match planner.plan(&key) {
            Ok(p) => p,
            Err(e) => {
                let wanted = planner.wanted().to_vec();
                let mut new = false;
                for k in self.inputs_behind(&wanted) {
                    if let Some(v) = self.value_inputs.get_mut(k).filter(|v| !**v) {
                        *v = true;
                        new = true;
                    }
                }
                return Err((e.context(&self.what), new));
            }
        };
        let plan = Arc::new(plan);
        self.plans.insert(key, plan.clone());
        Ok(plan)
    }
}

impl ModelInstance for OnnxGpuInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        let (stream, pool) = match &batch.gpu {
            Some(g) => (g.stream, g.pool().clone()),
            None => {
                return Err(Error::internal(format!(
                    "{}: not on a GPU instance",
                    self.what
                )))
            }
        };
        // Graph inputs from the batch, by name.
        let plan = loop {
            let key = self.key_of(batch)?;
            match self.plan_for(key) {
                Ok(p) => break p,
                // Values of inputs found to be needed: read them and plan again (each
                // round marks at least one more input, so this ends).
                Err((_, true)) => continue,
                Err((e, false)) => return Err(e),
            }
        };
        let mut in_ptrs = Vec::with_capacity(self.graph.inputs.len());
        for io in &self.graph.inputs {
            let i = batch.inputs.iter().position(|b| *b.name == io.name);
            in_ptrs.push(
                i.and_then(|i| batch.gpu.as_ref().map(|g| g.inputs[i]))
                    .unwrap_or(0),
            );
        }
        // Outputs the config lists, in device memory.
        let mut out_ptrs: Vec<Option<DevicePtr>> = Vec::with_capacity(plan.outputs.len());
        for (io, (dt, shape)) in self.graph.outputs.iter().zip(&plan.outputs) {
            // A model output, or the output of an implicit state.
            let declared = self
                .config
                .output(&io.name)
                .map(|t| t.data_type)
                .or_else(|| {
                    self.config
                        .sequence_batching
                        .as_ref()
                        .and_then(|q| q.state_by_output(&io.name))
                        .map(|st| st.data_type)
                });
            match declared {
                Some(cdt) => {
                    if Dt::from_library(cdt) != Some(*dt) {
                        return Err(Error::invalid(format!(
                            "{}: output '{}' is {} in the model and {} in the config",
                            self.what,
                            io.name,
                            dt.name(),
                            cdt.as_str()
                        )));
                    }
                    out_ptrs.push(Some(batch.alloc_output_device(&io.name, shape)?));
                }
                None => out_ptrs.push(None),
            }
        }
        if self.arena.as_ref().map_or(0, |a| a.len() as u64) < plan.arena_bytes {
            // The old arena goes back to the pool; only this instance's stream uses it,
            // so work still queued on it finishes before anything reuses it.
            self.arena = Some(pool.device(plan.arena_bytes as usize)?);
        }
        let arena = self.arena.as_ref().map_or(0, |a| a.ptr());
        if self.blas_stream != Some(stream as usize) {
            self.blas.set_stream(stream as _)?;
            self.blas_stream = Some(stream as usize);
        }
        let stream = stream as crate::cuda::CUstream;
        let batch_rows = (self.config.max_batch_size > 0).then_some(batch.size as i64);
        // (A model that does not batch has one shape per plan: graphs whenever asked for.)
        if self.graph_max_batch > 0 && batch_rows.is_none_or(|r| r <= self.graph_max_batch) {
            if let Some(done) = self.run_graph(&plan, &in_ptrs, &out_ptrs, arena, stream)? {
                return Ok(done);
            }
        }
        self.run_steps(&plan, &in_ptrs, &out_ptrs, arena, stream)
    }
}

impl OnnxGpuInstance {
    /// Queues the plan's steps on `stream`.
    fn run_steps(
        &self,
        plan: &Plan,
        in_ptrs: &[DevicePtr],
        out_ptrs: &[Option<DevicePtr>],
        arena: DevicePtr,
        stream: crate::cuda::CUstream,
    ) -> Result<()> {
        let resolve = |p: &Ptr| -> Option<DevicePtr> {
            let base = match &p.buf {
                Buf::Input(k) => in_ptrs[*k],
                Buf::Output(k) => out_ptrs[*k]?,
                Buf::Temp(t) => arena + plan.temp_offsets[*t],
                Buf::Const(m) => m.ptr(),
            };
            Some(base + p.bytes)
        };
        for step in &plan.steps {
            match step {
                Step::Kernel { k, args, ins, out } => {
                    let mut a = **args;
                    for (slot, p) in a.inp.iter_mut().zip(ins) {
                        *slot = p.as_ref().and_then(resolve).unwrap_or(0);
                    }
                    let Some(o) = resolve(out) else { continue };
                    a.out = o;
                    // SAFETY: the instance's live stream.
                    unsafe { self.module.launch(*k, &a, stream)? };
                }
                Step::Gemm { g, a, b, c } => {
                    let (Some(a), Some(b), Some(c)) = (resolve(a), resolve(b), resolve(c)) else {
                        continue;
                    };
                    self.blas.gemm(g, a, b, c)?;
                }
                Step::Copy { dst, src, bytes } => {
                    let (Some(d), Some(s)) = (resolve(dst), resolve(src)) else {
                        continue;
                    };
                    // SAFETY: both ranges were sized by the plan.
                    unsafe { crate::cuda::driver::copy_async(d, s, *bytes as usize, stream)? };
                }
            }
        }
        Ok(())
    }

    /// Runs the plan as a CUDA graph when it has one (capturing it on the plan's second
    /// run): copies the inputs into the graph's slots, launches it, copies the outputs
    /// out. Ok(None): run it step by step instead.
    fn run_graph(
        &mut self,
        plan: &Plan,
        in_ptrs: &[DevicePtr],
        out_ptrs: &[Option<DevicePtr>],
        arena: DevicePtr,
        stream: crate::cuda::CUstream,
    ) -> Result<Option<()>> {
        let key = plan.key.clone();
        let entry = self.graphs.remove(&key).unwrap_or(GraphEntry::Warming(0));
        let entry = match entry {
            GraphEntry::Warming(n) if n < 1 => {
                self.graphs.insert(key, GraphEntry::Warming(n + 1));
                return Ok(None);
            }
            GraphEntry::Ready { arena: a, .. } if a != arena => self.capture(plan, arena, stream),
            GraphEntry::Warming(_) => self.capture(plan, arena, stream),
            other => other,
        };
        let result = match &entry {
            GraphEntry::Ready {
                graph,
                inputs,
                outputs,
                ..
            } => {
                let copy = |d: DevicePtr, s: DevicePtr, n: usize| {
                    // SAFETY: slots were sized from the plan; the batch's buffers hold
                    // the same shapes.
                    unsafe { crate::cuda::driver::copy_async(d, s, n, stream) }
                };
                let mut r = Ok(Some(()));
                for (slot, &src) in inputs.iter().zip(in_ptrs) {
                    r = r.and_then(|x| copy(slot.ptr(), src, slot.len()).map(|()| x));
                }
                // SAFETY: the instance's stream, of the graph's context.
                r = r.and_then(|x| unsafe { graph.launch(stream) }.map(|()| x));
                for (slot, dst) in outputs.iter().zip(out_ptrs) {
                    if let (Some(slot), Some(dst)) = (slot, dst) {
                        r = r.and_then(|x| copy(*dst, slot.ptr(), slot.len()).map(|()| x));
                    }
                }
                r
            }
            _ => Ok(None),
        };
        self.graphs.insert(key, entry);
        result
    }

    /// Captures `plan` into a graph with its own input and output slots.
    fn capture(
        &mut self,
        plan: &Plan,
        arena: DevicePtr,
        stream: crate::cuda::CUstream,
    ) -> GraphEntry {
        let made = (|| -> Result<GraphEntry> {
            let mut inputs = Vec::new();
            for (dt, shape) in &plan.key.inputs {
                let bytes = shape.iter().product::<i64>().max(0) as usize * dt.size();
                inputs.push(crate::cuda::driver::DeviceMem::upload(
                    &self.ctx,
                    &vec![0u8; bytes],
                )?);
            }
            let mut outputs = Vec::new();
            for (io, (dt, shape)) in self.graph.outputs.iter().zip(&plan.outputs) {
                let wanted = self.config.output(&io.name).is_some()
                    || self
                        .config
                        .sequence_batching
                        .as_ref()
                        .is_some_and(|q| q.state_by_output(&io.name).is_some());
                outputs.push(if wanted {
                    let bytes = shape.iter().product::<i64>().max(0) as usize * dt.size();
                    Some(crate::cuda::driver::DeviceMem::upload(
                        &self.ctx,
                        &vec![0u8; bytes],
                    )?)
                } else {
                    None
                });
            }
            let in_ptrs: Vec<DevicePtr> = inputs.iter().map(|m| m.ptr()).collect();
            let out_ptrs: Vec<Option<DevicePtr>> = outputs
                .iter()
                .map(|m| m.as_ref().map(|m| m.ptr()))
                .collect();
            // SAFETY: the instance's stream, used by nothing else while this worker
            // captures; slots, arena and constants outlive the graph (kept with it, or
            // a new arena means a new capture).
            let graph = unsafe {
                crate::cuda::graph::CudaGraph::capture(&self.ctx, stream, || {
                    self.run_steps(plan, &in_ptrs, &out_ptrs, arena, stream)
                })?
            };
            Ok(GraphEntry::Ready {
                graph,
                inputs,
                outputs,
                arena,
            })
        })();
        made.unwrap_or(GraphEntry::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(extra: &str) -> Result<Options> {
        let text = format!(
            "name: \"m\" platform: \"onnxruntime_onnx\" max_batch_size: 16\n\
             input [ {{ name: \"X\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n\
             output [ {{ name: \"Y\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n{extra}"
        );
        let c =
            crate::config::parse_config(&text).map_err(|e| Error::internal(format!("{e:?}")))?;
        Options::of(&c, "model 'm'")
    }

    fn param(k: &str, v: &str) -> String {
        format!("parameters {{ key: \"{k}\" value: {{ string_value: \"{v}\" }} }}\n")
    }

    const TRT_FP16: &str = r#"optimization { execution_accelerators { gpu_execution_accelerator: [
        { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ] } }"#;

    #[test]
    fn defaults_and_parameters() {
        let none = Options {
            tf32: false,
            precision: None,
            graph_max_batch: 0,
        };
        assert_eq!(options("").unwrap(), none);
        let o = options(
            &(param("allow_tf32", "true")
                + &param("precision", "bf16")
                + &param("cuda_graph_max_batch", "8")),
        )
        .unwrap();
        assert_eq!(
            o,
            Options {
                tf32: true,
                precision: Some(Dt::BF16),
                graph_max_batch: 8
            }
        );
        let e = options(&param("precision", "INT8")).unwrap_err();
        assert!(e.message.contains("'precision' is 'INT8'"), "{e:?}");
        let e = options(&param("cuda_graph_max_batch", "many")).unwrap_err();
        assert!(
            e.message.contains("'cuda_graph_max_batch' is 'many'"),
            "{e:?}"
        );
    }

    #[test]
    fn instances_share_a_graph_until_the_file_changes() {
        use tract_onnx::pb;
        let model = |op: &str| pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
            graph: Some(pb::GraphProto {
                node: vec![pb::NodeProto {
                    op_type: op.into(),
                    input: vec!["X".into()],
                    output: vec!["Y".into()],
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let dir = std::env::temp_dir().join(format!("infer-shared-graph-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("model.onnx");
        std::fs::write(&file, prost::Message::encode_to_vec(&model("Relu"))).unwrap();
        let a = shared_graph(&file, "m").unwrap();
        let b = shared_graph(&file, "m").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        // A different file (another length) is read again.
        std::fs::write(&file, prost::Message::encode_to_vec(&model("Sigmoid"))).unwrap();
        let c = shared_graph(&file, "m").unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(c.nodes[0].op, "Sigmoid");
        // Once no instance holds it, it goes.
        let weak = Arc::downgrade(&c);
        drop(c);
        assert!(weak.upgrade().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn triton_optimization_settings_carry_over() {
        assert_eq!(options(TRT_FP16).unwrap().precision, Some(Dt::F16));
        // The parameter wins over the accelerator's mode.
        let both = format!("{TRT_FP16}\n{}", param("precision", "FP32"));
        assert_eq!(options(&both).unwrap().precision, None);
        let int8 = TRT_FP16.replace("FP16", "INT8");
        let e = options(&int8).unwrap_err();
        assert_eq!(e.code, crate::status::Code::Unsupported);
        assert!(e.message.contains("precision_mode 'INT8'"), "{e:?}");
        // Another accelerator's parameters are not ours.
        let other = TRT_FP16.replace("tensorrt", "openvino");
        assert_eq!(options(&other).unwrap().precision, None);

        let graphs = "optimization { cuda { graphs: true } }";
        assert_eq!(options(graphs).unwrap().graph_max_batch, 16);
        let spec = r#"optimization { cuda { graphs: true graph_spec [ { batch_size: 2 }, { batch_size: 4 } ] } }"#;
        assert_eq!(options(spec).unwrap().graph_max_batch, 4);
        let off = "optimization { cuda { graphs: false } }";
        assert_eq!(options(off).unwrap().graph_max_batch, 0);
        let both = format!("{graphs}\n{}", param("cuda_graph_max_batch", "0"));
        assert_eq!(options(&both).unwrap().graph_max_batch, 0);
    }
}
