//! Semantic checks of a parsed configuration and its conversion into [`ModelConfig`].
//!
//! Every error is INVALID_ARGUMENT and reads `model 'NAME': FIELD.PATH: what is wrong`,
//! with the offending value in it, so that a user can find the line to fix.

use super::parse::pb;
use super::{
    DynamicBatching, InstanceGroup, InstanceKind, ModelConfig, QueuePolicy, TensorConfig,
    TimeoutAction, VersionPolicy,
};
use crate::status::{Error, Result};
use crate::tensor::{element_count, shape_string, DataType};
use std::collections::BTreeMap;
use std::fmt::Display;

/// The name the model is known by: the config's own, or `given` when the config has none.
pub(super) fn resolve_name(config_name: &str, given: Option<&str>) -> Result<String> {
    let given = given.filter(|g| !g.is_empty());
    match (config_name, given) {
        ("", None) => Err(Error::invalid(
            "model config: name: empty, and no model name was given",
        )),
        ("", Some(g)) => Ok(g.to_owned()),
        (c, Some(g)) if c != g => Err(Error::invalid(format!(
            "model '{g}': name: the config names a different model, '{c}'"
        ))),
        (c, _) => Ok(c.to_owned()),
    }
}

/// Checks `config` and converts it; `json` becomes [`ModelConfig::json`].
pub(super) fn build(config: &pb::ModelConfig, name: String, json: String) -> Result<ModelConfig> {
    let ck = Checker { model: &name };
    if config.backend.is_empty() && config.platform.is_empty() {
        return Err(ck.err("backend", "neither backend nor platform is set"));
    }
    let max_batch_size = u32::try_from(config.max_batch_size).map_err(|_| {
        ck.err(
            "max_batch_size",
            format!("{} is negative", config.max_batch_size),
        )
    })?;

    let inputs = ck.tensors("input", config.input.iter().map(TensorView::input))?;
    let outputs = ck.tensors("output", config.output.iter().map(TensorView::output))?;
    let instance_groups = ck.instance_groups(&config.instance_group)?;
    let version_policy = ck.version_policy(config.version_policy.as_ref())?;

    use pb::model_config::SchedulingChoice;
    let dynamic_batching = match &config.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(d)) => Some(ck.dynamic_batching(d, max_batch_size)?),
        _ => None,
    };
    let parameters = config
        .parameters
        .iter()
        .map(|(k, v)| (k.clone(), v.string_value.clone()))
        .collect();

    Ok(ModelConfig {
        backend: config.backend.clone(),
        platform: config.platform.clone(),
        max_batch_size,
        inputs,
        outputs,
        instance_groups,
        dynamic_batching,
        has_sequence_batching: matches!(
            config.scheduling_choice,
            Some(SchedulingChoice::SequenceBatching(_))
        ),
        has_ensemble_scheduling: matches!(
            config.scheduling_choice,
            Some(SchedulingChoice::EnsembleScheduling(_))
        ),
        parameters,
        version_policy,
        default_model_filename: config.default_model_filename.clone(),
        json,
        name,
    })
}

/// What inputs and outputs have in common.
struct TensorView<'a> {
    name: &'a str,
    data_type: i32,
    dims: &'a [i64],
    reshape: Option<&'a [i64]>,
    optional: bool,
    allow_ragged_batch: bool,
}

impl<'a> TensorView<'a> {
    fn input(t: &'a pb::ModelInput) -> Self {
        TensorView {
            name: &t.name,
            data_type: t.data_type,
            dims: &t.dims,
            reshape: t.reshape.as_ref().map(|r| r.shape.as_slice()),
            optional: t.optional,
            allow_ragged_batch: t.allow_ragged_batch,
        }
    }
    fn output(t: &'a pb::ModelOutput) -> Self {
        TensorView {
            name: &t.name,
            data_type: t.data_type,
            dims: &t.dims,
            reshape: t.reshape.as_ref().map(|r| r.shape.as_slice()),
            optional: false,
            allow_ragged_batch: false,
        }
    }
}

struct Checker<'a> {
    model: &'a str,
}

impl Checker<'_> {
    fn err(&self, path: impl Display, what: impl Display) -> Error {
        Error::invalid(format!("model '{}': {path}: {what}", self.model))
    }

    fn tensors<'t>(
        &self,
        kind: &str,
        views: impl Iterator<Item = TensorView<'t>>,
    ) -> Result<Vec<TensorConfig>> {
        let mut out: Vec<TensorConfig> = Vec::new();
        for (i, t) in views.enumerate() {
            let path = format!("{kind}[{i}]");
            if t.name.is_empty() {
                return Err(self.err(format_args!("{path}.name"), "empty"));
            }
            if let Some(j) = out.iter().position(|o| &*o.name == t.name) {
                return Err(self.err(
                    format_args!("{path}.name"),
                    format!("'{}' is already the name of {kind}[{j}]", t.name),
                ));
            }
            let data_type = self.data_type(&format!("{path}.data_type"), t.data_type, t.name)?;
            self.dims(&format!("{path}.dims"), t.dims, t.name)?;
            if let Some(shape) = t.reshape {
                let rpath = format!("{path}.reshape.shape");
                self.dims(&rpath, shape, t.name)?;
                let counts = (fixed_count(t.dims), fixed_count(shape));
                if let (Some(from), Some(to)) = counts {
                    if from != to {
                        return Err(self.err(
                            rpath,
                            format!(
                                "{} has {to} elements but dims {} of '{}' has {from}",
                                shape_string(shape),
                                shape_string(t.dims),
                                t.name
                            ),
                        ));
                    }
                }
            }
            out.push(TensorConfig {
                name: t.name.into(),
                data_type,
                dims: t.dims.to_vec(),
                reshape: t.reshape.map(<[i64]>::to_vec),
                optional: t.optional,
                allow_ragged_batch: t.allow_ragged_batch,
            });
        }
        if out.is_empty() {
            return Err(self.err(kind, format!("the model has no {kind}s")));
        }
        Ok(out)
    }

    fn data_type(&self, path: &str, value: i32, tensor: &str) -> Result<DataType> {
        let name = pb::DataType::try_from(value)
            .map_err(|_| self.err(path, format!("{value} is not a data type ('{tensor}')")))?
            .as_str_name();
        DataType::parse(name)
            .ok_or_else(|| self.err(path, format!("{name} is not allowed ('{tensor}')")))
    }

    fn dims(&self, path: &str, dims: &[i64], tensor: &str) -> Result<()> {
        const DIM_RULE: &str = "must be > 0, or -1 for any size";
        for (i, &d) in dims.iter().enumerate() {
            if d <= 0 && d != -1 {
                return Err(self.err(
                    format_args!("{path}[{i}]"),
                    format!("{d} is not a valid dimension of '{tensor}' ({DIM_RULE})"),
                ));
            }
        }
        if !dims.contains(&-1) && element_count(dims).is_none() {
            return Err(self.err(
                path,
                format!("{} of '{tensor}' has too many elements", shape_string(dims)),
            ));
        }
        Ok(())
    }

    fn instance_groups(&self, groups: &[pb::ModelInstanceGroup]) -> Result<Vec<InstanceGroup>> {
        use pb::model_instance_group::Kind;
        if groups.is_empty() {
            return Ok(vec![InstanceGroup {
                name: format!("{}_0", self.model),
                count: 1,
                kind: InstanceKind::Auto,
                gpus: Vec::new(),
            }]);
        }
        let mut out = Vec::with_capacity(groups.len());
        for (i, g) in groups.iter().enumerate() {
            let path = format!("instance_group[{i}]");
            let kind = match Kind::try_from(g.kind) {
                Ok(Kind::Auto) => InstanceKind::Auto,
                Ok(Kind::Gpu) => InstanceKind::Gpu,
                Ok(Kind::Cpu) => InstanceKind::Cpu,
                Ok(Kind::Model) => {
                    return Err(self.err(format_args!("{path}.kind"), "KIND_MODEL is not supported"))
                }
                Err(_) => {
                    return Err(self.err(
                        format_args!("{path}.kind"),
                        format!("{} is not an instance kind", g.kind),
                    ))
                }
            };
            let count = u32::try_from(g.count).map_err(|_| {
                self.err(
                    format_args!("{path}.count"),
                    format!("{} is negative", g.count),
                )
            })?;
            for (j, &gpu) in g.gpus.iter().enumerate() {
                if gpu < 0 {
                    return Err(self.err(
                        format_args!("{path}.gpus[{j}]"),
                        format!("{gpu} is negative"),
                    ));
                }
            }
            if kind == InstanceKind::Cpu && !g.gpus.is_empty() {
                return Err(self.err(
                    format_args!("{path}.gpus"),
                    format!("{:?} given for a KIND_CPU group", g.gpus),
                ));
            }
            for (j, &cpu) in g.cpus.iter().enumerate() {
                if cpu < 0 {
                    return Err(self.err(
                        format_args!("{path}.cpus[{j}]"),
                        format!("{cpu} is negative"),
                    ));
                }
            }
            out.push(InstanceGroup {
                name: if g.name.is_empty() {
                    format!("{}_{i}", self.model)
                } else {
                    g.name.clone()
                },
                count: count.max(1),
                kind,
                gpus: g.gpus.clone(),
            });
        }
        Ok(out)
    }

    fn version_policy(&self, policy: Option<&pb::ModelVersionPolicy>) -> Result<VersionPolicy> {
        use pb::model_version_policy::PolicyChoice;
        match policy.and_then(|p| p.policy_choice.as_ref()) {
            None => Ok(VersionPolicy::Latest(1)),
            Some(PolicyChoice::Latest(l)) if l.num_versions == 0 => Err(self.err(
                "version_policy.latest.num_versions",
                "0 would serve no version (must be >= 1)",
            )),
            Some(PolicyChoice::Latest(l)) => Ok(VersionPolicy::Latest(l.num_versions)),
            Some(PolicyChoice::All(_)) => Ok(VersionPolicy::All),
            Some(PolicyChoice::Specific(s)) => {
                if s.versions.is_empty() {
                    return Err(self.err("version_policy.specific.versions", "empty"));
                }
                if let Some((i, v)) = s.versions.iter().enumerate().find(|(_, &v)| v <= 0) {
                    return Err(self.err(
                        format_args!("version_policy.specific.versions[{i}]"),
                        format!("{v} must be > 0"),
                    ));
                }
                let mut versions = s.versions.clone();
                versions.sort_unstable();
                versions.dedup();
                Ok(VersionPolicy::Specific(versions))
            }
        }
    }

    fn dynamic_batching(
        &self,
        d: &pb::ModelDynamicBatching,
        max_batch_size: u32,
    ) -> Result<DynamicBatching> {
        let mut preferred: Vec<u32> = Vec::with_capacity(d.preferred_batch_size.len());
        for (i, &size) in d.preferred_batch_size.iter().enumerate() {
            let path = format!("dynamic_batching.preferred_batch_size[{i}]");
            let size = match u32::try_from(size) {
                Ok(s) if s > 0 => s,
                _ => return Err(self.err(path, format!("{size} must be > 0"))),
            };
            if size > max_batch_size {
                let why = if max_batch_size == 0 {
                    " (the model does not batch)"
                } else {
                    ""
                };
                return Err(self.err(
                    path,
                    format!("{size} exceeds max_batch_size {max_batch_size}{why}"),
                ));
            }
            if preferred.contains(&size) {
                return Err(self.err(path, format!("{size} is listed twice")));
            }
            preferred.push(size);
        }
        preferred.sort_unstable();

        let levels = u32::try_from(d.priority_levels).map_err(|_| {
            self.err(
                "dynamic_batching.priority_levels",
                format!("{} is too large", d.priority_levels),
            )
        })?;
        let default_level = d.default_priority_level;
        let level_range = format!("1..={levels}");
        let in_levels = |l: u64| l >= 1 && l <= u64::from(levels);
        if levels == 0 && default_level != 0 {
            return Err(self.err(
                "dynamic_batching.default_priority_level",
                format!("{default_level} is set but priority_levels is 0"),
            ));
        }
        if levels > 0 && !in_levels(default_level) {
            return Err(self.err(
                "dynamic_batching.default_priority_level",
                format!("{default_level} is not in {level_range} (priority_levels)"),
            ));
        }

        let default_queue_policy = self.queue_policy(
            "dynamic_batching.default_queue_policy",
            d.default_queue_policy.as_ref(),
        )?;
        let mut priority_queue_policy = BTreeMap::new();
        for (&level, policy) in &d.priority_queue_policy {
            let path = format!("dynamic_batching.priority_queue_policy[{level}]");
            let level = match u32::try_from(level) {
                Ok(l) if in_levels(level) => l,
                _ if levels == 0 => {
                    return Err(
                        self.err(path, format!("level {level} set but priority_levels is 0"))
                    )
                }
                _ => {
                    return Err(self.err(
                        path,
                        format!("level {level} is not in {level_range} (priority_levels)"),
                    ))
                }
            };
            priority_queue_policy.insert(level, self.queue_policy(&path, Some(policy))?);
        }

        Ok(DynamicBatching {
            preferred_batch_size: preferred,
            max_queue_delay_us: d.max_queue_delay_microseconds,
            preserve_ordering: d.preserve_ordering,
            priority_levels: levels,
            // Fits: checked against `levels` above.
            default_priority_level: u32::try_from(default_level).unwrap_or(0),
            default_queue_policy,
            priority_queue_policy,
        })
    }

    fn queue_policy(&self, path: &str, p: Option<&pb::ModelQueuePolicy>) -> Result<QueuePolicy> {
        use pb::model_queue_policy::TimeoutAction as Action;
        let Some(p) = p else {
            return Ok(QueuePolicy::default());
        };
        let timeout_action = match Action::try_from(p.timeout_action) {
            Ok(Action::Reject) => TimeoutAction::Reject,
            Ok(Action::Delay) => TimeoutAction::Delay,
            Err(_) => {
                return Err(self.err(
                    format_args!("{path}.timeout_action"),
                    format!("{} is not a timeout action", p.timeout_action),
                ))
            }
        };
        Ok(QueuePolicy {
            timeout_action,
            default_timeout_us: p.default_timeout_microseconds,
            allow_timeout_override: p.allow_timeout_override,
            max_queue_size: p.max_queue_size,
        })
    }
}

/// Element count of a shape without wildcards; None when any dim is -1.
fn fixed_count(dims: &[i64]) -> Option<usize> {
    if dims.contains(&-1) {
        None
    } else {
        element_count(dims)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{parse_config, parse_config_named, VersionPolicy};
    use crate::status::Code;

    /// A valid config with `max_batch_size` and `extra` spliced in.
    fn config(max_batch_size: i64, extra: &str) -> String {
        format!(
            "name: \"m\"\nbackend: \"b\"\nmax_batch_size: {max_batch_size}\n\
             input [ {{ name: \"IN\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n\
             output [ {{ name: \"OUT\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n{extra}"
        )
    }

    #[track_caller]
    fn rejects(text: &str, expected: &str) {
        match parse_config(text) {
            Ok(c) => panic!("accepted: {c:?}"),
            Err(e) => {
                assert_eq!(e.code, Code::InvalidArgument, "{e}");
                assert_eq!(e.message, format!("model 'm': {expected}"));
            }
        }
    }

    /// (max_batch_size, text added to a valid config, the error after "model 'm': ").
    const REJECTED: &[(i64, &str, &str)] = &[
        (-1, "", "max_batch_size: -1 is negative"),
        // Tensors.
        (8, "input { name: \"IN\" data_type: TYPE_INT8 }",
         "input[1].name: 'IN' is already the name of input[0]"),
        (8, "output { name: \"OUT\" data_type: TYPE_INT8 }",
         "output[1].name: 'OUT' is already the name of output[0]"),
        (8, "output { data_type: TYPE_INT8 dims: [ 1 ] }", "output[1].name: empty"),
        (8, "input { name: \"X\" data_type: TYPE_INVALID dims: [ 1 ] }",
         "input[1].data_type: TYPE_INVALID is not allowed ('X')"),
        (8, "output { name: \"Y\" dims: [ 1 ] }",
         "output[1].data_type: TYPE_INVALID is not allowed ('Y')"),
        (8, "output { name: \"Y\" data_type: 99 }", "output[1].data_type: 99 is not a data type ('Y')"),
        (8, "input { name: \"X\" data_type: TYPE_FP32 dims: [ 2, 0 ] }",
         "input[1].dims[1]: 0 is not a valid dimension of 'X' (must be > 0, or -1 for any size)"),
        (8, "output { name: \"Y\" data_type: TYPE_FP32 dims: [ -2 ] }",
         "output[1].dims[0]: -2 is not a valid dimension of 'Y' (must be > 0, or -1 for any size)"),
        (8, "input { name: \"X\" data_type: TYPE_FP32 dims: [ 4294967296, 4294967296 ] }",
         "input[1].dims: [4294967296,4294967296] of 'X' has too many elements"),
        (8, "input { name: \"X\" data_type: TYPE_FP32 dims: [ 2, 8 ] reshape { shape: [ 4, 8 ] } }",
         "input[1].reshape.shape: [4,8] has 32 elements but dims [2,8] of 'X' has 16"),
        (8, "output { name: \"Y\" data_type: TYPE_FP32 dims: [ 2 ] reshape { shape: [ 0 ] } }",
         "output[1].reshape.shape[0]: 0 is not a valid dimension of 'Y' (must be > 0, or -1 for any size)"),
        // Dynamic batching.
        (64, "dynamic_batching { preferred_batch_size: [ 32, 128 ] }",
         "dynamic_batching.preferred_batch_size[1]: 128 exceeds max_batch_size 64"),
        (64, "dynamic_batching { preferred_batch_size: [ 4, 0 ] }",
         "dynamic_batching.preferred_batch_size[1]: 0 must be > 0"),
        (64, "dynamic_batching { preferred_batch_size: [ -4 ] }",
         "dynamic_batching.preferred_batch_size[0]: -4 must be > 0"),
        (64, "dynamic_batching { preferred_batch_size: [ 8, 4, 8 ] }",
         "dynamic_batching.preferred_batch_size[2]: 8 is listed twice"),
        (0, "dynamic_batching { preferred_batch_size: [ 2 ] }",
         "dynamic_batching.preferred_batch_size[0]: 2 exceeds max_batch_size 0 (the model does not batch)"),
        (8, "dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
         "dynamic_batching.default_priority_level: 3 is not in 1..=2 (priority_levels)"),
        (8, "dynamic_batching { priority_levels: 2 }",
         "dynamic_batching.default_priority_level: 0 is not in 1..=2 (priority_levels)"),
        (8, "dynamic_batching { default_priority_level: 1 }",
         "dynamic_batching.default_priority_level: 1 is set but priority_levels is 0"),
        (8, "dynamic_batching { priority_levels: 5000000000 default_priority_level: 1 }",
         "dynamic_batching.priority_levels: 5000000000 is too large"),
        (8, "dynamic_batching { priority_levels: 2 default_priority_level: 1\n\
             priority_queue_policy { key: 3 value { max_queue_size: 4 } } }",
         "dynamic_batching.priority_queue_policy[3]: level 3 is not in 1..=2 (priority_levels)"),
        (8, "dynamic_batching { priority_levels: 2 default_priority_level: 1\n\
             priority_queue_policy { key: 0 value { } } }",
         "dynamic_batching.priority_queue_policy[0]: level 0 is not in 1..=2 (priority_levels)"),
        (8, "dynamic_batching { priority_queue_policy { key: 1 value {} } }",
         "dynamic_batching.priority_queue_policy[1]: level 1 set but priority_levels is 0"),
        (8, "dynamic_batching { default_queue_policy { timeout_action: 7 } }",
         "dynamic_batching.default_queue_policy.timeout_action: 7 is not a timeout action"),
        // Instance groups.
        (8, "instance_group { count: -1 }", "instance_group[0].count: -1 is negative"),
        (8, "instance_group { kind: KIND_GPU }\ninstance_group { kind: KIND_GPU gpus: [ 0, -1 ] }",
         "instance_group[1].gpus[1]: -1 is negative"),
        (8, "instance_group { kind: KIND_CPU cpus: [ -2 ] }", "instance_group[0].cpus[0]: -2 is negative"),
        (8, "instance_group { kind: KIND_MODEL }", "instance_group[0].kind: KIND_MODEL is not supported"),
        (8, "instance_group { kind: 9 }", "instance_group[0].kind: 9 is not an instance kind"),
        (8, "instance_group { kind: KIND_CPU gpus: [ 0 ] }",
         "instance_group[0].gpus: [0] given for a KIND_CPU group"),
        // Versions.
        (8, "version_policy { specific { versions: [ 2, 0 ] } }",
         "version_policy.specific.versions[1]: 0 must be > 0"),
        (8, "version_policy { specific { } }", "version_policy.specific.versions: empty"),
        (8, "version_policy { latest { } }",
         "version_policy.latest.num_versions: 0 would serve no version (must be >= 1)"),
    ];

    #[test]
    fn rejected() {
        for &(max_batch_size, extra, expected) in REJECTED {
            rejects(&config(max_batch_size, extra), expected);
        }
    }

    #[test]
    fn name() {
        let body = "backend: \"b\"\ninput { name: \"a\" data_type: TYPE_FP32 }\n\
                    output { name: \"b\" data_type: TYPE_FP32 }";
        let e = parse_config(body).unwrap_err();
        assert_eq!(
            e.message,
            "model config: name: empty, and no model name was given"
        );
        let e = parse_config_named(&config(8, ""), Some("dir")).unwrap_err();
        assert_eq!(
            e.message,
            "model 'dir': name: the config names a different model, 'm'"
        );
        assert_eq!(parse_config_named(body, Some("dir")).unwrap().name, "dir");
    }

    #[test]
    fn required_sections() {
        let text = config(8, "").replace("backend: \"b\"", "");
        rejects(&text, "backend: neither backend nor platform is set");
        let identity = "name: \"m\" backend: \"identity\"\n";
        let input = "input { name: \"IN\" data_type: TYPE_FP32 dims: [ 1 ] }\n";
        let output = "output { name: \"OUT\" data_type: TYPE_FP32 dims: [ 1 ] }\n";
        rejects(
            &format!("{identity}{output}"),
            "input: the model has no inputs",
        );
        rejects(
            &format!("{identity}{input}"),
            "output: the model has no outputs",
        );
        parse_config(&format!("{identity}{input}{output}")).unwrap();
    }

    #[test]
    fn accepted() {
        parse_config(&config(0, "dynamic_batching { }")).unwrap();
        // An input and an output may share a name.
        parse_config(&config(8, "output { name: \"IN\" data_type: TYPE_FP32 }")).unwrap();
        let c = parse_config(&config(
            64,
            "input { name: \"S\" data_type: TYPE_INT64 dims: [ ] }\n\
             input { name: \"V\" data_type: TYPE_INT64 dims: [ -1, 3 ] }\n\
             input { name: \"A\" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } }\n\
             input { name: \"B\" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape { shape: [ 2, -1 ] } }\n\
             version_policy { specific { versions: [ 3, 1, 3 ] } }\n\
             dynamic_batching { preferred_batch_size: [ 64, 1, 16 ]\n\
               priority_levels: 2 default_priority_level: 1\n\
               priority_queue_policy { key: 2 value { max_queue_size: 4 } } }",
        ))
        .unwrap();
        assert!(c.input("S").unwrap().dims.is_empty());
        assert_eq!(c.input("V").unwrap().dims, vec![-1, 3]);
        assert_eq!(c.input("A").unwrap().reshape, Some(vec![]));
        assert_eq!(c.input("B").unwrap().reshape, Some(vec![2, -1]));
        assert_eq!(c.version_policy, VersionPolicy::Specific(vec![1, 3]));
        let d = c.dynamic_batching.unwrap();
        assert_eq!(d.preferred_batch_size, vec![1, 16, 64]);
        assert_eq!(d.policy(2).max_queue_size, 4);
        assert_eq!(d.policy(1).max_queue_size, 0);
    }
}
