//! Weight element types of decoder matrices, as GGML lays them out (F32, F16, BF16 and
//! the block-quantized Q8_0, Q4_0, Q5_0, Q4_K, Q6_K), with the dot product of one weight
//! row against one activation row computed in the weight's own type.
//!
//! Quantized rows are never expanded to f32 to be multiplied: the activation row is
//! quantized once per matrix product (to 8-bit blocks, [`Q8`] for the 32-element formats
//! and [`Q8K`] for the 256-element K formats), and each block's products are summed in
//! integers, then scaled — the arithmetic llama.cpp uses, so answers agree with it to
//! rounding.
//!
//! Every dot product's result depends only on the two rows (never on which thread runs
//! it or what else is in the batch): each kernel is one fixed sequence of operations for
//! a given row length. On x86-64 an AVX2+FMA+F16C version is picked at start-up; it sums
//! in another order than the portable one, so answers differ between machines in the
//! last bits, never within a process.

use half::f16;

/// An element type of a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    BF16,
    /// 32 elements: f16 scale, 32 × i8.
    Q8_0,
    /// 32 elements: f16 scale, 32 × 4-bit (offset 8).
    Q4_0,
    /// 32 elements: f16 scale, 32 high bits, 32 × 4 low bits (offset 16).
    Q5_0,
    /// 256 elements: f16 scale and min, 8 × 6-bit sub-scales and sub-mins, 256 × 4-bit.
    Q4K,
    /// 256 elements: 256 × 6-bit (offset 32), 16 × i8 sub-scales, f16 scale.
    Q6K,
}

/// What a weight type multiplies against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    F32,
    Q8,
    Q8K,
}

impl WeightType {
    /// Every type, in the order of the enum.
    pub(crate) const ALL: [WeightType; 8] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::BF16,
        WeightType::Q8_0,
        WeightType::Q4_0,
        WeightType::Q5_0,
        WeightType::Q4K,
        WeightType::Q6K,
    ];

    /// The GGML type number (`ggml_type`) of each supported type.
    pub fn from_ggml(t: u32) -> Option<WeightType> {
        Some(match t {
            0 => WeightType::F32,
            1 => WeightType::F16,
            2 => WeightType::Q4_0,
            6 => WeightType::Q5_0,
            8 => WeightType::Q8_0,
            12 => WeightType::Q4K,
            14 => WeightType::Q6K,
            30 => WeightType::BF16,
            _ => return None,
        })
    }

    /// GGML's name of a type number, for messages about types that are not supported.
    pub fn ggml_name(t: u32) -> &'static str {
        const NAMES: [&str; 31] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
            "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
            "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
            "BF16",
        ];
        NAMES.get(t as usize).copied().unwrap_or("unknown")
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightType::F32 => "F32",
            WeightType::F16 => "F16",
            WeightType::BF16 => "BF16",
            WeightType::Q8_0 => "Q8_0",
            WeightType::Q4_0 => "Q4_0",
            WeightType::Q5_0 => "Q5_0",
            WeightType::Q4K => "Q4_K",
            WeightType::Q6K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1,
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q5_0 => 32,
            WeightType::Q4K | WeightType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::BF16 => 2,
            WeightType::Q8_0 => 34,
            WeightType::Q4_0 => 18,
            WeightType::Q5_0 => 22,
            WeightType::Q4K => 144,
            WeightType::Q6K => 210,
        }
    }

    /// Bytes of a row of `n` elements (`n` a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    pub(crate) fn act(self) -> ActKind {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => ActKind::F32,
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q5_0 => ActKind::Q8,
            WeightType::Q4K | WeightType::Q6K => ActKind::Q8K,
        }
    }
}

/// 32 activations quantized to i8 with one scale, and their sum.
#[derive(Clone, Copy)]
#[repr(C, align(4))]
pub(crate) struct Q8 {
    pub d: f32,
    pub qs: [i8; 32],
    /// The sum of `qs` (the VNNI panel kernels take 128 times it off their sums).
    pub sum: i32,
}

/// 256 activations quantized to i8 with one scale, and the sums of each 16.
#[derive(Clone, Copy)]
#[repr(C, align(4))]
pub(crate) struct Q8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

impl Default for Q8 {
    fn default() -> Q8 {
        Q8 {
            d: 0.0,
            qs: [0; 32],
            sum: 0,
        }
    }
}

impl Default for Q8K {
    fn default() -> Q8K {
        Q8K {
            d: 0.0,
            qs: [0; 256],
            bsums: [0; 16],
        }
    }
}

/// Rounds to the nearest integer (halves away from zero), as an i8 in -127..=127.
#[inline(always)]
fn q8_of(v: f32) -> i8 {
    v.round().clamp(-127.0, 127.0) as i8
}

/// One block of activations to i8 with a shared scale (its largest magnitude maps to
/// 127); returns the scale.
#[inline]
fn quantize_block(b: &[f32], qs: &mut [i8]) -> f32 {
    let amax = b.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(b) {
        *q = q8_of(v * id);
    }
    d
}

/// Whether the element-wise loops and attention run their AVX-512 copies: where the
/// quantized products run AVX-512 (so `INFER_CPU_MAX_ISA=avx2` or `avxvnni` keeps
/// everything to 256-bit vectors). Such a CPU has AVX2, FMA, F16C and AVX-512 F, BW
/// and VL ([`panel::Isa::runs`]). Every copy gives the same bits; only the speed
/// differs.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512() -> bool {
    matches!(panel::Isa::best(), panel::Isa::Vnni | panel::Isa::Amx)
}

/// Quantizes `x` (a multiple of 32 long) into `out`.
pub(crate) fn quantize_q8(x: &[f32], out: &mut [Q8]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512 F, BW and VL, and AVX2, FMA and F16C.
        return unsafe { avx512::quantize_q8(x, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { avx2::quantize_q8(x, out) };
    }
    portable_quantize_q8(x, out)
}

fn portable_quantize_q8(x: &[f32], out: &mut [Q8]) {
    for (b, o) in x.chunks_exact(32).zip(out.iter_mut()) {
        o.d = quantize_block(b, &mut o.qs);
        o.sum = o.qs.iter().map(|&q| q as i32).sum();
    }
}

/// Quantizes `x` (a multiple of 256 long) into `out`.
pub(crate) fn quantize_q8k(x: &[f32], out: &mut [Q8K]) {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: the CPU has AVX-512 F, BW and VL, and AVX2, FMA and F16C.
        return unsafe { avx512::quantize_q8k(x, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { avx2::quantize_q8k(x, out) };
    }
    portable_quantize_q8k(x, out)
}

fn portable_quantize_q8k(x: &[f32], out: &mut [Q8K]) {
    for (b, o) in x.chunks_exact(256).zip(out.iter_mut()) {
        o.d = quantize_block(b, &mut o.qs);
        for (s, g) in o.bsums.iter_mut().zip(o.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Sub-block `j`'s 6-bit scale and min of a Q4_K block.
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Expands one row (`row` holds whole blocks) to f32 into `out` (its element count).
pub(crate) fn dequantize_row(t: WeightType, row: &[u8], out: &mut [f32]) {
    match t {
        WeightType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightType::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        WeightType::BF16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        WeightType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = d * (q as i8) as f32;
                }
            }
        }
        WeightType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    o[j] = d * ((q & 0xf) as i32 - 8) as f32;
                    o[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        WeightType::Q5_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(row.chunks_exact(22)) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, &q) in b[6..].iter().enumerate() {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    o[j] = d * (((q & 0xf) as u32 | h0) as i32 - 16) as f32;
                    o[j + 16] = d * (((q >> 4) as u32 | h1) as i32 - 16) as f32;
                }
            }
        }
        WeightType::Q4K => {
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(144)) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let (scales, qs) = (&b[4..16], &b[16..]);
                for c in 0..4 {
                    let (s1, m1) = scale_min_k4(2 * c, scales);
                    let (s2, m2) = scale_min_k4(2 * c + 1, scales);
                    let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * c..32 * c + 32];
                    let o = &mut o[64 * c..64 * c + 64];
                    for l in 0..32 {
                        o[l] = d1 * (q[l] & 0xf) as f32 - m1;
                        o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
        }
        WeightType::Q6K => {
            for (o, b) in out.chunks_exact_mut(256).zip(row.chunks_exact(210)) {
                let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for n in 0..2 {
                    let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
                    let sc = &sc[8 * n..];
                    let o = &mut o[128 * n..128 * n + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// An activation row prepared for one kind of weight.
#[derive(Clone, Copy)]
pub(crate) enum ActRow<'a> {
    F32(&'a [f32]),
    Q8(&'a [Q8]),
    Q8K(&'a [Q8K]),
}

/// The dot products of one weight row (`row`: whole blocks) with several activation
/// rows prepared for its type: `out[i] = row · acts[i]`. A kernel reads each weight
/// block once for a group of activation rows; each product is the same sequence of
/// operations whatever the group, so `out[i]` does not depend on the other rows.
pub(crate) type DotFn = fn(&[u8], &[ActRow<'_>], &mut [f32]);

/// One weight row with one activation row.
type Dot1 = fn(&[u8], ActRow<'_>) -> f32;

/// The dot product kernel for `t` on this CPU.
pub(crate) fn dot_fn(t: WeightType) -> DotFn {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        return avx2::dot_fn(t);
    }
    portable_dot_fn(t)
}

pub(crate) fn portable_dot_fn(t: WeightType) -> DotFn {
    fn each<const T: u8>(row: &[u8], acts: &[ActRow<'_>], out: &mut [f32]) {
        let one = portable_dot1(WeightType::ALL[T as usize]);
        for (o, &a) in out.iter_mut().zip(acts) {
            *o = one(row, a);
        }
    }
    match t {
        WeightType::F32 => each::<0>,
        WeightType::F16 => each::<1>,
        WeightType::BF16 => each::<2>,
        WeightType::Q8_0 => each::<3>,
        WeightType::Q4_0 => each::<4>,
        WeightType::Q5_0 => each::<5>,
        WeightType::Q4K => each::<6>,
        WeightType::Q6K => each::<7>,
    }
}

fn portable_dot1(t: WeightType) -> Dot1 {
    match t {
        WeightType::F32 => |r, a| dot_float(WeightType::F32, r, a),
        WeightType::F16 => |r, a| dot_float(WeightType::F16, r, a),
        WeightType::BF16 => |r, a| dot_float(WeightType::BF16, r, a),
        WeightType::Q8_0 => dot_q8_0,
        WeightType::Q4_0 => dot_q4_0,
        WeightType::Q5_0 => dot_q5_0,
        WeightType::Q4K => dot_q4k,
        WeightType::Q6K => dot_q6k,
    }
}

fn f32s(a: ActRow<'_>) -> &[f32] {
    match a {
        ActRow::F32(x) => x,
        _ => &[],
    }
}

#[inline(always)]
fn q8s(a: ActRow<'_>) -> &[Q8] {
    match a {
        ActRow::Q8(x) => x,
        _ => &[],
    }
}

#[inline(always)]
fn q8ks(a: ActRow<'_>) -> &[Q8K] {
    match a {
        ActRow::Q8K(x) => x,
        _ => &[],
    }
}

/// [`q8s`] of each of the first `N` rows of `a` (a kernel's group of rows).
#[inline(always)]
fn q8s_n<'a, const N: usize>(a: &[ActRow<'a>]) -> [&'a [Q8]; N] {
    std::array::from_fn(|i| q8s(a[i]))
}

/// [`q8ks`] of each of the first `N` rows of `a`.
#[inline(always)]
fn q8ks_n<'a, const N: usize>(a: &[ActRow<'a>]) -> [&'a [Q8K]; N] {
    std::array::from_fn(|i| q8ks(a[i]))
}

/// Float rows: eight running sums, combined pairwise at the end.
fn dot_float(t: WeightType, row: &[u8], a: ActRow<'_>) -> f32 {
    let x = f32s(a);
    let mut acc = [0.0f32; 8];
    let mut tmp = [0.0f32; 8];
    let w = t.block_bytes();
    for (xs, ws) in x.chunks(8).zip(row.chunks(8 * w)) {
        dequantize_row(t, ws, &mut tmp[..xs.len()]);
        for l in 0..xs.len() {
            acc[l] += tmp[l] * xs[l];
        }
    }
    super::kernels::reduce8(acc)
}

/// The 32-element formats: each block's integer sum (exact), then `sum = fma(d · x.d,
/// sums, sum)`, block by block, as every kernel of these types does (see `dot_q4k`).
fn dot_q8_0(row: &[u8], a: ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, x) in row.chunks_exact(34).zip(q8s(a)) {
        let s: i32 = b[2..]
            .iter()
            .zip(&x.qs)
            .map(|(&w, &x)| (w as i8) as i32 * x as i32)
            .sum();
        sum = (f16_at(b, 0) * x.d).mul_add(s as f32, sum);
    }
    sum
}

fn dot_q4_0(row: &[u8], a: ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, x) in row.chunks_exact(18).zip(q8s(a)) {
        let mut s = 0i32;
        for (j, &q) in b[2..].iter().enumerate() {
            s += ((q & 0xf) as i32 - 8) * x.qs[j] as i32;
            s += ((q >> 4) as i32 - 8) * x.qs[j + 16] as i32;
        }
        sum = (f16_at(b, 0) * x.d).mul_add(s as f32, sum);
    }
    sum
}

fn dot_q5_0(row: &[u8], a: ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, x) in row.chunks_exact(22).zip(q8s(a)) {
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let mut s = 0i32;
        for (j, &q) in b[6..].iter().enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            s += (((q & 0xf) as u32 | h0) as i32 - 16) * x.qs[j] as i32;
            s += (((q >> 4) as u32 | h1) as i32 - 16) * x.qs[j + 16] as i32;
        }
        sum = (f16_at(b, 0) * x.d).mul_add(s as f32, sum);
    }
    sum
}

/// Q4_K: each block's integer sums (exact), then `acc = fma(d · x.d, sums, acc)` and
/// the same for the mins, block by block: the float operations every Q4_K kernel
/// (one row at a time, or eight interleaved) does in the same order, so all give the
/// same bits.
fn dot_q4k(row: &[u8], a: ActRow<'_>) -> f32 {
    let (mut acc, mut acc_m) = (0.0f32, 0.0f32);
    for (b, x) in row.chunks_exact(144).zip(q8ks(a)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qs) = (&b[4..16], &b[16..]);
        let (mut si, mut mi) = (0i32, 0i32);
        for c in 0..4 {
            let (s1, m1) = scale_min_k4(2 * c, scales);
            let (s2, m2) = scale_min_k4(2 * c + 1, scales);
            let q = &qs[32 * c..32 * c + 32];
            let xs = &x.qs[64 * c..64 * c + 64];
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                lo += (q[l] & 0xf) as i32 * xs[l] as i32;
                hi += (q[l] >> 4) as i32 * xs[l + 32] as i32;
            }
            si += s1 as i32 * lo + s2 as i32 * hi;
            let b1 = x.bsums[4 * c] as i32 + x.bsums[4 * c + 1] as i32;
            let b2 = x.bsums[4 * c + 2] as i32 + x.bsums[4 * c + 3] as i32;
            mi += m1 as i32 * b1 + m2 as i32 * b2;
        }
        acc = (d * x.d).mul_add(si as f32, acc);
        acc_m = (dmin * x.d).mul_add(mi as f32, acc_m);
    }
    acc - acc_m
}

/// Q6_K: each block's integer sum (exact), then `sum = fma(d · x.d, sums, sum)`, block
/// by block, as every Q6_K kernel does (see `dot_q4k`).
fn dot_q6k(row: &[u8], a: ActRow<'_>) -> f32 {
    let mut sum = 0.0f32;
    for (b, x) in row.chunks_exact(210).zip(q8ks(a)) {
        let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
        let d = f16_at(b, 208);
        let mut si = 0i32;
        for n in 0..2 {
            let (ql, qh) = (&ql[64 * n..], &qh[32 * n..]);
            let xs = &x.qs[128 * n..];
            let mut part = [0i32; 8];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                part[is] += q1 * xs[l] as i32;
                part[is + 2] += q2 * xs[l + 32] as i32;
                part[is + 4] += q3 * xs[l + 64] as i32;
                part[is + 6] += q4 * xs[l + 96] as i32;
            }
            for (j, &p) in part.iter().enumerate() {
                si += (sc[8 * n + j] as i8) as i32 * p;
            }
        }
        sum = (d * x.d).mul_add(si as f32, sum);
    }
    sum
}

/// A Q6_K block's 256 weights as stored (0..=63, to be read minus 32), in order.
fn unpack_q6k(b: &[u8], out: &mut [u8; 256]) {
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C.
        return unsafe { avx2::unpack_q6k(b, out) };
    }
    let (ql, qh) = (&b[..128], &b[128..192]);
    for n in 0..2 {
        let (ql, qh, o) = (&ql[64 * n..], &qh[32 * n..], &mut out[128 * n..]);
        for l in 0..32 {
            o[l] = (ql[l] & 0xf) | ((qh[l] & 3) << 4);
            o[l + 32] = (ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4);
            o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 kernels. Weight blocks are read with unaligned loads (rows in a mapped
    //! file have any alignment), each from a slice whose length the load checks. Each
    //! kernel takes `N` activation rows at once: a weight block is loaded and unpacked
    //! once, then met by each row in turn, every row with its own accumulator.

    use super::{f16_at, q8ks_n, q8s_n, ActRow, DotFn, WeightType, Q8, Q8K};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub(super) fn available() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// `$many(row, acts, out)` runs `$kernel::<G>` over groups of `G` activation rows,
    /// then `$kernel::<1>` over the rest.
    macro_rules! many {
        ($many:ident, $kernel:ident, $g:literal) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            fn $many(row: &[u8], acts: &[ActRow<'_>], out: &mut [f32]) {
                let mut i = 0;
                while i + $g <= acts.len() {
                    let r = $kernel::<$g>(row, &acts[i..i + $g]);
                    out[i..i + $g].copy_from_slice(&r);
                    i += $g;
                }
                while i < acts.len() {
                    out[i] = $kernel::<1>(row, &acts[i..i + 1])[0];
                    i += 1;
                }
            }
        };
    }

    many!(many_f32, dot_f32, 2);
    many!(many_f16, dot_f16, 2);
    many!(many_bf16, dot_bf16, 2);
    many!(many_q8_0, dot_q8_0, 4);
    many!(many_q4_0, dot_q4_0, 4);
    many!(many_q5_0, dot_q5_0, 4);
    many!(many_q4k, dot_q4k, 4);
    many!(many_q6k, dot_q6k, 4);

    pub(super) fn dot_fn(t: WeightType) -> DotFn {
        // SAFETY (each closure): `dot_fn` is only called once `available()` said the CPU
        // has AVX2, FMA and F16C.
        match t {
            WeightType::F32 => |r, a, o| unsafe { many_f32(r, a, o) },
            WeightType::F16 => |r, a, o| unsafe { many_f16(r, a, o) },
            WeightType::BF16 => |r, a, o| unsafe { many_bf16(r, a, o) },
            WeightType::Q8_0 => |r, a, o| unsafe { many_q8_0(r, a, o) },
            WeightType::Q4_0 => |r, a, o| unsafe { many_q4_0(r, a, o) },
            WeightType::Q5_0 => |r, a, o| unsafe { many_q5_0(r, a, o) },
            WeightType::Q4K => |r, a, o| unsafe { many_q4k(r, a, o) },
            WeightType::Q6K => |r, a, o| unsafe { many_q6k(r, a, o) },
        }
    }

    /// `quantize_block` for a block of whole 32s: the same scale and, for finite
    /// values, the same integers (rounding halves away from zero, as `f32::round`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn quantize_block(b: &[f32], qs: &mut [i8]) -> f32 {
        let n = b.len().min(qs.len()) / 32 * 32;
        let magnitude = _mm256_set1_ps(f32::from_bits(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        for c in b[..n].chunks_exact(8) {
            // `max(|v|, m)`: a NaN is passed over, as `f32::max` does.
            m = _mm256_max_ps(_mm256_and_ps(load8f(c), magnitude), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let int = |c: &[f32]| {
            let v = _mm256_mul_ps(load8f(c), id);
            // Round half away from zero: truncate, then step away from zero where the
            // part cut off was at least a half (`v - t` is exact).
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
            let cut = _mm256_and_ps(_mm256_sub_ps(v, t), magnitude);
            let away = _mm256_or_ps(one, _mm256_andnot_ps(magnitude, v));
            let r = _mm256_add_ps(
                t,
                _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(cut, half), away),
            );
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        };
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (c, q) in b[..n].chunks_exact(32).zip(qs.chunks_exact_mut(32)) {
            let w01 = _mm256_packs_epi32(int(&c[..8]), int(&c[8..16]));
            let w23 = _mm256_packs_epi32(int(&c[16..24]), int(&c[24..]));
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
            // SAFETY: `q` holds 32 bytes; the store is unaligned.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes) };
        }
        d
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_q8(x: &[f32], out: &mut [Q8]) {
        for (b, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            o.d = quantize_block(b, &mut o.qs);
            o.sum = o.qs.iter().map(|&q| q as i32).sum();
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize_q8k(x: &[f32], out: &mut [Q8K]) {
        let (ones8, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
        for (b, o) in x.chunks_exact(256).zip(out.iter_mut()) {
            o.d = quantize_block(b, &mut o.qs);
            for (s, q) in o.bsums.chunks_exact_mut(2).zip(o.qs.chunks_exact(32)) {
                // Sums of 4 as i32, then of each 16 (one per 128-bit half).
                let s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, load32(q)), ones16);
                let s8 = _mm256_hadd_epi32(s4, s4);
                let s16 = _mm256_hadd_epi32(s8, s8);
                s[0] = _mm256_extract_epi32::<0>(s16) as i16;
                s[1] = _mm256_extract_epi32::<4>(s16) as i16;
            }
        }
    }

    /// 32 bytes from the start of `b` (panics when shorter).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn load32<T: Copy>(b: &[T]) -> __m256i {
        let b = &b[..32 / size_of::<T>()];
        // SAFETY: `b` holds 32 bytes; the load is unaligned.
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    }

    /// 16 bytes from the start of `b` (panics when shorter).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn load16(b: &[u8]) -> __m128i {
        let b = &b[..16];
        // SAFETY: `b` holds 16 bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) }
    }

    /// 8 f32s from the start of `x` (panics when shorter).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn load8f(x: &[f32]) -> __m256 {
        let x = &x[..8];
        // SAFETY: `x` holds 8 f32s; the load is unaligned.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    /// The f16 at `b[at..at + 2]` as f32, with the F16C instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn f16c(b: &[u8], at: usize) -> f32 {
        let h = u16::from_le_bytes([b[at], b[at + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    fn f32s<'a, const N: usize>(a: &[ActRow<'a>]) -> [&'a [f32]; N] {
        std::array::from_fn(|i| super::f32s(a[i]))
    }

    /// Float rows of `width`-byte elements: whole 32s with four FMA accumulators per
    /// activation row, whole 8s with one, the rest in scalar. `load` turns the first 8
    /// weights of a slice into f32s, `one` a single weight.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot_floats<const N: usize>(
        row: &[u8],
        x: [&[f32]; N],
        width: usize,
        load: impl Fn(&[u8]) -> __m256,
        one: impl Fn(&[u8]) -> f32,
    ) -> [f32; N] {
        let n = x
            .iter()
            .map(|x| x.len())
            .min()
            .unwrap_or(0)
            .min(row.len() / width);
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        let mut i = 0;
        while i + 32 <= n {
            let w: [__m256; 4] = std::array::from_fn(|j| load(&row[(i + 8 * j) * width..]));
            for (acc, x) in acc.iter_mut().zip(&x) {
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(w[j], load8f(&x[i + 8 * j..]), *a);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            let w = load(&row[i * width..]);
            for (acc, x) in acc.iter_mut().zip(&x) {
                acc[0] = _mm256_fmadd_ps(w, load8f(&x[i..]), acc[0]);
            }
            i += 8;
        }
        let mut out = [0.0f32; N];
        for ((o, acc), x) in out.iter_mut().zip(&acc).zip(&x) {
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut s = hsum(v);
            for k in i..n {
                s += one(&row[k * width..(k + 1) * width]) * x[k];
            }
            *o = s;
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_f32<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        dot_floats(
            row,
            f32s::<N>(a),
            4,
            |b| _mm256_castsi256_ps(load32(b)),
            |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_f16<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        dot_floats(
            row,
            f32s::<N>(a),
            2,
            |b| _mm256_cvtph_ps(load16(b)),
            |b| f16_at(b, 0),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_bf16<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        dot_floats(
            row,
            f32s::<N>(a),
            2,
            |b| {
                let h = _mm256_cvtepu16_epi32(load16(b));
                _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
            },
            |b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        )
    }

    /// The 32-element formats: `unpack` turns a block into 32 signed weights (i8) and
    /// its scale; each activation row adds scale × its scale × the integer dot product.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn dot_blocks32<const N: usize>(
        row: &[u8],
        a: &[ActRow<'_>],
        bytes: usize,
        unpack: impl Fn(&[u8]) -> __m256i,
    ) -> [f32; N] {
        let xs = q8s_n::<N>(a);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [0.0f32; N];
        // Four rows at once: their sums side by side in one vector.
        let mut acc4 = _mm_setzero_ps();
        let mut first = 0;
        if N == 1 {
            // One row: eight blocks' sums added up side by side, then the float updates
            // one block at a time.
            let x = xs[0];
            let mut sums = [_mm256_setzero_si256(); 8];
            let mut dd = [0.0f32; 8];
            for (j, b8) in row.chunks_exact(8 * bytes).enumerate() {
                for (k, b) in b8.chunks_exact(bytes).enumerate() {
                    let w = unpack(b);
                    let x = &x[8 * j + k];
                    let p = _mm256_maddubs_epi16(
                        _mm256_sign_epi8(w, w),
                        _mm256_sign_epi8(load32(&x.qs), w),
                    );
                    sums[k] = _mm256_madd_epi16(p, ones);
                    dd[k] = f16c(b, 0) * x.d;
                }
                let [s0, s1, s2, s3, s4, s5, s6, s7] = sums;
                let q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
                let q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s4, s5), _mm256_hadd_epi32(s6, s7));
                let total = _mm256_add_epi32(
                    _mm256_permute2x128_si256::<0x20>(q0, q1),
                    _mm256_permute2x128_si256::<0x31>(q0, q1),
                );
                let mut f = [0.0f32; 8];
                // SAFETY: `f` is 8 f32s; the store is unaligned.
                unsafe { _mm256_storeu_ps(f.as_mut_ptr(), _mm256_cvtepi32_ps(total)) };
                for (&dd, &f) in dd.iter().zip(&f) {
                    acc[0] = dd.mul_add(f, acc[0]);
                }
                first = 8 * (j + 1);
            }
        }
        for (j, b) in row.chunks_exact(bytes).enumerate().skip(first) {
            let w = unpack(b);
            let d = f16c(b, 0);
            let aw = _mm256_sign_epi8(w, w);
            let mut sums = [_mm256_setzero_si256(); N];
            for (s, x) in sums.iter_mut().zip(&xs) {
                let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(load32(&x[j].qs), w));
                *s = _mm256_madd_epi16(p, ones);
            }
            if N == 4 {
                // Each row's 8 lanes added up, the four rows' totals in one vector.
                let h = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(sums[0], sums[1]),
                    _mm256_hadd_epi32(sums[2], sums[3]),
                );
                let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                let xd = _mm_set_ps(xs[3][j].d, xs[2][j].d, xs[1][j].d, xs[0][j].d);
                let dd = _mm_mul_ps(_mm_set1_ps(d), xd);
                acc4 = _mm_fmadd_ps(dd, _mm_cvtepi32_ps(s), acc4);
            } else {
                for ((acc, x), s) in acc.iter_mut().zip(&xs).zip(&sums) {
                    let s =
                        _mm_add_epi32(_mm256_castsi256_si128(*s), _mm256_extracti128_si256(*s, 1));
                    *acc = (d * x[j].d).mul_add(hsum_epi32(s) as f32, *acc);
                }
            }
        }
        if N == 4 {
            let mut four = [0.0f32; 4];
            // SAFETY: `four` is 4 f32s; the store is unaligned.
            unsafe { _mm_storeu_ps(four.as_mut_ptr(), acc4) };
            acc[..4].copy_from_slice(&four);
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q8_0<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        dot_blocks32(row, a, 34, |b| load32(&b[2..]))
    }

    /// 16 bytes of nibbles to 32 bytes: low nibbles first, then high.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn nibbles(b: &[u8]) -> __m256i {
        let q = load16(b);
        let lo = _mm_and_si128(q, _mm_set1_epi8(0xf));
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0xf));
        _mm256_set_m128i(hi, lo)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q4_0<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        dot_blocks32(row, a, 18, |b| {
            _mm256_sub_epi8(nibbles(&b[2..]), _mm256_set1_epi8(8))
        })
    }

    /// The 32 high bits of a Q5_0 block as bytes 0x10 (bit set) or 0.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn high_bits(qh: u32) -> __m256i {
        // Byte i takes the byte of `qh` holding bit i, then tests that bit.
        let v = _mm256_set1_epi32(qh as i32);
        let shuf = _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        );
        let bytes = _mm256_shuffle_epi8(v, shuf);
        let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q5_0<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        dot_blocks32(row, a, 22, |b| {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let w = _mm256_or_si256(nibbles(&b[6..]), high_bits(qh));
            _mm256_sub_epi8(w, _mm256_set1_epi8(16))
        })
    }

    /// A Q4_K block's 12 packed bytes as its 8 scales (bytes 0-7) and 8 mins (bytes
    /// 8-15), by GGML's bit layout (see `scale_min_k4`).
    #[inline(always)]
    fn unpack_k4(s: &[u8]) -> [u32; 4] {
        const M1: u32 = 0x3f3f_3f3f;
        const M2: u32 = 0x0f0f_0f0f;
        const M3: u32 = 0x0303_0303;
        let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
        let (a, b, c) = (w(0), w(1), w(2));
        [
            a & M1,
            (c & M2) | (((a >> 6) & M3) << 4),
            b & M1,
            ((c >> 4) & M2) | (((b >> 6) & M3) << 4),
        ]
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q4k<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        let xs = q8ks_n::<N>(a);
        let (mut acc, mut acc_m) = ([0.0f32; N], [0.0f32; N]);
        let low = _mm256_set1_epi8(0xf);
        for (j, b) in row.chunks_exact(144).enumerate() {
            let (d, dmin) = (f16c(b, 0), f16c(b, 2));
            let (scales, qs) = (&b[4..16], &b[16..]);
            let u = unpack_k4(scales);
            // 8 scales then 8 mins, as i16.
            let sm = _mm256_cvtepu8_epi16(_mm_set_epi32(
                u[3] as i32,
                u[2] as i32,
                u[1] as i32,
                u[0] as i32,
            ));
            let mins = _mm256_extracti128_si256(sm, 1);
            let sc128 = _mm256_castsi256_si128(sm);
            let sc = _mm256_set_m128i(sc128, sc128);
            // Chunk by chunk (64 weights: two sub-blocks), each chunk unpacked once and
            // met by every activation row, so that few vectors are live at once.
            let mut sumi = [_mm256_setzero_si256(); N];
            for c in 0..4 {
                let v = load32(&qs[32 * c..]);
                let lo = _mm256_and_si256(v, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                // Broadcast i16 scales 2c and 2c + 1: bytes (2k, 2k + 1) everywhere.
                let pick = |k: i16| _mm256_set1_epi16((2 * k) | ((2 * k + 1) << 8));
                let s_lo = _mm256_shuffle_epi8(sc, pick(2 * c as i16));
                let s_hi = _mm256_shuffle_epi8(sc, pick(2 * c as i16 + 1));
                for (sumi, x) in sumi.iter_mut().zip(&xs) {
                    let x = &x[j];
                    let p1 =
                        _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(&x.qs[64 * c..])), s_lo);
                    let p2 = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(hi, load32(&x.qs[64 * c + 32..])),
                        s_hi,
                    );
                    *sumi = _mm256_add_epi32(*sumi, _mm256_add_epi32(p1, p2));
                }
            }
            for (((acc, acc_m), x), sumi) in
                acc.iter_mut().zip(acc_m.iter_mut()).zip(&xs).zip(&sumi)
            {
                let x = &x[j];
                // Sums of each 32 activations, times the mins.
                let bs = load32(&x.bsums);
                let pairs =
                    _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                let prod = _mm_madd_epi16(mins, pairs);
                let s = _mm_add_epi32(
                    _mm256_castsi256_si128(*sumi),
                    _mm256_extracti128_si256(*sumi, 1),
                );
                *acc = (d * x.d).mul_add(hsum_epi32(s) as f32, *acc);
                *acc_m = (dmin * x.d).mul_add(hsum_epi32(prod) as f32, *acc_m);
            }
        }
        std::array::from_fn(|i| acc[i] - acc_m[i])
    }

    /// The sum of 4 i32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum_epi32(v: __m128i) -> i32 {
        let v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01>(v));
        _mm_cvtsi128_si32(v)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_q6k<const N: usize>(row: &[u8], a: &[ActRow<'_>]) -> [f32; N] {
        let xs = q8ks_n::<N>(a);
        let mut acc = [0.0f32; N];
        for (j, b) in row.chunks_exact(210).enumerate() {
            let sc = &b[192..208];
            let d = f16c(b, 208);
            // Eight quarters of 32 weights (stored plus 32), and each quarter's two
            // scales (elements 0-15 take the first, 16-31 the second).
            // The 16 scales as i16; quarter k (32 weights) takes scales 2k (its first 16
            // weights) and 2k + 1 (the rest), broadcast to each half.
            let sc16 = _mm256_cvtepi8_epi16(load16(sc));
            let lanes = [
                _mm256_permute2x128_si256(sc16, sc16, 0x00),
                _mm256_permute2x128_si256(sc16, sc16, 0x11),
            ];
            let pick = |e: i16| (2 * (e % 8)) | ((2 * (e % 8) + 1) << 8);
            let mut sumi = [_mm256_setzero_si256(); N];
            for n in 0..2 {
                let ql = &b[64 * n..];
                let qh = load32(&b[128 + 32 * n..]);
                let (l0, l1) = (load32(ql), load32(&ql[32..]));
                for k in 0..4 {
                    let q = q6k_quarter(l0, l1, qh, k);
                    let e = (8 * n + 2 * k) as i16;
                    let mask =
                        _mm256_set_m128i(_mm_set1_epi16(pick(e + 1)), _mm_set1_epi16(pick(e)));
                    let scale = _mm256_shuffle_epi8(lanes[n], mask);
                    for (sumi, x) in sumi.iter_mut().zip(&xs) {
                        let xk = load32(&x[j].qs[128 * n + 32 * k..]);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xk), scale);
                        *sumi = _mm256_add_epi32(*sumi, p);
                    }
                }
            }
            for ((acc, x), sumi) in acc.iter_mut().zip(&xs).zip(sumi) {
                let x = &x[j];
                // The values are stored plus 32: take 32 × scale × (sum of each 16) back.
                let offset = _mm256_madd_epi16(sc16, load32(&x.bsums));
                let sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(offset, 5));
                let s = _mm_add_epi32(
                    _mm256_castsi256_si128(sumi),
                    _mm256_extracti128_si256(sumi, 1),
                );
                *acc = (d * x.d).mul_add(hsum_epi32(s) as f32, *acc);
            }
        }
        acc
    }

    /// Quarter `k` (32 weights, as stored: 0..=63) of one half of a Q6_K block, from the
    /// half's two 32-byte runs of low nibbles (`l0`, `l1`) and its 32 bytes of high bits.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn q6k_quarter(l0: __m256i, l1: __m256i, qh: __m256i, k: usize) -> __m256i {
        let low = _mm256_set1_epi8(0xf);
        let lowbits = match k {
            0 => _mm256_and_si256(l0, low),
            1 => _mm256_and_si256(l1, low),
            2 => _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
            _ => _mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
        };
        let h = match k {
            0 => qh,
            1 => _mm256_srli_epi16(qh, 2),
            2 => _mm256_srli_epi16(qh, 4),
            _ => _mm256_srli_epi16(qh, 6),
        };
        let high = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(3)), 4);
        _mm256_or_si256(lowbits, high)
    }

    /// [`super::unpack_q6k`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn unpack_q6k(b: &[u8], out: &mut [u8; 256]) {
        for n in 0..2 {
            let ql = &b[64 * n..];
            let qh = load32(&b[128 + 32 * n..]);
            let (l0, l1) = (load32(ql), load32(&ql[32..]));
            for k in 0..4 {
                let q = q6k_quarter(l0, l1, qh, k);
                let o = &mut out[128 * n + 32 * k..128 * n + 32 * k + 32];
                // SAFETY: `o` holds 32 bytes; the store is unaligned.
                unsafe { _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, q) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! Quantizing activations with 512-bit vectors, where the products run AVX-512.

    use super::{Q8, Q8K};
    use std::arch::x86_64::*;

    /// [`super::portable_quantize_q8`] a block (two vectors) at a time: the same
    /// scale, and for finite values the same integers (rounding halves away from zero,
    /// as `f32::round`) and their sum, as `avx2::quantize_q8`'s.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) fn quantize_q8(x: &[f32], out: &mut [Q8]) {
        for (b, o) in x.chunks_exact(32).zip(out.iter_mut()) {
            let mut sum = _mm512_setzero_si512();
            o.d = quantize_block::<2>(b, &mut o.qs, |_, q| sum = _mm512_add_epi32(sum, q));
            o.sum = _mm512_reduce_add_epi32(sum);
        }
    }

    /// [`super::portable_quantize_q8k`] in 512-bit vectors, as [`quantize_q8`]: each
    /// vector's 16 integers are a sub-block, summed as they are made.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) fn quantize_q8k(x: &[f32], out: &mut [Q8K]) {
        for (b, o) in x.chunks_exact(256).zip(out.iter_mut()) {
            let bsums = &mut o.bsums;
            o.d = quantize_block::<16>(b, &mut o.qs, |c, q| {
                // 16 integers of -127..=127: the sum fits an i16.
                bsums[c] = _mm512_reduce_add_epi32(q) as i16;
            });
        }
    }

    /// The first `16 V` values of `b` to i8 in `qs` with one scale (their largest
    /// magnitude maps to 127), as the portable `quantize_block`; returns the scale.
    /// `each(c, q)` gets vector `c`'s 16 integers as i32s.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    #[inline]
    fn quantize_block<const V: usize>(
        b: &[f32],
        qs: &mut [i8],
        mut each: impl FnMut(usize, __m512i),
    ) -> f32 {
        let (b, qs) = (&b[..16 * V], &mut qs[..16 * V]);
        let load = |c: usize| {
            // SAFETY: `b` holds `16 V` f32s and `c < V`; the load is unaligned.
            unsafe { _mm512_loadu_ps(b.as_ptr().add(16 * c)) }
        };
        // `max(|v|, m)`: a NaN is passed over, as `f32::max` does; `m` holds none, so
        // the order of the lanes' maximum does not matter.
        let mut m = _mm512_setzero_ps();
        for c in 0..V {
            m = _mm512_max_ps(_mm512_abs_ps(load(c)), m);
        }
        let d = _mm512_reduce_max_ps(m) / 127.0;
        let id = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let sign = _mm512_set1_epi32(i32::MIN);
        let (half, one) = (_mm512_set1_ps(0.5), _mm512_set1_ps(1.0));
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for c in 0..V {
            let v = _mm512_mul_ps(load(c), id);
            // Round half away from zero: truncate, then step away from zero where the
            // part cut off was at least a half (`v - t` is exact).
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
            let cut = _mm512_abs_ps(_mm512_sub_ps(v, t));
            let away = _mm512_castsi512_ps(_mm512_or_si512(
                _mm512_castps_si512(one),
                _mm512_and_si512(_mm512_castps_si512(v), sign),
            ));
            let step = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(cut, half);
            let r = _mm512_mask_add_ps(t, step, t, away);
            let q = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            // In -127..=127: narrowing saturates nothing.
            let bytes = _mm512_cvtsepi32_epi8(q);
            let to = &mut qs[16 * c..16 * c + 16];
            // SAFETY: `to` holds 16 bytes; the store is unaligned.
            unsafe { _mm_storeu_si128(to.as_mut_ptr().cast(), bytes) };
            each(c, q);
        }
        d
    }
}

#[path = "quant_panel.rs"]
pub(crate) mod panel;

#[cfg(test)]
#[path = "quant_tests.rs"]
pub(crate) mod tests;
