//! The scheduler's request queue: one FIFO per priority level, each with its queue policy
//! (timeout, timeout action, maximum size). Scan order is level 1 (highest) first; within a
//! level, requests whose timeout expired with action DELAY come after the others.

use super::dynamic::Candidate;
use crate::config::{DynamicBatching, QueuePolicy, TimeoutAction};
use crate::request::Request;
use crate::status::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
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

/// A FIFO from whose middle an entry can be taken in O(1): it leaves a hole that the
/// ends skip. Every entry has a position number (they only grow) that finds it.
#[derive(Default)]
struct Fifo {
    slots: VecDeque<Option<Queued>>,
    /// The position number of `slots[0]`.
    head: u64,
    /// Entries that are not holes.
    live: usize,
}

impl Fifo {
    /// Adds `q` at the back; its position number.
    fn push(&mut self, q: Queued) -> u64 {
        let pos = self.head + self.slots.len() as u64;
        self.slots.push_back(Some(q));
        self.live += 1;
        pos
    }

    fn pop(&mut self) -> Option<Queued> {
        while let Some(slot) = self.slots.pop_front() {
            self.head += 1;
            if let Some(q) = slot {
                self.live -= 1;
                return Some(q);
            }
        }
        None
    }

    /// Takes the entry at position `pos` out.
    fn take(&mut self, pos: u64) -> Option<Queued> {
        let i = usize::try_from(pos.checked_sub(self.head)?).ok()?;
        let q = self.slots.get_mut(i)?.take()?;
        self.live -= 1;
        while matches!(self.slots.front(), Some(None)) {
            self.slots.pop_front();
            self.head += 1;
        }
        while matches!(self.slots.back(), Some(None)) {
            self.slots.pop_back();
        }
        Some(q)
    }

    fn iter(&self) -> impl Iterator<Item = &Queued> {
        self.slots.iter().flatten()
    }

    /// Takes every entry out, in order.
    fn take_all(&mut self) -> impl Iterator<Item = Queued> + '_ {
        self.head += self.slots.len() as u64;
        self.live = 0;
        self.slots.drain(..).flatten()
    }
}

struct Level {
    policy: QueuePolicy,
    main: Fifo,
    delayed: Fifo,
}

/// Where a queued request is: its level, which FIFO (delayed or not) and its position.
#[derive(Clone, Copy)]
struct Place {
    level: u32,
    delayed: bool,
    pos: u64,
}

/// Hashes request ids (unique integers) with one multiplication.
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type IdMap = HashMap<u64, Place, BuildHasherDefault<IdHasher>>;

pub struct PriorityQueue {
    levels: Vec<Level>,
    /// 0-based index of the level used when a request gives no priority.
    default_level: usize,
    len: usize,
    /// No request has a deadline before this (None: none has one), so most scans for
    /// expired requests are skipped.
    earliest_deadline: Option<Instant>,
    /// Every queued request by id, kept while the queue is long and requests are being
    /// cancelled: a cancel then finds its request without a scan. Short queues are
    /// scanned, and the enqueue/dequeue path pays nothing for an index.
    index: Option<IdMap>,
}

/// Queue length from which a cancel builds the index.
const INDEX_FROM: usize = 4096;

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
                        main: Fifo::default(),
                        delayed: Fifo::default(),
                    })
                    .collect();
                (levels, db.default_priority_level.saturating_sub(1) as usize)
            }
            None => (
                vec![Level {
                    policy: QueuePolicy::default(),
                    main: Fifo::default(),
                    delayed: Fifo::default(),
                }],
                0,
            ),
        };
        PriorityQueue {
            levels,
            default_level,
            len: 0,
            earliest_deadline: None,
            index: None,
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
        if max > 0 && l.main.live + l.delayed.live >= max {
            let err = Error::exhausted(format!(
                "queue is full: {max} requests queued at priority level {}",
                level + 1
            ));
            return Err((q, err));
        }
        if let Some(d) = q.deadline {
            self.earliest_deadline = Some(self.earliest_deadline.map_or(d, |e| e.min(d)));
        }
        let id = q.req.id;
        let pos = l.main.push(q);
        if let Some(index) = &mut self.index {
            index.insert(
                id,
                Place {
                    level: level as u32,
                    delayed: false,
                    pos,
                },
            );
        }
        self.len += 1;
        Ok(())
    }

    /// Applies timeouts: expired REJECT requests are removed into `rejected`, expired
    /// DELAY requests move behind the others of their level (without a deadline).
    pub fn expire(&mut self, now: Instant, rejected: &mut Vec<Queued>) {
        match self.earliest_deadline {
            Some(d) if d <= now => {}
            _ => return,
        }
        let mut earliest: Option<Instant> = None;
        let before = rejected.len();
        for (li, l) in self.levels.iter_mut().enumerate() {
            let mut old = std::mem::take(&mut l.main);
            l.main.head = old.head + old.slots.len() as u64;
            for q in old.take_all() {
                let id = q.req.id;
                let (delayed, pos) = match q.deadline {
                    Some(d) if d <= now => match l.policy.timeout_action {
                        TimeoutAction::Reject => {
                            if let Some(index) = &mut self.index {
                                index.remove(&id);
                            }
                            rejected.push(q);
                            continue;
                        }
                        TimeoutAction::Delay => (
                            true,
                            l.delayed.push(Queued {
                                deadline: None,
                                ..q
                            }),
                        ),
                    },
                    Some(d) => {
                        earliest = Some(earliest.map_or(d, |e| e.min(d)));
                        (false, l.main.push(q))
                    }
                    None => (false, l.main.push(q)),
                };
                if let Some(index) = &mut self.index {
                    index.insert(
                        id,
                        Place {
                            level: li as u32,
                            delayed,
                            pos,
                        },
                    );
                }
            }
        }
        self.len -= rejected.len() - before;
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
                let Some(q) = l.main.pop().or_else(|| l.delayed.pop()) else {
                    break;
                };
                if let Some(index) = &mut self.index {
                    index.remove(&q.req.id);
                }
                out.push(q);
                left -= 1;
            }
        }
        self.len -= n - left;
        if self.len < INDEX_FROM / 4 {
            self.index = None;
        }
    }

    /// Takes a queued request out by id: a scan of a short queue, a look-up in a long
    /// one (the index is built at the first cancel).
    pub fn remove(&mut self, request_id: u64) -> Option<Queued> {
        if self.index.is_none() && self.len >= INDEX_FROM {
            self.index = Some(self.build_index());
        }
        let place = match &mut self.index {
            Some(index) => index.remove(&request_id)?,
            None => self.find(request_id)?,
        };
        let l = self.levels.get_mut(place.level as usize)?;
        let fifo = if place.delayed {
            &mut l.delayed
        } else {
            &mut l.main
        };
        let q = fifo.take(place.pos)?;
        self.len -= 1;
        Some(q)
    }

    /// Where request `id` is, by a scan.
    fn find(&self, id: u64) -> Option<Place> {
        self.places().find(|(qid, _)| *qid == id).map(|(_, p)| p)
    }

    fn build_index(&self) -> IdMap {
        let mut index = IdMap::with_capacity_and_hasher(self.len, Default::default());
        index.extend(self.places());
        index
    }

    /// Every queued request's id and place.
    fn places(&self) -> impl Iterator<Item = (u64, Place)> + '_ {
        self.levels.iter().enumerate().flat_map(|(li, l)| {
            [(false, &l.main), (true, &l.delayed)]
                .into_iter()
                .flat_map(move |(delayed, f)| {
                    f.slots.iter().enumerate().filter_map(move |(i, slot)| {
                        let q = slot.as_ref()?;
                        Some((
                            q.req.id,
                            Place {
                                level: li as u32,
                                delayed,
                                pos: f.head + i as u64,
                            },
                        ))
                    })
                })
        })
    }

    pub fn drain(&mut self) -> Vec<Queued> {
        let mut out = Vec::with_capacity(self.len);
        for l in &mut self.levels {
            out.extend(l.main.take_all());
            out.extend(l.delayed.take_all());
        }
        self.len = 0;
        self.earliest_deadline = None;
        self.index = None;
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

    #[test]
    fn removal_leaves_holes_that_pops_and_scans_skip() {
        let mut q = PriorityQueue::new(None);
        for i in 1..=6 {
            q.push(0, queued(i, None)).ok().unwrap();
        }
        // The middle, the front and the back.
        for id in [3, 1, 6] {
            assert_eq!(q.remove(id).map(|q| q.req.id), Some(id));
        }
        assert_eq!(ids(&q), vec![2, 4, 5]);
        assert_eq!(q.len(), 3);
        q.push(0, queued(7, None)).ok().unwrap();
        let mut out = Vec::new();
        q.pop_front(2, &mut out);
        assert_eq!(out.iter().map(|q| q.req.id).collect::<Vec<_>>(), vec![2, 4]);
        assert!(q.remove(2).is_none(), "a popped request is not found");
        assert_eq!(q.remove(7).map(|q| q.req.id), Some(7));
        assert_eq!(ids(&q), vec![5]);
    }

    /// Random pushes, pops, removals and expiries against a plain list, on a short queue
    /// (cancels scan) and on a long one (cancels use the index).
    #[test]
    fn behaves_like_a_list_scanned_in_order() {
        like_a_list(0, 20_000);
        like_a_list(INDEX_FROM + 500, 3_000);
    }

    fn like_a_list(prefill: usize, steps: usize) {
        let t0 = Instant::now();
        let db = batching(2, 1);
        let mut q = PriorityQueue::new(Some(&db));
        // (id, level, deadline, delayed) in scan order within a level.
        let mut model: Vec<(u64, usize, Option<Instant>, bool)> = Vec::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next_id = 1u64;
        let mut now = t0;
        for _ in 0..prefill {
            q.push(0, queued(next_id, None)).ok().unwrap();
            model.push((next_id, 0, None, false));
            next_id += 1;
        }
        for _ in 0..steps {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            match rng % 10 {
                0..=3 => {
                    let level = (rng >> 8) as usize % 2;
                    let deadline = (rng >> 16)
                        .is_multiple_of(3)
                        .then(|| now + Duration::from_micros((rng >> 20) % 50));
                    let id = next_id;
                    next_id += 1;
                    let full = level == 1 && model.iter().filter(|m| m.1 == 1).count() >= 2;
                    let pushed = q.push(level, queued(id, deadline)).is_ok();
                    assert_eq!(pushed, !full);
                    if pushed {
                        model.push((id, level, deadline, false));
                    }
                }
                4..=6 if next_id > 1 => {
                    let id = 1 + (rng >> 8) % (next_id - 1);
                    let want = model.iter().position(|m| m.0 == id);
                    assert_eq!(
                        q.remove(id).map(|q| q.req.id),
                        want.map(|i| model.remove(i).0)
                    );
                }
                7 => {
                    let n = ((rng >> 8) % 4) as usize;
                    let mut out = Vec::new();
                    q.pop_front(n, &mut out);
                    let order = scan_order(&model);
                    let want: Vec<u64> = order.iter().take(n).copied().collect();
                    assert_eq!(out.iter().map(|q| q.req.id).collect::<Vec<_>>(), want);
                    model.retain(|m| !want.contains(&m.0));
                }
                _ => {
                    now += Duration::from_micros((rng >> 8) % 20);
                    let mut rejected = Vec::new();
                    q.expire(now, &mut rejected);
                    // Level 1 rejects; level 2 delays (its policy in `batching`).
                    let mut want_rejected = Vec::new();
                    let mut newly_delayed = Vec::new();
                    for m in model.iter_mut() {
                        if m.2.is_some_and(|d| d <= now) {
                            if m.1 == 0 {
                                want_rejected.push(m.0);
                            } else {
                                m.2 = None;
                                m.3 = true;
                                newly_delayed.push(m.0);
                            }
                        }
                    }
                    // Newly delayed requests go behind those delayed before, in order.
                    model.retain(|m| !want_rejected.contains(&m.0));
                    let (mut rest, mut moved): (Vec<_>, Vec<_>) =
                        model.drain(..).partition(|m| !newly_delayed.contains(&m.0));
                    rest.append(&mut moved);
                    model = rest;
                    let mut got: Vec<u64> = rejected.iter().map(|q| q.req.id).collect();
                    got.sort_unstable();
                    want_rejected.sort_unstable();
                    assert_eq!(got, want_rejected);
                }
            }
            assert_eq!(ids(&q), scan_order(&model));
            assert_eq!(q.len(), model.len());
        }
    }

    fn scan_order(model: &[(u64, usize, Option<Instant>, bool)]) -> Vec<u64> {
        let mut out = Vec::new();
        for level in 0..2 {
            for delayed in [false, true] {
                out.extend(
                    model
                        .iter()
                        .filter(|m| m.1 == level && m.3 == delayed)
                        .map(|m| m.0),
                );
            }
        }
        out
    }
}
