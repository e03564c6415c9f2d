//! Llama-family decoders against an independent reference.
//!
//! `scripts/make_llama.py make` (run by scripts/test.sh with the pinned Python packages)
//! writes random-weight Llama and Qwen2 models as Hugging Face folders and as GGUF files
//! in every supported weight type; `make_llama.py reference` runs a numpy forward pass
//! written from the Hugging Face model definitions (GGUF files through gguf-py's own
//! dequantization) and writes `ref-<folder>.json`: the prompt's logits at every position,
//! the greedy continuation and the logits of each greedy step.
//!
//! For every model file under `INFER_LLAMA_MODELS_DIR` (without it the test passes with
//! a skip notice), this test loads it, runs the prompt in one step and the continuation
//! one token per step (the decode path), and checks the logits against the reference of
//! the same weights (quantized files: the reference on their dequantized weights) and
//! the greedy tokens: equal for float weights; for quantized weights, equal wherever
//! the reference's top-2 margin exceeds the stated logit tolerance (libinfer quantizes
//! activations to 8 bits as llama.cpp does, so near-ties may break the other way).
//!
//! Run: `INFER_LLAMA_MODELS_DIR=DIR cargo test --release --test llama -- --nocapture`.

use infer::llm::{KvCache, KvType, Llama, LlamaRunner, Logits, StepSeq};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

const DIR_ENV: &str = "INFER_LLAMA_MODELS_DIR";

/// Largest |got - want| / max(1, |want|).
fn worst(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0))
        .fold(0.0, f64::max)
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

struct Outcome {
    prompt_worst: f64,
    step_worst: f64,
    tokens: Vec<u32>,
}

/// The prompt in one step, then the reference's greedy tokens fed back one per step.
fn run(model: Arc<Llama>, kv_type: KvType, threads: usize, reference: &Value) -> Outcome {
    let v = model.config.vocab_size;
    let shape = model.config.kv_shape(kv_type);
    let mut runner = LlamaRunner::new(model, threads).unwrap();
    let mut kv = KvCache::new(shape, 16, 8).unwrap();
    let blocks: Vec<u32> = (0..8).collect();
    let prompt = ids(&reference["prompt"]);
    let greedy = ids(&reference["greedy"]);
    let mut logits = Vec::new();
    runner
        .step(
            &mut kv,
            &[StepSeq {
                tokens: &prompt,
                start: 0,
                blocks: &blocks,
                logits: Logits::All,
            }],
            &mut logits,
        )
        .unwrap();
    let all = reference["logits_all"].as_array().unwrap();
    let mut prompt_worst = 0.0f64;
    for (p, want) in all.iter().enumerate() {
        prompt_worst = prompt_worst.max(worst(&logits[p * v..(p + 1) * v], &floats(want)));
    }
    let mut tokens = vec![argmax(&logits[(prompt.len() - 1) * v..])];
    let mut step_worst = 0.0f64;
    let steps = reference["logits_greedy"].as_array().unwrap();
    for (i, want) in steps.iter().enumerate() {
        // Feed the reference's token so that later steps compare like with like.
        let tok = [greedy[i]];
        let s = StepSeq {
            tokens: &tok,
            start: prompt.len() + i,
            blocks: &blocks,
            logits: Logits::Last,
        };
        runner.step(&mut kv, &[s], &mut logits).unwrap();
        step_worst = step_worst.max(worst(&logits, &floats(want)));
        tokens.push(argmax(&logits));
    }
    Outcome {
        prompt_worst,
        step_worst,
        tokens,
    }
}

#[test]
fn every_file_matches_the_reference() {
    let Ok(root) = std::env::var(DIR_ENV) else {
        eprintln!(
            "skipped: set {DIR_ENV} (scripts/test.sh does) to run the Llama reference checks"
        );
        return;
    };
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no model folders under {root}");
    let mut checked = 0;
    for dir in dirs {
        let manifest: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap())
                .unwrap();
        let mut files: Vec<(String, String, String)> = manifest["files"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(f, m)| {
                (
                    f.clone(),
                    m["reference_hf"].as_str().unwrap().to_string(),
                    m["weights"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        files.push(("hf".into(), "hf".into(), "f32".into()));
        files.sort();
        for (file, reference, weights) in files {
            let reference: Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join(format!("ref-{reference}.json"))).unwrap(),
            )
            .unwrap();
            let path = dir.join(&file);
            let model = Arc::new(if file.ends_with(".gguf") {
                Llama::load_gguf(&path).unwrap()
            } else {
                Llama::load(&folder(&path)).unwrap()
            });
            let quantized = !matches!(weights.as_str(), "f32" | "f16" | "bf16");
            if quantized {
                // The file's blocks decode to exactly the reference's weights: the
                // dequantized model matches as closely as a float file does.
                let exact = run(
                    Arc::new(model.dequantized().unwrap()),
                    KvType::F32,
                    1,
                    &reference,
                );
                let name = format!("{}/{file} dequantized", dir.display());
                println!(
                    "{name}: prompt logits within {:.1e}, decode logits within {:.1e}",
                    exact.prompt_worst, exact.step_worst
                );
                assert!(
                    exact.prompt_worst <= 1e-4 && exact.step_worst <= 1e-4,
                    "{name}"
                );
                assert_eq!(
                    exact.tokens,
                    ids(&reference["greedy"]),
                    "{name}: greedy tokens"
                );
            }
            // Quantized rows meet 8-bit activations (as in llama.cpp): a stated looser
            // bound on logits of standard deviation about 1.
            let tolerance: f64 = if quantized { 0.25 } else { 1e-4 };
            for (kv_type, threads) in [(KvType::F32, 1), (KvType::F16, 2)] {
                let out = run(Arc::clone(&model), kv_type, threads, &reference);
                let name = format!(
                    "{}/{file} (KV {kv_type:?}, {threads} threads)",
                    dir.display()
                );
                // An F16 cache rounds K and V: a stated looser bound.
                let tol = if kv_type == KvType::F16 {
                    tolerance.max(1e-2)
                } else {
                    tolerance
                };
                // Greedy tokens must agree wherever the reference's choice is clear.
                let clear = if quantized { 0.5 } else { 2.0 * tol };
                println!(
                    "{name}: prompt logits within {:.1e}, decode logits within {:.1e}",
                    out.prompt_worst, out.step_worst
                );
                assert!(
                    out.prompt_worst <= tol,
                    "{name}: prompt logits off by {}",
                    out.prompt_worst
                );
                assert!(
                    out.step_worst <= tol,
                    "{name}: decode logits off by {}",
                    out.step_worst
                );
                let greedy = ids(&reference["greedy"]);
                let margins = floats(&reference["greedy_margins"]);
                for (i, (&got, &want)) in out.tokens.iter().zip(&greedy).enumerate() {
                    if margins[i] > clear || (!quantized && kv_type == KvType::F32) {
                        assert_eq!(
                            got, want,
                            "{name}: greedy token {i} (margin {})",
                            margins[i]
                        );
                    }
                }
                checked += 1;
            }
        }
    }
    println!("{checked} model runs matched the reference");
}

fn folder(p: &Path) -> infer::folder::Folder {
    infer::folder::Folder::root(p, false, "model").unwrap()
}

/// The tokenizers libinfer builds (from `tokenizer.json`, and from each GGUF file's
/// embedded vocabulary) give the ids the `tokenizers` package gives for the texts of
/// `text-cases.json`, decode them back, and render the chat template as jinja2 does.
#[test]
fn tokenizers_and_chat_templates_match_the_reference() {
    use infer::llm::{TextCodec, TextSource};
    let Ok(root) = std::env::var(DIR_ENV) else {
        eprintln!("skipped: set {DIR_ENV} (scripts/test.sh does)");
        return;
    };
    let mut checked = 0;
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("text-cases.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no text-cases.json under {root}");
    for dir in dirs {
        let cases: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("text-cases.json")).unwrap())
                .unwrap();
        let manifest: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap())
                .unwrap();
        // A SentencePiece model's Hugging Face folder holds tokenizer.model, which is not
        // read (only its GGUF files carry the vocabulary libinfer reads).
        let mut sources: Vec<(String, TextSource)> = Vec::new();
        if manifest["vocab"] != "spm" {
            sources.push((
                "hf".into(),
                TextCodec::load(&folder(&dir.join("hf"))).unwrap(),
            ));
        }
        for f in manifest["files"].as_object().unwrap().keys() {
            sources.push((f.clone(), TextCodec::load_gguf(&dir.join(f)).unwrap()));
        }
        for (name, src) in sources {
            let at = format!("{}/{name}", dir.display());
            let codec = match src {
                TextSource::Ready(c) => c,
                TextSource::Missing(why) => panic!("{at}: no tokenizer: {why}"),
            };
            for case in cases["cases"].as_array().unwrap() {
                let text = case["text"].as_str().unwrap();
                assert_eq!(
                    codec.encode(text, true).unwrap(),
                    ids(&case["ids"]),
                    "{at}: {text:?} with special tokens"
                );
                let plain = ids(&case["ids_plain"]);
                assert_eq!(codec.encode(text, false).unwrap(), plain, "{at}: {text:?}");
                if case["round_trip"] != false {
                    assert_eq!(codec.decode(&plain, false), text, "{at}: decoding {text:?}");
                }
            }
            let chat = &cases["chat"];
            let rendered = codec.apply_chat_template(&chat["messages"]).unwrap();
            assert_eq!(rendered, chat["rendered"].as_str().unwrap(), "{at}: chat");
            assert_eq!(
                codec.encode(&rendered, false).unwrap(),
                ids(&chat["ids"]),
                "{at}: chat ids"
            );
            // A GGUF file's end-of-turn token ends generation, as in llama.cpp.
            if name.ends_with(".gguf") && manifest["vocab"] != "spm" {
                let turn_end = ids(&chat["ids"])
                    .into_iter()
                    .find(|&t| {
                        codec.decode(&[t], false).contains("<|eot_id|>")
                            || codec.decode(&[t], false).contains("<|im_end|>")
                    })
                    .unwrap();
                assert!(
                    codec.eos_ids.contains(&turn_end),
                    "{at}: {:?}",
                    codec.eos_ids
                );
            }
            checked += 1;
        }
    }
    println!("{checked} tokenizers matched the reference");
}
