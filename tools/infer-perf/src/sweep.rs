//! `--sweep`: config overrides tried one combination at a time, as model_analyzer does.

use serde_json::{json, Value};

/// One overridable field and the values to try.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub key: Key,
    pub values: Vec<Vec<u64>>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Key {
    MaxBatchSize,
    MaxQueueDelay,
    PreferredBatchSize,
    InstanceCount,
}

impl Key {
    pub fn name(self) -> &'static str {
        match self {
            Key::MaxBatchSize => "max_batch_size",
            Key::MaxQueueDelay => "max_queue_delay_microseconds",
            Key::PreferredBatchSize => "preferred_batch_size",
            Key::InstanceCount => "instance_count",
        }
    }
}

/// `KEY=V1,V2,...`; a preferred_batch_size value lists its sizes with `+` (`4+8`).
pub fn parse_axis(s: &str) -> Result<Axis, String> {
    let (k, vals) = s
        .split_once('=')
        .ok_or_else(|| format!("--sweep '{s}': expected KEY=V1,V2,..."))?;
    let key = match k.trim() {
        "max_batch_size" => Key::MaxBatchSize,
        "max_queue_delay_microseconds" => Key::MaxQueueDelay,
        "preferred_batch_size" => Key::PreferredBatchSize,
        "instance_count" => Key::InstanceCount,
        other => {
            return Err(format!(
                "--sweep '{s}': '{other}' cannot be swept (max_batch_size, max_queue_delay_microseconds, preferred_batch_size, instance_count)"
            ))
        }
    };
    let mut values = Vec::new();
    for v in vals.split(',') {
        let parts = v
            .split('+')
            .map(|x| {
                x.trim()
                    .parse::<u64>()
                    .map_err(|_| format!("--sweep '{s}': '{x}' is not a whole number"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if key != Key::PreferredBatchSize && parts.len() != 1 {
            return Err(format!(
                "--sweep '{s}': '{v}': only preferred_batch_size takes several sizes (a+b)"
            ));
        }
        if key == Key::InstanceCount && parts[0] == 0 {
            return Err(format!("--sweep '{s}': instance_count must be at least 1"));
        }
        values.push(parts);
    }
    Ok(Axis { key, values })
}

/// Every combination of the axes' values (the first axis varies slowest).
pub fn combinations(axes: &[Axis]) -> Vec<Vec<(Key, Vec<u64>)>> {
    let mut out: Vec<Vec<(Key, Vec<u64>)>> = vec![Vec::new()];
    for a in axes {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                a.values.iter().map(move |v| {
                    let mut c = prefix.clone();
                    c.push((a.key, v.clone()));
                    c
                })
            })
            .collect();
    }
    out
}

/// A combination as text: `max_batch_size=8 instance_count=2`.
pub fn label(combo: &[(Key, Vec<u64>)]) -> String {
    combo
        .iter()
        .map(|(k, v)| {
            format!(
                "{}={}",
                k.name(),
                v.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join("+")
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `base` (the model's config JSON, Triton's field names) with a combination applied.
pub fn apply(base: &Value, combo: &[(Key, Vec<u64>)], model: &str) -> Result<Value, String> {
    let mut cfg = base.clone();
    let obj = cfg
        .as_object_mut()
        .ok_or_else(|| format!("the config of '{model}' is not a JSON object"))?;
    for (key, v) in combo {
        match key {
            Key::MaxBatchSize => {
                obj.insert("max_batch_size".into(), json!(v[0]));
            }
            Key::MaxQueueDelay | Key::PreferredBatchSize => {
                if obj.get("sequence_batching").is_some_and(|s| !s.is_null()) {
                    return Err(format!(
                        "--sweep {}: model '{model}' uses sequence batching, which has no dynamic batcher to tune",
                        key.name()
                    ));
                }
                let db = obj.entry("dynamic_batching").or_insert_with(|| json!({}));
                if db.is_null() {
                    *db = json!({});
                }
                let db = db
                    .as_object_mut()
                    .ok_or_else(|| format!("dynamic_batching of '{model}' is not an object"))?;
                if *key == Key::MaxQueueDelay {
                    db.insert("max_queue_delay_microseconds".into(), json!(v[0]));
                } else {
                    db.insert("preferred_batch_size".into(), json!(v));
                }
            }
            Key::InstanceCount => {
                let groups = obj.entry("instance_group").or_insert_with(|| json!([]));
                let list = groups
                    .as_array_mut()
                    .ok_or_else(|| format!("instance_group of '{model}' is not a list"))?;
                if list.is_empty() {
                    list.push(json!({"kind": "KIND_CPU"}));
                }
                for g in list {
                    if let Some(g) = g.as_object_mut() {
                        g.insert("count".into(), json!(v[0]));
                    }
                }
            }
        }
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_parse_and_combine() {
        let a = parse_axis("max_batch_size=1,8").unwrap();
        let b = parse_axis("preferred_batch_size=4+8,2").unwrap();
        assert_eq!(b.values, vec![vec![4, 8], vec![2]]);
        let c = combinations(&[a, b]);
        assert_eq!(c.len(), 4);
        assert_eq!(label(&c[1]), "max_batch_size=1 preferred_batch_size=2");
        assert!(parse_axis("nope=1")
            .unwrap_err()
            .contains("'nope' cannot be swept"));
        assert!(parse_axis("max_batch_size").unwrap_err().contains("KEY=V1"));
        assert!(parse_axis("max_batch_size=x").unwrap_err().contains("'x'"));
        assert!(parse_axis("max_batch_size=1+2")
            .unwrap_err()
            .contains("only preferred"));
        assert!(parse_axis("instance_count=0").is_err());
    }

    #[test]
    fn overrides_land_in_the_config() {
        let base = json!({"name": "m", "max_batch_size": 4, "instance_group": [{"count": 1, "kind": "KIND_CPU"}]});
        let combo = combinations(&[
            parse_axis("max_batch_size=8").unwrap(),
            parse_axis("instance_count=3").unwrap(),
            parse_axis("max_queue_delay_microseconds=100").unwrap(),
        ])
        .remove(0);
        let c = apply(&base, &combo, "m").unwrap();
        assert_eq!(c["max_batch_size"], 8);
        assert_eq!(c["instance_group"][0]["count"], 3);
        assert_eq!(c["dynamic_batching"]["max_queue_delay_microseconds"], 100);
        let seq = json!({"sequence_batching": {}});
        assert!(apply(&seq, &combo, "m")
            .unwrap_err()
            .contains("sequence batching"));
    }
}
