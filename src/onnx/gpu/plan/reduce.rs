//! Reductions along axes: Softmax and LogSoftmax, the Reduce operators, ArgMax and
//! ArgMin, the global pools, LayerNormalization and RMSNormalization, CumSum and TopK.

use super::{host, numel, unsupported, Dev, KArgs, Kernel, Planner, Ptr, Step, Val};
use crate::onnx::gpu::ops::reduce;
use crate::onnx::graph::{Dt, Node};
use crate::status::{Error, Result};

impl Planner<'_> {
    /// CumSum along an axis (exclusive and reverse as asked).
    pub(super) fn cumsum(&mut self, node: &Node) -> Result<()> {
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

    /// TopK: the k largest or smallest along an axis, with their indices.
    pub(super) fn topk(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
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

    /// Softmax and LogSoftmax.
    pub(super) fn softmax(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
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

    /// ArgMax and ArgMin (first index of the extreme).
    pub(super) fn arg(&mut self, node: &Node) -> Result<()> {
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

    /// ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceSumSquare, ReduceL1 and ReduceL2.
    pub(super) fn reduce(&mut self, node: &Node) -> Result<()> {
        let opset = self.graph.opset;
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
            "ReduceSum" => reduce::SUM,
            "ReduceMean" => reduce::MEAN,
            "ReduceMax" => reduce::MAX,
            "ReduceMin" => reduce::MIN,
            "ReduceProd" => reduce::PROD,
            "ReduceSumSquare" => reduce::SUM_SQUARE,
            "ReduceL2" => reduce::L2,
            _ => reduce::L1,
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

    /// GlobalAveragePool and GlobalMaxPool: a reduction over the spatial dims.
    pub(super) fn global_pool(&mut self, node: &Node) -> Result<()> {
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
        let op = if node.op == "GlobalAveragePool" {
            reduce::MEAN
        } else {
            reduce::MAX
        };
        self.kernel(Kernel::Reduce, x.shape[0] * x.shape[1], &[&x], &y, |k| {
            k.p[0] = spatial;
            k.p[1] = 1;
            k.p[2] = op;
            k.ft = ft;
        });
        self.set(node, 0, Val::Dev(y));
        Ok(())
    }

    /// LayerNormalization (with its Mean and InvStdDev outputs when asked for) and
    /// RMSNormalization over the dims from `axis` on, in one cooperative launch.
    pub(super) fn norm(&mut self, node: &Node, rms: bool) -> Result<()> {
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
}
