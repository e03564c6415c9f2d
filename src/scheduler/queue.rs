//! The scheduler's request queue: one FIFO per priority level, each with its queue policy
//! (timeout, timeout action, maximum size). Scan order is level 1 (highest) first; within a
//! level, requests whose timeout expired with action DELAY come after the others.

use super::dynamic::Candidate;
use crate::config::{DynamicBatching, QueuePolicy, TimeoutAction};
use crate::request::Request;
use crate::status::{Error, Result};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A queued request and what the scheduler derived from it at enqueue.
pub struct Queued {
    pub req: Box<Request>,
    pub deadline: Option<Instant>,
    /// Non-batch dims of every input, separated by -2; None = ragged.
    pub shape_key: Option<smallvec::SmallVec<[i64; 8]>>,
}

impl Queued {
    pub fn candidate(&self) -> Candidate<'_> {
        Candidate {
            batch_size: self.req.batch_size,
            shape_key: self.shape_key.as_deref(),
            enqueued_at: self.req.enqueued_at,
        }
    }
}

struct Level {
    policy: QueuePolicy,
    main: VecDeque<Queued>,
    delayed: VecDeque<Queued>,
}

pub struct PriorityQueue {
    levels: Vec<Level>,
    /// 0-based index of the level used when a request gives no priority.
    default_level: usize,
    len: usize,
    /// No request has a deadline before this (None: none has one), so most scans for
    /// expired requests are skipped.
    earliest_deadline: Option<Instant>,
}

impl PriorityQueue {
    pub fn new(batching: Option<&DynamicBatching>) -> PriorityQueue {
        let (levels, default_level) = match batching {
            Some(db) => {
                let n = db.level_count();
                let levels = (0..n)
                    .map(|i| Level {
                        policy: if db.priority_levels == 0 {
                            db.default_queue_policy
                        } else {
                            db.policy(i as u32 + 1)
                        },
                        main: VecDeque::new(),
                        delayed: VecDeque::new(),
                    })
                    .collect();
                (levels, db.default_priority_level.saturating_sub(1) as usize)
            }
            None => (
                vec![Level {
                    policy: QueuePolicy::default(),
                    main: VecDeque::new(),
                    delayed: VecDeque::new(),
                }],
                0,
            ),
        };
        PriorityQueue {
            levels,
            default_level,
            len: 0,
            earliest_deadline: None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 0-based level for a request priority (0 = default; 1 = highest), or an error
    /// naming the valid range.
    pub fn level_of(&self, priority: u32) -> Result<usize> {
        if priority == 0 {
            return Ok(self.default_level);
        }
        if self.levels.len() == 1 {
            // Priorities off: Triton ignores the request priority.
            return Ok(0);
        }
        let i = priority as usize - 1;
        if i >= self.levels.len() {
            return Err(Error::invalid(format!(
                "priority {priority} is out of range: the model has priority levels 1..={}",
                self.levels.len()
            )));
        }
        Ok(i)
    }

    /// The timeout a request gets at `level` given its own `timeout_us` (0 = none).
    pub fn timeout_for(&self, level: usize, request_timeout_us: u64) -> Option<Duration> {
        let p = &self.levels[level].policy;
        let us = match (p.default_timeout_us, request_timeout_us) {
            (d, 0) => d,
            (0, r) => r,
            // A request may shorten the default only where the policy allows overriding.
            (d, r) if p.allow_timeout_override => r.min(d),
            (d, _) => d,
        };
        (us > 0).then(|| Duration::from_micros(us))
    }

    /// Adds a request at the back of its level, or gives it back when the level is full.
    pub fn push(&mut self, level: usize, q: Queued) -> std::result::Result<(), (Queued, Error)> {
        let l = &mut self.levels[level];
        let max = l.policy.max_queue_size as usize;
        if max > 0 && l.main.len() + l.delayed.len() >= max {
            let err = Error::exhausted(format!(
                "queue is full: {max} requests queued at priority level {}",
                level + 1
            ));
            return Err((q, err));
        }
        if let Some(d) = q.deadline {
            self.earliest_deadline = Some(self.earliest_deadline.map_or(d, |e| e.min(d)));
        }
        l.main.push_back(q);
        self.len += 1;
        Ok(())
    }

    /// Applies timeouts: expired REJECT requests are removed into `rejected`, expired
    /// DELAY requests move behind the other requests of their level.
    pub fn expire(&mut self, now: Instant, rejected: &mut Vec<Queued>) {
        match self.earliest_deadline {
            Some(d) if d <= now => {}
            _ => return,
        }
        let mut earliest: Option<Instant> = None;
        for l in &mut self.levels {
            let mut keep = VecDeque::with_capacity(l.main.len());
            for q in l.main.drain(..) {
                match q.deadline {
                    Some(d) if d <= now => match l.policy.timeout_action {
                        TimeoutAction::Reject => rejected.push(q),
                        TimeoutAction::Delay => l.delayed.push_back(Queued {
                            deadline: None,
                            ..q
                        }),
                    },
                    Some(d) => {
                        earliest = Some(earliest.map_or(d, |e| e.min(d)));
                        keep.push_back(q);
                    }
                    None => keep.push_back(q),
                }
            }
            l.main = keep;
        }
        self.len -= rejected.len();
        self.earliest_deadline = earliest;
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.earliest_deadline
    }

    /// Requests in scan order.
    pub fn iter(&self) -> impl Iterator<Item = &Queued> {
        self.levels
            .iter()
            .flat_map(|l| l.main.iter().chain(l.delayed.iter()))
    }

    /// Removes the first `n` requests in scan order.
    pub fn pop_front(&mut self, n: usize, out: &mut Vec<Queued>) {
        let mut left = n;
        for l in &mut self.levels {
            while left > 0 {
                let Some(q) = l.main.pop_front().or_else(|| l.delayed.pop_front()) else {
                    break;
                };
                out.push(q);
                left -= 1;
            }
        }
        self.len -= n - left;
    }

    pub fn remove(&mut self, request_id: u64) -> Option<Queued> {
        for l in &mut self.levels {
            for dq in [&mut l.main, &mut l.delayed] {
                if let Some(i) = dq.iter().position(|q| q.req.id == request_id) {
                    self.len -= 1;
                    return dq.remove(i);
                }
            }
        }
        None
    }

    pub fn drain(&mut self) -> Vec<Queued> {
        let mut out = Vec::with_capacity(self.len);
        for l in &mut self.levels {
            out.extend(l.main.drain(..));
            out.extend(l.delayed.drain(..));
        }
        self.len = 0;
        self.earliest_deadline = None;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn queued(id: u64, deadline: Option<Instant>) -> Queued {
        let mut r = Request::new("m", -1, None);
        r.id = id;
        Queued {
            req: Box::new(r),
            deadline,
            shape_key: None,
        }
    }

    fn batching(levels: u32, default: u32) -> DynamicBatching {
        let mut policies = BTreeMap::new();
        policies.insert(
            2,
            QueuePolicy {
                timeout_action: TimeoutAction::Delay,
                default_timeout_us: 0,
                allow_timeout_override: true,
                max_queue_size: 2,
            },
        );
        DynamicBatching {
            priority_levels: levels,
            default_priority_level: default,
            priority_queue_policy: policies,
            ..Default::default()
        }
    }

    fn ids(q: &PriorityQueue) -> Vec<u64> {
        q.iter().map(|q| q.req.id).collect()
    }

    #[test]
    fn scan_order_is_priority_then_arrival() {
        let db = batching(2, 2);
        let mut q = PriorityQueue::new(Some(&db));
        let lo = q.level_of(0).unwrap();
        assert_eq!(lo, 1);
        q.push(lo, queued(1, None)).ok().unwrap();
        q.push(0, queued(2, None)).ok().unwrap();
        q.push(lo, queued(3, None)).ok().unwrap();
        q.push(0, queued(4, None)).ok().unwrap();
        assert_eq!(ids(&q), vec![2, 4, 1, 3]);
        let mut out = Vec::new();
        q.pop_front(3, &mut out);
        assert_eq!(
            out.iter().map(|q| q.req.id).collect::<Vec<_>>(),
            vec![2, 4, 1]
        );
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn level_full_is_resource_exhausted() {
        let db = batching(2, 1);
        let mut q = PriorityQueue::new(Some(&db));
        q.push(1, queued(1, None)).ok().unwrap();
        q.push(1, queued(2, None)).ok().unwrap();
        let (back, err) = q.push(1, queued(3, None)).err().unwrap();
        assert_eq!(back.req.id, 3);
        assert_eq!(err.code, crate::status::Code::ResourceExhausted);
        assert!(err.message.contains("level 2"), "{}", err.message);
        // Level 1 has no limit.
        q.push(0, queued(4, None)).ok().unwrap();
    }

    #[test]
    fn priority_out_of_range() {
        let q = PriorityQueue::new(Some(&batching(2, 1)));
        let e = q.level_of(3).unwrap_err();
        assert!(e.message.contains("1..=2"), "{}", e.message);
        // Priorities off: any priority is accepted and ignored.
        let q = PriorityQueue::new(None);
        assert_eq!(q.level_of(7).unwrap(), 0);
    }

    #[test]
    fn timeouts_reject_or_delay() {
        let t0 = Instant::now();
        let db = batching(2, 1);
        let mut q = PriorityQueue::new(Some(&db));
        let soon = Some(t0 + Duration::from_micros(10));
        q.push(0, queued(1, soon)).ok().unwrap(); // level 1: REJECT
        q.push(0, queued(2, None)).ok().unwrap();
        q.push(1, queued(3, soon)).ok().unwrap(); // level 2: DELAY
        q.push(1, queued(4, None)).ok().unwrap();
        let mut rejected = Vec::new();
        q.expire(t0, &mut rejected);
        assert!(rejected.is_empty());
        q.expire(t0 + Duration::from_micros(10), &mut rejected);
        assert_eq!(
            rejected.iter().map(|q| q.req.id).collect::<Vec<_>>(),
            vec![1]
        );
        assert_eq!(ids(&q), vec![2, 4, 3]);
        assert_eq!(q.len(), 3);
        assert_eq!(q.next_deadline(), None);
    }

    #[test]
    fn timeout_override_rules() {
        let mut db = batching(2, 1);
        db.default_queue_policy.default_timeout_us = 100;
        let q = PriorityQueue::new(Some(&db));
        // Level 1: default policy, override not allowed -> the default wins.
        assert_eq!(q.timeout_for(0, 50), Some(Duration::from_micros(100)));
        assert_eq!(q.timeout_for(0, 0), Some(Duration::from_micros(100)));
        // Level 2: no default, override allowed.
        assert_eq!(q.timeout_for(1, 50), Some(Duration::from_micros(50)));
        assert_eq!(q.timeout_for(1, 0), None);
    }

    #[test]
    fn remove_and_drain() {
        let mut q = PriorityQueue::new(None);
        for i in 1..=3 {
            q.push(0, queued(i, None)).ok().unwrap();
        }
        assert_eq!(q.remove(2).map(|q| q.req.id), Some(2));
        assert!(q.remove(2).is_none());
        assert_eq!(q.drain().len(), 2);
        assert!(q.is_empty());
    }
}
