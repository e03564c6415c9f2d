use super::*;

/// Deterministic pseudo-random bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// A row of `n` elements of type `t` with sane scales (random bytes elsewhere).
pub(crate) fn random_row(t: WeightType, n: usize, seed: u64) -> Vec<u8> {
    let mut row = bytes(t.row_bytes(n).unwrap(), seed);
    let put = |row: &mut [u8], at: usize, v: f32| {
        row[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
    };
    let bb = t.block_bytes();
    for (i, b) in (0..row.len() / bb).map(|i| (i, i * bb)) {
        // Rows of other seeds have other scales in the same block, so that a kernel
        // that takes a row's scale for another's fails.
        let v = 0.002 + ((i as u64 + seed) % 7) as f32 * 0.001;
        match t {
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q5_0 => put(&mut row, b, v),
            WeightType::Q4K => {
                put(&mut row, b, v);
                put(&mut row, b + 2, v * 0.5);
            }
            WeightType::Q6K => put(&mut row, b + 208, v),
            WeightType::F16 | WeightType::BF16 | WeightType::F32 => {}
        }
    }
    match t {
        WeightType::F32 => row
            .chunks_exact(4)
            .enumerate()
            .flat_map(|(i, _)| (((i * 37 % 101) as f32 - 50.0) * 0.01).to_le_bytes())
            .collect(),
        WeightType::F16 => (0..n)
            .flat_map(|i| f16::from_f32(((i * 37 % 101) as f32 - 50.0) * 0.01).to_le_bytes())
            .collect(),
        WeightType::BF16 => (0..n)
            .flat_map(|i| {
                let v = ((i * 37 % 101) as f32 - 50.0) * 0.01;
                ((v.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect(),
        _ => row,
    }
}

fn act(n: usize, seed: u64) -> Vec<f32> {
    bytes(n, seed)
        .into_iter()
        .map(|b| (b as f32 - 127.5) / 40.0)
        .collect()
}

const ALL: [WeightType; 8] = WeightType::ALL;

/// The dot of `row` and `x` through `f`, preparing `x` as the type wants.
fn dot_with(f: DotFn, t: WeightType, row: &[u8], x: &[f32]) -> f32 {
    dots_with(f, t, row, &[x])[0]
}

/// The dots of `row` with each of `xs` in one kernel call.
fn dots_with(f: DotFn, t: WeightType, row: &[u8], xs: &[&[f32]]) -> Vec<f32> {
    let q8 = q8_rows(xs);
    let q8k = q8k_rows(xs);
    let acts: Vec<ActRow<'_>> = (0..xs.len())
        .map(|i| match t.act() {
            ActKind::F32 => ActRow::F32(xs[i]),
            ActKind::Q8 => ActRow::Q8(&q8[i]),
            ActKind::Q8K => ActRow::Q8K(&q8k[i]),
        })
        .collect();
    let mut out = vec![0.0; xs.len()];
    f(row, &acts, &mut out);
    out
}

#[test]
fn grouped_rows_give_the_bits_of_single_rows() {
    for t in ALL {
        let n = 512;
        let row = random_row(t, n, 11);
        let xs: Vec<Vec<f32>> = (0..7).map(|i| act(n, 20 + i)).collect();
        let refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
        let together = dots_with(dot_fn(t), t, &row, &refs);
        for (i, x) in refs.iter().enumerate() {
            let alone = dot_with(dot_fn(t), t, &row, x);
            assert_eq!(
                together[i].to_bits(),
                alone.to_bits(),
                "{} row {i}",
                t.name()
            );
        }
    }
}

#[test]
fn kernels_agree_with_the_dequantized_row() {
    for t in ALL {
        for n in [256, 768, 1024 + 256] {
            let row = random_row(t, n, n as u64 + t as u64);
            let x = act(n, 99);
            let mut w = vec![0.0; n];
            dequantize_row(t, &row, &mut w);
            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let scale: f64 = w
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            // 8-bit activations: about 0.4% of each product's size, mostly cancelling.
            let tol = if t.act() == ActKind::F32 { 1e-5 } else { 1e-2 } * scale.max(1e-3);
            for (name, f) in [("portable", portable_dot_fn(t)), ("fastest", dot_fn(t))] {
                let got = dot_with(f, t, &row, &x) as f64;
                assert!(
                    (got - exact).abs() <= tol,
                    "{} n={n} {name}: {got} vs {exact} (tolerance {tol})",
                    t.name()
                );
            }
        }
    }
}

#[test]
fn quantized_kernels_agree_with_integer_sums() {
    // Against the portable kernel, which sums exactly in integers per block: the SIMD
    // kernels may only differ by float rounding.
    for t in ALL.into_iter().filter(|t| t.act() != ActKind::F32) {
        let n = 2048;
        let row = random_row(t, n, 7 + t as u64);
        let x = act(n, 3);
        let a = dot_with(portable_dot_fn(t), t, &row, &x);
        let b = dot_with(dot_fn(t), t, &row, &x);
        assert!(
            (a - b).abs() <= 1e-4 * a.abs().max(1.0),
            "{}: {a} vs {b}",
            t.name()
        );
    }
}

#[test]
fn known_blocks_dequantize_as_ggml_defines_them() {
    // Q4_0: d = 1, nibble 0x1 low / 0xf high → -7 and 7.
    let mut b = vec![0u8; 18];
    b[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    b[2] = 0xf1;
    let mut out = vec![0.0; 32];
    dequantize_row(WeightType::Q4_0, &b, &mut out);
    assert_eq!((out[0], out[16], out[1]), (-7.0, 7.0, -8.0));
    // Q5_0: the high bit of element 16 set.
    let mut b = vec![0u8; 22];
    b[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
    b[2..6].copy_from_slice(&(1u32 << 16).to_le_bytes());
    dequantize_row(WeightType::Q5_0, &b, &mut out);
    assert_eq!((out[0], out[16]), (-8.0, 0.0));
    // Q4_K: sub-block 5's scale and min come from the packed high bits.
    let mut b = vec![0u8; 144];
    b[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    b[2..4].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    b[4 + 1] = 0b0100_0000; // scales[1] top bits → sub-block 5's scale bits 4-5
    b[4 + 9] = 0x32; // scales[9]: sub-block 5 scale low 2, min low 3
    b[4 + 5] = 0b1000_0000; // scales[5] top bits → sub-block 5's min bits 4-5
    b[16 + 64..16 + 96].fill(0x10); // chunk 2's high nibbles = 1 (sub-block 5)
    let mut out = vec![0.0; 256];
    dequantize_row(WeightType::Q4K, &b, &mut out);
    let (sc, m) = (2.0 + 16.0, 3.0 + 32.0);
    assert_eq!(out[160], sc * 1.0 - m);
}

#[test]
fn the_fast_quantizer_equals_the_portable_one() {
    // The first 512 values: blocks whose largest magnitude is 127, so a step is 1 and
    // every other value lies exactly on a half; then zeros, an extreme, random values.
    let mut x = act(2048, 11);
    for (i, v) in x[..512].iter_mut().enumerate() {
        *v = match i % 32 {
            0 => 127.0,
            j => (j * 8) as f32 - 124.5,
        };
    }
    x[512..576].fill(0.0);
    x[700] = -1e6;
    let (mut a, mut b) = (vec![Q8::default(); 64], vec![Q8::default(); 64]);
    quantize_q8(&x, &mut a);
    portable_quantize_q8(&x, &mut b);
    for (a, b) in a.iter().zip(&b) {
        assert_eq!((a.d.to_bits(), a.qs, a.sum), (b.d.to_bits(), b.qs, b.sum));
    }
    let (mut a, mut b) = (vec![Q8K::default(); 8], vec![Q8K::default(); 8]);
    quantize_q8k(&x, &mut a);
    portable_quantize_q8k(&x, &mut b);
    for (a, b) in a.iter().zip(&b) {
        assert_eq!(
            (a.d.to_bits(), a.qs, a.bsums),
            (b.d.to_bits(), b.qs, b.bsums)
        );
    }
}

#[test]
fn activations_quantize_within_half_a_step() {
    let x = act(512, 5);
    let mut q = vec![Q8K::default(); 2];
    quantize_q8k(&x, &mut q);
    for (b, qb) in x.chunks(256).zip(&q) {
        for (&v, &qv) in b.iter().zip(&qb.qs) {
            assert!((v - qb.d * qv as f32).abs() <= qb.d * 0.5 + 1e-6);
        }
        for (g, &s) in qb.qs.chunks(16).zip(&qb.bsums) {
            assert_eq!(g.iter().map(|&v| v as i16).sum::<i16>(), s);
        }
    }
    let mut z = vec![Q8::default(); 1];
    quantize_q8(&[0.0; 32], &mut z);
    assert_eq!((z[0].d, z[0].qs), (0.0, [0; 32]));
}

/// Q8_K rows of `xs`.
fn q8k_rows(xs: &[impl AsRef<[f32]>]) -> Vec<Vec<Q8K>> {
    xs.iter()
        .map(|x| {
            let x = x.as_ref();
            let mut q = vec![Q8K::default(); x.len() / 256];
            quantize_q8k(x, &mut q);
            q
        })
        .collect()
}

/// Q8 rows of `xs`.
fn q8_rows(xs: &[impl AsRef<[f32]>]) -> Vec<Vec<Q8>> {
    xs.iter()
        .map(|x| {
            let x = x.as_ref();
            let mut q = vec![Q8::default(); x.len() / 32];
            quantize_q8(x, &mut q);
            q
        })
        .collect()
}

/// The row kernels (portable and fastest) and the panel kernels of `t` (each
/// instruction set the CPU runs) give the same
/// bits, on random rows and on a row at every extreme (`extreme` sets a block) that
/// meets activations of ±127, where 16-bit partial sums come closest to overflowing.
fn kernels_give_the_same_bits_everywhere<P: panel::Panel>(t: WeightType, extreme: fn(&mut [u8])) {
    kernels_give_the_same_bits_on::<P>(t, extreme, |_| {})
}

/// [`kernels_give_the_same_bits_everywhere`] with every block of every row through
/// `fix` first.
fn kernels_give_the_same_bits_on<P: panel::Panel>(
    t: WeightType,
    extreme: fn(&mut [u8]),
    fix: fn(&mut [u8]),
) {
    let n = 768;
    let mut rows: Vec<Vec<u8>> = (0..8).map(|r| random_row(t, n, 40 + r)).collect();
    rows.iter_mut()
        .for_each(|r| r.chunks_exact_mut(t.block_bytes()).for_each(fix));
    rows[5].chunks_exact_mut(t.block_bytes()).for_each(extreme);
    // More token rows than a kernel call takes (two AMX tiles' 16), each row's blocks
    // right after the previous row's, as a prepared matrix lays them out.
    let mut xs: Vec<Vec<f32>> = (0..35).map(|i| act(n, 60 + i)).collect();
    xs[3] = vec![1.0; n];
    xs[4] = (0..n)
        .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    xs[5] = vec![-2.5; n];
    let q: Vec<Q8K> = q8k_rows(&xs).concat();
    let q8: Vec<Q8> = q8_rows(&xs).concat();
    let acts: Vec<ActRow<'_>> = match t.act() {
        ActKind::Q8K => q.chunks_exact(n / 256).map(ActRow::Q8K).collect(),
        _ => q8.chunks_exact(n / 32).map(ActRow::Q8).collect(),
    };
    let expect: Vec<Vec<f32>> = rows
        .iter()
        .map(|row| {
            let mut o = vec![0.0; acts.len()];
            portable_dot_fn(t)(row, &acts, &mut o);
            o
        })
        .collect();
    for (r, row) in rows.iter().enumerate() {
        let mut o = vec![0.0; acts.len()];
        dot_fn(t)(row, &acts, &mut o);
        assert_eq!(
            o.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            expect[r].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{}: row kernel, row {r}",
            t.name()
        );
    }
    if !panel::available() {
        return;
    }
    // Panels, with every count of tokens up to the activations'.
    let mut packed = vec![P::default(); n / 256];
    P::pack(std::array::from_fn(|r| &rows[r][..]), &mut packed);
    // Each kernel set this CPU runs.
    for isa in panel::Isa::ALL {
        if !isa.runs() {
            continue;
        }
        for count in 1..=acts.len() {
            let mut out = vec![[0.0f32; 8]; count];
            P::gemm_with(isa, &packed, &acts[..count], &mut out);
            for (i, o) in out.iter().enumerate() {
                for (r, v) in o.iter().enumerate() {
                    assert_eq!(
                        v.to_bits(),
                        expect[r][i].to_bits(),
                        "{}: {isa:?} panel of {count} tokens: row {r} token {i}: {v} against {}",
                        t.name(),
                        expect[r][i]
                    );
                }
            }
            // Two panels at once: these rows, then the same rows in reverse order.
            let mut rev = vec![P::default(); n / 256];
            P::pack(std::array::from_fn(|r| &rows[7 - r][..]), &mut rev);
            let mut out = vec![[0.0f32; 16]; count];
            P::gemm_pair_with(isa, &packed, &rev, &acts[..count], &mut out);
            for (i, o) in out.iter().enumerate() {
                for (r, v) in o.iter().enumerate() {
                    let e = expect[if r < 8 { r } else { 15 - r }][i];
                    assert_eq!(
                        v.to_bits(),
                        e.to_bits(),
                        "{}: {isa:?} panel pair of {count} tokens: row {r} token {i}: {v} against {e}",
                        t.name(),
                    );
                }
            }
            // The token rows in reverse order (evenly apart, backwards), and with the
            // first two swapped (not evenly apart, which the AMX kernel leaves to VNNI).
            if count == acts.len() {
                let mut swapped: Vec<usize> = (0..count).collect();
                swapped.swap(0, 1);
                for order in [(0..count).rev().collect::<Vec<_>>(), swapped] {
                    let acts: Vec<ActRow<'_>> = order.iter().map(|&i| acts[i]).collect();
                    P::gemm_pair_with(isa, &packed, &rev, &acts, &mut out);
                    for (i, o) in out.iter().enumerate() {
                        for (r, v) in o.iter().enumerate() {
                            let e = expect[if r < 8 { r } else { 15 - r }][order[i]];
                            assert_eq!(
                                v.to_bits(),
                                e.to_bits(),
                                "{}: {isa:?} panel pair, tokens in the order {order:?}: row {r} token {i}",
                                t.name(),
                            );
                        }
                    }
                }
            }
            // Four panels of one token: the rows, reversed, reversed, the rows.
            let mut quad = [0.0f32; 32];
            P::gemm_quad_with(
                isa,
                [&packed, &rev, &rev, &packed],
                acts[count - 1],
                &mut quad,
            );
            for (r, v) in quad.iter().enumerate() {
                let row = if (8..24).contains(&r) {
                    7 - r % 8
                } else {
                    r % 8
                };
                let e = expect[row][count - 1];
                assert_eq!(
                    v.to_bits(),
                    e.to_bits(),
                    "{}: {isa:?} four panels, token {}: row {r}: {v} against {e}",
                    t.name(),
                    count - 1
                );
            }
        }
    }
}

#[test]
fn q4k_kernels_give_the_same_bits_everywhere() {
    // Nibbles 15, scales and mins 63.
    kernels_give_the_same_bits_everywhere::<panel::Q4KPanel>(WeightType::Q4K, |b| {
        b[4..].fill(0xff)
    });
}

#[test]
fn q6k_kernels_give_the_same_bits_everywhere() {
    // Weights 63 (31 once read), scales 127 and -128 in turn.
    kernels_give_the_same_bits_everywhere::<panel::Q6KPanel>(WeightType::Q6K, |b| {
        b[..192].fill(0xff);
        for (s, sc) in b[192..208].iter_mut().enumerate() {
            *sc = if s % 2 == 0 { 0x7f } else { 0x80 };
        }
    });
}

#[test]
fn q8_0_kernels_give_the_same_bits_everywhere() {
    // Weights of -128 (only a hand-made file holds them) and 127 in turn.
    kernels_give_the_same_bits_everywhere::<panel::Q8Panel>(WeightType::Q8_0, |b| {
        for (i, q) in b[2..].iter_mut().enumerate() {
            *q = if i % 2 == 0 { 0x80 } else { 0x7f };
        }
    });
}

#[test]
fn q8_0_sign_magnitude_kernels_give_the_same_bits_everywhere() {
    // The panels AVX2 runs where no weight is -128: -127 and 127 in turn at the extreme,
    // every -128 of the random rows made -127.
    kernels_give_the_same_bits_on::<panel::Q8SmPanel>(
        WeightType::Q8_0,
        |b| {
            for (i, q) in b[2..].iter_mut().enumerate() {
                *q = if i % 2 == 0 { 0x81 } else { 0x7f };
            }
        },
        |b| {
            b[2..]
                .iter_mut()
                .filter(|q| **q == 0x80)
                .for_each(|q| *q = 0x81)
        },
    );
}

#[test]
fn blocks32_kernels_give_the_bits_of_the_portable_ones() {
    // Four rows at once (one vector of sums) and one at a time.
    // Blocks in whole eights and not.
    for (t, n) in [
        (WeightType::Q4_0, 512),
        (WeightType::Q5_0, 512),
        (WeightType::Q8_0, 352),
        (WeightType::Q4_0, 96),
    ] {
        let row = random_row(t, n, 77);
        let xs: Vec<Vec<f32>> = (0..6).map(|i| act(n, 90 + i)).collect();
        let refs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
        let fast = dots_with(dot_fn(t), t, &row, &refs);
        let portable = dots_with(portable_dot_fn(t), t, &row, &refs);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&portable), "{}", t.name());
    }
}

#[test]
fn only_named_instruction_sets_are_caps() {
    for ok in [
        None,
        Some(""),
        Some("avx2"),
        Some(" AVX2 "),
        Some("avxvnni"),
        Some("avx512"),
        Some("amx"),
    ] {
        assert_eq!(panel::Isa::problem_of(ok), None, "{ok:?}");
    }
    for bad in ["sse4", "avx-512", "avx_vnni", "off"] {
        let why = panel::Isa::problem_of(Some(bad)).expect(bad);
        assert!(why.contains(bad) && why.contains("ignored"), "{why}");
        assert_eq!(panel::Isa::cap_of(Some(bad)), None, "{bad}");
    }
    let caps = [
        ("avx2", panel::Isa::Avx2),
        ("AvxVnni", panel::Isa::AvxVnni),
        ("avx512", panel::Isa::Vnni),
        ("AMX", panel::Isa::Amx),
    ];
    for (v, isa) in caps {
        assert_eq!(panel::Isa::cap_of(Some(v)), Some(isa), "{v}");
    }
    // Whatever the cap, the kernels chosen run here.
    assert!(!panel::available() || panel::Isa::best().runs());
}

/// The pair kernel of each instruction set this CPU runs, alternated in rounds:
/// `cargo test --release --lib pair_kernel_speed -- --ignored --nocapture`
/// (`INFER_PAIR_SHAPE="pairs,k,tokens"`, default 44 pairs of panels, 1024 columns, 32
/// tokens: a block of rows as `linear` walks it, one token group; `INFER_PAIR_TYPE`
/// `q8_0`, the default, `q4_k` or `q6_k`). The best round of each is printed last: on
/// a shared host it is the steadiest figure.
#[test]
#[ignore]
fn pair_kernel_speed() {
    if !panel::available() {
        return;
    }
    let shape = std::env::var("INFER_PAIR_SHAPE").unwrap_or("44,1024,32".into());
    let d: Vec<usize> = shape
        .split(',')
        .map(|v| v.trim().parse().unwrap())
        .collect();
    match std::env::var("INFER_PAIR_TYPE").as_deref() {
        Ok("q4_k") => pair_speed::<panel::Q4KPanel>(WeightType::Q4K, d[0], d[1], d[2]),
        Ok("q6_k") => pair_speed::<panel::Q6KPanel>(WeightType::Q6K, d[0], d[1], d[2]),
        _ => pair_speed::<panel::Q8Panel>(WeightType::Q8_0, d[0], d[1], d[2]),
    }
}

fn pair_speed<P: panel::Panel>(wt: WeightType, pairs: usize, k: usize, t: usize) {
    let rows: Vec<Vec<u8>> = (0..16 * pairs)
        .map(|r| random_row(wt, k, r as u64))
        .collect();
    let panels: Vec<Vec<P>> = rows
        .chunks_exact(8)
        .map(|r| {
            let mut p = vec![P::default(); k / 256];
            P::pack(std::array::from_fn(|i| &r[i][..]), &mut p);
            p
        })
        .collect();
    let xs: Vec<Vec<f32>> = (0..t).map(|i| act(k, 500 + i as u64)).collect();
    let q8: Vec<Q8> = q8_rows(&xs).concat();
    let q8k: Vec<Q8K> = q8k_rows(&xs).concat();
    let acts: Vec<ActRow<'_>> = match wt.act() {
        ActKind::Q8K => q8k.chunks_exact(k / 256).map(ActRow::Q8K).collect(),
        _ => q8.chunks_exact(k / 32).map(ActRow::Q8).collect(),
    };
    let mut out = vec![[0.0f32; 16]; t];
    // Short rounds, alternated: the host's speed drifts over seconds.
    let reps = (1usize << 28) / (16 * pairs * k * t) + 1;
    // `INFER_PAIR_ISA=avx512,amx` runs those instruction sets only;
    // `INFER_PAIR_ROUNDS` sets the rounds (4).
    let only: Option<Vec<panel::Isa>> = std::env::var("INFER_PAIR_ISA").ok().map(|v| {
        v.split(',')
            .filter_map(|i| panel::Isa::cap_of(Some(i)))
            .collect()
    });
    let isas: Vec<panel::Isa> = panel::Isa::ALL
        .into_iter()
        .filter(|i| i.runs() && only.as_ref().is_none_or(|o| o.contains(i)))
        .collect();
    let rounds = std::env::var("INFER_PAIR_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut best = std::collections::BTreeMap::new();
    for round in 0..rounds {
        let mut line = format!("round {round}:");
        for &isa in &isas {
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                for p in panels.chunks_exact(2) {
                    P::gemm_pair_with(isa, &p[0], &p[1], &acts, &mut out);
                }
            }
            let s = t0.elapsed().as_secs_f64();
            let macs = (reps * 16 * pairs * k * t) as f64;
            line += &format!(" {isa:?} {:.1}", macs / s / 1e9);
            let e = best.entry(format!("{isa:?}")).or_insert(0.0f64);
            *e = e.max(macs / s / 1e9);
        }
        println!("{line} G multiply-adds/s");
    }
    println!("best: {best:?}");
}
