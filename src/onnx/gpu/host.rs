//! Nodes evaluated on the host while a plan is made: constants and the small integer
//! tensors of shape computations (Shape -> Gather -> Concat -> Reshape and the like),
//! which exported models are full of. Their results are known before anything runs on
//! the device, so the device only sees real data.

use crate::onnx::graph::{Dt, HostTensor, Node};
use crate::status::{Error, Result};

/// Row-major strides of `shape`, in elements.
pub fn strides(shape: &[i64]) -> Vec<i64> {
    let mut s = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1].max(1);
    }
    s
}

/// The broadcast shape of two shapes (numpy rules).
pub fn broadcast(a: &[i64], b: &[i64]) -> Option<Vec<i64>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Strides that read a tensor of `shape` broadcast to `out` (0 on broadcast dims).
pub fn broadcast_strides(shape: &[i64], out: &[i64]) -> Vec<i64> {
    let s = strides(shape);
    let k = out.len() - shape.len();
    (0..out.len())
        .map(|i| {
            if i < k || shape[i - k] == 1 && out[i] != 1 {
                0
            } else {
                s[i - k]
            }
        })
        .collect()
}

/// Normalises a possibly negative axis against `rank`.
pub fn axis(a: i64, rank: usize, node: &Node) -> Result<usize> {
    let r = rank as i64;
    let v = if a < 0 { a + r } else { a };
    if v < 0 || v >= r {
        return Err(Error::invalid(format!(
            "{}: axis {a} is out of range for rank {rank}",
            node.label()
        )));
    }
    Ok(v as usize)
}

fn binary(
    a: &HostTensor,
    b: &HostTensor,
    dt: Dt,
    f: impl Fn(f64, f64) -> f64,
) -> Option<HostTensor> {
    let shape = broadcast(&a.shape, &b.shape)?;
    let n = host_numel(&shape)?;
    let (sa, sb) = (
        broadcast_strides(&a.shape, &shape),
        broadcast_strides(&b.shape, &shape),
    );
    let outs = strides(&shape);
    let mut data = Vec::with_capacity(n as usize);
    for i in 0..n {
        let (mut ia, mut ib, mut rem) = (0i64, 0i64, i);
        for d in 0..shape.len() {
            let q = rem / outs[d];
            rem %= outs[d];
            ia += q * sa[d];
            ib += q * sb[d];
        }
        data.push(f(a.data[ia as usize], b.data[ib as usize]));
    }
    Some(HostTensor { dt, shape, data }.normalize())
}

/// Input `i` of a node, when it is known on the host.
fn input<'a>(ins: &[Option<&'a HostTensor>], i: usize) -> Option<&'a HostTensor> {
    ins.get(i).copied().flatten()
}

/// The one output of a node evaluated on the host.
fn one(t: HostTensor) -> Result<Option<Vec<HostTensor>>> {
    Ok(Some(vec![t]))
}

/// An error about `node`.
fn bad(node: &Node, why: String) -> Error {
    Error::invalid(format!("{}: {why}", node.label()))
}

/// Evaluates `node` on host inputs; None when the executor does not evaluate this op on
/// the host (then it runs on the device, or the model is refused).
pub fn eval(
    node: &Node,
    ins: &[Option<&HostTensor>],
    opset: i64,
) -> Result<Option<Vec<HostTensor>>> {
    let x = match input(ins, 0) {
        Some(x) => x,
        None if node.op == "Constant" || node.op == "Range" && input(ins, 1).is_some() => {
            // Constant has no inputs; handled below.
            &HostTensor::scalar_i64(0)
        }
        None => return Ok(None),
    };
    match node.op.as_str() {
        "Constant" => eval_constant(node),
        "Identity" => one(x.clone()),
        "Dropout" => {
            dropout_is_identity(node, ins.get(2).copied().flatten())?;
            one(x.clone())
        }
        "Shape" => {
            let r = x.shape.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let start = clamp(node.int("start", 0));
            let end = clamp(node.int("end", r));
            one(HostTensor::vec_i64(&x.shape[start..end.max(start)]))
        }
        "Size" => one(HostTensor::scalar_i64(x.len() as i64)),
        "Cast" => {
            let to = Dt::from_onnx(node.int("to", 1) as i32)
                .ok_or_else(|| Error::unsupported(format!("{}: target type", node.label())))?;
            let mut t = x.clone();
            t.dt = to;
            // Float to integer truncates toward zero, as the kernels do.
            one(t.normalize())
        }
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Max" | "Min" | "Equal" | "Less" | "Greater"
        | "And" | "Or" | "Mod" => eval_binary_op(node, x, ins),
        "Neg" | "Abs" | "Sqrt" | "Not" | "Floor" | "Ceil" | "Reciprocal" | "Exp" | "Log" => {
            let mut t = x.clone();
            for v in &mut t.data {
                *v = match node.op.as_str() {
                    "Neg" => -*v,
                    "Abs" => v.abs(),
                    "Sqrt" => v.sqrt(),
                    "Floor" => v.floor(),
                    "Ceil" => v.ceil(),
                    "Reciprocal" => 1.0 / *v,
                    "Exp" => v.exp(),
                    "Log" => v.ln(),
                    _ => f64::from(u8::from(*v == 0.0)),
                };
            }
            one(t.normalize())
        }
        "Unsqueeze" | "Squeeze" => {
            let axes = match input(ins, 1) {
                Some(a) if opset >= 13 => Some(a.as_i64()),
                _ => node.ints("axes"),
            };
            one(HostTensor {
                shape: squeeze_shape(node, &x.shape, axes.as_deref())?,
                ..x.clone()
            })
        }
        "Reshape" => {
            let Some(s) = input(ins, 1) else {
                return Ok(None);
            };
            let shape = reshape_shape(node, &x.shape, &s.as_i64())?;
            one(HostTensor { shape, ..x.clone() })
        }
        "Flatten" => {
            let a = flatten_axis(node, x.shape.len())?;
            let outer: i64 = x.shape[..a].iter().product();
            one(HostTensor {
                shape: vec![outer, x.len() as i64 / outer.max(1)],
                ..x.clone()
            })
        }
        "Concat" => eval_concat(node, x, ins),
        "Gather" => eval_gather(node, x, ins),
        "Slice" => eval_slice(node, x, ins),
        "ConstantOfShape" => eval_constant_of_shape(node, x),
        "Range" => eval_range(node, ins),
        "Expand" => {
            let Some(s) = input(ins, 1) else {
                return Ok(None);
            };
            let shape = broadcast(&x.shape, &s.as_i64()).ok_or_else(|| {
                bad(
                    node,
                    format!("cannot expand {:?} to {:?}", x.shape, s.as_i64()),
                )
            })?;
            // Too large for the host: the device expands it.
            let Some(n) = host_numel(&shape) else {
                return Ok(None);
            };
            let zero = HostTensor {
                dt: x.dt,
                shape: shape.clone(),
                data: vec![0.0; n as usize],
            };
            one(binary(x, &zero, x.dt, |a, _| a).unwrap_or(zero))
        }
        "Where" => eval_where_op(node, x, ins),
        _ => Ok(None),
    }
}

/// A Constant node's value.
fn eval_constant(node: &Node) -> Result<Option<Vec<HostTensor>>> {
    if let Some(t) = node.tensor("value") {
        return one(crate::onnx::graph::tensor_from_proto(t, &node.label())?);
    }
    if node.has("value_ints") {
        return one(HostTensor::vec_i64(
            &node.ints("value_ints").unwrap_or_default(),
        ));
    }
    if node.has("value_int") {
        return one(HostTensor::scalar_i64(node.int("value_int", 0)));
    }
    if node.has("value_float") {
        return one(HostTensor {
            dt: Dt::F32,
            shape: Vec::new(),
            data: vec![node.float("value_float", 0.0) as f64],
        });
    }
    Err(Error::unsupported(format!(
        "{}: this kind of Constant is not supported",
        node.label()
    )))
}

/// Element-wise arithmetic, comparison and logic of two host tensors (None: too large for the host).
fn eval_binary_op(
    node: &Node,
    x: &HostTensor,
    ins: &[Option<&HostTensor>],
) -> Result<Option<Vec<HostTensor>>> {
    let Some(y) = input(ins, 1) else {
        return Ok(None);
    };
    let int = !x.dt.is_float();
    let dt = if matches!(
        node.op.as_str(),
        "Equal" | "Less" | "Greater" | "And" | "Or"
    ) {
        Dt::Bool
    } else {
        x.dt
    };
    let f: Box<dyn Fn(f64, f64) -> f64> = match node.op.as_str() {
        "Add" => Box::new(|a, b| a + b),
        "Sub" => Box::new(|a, b| a - b),
        "Mul" => Box::new(|a, b| a * b),
        "Div" if int => Box::new(|a, b| if b == 0.0 { 0.0 } else { (a / b).trunc() }),
        "Div" => Box::new(|a, b| a / b),
        "Mod" => Box::new(|a, b| {
            if b == 0.0 {
                0.0
            } else {
                a - b * (a / b).floor()
            }
        }),
        "Pow" => Box::new(f64::powf),
        "Max" => Box::new(f64::max),
        "Min" => Box::new(f64::min),
        "Equal" => Box::new(|a, b| f64::from(u8::from(a == b))),
        "Less" => Box::new(|a, b| f64::from(u8::from(a < b))),
        "Greater" => Box::new(|a, b| f64::from(u8::from(a > b))),
        "And" => Box::new(|a, b| f64::from(u8::from(a != 0.0 && b != 0.0))),
        _ => Box::new(|a, b| f64::from(u8::from(a != 0.0 || b != 0.0))),
    };
    if broadcast(&x.shape, &y.shape).is_some_and(|s| host_numel(&s).is_none()) {
        return Ok(None); // too large for the host: on the device
    }
    let r = binary(x, y, dt, f).ok_or_else(|| {
        bad(
            node,
            format!("shapes {:?} and {:?} do not broadcast", x.shape, y.shape),
        )
    })?;
    one(r)
}

/// Concat of host tensors.
fn eval_concat(
    node: &Node,
    x: &HostTensor,
    ins: &[Option<&HostTensor>],
) -> Result<Option<Vec<HostTensor>>> {
    let mut parts = Vec::new();
    for i in 0..node.inputs.len() {
        match input(ins, i) {
            Some(t) => parts.push(t),
            None => return Ok(None),
        }
    }
    let a = axis(node.int("axis", 0), x.shape.len(), node)?;
    check_concat(
        node,
        a,
        &parts.iter().map(|t| &t.shape[..]).collect::<Vec<_>>(),
    )?;
    let mut shape = x.shape.clone();
    shape[a] = parts.iter().map(|t| t.shape[a]).sum();
    let outer: i64 = x.shape[..a].iter().product();
    let mut data = Vec::new();
    for o in 0..outer {
        for t in &parts {
            let block: i64 = t.shape[a..].iter().product();
            data.extend_from_slice(&t.data[(o * block) as usize..((o + 1) * block) as usize]);
        }
    }
    one(HostTensor {
        dt: x.dt,
        shape,
        data,
    })
}

/// Gather from a host tensor.
fn eval_gather(
    node: &Node,
    x: &HostTensor,
    ins: &[Option<&HostTensor>],
) -> Result<Option<Vec<HostTensor>>> {
    let Some(idx) = input(ins, 1) else {
        return Ok(None);
    };
    let a = axis(node.int("axis", 0), x.shape.len(), node)?;
    let outer: i64 = x.shape[..a].iter().product();
    let n = x.shape[a];
    let inner: i64 = x.shape[a + 1..].iter().product();
    let mut data = Vec::new();
    for o in 0..outer {
        for &j in &idx.as_i64() {
            let j = if j < 0 { j + n } else { j };
            if j < 0 || j >= n {
                return Err(bad(
                    node,
                    format!("index {j} is out of range for a dim of {n}"),
                ));
            }
            let at = ((o * n + j) * inner) as usize;
            data.extend_from_slice(&x.data[at..at + inner as usize]);
        }
    }
    let mut shape = x.shape[..a].to_vec();
    shape.extend_from_slice(&idx.shape);
    shape.extend_from_slice(&x.shape[a + 1..]);
    one(HostTensor {
        dt: x.dt,
        shape,
        data,
    })
}

/// Slice of a host tensor.
fn eval_slice(
    node: &Node,
    x: &HostTensor,
    ins: &[Option<&HostTensor>],
) -> Result<Option<Vec<HostTensor>>> {
    let (Some(starts), Some(ends)) = (input(ins, 1), input(ins, 2)) else {
        return Ok(None);
    };
    let spec = SliceSpec::new(
        node,
        &x.shape,
        &starts.as_i64(),
        &ends.as_i64(),
        input(ins, 3).map(|t| t.as_i64()),
        input(ins, 4).map(|t| t.as_i64()),
    )?;
    let out = spec.out_shape();
    let n: i64 = out.iter().product();
    let xs = strides(&x.shape);
    let os = strides(&out);
    let mut data = Vec::with_capacity(n as usize);
    for i in 0..n {
        let (mut at, mut rem) = (0i64, i);
        for d in 0..out.len() {
            let q = rem / os[d];
            rem %= os[d];
            at += (spec.start[d] + q * spec.step[d]) * xs[d];
        }
        data.push(x.data[at as usize]);
    }
    one(HostTensor {
        dt: x.dt,
        shape: out,
        data,
    })
}

/// ConstantOfShape.
fn eval_constant_of_shape(node: &Node, x: &HostTensor) -> Result<Option<Vec<HostTensor>>> {
    let shape = x.as_i64();
    let n = host_numel(&shape).unwrap_or(i64::MAX);
    if shape.iter().any(|&d| d < 0) || n > HOST_LIMIT {
        return Err(bad(
            node,
            format!("shape {shape:?} cannot be made while planning"),
        ));
    }
    let (dt, v) = match node.tensor("value") {
        Some(t) => {
            let t = crate::onnx::graph::tensor_from_proto(t, &node.label())?;
            (t.dt, t.data.first().copied().unwrap_or(0.0))
        }
        None => (Dt::F32, 0.0),
    };
    one(HostTensor {
        dt,
        shape,
        data: vec![v; n.max(0) as usize],
    })
}

/// Range.
fn eval_range(node: &Node, ins: &[Option<&HostTensor>]) -> Result<Option<Vec<HostTensor>>> {
    let (Some(start), Some(limit), Some(delta)) = (input(ins, 0), input(ins, 1), input(ins, 2))
    else {
        return Ok(None);
    };
    let (Some(&s), Some(&l), Some(&d)) =
        (start.data.first(), limit.data.first(), delta.data.first())
    else {
        return Err(bad(node, "start, limit and delta must be scalars".into()));
    };
    if d == 0.0 {
        return Err(bad(node, "delta is 0".into()));
    }
    let n = ((l - s) / d).ceil().max(0.0);
    if n > HOST_LIMIT as f64 {
        return Err(bad(
            node,
            format!("{n} elements is too many to compute while planning"),
        ));
    }
    let n = n as usize;
    one(HostTensor {
        dt: start.dt,
        shape: vec![n as i64],
        data: (0..n).map(|i| s + i as f64 * d).collect(),
    }
    .normalize())
}

/// Where on host tensors (None: too large for the host).
fn eval_where_op(
    node: &Node,
    x: &HostTensor,
    ins: &[Option<&HostTensor>],
) -> Result<Option<Vec<HostTensor>>> {
    let (Some(a), Some(b)) = (input(ins, 1), input(ins, 2)) else {
        return Ok(None);
    };
    let out = broadcast(&x.shape, &a.shape).and_then(|s| broadcast(&s, &b.shape));
    if out.as_ref().is_some_and(|s| host_numel(s).is_none()) {
        return Ok(None); // too large for the host: on the device
    }
    let r = out.map(|shape| {
        let (sc, sa, sb) = (
            broadcast_strides(&x.shape, &shape),
            broadcast_strides(&a.shape, &shape),
            broadcast_strides(&b.shape, &shape),
        );
        let outs = strides(&shape);
        let n: i64 = shape.iter().product();
        let data = (0..n)
            .map(|i| {
                let (mut ic, mut ia, mut ib, mut rem) = (0i64, 0i64, 0i64, i);
                for d in 0..shape.len() {
                    let q = rem / outs[d];
                    rem %= outs[d];
                    ic += q * sc[d];
                    ia += q * sa[d];
                    ib += q * sb[d];
                }
                if x.data[ic as usize] != 0.0 {
                    a.data[ia as usize]
                } else {
                    b.data[ib as usize]
                }
            })
            .collect();
        HostTensor {
            dt: a.dt,
            shape,
            data,
        }
    });
    one(r.ok_or_else(|| bad(node, "shapes do not broadcast".into()))?)
}

/// The most elements a tensor computed on the host while planning may have.
pub const HOST_LIMIT: i64 = 1 << 24;

/// The element count of `shape` when it is a shape (no negative dims) of at most
/// [`HOST_LIMIT`] elements.
pub fn host_numel(shape: &[i64]) -> Option<i64> {
    shape
        .iter()
        .try_fold(1i64, |n, &d| if d < 0 { None } else { n.checked_mul(d) })
        .filter(|&n| n <= HOST_LIMIT)
}

/// Concat's inputs agree: same rank, same dims but along `a`.
pub fn check_concat(node: &Node, a: usize, shapes: &[&[i64]]) -> Result<()> {
    let Some(first) = shapes.first() else {
        return Err(Error::invalid(format!("{}: no inputs", node.label())));
    };
    for s in shapes {
        let same = s.len() == first.len()
            && s.iter()
                .zip(first.iter())
                .enumerate()
                .all(|(d, (x, y))| d == a || x == y);
        if !same {
            return Err(Error::invalid(format!(
                "{}: inputs of shapes {first:?} and {s:?} cannot be concatenated along axis {a}",
                node.label()
            )));
        }
    }
    Ok(())
}

/// Flatten's axis, in [0, rank] (negative counts from the end).
pub fn flatten_axis(node: &Node, rank: usize) -> Result<usize> {
    let a = node.int("axis", 1);
    let v = if a < 0 { a + rank as i64 } else { a };
    if v < 0 || v > rank as i64 {
        return Err(Error::invalid(format!(
            "{}: axis {a} is out of range for rank {rank}",
            node.label()
        )));
    }
    Ok(v as usize)
}

/// Dropout is the identity at inference; training mode (and the mask output) is refused.
pub fn dropout_is_identity(node: &Node, training: Option<&HostTensor>) -> Result<()> {
    let on = match (node.input(2), training) {
        (None, _) => false,
        (Some(_), Some(t)) => t.data.first().is_some_and(|&v| v != 0.0),
        (Some(_), None) => true,
    };
    if on || node.outputs.get(1).is_some_and(|m| !m.is_empty()) {
        return Err(Error::unsupported(format!(
            "{}: Dropout in training mode or with its mask output is not supported",
            node.label()
        )));
    }
    Ok(())
}

/// Output shape of Squeeze/Unsqueeze.
pub fn squeeze_shape(node: &Node, shape: &[i64], axes: Option<&[i64]>) -> Result<Vec<i64>> {
    if node.op == "Unsqueeze" {
        let axes = axes.ok_or_else(|| Error::invalid(format!("{}: no axes", node.label())))?;
        let rank = shape.len() + axes.len();
        let mut norm: Vec<usize> = axes
            .iter()
            .map(|&a| axis(a, rank, node))
            .collect::<Result<_>>()?;
        norm.sort_unstable();
        let mut out = shape.to_vec();
        for a in norm {
            out.insert(a.min(out.len()), 1);
        }
        Ok(out)
    } else {
        match axes {
            None => Ok(shape.iter().copied().filter(|&d| d != 1).collect()),
            Some(axes) => {
                let norm: Vec<usize> = axes
                    .iter()
                    .map(|&a| axis(a, shape.len(), node))
                    .collect::<Result<_>>()?;
                if let Some(&a) = norm.iter().find(|&&a| shape[a] != 1) {
                    return Err(Error::invalid(format!(
                        "{}: dim {a} of {shape:?} is not 1 and cannot be squeezed",
                        node.label()
                    )));
                }
                Ok(shape
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !norm.contains(i))
                    .map(|(_, &d)| d)
                    .collect())
            }
        }
    }
}

/// Output shape of Reshape (0 copies the input dim unless allowzero; one -1 is inferred).
pub fn reshape_shape(node: &Node, shape: &[i64], target: &[i64]) -> Result<Vec<i64>> {
    let allowzero = node.int("allowzero", 0) != 0;
    let total: i64 = shape.iter().product();
    let mut out: Vec<i64> = target
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            if d == 0 && !allowzero {
                shape.get(i).copied().unwrap_or(0)
            } else {
                d
            }
        })
        .collect();
    let known: i64 = out.iter().filter(|&&d| d != -1).product();
    if let Some(p) = out.iter().position(|&d| d == -1) {
        if known == 0 || total % known != 0 {
            return Err(Error::invalid(format!(
                "{}: cannot reshape {shape:?} to {target:?}",
                node.label()
            )));
        }
        out[p] = total / known;
    }
    if out.iter().product::<i64>() != total || out.iter().any(|&d| d < 0) {
        return Err(Error::invalid(format!(
            "{}: cannot reshape {shape:?} to {target:?}",
            node.label()
        )));
    }
    Ok(out)
}

/// A normalised Slice: per dim of the input, the first index and the step.
pub struct SliceSpec {
    pub start: Vec<i64>,
    pub step: Vec<i64>,
    pub len: Vec<i64>,
}

impl SliceSpec {
    pub fn new(
        node: &Node,
        shape: &[i64],
        starts: &[i64],
        ends: &[i64],
        axes: Option<Vec<i64>>,
        steps: Option<Vec<i64>>,
    ) -> Result<SliceSpec> {
        let r = shape.len();
        let mut start = vec![0i64; r];
        let mut step = vec![1i64; r];
        let mut len: Vec<i64> = shape.to_vec();
        let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
        if axes.len() != starts.len() || ends.len() != starts.len() {
            return Err(Error::invalid(format!(
                "{}: starts, ends and axes differ in length",
                node.label()
            )));
        }
        for (k, &a) in axes.iter().enumerate() {
            let d = axis(a, r, node)?;
            let n = shape[d];
            let st = steps.as_ref().and_then(|s| s.get(k).copied()).unwrap_or(1);
            if st == 0 || st == i64::MIN {
                return Err(Error::invalid(format!(
                    "{}: step {st} is not usable",
                    node.label()
                )));
            }
            let clampi = |v: i64, lo: i64, hi: i64| v.clamp(lo, hi);
            let norm = |v: i64| if v < 0 { v + n } else { v };
            let (b, e) = if st > 0 {
                (clampi(norm(starts[k]), 0, n), clampi(norm(ends[k]), 0, n))
            } else {
                (
                    clampi(norm(starts[k]), -1, n - 1),
                    clampi(norm(ends[k]), -1, n - 1),
                )
            };
            let span = if st > 0 {
                (e - b).max(0)
            } else {
                (b - e).max(0)
            };
            let l = if span == 0 {
                0
            } else {
                (span - 1) / st.abs() + 1
            };
            start[d] = b;
            step[d] = st;
            len[d] = l;
        }
        Ok(SliceSpec { start, step, len })
    }
    pub fn out_shape(&self) -> Vec<i64> {
        self.len.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::pb;

    fn node(op: &str, attrs: Vec<pb::AttributeProto>) -> Node {
        Node::from_proto(&pb::NodeProto {
            op_type: op.into(),
            name: "n".into(),
            input: vec!["a".into(), "b".into()],
            attribute: attrs,
            ..Default::default()
        })
    }

    fn ints(name: &str, v: &[i64]) -> pb::AttributeProto {
        pb::AttributeProto {
            name: name.into(),
            ints: v.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn broadcasting_shapes_and_strides() {
        assert_eq!(broadcast(&[2, 1, 4], &[3, 1]), Some(vec![2, 3, 4]));
        assert_eq!(broadcast(&[2, 3], &[4]), None);
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<i64>::new());
    }

    #[test]
    fn concat_inputs_must_agree_off_the_axis() {
        let n = node("Concat", vec![]);
        assert!(check_concat(&n, 1, &[&[2, 4], &[2, 3]]).is_ok());
        assert!(check_concat(&n, 1, &[&[2, 4], &[1000, 4]]).is_err());
        assert!(check_concat(&n, 0, &[&[2, 4], &[2, 4, 1]]).is_err());
        assert!(check_concat(&n, 0, &[]).is_err());
        let s = node("Squeeze", vec![]);
        assert!(squeeze_shape(&s, &[1, 3], Some(&[0])).is_ok());
        assert!(squeeze_shape(&s, &[2, 3], Some(&[0])).is_err());
        assert!(axis(0, 0, &s).is_err(), "a scalar has no axis");
    }

    #[test]
    fn reshape_keeps_zero_and_infers_minus_one() {
        let n = node("Reshape", vec![]);
        assert_eq!(
            reshape_shape(&n, &[2, 3, 4], &[0, -1]).unwrap(),
            vec![2, 12]
        );
        assert!(reshape_shape(&n, &[2, 3, 4], &[5, -1]).is_err());
    }

    #[test]
    fn slices_clamp_and_step_backwards() {
        let n = node("Slice", vec![]);
        let s = SliceSpec::new(&n, &[10, 4], &[-3, 0], &[100, 4], None, None).unwrap();
        assert_eq!((s.start.clone(), s.out_shape()), (vec![7, 0], vec![3, 4]));
        let s = SliceSpec::new(&n, &[10], &[-1], &[i64::MIN], None, Some(vec![-2])).unwrap();
        assert_eq!((s.start[0], s.step[0], s.out_shape()), (9, -2, vec![5]));
    }

    #[test]
    fn shape_computations_run_on_the_host() {
        let x = HostTensor {
            dt: Dt::F32,
            shape: vec![2, 3, 4],
            data: vec![0.0; 24],
        };
        let shape = eval(&node("Shape", vec![]), &[Some(&x)], 17)
            .unwrap()
            .unwrap();
        assert_eq!(shape[0].as_i64(), vec![2, 3, 4]);
        let idx = HostTensor::scalar_i64(-1);
        let last = eval(&node("Gather", vec![]), &[Some(&shape[0]), Some(&idx)], 17)
            .unwrap()
            .unwrap();
        assert_eq!((last[0].as_i64(), last[0].shape.clone()), (vec![4], vec![]));
        let axes = HostTensor::vec_i64(&[0]);
        let un = eval(
            &node("Unsqueeze", vec![]),
            &[Some(&last[0]), Some(&axes)],
            17,
        )
        .unwrap()
        .unwrap();
        assert_eq!(un[0].shape, vec![1]);
        let cat = eval(
            &node(
                "Concat",
                vec![pb::AttributeProto {
                    name: "axis".into(),
                    i: 0,
                    ..Default::default()
                }],
            ),
            &[Some(&HostTensor::vec_i64(&[-1])), Some(&un[0])],
            17,
        )
        .unwrap()
        .unwrap();
        assert_eq!(cat[0].as_i64(), vec![-1, 4]);
        let t = eval(
            &node("Transpose", vec![ints("perm", &[1, 0])]),
            &[Some(&x)],
            17,
        )
        .unwrap();
        assert!(t.is_none(), "Transpose is not evaluated on the host");
        let div = eval(
            &node("Div", vec![]),
            &[
                Some(&HostTensor::vec_i64(&[-7, 7])),
                Some(&HostTensor::scalar_i64(2)),
            ],
            17,
        )
        .unwrap()
        .unwrap();
        assert_eq!(div[0].as_i64(), vec![-3, 3], "integer division truncates");
    }

    #[test]
    fn where_picks_integers_and_broadcasts() {
        let cond = HostTensor {
            dt: Dt::Bool,
            shape: vec![2, 1],
            data: vec![0.0, 1.0],
        };
        let a = HostTensor::vec_i64(&[7, 8, 9]);
        let b = HostTensor::scalar_i64(1);
        let r = eval(
            &node("Where", vec![]),
            &[Some(&cond), Some(&a), Some(&b)],
            17,
        )
        .unwrap()
        .unwrap();
        assert_eq!(r[0].shape, vec![2, 3]);
        assert_eq!(r[0].as_i64(), vec![1, 1, 1, 7, 8, 9]);
        assert_eq!(r[0].dt, Dt::I64);
    }
}
