//! Operators the planner runs as a few of its own operators (the way ONNX defines many of
//! them as functions): Trilu, Mean, ReduceLogSum, ReduceLogSumExp, LpNormalization,
//! Hardmax, InstanceNormalization, DequantizeLinear and QuantizeLinear. The parts get
//! names under the node's first output (`<output>#<op>/<part>`), constants are host
//! values uploaded like any other, and element-wise parts fuse as usual.

use super::{host, numel, unsupported, Dev, KArgs, Kernel, Planner, Ptr, Step, Val};
use crate::onnx::graph::{Dt, HostTensor, Node};
use crate::status::{Error, Result};
use std::sync::Arc;

/// The name of `node`'s input `i`, which must be given.
fn input(node: &Node, i: usize) -> Result<String> {
    node.input(i)
        .map(str::to_owned)
        .ok_or_else(|| Error::invalid(format!("{}: input {i} is missing", node.label())))
}

impl Planner<'_> {
    /// The prefix of the names of `node`'s parts.
    pub(super) fn base(node: &Node) -> String {
        format!(
            "{}#{}",
            node.outputs.first().map_or("", String::as_str),
            node.op
        )
    }

    /// Gives device value `d` a name, for the planner operators that follow.
    pub(super) fn named(&mut self, base: &str, what: &str, d: Dev) -> String {
        let name = format!("{base}/{what}");
        self.vals.insert(name.clone(), Val::Dev(d));
        name
    }

    /// A constant of the graph's type `dt`, by name.
    pub(super) fn constant(
        &mut self,
        base: &str,
        what: &str,
        dt: Dt,
        shape: Vec<i64>,
        data: Vec<f64>,
    ) -> String {
        let name = format!("{base}/{what}");
        let t = HostTensor { dt, shape, data }.normalize();
        self.vals.insert(name.clone(), Val::Host(Arc::new(t)));
        name
    }

    /// Plans planner operator `part` (its output is named by its first output) on
    /// named values; errors name `node`.
    pub(super) fn part(&mut self, node: &Node, part: Node) -> Result<String> {
        let out = part.outputs.first().cloned().unwrap_or_default();
        self.node(&part).map_err(|e| e.context(node.label()))?;
        Ok(out)
    }

    /// Planner operator `op` on named values, output `<base>/<out>`.
    pub(super) fn sub(
        &mut self,
        node: &Node,
        base: &str,
        op: &str,
        ins: &[&str],
        out: &str,
    ) -> Result<String> {
        let part = Self::part_node(base, op, ins, out);
        self.part(node, part)
    }

    /// A part's node (attributes are added with `Node::with_*`).
    pub(super) fn part_node(base: &str, op: &str, ins: &[&str], out: &str) -> Node {
        Node::new(
            op,
            format!("{base}/{op}"),
            ins.iter().map(|s| s.to_string()).collect(),
            vec![format!("{base}/{out}")],
        )
    }

    /// The graph's type of a value computed in type `dt` (FLOAT for the reduced
    /// precision type: constants are converted when uploaded).
    pub(super) fn graph_type(&self, dt: Dt) -> Dt {
        if Some(dt) == self.precision {
            Dt::F32
        } else {
            dt
        }
    }

    /// A part of `node`: reduction `op` of `x` over `axes` (None: all), as the graph's
    /// opset spells it (axes as an attribute or an input).
    fn reduce_part(
        &mut self,
        node: &Node,
        op: &str,
        x: &str,
        axes: Option<&[i64]>,
        keepdims: bool,
        out: &str,
    ) -> Result<String> {
        let base = &Self::base(node);
        let as_input = self.graph.opset >= 18 || (op == "ReduceSum" && self.graph.opset >= 13);
        let mut part = match (axes, as_input) {
            (Some(a), true) => {
                let c = self.constant(
                    base,
                    &format!("{out}_axes"),
                    Dt::I64,
                    vec![a.len() as i64],
                    a.iter().map(|&v| v as f64).collect(),
                );
                Self::part_node(base, op, &[x, &c], out)
            }
            (Some(a), false) => Self::part_node(base, op, &[x], out).with_ints("axes", a),
            (None, _) => Self::part_node(base, op, &[x], out),
        };
        part = part.with_int("keepdims", i64::from(keepdims));
        part.name = format!("{base}/{out}");
        self.part(node, part)
    }

    /// The axes a reduction node names (None: all), from its attribute or input.
    fn reduce_axes(&mut self, node: &Node) -> Result<Option<Vec<i64>>> {
        let a = if self.graph.opset >= 18 {
            self.host_input(node, 1)?
        } else {
            node.ints("axes")
        };
        Ok(a.filter(|a| !a.is_empty()))
    }

    pub(super) fn composite(&mut self, node: &Node) -> Result<()> {
        match node.op.as_str() {
            "Trilu" => self.trilu(node),
            "Mean" => self.mean(node),
            "ReduceLogSum" | "ReduceLogSumExp" => self.reduce_log_sum(node),
            "LpNormalization" => self.lp_normalization(node),
            "Hardmax" => self.hardmax(node),
            "InstanceNormalization" | "GroupNormalization" => self.instance_norm(node),
            "HannWindow" | "HammingWindow" | "BlackmanWindow" => self.window_fn(node),
            "LpPool" => self.lp_pool(node),
            "MeanVarianceNormalization" => self.mean_variance_normalization(node),
            "DepthToSpace" | "SpaceToDepth" => self.depth_to_space(node),
            "OneHot" => self.one_hot(node),
            "EyeLike" => self.eye_like(node),
            "DequantizeLinear" => self.dequantize(node),
            "QuantizeLinear" => self.quantize(node),
            op => Err(Error::unsupported(format!(
                "{}: operator {op} is not supported by the GPU executor",
                node.label()
            ))),
        }
    }

    /// Gives `node` its output: the planner value named `name`.
    fn set_named(&mut self, node: &Node, name: &str) -> Result<()> {
        let d = self.dev(name)?;
        self.set(node, 0, Val::Dev(d));
        Ok(())
    }

    /// Gives `node` its output: the device value `d` seen with `shape` (same bytes).
    fn set_shaped(&mut self, node: &Node, d: Dev, shape: Vec<i64>) -> Result<()> {
        self.set(node, 0, Val::Dev(Dev { shape, ..d }));
        Ok(())
    }

    /// Trilu: the input where a constant band mask holds, else 0.
    fn trilu(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let r = x.shape.len();
        if r < 2 {
            return Err(Error::invalid(format!(
                "{}: a tensor of rank {r} (at least 2)",
                node.label()
            )));
        }
        let k = self
            .host_input(node, 1)?
            .and_then(|v| v.first().copied())
            .unwrap_or(0);
        let upper = node.int("upper", 1) != 0;
        let (n, m) = (x.shape[r - 2], x.shape[r - 1]);
        let mut keep = Vec::with_capacity((n * m) as usize);
        for i in 0..n {
            for j in 0..m {
                let on = if upper { j - i >= k } else { j - i <= k };
                keep.push(f64::from(u8::from(on)));
            }
        }
        let mask = self.constant(&base, "mask", Dt::Bool, vec![n, m], keep);
        let zero = self.constant(&base, "zero", self.graph_type(x.dt), vec![], vec![0.0]);
        let xs = input(node, 0)?;
        let y = self.sub(node, &base, "Where", &[&mask, &xs, &zero], "y")?;
        self.set_named(node, &y)
    }

    /// Mean: Sum of the inputs divided by their count.
    fn mean(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let names: Vec<String> = node
            .inputs
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let sum = self.sub(node, &base, "Sum", &refs, "sum")?;
        let x = self.x(node, 0)?;
        let n = self.constant(
            &base,
            "count",
            self.graph_type(x.dt),
            vec![],
            vec![names.len() as f64],
        );
        let y = self.sub(node, &base, "Div", &[&sum, &n], "y")?;
        self.set_named(node, &y)
    }

    /// ReduceLogSum (the log of ReduceSum) and ReduceLogSumExp (max + log(sum(exp(x -
    /// max))): no overflow for large x).
    fn reduce_log_sum(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let axes = self.reduce_axes(node)?;
        if axes.is_none() && node.int("noop_with_empty_axes", 0) != 0 {
            let x = self.x(node, 0)?;
            let shape = x.shape.clone();
            if node.op == "ReduceLogSum" {
                // log(x) of each element: reducing nothing.
                let xs = input(node, 0)?;
                let y = self.sub(node, &base, "Log", &[&xs], "y")?;
                let d = self.dev(&y)?;
                self.set(node, 0, Val::Dev(d));
                return Ok(());
            }
            self.alias(node, &x, shape);
            return Ok(());
        }
        let keep = node.int("keepdims", 1) != 0;
        let xs = input(node, 0)?;
        let y = if node.op == "ReduceLogSum" {
            let s = self.reduce_part(node, "ReduceSum", &xs, axes.as_deref(), keep, "sum")?;
            self.sub(node, &base, "Log", &[&s], "y")?
        } else {
            // max + log(sum(exp(x - max))): no overflow for large x.
            let m = self.reduce_part(node, "ReduceMax", &xs, axes.as_deref(), true, "max")?;
            let d = self.sub(node, &base, "Sub", &[&xs, &m], "shifted")?;
            let e = self.sub(node, &base, "Exp", &[&d], "exp")?;
            let s = self.reduce_part(node, "ReduceSum", &e, axes.as_deref(), keep, "sum")?;
            let l = self.sub(node, &base, "Log", &[&s], "log")?;
            let m = if keep {
                m
            } else {
                let md = self.dev(&m)?;
                let shape = self.dev(&l)?.shape;
                self.named(&base, "max_dropped", Dev { shape, ..md })
            };
            self.sub(node, &base, "Add", &[&l, &m], "y")?
        };
        self.set_named(node, &y)
    }

    /// LpNormalization: the input divided by its L1 or L2 norm along an axis.
    fn lp_normalization(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let a = host::axis(node.int("axis", -1), x.shape.len(), node)? as i64;
        let op = match node.int("p", 2) {
            1 => "ReduceL1",
            2 => "ReduceL2",
            p => {
                return Err(Error::invalid(format!(
                    "{}: p = {p} (1 or 2)",
                    node.label()
                )))
            }
        };
        let xs = input(node, 0)?;
        let norm = self.reduce_part(node, op, &xs, Some(&[a]), true, "norm")?;
        let y = self.sub(node, &base, "Div", &[&xs, &norm], "y")?;
        self.set_named(node, &y)
    }

    /// Hardmax: 1 where ArgMax points along the axis (the 2-D coercion before opset 13),
    /// else 0.
    fn hardmax(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let r = x.shape.len();
        // Before opset 13: over the 2-D coercion [prod(dims before axis), rest].
        let (view, a) = if self.graph.opset < 13 {
            let a = host::axis(node.int("axis", 1), r, node)?;
            let v = vec![numel(&x.shape[..a]), numel(&x.shape[a..])];
            (v, 1)
        } else {
            (x.shape.clone(), host::axis(node.int("axis", -1), r, node)?)
        };
        let xv = self.named(
            &base,
            "x",
            Dev {
                shape: view.clone(),
                ..x.clone()
            },
        );
        let am = Self::part_node(&base, "ArgMax", &[&xv], "argmax")
            .with_int("axis", a as i64)
            .with_int("keepdims", 1);
        let am = self.part(node, am)?;
        let mut ishape = vec![1i64; view.len()];
        ishape[a] = view[a];
        let idx = self.constant(
            &base,
            "index",
            Dt::I64,
            ishape,
            (0..view[a]).map(|v| v as f64).collect(),
        );
        let eq = self.sub(node, &base, "Equal", &[&am, &idx], "is_max")?;
        let y = self.sub(node, &base, "CastLike", &[&eq, &xv], "y")?;
        let d = self.dev(&y)?;
        self.set_shaped(node, d, x.shape.clone())
    }

    /// HannWindow, HammingWindow and BlackmanWindow: known from the size alone, a host
    /// value.
    fn window_fn(&mut self, node: &Node) -> Result<()> {
        // Known from the size alone: a host value.
        let size = match node.input(0) {
            Some(n) => match self.host(n) {
                Some(t) => t.data.first().copied().unwrap_or(0.0) as i64,
                None => return Err(self.want(node, n, "size")),
            },
            None => return Err(Error::invalid(format!("{}: no size", node.label()))),
        };
        if !(0..=host::HOST_LIMIT).contains(&size) {
            return Err(Error::invalid(format!("{}: size {size}", node.label())));
        }
        let dt = Dt::from_onnx(node.int("output_datatype", 1) as i32)
            .ok_or_else(|| unsupported(node, "this output_datatype"))?;
        let periodic = node.int("periodic", 1) != 0;
        let denom = if periodic { size } else { size - 1 }.max(1) as f64;
        let tau = 2.0 * std::f64::consts::PI;
        let data = (0..size)
            .map(|n| {
                let c = (tau * n as f64 / denom).cos();
                match node.op.as_str() {
                    "HannWindow" => 0.5 - 0.5 * c,
                    "HammingWindow" => 25.0 / 46.0 - (1.0 - 25.0 / 46.0) * c,
                    _ => 0.42 - 0.5 * c + 0.08 * (2.0 * tau * n as f64 / denom).cos(),
                }
            })
            .collect();
        let t = HostTensor {
            dt,
            shape: vec![size],
            data,
        }
        .normalize();
        self.set(node, 0, Val::Host(Arc::new(t)));
        Ok(())
    }

    /// LpPool: (sum over the window of |x|^p)^(1/p).
    fn lp_pool(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        // (sum over the window of |x|^p)^(1/p): an average pool counting the
        // padding, times the window's size.
        let x = self.x(node, 0)?;
        let p = node.int("p", 2);
        if p <= 0 {
            return Err(Error::invalid(format!("{}: p = {p}", node.label())));
        }
        let ks = node.ints("kernel_shape").unwrap_or_default();
        let gt = self.graph_type(x.dt);
        let xs = input(node, 0)?;
        let pw = self.constant(&base, "p", gt, vec![], vec![p as f64]);
        let inv = self.constant(&base, "inv_p", gt, vec![], vec![1.0 / p as f64]);
        let size = self.constant(
            &base,
            "size",
            gt,
            vec![],
            vec![ks.iter().product::<i64>() as f64],
        );
        let a = self.sub(node, &base, "Abs", &[&xs], "abs")?;
        let a = self.sub(node, &base, "Pow", &[&a, &pw], "pow")?;
        let mut avg = Self::part_node(&base, "AveragePool", &[&a], "avg")
            .with_ints("kernel_shape", &ks)
            .with_int("count_include_pad", 1)
            .with_int("ceil_mode", node.int("ceil_mode", 0));
        for attr in ["strides", "pads", "dilations"] {
            if let Some(v) = node.ints(attr) {
                avg = avg.with_ints(attr, &v);
            }
        }
        if let Some(v) = node.string("auto_pad") {
            avg = avg.with_string("auto_pad", &v);
        }
        let avg = self.part(node, avg)?;
        let sum = self.sub(node, &base, "Mul", &[&avg, &size], "sum")?;
        let y = self.sub(node, &base, "Pow", &[&sum, &inv], "y")?;
        self.set_named(node, &y)
    }

    /// MeanVarianceNormalization: (x - mean) / (std + 1e-9) over `axes`.
    fn mean_variance_normalization(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let axes = node.ints("axes").unwrap_or_else(|| vec![0, 2, 3]);
        let xs = input(node, 0)?;
        let gt = self.graph_type(x.dt);
        let two = self.constant(&base, "two", gt, vec![], vec![2.0]);
        let eps = self.constant(&base, "eps", gt, vec![], vec![1e-9]);
        let mean = self.reduce_part(node, "ReduceMean", &xs, Some(&axes), true, "mean")?;
        let sq = self.sub(node, &base, "Pow", &[&xs, &two], "x_squared")?;
        let msq = self.reduce_part(node, "ReduceMean", &sq, Some(&axes), true, "mean_sq")?;
        let m2 = self.sub(node, &base, "Pow", &[&mean, &two], "mean_squared")?;
        let var = self.sub(node, &base, "Sub", &[&msq, &m2], "variance")?;
        let sd = self.sub(node, &base, "Sqrt", &[&var], "std")?;
        let sd = self.sub(node, &base, "Add", &[&sd, &eps], "std_eps")?;
        let c = self.sub(node, &base, "Sub", &[&xs, &mean], "centered")?;
        let y = self.sub(node, &base, "Div", &[&c, &sd], "y")?;
        self.set_named(node, &y)
    }

    /// DepthToSpace (DCR and CRD) and SpaceToDepth: a reshape, a transpose and a reshape.
    fn depth_to_space(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let [n, c, h, w] = x.shape[..] else {
            return Err(Error::invalid(format!(
                "{}: input {:?} (4-D)",
                node.label(),
                x.shape
            )));
        };
        let b = node.int("blocksize", 0);
        let bad = b <= 0
            || if node.op == "DepthToSpace" {
                c % (b * b) != 0
            } else {
                h % b != 0 || w % b != 0
            };
        if bad {
            return Err(Error::invalid(format!(
                "{}: blocksize {b} for {:?}",
                node.label(),
                x.shape
            )));
        }
        let (split, perm, out): (Vec<i64>, [usize; 6], Vec<i64>) = if node.op == "SpaceToDepth" {
            (
                vec![n, c, h / b, b, w / b, b],
                [0, 3, 5, 1, 2, 4],
                vec![n, c * b * b, h / b, w / b],
            )
        } else if node.string("mode").as_deref() == Some("CRD") {
            (
                vec![n, c / (b * b), b, b, h, w],
                [0, 1, 4, 2, 5, 3],
                vec![n, c / (b * b), h * b, w * b],
            )
        } else {
            (
                vec![n, b, b, c / (b * b), h, w],
                [0, 3, 4, 1, 5, 2],
                vec![n, c / (b * b), h * b, w * b],
            )
        };
        let t = self.transpose(node, &Dev { shape: split, ..x }, &perm)?;
        self.set_shaped(node, t, out)
    }

    /// OneHot: `on` where an index equals its position along the new axis, else `off`.
    fn one_hot(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let ind = self.x(node, 0)?;
        let depth = match node.input(1) {
            Some(n) => match self.host(n) {
                Some(t) => t.data.first().copied().unwrap_or(0.0) as i64,
                None => return Err(self.want(node, n, "depth")),
            },
            None => return Err(Error::invalid(format!("{}: no depth", node.label()))),
        };
        if !(1..=host::HOST_LIMIT).contains(&depth) {
            return Err(Error::invalid(format!("{}: depth {depth}", node.label())));
        }
        let r = ind.shape.len() + 1;
        let a = host::axis(node.int("axis", -1), r, node)?;
        let is = input(node, 0)?;
        // Indices as INT64 (floats truncate), negatives counted from the end.
        let i64like = self.constant(&base, "i64", Dt::I64, vec![], vec![0.0]);
        let idx = self.sub(node, &base, "CastLike", &[&is, &i64like], "indices")?;
        let zero = self.constant(&base, "zero", Dt::I64, vec![], vec![0.0]);
        let dep = self.constant(&base, "depth", Dt::I64, vec![], vec![depth as f64]);
        let neg = self.sub(node, &base, "Less", &[&idx, &zero], "negative")?;
        let up = self.sub(node, &base, "Add", &[&idx, &dep], "from_end")?;
        let idx = self.sub(node, &base, "Where", &[&neg, &up, &idx], "wrapped")?;
        let wd = self.dev(&idx)?;
        let mut shape = wd.shape.clone();
        shape.insert(a, 1);
        let idx = self.named(&base, "expanded", Dev { shape, ..wd });
        let mut rshape = vec![1i64; r];
        rshape[a] = depth;
        let range = self.constant(
            &base,
            "range",
            Dt::I64,
            rshape,
            (0..depth).map(|v| v as f64).collect(),
        );
        let hot = self.sub(node, &base, "Equal", &[&idx, &range], "hot")?;
        let vs = input(node, 2)?;
        let pick = |s: &mut Self, what: &str, i: f64| -> Result<String> {
            let at = s.constant(&base, &format!("{what}_at"), Dt::I64, vec![], vec![i]);
            s.sub(node, &base, "Gather", &[&vs, &at], what)
        };
        let off = pick(self, "off", 0.0)?;
        let on = pick(self, "on", 1.0)?;
        let y = self.sub(node, &base, "Where", &[&hot, &on, &off], "y")?;
        self.set_named(node, &y)
    }

    /// EyeLike: ones on the `k`th diagonal, a host value.
    fn eye_like(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let [rows, cols] = x.shape[..] else {
            return Err(Error::invalid(format!(
                "{}: input {:?} (2-D)",
                node.label(),
                x.shape
            )));
        };
        let dt = match node.int("dtype", 0) {
            0 => self.graph_type(x.dt),
            c => Dt::from_onnx(c as i32).ok_or_else(|| unsupported(node, format!("dtype {c}")))?,
        };
        let k = node.int("k", 0);
        let mut data = vec![0.0; (rows * cols) as usize];
        for i in 0..rows {
            let j = i + k;
            if (0..cols).contains(&j) {
                data[(i * cols + j) as usize] = 1.0;
            }
        }
        // Known from the shape alone: a host value (uploaded where the device needs it).
        let t = HostTensor {
            dt,
            shape: vec![rows, cols],
            data,
        };
        self.set(node, 0, Val::Host(Arc::new(t)));
        Ok(())
    }

    /// DequantizeLinear: (x - zero point) * scale, per tensor or per axis.
    fn dequantize(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let scale = self.x(node, 1)?;
        if node.int("block_size", 0) != 0 {
            return Err(unsupported(node, "blocked quantization"));
        }
        let (xs, ss) = (input(node, 0)?, input(node, 1)?);
        let sb = self.per_axis(node, &base, "scale", &ss, &scale, x.shape.len())?;
        let xf = self.sub(node, &base, "CastLike", &[&xs, &ss], "x_float")?;
        let centered = match node.input(2) {
            Some(zp) => {
                let zd = self.dev(zp)?;
                let zb = self.per_axis(node, &base, "zero_point", zp, &zd, x.shape.len())?;
                let zf = self.sub(node, &base, "CastLike", &[&zb, &ss], "zero_float")?;
                self.sub(node, &base, "Sub", &[&xf, &zf], "centered")?
            }
            None => xf,
        };
        let y = self.sub(node, &base, "Mul", &[&centered, &sb], "y")?;
        self.set_named(node, &y)
    }

    /// QuantizeLinear: x / scale rounded half to even, plus the zero point, saturated to
    /// the output type.
    fn quantize(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let scale = self.x(node, 1)?;
        if node.int("block_size", 0) != 0 {
            return Err(unsupported(node, "blocked quantization"));
        }
        let (xs, ss) = (input(node, 0)?, input(node, 1)?);
        let to = match node.input(2) {
            Some(zp) => self.dev(zp)?.dt,
            None => match node.int("output_dtype", 0) {
                0 => Dt::U8,
                c => Dt::from_onnx(c as i32)
                    .ok_or_else(|| unsupported(node, format!("output_dtype {c}")))?,
            },
        };
        // Bounds the compute type holds exactly (16-bit floats do not hold
        // 16- and 32-bit integer ranges).
        if matches!(x.dt, Dt::F16 | Dt::BF16) && !matches!(to, Dt::U8 | Dt::I8) {
            return Err(unsupported(
                node,
                format!("quantizing {} to {}", x.dt.name(), to.name()),
            ));
        }
        let (lo, hi) = match to {
            Dt::U8 => (0.0, 255.0),
            Dt::I8 => (-128.0, 127.0),
            Dt::U16 => (0.0, 65535.0),
            Dt::I16 => (-32768.0, 32767.0),
            Dt::I32 => (i32::MIN as f64, i32::MAX as f64),
            other => return Err(unsupported(node, format!("quantizing to {}", other.name()))),
        };
        let sb = self.per_axis(node, &base, "scale", &ss, &scale, x.shape.len())?;
        let q = self.sub(node, &base, "Div", &[&xs, &sb], "scaled")?;
        // Halves to even, as ONNX rounds.
        let q = self.sub(node, &base, "Round", &[&q], "rounded")?;
        let q = match node.input(2) {
            Some(zp) => {
                let zd = self.dev(zp)?;
                let zb = self.per_axis(node, &base, "zero_point", zp, &zd, x.shape.len())?;
                let zf = self.sub(node, &base, "CastLike", &[&zb, &xs], "zero_float")?;
                self.sub(node, &base, "Add", &[&q, &zf], "shifted")?
            }
            None => q,
        };
        let gt = self.graph_type(x.dt);
        let lo = self.constant(&base, "lo", gt, vec![], vec![lo]);
        let hi = self.constant(&base, "hi", gt, vec![], vec![hi]);
        let q = self.sub(node, &base, "Clip", &[&q, &lo, &hi], "saturated")?;
        let like = self.constant(&base, "like", to, vec![], vec![0.0]);
        let y = self.sub(node, &base, "CastLike", &[&q, &like], "y")?;
        self.set_named(node, &y)
    }

    /// ArgMax/ArgMin with `select_last_index`: the first extreme of the axis reversed,
    /// counted back from the end.
    pub(super) fn arg_last(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let a = host::axis(node.int("axis", 0), x.shape.len(), node)? as i64;
        let n = x.shape[a as usize];
        let xs = node.input(0).unwrap_or_default().to_owned();
        let c = |s: &mut Self, what: &str, v: i64| {
            s.constant(&base, what, Dt::I64, vec![1], vec![v as f64])
        };
        let (st, en, ax, step) = (
            c(self, "start", -1),
            c(self, "end", i64::MIN),
            c(self, "axis", a),
            c(self, "step", -1),
        );
        let rev = self.sub(
            node,
            &base,
            "Slice",
            &[&xs, &st, &en, &ax, &step],
            "reversed",
        )?;
        let arg = Self::part_node(&base, &node.op, &[&rev], "first")
            .with_int("axis", a)
            .with_int("keepdims", node.int("keepdims", 1));
        let first = self.part(node, arg)?;
        let last = self.constant(&base, "last", Dt::I64, vec![], vec![(n - 1) as f64]);
        let y = self.sub(node, &base, "Sub", &[&last, &first], "y")?;
        let d = self.dev(&y)?;
        self.set(node, 0, Val::Dev(d));
        Ok(())
    }

    /// A quantization parameter `p` (named `name`) broadcast along the node's `axis` of
    /// a rank-`rank` tensor: a scalar (or one value) as it is, a 1-D one reshaped to
    /// [1, .., n, .., 1].
    fn per_axis(
        &mut self,
        node: &Node,
        base: &str,
        what: &str,
        name: &str,
        p: &Dev,
        rank: usize,
    ) -> Result<String> {
        if p.shape.iter().product::<i64>() <= 1 && p.shape.len() <= 1 {
            return Ok(name.to_owned());
        }
        if p.shape.len() != 1 {
            return Err(unsupported(
                node,
                format!("a {what} of shape {:?}", p.shape),
            ));
        }
        let a = host::axis(node.int("axis", 1), rank, node)?;
        let mut shape = vec![1i64; rank];
        shape[a] = p.shape[0];
        Ok(self.named(base, what, Dev { shape, ..p.clone() }))
    }

    /// 3-D MaxPool/AveragePool as two 2-D pools: over (H, W) with the depth folded into
    /// the channels, then over D with H and W folded into one. Box windows make both
    /// separable: a maximum of maxima, and an average of averages whose counts (with or
    /// without the padding) multiply.
    pub(super) fn pool3d(&mut self, node: &Node, x: &Dev) -> Result<()> {
        let base = Self::base(node);
        if node.outputs.len() > 1 && !node.outputs[1].is_empty() {
            return Err(unsupported(node, "the Indices output"));
        }
        let [n, c, d, h, w] = x.shape[..] else {
            return Err(Error::invalid(format!(
                "{}: input {:?}",
                node.label(),
                x.shape
            )));
        };
        let three = |name: &str, dflt: i64| -> Result<[i64; 3]> {
            match node.ints(name) {
                None => Ok([dflt; 3]),
                Some(v) if v.len() == 3 => Ok([v[0], v[1], v[2]]),
                Some(v) => Err(Error::invalid(format!(
                    "{}: {name} {v:?} for a 3-D pool",
                    node.label()
                ))),
            }
        };
        let ks = node
            .ints("kernel_shape")
            .filter(|k| k.len() == 3)
            .ok_or_else(|| {
                Error::invalid(format!("{}: kernel_shape for a 3-D pool", node.label()))
            })?;
        let (st, dil) = (three("strides", 1)?, three("dilations", 1)?);
        let pads = match node.ints("pads") {
            None => [0; 6],
            Some(v) if v.len() == 6 => [v[0], v[1], v[2], v[3], v[4], v[5]],
            Some(v) => {
                return Err(Error::invalid(format!(
                    "{}: pads {v:?} for a 3-D pool",
                    node.label()
                )))
            }
        };
        let pool2d =
            |ins: &str, out: &str, k: [i64; 2], st: [i64; 2], dil: [i64; 2], p: [i64; 4]| {
                let mut part = Self::part_node(&base, &node.op, &[ins], out)
                    .with_ints("kernel_shape", &k)
                    .with_ints("strides", &st)
                    .with_ints("dilations", &dil)
                    .with_ints("pads", &p)
                    .with_int("ceil_mode", node.int("ceil_mode", 0))
                    .with_int("count_include_pad", node.int("count_include_pad", 0));
                if let Some(a) = node.string("auto_pad") {
                    part = part.with_string("auto_pad", &a);
                }
                part.name = format!("{base}/{out}");
                part
            };
        let folded = self.named(
            &base,
            "hw_in",
            Dev {
                shape: vec![n, c * d, h, w],
                ..x.clone()
            },
        );
        let p1 = pool2d(
            &folded,
            "hw",
            [ks[1], ks[2]],
            [st[1], st[2]],
            [dil[1], dil[2]],
            [pads[1], pads[2], pads[4], pads[5]],
        );
        let hw = self.part(node, p1)?;
        let hwd = self.dev(&hw)?;
        let (oh, ow) = (hwd.shape[2], hwd.shape[3]);
        let refold = self.named(
            &base,
            "d_in",
            Dev {
                shape: vec![n, c, d, oh * ow],
                ..hwd
            },
        );
        let p2 = pool2d(
            &refold,
            "d",
            [ks[0], 1],
            [st[0], 1],
            [dil[0], 1],
            [pads[0], 0, pads[3], 0],
        );
        let dd = self.part(node, p2)?;
        let y = self.dev(&dd)?;
        let od = y.shape[2];
        self.set_shaped(node, y, vec![n, c, od, oh, ow])
    }

    /// InstanceNormalization and GroupNormalization: each (sample, group of channels)
    /// normalized over its values by the norm kernel (an instance is a group of one
    /// channel), then scaled and shifted per channel (opset 21's GroupNormalization).
    fn instance_norm(&mut self, node: &Node) -> Result<()> {
        let base = Self::base(node);
        let x = self.x(node, 0)?;
        let ft = Self::ft(node, &x)?;
        if x.shape.len() < 3 {
            return Err(Error::invalid(format!(
                "{}: input rank {} (at least 3)",
                node.label(),
                x.shape.len()
            )));
        }
        let (n, c) = (x.shape[0], x.shape[1]);
        let group = node.op == "GroupNormalization";
        if group && self.graph.opset < 21 {
            return Err(unsupported(
                node,
                "GroupNormalization before opset 21 (scale and bias per group)",
            ));
        }
        let g = if group { node.int("num_groups", 0) } else { c };
        if g <= 0 || c % g != 0 {
            return Err(Error::invalid(format!(
                "{}: num_groups {g} for {c} channels",
                node.label()
            )));
        }
        if node.int("stash_type", 1) != 1 {
            return Err(unsupported(node, "a stash_type other than FLOAT"));
        }
        let cols = numel(&x.shape[1..]) / g;
        let ones = self.constant(
            &base,
            "ones",
            self.graph_type(x.dt),
            vec![cols],
            vec![1.0; cols as usize],
        );
        let ones = self.dev(&ones)?;
        let y = self.temp(x.dt, x.shape.clone());
        let mut k = KArgs {
            n: n * g,
            ..KArgs::default()
        };
        k.p[0] = cols;
        k.f[0] = node.float("epsilon", 1e-5);
        k.ft = ft;
        let ins: [Option<Ptr>; 4] = [Some(x.ptr.clone()), Some(ones.ptr.clone()), None, None];
        self.push(Step::Kernel {
            k: Kernel::LayerNorm,
            args: Box::new(k),
            ins,
            out: y.ptr.clone(),
        });
        let rank = y.shape.len();
        let normalized = self.named(&base, "normalized", y);
        let mut pshape = vec![1i64; rank - 1];
        pshape[0] = c;
        let mut per_channel = |i: usize, what: &str| -> Result<String> {
            let name = node
                .input(i)
                .ok_or_else(|| Error::invalid(format!("{}: input {i} is missing", node.label())))?
                .to_owned();
            let d = self.dev(&name)?;
            if d.shape.iter().product::<i64>() != c {
                return Err(Error::invalid(format!(
                    "{}: {what} has {} values for {c} channels",
                    node.label(),
                    d.shape.iter().product::<i64>()
                )));
            }
            Ok(self.named(
                &base,
                what,
                Dev {
                    shape: pshape.clone(),
                    ..d
                },
            ))
        };
        let scale = per_channel(1, "scale")?;
        let bias = per_channel(2, "bias")?;
        let scaled = self.sub(node, &base, "Mul", &[&normalized, &scale], "scaled")?;
        let y = self.sub(node, &base, "Add", &[&scaled, &bias], "y")?;
        let d = self.dev(&y)?;
        self.set_shaped(node, d, x.shape.clone())
    }
}
