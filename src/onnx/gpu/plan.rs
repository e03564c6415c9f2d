//! Turning a graph into a plan for given input shapes: every node becomes kernel
//! launches, cuBLAS GEMMs or nothing at all (views and host computations), and every
//! intermediate tensor gets an offset in one device arena, reused once the tensor is dead.

use super::host::{self, broadcast, broadcast_strides, strides, SliceSpec};
use super::kargs::{KArgs, Kernel};
use crate::cuda::cublas::GemmArgs;
use crate::cuda::driver::{Context, DeviceMem};
use crate::onnx::graph::{Dt, Graph, HostTensor, Node};
use crate::status::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Weak};

mod attention;
mod composite;
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
    Host(HostTensor),
    Dev(Dev),
}

struct Temp {
    bytes: u64,
    first: usize,
    last: usize,
}

/// What a plan is for: the type and shape of every graph input (graph input order), and
/// the values of the inputs that the planner reads (see [`Planner::wanted`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    pub inputs: Vec<(Dt, Vec<i64>)>,
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
            self.vals.insert(name.clone(), Val::Host(t.clone()));
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
                    self.vals.insert(io.name.clone(), Val::Host(t));
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
                    converted = HostTensor { dt, ..t.clone() }.normalize();
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
                    self.set(node, i, Val::Host(t));
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
                self.set(node, 0, Val::Host(y));
                return Ok(());
            }
        }
        // Shape and Size need no data.
        if node.op == "Size" {
            let x = self.dev(node.input(0).unwrap_or(""))?;
            self.set(node, 0, Val::Host(HostTensor::scalar_i64(x.numel())));
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
                    self.set(node, i, Val::Host(t));
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

    fn unary(&mut self, node: &Node, op: i64, f: [f32; 4]) -> Result<()> {
        let x = self.x(node, 0)?;
        if x.dt.is_int() {
            let iop = match op {
                10 => 14, // Neg
                11 => 15, // Abs
                23 => 16, // Sign
                1 if x.dt.is_unsigned() => {
                    // Relu of an unsigned integer: itself.
                    self.alias(node, &x, x.shape.clone());
                    return Ok(());
                }
                _ => return Err(unsupported(node, format!("{} tensors", x.dt.name()))),
            };
            let y = self.int_op(node, iop, &x, None, (0, 0))?;
            self.set(node, 0, Val::Dev(y));
            return Ok(());
        }
        let ft = Self::ft(node, &x)?;
        let y = self.temp(x.dt, x.shape.clone());
        let s = strides(&x.shape);
        self.strided(
            node,
            Kernel::Unary,
            &x.shape,
            &[(&x, s.clone(), 0)],
            &y.ptr,
            &s,
            0,
            |a| {
                a.p[0] = op;
                a.f = f;
                a.ft = ft;
            },
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    fn binary_of(&mut self, node: &Node, op: i64, a: &Dev, b: &Dev) -> Result<Dev> {
        if a.dt.is_int() || b.dt.is_int() {
            let iop = match op {
                0..=6 | 8 => op,
                9 => 7, // Mod with the divisor's sign
                _ => return Err(unsupported(node, format!("{} tensors", a.dt.name()))),
            };
            return self.int_op(node, iop, a, Some(b), (0, 0));
        }
        let ft = Self::ft_all(node, &[a, b])?;
        let shape = broadcast(&a.shape, &b.shape).ok_or_else(|| {
            Error::invalid(format!(
                "{}: shapes {:?} and {:?} do not broadcast",
                node.label(),
                a.shape,
                b.shape
            ))
        })?;
        let y = self.temp(a.dt, shape.clone());
        let (sa, sb) = (
            broadcast_strides(&a.shape, &shape),
            broadcast_strides(&b.shape, &shape),
        );
        self.strided(
            node,
            Kernel::Binary,
            &shape,
            &[(a, sa, 0), (b, sb, 0)],
            &y.ptr,
            &strides(&shape),
            0,
            |k| {
                k.p[0] = op;
                k.ft = ft;
            },
        )?;
        Ok(y)
    }

    /// GatherElements and ScatterElements: one strided launch over the indices (a
    /// scatter's output is first a copy of its data).
    fn elements(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let idx = self.x(node, 1)?;
        if !matches!(idx.dt, Dt::I64 | Dt::I32) {
            return Err(unsupported(node, format!("{} indices", idx.dt.name())));
        }
        let r = x.shape.len();
        let a = host::axis(node.int("axis", 0), r, node)?;
        let fits = idx.shape.len() == r
            && idx
                .shape
                .iter()
                .zip(&x.shape)
                .enumerate()
                .all(|(d, (&i, &n))| d == a || i <= n);
        if !fits {
            return Err(Error::invalid(format!(
                "{}: indices {:?} do not fit data {:?} along axis {a}",
                node.label(),
                idx.shape,
                x.shape
            )));
        }
        let xs = strides(&x.shape);
        let mut off_axis = xs.clone();
        off_axis[a] = 0;
        let ity = i64::from(idx.dt == Dt::I32);
        let size = x.dt.size() as i64;
        if node.op == "GatherElements" {
            let y = self.temp(x.dt, idx.shape.clone());
            self.strided(
                node,
                Kernel::GatherElements,
                &idx.shape.clone(),
                &[(&x, off_axis, 0), (&idx, strides(&idx.shape), 0)],
                &y.ptr,
                &strides(&idx.shape),
                0,
                |k| {
                    k.p[..4].copy_from_slice(&[xs[a], x.shape[a], size, ity]);
                },
            )?;
            self.set(node, 0, Val::Dev(y));
            return Ok(());
        }
        let upd = self.x(node, 2)?;
        if upd.shape != idx.shape || upd.dt != x.dt {
            return Err(Error::invalid(format!(
                "{}: updates {} {:?} for indices {:?} into {}",
                node.label(),
                upd.dt.name(),
                upd.shape,
                idx.shape,
                x.dt.name()
            )));
        }
        let (y, red) = self.scatter_target(node, &x)?;
        self.strided(
            node,
            Kernel::ScatterElements,
            &idx.shape.clone(),
            &[
                (&idx, strides(&idx.shape), 0),
                (&upd, strides(&upd.shape), 0),
            ],
            &y.ptr,
            &off_axis,
            0,
            |k| {
                k.p[..6].copy_from_slice(&[xs[a], x.shape[a], size, ity, red, x.dt.cast_code()]);
            },
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// RotaryEmbedding (opset 23): `infer_rope`, one launch.
    fn rope(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let cos = self.x(node, 1)?;
        let sin = self.x(node, 2)?;
        let ft = Self::ft_all(node, &[&x, &cos, &sin])?;
        let bad = |why: String| Error::invalid(format!("{}: {why}", node.label()));
        let (b, s, h, d, bshd) = match x.shape[..] {
            [b, h, s, d] => (b, s, h, d, 0),
            [b, s, hidden] => {
                let h = node.int("num_heads", 0);
                if h <= 0 || hidden % h != 0 {
                    return Err(bad(format!(
                        "a 3-D input of hidden size {hidden} needs num_heads dividing it"
                    )));
                }
                (b, s, h, hidden / h, 1)
            }
            _ => return Err(bad(format!("input {:?} (3-D or 4-D)", x.shape))),
        };
        let rot = match node.int("rotary_embedding_dim", 0) {
            0 => d,
            r => r,
        };
        if rot <= 0 || rot > d || rot % 2 != 0 {
            return Err(bad(format!(
                "rotary_embedding_dim {rot} for a head size of {d}"
            )));
        }
        let half = rot / 2;
        let ids = match node.input(3) {
            Some(_) => Some(self.x(node, 3)?),
            None => None,
        };
        let rows = match &ids {
            Some(p) => {
                if p.dt != Dt::I64 || p.shape != [b, s] {
                    return Err(bad(format!(
                        "position_ids are {} {:?}, not INT64 [{b}, {s}]",
                        p.dt.name(),
                        p.shape
                    )));
                }
                if cos.shape.len() != 2 || cos.shape[1] != half {
                    return Err(bad(format!("cos_cache {:?} (rows, {half})", cos.shape)));
                }
                cos.shape[0]
            }
            None => {
                if cos.shape != [b, s, half] {
                    return Err(bad(format!(
                        "cos_cache {:?} (not [{b}, {s}, {half}])",
                        cos.shape
                    )));
                }
                b * s
            }
        };
        if sin.shape != cos.shape {
            return Err(bad(format!(
                "sin_cache {:?} and cos_cache {:?} differ",
                sin.shape, cos.shape
            )));
        }
        let y = self.temp(x.dt, x.shape.clone());
        let mut k = KArgs {
            n: x.numel(),
            ..KArgs::default()
        };
        let inter = i64::from(node.int("interleaved", 0) != 0);
        k.p[..9].copy_from_slice(&[b, s, h, d, rot, inter, bshd, i64::from(ids.is_some()), rows]);
        k.ft = ft;
        self.push(Step::Kernel {
            k: Kernel::Rope,
            args: Box::new(k),
            ins: [
                Some(x.ptr.clone()),
                Some(cos.ptr.clone()),
                Some(sin.ptr.clone()),
                ids.as_ref().map(|p| p.ptr.clone()),
            ],
            out: y.ptr.clone(),
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// A scatter's output, first a copy of its data `x`, and its reduction's code (0 none,
    /// 1 add, 2 mul, 3 max, 4 min: `infer_scatter_elements` and `infer_nd`).
    fn scatter_target(&mut self, node: &Node, x: &Dev) -> Result<(Dev, i64)> {
        let red = match node.string("reduction").as_deref().unwrap_or("none") {
            "none" => 0,
            "add" => 1,
            "mul" => 2,
            "max" => 3,
            "min" => 4,
            other => return Err(unsupported(node, format!("reduction {other}"))),
        };
        if red != 0 && x.dt == Dt::Bool {
            return Err(unsupported(node, "a reduction of BOOL tensors"));
        }
        let y = self.temp(x.dt, x.shape.clone());
        self.push(Step::Copy {
            dst: y.ptr.clone(),
            src: x.ptr.clone(),
            bytes: (x.numel() * x.dt.size() as i64) as u64,
        });
        Ok((y, red))
    }

    /// GatherND (with `batch_dims`) and ScatterND (with its reductions): `infer_nd`.
    fn nd(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let idx = self.x(node, 1)?;
        if idx.dt != Dt::I64 {
            return Err(unsupported(node, format!("{} indices", idx.dt.name())));
        }
        let gather = node.op == "GatherND";
        let bd = if gather { node.int("batch_dims", 0) } else { 0 } as usize;
        let (r, q) = (x.shape.len(), idx.shape.len());
        let m = idx.shape.last().copied().unwrap_or(0);
        let bad = |why: &str| {
            Error::invalid(format!(
                "{}: data {:?} and indices {:?}: {why}",
                node.label(),
                x.shape,
                idx.shape
            ))
        };
        if q < 1 || bd >= q || bd > r || m < 0 || bd + m as usize > r {
            return Err(bad("the index tuples do not fit the data"));
        }
        if x.shape[..bd] != idx.shape[..bd] {
            return Err(bad("batch dims differ"));
        }
        let m = m as usize;
        if m > 8 {
            return Err(unsupported(
                node,
                format!("index tuples of {m} entries (at most 8)"),
            ));
        }
        let b = numel(&x.shape[..bd]);
        let j = numel(&idx.shape[bd..q - 1]);
        let slice = numel(&x.shape[bd + m..]);
        let per = numel(&x.shape[bd..]);
        let xs = strides(&x.shape);
        let mut k = KArgs::default();
        for t in 0..m {
            k.dims[t] = x.shape[bd + t];
            k.strides[0][t] = xs[bd + t];
        }
        let size = x.dt.size() as i64;
        if gather {
            let mut shape = idx.shape[..q - 1].to_vec();
            shape.extend_from_slice(&x.shape[bd + m..]);
            let y = self.temp(x.dt, shape);
            k.n = b * j * slice;
            k.p[..8].copy_from_slice(&[b, j, m as i64, slice, per, size, 0, x.dt.cast_code()]);
            if k.n > 0 {
                self.push(Step::Kernel {
                    k: Kernel::Nd,
                    args: Box::new(k),
                    ins: [Some(x.ptr.clone()), Some(idx.ptr.clone()), None, None],
                    out: y.ptr.clone(),
                });
            }
            self.set(node, 0, Val::Dev(y));
            return Ok(());
        }
        let upd = self.x(node, 2)?;
        let mut want = idx.shape[..q - 1].to_vec();
        want.extend_from_slice(&x.shape[m..]);
        if upd.shape != want || upd.dt != x.dt {
            return Err(bad(&format!(
                "updates are {} {:?}, not {} {want:?}",
                upd.dt.name(),
                upd.shape,
                x.dt.name()
            )));
        }
        let (y, red) = self.scatter_target(node, &x)?;
        k.n = j * slice;
        k.p[..8].copy_from_slice(&[1, j, m as i64, slice, per, size, 1 + red, x.dt.cast_code()]);
        if k.n > 0 {
            self.push(Step::Kernel {
                k: Kernel::Nd,
                args: Box::new(k),
                ins: [None, Some(idx.ptr.clone()), Some(upd.ptr.clone()), None],
                out: y.ptr.clone(),
            });
        }
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Integer arithmetic (`infer_int`, op codes there) on `a` and, for the binary ops,
    /// `b` broadcast against it; both of one integer type. `clip`: Clip's bounds.
    fn int_op(
        &mut self,
        node: &Node,
        op: i64,
        a: &Dev,
        b: Option<&Dev>,
        clip: (i64, i64),
    ) -> Result<Dev> {
        if !a.dt.is_int() || b.is_some_and(|b| b.dt != a.dt) {
            return Err(match b {
                Some(b) if a.dt.is_int() || b.dt.is_int() => Error::invalid(format!(
                    "{}: operands of types {} and {}",
                    node.label(),
                    a.dt.name(),
                    b.dt.name()
                )),
                _ => unsupported(node, format!("{} tensors", a.dt.name())),
            });
        }
        let shape = match b {
            Some(b) => broadcast(&a.shape, &b.shape).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: shapes {:?} and {:?} do not broadcast",
                    node.label(),
                    a.shape,
                    b.shape
                ))
            })?,
            None => a.shape.clone(),
        };
        let y = self.temp(a.dt, shape.clone());
        let mut ins = vec![(a, broadcast_strides(&a.shape, &shape), 0)];
        if let Some(b) = b {
            ins.push((b, broadcast_strides(&b.shape, &shape), 0));
        }
        let (code, uns) = (a.dt.cast_code(), i64::from(a.dt.is_unsigned()));
        self.strided(
            node,
            Kernel::Int,
            &shape,
            &ins,
            &y.ptr,
            &strides(&shape),
            0,
            |k| {
                k.p[0] = op;
                k.p[1] = code;
                k.p[2] = uns;
                k.p[3] = clip.0;
                k.p[4] = clip.1;
            },
        )?;
        Ok(y)
    }

    /// Pad (constant, reflect, edge, wrap; negative pads crop) and Tile (a wrap with
    /// nothing before), through `infer_pad`.
    fn pad(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let r = x.shape.len();
        let opset = self.graph.opset;
        let (mut before, mut after) = (vec![0i64; r], vec![0i64; r]);
        let (mode, bits) = if node.op == "Tile" {
            let reps = self
                .host_input(node, 1)?
                .ok_or_else(|| Error::invalid(format!("{}: no repeats", node.label())))?;
            if reps.len() != r || reps.iter().any(|&v| v < 0) {
                return Err(Error::invalid(format!(
                    "{}: repeats {reps:?} for an input of rank {r}",
                    node.label()
                )));
            }
            for d in 0..r {
                after[d] = x.shape[d] * (reps[d] - 1);
            }
            (3, 0u64)
        } else {
            let mode = match node.string("mode").as_deref().unwrap_or("constant") {
                "constant" => 0,
                "reflect" => 1,
                "edge" => 2,
                "wrap" => 3,
                other => return Err(unsupported(node, format!("mode {other}"))),
            };
            let pads = if opset >= 11 {
                self.host_input(node, 1)?
            } else {
                node.ints("pads")
            }
            .unwrap_or_default();
            let axes: Vec<usize> = match if opset >= 18 {
                self.host_input(node, 3)?
            } else {
                None
            } {
                Some(a) => a
                    .iter()
                    .map(|&v| host::axis(v, r, node))
                    .collect::<Result<_>>()?,
                None => (0..r).collect(),
            };
            if pads.len() != 2 * axes.len() {
                return Err(Error::invalid(format!(
                    "{}: {} pads for {} axes",
                    node.label(),
                    pads.len(),
                    axes.len()
                )));
            }
            for (i, &a) in axes.iter().enumerate() {
                before[a] = pads[i];
                after[a] = pads[axes.len() + i];
            }
            // The constant, in the input's type.
            let value = if opset >= 11 {
                match node.input(2) {
                    Some(n) => match self.host(n) {
                        Some(t) => t.data.first().copied().unwrap_or(0.0),
                        None => return Err(self.want(node, n, "constant_value")),
                    },
                    None => 0.0,
                }
            } else {
                node.float("value", 0.0) as f64
            };
            let one = HostTensor {
                dt: x.dt,
                shape: Vec::new(),
                data: vec![value],
            }
            .normalize()
            .to_bytes();
            let mut b = [0u8; 8];
            b[..one.len().min(8)].copy_from_slice(&one[..one.len().min(8)]);
            (mode, u64::from_le_bytes(b))
        };
        let shape: Vec<i64> = (0..r).map(|d| x.shape[d] + before[d] + after[d]).collect();
        if shape.iter().any(|&d| d < 0) {
            return Err(Error::invalid(format!(
                "{}: pads crop more than the input {:?} has",
                node.label(),
                x.shape
            )));
        }
        if mode != 0 && x.shape.contains(&0) && numel(&shape) > 0 {
            return Err(Error::invalid(format!(
                "{}: an empty input {:?} cannot be padded by {} mode",
                node.label(),
                x.shape,
                node.string("mode").unwrap_or_default()
            )));
        }
        if r > 8 {
            return Err(unsupported(node, format!("rank {r} (at most 8)")));
        }
        let y = self.temp(x.dt, shape.clone());
        let xs = strides(&x.shape);
        let size = x.dt.size() as i64;
        let mut a = KArgs {
            n: numel(&shape),
            rank: r as i64,
            ..KArgs::default()
        };
        a.dims[..r].copy_from_slice(&shape);
        a.strides[0][..r].copy_from_slice(&xs);
        a.strides[1][..r].copy_from_slice(&x.shape);
        a.strides[2][..r].copy_from_slice(&before);
        a.p[0] = mode;
        a.p[1] = size;
        a.p[2] = bits as i64;
        self.launch_one(Kernel::Pad, a, &x, &y);
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Resize (opset 11+), nearest and n-linear, for every coordinate transformation,
    /// from scales or sizes (over `axes`, opset 18).
    fn resize(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let ft = Self::ft(node, &x)?;
        let r = x.shape.len();
        let at = ResizeAttrs::of(node, self.graph.opset)?;
        let axes: Vec<usize> = match node.ints("axes") {
            Some(a) => a
                .iter()
                .map(|&v| host::axis(v, r, node))
                .collect::<Result<_>>()?,
            None => (0..r).collect(),
        };
        let mut floats = |i: usize| -> Result<Option<Vec<f64>>> {
            match node.input(i) {
                None => Ok(None),
                Some(n) => match self.host(n) {
                    Some(t) if t.is_empty() => Ok(None),
                    Some(t) => Ok(Some(t.data.clone())),
                    None => Err(self.want(node, n, "input")),
                },
            }
        };
        let (roi, scales, sizes) = (floats(1)?, floats(2)?, floats(3)?);
        let mut scale = vec![1.0f64; r];
        let mut sizes_given = false;
        let mut out = x.shape.clone();
        match (scales, sizes) {
            (Some(s), None) if s.len() == axes.len() => {
                for (&a, &v) in axes.iter().zip(&s) {
                    if !(v > 0.0 && v.is_finite()) {
                        return Err(Error::invalid(format!("{}: scale {v}", node.label())));
                    }
                    scale[a] = v;
                    out[a] = (x.shape[a] as f64 * v).floor() as i64;
                }
            }
            (None, Some(z)) if z.len() == axes.len() => {
                sizes_given = true;
                // not_larger / not_smaller: one scale for every axis, the smallest or the
                // largest of theirs, and sizes rounded from it (halves to even).
                let one = match at.policy.as_str() {
                    "not_larger" => axes
                        .iter()
                        .zip(&z)
                        .map(|(&a, &v)| v / x.shape[a].max(1) as f64)
                        .reduce(f64::min),
                    "not_smaller" => axes
                        .iter()
                        .zip(&z)
                        .map(|(&a, &v)| v / x.shape[a].max(1) as f64)
                        .reduce(f64::max),
                    _ => None,
                };
                for (&a, &v) in axes.iter().zip(&z) {
                    match one {
                        Some(s) => {
                            out[a] = (s * x.shape[a] as f64).round_ties_even() as i64;
                            scale[a] = s;
                        }
                        None => {
                            out[a] = v as i64;
                            scale[a] = v / x.shape[a].max(1) as f64;
                        }
                    }
                }
            }
            _ => {
                return Err(Error::invalid(format!(
                    "{}: one of scales and sizes, with one value per axis ({} axes), is needed",
                    node.label(),
                    axes.len()
                )))
            }
        }
        if out.iter().any(|&d| d <= 0) || x.shape.iter().any(|&d| d <= 0) {
            return Err(Error::invalid(format!(
                "{}: resizing {:?} to {out:?}",
                node.label(),
                x.shape
            )));
        }
        if r > 8 {
            return Err(unsupported(node, format!("rank {r} (at most 8)")));
        }
        // tf_crop_and_resize: the region of interest per dim (start, end), normalized.
        let mut region = vec![(0.0f64, 1.0f64); r];
        if at.ctm == "tf_crop_and_resize" {
            let roi = roi.unwrap_or_default();
            if roi.iter().any(|v| !v.is_finite()) {
                return Err(Error::invalid(format!("{}: roi {roi:?}", node.label())));
            }
            if roi.len() != 2 * axes.len() {
                return Err(Error::invalid(format!(
                    "{}: roi has {} values; tf_crop_and_resize needs {} (start and end per axis)",
                    node.label(),
                    roi.len(),
                    2 * axes.len()
                )));
            }
            for (i, &a) in axes.iter().enumerate() {
                region[a] = (roi[i], roi[axes.len() + i]);
            }
        }
        let mut a = KArgs {
            n: numel(&out),
            rank: r as i64,
            ..KArgs::default()
        };
        let xs = strides(&x.shape);
        // Output coordinate x maps to the input coordinate (x + P) * M / S + Q, evaluated
        // in that order as ONNX's reference does (so ties in nearest rounding agree).
        let half = matches!(
            at.ctm.as_str(),
            "half_pixel" | "pytorch_half_pixel" | "half_pixel_symmetric"
        );
        for d in 0..r {
            let (len, o, s) = (x.shape[d], out[d], scale[d]);
            let (lf, of) = (len as f64, o as f64);
            let (m, sd, q) = match at.ctm.as_str() {
                "half_pixel" => (1.0, s, -0.5),
                "pytorch_half_pixel" if o > 1 => (1.0, s, -0.5),
                "pytorch_half_pixel" => (0.0, 1.0, 0.0),
                "half_pixel_symmetric" => {
                    let adjustment = of / (lf * s);
                    let offset = lf / 2.0 * (1.0 - adjustment);
                    (1.0, s, offset - 0.5)
                }
                "asymmetric" => (1.0, s, 0.0),
                // With scales, ONNX takes the unrounded output length here.
                "align_corners" => {
                    let lr = if sizes_given { of } else { lf * s };
                    if o > 1 {
                        (lf - 1.0, lr - 1.0, 0.0)
                    } else {
                        (0.0, 1.0, 0.0)
                    }
                }
                _ => {
                    let (st, en) = region[d];
                    if o > 1 {
                        ((en - st) * (lf - 1.0), of - 1.0, st * (lf - 1.0))
                    } else {
                        (0.0, 1.0, 0.5 * (st + en) * (lf - 1.0))
                    }
                }
            };
            a.dims[d] = o;
            a.strides[0][d] = xs[d];
            a.strides[1][d] = len;
            a.strides[2][d] = m.to_bits() as i64;
            a.strides[3][d] = sd.to_bits() as i64;
            a.ostrides[d] = q.to_bits() as i64;
        }
        a.p[2] = if half { 0.5f64 } else { 0.0 }.to_bits() as i64;
        if at.ctm == "tf_crop_and_resize" {
            a.p[3] = 1;
            a.f[0] = node.float("extrapolation_value", 0.0);
        }
        if at.mode == 2 {
            a.f[1] = node.float("cubic_coeff_a", -0.75);
            a.p[5] = i64::from(node.int("exclude_outside", 0) != 0);
        }
        let (mode, nearest) = (at.mode, at.nearest);
        a.p[0] = mode;
        a.p[1] = nearest;
        a.ft = ft;
        let y = self.temp(x.dt, out);
        self.launch_one(Kernel::Resize, a, &x, &y);
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Comparisons and logic into BOOL (`infer_compare`).
    fn compare(&mut self, node: &Node) -> Result<()> {
        let op = match node.op.as_str() {
            "Equal" => 0,
            "Less" => 1,
            "Greater" => 2,
            "LessOrEqual" => 3,
            "GreaterOrEqual" => 4,
            "And" => 5,
            "Or" => 6,
            "Xor" => 7,
            "Not" => 8,
            "IsNaN" => 9,
            _ => 10,
        };
        let a = self.x(node, 0)?;
        let ins = if op >= 8 {
            vec![a]
        } else {
            vec![a, self.x(node, 1)?]
        };
        for d in &ins {
            let ok = match op {
                5..=8 => d.dt == Dt::Bool,
                9 | 10 => d.dt.is_float(),
                _ => true,
            };
            if !ok {
                return Err(Error::invalid(format!(
                    "{}: an input of type {}",
                    node.label(),
                    d.dt.name()
                )));
            }
        }
        let shape = match ins.as_slice() {
            [x, y] => broadcast(&x.shape, &y.shape).ok_or_else(|| {
                Error::invalid(format!(
                    "{}: shapes {:?} and {:?} do not broadcast",
                    node.label(),
                    x.shape,
                    y.shape
                ))
            })?,
            _ => ins[0].shape.clone(),
        };
        let y = self.temp(Dt::Bool, shape.clone());
        let codes: Vec<i64> = ins.iter().map(|d| d.dt.cast_code()).collect();
        let spec: Vec<(&Dev, Vec<i64>, i64)> = ins
            .iter()
            .map(|d| (d, broadcast_strides(&d.shape, &shape), 0))
            .collect();
        let (pos, neg) = (
            node.int("detect_positive", 1) != 0,
            node.int("detect_negative", 1) != 0,
        );
        self.strided(
            node,
            Kernel::Compare,
            &shape,
            &spec,
            &y.ptr,
            &strides(&shape),
            0,
            |k| {
                k.p[0] = op;
                k.p[1] = codes[0];
                k.p[2] = codes.get(1).copied().unwrap_or(0);
                k.p[3] = i64::from(pos);
                k.p[4] = i64::from(neg);
            },
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    fn binary(&mut self, node: &Node, op: i64) -> Result<()> {
        let mut acc = self.x(node, 0)?;
        for i in 1..node.inputs.len() {
            let b = self.x(node, i)?;
            acc = self.binary_of(node, op, &acc, &b)?;
        }
        self.set(node, 0, Val::Dev(acc));
        Ok(())
    }

    /// A contiguous copy of `x` read through `strides`/`off` over `dims`.
    fn gather_view(
        &mut self,
        node: &Node,
        x: &Dev,
        dims: Vec<i64>,
        st: Vec<i64>,
        off: i64,
    ) -> Result<Dev> {
        let y = self.temp(x.dt, dims.clone());
        let os = strides(&dims);
        let size = x.dt.size() as i64;
        self.strided(
            node,
            Kernel::StridedCopy,
            &dims,
            &[(x, st, off)],
            &y.ptr,
            &os,
            0,
            |a| {
                a.p[1] = size;
            },
        )?;
        Ok(y)
    }

    fn transpose(&mut self, node: &Node, x: &Dev, perm: &[usize]) -> Result<Dev> {
        let xs = strides(&x.shape);
        let dims: Vec<i64> = perm.iter().map(|&p| x.shape[p]).collect();
        let st: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
        self.gather_view(node, x, dims, st, 0)
    }

    fn device_node(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
        match node.op.as_str() {
            "Identity" | "Dropout" => {
                if node.op == "Dropout" {
                    let training = node.input(2).and_then(|n| self.host(n));
                    host::dropout_is_identity(node, training)?;
                }
                let x = self.x(node, 0)?;
                let shape = x.shape.clone();
                self.alias(node, &x, shape);
                Ok(())
            }
            "Relu" => self.unary(node, 1, [0.0; 4]),
            "Sigmoid" => self.unary(node, 2, [0.0; 4]),
            "Tanh" => self.unary(node, 3, [0.0; 4]),
            "Erf" => self.unary(node, 4, [0.0; 4]),
            "Gelu" => {
                let tanh = node.string("approximate").as_deref() == Some("tanh");
                self.unary(node, if tanh { 6 } else { 5 }, [0.0; 4])
            }
            "Exp" => self.unary(node, 7, [0.0; 4]),
            "Log" => self.unary(node, 8, [0.0; 4]),
            "Sqrt" => self.unary(node, 9, [0.0; 4]),
            "Neg" => self.unary(node, 10, [0.0; 4]),
            "Abs" => self.unary(node, 11, [0.0; 4]),
            "Reciprocal" => self.unary(node, 12, [0.0; 4]),
            "LeakyRelu" => self.unary(node, 13, [node.float("alpha", 0.01), 0.0, 0.0, 0.0]),
            "Clip" => {
                let (mut lo, mut hi) = (f32::MIN, f32::MAX);
                if opset >= 11 {
                    let device_bounds = [1, 2]
                        .iter()
                        .any(|&i| node.input(i).is_some_and(|n| self.host(n).is_none()));
                    if device_bounds {
                        // Bounds computed on the device: max with min, then min with max.
                        let mut y = self.x(node, 0)?;
                        if node.input(1).is_some() {
                            let b = self.x(node, 1)?;
                            y = self.binary_of(node, 5, &y, &b)?;
                        }
                        if node.input(2).is_some() {
                            let b = self.x(node, 2)?;
                            y = self.binary_of(node, 6, &y, &b)?;
                        }
                        self.set(node, 0, Val::Dev(y));
                        return Ok(());
                    }
                    let x = self.x(node, 0)?;
                    if x.dt.is_int() {
                        // Integer bounds, exactly (unsigned ones as their bits).
                        let mut b = if x.dt.is_unsigned() {
                            [0, -1]
                        } else {
                            [i64::MIN, i64::MAX]
                        };
                        for (i, v) in [1, 2].into_iter().zip(b.iter_mut()) {
                            if let Some(t) = node.input(i).and_then(|n| self.host(n)) {
                                *v = t.data.first().map_or(*v, |&f| {
                                    if t.dt.is_unsigned() {
                                        f as u64 as i64
                                    } else {
                                        f as i64
                                    }
                                });
                            }
                        }
                        let y = self.int_op(node, 18, &x, None, (b[0], b[1]))?;
                        self.set(node, 0, Val::Dev(y));
                        return Ok(());
                    }
                    for (i, v) in [(1, &mut lo), (2, &mut hi)] {
                        if let Some(n) = node.input(i) {
                            *v = match self.host(n) {
                                Some(t) => t.data.first().copied().unwrap_or(0.0) as f32,
                                None => return Err(self.want(node, n, "bound")),
                            };
                        }
                    }
                } else {
                    lo = node.float("min", lo);
                    hi = node.float("max", hi);
                }
                self.unary(node, 14, [lo, hi, 0.0, 0.0])
            }
            "Floor" => self.unary(node, 15, [0.0; 4]),
            "Round" => self.unary(node, 22, [0.0; 4]),
            "Sign" => self.unary(node, 23, [0.0; 4]),
            "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or"
            | "Xor" | "Not" | "IsNaN" | "IsInf" => self.compare(node),
            // Floats: fmod = 1 keeps the dividend's sign, 0 the divisor's (as numpy).
            "Mod" => self.binary(node, if node.int("fmod", 0) != 0 { 8 } else { 9 }),
            "BitwiseAnd" | "BitwiseOr" | "BitwiseXor" | "BitShift" | "BitwiseNot" => {
                let op = match node.op.as_str() {
                    "BitwiseAnd" => 9,
                    "BitwiseOr" => 10,
                    "BitwiseXor" => 11,
                    "BitwiseNot" => 17,
                    _ => match node.string("direction").as_deref() {
                        Some("LEFT") => 12,
                        Some("RIGHT") => 13,
                        other => {
                            return Err(Error::invalid(format!(
                                "{}: direction {other:?} (LEFT or RIGHT)",
                                node.label()
                            )))
                        }
                    },
                };
                let x = self.x(node, 0)?;
                let b = if op == 17 {
                    None
                } else {
                    Some(self.x(node, 1)?)
                };
                let y = self.int_op(node, op, &x, b.as_ref(), (0, 0))?;
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Ceil" => self.unary(node, 16, [0.0; 4]),
            "Sin" => self.unary(node, 17, [0.0; 4]),
            "Tan" => self.unary(node, 24, [0.0; 4]),
            "Asin" => self.unary(node, 25, [0.0; 4]),
            "Acos" => self.unary(node, 26, [0.0; 4]),
            "Atan" => self.unary(node, 27, [0.0; 4]),
            "Sinh" => self.unary(node, 28, [0.0; 4]),
            "Cosh" => self.unary(node, 29, [0.0; 4]),
            "Asinh" => self.unary(node, 30, [0.0; 4]),
            "Acosh" => self.unary(node, 31, [0.0; 4]),
            "Atanh" => self.unary(node, 32, [0.0; 4]),
            "Softsign" => self.unary(node, 33, [0.0; 4]),
            "Selu" => self.unary(
                node,
                34,
                [
                    node.float("alpha", 1.673_263_2),
                    node.float("gamma", 1.050_701),
                    0.0,
                    0.0,
                ],
            ),
            "ThresholdedRelu" => self.unary(node, 35, [node.float("alpha", 1.0), 0.0, 0.0, 0.0]),
            "Shrink" => self.unary(
                node,
                36,
                [node.float("bias", 0.0), node.float("lambd", 0.5), 0.0, 0.0],
            ),
            "Mish" => self.unary(node, 37, [0.0; 4]),
            "HardSwish" => self.unary(node, 38, [0.0; 4]),
            "Celu" => self.unary(node, 39, [node.float("alpha", 1.0), 0.0, 0.0, 0.0]),
            "Swish" => self.unary(node, 40, [node.float("alpha", 1.0), 0.0, 0.0, 0.0]),
            "Cos" => self.unary(node, 18, [0.0; 4]),
            "Softplus" => self.unary(node, 19, [0.0; 4]),
            "HardSigmoid" => self.unary(
                node,
                20,
                [node.float("alpha", 0.2), node.float("beta", 0.5), 0.0, 0.0],
            ),
            "Elu" => self.unary(node, 21, [node.float("alpha", 1.0), 0.0, 0.0, 0.0]),
            "Add" | "Sum" => self.binary(node, 0),
            "Sub" => self.binary(node, 1),
            "Mul" => self.binary(node, 2),
            "Div" => self.binary(node, 3),
            "Pow" => self.binary(node, 4),
            "Max" => self.binary(node, 5),
            "Min" => self.binary(node, 6),
            "PRelu" => self.binary(node, 7),
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => {
                let x = self.x(node, 0)?;
                let shape = match node.op.as_str() {
                    "Reshape" => {
                        let target = self
                            .host_input(node, 1)?
                            .ok_or_else(|| Error::invalid(format!("{}: no shape", node.label())))?;
                        host::reshape_shape(node, &x.shape, &target)?
                    }
                    "Flatten" => {
                        let a = host::flatten_axis(node, x.shape.len())?;
                        let outer = numel(&x.shape[..a]);
                        vec![outer, numel(&x.shape) / outer.max(1)]
                    }
                    _ => {
                        let axes = if opset >= 13 {
                            self.host_input(node, 1)?
                        } else {
                            node.ints("axes")
                        };
                        host::squeeze_shape(node, &x.shape, axes.as_deref())?
                    }
                };
                self.alias(node, &x, shape);
                Ok(())
            }
            "Transpose" => {
                let x = self.x(node, 0)?;
                let r = x.shape.len();
                let perm: Vec<usize> = match node.ints("perm") {
                    Some(p) => p
                        .iter()
                        .map(|&a| host::axis(a, r, node))
                        .collect::<Result<_>>()?,
                    None => (0..r).rev().collect(),
                };
                let mut seen = perm.clone();
                seen.sort_unstable();
                if seen != (0..r).collect::<Vec<_>>() {
                    return Err(Error::invalid(format!(
                        "{}: perm {perm:?} is not a permutation of the {r} axes",
                        node.label()
                    )));
                }
                let y = self.transpose(node, &x, &perm)?;
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Expand" => {
                let x = self.x(node, 0)?;
                let target = self.host_input(node, 1)?.unwrap_or_default();
                let shape = broadcast(&x.shape, &target).ok_or_else(|| {
                    Error::invalid(format!(
                        "{}: cannot expand {:?} to {target:?}",
                        node.label(),
                        x.shape
                    ))
                })?;
                let st = broadcast_strides(&x.shape, &shape);
                let y = self.gather_view(node, &x, shape, st, 0)?;
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Slice" => {
                let x = self.x(node, 0)?;
                let (starts, ends) = if opset >= 10 {
                    (self.host_input(node, 1)?, self.host_input(node, 2)?)
                } else {
                    (node.ints("starts"), node.ints("ends"))
                };
                let (axes, steps) = if opset >= 10 {
                    (self.host_input(node, 3)?, self.host_input(node, 4)?)
                } else {
                    (node.ints("axes"), None)
                };
                let spec = SliceSpec::new(
                    node,
                    &x.shape,
                    &starts.unwrap_or_default(),
                    &ends.unwrap_or_default(),
                    axes,
                    steps,
                )?;
                let xs = strides(&x.shape);
                let off: i64 = (0..xs.len()).map(|d| spec.start[d] * xs[d]).sum();
                let st: Vec<i64> = (0..xs.len()).map(|d| xs[d] * spec.step[d]).collect();
                let y = self.gather_view(node, &x, spec.out_shape(), st, off)?;
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Split" => {
                let x = self.x(node, 0)?;
                let a = host::axis(node.int("axis", 0), x.shape.len(), node)?;
                let n = x.shape[a];
                let outs = node.outputs.len() as i64;
                let sizes = match if opset >= 13 {
                    self.host_input(node, 1)?
                } else {
                    node.ints("split")
                } {
                    Some(v) if !v.is_empty() => v,
                    _ => {
                        // Equal parts (the last smaller when uneven, opset 18's num_outputs).
                        let parts = node.int("num_outputs", outs).max(1);
                        let each = (n + parts - 1) / parts;
                        (0..parts).map(|i| each.min(n - i * each).max(0)).collect()
                    }
                };
                if sizes.len() as i64 != outs || sizes.iter().sum::<i64>() != n {
                    return Err(Error::invalid(format!(
                        "{}: split sizes {sizes:?} do not divide a dim of {n} into {outs} outputs",
                        node.label()
                    )));
                }
                let xs = strides(&x.shape);
                let mut start = 0i64;
                for (i, len) in sizes.iter().enumerate() {
                    let mut dims = x.shape.clone();
                    dims[a] = *len;
                    let y = self.gather_view(node, &x, dims, xs.clone(), start * xs[a])?;
                    self.set(node, i, Val::Dev(y));
                    start += len;
                }
                Ok(())
            }
            "Concat" => {
                let parts: Vec<Dev> = (0..node.inputs.len())
                    .map(|i| self.x(node, i))
                    .collect::<Result<_>>()?;
                let Some(first) = parts.first() else {
                    return Err(Error::invalid(format!("{}: no inputs", node.label())));
                };
                let a = host::axis(node.int("axis", 0), first.shape.len(), node)?;
                let shapes: Vec<&[i64]> = parts.iter().map(|p| &p.shape[..]).collect();
                host::check_concat(node, a, &shapes)?;
                let mut shape = first.shape.clone();
                shape[a] = parts.iter().map(|p| p.shape[a]).sum();
                let y = self.temp(first.dt, shape.clone());
                let ys = strides(&shape);
                let mut at = 0i64;
                for p in &parts {
                    if p.dt != first.dt {
                        return Err(Error::invalid(format!(
                            "{}: inputs differ in type",
                            node.label()
                        )));
                    }
                    let size = p.dt.size() as i64;
                    self.strided(
                        node,
                        Kernel::StridedCopy,
                        &p.shape,
                        &[(p, strides(&p.shape), 0)],
                        &y.ptr,
                        &ys,
                        at * ys[a],
                        |k| k.p[1] = size,
                    )?;
                    at += p.shape[a];
                }
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Gather" => {
                let x = self.x(node, 0)?;
                let idx = self.x(node, 1)?;
                if !matches!(idx.dt, Dt::I64 | Dt::I32) {
                    return Err(unsupported(node, format!("{} indices", idx.dt.name())));
                }
                let a = host::axis(node.int("axis", 0), x.shape.len(), node)?;
                let mut shape = x.shape[..a].to_vec();
                shape.extend_from_slice(&idx.shape);
                shape.extend_from_slice(&x.shape[a + 1..]);
                let y = self.temp(x.dt, shape.clone());
                let (outer, n, ni, inner) = (
                    numel(&x.shape[..a]),
                    x.shape[a],
                    numel(&idx.shape),
                    numel(&x.shape[a + 1..]),
                );
                let (size, ity) = (x.dt.size() as i64, i64::from(idx.dt == Dt::I32));
                self.kernel(Kernel::Gather, numel(&shape), &[&x, &idx], &y, |k| {
                    k.p[..6].copy_from_slice(&[outer, n, ni, inner, size, ity]);
                });
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "CumSum" => {
                let x = self.x(node, 0)?;
                if x.dt == Dt::Bool {
                    return Err(unsupported(node, "BOOL tensors"));
                }
                let r = x.shape.len();
                let a = match self.host_input(node, 1)?.and_then(|v| v.first().copied()) {
                    Some(v) => host::axis(v, r, node)?,
                    None => {
                        return Err(Error::invalid(format!(
                            "{}: the axis input is missing",
                            node.label()
                        )))
                    }
                };
                let (len, inner) = (x.shape[a], numel(&x.shape[a + 1..]));
                let y = self.temp(x.dt, x.shape.clone());
                let (excl, rev, code) = (
                    i64::from(node.int("exclusive", 0) != 0),
                    i64::from(node.int("reverse", 0) != 0),
                    x.dt.cast_code(),
                );
                self.kernel(
                    Kernel::CumSum,
                    numel(&x.shape[..a]) * inner,
                    &[&x],
                    &y,
                    |k| {
                        k.p[..5].copy_from_slice(&[len, inner, excl, rev, code]);
                    },
                );
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            // (Scatter: ScatterElements before opset 11.)
            "TopK" => {
                let x = self.x(node, 0)?;
                if x.dt == Dt::Bool {
                    return Err(unsupported(node, "BOOL tensors"));
                }
                let r = x.shape.len();
                let a = host::axis(node.int("axis", -1), r, node)?;
                let k = if opset >= 10 {
                    self.host_input(node, 1)?.and_then(|v| v.first().copied())
                } else {
                    Some(node.int("k", 0))
                };
                let len = x.shape[a];
                let k = match k {
                    Some(k) if (0..=len).contains(&k) => k,
                    other => {
                        return Err(Error::invalid(format!(
                            "{}: k = {other:?} for an axis of {len}",
                            node.label()
                        )))
                    }
                };
                let mut shape = x.shape.clone();
                shape[a] = k;
                let values = self.temp(x.dt, shape.clone());
                let indices = self.temp(Dt::I64, shape);
                let inner = numel(&x.shape[a + 1..]);
                let mut args = KArgs {
                    n: numel(&x.shape[..a]) * inner,
                    ..KArgs::default()
                };
                let largest = i64::from(node.int("largest", 1) != 0);
                args.p[..5].copy_from_slice(&[len, inner, k, largest, x.dt.cast_code()]);
                if k > 0 {
                    self.push(Step::Kernel {
                        k: Kernel::TopK,
                        args: Box::new(args),
                        ins: [Some(x.ptr.clone()), None, None, Some(indices.ptr.clone())],
                        out: values.ptr.clone(),
                    });
                }
                self.set(node, 0, Val::Dev(values));
                self.set(node, 1, Val::Dev(indices));
                Ok(())
            }
            "GatherElements" | "ScatterElements" | "Scatter" => self.elements(node),
            "GatherND" | "ScatterND" => self.nd(node),
            "RotaryEmbedding" => self.rope(node),
            "Cast" | "CastLike" => {
                let x = self.x(node, 0)?;
                let to = if node.op == "CastLike" {
                    self.x(node, 1)?.dt
                } else {
                    let to = Dt::from_onnx(node.int("to", 1) as i32)
                        .ok_or_else(|| unsupported(node, "this target type"))?;
                    self.compute_type(to)
                };
                if to == x.dt {
                    let shape = x.shape.clone();
                    self.alias(node, &x, shape);
                    return Ok(());
                }
                let y = self.temp(to, x.shape.clone());
                self.cast(&x, &y);
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Where" => {
                let c = self.x(node, 0)?;
                let a = self.x(node, 1)?;
                let b = self.x(node, 2)?;
                if c.dt != Dt::Bool || a.dt != b.dt {
                    return Err(Error::invalid(format!(
                        "{}: a BOOL condition and two inputs of one type are needed, got {}, {} and {}",
                        node.label(),
                        c.dt.name(),
                        a.dt.name(),
                        b.dt.name()
                    )));
                }
                let shape = broadcast(&c.shape, &a.shape)
                    .and_then(|s| broadcast(&s, &b.shape))
                    .ok_or_else(|| {
                        Error::invalid(format!("{}: shapes do not broadcast", node.label()))
                    })?;
                let y = self.temp(a.dt, shape.clone());
                let size = a.dt.size() as i64;
                let ins = [
                    (&c, broadcast_strides(&c.shape, &shape), 0),
                    (&a, broadcast_strides(&a.shape, &shape), 0),
                    (&b, broadcast_strides(&b.shape, &shape), 0),
                ];
                self.strided(
                    node,
                    Kernel::Where,
                    &shape,
                    &ins,
                    &y.ptr,
                    &strides(&shape),
                    0,
                    |k| k.p[1] = size,
                )?;
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Softmax" | "LogSoftmax" => {
                let x = self.x(node, 0)?;
                let ft = Self::ft(node, &x)?;
                let r = x.shape.len();
                let log = i64::from(node.op == "LogSoftmax");
                if opset < 13 {
                    let a = host::axis(node.int("axis", 1), r, node)?;
                    let cols = numel(&x.shape[a..]);
                    let y = self.temp(x.dt, x.shape.clone());
                    self.kernel(Kernel::Softmax, numel(&x.shape[..a]), &[&x], &y, |k| {
                        k.p[0] = cols;
                        k.p[1] = log;
                        k.ft = ft;
                    });
                    self.set(node, 0, Val::Dev(y));
                    return Ok(());
                }
                let a = host::axis(node.int("axis", -1), r, node)?;
                let (src, perm) = if a + 1 == r {
                    (x.clone(), None)
                } else {
                    let mut perm: Vec<usize> = (0..r).collect();
                    perm.swap(a, r - 1);
                    (self.transpose(node, &x, &perm)?, Some(perm))
                };
                let cols = *src.shape.last().unwrap_or(&1);
                let y = self.temp(x.dt, src.shape.clone());
                self.kernel(
                    Kernel::Softmax,
                    src.numel() / cols.max(1),
                    &[&src],
                    &y,
                    |k| {
                        k.p[0] = cols;
                        k.p[1] = log;
                        k.ft = ft;
                    },
                );
                let y = match perm {
                    Some(p) => self.transpose(node, &y, &p)?,
                    None => y,
                };
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "LayerNormalization" => self.norm(node, false),
            "RMSNormalization" => self.norm(node, true),
            "ArgMax" | "ArgMin" if node.int("select_last_index", 0) != 0 => self.arg_last(node),
            "ArgMax" | "ArgMin" => {
                let x = self.x(node, 0)?;
                let ft = Self::ft(node, &x)?;
                let a = host::axis(node.int("axis", 0), x.shape.len(), node)?;
                let mut shape = x.shape.clone();
                if node.int("keepdims", 1) != 0 {
                    shape[a] = 1;
                } else {
                    shape.remove(a);
                }
                let y = self.temp(Dt::I64, shape);
                let (n, inner) = (x.shape[a], numel(&x.shape[a + 1..]));
                let min = i64::from(node.op == "ArgMin");
                self.kernel(
                    Kernel::ArgMax,
                    numel(&x.shape[..a]) * inner,
                    &[&x],
                    &y,
                    |k| {
                        k.p[0] = n;
                        k.p[1] = inner;
                        k.p[2] = min;
                        k.ft = ft;
                    },
                );
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd"
            | "ReduceSumSquare" | "ReduceL2" | "ReduceL1" => {
                let x = self.x(node, 0)?;
                let ft = Self::ft(node, &x)?;
                let r = x.shape.len();
                let axes_in = if node.op == "ReduceSum" && opset >= 13 || opset >= 18 {
                    self.host_input(node, 1)?
                } else {
                    node.ints("axes")
                };
                let mut axes: Vec<usize> = match axes_in {
                    Some(a) if !a.is_empty() => a
                        .iter()
                        .map(|&v| host::axis(v, r, node))
                        .collect::<Result<_>>()?,
                    _ if node.int("noop_with_empty_axes", 0) != 0 => {
                        let shape = x.shape.clone();
                        self.alias(node, &x, shape);
                        return Ok(());
                    }
                    _ => (0..r).collect(),
                };
                axes.sort_unstable();
                axes.dedup();
                let (Some(&lo), Some(&hi)) = (axes.first(), axes.last()) else {
                    // A scalar: nothing to reduce.
                    let shape = x.shape.clone();
                    self.alias(node, &x, shape);
                    return Ok(());
                };
                // Axes apart: moved to the end (after the others, in order) first.
                let (x, lo, hi, shape) = if hi - lo + 1 != axes.len() {
                    let mut perm: Vec<usize> = (0..r).filter(|d| !axes.contains(d)).collect();
                    perm.extend(&axes);
                    let xt = self.transpose(node, &x, &perm)?;
                    let mut shape = x.shape.clone();
                    if node.int("keepdims", 1) != 0 {
                        for &a in &axes {
                            shape[a] = 1;
                        }
                    } else {
                        shape = perm[..r - axes.len()].iter().map(|&d| x.shape[d]).collect();
                    }
                    (xt, r - axes.len(), r - 1, shape)
                } else {
                    let mut shape = x.shape.clone();
                    if node.int("keepdims", 1) != 0 {
                        shape[lo..=hi].fill(1);
                    } else {
                        shape.drain(lo..=hi);
                    }
                    (x, lo, hi, shape)
                };
                let op = match node.op.as_str() {
                    "ReduceSum" => 0,
                    "ReduceMean" => 1,
                    "ReduceMax" => 2,
                    "ReduceMin" => 3,
                    "ReduceProd" => 4,
                    "ReduceSumSquare" => 5,
                    "ReduceL2" => 6,
                    _ => 7,
                };
                let n = numel(&x.shape[lo..=hi]);
                let inner = numel(&x.shape[hi + 1..]);
                let y = self.temp(x.dt, shape);
                self.kernel(
                    Kernel::Reduce,
                    numel(&x.shape[..lo]) * inner,
                    &[&x],
                    &y,
                    |k| {
                        k.p[0] = n;
                        k.p[1] = inner;
                        k.p[2] = op;
                        k.ft = ft;
                    },
                );
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "GlobalAveragePool" | "GlobalMaxPool" => {
                let x = self.x(node, 0)?;
                let ft = Self::ft(node, &x)?;
                if x.shape.len() < 3 {
                    return Err(Error::invalid(format!(
                        "{}: input rank {} < 3",
                        node.label(),
                        x.shape.len()
                    )));
                }
                let spatial = numel(&x.shape[2..]);
                let mut shape = x.shape.clone();
                for d in &mut shape[2..] {
                    *d = 1;
                }
                let y = self.temp(x.dt, shape);
                let op = if node.op == "GlobalAveragePool" { 1 } else { 2 };
                self.kernel(Kernel::Reduce, x.shape[0] * x.shape[1], &[&x], &y, |k| {
                    k.p[0] = spatial;
                    k.p[1] = 1;
                    k.p[2] = op;
                    k.ft = ft;
                });
                self.set(node, 0, Val::Dev(y));
                Ok(())
            }
            "Pad" | "Tile" => self.pad(node),
            "Resize" => self.resize(node),
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

    /// LayerNormalization (with its Mean and InvStdDev outputs when asked for) and
    /// RMSNormalization over the dims from `axis` on, in one cooperative launch.
    fn norm(&mut self, node: &Node, rms: bool) -> Result<()> {
        let x = self.x(node, 0)?;
        let a = host::axis(node.int("axis", -1), x.shape.len(), node)?;
        let cols = numel(&x.shape[a..]);
        let scale = self.x(node, 1)?;
        let bias = match node.input(2).filter(|_| !rms) {
            Some(_) => Some(self.x(node, 2)?),
            None => None,
        };
        if scale.numel() != cols || bias.as_ref().is_some_and(|b| b.numel() != cols) {
            return Err(unsupported(
                node,
                "scale or bias that is not the normalized shape",
            ));
        }
        if node.int("stash_type", 1) != 1 {
            return Err(unsupported(node, "a stash_type other than FLOAT"));
        }
        let y = self.temp(x.dt, x.shape.clone());
        let eps = node.float("epsilon", 1e-5);
        let mut ins = vec![&x, &scale];
        if let Some(b) = &bias {
            ins.push(b);
        }
        let ft = Self::ft_all(node, &ins)?;
        let rows = numel(&x.shape[..a]);
        // Mean and InvStdDev: one f32 buffer, the means then the inverse deviations.
        let wants_stats = !rms && node.outputs.iter().skip(1).any(|o| !o.is_empty());
        let stats = wants_stats.then(|| self.temp(Dt::F32, vec![2, rows]));
        let mut ins: [Option<Ptr>; 4] = [None, None, None, None];
        ins[0] = Some(x.ptr.clone());
        ins[1] = Some(scale.ptr.clone());
        ins[2] = bias.as_ref().map(|b| b.ptr.clone());
        ins[3] = stats.as_ref().map(|t| t.ptr.clone());
        let mut k = KArgs {
            n: rows,
            ..KArgs::default()
        };
        k.p[0] = cols;
        k.p[1] = i64::from(rms);
        k.f[0] = eps;
        k.ft = ft;
        self.push(Step::Kernel {
            k: Kernel::LayerNorm,
            args: Box::new(k),
            ins,
            out: y.ptr.clone(),
        });
        self.set(node, 0, Val::Dev(y));
        if let Some(st) = stats {
            let mut shape = x.shape[..a].to_vec();
            shape.resize(x.shape.len(), 1);
            for i in 1..3 {
                let half = Dev {
                    dt: Dt::F32,
                    shape: shape.clone(),
                    ptr: st.ptr.plus((i as u64 - 1) * rows as u64 * 4),
                };
                // Computed in reduced precision, FLOAT tensors are that type in the plan.
                let half = match self.precision {
                    Some(p) => {
                        let c = self.temp(p, shape.clone());
                        self.cast(&half, &c);
                        c
                    }
                    None => half,
                };
                self.set(node, i, Val::Dev(half));
            }
        }
        Ok(())
    }

    fn matmul(&mut self, node: &Node) -> Result<()> {
        let a = self.x(node, 0)?;
        let b = self.x(node, 1)?;
        let ft = Self::ft_all(node, &[&a, &b])?;
        let (ar, br) = (a.shape.len(), b.shape.len());
        if ar == 0 || br == 0 {
            return Err(Error::invalid(format!("{}: scalar operand", node.label())));
        }
        // 1-D operands: [K] is [1, K] on the left and [K, 1] on the right.
        let a2 = if ar == 1 {
            vec![1, a.shape[0]]
        } else {
            a.shape.clone()
        };
        let b2 = if br == 1 {
            vec![b.shape[0], 1]
        } else {
            b.shape.clone()
        };
        let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
        let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
        if k != k2 {
            return Err(Error::invalid(format!(
                "{}: shapes {:?} and {:?} do not multiply",
                node.label(),
                a.shape,
                b.shape
            )));
        }
        let (abatch, bbatch) = (&a2[..a2.len() - 2], &b2[..b2.len() - 2]);
        let batch_shape = broadcast(abatch, bbatch).ok_or_else(|| {
            Error::invalid(format!("{}: batch dims do not broadcast", node.label()))
        })?;
        let batch = numel(&batch_shape);
        let mut out_shape = batch_shape.clone();
        if ar > 1 {
            out_shape.push(m);
        }
        if br > 1 {
            out_shape.push(n);
        }
        let y = self.temp(a.dt, out_shape.clone());
        let (na, nb) = (numel(abatch), numel(bbatch));
        // Rows of a batched A against one B: one GEMM with M * batch rows.
        let (m_eff, batch_eff, sa, sb) = if nb == 1 && na == batch {
            (m * batch, 1, 0, 0)
        } else if na == batch && nb == batch {
            (m, batch, m * k, k * n)
        } else if na == 1 && nb == batch {
            (m, batch, 0, k * n)
        } else {
            return Err(unsupported(node, "this broadcast of batch dims"));
        };
        fits32(node, &[n, m_eff, k, batch_eff])?;
        let g = GemmArgs {
            trans_a: false,
            trans_b: false,
            m: n as i32,
            n: m_eff as i32,
            k: k as i32,
            lda: n as i32,
            ldb: k as i32,
            ldc: n as i32,
            stride_a: sb,
            stride_b: sa,
            stride_c: m * n,
            batch: batch_eff as i32,
            alpha: 1.0,
            beta: 0.0,
            dt: ft,
        };
        self.push(Step::Gemm {
            g,
            a: b.ptr.clone(),
            b: a.ptr.clone(),
            c: y.ptr.clone(),
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    fn gemm(&mut self, node: &Node) -> Result<()> {
        let a = self.x(node, 0)?;
        let b = self.x(node, 1)?;
        let ft = Self::ft_all(node, &[&a, &b])?;
        if a.shape.len() != 2 || b.shape.len() != 2 {
            return Err(Error::invalid(format!(
                "{}: Gemm needs 2-D A and B",
                node.label()
            )));
        }
        let (ta, tb) = (node.int("transA", 0) != 0, node.int("transB", 0) != 0);
        let (m, k) = if ta {
            (a.shape[1], a.shape[0])
        } else {
            (a.shape[0], a.shape[1])
        };
        let (k2, n) = if tb {
            (b.shape[1], b.shape[0])
        } else {
            (b.shape[0], b.shape[1])
        };
        if k != k2 {
            return Err(Error::invalid(format!(
                "{}: shapes {:?} and {:?} do not multiply",
                node.label(),
                a.shape,
                b.shape
            )));
        }
        let (alpha, mut beta) = (node.float("alpha", 1.0), node.float("beta", 1.0));
        let y = self.temp(a.dt, vec![m, n]);
        match node.input(2) {
            Some(_) if beta != 0.0 => {
                // C broadcast into Y first; the GEMM adds to it (beta).
                let c = self.x(node, 2)?;
                Self::ft_all(node, &[&a, &c])?;
                let shape = vec![m, n];
                if broadcast(&c.shape, &shape).as_deref() != Some(&shape[..]) {
                    return Err(Error::invalid(format!(
                        "{}: C of shape {:?} does not broadcast to [{m}, {n}]",
                        node.label(),
                        c.shape
                    )));
                }
                let st = broadcast_strides(&c.shape, &shape);
                let size = c.dt.size() as i64;
                self.strided(
                    node,
                    Kernel::StridedCopy,
                    &shape,
                    &[(&c, st, 0)],
                    &y.ptr,
                    &strides(&shape),
                    0,
                    |k| k.p[1] = size,
                )?;
            }
            _ => beta = 0.0,
        }
        fits32(node, &[m, n, k])?;
        let g = GemmArgs {
            trans_a: tb,
            trans_b: ta,
            m: n as i32,
            n: m as i32,
            k: k as i32,
            lda: if tb { k as i32 } else { n as i32 },
            ldb: if ta { m as i32 } else { k as i32 },
            ldc: n as i32,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
            alpha,
            beta,
            dt: ft,
        };
        self.push(Step::Gemm {
            g,
            a: b.ptr.clone(),
            b: a.ptr.clone(),
            c: y.ptr.clone(),
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// Spatial geometry of Conv and pooling (2-D; 1-D as height 1).
    #[allow(clippy::type_complexity)]
    fn window(
        &self,
        node: &Node,
        x: &[i64],
        kernel: (i64, i64),
    ) -> Result<(
        (i64, i64),
        (i64, i64),
        (i64, i64),
        (i64, i64, i64, i64),
        (i64, i64),
    )> {
        let one_d = x.len() == 3;
        let pair = |v: Option<Vec<i64>>, d: i64| -> (i64, i64) {
            match v {
                Some(v) if one_d && !v.is_empty() => (1, v[0]),
                Some(v) if v.len() >= 2 => (v[0], v[1]),
                _ => (d, d),
            }
        };
        let (h, w) = if one_d { (1, x[2]) } else { (x[2], x[3]) };
        let stride = pair(node.ints("strides"), 1);
        let dil = pair(node.ints("dilations"), 1);
        if stride.0 < 1 || stride.1 < 1 || dil.0 < 1 || dil.1 < 1 || kernel.0 < 1 || kernel.1 < 1 {
            return Err(Error::invalid(format!(
                "{}: strides {stride:?}, dilations {dil:?} and kernel {kernel:?} must be positive",
                node.label()
            )));
        }
        let eff = (dil.0 * (kernel.0 - 1) + 1, dil.1 * (kernel.1 - 1) + 1);
        let ceil = node.int("ceil_mode", 0) != 0;
        let auto = node.string("auto_pad").unwrap_or_default();
        let (mut pt, mut pl, mut pb, mut pr) = (0, 0, 0, 0);
        match auto.as_str() {
            "" | "NOTSET" => {
                if let Some(p) = node.ints("pads") {
                    if one_d && p.len() == 2 {
                        (pl, pr) = (p[0], p[1]);
                    } else if p.len() == 4 {
                        (pt, pl, pb, pr) = (p[0], p[1], p[2], p[3]);
                    }
                }
            }
            "VALID" => {}
            "SAME_UPPER" | "SAME_LOWER" => {
                let tot = |n: i64, s: i64, e: i64| {
                    let o = (n + s - 1) / s;
                    ((o - 1) * s + e - n).max(0)
                };
                let (th, tw) = (tot(h, stride.0, eff.0), tot(w, stride.1, eff.1));
                if auto == "SAME_UPPER" {
                    (pt, pl) = (th / 2, tw / 2);
                } else {
                    (pt, pl) = (th - th / 2, tw - tw / 2);
                }
                (pb, pr) = (th - pt, tw - pl);
            }
            other => return Err(unsupported(node, format!("auto_pad {other}"))),
        }
        let out = |n: i64, begin: i64, end: i64, e: i64, s: i64| {
            let span = n + begin + end - e;
            if span < 0 || begin < 0 || end < 0 {
                return 0; // refused below
            }
            if ceil {
                let mut o = (span + s - 1) / s + 1;
                // The last window must start inside the input or its leading padding.
                if (o - 1) * s >= n + begin {
                    o -= 1;
                }
                o
            } else {
                span / s + 1
            }
        };
        let oh = out(h, pt, pb, eff.0, stride.0);
        let ow = out(w, pl, pr, eff.1, stride.1);
        if oh <= 0 || ow <= 0 {
            return Err(Error::invalid(format!(
                "{}: the window does not fit the input {x:?}",
                node.label()
            )));
        }
        Ok(((h, w), (oh, ow), stride, (pt, pl, pb, pr), dil))
    }

    fn conv(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let w = self.x(node, 1)?;
        let ft = Self::ft_all(node, &[&x, &w])?;
        let one_d = x.shape.len() == 3;
        if !(x.shape.len() == 4 || one_d) || w.shape.len() != x.shape.len() {
            return Err(unsupported(
                node,
                format!("convolution of rank {}", x.shape.len()),
            ));
        }
        let groups = node.int("group", 1);
        let (c, kout) = (x.shape[1], w.shape[0]);
        let (r, s) = if one_d {
            (1, w.shape[2])
        } else {
            (w.shape[2], w.shape[3])
        };
        if groups <= 0 || c % groups != 0 || w.shape[1] * groups != c || kout % groups != 0 {
            return Err(Error::invalid(format!(
                "{}: {c} input channels, weights {:?} and group {groups} do not agree",
                node.label(),
                w.shape
            )));
        }
        let ((h, wd), (oh, ow), st, (pt, pl, _, _), dil) = self.window(node, &x.shape, (r, s))?;
        let bias = match node.input(2) {
            Some(_) => Some(self.x(node, 2)?),
            None => None,
        };
        if let Some(b) = bias.as_ref().filter(|b| b.numel() != kout || b.dt != x.dt) {
            return Err(Error::invalid(format!(
                "{}: a bias of shape {:?} and type {} for {kout} output channels of {}",
                node.label(),
                b.shape,
                b.dt.name(),
                x.dt.name()
            )));
        }
        let shape = if one_d {
            vec![x.shape[0], kout, ow]
        } else {
            vec![x.shape[0], kout, oh, ow]
        };
        let y = self.temp(x.dt, shape.clone());
        let esize = x.dt.size() as i64;
        let params = [
            c, h, wd, kout, r, s, oh, ow, st.0, st.1, pt, pl, dil.0, dil.1, groups,
        ];
        let n = x.shape[0];
        let (p, crs) = (oh * ow, c * r * s);
        let col_bytes = (n * crs * p) as u64 * esize as u64;
        if col_bytes > COL_LIMIT {
            // Columns too large for the arena: the direct kernel.
            let mut ins = vec![&x, &w];
            if let Some(b) = &bias {
                ins.push(b);
            }
            self.kernel(Kernel::Conv2d, numel(&shape), &ins, &y, |k| {
                k.p[..15].copy_from_slice(&params);
                k.ft = ft;
            });
            self.set(node, 0, Val::Dev(y));
            return Ok(());
        }
        // im2col, then one strided-batched GEMM per group (over the images), adding to
        // the bias broadcast into the output first.
        let col = self.temp(x.dt, vec![n, crs, p]);
        self.kernel(Kernel::Im2col, n * crs * p, &[&x], &col, |k| {
            k.p[..15].copy_from_slice(&params);
            k.ft = ft;
        });
        let beta = match &bias {
            Some(b) => {
                let dims = [n, kout, p];
                let st = vec![0, 1, 0];
                let os = strides(&dims);
                self.strided(
                    node,
                    Kernel::StridedCopy,
                    &dims,
                    &[(b, st, 0)],
                    &y.ptr,
                    &os,
                    0,
                    |a| a.p[1] = esize,
                )?;
                1.0
            }
            None => 0.0,
        };
        let (kg, crsg) = (kout / groups, crs / groups);
        fits32(node, &[p, kg, crsg, n])?;
        let at = |base: &Ptr, elems: i64| base.plus((elems * esize) as u64);
        for g in 0..groups {
            let gemm = GemmArgs {
                trans_a: false,
                trans_b: false,
                m: p as i32,
                n: kg as i32,
                k: crsg as i32,
                lda: p as i32,
                ldb: crsg as i32,
                ldc: p as i32,
                stride_a: crs * p,
                stride_b: 0,
                stride_c: kout * p,
                batch: n as i32,
                alpha: 1.0,
                beta,
                dt: ft,
            };
            self.push(Step::Gemm {
                g: gemm,
                a: at(&col.ptr, g * crsg * p),
                b: at(&w.ptr, g * kg * crsg),
                c: at(&y.ptr, g * kg * p),
            });
        }
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// ConvTranspose (1-D and 2-D, groups, strides, dilations, pads, output_padding): one
    /// strided-batched GEMM per group gives every input pixel's contribution to every
    /// tap (W_g^T X_g), and `infer_col2im` sums them into the output (with the bias).
    fn conv_transpose(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let w = self.x(node, 1)?;
        let ft = Self::ft_all(node, &[&x, &w])?;
        let one_d = x.shape.len() == 3;
        if !(x.shape.len() == 4 || one_d) || w.shape.len() != x.shape.len() {
            return Err(unsupported(
                node,
                format!("transposed convolution of rank {}", x.shape.len()),
            ));
        }
        let auto = node.string("auto_pad").unwrap_or_default();
        if !matches!(
            auto.as_str(),
            "" | "NOTSET" | "VALID" | "SAME_UPPER" | "SAME_LOWER"
        ) {
            return Err(unsupported(node, format!("auto_pad {auto}")));
        }
        let groups = node.int("group", 1);
        let (n, c) = (x.shape[0], x.shape[1]);
        let (h, wd) = if one_d {
            (1, x.shape[2])
        } else {
            (x.shape[2], x.shape[3])
        };
        let (r, s) = if one_d {
            (1, w.shape[2])
        } else {
            (w.shape[2], w.shape[3])
        };
        if groups <= 0 || c % groups != 0 || w.shape[0] != c {
            return Err(Error::invalid(format!(
                "{}: {c} input channels, weights {:?} and group {groups} do not agree",
                node.label(),
                w.shape
            )));
        }
        let (cg, kg) = (c / groups, w.shape[1]);
        let k = kg * groups;
        let pair = |v: Option<Vec<i64>>, d: i64| -> (i64, i64) {
            match v {
                Some(v) if one_d && !v.is_empty() => (d, v[0]),
                Some(v) if v.len() >= 2 => (v[0], v[1]),
                _ => (d, d),
            }
        };
        let st = pair(node.ints("strides"), 1);
        let dil = pair(node.ints("dilations"), 1);
        let opad = pair(node.ints("output_padding"), 0);
        let (st, dil, opad) = if one_d {
            ((1, st.1), (1, dil.1), (0, opad.1))
        } else {
            (st, dil, opad)
        };
        let (mut pt, mut pl, mut pb, mut pr) = (0, 0, 0, 0);
        // An output shape (given, or the input's times the strides for SAME) sets the
        // pads: the total split in two, the odd one at the end for SAME_UPPER and at the
        // start otherwise (ONNX's rule).
        let spatial = if one_d { 1 } else { 2 };
        let target: Option<Vec<i64>> = match node.ints("output_shape") {
            Some(v) if v.len() >= spatial => Some(v[v.len() - spatial..].to_vec()),
            Some(v) => {
                return Err(Error::invalid(format!(
                    "{}: output_shape {v:?} for {spatial} spatial dims",
                    node.label()
                )))
            }
            None if auto.starts_with("SAME") => Some(if one_d {
                vec![wd * st.1]
            } else {
                vec![h * st.0, wd * st.1]
            }),
            None => None,
        };
        if let Some(t) = target {
            let total = |n: i64, s: i64, o: i64, k: i64, d: i64, want: i64| {
                s * (n - 1) + o + (k - 1) * d + 1 - want
            };
            let split = |tot: i64| {
                if auto == "SAME_UPPER" {
                    (tot / 2, tot - tot / 2)
                } else {
                    (tot - tot / 2, tot / 2)
                }
            };
            let tw = total(wd, st.1, opad.1, s, dil.1, t[t.len() - 1]);
            let th = if one_d {
                0
            } else {
                total(h, st.0, opad.0, r, dil.0, t[0])
            };
            if tw < 0 || th < 0 {
                return Err(unsupported(
                    node,
                    format!("output_shape {t:?} beyond what the input gives without padding"),
                ));
            }
            (pt, pb) = split(th);
            (pl, pr) = split(tw);
        } else if auto != "VALID" {
            if let Some(p) = node.ints("pads") {
                if one_d && p.len() == 2 {
                    (pl, pr) = (p[0], p[1]);
                } else if p.len() == 4 {
                    (pt, pl, pb, pr) = (p[0], p[1], p[2], p[3]);
                }
            }
        }
        if st.0 < 1 || st.1 < 1 || dil.0 < 1 || dil.1 < 1 || r < 1 || s < 1 {
            return Err(Error::invalid(format!(
                "{}: strides {st:?}, dilations {dil:?} and kernel ({r}, {s}) must be positive",
                node.label()
            )));
        }
        if [pt, pl, pb, pr, opad.0, opad.1].iter().any(|&v| v < 0) {
            return Err(Error::invalid(format!(
                "{}: negative pads or output_padding",
                node.label()
            )));
        }
        let oh = st.0 * (h - 1) + opad.0 + (r - 1) * dil.0 + 1 - pt - pb;
        let ow = st.1 * (wd - 1) + opad.1 + (s - 1) * dil.1 + 1 - pl - pr;
        if oh <= 0 || ow <= 0 || h <= 0 || wd <= 0 {
            return Err(Error::invalid(format!(
                "{}: an output of {oh} x {ow} from an input of {h} x {wd}",
                node.label()
            )));
        }
        let bias = match node.input(2) {
            Some(_) => Some(self.x(node, 2)?),
            None => None,
        };
        if let Some(b) = bias.as_ref().filter(|b| b.numel() != k || b.dt != x.dt) {
            return Err(Error::invalid(format!(
                "{}: a bias of shape {:?} and type {} for {k} output channels of {}",
                node.label(),
                b.shape,
                b.dt.name(),
                x.dt.name()
            )));
        }
        let (hw, krs) = (h * wd, k * r * s);
        let esize = x.dt.size() as i64;
        if (n * krs * hw) as u64 * esize as u64 > COL_LIMIT {
            return Err(unsupported(
                node,
                format!(
                    "columns of {} bytes (at most {COL_LIMIT})",
                    n * krs * hw * esize
                ),
            ));
        }
        let cols = self.temp(x.dt, vec![n, krs, hw]);
        let m = kg * r * s;
        fits32(node, &[hw, m, cg, n])?;
        let at = |base: &Ptr, elems: i64| base.plus((elems * esize) as u64);
        for g in 0..groups {
            let gemm = GemmArgs {
                trans_a: false,
                trans_b: true,
                m: hw as i32,
                n: m as i32,
                k: cg as i32,
                lda: hw as i32,
                ldb: m as i32,
                ldc: hw as i32,
                stride_a: c * hw,
                stride_b: 0,
                stride_c: krs * hw,
                batch: n as i32,
                alpha: 1.0,
                beta: 0.0,
                dt: ft,
            };
            self.push(Step::Gemm {
                g: gemm,
                a: at(&x.ptr, g * cg * hw),
                b: at(&w.ptr, g * cg * m),
                c: at(&cols.ptr, g * m * hw),
            });
        }
        let shape = if one_d {
            vec![n, k, ow]
        } else {
            vec![n, k, oh, ow]
        };
        let y = self.temp(x.dt, shape.clone());
        let mut ins = vec![&cols];
        if let Some(b) = &bias {
            ins.push(b);
        }
        let params = [k, h, wd, 0, r, s, oh, ow, st.0, st.1, pt, pl, dil.0, dil.1];
        self.kernel(Kernel::Col2im, numel(&shape), &ins, &y, |a| {
            a.p[..14].copy_from_slice(&params);
            a.ft = ft;
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    fn pool(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let ft = Self::ft(node, &x)?;
        if x.shape.len() == 5 {
            return self.pool3d(node, &x);
        }
        let one_d = x.shape.len() == 3;
        if !(x.shape.len() == 4 || one_d) {
            return Err(unsupported(
                node,
                format!("pooling of rank {}", x.shape.len()),
            ));
        }
        if node.outputs.len() > 1 && !node.outputs[1].is_empty() {
            return Err(unsupported(node, "the Indices output"));
        }
        let ks = node
            .ints("kernel_shape")
            .ok_or_else(|| Error::invalid(format!("{}: no kernel_shape", node.label())))?;
        let want = if one_d { 1 } else { 2 };
        if ks.len() != want || ks.iter().any(|&k| k <= 0) {
            return Err(Error::invalid(format!(
                "{}: kernel_shape {ks:?} for a {want}-D pool",
                node.label()
            )));
        }
        let kernel = if one_d { (1, ks[0]) } else { (ks[0], ks[1]) };
        let ((h, w), (oh, ow), st, (pt, pl, pb, pr), dil) = self.window(node, &x.shape, kernel)?;
        let mode = if node.op == "MaxPool" {
            0
        } else if node.int("count_include_pad", 0) != 0 {
            2
        } else {
            1
        };
        let shape = if one_d {
            vec![x.shape[0], x.shape[1], ow]
        } else {
            vec![x.shape[0], x.shape[1], oh, ow]
        };
        let y = self.temp(x.dt, shape.clone());
        self.kernel(Kernel::Pool2d, numel(&shape), &[&x], &y, |k| {
            k.ft = ft;
            k.p[1] = h;
            k.p[2] = w;
            k.p[3] = pb;
            k.p[15] = pr;
            k.p[4] = kernel.0;
            k.p[5] = kernel.1;
            k.p[6] = oh;
            k.p[7] = ow;
            k.p[8] = st.0;
            k.p[9] = st.1;
            k.p[10] = pt;
            k.p[11] = pl;
            k.p[12] = dil.0;
            k.p[13] = dil.1;
            k.p[14] = mode;
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// BatchNormalization (inference) as y = x * s + t with per-channel s and t computed
    /// on the host (the loader already folded those that follow a Conv).
    fn batchnorm(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        Self::ft(node, &x)?;
        let mut p: Vec<HostTensor> = Vec::with_capacity(4);
        for i in 1..5 {
            let n = node.input(i).unwrap_or("");
            match self.host(n) {
                Some(t) => p.push(t.clone()),
                None => return Err(self.want(node, n, "parameter")),
            }
        }
        let eps = node.float("epsilon", 1e-5) as f64;
        let c = x.shape.get(1).copied().unwrap_or(1);
        if p.iter().any(|t| t.len() as i64 != c) {
            return Err(Error::invalid(format!(
                "{}: scale, bias, mean and variance must each have {c} values (the channels)",
                node.label()
            )));
        }
        let (sc, tc) = fold_bn(&p[0], &p[1], &p[2], &p[3], eps);
        let mut pshape = vec![c];
        pshape.extend(std::iter::repeat_n(1, x.shape.len().saturating_sub(2)));
        let key = node.outputs.first().cloned().unwrap_or_default();
        // In the input's type (FLOAT ones are converted at upload when computing in
        // reduced precision).
        let pdt = if x.dt == self.compute_type(Dt::F32) {
            Dt::F32
        } else {
            x.dt
        };
        let s = HostTensor {
            dt: pdt,
            shape: pshape.clone(),
            data: sc,
        }
        .normalize();
        let t = HostTensor {
            dt: pdt,
            shape: pshape,
            data: tc,
        }
        .normalize();
        let (sk, tk) = (format!("{key}#bn_scale"), format!("{key}#bn_shift"));
        self.vals.insert(sk.clone(), Val::Host(s));
        self.vals.insert(tk.clone(), Val::Host(t));
        let s = self.dev(&sk)?;
        let t = self.dev(&tk)?;
        let xs = self.binary_of(node, 2, &x, &s)?;
        let y = self.binary_of(node, 0, &xs, &t)?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
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
    let consts: HashMap<String, HostTensor> = g.initializers.iter().cloned().collect();
    let uses = |g: &Graph, name: &str| {
        g.nodes
            .iter()
            .flat_map(|n| &n.inputs)
            .filter(|i| *i == name)
            .count()
            + g.outputs.iter().filter(|o| o.name == name).count()
    };
    let mut added: Vec<(String, HostTensor)> = Vec::new();
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
            .map(|i| bn.input(i).and_then(|n| consts.get(n)))
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
        let mut nw = w.clone();
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
        added.push((wn.clone(), nw.normalize()));
        added.push((
            bnm.clone(),
            HostTensor {
                dt: w.dt,
                shape: vec![k as i64],
                data: nb,
            }
            .normalize(),
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
