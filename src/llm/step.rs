//! What one step of a decoder is asked to compute: the types the forward pass, the
//! attention and the scheduler share, with no code of their own.

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
