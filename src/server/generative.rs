//! Generative models: the GPT-2 decoder as the in-flight engine's executor (a model
//! version's weights loaded once, one KV cache and compute runner per instance), and the
//! start of a version.

use crate::config::ModelConfig;
use crate::folder::Folder;
use crate::llm::{Gpt2, KvCache, Logits, Runner, StepSeq};
use crate::log::Logger;
use crate::request::ModelIdentity;
use crate::scheduler::inflight::settings::Settings;
use crate::scheduler::inflight::{Engine, Executor, ModelLimits, Work};
use crate::scheduler::Scheduler;
use crate::status::Result;
use std::sync::Arc;

struct Gpt2Executor {
    runner: Runner,
    kv: KvCache,
}

impl Executor for Gpt2Executor {
    fn step(&mut self, work: &[Work<'_>], logits: &mut Vec<f32>) -> Result<()> {
        let seqs: Vec<StepSeq<'_>> = work
            .iter()
            .map(|w| StepSeq {
                tokens: w.tokens,
                start: w.start,
                blocks: w.blocks,
                logits: if w.logits { Logits::Last } else { Logits::None },
            })
            .collect();
        self.runner.step(&mut self.kv, &seqs, logits)
    }
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
    let model = Arc::new(Gpt2::load(&vdir).map_err(|e| e.context(&at))?);
    let c = &model.config;
    let (settings, unknown) = Settings::from_config(config, c.n_positions, |tpb| {
        KvCache::bytes_per_block(c, tpb)
    })?;
    for k in unknown {
        log.warn(&format!(
            "model '{m}': parameter '{k}' is not one the generative backend reads; ignored"
        ));
    }
    let instances: u32 = config
        .instance_groups
        .iter()
        .map(|g| g.count.max(1))
        .sum::<u32>()
        .max(1);
    let mut executors: Vec<Box<dyn Executor>> = Vec::new();
    for i in 0..instances {
        let kv = KvCache::new(c, settings.tokens_per_block, settings.kv_blocks).map_err(|e| {
            e.context(format!(
                "{at}: instance {i}: KV cache of {} blocks of {} tokens",
                settings.kv_blocks, settings.tokens_per_block
            ))
        })?;
        let runner = Runner::new(model.clone(), settings.threads)
            .map_err(|e| e.context(format!("{at}: instance {i}")))?;
        executors.push(Box::new(Gpt2Executor { runner, kv }));
    }
    let mib = (KvCache::bytes_per_block(c, settings.tokens_per_block) as f64
        * settings.kv_blocks as f64)
        / (1u64 << 20) as f64;
    log.info(&format!(
        "{at}: GPT-2 with {} layers, {} heads, width {}, vocabulary {}, context {}; {instances} instance(s), each with a KV cache of {} blocks of {} tokens ({mib:.1} MiB); policy {}, up to {} sequences and {} tokens per iteration",
        c.n_layer,
        c.n_head,
        c.n_embd,
        c.vocab_size,
        c.n_positions,
        settings.kv_blocks,
        settings.tokens_per_block,
        settings.policy.as_str(),
        settings.max_num_sequences,
        settings.max_num_tokens,
    ));
    let limits = ModelLimits {
        vocab_size: c.vocab_size,
        n_positions: c.n_positions,
    };
    let engine = Engine::new(config, settings, limits);
    Scheduler::start_generative(
        ModelIdentity::new(m, version),
        config.clone(),
        engine,
        executors,
        log.clone(),
    )
}
