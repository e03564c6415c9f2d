use super::*;
use crate::llm::config::Gpt2Config;
use crate::llm::sampling::argmax;
use crate::llm::step::Logits;
use crate::status::Code;
use serde_json::Value;
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tiny_gpt2() -> Arc<Gpt2> {
    Arc::new(Gpt2::load(&folder(&root().join("models/tiny_gpt2/1"))).unwrap())
}

fn fixture() -> Value {
    let text =
        std::fs::read_to_string(root().join("tests/fixtures/models/tiny_gpt2.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Largest |got - want| / max(1, |want|) over a row.
fn worst(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g - w).abs() / w.abs().max(1.0))
        .fold(0.0, f32::max)
}

const TOLERANCE: f32 = 1e-4;

/// A sequence being decoded in tests: its tokens so far and its block table.
struct Seq {
    tokens: Vec<u32>,
    blocks: Vec<u32>,
}

#[test]
fn prompt_logits_match_transformers() {
    let model = tiny_gpt2();
    let v = model.config.vocab_size;
    let fx = fixture();
    let mut runner = Runner::new(model, 1).unwrap();
    let mut kv = KvCache::new(&runner.model().config, 16, 8).unwrap();
    let blocks: Vec<u32> = (0..8).collect();
    let mut logits = Vec::new();
    let mut worst_all = 0.0f32;
    for case in fx["cases"].as_array().unwrap() {
        let prompt = ids(&case["prompt"]);
        let want = rows(&case["prompt_logits"]);
        let seq = StepSeq {
            tokens: &prompt,
            start: 0,
            blocks: &blocks,
            logits: Logits::All,
        };
        runner.step(&mut kv, &[seq], &mut logits).unwrap();
        assert_eq!(logits.len(), prompt.len() * v);
        for (p, w) in want.iter().enumerate() {
            let d = worst(&logits[p * v..(p + 1) * v], w);
            assert!(
                d <= TOLERANCE,
                "prompt of {}: position {p} is off by {d}",
                prompt.len()
            );
            worst_all = worst_all.max(d);
        }
    }
    println!(
        "worst prompt-logit difference vs transformers: {worst_all:e} (relative to max(1, |ref|))"
    );
}

/// Greedy decoding of every fixture prompt, all in one batch (prefills and decodes mixed
/// as sequences start), compared with transformers' tokens and per-step logits.
#[test]
fn greedy_decoding_matches_transformers() {
    let model = tiny_gpt2();
    let v = model.config.vocab_size;
    let fx = fixture();
    let cases = fx["cases"].as_array().unwrap();
    for threads in [1, 2] {
        let mut runner = Runner::new(Arc::clone(&model), threads).unwrap();
        let tpb = 8;
        let mut kv = KvCache::new(&model.config, tpb, 64).unwrap();
        let mut seqs: Vec<Seq> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| Seq {
                tokens: ids(&c["prompt"]),
                // Interleaved block ids: sequence i owns blocks i, i+4, i+8, ...
                blocks: (0..16).map(|b| (b * 4 + i) as u32).collect(),
            })
            .collect();
        let prompt_lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let mut done: Vec<usize> = vec![0; seqs.len()]; // tokens already in the cache
        let mut logits = Vec::new();
        let mut worst_step = 0.0f32;
        for round in 0..24 {
            let step: Vec<StepSeq<'_>> = seqs
                .iter()
                .zip(&done)
                .map(|(s, &d)| StepSeq {
                    tokens: &s.tokens[d..],
                    start: d,
                    blocks: &s.blocks,
                    logits: Logits::Last,
                })
                .collect();
            runner.step(&mut kv, &step, &mut logits).unwrap();
            assert_eq!(logits.len(), seqs.len() * v);
            for (i, s) in seqs.iter_mut().enumerate() {
                let row = &logits[i * v..(i + 1) * v];
                if let Some(want) = cases[i].get("step_logits") {
                    let d = worst(row, &rows(want)[round]);
                    assert!(d <= TOLERANCE, "case {i} step {round}: off by {d}");
                    worst_step = worst_step.max(d);
                }
                done[i] = s.tokens.len();
                s.tokens.push(argmax(row));
            }
        }
        for (i, s) in seqs.iter().enumerate() {
            assert_eq!(
                s.tokens[prompt_lens[i]..],
                ids(&cases[i]["greedy"])[..],
                "case {i}"
            );
        }
        println!("threads {threads}: worst decode-step logit difference {worst_step:e}");
    }
}

// ---- batching invariance -------------------------------------------------------------

fn invariance_model() -> Arc<Gpt2> {
    // Widths that are not multiples of the GEMM tiles, a vocabulary wider than one
    // thread part, and enough positions for long prompts.
    let c = Gpt2Config {
        n_layer: 2,
        n_head: 3,
        n_embd: 48,
        n_inner: 200,
        vocab_size: 1037,
        n_positions: 96,
        ..Gpt2Config::default()
    };
    Arc::new(Gpt2::random(c, 42))
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 131 + salt * 977 + 7) % 1037)
        .collect()
}

/// Runs `chunks` (token counts) of `tokens` through one sequence with table `blocks`;
/// returns the logits of every token and the sequence's K/V, read back position by
/// position.
fn run_chunked(
    runner: &mut Runner,
    kv: &mut KvCache,
    tokens: &[u32],
    blocks: &[u32],
    chunks: &[usize],
) -> (Vec<f32>, Vec<f32>) {
    let mut all = Vec::new();
    let mut logits = Vec::new();
    let mut at = 0;
    for &n in chunks {
        let seq = StepSeq {
            tokens: &tokens[at..at + n],
            start: at,
            blocks,
            logits: Logits::All,
        };
        runner.step(kv, &[seq], &mut logits).unwrap();
        all.extend_from_slice(&logits);
        at += n;
    }
    assert_eq!(at, tokens.len());
    let cache = read_kv(runner.model(), kv, blocks, tokens.len());
    (all, cache)
}

/// K and V of positions `0..len`, layer by layer, in a layout independent of the table.
fn read_kv(model: &Gpt2, kv: &KvCache, blocks: &[u32], len: usize) -> Vec<f32> {
    let c = &model.config;
    let (hd, tpb) = (c.head_dim(), kv.tokens_per_block());
    let mut out = Vec::new();
    let mut scratch = Vec::new();
    for l in 0..c.n_layer {
        for value in [false, true] {
            for h in 0..c.n_head {
                for p in 0..len {
                    let head = kv.head(blocks[p / tpb] as usize, l, value, h);
                    let head = head.as_f32(&mut scratch);
                    out.extend_from_slice(&head[(p % tpb) * hd..(p % tpb + 1) * hd]);
                }
            }
        }
    }
    out
}

fn runner(model: &Arc<Gpt2>, threads: usize, force_parallel: bool) -> Runner {
    let mut r = Runner::new(Arc::clone(model), threads).unwrap();
    if force_parallel {
        r.min_par_work = 0;
    }
    r
}

#[test]
fn prefill_chunking_does_not_change_a_bit() {
    let model = invariance_model();
    let tokens = prompt(61, 1);
    let blocks: Vec<u32> = (0..16).collect();
    let mut reference = None;
    for (threads, parallel) in [(1, false), (3, true), (2, false)] {
        let mut r = runner(&model, threads, parallel);
        for chunks in [
            vec![61],
            vec![1; 61],
            [vec![3; 20], vec![1]].concat(),
            [vec![7; 8], vec![5]].concat(),
            vec![30, 1, 30],
        ] {
            let mut kv = KvCache::new(&model.config, 4, 16).unwrap();
            let got = run_chunked(&mut r, &mut kv, &tokens, &blocks, &chunks);
            match &reference {
                None => reference = Some(got),
                Some((logits, cache)) => {
                    assert_eq!(
                        bits(&got.0),
                        bits(logits),
                        "logits, chunks {chunks:?}, threads {threads}"
                    );
                    assert_eq!(
                        bits(&got.1),
                        bits(cache),
                        "K/V, chunks {chunks:?}, threads {threads}"
                    );
                }
            }
        }
    }
}

#[test]
fn block_tables_do_not_change_a_bit() {
    let model = invariance_model();
    let tokens = prompt(37, 2);
    let mut r = runner(&model, 1, false);
    let tables: [Vec<u32>; 3] = [
        (0..10).collect(),
        vec![17, 3, 9, 30, 0, 22, 5, 11, 28, 14],
        vec![39, 38, 1, 36, 2, 20, 21, 7, 8, 33],
    ];
    let mut reference: Option<(Vec<f32>, Vec<f32>)> = None;
    for (tpb_chunks, table) in [
        (vec![37], &tables[0]),
        (vec![37], &tables[1]),
        (vec![10, 27], &tables[2]),
        (vec![1; 37], &tables[1]),
    ] {
        let mut kv = KvCache::new(&model.config, 4, 40).unwrap();
        let got = run_chunked(&mut r, &mut kv, &tokens, table, &tpb_chunks);
        match &reference {
            None => reference = Some(got),
            Some((logits, cache)) => {
                assert_eq!(bits(&got.0), bits(logits), "table {table:?}");
                assert_eq!(bits(&got.1), bits(cache), "table {table:?}");
            }
        }
    }
}

/// Several sequences in one step (prefills and decodes mixed, shared cache, interleaved
/// tables) give each one exactly what it gets alone.
#[test]
fn batching_does_not_change_a_bit() {
    let model = invariance_model();
    let v = model.config.vocab_size;
    let tpb = 4;
    let lens = [13, 5, 1, 29, 8];
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, 10 + i as u32))
        .collect();
    let continuation: Vec<Vec<u32>> = (0..lens.len()).map(|i| prompt(6, 20 + i as u32)).collect();
    let tables: Vec<Vec<u32>> = (0..lens.len())
        .map(|i| (0..10).map(|b| (b * 5 + i) as u32).rev().collect())
        .collect();

    // Alone, single thread, one chunk then one decode token at a time.
    let mut alone_logits = Vec::new();
    let mut alone_kv = Vec::new();
    for i in 0..lens.len() {
        let mut r = runner(&model, 1, false);
        let mut kv = KvCache::new(&model.config, tpb, 50).unwrap();
        let all: Vec<u32> = [prompts[i].clone(), continuation[i].clone()].concat();
        let chunks = [vec![lens[i]], vec![1; 6]].concat();
        let (l, c) = run_chunked(&mut r, &mut kv, &all, &tables[i], &chunks);
        alone_logits.push(l);
        alone_kv.push(c);
    }

    for (threads, parallel) in [(1, false), (2, false), (4, true)] {
        let mut r = runner(&model, threads, parallel);
        let mut kv = KvCache::new(&model.config, tpb, 50).unwrap();
        let mut got: Vec<Vec<f32>> = vec![Vec::new(); lens.len()];
        let mut logits = Vec::new();
        // Staggered: sequence i starts at round i; its first round is its prefill.
        let mut done = vec![0usize; lens.len()];
        for round in 0..lens.len() + 6 {
            let mut batch = Vec::new();
            let mut who = Vec::new();
            for i in 0..lens.len() {
                if round < i || done[i] == lens[i] + 6 {
                    continue;
                }
                let n = if done[i] == 0 { lens[i] } else { 1 };
                let all: &[u32] = if done[i] < lens[i] {
                    &prompts[i]
                } else {
                    &continuation[i]
                };
                let off = if done[i] < lens[i] { 0 } else { lens[i] };
                batch.push(StepSeq {
                    tokens: &all[done[i] - off..done[i] - off + n],
                    start: done[i],
                    blocks: &tables[i],
                    logits: Logits::All,
                });
                who.push((i, n));
            }
            r.step(&mut kv, &batch, &mut logits).unwrap();
            let mut at = 0;
            for &(i, n) in &who {
                got[i].extend_from_slice(&logits[at * v..(at + n) * v]);
                at += n;
                done[i] += n;
            }
            assert_eq!(at * v, logits.len());
        }
        for i in 0..lens.len() {
            assert_eq!(
                bits(&got[i]),
                bits(&alone_logits[i]),
                "sequence {i} logits, threads {threads}"
            );
            let c = read_kv(&model, &kv, &tables[i], lens[i] + 6);
            assert_eq!(
                bits(&c),
                bits(&alone_kv[i]),
                "sequence {i} K/V, threads {threads}"
            );
        }
    }
}

#[test]
fn logits_selection() {
    let model = invariance_model();
    let v = model.config.vocab_size;
    let mut r = runner(&model, 1, false);
    let mut kv = KvCache::new(&model.config, 4, 30).unwrap();
    let (a, b, c) = (prompt(5, 1), prompt(3, 2), prompt(4, 3));
    let t: [Vec<u32>; 3] = [(0..10).collect(), (10..20).collect(), (20..30).collect()];
    let mut all = Vec::new();
    let step = |a_mode, b_mode, c_mode| {
        [
            StepSeq {
                tokens: &a,
                start: 0,
                blocks: &t[0],
                logits: a_mode,
            },
            StepSeq {
                tokens: &b,
                start: 0,
                blocks: &t[1],
                logits: b_mode,
            },
            StepSeq {
                tokens: &c,
                start: 0,
                blocks: &t[2],
                logits: c_mode,
            },
        ]
    };
    r.step(
        &mut kv,
        &step(Logits::All, Logits::All, Logits::All),
        &mut all,
    )
    .unwrap();
    assert_eq!(all.len(), 12 * v);
    let mut some = vec![1.0; 3];
    r.step(
        &mut kv,
        &step(Logits::Last, Logits::None, Logits::All),
        &mut some,
    )
    .unwrap();
    assert_eq!(some.len(), 5 * v);
    assert_eq!(bits(&some[..v]), bits(&all[4 * v..5 * v]));
    assert_eq!(bits(&some[v..]), bits(&all[8 * v..12 * v]));
    r.step(
        &mut kv,
        &step(Logits::None, Logits::None, Logits::None),
        &mut some,
    )
    .unwrap();
    assert!(some.is_empty());
    r.step(&mut kv, &[], &mut some).unwrap();
    assert!(some.is_empty());
}

#[test]
fn bad_steps_are_invalid_and_change_nothing() {
    let model = invariance_model();
    let c = &model.config;
    let mut r = runner(&model, 1, false);
    let mut kv = KvCache::new(c, 4, 8).unwrap();
    let good_tokens = prompt(6, 1);
    let good_blocks = [0u32, 1];
    let good = StepSeq {
        tokens: &good_tokens,
        start: 0,
        blocks: &good_blocks,
        logits: Logits::Last,
    };
    let before = read_kv(&model, &kv, &[0, 1, 2, 3, 4, 5, 6, 7], 32);
    let far = [6u32; 30];
    let bad_token = [1u32, 1037];
    let cases: Vec<(StepSeq<'_>, &str)> = vec![
        (
            StepSeq {
                tokens: &bad_token,
                start: 0,
                blocks: &[2],
                logits: Logits::Last,
            },
            "vocabulary",
        ),
        (
            StepSeq {
                tokens: &[1],
                start: 96,
                blocks: &far,
                logits: Logits::Last,
            },
            "positions",
        ),
        (
            StepSeq {
                tokens: &[1, 2],
                start: 3,
                blocks: &[2],
                logits: Logits::Last,
            },
            "cannot hold",
        ),
        (
            StepSeq {
                tokens: &[1],
                start: 0,
                blocks: &[8],
                logits: Logits::Last,
            },
            "block id 8",
        ),
        (
            StepSeq {
                tokens: &[],
                start: 0,
                blocks: &[2],
                logits: Logits::Last,
            },
            "no tokens",
        ),
        (
            StepSeq {
                tokens: &[1],
                start: 4,
                blocks: &[2, 1],
                logits: Logits::None,
            },
            "writes block 1",
        ),
    ];
    let mut logits = vec![5.0];
    for (bad, needle) in cases {
        let e = r.step(&mut kv, &[good, bad], &mut logits).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument, "{e}");
        assert!(e.message.contains(needle), "{needle}: {e}");
        assert!(logits.is_empty());
    }
    assert_eq!(
        bits(&read_kv(&model, &kv, &[0, 1, 2, 3, 4, 5, 6, 7], 32)),
        bits(&before)
    );
    // Reading a block another sequence writes is the scheduler's business, and allowed;
    // so is a sequence with no tokens and no logits.
    let empty = StepSeq {
        tokens: &[],
        start: 0,
        blocks: &[],
        logits: Logits::None,
    };
    r.step(&mut kv, &[good, empty], &mut logits).unwrap();
    // A cache made for another shape.
    let other = Gpt2Config {
        n_layer: 3,
        ..c.clone()
    };
    let mut kv3 = KvCache::new(&other, 4, 8).unwrap();
    let e = r.step(&mut kv3, &[good], &mut logits).unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
}

#[test]
fn thread_safety() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Runner>();
    send::<KvCache>();
    send_sync::<Gpt2>();
}

#[test]
fn runner_refuses_a_bad_config() {
    let c = Gpt2Config {
        n_head: 5,
        n_embd: 48,
        n_inner: 8,
        vocab_size: 8,
        n_positions: 8,
        n_layer: 1,
        ..Gpt2Config::default()
    };
    let e = Runner::new(Arc::new(Gpt2::random(c, 1)), 1).err().unwrap();
    assert_eq!(e.code, Code::InvalidArgument);
    // Weights that no longer match a config changed after loading.
    let mut m = Gpt2::random(invariance_model().config.clone(), 1);
    m.config.n_inner += 1;
    let e = Runner::new(Arc::new(m), 1).err().unwrap();
    assert!(
        e.code == Code::InvalidArgument && e.message.contains("mlp.c_fc"),
        "{e}"
    );
}

/// Times one step of a GPT-2-small-sized random model. Run with
/// `cargo test --release --lib llm::gpt2::tests::step_timing -- --ignored --nocapture`
/// (`GPT2_THREADS` picks the thread count, 0 = all cores).
#[test]
#[ignore]
fn step_timing() {
    use std::time::Instant;
    let threads: usize = std::env::var("GPT2_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let t0 = Instant::now();
    let model = Arc::new(Gpt2::random(Gpt2Config::default(), 1));
    println!("random GPT-2 small: {:.2?}", t0.elapsed());
    let c = model.config.clone();
    let mut r = Runner::new(Arc::clone(&model), threads).unwrap();
    println!("threads: {}", r.threads());
    let tpb = 16;
    let seqs = 64;
    let ctx = 256;
    let per_seq = ctx / tpb + 1;
    let mut kv = KvCache::new(&c, tpb, seqs * per_seq).unwrap();
    let mut logits = Vec::new();

    let prompt: Vec<u32> = (0..128).map(|i| (i * 389 + 11) % 50257).collect();
    let table: Vec<u32> = (0..per_seq as u32).collect();
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        let s = StepSeq {
            tokens: &prompt,
            start: 0,
            blocks: &table,
            logits: Logits::Last,
        };
        r.step(&mut kv, &[s], &mut logits).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("1 sequence, 128-token prefill: {:.1} ms", best * 1e3);

    // The caches of 64 sequences at 255 tokens: filled by prefilling one sequence and
    // copying its blocks (values do not matter for timing, only the reads).
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let long: Vec<u32> = (0..ctx as u32 - 1)
        .map(|i| (i * 389 + 11) % 50257)
        .collect();
    let t = Instant::now();
    let s = StepSeq {
        tokens: &long,
        start: 0,
        blocks: &tables[0],
        logits: Logits::None,
    };
    r.step(&mut kv, &[s], &mut logits).unwrap();
    println!(
        "1 sequence, 255-token prefill: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    for t in &tables[1..] {
        for (&src, &dst) in tables[0].iter().zip(t) {
            kv.copy_block(src, dst).unwrap();
        }
    }
    let next: Vec<u32> = (0..seqs as u32).map(|i| i * 7 + 3).collect();
    let mut best = f64::MAX;
    for _ in 0..4 {
        let batch: Vec<StepSeq<'_>> = (0..seqs)
            .map(|s| StepSeq {
                tokens: &next[s..s + 1],
                start: ctx - 1,
                blocks: &tables[s],
                logits: Logits::Last,
            })
            .collect();
        let t = Instant::now();
        r.step(&mut kv, &batch, &mut logits).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "64 sequences decoding 1 token at context 256: {:.1} ms",
        best * 1e3
    );
    let mut best = f64::MAX;
    for _ in 0..4 {
        let s = StepSeq {
            tokens: &next[..1],
            start: ctx - 1,
            blocks: &tables[0],
            logits: Logits::Last,
        };
        let t = Instant::now();
        r.step(&mut kv, &[s], &mut logits).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "1 sequence decoding 1 token at context 256: {:.1} ms",
        best * 1e3
    );
}

/// A test folder as the server opens one.
fn folder(p: &std::path::Path) -> crate::folder::Folder {
    crate::folder::Folder::root(p, false, "test").unwrap()
}
