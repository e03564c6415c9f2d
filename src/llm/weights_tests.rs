use super::*;
use crate::llm::config::Activation;
use crate::status::Code;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh, empty folder under the temp dir, removed on drop.
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(what: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "libinfer-llm-{}-{what}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn small() -> Gpt2Config {
    Gpt2Config {
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        n_inner: 48,
        vocab_size: 40,
        n_positions: 24,
        ..Gpt2Config::default()
    }
}

fn same_weights(a: &Gpt2, b: &Gpt2) {
    assert_eq!(a.config, b.config);
    assert_eq!(a.wpe, b.wpe);
    assert_eq!(a.head.to_f32(), b.head.to_f32());
    assert_eq!(a.ln_f.weight, b.ln_f.weight);
    match (&a.wte, &b.wte) {
        (TokenEmbedding::Tied, TokenEmbedding::Tied) => {}
        (TokenEmbedding::Own(x), TokenEmbedding::Own(y)) => assert_eq!(x.to_f32(), y.to_f32()),
        _ => panic!("tying differs"),
    }
    for (x, y) in a.blocks.iter().zip(&b.blocks) {
        assert_eq!(x.attn.to_f32(), y.attn.to_f32());
        assert_eq!(x.attn_b, y.attn_b);
        assert_eq!(x.attn_proj.to_f32(), y.attn_proj.to_f32());
        assert_eq!(x.fc.to_f32(), y.fc.to_f32());
        assert_eq!(x.fc_b, y.fc_b);
        assert_eq!(x.mlp_proj.to_f32(), y.mlp_proj.to_f32());
        assert_eq!(x.mlp_proj_b, y.mlp_proj_b);
        assert_eq!(x.ln_1.bias, y.ln_1.bias);
        assert_eq!(x.ln_2.weight, y.ln_2.weight);
    }
}

#[test]
fn save_then_load_round_trips() {
    for tied in [true, false] {
        let c = Gpt2Config {
            tie_word_embeddings: tied,
            activation: Activation::GeluErf,
            ..small()
        };
        let m = Gpt2::random(c, 5);
        let dir = TempDir::new("round-trip");
        m.save(&dir.0).unwrap();
        let back = Gpt2::load(&folder(&dir.0)).unwrap();
        same_weights(&m, &back);
    }
    // Deterministic in the seed.
    same_weights(&Gpt2::random(small(), 9), &Gpt2::random(small(), 9));
    assert_ne!(Gpt2::random(small(), 9).wpe, Gpt2::random(small(), 10).wpe);
}

/// Rewrites `dir/model.safetensors` with `edit` applied to its (name, dtype, shape, bytes).
fn rewrite(dir: &Path, edit: impl Fn(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut t: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut t);
    let views: Vec<_> = t
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn saved(what: &str) -> (TempDir, Gpt2) {
    let m = Gpt2::random(small(), 1);
    let dir = TempDir::new(what);
    m.save(&dir.0).unwrap();
    (dir, m)
}

#[test]
fn half_precision_tensors_keep_their_values() {
    let (dir, m) = saved("half");
    let (e, v) = (m.config.n_embd, m.config.vocab_size);
    // wte in F16 and wpe in BF16, with bit patterns of mixed signs and exponents.
    let f16_bits = |i: usize| {
        (0x2c00 + (i * 37) % 0x1800) as u16 | if i.is_multiple_of(3) { 0x8000 } else { 0 }
    };
    let bf16_bits = |i: usize| {
        (0x3c00 + (i * 53) % 0x400) as u16 | if i.is_multiple_of(2) { 0x8000 } else { 0 }
    };
    rewrite(&dir.0, |t| {
        for (name, dtype, _, bytes) in t.iter_mut() {
            let n = bytes.len() / 4;
            if name.ends_with("wte.weight") {
                *dtype = Dtype::F16;
                *bytes = (0..n).flat_map(|i| f16_bits(i).to_le_bytes()).collect();
            } else if name.ends_with("wpe.weight") {
                *dtype = Dtype::BF16;
                *bytes = (0..n).flat_map(|i| bf16_bits(i).to_le_bytes()).collect();
            }
        }
    });
    let back = Gpt2::load(&folder(&dir.0)).unwrap();
    for (i, &x) in back.wpe.iter().enumerate() {
        assert_eq!(
            x,
            f32::from_bits((bf16_bits(i) as u32) << 16),
            "wpe value {i}"
        );
    }
    let head = back.head.to_f32();
    for tok in 0..v {
        for d in 0..e {
            assert_eq!(
                head[tok * e + d],
                half::f16::from_bits(f16_bits(tok * e + d)).to_f32(),
                "wte[{tok}][{d}]"
            );
        }
    }
}

#[test]
fn transformer_prefix_is_optional_and_buffers_are_ignored() {
    let (dir, m) = saved("prefix");
    rewrite(&dir.0, |t| {
        for (name, ..) in t.iter_mut() {
            if let Some(rest) = name.strip_prefix("transformer.") {
                *name = rest.to_string();
            }
        }
        t.push((
            "h.0.attn.bias".into(),
            Dtype::BOOL,
            vec![1, 1, 24, 24],
            vec![1; 576],
        ));
        t.push((
            "h.0.attn.masked_bias".into(),
            Dtype::F32,
            vec![],
            vec![0; 4],
        ));
    });
    same_weights(&m, &Gpt2::load(&folder(&dir.0)).unwrap());
}

fn load_err(dir: &Path) -> Error {
    match Gpt2::load(&folder(dir)) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn missing_files_are_not_found() {
    let dir = TempDir::new("empty");
    let e = load_err(&dir.0);
    assert_eq!(e.code, Code::NotFound, "{e}");
    assert!(e.message.contains("config.json"), "{e}");
    std::fs::write(dir.0.join("config.json"), small().to_json()).unwrap();
    let e = load_err(&dir.0);
    assert_eq!(e.code, Code::NotFound, "{e}");
    assert!(e.message.contains("model.safetensors"), "{e}");
}

#[test]
fn bad_configs_are_refused_with_the_path() {
    let (dir, _) = saved("config");
    let cases = [
        ("{", Code::InvalidArgument, "JSON"),
        (
            r#"{"model_type": "gpt2", "n_layer": 2, "n_embd": 16}"#,
            Code::InvalidArgument,
            "is missing",
        ),
        (r#"{"model_type": "bert"}"#, Code::Unsupported, "model_type"),
    ];
    for (text, code, needle) in cases {
        std::fs::write(dir.0.join("config.json"), text).unwrap();
        let e = load_err(&dir.0);
        assert_eq!(e.code, code, "{e}");
        assert!(
            e.message.contains(needle) && e.message.contains("config.json"),
            "{e}"
        );
    }
    let mut c = serde_json::from_str::<serde_json::Value>(&small().to_json()).unwrap();
    c["activation_function"] = "mish".into();
    std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
    assert_eq!(load_err(&dir.0).code, Code::Unsupported);
    // A layer count the weights do not have is refused before anything is sized by it
    // (10^9 layers once reserved room for them and aborted the process).
    for n in [3u64, 1_000_000_000] {
        let mut c = serde_json::from_str::<serde_json::Value>(&small().to_json()).unwrap();
        c["n_layer"] = n.into();
        std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
        let e = load_err(&dir.0);
        assert_eq!(e.code, Code::InvalidArgument, "{e}");
        let last = format!("h.{}.ln_1.weight", n - 1);
        assert!(
            e.message.contains(&format!("n_layer {n}")) && e.message.contains(&last),
            "{e}"
        );
    }
    c["activation_function"] = "gelu_new".into();
    c["n_head"] = 3.into();
    std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
    let e = load_err(&dir.0);
    assert!(
        e.code == Code::InvalidArgument && e.message.contains("multiple"),
        "{e}"
    );
}

#[test]
fn bad_tensors_are_named() {
    let (dir, _) = saved("tensors");
    rewrite(&dir.0, |t| {
        t.retain(|(n, ..)| n != "transformer.h.1.mlp.c_fc.bias")
    });
    let e = load_err(&dir.0);
    assert_eq!(e.code, Code::InvalidArgument, "{e}");
    assert!(
        e.message
            .contains("transformer.h.1.mlp.c_fc.bias is missing"),
        "{e}"
    );

    let (dir, _) = saved("shape");
    rewrite(&dir.0, |t| {
        for (n, _, shape, _) in t.iter_mut() {
            if n == "transformer.h.0.attn.c_attn.weight" {
                *shape = vec![48, 16];
            }
        }
    });
    let e = load_err(&dir.0);
    assert_eq!(e.code, Code::InvalidArgument, "{e}");
    assert!(
        e.message
            .contains("transformer.h.0.attn.c_attn.weight has shape [48, 16], expected [16, 48]"),
        "{e}"
    );

    let (dir, _) = saved("dtype");
    rewrite(&dir.0, |t| {
        for (n, dtype, ..) in t.iter_mut() {
            if n == "transformer.ln_f.weight" {
                *dtype = Dtype::I32;
            }
        }
    });
    let e = load_err(&dir.0);
    assert_eq!(e.code, Code::Unsupported, "{e}");
    assert!(
        e.message.contains("transformer.ln_f.weight") && e.message.contains("I32"),
        "{e}"
    );

    // An untied model needs its own head.
    let m = Gpt2::random(
        Gpt2Config {
            tie_word_embeddings: false,
            ..small()
        },
        2,
    );
    let dir = TempDir::new("head");
    m.save(&dir.0).unwrap();
    rewrite(&dir.0, |t| t.retain(|(n, ..)| n != "lm_head.weight"));
    let e = load_err(&dir.0);
    assert!(
        e.code == Code::InvalidArgument && e.message.contains("lm_head.weight is missing"),
        "{e}"
    );

    // Not a safetensors file at all.
    std::fs::write(dir.0.join("model.safetensors"), b"\x05\0\0\0\0\0\0\0{}").unwrap();
    let e = load_err(&dir.0);
    assert!(
        e.code == Code::InvalidArgument && e.message.contains("safetensors"),
        "{e}"
    );
}

/// A test folder as the server opens one.
fn folder(p: &std::path::Path) -> crate::folder::Folder {
    crate::folder::Folder::root(p, false, "test").unwrap()
}
