//! Semantic checks of a parsed configuration and its conversion into [`ModelConfig`].
//!
//! Every error is INVALID_ARGUMENT and reads `model 'NAME': FIELD.PATH: what is wrong`,
//! with the offending value in it, so that a user can find the line to fix.

use super::pb;
use super::{
    BatchInputConfig, BatchInputKind, BatchOutputConfig, ControlInput, ControlKind,
    DynamicBatching, Ensemble, EnsembleStep, InitialState, InstanceGroup, InstanceKind,
    ModelConfig, QueuePolicy, RateLimit, RateResource, SequenceBatching, SequenceStrategy,
    StateConfig, TensorConfig, TimeoutAction, VersionPolicy,
};
use super::{Warmup, WarmupData, WarmupInput};
use crate::status::{Error, Result};
use crate::tensor::{element_count, shape_string, DataType};
use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::Arc;

/// The limits a config stays within (README, "Security and limits"): each number drives
/// memory or threads at load, so a larger one is refused (INVALID_ARGUMENT naming the
/// field) instead of exhausting the host.
pub mod limits {
    /// `max_batch_size`.
    pub const MAX_BATCH_SIZE: u32 = 1 << 16;
    /// `dynamic_batching.priority_levels`.
    pub const MAX_PRIORITY_LEVELS: u32 = 1 << 16;
    /// `sequence_batching.oldest.max_candidate_sequences`.
    pub const MAX_CANDIDATE_SEQUENCES: u32 = 1 << 16;
    /// Instances of one version, over all instance groups (`count` times the GPUs listed).
    pub const MAX_INSTANCES: u64 = 256;
    /// Bytes of one implicit state tensor (its fixed dims, or its `initial_state` dims).
    pub const MAX_STATE_BYTES: usize = 1 << 30;
}

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
    if max_batch_size > limits::MAX_BATCH_SIZE {
        return Err(ck.err(
            "max_batch_size",
            format!(
                "{max_batch_size} exceeds the limit of {}",
                limits::MAX_BATCH_SIZE
            ),
        ));
    }

    // Fields libinfer does not implement were refused by `fields::check`.
    let decoupled = config
        .model_transaction_policy
        .as_ref()
        .is_some_and(|p| p.decoupled);

    let inputs = ck.tensors("input", config.input.iter().map(TensorView::input))?;
    let outputs = ck.tensors("output", config.output.iter().map(TensorView::output))?;
    let instance_groups = ck.instance_groups(&config.instance_group)?;
    let version_policy = ck.version_policy(config.version_policy.as_ref())?;
    let metric_tags = ck.metric_tags(&config.metric_tags)?;

    use pb::model_config::SchedulingChoice;
    let dynamic_batching = match &config.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(d)) => Some(ck.dynamic_batching(d, max_batch_size)?),
        _ => None,
    };
    let sequence_batching = match &config.scheduling_choice {
        Some(SchedulingChoice::SequenceBatching(q)) => {
            Some(ck.sequence_batching(q, max_batch_size, &inputs, &outputs)?)
        }
        _ => None,
    };
    let ensemble = match &config.scheduling_choice {
        Some(SchedulingChoice::EnsembleScheduling(e)) => {
            if config.platform != "ensemble" {
                return Err(ck.err(
                    "platform",
                    format!(
                        "'{}': a config with ensemble_scheduling needs platform: \"ensemble\"",
                        config.platform
                    ),
                ));
            }
            Some(ck.ensemble(e, &inputs, &outputs)?)
        }
        _ if config.platform == "ensemble" => {
            return Err(ck.err(
                "ensemble_scheduling",
                "missing: platform \"ensemble\" needs ensemble_scheduling { step [ ... ] }",
            ))
        }
        _ => None,
    };
    let parameters = config
        .parameters
        .iter()
        .map(|(k, v)| (k.clone(), v.string_value.clone()))
        .collect();

    let (batch_inputs, batch_outputs) = ck.batch_io(config, &inputs, &outputs)?;
    let warmup = ck.warmup(
        &config.model_warmup,
        max_batch_size,
        &inputs,
        sequence_batching.as_ref(),
    )?;
    Ok(ModelConfig {
        backend: config.backend.clone(),
        platform: config.platform.clone(),
        max_batch_size,
        inputs,
        outputs,
        instance_groups,
        dynamic_batching,
        sequence_batching,
        ensemble,
        parameters,
        version_policy,
        default_model_filename: config.default_model_filename.clone(),
        optimization: config.optimization.clone(),
        warmup,
        decoupled,
        response_cache: config.response_cache.as_ref().is_some_and(|c| c.enable),
        metric_tags,
        batch_inputs,
        batch_outputs,
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
    /// `format` FORMAT_NHWC or FORMAT_NCHW (an image input).
    image_format: bool,
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
            image_format: matches!(
                pb::model_input::Format::try_from(t.format),
                Ok(pb::model_input::Format::Nhwc | pb::model_input::Format::Nchw)
            ),
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
            image_format: false,
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
            if t.image_format && t.dims.len() != 3 {
                return Err(self.err(
                    format_args!("{path}.format"),
                    format!(
                        "model input NHWC/NCHW require 3 dims ('{}' has {})",
                        t.name,
                        t.dims.len()
                    ),
                ));
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

    /// `model_warmup`: each sample named, its batch size within the model's, every
    /// required input given, each input a model input (or a sequence control or state
    /// input) of the model's type and of dims the model takes (no -1), with its data.
    fn warmup(
        &self,
        samples: &[pb::ModelWarmup],
        max_batch_size: u32,
        inputs: &[TensorConfig],
        seq: Option<&SequenceBatching>,
    ) -> Result<Vec<Warmup>> {
        use pb::model_warmup::input::InputDataType;
        let mut out = Vec::with_capacity(samples.len());
        for (i, w) in samples.iter().enumerate() {
            let path = format!("model_warmup[{i}]");
            if w.name.is_empty() {
                return Err(self.err(format_args!("{path}.name"), "empty"));
            }
            let batch_size = match (max_batch_size, w.batch_size) {
                (0, 0 | 1) => 1,
                (0, b) => {
                    return Err(self.err(
                        format_args!("{path}.batch_size"),
                        format!("{b}: the model does not batch (0 or 1)"),
                    ))
                }
                (m, b) if b == 0 || b > m => {
                    return Err(self.err(
                        format_args!("{path}.batch_size"),
                        format!("{b} is not in 1..={m} (max_batch_size)"),
                    ))
                }
                (_, b) => b,
            };
            let mut ins = Vec::with_capacity(w.inputs.len());
            let mut names: Vec<&String> = w.inputs.keys().collect();
            names.sort();
            for name in names {
                let v = &w.inputs[name];
                let ipath = format!("{path}.inputs[{name}]");
                let data_type = self.data_type(&format!("{ipath}.data_type"), v.data_type, name)?;
                let known = inputs.iter().find(|t| *t.name == **name);
                let extra = seq.and_then(|q| {
                    (q.controls.iter().find(|c| *c.name == **name))
                        .map(|c| c.data_type)
                        .or_else(|| {
                            (q.states.iter().find(|s| *s.input_name == **name)).map(|s| s.data_type)
                        })
                });
                let want = match (known, extra) {
                    (Some(t), _) => t.data_type,
                    (None, Some(dt)) => dt,
                    (None, None) => {
                        return Err(
                            self.err(ipath, format!("'{name}' is not an input of the model"))
                        )
                    }
                };
                if data_type != want {
                    return Err(self.err(
                        format_args!("{ipath}.data_type"),
                        format!("{} but '{name}' is {}", data_type.as_str(), want.as_str()),
                    ));
                }
                if v.dims.iter().any(|&d| d <= 0) {
                    return Err(self.err(
                        format_args!("{ipath}.dims"),
                        format!("{:?}: every dim must be > 0", v.dims),
                    ));
                }
                if let Some(t) = known {
                    let fits = t.dims.len() == v.dims.len()
                        && t.dims.iter().zip(&v.dims).all(|(&c, &d)| c == -1 || c == d);
                    if !fits {
                        return Err(self.err(
                            format_args!("{ipath}.dims"),
                            format!("{:?} do not fit '{name}' {:?}", v.dims, t.dims),
                        ));
                    }
                }
                let data = match &v.input_data_type {
                    Some(InputDataType::ZeroData(true)) => WarmupData::Zero,
                    Some(InputDataType::RandomData(true)) if data_type == DataType::Bytes => {
                        return Err(Error::unsupported(format!(
                            "model '{}': {ipath}.random_data: random TYPE_STRING data is not supported (use zero_data or input_data_file)",
                            self.model
                        )))
                    }
                    Some(InputDataType::RandomData(true)) => WarmupData::Random,
                    Some(InputDataType::InputDataFile(f)) if !f.is_empty() => {
                        WarmupData::File(f.clone())
                    }
                    _ => {
                        return Err(self.err(
                            ipath,
                            "no data: set zero_data, random_data or input_data_file",
                        ))
                    }
                };
                ins.push(WarmupInput {
                    name: Arc::from(name.as_str()),
                    data_type,
                    dims: v.dims.clone(),
                    data,
                });
            }
            if let Some(t) = inputs
                .iter()
                .find(|t| !t.optional && !ins.iter().any(|x| x.name == t.name))
            {
                return Err(self.err(
                    format_args!("{path}.inputs"),
                    format!("sample '{}' does not give input '{}'", w.name, t.name),
                ));
            }
            out.push(Warmup {
                name: w.name.clone(),
                batch_size,
                count: w.count.max(1),
                inputs: ins,
            });
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
                cpus: Vec::new(),
                rate_limiter: None,
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
            let mut cpus = Vec::with_capacity(g.cpus.len());
            for (j, &cpu) in g.cpus.iter().enumerate() {
                if cpu < 0 {
                    return Err(self.err(
                        format_args!("{path}.cpus[{j}]"),
                        format!("{cpu} is negative"),
                    ));
                }
                let cpu = cpu as u32;
                if cpu >= crate::affinity::MAX_CPUS {
                    return Err(self.err(
                        format_args!("{path}.cpus[{j}]"),
                        format!(
                            "{cpu} is out of range (CPU indices must be < {}, the size of the OS's CPU set)",
                            crate::affinity::MAX_CPUS
                        ),
                    ));
                }
                cpus.push(cpu);
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
                cpus,
                rate_limiter: self.rate_limiter(&path, g.rate_limiter.as_ref())?,
            });
        }
        let total: u64 = out
            .iter()
            .map(|g| u64::from(g.count) * g.gpus.len().max(1) as u64)
            .sum();
        if total > limits::MAX_INSTANCES {
            return Err(self.err(
                "instance_group",
                format!(
                    "{total} instances (count times the GPUs listed, over all groups) exceed the limit of {}",
                    limits::MAX_INSTANCES
                ),
            ));
        }
        Ok(out)
    }

    /// Prometheus label names, not those the library's own samples carry.
    /// `batch_input` and `batch_output` (ragged batching), as Triton checks them: a
    /// batching model; each with one source input of the config; batch input targets
    /// that name no other tensor; batch output targets that are config outputs.
    fn batch_io(
        &self,
        config: &pb::ModelConfig,
        inputs: &[TensorConfig],
        outputs: &[TensorConfig],
    ) -> Result<(Vec<BatchInputConfig>, Vec<BatchOutputConfig>)> {
        use pb::batch_input::Kind;
        let (bi, bo) = (&config.batch_input, &config.batch_output);
        if bi.is_empty() && bo.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let field = if bi.is_empty() {
            "batch_output"
        } else {
            "batch_input"
        };
        if config.max_batch_size == 0 {
            return Err(self.err(field, "needs a model that batches (max_batch_size > 0)"));
        }
        if config.platform == "ensemble" {
            return Err(self.err(field, "an ensemble has no backend to compute it for"));
        }
        if let Some(pb::model_config::SchedulingChoice::SequenceBatching(_)) =
            &config.scheduling_choice
        {
            return Err(Error::unsupported(format!(
                "model '{}': {field} with sequence_batching: a sequence batch's padding slots have no requests to describe",
                self.model
            )));
        }
        let source = |path: &str, names: &[String]| -> Result<Arc<str>> {
            let [one] = names else {
                return Err(self.err(
                    format_args!("{path}.source_input"),
                    format!("must name exactly one input (it names {})", names.len()),
                ));
            };
            inputs
                .iter()
                .find(|t| *t.name == **one)
                .map(|t| t.name.clone())
                .ok_or_else(|| {
                    self.err(
                        format_args!("{path}.source_input"),
                        format!("'{one}' is not an input of the config"),
                    )
                })
        };
        let mut batch_inputs: Vec<BatchInputConfig> = Vec::with_capacity(bi.len());
        for (i, b) in bi.iter().enumerate() {
            let path = format!("batch_input[{i}]");
            let kind = match Kind::try_from(b.kind) {
                Ok(Kind::BatchElementCount) => BatchInputKind::ElementCount,
                Ok(Kind::BatchAccumulatedElementCount) => BatchInputKind::AccumulatedElementCount,
                Ok(Kind::BatchAccumulatedElementCountWithZero) => {
                    BatchInputKind::AccumulatedElementCountWithZero
                }
                Ok(Kind::BatchMaxElementCountAsShape) => BatchInputKind::MaxElementCountAsShape,
                Ok(Kind::BatchItemShape) => BatchInputKind::ItemShape,
                Ok(Kind::BatchItemShapeFlatten) => BatchInputKind::ItemShapeFlatten,
                Err(_) => {
                    return Err(self.err(
                        format_args!("{path}.kind"),
                        format!("unknown kind {}", b.kind),
                    ))
                }
            };
            let data_type = self.data_type(&format!("{path}.data_type"), b.data_type, &path)?;
            if !matches!(
                data_type,
                DataType::Int32 | DataType::Int64 | DataType::Fp32
            ) {
                return Err(self.err(
                    format_args!("{path}.data_type"),
                    format!(
                        "{} (a batch input is TYPE_INT32, TYPE_INT64 or TYPE_FP32)",
                        data_type.as_str()
                    ),
                ));
            }
            if b.target_name.is_empty() {
                return Err(self.err(
                    format_args!("{path}.target_name"),
                    "empty: name the model input that receives it",
                ));
            }
            let mut targets: Vec<Arc<str>> = Vec::with_capacity(b.target_name.len());
            for t in &b.target_name {
                let taken = inputs.iter().any(|x| *x.name == **t)
                    || outputs.iter().any(|x| *x.name == **t)
                    || targets.iter().any(|x| **x == **t)
                    || batch_inputs
                        .iter()
                        .any(|x| x.targets.iter().any(|y| **y == **t));
                if t.is_empty() || taken {
                    return Err(self.err(
                        format_args!("{path}.target_name"),
                        format!("'{t}' is empty or already names an input, an output or another batch input"),
                    ));
                }
                targets.push(Arc::from(t.as_str()));
            }
            batch_inputs.push(BatchInputConfig {
                kind,
                targets,
                data_type,
                source: source(&path, &b.source_input)?,
            });
        }
        let mut batch_outputs: Vec<BatchOutputConfig> = Vec::with_capacity(bo.len());
        for (i, b) in bo.iter().enumerate() {
            let path = format!("batch_output[{i}]");
            if pb::batch_output::Kind::try_from(b.kind).is_err() {
                return Err(self.err(
                    format_args!("{path}.kind"),
                    format!("unknown kind {}", b.kind),
                ));
            }
            if b.target_name.is_empty() {
                return Err(self.err(
                    format_args!("{path}.target_name"),
                    "empty: name the outputs to scatter",
                ));
            }
            let mut targets: Vec<Arc<str>> = Vec::with_capacity(b.target_name.len());
            for t in &b.target_name {
                let Some(o) = outputs.iter().find(|x| *x.name == **t) else {
                    return Err(self.err(
                        format_args!("{path}.target_name"),
                        format!("'{t}' is not an output of the config"),
                    ));
                };
                if o.data_type == DataType::Bytes {
                    return Err(Error::unsupported(format!(
                        "model '{}': {path}.target_name: '{t}' is BYTES; only fixed-size elements are scattered",
                        self.model
                    )));
                }
                let twice = targets.iter().any(|x| **x == **t)
                    || batch_outputs
                        .iter()
                        .any(|x| x.targets.iter().any(|y| **y == **t));
                if twice {
                    return Err(self.err(
                        format_args!("{path}.target_name"),
                        format!("'{t}' is the target of two batch outputs"),
                    ));
                }
                targets.push(o.name.clone());
            }
            batch_outputs.push(BatchOutputConfig {
                targets,
                source: source(&path, &b.source_input)?,
            });
        }
        Ok((batch_inputs, batch_outputs))
    }

    fn rate_limiter(
        &self,
        path: &str,
        r: Option<&pb::ModelRateLimiter>,
    ) -> Result<Option<RateLimit>> {
        let Some(r) = r.filter(|r| !r.resources.is_empty() || r.priority != 0) else {
            return Ok(None);
        };
        let mut resources: Vec<RateResource> = Vec::with_capacity(r.resources.len());
        for (i, x) in r.resources.iter().enumerate() {
            let at = format!("{path}.rate_limiter.resources[{i}]");
            if x.name.is_empty() {
                return Err(self.err(format_args!("{at}.name"), "empty"));
            }
            if resources.iter().any(|y| y.name == x.name) {
                return Err(self.err(
                    format_args!("{at}.name"),
                    format!("'{}' is listed twice", x.name),
                ));
            }
            resources.push(RateResource {
                name: x.name.clone(),
                global: x.global,
                count: x.count,
            });
        }
        Ok(Some(RateLimit {
            resources,
            priority: r.priority,
        }))
    }

    fn metric_tags(
        &self,
        tags: &std::collections::BTreeMap<String, String>,
    ) -> Result<Vec<(String, String)>> {
        const RESERVED: [&str; 5] = ["model", "version", "instance", "device", "le"];
        let mut out: Vec<(String, String)> =
            tags.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        out.sort();
        for (k, _) in &out {
            let mut chars = k.chars();
            let well_formed = chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !well_formed || k.starts_with("__") {
                return Err(self.err(
                    format_args!("metric_tags['{k}']"),
                    "not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with '__')",
                ));
            }
            if RESERVED.contains(&k.as_str()) {
                return Err(self.err(
                    format_args!("metric_tags['{k}']"),
                    format!("the label '{k}' is the library's own (it labels every sample with model and version, GPU samples with instance and device, histograms with le)"),
                ));
            }
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
        if levels > limits::MAX_PRIORITY_LEVELS {
            return Err(self.err(
                "dynamic_batching.priority_levels",
                format!(
                    "{levels} exceeds the limit of {}",
                    limits::MAX_PRIORITY_LEVELS
                ),
            ));
        }
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

    fn sequence_batching(
        &self,
        q: &pb::ModelSequenceBatching,
        max_batch_size: u32,
        inputs: &[TensorConfig],
        outputs: &[TensorConfig],
    ) -> Result<SequenceBatching> {
        use pb::model_sequence_batching::StrategyChoice;
        const P: &str = "sequence_batching";
        let strategy = match &q.strategy_choice {
            None => SequenceStrategy::Direct {
                max_queue_delay_us: 0,
                minimum_slot_utilization: 0.0,
            },
            Some(StrategyChoice::Direct(d)) => {
                let u = d.minimum_slot_utilization;
                if !(0.0..=1.0).contains(&u) {
                    return Err(self.err(
                        format_args!("{P}.direct.minimum_slot_utilization"),
                        format!("{u} is not in 0..1"),
                    ));
                }
                SequenceStrategy::Direct {
                    max_queue_delay_us: d.max_queue_delay_microseconds,
                    minimum_slot_utilization: u,
                }
            }
            Some(StrategyChoice::Oldest(o)) => {
                let path = format!("{P}.oldest.max_candidate_sequences");
                let candidates = match o.max_candidate_sequences {
                    0 => max_batch_size.max(1),
                    n if n < 0 => return Err(self.err(path, format!("{n} is negative"))),
                    n if n as u64 > u64::from(limits::MAX_CANDIDATE_SEQUENCES) => {
                        return Err(self.err(
                            path,
                            format!(
                                "{n} exceeds the limit of {}",
                                limits::MAX_CANDIDATE_SEQUENCES
                            ),
                        ))
                    }
                    n => n as u32,
                };
                let mut preferred: Vec<u32> = Vec::new();
                for (i, &size) in o.preferred_batch_size.iter().enumerate() {
                    let path = format!("{P}.oldest.preferred_batch_size[{i}]");
                    let size = match u32::try_from(size) {
                        Ok(s) if s > 0 => s,
                        _ => return Err(self.err(path, format!("{size} must be > 0"))),
                    };
                    if size > max_batch_size.max(1) {
                        return Err(self.err(
                            path,
                            format!("{size} exceeds max_batch_size {max_batch_size}"),
                        ));
                    }
                    if preferred.contains(&size) {
                        return Err(self.err(path, format!("{size} is listed twice")));
                    }
                    preferred.push(size);
                }
                preferred.sort_unstable();
                SequenceStrategy::Oldest {
                    max_candidate_sequences: candidates,
                    preferred_batch_size: preferred,
                    max_queue_delay_us: o.max_queue_delay_microseconds,
                    preserve_ordering: o.preserve_ordering,
                }
            }
        };
        let taken = |name: &str| {
            inputs.iter().any(|t| &*t.name == name) || outputs.iter().any(|t| &*t.name == name)
        };

        let mut controls: Vec<ControlInput> = Vec::new();
        for (i, ci) in q.control_input.iter().enumerate() {
            let path = format!("{P}.control_input[{i}]");
            if ci.name.is_empty() {
                return Err(self.err(format_args!("{path}.name"), "empty"));
            }
            if taken(&ci.name) || controls.iter().any(|c| *c.name == *ci.name) {
                return Err(self.err(
                    format_args!("{path}.name"),
                    format!(
                        "'{}' is already the name of an input, output or control",
                        ci.name
                    ),
                ));
            }
            let [c] = ci.control.as_slice() else {
                return Err(self.err(
                    format_args!("{path}.control"),
                    format!(
                        "control input '{}' needs exactly one control, has {}",
                        ci.name,
                        ci.control.len()
                    ),
                ));
            };
            let control = self.control(&format!("{path}.control[0]"), &ci.name, c)?;
            if let Some(other) = controls.iter().find(|o| o.kind == control.kind) {
                return Err(self.err(
                    format_args!("{path}.control[0].kind"),
                    format!(
                        "{} is already given by control input '{}'",
                        control.kind.as_str(),
                        other.name
                    ),
                ));
            }
            controls.push(control);
        }

        let mut states: Vec<StateConfig> = Vec::new();
        for (i, st) in q.state.iter().enumerate() {
            let state = self.state(&format!("{P}.state[{i}]"), st, inputs, outputs)?;
            let clash = controls
                .iter()
                .any(|c| *c.name == *state.input_name || *c.name == *state.output_name)
                || inputs.iter().any(|t| t.name == state.output_name)
                || states.iter().any(|o| {
                    o.input_name == state.input_name
                        || o.output_name == state.output_name
                        || o.input_name == state.output_name
                        || o.output_name == state.input_name
                });
            if clash {
                return Err(self.err(
                    format_args!("{P}.state[{i}]"),
                    format!(
                        "state '{}' -> '{}' reuses the name of an input, a control or another state",
                        state.input_name, state.output_name
                    ),
                ));
            }
            states.push(state);
        }
        Ok(SequenceBatching {
            strategy,
            max_sequence_idle_us: if q.max_sequence_idle_microseconds == 0 {
                1_000_000
            } else {
                q.max_sequence_idle_microseconds
            },
            controls,
            states,
        })
    }

    /// The checks an ensemble needs no other model for: every step maps something, every
    /// ensemble input is used, every output produced once, no tensor written twice or
    /// written and never used, and the steps form no cycle.
    fn ensemble(
        &self,
        e: &pb::ModelEnsembling,
        inputs: &[TensorConfig],
        outputs: &[TensorConfig],
    ) -> Result<Ensemble> {
        const P: &str = "ensemble_scheduling";
        if e.step.is_empty() {
            return Err(self.err(format_args!("{P}.step"), "empty: an ensemble needs steps"));
        }
        let mut steps: Vec<EnsembleStep> = Vec::with_capacity(e.step.len());
        // Ensemble tensor -> who writes it (None: an ensemble input).
        let mut writer: BTreeMap<&str, Option<usize>> = BTreeMap::new();
        for t in inputs {
            writer.insert(&t.name, None);
        }
        for (i, st) in e.step.iter().enumerate() {
            let path = format!("{P}.step[{i}]");
            if st.model_name.is_empty() {
                return Err(self.err(format_args!("{path}.model_name"), "empty"));
            }
            if st.model_name == self.model {
                return Err(self.err(
                    format_args!("{path}.model_name"),
                    format!("'{}' is the ensemble itself (a cycle)", st.model_name),
                ));
            }
            if st.model_version < -1 || st.model_version == 0 {
                return Err(self.err(
                    format_args!("{path}.model_version"),
                    format!("{} is not a version (-1 = latest)", st.model_version),
                ));
            }
            if st.input_map.is_empty() || st.output_map.is_empty() {
                return Err(self.err(
                    &path,
                    format!(
                        "step '{}' needs an input_map and an output_map",
                        st.model_name
                    ),
                ));
            }
            for (k, v) in &st.output_map {
                match writer.get(v.as_str()) {
                    Some(None) => {
                        return Err(self.err(
                            format_args!("{path}.output_map[{k}]"),
                            format!("'{v}' is an ensemble input; a step cannot write it"),
                        ))
                    }
                    Some(Some(j)) => {
                        return Err(self.err(
                            format_args!("{path}.output_map[{k}]"),
                            format!("tensor '{v}' is written twice: step[{j}] also writes it"),
                        ))
                    }
                    None => {
                        writer.insert(v, Some(i));
                    }
                }
            }
            let map = |m: &BTreeMap<String, String>| {
                let mut v: Vec<(Arc<str>, Arc<str>)> = m
                    .iter()
                    .map(|(k, v)| (Arc::from(k.as_str()), Arc::from(v.as_str())))
                    .collect();
                v.sort();
                v
            };
            if st.max_queue_size > 0 && st.max_inflight_requests == 0 {
                return Err(self.err(
                    format_args!("{path}.max_queue_size"),
                    format!(
                        "{} needs max_inflight_requests: a step's requests only wait behind that limit",
                        st.max_queue_size
                    ),
                ));
            }
            steps.push(EnsembleStep {
                model_name: st.model_name.clone(),
                model_version: st.model_version,
                input_map: map(&st.input_map),
                output_map: map(&st.output_map),
                max_inflight_requests: st.max_inflight_requests,
                max_queue_size: st.max_queue_size,
            });
        }
        for (i, st) in steps.iter().enumerate() {
            for (k, v) in &st.input_map {
                if !writer.contains_key(&**v) {
                    return Err(self.err(
                        format_args!("{P}.step[{i}].input_map[{k}]"),
                        format!("tensor '{v}' is neither an ensemble input nor written by a step"),
                    ));
                }
            }
        }
        // A tensor a step writes that no step reads and no output returns: Triton refuses
        // the ensemble.
        for (i, st) in steps.iter().enumerate() {
            for (k, v) in &st.output_map {
                let read = steps
                    .iter()
                    .any(|s| s.input_map.iter().any(|(_, t)| t == v));
                if !read && !outputs.iter().any(|t| t.name == *v) {
                    return Err(self.err(
                        format_args!("{P}.step[{i}].output_map[{k}]"),
                        format!(
                            "ensemble tensor '{v}' is unused in ensemble '{}' (no step reads it and it is not an ensemble output)",
                            self.model
                        ),
                    ));
                }
            }
        }
        for t in outputs {
            if !matches!(writer.get(&*t.name), Some(Some(_))) {
                return Err(self.err(
                    "output",
                    format!("ensemble output '{}' is not written by any step", t.name),
                ));
            }
        }
        for t in inputs {
            if !steps
                .iter()
                .any(|s| s.input_map.iter().any(|(_, v)| *v == t.name))
            {
                return Err(self.err(
                    "input",
                    format!("ensemble input '{}' is not used by any step", t.name),
                ));
            }
        }
        // A cycle: a step that (through the tensors) waits for its own output.
        let deps: Vec<Vec<usize>> = steps
            .iter()
            .map(|s| {
                s.input_map
                    .iter()
                    .filter_map(|(_, v)| writer.get(&**v).copied().flatten())
                    .collect()
            })
            .collect();
        let mut mark = vec![0u8; steps.len()]; // 0 new, 1 on the path, 2 done
        fn visit(i: usize, deps: &[Vec<usize>], mark: &mut [u8]) -> Option<usize> {
            match mark[i] {
                1 => return Some(i),
                2 => return None,
                _ => {}
            }
            mark[i] = 1;
            for &d in &deps[i] {
                if let Some(c) = visit(d, deps, mark) {
                    return Some(c);
                }
            }
            mark[i] = 2;
            None
        }
        for i in 0..steps.len() {
            if let Some(c) = visit(i, &deps, &mut mark) {
                return Err(self.err(
                    format_args!("{P}.step[{c}]"),
                    format!(
                        "the steps form a cycle through step '{}'",
                        steps[c].model_name
                    ),
                ));
            }
        }
        Ok(Ensemble { steps })
    }

    fn control(
        &self,
        path: &str,
        name: &str,
        c: &pb::model_sequence_batching::Control,
    ) -> Result<ControlInput> {
        use pb::model_sequence_batching::control::Kind;
        let kind = match Kind::try_from(c.kind) {
            Ok(Kind::ControlSequenceStart) => ControlKind::Start,
            Ok(Kind::ControlSequenceEnd) => ControlKind::End,
            Ok(Kind::ControlSequenceReady) => ControlKind::Ready,
            Ok(Kind::ControlSequenceCorrid) => ControlKind::CorrId,
            Err(_) => {
                return Err(self.err(
                    format_args!("{path}.kind"),
                    format!("{} is not a control kind", c.kind),
                ))
            }
        };
        let given = [
            !c.int32_false_true.is_empty(),
            !c.fp32_false_true.is_empty(),
            !c.bool_false_true.is_empty(),
        ];
        let n_given = given.iter().filter(|g| **g).count();
        if kind == ControlKind::CorrId {
            if n_given > 0 {
                return Err(self.err(
                    path,
                    format!("CONTROL_SEQUENCE_CORRID ('{name}') takes a data_type, not *_false_true values"),
                ));
            }
            let dt = pb::DataType::try_from(c.data_type)
                .map(|d| d.as_str_name())
                .unwrap_or("?");
            let data_type = match DataType::parse(dt) {
                Some(
                    d @ (DataType::Uint64
                    | DataType::Int64
                    | DataType::Uint32
                    | DataType::Int32
                    | DataType::Bytes),
                ) => d,
                _ => {
                    return Err(self.err(
                        format_args!("{path}.data_type"),
                        format!(
                            "{dt} is not a correlation ID type for '{name}' (TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING)"
                        ),
                    ))
                }
            };
            return Ok(ControlInput {
                name: name.into(),
                kind,
                data_type,
                false_true: None,
            });
        }
        if n_given != 1 {
            return Err(self.err(
                path,
                format!(
                    "{} ('{name}') needs exactly one of int32_false_true, fp32_false_true, bool_false_true",
                    kind.as_str()
                ),
            ));
        }
        let count = c
            .int32_false_true
            .len()
            .max(c.fp32_false_true.len())
            .max(c.bool_false_true.len());
        if count != 2 {
            return Err(self.err(
                path,
                format!(
                    "{} ('{name}') needs 2 values [false, true], has {count}",
                    kind.as_str()
                ),
            ));
        }
        let (data_type, false_true) = if given[0] {
            let v = &c.int32_false_true;
            (
                DataType::Int32,
                [v[0].to_le_bytes().to_vec(), v[1].to_le_bytes().to_vec()],
            )
        } else if given[1] {
            let v = &c.fp32_false_true;
            (
                DataType::Fp32,
                [v[0].to_le_bytes().to_vec(), v[1].to_le_bytes().to_vec()],
            )
        } else {
            let v = &c.bool_false_true;
            (DataType::Bool, [vec![u8::from(v[0])], vec![u8::from(v[1])]])
        };
        Ok(ControlInput {
            name: name.into(),
            kind,
            data_type,
            false_true: Some(false_true),
        })
    }

    fn state(
        &self,
        path: &str,
        st: &pb::model_sequence_batching::State,
        inputs: &[TensorConfig],
        outputs: &[TensorConfig],
    ) -> Result<StateConfig> {
        use pb::model_sequence_batching::initial_state::StateData;
        for (field, v) in [
            ("input_name", &st.input_name),
            ("output_name", &st.output_name),
        ] {
            if v.is_empty() {
                return Err(self.err(format_args!("{path}.{field}"), "empty"));
            }
        }
        let tensor = st.input_name.as_str();
        if inputs.iter().any(|t| &*t.name == tensor) {
            return Err(self.err(
                format_args!("{path}.input_name"),
                format!("'{tensor}' is a model input; the state input is fed by the library and must not be listed under input"),
            ));
        }
        let data_type = self.data_type(&format!("{path}.data_type"), st.data_type, tensor)?;
        if data_type == DataType::Bytes {
            return Err(Error::unsupported(format!(
                "model '{}': {path}.data_type: TYPE_STRING state ('{tensor}') is not supported",
                self.model
            )));
        }
        if st.dims.is_empty() {
            return Err(self.err(
                format_args!("{path}.dims"),
                format!("empty for state '{tensor}'"),
            ));
        }
        self.dims(&format!("{path}.dims"), &st.dims, tensor)?;
        self.state_size(&format!("{path}.dims"), &st.dims, data_type, tensor)?;
        if let Some(out) = outputs.iter().find(|t| *t.name == *st.output_name) {
            if out.data_type != data_type || out.dims != st.dims {
                return Err(self.err(
                    format_args!("{path}.output_name"),
                    format!(
                        "'{}' is listed as an output with {} {} but the state is {} {}",
                        out.name,
                        out.data_type.as_str(),
                        shape_string(&out.dims),
                        data_type.as_str(),
                        shape_string(&st.dims)
                    ),
                ));
            }
        }
        let initial = match st.initial_state.as_slice() {
            [] => InitialState::Default,
            [init] => {
                let ipath = format!("{path}.initial_state[0]");
                let idt = self.data_type(&format!("{ipath}.data_type"), init.data_type, tensor)?;
                if idt != data_type {
                    return Err(self.err(
                        format_args!("{ipath}.data_type"),
                        format!(
                            "{} differs from the state's {}",
                            idt.as_str(),
                            data_type.as_str()
                        ),
                    ));
                }
                let fits = init.dims.len() == st.dims.len()
                    && init
                        .dims
                        .iter()
                        .zip(&st.dims)
                        .all(|(&i, &s)| i > 0 && (s == -1 || s == i));
                if !fits || element_count(&init.dims).is_none() {
                    return Err(self.err(
                        format_args!("{ipath}.dims"),
                        format!(
                            "{} does not fit state '{tensor}' {} (fixed sizes > 0 of the same rank)",
                            shape_string(&init.dims),
                            shape_string(&st.dims)
                        ),
                    ));
                }
                self.state_size(&format!("{ipath}.dims"), &init.dims, data_type, tensor)?;
                let dims = init.dims.clone();
                match &init.state_data {
                    Some(StateData::ZeroData(true)) => InitialState::Zero { dims },
                    Some(StateData::DataFile(f)) => {
                        let bad = f.is_empty()
                            || std::path::Path::new(f)
                                .components()
                                .any(|c| !matches!(c, std::path::Component::Normal(_)));
                        if bad {
                            return Err(self.err(
                                format_args!("{ipath}.data_file"),
                                format!("'{f}' must be a relative path inside the model's initial_state folder"),
                            ));
                        }
                        InitialState::File {
                            dims,
                            file: f.clone(),
                        }
                    }
                    _ => {
                        return Err(self.err(
                            &ipath,
                            format!("state '{tensor}': give zero_data: true or a data_file"),
                        ))
                    }
                }
            }
            more => {
                return Err(self.err(
                    format_args!("{path}.initial_state"),
                    format!(
                        "state '{tensor}' has {} initial states; at most one",
                        more.len()
                    ),
                ))
            }
        };
        Ok(StateConfig {
            input_name: st.input_name.as_str().into(),
            output_name: st.output_name.as_str().into(),
            data_type,
            dims: st.dims.clone(),
            initial,
        })
    }

    /// A state's fixed size (wildcards count as 1) within [`limits::MAX_STATE_BYTES`].
    fn state_size(&self, path: &str, dims: &[i64], dt: DataType, tensor: &str) -> Result<()> {
        let fixed: Vec<i64> = dims.iter().map(|&d| d.max(1)).collect();
        let bytes = element_count(&fixed).and_then(|n| n.checked_mul(dt.byte_size()));
        match bytes {
            Some(b) if b <= limits::MAX_STATE_BYTES => Ok(()),
            _ => Err(self.err(
                path,
                format!(
                    "state '{tensor}' of {} {} is larger than the limit of {} bytes",
                    dt.as_str(),
                    shape_string(dims),
                    limits::MAX_STATE_BYTES
                ),
            )),
        }
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
