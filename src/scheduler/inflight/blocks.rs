//! The KV-cache block manager: which fixed-size blocks of an instance's cache each
//! sequence holds, and (with prefix reuse) which full blocks hold the keys and values of
//! which token prefix.
//!
//! A block is free, held (reference count > 0), or cached: unreferenced but still holding
//! a known prefix, so a later request with the same prefix can take it without computing
//! it again. Cached blocks are evicted least recently released first when free blocks run
//! out. Only full blocks are ever shared, and a full block is never written again, so
//! sharing needs no copy-on-write.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Identifies the whole token prefix ending with a block: a 128-bit chain hash over the
/// previous block's identity and this block's tokens.
pub type PrefixHash = u128;

/// The identity of the empty prefix (the parent of a sequence's first block).
pub const ROOT: PrefixHash = 0;

/// Chains `tokens` (one full block) onto the prefix `parent`.
pub fn chain(parent: PrefixHash, tokens: &[u32]) -> PrefixHash {
    let half = |salt: u64| {
        let mut h = DefaultHasher::new();
        salt.hash(&mut h);
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    };
    let v =
        (u128::from(half(0x9e37_79b9_7f4a_7c15)) << 64) | u128::from(half(0x6a09_e667_f3bc_c909));
    // ROOT is reserved for the empty prefix.
    v.max(1)
}

struct Cached {
    hash: PrefixHash,
    parent: PrefixHash,
    tokens: Box<[u32]>,
}

pub struct BlockManager {
    tokens_per_block: usize,
    refs: Vec<u32>,
    /// Blocks holding nothing reusable (a stack: the most recently freed is reused first).
    free: Vec<u32>,
    reuse: bool,
    /// Per block: the prefix it holds, when it is registered for reuse.
    cached: Vec<Option<Cached>>,
    by_hash: HashMap<PrefixHash, u32>,
    /// Unreferenced registered blocks by release tick (oldest first: evicted first).
    idle: BTreeMap<u64, u32>,
    idle_tick: Vec<u64>,
    tick: u64,
    /// Blocks taken from the cache (prefix hits) since creation, and evictions.
    pub reused_blocks: u64,
    pub evicted_blocks: u64,
}

impl BlockManager {
    pub fn new(num_blocks: usize, tokens_per_block: usize, reuse: bool) -> BlockManager {
        BlockManager {
            tokens_per_block,
            refs: vec![0; num_blocks],
            free: (0..num_blocks as u32).rev().collect(),
            reuse,
            cached: (0..num_blocks).map(|_| None).collect(),
            by_hash: HashMap::new(),
            idle: BTreeMap::new(),
            idle_tick: vec![0; num_blocks],
            tick: 0,
            reused_blocks: 0,
            evicted_blocks: 0,
        }
    }

    pub fn tokens_per_block(&self) -> usize {
        self.tokens_per_block
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks a sequence needs to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.tokens_per_block)
    }

    /// Blocks that can be handed out now: free plus cached-but-unreferenced.
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn used(&self) -> usize {
        self.refs.len() - self.available()
    }

    /// Unreferenced blocks that still hold a reusable prefix.
    pub fn cached_idle(&self) -> usize {
        self.idle.len()
    }

    /// How many leading full blocks of `tokens` are cached, and how many of those are
    /// unreferenced now (taking them lowers [`available`](Self::available)). At most
    /// `max_blocks` are matched. Changes nothing.
    pub fn peek_prefix(&self, tokens: &[u32], max_blocks: usize) -> (usize, usize) {
        let mut matched = 0;
        let mut idle = 0;
        self.walk_prefix(tokens, max_blocks, |b| {
            matched += 1;
            if b.1 == 0 {
                idle += 1;
            }
        });
        (matched, idle)
    }

    /// Takes a reference on the leading cached full blocks of `tokens` (at most
    /// `max_blocks`), appending them to `blocks` and their prefix hashes to `hashes`.
    /// Returns how many were taken.
    pub fn acquire_prefix(
        &mut self,
        tokens: &[u32],
        max_blocks: usize,
        blocks: &mut Vec<u32>,
        hashes: &mut Vec<PrefixHash>,
    ) -> usize {
        let mut found: Vec<(u32, PrefixHash)> = Vec::new();
        self.walk_prefix(tokens, max_blocks, |b| found.push((b.0, b.2)));
        for &(b, h) in &found {
            self.take_ref(b);
            blocks.push(b);
            hashes.push(h);
        }
        self.reused_blocks += found.len() as u64;
        found.len()
    }

    /// Calls `f((block, refs, hash))` for each leading block of `tokens` found in the cache.
    fn walk_prefix(
        &self,
        tokens: &[u32],
        max_blocks: usize,
        mut f: impl FnMut((u32, u32, PrefixHash)),
    ) {
        if !self.reuse {
            return;
        }
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(self.tokens_per_block).take(max_blocks) {
            let h = chain(parent, chunk);
            let Some(&b) = self.by_hash.get(&h) else {
                return;
            };
            // The hash is only an index: the block's own tokens and parent must match.
            match &self.cached[b as usize] {
                Some(c) if c.parent == parent && *c.tokens == *chunk => {}
                _ => return,
            }
            f((b, self.refs[b as usize], h));
            parent = h;
        }
    }

    fn take_ref(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.idle.remove(&self.idle_tick[i]);
        }
        self.refs[i] += 1;
    }

    /// A block for new positions: a free one, else the least recently released cached one
    /// (forgetting its prefix). None when every block is referenced.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.idle.pop_first()?;
                self.forget(b);
                self.evicted_blocks += 1;
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    fn forget(&mut self, b: u32) {
        if let Some(c) = self.cached[b as usize].take() {
            if self.by_hash.get(&c.hash) == Some(&b) {
                self.by_hash.remove(&c.hash);
            }
        }
    }

    /// Drops one reference on each block. A block nobody references becomes free, or
    /// cached when it holds a registered prefix.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks {
            let i = b as usize;
            debug_assert!(self.refs[i] > 0, "block {b} released more often than taken");
            if self.refs[i] == 0 {
                continue;
            }
            self.refs[i] -= 1;
            if self.refs[i] > 0 {
                continue;
            }
            if self.cached[i].is_some() {
                self.tick += 1;
                self.idle_tick[i] = self.tick;
                self.idle.insert(self.tick, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Records that `block` (held by the caller) is full and holds the prefix `parent` +
    /// `tokens`; returns that prefix's hash. When another block already holds the same
    /// prefix, this one stays unregistered (it becomes free when released).
    pub fn register_full(&mut self, block: u32, parent: PrefixHash, tokens: &[u32]) -> PrefixHash {
        let h = chain(parent, tokens);
        if !self.reuse || self.cached[block as usize].is_some() || self.by_hash.contains_key(&h) {
            return h;
        }
        self.by_hash.insert(h, block);
        self.cached[block as usize] = Some(Cached {
            hash: h,
            parent,
            tokens: tokens.into(),
        });
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(bm: &mut BlockManager, tokens: &[u32]) -> (Vec<u32>, Vec<PrefixHash>) {
        let tpb = bm.tokens_per_block();
        let mut blocks = Vec::new();
        let mut hashes = Vec::new();
        bm.acquire_prefix(tokens, tokens.len() / tpb, &mut blocks, &mut hashes);
        while blocks.len() < bm.blocks_for(tokens.len()) {
            blocks.push(bm.allocate().expect("a block"));
        }
        for (i, chunk) in tokens.chunks_exact(tpb).enumerate().skip(hashes.len()) {
            let parent = if i == 0 { ROOT } else { hashes[i - 1] };
            hashes.push(bm.register_full(blocks[i], parent, chunk));
        }
        (blocks, hashes)
    }

    #[test]
    fn allocate_and_release_without_reuse() {
        let mut bm = BlockManager::new(3, 4, false);
        assert_eq!(bm.blocks_for(0), 0);
        assert_eq!(bm.blocks_for(4), 1);
        assert_eq!(bm.blocks_for(5), 2);
        let a = bm.allocate().unwrap();
        let b = bm.allocate().unwrap();
        let c = bm.allocate().unwrap();
        assert_eq!(bm.allocate(), None);
        assert_eq!((bm.used(), bm.available()), (3, 0));
        bm.release(&[a, b, c]);
        assert_eq!((bm.used(), bm.available()), (0, 3));
        // Without reuse nothing is ever found.
        let (blocks, _) = fill(&mut bm, &[1, 2, 3, 4, 5]);
        bm.release(&blocks);
        assert_eq!(bm.peek_prefix(&[1, 2, 3, 4, 5], 9), (0, 0));
    }

    #[test]
    fn shared_prefix_is_found_and_reference_counted() {
        let mut bm = BlockManager::new(8, 2, true);
        let (a, ha) = fill(&mut bm, &[1, 2, 3, 4, 5]);
        assert_eq!(a.len(), 3);
        assert_eq!(ha.len(), 2);
        // Another sequence with the same first four tokens shares two blocks.
        assert_eq!(bm.peek_prefix(&[1, 2, 3, 4, 9, 9], 9), (2, 0));
        let (b, hb) = fill(&mut bm, &[1, 2, 3, 4, 9, 9]);
        assert_eq!(&b[..2], &a[..2]);
        assert_ne!(b[2], a[2]);
        assert_eq!(&hb[..2], &ha[..2]);
        assert_eq!(bm.used(), 4);
        // A different first block shares nothing, even with the same second block.
        assert_eq!(bm.peek_prefix(&[0, 2, 3, 4], 9), (0, 0));
        bm.release(&a);
        // Two blocks are still held by b; a's last block was never registered (partial).
        assert_eq!(bm.used(), 3);
        bm.release(&b);
        assert_eq!(bm.used(), 0);
        assert_eq!(bm.cached_idle(), 3, "[1,2] [3,4] [9,9] stay cached");
        assert_eq!(bm.peek_prefix(&[1, 2, 3, 4, 9, 9, 7], 9), (3, 3));
        assert_eq!(bm.peek_prefix(&[1, 2, 3, 4, 9, 9, 7], 1), (1, 1));
    }

    #[test]
    fn eviction_takes_the_least_recently_released_cached_block() {
        let mut bm = BlockManager::new(3, 1, true);
        let (a, _) = fill(&mut bm, &[1]);
        let (b, _) = fill(&mut bm, &[2]);
        let (c, _) = fill(&mut bm, &[3]);
        bm.release(&b);
        bm.release(&a);
        bm.release(&c);
        assert_eq!(bm.available(), 3);
        let x = bm.allocate().unwrap();
        assert_eq!(x, b[0], "released first, evicted first");
        assert_eq!(bm.evicted_blocks, 1);
        assert_eq!(bm.peek_prefix(&[2], 9), (0, 0), "its prefix is forgotten");
        assert_eq!(bm.peek_prefix(&[1], 9), (1, 1));
        // Taking a cached block makes it not evictable.
        let mut blocks = Vec::new();
        let mut hashes = Vec::new();
        assert_eq!(bm.acquire_prefix(&[1], 1, &mut blocks, &mut hashes), 1);
        assert_eq!(blocks, a);
        assert_eq!(bm.allocate(), Some(c[0]));
        assert_eq!(bm.allocate(), None);
    }

    #[test]
    fn a_duplicate_full_block_stays_private() {
        let mut bm = BlockManager::new(4, 2, true);
        // Two sequences computed the same prefix at the same time.
        let a = bm.allocate().unwrap();
        let b = bm.allocate().unwrap();
        let ha = bm.register_full(a, ROOT, &[5, 6]);
        let hb = bm.register_full(b, ROOT, &[5, 6]);
        assert_eq!(ha, hb);
        bm.release(&[b]);
        assert_eq!(bm.cached_idle(), 0, "b was not registered: it is free");
        assert_eq!(bm.available(), 3);
        bm.release(&[a]);
        assert_eq!(bm.cached_idle(), 1);
    }

    #[test]
    fn chain_hashes_depend_on_order_and_parent() {
        assert_ne!(chain(ROOT, &[1, 2]), chain(ROOT, &[2, 1]));
        assert_ne!(
            chain(chain(ROOT, &[1]), &[2]),
            chain(chain(ROOT, &[2]), &[2])
        );
        assert_ne!(chain(ROOT, &[]), ROOT);
    }
}
