//! Every field of Triton's model config is either used or refused: a config that sets a
//! field libinfer does not implement fails to load with UNSUPPORTED naming the field,
//! instead of loading and behaving differently from Triton without a word.
//!
//! [`USED`] lists the fields libinfer reads (message fields too: setting a message,
//! even empty, can mean something, as `dynamic_batching { }` does); [`REFUSED`] gives the
//! reason for the fields known not to be implemented. A set field in neither is refused
//! too, so a field added to the schema is refused until it is implemented. "Set" is
//! protobuf's: a scalar at its default value (`decoupled: false`) is not set.

use crate::status::{Error, Result};
use prost_reflect::{DynamicMessage, Value};

/// The fields libinfer reads, as dotted paths from the config's root (map values and
/// list elements have their field's path).
pub(crate) const USED: &[&str] = &[
    "name",
    "platform",
    "backend",
    "version_policy",
    "version_policy.latest",
    "version_policy.latest.num_versions",
    "version_policy.all",
    "version_policy.specific",
    "version_policy.specific.versions",
    "max_batch_size",
    "input",
    "input.name",
    "input.data_type",
    // Checked as Triton checks it: NHWC and NCHW inputs have 3 dims.
    "input.format",
    "input.dims",
    "input.reshape",
    "input.reshape.shape",
    "input.allow_ragged_batch",
    "input.optional",
    "output",
    "output.name",
    "output.data_type",
    "output.dims",
    "output.reshape",
    "output.reshape.shape",
    // Triton reads the labels only for its classification extension, which a request
    // here cannot ask for: every request libinfer takes is answered as Triton answers it.
    "output.label_filename",
    "optimization",
    // The ONNX Runtime engine's; `onnx::onnxruntime::settings` refuses what it lacks.
    "optimization.graph",
    "optimization.graph.level",
    "optimization.execution_accelerators",
    "optimization.execution_accelerators.gpu_execution_accelerator",
    "optimization.execution_accelerators.gpu_execution_accelerator.name",
    "optimization.execution_accelerators.gpu_execution_accelerator.parameters",
    "optimization.execution_accelerators.cpu_execution_accelerator",
    "optimization.execution_accelerators.cpu_execution_accelerator.name",
    "optimization.execution_accelerators.cpu_execution_accelerator.parameters",
    // CUDA graphs of the GPU executor (for the graph_spec batch sizes); the parameter
    // cuda_graph_max_batch says the same.
    "optimization.cuda",
    "optimization.cuda.graphs",
    "optimization.cuda.graph_spec",
    "optimization.cuda.graph_spec.batch_size",
    // Host data is always staged through pinned memory: `enable: true` is what happens,
    // and an explicit `enable: false` is refused by [`check`].
    "optimization.input_pinned_memory",
    "optimization.input_pinned_memory.enable",
    "optimization.output_pinned_memory",
    "optimization.output_pinned_memory.enable",
    "dynamic_batching",
    "dynamic_batching.preferred_batch_size",
    "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preserve_ordering",
    "dynamic_batching.priority_levels",
    "dynamic_batching.default_priority_level",
    "dynamic_batching.default_queue_policy",
    "dynamic_batching.default_queue_policy.timeout_action",
    "dynamic_batching.default_queue_policy.default_timeout_microseconds",
    "dynamic_batching.default_queue_policy.allow_timeout_override",
    "dynamic_batching.default_queue_policy.max_queue_size",
    "dynamic_batching.priority_queue_policy",
    "dynamic_batching.priority_queue_policy.timeout_action",
    "dynamic_batching.priority_queue_policy.default_timeout_microseconds",
    "dynamic_batching.priority_queue_policy.allow_timeout_override",
    "dynamic_batching.priority_queue_policy.max_queue_size",
    "sequence_batching",
    "sequence_batching.max_sequence_idle_microseconds",
    "sequence_batching.control_input",
    "sequence_batching.control_input.name",
    "sequence_batching.control_input.control",
    "sequence_batching.control_input.control.kind",
    "sequence_batching.control_input.control.int32_false_true",
    "sequence_batching.control_input.control.fp32_false_true",
    "sequence_batching.control_input.control.data_type",
    "sequence_batching.control_input.control.bool_false_true",
    "sequence_batching.direct",
    "sequence_batching.direct.max_queue_delay_microseconds",
    "sequence_batching.direct.minimum_slot_utilization",
    "sequence_batching.oldest",
    "sequence_batching.oldest.max_candidate_sequences",
    "sequence_batching.oldest.preferred_batch_size",
    "sequence_batching.oldest.max_queue_delay_microseconds",
    "sequence_batching.oldest.preserve_ordering",
    "sequence_batching.state",
    "sequence_batching.state.input_name",
    "sequence_batching.state.output_name",
    "sequence_batching.state.data_type",
    "sequence_batching.state.dims",
    "sequence_batching.state.initial_state",
    "sequence_batching.state.initial_state.data_type",
    "sequence_batching.state.initial_state.dims",
    "sequence_batching.state.initial_state.zero_data",
    "sequence_batching.state.initial_state.data_file",
    "sequence_batching.state.initial_state.name",
    "ensemble_scheduling",
    "ensemble_scheduling.step",
    "ensemble_scheduling.step.model_name",
    "ensemble_scheduling.step.model_version",
    "ensemble_scheduling.step.input_map",
    "ensemble_scheduling.step.output_map",
    "ensemble_scheduling.step.max_inflight_requests",
    "ensemble_scheduling.step.max_queue_size",
    "instance_group",
    "instance_group.name",
    "instance_group.kind",
    "instance_group.count",
    // Loads and has no effect, as in Triton without --rate-limit (the load logs it).
    "instance_group.rate_limiter",
    "instance_group.rate_limiter.resources",
    "instance_group.rate_limiter.resources.name",
    "instance_group.rate_limiter.resources.global",
    "instance_group.rate_limiter.resources.count",
    "instance_group.rate_limiter.priority",
    "instance_group.gpus",
    "instance_group.cpus",
    "default_model_filename",
    // Labels of the model's Prometheus samples.
    "metric_tags",
    "parameters",
    "parameters.string_value",
    "model_warmup",
    "model_warmup.name",
    "model_warmup.batch_size",
    "model_warmup.inputs",
    "model_warmup.inputs.data_type",
    "model_warmup.inputs.dims",
    "model_warmup.inputs.zero_data",
    "model_warmup.inputs.random_data",
    "model_warmup.inputs.input_data_file",
    "model_warmup.count",
    "model_operations",
    // Generative models stream; the load refuses it for every other backend.
    "model_transaction_policy",
    "model_transaction_policy.decoupled",
    "model_repository_agents",
    "batch_input",
    "batch_input.kind",
    "batch_input.target_name",
    "batch_input.data_type",
    "batch_input.source_input",
    "batch_output",
    "batch_output.target_name",
    "batch_output.kind",
    "batch_output.source_input",
    "response_cache",
    // Checked against the server's cache and the model's kind at load.
    "response_cache.enable",
];

/// Fields refused with their reason.
pub(crate) const REFUSED: &[(&str, &str)] = &[
    (
        "runtime",
        "backends are chosen by backend and platform; no runtime library is loaded",
    ),
    ("input.is_shape_tensor", "shape tensors are TensorRT's"),
    (
        "input.is_non_linear_format_io",
        "non-linear I/O formats are TensorRT's",
    ),
    ("output.is_shape_tensor", "shape tensors are TensorRT's"),
    (
        "output.is_non_linear_format_io",
        "non-linear I/O formats are TensorRT's",
    ),
    (
        "optimization.priority",
        "execution priorities are not implemented",
    ),
    (
        "optimization.cuda.busy_wait_events",
        "workers poll a batch's event for 500 us, then sleep",
    ),
    (
        "optimization.cuda.output_copy_stream",
        "outputs are copied on the instance's stream",
    ),
    (
        "optimization.cuda.graph_spec.input",
        "the GPU executor captures a CUDA graph per batch size",
    ),
    (
        "optimization.cuda.graph_spec.graph_lower_bound",
        "the GPU executor captures a CUDA graph per batch size",
    ),
    (
        "optimization.gather_kernel_buffer_threshold",
        "inputs are gathered on the host",
    ),
    (
        "optimization.eager_batching",
        "the dynamic batcher forms a batch as Triton's does without it",
    ),
    (
        "sequence_batching.state.use_same_buffer_for_input_output",
        "implicit state is copied between executions",
    ),
    (
        "sequence_batching.state.use_growable_memory",
        "implicit state is copied between executions",
    ),
    (
        "sequence_batching.iterative_sequence",
        "iterative sequences are not implemented",
    ),
    (
        "ensemble_scheduling.step.model_namespace",
        "model namespaces are not implemented",
    ),
    (
        "instance_group.secondary_devices",
        "instances run on one device",
    ),
    (
        "instance_group.profile",
        "TensorRT optimization profiles are TensorRT's",
    ),
    ("instance_group.passive", "every instance is scheduled"),
    (
        "instance_group.host_policy",
        "host policies are not implemented; instance_group.cpus pins an instance's thread",
    ),
    (
        "cc_model_filenames",
        "the model file is default_model_filename on every device",
    ),
    (
        "model_operations.op_library_filename",
        "custom operation libraries are not loaded",
    ),
    (
        "model_repository_agents.agents",
        "repository agents (checksums, decryption) are not run",
    ),
];

/// Refuses the first set field that is not in [`USED`].
pub(crate) fn check(msg: &DynamicMessage, model: &str) -> Result<()> {
    walk(msg, "", model)?;
    // Set to an empty message, these say `enable: false`: what libinfer does not do.
    if let Some(Value::Message(o)) = msg.get_field_by_name("optimization").as_deref() {
        for f in ["input_pinned_memory", "output_pinned_memory"] {
            if o.has_field_by_name(f) {
                if let Some(Value::Message(m)) = o.get_field_by_name(f).as_deref() {
                    if m.fields().next().is_none() {
                        return Err(Error::unsupported(format!(
                            "model '{model}': optimization.{f}.enable: false is not supported (host data is always staged through pinned memory); remove it from the config"
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

fn walk(msg: &DynamicMessage, prefix: &str, model: &str) -> Result<()> {
    for (field, value) in msg.fields() {
        let path = join(prefix, field.name());
        if !USED.contains(&path.as_str()) {
            let named = deepest(&path, value);
            let reason = REFUSED
                .iter()
                .find(|(p, _)| named == *p || named.starts_with(&format!("{p}.")))
                .map_or("libinfer does not implement it", |(_, r)| r);
            return Err(Error::unsupported(format!(
                "model '{model}': {named} is not supported ({reason}); remove it from the config"
            )));
        }
        for_messages(value, &mut |m| walk(m, &path, model))?;
    }
    Ok(())
}

/// Calls `f` on the messages in a value (itself, a list's elements, a map's values).
fn for_messages(value: &Value, f: &mut dyn FnMut(&DynamicMessage) -> Result<()>) -> Result<()> {
    match value {
        Value::Message(m) => f(m),
        Value::List(items) => items.iter().try_for_each(|v| for_messages(v, f)),
        Value::Map(entries) => entries.values().try_for_each(|v| for_messages(v, f)),
        _ => Ok(()),
    }
}

/// The path of the first set field at the bottom of `value` (the leaf a user wrote).
fn deepest(path: &str, value: &Value) -> String {
    let mut first: Option<String> = None;
    let _ = for_messages(value, &mut |m| {
        if first.is_none() {
            if let Some((f, v)) = m.fields().next() {
                first = Some(deepest(&join(path, f.name()), v));
            }
        }
        Ok(())
    });
    first.unwrap_or_else(|| path.to_owned())
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

#[cfg(test)]
/// Every field path of the schema below `desc` (message fields and leaves), depth-first;
/// a message type met again on its own path is not entered twice.
pub(crate) fn schema_paths(desc: &prost_reflect::MessageDescriptor) -> Vec<(String, bool)> {
    use prost_reflect::Kind;
    fn go(
        d: &prost_reflect::MessageDescriptor,
        prefix: &str,
        seen: &mut Vec<String>,
        out: &mut Vec<(String, bool)>,
    ) {
        for f in d.fields() {
            let path = join(prefix, f.name());
            let target = match f.kind() {
                Kind::Message(m) if f.is_map() => match m.map_entry_value_field().kind() {
                    Kind::Message(v) => Some(v),
                    _ => None,
                },
                Kind::Message(m) => Some(m),
                _ => None,
            };
            out.push((path.clone(), target.is_none()));
            if let Some(m) = target {
                if !seen.contains(&m.full_name().to_owned()) {
                    seen.push(m.full_name().to_owned());
                    go(&m, &path, seen, out);
                    seen.pop();
                }
            }
        }
    }
    let mut out = Vec::new();
    go(desc, "", &mut vec![desc.full_name().to_owned()], &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;
    use prost_reflect::{Kind, MapKey, MessageDescriptor, ReflectMessage};

    /// A value for `field` that is not its default: `rest` set below it when it is a
    /// message, an element or an entry when it repeats.
    fn value_for(field: &prost_reflect::FieldDescriptor, rest: &[&str]) -> Value {
        let one = |kind: Kind| -> Value {
            match kind {
                Kind::Message(m) => {
                    let mut child = DynamicMessage::new(m);
                    if !rest.is_empty() {
                        set_path(&mut child, rest);
                    }
                    Value::Message(child)
                }
                Kind::Bool => Value::Bool(true),
                Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(1),
                Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(1),
                Kind::Uint32 | Kind::Fixed32 => Value::U32(1),
                Kind::Uint64 | Kind::Fixed64 => Value::U64(1),
                Kind::Float => Value::F32(1.0),
                Kind::Double => Value::F64(1.0),
                Kind::String => Value::String("x".into()),
                Kind::Bytes => Value::Bytes(vec![1u8].into()),
                Kind::Enum(_) => Value::EnumNumber(1),
            }
        };
        match field.kind() {
            Kind::Message(entry) if field.is_map() => {
                let v = one(entry.map_entry_value_field().kind());
                let key = match entry.map_entry_key_field().kind() {
                    Kind::String => MapKey::String("k".into()),
                    Kind::Uint64 => MapKey::U64(1),
                    Kind::Uint32 => MapKey::U32(1),
                    Kind::Int64 => MapKey::I64(1),
                    k => panic!("a map key of kind {k:?}"),
                };
                Value::Map([(key, v)].into_iter().collect())
            }
            k if field.is_list() => Value::List(vec![one(k)]),
            k => one(k),
        }
    }

    fn set_path(msg: &mut DynamicMessage, path: &[&str]) {
        let field = msg
            .descriptor()
            .get_field_by_name(path[0])
            .expect("a field of the schema");
        let v = value_for(&field, &path[1..]);
        msg.set_field(&field, v);
    }

    fn prefixes(path: &str) -> impl Iterator<Item = &str> {
        path.match_indices('.')
            .map(move |(i, _)| &path[..i])
            .chain(std::iter::once(path))
    }

    /// Each field of the schema, set alone (with the messages above it), is either used
    /// (the config passes this check) or refused with UNSUPPORTED naming that field.
    #[test]
    fn every_field_of_the_schema_is_used_or_refused_by_name() {
        let desc: MessageDescriptor = super::super::parse::descriptor_for_tests();
        let paths = schema_paths(&desc);
        for p in USED.iter().chain(REFUSED.iter().map(|(p, _)| p)) {
            assert!(
                paths.iter().any(|(q, _)| q == p),
                "'{p}' is not a field of the schema"
            );
        }
        for (p, _) in REFUSED {
            assert!(!USED.contains(p), "'{p}' is both used and refused");
        }
        let (mut used, mut refused) = (0, 0);
        for (path, _) in &paths {
            let mut msg = DynamicMessage::new(desc.clone());
            set_path(&mut msg, &path.split('.').collect::<Vec<_>>());
            let got = check(&msg, "m");
            let pinned_off = path.ends_with("_pinned_memory");
            if prefixes(path).all(|p| USED.contains(&p)) && !pinned_off {
                assert!(got.is_ok(), "{path}: {got:?}");
                used += 1;
                continue;
            }
            let e = got.expect_err(path);
            assert_eq!(e.code, Code::Unsupported, "{path}: {}", e.message);
            let named = if pinned_off {
                format!("{path}.enable: false")
            } else {
                path.clone()
            };
            assert!(
                e.message
                    .starts_with(&format!("model 'm': {named} is not supported (")),
                "{path}: {}",
                e.message
            );
            refused += 1;
        }
        // 169 field paths (a message met again on its own path is walked once): a field
        // moved from one table to the other changes these.
        assert_eq!(used + refused, paths.len());
        assert_eq!((used, refused), (136, 33));
    }

    /// Through the parser: a config with a field that is not implemented does not load.
    #[test]
    fn a_config_with_an_unimplemented_field_does_not_load() {
        for (extra, named) in [
            (
                "optimization { cuda { graphs: true busy_wait_events: true } }",
                "optimization.cuda.busy_wait_events",
            ),
            (
                "optimization { input_pinned_memory { enable: false } }",
                "optimization.input_pinned_memory.enable: false",
            ),
            (
                "instance_group [ { host_policy: \"numa0\" } ]",
                "instance_group.host_policy",
            ),
            (
                "input [ { name: \"z\" data_type: TYPE_FP32 dims: [ 1 ] is_shape_tensor: true } ]",
                "input.is_shape_tensor",
            ),
        ] {
            let text = format!(
                "name: \"m\" backend: \"b\" input [ {{ name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] }} ] {extra}"
            );
            let e = crate::config::parse_config(&text).expect_err(extra);
            assert_eq!(e.code, Code::Unsupported, "{}", e.message);
            assert!(
                e.message.contains(&format!("{named} is not supported")),
                "{}",
                e.message
            );
        }
        for ok in [
            "optimization { input_pinned_memory { enable: true } output_pinned_memory { enable: true } }",
            "response_cache { enable: false }",
            "model_transaction_policy { decoupled: false }",
        ] {
            let text = format!(
                "name: \"m\" backend: \"b\" input [ {{ name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] }} ] output [ {{ name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] }} ] {ok}"
            );
            crate::config::parse_config(&text).unwrap_or_else(|e| panic!("{ok}: {}", e.message));
        }
        let e = crate::config::parse_config(
            "name: \"m\" backend: \"b\" input [ { name: \"x\" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 1, 2 ] } ] output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] } ]",
        )
        .expect_err("NCHW with 2 dims");
        assert!(
            e.message
                .contains("input[0].format: model input NHWC/NCHW require 3 dims"),
            "{}",
            e.message
        );
    }
}
