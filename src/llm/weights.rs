//! A GPT-2 model's parameters: loading them from a Hugging Face folder (`config.json` +
//! `model.safetensors`), drawing random ones, and saving them back.
//!
//! Matrices are stored `[out][in]` (transposed once, at load, from Hugging Face's Conv1D
//! `[in][out]`) in the file's type (F32, F16 or BF16), which is what the row dot-product
//! kernels of `linear` read without repacking; this module never runs the model.

use super::config::Gpt2Config;
use super::linear::{Bytes, Matrix};
use super::quant::WeightType;
use super::sampling::Rng;
use crate::folder::Folder;
use crate::status::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// A layer norm's gain and bias, `[n_embd]` each.
pub(crate) struct Norm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// One transformer block. Matrices are `[out][in]`.
pub(crate) struct Block {
    pub ln_1: Norm,
    /// `[3 n_embd][n_embd]`: q, k, v.
    pub attn: Matrix,
    pub attn_b: Vec<f32>,
    /// `[n_embd][n_embd]`.
    pub attn_proj: Matrix,
    pub attn_proj_b: Vec<f32>,
    pub ln_2: Norm,
    /// `[n_inner][n_embd]`.
    pub fc: Matrix,
    pub fc_b: Vec<f32>,
    /// `[n_embd][n_inner]`.
    pub mlp_proj: Matrix,
    pub mlp_proj_b: Vec<f32>,
}

/// Where token embeddings are read from.
pub(crate) enum TokenEmbedding {
    /// `[vocab][n_embd]`, the model's own (its LM head is separate).
    Own(Matrix),
    /// Tied to the LM head: row `token` of `head`.
    Tied,
}

/// A GPT-2 language model (`GPT2LMHeadModel`).
pub struct Gpt2 {
    pub config: Gpt2Config,
    pub(crate) wte: TokenEmbedding,
    /// `[n_positions][n_embd]`.
    pub(crate) wpe: Vec<f32>,
    pub(crate) blocks: Vec<Block>,
    pub(crate) ln_f: Norm,
    /// The LM head, `[vocab][n_embd]`.
    pub(crate) head: Matrix,
}

impl Gpt2 {
    /// Reads `<dir>/config.json` (Hugging Face GPT-2 fields) and `<dir>/model.safetensors`
    /// (F32, F16 or BF16 tensors, with or without the `transformer.` prefix).
    pub fn load(dir: &Folder) -> Result<Gpt2> {
        let config_path = dir.path().join("config.json");
        let text = String::from_utf8(dir.read("config.json", "GPT-2 config")?)
            .map_err(|_| Error::invalid(format!("{}: not UTF-8 text", config_path.display())))?;
        let config = Gpt2Config::from_json(&text).map_err(|e| e.context(config_path.display()))?;
        let weights_path = dir.path().join("model.safetensors");
        let bytes = dir.read("model.safetensors", "GPT-2 weights")?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| {
            Error::invalid(format!(
                "{}: not a valid safetensors file: {e}",
                weights_path.display()
            ))
        })?;
        Gpt2::from_tensors(config, &Tensors(st)).map_err(|e| e.context(weights_path.display()))
    }

    fn from_tensors(c: Gpt2Config, t: &Tensors<'_>) -> Result<Gpt2> {
        let (e, i, v) = (c.n_embd, c.n_inner, c.vocab_size);
        let norm = |name: &str| -> Result<Norm> {
            Ok(Norm {
                weight: t.get(&format!("{name}.weight"), &[e])?,
                bias: t.get(&format!("{name}.bias"), &[e])?,
            })
        };
        // The last block's first tensor, before anything is sized by the layer count.
        let last = format!("h.{}.ln_1.weight", c.n_layer - 1);
        t.get(&last, &[e]).map_err(|err| {
            Error::invalid(format!(
                "GPT-2 config: n_layer {}, but the weights do not hold {last}: {}",
                c.n_layer, err.message
            ))
        })?;
        let mut blocks = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let p = format!("h.{l}");
            blocks.push(Block {
                ln_1: norm(&format!("{p}.ln_1"))?,
                attn: t.conv1d(&format!("{p}.attn.c_attn.weight"), e, 3 * e)?,
                attn_b: t.get(&format!("{p}.attn.c_attn.bias"), &[3 * e])?,
                attn_proj: t.conv1d(&format!("{p}.attn.c_proj.weight"), e, e)?,
                attn_proj_b: t.get(&format!("{p}.attn.c_proj.bias"), &[e])?,
                ln_2: norm(&format!("{p}.ln_2"))?,
                fc: t.conv1d(&format!("{p}.mlp.c_fc.weight"), e, i)?,
                fc_b: t.get(&format!("{p}.mlp.c_fc.bias"), &[i])?,
                mlp_proj: t.conv1d(&format!("{p}.mlp.c_proj.weight"), i, e)?,
                mlp_proj_b: t.get(&format!("{p}.mlp.c_proj.bias"), &[e])?,
            });
        }
        let wte = t.rows("wte.weight", v, e)?;
        // Like transformers: a tied model uses the embedding whatever lm_head.weight holds.
        let (wte, head) = if c.tie_word_embeddings {
            (TokenEmbedding::Tied, wte)
        } else {
            let head = t.rows("lm_head.weight", v, e)?;
            (TokenEmbedding::Own(wte), head)
        };
        Ok(Gpt2 {
            wte,
            wpe: t.get("wpe.weight", &[c.n_positions, e])?,
            blocks,
            ln_f: norm("ln_f")?,
            head,
            config: c,
        })
    }

    /// Random weights (for benchmarks and tests), deterministic in `seed`: matrices and
    /// embeddings uniform with standard deviation 0.02 (Hugging Face's initializer
    /// range), layer-norm gains around 1, small biases. The config should pass
    /// [`Gpt2Config::validate`]; `Runner::new` refuses one that does not.
    pub fn random(config: Gpt2Config, seed: u64) -> Gpt2 {
        // Drawn in Conv1D order, `[in][out]`, then stored `[out][in]`.
        let m = |name: &str, w: Vec<f32>, rows_in: usize, cols_out: usize| -> Matrix {
            let t = transpose(&w, rows_in, cols_out);
            // The sizes agree by construction; a config too large to allocate aborts as
            // any allocation does.
            Matrix::from_f32(name, cols_out, rows_in, &t).expect("sizes agree")
        };
        let c = config;
        let (e, i, v) = (c.n_embd, c.n_inner, c.vocab_size);
        let mut rng = Rng::new(seed);
        let mut draw = |n: usize, mean: f32, std: f32| -> Vec<f32> {
            // Uniform on [-sqrt(3) std, sqrt(3) std] has standard deviation `std`.
            let half = std * 3f32.sqrt();
            (0..n)
                .map(|_| mean + (rng.next_f64() as f32 * 2.0 - 1.0) * half)
                .collect()
        };
        let norm = |draw: &mut dyn FnMut(usize, f32, f32) -> Vec<f32>| Norm {
            weight: draw(e, 1.0, 0.02),
            bias: draw(e, 0.0, 0.02),
        };
        let mut blocks = Vec::with_capacity(c.n_layer);
        for _ in 0..c.n_layer {
            let ln_1 = norm(&mut draw);
            let attn = m("attn.c_attn.weight", draw(e * 3 * e, 0.0, 0.02), e, 3 * e);
            let attn_b = draw(3 * e, 0.0, 0.02);
            let attn_proj = m("attn.c_proj.weight", draw(e * e, 0.0, 0.02), e, e);
            let attn_proj_b = draw(e, 0.0, 0.02);
            let ln_2 = norm(&mut draw);
            let fc = m("mlp.c_fc.weight", draw(e * i, 0.0, 0.02), e, i);
            let fc_b = draw(i, 0.0, 0.02);
            let mlp_proj = m("mlp.c_proj.weight", draw(i * e, 0.0, 0.02), i, e);
            let mlp_proj_b = draw(e, 0.0, 0.02);
            blocks.push(Block {
                ln_1,
                attn,
                attn_b,
                attn_proj,
                attn_proj_b,
                ln_2,
                fc,
                fc_b,
                mlp_proj,
                mlp_proj_b,
            });
        }
        let wpe = draw(c.n_positions * e, 0.0, 0.02);
        let ln_f = norm(&mut draw);
        // The head was drawn `[n_embd][vocab]`.
        let head = m("lm_head.weight", draw(e * v, 0.0, 0.02), e, v);
        let wte = if c.tie_word_embeddings {
            TokenEmbedding::Tied
        } else {
            let w = draw(v * e, 0.0, 0.02);
            TokenEmbedding::Own(Matrix::from_f32("wte.weight", v, e, &w).expect("sizes agree"))
        };
        Gpt2 {
            config: c,
            wte,
            wpe,
            blocks,
            ln_f,
            head,
        }
    }

    /// Writes `config.json` and `model.safetensors` (F32, Hugging Face's tensor names) to
    /// `dir`, creating it if needed.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let c = &self.config;
        let (e, v) = (c.n_embd, c.vocab_size);
        std::fs::create_dir_all(dir)
            .map_err(|err| Error::invalid(format!("cannot create {}: {err}", dir.display())))?;
        let head = self.head.to_f32();
        let own = match &self.wte {
            TokenEmbedding::Own(w) => Some(w.to_f32()),
            TokenEmbedding::Tied => None,
        };
        let wte: &[f32] = own.as_deref().unwrap_or(&head);
        // Conv1D layout, `[in][out]`.
        let conv = |m: &Matrix| transpose(&m.to_f32(), m.rows, m.cols);
        let mats: Vec<[Vec<f32>; 4]> = self
            .blocks
            .iter()
            .map(|b| {
                [
                    conv(&b.attn),
                    conv(&b.attn_proj),
                    conv(&b.fc),
                    conv(&b.mlp_proj),
                ]
            })
            .collect();
        let mut tensors: Vec<(String, Vec<usize>, &[f32])> = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, data| {
            let name = if name.starts_with("lm_head.") {
                name
            } else {
                format!("transformer.{name}")
            };
            tensors.push((name, shape, data));
        };
        add("wte.weight".into(), vec![v, e], wte);
        add("wpe.weight".into(), vec![c.n_positions, e], &self.wpe);
        for (l, (b, [attn, attn_proj, fc, mlp_proj])) in self.blocks.iter().zip(&mats).enumerate() {
            let p = format!("h.{l}");
            add(format!("{p}.ln_1.weight"), vec![e], &b.ln_1.weight);
            add(format!("{p}.ln_1.bias"), vec![e], &b.ln_1.bias);
            add(format!("{p}.attn.c_attn.weight"), vec![e, 3 * e], attn);
            add(format!("{p}.attn.c_attn.bias"), vec![3 * e], &b.attn_b);
            add(format!("{p}.attn.c_proj.weight"), vec![e, e], attn_proj);
            add(format!("{p}.attn.c_proj.bias"), vec![e], &b.attn_proj_b);
            add(format!("{p}.ln_2.weight"), vec![e], &b.ln_2.weight);
            add(format!("{p}.ln_2.bias"), vec![e], &b.ln_2.bias);
            add(format!("{p}.mlp.c_fc.weight"), vec![e, c.n_inner], fc);
            add(format!("{p}.mlp.c_fc.bias"), vec![c.n_inner], &b.fc_b);
            add(
                format!("{p}.mlp.c_proj.weight"),
                vec![c.n_inner, e],
                mlp_proj,
            );
            add(format!("{p}.mlp.c_proj.bias"), vec![e], &b.mlp_proj_b);
        }
        add("ln_f.weight".into(), vec![e], &self.ln_f.weight);
        add("ln_f.bias".into(), vec![e], &self.ln_f.bias);
        if let TokenEmbedding::Own(_) = self.wte {
            add("lm_head.weight".into(), vec![v, e], &head);
        }
        let bytes: Vec<Cow<'_, [u8]>> = tensors.iter().map(|(_, _, d)| le_bytes(d)).collect();
        let mut views = Vec::with_capacity(tensors.len());
        for ((name, shape, _), data) in tensors.iter().zip(&bytes) {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), data)
                .map_err(|err| Error::internal(format!("tensor {name}: {err}")))?;
            views.push((name.clone(), view));
        }
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let path = dir.join("model.safetensors");
        safetensors::serialize_to_file(views, Some(meta), &path)
            .map_err(|err| Error::invalid(format!("cannot write {}: {err}", path.display())))?;
        let config_path = dir.join("config.json");
        std::fs::write(&config_path, c.to_json())
            .map_err(|err| Error::invalid(format!("cannot write {}: {err}", config_path.display())))
    }

    /// Checks that every weight has the size `config` implies (the config is public and
    /// could have been changed after loading): INVALID_ARGUMENT naming the first that
    /// does not.
    pub(crate) fn check_shapes(&self) -> Result<()> {
        let c = &self.config;
        let (e, i, v) = (c.n_embd, c.n_inner, c.vocab_size);
        let dims = |m: &Matrix| (m.rows, m.cols);
        let mut want: Vec<(&str, usize, usize)> = vec![
            ("wpe", self.wpe.len(), c.n_positions * e),
            ("ln_f.weight", self.ln_f.weight.len(), e),
            ("ln_f.bias", self.ln_f.bias.len(), e),
            ("layers", self.blocks.len(), c.n_layer),
        ];
        /// A matrix's name, its (rows, cols) and the config's.
        type Dims<'a> = (&'a str, (usize, usize), (usize, usize));
        let mut mats: Vec<Dims<'_>> = vec![("lm head", dims(&self.head), (v, e))];
        if let TokenEmbedding::Own(w) = &self.wte {
            mats.push(("wte", dims(w), (v, e)));
        }
        for b in &self.blocks {
            want.extend([
                ("ln_1", b.ln_1.weight.len() + b.ln_1.bias.len(), 2 * e),
                ("ln_2", b.ln_2.weight.len() + b.ln_2.bias.len(), 2 * e),
                ("attn.c_attn.bias", b.attn_b.len(), 3 * e),
                ("attn.c_proj.bias", b.attn_proj_b.len(), e),
                ("mlp.c_fc.bias", b.fc_b.len(), i),
                ("mlp.c_proj.bias", b.mlp_proj_b.len(), e),
            ]);
            mats.extend([
                ("attn.c_attn.weight", dims(&b.attn), (3 * e, e)),
                ("attn.c_proj.weight", dims(&b.attn_proj), (e, e)),
                ("mlp.c_fc.weight", dims(&b.fc), (i, e)),
                ("mlp.c_proj.weight", dims(&b.mlp_proj), (e, i)),
            ]);
        }
        if let Some((name, got, need)) = mats.into_iter().find(|(_, got, need)| got != need) {
            return Err(Error::invalid(format!(
                "GPT-2 weights do not match the config: {name} is {} x {}, the config needs {} x {}",
                got.0, got.1, need.0, need.1
            )));
        }
        match want.into_iter().find(|&(_, got, want)| got != want) {
            Some((name, got, want)) => Err(Error::invalid(format!(
                "GPT-2 weights do not match the config: {name} holds {got} values, the config needs {want}"
            ))),
            None => Ok(()),
        }
    }

    /// Writes the input embedding of `token` at `pos` (token + position) to `out`.
    #[inline]
    pub(crate) fn embed(&self, token: usize, pos: usize, out: &mut [f32]) {
        let e = self.config.n_embd;
        let wpe = &self.wpe[pos * e..(pos + 1) * e];
        match &self.wte {
            TokenEmbedding::Own(w) => w.row_f32(token, out),
            TokenEmbedding::Tied => self.head.row_f32(token, out),
        }
        for (o, &p) in out.iter_mut().zip(wpe) {
            *o += p;
        }
    }
}

/// The tensors of a safetensors file, found by Hugging Face name.
struct Tensors<'a>(SafeTensors<'a>);

impl<'a> Tensors<'a> {
    /// The tensor `name` (tried with and without `transformer.`), checked to have
    /// `shape`, with its element type and bytes.
    fn raw(&self, name: &str, shape: &[usize]) -> Result<(String, WeightType, &'a [u8])> {
        let full = if name.starts_with("lm_head.") {
            name.to_string()
        } else {
            format!("transformer.{name}")
        };
        let (found, view) = match self.0.tensor(&full) {
            Ok(v) => (full, v),
            Err(_) => match self.0.tensor(name) {
                Ok(v) => (name.to_string(), v),
                Err(_) => return Err(Error::invalid(format!("tensor {full} is missing"))),
            },
        };
        if view.shape() != shape {
            return Err(Error::invalid(format!(
                "tensor {found} has shape {:?}, expected {shape:?}",
                view.shape()
            )));
        }
        let t = match view.dtype() {
            Dtype::F32 => WeightType::F32,
            Dtype::F16 => WeightType::F16,
            Dtype::BF16 => WeightType::BF16,
            other => {
                return Err(Error::unsupported(format!(
                    "tensor {found} has dtype {other:?}; F32, F16 and BF16 are supported"
                )))
            }
        };
        Ok((found, t, view.data()))
    }

    /// A matrix stored `[rows][cols]`, kept in its type.
    fn rows(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let (found, t, data) = self.raw(name, &[rows, cols])?;
        Matrix::new(&found, t, rows, cols, Bytes::Owned(Arc::new(data.to_vec())))
    }

    /// A Conv1D matrix stored `[n_in][n_out]`, transposed to `[n_out][n_in]` in its type.
    fn conv1d(&self, name: &str, n_in: usize, n_out: usize) -> Result<Matrix> {
        let (found, t, data) = self.raw(name, &[n_in, n_out])?;
        let es = t.block_bytes();
        if data.len() != n_in * n_out * es {
            return Err(Error::invalid(format!(
                "tensor {found} holds {} bytes, its shape [{n_in}, {n_out}] needs {}",
                data.len(),
                n_in * n_out * es
            )));
        }
        let mut out = vec![0u8; data.len()];
        for i in 0..n_in {
            for o in 0..n_out {
                let src = (i * n_out + o) * es;
                let dst = (o * n_in + i) * es;
                out[dst..dst + es].copy_from_slice(&data[src..src + es]);
            }
        }
        Matrix::new(&found, t, n_out, n_in, Bytes::Owned(Arc::new(out)))
    }

    /// The tensor `name` (tried with and without `transformer.`) as f32, checked to have
    /// `shape`.
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (found, t, data) = self.raw(name, shape)?;
        let want: usize = shape.iter().product();
        if data.len() != want * t.block_bytes() {
            return Err(Error::invalid(format!(
                "tensor {found} holds {} bytes, its shape {shape:?} needs {want} values",
                data.len()
            )));
        }
        let mut out = vec![0.0; want];
        super::quant::dequantize_row(t, data, &mut out);
        Ok(out)
    }
}

/// `[rows][cols]` → `[cols][rows]`, in tiles to stay in cache.
pub(crate) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 32;
    let mut out = vec![0.0; rows * cols];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    out[c * rows + r] = x[r * cols + c];
                }
            }
        }
    }
    out
}

fn le_bytes(x: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(x))
    } else {
        Cow::Owned(x.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

#[cfg(test)]
#[path = "weights_tests.rs"]
mod tests;
