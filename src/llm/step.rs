//! What one step of a decoder is asked to compute: the types the forward passes, the
//! attention and the scheduler share, and the validation and layout of a step's tokens
//! that every decoder runs first.

use super::kv::KvCache;
use crate::status::{Error, Result};

/// Which logits a sequence wants from a step.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Logits {
    None,
    /// The last token's row.
    Last,
    /// One row per token.
    All,
}

/// One sequence's share of a step: process `tokens`, which sit at positions
/// `start..start + tokens.len()`; positions `0..start` are already in the cache. `blocks`
/// is the sequence's block table and covers at least positions `0..start + tokens.len()`
/// (block `i` holds positions `i * tpb..(i + 1) * tpb`). The step writes K/V of the new
/// positions; the blocks it writes must not be written by another sequence of the step.
#[derive(Clone, Copy, Debug)]
pub struct StepSeq<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub blocks: &'a [u32],
    pub logits: Logits,
}

/// One token's place in a step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenSlot {
    /// Index of its sequence in the step.
    pub seq: u32,
    /// Its position in that sequence.
    pub pos: u32,
}

/// A step's tokens laid out: per token its sequence and position, which rows return
/// logits, and the bookkeeping that refuses two sequences writing one block.
#[derive(Default)]
pub(crate) struct Planner {
    /// Per token of the step: its sequence and position.
    pub slots: Vec<TokenSlot>,
    /// Tokens whose logits are returned, in order.
    pub head_rows: Vec<u32>,
    /// Their slots, in the same order.
    pub head_slots: Vec<TokenSlot>,
    /// Which sequence of which step last claimed a block for writing (see `plan`).
    claims: Vec<u64>,
    step_no: u32,
}

impl Planner {
    /// Validates the step and lays out its tokens (`slots`, `head_rows`).
    pub(crate) fn plan(
        &mut self,
        vocab_size: usize,
        n_positions: usize,
        kv: &KvCache,
        seqs: &[StepSeq<'_>],
    ) -> Result<()> {
        self.slots.clear();
        self.head_rows.clear();
        self.head_slots.clear();
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
                if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= vocab_size) {
                    return err(format!(
                        "token id {bad} is outside the vocabulary ({})",
                        vocab_size
                    ));
                }
                if end > n_positions {
                    return err(format!(
                        "positions {}..{end} go past the model's {} positions",
                        s.start, n_positions
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
                let slot = TokenSlot {
                    seq: si as u32,
                    pos: (s.start + j) as u32,
                };
                if self.head_rows.last() == Some(&(self.slots.len() as u32)) {
                    self.head_slots.push(slot);
                }
                self.slots.push(slot);
            }
        }
        Ok(())
    }
}

/// Moves rows `rows` (ascending) of `buf`, `width` apart, to its front in that order: a
/// step's last layer keeps only the rows whose logits are returned.
pub(crate) fn keep_rows(rows: &[u32], buf: &mut [f32], width: usize) {
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        // Ascending, so each row moves down or stays.
        buf.copy_within(r * width..(r + 1) * width, i * width);
    }
}
