//! In-flight (iteration-level) batching for generative models.
//!
//! Each model instance runs one loop. Every iteration it admits waiting requests under
//! the capacity policy, runs one forward step over all of its active requests together
//! (prompt tokens of new requests, possibly in chunks, next to one token of each
//! generating request), samples, delivers the new tokens, and retires finished requests
//! at once, freeing their KV blocks for the next iteration.
//!
//! Requests wait in one queue shared by the model's instances. The queue lock is held only
//! to move requests in and out; model code and callbacks run without it. Each instance
//! owns its KV cache and [`blocks::BlockManager`].
//!
//! The loop talks to the model through [`Executor`]: a step over packed sequences with
//! paged KV. The GPT-2 executor runs it on the CPU; the scheduling does not depend on it.

pub mod blocks;
pub mod settings;
#[cfg(test)]
mod tests;

use crate::config::ModelConfig;
use crate::llm::{
    penalize, sample, Detokenizer, Penalties, Rng, SamplingParams, StopStrings, TextCodec,
};
use crate::request::{ModelIdentity, OutputTensor, ParamValue, Request, Response, ResponseSink};
use crate::scheduler::{c_name, CancelOutcome, Kind, Scheduler};
use crate::stats::Histogram;
use crate::status::{Code, Error, Result};
use crate::tensor::{DataType, Shape, TensorData};
use blocks::{BlockManager, PrefixHash, ROOT};
use parking_lot::{Condvar, Mutex};
use settings::{
    Policy, Settings, INPUT_IDS, OUTPUT_IDS, OUTPUT_LOG_PROBS, TEXT_INPUT, TEXT_OUTPUT,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One sequence's share of a step: `tokens` sit at positions `start..start+len`; the
/// positions before are in the cache. `blocks` covers every position up to the last.
pub struct Work<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub blocks: &'a [u32],
    /// Whether the step returns the logits of the last token.
    pub logits: bool,
}

/// The model side of an instance: its weights, KV cache and compute.
pub trait Executor: Send {
    /// One forward pass over `work` packed together. Fills `logits` (cleared first) with a
    /// vocabulary-sized row for each work item that asks, in order.
    fn step(&mut self, work: &[Work<'_>], logits: &mut Vec<f32>) -> Result<()>;
}

/// The model's limits the scheduler needs before any step.
#[derive(Clone, Copy, Debug)]
pub struct ModelLimits {
    pub vocab_size: usize,
    /// The longest sequence (prompt plus output) the model can attend over.
    pub n_positions: usize,
}

/// What the engine knows of the model's tokens: the ids that end generation unless a
/// request says otherwise, and the tokenizer when the model has one.
#[derive(Default)]
pub struct Vocabulary {
    pub eos: Vec<u32>,
    pub text: Option<Arc<TextCodec>>,
}

/// An application's iteration-statistics callback (the C API wraps its function and user
/// data in one): called with each iteration's JSON on the generation loop's thread.
pub type StatsCallback = dyn Fn(&str) + Send + Sync;

#[derive(Default)]
struct StatsSlot {
    cb: Option<Arc<StatsCallback>>,
    /// Calls running now (a replaced callback is not called once the setter returns).
    calling: usize,
}

thread_local! {
    /// On a generation loop thread: the address of its engine (a stats callback that
    /// replaces itself must not wait for itself).
    static ON_LOOP: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counters of a generative model version, shown in the statistics JSON and Prometheus.
#[derive(Default)]
pub struct GenStats {
    pub iterations: AtomicU64,
    pub context_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub reused_blocks: AtomicU64,
    pub time_to_first_token_us: Histogram,
    pub inter_token_us: Histogram,
    pub scheduler_us: Histogram,
    /// Building the iteration's responses and running their callbacks.
    pub deliver_us: Histogram,
    /// Per instance: (active, paused, kv used, kv free, kv max), updated every iteration.
    gauges: Mutex<Vec<[u64; 5]>>,
}

impl GenStats {
    fn set_gauges(&self, instance: usize, g: [u64; 5]) {
        let mut v = self.gauges.lock();
        if v.len() <= instance {
            v.resize(instance + 1, [0; 5]);
        }
        v[instance] = g;
    }

    fn sums(&self) -> [u64; 5] {
        let v = self.gauges.lock();
        let mut s = [0u64; 5];
        for g in v.iter() {
            for i in 0..5 {
                s[i] += g[i];
            }
        }
        s
    }

    pub fn json(&self) -> String {
        let [active, paused, used, free, max] = self.sums();
        format!(
            "{{\"iterations\":{},\"context_tokens\":{},\"generated_tokens\":{},\"preemptions\":{},\"reused_kv_blocks\":{},\"active_requests\":{active},\"paused_requests\":{paused},\"kv_blocks_used\":{used},\"kv_blocks_free\":{free},\"kv_blocks_max\":{max},\"time_to_first_token_us\":{},\"inter_token_us\":{},\"scheduler_us\":{},\"deliver_us\":{}}}",
            self.iterations.load(Relaxed),
            self.context_tokens.load(Relaxed),
            self.generated_tokens.load(Relaxed),
            self.preemptions.load(Relaxed),
            self.reused_blocks.load(Relaxed),
            self.time_to_first_token_us.json(),
            self.inter_token_us.json(),
            self.scheduler_us.json(),
            self.deliver_us.json(),
        )
    }

    pub fn prometheus(&self, out: &mut crate::stats::PromText, labels: &str) {
        let c = |a: &AtomicU64| a.load(Relaxed);
        let [active, paused, used, free, max] = self.sums();
        let rows: [(&str, &str, &str, u64); 13] = [
            (
                "infer_generation_iterations_total",
                "counter",
                "Scheduler iterations of generative models",
                c(&self.iterations),
            ),
            (
                "infer_generation_context_tokens_total",
                "counter",
                "Prompt tokens processed (recomputation included)",
                c(&self.context_tokens),
            ),
            (
                "infer_generation_tokens_total",
                "counter",
                "Tokens generated",
                c(&self.generated_tokens),
            ),
            (
                "infer_generation_preemptions_total",
                "counter",
                "Requests paused for lack of KV blocks",
                c(&self.preemptions),
            ),
            (
                "infer_kv_cache_reused_blocks_total",
                "counter",
                "KV blocks taken from the prefix cache",
                c(&self.reused_blocks),
            ),
            (
                "infer_generation_active_requests",
                "gauge",
                "Requests in the running batch",
                active,
            ),
            (
                "infer_generation_paused_requests",
                "gauge",
                "Requests paused, waiting to resume",
                paused,
            ),
            (
                "infer_kv_cache_blocks_used",
                "gauge",
                "KV cache blocks in use",
                used,
            ),
            (
                "infer_kv_cache_blocks_free",
                "gauge",
                "KV cache blocks free (cached prefixes included)",
                free,
            ),
            (
                "infer_kv_cache_blocks_max",
                "gauge",
                "KV cache blocks in all",
                max,
            ),
            (
                "infer_generation_time_to_first_token_us_total",
                "counter",
                "Microseconds from enqueue to first token, summed",
                self.time_to_first_token_us.total(),
            ),
            (
                "infer_generation_inter_token_us_total",
                "counter",
                "Microseconds between consecutive tokens, summed",
                self.inter_token_us.total(),
            ),
            (
                "infer_generation_scheduler_us_total",
                "counter",
                "Microseconds of scheduler work outside the model, summed",
                self.scheduler_us.total(),
            ),
        ];
        for (name, kind, help, v) in rows {
            out.sample(name, kind, help, labels, v);
        }
    }
}

/// A request that passed the checks, waiting for admission.
struct Pending {
    req: Box<Request>,
    prompt: Vec<u32>,
    max_tokens: usize,
    /// Tokens that end the request (not returned).
    end_ids: Vec<u32>,
    streaming: bool,
    sampling: SamplingParams,
    penalties: Penalties,
    logit_bias: Vec<(u32, f32)>,
    seed: u64,
    deadline: Option<Instant>,
    stop: StopStrings,
    /// Whether the responses carry `text_output`.
    text_out: bool,
    skip_special: bool,
}

impl Pending {
    /// Whether the generated tokens are turned into text (for the output or stop strings).
    fn decodes(&self) -> bool {
        self.text_out || !self.stop.is_empty()
    }
}

/// A running request (or a paused one, with its state kept for resumption).
struct Seq {
    p: Pending,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    generated: usize,
    /// Positions whose keys and values are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    /// Prefix hashes of the full blocks registered so far (with reuse).
    hashes: Vec<PrefixHash>,
    rng: Rng,
    log_probs: Vec<f32>,
    /// Generated tokens already streamed.
    streamed: usize,
    /// Admission order: preemption takes the newest.
    order: u64,
    reserve: usize,
    cached_tokens: usize,
    last_token_at: Option<Instant>,
    /// Chunk planned for this iteration.
    chunk: usize,
    cancel: Option<Error>,
    /// Where the responses go (taken from the request at admission).
    sink: Option<ResponseSink>,
    /// New tokens to stream after this iteration.
    stream_out: bool,
    /// Whether the responses carry `output_log_probs`.
    wants_log_probs: bool,
    /// The prompt's distinct tokens, sorted (for a repetition penalty).
    prompt_set: Vec<u32>,
    /// Each generated token and how often (for penalties).
    counts: HashMap<u32, u32>,
    detok: Detokenizer,
    /// The generated text so far (up to a stop string), and how much of it was streamed.
    text: String,
    text_sent: usize,
}

impl Seq {
    fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }
    fn in_context(&self) -> bool {
        self.remaining() > 1 || self.generated == 0
    }
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    /// Waiting requests that have a deadline (to skip the scan when none has).
    with_deadline: usize,
    /// Requests taken out of the queue (cancelled) for a loop to answer.
    ending: Vec<(Box<Request>, Error)>,
    /// Running requests to cancel after the current iteration.
    cancel: HashSet<u64>,
    running: HashSet<u64>,
    paused: bool,
    closed: bool,
    /// Bumped by cancel_all; loops cancel their running requests when they see it.
    cancel_epoch: u64,
    cancel_reason: String,
}

/// The generative side of a [`Scheduler`].
pub struct Engine {
    pub settings: Settings,
    pub limits: ModelLimits,
    vocab: Vocabulary,
    out_int64: bool,
    ids_name: Arc<CString>,
    log_probs_name: Option<Arc<CString>>,
    text_name: Option<Arc<CString>>,
    q: Mutex<Queue>,
    cv: Condvar,
    stats_cb: Mutex<StatsSlot>,
    stats_cv: Condvar,
    pub gen_stats: GenStats,
    next_order: AtomicU64,
}

pub fn is_generative(key: &str) -> bool {
    key == "gpt2" || key == "llama"
}

/// Fills in the tensors of a generative config that lists none: token ids in and out,
/// and with `text` (every version has a tokenizer) text in and out too, each input
/// optional (a request sends one of them).
pub fn autocomplete(raw: &mut crate::config::RawConfig, text: bool) {
    use crate::config::pb;
    let int32 = pb::DataType::TypeInt32 as i32;
    let string = pb::DataType::TypeString as i32;
    if raw.pb.input.is_empty() {
        raw.pb.input.push(pb::ModelInput {
            name: INPUT_IDS.to_owned(),
            data_type: int32,
            dims: vec![-1],
            optional: text,
            ..Default::default()
        });
        if text {
            raw.pb.input.push(pb::ModelInput {
                name: TEXT_INPUT.to_owned(),
                data_type: string,
                dims: vec![1],
                optional: true,
                ..Default::default()
            });
        }
    }
    if raw.pb.output.is_empty() {
        raw.pb.output.push(pb::ModelOutput {
            name: OUTPUT_IDS.to_owned(),
            data_type: int32,
            dims: vec![-1],
            ..Default::default()
        });
        if text {
            raw.pb.output.push(pb::ModelOutput {
                name: TEXT_OUTPUT.to_owned(),
                data_type: string,
                dims: vec![-1],
                ..Default::default()
            });
        }
    }
}

impl Engine {
    /// The engine of a model; a config with text tensors needs `vocab.text`.
    pub fn new(
        config: &ModelConfig,
        settings: Settings,
        limits: ModelLimits,
        vocab: Vocabulary,
    ) -> Result<Engine> {
        let out_int64 = config
            .output(OUTPUT_IDS)
            .is_some_and(|t| t.data_type == DataType::Int64);
        if vocab.text.is_none() {
            if let Some(t) = [TEXT_INPUT, TEXT_OUTPUT]
                .into_iter()
                .find(|t| config.input(t).is_some() || config.output(t).is_some())
            {
                return Err(Error::unsupported(format!(
                    "model '{}': '{t}' needs the model's tokenizer, and it has none",
                    config.name
                )));
            }
        }
        Ok(Engine {
            settings,
            limits,
            vocab,
            out_int64,
            ids_name: c_name(OUTPUT_IDS),
            log_probs_name: config
                .output(OUTPUT_LOG_PROBS)
                .map(|_| c_name(OUTPUT_LOG_PROBS)),
            text_name: config.output(TEXT_OUTPUT).map(|_| c_name(TEXT_OUTPUT)),
            q: Mutex::new(Queue::default()),
            cv: Condvar::new(),
            stats_cb: Mutex::new(StatsSlot::default()),
            stats_cv: Condvar::new(),
            gen_stats: GenStats::default(),
            next_order: AtomicU64::new(0),
        })
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.settings.tokens_per_block)
    }

    /// The longest a request can grow: its prompt plus max_tokens, within the context.
    fn final_len(&self, p: &Pending) -> usize {
        (p.prompt.len() + p.max_tokens).min(self.limits.n_positions)
    }

    /// Checks a request and reads its parameters.
    fn parse(
        &self,
        model: &str,
        req: Box<Request>,
    ) -> std::result::Result<Pending, (Box<Request>, Error)> {
        match self.parse_inner(model, &req) {
            Ok(p) => Ok(Pending { req, ..p }),
            Err(e) => Err((req, e)),
        }
    }

    fn parse_inner(&self, m: &str, req: &Request) -> Result<Pending> {
        let mut max_tokens = self.settings.default_max_tokens;
        let mut end_id: Option<Option<u32>> = None;
        let mut ignore_eos = false;
        let mut streaming = false;
        let mut temperature: Option<f64> = None;
        let mut top_k = 0u32;
        let mut top_p = 1.0f64;
        let mut min_p = 0.0f64;
        let mut penalties = Penalties::NONE;
        let mut logit_bias = Vec::new();
        let mut seed = 0u64;
        let mut chat = false;
        let mut add_special: Option<bool> = None;
        let mut skip_special = true;
        let mut stop = Vec::new();
        let vocab = self.limits.vocab_size;
        let int = |k: &str, v: &ParamValue| match v {
            ParamValue::Int(i) => Ok(*i),
            _ => Err(Error::invalid(format!(
                "model '{m}': parameter '{k}' must be an integer"
            ))),
        };
        let float = |k: &str, v: &ParamValue| match v {
            ParamValue::Double(d) => Ok(*d),
            ParamValue::Int(i) => Ok(*i as f64),
            _ => Err(Error::invalid(format!(
                "model '{m}': parameter '{k}' must be a number"
            ))),
        };
        let boolean = |k: &str, v: &ParamValue| match v {
            ParamValue::Bool(b) => Ok(*b),
            _ => Err(Error::invalid(format!(
                "model '{m}': parameter '{k}' must be a bool"
            ))),
        };
        let string = |k: &str, v: &ParamValue| match v {
            ParamValue::Str(s) => s.to_str().map(str::to_owned).map_err(|_| {
                Error::invalid(format!("model '{m}': parameter '{k}' is not UTF-8 text"))
            }),
            _ => Err(Error::invalid(format!(
                "model '{m}': parameter '{k}' must be a string"
            ))),
        };
        let in_range = |k: &str, x: f64, lo: f64, hi: f64| {
            if x.is_finite() && x >= lo && x <= hi {
                Ok(x)
            } else {
                Err(Error::invalid(format!(
                    "model '{m}': parameter '{k}' must be in [{lo}, {hi}], got {x:?}"
                )))
            }
        };
        for (k, v) in &req.parameters {
            match k.as_str() {
                "max_tokens" => {
                    let n = int(k, v)?;
                    if n < 1 {
                        return Err(Error::invalid(format!(
                            "model '{m}': parameter 'max_tokens' must be at least 1, got {n}"
                        )));
                    }
                    max_tokens = usize::try_from(n).unwrap_or(usize::MAX);
                }
                "end_id" => {
                    let n = int(k, v)?;
                    end_id = Some(u32::try_from(n).ok());
                }
                "ignore_eos" => ignore_eos = boolean(k, v)?,
                "streaming" => streaming = boolean(k, v)?,
                "temperature" => {
                    let t = float(k, v)?;
                    if !(t.is_finite() && t >= 0.0) {
                        return Err(Error::invalid(format!(
                            "model '{m}': parameter 'temperature' must be a finite number >= 0, got {t:?}"
                        )));
                    }
                    temperature = Some(t);
                }
                "top_k" => {
                    let n = int(k, v)?;
                    if n < 0 {
                        return Err(Error::invalid(format!(
                            "model '{m}': parameter 'top_k' must be >= 0 (0 = off), got {n}"
                        )));
                    }
                    // Past the vocabulary every token is kept, as with the largest u32.
                    top_k = u32::try_from(n).unwrap_or(u32::MAX);
                }
                "top_p" => {
                    let p = float(k, v)?;
                    if !(p > 0.0 && p <= 1.0) {
                        return Err(Error::invalid(format!(
                            "model '{m}': parameter 'top_p' must be in (0, 1], got {p:?}"
                        )));
                    }
                    top_p = p;
                }
                "min_p" => min_p = in_range(k, float(k, v)?, 0.0, 1.0)?,
                "repetition_penalty" => {
                    let r = float(k, v)?;
                    if !(r.is_finite() && r > 0.0) {
                        return Err(Error::invalid(format!(
                            "model '{m}': parameter 'repetition_penalty' must be a finite number > 0 (1 = off), got {r:?}"
                        )));
                    }
                    penalties.repetition = r as f32;
                }
                "presence_penalty" => {
                    penalties.presence = in_range(k, float(k, v)?, -2.0, 2.0)? as f32
                }
                "frequency_penalty" => {
                    penalties.frequency = in_range(k, float(k, v)?, -2.0, 2.0)? as f32
                }
                "logit_bias" => logit_bias = parse_logit_bias(m, &string(k, v)?, vocab)?,
                "seed" => seed = int(k, v)? as u64,
                "stop" => stop = parse_stop(m, &string(k, v)?)?,
                "apply_chat_template" => chat = boolean(k, v)?,
                "add_special_tokens" => add_special = Some(boolean(k, v)?),
                "skip_special_tokens" => skip_special = boolean(k, v)?,
                other => {
                    return Err(Error::invalid(format!(
                        "model '{m}': unknown request parameter '{other}' (known: max_tokens, end_id, ignore_eos, streaming, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, seed, stop, apply_chat_template, add_special_tokens, skip_special_tokens)"
                    )))
                }
            }
        }
        let text = self.vocab.text.as_deref();
        let prompt = match (req.input(INPUT_IDS), req.input(TEXT_INPUT)) {
            (Some(_), Some(_)) => {
                return Err(Error::invalid(format!(
                    "model '{m}': a request sends '{INPUT_IDS}' or '{TEXT_INPUT}', not both"
                )))
            }
            (None, None) => {
                return Err(Error::invalid(format!(
                    "model '{m}': input '{INPUT_IDS}' (or '{TEXT_INPUT}') is missing"
                )))
            }
            (Some(t), None) => {
                if chat {
                    return Err(Error::invalid(format!(
                        "model '{m}': apply_chat_template needs the messages in '{TEXT_INPUT}'"
                    )));
                }
                token_ids(m, t, vocab)?
            }
            (None, Some(t)) => {
                let codec = text.ok_or_else(|| {
                    Error::unsupported(format!(
                        "model '{m}': '{TEXT_INPUT}' needs the model's tokenizer, and it has none"
                    ))
                })?;
                let input = one_text(m, t)?;
                let ids = if chat {
                    let messages = match serde_json::from_str::<serde_json::Value>(&input) {
                        Ok(v @ serde_json::Value::Array(_)) => v,
                        // Plain text is one user turn.
                        _ => serde_json::json!([{"role": "user", "content": input}]),
                    };
                    let rendered = codec
                        .apply_chat_template(&messages)
                        .map_err(|e| e.context(format!("model '{m}'")))?;
                    // The template writes the special tokens it wants.
                    codec.encode(&rendered, add_special.unwrap_or(false))
                } else {
                    codec.encode(&input, add_special.unwrap_or(true))
                }
                .map_err(|e| e.context(format!("model '{m}': input '{TEXT_INPUT}'")))?;
                if ids.is_empty() {
                    return Err(Error::invalid(format!(
                        "model '{m}': input '{TEXT_INPUT}' is empty (no tokens)"
                    )));
                }
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(Error::invalid(format!(
                        "model '{m}': the tokenizer gave token {bad}, outside the model's vocabulary of {vocab}"
                    )));
                }
                ids
            }
        };
        if prompt.len() >= self.limits.n_positions {
            return Err(Error::invalid(format!(
                "model '{m}': a prompt of {} tokens leaves no room to generate: the model's context is {} positions",
                prompt.len(),
                self.limits.n_positions
            )));
        }
        let text_out = self.text_name.is_some() && req.wants_output(TEXT_OUTPUT);
        if !stop.is_empty() && text.is_none() {
            return Err(Error::unsupported(format!(
                "model '{m}': parameter 'stop' needs the model's tokenizer, and it has none"
            )));
        }
        // Greedy unless the request asks for sampling.
        let sampling = match temperature {
            None if top_k == 0 && top_p >= 1.0 && min_p == 0.0 => SamplingParams::GREEDY,
            t => SamplingParams {
                temperature: t.unwrap_or(1.0) as f32,
                top_k,
                top_p: top_p as f32,
                min_p: min_p as f32,
            },
        };
        let end_ids = match end_id {
            Some(id) => id.into_iter().collect(),
            None if ignore_eos => Vec::new(),
            None => self.vocab.eos.clone(),
        };
        let p = Pending {
            req: Box::new(Request::new(m, 0, None)),
            prompt,
            max_tokens,
            end_ids,
            streaming,
            sampling,
            penalties,
            logit_bias,
            seed,
            deadline: (req.timeout_us > 0)
                .then(|| req.enqueued_at + Duration::from_micros(req.timeout_us)),
            stop: StopStrings::new(stop),
            text_out,
            skip_special,
        };
        // What can never run here is refused now rather than left waiting forever.
        let s = &self.settings;
        let blocks = s.kv_blocks;
        let need = match s.policy {
            Policy::MaxUtilization => self.blocks_for(p.prompt.len() + 1),
            _ => self.blocks_for(self.final_len(&p)),
        };
        if need > blocks {
            return Err(Error::invalid(format!(
                "model '{m}': the request needs {need} KV blocks ({} tokens{}), but an instance's cache has {blocks} of {} tokens",
                match s.policy {
                    Policy::MaxUtilization => p.prompt.len() + 1,
                    _ => self.final_len(&p),
                },
                match s.policy {
                    Policy::MaxUtilization => " to start",
                    _ => " of prompt and max_tokens, reserved by the policy",
                },
                s.tokens_per_block
            )));
        }
        if !s.chunked_context && p.prompt.len() > s.max_num_tokens {
            return Err(Error::invalid(format!(
                "model '{m}': a prompt of {} tokens exceeds max_num_tokens ({}) and enable_chunked_context is off",
                p.prompt.len(),
                s.max_num_tokens
            )));
        }
        Ok(p)
    }

    /// Sets (or with None clears) the iteration-statistics callback. When it returns, the
    /// previous callback is no longer running and is never called again (unless it is
    /// the caller: a callback may replace itself).
    pub fn set_stats_callback(&self, cb: Option<Arc<StatsCallback>>) {
        let mut slot = self.stats_cb.lock();
        slot.cb = cb;
        if ON_LOOP.with(|c| c.get()) == self as *const Engine as usize {
            return;
        }
        while slot.calling > 0 {
            self.stats_cv.wait(&mut slot);
        }
    }

    fn report(&self, json: &str) {
        let cb = {
            let mut slot = self.stats_cb.lock();
            let Some(cb) = slot.cb.clone() else {
                return;
            };
            slot.calling += 1;
            cb
        };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(json)));
        let mut slot = self.stats_cb.lock();
        slot.calling -= 1;
        drop(slot);
        self.stats_cv.notify_all();
    }
}

impl Kind for Engine {
    fn enqueue(
        &self,
        s: &Scheduler,
        req: Box<Request>,
        _shape_key: Option<crate::scheduler::ShapeKey>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        let model = &s.model;
        let p = self.parse(model.name_str(), req)?;
        let mut q = self.q.lock();
        if q.closed {
            drop(q);
            let e = Error::unavailable(format!("model '{}' is unloading", model.name_str()));
            return Err((p.req, e));
        }
        let max = self.settings.max_queue_size;
        if max > 0 && q.waiting.len() >= max {
            drop(q);
            let e = Error::exhausted(format!(
                "model '{}': {max} requests already wait for admission (max_queue_size {max})",
                model.name_str()
            ));
            return Err((p.req, e));
        }
        if p.deadline.is_some() {
            q.with_deadline += 1;
        }
        q.waiting.push_back(p);
        drop(q);
        self.cv.notify_one();
        Ok(())
    }

    fn pending(&self) -> usize {
        self.q.lock().waiting.len()
    }

    fn set_paused(&self, paused: bool) {
        self.q.lock().paused = paused;
        self.cv.notify_all();
    }

    fn close(&self) {
        self.q.lock().closed = true;
        self.cv.notify_all();
    }

    fn is_idle(&self) -> bool {
        let q = self.q.lock();
        q.waiting.is_empty() && q.running.is_empty() && q.ending.is_empty()
    }

    fn cancel_all(&self, why: &str) {
        let mut q = self.q.lock();
        let waiting: Vec<Pending> = q.waiting.drain(..).collect();
        q.with_deadline = 0;
        q.ending.extend(
            waiting
                .into_iter()
                .map(|p| (p.req, Error::cancelled(why.to_owned()))),
        );
        q.cancel_epoch += 1;
        q.cancel_reason = why.to_owned();
        drop(q);
        self.cv.notify_all();
    }

    fn cancel(&self, s: &Scheduler, id: u64) -> CancelOutcome {
        let model = &s.model;
        let mut q = self.q.lock();
        if let Some(i) = q.waiting.iter().position(|p| p.req.id == id) {
            if let Some(p) = q.waiting.remove(i) {
                if p.deadline.is_some() {
                    q.with_deadline -= 1;
                }
                let msg = format!(
                    "request {id} for model '{}' was cancelled",
                    model.name_str()
                );
                q.ending.push((p.req, Error::cancelled(msg)));
            }
            drop(q);
            self.cv.notify_all();
            return CancelOutcome::Cancelled;
        }
        if q.running.contains(&id) {
            q.cancel.insert(id);
            return CancelOutcome::Running;
        }
        CancelOutcome::NotFound
    }

    fn stats_json(&self, out: &mut String) {
        out.push_str(",\"generation\":");
        out.push_str(&self.gen_stats.json());
    }

    fn stats_prometheus(&self, out: &mut crate::stats::PromText, labels: &str) {
        self.gen_stats.prometheus(out, labels);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A FINAL response to deliver (without any lock) after the iteration, and whether the
/// request succeeded.
type Final = (ResponseSink, Box<Response>, bool);

/// One instance's loop and its state.
struct Loop<'a> {
    s: &'a Scheduler,
    e: &'a Engine,
    index: usize,
    exec: Box<dyn Executor>,
    bm: BlockManager,
    active: Vec<Seq>,
    /// Paused by preemption, resumed before new requests (oldest first).
    paused: VecDeque<Seq>,
    cancel_epoch: u64,
    logits: Vec<f32>,
    finals: Vec<Final>,
    ending: Vec<(Box<Request>, Error)>,
    iteration: u64,
    /// STATIC_BATCH: the running batch takes no new requests.
    batch_closed: bool,
    /// Time spent sampling in this iteration (model output processing, not scheduling).
    sample_time: Duration,
    /// Reused per iteration: (request index, logits row) to sample, and what was sampled.
    to_sample: Vec<(usize, usize)>,
    sampled: Vec<(u32, f32)>,
    scratch: Vec<(f32, u32)>,
    /// A logits row with penalties and biases applied.
    row: Vec<f32>,
}

/// Runs instance `index`'s iteration loop until the scheduler closes and everything is
/// answered.
pub(crate) fn run(s: &Scheduler, e: &Engine, index: usize, exec: Box<dyn Executor>) {
    ON_LOOP.with(|c| c.set(e as *const Engine as usize));
    let st = &e.settings;
    let mut lp = Loop {
        s,
        e,
        index,
        exec,
        bm: BlockManager::new(st.kv_blocks, st.tokens_per_block, st.prefix_reuse),
        active: Vec::new(),
        paused: VecDeque::new(),
        cancel_epoch: e.q.lock().cancel_epoch,
        logits: Vec::new(),
        finals: Vec::new(),
        ending: Vec::new(),
        iteration: 0,
        batch_closed: false,
        sample_time: Duration::ZERO,
        to_sample: Vec::new(),
        sampled: Vec::new(),
        scratch: Vec::new(),
        row: Vec::new(),
    };
    lp.publish_gauges();
    while lp.sync() {
        lp.deliver();
        lp.iterate();
        let t = Instant::now();
        if lp.deliver() {
            e.gen_stats
                .deliver_us
                .record(t.elapsed().as_micros() as u64);
        }
    }
    lp.deliver();
}

impl Loop<'_> {
    fn model(&self) -> &ModelIdentity {
        &self.s.model
    }

    /// Exchanges with the shared queue: picks up cancellations, expires waiting requests,
    /// admits new ones; waits when there is nothing to do. False when the loop is done.
    fn sync(&mut self) -> bool {
        let e = self.e;
        let mut q = e.q.lock();
        loop {
            self.ending.append(&mut q.ending);
            if q.cancel_epoch != self.cancel_epoch {
                self.cancel_epoch = q.cancel_epoch;
                let why = q.cancel_reason.clone();
                for seq in self.active.iter_mut().chain(self.paused.iter_mut()) {
                    seq.cancel
                        .get_or_insert_with(|| Error::cancelled(why.clone()));
                }
            }
            if !q.cancel.is_empty() {
                for seq in self.active.iter_mut().chain(self.paused.iter_mut()) {
                    if q.cancel.remove(&seq.p.req.id) {
                        let msg = format!(
                            "request {} for model '{}' was cancelled",
                            seq.p.req.id,
                            self.s.model.name_str()
                        );
                        seq.cancel.get_or_insert_with(|| Error::cancelled(msg));
                    }
                }
            }
            let now = Instant::now();
            if q.with_deadline > 0 {
                let mut kept = VecDeque::with_capacity(q.waiting.len());
                while let Some(p) = q.waiting.pop_front() {
                    if p.deadline.is_some_and(|d| d <= now) {
                        q.with_deadline -= 1;
                        let msg = format!(
                            "request {} for model '{}' timed out after {} us waiting for admission",
                            p.req.id,
                            self.s.model.name_str(),
                            p.req.timeout_us
                        );
                        self.ending.push((p.req, Error::deadline(msg)));
                    } else {
                        kept.push_back(p);
                    }
                }
                q.waiting = kept;
            }
            let ours = self.active.len() + self.paused.len();
            if !q.paused {
                self.admit(&mut q);
            }
            let has_cancel = self
                .active
                .iter()
                .chain(self.paused.iter())
                .any(|s| s.cancel.is_some());
            if !self.ending.is_empty() || has_cancel || (!q.paused && !self.active.is_empty()) {
                return true;
            }
            if q.closed && q.waiting.is_empty() && ours == 0 {
                return false;
            }
            // Nothing to run: sleep until a request, a resume, or the next deadline.
            let until = q
                .waiting
                .iter()
                .filter_map(|p| p.deadline)
                .min()
                .unwrap_or(now + Duration::from_secs(3600));
            self.publish_gauges();
            e.cv.wait_until(&mut q, until);
        }
    }

    /// Admits what the policy allows (under the queue lock; only bookkeeping).
    fn admit(&mut self, q: &mut Queue) {
        let st = &self.e.settings;
        if st.policy == Policy::StaticBatch {
            if !self.active.is_empty() || !self.paused.is_empty() {
                return;
            }
            self.batch_closed = false;
        }
        if self.batch_closed {
            return;
        }
        while self.active.len() < st.max_num_sequences {
            if let Some(seq) = self.paused.front() {
                if !self.fits(&seq.tokens, seq.reserve, true) {
                    break;
                }
                if let Some(mut seq) = self.paused.pop_front() {
                    self.resume(&mut seq);
                    q.running.insert(seq.p.req.id);
                    self.active.push(seq);
                }
                continue;
            }
            let Some(p) = q.waiting.front() else {
                break;
            };
            let reserve = self.e.blocks_for(self.e.final_len(p));
            if !self.fits(&p.prompt, reserve, false) {
                break;
            }
            let Some(p) = q.waiting.pop_front() else {
                break;
            };
            if p.deadline.is_some() {
                q.with_deadline -= 1;
            }
            q.running.insert(p.req.id);
            let seq = self.start(p, reserve);
            self.active.push(seq);
        }
        if st.policy == Policy::StaticBatch && !self.active.is_empty() {
            self.batch_closed = true;
        }
    }

    /// Blocks the running requests are still owed under a reserving policy.
    fn outstanding(&self) -> usize {
        match self.e.settings.policy {
            Policy::MaxUtilization => 0,
            _ => self
                .active
                .iter()
                .map(|s| s.reserve.saturating_sub(s.blocks.len()))
                .sum(),
        }
    }

    fn fits(&self, tokens: &[u32], reserve: usize, resuming: bool) -> bool {
        let tpb = self.bm.tokens_per_block();
        let max_prefix = (tokens.len() - 1) / tpb;
        let (matched, matched_idle) = self.bm.peek_prefix(tokens, max_prefix);
        let need = match self.e.settings.policy {
            Policy::MaxUtilization => {
                let len = if resuming {
                    tokens.len()
                } else {
                    tokens.len() + 1
                };
                self.bm.blocks_for(len)
            }
            _ => reserve,
        };
        let avail = self.bm.available().saturating_sub(self.outstanding());
        need.saturating_sub(matched) + matched_idle <= avail
    }

    fn start(&mut self, mut p: Pending, reserve: usize) -> Seq {
        let now = Instant::now();
        let queued = now.saturating_duration_since(p.req.enqueued_at);
        self.s.stats.queue_us.record(queued.as_micros() as u64);
        let mut seq = Seq {
            tokens: p.prompt.clone(),
            generated: 0,
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            rng: Rng::new(p.seed),
            log_probs: Vec::new(),
            streamed: 0,
            order: self.e.next_order.fetch_add(1, Relaxed),
            reserve,
            cached_tokens: 0,
            last_token_at: None,
            chunk: 0,
            cancel: None,
            sink: p.req.sink.take(),
            stream_out: false,
            wants_log_probs: self.e.log_probs_name.is_some()
                && p.req.wants_output(OUTPUT_LOG_PROBS),
            prompt_set: if p.penalties.repetition != 1.0 {
                let mut v = p.prompt.clone();
                v.sort_unstable();
                v.dedup();
                v
            } else {
                Vec::new()
            },
            counts: HashMap::new(),
            detok: Detokenizer::default(),
            text: String::new(),
            text_sent: 0,
            p,
        };
        self.take_prefix(&mut seq);
        seq
    }

    /// Resumes a preempted request: its tokens so far are recomputed (or found cached).
    fn resume(&mut self, seq: &mut Seq) {
        seq.order = self.e.next_order.fetch_add(1, Relaxed);
        self.take_prefix(seq);
    }

    fn take_prefix(&mut self, seq: &mut Seq) {
        let tpb = self.bm.tokens_per_block();
        let max_prefix = (seq.tokens.len() - 1) / tpb;
        let n = self
            .bm
            .acquire_prefix(&seq.tokens, max_prefix, &mut seq.blocks, &mut seq.hashes);
        seq.computed = n * tpb;
        if seq.generated == 0 {
            seq.cached_tokens = seq.computed;
        }
        self.e.gen_stats.reused_blocks.fetch_add(n as u64, Relaxed);
    }

    /// One iteration: end what must end, plan, step, sample, answer.
    fn iterate(&mut self) {
        let t0 = Instant::now();
        self.end_cancelled_and_expired();
        if self.active.is_empty() || self.e.q.lock().paused {
            return;
        }
        self.plan();
        // Preemption may have emptied the batch.
        if self.active.iter().all(|s| s.chunk == 0) {
            return;
        }
        let t_plan = t0.elapsed();
        let step_start = Instant::now();
        let result = {
            let work: Vec<Work<'_>> = self
                .active
                .iter()
                .filter(|s| s.chunk > 0)
                .map(|s| Work {
                    tokens: &s.tokens[s.computed..s.computed + s.chunk],
                    start: s.computed,
                    blocks: &s.blocks,
                    logits: s.computed + s.chunk == s.tokens.len(),
                })
                .collect();
            let exec = &mut self.exec;
            let logits = &mut self.logits;
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exec.step(&work, logits)))
                .unwrap_or_else(|p| {
                    Err(Error::internal(format!(
                        "the model's step panicked: {}",
                        crate::status::panic_message(&*p)
                    )))
                })
        };
        let step_us = step_start.elapsed().as_micros() as u64;
        let t_post = Instant::now();
        self.sample_time = Duration::ZERO;
        let (context_requests, context_tokens, generation_requests) = self.tally();
        self.iteration += 1;
        let gs = &self.e.gen_stats;
        gs.iterations.fetch_add(1, Relaxed);
        gs.context_tokens.fetch_add(context_tokens as u64, Relaxed);
        let scheduled = self.active.iter().filter(|s| s.chunk > 0).count();
        let finished = match result {
            Ok(()) => self.advance(),
            Err(err) => {
                let err = err.context(format!("model '{}'", self.s.model.name_str()));
                self.fail_scheduled(err)
            }
        };
        self.s
            .stats
            .record_execution(scheduled as u32, finished as u64, step_us);
        // An iteration's phases: planning it, the step, and delivering its tokens.
        self.s.stats.record_phases(
            t_plan,
            std::time::Duration::from_micros(step_us),
            t_post.elapsed(),
        );
        self.publish_gauges();
        let sample_us = self.sample_time.as_micros() as u64;
        let sched_us = (t_plan + t_post.elapsed())
            .saturating_sub(self.sample_time)
            .as_micros() as u64;
        gs.scheduler_us.record(sched_us);
        if self.e.stats_cb.lock().cb.is_some() {
            let json = self.iteration_json(
                scheduled,
                context_requests,
                context_tokens,
                generation_requests,
                finished,
                step_us,
                sample_us,
                sched_us,
            );
            self.e.report(&json);
        }
    }

    fn tally(&self) -> (usize, usize, usize) {
        let mut ctx_req = 0;
        let mut ctx_tok = 0;
        let mut gen_req = 0;
        for s in self.active.iter().filter(|s| s.chunk > 0) {
            if s.in_context() {
                ctx_req += 1;
                ctx_tok += s.chunk;
            } else {
                gen_req += 1;
            }
        }
        (ctx_req, ctx_tok, gen_req)
    }

    #[allow(clippy::too_many_arguments)]
    fn iteration_json(
        &self,
        scheduled: usize,
        context_requests: usize,
        context_tokens: usize,
        generation_requests: usize,
        finished: usize,
        step_us: u64,
        sample_us: u64,
        scheduler_us: u64,
    ) -> String {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let queued = self.e.q.lock().waiting.len();
        format!(
            "{{\"timestamp_us\":{ts},\"model\":{},\"version\":{},\"instance\":{},\"iteration\":{},\"active_requests\":{},\"max_requests\":{},\"scheduled_requests\":{scheduled},\"context_requests\":{context_requests},\"generation_requests\":{generation_requests},\"context_tokens\":{context_tokens},\"finished_requests\":{finished},\"queued_requests\":{queued},\"paused_requests\":{},\"kv_blocks_max\":{},\"kv_blocks_used\":{},\"kv_blocks_free\":{},\"kv_blocks_cached\":{},\"tokens_per_block\":{},\"step_us\":{step_us},\"sample_us\":{sample_us},\"scheduler_us\":{scheduler_us}}}",
            serde_json::Value::String(self.s.model.name_str().to_owned()),
            self.s.model.version,
            self.index,
            self.iteration,
            self.active.len(),
            self.e.settings.max_num_sequences,
            self.paused.len(),
            self.bm.num_blocks(),
            self.bm.used(),
            self.bm.available(),
            self.bm.cached_idle(),
            self.bm.tokens_per_block(),
        )
    }

    fn publish_gauges(&self) {
        self.e.gen_stats.set_gauges(
            self.index,
            [
                self.active.len() as u64,
                self.paused.len() as u64,
                self.bm.used() as u64,
                self.bm.available() as u64,
                self.bm.num_blocks() as u64,
            ],
        );
    }

    /// Answers cancelled requests and running requests past their deadline.
    fn end_cancelled_and_expired(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.active.len() {
            let seq = &mut self.active[i];
            let err = seq.cancel.take().or_else(|| {
                seq.p.deadline.filter(|d| *d <= now).map(|_| {
                    Error::deadline(format!(
                        "request {} for model '{}' timed out after {} us ({} tokens generated)",
                        seq.p.req.id,
                        self.s.model.name_str(),
                        seq.p.req.timeout_us,
                        seq.generated
                    ))
                })
            });
            match err {
                Some(err) => {
                    let seq = self.active.swap_remove(i);
                    self.finish(seq, Finish::Error(err));
                }
                None => i += 1,
            }
        }
        let mut kept = VecDeque::with_capacity(self.paused.len());
        while let Some(mut seq) = self.paused.pop_front() {
            let expired = seq.p.deadline.is_some_and(|d| d <= now);
            match seq.cancel.take() {
                Some(err) => self.finish(seq, Finish::Error(err)),
                None if expired => {
                    let err = Error::deadline(format!(
                        "request {} for model '{}' timed out after {} us (paused for KV cache space)",
                        seq.p.req.id,
                        self.s.model.name_str(),
                        seq.p.req.timeout_us
                    ));
                    self.finish(seq, Finish::Error(err));
                }
                None => kept.push_back(seq),
            }
        }
        self.paused = kept;
        // Oldest first: the scheduling order below relies on it.
        self.active.sort_by_key(|s| s.order);
    }

    /// Decides each active request's tokens for this step and makes sure its blocks are
    /// there, pausing the newest requests when blocks run out (MAX_UTILIZATION).
    fn plan(&mut self) {
        let st = &self.e.settings;
        let mut budget = st.max_num_tokens;
        for s in self.active.iter_mut() {
            s.chunk = 0;
            if !s.in_context() {
                s.chunk = 1;
                budget -= 1;
            }
        }
        for s in self.active.iter_mut().filter(|s| s.in_context()) {
            let remaining = s.remaining();
            // Recomputation after preemption may always be chunked: the result is the same.
            let may_chunk = st.chunked_context || s.generated > 0;
            s.chunk = if remaining <= budget {
                remaining
            } else if may_chunk {
                budget
            } else {
                0
            };
            budget -= s.chunk;
        }
        // Blocks, oldest first.
        let mut i = 0;
        while i < self.active.len() {
            let s = &self.active[i];
            let need = self.bm.blocks_for(s.computed + s.chunk);
            if s.blocks.len() >= need {
                i += 1;
                continue;
            }
            match self.bm.allocate() {
                Some(b) => self.active[i].blocks.push(b),
                None => {
                    if self.e.settings.policy != Policy::MaxUtilization {
                        // The reservation makes this unreachable; fail safe, not silent.
                        let seq = self.active.remove(i);
                        let err = Error::internal(format!(
                            "model '{}': KV cache accounting ran out of blocks for request {}",
                            self.s.model.name_str(),
                            seq.p.req.id
                        ));
                        self.finish(seq, Finish::Error(err));
                        continue;
                    }
                    if self.active.len() == 1 {
                        // Alone, it has the whole cache: it can never grow further.
                        let seq = self.active.remove(i);
                        let err = Error::exhausted(format!(
                            "model '{}': request {} outgrew the KV cache ({} blocks of {} tokens) at {} tokens, with no other request to pause",
                            self.s.model.name_str(),
                            seq.p.req.id,
                            self.bm.num_blocks(),
                            self.bm.tokens_per_block(),
                            seq.tokens.len()
                        ));
                        self.finish(seq, Finish::Error(err));
                        break;
                    }
                    // Pause the newest request (possibly this one) and try again.
                    let Some(victim) = self.active.pop() else {
                        break;
                    };
                    self.preempt(victim);
                    if i >= self.active.len() {
                        break;
                    }
                }
            }
        }
    }

    fn preempt(&mut self, mut seq: Seq) {
        self.bm.release(&seq.blocks);
        seq.blocks.clear();
        seq.hashes.clear();
        seq.computed = 0;
        seq.chunk = 0;
        // It stays in `running`: cancel finds it while it waits to resume.
        self.e.gen_stats.preemptions.fetch_add(1, Relaxed);
        // Resumed before newer paused requests: keep the queue in admission order.
        let at = self
            .paused
            .iter()
            .position(|p| p.order > seq.order)
            .unwrap_or(self.paused.len());
        self.paused.insert(at, seq);
    }

    /// After a successful step: register full blocks, sample, stream, retire. Returns the
    /// number of requests that finished.
    fn advance(&mut self) -> usize {
        let vocab = self.e.limits.vocab_size;
        let n_positions = self.e.limits.n_positions;
        let mut finished: Vec<(usize, Finish)> = Vec::new();
        let now = Instant::now();
        let gs = &self.e.gen_stats;
        let reuse = self.e.settings.prefix_reuse;
        // Positions computed; which requests sample, with their logits row.
        let mut to_sample = std::mem::take(&mut self.to_sample);
        to_sample.clear();
        for (i, seq) in self.active.iter_mut().enumerate() {
            if seq.chunk == 0 {
                continue;
            }
            seq.computed += seq.chunk;
            seq.chunk = 0;
            if reuse {
                register_blocks(&mut self.bm, seq);
            }
            if seq.computed == seq.tokens.len() {
                to_sample.push((i, to_sample.len()));
            }
        }
        if self.logits.len() < to_sample.len() * vocab {
            let err = Error::internal(format!(
                "model '{}': the step returned {} logits for {} rows of {vocab}",
                self.s.model.name_str(),
                self.logits.len(),
                to_sample.len()
            ));
            finished.extend(
                to_sample
                    .drain(..)
                    .map(|(i, _)| (i, Finish::Error(err.clone()))),
            );
        }
        // Sampling (timed apart: it is model output processing, not scheduling).
        let t = Instant::now();
        let mut sampled = std::mem::take(&mut self.sampled);
        sampled.clear();
        for &(i, row) in &to_sample {
            let logits = &self.logits[row * vocab..(row + 1) * vocab];
            let seq = &mut self.active[i];
            // Penalties and biases change a copy: log-probs stay the model's.
            let shaped = if seq.p.penalties.is_none() && seq.p.logit_bias.is_empty() {
                logits
            } else {
                self.row.clear();
                self.row.extend_from_slice(logits);
                penalize(
                    &mut self.row,
                    &seq.p.penalties,
                    &seq.prompt_set,
                    &seq.counts,
                );
                for &(t, b) in &seq.p.logit_bias {
                    if let Some(l) = self.row.get_mut(t as usize) {
                        *l += b;
                    }
                }
                &self.row
            };
            let (token, _) = sample(shaped, &seq.p.sampling, &mut seq.rng, &mut self.scratch);
            let log_prob = if seq.wants_log_probs {
                model_log_prob(logits, token)
            } else {
                0.0
            };
            sampled.push((token, log_prob));
        }
        self.sample_time += t.elapsed();
        gs.generated_tokens.fetch_add(sampled.len() as u64, Relaxed);
        for (&(i, _), &(token, log_prob)) in to_sample.iter().zip(&sampled) {
            let seq = &mut self.active[i];
            match seq.last_token_at {
                None => gs.time_to_first_token_us.record(
                    now.saturating_duration_since(seq.p.req.enqueued_at)
                        .as_micros() as u64,
                ),
                Some(t) => gs
                    .inter_token_us
                    .record(now.saturating_duration_since(t).as_micros() as u64),
            }
            seq.last_token_at = Some(now);
            if seq.p.end_ids.contains(&token) {
                finished.push((i, Finish::EndId));
                continue;
            }
            seq.tokens.push(token);
            if seq.wants_log_probs {
                seq.log_probs.push(log_prob);
            }
            seq.generated += 1;
            if !seq.p.penalties.is_none() {
                *seq.counts.entry(token).or_insert(0) += 1;
            }
            if let (true, Some(codec)) = (seq.p.decodes(), &self.e.vocab.text) {
                if decode_more(codec, seq, false) {
                    finished.push((i, Finish::Stop));
                    continue;
                }
            }
            if seq.generated >= seq.p.max_tokens || seq.tokens.len() >= n_positions {
                finished.push((i, Finish::Length));
            }
        }
        self.to_sample = to_sample;
        self.sampled = sampled;
        let count = finished.len();
        // Stream the new tokens of the requests that go on.
        let mut done = vec![false; self.active.len()];
        for (i, _) in &finished {
            done[*i] = true;
        }
        for (i, seq) in self.active.iter_mut().enumerate() {
            if done[i] || !seq.p.streaming || seq.generated <= seq.streamed {
                continue;
            }
            seq.stream_out = true;
        }
        // Retire finished requests (highest index first so indices stay valid).
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, why) in finished {
            let seq = self.active.swap_remove(i);
            self.finish(seq, why);
        }
        count
    }

    /// The step failed: every scheduled request ends with the error.
    fn fail_scheduled(&mut self, err: Error) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].chunk > 0 {
                let seq = self.active.swap_remove(i);
                self.finish(seq, Finish::Error(err.clone()));
                n += 1;
            } else {
                i += 1;
            }
        }
        n
    }

    /// Frees a request's blocks and queues its FINAL response.
    fn finish(&mut self, mut seq: Seq, why: Finish) {
        self.bm.release(&seq.blocks);
        seq.blocks.clear();
        self.e.q.lock().running.remove(&seq.p.req.id);
        if let (true, true, Some(codec)) = (
            seq.p.decodes(),
            matches!(why, Finish::Length | Finish::EndId),
            &self.e.vocab.text,
        ) {
            // What is left of an incomplete character, and a last look for a stop string.
            decode_more(codec, &mut seq, true);
        }
        let from = if seq.p.streaming { seq.streamed } else { 0 };
        let text_from = if seq.p.streaming { seq.text_sent } else { 0 };
        let mut resp = response(self.e, &self.s.model, &seq, from, text_from..seq.text.len());
        let reason = finish_reason(&why);
        let ok = matches!(why, Finish::Length | Finish::EndId | Finish::Stop);
        if let Finish::Error(e) = why {
            resp.status = e.code;
            resp.error = Some(CString::new(e.message.replace('\0', " ")).unwrap_or_default());
        }
        push_finish(
            &mut resp,
            reason,
            [seq.p.prompt.len(), seq.generated, seq.cached_tokens],
        );
        if let Some(sink) = seq.sink.take() {
            self.finals.push((sink, resp, ok));
        }
    }

    /// Runs the callbacks (no lock held). Returns whether there was anything to deliver.
    fn deliver(&mut self) -> bool {
        let mut any = !self.ending.is_empty() || !self.finals.is_empty();
        for (mut req, err) in std::mem::take(&mut self.ending) {
            self.s.stats.failure_count.fetch_add(1, Relaxed);
            let reason = finish_reason(&Finish::Error(err.clone()));
            let mut resp = Response::error(req.id, self.model(), &req.correlation_id, err);
            let prompt = req
                .input(INPUT_IDS)
                .and_then(|t| t.shape.first().copied())
                .unwrap_or(0);
            push_finish(&mut resp, reason, [prompt.max(0) as usize, 0, 0]);
            if let Some(sink) = req.sink.take() {
                sink.send_final(resp);
            }
        }
        // Stream responses are built here, after the iteration's bookkeeping, with the
        // callbacks.
        for seq in self.active.iter_mut() {
            if !std::mem::take(&mut seq.stream_out) {
                continue;
            }
            any = true;
            // Text that may be the start of a stop string waits.
            let text_to = seq.text.len() - seq.p.stop.held(&seq.text);
            let text_to = text_to.max(seq.text_sent);
            let resp = response(
                self.e,
                &self.s.model,
                seq,
                seq.streamed,
                seq.text_sent..text_to,
            );
            seq.streamed = seq.generated;
            seq.text_sent = text_to;
            if let Some(sink) = seq.sink.as_mut() {
                sink.send(resp);
            }
        }
        for (sink, resp, ok) in std::mem::take(&mut self.finals) {
            let c = if ok {
                &self.s.stats.success_count
            } else {
                &self.s.stats.failure_count
            };
            c.fetch_add(1, Relaxed);
            sink.send_final(resp);
        }
        any
    }
}

fn register_blocks(bm: &mut BlockManager, seq: &mut Seq) {
    let tpb = bm.tokens_per_block();
    while seq.hashes.len() < seq.computed / tpb {
        let i = seq.hashes.len();
        let parent = if i == 0 { ROOT } else { seq.hashes[i - 1] };
        let h = bm.register_full(seq.blocks[i], parent, &seq.tokens[i * tpb..(i + 1) * tpb]);
        seq.hashes.push(h);
    }
}

enum Finish {
    Length,
    EndId,
    /// A stop string was generated.
    Stop,
    Error(Error),
}

/// Decodes a sequence's new tokens into its text and looks for a stop string in what was
/// added; on one, the text ends where the stop string starts. Returns whether it stopped.
fn decode_more(codec: &TextCodec, seq: &mut Seq, flush: bool) -> bool {
    let prompt = seq.p.prompt.len();
    let piece = seq
        .detok
        .step(codec, &seq.tokens[prompt..], seq.p.skip_special, flush);
    if piece.is_empty() {
        return false;
    }
    seq.text.push_str(&piece);
    if seq.p.stop.is_empty() {
        return false;
    }
    match seq.p.stop.find(&seq.text, piece.len()) {
        Some(at) => {
            seq.text.truncate(at.max(seq.text_sent));
            true
        }
        None => false,
    }
}

/// The log-probability of `token` under the model's distribution (the softmax of the
/// logits, before temperature and truncation).
fn model_log_prob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let l = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    (f64::from(l - max) - sum.ln()) as f32
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        Finish::EndId => "end_id",
        Finish::Stop => "stop",
        Finish::Error(e) if e.code == Code::Cancelled => "cancelled",
        Finish::Error(_) => "error",
    }
}

/// The FINAL response's parameters: `finish_reason`, then `prompt_tokens`,
/// `generated_tokens` and `cached_tokens` (prompt tokens found in the prefix cache).
fn push_finish(resp: &mut Response, reason: &str, counts: [usize; 3]) {
    resp.parameters.push((
        CString::new("finish_reason").unwrap_or_default(),
        ParamValue::Str(CString::new(reason).unwrap_or_default()),
    ));
    for (k, v) in ["prompt_tokens", "generated_tokens", "cached_tokens"]
        .into_iter()
        .zip(counts)
    {
        resp.parameters.push((
            CString::new(k).unwrap_or_default(),
            ParamValue::Int(v as i64),
        ));
    }
}

/// A response with the generated tokens from index `from` on, and the bytes `text` of the
/// generated text.
fn response(
    e: &Engine,
    model: &ModelIdentity,
    seq: &Seq,
    from: usize,
    text: std::ops::Range<usize>,
) -> Box<Response> {
    let req = &seq.p.req;
    let mut resp = Response::ok(req.id, model, &req.correlation_id);
    let prompt = seq.p.prompt.len();
    let new = &seq.tokens[prompt + from.min(seq.generated)..prompt + seq.generated];
    if req.wants_output(OUTPUT_IDS) {
        let bytes: Vec<u8> = if e.out_int64 {
            new.iter()
                .flat_map(|&t| i64::from(t).to_le_bytes())
                .collect()
        } else {
            new.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect()
        };
        resp.outputs.push(OutputTensor {
            name: e.ids_name.clone(),
            dtype: if e.out_int64 {
                DataType::Int64
            } else {
                DataType::Int32
            },
            shape: Shape::from_slice(&[new.len() as i64]),
            data: TensorData::Owned(bytes),
        });
    }
    if let (Some(name), true) = (&e.log_probs_name, seq.wants_log_probs) {
        let lp = seq
            .log_probs
            .get(from.min(seq.generated)..seq.generated)
            .unwrap_or_default();
        resp.outputs.push(OutputTensor {
            name: name.clone(),
            dtype: DataType::Fp32,
            shape: Shape::from_slice(&[lp.len() as i64]),
            data: TensorData::Owned(lp.iter().flat_map(|v| v.to_le_bytes()).collect()),
        });
    }
    if let (Some(name), true) = (&e.text_name, seq.p.text_out) {
        let piece = seq.text.get(text).unwrap_or_default().as_bytes();
        let mut bytes = Vec::with_capacity(4 + piece.len());
        bytes.extend((piece.len() as u32).to_le_bytes());
        bytes.extend_from_slice(piece);
        resp.outputs.push(OutputTensor {
            name: name.clone(),
            dtype: DataType::Bytes,
            shape: Shape::from_slice(&[1]),
            data: TensorData::Owned(bytes),
        });
    }
    resp
}

/// The token ids of an `input_ids` tensor.
fn token_ids(m: &str, t: &crate::tensor::Tensor, vocab: usize) -> Result<Vec<u32>> {
    if t.shape.len() != 1 || t.shape[0] < 1 {
        return Err(Error::invalid(format!(
            "model '{m}': input '{INPUT_IDS}' must be a non-empty list of token ids (shape [n]), got shape {:?}",
            t.shape.as_slice()
        )));
    }
    let bytes = t.data.as_slice();
    let raw: Vec<i64> = match t.dtype {
        DataType::Int32 => bytes
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        DataType::Int64 => bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        other => {
            return Err(Error::invalid(format!(
                "model '{m}': input '{INPUT_IDS}' must be INT32 or INT64, not {}",
                other.as_str()
            )))
        }
    };
    raw.iter()
        .enumerate()
        .map(|(i, &v)| {
            u32::try_from(v)
                .ok()
                .filter(|&t| (t as usize) < vocab)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "model '{m}': input '{INPUT_IDS}'[{i}] = {v} is not a token id (the vocabulary has {vocab}: 0 to {})",
                        vocab.saturating_sub(1)
                    ))
                })
        })
        .collect()
}

/// The one UTF-8 string of a `text_input` tensor.
fn one_text(m: &str, t: &crate::tensor::Tensor) -> Result<String> {
    let d = t.data.as_slice();
    let bad = |why: &str| Error::invalid(format!("model '{m}': input '{TEXT_INPUT}' {why}"));
    if d.len() < 4 {
        return Err(bad("must hold one string"));
    }
    let n = u32::from_le_bytes([d[0], d[1], d[2], d[3]]) as usize;
    if d.len() != 4 + n {
        return Err(bad("must hold exactly one string"));
    }
    String::from_utf8(d[4..].to_vec()).map_err(|e| {
        bad(&format!(
            "is not UTF-8 text (invalid byte at {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// `v` quoted for a message, its middle cut out past 60 characters (a parameter may hold
/// megabytes).
fn quoted(v: &str) -> String {
    let n = v.chars().count();
    if n <= 60 {
        return format!("{v:?}");
    }
    let head: String = v.chars().take(40).collect();
    let tail: String = v.chars().skip(n - 12).collect();
    format!("{head:?} ... {tail:?} ({} bytes)", v.len())
}

/// Parameter `stop`: one stop string, or a JSON array of them.
fn parse_stop(m: &str, v: &str) -> Result<Vec<String>> {
    let list = match serde_json::from_str::<serde_json::Value>(v) {
        Ok(serde_json::Value::Array(a)) if v.trim_start().starts_with('[') => a
            .into_iter()
            .map(|x| match x {
                serde_json::Value::String(s) => Ok(s),
                other => Err(Error::invalid(format!(
                    "model '{m}': parameter 'stop': {} is not a string",
                    quoted(&other.to_string())
                ))),
            })
            .collect::<Result<Vec<_>>>()?,
        _ => vec![v.to_owned()],
    };
    if list.iter().any(String::is_empty) {
        return Err(Error::invalid(format!(
            "model '{m}': parameter 'stop' holds an empty string"
        )));
    }
    Ok(list)
}

/// Parameter `logit_bias`: a JSON object from token id to the bias added to its logit,
/// as the OpenAI API takes it (`{"50256": -100}`).
fn parse_logit_bias(m: &str, v: &str, vocab: usize) -> Result<Vec<(u32, f32)>> {
    let bad = |why: String| Error::invalid(format!("model '{m}': parameter 'logit_bias': {why}"));
    let obj = match serde_json::from_str::<serde_json::Value>(v) {
        Ok(serde_json::Value::Object(o)) => o,
        _ => {
            return Err(bad(format!(
                "{} is not a JSON object of token id to bias",
                quoted(v)
            )))
        }
    };
    let mut out = Vec::with_capacity(obj.len());
    for (k, b) in obj {
        let id: u32 = k
            .trim()
            .parse()
            .ok()
            .filter(|&i: &u32| (i as usize) < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "{} is not a token id (0 to {})",
                    quoted(&k),
                    vocab - 1
                ))
            })?;
        let b = b
            .as_f64()
            .filter(|b| b.is_finite() && (-100.0..=100.0).contains(b))
            .ok_or_else(|| bad(format!("the bias of {id} must be a number in [-100, 100]")))?;
        out.push((id, b as f32));
    }
    Ok(out)
}
