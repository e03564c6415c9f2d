//! The operators that multiply: MatMul and Gemm through cuBLAS, Conv (direct or as
//! im2col and a GEMM), ConvTranspose, the pools and BatchNormalization.

use super::{
    broadcast, broadcast_strides, fits32, fold_bn, numel, strides, unsupported, Dev, Kernel,
    Planner, Ptr, Step, Val, COL_LIMIT,
};
use crate::cuda::cublas::GemmArgs;
use crate::onnx::gpu::ops::binary;
use crate::onnx::graph::{Dt, HostTensor, Node};
use crate::status::{Error, Result};
use std::sync::Arc;

impl Planner<'_> {
    pub(super) fn matmul(&mut self, node: &Node) -> Result<()> {
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

    pub(super) fn gemm(&mut self, node: &Node) -> Result<()> {
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
    pub(super) fn window(
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

    pub(super) fn conv(&mut self, node: &Node) -> Result<()> {
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

    /// The geometry of a ConvTranspose from its inputs' shapes and its attributes (the
    /// pads from `pads`, `output_shape` or `auto_pad`), checked.
    fn transpose_geometry(node: &Node, x: &Dev, w: &Dev) -> Result<TransposeGeometry> {
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
        Ok(TransposeGeometry {
            one_d,
            n,
            c,
            h,
            wd,
            r,
            s,
            groups,
            cg,
            kg,
            st,
            dil,
            pt,
            pl,
            oh,
            ow,
        })
    }

    /// ConvTranspose (1-D and 2-D, groups, strides, dilations, pads, output_padding): one
    /// strided-batched GEMM per group gives every input pixel's contribution to every
    /// tap (W_g^T X_g), and `infer_col2im` sums them into the output (with the bias).
    pub(super) fn conv_transpose(&mut self, node: &Node) -> Result<()> {
        let x = self.x(node, 0)?;
        let w = self.x(node, 1)?;
        let ft = Self::ft_all(node, &[&x, &w])?;
        let TransposeGeometry {
            one_d,
            n,
            c,
            h,
            wd,
            r,
            s,
            groups,
            cg,
            kg,
            st,
            dil,
            pt,
            pl,
            oh,
            ow,
        } = Self::transpose_geometry(node, &x, &w)?;
        let k = kg * groups;
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

    pub(super) fn pool(&mut self, node: &Node) -> Result<()> {
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
    pub(super) fn batchnorm(&mut self, node: &Node) -> Result<()> {
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
        self.vals.insert(sk.clone(), Val::Host(Arc::new(s)));
        self.vals.insert(tk.clone(), Val::Host(Arc::new(t)));
        let s = self.dev(&sk)?;
        let t = self.dev(&tk)?;
        let xs = self.binary_of(node, binary::MUL, &x, &s)?;
        let y = self.binary_of(node, binary::ADD, &xs, &t)?;
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }
}

/// A ConvTranspose's sizes: batch `n`, channels `c` (`cg` per group, `kg` outputs per
/// group), input `h` x `wd`, kernel `r` x `s`, strides, dilations, the top and left pads
/// and the output `oh` x `ow` (`h`, `r`, the first stride and dilation 1 for 1-D).
struct TransposeGeometry {
    one_d: bool,
    n: i64,
    c: i64,
    h: i64,
    wd: i64,
    r: i64,
    s: i64,
    groups: i64,
    cg: i64,
    kg: i64,
    st: (i64, i64),
    dil: (i64, i64),
    pt: i64,
    pl: i64,
    oh: i64,
    ow: i64,
}
