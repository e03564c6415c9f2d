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
        // Values that size tables or make the rotary frequencies NaN are refused before
        // anything is computed from them.
        (
            "head_dim",
            serde_json::json!(1u64 << 20),
            Code::InvalidArgument,
            "head size",
        ),
        (
            "partial_rotary_factor",
            serde_json::json!(1e30),
            Code::InvalidArgument,
            "partial_rotary_factor",
        ),
        (
            "rope_theta",
            serde_json::json!(-1.0),
            Code::InvalidArgument,
            "rope_theta",
        ),
        (
            "rope_theta",
            serde_json::json!(0.0),
            Code::InvalidArgument,
            "rope_theta",
        ),
        // Fewer than one rotary pair per head (once a panic in every step).
        (
            "partial_rotary_factor",
            serde_json::json!(1e-300),
            Code::InvalidArgument,
            "0 rotary dimensions",
        ),
        // Values of the wrong kind are refused, not replaced by defaults.
        (
            "rms_norm_eps",
            serde_json::json!("x"),
            Code::InvalidArgument,
            "rms_norm_eps \"x\" is not a number",
        ),
        (
            "rope_theta",
            serde_json::json!("1e4"),
            Code::InvalidArgument,
            "rope_theta",
        ),
        // A token id past 32 bits (once truncated to token 0, which then ended every
        // generation).
        (
            "eos_token_id",
            serde_json::json!(1u64 << 32),
            Code::InvalidArgument,
            "eos_token_id 4294967296",
        ),
        (
            "bos_token_id",
            serde_json::json!(-1),
            Code::InvalidArgument,
            "bos_token_id -1",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "linear", "factor": 0.0}),
            Code::InvalidArgument,
            "rope_scaling.factor",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0,
                "high_freq_factor": 0.0, "original_max_position_embeddings": 8192}),
            Code::InvalidArgument,
            "high_freq_factor above",
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
    j["sliding_window"] = serde_json::json!("32");
    let e = LlamaConfig::from_hf_json(&j.to_string()).unwrap_err();
    assert!(e.message.contains("sliding_window"), "{e}");
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

type GgufTensor = (&'static str, Vec<u64>, u32, Vec<u8>);

/// A one-layer Llama GGUF of F32 weights (width 32, 2 heads of 16 sharing one key/value
/// head, MLP width 64, 40 tokens): its metadata and tensors, as `gguf::tests::write`
/// takes them.
fn tiny_gguf() -> (
    Vec<(&'static str, crate::llm::gguf::Value)>,
    Vec<GgufTensor>,
) {
    use crate::llm::gguf::Value;
    let (e, ff, vocab, hd) = (32u64, 64u64, 40u64, 16u64);
    let t = |name: &'static str, dims: Vec<u64>| -> GgufTensor {
        let n: u64 = dims.iter().product();
        let v = (0..n)
            .flat_map(|i| (((i * 7919) % 61) as f32 / 61.0 - 0.5).to_le_bytes())
            .collect();
        (name, dims, 0, v)
    };
    let tensors = vec![
        t("token_embd.weight", vec![e, vocab]),
        t("blk.0.attn_norm.weight", vec![e]),
        t("blk.0.attn_q.weight", vec![e, 2 * hd]),
        t("blk.0.attn_k.weight", vec![e, hd]),
        t("blk.0.attn_v.weight", vec![e, hd]),
        t("blk.0.attn_output.weight", vec![2 * hd, e]),
        t("blk.0.ffn_norm.weight", vec![e]),
        t("blk.0.ffn_gate.weight", vec![e, ff]),
        t("blk.0.ffn_up.weight", vec![e, ff]),
        t("blk.0.ffn_down.weight", vec![ff, e]),
        t("output_norm.weight", vec![e]),
        t("output.weight", vec![e, vocab]),
    ];
    let meta = vec![
        ("general.architecture", Value::Str("llama".into())),
        ("llama.block_count", Value::UInt(1)),
        ("llama.context_length", Value::UInt(64)),
        ("llama.embedding_length", Value::UInt(e)),
        ("llama.feed_forward_length", Value::UInt(ff)),
        ("llama.attention.head_count", Value::UInt(2)),
        ("llama.attention.head_count_kv", Value::UInt(1)),
        ("llama.attention.key_length", Value::UInt(hd)),
        ("llama.attention.value_length", Value::UInt(hd)),
        ("llama.rope.freq_base", Value::Float(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::Float(1e-5)),
    ];
    (meta, tensors)
}

/// A GGUF file's metadata is untrusted: a layer count, head size or rotary base out of
/// range is INVALID_ARGUMENT naming it, before anything is sized or computed from it
/// (a layer count of 2^32 - 1 once reserved room for that many layers and aborted the
/// process; a rotary base of 0 gave NaN logits).
#[test]
fn gguf_metadata_out_of_range_is_refused() {
    use crate::llm::gguf::{tests::write, Value};
    let dir = std::env::temp_dir().join(format!("infer-llama-meta-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("m.gguf");
    let (base, tensors) = tiny_gguf();
    let meta = |changed: &[(&'static str, Value)], dropped: &[&str]| {
        let mut m = base.clone();
        m.retain(|(k, _)| !dropped.contains(k) && !changed.iter().any(|(c, _)| c == k));
        m.extend(changed.iter().cloned());
        m
    };
    write(&p, &meta(&[], &[]), &tensors);
    let m = Llama::load_gguf(&p).unwrap();
    assert_eq!((m.config.n_layer, m.config.head_dim), (1, 16));
    let no_value_length = ["llama.attention.value_length"];
    for (changed, dropped, words) in [
        (
            vec![("llama.block_count", Value::UInt(u32::MAX as u64))],
            &[][..],
            &["4294967295 layers", "blk.4294967294.attn_norm.weight"][..],
        ),
        (
            vec![("llama.block_count", Value::UInt(2))],
            &[],
            &["2 layers", "blk.1.attn_norm.weight"],
        ),
        (
            vec![("llama.attention.key_length", Value::UInt(1 << 31))],
            &no_value_length,
            &["head size of 2147483648"],
        ),
        (
            vec![("llama.rope.dimension_count", Value::UInt(1 << 31))],
            &[],
            &["2147483648 rotary dimensions"],
        ),
        (
            vec![("llama.rope.freq_base", Value::Float(0.0))],
            &[],
            &["llama.rope.freq_base 0"],
        ),
        (
            vec![("llama.rope.freq_base", Value::Float(f64::NAN))],
            &[],
            &["llama.rope.freq_base NaN"],
        ),
        (
            vec![
                ("llama.rope.scaling.type", Value::Str("linear".into())),
                ("llama.rope.scaling.factor", Value::Float(-2.0)),
            ],
            &[],
            &["llama.rope.scaling.factor -2"],
        ),
    ] {
        write(&p, &meta(&changed, dropped), &tensors);
        let err = Llama::load_gguf(&p)
            .err()
            .expect("out-of-range metadata must be refused");
        assert_eq!(err.code, Code::InvalidArgument, "{err}");
        for w in words {
            assert!(err.message.contains(w), "{w}: {err}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every number in a small GGUF file's metadata and tensor table set to values at and
/// past the edges (0, 1, 2^31 - 1, 2^64 - 1, NaN, ...; each tensor's dimensions, type
/// and offset): each file is refused as INVALID_ARGUMENT or UNSUPPORTED, or loads and
/// gives finite logits. Nothing panics, aborts or computes from another tensor's bytes.
#[test]
fn damaged_gguf_numbers_are_refused_or_harmless() {
    use crate::llm::gguf::{tests::info_at, tests::write, Value};
    let dir = std::env::temp_dir().join(format!("infer-llama-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("m.gguf");
    let (meta, tensors) = tiny_gguf();
    write(&p, &meta, &tensors);
    let good = std::fs::read(&p).unwrap();
    let mut outcomes = [0usize; 2];
    let mut check = |what: String, file: &[u8]| {
        std::fs::write(&p, file).unwrap();
        match Llama::load_gguf(&p) {
            Err(e) => {
                assert!(
                    matches!(e.code, Code::InvalidArgument | Code::Unsupported),
                    "{what}: {e}"
                );
                outcomes[0] += 1;
            }
            Ok(m) => {
                let m = Arc::new(m);
                let shape = m.config.kv_shape(KvType::F32);
                let mut kv = KvCache::new(shape, 8, 2).unwrap();
                let s = StepSeq {
                    tokens: &[2, 3, 4],
                    start: 0,
                    blocks: &[0, 1],
                    logits: Logits::All,
                };
                let mut logits = Vec::new();
                match runner(&m, 1).step(&mut kv, &[s], &mut logits) {
                    // A context too short for the prompt (the server refuses it at enqueue).
                    Err(e) => assert_eq!(e.code, Code::InvalidArgument, "{what}: {e}"),
                    Ok(()) => assert!(
                        logits.iter().all(|x| x.is_finite()),
                        "{what}: logits not finite"
                    ),
                }
                outcomes[1] += 1;
            }
        }
    };
    let ints = [0u64, 1, 3, 255, (1 << 31) - 1, u32::MAX as u64, u64::MAX];
    let floats = [0.0, -1.0, f64::NAN, f64::INFINITY, 1e30, 1e-30];
    for (i, (k, v)) in meta.iter().enumerate() {
        let values: Vec<Value> = match v {
            Value::UInt(_) => ints.iter().map(|&x| Value::UInt(x)).collect(),
            Value::Float(_) => floats.iter().map(|&x| Value::Float(x)).collect(),
            _ => vec![Value::Str("qwen3".into()), Value::UInt(1)],
        };
        for v in values {
            let mut m = meta.clone();
            m[i].1 = v.clone();
            write(&p, &m, &tensors);
            let f = std::fs::read(&p).unwrap();
            check(format!("{k} = {v:?}"), &f);
        }
    }
    for (name, dims, _, _) in &tensors {
        let at = info_at(&good, name, dims.len());
        for d in 0..dims.len() {
            for v in [0u64, 1, 2, 1 << 20, 1 << 40, u64::MAX] {
                let mut f = good.clone();
                let o = at - 8 * (dims.len() - d);
                f[o..o + 8].copy_from_slice(&v.to_le_bytes());
                check(format!("{name} dim {d} = {v}"), &f);
            }
        }
        for t in [1u32, 2, 6, 8, 12, 14, 30, 99, u32::MAX] {
            let mut f = good.clone();
            f[at..at + 4].copy_from_slice(&t.to_le_bytes());
            check(format!("{name} type {t}"), &f);
        }
        for off in [1u64, 32, 1 << 40, u64::MAX - 31] {
            let mut f = good.clone();
            f[at + 4..at + 12].copy_from_slice(&off.to_le_bytes());
            check(format!("{name} offset {off}"), &f);
        }
    }
    // Most are refused; some (a larger context, another epsilon) are models still.
    assert!(outcomes[0] > 200 && outcomes[1] > 5, "{outcomes:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
