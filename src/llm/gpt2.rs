//! The GPT-2 forward pass over a packed batch of sequences and a paged KV cache.
//!
//! A step takes any mix of prefill chunks and decode tokens, packed without padding into
//! one `[T, n_embd]` activation matrix. Every token's result is bitwise the same however
//! the batch is composed or chunked (see `kernels`); this module must never introduce an
//! operation whose order depends on the batch (no sums over tokens, no size-dependent
//! kernels).

use super::attention::{self, AttentionShape, Scratch};
use super::kernels::{self, Exec};
use super::kv::KvCache;
use super::linear::{matmul, Acts, Out};
use super::step::{keep_rows, Planner, StepSeq, TokenSlot};
use super::weights::Gpt2;
use crate::status::{Error, Result};
use std::sync::Arc;

/// Multiply-adds below which a kernel stays on the calling thread.
const MIN_PARALLEL_WORK: usize = 1 << 18;

/// Reusable buffers and the thread pool of one model instance. Not shared between
/// threads (`step` takes `&mut self`); one Runner per instance.
pub struct Runner {
    model: Arc<Gpt2>,
    pool: Option<Arc<super::pool::Pool>>,
    threads: usize,
    pub(crate) min_par_work: usize,
    plan: Planner,
    hidden: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    fc: Vec<f32>,
    head_in: Vec<f32>,
    acts: Acts,
    /// One attention scratch per thread part.
    scores: Vec<Scratch>,
}

impl Runner {
    /// `threads`: 0 = one per available core, 1 = no pool (everything on the caller's
    /// thread).
    pub fn new(model: Arc<Gpt2>, threads: usize) -> Result<Runner> {
        model.config.validate()?;
        model.check_shapes()?;
        let (pool, threads) = kernels::thread_pool(threads, "gpt2")?;
        let scores = (0..threads * attention::PARTS_PER_THREAD)
            .map(|_| Scratch::default())
            .collect();
        Ok(Runner {
            model,
            pool: pool.map(Arc::new),
            threads,
            min_par_work: MIN_PARALLEL_WORK,
            plan: Planner::default(),
            hidden: Vec::new(),
            normed: Vec::new(),
            qkv: Vec::new(),
            attn: Vec::new(),
            fc: Vec::new(),
            head_in: Vec::new(),
            acts: Acts::default(),
            scores,
        })
    }

    pub fn model(&self) -> &Gpt2 {
        &self.model
    }

    /// Threads the runner computes on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// One forward pass over all `seqs` packed together. Appends to `logits` (cleared
    /// first) the vocabulary-sized rows asked for, in sequence order (`All`: one row per
    /// token). A step that fails validation (INVALID_ARGUMENT) changes nothing.
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
        pool: Option<&super::pool::Pool>,
        kv: &mut KvCache,
        seqs: &[StepSeq<'_>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        logits.clear();
        let model = Arc::clone(&self.model);
        let c = &model.config;
        if !kv.fits(c) {
            return Err(Error::invalid(
                "the KV cache was made for a model of another shape",
            ));
        }
        self.plan.plan(c.vocab_size, c.n_positions, kv, seqs)?;
        let t = self.plan.slots.len();
        if t == 0 {
            return Ok(());
        }
        let (e, i, v) = (c.n_embd, c.n_inner, c.vocab_size);
        let rows = self.plan.head_rows.len();
        // Every allocation happens before the cache is touched, so running out of memory
        // (RESOURCE_EXHAUSTED) also leaves it as it was.
        let hidden = grow(&mut self.hidden, t * e)?;
        let normed = grow(&mut self.normed, t * e)?;
        let qkv = grow(&mut self.qkv, t * 3 * e)?;
        let attn = grow(&mut self.attn, t * e)?;
        let fc = grow(&mut self.fc, t * i)?;
        let head_in = grow(&mut self.head_in, rows * e)?;
        grow(logits, rows * v)?;
        let exec = Exec {
            pool,
            threads: self.threads,
            min_par_work: self.min_par_work,
        };
        let acts = &mut self.acts;

        let mut ti = 0;
        for s in seqs {
            for (j, &tok) in s.tokens.iter().enumerate() {
                model.embed(tok as usize, s.start + j, &mut hidden[ti * e..(ti + 1) * e]);
                ti += 1;
            }
        }

        let eps = c.layer_norm_epsilon;
        let hd = c.head_dim();
        // The last layer computes every token's keys and values (later tokens attend to
        // them), and the rest of the layer only for the tokens whose logits are returned.
        // Each row's operations are the same either way, so the same bits.
        let mut slots: &[TokenSlot] = &self.plan.slots;
        let mut live = t;
        let last = model.blocks.len().saturating_sub(1);
        for (l, b) in model.blocks.iter().enumerate() {
            kernels::layer_norm_rows(exec, hidden, &b.ln_1.weight, &b.ln_1.bias, eps, normed);
            acts.prepare(exec, normed, t, e, [b.attn.wtype])?;
            matmul(
                exec,
                &b.attn,
                acts,
                normed,
                qkv,
                3 * e,
                Out::Bias(&b.attn_b),
            );
            for (r, slot) in self.plan.slots.iter().enumerate() {
                let pos = slot.pos as usize;
                let block = seqs[slot.seq as usize].blocks[pos / kv.tokens_per_block()];
                let row = &qkv[r * 3 * e..(r + 1) * 3 * e];
                kv.write(
                    block as usize,
                    pos % kv.tokens_per_block(),
                    l,
                    &row[e..2 * e],
                    &row[2 * e..],
                );
            }
            if l == last && rows < t {
                if rows == 0 {
                    break;
                }
                keep_rows(&self.plan.head_rows, hidden, e);
                keep_rows(&self.plan.head_rows, qkv, 3 * e);
                slots = &self.plan.head_slots;
                live = rows;
            }
            let mut divisor = 1.0f32;
            if c.scale_attn_weights {
                divisor = (hd as f32).sqrt();
            }
            if c.scale_attn_by_inverse_layer_idx {
                divisor *= (l + 1) as f32;
            }
            let shape = AttentionShape {
                n_head: c.n_head,
                n_kv_head: c.n_head,
                head_dim: hd,
                q_stride: 3 * e,
                layer: l,
                divisor,
            };
            attention::attention(exec, &shape, qkv, kv, slots, seqs, &mut self.scores, attn);
            acts.prepare(exec, attn, live, e, [b.attn_proj.wtype])?;
            matmul(
                exec,
                &b.attn_proj,
                acts,
                attn,
                hidden,
                e,
                Out::BiasAdd(&b.attn_proj_b),
            );
            let (h, n) = (&hidden[..live * e], &mut normed[..live * e]);
            kernels::layer_norm_rows(exec, h, &b.ln_2.weight, &b.ln_2.bias, eps, n);
            acts.prepare(exec, normed, live, e, [b.fc.wtype])?;
            matmul(exec, &b.fc, acts, normed, fc, i, Out::Bias(&b.fc_b));
            kernels::activate_rows(exec, c.activation, &mut fc[..live * i], i);
            acts.prepare(exec, fc, live, i, [b.mlp_proj.wtype])?;
            matmul(
                exec,
                &b.mlp_proj,
                acts,
                fc,
                hidden,
                e,
                Out::BiasAdd(&b.mlp_proj_b),
            );
        }

        if rows > 0 {
            for (k, (o, &r)) in head_in
                .chunks_exact_mut(e)
                .zip(&self.plan.head_rows)
                .enumerate()
            {
                // The last layer left the returned rows first when it computed only them.
                let r = if live < t { k } else { r as usize };
                kernels::layer_norm(
                    &hidden[r * e..(r + 1) * e],
                    &model.ln_f.weight,
                    &model.ln_f.bias,
                    eps,
                    o,
                );
            }
            acts.prepare(exec, head_in, rows, e, [model.head.wtype])?;
            matmul(exec, &model.head, acts, head_in, logits, v, Out::Set);
        }
        Ok(())
    }
}

/// `v[..n]`, growing `v` (never shrinking it) so steady-state steps do not allocate;
/// RESOURCE_EXHAUSTED instead of aborting when memory runs out.
fn grow(v: &mut Vec<f32>, n: usize) -> Result<&mut [f32]> {
    if v.len() < n {
        v.try_reserve(n - v.len()).map_err(|e| {
            Error::exhausted(format!("GPT-2 step: cannot allocate {n} activations: {e}"))
        })?;
        v.resize(n, 0.0);
    }
    Ok(&mut v[..n])
}

#[cfg(test)]
#[path = "gpt2_tests.rs"]
mod tests;
