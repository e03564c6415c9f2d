//! Model configuration: Triton's `config.pbtxt` (protobuf text format) or the same schema
//! as JSON, parsed against a schema compiled at build time, then checked and turned into
//! the typed [`ModelConfig`] the rest of the library reads.
//!
//! This module owns parsing and validation only; it never looks at the file system.

mod fields;
mod parse;
pub(crate) mod schema;
mod validate;
pub use validate::limits;

pub use parse::{parse_config, parse_config_named, parse_raw, RawConfig};
pub(crate) use schema as pb;

use crate::tensor::DataType;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A checked model configuration.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub name: String,
    /// `backend:`; empty when only `platform:` is given.
    pub backend: String,
    pub platform: String,
    /// 0 = the model does not batch (no batch dimension).
    pub max_batch_size: u32,
    pub inputs: Vec<TensorConfig>,
    pub outputs: Vec<TensorConfig>,
    pub instance_groups: Vec<InstanceGroup>,
    pub dynamic_batching: Option<DynamicBatching>,
    pub sequence_batching: Option<SequenceBatching>,
    /// `ensemble_scheduling` (with `platform: "ensemble"`).
    pub ensemble: Option<Ensemble>,
    pub parameters: BTreeMap<String, String>,
    pub version_policy: VersionPolicy,
    pub default_model_filename: String,
    /// `optimization`, as written: the ONNX Runtime engine reads `graph` and
    /// `execution_accelerators` from it.
    pub(crate) optimization: Option<pb::ModelOptimizationPolicy>,
    /// `model_warmup`: samples each instance runs before the model is ready.
    pub warmup: Vec<Warmup>,
    /// `model_transaction_policy { decoupled }`: responses apart from requests (the
    /// generative backends stream so; other backends refuse it at load).
    pub decoupled: bool,
    /// `response_cache { enable }`: answers repeated requests from the server's response
    /// cache.
    pub response_cache: bool,
    /// `metric_tags`: labels added to every Prometheus sample of the model, sorted by name.
    pub metric_tags: Vec<(String, String)>,
    /// `batch_input`: inputs the library computes for each batch (ragged batching).
    pub batch_inputs: Vec<BatchInputConfig>,
    /// `batch_output`: outputs split back by the shape of an input (ragged batching).
    pub batch_outputs: Vec<BatchOutputConfig>,
    /// The whole configuration as JSON with Triton's field names (for
    /// `infer_server_model_config_json` and custom backends' `instance_init`).
    pub json: String,
}

/// One `model_warmup` sample: `count` executions (at least 1) of a batch of
/// `batch_size` rows (1 when the model does not batch) with these inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Warmup {
    pub name: String,
    pub batch_size: u32,
    pub count: u32,
    pub inputs: Vec<WarmupInput>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WarmupInput {
    pub name: Arc<str>,
    pub data_type: DataType,
    /// Without the batch dimension; no -1.
    pub dims: Vec<i64>,
    pub data: WarmupData,
}

#[derive(Clone, Debug, PartialEq)]
pub enum WarmupData {
    Zero,
    Random,
    /// A file under `<model_dir>/warmup/`: the tensor's bytes as a request would carry
    /// them (BYTES: each element a 4-byte little-endian length, then its bytes).
    File(String),
}

/// What a `batch_input` computes from its source input, per batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchInputKind {
    /// [requests]: each request's element count of the source.
    ElementCount,
    /// [requests]: the running sum of the element counts.
    AccumulatedElementCount,
    /// [requests + 1]: 0, then the running sum.
    AccumulatedElementCountWithZero,
    /// [max element count of a request]: only its shape means something (zeros).
    MaxElementCountAsShape,
    /// [rows, source rank - 1]: each batch row's shape of the source (batch dim left out).
    ItemShape,
    /// [rows x (source rank - 1)]: the same, flattened.
    ItemShapeFlatten,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BatchInputConfig {
    pub kind: BatchInputKind,
    /// The model inputs that receive the tensor (one or more names).
    pub targets: Vec<Arc<str>>,
    /// INT32, INT64 or FP32.
    pub data_type: DataType,
    /// The config input it describes.
    pub source: Arc<str>,
}

/// `batch_output` BATCH_SCATTER_WITH_INPUT_SHAPE: each request gets the next elements of
/// the target outputs, in the shape it gave its source input.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchOutputConfig {
    pub targets: Vec<Arc<str>>,
    pub source: Arc<str>,
}

impl ModelConfig {
    /// The `batch_input` a model input name is a target of.
    pub fn batch_input(&self, name: &str) -> Option<&BatchInputConfig> {
        (self.batch_inputs.iter()).find(|b| b.targets.iter().any(|t| &**t == name))
    }

    /// The source input of the `batch_output` an output is a target of.
    pub fn batch_output_source(&self, output: &str) -> Option<&Arc<str>> {
        (self.batch_outputs.iter())
            .find(|b| b.targets.iter().any(|t| &**t == output))
            .map(|b| &b.source)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorConfig {
    pub name: Arc<str>,
    pub data_type: DataType,
    /// Without the batch dimension; -1 = any size.
    pub dims: Vec<i64>,
    pub reshape: Option<Vec<i64>>,
    pub optional: bool,
    pub allow_ragged_batch: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceKind {
    Auto,
    Cpu,
    Gpu,
}

#[derive(Clone, Debug, PartialEq)]
pub struct InstanceGroup {
    pub name: String,
    /// At least 1.
    pub count: u32,
    pub kind: InstanceKind,
    pub gpus: Vec<i32>,
    /// CPU cores the group's worker threads are pinned to; empty = not pinned.
    pub cpus: Vec<u32>,
    /// `rate_limiter`, when it names resources or a priority: used when the server's
    /// rate limiter is on (as in Triton, whose rate limiter is off unless its server
    /// turns it on; the load says so in the log).
    pub rate_limiter: Option<RateLimit>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Distinct names.
    pub resources: Vec<RateResource>,
    /// 0 = 1.
    pub priority: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateResource {
    pub name: String,
    pub global: bool,
    pub count: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeoutAction {
    Reject,
    Delay,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuePolicy {
    pub timeout_action: TimeoutAction,
    /// 0 = no timeout.
    pub default_timeout_us: u64,
    pub allow_timeout_override: bool,
    /// 0 = unbounded.
    pub max_queue_size: u32,
}

impl Default for QueuePolicy {
    fn default() -> Self {
        QueuePolicy {
            timeout_action: TimeoutAction::Reject,
            default_timeout_us: 0,
            allow_timeout_override: false,
            max_queue_size: 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct DynamicBatching {
    /// Sorted ascending, unique, each <= max_batch_size.
    pub preferred_batch_size: Vec<u32>,
    pub max_queue_delay_us: u64,
    pub preserve_ordering: bool,
    /// 0 = priorities off (one level).
    pub priority_levels: u32,
    /// In 1..=priority_levels when priority_levels > 0, else 0.
    pub default_priority_level: u32,
    pub default_queue_policy: QueuePolicy,
    /// Per level (1-based) overrides of the default policy.
    pub priority_queue_policy: BTreeMap<u32, QueuePolicy>,
}

impl DynamicBatching {
    /// Number of queues the batcher keeps (at least one).
    pub fn level_count(&self) -> usize {
        self.priority_levels.max(1) as usize
    }
    /// The policy of a 1-based level (level 0 when priorities are off).
    pub fn policy(&self, level: u32) -> QueuePolicy {
        self.priority_queue_policy
            .get(&level)
            .copied()
            .unwrap_or(self.default_queue_policy)
    }
}

/// A pipeline of composing models.
#[derive(Clone, Debug, PartialEq)]
pub struct Ensemble {
    pub steps: Vec<EnsembleStep>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EnsembleStep {
    pub model_name: String,
    /// -1: the latest version.
    pub model_version: i64,
    /// (composing model input, ensemble tensor), sorted by input.
    pub input_map: Vec<(Arc<str>, Arc<str>)>,
    /// (composing model output, ensemble tensor), sorted by output.
    pub output_map: Vec<(Arc<str>, Arc<str>)>,
    /// 0 = no limit.
    pub max_inflight_requests: u32,
    /// Requests waiting for an in-flight place; 0 = no limit.
    pub max_queue_size: u32,
}

/// `sequence_batching`: stateful models whose requests form sequences.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceBatching {
    pub strategy: SequenceStrategy,
    /// A sequence with no request for this long loses its slot (default 1 s).
    pub max_sequence_idle_us: u64,
    pub controls: Vec<ControlInput>,
    pub states: Vec<StateConfig>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SequenceStrategy {
    /// One batch slot per sequence, for the sequence's whole life.
    Direct {
        max_queue_delay_us: u64,
        /// In 0..=1: the share of an instance's slots that must be ready before the delay
        /// runs out.
        minimum_slot_utilization: f32,
    },
    /// Sequences are candidates of one instance; batches are formed from their oldest
    /// requests by the dynamic batcher's decision.
    Oldest {
        /// At least 1.
        max_candidate_sequences: u32,
        /// Ascending, unique, each <= max_batch_size.
        preferred_batch_size: Vec<u32>,
        max_queue_delay_us: u64,
        preserve_ordering: bool,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlKind {
    Start,
    End,
    Ready,
    CorrId,
}

impl ControlKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ControlKind::Start => "CONTROL_SEQUENCE_START",
            ControlKind::End => "CONTROL_SEQUENCE_END",
            ControlKind::Ready => "CONTROL_SEQUENCE_READY",
            ControlKind::CorrId => "CONTROL_SEQUENCE_CORRID",
        }
    }
}

/// A control tensor the sequence batcher adds to every batch.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlInput {
    pub name: Arc<str>,
    pub kind: ControlKind,
    pub data_type: DataType,
    /// For START/END/READY: the element bytes of false and true (little-endian).
    pub false_true: Option<[Vec<u8>; 2]>,
}

/// Implicit state: `input_name` is fed from the previous request's `output_name`.
#[derive(Clone, Debug, PartialEq)]
pub struct StateConfig {
    pub input_name: Arc<str>,
    pub output_name: Arc<str>,
    pub data_type: DataType,
    /// Without the batch dimension; -1 = whatever the model writes.
    pub dims: Vec<i64>,
    pub initial: InitialState,
}

#[derive(Clone, Debug, PartialEq)]
pub enum InitialState {
    /// Zeros, with every variable dimension taken as 1.
    Default,
    Zero {
        dims: Vec<i64>,
    },
    /// Row-major data from `<model_dir>/initial_state/<file>`.
    File {
        dims: Vec<i64>,
        file: String,
    },
}

impl InitialState {
    /// The shape of the initial state of `state`.
    pub fn dims(&self, state: &StateConfig) -> Vec<i64> {
        match self {
            InitialState::Default => state.dims.iter().map(|&d| d.max(1)).collect(),
            InitialState::Zero { dims } | InitialState::File { dims, .. } => dims.clone(),
        }
    }
}

impl SequenceBatching {
    pub fn control(&self, kind: ControlKind) -> Option<&ControlInput> {
        self.controls.iter().find(|c| c.kind == kind)
    }
    pub fn state_by_output(&self, name: &str) -> Option<&StateConfig> {
        self.states.iter().find(|s| &*s.output_name == name)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VersionPolicy {
    /// The newest `n` versions (Triton's default is latest 1).
    Latest(u32),
    All,
    Specific(Vec<i64>),
}

impl ModelConfig {
    pub fn input(&self, name: &str) -> Option<&TensorConfig> {
        self.inputs.iter().find(|t| &*t.name == name)
    }
    pub fn output(&self, name: &str) -> Option<&TensorConfig> {
        self.outputs.iter().find(|t| &*t.name == name)
    }
    /// An integer `parameters { key: ... value { string_value: "..." } }` entry.
    pub fn parameter_u64(&self, key: &str) -> crate::status::Result<Option<u64>> {
        match self.parameters.get(key) {
            None => Ok(None),
            Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                crate::status::Error::invalid(format!(
                    "model '{}': parameter '{key}' must be a non-negative integer, got '{v}'",
                    self.name
                ))
            }),
        }
    }
}
