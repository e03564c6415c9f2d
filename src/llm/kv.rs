//! The paged KV cache of one model instance.
//!
//! The cache owns the memory and its layout; which sequence owns which block is the
//! scheduler's business (a block table per sequence), never this module's.
//!
//! Layout: block → layer → (K, V) → head → position in the block → head_dim. One head's
//! keys (or values) for a whole block are contiguous, which is what attention reads.

use super::config::Gpt2Config;
use crate::status::{Error, Result};

/// The KV cache of one model instance: `num_blocks` blocks of `tokens_per_block`
/// positions, each holding K and V of every layer.
pub struct KvCache {
    data: Vec<f32>,
    tokens_per_block: usize,
    num_blocks: usize,
    n_layer: usize,
    n_head: usize,
    head_dim: usize,
    /// f32s per block.
    block_len: usize,
}

impl KvCache {
    /// Fails with RESOURCE_EXHAUSTED if the memory cannot be allocated (never aborts),
    /// INVALID_ARGUMENT for a bad config or zero sizes.
    pub fn new(config: &Gpt2Config, tokens_per_block: usize, num_blocks: usize) -> Result<KvCache> {
        config.validate()?;
        if tokens_per_block == 0 || num_blocks == 0 {
            return Err(Error::invalid(format!(
                "KV cache: tokens_per_block ({tokens_per_block}) and num_blocks ({num_blocks}) must be positive"
            )));
        }
        let too_big = || {
            Error::exhausted(format!(
                "KV cache: {num_blocks} blocks of {tokens_per_block} tokens do not fit in memory"
            ))
        };
        let block_len = block_len(config, tokens_per_block).ok_or_else(too_big)?;
        let len = block_len.checked_mul(num_blocks).ok_or_else(too_big)?;
        len.checked_mul(4)
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(too_big)?;
        if num_blocks > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "KV cache: {num_blocks} blocks do not fit u32 block ids"
            )));
        }
        let mut data = Vec::new();
        data.try_reserve_exact(len).map_err(|e| {
            Error::exhausted(format!(
                "KV cache: cannot allocate {} bytes ({num_blocks} blocks of {tokens_per_block} tokens): {e}",
                len * 4
            ))
        })?;
        data.resize(len, 0.0);
        Ok(KvCache {
            data,
            tokens_per_block,
            num_blocks,
            n_layer: config.n_layer,
            n_head: config.n_head,
            head_dim: config.head_dim(),
            block_len,
        })
    }

    /// Bytes one block takes (saturates instead of overflowing).
    pub fn bytes_per_block(config: &Gpt2Config, tokens_per_block: usize) -> usize {
        block_len(config, tokens_per_block)
            .and_then(|n| n.checked_mul(4))
            .unwrap_or(usize::MAX)
    }

    pub fn tokens_per_block(&self) -> usize {
        self.tokens_per_block
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Copies block `src` (every layer's K and V) onto block `dst`: copy-on-write for a
    /// scheduler whose sequences share a prefix block that one of them must extend.
    pub fn copy_block(&mut self, src: u32, dst: u32) -> Result<()> {
        let (src, dst) = (src as usize, dst as usize);
        if src >= self.num_blocks || dst >= self.num_blocks {
            return Err(Error::invalid(format!(
                "KV cache: block {} is not below {}",
                src.max(dst),
                self.num_blocks
            )));
        }
        let n = self.block_len;
        self.data.copy_within(src * n..(src + 1) * n, dst * n);
        Ok(())
    }

    /// Whether this cache was made for a model of this shape.
    pub(crate) fn fits(&self, config: &Gpt2Config) -> bool {
        self.n_layer == config.n_layer
            && self.n_head == config.n_head
            && self.head_dim == config.head_dim()
    }

    /// Offset of (block, layer, K or V, head, slot 0).
    #[inline]
    fn offset(&self, block: usize, layer: usize, value: bool, head: usize) -> usize {
        let tpb_hd = self.tokens_per_block * self.head_dim;
        block * self.block_len + (layer * 2 + value as usize) * self.n_head * tpb_hd + head * tpb_hd
    }

    /// One head's keys (`value` false) or values for all positions of a block:
    /// `[tokens_per_block][head_dim]`.
    #[inline]
    pub(crate) fn head(&self, block: usize, layer: usize, value: bool, head: usize) -> &[f32] {
        let o = self.offset(block, layer, value, head);
        &self.data[o..o + self.tokens_per_block * self.head_dim]
    }

    /// Stores one position's K and V (each `[n_head * head_dim]`, heads in order).
    pub(crate) fn write(&mut self, block: usize, slot: usize, layer: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for (value, src) in [(false, k), (true, v)] {
            for h in 0..self.n_head {
                let o = self.offset(block, layer, value, h) + slot * hd;
                self.data[o..o + hd].copy_from_slice(&src[h * hd..(h + 1) * hd]);
            }
        }
    }
}

fn block_len(config: &Gpt2Config, tokens_per_block: usize) -> Option<usize> {
    config
        .n_layer
        .checked_mul(2)?
        .checked_mul(config.n_embd)?
        .checked_mul(tokens_per_block)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    fn tiny() -> Gpt2Config {
        Gpt2Config {
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            n_inner: 256,
            vocab_size: 256,
            n_positions: 128,
            ..Gpt2Config::default()
        }
    }

    #[test]
    fn sizes() {
        let c = tiny();
        assert_eq!(KvCache::bytes_per_block(&c, 16), 2 * 2 * 64 * 16 * 4);
        let kv = KvCache::new(&c, 16, 10).unwrap();
        assert_eq!(kv.tokens_per_block(), 16);
        assert_eq!(kv.num_blocks(), 10);
        assert!(kv.fits(&c));
        assert_eq!(KvCache::bytes_per_block(&c, usize::MAX), usize::MAX);
    }

    #[test]
    fn too_large_is_resource_exhausted() {
        let c = tiny();
        for (tpb, blocks) in [
            (16, usize::MAX / 2),
            (16, u32::MAX as usize),
            (usize::MAX / 4, 1),
        ] {
            let e = KvCache::new(&c, tpb, blocks).err().unwrap();
            assert_eq!(e.code, Code::ResourceExhausted, "{e}");
        }
        // Not an overflow, just more than any machine has (2^50 bytes).
        let e = KvCache::new(&c, 1 << 16, 1 << 22).err().unwrap();
        assert_eq!(e.code, Code::ResourceExhausted, "{e}");
        assert_eq!(
            KvCache::new(&c, 0, 4).err().unwrap().code,
            Code::InvalidArgument
        );
        assert_eq!(
            KvCache::new(&c, 4, 0).err().unwrap().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn write_lands_in_the_head_slices() {
        let c = tiny();
        let mut kv = KvCache::new(&c, 4, 3).unwrap();
        let k: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..64).map(|i| -(i as f32)).collect();
        kv.write(2, 3, 1, &k, &v);
        kv.copy_block(2, 0).unwrap();
        assert_eq!(kv.copy_block(0, 3).unwrap_err().code, Code::InvalidArgument);
        for h in 0..4 {
            assert_eq!(kv.head(0, 1, false, h), kv.head(2, 1, false, h));
            assert_eq!(&kv.head(2, 1, false, h)[3 * 16..], &k[h * 16..(h + 1) * 16]);
            assert_eq!(&kv.head(2, 1, true, h)[3 * 16..], &v[h * 16..(h + 1) * 16]);
            assert!(kv.head(2, 0, false, h).iter().all(|&x| x == 0.0));
        }
    }
}
