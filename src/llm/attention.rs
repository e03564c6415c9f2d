//! Causal attention of a step's tokens over the paged KV cache.
//!
//! Each token's attention is computed on its own, from its query, its position and its
//! sequence's block table: never from anything about the rest of the batch, so it is the
//! same bits however the step is composed or split over threads.

use super::kernels::{dot, exp_nonpositive, max_of, prefetch, reduce8, sum, Exec};
use super::kv::{HeadRef, KvCache};
use super::step::{StepSeq, TokenSlot};

/// Attention of one layer.
pub(crate) struct AttentionShape {
    pub n_head: usize,
    /// Heads of K and V: each serves `n_head / n_kv_head` query heads in a row
    /// (grouped-query attention; `n_head` for plain multi-head attention).
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Distance between two tokens' queries in the `q` buffer.
    pub q_stride: usize,
    pub layer: usize,
    /// Attention scores are divided by this (sqrt(head_dim) and/or layer + 1).
    pub divisor: f32,
}

/// The most parts [`attention`] splits a step into for each of the pool's threads; a
/// runner keeps this many [`Scratch`]es a thread.
pub(crate) const PARTS_PER_THREAD: usize = 4;

/// One thread part's buffers: scores (`[n_head][context]`) and a block's keys or
/// values widened to f32 (for an F16 cache).
#[derive(Default)]
pub(crate) struct Scratch {
    scores: Vec<f32>,
    widened: Vec<f32>,
}

/// Causal attention of every token over its sequence's cache (which already holds this
/// step's K and V). Token `i`'s query heads start at `q[i * q_stride]`; `out` is
/// `[T][n_head · head_dim]`. `scratch` holds one [`Scratch`] per thread part.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    exec: Exec<'_>,
    shape: &AttentionShape,
    q: &[f32],
    kv: &KvCache,
    tokens: &[TokenSlot],
    seqs: &[StepSeq<'_>],
    scratch: &mut [Scratch],
    out: &mut [f32],
) {
    let e = shape.n_head * shape.head_dim;
    let t = tokens.len();
    // A token's cost grows with its position (a prompt's last token attends over all of
    // it): parts are contiguous runs of tokens with equal shares of the positions, not of
    // the tokens.
    let cost = |s: &TokenSlot| s.pos as usize + 1;
    let total: usize = tokens.iter().map(cost).sum();
    // Up to PARTS_PER_THREAD parts a thread: one that finishes early (or that the host
    // preempted, or that waited longer on memory) takes another instead of waiting.
    let parts = match exec.parts(total * e * 2, t) {
        p if p > 1 => (p * PARTS_PER_THREAD).min(t).min(scratch.len()),
        p => p,
    }
    .max(1);
    let mut bounds = Vec::with_capacity(parts + 1);
    bounds.push(0);
    let mut acc = 0;
    for (i, s) in tokens.iter().enumerate() {
        acc += cost(s);
        while bounds.len() < parts && acc * parts >= total * bounds.len() {
            bounds.push(i + 1);
        }
    }
    while bounds.len() <= parts {
        bounds.push(t);
    }
    let mut chunks: Vec<(usize, &mut [f32], &mut Scratch)> = Vec::with_capacity(parts);
    let mut rest = &mut out[..t * e];
    for (w, sc) in bounds.windows(2).zip(scratch.iter_mut()) {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut((w[1] - w[0]) * e);
        rest = tail;
        chunks.push((w[0], head, sc));
    }
    // A layer's keys and values of one position, in bytes.
    let per_pos = KvCache::bytes_per_block(kv.shape(), 1) / kv.shape().n_layer.max(1);
    let part = |(first, out, scores): (usize, &mut [f32], &mut Scratch)| {
        for (r, o) in out.chunks_exact_mut(e).enumerate() {
            let ti = first + r;
            let slot = tokens[ti];
            let q = &q[ti * shape.q_stride..ti * shape.q_stride + e];
            // A token right after one of its own sequence on this thread (a prompt's)
            // reads the keys and values that one just read, all but its own: where they
            // fit in half of a core's L2 (1 MiB), they are there, and asking for them
            // again only costs. Elsewhere (decoding, a long prompt) they are asked for
            // ahead of their reads.
            let warm = r > 0
                && tokens[ti - 1].seq == slot.seq
                && (slot.pos as usize + 1).saturating_mul(per_pos) <= 1 << 20;
            attend(
                shape,
                q,
                kv,
                seqs[slot.seq as usize].blocks,
                slot.pos as usize,
                !warm,
                scores,
                o,
            );
        }
    };
    match exec.pool {
        Some(pool) if parts > 1 => pool.for_each(chunks, part),
        _ => chunks.into_iter().for_each(part),
    }
}

/// One token at `pos` attends over positions `0..=pos` of its block table; with
/// `ahead`, asking for each next head's keys and values while it reads one (for a
/// cache that is not in the core's caches already).
///
/// Compiled three times on x86-64: for the baseline, for AVX2 and for AVX-512, picked
/// at run time. All run the same operations in the same order (the wider copies only
/// widen the vectors; no FMA), so they give the same bits.
#[allow(clippy::too_many_arguments)]
fn attend(
    shape: &AttentionShape,
    q: &[f32],
    kv: &KvCache,
    blocks: &[u32],
    pos: usize,
    ahead: bool,
    scores: &mut Scratch,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::quant::avx512() {
            // SAFETY: the CPU has AVX2, F16C and AVX-512 (F, BW, VL).
            return unsafe { attend_avx512(shape, q, kv, blocks, pos, ahead, scores, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { attend_avx2(shape, q, kv, blocks, pos, ahead, scores, out) };
        }
    }
    attend_body(
        shape,
        q,
        kv,
        blocks,
        pos,
        ahead,
        scores,
        out,
        dot,
        None::<F16Fns>,
    )
}

/// Products with an F16 cache's keys and values read as they lie (no widened copy), in
/// the same operations and order as [`dot`] and the f32 loop over a widened copy, so the
/// bits are the same: `scores(q, keys, divisor, out)` sets `out[i] = dot(q, key i) /
/// divisor`, and `axpy(o, probs, values)` does `o += probs[i] · value i` for each `i` in
/// turn.
///
/// `scores2` and `axpy2` do the same for two query heads that share the keys and
/// values (grouped-query attention): each F16 element is widened once for both, and
/// each head's outputs get the same operations in the same order as from `scores` and
/// `axpy`. Each also takes the next head's keys or values (or nothing), which it asks
/// the cache for a part at a time, as far into them as it is into its own.
struct F16Ops<S, A, S2, A2>
where
    S: Fn(&[f32], &[u16], f32, &mut [f32], &[u16]),
    A: Fn(&mut [f32], &[f32], &[u16], &[u16]),
    S2: Fn([&[f32]; 2], &[u16], f32, [&mut [f32]; 2], &[u16]),
    A2: Fn([&mut [f32]; 2], [&[f32]; 2], &[u16], &[u16]),
{
    scores: S,
    axpy: A,
    scores2: S2,
    axpy2: A2,
}

type F16Fns = F16Ops<
    fn(&[f32], &[u16], f32, &mut [f32], &[u16]),
    fn(&mut [f32], &[f32], &[u16], &[u16]),
    fn([&[f32]; 2], &[u16], f32, [&mut [f32]; 2], &[u16]),
    fn([&mut [f32]; 2], [&[f32]; 2], &[u16], &[u16]),
>;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
fn attend_avx2(
    shape: &AttentionShape,
    q: &[f32],
    kv: &KvCache,
    blocks: &[u32],
    pos: usize,
    ahead: bool,
    scores: &mut Scratch,
    out: &mut [f32],
) {
    // Closures inherit the enclosing function's target features.
    let dot = |a: &[f32], b: &[f32]| dot_avx2(a, b);
    // F16C comes with every AVX2 CPU this runs on; checked all the same.
    let f16 = std::arch::is_x86_feature_detected!("f16c").then(|| F16Ops {
        // SAFETY: the CPU has AVX2 and F16C.
        scores: |q: &[f32], k: &[u16], div: f32, out: &mut [f32], ahead: &[u16]| unsafe {
            scores_f16([q], k, div, [out], ahead)
        },
        // SAFETY: as above.
        axpy: |o: &mut [f32], p: &[f32], v: &[u16], ahead: &[u16]| unsafe {
            axpy_f16([o], [p], v, ahead)
        },
        // SAFETY: as above.
        scores2: |q: [&[f32]; 2], k: &[u16], div: f32, out: [&mut [f32]; 2], ahead: &[u16]| unsafe {
            scores_f16(q, k, div, out, ahead)
        },
        // SAFETY: as above.
        axpy2: |o: [&mut [f32]; 2], p: [&[f32]; 2], v: &[u16], ahead: &[u16]| unsafe {
            axpy_f16(o, p, v, ahead)
        },
    });
    attend_body(shape, q, kv, blocks, pos, ahead, scores, out, dot, f16)
}

/// [`attend_avx2`] with 512-bit vectors where a lane is an output of its own: the
/// products with an F16 cache's values ([`axpy_f16_avx512`]) and the element-wise
/// steps of the softmax, which the compiler widens. The scores keep the AVX2 kernels
/// (their sums go 8 lanes wide). Every lane takes the same operations in the same
/// order as in [`attend_avx2`], so the bits are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
#[allow(clippy::too_many_arguments)]
fn attend_avx512(
    shape: &AttentionShape,
    q: &[f32],
    kv: &KvCache,
    blocks: &[u32],
    pos: usize,
    ahead: bool,
    scores: &mut Scratch,
    out: &mut [f32],
) {
    let dot = |a: &[f32], b: &[f32]| dot_avx2(a, b);
    let f16 = F16Ops {
        scores: |q: &[f32], k: &[u16], div: f32, out: &mut [f32], ahead: &[u16]| {
            scores_f16([q], k, div, [out], ahead)
        },
        axpy: |o: &mut [f32], p: &[f32], v: &[u16], ahead: &[u16]| {
            axpy_f16_wide([o], [p], v, ahead)
        },
        scores2: |q: [&[f32]; 2], k: &[u16], div: f32, out: [&mut [f32]; 2], ahead: &[u16]| {
            scores_f16(q, k, div, out, ahead)
        },
        axpy2: |o: [&mut [f32]; 2], p: [&[f32]; 2], v: &[u16], ahead: &[u16]| {
            axpy_f16_wide(o, p, v, ahead)
        },
    };
    attend_body(
        shape,
        q,
        kv,
        blocks,
        pos,
        ahead,
        scores,
        out,
        dot,
        Some(f16),
    )
}

/// [`axpy_f16_avx512`] for the head width, compiled for the common widths (see
/// [`scores_f16`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
#[inline]
fn axpy_f16_wide<const H: usize>(
    o: [&mut [f32]; H],
    probs: [&[f32]; H],
    values: &[u16],
    ahead: &[u16],
) {
    match o[0].len() {
        64 => axpy_f16_avx512::<H, 64>(o, probs, values, ahead),
        128 => axpy_f16_avx512::<H, 128>(o, probs, values, ahead),
        _ => axpy_f16_avx512::<H, 0>(o, probs, values, ahead),
    }
}

/// [`axpy_f16_avx2`] with 16 outputs to a vector: `o[h] += probs[h][i] · value i` for
/// each value in turn (a multiply, then an add), `256 / H` outputs of each head at a
/// time held in registers over all the values (a head of 128 in one sweep of the
/// values for two heads). Heads whose width is not whole 16s go to
/// [`axpy_f16_avx2`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
#[inline]
fn axpy_f16_avx512<const H: usize, const HD: usize>(
    mut o: [&mut [f32]; H],
    probs: [&[f32]; H],
    values: &[u16],
    ahead: &[u16],
) {
    use std::arch::x86_64::*;
    let hd = if HD > 0 { HD } else { o[0].len() };
    if hd == 0 || !hd.is_multiple_of(16) || o.iter().any(|o| o.len() != hd) {
        return axpy_f16_avx2::<H, HD>(o, probs, values, ahead);
    }
    let count = probs.iter().map(|p| p.len()).min().unwrap_or(0);
    // Vectors of each head's outputs in registers.
    let per = 16 / H;
    let mut d0 = 0;
    while d0 < hd {
        let width = ((hd - d0) / 16).min(per);
        // acc[h · per + c]: head h, outputs d0 + 16c ..+ 16.
        let mut acc = [_mm512_setzero_ps(); 16];
        for (h, o) in o.iter().enumerate() {
            for c in 0..width {
                let s = &o[d0 + 16 * c..d0 + 16 * c + 16];
                // SAFETY: `s` is 16 f32s.
                acc[h * per + c] = unsafe { _mm512_loadu_ps(s.as_ptr()) };
            }
        }
        for (i, v) in values.chunks_exact(hd).take(count).enumerate() {
            if d0 == 0 {
                prefetch_part(ahead, i * hd..(i + 1) * hd);
            }
            let p: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(probs[h][i]));
            for c in 0..width {
                let v = &v[d0 + 16 * c..d0 + 16 * c + 16];
                // SAFETY: `v` is 16 u16s (32 bytes).
                let w = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().cast())) };
                for (h, p) in p.iter().enumerate() {
                    let a = &mut acc[h * per + c];
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(*p, w));
                }
            }
        }
        for (h, o) in o.iter_mut().enumerate() {
            for c in 0..width {
                let s = &mut o[d0 + 16 * c..d0 + 16 * c + 16];
                // SAFETY: `s` is 16 f32s.
                unsafe { _mm512_storeu_ps(s.as_mut_ptr(), acc[h * per + c]) };
            }
        }
        d0 += 16 * width;
    }
}

/// [`scores_f16_avx2`] for the head width: compiled for the common widths (64 and 128)
/// and for any other.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn scores_f16<const H: usize>(
    q: [&[f32]; H],
    keys: &[u16],
    divisor: f32,
    out: [&mut [f32]; H],
    ahead: &[u16],
) {
    match q[0].len() {
        64 => scores_f16_avx2::<H, 64>(q, keys, divisor, out, ahead),
        128 => scores_f16_avx2::<H, 128>(q, keys, divisor, out, ahead),
        _ => scores_f16_avx2::<H, 0>(q, keys, divisor, out, ahead),
    }
}

/// [`axpy_f16_avx2`] for the head width, compiled for the common widths (see
/// [`scores_f16`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn axpy_f16<const H: usize>(o: [&mut [f32]; H], probs: [&[f32]; H], values: &[u16], ahead: &[u16]) {
    match o[0].len() {
        64 => axpy_f16_avx2::<H, 64>(o, probs, values, ahead),
        128 => axpy_f16_avx2::<H, 128>(o, probs, values, ahead),
        _ => axpy_f16_avx2::<H, 0>(o, probs, values, ahead),
    }
}

/// `out[h][i] = dot_f16_avx2(q[h], key i) / divisor` for `H` query heads (1 or 2: two
/// heads that share a KV head) over the `out[h].len()` keys of `keys`, `8 / H` keys at a
/// time where the head's width is whole 8s. Each (head, key) pair's lanes take the same
/// products and sums as [`dot_f16_avx2`], each key widened once for all heads; then the
/// eight pairs' lanes are transposed so that `reduce8`'s sums of all eight run side by
/// side. `HD` is the head's width where it is known when compiled (0 where not): with
/// it, the loops over a key have fixed bounds and no checks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn scores_f16_avx2<const H: usize, const HD: usize>(
    q: [&[f32]; H],
    keys: &[u16],
    divisor: f32,
    mut out: [&mut [f32]; H],
    ahead: &[u16],
) {
    use std::arch::x86_64::*;
    let hd = if HD > 0 { HD } else { q[0].len() };
    let n = out.iter().map(|o| o.len()).min().unwrap_or(0);
    let step = 8 / H;
    let mut i = 0;
    if hd.is_multiple_of(8) && hd > 0 && q.iter().all(|q| q.len() == hd) {
        let q: [&[f32]; H] = std::array::from_fn(|h| &q[h][..hd]);
        let div = _mm256_set1_ps(divisor);
        while i + step <= n {
            prefetch_part(ahead, i * hd..(i + step) * hd);
            let keys = &keys[i * hd..][..step * hd];
            // acc[h · step + j]: head h, key j.
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in 0..hd / 8 {
                let qv: [__m256; H] = std::array::from_fn(|h| {
                    let qc = &q[h][8 * c..8 * c + 8];
                    // SAFETY: `qc` is 8 f32s.
                    unsafe { _mm256_loadu_ps(qc.as_ptr()) }
                });
                for j in 0..step {
                    let k = &keys[j * hd + 8 * c..j * hd + 8 * c + 8];
                    // SAFETY: `k` is 8 u16s (16 bytes).
                    let kv =
                        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr() as *const __m128i)) };
                    for (h, qv) in qv.iter().enumerate() {
                        let a = &mut acc[h * step + j];
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(*qv, kv));
                    }
                }
            }
            // Lane l of every pair in one vector, then reduce8's sums.
            let l = super::kernels::transpose8(acc);
            let sum = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[1], l[5])),
                _mm256_add_ps(_mm256_add_ps(l[2], l[6]), _mm256_add_ps(l[3], l[7])),
            );
            let mut s = [0.0f32; 8];
            // SAFETY: `s` holds 8 f32s; the store is unaligned.
            unsafe { _mm256_storeu_ps(s.as_mut_ptr(), _mm256_div_ps(sum, div)) };
            for (h, out) in out.iter_mut().enumerate() {
                out[i..i + step].copy_from_slice(&s[h * step..(h + 1) * step]);
            }
            i += step;
        }
    }
    for (h, out) in out.iter_mut().enumerate() {
        for (s, k) in out[i..n]
            .iter_mut()
            .zip(keys[i * hd..].chunks_exact(hd.max(1)))
        {
            *s = dot_f16_avx2(q[h], k) / divisor;
        }
    }
}

/// `o[h] += probs[h][i] · value i` for each value in turn (a multiply, then an add: no
/// fused multiply-add), for `H` heads (1 or 2) over the same values, each value widened
/// once for all heads; `64 / H` outputs of each head at a time held in registers over
/// all the values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn axpy_f16_avx2<const H: usize, const HD: usize>(
    mut o: [&mut [f32]; H],
    probs: [&[f32]; H],
    values: &[u16],
    ahead: &[u16],
) {
    use std::arch::x86_64::*;
    let hd = if HD > 0 { HD } else { o[0].len() };
    if o.iter().any(|o| o.len() != hd) {
        for (o, p) in o.into_iter().zip(probs) {
            axpy_f16_avx2::<1, 0>([o], [p], values, ahead);
        }
        return;
    }
    let whole = hd / 8 * 8;
    let count = probs.iter().map(|p| p.len()).min().unwrap_or(0);
    // Vectors of each head's outputs in registers.
    let per = 8 / H;
    let mut d0 = 0;
    while d0 < whole {
        let width = (whole - d0).min(8 * per) / 8;
        // acc[h · per + c]: head h, outputs d0 + 8c ..+ 8.
        let mut acc = [_mm256_setzero_ps(); 8];
        for (h, o) in o.iter().enumerate() {
            for c in 0..width {
                let s = &o[d0 + 8 * c..d0 + 8 * c + 8];
                // SAFETY: `s` is 8 f32s.
                acc[h * per + c] = unsafe { _mm256_loadu_ps(s.as_ptr()) };
            }
        }
        for (i, v) in values.chunks_exact(hd.max(1)).take(count).enumerate() {
            if d0 == 0 {
                prefetch_part(ahead, i * hd..(i + 1) * hd);
            }
            let p: [__m256; H] = std::array::from_fn(|h| _mm256_set1_ps(probs[h][i]));
            for c in 0..width {
                let v = &v[d0 + 8 * c..d0 + 8 * c + 8];
                // SAFETY: `v` is 8 u16s (16 bytes).
                let w = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr() as *const __m128i)) };
                for (h, p) in p.iter().enumerate() {
                    let a = &mut acc[h * per + c];
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(*p, w));
                }
            }
        }
        for (h, o) in o.iter_mut().enumerate() {
            for c in 0..width {
                let s = &mut o[d0 + 8 * c..d0 + 8 * c + 8];
                // SAFETY: `s` is 8 f32s.
                unsafe { _mm256_storeu_ps(s.as_mut_ptr(), acc[h * per + c]) };
            }
        }
        d0 += 8 * width;
    }
    if whole < hd {
        for (o, p) in o.iter_mut().zip(probs) {
            for (&p, v) in p.iter().zip(values.chunks_exact(hd)) {
                for (o, &v) in o[whole..].iter_mut().zip(&v[whole..]) {
                    *o += p * half::f16::from_bits(v).to_f32();
                }
            }
        }
    }
}

/// Asks for elements `range` of `x` (clamped to it) to be loaded into the caches.
#[inline(always)]
fn prefetch_part(x: &[u16], range: std::ops::Range<usize>) {
    let end = range.end.min(x.len());
    if range.start < end {
        prefetch(&x[range.start..end]);
    }
}

/// [`dot_avx2`] with `b` in F16, widened by F16C as it is read (widening is exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn dot_f16_avx2(a: &[f32], b: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    dot8_avx2(
        a,
        b,
        // SAFETY: `y` is 8 u16s (16 bytes).
        |y| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(y.as_ptr() as *const __m128i)) },
        |y| half::f16::from_bits(y).to_f32(),
    )
}

/// [`dot`] with the 8 accumulators in one AVX register: the same sums in the same order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: `y` is 8 f32s.
    dot8_avx2(a, b, |y| unsafe { _mm256_loadu_ps(y.as_ptr()) }, |y| y)
}

/// The sums of [`dot`] in one AVX register, `b`'s elements read as f32 by `load8` (8 at a
/// time) and `one` (the rest).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn dot8_avx2<T: Copy>(
    a: &[f32],
    b: &[T],
    load8: impl Fn(&[T; 8]) -> std::arch::x86_64::__m256,
    one: impl Fn(T) -> f32,
) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (a8, ar) = a[..n].as_chunks::<8>();
    let (b8, br) = b[..n].as_chunks::<8>();
    let mut acc = _mm256_setzero_ps();
    for (x, y) in a8.iter().zip(b8) {
        // SAFETY: `x` is 8 f32s.
        let x = unsafe { _mm256_loadu_ps(x.as_ptr()) };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, load8(y)));
    }
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 f32s.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    for (l, (&x, &y)) in ar.iter().zip(br).enumerate() {
        lanes[l] += x * one(y);
    }
    reduce8(lanes)
}

/// Blocks are walked in the outer loop so that each block's K (then V) of all heads,
/// contiguous in the cache, is read in one sweep; `scores` holds `[n_head][pos + 1]`.
/// Each KV head's block is read (and widened, for an F16 cache) once for all the query
/// heads it serves.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_body(
    shape: &AttentionShape,
    q: &[f32],
    kv: &KvCache,
    blocks: &[u32],
    pos: usize,
    ahead: bool,
    scratch: &mut Scratch,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
    f16: Option<
        F16Ops<
            impl Fn(&[f32], &[u16], f32, &mut [f32], &[u16]),
            impl Fn(&mut [f32], &[f32], &[u16], &[u16]),
            impl Fn([&[f32]; 2], &[u16], f32, [&mut [f32]; 2], &[u16]),
            impl Fn([&mut [f32]; 2], [&[f32]; 2], &[u16], &[u16]),
        >,
    >,
) {
    let (nh, hd) = (shape.n_head, shape.head_dim);
    let group = nh / shape.n_kv_head.max(1);
    let tpb = kv.tokens_per_block();
    let n_ctx = pos + 1;
    let Scratch { scores, widened } = scratch;
    if scores.len() < nh * n_ctx {
        scores.resize(nh * n_ctx, 0.0);
    }
    let scores = &mut scores[..nh * n_ctx];
    let used = &blocks[..n_ctx.div_ceil(tpb)];
    // The head after the one being read: the next of the block, or the next block's
    // first.
    // (None where the caller says the cache is warm: `ahead` false.)
    let prefetch = ahead;
    let ahead = |bi: usize, g: usize| match g + 1 < shape.n_kv_head {
        _ if !prefetch => None,
        true => Some((used[bi] as usize, g + 1)),
        false => used.get(bi + 1).map(|&b| (b as usize, 0)),
    };
    // The F16 kernels load the next head a little at a time as they go, each step a
    // part as long as the one it reads (a whole head's lines asked for at once wait on
    // each other: more than the core can have in flight).
    let ahead_f16 = |bi: usize, g: usize, value: bool| match ahead(bi, g) {
        Some((b, h)) => match kv.head(b, shape.layer, value, h) {
            HeadRef::F16(x) => x,
            HeadRef::F32(_) => &[],
        },
        None => &[],
    };
    for (bi, &block) in used.iter().enumerate() {
        let first = bi * tpb;
        let count = tpb.min(n_ctx - first);
        for g in 0..shape.n_kv_head {
            let keys: HeadRef<'_> = kv.head(block as usize, shape.layer, false, g);
            if let (HeadRef::F16(keys), Some(f16)) = (&keys, &f16) {
                let mut next = ahead_f16(bi, g, false);
                let keys = &keys[..count * hd];
                let mut h = g * group;
                while h < (g + 1) * group {
                    let row = |h: usize| h * n_ctx + first..h * n_ctx + first + count;
                    if h + 2 <= (g + 1) * group {
                        // Two heads' rows of the scores (the second starts n_ctx on).
                        let (a, b) = scores[h * n_ctx..].split_at_mut(n_ctx);
                        let qs = [&q[h * hd..(h + 1) * hd], &q[(h + 1) * hd..(h + 2) * hd]];
                        let rows = [&mut a[first..first + count], &mut b[first..first + count]];
                        (f16.scores2)(qs, keys, shape.divisor, rows, std::mem::take(&mut next));
                        h += 2;
                    } else {
                        let qh = &q[h * hd..(h + 1) * hd];
                        let next = std::mem::take(&mut next);
                        (f16.scores)(qh, keys, shape.divisor, &mut scores[row(h)], next);
                        h += 1;
                    }
                }
                continue;
            }
            if let Some((b, h)) = ahead(bi, g) {
                kv.prefetch(b, shape.layer, false, h);
            }
            let keys = keys.as_f32(widened);
            for h in g * group..(g + 1) * group {
                let qh = &q[h * hd..(h + 1) * hd];
                let row = &mut scores[h * n_ctx + first..h * n_ctx + first + count];
                for (s, k) in row.iter_mut().zip(keys.chunks_exact(hd)) {
                    *s = dot(qh, k) / shape.divisor;
                }
            }
        }
    }
    if let Some(&b) = used.first().filter(|_| prefetch) {
        kv.prefetch(b as usize, shape.layer, true, 0);
    }
    for row in scores.chunks_exact_mut(n_ctx) {
        // The maximum, the exponentials and their sum all vectorize (in the AVX2 copy),
        // in the same operations as the baseline's.
        let max = max_of(row);
        for s in row.iter_mut() {
            *s = exp_nonpositive(*s - max);
        }
        let total = sum(row);
        for s in row.iter_mut() {
            *s /= total;
        }
    }
    out.fill(0.0);
    for (bi, &block) in used.iter().enumerate() {
        let first = bi * tpb;
        let count = tpb.min(n_ctx - first);
        for g in 0..shape.n_kv_head {
            let values: HeadRef<'_> = kv.head(block as usize, shape.layer, true, g);
            if let (HeadRef::F16(values), Some(f16)) = (&values, &f16) {
                let mut next = ahead_f16(bi, g, true);
                let values = &values[..count * hd];
                let probs = |h: usize| &scores[h * n_ctx + first..h * n_ctx + first + count];
                let mut h = g * group;
                while h < (g + 1) * group {
                    if h + 2 <= (g + 1) * group {
                        let (a, b) = out[h * hd..(h + 2) * hd].split_at_mut(hd);
                        let next = std::mem::take(&mut next);
                        (f16.axpy2)([a, b], [probs(h), probs(h + 1)], values, next);
                        h += 2;
                    } else {
                        let next = std::mem::take(&mut next);
                        (f16.axpy)(&mut out[h * hd..(h + 1) * hd], probs(h), values, next);
                        h += 1;
                    }
                }
                continue;
            }
            if let Some((b, h)) = ahead(bi, g) {
                kv.prefetch(b, shape.layer, true, h);
            }
            let values = values.as_f32(widened);
            for h in g * group..(g + 1) * group {
                let oh = &mut out[h * hd..(h + 1) * hd];
                let probs = &scores[h * n_ctx + first..h * n_ctx + first + count];
                for (&p, v) in probs.iter().zip(values.chunks_exact(hd)) {
                    for (o, &v) in oh.iter_mut().zip(v) {
                        *o += p * v;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::kernels::tests::bits;

    /// One token's attention by the path this CPU takes and by the baseline over a
    /// widened copy.
    fn both_paths(
        shape: &AttentionShape,
        q: &[f32],
        kv: &KvCache,
        blocks: &[u32],
        pos: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let e = shape.n_head * shape.head_dim;
        let (mut a, mut b) = (vec![0.0; e], vec![0.0; e]);
        let mut scratch = Scratch::default();
        // Asking ahead or not changes no bits: both ways, by the position.
        attend(
            shape,
            q,
            kv,
            blocks,
            pos,
            pos.is_multiple_of(2),
            &mut scratch,
            &mut a,
        );
        let none = None::<F16Fns>;
        let ahead = pos.is_multiple_of(3);
        attend_body(
            shape,
            q,
            kv,
            blocks,
            pos,
            ahead,
            &mut scratch,
            &mut b,
            dot,
            none,
        );
        (a, b)
    }

    #[test]
    fn attention_versions_agree_bitwise() {
        use crate::llm::config::Gpt2Config;
        let c = Gpt2Config {
            n_layer: 1,
            n_head: 3,
            n_embd: 60,
            n_inner: 8,
            vocab_size: 8,
            n_positions: 64,
            ..Gpt2Config::default()
        };
        let mut kv = KvCache::new(&c, 5, 13).unwrap();
        let val = |i: usize| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0;
        let blocks: Vec<u32> = (0..13).rev().collect();
        for p in 0..64 {
            let k: Vec<f32> = (0..60).map(|d| val(p * 120 + d)).collect();
            let v: Vec<f32> = (0..60).map(|d| val(p * 120 + 60 + d)).collect();
            kv.write(blocks[p / 5] as usize, p % 5, 0, &k, &v);
        }
        let q: Vec<f32> = (0..60).map(|d| val(100_000 + d)).collect();
        let shape = AttentionShape {
            n_head: 3,
            n_kv_head: 3,
            head_dim: 20,
            q_stride: 60,
            layer: 0,
            divisor: 20f32.sqrt(),
        };
        for pos in [0, 4, 5, 37, 63] {
            let (a, b) = both_paths(&shape, &q, &kv, &blocks, pos);
            assert_eq!(bits(&a), bits(&b), "position {pos}");
        }
        // An F16 cache: the AVX2 path reads it as it lies, the baseline widens a copy;
        // head_dim 20 leaves a remainder of 4 after the 8-wide steps.
        let mut kv16 = KvCache::new(
            crate::llm::KvShape {
                dtype: crate::llm::KvType::F16,
                ..crate::llm::KvShape::from(&c)
            },
            5,
            13,
        )
        .unwrap();
        for p in 0..64 {
            let k: Vec<f32> = (0..60).map(|d| val(p * 120 + d)).collect();
            let v: Vec<f32> = (0..60).map(|d| val(p * 120 + 60 + d)).collect();
            kv16.write(blocks[p / 5] as usize, p % 5, 0, &k, &v);
        }
        for pos in [0, 4, 5, 37, 63] {
            let (a, b) = both_paths(&shape, &q, &kv16, &blocks, pos);
            assert_eq!(bits(&a), bits(&b), "F16 cache, position {pos}");
        }
    }

    /// Heads of whole 8s and 16s (the 8-key and register-held paths, the widths 64
    /// and 128 compiled on their own), grouped-query attention, blocks of more than 8
    /// tokens: the path this CPU takes (AVX2 or AVX-512) on an F16 cache gives the
    /// bits of the baseline over a widened copy.
    #[test]
    fn eight_keys_at_a_time_give_the_same_bits() {
        let val = |i: usize| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0;
        for (n_head, n_kv_head, hd, tpb) in [
            (4, 2, 32, 16),
            (2, 1, 72, 11),
            (3, 3, 8, 9),
            (6, 2, 40, 7),
            (8, 1, 64, 13),
            (4, 2, 20, 10),
            // The widths compiled on their own: one and two query heads a KV head.
            (2, 2, 64, 16),
            (3, 1, 128, 16),
            (2, 2, 128, 5),
            // Two sweeps of the values for each pair of heads on 512-bit vectors.
            (4, 2, 256, 3),
        ] {
            let kv_width = n_kv_head * hd;
            let shape = AttentionShape {
                n_head,
                n_kv_head,
                head_dim: hd,
                q_stride: n_head * hd,
                layer: 0,
                divisor: (hd as f32).sqrt(),
            };
            let mut kv = KvCache::new(
                crate::llm::KvShape {
                    n_layer: 1,
                    n_kv_head,
                    head_dim: hd,
                    dtype: crate::llm::KvType::F16,
                },
                tpb,
                8,
            )
            .unwrap();
            let blocks: Vec<u32> = (0..8).rev().collect();
            let positions = 8 * tpb;
            for p in 0..positions {
                let k: Vec<f32> = (0..kv_width).map(|d| val(p * 1000 + d)).collect();
                let v: Vec<f32> = (0..kv_width).map(|d| val(p * 1000 + 500 + d)).collect();
                kv.write(blocks[p / tpb] as usize, p % tpb, 0, &k, &v);
            }
            let q: Vec<f32> = (0..n_head * hd).map(|d| val(100_000 + d)).collect();
            for pos in [0, 7, 8, tpb, 2 * tpb + 9, positions - 1] {
                let (a, b) = both_paths(&shape, &q, &kv, &blocks, pos);
                assert_eq!(bits(&a), bits(&b), "head width {hd}, position {pos}");
            }
        }
    }

    /// Decoding-shaped attention (32 sequences at position 191, 24 layers of 8 F16 KV
    /// heads of 64, 16 query heads, blocks of 16 tokens spread over the cache) on 2
    /// threads: bytes of K and V read per second, the best of several rounds.
    /// `INFER_ATTENTION_PROMPT=N`: one sequence's prompt of N tokens instead (positions
    /// 0 to N - 1 in one step), timed the same way.
    /// `cargo test --release --lib llm::attention::tests::speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn speed() {
        use crate::llm::step::{Logits, StepSeq};
        let prompt: Option<usize> = std::env::var("INFER_ATTENTION_PROMPT")
            .ok()
            .and_then(|v| v.parse().ok());
        let (n_layer, n_kv, hd, nh, tpb) = (24, 8, 64, 16, 16);
        let (seqs_n, pos) = match prompt {
            Some(n) => (1, n.max(1) - 1),
            None => (32, 191),
        };
        let per_seq = (pos + 1usize).div_ceil(tpb);
        let cached = std::env::var_os("INFER_ATTENTION_CACHED").is_some();
        let mut kv = KvCache::new(
            crate::llm::KvShape {
                n_layer,
                n_kv_head: n_kv,
                head_dim: hd,
                dtype: crate::llm::KvType::F16,
            },
            tpb,
            seqs_n * per_seq,
        )
        .unwrap();
        // Sequence s holds blocks s, s + 32, ...: the blocks of one sequence lie apart.
        // INFER_ATTENTION_CACHED=1: every sequence reads sequence 0's blocks, which stay
        // in the caches (the rate of the arithmetic alone).
        let tables: Vec<Vec<u32>> = (0..seqs_n)
            .map(|s| {
                (0..per_seq)
                    .map(|b| (b * seqs_n + if cached { 0 } else { s }) as u32)
                    .collect()
            })
            .collect();
        let val = |i: usize| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0;
        let k: Vec<f32> = (0..n_kv * hd).map(val).collect();
        let v: Vec<f32> = (0..n_kv * hd).map(|i| val(i + 5000)).collect();
        for t in &tables {
            for p in 0..=pos {
                for l in 0..n_layer {
                    kv.write(t[p / tpb] as usize, p % tpb, l, &k, &v);
                }
            }
        }
        let seqs: Vec<StepSeq<'_>> = tables
            .iter()
            .map(|t| StepSeq {
                tokens: &[],
                start: if prompt.is_some() { 0 } else { pos },
                blocks: t,
                logits: Logits::None,
            })
            .collect();
        let tokens: Vec<TokenSlot> = match prompt {
            Some(_) => (0..=pos)
                .map(|p| TokenSlot {
                    seq: 0,
                    pos: p as u32,
                })
                .collect(),
            None => (0..seqs_n)
                .map(|s| TokenSlot {
                    seq: s as u32,
                    pos: pos as u32,
                })
                .collect(),
        };
        let q: Vec<f32> = (0..tokens.len() * nh * hd).map(|i| val(i + 99)).collect();
        let mut out = vec![0.0f32; tokens.len() * nh * hd];
        let threads = 2;
        let pool = crate::llm::pool::Pool::new(threads, "test").unwrap();
        let exec = Exec {
            pool: Some(&pool),
            threads,
            min_par_work: 0,
        };
        let mut scratch: Vec<Scratch> = (0..threads * PARTS_PER_THREAD)
            .map(|_| Scratch::default())
            .collect();
        let mut best = f64::MAX;
        for _ in 0..8 {
            let t0 = std::time::Instant::now();
            for layer in 0..n_layer {
                let shape = AttentionShape {
                    n_head: nh,
                    n_kv_head: n_kv,
                    head_dim: hd,
                    q_stride: nh * hd,
                    layer,
                    divisor: (hd as f32).sqrt(),
                };
                attention(
                    exec,
                    &shape,
                    &q,
                    &kv,
                    &tokens,
                    &seqs,
                    &mut scratch,
                    &mut out,
                );
            }
            best = best.min(t0.elapsed().as_secs_f64());
        }
        // Every token reads the keys and values up to its position.
        let positions: usize = tokens.iter().map(|t| t.pos as usize + 1).sum();
        let bytes = (positions * n_layer * 2 * n_kv * hd * 2) as f64;
        println!(
            "attention: {:.2} ms a step, {:.1} GB/s of K and V",
            best * 1e3,
            bytes / best / 1e9
        );
    }
}
