//! Turning a graph into a plan for given input shapes: every node becomes kernel
//! launches, cuBLAS GEMMs or nothing at all (views and host computations), and every
//! intermediate tensor gets an offset in one device arena, reused once the tensor is dead.

use super::host::{self, broadcast, broadcast_strides, strides, SliceSpec};
use super::kargs::{KArgs, Kernel};
use crate::cuda::driver::{Context, DeviceMem};
use crate::onnx::graph::{Dt, Graph, HostTensor, Node};
use crate::status::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

mod attention;
mod composite;
mod elementwise;
mod linear;
mod reduce;
mod shape;
pub mod step;

pub use step::{Buf, Ptr, Step};

/// A tensor on the device: contiguous, row-major.
#[derive(Clone)]
pub struct Dev {
    pub dt: Dt,
    pub shape: Vec<i64>,
    pub ptr: Ptr,
}

impl Dev {
    fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

#[derive(Clone)]
pub enum Val {
    /// Shared: the graph's initializers are not copied into each plan.
    Host(Arc<HostTensor>),
    Dev(Dev),
}

struct Temp {
    bytes: u64,
    first: usize,
    last: usize,
}

/// A graph input's type and shape.
pub type InputKey = (Dt, Vec<i64>);

/// What a plan is for: the type and shape of every graph input (graph input order), and
/// the values of the inputs that the planner reads (see [`Planner::wanted`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    pub inputs: Vec<InputKey>,
    /// (graph input, its values as f64 bit patterns).
    pub values: Vec<(usize, Vec<u64>)>,
}

impl PlanKey {
    /// Value input `k` as a host tensor.
    fn value(&self, k: usize) -> Option<HostTensor> {
        let (_, bits) = self.values.iter().find(|(i, _)| *i == k)?;
        let (dt, shape) = self.inputs.get(k)?;
        Some(HostTensor {
            dt: *dt,
            shape: shape.clone(),
            data: bits.iter().map(|&b| f64::from_bits(b)).collect(),
        })
    }
}

/// A plan for one set of input shapes (and values of the inputs it reads).
pub struct Plan {
    pub key: PlanKey,
    pub steps: Vec<Step>,
    /// Arena offset of each intermediate.
    pub temp_offsets: Vec<u64>,
    pub arena_bytes: u64,
    /// Element type and shape of each graph output.
    pub outputs: Vec<(Dt, Vec<i64>)>,
}

/// Constants uploaded to one device. Content-addressed and shared by every plan of every
/// instance on that device (two instances of a model on one GPU hold its weights once):
/// the registry keeps weak references, so a constant is freed when the last plan that
/// uses it goes.
pub struct Consts {
    ctx: Arc<Context>,
    /// The graph's initializers as uploaded (by name and the type they are computed in):
    /// found again without hashing their contents when the next plan is made.
    initializers: HashMap<(String, Dt), Arc<DeviceMem>>,
}

type ConstKey = (i32, String);
static CONSTS: std::sync::OnceLock<parking_lot::Mutex<HashMap<ConstKey, Weak<DeviceMem>>>> =
    std::sync::OnceLock::new();

impl Consts {
    pub fn new(ctx: &Arc<Context>) -> Consts {
        Consts {
            ctx: ctx.clone(),
            initializers: HashMap::new(),
        }
    }

    fn get(&mut self, key: &str, t: &HostTensor) -> Result<Arc<DeviceMem>> {
        let full = (
            self.ctx.ordinal(),
            format!("{key}|{:?}|{:?}|{}", t.dt, t.shape, content_hash(t)),
        );
        let mut reg = CONSTS.get_or_init(Default::default).lock();
        if let Some(m) = reg.get(&full).and_then(Weak::upgrade) {
            return Ok(m);
        }
        // Dead entries go when new ones come (a model reloaded with new weights).
        reg.retain(|_, w| w.strong_count() > 0);
        let m = Arc::new(DeviceMem::upload(&self.ctx, &t.to_bytes())?);
        reg.insert(full, Arc::downgrade(&m));
        Ok(m)
    }
}

fn content_hash(t: &HostTensor) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for v in &t.data {
        v.to_bits().hash(&mut h);
    }
    h.finish()
}

const ALIGN: u64 = 256;

/// The largest im2col buffer a convolution gets (bytes); above it, the direct kernel.
const COL_LIMIT: u64 = 1 << 30;

/// Builds plans.
pub struct Planner<'a> {
    graph: &'a Graph,
    consts: &'a mut Consts,
    /// FP16 or BF16: FLOAT tensors are computed in this type (graph inputs and outputs
    /// stay FLOAT, converted at the edges; FLOAT constants are converted at upload).
    precision: Option<Dt>,
    /// One-element float constants on the device: address -> value (for fusion).
    scalars: HashMap<usize, f32>,
    /// The names of the graph's initializers (constant whatever the input shapes).
    initializers: std::collections::HashSet<&'a str>,
    vals: HashMap<String, Val>,
    /// Graph inputs whose values are known while planning, as they are on the device.
    input_devs: HashMap<String, Dev>,
    /// Values the planner needed on the host but found computed on the device.
    wanted: Vec<String>,
    steps: Vec<Step>,
    temps: Vec<Temp>,
    /// An intermediate too large to make (its type and shape): the plan fails.
    too_large: Option<(Dt, Vec<i64>)>,
}

fn unsupported(node: &Node, why: impl std::fmt::Display) -> Error {
    Error::unsupported(format!("{}: {why} on the GPU", node.label()))
}

/// GEMM sizes must fit cuBLAS's 32-bit ints.
fn fits32(node: &Node, dims: &[i64]) -> Result<()> {
    if dims.iter().any(|&d| d < 0 || d > i32::MAX as i64) {
        return Err(unsupported(
            node,
            format!("GEMM sizes {dims:?} beyond 32 bits"),
        ));
    }
    Ok(())
}

/// Elements of `shape`; saturates (a shape that large is refused when its tensor is made,
/// see [`Planner::temp`]).
fn numel(shape: &[i64]) -> i64 {
    shape
        .iter()
        .try_fold(1i64, |n, &d| n.checked_mul(d))
        .unwrap_or(i64::MAX)
}

/// The largest intermediate a plan makes (bytes): beyond any device's memory.
const MAX_TEMP: u64 = 1 << 44;

impl<'a> Planner<'a> {
    pub fn new(graph: &'a Graph, consts: &'a mut Consts, precision: Option<Dt>) -> Planner<'a> {
        Planner {
            graph,
            consts,
            precision: precision.filter(|p| matches!(p, Dt::F16 | Dt::BF16)),
            scalars: HashMap::new(),
            initializers: graph.initializers.iter().map(|(n, _)| n.as_str()).collect(),
            vals: HashMap::new(),
            input_devs: HashMap::new(),
            wanted: Vec::new(),
            steps: Vec::new(),
            temps: Vec::new(),
            too_large: None,
        }
    }

    /// After a failed [`Planner::plan`]: the values it needed while planning (a shape, an
    /// operator's parameters) that were computed on the device. Graph inputs among them,
    /// or behind them, can be given to the next plan as values (see [`PlanKey`]).
    pub fn wanted(&self) -> &[String] {
        &self.wanted
    }

    /// Records that `name` was needed on the host; the error to return.
    fn want(&mut self, node: &Node, name: &str, what: impl std::fmt::Display) -> Error {
        self.wanted.push(name.to_owned());
        unsupported(
            node,
            format!("{what} '{name}' computed on the device (it must be a constant, come from shapes, or be a graph input)"),
        )
    }

    /// Plans the graph for inputs of these types and shapes (and values, where the key
    /// has them). A planner makes one plan.
    pub fn plan(&mut self, key: &PlanKey) -> Result<Plan> {
        let inputs = &key.inputs;
        for (name, t) in &self.graph.initializers {
            self.vals.insert(name.clone(), Val::Host(Arc::clone(t)));
        }
        for (k, (io, (dt, shape))) in self.graph.inputs.iter().zip(inputs).enumerate() {
            let x = Dev {
                dt: *dt,
                shape: shape.clone(),
                ptr: Ptr {
                    buf: Buf::Input(k),
                    bytes: 0,
                },
            };
            let x = match self.precision {
                Some(p) if *dt == Dt::F32 => {
                    let y = self.temp(p, shape.clone());
                    self.cast(&x, &y);
                    y
                }
                _ => x,
            };
            match key.value(k) {
                Some(t) => {
                    self.vals.insert(io.name.clone(), Val::Host(Arc::new(t)));
                    self.input_devs.insert(io.name.clone(), x);
                }
                None => {
                    self.vals.insert(io.name.clone(), Val::Dev(x));
                }
            }
        }
        let graph = self.graph;
        for node in &graph.nodes {
            self.node(node)?;
            if let Some((dt, shape)) = self.too_large.take() {
                return Err(Error::exhausted(format!(
                    "{}: a {} tensor of shape {shape:?} is too large",
                    node.label(),
                    dt.name()
                )));
            }
        }
        let mut outputs = Vec::new();
        for (k, io) in graph.outputs.iter().enumerate() {
            let v = self.dev(&io.name)?;
            let dst = Ptr {
                buf: Buf::Output(k),
                bytes: 0,
            };
            // Computed in reduced precision for a FLOAT output: converted back.
            let widen = self.precision == Some(v.dt) && io.dt.is_none_or(|d| d == Dt::F32);
            if widen {
                let y = Dev {
                    dt: Dt::F32,
                    shape: v.shape.clone(),
                    ptr: dst,
                };
                self.cast(&v, &y);
                outputs.push((Dt::F32, v.shape.clone()));
                continue;
            }
            let bytes = (numel(&v.shape) as usize * v.dt.size()) as u64;
            self.push(Step::Copy {
                dst,
                src: v.ptr.clone(),
                bytes,
            });
            outputs.push((v.dt, v.shape.clone()));
        }
        let steps = std::mem::take(&mut self.steps);
        self.steps = super::fuse::fuse(steps, &self.scalars);
        super::fuse::collapse_dims(&mut self.steps);
        self.lifetimes();
        let (temp_offsets, arena_bytes) = self.assign();
        Ok(Plan {
            key: key.clone(),
            steps: std::mem::take(&mut self.steps),
            temp_offsets,
            arena_bytes,
            outputs,
        })
    }

    /// Each intermediate's first and last step, from the final steps (fusion moves and
    /// drops uses); those no step uses take no space.
    fn lifetimes(&mut self) {
        let mut span: Vec<Option<(usize, usize)>> = vec![None; self.temps.len()];
        for (at, step) in self.steps.iter().enumerate() {
            let mut uses: Vec<&Ptr> = Vec::new();
            match step {
                Step::Kernel { ins, out, .. } => {
                    uses.extend(ins.iter().flatten());
                    uses.push(out);
                }
                Step::Gemm { a, b, c, .. } => uses.extend([a, b, c]),
                Step::Copy { dst, src, .. } => uses.extend([dst, src]),
            }
            for p in uses {
                if let Buf::Temp(t) = p.buf {
                    let s = span[t].get_or_insert((at, at));
                    s.0 = s.0.min(at);
                    s.1 = s.1.max(at);
                }
            }
        }
        for (t, s) in self.temps.iter_mut().zip(span) {
            match s {
                Some((first, last)) => {
                    t.first = first;
                    t.last = last;
                }
                None => {
                    t.bytes = 0;
                    t.first = 0;
                    t.last = 0;
                }
            }
        }
    }

    /// First-fit offsets for the intermediates, reusing space of dead ones.
    fn assign(&self) -> (Vec<u64>, u64) {
        let mut placed: Vec<(u64, u64, usize, usize)> = Vec::new(); // offset, bytes, first, last
        let mut offsets = vec![0u64; self.temps.len()];
        let mut total = 0u64;
        let mut order: Vec<usize> = (0..self.temps.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(self.temps[i].bytes));
        for i in order {
            let t = &self.temps[i];
            let mut busy: Vec<(u64, u64)> = placed
                .iter()
                .filter(|p| p.2 <= t.last && t.first <= p.3)
                .map(|p| (p.0, p.0 + p.1))
                .collect();
            busy.sort_unstable();
            let mut at = 0u64;
            for (s, e) in busy {
                if at + t.bytes <= s {
                    break;
                }
                at = at.max(e.next_multiple_of(ALIGN));
            }
            offsets[i] = at;
            total = total.max(at + t.bytes);
            placed.push((at, t.bytes, t.first, t.last));
        }
        (offsets, total)
    }

    fn push(&mut self, mut step: Step) {
        if let Step::Gemm { g, .. } = &mut step {
            // cuBLAS wants leading dimensions of at least 1, even for empty matrices.
            g.lda = g.lda.max(1);
            g.ldb = g.ldb.max(1);
            g.ldc = g.ldc.max(1);
        }
        let at = self.steps.len();
        let mut uses = Vec::new();
        match &step {
            Step::Kernel { ins, out, .. } => {
                uses.extend(ins.iter().flatten().cloned());
                uses.push(out.clone());
            }
            Step::Gemm { a, b, c, .. } => uses.extend([a.clone(), b.clone(), c.clone()]),
            Step::Copy { dst, src, .. } => uses.extend([dst.clone(), src.clone()]),
        }
        for p in uses {
            if let Buf::Temp(t) = p.buf {
                let t = &mut self.temps[t];
                t.first = t.first.min(at);
                t.last = t.last.max(at);
            }
        }
        self.steps.push(step);
    }

    fn temp(&mut self, dt: Dt, shape: Vec<i64>) -> Dev {
        let mut bytes = (numel(&shape).max(0) as u64)
            .saturating_mul(dt.size() as u64)
            .max(1);
        if bytes > MAX_TEMP {
            self.too_large.get_or_insert((dt, shape.clone()));
            bytes = 1;
        }
        let at = self.steps.len();
        self.temps.push(Temp {
            bytes: bytes.next_multiple_of(ALIGN),
            first: at,
            last: at,
        });
        Dev {
            dt,
            shape,
            ptr: Ptr {
                buf: Buf::Temp(self.temps.len() - 1),
                bytes: 0,
            },
        }
    }

    /// A value on the device (host values are uploaded as constants).
    fn dev(&mut self, name: &str) -> Result<Dev> {
        if let Some(x) = self.input_devs.get(name) {
            return Ok(x.clone());
        }
        let t = match self.vals.get(name) {
            None => {
                return Err(Error::invalid(format!(
                    "the graph uses '{name}' before it is computed"
                )))
            }
            Some(Val::Dev(d)) => return Ok(d.clone()),
            Some(Val::Host(t)) => t,
        };
        let dt = match self.precision {
            Some(p) if t.dt == Dt::F32 => p,
            _ => t.dt,
        };
        let key = (name.to_owned(), dt);
        let init = self.initializers.contains(name);
        let mem = match self.consts.initializers.get(&key).filter(|_| init) {
            Some(m) => m.clone(),
            None => {
                let converted;
                let t = if dt == t.dt {
                    t
                } else {
                    converted = HostTensor {
                        dt,
                        ..(**t).clone()
                    }
                    .normalize();
                    &converted
                };
                let mem = self.consts.get(name, t)?;
                if init {
                    self.consts.initializers.insert(key, mem.clone());
                }
                mem
            }
        };
        if dt.float_code().is_some() && t.len() == 1 {
            // The value as computed (rounded to the 16-bit type where it is one).
            let v = HostTensor {
                dt,
                shape: Vec::new(),
                data: vec![t.data[0]],
            }
            .normalize()
            .data[0];
            self.scalars.insert(Arc::as_ptr(&mem) as usize, v as f32);
        }
        Ok(Dev {
            dt,
            shape: t.shape.clone(),
            ptr: Ptr {
                buf: Buf::Const(mem),
                bytes: 0,
            },
        })
    }

    fn host(&self, name: &str) -> Option<&HostTensor> {
        match self.vals.get(name) {
            Some(Val::Host(t)) => Some(t),
            _ => None,
        }
    }

    fn set(&mut self, node: &Node, i: usize, v: Val) {
        if let Some(name) = node.outputs.get(i) {
            if !name.is_empty() {
                self.vals.insert(name.clone(), v);
            }
        }
    }

    fn node(&mut self, node: &Node) -> Result<()> {
        // Everything known on the host: evaluate there.
        let host_ins: Vec<Option<&HostTensor>> = node
            .inputs
            .iter()
            .map(|n| if n.is_empty() { None } else { self.host(n) })
            .collect();
        let all_host = node
            .inputs
            .iter()
            .zip(&host_ins)
            .all(|(n, h)| n.is_empty() || h.is_some());
        if all_host {
            if let Some(outs) = host::eval(node, &host_ins, self.graph.opset)? {
                for (i, t) in outs.into_iter().enumerate() {
                    self.set(node, i, Val::Host(Arc::new(t)));
                }
                return Ok(());
            }
        }
        // CastLike of a host value needs only the other input's type.
        if node.op == "CastLike" {
            let like = match node.input(1).and_then(|n| self.vals.get(n)) {
                Some(Val::Dev(d)) => Some(d.dt),
                _ => None,
            };
            if let (Some(x), Some(like)) = (node.input(0).and_then(|n| self.host(n)), like) {
                // (A FLOAT computed in reduced precision is FLOAT to the graph; host values
                // are converted when they are uploaded.)
                let dt = if Some(like) == self.precision {
                    Dt::F32
                } else {
                    like
                };
                let y = HostTensor { dt, ..x.clone() }.normalize();
                self.set(node, 0, Val::Host(Arc::new(y)));
                return Ok(());
            }
        }
        // Shape and Size need no data.
        if node.op == "Size" {
            let x = self.dev(node.input(0).unwrap_or(""))?;
            self.set(
                node,
                0,
                Val::Host(Arc::new(HostTensor::scalar_i64(x.numel()))),
            );
            return Ok(());
        }
        if node.op == "Shape" {
            let x = self.dev(node.input(0).unwrap_or(""))?;
            let shape_only = HostTensor {
                dt: Dt::F32,
                shape: x.shape.clone(),
                data: Vec::new(),
            };
            if let Some(outs) = host::eval(node, &[Some(&shape_only)], self.graph.opset)? {
                for (i, t) in outs.into_iter().enumerate() {
                    self.set(node, i, Val::Host(Arc::new(t)));
                }
                return Ok(());
            }
        }
        self.device_node(node)
    }

    fn x(&mut self, node: &Node, i: usize) -> Result<Dev> {
        let name = node
            .input(i)
            .ok_or_else(|| Error::invalid(format!("{}: input {i} is missing", node.label())))?
            .to_owned();
        self.dev(&name)
    }

    fn host_input(&mut self, node: &Node, i: usize) -> Result<Option<Vec<i64>>> {
        match node.input(i) {
            None => Ok(None),
            Some(n) => match self.host(n) {
                Some(t) => Ok(Some(t.as_i64())),
                None => Err(self.want(node, n, "input")),
            },
        }
    }

    /// The float kernels' type code of `d` (FLOAT, FLOAT16 or BFLOAT16 only).
    fn ft(node: &Node, d: &Dev) -> Result<i64> {
        d.dt.float_code()
            .ok_or_else(|| unsupported(node, format!("{} tensors", d.dt.name())))
    }

    /// The float kernels' type code shared by `ds` (they must agree).
    fn ft_all(node: &Node, ds: &[&Dev]) -> Result<i64> {
        let Some(first) = ds.first() else {
            return Ok(0);
        };
        let code = Self::ft(node, first)?;
        if let Some(d) = ds.iter().find(|d| d.dt != first.dt) {
            return Err(Error::invalid(format!(
                "{}: inputs of types {} and {} (they must agree)",
                node.label(),
                first.dt.name(),
                d.dt.name()
            )));
        }
        Ok(code)
    }

    /// `y` = `x` converted to y's type (same shape, contiguous).
    fn cast(&mut self, x: &Dev, y: &Dev) {
        let (from, to) = (x.dt.cast_code(), y.dt.cast_code());
        self.kernel(Kernel::Cast, x.numel(), &[x], y, |k| {
            k.p[1] = from;
            k.p[2] = to;
        });
    }

    /// FLOAT in the model, in the type it is computed in.
    fn compute_type(&self, dt: Dt) -> Dt {
        match self.precision {
            Some(p) if dt == Dt::F32 => p,
            _ => dt,
        }
    }

    fn alias(&mut self, node: &Node, x: &Dev, shape: Vec<i64>) {
        self.set(
            node,
            0,
            Val::Dev(Dev {
                dt: x.dt,
                shape,
                ptr: x.ptr.clone(),
            }),
        );
    }

    /// A strided kernel over the index space `dims`.
    #[allow(clippy::too_many_arguments)]
    fn strided(
        &mut self,
        node: &Node,
        k: Kernel,
        dims: &[i64],
        ins: &[(&Dev, Vec<i64>, i64)],
        out: &Ptr,
        ostrides: &[i64],
        ooff: i64,
        set: impl FnOnce(&mut KArgs),
    ) -> Result<()> {
        if dims.len() > 8 {
            return Err(unsupported(
                node,
                format!("rank {} (at most 8)", dims.len()),
            ));
        }
        let mut a = KArgs {
            n: numel(dims),
            rank: dims.len() as i64,
            ooff,
            ..KArgs::default()
        };
        a.dims[..dims.len()].copy_from_slice(dims);
        a.ostrides[..dims.len()].copy_from_slice(ostrides);
        let mut ptrs: [Option<Ptr>; 4] = [None, None, None, None];
        for (i, (d, s, off)) in ins.iter().enumerate() {
            a.strides[i][..dims.len()].copy_from_slice(s);
            a.off[i] = *off;
            ptrs[i] = Some(d.ptr.clone());
        }
        set(&mut a);
        self.push(Step::Kernel {
            k,
            args: Box::new(a),
            ins: ptrs,
            out: out.clone(),
        });
        Ok(())
    }

    /// A launch of `k` with arguments `a` (complete) reading `x` and writing `y`.
    fn launch_one(&mut self, k: Kernel, a: KArgs, x: &Dev, y: &Dev) {
        self.push(Step::Kernel {
            k,
            args: Box::new(a),
            ins: [Some(x.ptr.clone()), None, None, None],
            out: y.ptr.clone(),
        });
    }

    fn kernel(&mut self, k: Kernel, n: i64, ins: &[&Dev], out: &Dev, set: impl FnOnce(&mut KArgs)) {
        let mut a = KArgs {
            n,
            ..KArgs::default()
        };
        set(&mut a);
        let mut ptrs: [Option<Ptr>; 4] = [None, None, None, None];
        for (i, d) in ins.iter().enumerate() {
            ptrs[i] = Some(d.ptr.clone());
        }
        self.push(Step::Kernel {
            k,
            args: Box::new(a),
            ins: ptrs,
            out: out.ptr.clone(),
        });
    }

    /// Plans one node computed on the device, by its operator's family: element-wise
    /// (`elementwise.rs`), data movement (`shape.rs`), reductions (`reduce.rs`), the
    /// operators that multiply (`linear.rs`), Attention (`attention.rs`) and the operators
    /// built from others (`composite.rs`).
    fn device_node(&mut self, node: &Node) -> Result<()> {
        if let Some((op, f)) = elementwise::unary_op(node) {
            return self.unary(node, op, f);
        }
        if let Some(op) = elementwise::binary_op(node) {
            return self.binary(node, op);
        }
        match node.op.as_str() {
            "Identity" | "Dropout" => self.identity(node),
            "Clip" => self.clip(node),
            "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or"
            | "Xor" | "Not" | "IsNaN" | "IsInf" => self.compare(node),
            "BitwiseAnd" | "BitwiseOr" | "BitwiseXor" | "BitShift" | "BitwiseNot" => {
                self.bitwise(node)
            }
            "Cast" | "CastLike" => self.cast_node(node),
            "Where" => self.where_node(node),
            "RotaryEmbedding" => self.rope(node),
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => self.reshape(node),
            "Transpose" => self.transpose_node(node),
            "Expand" => self.expand(node),
            "Slice" => self.slice(node),
            "Split" => self.split(node),
            "Concat" => self.concat(node),
            "Gather" => self.gather(node),
            // (Scatter: ScatterElements before opset 11.)
            "GatherElements" | "ScatterElements" | "Scatter" => self.elements(node),
            "GatherND" | "ScatterND" => self.nd(node),
            "Pad" | "Tile" => self.pad(node),
            "Resize" => self.resize(node),
            "Softmax" | "LogSoftmax" => self.softmax(node),
            "LayerNormalization" => self.norm(node, false),
            "RMSNormalization" => self.norm(node, true),
            "ArgMax" | "ArgMin" if node.int("select_last_index", 0) != 0 => self.arg_last(node),
            "ArgMax" | "ArgMin" => self.arg(node),
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd"
            | "ReduceSumSquare" | "ReduceL2" | "ReduceL1" => self.reduce(node),
            "GlobalAveragePool" | "GlobalMaxPool" => self.global_pool(node),
            "CumSum" => self.cumsum(node),
            "TopK" => self.topk(node),
            "MatMul" => self.matmul(node),
            "Gemm" => self.gemm(node),
            "Conv" => self.conv(node),
            "ConvTranspose" => self.conv_transpose(node),
            "MaxPool" | "AveragePool" => self.pool(node),
            "BatchNormalization" => self.batchnorm(node),
            "Attention" => self.attention(node),
            "Trilu"
            | "Mean"
            | "ReduceLogSum"
            | "ReduceLogSumExp"
            | "LpNormalization"
            | "Hardmax"
            | "InstanceNormalization"
            | "MeanVarianceNormalization"
            | "DepthToSpace"
            | "SpaceToDepth"
            | "OneHot"
            | "EyeLike"
            | "LpPool"
            | "GroupNormalization"
            | "HannWindow"
            | "HammingWindow"
            | "BlackmanWindow"
            | "DequantizeLinear"
            | "QuantizeLinear" => self.composite(node),
            // Computed on the host while planning, from values: inputs computed on the
            // device are asked for (graph inputs among them become value inputs).
            "ConstantOfShape" | "Range" => {
                for n in node.inputs.iter().filter(|n| !n.is_empty()) {
                    if self.host(n).is_none() {
                        return Err(self.want(node, n, "input"));
                    }
                }
                Err(unsupported(node, "these inputs"))
            }
            op => Err(Error::unsupported(format!(
                "{}: operator {op} is not supported by the GPU executor",
                node.label()
            ))),
        }
    }
}

/// Resize's attributes, as far as the executor takes them.
struct ResizeAttrs {
    /// 0 nearest, 1 linear, 2 cubic.
    mode: i64,
    /// 0 round_prefer_floor, 1 round_prefer_ceil, 2 floor, 3 ceil.
    nearest: i64,
    ctm: String,
    /// keep_aspect_ratio_policy (with sizes).
    policy: String,
}

impl ResizeAttrs {
    fn of(node: &Node, opset: i64) -> Result<ResizeAttrs> {
        if opset < 11 {
            return Err(unsupported(node, "Resize before opset 11"));
        }
        let mode = match node.string("mode").as_deref().unwrap_or("nearest") {
            "nearest" => 0,
            "linear" => 1,
            "cubic" => 2,
            other => return Err(unsupported(node, format!("mode {other}"))),
        };
        let nearest = match node
            .string("nearest_mode")
            .as_deref()
            .unwrap_or("round_prefer_floor")
        {
            "round_prefer_floor" => 0,
            "round_prefer_ceil" => 1,
            "floor" => 2,
            "ceil" => 3,
            other => return Err(unsupported(node, format!("nearest_mode {other}"))),
        };
        let ctm = node
            .string("coordinate_transformation_mode")
            .unwrap_or_else(|| "half_pixel".into());
        if !matches!(
            ctm.as_str(),
            "half_pixel"
                | "pytorch_half_pixel"
                | "half_pixel_symmetric"
                | "asymmetric"
                | "align_corners"
                | "tf_crop_and_resize"
        ) {
            return Err(unsupported(
                node,
                format!("coordinate_transformation_mode {ctm}"),
            ));
        }
        if node.int("antialias", 0) != 0 {
            return Err(unsupported(node, "antialias"));
        }
        let policy = node
            .string("keep_aspect_ratio_policy")
            .unwrap_or_else(|| "stretch".into());
        if !matches!(policy.as_str(), "stretch" | "not_larger" | "not_smaller") {
            return Err(unsupported(
                node,
                format!("keep_aspect_ratio_policy {policy}"),
            ));
        }
        Ok(ResizeAttrs {
            mode,
            nearest,
            ctm,
            policy,
        })
    }
}

/// Refuses, when the model loads, attributes and outputs the executor does not support
/// (whatever the input shapes and values: planning may wait for the first batch).
pub fn check_node(node: &Node, opset: i64) -> Result<()> {
    let extra_outputs = node.outputs.len() > 1 && node.outputs[1..].iter().any(|o| !o.is_empty());
    match node.op.as_str() {
        "Resize" => ResizeAttrs::of(node, opset).map(|_| ()),
        "BatchNormalization" if extra_outputs || node.int("training_mode", 0) != 0 => Err(
            unsupported(node, "training mode (running mean and variance outputs)"),
        ),
        "Dropout" if node.outputs.get(1).is_some_and(|m| !m.is_empty()) => {
            host::dropout_is_identity(node, None)
        }
        _ => Ok(()),
    }
}

/// Per-channel scale and shift of an inference BatchNormalization.
pub fn fold_bn(
    gamma: &HostTensor,
    beta: &HostTensor,
    mean: &HostTensor,
    var: &HostTensor,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let scale: Vec<f64> = gamma
        .data
        .iter()
        .zip(&var.data)
        .map(|(g, v)| g / (v + eps).sqrt())
        .collect();
    let shift = beta
        .data
        .iter()
        .zip(&mean.data)
        .zip(&scale)
        .map(|((b, m), s)| b - m * s)
        .collect();
    (scale, shift)
}

/// Folds every BatchNormalization whose input is a Conv with constant weights (and whose
/// Conv output feeds nothing else) into the Conv's weights and bias.
pub fn fold_batchnorm_into_conv(g: &mut Graph) {
    let consts: HashMap<String, Arc<HostTensor>> = g.initializers.iter().cloned().collect();
    let uses = |g: &Graph, name: &str| {
        g.nodes
            .iter()
            .flat_map(|n| &n.inputs)
            .filter(|i| *i == name)
            .count()
            + g.outputs.iter().filter(|o| o.name == name).count()
    };
    let mut added: Vec<(String, Arc<HostTensor>)> = Vec::new();
    let mut remove = Vec::new();
    for bi in 0..g.nodes.len() {
        let bn = &g.nodes[bi];
        if bn.op != "BatchNormalization"
            || bn.outputs.is_empty()
            || bn.outputs.iter().skip(1).any(|o| !o.is_empty())
        {
            continue;
        }
        let Some(ci) = g
            .nodes
            .iter()
            .position(|n| n.op == "Conv" && n.outputs.first() == bn.inputs.first())
        else {
            continue;
        };
        let conv = &g.nodes[ci];
        let params: Option<Vec<&HostTensor>> = (1..5)
            .map(|i| bn.input(i).and_then(|n| consts.get(n).map(|t| &**t)))
            .collect();
        let (Some(params), Some(w)) = (params, conv.input(1).and_then(|n| consts.get(n))) else {
            continue;
        };
        if uses(g, &conv.outputs[0]) != 1 || !matches!(w.dt, Dt::F32 | Dt::F16 | Dt::BF16) {
            continue;
        }
        let eps = bn.float("epsilon", 1e-5) as f64;
        let (scale, shift) = fold_bn(params[0], params[1], params[2], params[3], eps);
        let Some(&k) = w.shape.first() else {
            continue;
        };
        let k = k.max(0) as usize;
        if params.iter().any(|t| t.len() != k) {
            continue;
        }
        if scale.len() != k {
            continue;
        }
        let per = w.data.len() / k.max(1);
        let mut nw = HostTensor::clone(w);
        for (o, s) in scale.iter().enumerate() {
            for v in &mut nw.data[o * per..(o + 1) * per] {
                *v *= s;
            }
        }
        let b0: Vec<f64> = match conv.input(2).and_then(|n| consts.get(n)) {
            Some(b) => b.data.clone(),
            None if conv.input(2).is_none() => vec![0.0; k],
            None => continue,
        };
        let nb: Vec<f64> = b0
            .iter()
            .zip(&scale)
            .zip(&shift)
            .map(|((b, s), t)| b * s + t)
            .collect();
        let base = format!("{}#folded", bn.outputs[0]);
        let (wn, bnm) = (format!("{base}_w"), format!("{base}_b"));
        added.push((wn.clone(), nw.normalize().into()));
        added.push((
            bnm.clone(),
            HostTensor {
                dt: w.dt,
                shape: vec![k as i64],
                data: nb,
            }
            .normalize()
            .into(),
        ));
        let out = bn.outputs[0].clone();
        let conv = &mut g.nodes[ci];
        conv.inputs.resize(3, String::new());
        conv.inputs[1] = wn;
        conv.inputs[2] = bnm;
        conv.outputs[0] = out;
        remove.push(bi);
    }
    for bi in remove.into_iter().rev() {
        g.nodes.remove(bi);
    }
    g.initializers.extend(added);
}
