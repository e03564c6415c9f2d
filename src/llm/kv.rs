//! The paged KV cache of one model instance.
//!
//! The cache owns the memory and its layout; which sequence owns which block is the
//! scheduler's business (a block table per sequence), never this module's.
//!
//! Layout: block → layer → (K, V) → head → position in the block → head_dim. One head's
//! keys (or values) for a whole block are contiguous, which is what attention reads.

use super::config::Gpt2Config;
use super::kernels::prefetch;
use crate::status::{Error, Result};
use half::f16;

/// How the cache stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    F32,
    /// Half the bytes; attention widens each block to f32 as it reads it.
    F16,
}

impl KvType {
    fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
        }
    }
}

/// What a cache holds per position: K and V of `n_kv_head` heads of `head_dim` in each
/// of `n_layer` layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_layer: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub dtype: KvType,
}

impl From<&Gpt2Config> for KvShape {
    fn from(c: &Gpt2Config) -> KvShape {
        KvShape {
            n_layer: c.n_layer,
            n_kv_head: c.n_head,
            head_dim: c.head_dim(),
            dtype: KvType::F32,
        }
    }
}

impl KvShape {
    /// Elements one block holds.
    fn block_len(&self, tokens_per_block: usize) -> Option<usize> {
        self.n_layer
            .checked_mul(2)?
            .checked_mul(self.n_kv_head)?
            .checked_mul(self.head_dim)?
            .checked_mul(tokens_per_block)
    }
}

/// The cache's memory: anonymous pages, so that blocks never used are never resident.
enum Store {
    F32(&'static mut [f32]),
    F16(&'static mut [u16]),
}

/// One head's keys or values of a block.
pub(crate) enum HeadRef<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

impl HeadRef<'_> {
    /// As f32: the slice itself, or widened into `scratch`.
    #[inline]
    pub(crate) fn as_f32<'s>(&'s self, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        match self {
            HeadRef::F32(x) => x,
            HeadRef::F16(x) => {
                use half::slice::HalfFloatSliceExt;
                scratch.resize(x.len(), 0.0);
                let halves: &[f16] = bytemuck::cast_slice(x);
                halves.convert_to_f32_slice(&mut scratch[..x.len()]);
                &scratch[..x.len()]
            }
        }
    }
}

/// The KV cache of one model instance: `num_blocks` blocks of `tokens_per_block`
/// positions, each holding K and V of every layer.
pub struct KvCache {
    /// Owns the pages `data` points into.
    _map: memmap2::MmapMut,
    data: Store,
    tokens_per_block: usize,
    num_blocks: usize,
    shape: KvShape,
    /// Elements per block.
    block_len: usize,
}

impl KvCache {
    /// Fails with RESOURCE_EXHAUSTED if the memory cannot be reserved (never aborts),
    /// INVALID_ARGUMENT for zero sizes. The memory is reserved, not touched: a block
    /// takes resident memory once a sequence writes it.
    pub fn new(
        shape: impl Into<KvShape>,
        tokens_per_block: usize,
        num_blocks: usize,
    ) -> Result<KvCache> {
        let shape = shape.into();
        if shape.n_layer == 0 || shape.n_kv_head == 0 || shape.head_dim == 0 {
            return Err(Error::invalid(format!("KV cache: empty shape {shape:?}")));
        }
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
        let block_len = shape.block_len(tokens_per_block).ok_or_else(too_big)?;
        let len = block_len.checked_mul(num_blocks).ok_or_else(too_big)?;
        let bytes = len
            .checked_mul(shape.dtype.bytes())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(too_big)?;
        if num_blocks > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "KV cache: {num_blocks} blocks do not fit u32 block ids"
            )));
        }
        let mut map = memmap2::MmapMut::map_anon(bytes).map_err(|e| {
            Error::exhausted(format!(
                "KV cache: cannot reserve {bytes} bytes ({num_blocks} blocks of {tokens_per_block} tokens): {e}"
            ))
        })?;
        let ptr = map.as_mut_ptr();
        // SAFETY: the mapping is page-aligned (so aligned for f32 and u16), `bytes` long,
        // zero-filled (zero is 0.0 in both types), and lives in `_map` for as long as the
        // cache: the slice never outlives it (it is private and only lent out by
        // reference through `&self` / `&mut self`).
        let data = unsafe {
            match shape.dtype {
                KvType::F32 => Store::F32(std::slice::from_raw_parts_mut(ptr as *mut f32, len)),
                KvType::F16 => Store::F16(std::slice::from_raw_parts_mut(ptr as *mut u16, len)),
            }
        };
        Ok(KvCache {
            _map: map,
            data,
            tokens_per_block,
            num_blocks,
            shape,
            block_len,
        })
    }

    /// Bytes one block takes (saturates instead of overflowing).
    pub fn bytes_per_block(shape: impl Into<KvShape>, tokens_per_block: usize) -> usize {
        let shape = shape.into();
        shape
            .block_len(tokens_per_block)
            .and_then(|n| n.checked_mul(shape.dtype.bytes()))
            .unwrap_or(usize::MAX)
    }

    pub fn tokens_per_block(&self) -> usize {
        self.tokens_per_block
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn shape(&self) -> KvShape {
        self.shape
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
        match &mut self.data {
            Store::F32(d) => d.copy_within(src * n..(src + 1) * n, dst * n),
            Store::F16(d) => d.copy_within(src * n..(src + 1) * n, dst * n),
        }
        Ok(())
    }

    /// Whether this cache was made for a model of this shape.
    pub(crate) fn fits(&self, shape: impl Into<KvShape>) -> bool {
        let s = shape.into();
        (s.n_layer, s.n_kv_head, s.head_dim)
            == (
                self.shape.n_layer,
                self.shape.n_kv_head,
                self.shape.head_dim,
            )
    }

    /// Offset of (block, layer, K or V, head, slot 0).
    #[inline]
    fn offset(&self, block: usize, layer: usize, value: bool, head: usize) -> usize {
        let tpb_hd = self.tokens_per_block * self.shape.head_dim;
        block * self.block_len
            + (layer * 2 + value as usize) * self.shape.n_kv_head * tpb_hd
            + head * tpb_hd
    }

    /// Asks the CPU to start loading one KV head's keys (`value` false) or values of
    /// `block` in `layer`, which attention reads next: a sequence's blocks lie apart,
    /// where the hardware prefetcher does not follow.
    #[inline]
    pub(crate) fn prefetch(&self, block: usize, layer: usize, value: bool, head: usize) {
        let o = self.offset(block, layer, value, head);
        let n = self.tokens_per_block * self.shape.head_dim;
        match &self.data {
            Store::F32(d) => prefetch(d.get(o..o + n).unwrap_or(&[])),
            Store::F16(d) => prefetch(d.get(o..o + n).unwrap_or(&[])),
        }
    }

    /// One KV head's keys (`value` false) or values for all positions of a block:
    /// `[tokens_per_block][head_dim]`.
    #[inline]
    pub(crate) fn head(&self, block: usize, layer: usize, value: bool, head: usize) -> HeadRef<'_> {
        let o = self.offset(block, layer, value, head);
        let n = self.tokens_per_block * self.shape.head_dim;
        match &self.data {
            Store::F32(d) => HeadRef::F32(&d[o..o + n]),
            Store::F16(d) => HeadRef::F16(&d[o..o + n]),
        }
    }

    /// Stores one position's K and V (each `[n_kv_head * head_dim]`, heads in order).
    pub(crate) fn write(&mut self, block: usize, slot: usize, layer: usize, k: &[f32], v: &[f32]) {
        let hd = self.shape.head_dim;
        for (value, src) in [(false, k), (true, v)] {
            for h in 0..self.shape.n_kv_head {
                let o = self.offset(block, layer, value, h) + slot * hd;
                let src = &src[h * hd..(h + 1) * hd];
                match &mut self.data {
                    Store::F32(d) => d[o..o + hd].copy_from_slice(src),
                    Store::F16(d) => {
                        use half::slice::HalfFloatSliceExt;
                        let halves: &mut [f16] = bytemuck::cast_slice_mut(&mut d[o..o + hd]);
                        halves.convert_from_f32_slice(src);
                    }
                }
            }
        }
    }
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
    fn f16_blocks_hold_half_precision() {
        let shape = KvShape {
            n_layer: 1,
            n_kv_head: 2,
            head_dim: 4,
            dtype: KvType::F16,
        };
        assert_eq!(KvCache::bytes_per_block(shape, 8), 2 * 2 * 4 * 8 * 2);
        let mut kv = KvCache::new(shape, 8, 2).unwrap();
        let k = [1.0, 0.1, -2.5, 65504.0, 3.0, 4.0, 5.0, 6.0];
        kv.write(1, 7, 0, &k, &k);
        let got = kv.head(1, 0, false, 0).as_f32(&mut Vec::new())[28..].to_vec();
        let want: Vec<f32> = k[..4].iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        assert_eq!(got, want);
        assert!(kv.fits(KvShape {
            dtype: KvType::F32,
            ..shape
        }));
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
        let f = |r: HeadRef<'_>| r.as_f32(&mut Vec::new()).to_vec();
        for h in 0..4 {
            assert_eq!(f(kv.head(0, 1, false, h)), f(kv.head(2, 1, false, h)));
            assert_eq!(
                &f(kv.head(2, 1, false, h))[3 * 16..],
                &k[h * 16..(h + 1) * 16]
            );
            assert_eq!(
                &f(kv.head(2, 1, true, h))[3 * 16..],
                &v[h * 16..(h + 1) * 16]
            );
            assert!(f(kv.head(2, 0, false, h)).iter().all(|&x| x == 0.0));
        }
    }
}
