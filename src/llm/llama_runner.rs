//! The Llama-family forward pass over a packed batch of sequences and a paged KV cache.
//!
//! As in `gpt2`, a step takes any mix of prefill chunks and decode tokens packed into one
//! `[T, n_embd]` matrix, and every token's result is bitwise the same however the batch
//! is composed, chunked or split over threads: matrix products are one dot product per
//! output (`linear`), attention is per token (`attention`), and everything else is per
//! row.

use super::attention::{self, AttentionShape, Scratch};
use super::kernels::{exp_nonpositive, par_rows, reduce8, Exec};
use super::kv::KvCache;
use super::linear::{combines, matmul, matmul_combined, matmuls, Acts, Blocking, Out, Target};
use super::llama::{Llama, RopeStyle};
use super::pool::Pool;
use super::step::{keep_rows, Planner, StepSeq, TokenSlot};
use crate::status::{Error, Result};
use std::sync::Arc;

/// Multiply-adds below which a kernel stays on the calling thread.
const MIN_PARALLEL_WORK: usize = 1 << 16;

/// Reusable buffers and the thread pool of one model instance (one per instance; `step`
/// takes `&mut self`).
pub struct LlamaRunner {
    model: Arc<Llama>,
    pool: Option<Arc<Pool>>,
    threads: usize,
    pub(crate) min_par_work: usize,
    plan: Planner,
    hidden: Vec<f32>,
    normed: Vec<f32>,
    /// `[T][q | k | v]`.
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    head_in: Vec<f32>,
    /// Per token: cos and sin of each rotary pair's angle.
    rope: Vec<f32>,
    acts: Acts,
    scratch: Vec<Scratch>,
}

impl LlamaRunner {
    /// `threads`: 0 = one per available core, 1 = everything on the caller's thread.
    pub fn new(model: Arc<Llama>, threads: usize) -> Result<LlamaRunner> {
        let (pool, threads) = super::kernels::thread_pool(threads, "llm")?;
        Ok(LlamaRunner {
            model,
            pool: pool.map(Arc::new),
            threads,
            min_par_work: MIN_PARALLEL_WORK,
            plan: Planner::default(),
            hidden: Vec::new(),
            normed: Vec::new(),
            qkv: Vec::new(),
            attn: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            head_in: Vec::new(),
            rope: Vec::new(),
            acts: Acts::default(),
            scratch: (0..threads * attention::PARTS_PER_THREAD)
                .map(|_| Scratch::default())
                .collect(),
        })
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// One forward pass over all `seqs` packed together: appends to `logits` (cleared
    /// first) the vocabulary-sized rows asked for, in sequence order. A step that fails
    /// validation (INVALID_ARGUMENT) changes nothing.
    pub fn step(
        &mut self,
        kv: &mut KvCache,
        seqs: &[StepSeq<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let pool = self.pool.clone();
        self.step_on(pool.as_deref(), kv, seqs, logits)
    }

    fn step_on(
        &mut self,
        pool: Option<&Pool>,
        kv: &mut KvCache,
        seqs: &[StepSeq<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        logits.clear();
        let model = Arc::clone(&self.model);
        let c = &model.config;
        if !kv.fits(c.kv_shape(kv.shape().dtype)) {
            return Err(Error::invalid(
                "the KV cache was made for a model of another shape",
            ));
        }
        self.plan.plan(c.vocab_size, c.n_ctx, kv, seqs)?;
        let t = self.plan.slots.len();
        if t == 0 {
            return Ok(());
        }
        let (e, hd, ff, v) = (c.n_embd, c.head_dim, c.n_ff, c.vocab_size);
        let (qw, kvw) = (c.n_head * hd, c.n_kv_head * hd);
        let width = qw + 2 * kvw;
        let rows = self.plan.head_rows.len();
        let pairs = c.rope_dims / 2;
        // Every allocation happens before the cache is touched.
        let hidden = grow(&mut self.hidden, t * e)?;
        let normed = grow(&mut self.normed, t * e)?;
        let qkv = grow(&mut self.qkv, t * width)?;
        let attn = grow(&mut self.attn, t * qw)?;
        let gate = grow(&mut self.gate, t * ff)?;
        // The up projection's outputs need a buffer only for the rows of the layers that
        // cannot run it side by side with the gate's (`combines`); the last layer may run
        // fewer rows.
        let separate = |(l, b): (usize, &super::llama::Layer)| {
            let n = if l + 1 == model.layers.len() { rows } else { t };
            (n > 0 && !combines(&b.gate, &b.up, n)).then_some(n)
        };
        let up_rows = model.layers.iter().enumerate().filter_map(separate).max();
        let up = grow(&mut self.up, up_rows.unwrap_or(0) * ff)?;
        let head_in = grow(&mut self.head_in, rows * e)?;
        let rope = grow(&mut self.rope, t * 2 * pairs)?;
        grow(logits, rows * v)?;
        let exec = Exec {
            pool,
            threads: self.threads,
            min_par_work: self.min_par_work,
        };
        let acts = &mut self.acts;

        let mut ti = 0;
        for s in seqs {
            for &tok in s.tokens {
                model
                    .embed
                    .row_f32(tok as usize, &mut hidden[ti * e..(ti + 1) * e]);
                ti += 1;
            }
        }
        for (slot, cs) in self.plan.slots.iter().zip(rope.chunks_exact_mut(2 * pairs)) {
            let pos = slot.pos as f32;
            for (i, &f) in c.inv_freq.iter().enumerate() {
                let a = (pos * f) as f64;
                cs[2 * i] = a.cos() as f32;
                cs[2 * i + 1] = a.sin() as f32;
            }
        }

        let shape = |layer| AttentionShape {
            n_head: c.n_head,
            n_kv_head: c.n_kv_head,
            head_dim: hd,
            q_stride: width,
            layer,
            divisor: (hd as f32).sqrt(),
        };
        // The last layer computes every token's keys and values (later tokens attend to
        // them), and the rest of the layer (attention, the output projection, the MLP)
        // only for the tokens whose logits are returned: a prompt's last token, not the
        // other 127 of it. Each row's operations are the same either way, so the same bits.
        let mut slots: &[TokenSlot] = &self.plan.slots;
        let mut live = t;
        let last = model.layers.len().saturating_sub(1);
        for (l, b) in model.layers.iter().enumerate() {
            let types = [b.wq.wtype, b.wk.wtype, b.wv.wtype];
            acts.fill_and_prepare(exec, normed, t, e, types, |r, o| {
                rms_norm(&hidden[r * e..(r + 1) * e], &b.attn_norm, c.rms_eps, o)
            })?;
            let (bq, bk, bv) = match &b.qkv_bias {
                Some(bias) => (
                    Out::Bias(&bias[..qw]),
                    Out::Bias(&bias[qw..qw + kvw]),
                    Out::Bias(&bias[qw + kvw..]),
                ),
                None => (Out::Set, Out::Set, Out::Set),
            };
            let qkv_products = [
                (&b.wq, 0, 0, bq),
                (&b.wk, 0, qw, bk),
                (&b.wv, 0, qw + kvw, bv),
            ];
            let target = &mut [Target { y: qkv, ldy: width }];
            matmuls(exec, &qkv_products, acts, normed, target, Blocking::DEFAULT);
            let rope = &*rope;
            par_rows(exec, t * width, &mut qkv[..t * width], width, |r, row| {
                let cs = &rope[r * 2 * pairs..(r + 1) * 2 * pairs];
                for head in row[..qw + kvw].chunks_exact_mut(hd) {
                    rotate(head, cs, c.rope_style, c.rope_dims);
                }
            });
            for (r, slot) in self.plan.slots.iter().enumerate() {
                let pos = slot.pos as usize;
                let block = seqs[slot.seq as usize].blocks[pos / kv.tokens_per_block()];
                let row = &qkv[r * width..(r + 1) * width];
                kv.write(
                    block as usize,
                    pos % kv.tokens_per_block(),
                    l,
                    &row[qw..qw + kvw],
                    &row[qw + kvw..],
                );
            }
            if l == last && rows < t {
                if rows == 0 {
                    break;
                }
                keep_rows(&self.plan.head_rows, hidden, e);
                keep_rows(&self.plan.head_rows, qkv, width);
                slots = &self.plan.head_slots;
                live = rows;
            }
            attention::attention(
                exec,
                &shape(l),
                qkv,
                kv,
                slots,
                seqs,
                &mut self.scratch,
                attn,
            );
            acts.prepare(exec, attn, live, qw, [b.wo.wtype])?;
            matmul(exec, &b.wo, acts, attn, hidden, e, Out::Add);
            if let Some(bias) = &b.wo_bias {
                for row in hidden[..live * e].chunks_exact_mut(e) {
                    row.iter_mut().zip(bias).for_each(|(h, b)| *h += b);
                }
            }

            acts.fill_and_prepare(exec, normed, live, e, [b.gate.wtype, b.up.wtype], |r, o| {
                rms_norm(&hidden[r * e..(r + 1) * e], &b.ffn_norm, c.rms_eps, o)
            })?;
            if combines(&b.gate, &b.up, live) {
                // SiLU(gate) x up as each kernel call's outputs come: the two products'
                // outputs never go to memory.
                matmul_combined(exec, &b.gate, &b.up, acts, normed, gate, ff, |g, u, h| {
                    h.copy_from_slice(g);
                    silu_mul(h, u);
                });
                acts.prepare(exec, gate, live, ff, [b.down.wtype])?;
            } else {
                let gate_up = [(&b.gate, 0, 0, Out::Set), (&b.up, 1, 0, Out::Set)];
                let targets = &mut [Target { y: gate, ldy: ff }, Target { y: up, ldy: ff }];
                matmuls(exec, &gate_up, acts, normed, targets, Blocking::DEFAULT);
                let up = &*up;
                acts.fill_and_prepare(exec, gate, live, ff, [b.down.wtype], |r, g| {
                    silu_mul(g, &up[r * ff..(r + 1) * ff])
                })?;
            }
            matmul(exec, &b.down, acts, gate, hidden, e, Out::Add);
        }

        if rows > 0 {
            for (i, (o, &r)) in head_in
                .chunks_exact_mut(e)
                .zip(&self.plan.head_rows)
                .enumerate()
            {
                // The last layer left the returned rows first when it computed only them.
                let r = if live < t { i } else { r as usize };
                rms_norm(&hidden[r * e..(r + 1) * e], &model.norm, c.rms_eps, o);
            }
            acts.prepare(exec, head_in, rows, e, [model.head.wtype])?;
            matmul(exec, &model.head, acts, head_in, logits, v, Out::Set);
        }
        Ok(())
    }
}

/// `g[i] = silu(g[i]) · u[i]`, where `silu(g) = g / (1 + e^-g)`: computed as
/// `g · n / (1 + a)` with `a = e^-|g|` ([`exp_nonpositive`], a loop that vectorizes)
/// and `n` 1 for `g >= 0`, `a` below (0 below -100). On x86-64 with AVX2 (or AVX-512)
/// the same loop compiled for it runs: the same operations (no fused multiply-add), so
/// the same bits.
fn silu_mul(g: &mut [f32], u: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2(g: &mut [f32], u: &[f32]) {
        silu_mul_portable(g, u)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    fn avx512(g: &mut [f32], u: &[f32]) {
        silu_mul_portable(g, u)
    }
    #[cfg(target_arch = "x86_64")]
    if super::quant::avx512() {
        // SAFETY: the CPU has AVX-512 F, BW and VL.
        return unsafe { avx512(g, u) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2(g, u) };
    }
    silu_mul_portable(g, u)
}

#[inline(always)]
fn silu_mul_portable(g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        let a = exp_nonpositive(-g.abs());
        // Below -100, e^g · g is under f32's smallest number (and e^-|g| stops at e^-87).
        let n = if *g >= 0.0 {
            1.0
        } else if *g < -100.0 {
            0.0
        } else {
            a
        };
        *g = *g * n / (1.0 + a) * u;
    }
}

/// Rotates one head's first `dims` dimensions by the angles in `cs` (cos, sin pairs).
#[inline]
fn rotate(head: &mut [f32], cs: &[f32], style: RopeStyle, dims: usize) {
    let half = dims / 2;
    for i in 0..half {
        let (c, s) = (cs[2 * i], cs[2 * i + 1]);
        let (a, b) = match style {
            RopeStyle::Half => (i, i + half),
            RopeStyle::Adjacent => (2 * i, 2 * i + 1),
        };
        let (x0, x1) = (head[a], head[b]);
        head[a] = x0 * c - x1 * s;
        head[b] = x1 * c + x0 * s;
    }
}

/// `out = x / sqrt(mean(x²) + eps) · w`, the sum of squares in eight fixed lanes.
#[inline]
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for ch in &mut chunks {
        for l in 0..8 {
            acc[l] += ch[l] * ch[l];
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        acc[l] += v * v;
    }
    let rstd = 1.0 / (reduce8(acc) / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = v * rstd * w;
    }
}

fn grow(v: &mut Vec<f32>, n: usize) -> Result<&mut [f32]> {
    if v.len() < n {
        v.try_reserve(n - v.len()).map_err(|e| {
            Error::exhausted(format!(
                "decoder step: cannot allocate {n} activations: {e}"
            ))
        })?;
        v.resize(n, 0.0);
    }
    Ok(&mut v[..n])
}

#[cfg(test)]
#[path = "llama_tests.rs"]
mod tests;
