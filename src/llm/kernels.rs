//! The dense arithmetic of the forward pass on the CPU besides matrix products (those are
//! in `linear`): layer norm, activations, and how each is spread over threads (attention
//! is in `attention`).
//!
//! Batching invariance is this module's contract: a row's result is computed by the same
//! instructions in the same order whatever the number of rows, which thread runs it, or
//! which other rows share the call. Work is therefore only ever split by output rows or
//! output columns, never along a reduction, and no reduction order depends on a size
//! other than the row's own (a token's context length, the model's widths).

use super::config::Activation;
use super::pool::Pool;

/// Where and how wide to run a kernel.
#[derive(Clone, Copy)]
pub(crate) struct Exec<'a> {
    pub pool: Option<&'a Pool>,
    pub threads: usize,
    /// Multiply-adds below which a kernel stays on the calling thread.
    pub min_par_work: usize,
}

/// The thread pool of one runner: `threads` 0 = one per available core, 1 = none (all on
/// the caller's thread). Returns the pool (the caller's thread and `threads - 1`
/// workers) and the thread count; RESOURCE_EXHAUSTED when the threads cannot be started.
pub(crate) fn thread_pool(
    threads: usize,
    name: &'static str,
) -> crate::status::Result<(Option<Pool>, usize)> {
    let threads = match threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    if threads <= 1 {
        return Ok((None, threads));
    }
    Ok((Some(Pool::new(threads, name)?), threads))
}

impl Exec<'_> {
    /// How many parts to split `work` multiply-adds into (1 = run here).
    pub(crate) fn parts(&self, work: usize, max_parts: usize) -> usize {
        match self.pool {
            Some(_) if work >= self.min_par_work => self.threads.min(max_parts).max(1),
            _ => 1,
        }
    }
}

/// Runs `f(row, out_row)` over `out` split in rows of `per`, on the pool when `work` is
/// large.
pub(crate) fn par_rows<T: Send>(
    exec: Exec<'_>,
    work: usize,
    out: &mut [T],
    per: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) {
    if per == 0 {
        return;
    }
    let rows = out.len() / per;
    let parts = exec.parts(work * 4, rows);
    match exec.pool {
        Some(pool) if parts > 1 => {
            // Each part a run of whole rows, 4 parts a thread (a thread that finishes
            // early takes another).
            let parts = (parts * 4).min(rows);
            let rows_per = rows.div_ceil(parts);
            pool.for_each(
                out.chunks_mut(rows_per * per).enumerate().collect(),
                |(p, o): (usize, &mut [T])| {
                    for (r, o) in o.chunks_mut(per).enumerate() {
                        f(p * rows_per + r, o)
                    }
                },
            )
        }
        _ => out.chunks_mut(per).enumerate().for_each(|(r, o)| f(r, o)),
    }
}

/// Applies `act` to `x` (rows of `width`), rows split over threads.
pub(crate) fn activate_rows(exec: Exec<'_>, act: Activation, x: &mut [f32], width: usize) {
    let rows = x.len() / width.max(1);
    let parts = exec.parts(x.len() * 16, rows);
    let per = rows.div_ceil(parts.max(1)).max(1);
    match exec.pool {
        Some(pool) if parts > 1 => pool.for_each(x.chunks_mut(per * width).collect(), |part| {
            activate(act, part)
        }),
        _ => activate(act, x),
    }
}

/// Applies `act` in place.
pub(crate) fn activate(act: Activation, x: &mut [f32]) {
    match act {
        Activation::GeluTanh => {
            const SQRT_2_OVER_PI: f32 = 0.797_884_6;
            for v in x.iter_mut() {
                let u = *v;
                *v = 0.5 * u * (1.0 + tanh(SQRT_2_OVER_PI * (u + 0.044715 * u * u * u)));
            }
        }
        Activation::GeluErf => {
            for v in x.iter_mut() {
                let u = *v as f64;
                *v = (0.5 * u * (1.0 + erf(u * std::f64::consts::FRAC_1_SQRT_2))) as f32;
            }
        }
        Activation::Relu => {
            for v in x.iter_mut() {
                *v = v.max(0.0);
            }
        }
    }
}

/// tanh as a rational function (Eigen's float approximation: a few ulp over the whole
/// range). Pure arithmetic, so the compiler vectorises it, unlike a libm call.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    const A1: f32 = 4.893_524_6e-3;
    const A3: f32 = 6.372_619_3e-4;
    const A5: f32 = 1.485_722_4e-5;
    const A7: f32 = 5.122_297e-8;
    const A9: f32 = -8.604_672e-11;
    const A11: f32 = 2.000_188e-13;
    const A13: f32 = -2.760_768_5e-16;
    const B0: f32 = 4.893_525e-3;
    const B2: f32 = 2.268_434_6e-3;
    const B4: f32 = 1.185_347_1e-4;
    const B6: f32 = 1.198_258_4e-6;
    let x = x.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = x2 * A13 + A11;
    p = p * x2 + A9;
    p = p * x2 + A7;
    p = p * x2 + A5;
    p = p * x2 + A3;
    p = p * x2 + A1;
    p *= x;
    let mut q = x2 * B6 + B4;
    q = q * x2 + B2;
    q = q * x2 + B0;
    p / q
}

/// erf in f64 (std has none on stable): the Taylor series for |x| < 3, the continued
/// fraction of erfc beyond; error well below f32's resolution.
pub(crate) fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 3.0 {
        let x2 = a * a;
        let mut term = a;
        let mut sum = a;
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -x2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        // erfc(a) = exp(-a²)/sqrt(pi) · 1/(a + 1/2/(a + 1/(a + 3/2/(a + 2/(a + ...)))))
        let mut f = a;
        for k in (1..60).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (f * std::f64::consts::PI.sqrt())
    };
    r.copysign(x)
}

/// `out[r] = layer_norm(x[r]) · w + b` for each row; rows split over threads.
pub(crate) fn layer_norm_rows(
    exec: Exec<'_>,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let e = w.len();
    let rows = out.len() / e;
    let parts = exec.parts(rows * e * 8, rows);
    let per = rows.div_ceil(parts.max(1)).max(1);
    let part = |(i, out): (usize, &mut [f32])| {
        for (r, o) in out.chunks_exact_mut(e).enumerate() {
            let row = i * per + r;
            layer_norm(&x[row * e..(row + 1) * e], w, b, eps, o);
        }
    };
    match exec.pool {
        Some(pool) if parts > 1 => {
            pool.for_each(out.chunks_mut(per * e).enumerate().collect(), part)
        }
        _ => part((0, out)),
    }
}

/// One row's layer norm (biased variance, like torch).
#[inline]
pub(crate) fn layer_norm(x: &[f32], w: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = sum(x) / n;
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            let d = c[l] - mean;
            acc[l] += d * d;
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        let d = v - mean;
        acc[l] += d * d;
    }
    let var = reduce8(acc) / n;
    let rstd = 1.0 / (var + eps).sqrt();
    for (((o, &v), &w), &b) in out.iter_mut().zip(x).zip(w).zip(b) {
        *o = (v - mean) * rstd * w + b;
    }
}

/// Asks the CPU to start loading the memory `v` takes into its caches, a line at a
/// time, for data read soon that the hardware prefetcher would not see coming (a
/// stream that starts elsewhere than where the last one ended). A hint: never a fault,
/// never a result.
#[inline]
pub(crate) fn prefetch<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(v);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// [`prefetch`] into the L2 cache only: for data read a while later, which the L1
/// cache would not keep (and whose lines would push out what is read meanwhile).
#[inline]
pub(crate) fn prefetch_l2<T>(v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T2 }, T>(v);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// Asks for the 64-byte line at `p` with the intent to write it (`PREFETCHW` where the
/// CPU has it), so that a store there a while later finds the line owned. A raw
/// address: the memory may be another thread's to write meanwhile (a prefetch never
/// faults and reads nothing the program sees).
#[inline]
pub(crate) fn prefetch_write_line<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// One `PREFETCH` with `HINT` for each 64-byte line of `v`'s memory.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<const HINT: i32, T>(v: &[T]) {
    let base = v.as_ptr() as *const i8;
    for at in (0..std::mem::size_of_val(v)).step_by(64) {
        // SAFETY: a prefetch never faults; the address is inside `v` all the same.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(base.wrapping_add(at)) }
    }
}

/// `e^x` for `x <= 0` (an attention score less its row's maximum, SiLU's `e^-|g|`), within 2 ulp, in plain f32
/// operations (no call, no fused multiply-add), so that a loop of them vectorizes and
/// every build gives the same bits. Cody and Waite's range reduction to
/// `2^n · e^r`, `|r| <= ln 2 / 2`, then a degree-7 polynomial of `e^r` (Cephes' `expf`
/// coefficients). Below -87 (where `e^x` is under f32's smallest normal) it returns
/// `e^-87`; a NaN stays NaN.
#[inline(always)]
// The constants are written as published; each rounds to the f32 it names.
#[allow(clippy::excessive_precision)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    // 1.5 · 2^23: adding and taking it away rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = if x < -87.0 { -87.0 } else { x };
    let k = x * std::f32::consts::LOG2_E + ROUND;
    let n = k - ROUND;
    // ln 2 in two parts: n · 0.693359375 is exact for |n| < 2^12.
    let r = (x - n * 0.693_359_375) - n * -2.121_944_40e-4;
    let p = ((((1.987_569_150_0e-4 * r + 1.398_199_950_7e-3) * r + 8.333_451_907_3e-3) * r
        + 4.166_579_589_4e-2)
        * r
        + 1.666_666_545_9e-1)
        * r
        + 5.000_000_120_1e-1;
    let e = (r * r) * p + r + 1.0;
    // n is in -126..=0, so 2^n is a normal number. `k`'s low bits hold n (two's
    // complement) on top of ROUND's: integer operations, which vectorize where a cast
    // of `n` to an integer does not. (A NaN `x` leaves `e` NaN.)
    let n_bits = k.to_bits().wrapping_sub(ROUND.to_bits());
    e * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

#[inline(always)]
pub(crate) fn reduce8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// The largest of `x` (`-inf` when empty; NaNs are passed over, as by `f32::max`), over
/// 8 lanes so that it vectorizes: the maximum is the same whatever the order.
#[inline(always)]
pub(crate) fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] = acc[l].max(c[l]);
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        acc[l] = acc[l].max(v);
    }
    acc.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// The sum of `x` over 8 lanes (element `i` into lane `i % 8`, each lane in order),
/// then [`reduce8`]: the same bits wherever it runs, vectorized or not.
#[inline(always)]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    for (l, &v) in chunks.remainder().iter().enumerate() {
        acc[l] += v;
    }
    reduce8(acc)
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a8, ar) = a[..n].as_chunks::<8>();
    let (b8, br) = b[..n].as_chunks::<8>();
    let mut acc = [0.0f32; 8];
    for (x, y) in a8.iter().zip(b8) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in ar.iter().zip(br).enumerate() {
        acc[l] += x * y;
    }
    reduce8(acc)
}

/// The 8 × 8 transpose of `v`'s 32-bit lanes: lane `j` of result `i` is lane `i` of
/// `v[j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn transpose8(v: [std::arch::x86_64::__m256; 8]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let [a0, a1, a2, a3, a4, a5, a6, a7] = v;
    let (t0, t1) = (_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    let (t2, t3) = (_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    let (t4, t5) = (_mm256_unpacklo_ps(a4, a5), _mm256_unpackhi_ps(a4, a5));
    let (t6, t7) = (_mm256_unpacklo_ps(a6, a7), _mm256_unpackhi_ps(a6, a7));
    let (u0, u1) = (
        _mm256_shuffle_ps::<0x44>(t0, t2),
        _mm256_shuffle_ps::<0xee>(t0, t2),
    );
    let (u2, u3) = (
        _mm256_shuffle_ps::<0x44>(t1, t3),
        _mm256_shuffle_ps::<0xee>(t1, t3),
    );
    let (u4, u5) = (
        _mm256_shuffle_ps::<0x44>(t4, t6),
        _mm256_shuffle_ps::<0xee>(t4, t6),
    );
    let (u6, u7) = (
        _mm256_shuffle_ps::<0x44>(t5, t7),
        _mm256_shuffle_ps::<0xee>(t5, t7),
    );
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn exponentials_are_within_two_ulp() {
        let mut worst = 0.0f64;
        // Every 997th f32 from -0 down to -87.
        let mut bits = (-0.0f32).to_bits();
        loop {
            bits += 997;
            let x = f32::from_bits(bits);
            if x <= -87.0 {
                break;
            }
            let got = exp_nonpositive(x) as f64;
            let want = (x as f64).exp();
            // One ulp of the true value.
            let ulp = (want as f32).to_bits();
            let ulp = (f32::from_bits(ulp + 1) - f32::from_bits(ulp)) as f64;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert!(exp_nonpositive(-1e30) > 0.0 && exp_nonpositive(-1e30) < 1e-37);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), exp_nonpositive(-87.0));
    }

    #[test]
    fn tanh_is_accurate() {
        let mut worst = 0.0f64;
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4;
            let err = (tanh(x) as f64 - (x as f64).tanh()).abs();
            worst = worst.max(err);
        }
        assert!(worst < 1e-6, "{worst}");
        assert_eq!(tanh(100.0), tanh(7.905_311));
        assert!((tanh(100.0) - 1.0).abs() < 1e-6);
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(-0.3), -tanh(0.3));
    }

    #[test]
    fn erf_is_accurate() {
        // erf from tables (Abramowitz & Stegun) and symmetric.
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_8),
            (1.0, 0.842_700_792_9),
            (2.0, 0.995_322_265_0),
            (3.5, 0.999_999_256_9),
        ] {
            assert!((erf(x) - want).abs() < 1e-9, "erf({x}) = {}", erf(x));
            assert!((erf(-x) + want).abs() < 1e-9);
        }
        // Continuous where the method changes.
        assert!((erf(2.999_999_9) - erf(3.0)).abs() < 1e-9);
    }

    #[test]
    fn layer_norm_matches_the_definition() {
        let x: Vec<f32> = (0..37)
            .map(|i| (i as f32 * 0.37).sin() * 3.0 + 1.0)
            .collect();
        let w: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let b: Vec<f32> = (0..37).map(|i| i as f32 * -0.02).collect();
        let mut out = vec![0.0; 37];
        layer_norm(&x, &w, &b, 1e-5, &mut out);
        let mean = x.iter().map(|&v| v as f64).sum::<f64>() / 37.0;
        let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 37.0;
        for i in 0..37 {
            let want = (x[i] as f64 - mean) / (var + 1e-5).sqrt() * w[i] as f64 + b[i] as f64;
            assert!(
                (out[i] as f64 - want).abs() < 1e-5,
                "{i}: {} vs {want}",
                out[i]
            );
        }
    }

    pub(crate) fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }
}
