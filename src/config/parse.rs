//! Reading a config's text (protobuf text format or JSON) into the schema compiled from
//! `proto/model_config.proto`, then handing the result to the checks in `validate`.
//!
//! Parsing goes through a dynamic message rather than straight into the generated types
//! so that syntax errors carry positions, unknown fields are refused, and the config can
//! be written back out as JSON with the schema's field names.

use super::{pb, validate, ModelConfig};
use crate::status::{Error, Result};
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};
use std::borrow::Cow;
use std::sync::OnceLock;

static DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/model_config.fds"));
const MESSAGE_NAME: &str = "inference.ModelConfig";

fn descriptor() -> Result<MessageDescriptor> {
    static DESC: OnceLock<Option<MessageDescriptor>> = OnceLock::new();
    DESC.get_or_init(|| {
        DescriptorPool::decode(DESCRIPTOR_SET)
            .ok()
            .and_then(|pool| pool.get_message_by_name(MESSAGE_NAME))
    })
    .clone()
    .ok_or_else(|| Error::internal("the built-in model config schema does not load"))
}

/// The schema's root message, for tests.
#[cfg(test)]
pub(crate) fn descriptor_for_tests() -> MessageDescriptor {
    descriptor().expect("the built-in schema")
}

/// Parses and checks a model configuration whose text must name the model.
pub fn parse_config(text: &str) -> Result<ModelConfig> {
    parse_config_named(text, None)
}

/// Parses and checks a model configuration. `name`, when given, is the name the caller
/// knows the model by (its directory in a repository): it fills in a config without
/// `name:`, and a config naming a different model is refused.
pub fn parse_config_named(text: &str, name: Option<&str>) -> Result<ModelConfig> {
    parse_raw(text, name)?.finish()
}

/// A configuration read against the schema but not yet checked: what auto-complete
/// (filling in what a model file declares) works on before [`RawConfig::finish`].
#[derive(Clone, Debug)]
pub struct RawConfig {
    pub(crate) pb: pb::ModelConfig,
    name: String,
}

impl RawConfig {
    /// The name the model is known by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks the configuration and converts it.
    pub fn finish(self) -> Result<ModelConfig> {
        let mut msg = DynamicMessage::new(descriptor()?);
        msg.transcode_from(&self.pb)
            .map_err(|e| Error::internal(format!("model config schema mismatch: {e}")))?;
        super::fields::check(&msg, &self.name)?;
        let json = to_json(&msg)?;
        validate::build(&self.pb, self.name, json)
    }
}

/// Reads a configuration's text (syntax and schema only; see [`parse_config_named`]).
pub fn parse_raw(text: &str, name: Option<&str>) -> Result<RawConfig> {
    let desc = descriptor()?;
    // A byte-order mark is invisible in editors; it would otherwise be a syntax error.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let msg = if text.trim_start().starts_with('{') {
        parse_json(desc, text)?
    } else {
        parse_text(desc, text)?
    };
    let mut config: pb::ModelConfig = msg
        .transcode_to()
        .map_err(|e| Error::internal(format!("model config schema mismatch: {e}")))?;
    let model_name = validate::resolve_name(&config.name, name)?;
    if config.name.is_empty() {
        config.name = model_name.clone();
    }
    Ok(RawConfig {
        pb: config,
        name: model_name,
    })
}

fn parse_text(desc: MessageDescriptor, text: &str) -> Result<DynamicMessage> {
    let (fixed, inserted) = insert_list_colons(text);
    DynamicMessage::parse_text_format(desc, &fixed).map_err(|e| {
        use miette::Diagnostic;
        // Errors without a span (end of input, bad map key) point at the end.
        let offset = e
            .labels()
            .and_then(|mut labels| labels.next())
            .map_or(fixed.len(), |label| label.offset());
        // Each inserted colon before `offset` moved it one byte on.
        let shift = inserted
            .iter()
            .enumerate()
            .take_while(|&(k, &at)| at + k < offset)
            .count();
        let (line, column) = line_column(text, offset.saturating_sub(shift));
        Error::invalid(format!("config line {line}:{column}: {e}"))
    })
}

/// Protobuf's text format lets a list of messages follow its field name without a colon
/// (`input [ { ... } ]`), and nearly every Triton config is written that way, but the
/// text-format parser in use insists on the colon. Returns the text with a colon after
/// every identifier that is followed by `[`, and the offsets (in `text`) where one went.
fn insert_list_colons(text: &str) -> (Cow<'_, str>, Vec<usize>) {
    let b = text.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut inserted = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'#' => i = skip_comment(b, i),
            quote @ (b'"' | b'\'') => {
                i += 1;
                while i < b.len() && b[i] != quote && b[i] != b'\n' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            // Numbers, including suffixes and exponents such as `1e5` or `2.5f`.
            c if c.is_ascii_digit() || c == b'.' => {
                while i < b.len() && (word(b[i]) || b[i] == b'.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                while i < b.len() && word(b[i]) {
                    i += 1;
                }
                let mut next = i;
                loop {
                    match b.get(next) {
                        Some(c) if c.is_ascii_whitespace() => next += 1,
                        Some(b'#') => next = skip_comment(b, next),
                        _ => break,
                    }
                }
                if b.get(next) == Some(&b'[') {
                    inserted.push(i);
                }
            }
            _ => i += 1,
        }
    }
    if inserted.is_empty() {
        return (Cow::Borrowed(text), inserted);
    }
    let mut fixed = String::with_capacity(text.len() + inserted.len());
    let mut from = 0;
    for &at in &inserted {
        fixed.push_str(&text[from..at]);
        fixed.push(':');
        from = at;
    }
    fixed.push_str(&text[from..]);
    (Cow::Owned(fixed), inserted)
}

/// The offset just past the end of the comment that starts at `i`.
fn skip_comment(b: &[u8], i: usize) -> usize {
    b[i..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |n| i + n + 1)
}

fn parse_json(desc: MessageDescriptor, text: &str) -> Result<DynamicMessage> {
    let mut de = serde_json::Deserializer::from_str(text);
    DynamicMessage::deserialize(desc, &mut de)
        .and_then(|msg| de.end().map(|()| msg))
        .map_err(|e| {
            // serde_json appends " at line L column C"; the position goes in front instead.
            let full = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let what = full.strip_suffix(&suffix).unwrap_or(&full);
            if e.line() == 0 {
                return Error::invalid(format!("config: {what}"));
            }
            Error::invalid(format!("config line {}:{}: {what}", e.line(), e.column()))
        })
}

/// 1-based line and column (in characters) of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

fn to_json(msg: &DynamicMessage) -> Result<String> {
    // Readers of this JSON (custom backends, the C API) get plain numbers, as Triton does.
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .stringify_64_bit_integers(false);
    let internal = |e: serde_json::Error| Error::internal(format!("model config to JSON: {e}"));
    let mut value = msg
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(internal)?;
    // Map fields come out in hash order; sorted keys make the text the same every time.
    value.sort_all_objects();
    serde_json::to_string(&value).map_err(internal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{
        DynamicBatching, InstanceKind, QueuePolicy, TensorConfig, TimeoutAction, VersionPolicy,
    };
    use crate::status::Code;
    use crate::tensor::DataType;

    const ADD_SUB: &str = r#"
# Triton's add_sub example, with every scheduling knob libinfer reads.
name: "add_sub"
backend: "python"
max_batch_size: 64
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] optional: true }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape: { shape: [ 4 ] } },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ -1 ] }
]
instance_group [
  { count: 2 kind: KIND_CPU cpus: [ 0, 1 ] },
  { name: "gpu" kind: KIND_GPU gpus: [ 0, 1 ] }
]
dynamic_batching {
  preferred_batch_size: [ 16, 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 5000000000
    allow_timeout_override: true max_queue_size: 100 }
  priority_queue_policy {
    key: 1
    value { timeout_action: REJECT default_timeout_microseconds: 1000 max_queue_size: 8 }
  }
  priority_queue_policy [ { key: 3 value: { max_queue_size: 2 } } ]
}
version_policy: { specific: { versions: [ 3, 1 ] } }
parameters {
  key: "EXECUTION_ENV_PATH"
  value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" }
}
parameters: { key: "threads" value: { string_value: "4" } }
default_model_filename: "model.py"
"#;

    const ADD_SUB_JSON: &str = r#"
{
  "name": "add_sub",
  "backend": "python",
  "max_batch_size": 64,
  "input": [
    {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
    {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": ["4"], "optional": true}
  ],
  "output": [
    {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [2, 2], "reshape": {"shape": [4]}},
    {"name": "OUTPUT1", "data_type": "TYPE_STRING", "dims": [-1]}
  ],
  "instance_group": [
    {"count": 2, "kind": "KIND_CPU", "cpus": [0, 1]},
    {"name": "gpu", "kind": "KIND_GPU", "gpus": [0, 1]}
  ],
  "dynamic_batching": {
    "preferred_batch_size": [16, 4, 8],
    "max_queue_delay_microseconds": "100",
    "preserve_ordering": true,
    "priority_levels": 3,
    "default_priority_level": "2",
    "default_queue_policy": {"timeout_action": "DELAY", "default_timeout_microseconds": 5000000000,
                             "allow_timeout_override": true, "max_queue_size": 100},
    "priority_queue_policy": {
      "1": {"timeout_action": "REJECT", "default_timeout_microseconds": "1000", "max_queue_size": 8},
      "3": {"max_queue_size": 2}
    }
  },
  "version_policy": {"specific": {"versions": [3, "1"]}},
  "parameters": {
    "EXECUTION_ENV_PATH": {"string_value": "$$TRITON_MODEL_DIRECTORY/env.tar.gz"},
    "threads": {"string_value": "4"}
  },
  "default_model_filename": "model.py"
}
"#;

    fn parse_err(text: &str) -> String {
        match parse_config(text) {
            Ok(c) => panic!("config parsed: {c:?}"),
            Err(e) => {
                assert_eq!(e.code, Code::InvalidArgument, "{e}");
                e.message
            }
        }
    }

    #[test]
    fn add_sub_text() {
        let c = parse_config(ADD_SUB).unwrap();
        assert_eq!(
            (&*c.name, &*c.backend, &*c.platform),
            ("add_sub", "python", "")
        );
        assert_eq!(c.max_batch_size, 64);
        let t = |t: &TensorConfig| (t.name.to_string(), t.data_type, t.dims.clone(), t.optional);
        let inputs: Vec<_> = c.inputs.iter().map(t).collect();
        let outputs: Vec<_> = c.outputs.iter().map(t).collect();
        let fp32 = DataType::Fp32;
        assert_eq!(
            inputs,
            [
                ("INPUT0".into(), fp32, vec![4], false),
                ("INPUT1".into(), fp32, vec![4], true)
            ]
        );
        assert_eq!(
            outputs,
            [
                ("OUTPUT0".into(), fp32, vec![2, 2], false),
                ("OUTPUT1".into(), DataType::Bytes, vec![-1], false)
            ]
        );
        assert_eq!(c.outputs[0].reshape, Some(vec![4]));
        assert_eq!(c.outputs[1].reshape, None);

        let g: Vec<_> = c
            .instance_groups
            .iter()
            .map(|g| (&*g.name, g.count, g.kind, &*g.gpus))
            .collect();
        assert_eq!(
            g,
            [
                ("add_sub_0", 2, InstanceKind::Cpu, &[][..]),
                ("gpu", 1, InstanceKind::Gpu, &[0, 1])
            ]
        );

        let policy =
            |timeout_action, default_timeout_us, allow_timeout_override, max_queue_size| {
                QueuePolicy {
                    timeout_action,
                    default_timeout_us,
                    allow_timeout_override,
                    max_queue_size,
                }
            };
        let expected = DynamicBatching {
            preferred_batch_size: vec![4, 8, 16],
            max_queue_delay_us: 100,
            preserve_ordering: true,
            priority_levels: 3,
            default_priority_level: 2,
            default_queue_policy: policy(TimeoutAction::Delay, 5_000_000_000, true, 100),
            priority_queue_policy: [
                (1, policy(TimeoutAction::Reject, 1000, false, 8)),
                (3, policy(TimeoutAction::Reject, 0, false, 2)),
            ]
            .into(),
        };
        let d = c.dynamic_batching.as_ref().unwrap();
        assert_eq!(*d, expected);
        assert_eq!(d.policy(2), d.default_queue_policy);

        assert_eq!(c.version_policy, VersionPolicy::Specific(vec![1, 3]));
        assert_eq!(c.parameters.len(), 2);
        assert_eq!(c.parameter_u64("threads").unwrap(), Some(4));
        assert_eq!(c.default_model_filename, "model.py");
        assert!(c.sequence_batching.is_none() && c.ensemble.is_none());
    }

    #[test]
    fn json_form_is_equal() {
        let text = parse_config(ADD_SUB).unwrap();
        let json = parse_config(ADD_SUB_JSON).unwrap();
        assert_eq!(format!("{text:?}"), format!("{json:?}"));
    }

    #[test]
    fn json_output() {
        let c = parse_config(ADD_SUB).unwrap();
        let v: serde_json::Value = serde_json::from_str(&c.json).unwrap();
        assert_eq!(v["name"], "add_sub");
        assert_eq!(v["max_batch_size"], 64);
        assert_eq!(v["input"][0]["data_type"], "TYPE_FP32");
        assert_eq!(v["input"][0]["dims"], serde_json::json!([4]));
        let d = &v["dynamic_batching"];
        assert_eq!(d["priority_levels"], 3);
        assert_eq!(
            d["default_queue_policy"]["default_timeout_microseconds"],
            5_000_000_000u64
        );
        assert_eq!(d["priority_queue_policy"]["1"]["max_queue_size"], 8);
        assert_eq!(v["instance_group"][0]["cpus"], serde_json::json!([0, 1]));
        assert_eq!(v["parameters"]["threads"]["string_value"], "4");
        // The JSON is itself a valid config.
        let again = parse_config(&c.json).unwrap();
        assert_eq!(format!("{again:?}"), format!("{c:?}"));
    }

    #[test]
    fn defaults() {
        let c = parse_config(
            "name: \"m\" platform: \"onnxruntime_onnx\"\n\
             input { name: \"x\" data_type: TYPE_BF16 dims: [] }\n\
             output { name: \"y\" data_type: TYPE_INT64 dims: [ 1 ] }",
        )
        .unwrap();
        assert_eq!(c.backend, "");
        assert_eq!(c.platform, "onnxruntime_onnx");
        assert_eq!(c.max_batch_size, 0);
        assert_eq!(c.inputs[0].data_type, DataType::Bf16);
        assert!(c.inputs[0].dims.is_empty());
        assert_eq!(c.version_policy, VersionPolicy::Latest(1));
        assert_eq!(c.instance_groups.len(), 1);
        assert_eq!(c.instance_groups[0].count, 1);
        assert_eq!(c.instance_groups[0].kind, InstanceKind::Auto);
        assert!(c.dynamic_batching.is_none());
        assert!(c.parameters.is_empty());
        let d = parse_config(
            "name: \"m\" backend: \"b\" max_batch_size: 8 dynamic_batching {}\n\
             version_policy { all {} }\n\
             input { name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] }\n\
             output { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] }\n\
             instance_group { count: 0 kind: KIND_CPU }",
        )
        .unwrap();
        assert_eq!(d.dynamic_batching.as_ref().unwrap().level_count(), 1);
        assert_eq!(
            d.dynamic_batching.as_ref().unwrap().default_priority_level,
            0
        );
        assert_eq!(d.version_policy, VersionPolicy::All);
        assert_eq!(d.instance_groups[0].count, 1);
    }

    #[test]
    fn real_world_configs() {
        let densenet = r#"
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
"#;
        let c = parse_config(densenet).unwrap();
        assert_eq!(c.inputs[0].reshape, Some(vec![1, 3, 224, 224]));

        let bert = r#"
name: "bert"
platform: "tensorrt_plan"
max_batch_size: 16
version_policy: { latest: { num_versions: 2 } }
input [
  { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true },
  { name: "segment_ids" data_type: TYPE_INT32 dims: [ -1 ] is_shape_tensor: false }
]
batch_input [
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "cu_seqlens" data_type: TYPE_INT32
    source_input: "input_ids" }
]
output [ { name: "logits" data_type: TYPE_FP16 dims: [ -1, 2 ] } ]
instance_group [
  {
    count: 2
    kind: KIND_GPU
    gpus: [ 0 ]
    rate_limiter { resources [ { name: "R1" count: 4 } ] priority: 2 }
    host_policy: "numa0"
  }
]
dynamic_batching { max_queue_delay_microseconds: 500 }
optimization {
  graph { level: 1 }
  priority: PRIORITY_MAX
  cuda { graphs: true busy_wait_events: true output_copy_stream: true
    graph_spec [ { batch_size: 4 input { key: "input_ids" value: { dim: [ 128 ] } } } ] }
  execution_accelerators {
    gpu_execution_accelerator : [ {
      name : "tensorrt"
      parameters { key: "precision_mode" value: "FP16" }
      parameters { key: "max_workspace_size_bytes" value: "1073741824" }
    } ]
    cpu_execution_accelerator : [ { name : "openvino" } ]
  }
  input_pinned_memory { enable: false }
  output_pinned_memory { enable: true }
  gather_kernel_buffer_threshold: 8
  eager_batching: true
}
model_warmup [
  {
    name: "zeros"
    batch_size: 8
    count: 3
    inputs {
      key: "input_ids"
      value: { data_type: TYPE_INT32 dims: [ 128 ] zero_data: true }
    }
    inputs [
      { key: "segment_ids" value: { data_type: TYPE_INT32 dims: [ 128 ] random_data: true } }
    ]
  }
]
response_cache { enable: true }
model_transaction_policy { decoupled: false }
model_operations { op_library_filename: [ "libcustom.so" ] }
model_repository_agents { agents [ { name: "checksum" parameters { key: "MD5:model.plan" value: "abc" } } ] }
cc_model_filenames [ { key: "8.6" value: "model_86.plan" } ]
metric_tags { key: "team" value: "nlp" }
runtime: "model.so"
"#;
        // Triton features not implemented are refused by name, one after another (in
        // the schema's field order), until the config loads.
        let mut bert = bert.to_owned();
        let mut fields = vec![
            ("runtime", "runtime: \"model.so\""),
            ("cc_model_filenames", "cc_model_filenames [ { key: \"8.6\" value: \"model_86.plan\" } ]"),
            (
                "model_operations.op_library_filename",
                "model_operations { op_library_filename: [ \"libcustom.so\" ] }",
            ),
            (
                "model_repository_agents.agents",
                "model_repository_agents { agents [ { name: \"checksum\" parameters { key: \"MD5:model.plan\" value: \"abc\" } } ] }",
            ),
            ("instance_group.host_policy", "host_policy: \"numa0\""),
            ("optimization.priority", "priority: PRIORITY_MAX"),
            ("optimization.cuda.busy_wait_events", "busy_wait_events: true"),
            ("optimization.cuda.output_copy_stream", "output_copy_stream: true"),
            (
                "optimization.cuda.graph_spec.input",
                " input { key: \"input_ids\" value: { dim: [ 128 ] } }",
            ),
            ("optimization.input_pinned_memory.enable: false", "input_pinned_memory { enable: false }"),
            ("optimization.gather_kernel_buffer_threshold", "gather_kernel_buffer_threshold: 8"),
            ("optimization.eager_batching", "eager_batching: true"),
        ];
        while !fields.is_empty() {
            let e = parse_config(&bert).unwrap_err();
            assert_eq!(e.code, crate::status::Code::Unsupported, "{e}");
            let i = (fields.iter())
                .position(|(f, _)| e.message.contains(&format!(": {f}")))
                .unwrap_or_else(|| panic!("refused a field not listed: {e}"));
            let (_, text) = fields.remove(i);
            // Drop the field (a bracketed list up to its closing line).
            let at = bert.find(text).unwrap();
            let end = if text.ends_with('[') {
                at + bert[at..].find("\n]\n").unwrap() + 2
            } else {
                at + text.len()
            };
            bert.replace_range(at..end, "");
        }
        let c = parse_config(&bert).unwrap();
        assert!(c.response_cache);
        assert_eq!(c.metric_tags, vec![("team".to_owned(), "nlp".to_owned())]);
        assert_eq!(c.version_policy, VersionPolicy::Latest(2));
        assert_eq!(
            c.instance_groups[0].rate_limiter,
            Some(crate::config::RateLimit {
                resources: vec![crate::config::RateResource {
                    name: "R1".into(),
                    global: false,
                    count: 4
                }],
                priority: 2
            })
        );
        assert_eq!(c.warmup.len(), 1);
        assert_eq!((c.warmup[0].batch_size, c.warmup[0].count), (8, 3));
        assert_eq!(c.warmup[0].inputs.len(), 2);
        assert!(!c.decoupled);
        assert!(c.inputs[0].allow_ragged_batch);
        assert_eq!(c.batch_inputs.len(), 1);
        assert_eq!(
            c.batch_input("cu_seqlens").map(|b| (b.kind, &*b.source)),
            Some((
                crate::config::BatchInputKind::AccumulatedElementCount,
                "input_ids"
            ))
        );
        assert_eq!(c.outputs[0].data_type, DataType::Fp16);
        assert_eq!(c.instance_groups[0].count, 2);
        assert_eq!(c.dynamic_batching.as_ref().unwrap().max_queue_delay_us, 500);
        assert!(c.json.contains("\"precision_mode\":\"FP16\""), "{}", c.json);

        let ensemble = r#"
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "CLASSES" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "preprocess" model_version: -1
      input_map { key: "in" value: "RAW" } output_map { key: "out" value: "img" } },
    { model_name: "classify" model_version: 2
      input_map { key: "x" value: "img" } output_map { key: "y" value: "CLASSES" } }
  ]
}
"#;
        let c = parse_config(ensemble).unwrap();
        assert!(c.ensemble.is_some() && c.sequence_batching.is_none());
        assert!(c.dynamic_batching.is_none());

        let sequence = r#"
name: "accumulate"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 100 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [
    { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ -1 ]
      initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zeros" } }
  ]
}
"#;
        let c = parse_config(sequence).unwrap();
        assert!(c.sequence_batching.is_some() && c.ensemble.is_none());
        let direct = sequence.replace(
            "oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 100 }",
            "direct { max_queue_delay_microseconds: 100 minimum_slot_utilization: 0.5 }",
        );
        assert!(parse_config(&direct).unwrap().sequence_batching.is_some());
    }

    #[test]
    fn names() {
        let body = "backend: \"b\"\n\
                    input { name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] }\n\
                    output { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] }";
        let c = parse_config_named(body, Some("dir")).unwrap();
        assert_eq!(c.name, "dir");
        assert!(c.json.contains("\"name\":\"dir\""), "{}", c.json);
        let named = format!("name: \"m\"\n{body}");
        assert_eq!(parse_config_named(&named, Some("m")).unwrap().name, "m");
        assert_eq!(parse_config_named(&named, None).unwrap().name, "m");
        let e = parse_config_named(&named, Some("other")).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(
            e.message.contains("'other'") && e.message.contains("'m'"),
            "{e}"
        );
        let e = parse_err(body);
        assert!(e.contains("name: empty"), "{e}");
        // A byte-order mark is ignored.
        assert_eq!(parse_config(&format!("\u{feff}{named}")).unwrap().name, "m");
    }

    #[test]
    fn text_syntax_error_position() {
        let e = parse_err("name: \"m\"\nbackend: \"b\"\nmax_batch_size: : 8\n");
        assert!(e.starts_with("config line 3:17: "), "{e}");
        let e = parse_err("name: \"m\"\ninput {\n  dims: [ 1, ]\n}\n");
        assert!(e.starts_with("config line 3:14: "), "{e}");
        let e = parse_err("name: \"m\"\ninput {\n");
        assert!(e.starts_with("config line 3:1: "), "{e}");
        assert!(e.contains("end of input"), "{e}");
        // Columns count characters, not bytes.
        let e = parse_err("name: \"é\" max_batch_size: x");
        assert!(e.starts_with("config line 1:27: "), "{e}");
        let e = parse_err("name: \"m\"\nmax_batch_size: \"eight\"");
        assert!(e.starts_with("config line 2:17: "), "{e}");
    }

    #[test]
    fn unknown_field() {
        let e = parse_err("name: \"m\"\n  max_batch: 8\n");
        assert!(e.starts_with("config line 2:3: "), "{e}");
        assert!(e.contains("'max_batch'"), "{e}");
        let e = parse_err("{\"name\": \"m\",\n \"max_batch\": 8}");
        assert!(e.starts_with("config line 2:"), "{e}");
        assert!(e.contains("'max_batch'"), "{e}");
    }

    #[test]
    fn wrong_enum_value() {
        let e = parse_err("name: \"m\"\ninput { name: \"x\" data_type: TYPE_FLOAT }");
        assert!(e.starts_with("config line 2:30: "), "{e}");
        assert!(e.contains("'TYPE_FLOAT'"), "{e}");
        let e = parse_err("{\"input\": [{\"data_type\": \"FP32\"}]}");
        assert!(e.contains("'FP32'"), "{e}");
        let e = parse_err("name: \"m\" instance_group { kind: KIND_TPU }");
        assert!(e.contains("'KIND_TPU'"), "{e}");
    }

    #[test]
    fn json_syntax_error_position() {
        let e = parse_err("{\n  \"name\": \"m\",\n  \"backend\" \"b\"\n}");
        assert!(e.starts_with("config line 3:13: "), "{e}");
        assert!(!e.contains("at line"), "{e}");
        let e = parse_err("{\"name\": \"m\"} trailing");
        assert!(e.starts_with("config line 1:"), "{e}");
        let e = parse_err("{\"max_batch_size\": \"many\"}");
        assert!(e.starts_with("config line 1:"), "{e}");
    }

    #[test]
    fn one_scheduler_only() {
        let e = parse_err("name: \"m\"\ndynamic_batching {}\nsequence_batching {}");
        assert!(e.starts_with("config line 3:19: "), "{e}");
        assert!(e.contains("oneof 'scheduling_choice'"), "{e}");
        let e = parse_err("{\"dynamic_batching\": {}, \"ensemble_scheduling\": {}}");
        assert!(e.contains("oneof"), "{e}");
    }

    #[test]
    fn list_without_colon() {
        let (fixed, at) = insert_list_colons("a [1] b: [2] c# x [\n[3] d[4] s: \"e [\" f { }");
        assert_eq!(fixed, "a: [1] b: [2] c:# x [\n[3] d:[4] s: \"e [\" f { }");
        assert_eq!(at, vec![1, 14, 25]);
        let (fixed, at) = insert_list_colons("x: 1.5e3 y: 'it\\'s [' z: \"\\\"[\"");
        assert_eq!(fixed, "x: 1.5e3 y: 'it\\'s [' z: \"\\\"[\"");
        assert!(at.is_empty());
        // Positions after an inserted colon still point into the original text.
        let e = parse_err("input[{ name: \"x\" }] output [ { nme: \"y\" } ]");
        assert!(e.starts_with("config line 1:33: "), "{e}");
    }

    #[test]
    fn line_columns() {
        assert_eq!(line_column("", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("ab\ncd", 99), (2, 3));
        assert_eq!(line_column("é", 1), (1, 1));
    }
}
