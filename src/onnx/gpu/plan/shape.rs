//! Operators that move data without computing on it: views (Identity, Reshape and its
//! kin), Transpose, Expand, Slice, Split, Concat, the gathers and scatters, Pad and Tile,
//! and Resize.

use super::{
    broadcast, broadcast_strides, host, numel, strides, unsupported, Dev, KArgs, Kernel, Planner,
    ResizeAttrs, SliceSpec, Step, Val,
};
use crate::onnx::graph::{Dt, HostTensor, Node};
use crate::status::{Error, Result};

impl Planner<'_> {
    /// Identity, and Dropout in inference: the input itself (a view).
    pub(super) fn identity(&mut self, node: &Node) -> Result<()> {
        if node.op == "Dropout" {
            let training = node.input(2).and_then(|n| self.host(n));
            host::dropout_is_identity(node, training)?;
        }
        let x = self.x(node, 0)?;
        let shape = x.shape.clone();
        self.alias(node, &x, shape);
        Ok(())
    }

    /// Reshape, Flatten, Squeeze and Unsqueeze: views with a new shape.
    pub(super) fn reshape(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
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

    /// Transpose, by `perm` or reversing the axes.
    pub(super) fn transpose_node(&mut self, node: &Node) -> Result<()> {
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

    /// Expand: a broadcasting view, gathered.
    pub(super) fn expand(&mut self, node: &Node) -> Result<()> {
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

    /// Slice: a strided view, gathered.
    pub(super) fn slice(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
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

    /// Split: one strided view per output.
    pub(super) fn split(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
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

    /// Concat: each input copied into its place of the output.
    pub(super) fn concat(&mut self, node: &Node) -> Result<()> {
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

    /// Gather along an axis.
    pub(super) fn gather(&mut self, node: &Node) -> Result<()> {
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

    pub(super) fn transpose(&mut self, node: &Node, x: &Dev, perm: &[usize]) -> Result<Dev> {
        let xs = strides(&x.shape);
        let dims: Vec<i64> = perm.iter().map(|&p| x.shape[p]).collect();
        let st: Vec<i64> = perm.iter().map(|&p| xs[p]).collect();
        self.gather_view(node, x, dims, st, 0)
    }

    /// A contiguous copy of `x` read through `strides`/`off` over `dims`.
    pub(super) fn gather_view(
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

    /// GatherElements and ScatterElements: one strided launch over the indices (a
    /// scatter's output is first a copy of its data).
    pub(super) fn elements(&mut self, node: &Node) -> Result<()> {
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
                k.p[..8].copy_from_slice(&[
                    xs[a],
                    x.shape[a],
                    size,
                    ity,
                    red,
                    x.dt.cast_code(),
                    idx.shape[a],
                    numel(&idx.shape[a + 1..]),
                ]);
            },
        )?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// A scatter's output, first a copy of its data `x`, and its reduction's code (0 none,
    /// 1 add, 2 mul, 3 max, 4 min: `infer_scatter_elements` and `infer_nd`).
    pub(super) fn scatter_target(&mut self, node: &Node, x: &Dev) -> Result<(Dev, i64)> {
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
    pub(super) fn nd(&mut self, node: &Node) -> Result<()> {
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

    /// Pad (constant, reflect, edge, wrap; negative pads crop) and Tile (a wrap with
    /// nothing before), through `infer_pad`.
    pub(super) fn pad(&mut self, node: &Node) -> Result<()> {
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
    pub(super) fn resize(&mut self, node: &Node) -> Result<()> {
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
}
