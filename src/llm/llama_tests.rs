use super::*;
use crate::llm::kernels::tests::bits;
use crate::llm::kv::KvType;
use crate::llm::llama::LlamaConfig;
use crate::llm::step::Logits;
use crate::status::Code;

fn config(tied: bool, bias: bool) -> LlamaConfig {
    let json = serde_json::json!({
        "model_type": if bias { "qwen2" } else { "llama" },
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
    });
    LlamaConfig::from_hf_json(&json.to_string()).unwrap()
}

fn model(tied: bool, bias: bool) -> Arc<Llama> {
    Arc::new(Llama::random(config(tied, bias), 7).unwrap())
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 31 + salt * 17 + 3) % 97)
        .collect()
}

fn runner(m: &Arc<Llama>, threads: usize) -> LlamaRunner {
    let mut r = LlamaRunner::new(Arc::clone(m), threads).unwrap();
    r.min_par_work = 0;
    r
}

/// All logits of `tokens`, fed in chunks of `chunk`.
fn run_chunked(r: &mut LlamaRunner, kv: &mut KvCache, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let blocks: Vec<u32> = (0..kv.num_blocks() as u32).collect();
    let mut all = Vec::new();
    let mut logits = Vec::new();
    for start in (0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        let s = StepSeq {
            tokens: &tokens[start..end],
            start,
            blocks: &blocks,
            logits: Logits::All,
        };
        r.step(kv, &[s], &mut logits).unwrap();
        all.extend_from_slice(&logits);
    }
    all
}

#[test]
fn chunks_threads_and_batches_do_not_change_a_bit() {
    for (tied, bias) in [(true, false), (false, true)] {
        let m = model(tied, bias);
        for dtype in [KvType::F32, KvType::F16] {
            let shape = m.config.kv_shape(dtype);
            let p = prompt(37, 1);
            let whole = run_chunked(
                &mut runner(&m, 1),
                &mut KvCache::new(shape, 8, 8).unwrap(),
                &p,
                37,
            );
            assert_eq!(whole.len(), 37 * 97);
            for (threads, chunk) in [(1, 1), (2, 5), (3, 16)] {
                let got = run_chunked(
                    &mut runner(&m, threads),
                    &mut KvCache::new(shape, 8, 8).unwrap(),
                    &p,
                    chunk,
                );
                assert_eq!(bits(&whole), bits(&got), "threads {threads}, chunk {chunk}");
            }
            // The same prompt inside a batch with two others, on scattered blocks.
            let others = [prompt(11, 2), prompt(23, 3)];
            let mut r = runner(&m, 2);
            let mut kv = KvCache::new(shape, 8, 24).unwrap();
            let tables: Vec<Vec<u32>> = (0..3)
                .map(|i| (0..8).map(|b| b * 3 + i).collect())
                .collect();
            let seqs = [
                StepSeq {
                    tokens: &others[0],
                    start: 0,
                    blocks: &tables[0],
                    logits: Logits::Last,
                },
                StepSeq {
                    tokens: &p,
                    start: 0,
                    blocks: &tables[1],
                    logits: Logits::All,
                },
                StepSeq {
                    tokens: &others[1],
                    start: 0,
                    blocks: &tables[2],
                    logits: Logits::None,
                },
            ];
            let mut logits = Vec::new();
            r.step(&mut kv, &seqs, &mut logits).unwrap();
            assert_eq!(logits.len(), 38 * 97);
            assert_eq!(bits(&whole), bits(&logits[97..]), "batched, {dtype:?}");
        }
    }
}

/// The last layer runs attention and the MLP only for the rows whose logits are
/// returned; its keys and values are still every token's. A prompt fed as chunks that
/// return nothing, then a last chunk that returns its last row, gives that row's bits
/// of the whole prompt's run (which computed every row), on one thread and on three.
#[test]
fn rows_without_logits_still_fill_the_last_layers_cache() {
    let m = model(false, true);
    let shape = m.config.kv_shape(KvType::F32);
    let p = prompt(29, 5);
    let whole = run_chunked(
        &mut runner(&m, 1),
        &mut KvCache::new(shape, 8, 8).unwrap(),
        &p,
        29,
    );
    let blocks: Vec<u32> = (0..8).collect();
    for threads in [1, 3] {
        let mut r = runner(&m, threads);
        let mut kv = KvCache::new(shape, 8, 8).unwrap();
        let mut logits = vec![1.0; 5];
        for (start, end, want) in [
            (0, 9, Logits::None),
            (9, 20, Logits::None),
            (20, 29, Logits::Last),
        ] {
            let s = StepSeq {
                tokens: &p[start..end],
                start,
                blocks: &blocks,
                logits: want,
            };
            r.step(&mut kv, &[s], &mut logits).unwrap();
        }
        assert_eq!(bits(&logits), bits(&whole[28 * 97..]), "threads {threads}");
        // One more token attends over all 30 positions, the last layer's included.
        let next = [p[3]];
        let s = StepSeq {
            tokens: &next,
            start: 29,
            blocks: &blocks,
            logits: Logits::Last,
        };
        r.step(&mut kv, &[s], &mut logits).unwrap();
        let mut longer = p.clone();
        longer.push(p[3]);
        let all = run_chunked(
            &mut runner(&m, 1),
            &mut KvCache::new(shape, 8, 8).unwrap(),
            &longer,
            30,
        );
        assert_eq!(bits(&logits), bits(&all[29 * 97..]), "threads {threads}");
    }
}

#[test]
fn f16_cache_stays_close_to_f32() {
    let m = model(true, false);
    let p = prompt(30, 4);
    let a = run_chunked(
        &mut runner(&m, 1),
        &mut KvCache::new(m.config.kv_shape(KvType::F32), 8, 8).unwrap(),
        &p,
        30,
    );
    let b = run_chunked(
        &mut runner(&m, 1),
        &mut KvCache::new(m.config.kv_shape(KvType::F16), 8, 8).unwrap(),
        &p,
        30,
    );
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst > 0.0 && worst < 1e-2, "{worst}");
}

#[test]
fn bad_steps_and_caches_are_refused() {
    let m = model(true, false);
    let mut r = runner(&m, 1);
    let mut logits = Vec::new();
    let other = LlamaConfig {
        n_kv_head: 4,
        ..m.config.clone()
    };
    let mut kv = KvCache::new(other.kv_shape(KvType::F32), 8, 4).unwrap();
    let blocks = [0, 1, 2, 3];
    let s = StepSeq {
        tokens: &[1, 2],
        start: 0,
        blocks: &blocks,
        logits: Logits::Last,
    };
    assert_eq!(
        r.step(&mut kv, &[s], &mut logits).unwrap_err().code,
        Code::InvalidArgument
    );
    let mut kv = KvCache::new(m.config.kv_shape(KvType::F32), 8, 4).unwrap();
    let s = StepSeq {
        tokens: &[97],
        start: 0,
        blocks: &blocks,
        logits: Logits::Last,
    };
    let e = r.step(&mut kv, &[s], &mut logits).unwrap_err();
    assert!(e.message.contains("outside the vocabulary"), "{e}");
}

#[test]
fn configs_name_what_they_cannot_serve() {
    let base = serde_json::json!({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 97,
        "max_position_embeddings": 64,
    });
    let with = |k: &str, v: serde_json::Value| {
        let mut j = base.clone();
        j[k] = v;
        LlamaConfig::from_hf_json(&j.to_string())
    };
    let c = with("num_key_value_heads", serde_json::Value::Null).unwrap();
    assert_eq!(
        (c.n_kv_head, c.head_dim, c.rope_style),
        (4, 16, crate::llm::llama::RopeStyle::Half)
    );
    for (k, v, code, word) in [
        (
            "model_type",
            serde_json::json!("gemma"),
            Code::Unsupported,
            "gemma",
        ),
        (
            "hidden_act",
            serde_json::json!("gelu"),
            Code::Unsupported,
            "hidden_act",
        ),
        (
            "mlp_bias",
            serde_json::json!(true),
            Code::Unsupported,
            "mlp_bias",
        ),
        (
            "num_key_value_heads",
            serde_json::json!(3),
            Code::InvalidArgument,
            "key/value heads",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            Code::Unsupported,
            "yarn",
        ),
        (
            "hidden_size",
            serde_json::json!(0),
            Code::InvalidArgument,
            "hidden_size",
        ),
    ] {
        let e = with(k, v).unwrap_err();
        assert_eq!(e.code, code, "{k}: {e}");
        assert!(e.message.contains(word), "{k}: {e}");
    }
    // Llama 3's scaling leaves high frequencies alone and divides low ones by the factor.
    let c = with(
        "rope_scaling",
        serde_json::json!({"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    )
    .unwrap();
    let plain = with("rope_scaling", serde_json::Value::Null).unwrap();
    assert_eq!(c.inv_freq[0], plain.inv_freq[0]);
    let last = c.inv_freq.len() - 1;
    assert!((c.inv_freq[last] * 8.0 - plain.inv_freq[last]).abs() < 1e-9);
    // Mistral's sliding window caps the context.
    let mut j = base.clone();
    j["model_type"] = serde_json::json!("mistral");
    j["sliding_window"] = serde_json::json!(32);
    assert_eq!(LlamaConfig::from_hf_json(&j.to_string()).unwrap().n_ctx, 32);
}

#[test]
fn silu_is_close_to_f64_and_the_same_bits_on_every_path() {
    let mut g: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.01).collect();
    g.extend([
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        20.0,
        -20.0,
        88.0,
        -88.0,
        200.0,
        -200.0,
        f32::MAX,
        f32::MIN,
    ]);
    let u: Vec<f32> = (0..g.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
    let mut fast = g.clone();
    silu_mul(&mut fast, &u);
    let mut portable = g.clone();
    silu_mul_portable(&mut portable, &u);
    assert_eq!(bits(&fast), bits(&portable));
    for ((&x, &u), &y) in g.iter().zip(&u).zip(&fast) {
        let want = (x as f64 / (1.0 + (-(x as f64)).exp()) * u as f64) as f32;
        // Within 4 ulp; below -87, where e^-|g| stops at e^-87, within 1e-30.
        let tol = 4.0 * f32::EPSILON * want.abs() + 1e-30;
        assert!((y - want).abs() <= tol, "silu({x}) · {u}: {y}, want {want}");
    }
    let mut nan = [f32::NAN, 1.0];
    silu_mul(&mut nan, &[1.0, 1.0]);
    assert!(nan[0].is_nan());
}

/// The gated MLP's first half, side by side (`matmul_combined`, SiLU(gate) x up applied
/// to each kernel call's outputs) against apart (both products to memory, then SiLU x up
/// in the quantizing pass), Q8_0 1024 -> 4096, interleaved rounds, best of each:
/// `INFER_GATE_UP_TOKENS=32,512,4096 INFER_GATE_UP_THREADS=2 cargo test --release --lib
/// gate_up_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn gate_up_speed() {
    use crate::llm::kernels::Exec;
    use crate::llm::linear::{Bytes, Matrix};
    use crate::llm::quant::tests::random_row;
    use crate::llm::quant::WeightType;
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or(default.into());
    let threads: usize = env("INFER_GATE_UP_THREADS", "2").parse().unwrap();
    let pool = crate::llm::pool::Pool::new(threads, "test").unwrap();
    let exec = Exec {
        pool: (threads > 1).then_some(&pool),
        threads,
        min_par_work: 0,
    };
    let (k, ff, wt) = (1024, 4096, WeightType::Q8_0);
    let matrix = |seed: u64| {
        let data: Vec<u8> = (0..ff)
            .flat_map(|r| random_row(wt, k, seed * 100_000 + r as u64))
            .collect();
        Matrix::new("w", wt, ff, k, Bytes::Owned(Arc::new(data)))
            .and_then(Matrix::packed)
            .unwrap()
    };
    let (gate, up) = (matrix(1), matrix(2));
    for t in env("INFER_GATE_UP_TOKENS", "32,512").split(',') {
        let t: usize = t.trim().parse().unwrap();
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.1)
            .collect();
        let mut acts = Acts::default();
        let mut down = Acts::default();
        let (mut g, mut u) = (vec![0.0f32; t * ff], vec![0.0f32; t * ff]);
        let reps = (1 << 30) / (2 * ff * k * t) + 1;
        let mut best = [f64::MAX; 2];
        for round in 0..10 {
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                acts.prepare(exec, &x, t, k, [wt]).unwrap();
                if round % 2 == 0 {
                    matmul_combined(exec, &gate, &up, &acts, &x, &mut g, ff, |a, b, h| {
                        h.copy_from_slice(a);
                        silu_mul(h, b);
                    });
                    down.prepare(exec, &g, t, ff, [wt]).unwrap();
                } else {
                    let products = [(&gate, 0, 0, Out::Set), (&up, 1, 0, Out::Set)];
                    let targets =
                        &mut [Target { y: &mut g, ldy: ff }, Target { y: &mut u, ldy: ff }];
                    matmuls(exec, &products, &acts, &x, targets, Blocking::DEFAULT);
                    let u = &u;
                    down.fill_and_prepare(exec, &mut g, t, ff, [wt], |r, row| {
                        silu_mul(row, &u[r * ff..(r + 1) * ff])
                    })
                    .unwrap();
                }
            }
            let b = &mut best[round % 2];
            *b = b.min(t0.elapsed().as_secs_f64() / reps as f64);
        }
        println!(
            "t {t:>5}: side by side {:.2} ms, apart {:.2} ms ({:.3}x)",
            best[0] * 1e3,
            best[1] * 1e3,
            best[1] / best[0]
        );
    }
}
