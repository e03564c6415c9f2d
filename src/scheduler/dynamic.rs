//! The dynamic batcher's batch decision: a pure function of the queue (in scan order)
//! and the current time, so it is tested without threads or sleeps.
//!
//! Semantics follow Triton's dynamic batcher: requests join in arrival order (within
//! priority order) while the batch fits and shapes match; a batch of the largest preferred
//! size that can be formed is sent at once; otherwise the batcher waits up to the queue
//! delay for the batch to fill, and a delay of 0 sends what is there.

use std::time::{Duration, Instant};

/// What the decision sees of one queued request.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    /// Rows the request adds to the batch.
    pub batch_size: u32,
    /// Requests can share a batch only when their keys are equal (None: ragged, any).
    pub shape_key: Option<&'a [i64]>,
    pub enqueued_at: Instant,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Largest batch, in rows (1 for models that do not batch).
    pub max_batch_size: u32,
    /// Ascending.
    pub preferred: Vec<u32>,
    pub max_queue_delay: Duration,
}

impl BatchPolicy {
    /// The default scheduler: every request executes alone, at once.
    pub fn single() -> BatchPolicy {
        BatchPolicy {
            max_batch_size: 1,
            preferred: Vec::new(),
            max_queue_delay: Duration::ZERO,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Send the first `n` requests (in scan order) as one batch.
    Execute(usize),
    /// Nothing to send before this instant, unless the queue changes.
    WaitUntil(Instant),
    /// The queue is empty.
    Idle,
}

/// Decides the next batch from the queue in scan order.
///
/// The scan takes requests while they fit `max_batch_size` and share a shape. While the
/// queue delay has not run out, a batch is cut at a preferred size (the largest one the
/// scan can form) and never grows past the largest preferred size; once it has run out
/// (or when it is 0 without any preferred size formed), what was scanned goes.
pub fn decide<'a>(
    policy: &BatchPolicy,
    queue: impl IntoIterator<Item = Candidate<'a>>,
    now: Instant,
) -> Decision {
    let limit = policy.max_batch_size.max(1);
    let max_preferred = policy.preferred.last().copied().unwrap_or(limit).min(limit);
    let mut rows = 0u32;
    let mut count = 0usize;
    // Requests that fit within the largest preferred size.
    let mut within_preferred = 0usize;
    let mut oldest: Option<Instant> = None;
    let mut key: Option<Option<&[i64]>> = None;
    let mut blocked = false;
    let mut best_preferred = 0usize;
    for c in queue {
        let fits_shape = match (key, c.shape_key) {
            (Some(Some(k)), Some(ck)) => k == ck,
            _ => true,
        };
        // A request larger than the limit still goes alone rather than starving.
        let fits_size = rows + c.batch_size <= limit || count == 0;
        if !fits_shape || !fits_size {
            blocked = true;
            break;
        }
        if key.is_none() {
            key = Some(c.shape_key);
        }
        rows += c.batch_size;
        count += 1;
        if rows <= max_preferred || within_preferred == 0 {
            within_preferred = count;
        }
        oldest = Some(oldest.map_or(c.enqueued_at, |o: Instant| o.min(c.enqueued_at)));
        if policy.preferred.binary_search(&rows).is_ok() {
            best_preferred = count;
        }
        if rows >= limit {
            break;
        }
    }
    let Some(oldest) = oldest else {
        return Decision::Idle;
    };
    let delay = policy.max_queue_delay;
    if !delay.is_zero() && now >= oldest + delay {
        return Decision::Execute(count);
    }
    // A preferred size that can be formed goes at once.
    if best_preferred > 0 {
        return Decision::Execute(best_preferred);
    }
    // Without a preferred size: send when the batch cannot grow, or may not wait.
    if rows >= max_preferred {
        return Decision::Execute(within_preferred);
    }
    if blocked || delay.is_zero() {
        return Decision::Execute(count);
    }
    Decision::WaitUntil(oldest + delay)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max: u32, preferred: &[u32], delay_us: u64) -> BatchPolicy {
        BatchPolicy {
            max_batch_size: max,
            preferred: preferred.to_vec(),
            max_queue_delay: Duration::from_micros(delay_us),
        }
    }

    /// Queue of `sizes` requests enqueued 1 us apart starting at `t0`.
    fn queue<'a>(t0: Instant, sizes: &[u32], keys: &[Option<&'a [i64]>]) -> Vec<Candidate<'a>> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| Candidate {
                batch_size: s,
                shape_key: keys.get(i).copied().unwrap_or(Some(&[16])),
                enqueued_at: t0 + Duration::from_micros(i as u64),
            })
            .collect()
    }

    #[test]
    fn empty_queue_is_idle() {
        let t0 = Instant::now();
        assert_eq!(
            decide(&policy(8, &[], 100), queue(t0, &[], &[]), t0),
            Decision::Idle
        );
    }

    #[test]
    fn zero_delay_sends_what_is_there() {
        let t0 = Instant::now();
        let d = decide(&policy(8, &[], 0), queue(t0, &[1, 1, 1], &[]), t0);
        assert_eq!(d, Decision::Execute(3));
    }

    #[test]
    fn full_batch_goes_at_once_and_rest_waits() {
        let t0 = Instant::now();
        let d = decide(&policy(4, &[], 1000), queue(t0, &[1; 6], &[]), t0);
        assert_eq!(d, Decision::Execute(4));
    }

    #[test]
    fn waits_for_delay_then_sends_partial() {
        let t0 = Instant::now();
        let p = policy(8, &[], 100);
        let q = queue(t0, &[1, 1, 1], &[]);
        assert_eq!(
            decide(&p, q.clone(), t0 + Duration::from_micros(50)),
            Decision::WaitUntil(t0 + Duration::from_micros(100))
        );
        assert_eq!(
            decide(&p, q, t0 + Duration::from_micros(100)),
            Decision::Execute(3)
        );
    }

    #[test]
    fn largest_preferred_prefix_goes_at_once() {
        let t0 = Instant::now();
        let p = policy(16, &[2, 4, 8], 1000);
        // 5 queued: a preferred batch of 4 can be formed now.
        assert_eq!(
            decide(&p, queue(t0, &[1; 5], &[]), t0),
            Decision::Execute(4)
        );
        // 8 queued: the largest preferred size, at once.
        assert_eq!(
            decide(&p, queue(t0, &[1; 9], &[]), t0),
            Decision::Execute(8)
        );
        // 1 queued: no preferred size reachable yet, wait.
        assert!(matches!(
            decide(&p, queue(t0, &[1], &[]), t0),
            Decision::WaitUntil(_)
        ));
        // After the delay, whatever is there goes even if not preferred.
        assert_eq!(
            decide(&p, queue(t0, &[1; 3], &[]), t0 + Duration::from_millis(2)),
            Decision::Execute(3)
        );
    }

    #[test]
    fn preferred_sizes_count_rows_not_requests() {
        let t0 = Instant::now();
        let p = policy(16, &[4], 1000);
        // 2 + 2 rows = 4: preferred.
        assert_eq!(
            decide(&p, queue(t0, &[2, 2, 1], &[]), t0),
            Decision::Execute(2)
        );
        // 3 + 3 rows: 4 can't be hit; batch can't grow past... waits.
        assert!(matches!(
            decide(&p, queue(t0, &[3], &[]), t0),
            Decision::WaitUntil(_)
        ));
        // 3 then 3: blocked (6 > 4), send the 3 alone.
        assert_eq!(
            decide(&p, queue(t0, &[3, 3], &[]), t0),
            Decision::Execute(1)
        );
    }

    #[test]
    fn shape_mismatch_stops_the_batch() {
        let t0 = Instant::now();
        let a: &[i64] = &[16];
        let b: &[i64] = &[8];
        let p = policy(8, &[], 1000);
        let q = queue(t0, &[1, 1, 1], &[Some(a), Some(a), Some(b)]);
        assert_eq!(decide(&p, q, t0), Decision::Execute(2));
        // Ragged (None) requests batch with anything.
        let q = queue(t0, &[1, 1], &[None, Some(b)]);
        assert!(matches!(decide(&p, q, t0), Decision::WaitUntil(_)));
    }

    #[test]
    fn oversized_request_goes_alone() {
        let t0 = Instant::now();
        let p = policy(4, &[2], 1000);
        assert_eq!(
            decide(&p, queue(t0, &[3, 1], &[]), t0),
            Decision::Execute(1)
        );
    }

    #[test]
    fn after_the_delay_everything_up_to_max_batch_size_goes() {
        let t0 = Instant::now();
        let p = policy(16, &[4], 1000);
        let late = t0 + Duration::from_millis(5);
        // 12 queued, preferred 4: before the delay the preferred 4 goes; after it, all 12.
        assert_eq!(
            decide(&p, queue(t0, &[1; 12], &[]), t0),
            Decision::Execute(4)
        );
        assert_eq!(
            decide(&p, queue(t0, &[1; 12], &[]), late),
            Decision::Execute(12)
        );
    }

    #[test]
    fn zero_delay_prefers_a_preferred_size() {
        let t0 = Instant::now();
        let p = policy(16, &[4, 8], 0);
        assert_eq!(
            decide(&p, queue(t0, &[1; 6], &[]), t0),
            Decision::Execute(4)
        );
        assert_eq!(
            decide(&p, queue(t0, &[1; 3], &[]), t0),
            Decision::Execute(3)
        );
    }

    #[test]
    fn default_scheduler_sends_one() {
        let t0 = Instant::now();
        assert_eq!(
            decide(&BatchPolicy::single(), queue(t0, &[1, 1], &[]), t0),
            Decision::Execute(1)
        );
    }
}
