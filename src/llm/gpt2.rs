//! The GPT-2 forward pass over a packed batch of sequences and a paged KV cache.
//!
//! A step takes any mix of prefill chunks and decode tokens, packed without padding into
//! one `[T, n_embd]` activation matrix. Every token's result is bitwise the same however
//! the batch is composed or chunked (see `kernels`); this module must never introduce an
//! operation whose order depends on the batch (no sums over tokens, no size-dependent
//! kernels).

use super::attention::{self, AttentionShape, TokenSlot};
use super::config::Gpt2Config;
use super::kernels::{self, Epilogue, Exec};
use super::kv::KvCache;
use super::step::{Logits, StepSeq};
use super::weights::Gpt2;
use crate::status::{Error, Result};
use std::sync::Arc;

/// Multiply-adds below which a kernel stays on the calling thread.
const MIN_PARALLEL_WORK: usize = 1 << 18;

/// Reusable buffers and the thread pool of one model instance. Not shared between
/// threads (`step` takes `&mut self`); one Runner per instance.
pub struct Runner {
    model: Arc<Gpt2>,
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    pub(crate) min_par_work: usize,
    /// Per token of the step: its sequence and position.
    slots: Vec<TokenSlot>,
    /// Tokens whose logits are returned, in order.
    head_rows: Vec<u32>,
    /// Which sequence of which step last claimed a block for writing (see `plan`).
    claims: Vec<u64>,
    step_no: u32,
    hidden: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    fc: Vec<f32>,
    head_in: Vec<f32>,
    /// One attention score buffer (`[n_head][n_positions]`) per thread part.
    scores: Vec<Vec<f32>>,
}

impl Runner {
    /// `threads`: 0 = one per available core, 1 = no pool (everything on the caller's
    /// thread).
    pub fn new(model: Arc<Gpt2>, threads: usize) -> Result<Runner> {
        model.config.validate()?;
        model.check_shapes()?;
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let pool = if threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("infer-gpt2-{i}"))
                .build()
                .map_err(|e| {
                    Error::exhausted(format!("cannot start {threads} GPT-2 threads: {e}"))
                })?;
            Some(pool)
        } else {
            None
        };
        let score_len = model.config.n_head.saturating_mul(model.config.n_positions);
        let scores = (0..threads).map(|_| vec![0.0; score_len]).collect();
        Ok(Runner {
            model,
            pool,
            threads,
            min_par_work: MIN_PARALLEL_WORK,
            slots: Vec::new(),
            head_rows: Vec::new(),
            claims: Vec::new(),
            step_no: 0,
            hidden: Vec::new(),
            normed: Vec::new(),
            qkv: Vec::new(),
            attn: Vec::new(),
            proj: Vec::new(),
            fc: Vec::new(),
            head_in: Vec::new(),
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
        logits.clear();
        let model = Arc::clone(&self.model);
        let c = &model.config;
        self.plan(c, kv, seqs)?;
        let t = self.slots.len();
        if t == 0 {
            return Ok(());
        }
        let (e, i, v) = (c.n_embd, c.n_inner, c.vocab_size);
        let rows = self.head_rows.len();
        // Every allocation happens before the cache is touched, so running out of memory
        // (RESOURCE_EXHAUSTED) also leaves it as it was.
        let hidden = grow(&mut self.hidden, t * e)?;
        let normed = grow(&mut self.normed, t * e)?;
        let qkv = grow(&mut self.qkv, t * 3 * e)?;
        let attn = grow(&mut self.attn, t * e)?;
        let proj = grow(&mut self.proj, t * e)?;
        let fc = grow(&mut self.fc, t * i)?;
        let head_in = grow(&mut self.head_in, rows * e)?;
        grow(logits, rows * v)?;
        let exec = Exec {
            pool: self.pool.as_ref(),
            threads: self.threads,
            min_par_work: self.min_par_work,
        };

        let mut ti = 0;
        for s in seqs {
            for (j, &tok) in s.tokens.iter().enumerate() {
                model.embed(tok as usize, s.start + j, &mut hidden[ti * e..(ti + 1) * e]);
                ti += 1;
            }
        }

        let eps = c.layer_norm_epsilon;
        let hd = c.head_dim();
        for (l, b) in model.blocks.iter().enumerate() {
            kernels::layer_norm_rows(exec, hidden, &b.ln_1.weight, &b.ln_1.bias, eps, normed);
            kernels::gemm(
                exec,
                (t, e, 3 * e),
                normed,
                &b.attn_w,
                qkv,
                Epilogue::Bias(&b.attn_b),
            );
            for (r, slot) in self.slots.iter().enumerate() {
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
            let mut divisor = 1.0f32;
            if c.scale_attn_weights {
                divisor = (hd as f32).sqrt();
            }
            if c.scale_attn_by_inverse_layer_idx {
                divisor *= (l + 1) as f32;
            }
            let shape = AttentionShape {
                n_head: c.n_head,
                head_dim: hd,
                layer: l,
                divisor,
            };
            attention::attention(
                exec,
                &shape,
                qkv,
                kv,
                &self.slots,
                seqs,
                &mut self.scores,
                attn,
            );
            kernels::gemm(
                exec,
                (t, e, e),
                attn,
                &b.attn_proj_w,
                proj,
                Epilogue::BiasResidual(&b.attn_proj_b, hidden),
            );
            kernels::layer_norm_rows(exec, hidden, &b.ln_2.weight, &b.ln_2.bias, eps, normed);
            kernels::gemm(
                exec,
                (t, e, i),
                normed,
                &b.fc_w,
                fc,
                Epilogue::BiasActivation(&b.fc_b, c.activation),
            );
            kernels::gemm(
                exec,
                (t, i, e),
                fc,
                &b.mlp_proj_w,
                proj,
                Epilogue::BiasResidual(&b.mlp_proj_b, hidden),
            );
        }

        if rows > 0 {
            for (o, &r) in head_in.chunks_exact_mut(e).zip(&self.head_rows) {
                let r = r as usize;
                kernels::layer_norm(
                    &hidden[r * e..(r + 1) * e],
                    &model.ln_f.weight,
                    &model.ln_f.bias,
                    eps,
                    o,
                );
            }
            kernels::gemm(
                exec,
                (rows, e, v),
                head_in,
                &model.head_t,
                logits,
                Epilogue::None,
            );
        }
        Ok(())
    }

    /// Validates the step and lays out its tokens (`slots`, `head_rows`).
    fn plan(&mut self, c: &Gpt2Config, kv: &KvCache, seqs: &[StepSeq<'_>]) -> Result<()> {
        self.slots.clear();
        self.head_rows.clear();
        if !kv.fits(c) {
            return Err(Error::invalid(
                "the KV cache was made for a model of another shape",
            ));
        }
        let tpb = kv.tokens_per_block();
        if self.claims.len() < kv.num_blocks() {
            self.claims.resize(kv.num_blocks(), 0);
        }
        self.step_no = self.step_no.wrapping_add(1);
        if self.step_no == 0 {
            // Claims of 2^32 steps ago would look current: forget them all.
            self.claims.fill(0);
            self.step_no = 1;
        }
        let stamp = (self.step_no as u64) << 32;
        let check = |seqs: &[StepSeq<'_>], claims: &mut [u64]| -> Result<()> {
            for (si, s) in seqs.iter().enumerate() {
                let err = |what: String| Err(Error::invalid(format!("step sequence {si}: {what}")));
                let end = s.start.saturating_add(s.tokens.len());
                if s.tokens.is_empty() && s.logits == Logits::Last {
                    return err("asks for the last token's logits but has no tokens".into());
                }
                if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                    return err(format!(
                        "token id {bad} is outside the vocabulary ({})",
                        c.vocab_size
                    ));
                }
                if end > c.n_positions {
                    return err(format!(
                        "positions {}..{end} go past the model's {} positions",
                        s.start, c.n_positions
                    ));
                }
                let needed = end.div_ceil(tpb);
                if s.blocks.len() < needed {
                    return err(format!(
                        "{} blocks of {tpb} tokens cannot hold {end} positions",
                        s.blocks.len()
                    ));
                }
                if let Some(&bad) = s.blocks[..needed]
                    .iter()
                    .find(|&&b| b as usize >= kv.num_blocks())
                {
                    return err(format!("block id {bad} is not below {}", kv.num_blocks()));
                }
                if s.tokens.is_empty() {
                    continue;
                }
                for &b in &s.blocks[s.start / tpb..needed] {
                    let claim = &mut claims[b as usize];
                    let mine = stamp | si as u64;
                    if *claim >> 32 == stamp >> 32 && *claim != mine {
                        return err(format!(
                            "writes block {b}, which sequence {} of the step writes too",
                            *claim & 0xffff_ffff
                        ));
                    }
                    *claim = mine;
                }
            }
            Ok(())
        };
        check(seqs, &mut self.claims)?;
        for (si, s) in seqs.iter().enumerate() {
            for j in 0..s.tokens.len() {
                if s.logits == Logits::All || (s.logits == Logits::Last && j + 1 == s.tokens.len())
                {
                    self.head_rows.push(self.slots.len() as u32);
                }
                self.slots.push(TokenSlot {
                    seq: si as u32,
                    pos: (s.start + j) as u32,
                });
            }
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
