//! Q8_0 panel products of many token rows on AMX tiles (Intel Xeon since Sapphire
//! Rapids), chosen only where `INFER_CPU_MAX_ISA=amx` asks for them. One `tdpbssd`
//! multiplies a Q8_0 block of 16 token rows (32 signed activation bytes each, a tile's
//! rows, read where the prepared activations lie) by the block of two panels' 16
//! weight rows (a tile of 8 rows of 64 bytes: 4 bytes of each of the 16 rows), into
//! 16 x 16 exact 32-bit sums, where AVX-512 VNNI takes a `vpdpbusd` for each 4 columns
//! of each token. A panel holds 8 rows, and a tile's multiply costs the same for 8
//! columns as for 16, so each call lays two panels' blocks side by side first (back to
//! signed bytes on the way). The sums go through memory to AVX-512, which applies each
//! block's scales exactly as the VNNI kernel does (`vnni::gemm2_q8_0`): the same float
//! operations on the same integers, so the same bits.
//!
//! On an Emerald Rapids core the kernel ran 0.95-1.2x the VNNI kernel's speed for 32
//! token rows (as the hour went), about even for 16, and a 512-token prompt no faster end to end
//! (docs/PERFORMANCE.md), so the tiles are not the default. The scale step costs about
//! what the VNNI kernel's own does, and the tiles read the token rows' blocks from L2,
//! 1,280 bytes apart; panels of 16 rows packed at load and the activations laid out
//! block by block for the tiles are what would take more.
//!
//! Tiles are instructions Rust has no stable intrinsics for, so they are written in
//! inline assembly. A process must ask Linux for the tile state first
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, once: [`granted`]); each kernel call loads its
//! tile configuration and at its end puts back the one the thread had (or releases the
//! tiles where it had none), so another library's tiles on the caller's thread keep
//! their shapes across a product.

use super::super::{q8s, Q8};
use super::vnni::f16s2;
use super::{ActRow, Q8Panel};
use std::arch::asm;
use std::arch::x86_64::*;

/// Whether the CPU has AMX tiles with 8-bit products (CPUID leaf 7: AMX-TILE and
/// AMX-INT8).
pub(super) fn on_cpu() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        edx & (3 << 24) == 3 << 24
    })
}

/// Whether the OS lets this process use the tiles: asked once, on the first call (Linux
/// grants them to a process that asks; other systems are not asked).
pub(super) fn granted() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| on_cpu() && ask())
}

#[cfg(target_os = "linux")]
fn ask() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: this `arch_prctl` only asks the kernel to let the process's threads use the
    // tile data state; it reads and writes no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(target_os = "linux"))]
fn ask() -> bool {
    false
}

/// A tile configuration (palette 1), 64 bytes as `ldtilecfg` reads them.
#[repr(C, align(64))]
struct Config([u8; 64]);

/// The tiles for token tiles of `m` rows: 0 and 1 two token tiles' bytes of a block
/// (`m` rows of 32), 2 the block's weights of both panels (8 rows of 64 bytes: 4 bytes
/// of each of the 16 rows), 3 and 4 each token tile's sums (`m` rows of 16 i32).
const fn config(m: u8) -> Config {
    let mut c = [0u8; 64];
    c[0] = 1;
    let tiles: [(u8, u8); 5] = [(m, 32), (m, 32), (8, 64), (m, 64), (m, 64)];
    let mut i = 0;
    while i < tiles.len() {
        // Bytes 16.. hold each tile's width in bytes (u16), bytes 48.. its rows.
        c[16 + 2 * i] = tiles[i].1;
        c[48 + i] = tiles[i].0;
        i += 1;
    }
    Config(c)
}

/// A panel block's weights of two panels, 4-byte groups of the 16 rows side by side
/// (block `k`, group `j`: `a`'s 8 rows, then `b`'s), as a tile of the 16 rows wants them.
#[repr(C, align(64))]
struct Weights([[[u32; 16]; 8]; 8]);

/// A panel block's sums of two token tiles, as the tiles store them: block `k`, token
/// row `t` (of up to 32), the 16 weight rows.
#[repr(C, align(64))]
struct Sums([[[i32; 16]; 32]; 8]);

/// [`super::Panel::gemm_pair_with`] of Q8_0 panels on tiles, for the first token rows
/// of `acts` in runs of 32 (two token tiles), then 16 and 8 (one), when their blocks lie
/// evenly apart in memory (rows of one prepared matrix): `out[t]` as
/// `vnni::gemm2_q8_0` gives it. Returns how many token rows it did; the caller does
/// the rest.
///
/// # Safety
/// The CPU must run AVX-512 VNNI, and [`granted`] must have returned true.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm2_q8_0(
    pa: &[Q8Panel],
    pb: &[Q8Panel],
    acts: &[ActRow<'_>],
    out: &mut [[f32; 16]],
) -> usize {
    let n = pa.len().min(pb.len());
    let mut done = 0;
    for (tiles, rows) in [(2, 16), (1, 16), (1, 8)] {
        let m = tiles * rows;
        while acts.len() - done >= m {
            let mut all: [&[Q8]; 32] = [&[]; 32];
            for (r, &a) in all.iter_mut().zip(&acts[done..done + m]) {
                *r = q8s(a);
            }
            let xs = &all[..m];
            let Some(stride) = even_stride(xs, 8 * n) else {
                return done;
            };
            let o = &mut out[done..done + m];
            // SAFETY: the caller's promise (AVX-512 VNNI, tiles granted); `xs` rows are
            // `stride` bytes apart with `8 n` blocks each (checked by `even_stride`).
            unsafe {
                match (tiles, rows) {
                    (2, _) => tiles_q8_0::<2, 16>(&pa[..n], &pb[..n], xs, stride, o),
                    (_, 16) => tiles_q8_0::<1, 16>(&pa[..n], &pb[..n], xs, stride, o),
                    _ => tiles_q8_0::<1, 8>(&pa[..n], &pb[..n], xs, stride, o),
                }
            }
            done += m;
        }
    }
    done
}

/// The distance in bytes from each row of `xs` to the next, when it is the same for
/// every row and every row has at least `blocks` blocks.
fn even_stride(xs: &[&[Q8]], blocks: usize) -> Option<isize> {
    if xs.iter().any(|x| x.len() < blocks) {
        return None;
    }
    let at = |t: usize| xs[t].as_ptr() as isize;
    let stride = if xs.len() > 1 { at(1) - at(0) } else { 0 };
    (0..xs.len())
        .all(|t| at(t) == at(0) + t as isize * stride)
        .then_some(stride)
}

/// `T` tiles of `R` token rows (`xs`, `stride` bytes apart, `8 pa.len()` blocks each)
/// against the 16 rows of `pa` and `pb`, block by block on tiles, each block's sums
/// scaled and added in AVX-512 as `vnni::gemm2_q8_0` does.
///
/// # Safety
/// As [`gemm2_q8_0`], and `xs` as said: `T R` rows, `xs[t]` starting `t * stride`
/// bytes after `xs[0]` and holding at least `8 pa.len()` blocks; `pb.len() ==
/// pa.len()`; `out` has `T R` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tiles_q8_0<const T: usize, const R: usize>(
    pa: &[Q8Panel],
    pb: &[Q8Panel],
    xs: &[&[Q8]],
    stride: isize,
    out: &mut [[f32; 16]],
) {
    let m = T * R;
    debug_assert!(xs.len() == m && out.len() == m && pa.len() == pb.len());
    let cfg = const { config(R as u8) };
    // Written before they are read (the weights a panel block at a time, the sums of
    // rows `0..m` by the tiles): not cleared at each call. Two of each: the tiles of
    // one block run while the scales of the one before are applied.
    let mut w = [const { std::mem::MaybeUninit::<Weights>::uninit() }; 2];
    let mut sums = [const { std::mem::MaybeUninit::<Sums>::uninit() }; 2];
    let flip = _mm512_set1_epi32(0x8080_8080u32 as i32);
    for o in out.iter_mut() {
        *o = [0.0; 16];
    }
    // The caller's tile configuration, put back at the end: another library on the
    // same thread (oneDNN, llama.cpp) may have configured the tiles once for all its
    // calls. All zeros where none is loaded.
    let mut saved = Config([0; 64]);
    // SAFETY: stores the 64-byte configuration into `saved`; the CPU has tiles.
    unsafe { asm!("sttilecfg [{}]", in(reg) &mut saved, options(nostack, preserves_flags)) };
    // SAFETY: `cfg` is a 64-byte tile configuration; the CPU has tiles (the caller).
    unsafe { asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly, preserves_flags)) };
    let first = xs[0].as_ptr() as *const u8;
    // Panel block `b`'s tiles, then panel block `b - 1`'s scales: the tile unit
    // multiplies while the vectors scale, where a block's scales straight after its
    // tiles would wait for its sums to come back through memory.
    for (b, (p, q)) in pa.iter().zip(pb).enumerate() {
        // The two panels' weights side by side, so that one tile holds the 16 rows,
        // back from plus 128 to signed bytes (so no sum of the activations comes off).
        let wb = w[b % 2].as_mut_ptr();
        for k in 0..8 {
            for j in 0..8 {
                // SAFETY: `p.qs[k][j]` and `q.qs[k][j]` are 32 bytes each; `wb[k][j]` is
                // 64 bytes, 64-byte aligned, inside `w[b % 2]`.
                unsafe {
                    let a = _mm256_loadu_si256(p.qs[k][j].as_ptr().cast());
                    let b = _mm256_loadu_si256(q.qs[k][j].as_ptr().cast());
                    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
                    let to = (&raw mut (*wb).0[k][j]).cast::<__m512i>();
                    _mm512_store_si512(to.cast(), _mm512_xor_si512(v, flip));
                }
            }
        }
        for k in 0..8 {
            let i = 8 * b + k;
            let at = i * size_of::<Q8>() + std::mem::offset_of!(Q8, qs);
            let x = first.wrapping_add(at);
            // SAFETY: in bounds of `w[b % 2]` (block `k < 8`).
            let wk = unsafe { (&raw const (*wb).0[k]).cast::<u8>() };
            // SAFETY: in bounds of `sums[b % 2]` (block `k < 8`).
            let o = unsafe { (&raw mut (*sums[b % 2].as_mut_ptr()).0[k]).cast::<[i32; 16]>() };
            if T == 2 {
                // SAFETY: tiles 0 and 1 read R rows of 32 bytes each, row `t` at `x + t
                // stride` and `x + (R + t) stride`: block `i` of token row `t`'s (`R +
                // t`'s) quants, inside `xs` (the caller's promise); tile 2 reads the 512
                // bytes of `wk`; tiles 3 and 4 are stored into rows `0..2R` of block `k`
                // of `sums[b % 2]` (64 bytes each). The tiles are configured above.
                unsafe {
                    asm!(
                        "tilezero tmm3",
                        "tilezero tmm4",
                        "tileloadd tmm2, [{w} + {s64}]",
                        "tileloadd tmm0, [{x} + {sx}]",
                        "tdpbssd tmm3, tmm0, tmm2",
                        "tileloadd tmm1, [{x1} + {sx}]",
                        "tdpbssd tmm4, tmm1, tmm2",
                        "tilestored [{o} + {s64}], tmm3",
                        "tilestored [{o1} + {s64}], tmm4",
                        w = in(reg) wk,
                        x = in(reg) x,
                        x1 = in(reg) x.wrapping_offset(R as isize * stride),
                        sx = in(reg) stride,
                        o = in(reg) o,
                        o1 = in(reg) o.wrapping_add(R),
                        s64 = in(reg) 64usize,
                        options(nostack, preserves_flags),
                    )
                };
            } else {
                // SAFETY: as above, for the one token tile (`R` rows).
                unsafe {
                    asm!(
                        "tilezero tmm3",
                        "tileloadd tmm2, [{w} + {s64}]",
                        "tileloadd tmm0, [{x} + {sx}]",
                        "tdpbssd tmm3, tmm0, tmm2",
                        "tilestored [{o} + {s64}], tmm3",
                        w = in(reg) wk,
                        x = in(reg) x,
                        sx = in(reg) stride,
                        o = in(reg) o,
                        s64 = in(reg) 64usize,
                        options(nostack, preserves_flags),
                    )
                };
            }
        }
        // After a panel block's tiles, the scales of the panel block before (its sums
        // were stored a panel block ago), a token at a time over its 8 blocks.
        if b > 0 {
            let b = b - 1;
            // SAFETY: panel block `b`'s tiles stored its sums of every token row.
            unsafe { scale_block(&pa[b], &pb[b], b, xs, sums[b % 2].as_ptr(), out) };
        }
    }
    if !pa.is_empty() {
        let b = pa.len() - 1;
        // SAFETY: as above, for the last panel block.
        unsafe { scale_block(&pa[b], &pb[b], b, xs, sums[b % 2].as_ptr(), out) };
    }
    if saved.0[0] == 0 {
        // SAFETY: releases the tiles this call configured (none were before).
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    } else {
        // SAFETY: `saved` is the configuration the CPU held at entry.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &saved, options(nostack, readonly, preserves_flags))
        };
    }
}

/// Panel block `b`'s scales (`p`, `q`) applied to its sums (`sums`, stored by its
/// tiles), into `out`, a token at a time over the 8 blocks, as `vnni::gemm2_q8_0` does.
///
/// # Safety
/// `sums` holds the panel block's sums of `out.len()` token rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scale_block(
    p: &Q8Panel,
    q: &Q8Panel,
    b: usize,
    xs: &[&[Q8]],
    sums: *const Sums,
    out: &mut [[f32; 16]],
) {
    let d: [__m512; 8] = std::array::from_fn(|k| f16s2(&p.d[k], &q.d[k]));
    for (t, o) in out.iter_mut().enumerate() {
        // SAFETY: `o` is 16 f32s.
        let mut acc = unsafe { _mm512_loadu_ps(o.as_ptr()) };
        for (k, d) in d.iter().enumerate() {
            let xd = _mm512_set1_ps(xs[t][8 * b + k].d);
            // SAFETY: row `t` of block `k`'s sums is 16 i32s, 64-byte aligned, stored by
            // the tiles (the caller's promise).
            let s = unsafe { _mm512_load_si512((&raw const (*sums).0[k][t]).cast()) };
            acc = _mm512_fmadd_ps(_mm512_mul_ps(*d, xd), _mm512_cvtepi32_ps(s), acc);
        }
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Isa, Panel, Q8Panel};
    use super::*;

    /// A configuration loaded before a product is the one loaded after it; with none
    /// loaded before, none is after.
    #[test]
    fn the_callers_tile_configuration_is_kept() {
        if !Isa::Amx.runs() {
            return;
        }
        let rows: Vec<Vec<u8>> = (0..16)
            .map(|r| {
                (0..8)
                    .flat_map(|b| {
                        let mut block = vec![0x00, 0x3c]; // scale 1.0 (f16)
                        block.extend((0..32).map(|i| ((r * 7 + b * 3 + i) % 200) as u8));
                        block
                    })
                    .collect()
            })
            .collect();
        let mut a = vec![Q8Panel::default(); 1];
        let mut b = vec![Q8Panel::default(); 1];
        Q8Panel::pack(std::array::from_fn(|i| &rows[i][..]), &mut a);
        Q8Panel::pack(std::array::from_fn(|i| &rows[8 + i][..]), &mut b);
        let q8: Vec<Q8> = (0..16 * 8)
            .map(|i| Q8 {
                d: 0.5,
                qs: std::array::from_fn(|j| ((i + j) % 50) as i8 - 25),
                sum: 0,
            })
            .collect();
        let acts: Vec<ActRow<'_>> = q8.chunks_exact(8).map(ActRow::Q8).collect();
        let mut out = vec![[0.0f32; 16]; 16];
        let stored = || {
            let mut c = Config([0; 64]);
            // SAFETY: stores 64 bytes into `c`; the CPU has tiles (checked above).
            unsafe { asm!("sttilecfg [{}]", in(reg) &mut c, options(nostack, preserves_flags)) };
            c.0
        };
        // None before: none after.
        // SAFETY: the CPU runs AVX-512 VNNI and the tiles are granted (checked above).
        assert_eq!(unsafe { gemm2_q8_0(&a, &b, &acts, &mut out) }, 16);
        assert_eq!(stored(), [0; 64]);
        // One of another shape before: the same after.
        let mine = config(3);
        // SAFETY: loads a valid configuration.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &mine, options(nostack, readonly, preserves_flags))
        };
        // SAFETY: as above.
        assert_eq!(unsafe { gemm2_q8_0(&a, &b, &acts, &mut out) }, 16);
        assert_eq!(stored(), mine.0);
        // SAFETY: releases the tiles this test configured.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}
