//! Generative models: the decoders (GPT-2, the Llama family) as the in-flight engine's
//! executor (a model version's weights loaded once, one KV cache and compute runner per
//! instance), and the start of a version.

use crate::config::ModelConfig;
use crate::folder::Folder;
use crate::llm::{
    hf_eos_ids, Gpt2, KvCache, KvShape, KvType, Llama, LlamaRunner, Logits, Runner, StepSeq,
    TextCodec, TextSource, WeightType,
};
use crate::log::Logger;
use crate::request::ModelIdentity;
use crate::scheduler::inflight::settings::Settings;
use crate::scheduler::inflight::{Engine, Executor, ModelLimits, Vocabulary, Work};
use crate::scheduler::Scheduler;
use crate::status::{Error, Result};
use std::sync::Arc;

struct Gpt2Executor {
    runner: Runner,
    kv: KvCache,
}

fn step_seqs<'a>(work: &[Work<'a>]) -> Vec<StepSeq<'a>> {
    work.iter()
        .map(|w| StepSeq {
            tokens: w.tokens,
            start: w.start,
            blocks: w.blocks,
            logits: if w.logits { Logits::Last } else { Logits::None },
        })
        .collect()
}

impl Executor for Gpt2Executor {
    fn step(&mut self, work: &[Work<'_>], logits: &mut Vec<f32>) -> Result<()> {
        self.runner.step(&mut self.kv, &step_seqs(work), logits)
    }
}

struct LlamaExecutor {
    runner: LlamaRunner,
    kv: KvCache,
}

impl Executor for LlamaExecutor {
    fn step(&mut self, work: &[Work<'_>], logits: &mut Vec<f32>) -> Result<()> {
        self.runner.step(&mut self.kv, &step_seqs(work), logits)
    }
}

/// The KV cache's element type: parameter `kv_cache_type` (`f16` or `f32`), else F16
/// when the weights are 16-bit or quantized and F32 when they are F32 (as llama.cpp
/// defaults to F16).
fn kv_type(config: &ModelConfig, weights_f32: bool) -> Result<KvType> {
    match config
        .parameters
        .get("kv_cache_type")
        .map(|v| v.trim().to_ascii_lowercase())
    {
        None => Ok(if weights_f32 {
            KvType::F32
        } else {
            KvType::F16
        }),
        Some(v) if v == "f16" => Ok(KvType::F16),
        Some(v) if v == "f32" => Ok(KvType::F32),
        Some(v) => Err(Error::invalid(format!(
            "model '{}': parameter 'kv_cache_type' must be f16 or f32, got '{v}'",
            config.name
        ))),
    }
}

/// The in-flight settings of a model whose KV cache blocks have `kv_shape`, warning of
/// parameters no generative backend reads.
fn settings(
    config: &ModelConfig,
    n_positions: usize,
    kv_shape: KvShape,
    log: &Logger,
) -> Result<Settings> {
    let (settings, unknown) = Settings::from_config(config, n_positions, |tpb| {
        KvCache::bytes_per_block(kv_shape, tpb)
    })?;
    for k in unknown {
        log.warn(&format!(
            "model '{}': parameter '{k}' is not one the generative backend reads; ignored",
            config.name
        ));
    }
    Ok(settings)
}

/// One executor per instance, each with its own KV cache; `make` builds an executor
/// around its cache.
fn executors(
    config: &ModelConfig,
    at: &str,
    kv_shape: KvShape,
    settings: &Settings,
    make: impl Fn(KvCache) -> Result<Box<dyn Executor>>,
) -> Result<Vec<Box<dyn Executor>>> {
    let instances: u32 = config
        .instance_groups
        .iter()
        .map(|g| g.count.max(1))
        .sum::<u32>()
        .max(1);
    let mut executors: Vec<Box<dyn Executor>> = Vec::new();
    for i in 0..instances {
        let kv =
            KvCache::new(kv_shape, settings.tokens_per_block, settings.kv_blocks).map_err(|e| {
                e.context(format!(
                    "{at}: instance {i}: KV cache of {} blocks of {} tokens",
                    settings.kv_blocks, settings.tokens_per_block
                ))
            })?;
        executors.push(make(kv).map_err(|e| e.context(format!("{at}: instance {i}")))?);
    }
    Ok(executors)
}

/// The KV cache of one instance, in MiB, and the log's words for it and the schedule.
fn describe(kv_shape: KvShape, s: &Settings, instances: usize) -> String {
    let mib = (KvCache::bytes_per_block(kv_shape, s.tokens_per_block) as f64 * s.kv_blocks as f64)
        / (1u64 << 20) as f64;
    format!(
        "{instances} instance(s), each with a {} KV cache of {} blocks of {} tokens ({mib:.1} MiB, resident as used); policy {}, up to {} sequences and {} tokens per iteration",
        kv_shape.dtype.name(),
        s.kv_blocks,
        s.tokens_per_block,
        s.policy.as_str(),
        s.max_num_sequences,
        s.max_num_tokens,
    )
}

/// The tokens of a version: its tokenizer (if any) and the ids that end generation by
/// default (`model_eos` and the folder's, within the vocabulary). Logs which tokenizer.
fn vocabulary(
    at: &str,
    vdir: &Folder,
    model_eos: &[u32],
    vocab_size: usize,
    log: &Logger,
) -> Result<Vocabulary> {
    let text = match TextCodec::load(vdir).map_err(|e| e.context(at))? {
        TextSource::Ready(c) => {
            log.info(&format!(
                "{at}: tokenizer {}{}",
                c.source,
                if c.has_chat_template() {
                    ", with a chat template"
                } else {
                    ""
                }
            ));
            if let Some(why) = c.chat_template_error() {
                log.warn(&format!(
                    "{at}: {why}; requests that ask for it (apply_chat_template) are refused"
                ));
            }
            Some(Arc::<TextCodec>::from(c))
        }
        TextSource::Missing(why) => {
            log.info(&format!("{at}: token ids only: {why}"));
            None
        }
    };
    let mut eos: Vec<u32> = model_eos.to_vec();
    eos.extend(hf_eos_ids(vdir).map_err(|e| e.context(at))?);
    if let Some(t) = &text {
        eos.extend(&t.eos_ids);
    }
    let mut out = Vec::new();
    for id in eos {
        if (id as usize) < vocab_size && !out.contains(&id) {
            out.push(id);
        }
    }
    Ok(Vocabulary { eos: out, text })
}

/// Starts the in-flight engine over `executors`.
fn start(
    config: &Arc<ModelConfig>,
    version: i64,
    settings: Settings,
    limits: ModelLimits,
    vocab: Vocabulary,
    executors: Vec<Box<dyn Executor>>,
    log: &Logger,
) -> Result<Arc<Scheduler>> {
    let engine = Engine::new(config, settings, limits, vocab)?;
    Scheduler::start_generative(
        ModelIdentity::new(&config.name, version),
        config.clone(),
        engine,
        executors,
        log.clone(),
    )
}

/// Loads version `version` from `<dir>/<version>/` and starts its instances' loops.
pub(super) fn start_version(
    config: &Arc<ModelConfig>,
    version: i64,
    dir: &Folder,
    log: &Logger,
) -> Result<Arc<Scheduler>> {
    let m = &config.name;
    let at = format!("model '{m}' version {version}");
    let vdir = dir.folder(&version.to_string(), &at)?;
    if super::backend_key(&config.backend, &config.platform) == "llama" {
        return start_llama(config, version, &vdir, log);
    }
    let model = Arc::new(Gpt2::load(&vdir).map_err(|e| e.context(&at))?);
    let c = &model.config;
    let kv_shape = KvShape {
        dtype: kv_type(config, true)?,
        ..KvShape::from(c)
    };
    let settings = settings(config, c.n_positions, kv_shape, log)?;
    let executors = executors(config, &at, kv_shape, &settings, |kv| {
        let runner = Runner::new(model.clone(), settings.threads)?;
        Ok(Box::new(Gpt2Executor { runner, kv }))
    })?;
    log.info(&format!(
        "{at}: GPT-2 with {} layers, {} heads, width {}, vocabulary {}, context {}; {}",
        c.n_layer,
        c.n_head,
        c.n_embd,
        c.vocab_size,
        c.n_positions,
        describe(kv_shape, &settings, executors.len()),
    ));
    let limits = ModelLimits {
        vocab_size: c.vocab_size,
        n_positions: c.n_positions,
    };
    let vocab = vocabulary(&at, &vdir, &[], c.vocab_size, log)?;
    start(config, version, settings, limits, vocab, executors, log)
}

/// A Llama-family version: the folder's one `.gguf` file, or a Hugging Face folder.
fn start_llama(
    config: &Arc<ModelConfig>,
    version: i64,
    vdir: &Folder,
    log: &Logger,
) -> Result<Arc<Scheduler>> {
    let m = &config.name;
    let at = format!("model '{m}' version {version}");
    let model = Arc::new(Llama::load(vdir).map_err(|e| e.context(&at))?);
    let c = &model.config;
    let types = model.weight_types();
    let all_f32 = types.iter().all(|(t, _)| *t == WeightType::F32);
    let kv_shape = c.kv_shape(kv_type(config, all_f32)?);
    let settings = settings(config, c.n_ctx, kv_shape, log)?;
    let executors = executors(config, &at, kv_shape, &settings, |kv| {
        let runner = LlamaRunner::new(model.clone(), settings.threads)?;
        Ok(Box::new(LlamaExecutor { runner, kv }))
    })?;
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let (total, mapped) = model.weight_bytes();
    let (kernels, problem) = crate::llm::cpu_kernels();
    if let Some(problem) = problem {
        log.warn(&format!("{at}: {problem}"));
    }
    let kinds: Vec<String> = types
        .iter()
        .map(|(t, b)| {
            format!(
                "{} {:.0}%",
                t.name(),
                100.0 * *b as f64 / total.max(1) as f64
            )
        })
        .collect();
    log.info(&format!(
        "{at}: {} ({}) with {} layers, {} heads ({} key/value), width {}, vocabulary {}, context {}; weights {:.1} MiB ({}), {:.1} MiB of them mapped from the file, {}; {}",
        c.arch,
        model.source,
        c.n_layer,
        c.n_head,
        c.n_kv_head,
        c.n_embd,
        c.vocab_size,
        c.n_ctx,
        mib(total as f64),
        kinds.join(", "),
        mib(mapped as f64),
        kernels,
        describe(kv_shape, &settings, executors.len()),
    ));
    let limits = ModelLimits {
        vocab_size: c.vocab_size,
        n_positions: c.n_ctx,
    };
    let vocab = vocabulary(&at, vdir, &c.eos_token_ids, c.vocab_size, log)?;
    start(config, version, settings, limits, vocab, executors, log)
}
