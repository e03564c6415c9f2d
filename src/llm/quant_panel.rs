//! Q4_K, Q6_K and Q8_0 weights eight rows at a time, interleaved (a "panel"), for
//! products with Q8_0 and Q4_K matrices (all of them) and with Q6_K matrices of many
//! token rows (prompts, many streams).
//!
//! A row-at-a-time kernel spends most of its instructions on work a single row cannot
//! share: applying each sub-block's scale to each token's partial sums, and combining
//! the lanes of a vector into one output. In a panel each 32-bit lane of a vector holds
//! one row: one `maddubs` multiplies 4 weights of each of 8 rows by the same 4
//! activations, the 16-bit partial sums of a sub-block add up in place (they cannot
//! overflow: Q4_K 8 × 2 × 15 × 127, Q6_K 2 × 2 × 63 × 127, both < 32768), one `madd`
//! applies 8 rows' scales, and the block's float update is one vector for 8 outputs.
//! (Q8_0's products of two signed bytes cannot add up in 16 bits; its panels save the
//! per-row float work only.)
//!
//! Packing is a transpose of 4-byte groups and costs about as much as one token's
//! product. A Q8_0 panel is the file's size (f16 scales) and a Q4_K panel 1.03x (f16
//! scales, a byte per 6-bit sub-block scale and min, widened in the kernel), so their
//! matrices are packed once, at load (`linear::Matrix::packed`), and the file's pages
//! released; packing per call had cost a third of the time of 8 streams' decoding
//! steps, and a panel is one sequential stream for the prefetcher. Q6_K's panels hold
//! the weights unpacked to bytes and their scales widened (1.7x the file's bytes). A
//! layout of the file's size that puts each weight's nibble and bit pair together in
//! the kernel was tried: the extra shifts and masks made products of many tokens 30 %
//! slower and the 32000-row head of a one-token decode 40 % slower. So Q6_K matrices
//! stay in the file, and a product of 4 or more token rows packs each block of rows
//! once per call (into a thread's scratch) and runs every token group over it. In AVX2
//! the packing unpacks each 32 weights of the eight rows into registers and transposes
//! them there, with the scales likewise: it costs a third of a 32-token product's time
//! (half, unpacked a row at a time through memory).
//!
//! Each kernel is written twice: in AVX2 (`maddubs` into 16-bit sums) and in AVX-512
//! VNNI (`vpdpbusd`, which multiplies 4 byte pairs and adds them into a 32-bit lane in
//! one instruction); the 256-bit VNNI kernels are also built for AVX-VNNI (the VEX form
//! of `vpdpbusd`, on CPUs without AVX-512). The VNNI kernels also run two panels at once (16 rows, a row to a
//! lane of a 512-bit vector) for 4 or more tokens: on Zen 4 a 512-bit `vpdpbusd`
//! issues as often as a 256-bit one, so it does twice the multiply-adds per cycle; for
//! Q4_K and Q6_K they take 8 token rows a call where there are (`pairs_by_eights`), as
//! taking the weights apart and loading the scales is shared by more multiplies (on
//! an Emerald Rapids core, 32 tokens' Q4_K products 1.1x and Q6_K's 1.1-1.2x). The
//! AVX2 Q8_0 kernel runs two panels at once too, each token's 4 activations broadcast
//! once for both (on Zen 3, 1.2x the multiply-adds a second of one panel at a time,
//! decoding 8 or 32 streams 1.2x faster); for Q4_K the 16 rows' sums take more
//! registers than there are, and two panels at once ran 10-20 % slower. Where AVX2's
//! kernels are the fastest, Q8_0 panels store each weight as sign and magnitude
//! ([`Q8SmPanel`]) rather than plus 128: two fewer vector operations a step.
//!
//! The outputs are the same bits as the row kernels' (`super::dot_q4k`,
//! `super::dot_q6k`, `super::dot_q8_0`): the integer sums of a block are exact in any order, and the float
//! operations per (row, token) are the same, block by block (`acc = fma(d · x.d, sums,
//! acc)`; for Q4_K the same for the mins, then `acc - mins`).

use super::{f16_at, scale_min_k4, unpack_q6k, ActRow};

/// Columns of one panel block (of any type).
pub(crate) const PANEL_COLS: usize = 256;

/// A weight type's panel: one 256-column block of eight rows.
pub(crate) trait Panel: Copy + Default + Send + 'static {
    /// Interleaves eight rows (whole blocks each, all the same length) into `out`, one
    /// panel block per 256 columns.
    fn pack(rows: [&[u8]; 8], out: &mut [Self]);
    /// `out[i][r] = row r · acts[i]` for the eight rows packed in `panel` (as many
    /// panel blocks as the activation rows have Q8_K blocks), in the kernels of `isa`.
    /// Call only when `isa.runs()`.
    fn gemm_with(isa: Isa, panel: &[Self], acts: &[ActRow<'_>], out: &mut [[f32; 8]]);

    /// [`Panel::gemm_with`] the fastest kernels ([`Isa::best`]).
    fn gemm(panel: &[Self], acts: &[ActRow<'_>], out: &mut [[f32; 8]]) {
        Self::gemm_with(Isa::best(), panel, acts, out)
    }

    /// Sixteen rows at once, the eight of `a` then the eight of `b` (as many panel
    /// blocks each): `out[i][r]` as [`Panel::gemm_with`] gives them. VNNI runs both
    /// panels on 512-bit vectors (a row to a 32-bit lane), which do twice the
    /// multiply-adds of 256-bit ones per instruction; AVX2 runs both panels side by
    /// side for Q8_0 (sharing each token's broadcast activations), one after the other
    /// otherwise. Call only when `isa.runs()`.
    fn gemm_pair_with(isa: Isa, a: &[Self], b: &[Self], acts: &[ActRow<'_>], out: &mut [[f32; 16]]);

    /// [`Panel::gemm_pair_with`] the fastest kernels ([`Isa::best`]).
    fn gemm_pair(a: &[Self], b: &[Self], acts: &[ActRow<'_>], out: &mut [[f32; 16]]) {
        Self::gemm_pair_with(Isa::best(), a, b, acts, out)
    }

    /// Thirty-two rows of one token row: the eight of each of `p`'s four panels (as
    /// many panel blocks each), in order, as [`Panel::gemm_with`] gives them. For
    /// decoding: a kernel that reads the four panels side by side keeps four streams of
    /// weights in flight. Here two [`Panel::gemm_pair_with`] calls; Q8_0 in AVX-512 VNNI
    /// has the kernel. Call only when `isa.runs()`.
    fn gemm_quad_with(isa: Isa, p: [&[Self]; 4], act: ActRow<'_>, out: &mut [f32; 32]) {
        quad_by_pairs(isa, p, act, out)
    }
}

/// [`Panel::gemm_quad_with`] as two pair calls.
fn quad_by_pairs<P: Panel>(isa: Isa, p: [&[P]; 4], act: ActRow<'_>, out: &mut [f32; 32]) {
    let mut half = [[0.0f32; 16]; 1];
    for (h, o) in out.chunks_exact_mut(16).enumerate() {
        P::gemm_pair_with(isa, p[2 * h], p[2 * h + 1], &[act], &mut half);
        o.copy_from_slice(&half[0]);
    }
}

/// [`Panel::gemm_pair_with`] as one panel after the other.
fn pair_by_halves<P: Panel>(
    isa: Isa,
    a: &[P],
    b: &[P],
    acts: &[ActRow<'_>],
    out: &mut [[f32; 16]],
) {
    let mut half = [[0.0f32; 8]; 4];
    for (acts, out) in acts.chunks(4).zip(out.chunks_mut(4)) {
        let n = acts.len();
        for (k, p) in [a, b].into_iter().enumerate() {
            P::gemm_with(isa, p, acts, &mut half[..n]);
            for (o, h) in out.iter_mut().zip(&half[..n]) {
                let (lo, hi) = o.split_at_mut(8);
                // Arrays, not slices: moves, not a call to `memcpy`.
                if let Ok(d) = <&mut [f32; 8]>::try_from(if k == 0 { lo } else { hi }) {
                    *d = *h;
                }
            }
        }
    }
}

/// `dst[j][r]` = bytes `4j ..+ 4` of `src[r]` (32 bytes each): eight rows' 4-byte
/// groups interleaved (an 8 x 8 transpose of 32-bit words).
fn interleave(src: [&[u8]; 8], dst: &mut [[u32; 8]; 8]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::interleave(src, dst) };
    }
    for (r, row) in src.iter().enumerate() {
        for (j, group) in dst.iter_mut().enumerate() {
            let q = &row[4 * j..4 * j + 4];
            group[r] = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
        }
    }
}

/// The instructions a panel kernel is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX2 with FMA and F16C: `maddubs` into 16-bit sums.
    Avx2,
    /// AVX-VNNI: `vpdpbusd` in its VEX form, on 256-bit vectors only, as client cores
    /// without AVX-512 have it (Alder Lake and later). One panel at a time.
    AvxVnni,
    /// AVX-512 VNNI (with BW and VL): `vpdpbusd` multiplies 4 byte pairs and adds
    /// them into a 32-bit lane in one instruction, on 256-bit vectors for one panel
    /// and 512-bit ones for two.
    Vnni,
    /// AVX-512 VNNI, and AMX tiles for Q8_0 products of 8 or more token rows (the
    /// `amx` module): a tile instruction multiplies a block of 16 token rows by two
    /// panels' block. Chosen only where `INFER_CPU_MAX_ISA=amx` asks for it.
    Amx,
}

impl Isa {
    /// Every kernel set, slowest first.
    pub(crate) const ALL: [Isa; 4] = [Isa::Avx2, Isa::AvxVnni, Isa::Vnni, Isa::Amx];

    /// The fastest kernels this CPU runs, up to the one the environment variable
    /// `INFER_CPU_MAX_ISA` names (`avx2`, `avxvnni`, `avx512` or `amx`); AMX tiles only
    /// where it names `amx` (they are not yet faster end to end: docs/PERFORMANCE.md).
    /// Every kernel gives the same bits, so the choice changes speed only. The tiles
    /// are asked of the OS here, only when the cap allows them.
    pub(crate) fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let cap =
                Isa::cap_of(std::env::var("INFER_CPU_MAX_ISA").ok().as_deref()).or(Some(Isa::Vnni));
            Isa::ALL
                .into_iter()
                .rev()
                .find(|isa| cap.is_none_or(|c| *isa as u8 <= c as u8) && isa.runs())
                .unwrap_or(Isa::Avx2)
        })
    }

    /// The kernel set an `INFER_CPU_MAX_ISA` value caps at (`None`: no cap, or a value
    /// that names none, which [`Isa::setting_problem`] reports).
    pub(crate) fn cap_of(v: Option<&str>) -> Option<Isa> {
        match v?.trim().to_ascii_lowercase().as_str() {
            "avx2" => Some(Isa::Avx2),
            "avxvnni" => Some(Isa::AvxVnni),
            "avx512" => Some(Isa::Vnni),
            "amx" => Some(Isa::Amx),
            _ => None,
        }
    }

    /// Which kernels quantized products run on this CPU, in words (for the log).
    pub(crate) fn describe() -> &'static str {
        if !available() {
            return "portable kernels (no AVX2)";
        }
        let capped = Isa::ALL
            .into_iter()
            .any(|i| i as u8 > Isa::best() as u8 && i.on_cpu());
        let cap = Isa::cap_of(std::env::var("INFER_CPU_MAX_ISA").ok().as_deref());
        match (Isa::best(), capped) {
            (Isa::Amx, _) => {
                "AVX-512 VNNI kernels and AMX tiles for Q8_0 products of 8 or more tokens \
                 (INFER_CPU_MAX_ISA=amx)"
            }
            (Isa::Vnni, false) => "AVX-512 VNNI kernels",
            (Isa::Vnni, true) => match cap {
                Some(Isa::Amx) => {
                    "AVX-512 VNNI kernels (INFER_CPU_MAX_ISA=amx, but the OS did not grant \
                     this process the AMX tiles)"
                }
                Some(_) => "AVX-512 VNNI kernels (INFER_CPU_MAX_ISA=avx512)",
                None => "AVX-512 VNNI kernels (AMX tiles with INFER_CPU_MAX_ISA=amx)",
            },
            (Isa::AvxVnni, false) => "AVX-VNNI kernels",
            (Isa::AvxVnni, true) => "AVX-VNNI kernels (INFER_CPU_MAX_ISA=avxvnni)",
            (Isa::Avx2, false) => "AVX2 kernels",
            (Isa::Avx2, true) => "AVX2 kernels (INFER_CPU_MAX_ISA=avx2)",
        }
    }

    /// A warning when `INFER_CPU_MAX_ISA` is set to something other than `avx2`,
    /// `avxvnni`, `avx512` or `amx` (it is then ignored).
    pub(crate) fn setting_problem() -> Option<String> {
        Isa::problem_of(std::env::var("INFER_CPU_MAX_ISA").ok().as_deref())
    }

    /// [`Isa::setting_problem`] for the variable's value.
    pub(crate) fn problem_of(v: Option<&str>) -> Option<String> {
        let v = v?;
        if v.trim().is_empty() || Isa::cap_of(Some(v)).is_some() {
            return None;
        }
        Some(format!(
            "INFER_CPU_MAX_ISA={v:?} is none of avx2, avxvnni, avx512 and amx, so it is ignored"
        ))
    }

    /// Whether this CPU has the instructions of `self` (for [`Isa::Amx`], without asking
    /// the OS for the tiles).
    fn on_cpu(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Vnni.runs() && amx::on_cpu(),
            _ => self.runs(),
        }
    }

    /// Whether this CPU runs kernels in `self` (for [`Isa::Amx`], asking the OS for the
    /// tiles the first time). Found once for each set: kernels assert it at every call.
    pub(crate) fn runs(self) -> bool {
        static RUNS: [std::sync::OnceLock<bool>; 4] = [const { std::sync::OnceLock::new() }; 4];
        *RUNS[self as usize].get_or_init(|| self.finds_it_runs())
    }

    fn finds_it_runs(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = super::avx2::available();
            match self {
                Isa::Avx2 => avx2,
                Isa::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Isa::Vnni => {
                    avx2 && is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                }
                Isa::Amx => Isa::Vnni.runs() && amx::granted(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
    }
}

/// Runs `kernel::<4>` over groups of 4 activation rows, then `kernel::<1>` over the
/// rest, in the kernels of `isa`.
macro_rules! by_fours {
    // AVX2's `$kernel` whatever the instruction set asked (a panel only AVX2 runs).
    (@avx2 $kernel:ident, $panel:expr, $acts:expr, $out:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            let (panel, acts, out) = ($panel, $acts, $out);
            assert!(
                Isa::Avx2.runs(),
                "this CPU does not run the AVX2 panel kernels"
            );
            let mut i = 0;
            while i + 4 <= acts.len() {
                let Ok(dst) = <&mut [[f32; 8]; 4]>::try_from(&mut out[i..i + 4]) else {
                    unreachable!("four rows are four rows")
                };
                // SAFETY: the CPU runs AVX2 (asserted above).
                unsafe { avx2::$kernel::<4>(panel, &acts[i..i + 4], dst) };
                i += 4;
            }
            while i < acts.len() {
                let dst = std::array::from_mut(&mut out[i]);
                // SAFETY: as above.
                unsafe { avx2::$kernel::<1>(panel, &acts[i..i + 1], dst) };
                i += 1;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = ($panel, $acts, $out);
            unreachable!("the panel kernel needs AVX2");
        }
    }};
    ($kernel:ident, $isa:expr, $panel:expr, $acts:expr, $out:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            let (isa, panel, acts, out) = ($isa, $panel, $acts, $out);
            assert!(
                isa.runs(),
                "this CPU does not run the {isa:?} panel kernels"
            );
            let mut i = 0;
            while i + 4 <= acts.len() {
                // The kernel stores into `out` itself (a result returned and copied
                // would be a call to `memcpy` for each kernel call).
                let Ok(dst) = <&mut [[f32; 8]; 4]>::try_from(&mut out[i..i + 4]) else {
                    unreachable!("four rows are four rows")
                };
                // SAFETY: the CPU runs `isa`'s instructions (asserted above).
                unsafe {
                    match isa {
                        Isa::Avx2 => avx2::$kernel::<4>(panel, &acts[i..i + 4], dst),
                        Isa::AvxVnni => avxvnni::$kernel::<4>(panel, &acts[i..i + 4], dst),
                        Isa::Vnni | Isa::Amx => vnni::$kernel::<4>(panel, &acts[i..i + 4], dst),
                    }
                };
                i += 4;
            }
            while i < acts.len() {
                let dst = std::array::from_mut(&mut out[i]);
                // SAFETY: as above.
                unsafe {
                    match isa {
                        Isa::Avx2 => avx2::$kernel::<1>(panel, &acts[i..i + 1], dst),
                        Isa::AvxVnni => avxvnni::$kernel::<1>(panel, &acts[i..i + 1], dst),
                        Isa::Vnni | Isa::Amx => vnni::$kernel::<1>(panel, &acts[i..i + 1], dst),
                    }
                };
                i += 1;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = ($isa, $panel, $acts, $out);
            unreachable!("the panel kernel needs AVX2");
        }
    }};
}

/// [`Panel::gemm_pair_with`] through `vnni::$kernel` (8 activation rows a call, then 4,
/// then 1: `pairs_by_eights`), and through `avx2::$kernel` and `avxvnni::$kernel` (4 rows
/// a call, then 1) too where the 256-bit kernels have a pair kernel (`both`); else one
/// panel after the other for those.
macro_rules! pairs_by_fours {
    ($kernel:ident, $isa:expr, $a:expr, $b:expr, $acts:expr, $out:expr) => {{
        let (isa, a, b, acts, out) = ($isa, $a, $b, $acts, $out);
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Vnni | Isa::Amx) {
            pairs_by_eights!(vnni::$kernel, isa, a, b, acts, out);
            return;
        }
        pair_by_halves(isa, a, b, acts, out)
    }};
    ($kernel:ident, $isa:expr, $a:expr, $b:expr, $acts:expr, $out:expr, both) => {{
        let (isa, a, b, acts, out) = ($isa, $a, $b, $acts, $out);
        #[cfg(target_arch = "x86_64")]
        match isa {
            Isa::Vnni | Isa::Amx => pairs_by_eights!(vnni::$kernel, isa, a, b, acts, out),
            Isa::AvxVnni => pairs_by_fours!(@run avxvnni::$kernel, isa, a, b, acts, out),
            Isa::Avx2 => pairs_by_fours!(@run avx2::$kernel, isa, a, b, acts, out),
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (isa, a, b, acts, out);
            unreachable!("the panel kernel needs AVX2");
        }
    }};
    (@run $($kernel:ident)::+, $isa:expr, $a:expr, $b:expr, $acts:expr, $out:expr) => {{
        let (isa, a, b, acts, out) = ($isa, $a, $b, $acts, $out);
        assert!(
            isa.runs(),
            "this CPU does not run the {isa:?} panel kernels"
        );
        let mut i = pairs_by_fours!(@rows 4, $($kernel)::+, a, b, acts, &mut *out);
        while i < acts.len() {
            // SAFETY: the CPU runs `isa`'s instructions (asserted above).
            unsafe { $($kernel)::+::<1>(a, b, &acts[i..i + 1], std::array::from_mut(&mut out[i])) };
            i += 1;
        }
    }};
    // `$kernel::<$n>` over the first whole groups of `$n` rows; the rows done. The
    // caller has asserted that the CPU runs the kernel's instructions.
    (@rows $n:literal, $($kernel:ident)::+, $a:expr, $b:expr, $acts:expr, $out:expr) => {{
        let (a, b, acts, out) = ($a, $b, $acts, $out);
        let mut i = 0;
        while i + $n <= acts.len() {
            // The kernel stores into `out` itself, as in `by_fours`.
            let Ok(dst) = <&mut [[f32; 16]; $n]>::try_from(&mut out[i..i + $n]) else {
                unreachable!("{} rows are {} rows", $n, $n)
            };
            // SAFETY: the CPU runs the kernel's instructions (the caller asserted it).
            unsafe { $($kernel)::+::<$n>(a, b, &acts[i..i + $n], dst) };
            i += $n;
        }
        i
    }};
}

/// `vnni::$kernel` over groups of 8 activation rows, then 4, then 1 (as
/// `pairs_by_fours`): in the kernels where a call's shared work (taking the weights
/// apart, loading the scales) is a large part of the work of 4 rows, 8 share it.
macro_rules! pairs_by_eights {
    ($($kernel:ident)::+, $isa:expr, $a:expr, $b:expr, $acts:expr, $out:expr) => {{
        let (isa, a, b, acts, out) = ($isa, $a, $b, $acts, $out);
        assert!(
            isa.runs(),
            "this CPU does not run the {isa:?} panel kernels"
        );
        let i = pairs_by_fours!(@rows 8, $($kernel)::+, a, b, acts, &mut *out);
        let (acts, out) = (&acts[i..], &mut out[i..]);
        pairs_by_fours!(@run $($kernel)::+, isa, a, b, acts, out);
    }};
}

/// The token rows a pair kernel of `w`'s panels takes a call in the kernels of `isa`
/// (those that `pairs_by_eights` runs take 8, the others 4).
pub(crate) fn rows_per_call(w: super::WeightType, isa: Isa) -> usize {
    use super::WeightType::{Q4K, Q6K, Q8_0};
    let eights = matches!(w, Q4K | Q6K | Q8_0) && matches!(isa, Isa::Vnni | Isa::Amx);
    if eights {
        8
    } else {
        4
    }
}

/// One 256-column block of eight Q4_K rows, interleaved: 1,184 bytes against the
/// file's 1,152 (the 6-bit scales and mins take a byte each), so a matrix can be
/// packed once, at load.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub(crate) struct Q4KPanel {
    /// Each row's block scale and min scale, as f16 bits (as in the file).
    d: [u16; 8],
    dmin: [u16; 8],
    /// Sub-block `s`: row `r`'s 6-bit scale at `[s][r]`.
    sc: [[u8; 8]; 8],
    /// Sub-blocks `2p` and `2p + 1`: row `r`'s two mins at `[p][2r]` and `[p][2r + 1]`
    /// (widened to 16 bits, lane `r` holds them low and high).
    mins: [[u8; 16]; 4],
    /// Chunk `c` (sub-blocks `2c` in the low nibbles and `2c + 1` in the high ones),
    /// group `j`: lane `r` holds row `r`'s bytes `32c + 4j ..+ 4` of the block's nibbles.
    qs: [[[u32; 8]; 8]; 4],
}

/// Whether this CPU runs [`gemm_q4k`].
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

impl Panel for Q4KPanel {
    fn pack(rows: [&[u8]; 8], out: &mut [Q4KPanel]) {
        for (bi, p) in out.iter_mut().enumerate() {
            for (r, row) in rows.iter().enumerate() {
                let b = &row[144 * bi..144 * (bi + 1)];
                p.d[r] = u16::from_le_bytes([b[0], b[1]]);
                p.dmin[r] = u16::from_le_bytes([b[2], b[3]]);
                for s in 0..8 {
                    let (scale, min) = scale_min_k4(s, &b[4..16]);
                    p.sc[s][r] = scale;
                    p.mins[s / 2][2 * r + s % 2] = min;
                }
            }
            for (c, chunk) in p.qs.iter_mut().enumerate() {
                let at = 144 * bi + 16 + 32 * c;
                interleave(std::array::from_fn(|r| &rows[r][at..at + 32]), chunk);
            }
        }
    }

    fn gemm_with(isa: Isa, panel: &[Q4KPanel], acts: &[ActRow<'_>], out: &mut [[f32; 8]]) {
        by_fours!(gemm_q4k, isa, panel, acts, out)
    }

    fn gemm_pair_with(
        isa: Isa,
        a: &[Q4KPanel],
        b: &[Q4KPanel],
        acts: &[ActRow<'_>],
        out: &mut [[f32; 16]],
    ) {
        pairs_by_fours!(gemm2_q4k, isa, a, b, acts, out)
    }
}

/// One 256-column block of eight Q6_K rows, interleaved.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(crate) struct Q6KPanel {
    /// Each row's block scale, as f32.
    d: [f32; 8],
    /// Sub-block `s` (16 weights): lane `r` holds row `r`'s scale (i16) in both halves.
    sc: [[u32; 8]; 16],
    /// Sub-blocks `2p` and `2p + 1`: lane `r` holds row `r`'s two scales (low, high),
    /// for the AVX2 kernel's correction at a block's end (the VNNI kernels start each
    /// sub-block's sums at -32 times its activations' sum instead).
    sc_pairs: [[u32; 8]; 8],
    /// Sub-block `s`, group `j`: lane `r` holds row `r`'s weights `16s + 4j ..+ 4` as
    /// stored (0..=63, read minus 32).
    q: [[[u32; 8]; 4]; 16],
}

impl Default for Q6KPanel {
    fn default() -> Q6KPanel {
        Q6KPanel {
            d: [0.0; 8],
            sc: [[0; 8]; 16],
            sc_pairs: [[0; 8]; 8],
            q: [[[0; 8]; 4]; 16],
        }
    }
}

impl Panel for Q6KPanel {
    fn pack(rows: [&[u8]; 8], out: &mut [Q6KPanel]) {
        #[cfg(target_arch = "x86_64")]
        if super::avx2::available() {
            // SAFETY: the CPU has AVX2, FMA and F16C.
            return unsafe { avx2::pack_q6k(rows, out) };
        }
        pack_q6k(rows, out)
    }

    fn gemm_with(isa: Isa, panel: &[Q6KPanel], acts: &[ActRow<'_>], out: &mut [[f32; 8]]) {
        by_fours!(gemm_q6k, isa, panel, acts, out)
    }

    fn gemm_pair_with(
        isa: Isa,
        a: &[Q6KPanel],
        b: &[Q6KPanel],
        acts: &[ActRow<'_>],
        out: &mut [[f32; 16]],
    ) {
        pairs_by_fours!(gemm2_q6k, isa, a, b, acts, out)
    }
}

/// [`Panel::pack`] for Q6_K, a row at a time (the AVX2 version transposes in registers).
pub(crate) fn pack_q6k(rows: [&[u8]; 8], out: &mut [Q6KPanel]) {
    let mut q = [[0u8; 256]; 8];
    for (bi, p) in out.iter_mut().enumerate() {
        for (r, row) in rows.iter().enumerate() {
            let b = &row[210 * bi..210 * (bi + 1)];
            p.d[r] = f16_at(b, 208);
            let scale = |s: usize| (b[192 + s] as i8) as i16 as u16 as u32;
            for (s, sc) in p.sc.iter_mut().enumerate() {
                sc[r] = scale(s) * 0x1_0001;
            }
            for (s, pair) in p.sc_pairs.iter_mut().enumerate() {
                pair[r] = scale(2 * s) | (scale(2 * s + 1) << 16);
            }
            unpack_q6k(b, &mut q[r]);
        }
        // Weights 32c ..+ 32 are sub-blocks 2c and 2c + 1: eight 4-byte groups.
        for (c, subs) in p.q.chunks_exact_mut(2).enumerate() {
            let groups: &mut [[u32; 8]; 8] = match subs.as_flattened_mut().try_into() {
                Ok(g) => g,
                Err(_) => unreachable!("two sub-blocks are eight groups"),
            };
            interleave(std::array::from_fn(|r| &q[r][32 * c..32 * c + 32]), groups);
        }
    }
}

/// Eight Q8_0 blocks (256 columns) of eight rows, interleaved.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
pub(crate) struct Q8Panel {
    /// Block `k`: each row's scale, as f16 bits (as in the file: a packed matrix is the
    /// file's size).
    d: [[u16; 8]; 8],
    /// Block `k`, group `j`: lane `r` holds row `r`'s weights `4j ..+ 4` of the block,
    /// each plus 128 (an unsigned byte, which `vpdpbusd` takes as it is; the kernels
    /// take 128 times the activations' sum back).
    qs: [[[u32; 8]; 8]; 8],
}

impl Panel for Q8Panel {
    fn pack(rows: [&[u8]; 8], out: &mut [Q8Panel]) {
        pack_q8_0(rows, out.iter_mut(), |w| w ^ 0x8080_8080)
    }

    fn gemm_with(isa: Isa, panel: &[Q8Panel], acts: &[ActRow<'_>], out: &mut [[f32; 8]]) {
        by_fours!(gemm_q8_0, isa, panel, acts, out)
    }

    fn gemm_pair_with(
        isa: Isa,
        a: &[Q8Panel],
        b: &[Q8Panel],
        acts: &[ActRow<'_>],
        out: &mut [[f32; 16]],
    ) {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Amx {
            assert!(
                isa.runs(),
                "this CPU does not run the {isa:?} panel kernels"
            );
            // SAFETY: the CPU runs AVX-512 VNNI and the OS granted the tiles (asserted
            // above).
            let done = unsafe { amx::gemm2_q8_0(a, b, acts, out) };
            let (acts, out) = (&acts[done..], &mut out[done..]);
            pairs_by_eights!(vnni::gemm2_q8_0, isa, a, b, acts, out);
            return;
        }
        pairs_by_fours!(gemm2_q8_0, isa, a, b, acts, out, both)
    }

    fn gemm_quad_with(isa: Isa, p: [&[Q8Panel]; 4], act: ActRow<'_>, out: &mut [f32; 32]) {
        #[cfg(target_arch = "x86_64")]
        if matches!(isa, Isa::Vnni | Isa::Amx) {
            assert!(
                isa.runs(),
                "this CPU does not run the {isa:?} panel kernels"
            );
            // SAFETY: the CPU runs AVX-512 VNNI (asserted above).
            return unsafe { vnni::gemm4_q8_0(p, act, out) };
        }
        quad_by_pairs(isa, p, act, out)
    }
}

/// Eight Q8_0 rows as [`Q8Panel`] lays them out, each weight stored as its sign (bit 7)
/// and magnitude (bits 0-6) instead of plus 128: for the AVX2 kernels, which multiply
/// each weight's magnitude by the activation given the weight's sign, and so take both
/// from the byte as stored (a `vpand`; the weight itself as the sign) where the
/// plus-128 form needs a `vpxor` and a `vpsignb` more a step. The step waits on its
/// sign transfers (`vpsignb` shares pipes with the multiplies on Zen 3), so fewer of
/// them make the product about 3 % faster there. A weight of -128 has no such form:
/// a matrix holding one (only a hand-made file does) is packed into [`Q8Panel`]s
/// (`linear::Packed`). VNNI wants the plus-128 form, so these panels are packed only
/// where the fastest kernels are AVX2's, and run on AVX2 whatever `isa` asks.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub(crate) struct Q8SmPanel(Q8Panel);

/// Whether a Q8_0 row (whole 34-byte blocks) holds a weight of -128, which
/// [`Q8SmPanel`] cannot store.
pub(crate) fn q8_0_has_min(row: &[u8]) -> bool {
    // No early exit inside a block: its comparisons compile to a few vector operations.
    row.chunks_exact(34)
        .any(|b| b[2..].iter().fold(false, |hit, &q| hit | (q == 0x80)))
}

/// Eight Q8_0 rows interleaved into `out`'s panels (one a 256-column block), each
/// 4-byte group of weights as `word` turns it (plus 128, or sign and magnitude).
fn pack_q8_0<'a>(
    rows: [&[u8]; 8],
    out: impl Iterator<Item = &'a mut Q8Panel>,
    word: impl Fn(u32) -> u32,
) {
    for (bi, p) in out.enumerate() {
        for (r, row) in rows.iter().enumerate() {
            for (k, d) in p.d.iter_mut().enumerate() {
                let at = 34 * (8 * bi + k);
                d[r] = u16::from_le_bytes([row[at], row[at + 1]]);
            }
        }
        for (k, block) in p.qs.iter_mut().enumerate() {
            let at = 34 * (8 * bi + k) + 2;
            interleave(std::array::from_fn(|r| &rows[r][at..at + 32]), block);
            for w in block.as_flattened_mut() {
                *w = word(*w);
            }
        }
    }
}

/// Four Q8_0 weights (bytes of `w`) from two's complement to sign and magnitude, all at
/// once: negative bytes (none -128) become `0x80 | -b`.
#[inline(always)]
fn sign_magnitude(w: u32) -> u32 {
    let neg = (w >> 7) & 0x0101_0101;
    // `-b` of a negative byte is `(b ^ 0xff) + 1`, at most 0x7f: no carry into the next
    // byte.
    (((w ^ (neg * 0xff)) + neg) & 0x7f7f_7f7f) | (neg << 7)
}

impl Panel for Q8SmPanel {
    /// The rows must hold no weight of -128 ([`q8_0_has_min`]; `linear::Packed` checks).
    fn pack(rows: [&[u8]; 8], out: &mut [Q8SmPanel]) {
        debug_assert!(
            !rows.iter().any(|r| q8_0_has_min(r)),
            "a Q8_0 weight of -128"
        );
        pack_q8_0(rows, out.iter_mut().map(|p| &mut p.0), sign_magnitude)
    }

    fn gemm_with(_isa: Isa, panel: &[Q8SmPanel], acts: &[ActRow<'_>], out: &mut [[f32; 8]]) {
        by_fours!(@avx2 gemm_q8_0_sm, peel(panel), acts, out)
    }

    fn gemm_pair_with(
        _isa: Isa,
        a: &[Q8SmPanel],
        b: &[Q8SmPanel],
        acts: &[ActRow<'_>],
        out: &mut [[f32; 16]],
    ) {
        #[cfg(target_arch = "x86_64")]
        pairs_by_fours!(@run avx2::gemm2_q8_0_sm, Isa::Avx2, peel(a), peel(b), acts, out);
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (a, b, acts, out);
            unreachable!("the panel kernel needs AVX2");
        }
    }
}

/// The [`Q8Panel`]s inside `p` (the same memory).
fn peel(p: &[Q8SmPanel]) -> &[Q8Panel] {
    // SAFETY: `Q8SmPanel` is `repr(transparent)` over `Q8Panel`: a slice of one is a
    // slice of the other, of the same length.
    unsafe { std::slice::from_raw_parts(p.as_ptr() as *const Q8Panel, p.len()) }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::{q8ks_n, q8s_n, Q8, Q8K};
    use super::{f16_at, ActRow, Q4KPanel, Q6KPanel, Q8Panel};
    use std::arch::x86_64::*;

    /// The 8 lanes of `v` as a vector (aligned: panels are 32-byte aligned).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn lanes(v: &[u32; 8]) -> __m256i {
        // SAFETY: `v` is 32 bytes inside a panel, which is 32-byte aligned, and every
        // field of one sits at a multiple of 32 bytes.
        unsafe { _mm256_load_si256(v.as_ptr() as *const __m256i) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn lanes_f(v: &[f32; 8]) -> __m256 {
        // SAFETY: as in `lanes`.
        unsafe { _mm256_load_ps(v.as_ptr()) }
    }

    /// 8 f16 values (bits) as f32 (exact).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn f16s(v: &[u16; 8]) -> __m256 {
        // SAFETY: `v` is 8 u16s (16 bytes); the load is unaligned.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(v.as_ptr() as *const __m128i) })
    }

    /// [`super::interleave`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn interleave(src: [&[u8]; 8], dst: &mut [[u32; 8]; 8]) {
        let mut v = [_mm256_setzero_ps(); 8];
        for (v, s) in v.iter_mut().zip(src) {
            let s = &s[..32];
            // SAFETY: `s` holds 32 bytes; the load is unaligned.
            *v = _mm256_castsi256_ps(unsafe { _mm256_loadu_si256(s.as_ptr() as *const __m256i) });
        }
        let out = super::super::super::kernels::transpose8(v);
        for (d, o) in dst.iter_mut().zip(out) {
            // SAFETY: `d` is 8 u32s (32 bytes); the store is unaligned.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr() as *mut f32, o) };
        }
    }

    /// [`super::pack_q6k`] with both transposes in registers: each row's 16 scales
    /// (as 8 pairs of 16-bit values, a pair to a 32-bit lane) and each 32 weights of the
    /// eight rows, unpacked straight into the vectors that are transposed.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn pack_q6k(rows: [&[u8]; 8], out: &mut [Q6KPanel]) {
        use super::super::super::kernels::transpose8;
        use super::super::avx2::{load32, q6k_quarter};
        for (bi, p) in out.iter_mut().enumerate() {
            let blocks: [&[u8]; 8] = std::array::from_fn(|r| &rows[r][210 * bi..210 * (bi + 1)]);
            for (d, b) in p.d.iter_mut().zip(blocks) {
                *d = f16_at(b, 208);
            }
            // Row r's scales sign-extended to 16 bits: pair k (scales 2k, 2k + 1) in
            // 32-bit lane k; transposed, lane r of vector k is row r's pair k.
            let mut v = [_mm256_setzero_ps(); 8];
            for r in 0..8 {
                let s = &blocks[r][192..208];
                // SAFETY: `s` holds 16 bytes; the load is unaligned.
                let s = unsafe { _mm_loadu_si128(s.as_ptr() as *const __m128i) };
                v[r] = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(s));
            }
            let pairs = transpose8(v);
            let low16 = _mm256_set1_epi32(0xffff);
            for (k, v) in pairs.into_iter().enumerate() {
                let v = _mm256_castps_si256(v);
                let lo = _mm256_and_si256(v, low16);
                let hi = _mm256_srli_epi32(v, 16);
                // SAFETY: each destination is 8 u32s (32 bytes) inside a 32-byte
                // aligned panel, at a multiple of 32 bytes.
                unsafe {
                    _mm256_store_si256(p.sc_pairs[k].as_mut_ptr() as *mut __m256i, v);
                    let sc = p.sc[2 * k..].as_mut_ptr() as *mut __m256i;
                    _mm256_store_si256(sc, _mm256_or_si256(lo, _mm256_slli_epi32(v, 16)));
                    _mm256_store_si256(sc.add(1), _mm256_or_si256(hi, _mm256_slli_epi32(hi, 16)));
                }
            }
            // Weights 32c ..+ 32 (half n, quarter k) are sub-blocks 2c and 2c + 1.
            for n in 0..2 {
                let mut l0 = [_mm256_setzero_si256(); 8];
                let mut l1 = [_mm256_setzero_si256(); 8];
                let mut qh = [_mm256_setzero_si256(); 8];
                for r in 0..8 {
                    let ql = &blocks[r][64 * n..];
                    (l0[r], l1[r]) = (load32(ql), load32(&ql[32..]));
                    qh[r] = load32(&blocks[r][128 + 32 * n..]);
                }
                for k in 0..4 {
                    let c = 4 * n + k;
                    let mut v = [_mm256_setzero_ps(); 8];
                    for r in 0..8 {
                        v[r] = _mm256_castsi256_ps(q6k_quarter(l0[r], l1[r], qh[r], k));
                    }
                    let q = transpose8(v);
                    // SAFETY: as above: sub-blocks 2c and 2c + 1 are 8 groups of 8 u32s.
                    unsafe {
                        let dst = p.q[2 * c..].as_mut_ptr() as *mut __m256;
                        for (j, q) in q.into_iter().enumerate() {
                            _mm256_store_ps(dst.add(j) as *mut f32, q);
                        }
                    }
                }
            }
        }
    }

    /// Activations `at..at + 4` in every 32-bit lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn spread4(q: &[i8], at: usize) -> __m256i {
        let q = &q[at..at + 4];
        // SAFETY: `q` holds 4 bytes; the read is unaligned.
        _mm256_set1_epi32(unsafe { (q.as_ptr() as *const i32).read_unaligned() })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn gemm_q4k<const N: usize>(
        panel: &[Q4KPanel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; N],
    ) {
        let xs: [&[Q8K]; N] = q8ks_n(a);
        let low = _mm256_set1_epi8(0xf);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut acc_m = [_mm256_setzero_ps(); N];
        for (b, p) in panel.iter().enumerate() {
            let mut sums = [_mm256_setzero_si256(); N];
            for s in 0..8 {
                let (c, high) = (s / 2, s % 2 == 1);
                let mut part = [_mm256_setzero_si256(); N];
                for j in 0..8 {
                    let v = lanes(&p.qs[c][j]);
                    let w = if high {
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low)
                    } else {
                        _mm256_and_si256(v, low)
                    };
                    for t in 0..N {
                        let x = spread4(&xs[t][b].qs, 32 * s + 4 * j);
                        part[t] = _mm256_add_epi16(part[t], _mm256_maddubs_epi16(w, x));
                    }
                }
                // SAFETY: `p.sc[s]` is 8 bytes; the load is unaligned.
                let sc = _mm256_cvtepu8_epi32(unsafe {
                    _mm_loadl_epi64(p.sc[s].as_ptr() as *const __m128i)
                });
                // Each row's scale in both 16-bit halves of its lane.
                let sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                for t in 0..N {
                    sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(part[t], sc));
                }
            }
            for t in 0..N {
                q4k_block_end(p, &xs[t][b], sums[t], &mut acc[t], &mut acc_m[t]);
            }
        }
        rows_out(
            std::array::from_fn(|t| _mm256_sub_ps(acc[t], acc_m[t])),
            out,
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn gemm_q6k<const N: usize>(
        panel: &[Q6KPanel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; N],
    ) {
        let xs: [&[Q8K]; N] = q8ks_n(a);
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, p) in panel.iter().enumerate() {
            let mut sums = [_mm256_setzero_si256(); N];
            for s in 0..16 {
                let w: [__m256i; 4] = [
                    lanes(&p.q[s][0]),
                    lanes(&p.q[s][1]),
                    lanes(&p.q[s][2]),
                    lanes(&p.q[s][3]),
                ];
                let sc = lanes(&p.sc[s]);
                for t in 0..N {
                    let x = &xs[t][b].qs;
                    let m = |j: usize| _mm256_maddubs_epi16(w[j], spread4(x, 16 * s + 4 * j));
                    let (lo, hi) = (_mm256_add_epi16(m(0), m(1)), _mm256_add_epi16(m(2), m(3)));
                    let part =
                        _mm256_add_epi32(_mm256_madd_epi16(lo, sc), _mm256_madd_epi16(hi, sc));
                    sums[t] = _mm256_add_epi32(sums[t], part);
                }
            }
            for t in 0..N {
                q6k_block_end(p, &xs[t][b], sums[t], &mut acc[t]);
            }
        }
        rows_out(acc, out)
    }

    /// A Q8_0 panel's weights `j` of block `k` as they are, and their magnitudes: from
    /// the plus-128 form ([`Q8Panel`]) or, with `SM`, the sign-magnitude one
    /// ([`super::Q8SmPanel`]), where the stored byte carries the weight's sign.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn q8_weights<const SM: bool>(v: &[u32; 8]) -> (__m256i, __m256i) {
        if SM {
            let w = lanes(v);
            (w, _mm256_and_si256(w, _mm256_set1_epi8(0x7f)))
        } else {
            let w = _mm256_xor_si256(lanes(v), _mm256_set1_epi8(-128));
            // |w| times x with w's sign: maddubs wants its first operand unsigned,
            // and its sums of two (under 2 · 255 · 127) would not fit 16 bits.
            (w, _mm256_sign_epi8(w, w))
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn gemm_q8_0<const N: usize>(
        panel: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; N],
    ) {
        gemm_q8_0_as::<N, false>(panel, a, out)
    }

    /// [`gemm_q8_0`] of sign-magnitude panels ([`super::Q8SmPanel`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn gemm_q8_0_sm<const N: usize>(
        panel: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; N],
    ) {
        gemm_q8_0_as::<N, true>(panel, a, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn gemm_q8_0_as<const N: usize, const SM: bool>(
        panel: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 8]; N],
    ) {
        let xs: [&[Q8]; N] = q8s_n(a);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, p) in panel.iter().enumerate() {
            for k in 0..8 {
                let mut sums = [_mm256_setzero_si256(); N];
                for j in 0..8 {
                    let (w, aw) = q8_weights::<SM>(&p.qs[k][j]);
                    for t in 0..N {
                        let x = _mm256_sign_epi8(spread4(&xs[t][8 * b + k].qs, 4 * j), w);
                        let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones);
                        sums[t] = _mm256_add_epi32(sums[t], prod);
                    }
                }
                let d = f16s(&p.d[k]);
                for t in 0..N {
                    let xd = _mm256_set1_ps(xs[t][8 * b + k].d);
                    acc[t] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(sums[t]), acc[t]);
                }
            }
        }
        rows_out(acc, out)
    }

    /// [`gemm_q8_0`] of two panels at once: each token's 4 activations are broadcast
    /// once for both.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn gemm2_q8_0<const N: usize>(
        pa: &[Q8Panel],
        pb: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        gemm2_q8_0_as::<N, false>(pa, pb, a, out)
    }

    /// [`gemm2_q8_0`] of sign-magnitude panels ([`super::Q8SmPanel`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn gemm2_q8_0_sm<const N: usize>(
        pa: &[Q8Panel],
        pb: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        gemm2_q8_0_as::<N, true>(pa, pb, a, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn gemm2_q8_0_as<const N: usize, const SM: bool>(
        pa: &[Q8Panel],
        pb: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        let xs: [&[Q8]; N] = q8s_n(a);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); N]; 2];
        for (b, (p, q)) in pa.iter().zip(pb).enumerate() {
            for k in 0..8 {
                let mut sums = [[_mm256_setzero_si256(); N]; 2];
                for j in 0..8 {
                    let (wa, awa) = q8_weights::<SM>(&p.qs[k][j]);
                    let (wb, awb) = q8_weights::<SM>(&q.qs[k][j]);
                    let (w, aw) = ([wa, wb], [awa, awb]);
                    for t in 0..N {
                        let x = spread4(&xs[t][8 * b + k].qs, 4 * j);
                        for h in 0..2 {
                            let x = _mm256_sign_epi8(x, w[h]);
                            let prod = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], x), ones);
                            sums[h][t] = _mm256_add_epi32(sums[h][t], prod);
                        }
                    }
                }
                pair_block_end([&p.d[k], &q.d[k]], xs, 8 * b + k, sums, &mut acc);
            }
        }
        rows_out2(std::array::from_fn(|t| [acc[0][t], acc[1][t]]), out)
    }

    /// The end of Q8_0 block `at` of two panels (row scales `d`): each token's integer
    /// sums, times the rows' and the token's scales, into its accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn pair_block_end<const N: usize>(
        d: [&[u16; 8]; 2],
        xs: [&[Q8]; N],
        at: usize,
        sums: [[__m256i; N]; 2],
        acc: &mut [[__m256; N]; 2],
    ) {
        let d = [f16s(d[0]), f16s(d[1])];
        for t in 0..N {
            let xd = _mm256_set1_ps(xs[t][at].d);
            for h in 0..2 {
                acc[h][t] = _mm256_fmadd_ps(
                    _mm256_mul_ps(d[h], xd),
                    _mm256_cvtepi32_ps(sums[h][t]),
                    acc[h][t],
                );
            }
        }
    }

    /// Each pair of vectors as a token's outputs of two panels' rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn rows_out2<const N: usize>(v: [[__m256; 2]; N], out: &mut [[f32; 16]; N]) {
        for (o, v) in out.iter_mut().zip(v) {
            let (lo, hi) = o.split_at_mut(8);
            // SAFETY: `lo` and `hi` hold 8 f32s each; the stores are unaligned.
            unsafe {
                _mm256_storeu_ps(lo.as_mut_ptr(), v[0]);
                _mm256_storeu_ps(hi.as_mut_ptr(), v[1]);
            }
        }
    }

    /// Each vector's 8 lanes as a token's outputs of the panel's rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn rows_out<const N: usize>(v: [__m256; N], out: &mut [[f32; 8]; N]) {
        for (o, v) in out.iter_mut().zip(v) {
            // SAFETY: `o` holds 8 f32s; the store is unaligned.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
        }
    }

    /// Sums of each 32 of the 256 activations of `x`, two to a 32-bit lane (Q4_K's
    /// sub-blocks, paired as its mins are).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn sub_block_sums(x: &Q8K) -> [i32; 4] {
        // SAFETY: `bsums` is 16 i16s (32 bytes); the load is unaligned.
        let bs = unsafe { _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i) };
        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        let mut pair = [0i32; 4];
        // SAFETY: `pair` is 4 i32s (16 bytes); the store is unaligned.
        unsafe { _mm_storeu_si128(pair.as_mut_ptr() as *mut __m128i, pairs) };
        pair
    }

    /// The end of a Q4_K panel block for one token: its integer `sums` (scales
    /// applied) into `acc`, and the mins times the activations' sub-block sums into
    /// `acc_m`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn q4k_block_end(
        p: &Q4KPanel,
        x: &Q8K,
        sums: __m256i,
        acc: &mut __m256,
        acc_m: &mut __m256,
    ) {
        let mut m = _mm256_setzero_si256();
        for (mins, &bp) in p.mins.iter().zip(&sub_block_sums(x)) {
            // SAFETY: `mins` is 16 bytes; the load is unaligned.
            let mins =
                _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(mins.as_ptr() as *const __m128i) });
            m = _mm256_add_epi32(m, _mm256_madd_epi16(mins, _mm256_set1_epi32(bp)));
        }
        let xd = _mm256_set1_ps(x.d);
        *acc = _mm256_fmadd_ps(
            _mm256_mul_ps(f16s(&p.d), xd),
            _mm256_cvtepi32_ps(sums),
            *acc,
        );
        *acc_m = _mm256_fmadd_ps(
            _mm256_mul_ps(f16s(&p.dmin), xd),
            _mm256_cvtepi32_ps(m),
            *acc_m,
        );
    }

    /// The end of a Q6_K panel block for one token: the weights are stored plus 32, so
    /// 32 × scale × (sum of each 16 activations) comes off `sums` (two sub-blocks to a
    /// 32-bit lane), which then go into `acc`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn q6k_block_end(p: &Q6KPanel, x: &Q8K, sums: __m256i, acc: &mut __m256) {
        let mut off = _mm256_setzero_si256();
        for (sc, pair) in p.sc_pairs.iter().zip(x.bsums.chunks_exact(2)) {
            let bp = (pair[0] as u16 as u32 | (pair[1] as u16 as u32) << 16) as i32;
            off = _mm256_add_epi32(off, _mm256_madd_epi16(lanes(sc), _mm256_set1_epi32(bp)));
        }
        let sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(off, 5));
        let xd = _mm256_set1_ps(x.d);
        *acc = _mm256_fmadd_ps(
            _mm256_mul_ps(lanes_f(&p.d), xd),
            _mm256_cvtepi32_ps(sums),
            *acc,
        );
    }
}

/// The one-panel kernels of `super::avx2` with the 256-bit `vpdpbusd` (`$dpbusd`), for
/// the target features `$feat`: AVX-512 VNNI's EVEX form and AVX-VNNI's VEX form are
/// the same instruction on the same vectors, so the two modules share one text.
#[cfg(target_arch = "x86_64")]
macro_rules! dpbusd_kernels_256 {
    ($feat:literal, $dpbusd:ident) => {
        /// 8 bytes widened to the 8 lanes of a vector.
        #[target_feature(enable = $feat)]
        #[inline]
        fn bytes8(v: &[u8; 8]) -> __m256i {
            // SAFETY: `v` is 8 bytes; the load is unaligned.
            _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(v.as_ptr() as *const __m128i) })
        }

        #[target_feature(enable = $feat)]
        pub(super) fn gemm_q4k<const N: usize>(
            panel: &[Q4KPanel],
            a: &[ActRow<'_>],
            out: &mut [[f32; 8]; N],
        ) {
            let xs: [&[Q8K]; N] = q8ks_n(a);
            let low = _mm256_set1_epi8(0xf);
            let mut acc = [_mm256_setzero_ps(); N];
            let mut acc_m = [_mm256_setzero_ps(); N];
            for (b, p) in panel.iter().enumerate() {
                let mut sums = [_mm256_setzero_si256(); N];
                // Chunk `c`: sub-block 2c in the low nibbles, 2c + 1 in the high ones.
                for c in 0..4 {
                    let mut lo = [_mm256_setzero_si256(); N];
                    let mut hi = [_mm256_setzero_si256(); N];
                    for j in 0..8 {
                        let v = lanes(&p.qs[c][j]);
                        let wl = _mm256_and_si256(v, low);
                        let wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                        for t in 0..N {
                            let x = &xs[t][b].qs;
                            lo[t] = $dpbusd(lo[t], wl, spread4(x, 64 * c + 4 * j));
                            hi[t] = $dpbusd(hi[t], wh, spread4(x, 64 * c + 32 + 4 * j));
                        }
                    }
                    let (sl, sh) = (bytes8(&p.sc[2 * c]), bytes8(&p.sc[2 * c + 1]));
                    for t in 0..N {
                        let part = _mm256_add_epi32(
                            _mm256_mullo_epi32(lo[t], sl),
                            _mm256_mullo_epi32(hi[t], sh),
                        );
                        sums[t] = _mm256_add_epi32(sums[t], part);
                    }
                }
                for t in 0..N {
                    q4k_block_end(p, &xs[t][b], sums[t], &mut acc[t], &mut acc_m[t]);
                }
            }
            rows_out(
                std::array::from_fn(|t| _mm256_sub_ps(acc[t], acc_m[t])),
                out,
            )
        }

        #[target_feature(enable = $feat)]
        pub(super) fn gemm_q6k<const N: usize>(
            panel: &[Q6KPanel],
            a: &[ActRow<'_>],
            out: &mut [[f32; 8]; N],
        ) {
            let xs: [&[Q8K]; N] = q8ks_n(a);
            let mut acc = [_mm256_setzero_ps(); N];
            for (b, p) in panel.iter().enumerate() {
                let mut sums = [_mm256_setzero_si256(); N];
                for s in 0..16 {
                    let w: [__m256i; 4] = std::array::from_fn(|j| lanes(&p.q[s][j]));
                    // The scale sits in both 16-bit halves: the high one, sign-extended.
                    let sc = _mm256_srai_epi32(lanes(&p.sc[s]), 16);
                    for t in 0..N {
                        let x = &xs[t][b];
                        let d = |acc, j: usize| $dpbusd(acc, w[j], spread4(&x.qs, 16 * s + 4 * j));
                        // The weights are stored plus 32: the sub-block's sum starts at -32
                        // times its activations' sum, and is then the sum of the weights'.
                        let init = _mm256_set1_epi32(-32 * x.bsums[s] as i32);
                        let zero = _mm256_setzero_si256();
                        let part = _mm256_add_epi32(d(d(init, 0), 1), d(d(zero, 2), 3));
                        sums[t] = _mm256_add_epi32(sums[t], _mm256_mullo_epi32(part, sc));
                    }
                }
                let d = lanes_f(&p.d);
                for t in 0..N {
                    let xd = _mm256_set1_ps(xs[t][b].d);
                    acc[t] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(sums[t]), acc[t]);
                }
            }
            rows_out(acc, out)
        }

        #[target_feature(enable = $feat)]
        pub(super) fn gemm_q8_0<const N: usize>(
            panel: &[Q8Panel],
            a: &[ActRow<'_>],
            out: &mut [[f32; 8]; N],
        ) {
            let xs: [&[Q8]; N] = q8s_n(a);
            let mut acc = [_mm256_setzero_ps(); N];
            for (b, p) in panel.iter().enumerate() {
                for k in 0..8 {
                    // The weights are stored plus 128 (unsigned, as `vpdpbusd` takes its
                    // first operand): the sums start at -128 times the activations' sum.
                    let mut sums: [__m256i; N] =
                        std::array::from_fn(|t| _mm256_set1_epi32(-(xs[t][8 * b + k].sum << 7)));
                    for j in 0..8 {
                        let w = lanes(&p.qs[k][j]);
                        for t in 0..N {
                            let x = spread4(&xs[t][8 * b + k].qs, 4 * j);
                            sums[t] = $dpbusd(sums[t], w, x);
                        }
                    }
                    let d = f16s(&p.d[k]);
                    for t in 0..N {
                        let xd = _mm256_set1_ps(xs[t][8 * b + k].d);
                        acc[t] = _mm256_fmadd_ps(
                            _mm256_mul_ps(d, xd),
                            _mm256_cvtepi32_ps(sums[t]),
                            acc[t],
                        );
                    }
                }
            }
            rows_out(acc, out)
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avxvnni {
    //! The one-panel kernels of `super::vnni` in AVX-VNNI (VEX-encoded `vpdpbusd`, 256-bit
    //! vectors only), and a two-panel Q8_0 kernel that broadcasts each token's
    //! activations once for both panels, as `super::avx2`'s does.

    use super::super::{q8ks_n, q8s_n, Q8, Q8K};
    // The AVX2 module's loads: callable here, where AVX2, FMA and F16C are enabled too.
    use super::avx2::{
        f16s, lanes, lanes_f, pair_block_end, q4k_block_end, rows_out, rows_out2, spread4,
    };
    use super::{ActRow, Q4KPanel, Q6KPanel, Q8Panel};
    use std::arch::x86_64::*;

    dpbusd_kernels_256!("avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32);

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) fn gemm2_q8_0<const N: usize>(
        pa: &[Q8Panel],
        pb: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        let xs: [&[Q8]; N] = q8s_n(a);
        let mut acc = [[_mm256_setzero_ps(); N]; 2];
        for (b, (p, q)) in pa.iter().zip(pb).enumerate() {
            for k in 0..8 {
                // Weights plus 128, as in the one-panel kernel.
                let init: [__m256i; N] =
                    std::array::from_fn(|t| _mm256_set1_epi32(-(xs[t][8 * b + k].sum << 7)));
                let mut sums = [init, init];
                for j in 0..8 {
                    let w = [lanes(&p.qs[k][j]), lanes(&q.qs[k][j])];
                    for t in 0..N {
                        let x = spread4(&xs[t][8 * b + k].qs, 4 * j);
                        for h in 0..2 {
                            sums[h][t] = _mm256_dpbusd_avx_epi32(sums[h][t], w[h], x);
                        }
                    }
                }
                pair_block_end([&p.d[k], &q.d[k]], xs, 8 * b + k, sums, &mut acc);
            }
        }
        rows_out2(std::array::from_fn(|t| [acc[0][t], acc[1][t]]), out)
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    //! The kernels of `super::avx2` with `vpdpbusd` (AVX-512 VNNI, on 256-bit vectors):
    //! one instruction multiplies 4 weight bytes of each of 8 rows by 4 activations and
    //! adds them into the row's 32-bit lane, where AVX2 takes a `maddubs` into 16 bits
    //! and an add (and for Q8_0 a `madd` more). The sums are exact integers either
    //! way, and the float operations per output are the same, so are the outputs.

    use super::super::{q8ks_n, q8s_n, Q8, Q8K};
    // The AVX2 module's loads: callable here, where AVX2, FMA and F16C are enabled too.
    use super::avx2::{f16s, lanes, lanes_f, q4k_block_end, rows_out, spread4, sub_block_sums};
    use super::{ActRow, Q4KPanel, Q6KPanel, Q8Panel};
    use std::arch::x86_64::*;

    dpbusd_kernels_256!(
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        _mm256_dpbusd_epi32
    );

    /// Rows of two panels' fields side by side: `a`'s 8 lanes, then `b`'s.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn lanes2(a: &[u32; 8], b: &[u32; 8]) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lanes(a)), lanes(b))
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn lanes2_f(a: &[f32; 8], b: &[f32; 8]) -> __m512 {
        let (a, b) = (
            _mm256_castps_si256(lanes_f(a)),
            _mm256_castps_si256(lanes_f(b)),
        );
        _mm512_castsi512_ps(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b))
    }

    /// 16 f16 values (bits), `a`'s then `b`'s, as f32 (exact).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    pub(super) fn f16s2(a: &[u16; 8], b: &[u16; 8]) -> __m512 {
        // SAFETY: `a` and `b` are 8 u16s (16 bytes) each; the loads are unaligned.
        let (a, b) = unsafe {
            (
                _mm_loadu_si128(a.as_ptr() as *const __m128i),
                _mm_loadu_si128(b.as_ptr() as *const __m128i),
            )
        };
        _mm512_cvtph_ps(_mm256_set_m128i(b, a))
    }

    /// 16 bytes, `a`'s 8 then `b`'s, widened to the 16 lanes of a vector.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn bytes16(a: &[u8; 8], b: &[u8; 8]) -> __m512i {
        // SAFETY: `a` and `b` are 8 bytes each; the loads are unaligned.
        let (a, b) = unsafe {
            (
                _mm_loadl_epi64(a.as_ptr() as *const __m128i),
                _mm_loadl_epi64(b.as_ptr() as *const __m128i),
            )
        };
        _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(a, b))
    }

    /// Activations `at..at + 4` in every 32-bit lane of a 512-bit vector.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    fn spread4_16(q: &[i8], at: usize) -> __m512i {
        let q = &q[at..at + 4];
        // SAFETY: `q` holds 4 bytes; the read is unaligned.
        _mm512_set1_epi32(unsafe { (q.as_ptr() as *const i32).read_unaligned() })
    }

    /// Stores each of `v`'s 16 lanes.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    pub(super) fn store16(v: __m512, out: &mut [f32; 16]) {
        // SAFETY: `out` holds 16 f32s; the store is unaligned.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) fn gemm2_q4k<const N: usize>(
        pa: &[Q4KPanel],
        pb: &[Q4KPanel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        let xs: [&[Q8K]; N] = q8ks_n(a);
        let low = _mm512_set1_epi8(0xf);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut acc_m = [_mm512_setzero_ps(); N];
        for (b, (p, q)) in pa.iter().zip(pb).enumerate() {
            let mut sums = [_mm512_setzero_si512(); N];
            for c in 0..4 {
                let mut lo = [_mm512_setzero_si512(); N];
                let mut hi = [_mm512_setzero_si512(); N];
                for j in 0..8 {
                    let v = lanes2(&p.qs[c][j], &q.qs[c][j]);
                    // The high nibbles left in place: 16 times the weight (at most
                    // 240, still a byte), where shifting them down takes a vector
                    // operation of the one port that also multiplies.
                    let wl = _mm512_and_si512(v, low);
                    let wh = _mm512_andnot_si512(low, v);
                    for t in 0..N {
                        let x = &xs[t][b].qs;
                        lo[t] = _mm512_dpbusd_epi32(lo[t], wl, spread4_16(x, 64 * c + 4 * j));
                        hi[t] = _mm512_dpbusd_epi32(hi[t], wh, spread4_16(x, 64 * c + 32 + 4 * j));
                    }
                }
                // The low nibbles' scales times 16 too: the sums are 16 times the
                // block's, exactly (at most 16 x 63 x 32 x 15 x 128 x 8 < 2^31).
                let sl = _mm512_slli_epi32(bytes16(&p.sc[2 * c], &q.sc[2 * c]), 4);
                let sh = bytes16(&p.sc[2 * c + 1], &q.sc[2 * c + 1]);
                for t in 0..N {
                    let part = _mm512_add_epi32(
                        _mm512_mullo_epi32(lo[t], sl),
                        _mm512_mullo_epi32(hi[t], sh),
                    );
                    sums[t] = _mm512_add_epi32(sums[t], part);
                }
            }
            let (d, dmin) = (f16s2(&p.d, &q.d), f16s2(&p.dmin, &q.dmin));
            // SAFETY: each `mins[k]` is 16 bytes; the loads are unaligned.
            let mins: [__m512i; 4] = std::array::from_fn(|k| unsafe {
                _mm512_cvtepu8_epi16(_mm256_set_m128i(
                    _mm_loadu_si128(q.mins[k].as_ptr() as *const __m128i),
                    _mm_loadu_si128(p.mins[k].as_ptr() as *const __m128i),
                ))
            });
            for t in 0..N {
                let x = &xs[t][b];
                let mut m = _mm512_setzero_si512();
                for (mins, &bp) in mins.iter().zip(&sub_block_sums(x)) {
                    m = _mm512_dpwssd_epi32(m, *mins, _mm512_set1_epi32(bp));
                }
                let xd = _mm512_set1_ps(x.d);
                let s = _mm512_srai_epi32(sums[t], 4);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(s), acc[t]);
                acc_m[t] =
                    _mm512_fmadd_ps(_mm512_mul_ps(dmin, xd), _mm512_cvtepi32_ps(m), acc_m[t]);
            }
        }
        for t in 0..N {
            store16(_mm512_sub_ps(acc[t], acc_m[t]), &mut out[t]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) fn gemm2_q6k<const N: usize>(
        pa: &[Q6KPanel],
        pb: &[Q6KPanel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        let xs: [&[Q8K]; N] = q8ks_n(a);
        let mut acc = [_mm512_setzero_ps(); N];
        for (b, (p, q)) in pa.iter().zip(pb).enumerate() {
            let mut sums = [_mm512_setzero_si512(); N];
            for s in 0..16 {
                let w: [__m512i; 4] = std::array::from_fn(|j| lanes2(&p.q[s][j], &q.q[s][j]));
                // The scale sits in both 16-bit halves: the high one, sign-extended.
                let sc = _mm512_srai_epi32(lanes2(&p.sc[s], &q.sc[s]), 16);
                for t in 0..N {
                    let x = &xs[t][b];
                    let d = |acc, j: usize| {
                        _mm512_dpbusd_epi32(acc, w[j], spread4_16(&x.qs, 16 * s + 4 * j))
                    };
                    // As in the 256-bit kernel: starting at -32 times the activations'
                    // sum takes the 32 the weights are stored plus back (where a
                    // correction at the block's end took 8 more multiplies a token).
                    let init = _mm512_set1_epi32(-32 * x.bsums[s] as i32);
                    let zero = _mm512_setzero_si512();
                    let part = _mm512_add_epi32(d(d(init, 0), 1), d(d(zero, 2), 3));
                    sums[t] = _mm512_add_epi32(sums[t], _mm512_mullo_epi32(part, sc));
                }
            }
            let d = lanes2_f(&p.d, &q.d);
            for t in 0..N {
                let xd = _mm512_set1_ps(xs[t][b].d);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(sums[t]), acc[t]);
            }
        }
        for t in 0..N {
            store16(acc[t], &mut out[t]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) fn gemm2_q8_0<const N: usize>(
        pa: &[Q8Panel],
        pb: &[Q8Panel],
        a: &[ActRow<'_>],
        out: &mut [[f32; 16]; N],
    ) {
        let xs: [&[Q8]; N] = q8s_n(a);
        let mut acc = [_mm512_setzero_ps(); N];
        for (b, (p, q)) in pa.iter().zip(pb).enumerate() {
            for k in 0..8 {
                // Weights plus 128, as in the 256-bit kernel.
                let mut sums: [__m512i; N] =
                    std::array::from_fn(|t| _mm512_set1_epi32(-(xs[t][8 * b + k].sum << 7)));
                for j in 0..8 {
                    let w = lanes2(&p.qs[k][j], &q.qs[k][j]);
                    for t in 0..N {
                        let x = spread4_16(&xs[t][8 * b + k].qs, 4 * j);
                        sums[t] = _mm512_dpbusd_epi32(sums[t], w, x);
                    }
                }
                let d = f16s2(&p.d[k], &q.d[k]);
                for t in 0..N {
                    let xd = _mm512_set1_ps(xs[t][8 * b + k].d);
                    acc[t] =
                        _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(sums[t]), acc[t]);
                }
            }
        }
        for t in 0..N {
            store16(acc[t], &mut out[t]);
        }
    }

    /// [`gemm2_q8_0`] of one token row over four panels (32 rows, two 512-bit
    /// vectors), reading the four side by side.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) fn gemm4_q8_0(p: [&[Q8Panel]; 4], a: ActRow<'_>, out: &mut [f32; 32]) {
        let [xs]: [&[Q8]; 1] = q8s_n(&[a]);
        let n = p.iter().map(|p| p.len()).min().unwrap_or(0);
        let mut acc = [_mm512_setzero_ps(); 2];
        for b in 0..n {
            let q = [&p[0][b], &p[1][b], &p[2][b], &p[3][b]];
            for k in 0..8 {
                let x = &xs[8 * b + k];
                // Weights plus 128, as in the 256-bit kernel.
                let init = _mm512_set1_epi32(-(x.sum << 7));
                let mut sums = [init; 2];
                for j in 0..8 {
                    let xv = spread4_16(&x.qs, 4 * j);
                    for (h, sum) in sums.iter_mut().enumerate() {
                        let w = lanes2(&q[2 * h].qs[k][j], &q[2 * h + 1].qs[k][j]);
                        *sum = _mm512_dpbusd_epi32(*sum, w, xv);
                    }
                }
                let xd = _mm512_set1_ps(x.d);
                for (h, (acc, sum)) in acc.iter_mut().zip(sums).enumerate() {
                    let d = f16s2(&q[2 * h].d[k], &q[2 * h + 1].d[k]);
                    *acc = _mm512_fmadd_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(sum), *acc);
                }
            }
        }
        for (h, acc) in acc.into_iter().enumerate() {
            let Ok(o) = <&mut [f32; 16]>::try_from(&mut out[16 * h..16 * h + 16]) else {
                unreachable!("sixteen are sixteen")
            };
            store16(acc, o);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "quant_amx.rs"]
mod amx;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_magnitude_of_every_byte() {
        for b in 0..=255u8 {
            if b == 0x80 {
                continue;
            }
            let v = b as i8;
            let want = if v < 0 { 0x80 | v.unsigned_abs() } else { b };
            // In each byte of a word, beside bytes that would carry or borrow.
            for (i, fill) in [(0, 0xffu8), (1, 0x00), (2, 0x81), (3, 0x7f)] {
                let mut w = [fill; 4];
                w[i] = b;
                let got = sign_magnitude(u32::from_le_bytes(w)).to_le_bytes();
                assert_eq!(got[i], want, "byte {b:#x} at {i}");
                let other = if (fill as i8) < 0 {
                    0x80 | (fill as i8).unsigned_abs()
                } else {
                    fill
                };
                assert!(
                    got.iter().enumerate().all(|(j, &g)| j == i || g == other),
                    "{b:#x}"
                );
            }
        }
    }
    use crate::llm::quant::tests::random_row;
    use crate::llm::quant::WeightType;

    /// The bytes of `panels`.
    fn bytes_of(panels: &[Q6KPanel]) -> Vec<u8> {
        panels
            .iter()
            .flat_map(|p| {
                let mut v: Vec<u8> = p.d.iter().flat_map(|d| d.to_le_bytes()).collect();
                for w in [&p.sc[..], &p.sc_pairs[..]] {
                    v.extend(w.as_flattened().iter().flat_map(|x| x.to_le_bytes()));
                }
                v.extend(
                    p.q.as_flattened()
                        .as_flattened()
                        .iter()
                        .flat_map(|x| x.to_le_bytes()),
                );
                v
            })
            .collect()
    }

    #[test]
    fn q6k_panels_pack_the_same_both_ways() {
        // Random bytes: every scale sign and every 6-bit weight; three blocks a row.
        let rows: Vec<Vec<u8>> = (0..8)
            .map(|r| random_row(WeightType::Q6K, 768, 7 + r))
            .collect();
        let rows: [&[u8]; 8] = std::array::from_fn(|r| &rows[r][..]);
        let mut want = vec![Q6KPanel::default(); 3];
        pack_q6k(rows, &mut want);
        let mut got = vec![Q6KPanel::default(); 3];
        Q6KPanel::pack(rows, &mut got);
        assert_eq!(bytes_of(&got), bytes_of(&want));
        // The scales came out as the kernels read them: the first row's, widened.
        let s = rows[0][192] as i8 as i16 as u16 as u32;
        assert_eq!(want[0].sc[0][0], s * 0x1_0001);
    }
}
