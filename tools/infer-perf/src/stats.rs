//! The server side of a measurement: differences of the model's statistics
//! (`infer_server_statistics_json`) between two moments.

use crate::capi::Server;
use serde_json::Value;
use std::collections::BTreeMap;

/// (count, total microseconds) of one of the statistics' timers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timer {
    pub count: u64,
    pub total_us: u64,
}

impl Timer {
    fn of(v: &Value) -> Timer {
        Timer {
            count: v["count"].as_u64().unwrap_or(0),
            total_us: v["total"].as_u64().unwrap_or(0),
        }
    }

    fn minus(self, o: Timer) -> Timer {
        Timer {
            count: self.count.saturating_sub(o.count),
            total_us: self.total_us.saturating_sub(o.total_us),
        }
    }

    fn plus(self, o: Timer) -> Timer {
        Timer {
            count: self.count + o.count,
            total_us: self.total_us + o.total_us,
        }
    }

    /// The mean, in microseconds (0 without samples).
    pub fn mean_us(self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.total_us as f64 / self.count as f64
        }
    }
}

/// The counters of one model at one moment.
#[derive(Clone, Debug, Default)]
pub struct ServerSnapshot(ServerDelta);

/// What the server did between two snapshots.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServerDelta {
    pub executions: u64,
    pub inferences: u64,
    /// Per request.
    pub queue: Timer,
    /// Per execution: assembling inputs, the backend, splitting outputs.
    pub compute_input: Timer,
    pub compute_infer: Timer,
    pub compute_output: Timer,
    /// Executed batch size -> executions.
    pub batch_sizes: BTreeMap<u64, u64>,
}

impl ServerSnapshot {
    pub fn take(server: &Server, model: &str) -> Result<ServerSnapshot, String> {
        Ok(ServerSnapshot::parse(&server.stats(model)?))
    }

    pub fn parse(v: &Value) -> ServerSnapshot {
        let batch_sizes = v["batch_sizes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| Some((b["size"].as_u64()?, b["count"].as_u64()?)))
            .collect();
        ServerSnapshot(ServerDelta {
            executions: v["execution_count"].as_u64().unwrap_or(0),
            inferences: v["inference_count"].as_u64().unwrap_or(0),
            queue: Timer::of(&v["queue_us"]),
            compute_input: Timer::of(&v["compute_input_us"]),
            compute_infer: Timer::of(&v["compute_infer_us"]),
            compute_output: Timer::of(&v["compute_output_us"]),
            batch_sizes,
        })
    }

    /// What happened since `before` (a reload resets the counters: never negative).
    pub fn since(&self, before: &ServerSnapshot) -> ServerDelta {
        let (a, b) = (&self.0, &before.0);
        let batch_sizes = a
            .batch_sizes
            .iter()
            .map(|(s, c)| {
                (
                    *s,
                    c.saturating_sub(b.batch_sizes.get(s).copied().unwrap_or(0)),
                )
            })
            .filter(|(_, c)| *c > 0)
            .collect();
        ServerDelta {
            executions: a.executions.saturating_sub(b.executions),
            inferences: a.inferences.saturating_sub(b.inferences),
            queue: a.queue.minus(b.queue),
            compute_input: a.compute_input.minus(b.compute_input),
            compute_infer: a.compute_infer.minus(b.compute_infer),
            compute_output: a.compute_output.minus(b.compute_output),
            batch_sizes,
        }
    }
}

impl ServerDelta {
    /// The sum of two windows.
    pub fn merge(&self, o: &ServerDelta) -> ServerDelta {
        let mut batch_sizes = self.batch_sizes.clone();
        for (s, c) in &o.batch_sizes {
            *batch_sizes.entry(*s).or_default() += c;
        }
        ServerDelta {
            executions: self.executions + o.executions,
            inferences: self.inferences + o.inferences,
            queue: self.queue.plus(o.queue),
            compute_input: self.compute_input.plus(o.compute_input),
            compute_infer: self.compute_infer.plus(o.compute_infer),
            compute_output: self.compute_output.plus(o.compute_output),
            batch_sizes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_of_the_statistics_json() {
        let a: Value = serde_json::from_str(
            r#"{"execution_count":2,"inference_count":3,"queue_us":{"count":3,"total":30},
                "compute_input_us":{"count":2,"total":4},"compute_infer_us":{"count":2,"total":400},
                "compute_output_us":{"count":2,"total":6},"batch_sizes":[{"size":1,"count":1},{"size":2,"count":1}]}"#,
        )
        .unwrap();
        let b: Value = serde_json::from_str(
            r#"{"execution_count":5,"inference_count":9,"queue_us":{"count":9,"total":120},
                "compute_input_us":{"count":5,"total":10},"compute_infer_us":{"count":5,"total":1000},
                "compute_output_us":{"count":5,"total":15},"batch_sizes":[{"size":1,"count":1},{"size":2,"count":4}]}"#,
        )
        .unwrap();
        let d = ServerSnapshot::parse(&b).since(&ServerSnapshot::parse(&a));
        assert_eq!(d.executions, 3);
        assert_eq!(d.inferences, 6);
        assert_eq!(d.queue.mean_us(), 15.0);
        assert_eq!(d.compute_infer.mean_us(), 200.0);
        assert_eq!(d.batch_sizes, BTreeMap::from([(2, 3)]));
        let m = d.merge(&d);
        assert_eq!(m.batch_sizes, BTreeMap::from([(2, 6)]));
        assert_eq!(m.compute_infer.mean_us(), 200.0);
    }
}
