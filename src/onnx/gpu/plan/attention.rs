//! ONNX's Attention (opset 23): scaled dot-product attention with multi-head, grouped-query
//! and multi-query heads, a boolean or additive mask, causal masking, soft capping and a
//! key/value cache (past in, present out), in two batched GEMMs around planner operators.
//!
//! The order of the steps is that of ONNX's own function for the operator (as in the
//! pinned `onnx` release's test data): scores = scale * Q K^T; + mask; + causal mask;
//! softcap * tanh(scores / softcap); softmax over the keys; times V.
//! `qk_matmul_output_mode` 0 to 3 picks the scores after the GEMM, the masks, the soft cap
//! and the softmax.
//!
//! Grouped-query heads need no copies of K and V: query heads `g * j .. g * j + g` use
//! key/value head `j`, and the rows of those query heads are contiguous, so one GEMM per
//! (batch, key/value head) multiplies `g * Sq` query rows with that head's keys.

use super::{fits32, unsupported, Dev, Planner, Step, Val};
use crate::cuda::cublas::GemmArgs;
use crate::onnx::graph::{Dt, Node};
use crate::status::{Error, Result};

impl Planner<'_> {
    pub(super) fn attention(&mut self, node: &Node) -> Result<()> {
        let bad = |why: String| Error::invalid(format!("{}: {why}", node.label()));
        let mode = attention_mode(node)?;
        let q = self.x(node, 0)?;
        let k = self.x(node, 1)?;
        let v = self.x(node, 2)?;
        let ft = Self::ft_all(node, &[&q, &k, &v])?;
        let rank = q.shape.len();
        if !matches!(rank, 3 | 4) || k.shape.len() != rank || v.shape.len() != rank {
            return Err(bad(format!(
                "Q, K and V must all be 3-D or all 4-D (they are {:?}, {:?}, {:?})",
                q.shape, k.shape, v.shape
            )));
        }
        let (qh, kvh) = if rank == 4 {
            (q.shape[1], k.shape[1])
        } else {
            let (a, b) = (node.int("q_num_heads", 0), node.int("kv_num_heads", 0));
            if a <= 0 || b <= 0 {
                return Err(bad(
                    "3-D inputs need the q_num_heads and kv_num_heads attributes".into(),
                ));
            }
            (a, b)
        };
        if qh <= 0 || kvh <= 0 {
            return Err(bad(format!("{qh} query heads and {kvh} key/value heads")));
        }
        let q4 = self.heads(node, &q, qh)?;
        let k4 = self.heads(node, &k, kvh)?;
        let v4 = self.heads(node, &v, kvh)?;
        let (b, sq, d) = (q4.shape[0], q4.shape[2], q4.shape[3]);
        let dv = v4.shape[3];
        if k4.shape[0] != b || v4.shape[0] != b || v4.shape[1] != kvh || k4.shape[3] != d {
            return Err(bad(format!(
                "Q {:?}, K {:?} and V {:?} (as batch, heads, sequence, head size) do not agree",
                q4.shape, k4.shape, v4.shape
            )));
        }
        if k4.shape[2] != v4.shape[2] {
            return Err(bad("K and V have different sequence lengths".into()));
        }
        if qh % kvh != 0 {
            return Err(bad(format!(
                "{qh} query heads are not a multiple of {kvh} key/value heads"
            )));
        }
        let g = qh / kvh;
        // The cache: past key/value before the new ones along the sequence.
        let base = format!(
            "{}#attention",
            node.outputs.first().map_or("", String::as_str)
        );
        let (k4, v4, past) = match (node.input(4), node.input(5)) {
            (None, None) => (k4, v4, 0),
            (Some(pk), Some(pv)) => {
                let pkd = self.dev(pk)?;
                let pvd = self.dev(pv)?;
                if pkd.shape.len() != 4 || pvd.shape.len() != 4 {
                    return Err(bad("past_key and past_value must be 4-D".into()));
                }
                let p = pkd.shape[2];
                let kc = self.sub_concat(node, &base, "present_key", pk, &k4)?;
                let vc = self.sub_concat(node, &base, "present_value", pv, &v4)?;
                (kc, vc, p)
            }
            _ => return Err(bad("past_key and past_value must be given together".into())),
        };
        let t = k4.shape[2];
        let scale = if node.has("scale") {
            node.float("scale", 1.0)
        } else {
            1.0 / (d as f32).sqrt()
        };
        // scores (b, qh, sq, t) = scale * Q K^T: per (batch, kv head), K [t, d] times the
        // g * sq query rows [g * sq, d], transposed (row-major C = Q K^T is column-major
        // C^T = K Q^T).
        let rows = g * sq;
        fits32(node, &[t, rows, d, b * kvh])?;
        let scores = self.temp(q4.dt, vec![b, qh, sq, t]);
        self.push(Step::Gemm {
            g: GemmArgs {
                trans_a: true,
                trans_b: false,
                m: t as i32,
                n: rows as i32,
                k: d as i32,
                lda: d as i32,
                ldb: d as i32,
                ldc: t as i32,
                stride_a: t * d,
                stride_b: rows * d,
                stride_c: rows * t,
                batch: (b * kvh) as i32,
                alpha: scale,
                beta: 0.0,
                dt: ft,
            },
            a: k4.ptr.clone(),
            b: q4.ptr.clone(),
            c: scores.ptr.clone(),
        });
        let mut cur = self.named(&base, "scores", scores);
        let mut qk = (mode == 0).then(|| cur.clone());
        // The graph's type for float constants (reduced precision converts at upload).
        let cdt = if Some(q4.dt) == self.precision {
            Dt::F32
        } else {
            q4.dt
        };
        if let Some(m) = node.input(3) {
            let bias = self.attention_mask(node, &base, m, q4.dt, cdt, [b, qh, sq, t])?;
            cur = self.sub(node, &base, "Add", &[&cur, &bias], "masked")?;
        }
        if node.int("is_causal", 0) != 0 {
            let c = causal_bias(sq, t, past);
            let causal = self.constant(&base, "causal", cdt, vec![sq, t], c);
            cur = self.sub(node, &base, "Add", &[&cur, &causal], "causal_masked")?;
        }
        if mode == 1 {
            qk = Some(cur.clone());
        }
        let softcap = node.float("softcap", 0.0);
        if softcap > 0.0 {
            let s = self.constant(&base, "softcap", cdt, vec![], vec![softcap as f64]);
            let x = self.sub(node, &base, "Div", &[&cur, &s], "capped_div")?;
            let x = self.sub(node, &base, "Tanh", &[&x], "capped_tanh")?;
            cur = self.sub(node, &base, "Mul", &[&x, &s], "capped")?;
        }
        if mode == 2 {
            qk = Some(cur.clone());
        }
        let probs = Node::new(
            "Softmax",
            format!("{base}/Softmax"),
            vec![cur],
            vec![format!("{base}/probs")],
        )
        .with_int("axis", -1);
        self.node(&probs)?;
        let probs = format!("{base}/probs");
        if mode == 3 {
            qk = Some(probs.clone());
        }
        let p = self.dev(&probs)?;
        // Y (b, qh, sq, dv) = P V: per (batch, kv head), the g * sq rows of P [rows, t]
        // times V [t, dv].
        fits32(node, &[dv, rows, t, b * kvh])?;
        let y4 = self.temp(q4.dt, vec![b, qh, sq, dv]);
        self.push(Step::Gemm {
            g: GemmArgs {
                trans_a: false,
                trans_b: false,
                m: dv as i32,
                n: rows as i32,
                k: t as i32,
                lda: dv as i32,
                ldb: t as i32,
                ldc: dv as i32,
                stride_a: t * dv,
                stride_b: rows * t,
                stride_c: rows * dv,
                batch: (b * kvh) as i32,
                alpha: 1.0,
                beta: 0.0,
                dt: ft,
            },
            a: v4.ptr.clone(),
            b: p.ptr.clone(),
            c: y4.ptr.clone(),
        });
        let y = if rank == 3 {
            // (b, qh, sq, dv) -> (b, sq, qh, dv) -> (b, sq, qh * dv).
            let yt = self.transpose(node, &y4, &[0, 2, 1, 3])?;
            Dev {
                shape: vec![b, sq, qh * dv],
                ..yt
            }
        } else {
            y4
        };
        self.set(node, 0, Val::Dev(y));
        self.set(node, 1, Val::Dev(k4));
        self.set(node, 2, Val::Dev(v4));
        if let Some(name) = qk {
            let d = self.dev(&name)?;
            self.set(node, 3, Val::Dev(d));
        }
        Ok(())
    }

    /// Attention's `attn_mask` as an additive bias (named): a boolean mask becomes 0 and
    /// -inf, a mask shorter than the keys is padded with -inf. `cdt` is the graph's type
    /// for float constants, `scores` the shape the bias is added to.
    fn attention_mask(
        &mut self,
        node: &Node,
        base: &str,
        m: &str,
        qdt: Dt,
        cdt: Dt,
        scores: [i64; 4],
    ) -> Result<String> {
        let bad = |why: String| Error::invalid(format!("{}: {why}", node.label()));
        let t = scores[3];
        let md = self.dev(m)?;
        let mut bias = m.to_owned();
        if md.dt == Dt::Bool {
            let zero = self.constant(base, "zero", cdt, vec![], vec![0.0]);
            let ninf = self.constant(base, "ninf", cdt, vec![], vec![f64::NEG_INFINITY]);
            bias = self.sub(node, base, "Where", &[&bias, &zero, &ninf], "mask_bias")?;
        } else if md.dt != qdt {
            return Err(bad(format!(
                "attn_mask is {}; it must be BOOL or the type of Q ({})",
                md.dt.name(),
                qdt.name()
            )));
        }
        // A mask shorter than the keys leaves the rest out (-inf; opset 24). Before,
        // a last dim of 1 broadcasts.
        let last = md.shape.last().copied().unwrap_or(1);
        if md.shape.is_empty() || last > t {
            return Err(bad(format!(
                "attn_mask {:?} does not broadcast to {:?}",
                md.shape, scores
            )));
        }
        if last < t && (last != 1 || self.graph.opset >= 24) {
            let r = md.shape.len();
            let mut pads = vec![0i64; 2 * r];
            pads[2 * r - 1] = t - last;
            let pads = self.constant(
                base,
                "mask_pads",
                Dt::I64,
                vec![2 * r as i64],
                pads.iter().map(|&x| x as f64).collect(),
            );
            let ninf = self.constant(base, "pad_ninf", cdt, vec![], vec![f64::NEG_INFINITY]);
            bias = self.sub(node, base, "Pad", &[&bias, &pads, &ninf], "mask_padded")?;
        }
        Ok(bias)
    }

    /// `x` as (batch, heads, sequence, head size): 4-D as it is; 3-D (batch, sequence,
    /// heads * head size) split into heads and transposed.
    fn heads(&mut self, node: &Node, x: &Dev, heads: i64) -> Result<Dev> {
        if x.shape.len() == 4 {
            return Ok(x.clone());
        }
        let (b, s, hidden) = (x.shape[0], x.shape[1], x.shape[2]);
        if hidden % heads != 0 {
            return Err(Error::invalid(format!(
                "{}: a hidden size of {hidden} does not split into {heads} heads",
                node.label()
            )));
        }
        let split = Dev {
            shape: vec![b, s, heads, hidden / heads],
            ..x.clone()
        };
        self.transpose(node, &split, &[0, 2, 1, 3])
    }

    /// The cache `past` followed by the new keys or values `new` along the sequence.
    fn sub_concat(
        &mut self,
        node: &Node,
        base: &str,
        what: &str,
        past: &str,
        new: &Dev,
    ) -> Result<Dev> {
        let n = self.named(base, &format!("{what}_new"), new.clone());
        let out = Node::new(
            "Concat",
            format!("{base}/Concat"),
            vec![past.to_owned(), n],
            vec![format!("{base}/{what}")],
        )
        .with_int("axis", 2);
        self.node(&out).map_err(|e| e.context(node.label()))?;
        self.dev(&format!("{base}/{what}"))
    }
}

/// Refuses what the executor does not take of Attention's inputs and attributes; the
/// `qk_matmul_output_mode`.
fn attention_mode(node: &Node) -> Result<i64> {
    let bad = |why: String| Error::invalid(format!("{}: {why}", node.label()));
    if node.input(6).is_some() {
        return Err(unsupported(node, "nonpad_kv_seqlen"));
    }
    for a in ["left_window_size", "right_window_size"] {
        if node.int(a, -1) != -1 {
            return Err(unsupported(node, a));
        }
    }
    let mode = node.int("qk_matmul_output_mode", 0);
    if !(0..=3).contains(&mode) {
        return Err(bad(format!("qk_matmul_output_mode {mode}")));
    }
    // Softmax runs in FP32 whatever the tensors' type.
    let sp = node.int("softmax_precision", 1);
    if !matches!(sp, 1 | 10 | 16) {
        return Err(unsupported(node, format!("softmax_precision {sp}")));
    }
    Ok(mode)
}

/// The causal mask of `sq` queries over `t` keys as a bias: query i (at position past + i)
/// sees keys up to past + i (0), not the later ones (-inf).
fn causal_bias(sq: i64, t: i64, past: i64) -> Vec<f64> {
    let mut c = Vec::with_capacity((sq * t).max(0) as usize);
    for i in 0..sq {
        for j in 0..t {
            c.push(if j <= past + i {
                0.0
            } else {
                f64::NEG_INFINITY
            });
        }
    }
    c
}
