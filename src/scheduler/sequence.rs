//! The sequence batcher: requests that share a correlation ID form a sequence that runs
//! in order on one model instance, with control tensors (START / END / READY / CORRID)
//! and, optionally, implicit state kept by the library between requests.
//!
//! Every sequence is placed in a slot of one instance when it starts, or waits in a FIFO
//! backlog until a slot frees. Sequences are numbered: once a sequence's END is queued,
//! its correlation ID no longer leads to it, and a new START with that ID begins another
//! sequence (as in Triton), which may run while the old one finishes. With the Direct strategy an instance's slots are its batch
//! rows: a batch covers rows 0..=highest allocated slot, and slots without a ready request
//! are padding (READY false, zero inputs, no response). With the Oldest strategy the slots
//! are candidate places, and batches are the oldest request of each candidate sequence,
//! cut by the dynamic batcher's decision ([`super::dynamic::decide`]); there is no padding.
//!
//! All bookkeeping sits behind one mutex that is never held while a backend, a callback or
//! the log callback runs. The workers (one per instance) do the timers: the idle reaper,
//! backlog timeouts and queue delays are deadlines of their condvar waits.

use super::dynamic::{decide, BatchPolicy, Candidate, Decision};
use super::execute::Batches;
use super::{c_name, CancelOutcome, Kind, Scheduler, ShapeKey};
use crate::config::{
    ControlInput, ControlKind, InitialState, ModelConfig, SequenceBatching, SequenceStrategy,
};
use crate::folder::Folder;
use crate::request::{CorrelationId, Request};
use crate::status::{Error, Result};
use crate::tensor::{element_count, shape_string, DataType, Shape};
use parking_lot::{Condvar, Mutex, MutexGuard};
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FLAG_START: u32 = 1;
const FLAG_END: u32 = 2;

/// One tensor of implicit state, without the batch dimension.
#[derive(Clone, Debug, PartialEq)]
pub struct StateValue {
    pub shape: Shape,
    pub data: Vec<u8>,
}

/// The initial value of each configured state, read once when the model loads. A data
/// file must lie inside `<model_dir>/initial_state/`.
pub fn initial_states(config: &ModelConfig, model_dir: Option<&Folder>) -> Result<Vec<StateValue>> {
    let Some(q) = &config.sequence_batching else {
        return Ok(Vec::new());
    };
    let m = &config.name;
    let mut out = Vec::with_capacity(q.states.len());
    for st in &q.states {
        let dims = st.initial.dims(st);
        let bytes = element_count(&dims)
            .and_then(|n| n.checked_mul(st.data_type.byte_size()))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "model '{m}': initial state of '{}' {} is too large",
                    st.input_name,
                    shape_string(&dims)
                ))
            })?;
        let data = match &st.initial {
            InitialState::Default | InitialState::Zero { .. } => vec![0u8; bytes],
            InitialState::File { file, .. } => {
                read_initial_state(m, &st.input_name, model_dir, file, bytes)?
            }
        };
        out.push(StateValue {
            shape: Shape::from_slice(&dims),
            data,
        });
    }
    Ok(out)
}

fn read_initial_state(
    model: &str,
    state: &str,
    model_dir: Option<&Folder>,
    file: &str,
    bytes: usize,
) -> Result<Vec<u8>> {
    let what = format!("model '{model}': initial state of '{state}' from data_file '{file}'");
    let dir = model_dir.ok_or_else(|| {
        Error::invalid(format!(
            "{what}: the model has no directory to read it from"
        ))
    })?;
    // Every failure here is the config's: INVALID_ARGUMENT, a missing file included.
    let data = dir
        .folder("initial_state", &what)
        .and_then(|f| f.read(file, &what))
        .map_err(|e| Error::invalid(e.message))?;
    if data.len() != bytes {
        return Err(Error::invalid(format!(
            "{what}: the file holds {} bytes, the state needs {bytes}",
            data.len()
        )));
    }
    Ok(data)
}

/// A queued request of a sequence.
struct Pending {
    req: Box<Request>,
    /// Request timeout: enforced while the sequence waits in the backlog.
    deadline: Option<Instant>,
    key: SmallVec<[i64; 8]>,
}

/// A sequence's number in its batcher (a correlation ID may have two sequences at once:
/// one whose END is queued, and a new one started after it).
type SeqId = u64;

struct Seq {
    corr: CorrelationId,
    /// (instance, slot); None while in the backlog.
    place: Option<(usize, usize)>,
    queue: VecDeque<Pending>,
    /// A request of this sequence is executing.
    in_flight: bool,
    last_activity: Instant,
    /// The state the next request sees (None: the initial state).
    states: Option<Vec<StateValue>>,
}

struct SeqState {
    seqs: HashMap<SeqId, Seq>,
    /// The sequence each correlation ID's next request joins: from its START until its
    /// END is queued (as Triton forgets the ID then: a later START begins a new sequence,
    /// in a free slot or the backlog, while the old one finishes).
    open: HashMap<CorrelationId, SeqId>,
    next_seq_id: SeqId,
    /// [instance][slot] -> the sequence there.
    slots: Vec<Vec<Option<SeqId>>>,
    backlog: VecDeque<SeqId>,
    /// Requests taken out (cancelled, timed out) whose error FINAL a worker delivers.
    ending: Vec<(Box<Request>, crate::status::Error)>,
    /// Messages for the log, written by a worker after it unlocks.
    notes: Vec<(u32, String)>,
    queued: usize,
    executing: usize,
    paused: bool,
    closed: bool,
    next_batch_seq: u64,
    /// Earliest instant an idle sequence may be reaped (None: no idle sequence).
    next_idle_check: Option<Instant>,
    /// Earliest request deadline in the backlog.
    backlog_deadline: Option<Instant>,
    /// The deadline the timer is armed for (None: not armed).
    armed: Option<Instant>,
}

/// One request's row in a formed batch.
pub(super) struct RowInfo {
    pub row: u32,
    seq: SeqId,
    corr: CorrelationId,
    flags: u32,
    /// The sequence stays after this row (false: it ended and was removed).
    kept: bool,
    /// The state fed to this row.
    state_in: Vec<StateValue>,
}

/// A batch formed for one instance.
pub(super) struct Formed {
    pub seq_no: u64,
    pub size: u32,
    pub requests: Vec<Box<Request>>,
    pub rows: Vec<RowInfo>,
}

/// A request the sequence batcher took: a warning to log, and a deadline to arm the
/// timer for.
pub(super) struct Enqueued {
    warning: Option<String>,
    arm: Option<Instant>,
}

pub(super) enum Work {
    /// Requests to end with an error.
    End(Vec<(Box<Request>, Error)>),
    Batch(Formed),
    Exit,
}

pub(super) struct Sequencer {
    cfg: SequenceBatching,
    model: String,
    max_batch_size: u32,
    direct: bool,
    slots_per_instance: usize,
    idle: Duration,
    /// Oldest: the batch decision's policy. Direct: only `max_queue_delay` is used.
    policy: BatchPolicy,
    min_slot_utilization: f32,
    initial: Vec<StateValue>,
    control_names: Vec<Arc<CString>>,
    state_names: Vec<Arc<CString>>,
    st: Mutex<SeqState>,
    /// One per instance, all used with `st`.
    cvs: Vec<Condvar>,
}

impl Sequencer {
    pub(super) fn new(
        config: &ModelConfig,
        cfg: &SequenceBatching,
        instances: usize,
        initial: Vec<StateValue>,
    ) -> Sequencer {
        let (direct, slots, policy, util) = match &cfg.strategy {
            SequenceStrategy::Direct {
                max_queue_delay_us,
                minimum_slot_utilization,
            } => (
                true,
                config.max_batch_size.max(1) as usize,
                BatchPolicy {
                    max_batch_size: config.max_batch_size.max(1),
                    preferred: Vec::new(),
                    max_queue_delay: Duration::from_micros(*max_queue_delay_us),
                },
                *minimum_slot_utilization,
            ),
            SequenceStrategy::Oldest {
                max_candidate_sequences,
                preferred_batch_size,
                max_queue_delay_us,
                ..
            } => (
                false,
                (*max_candidate_sequences).max(1) as usize,
                BatchPolicy {
                    max_batch_size: config.max_batch_size.max(1),
                    preferred: preferred_batch_size.clone(),
                    max_queue_delay: Duration::from_micros(*max_queue_delay_us),
                },
                0.0,
            ),
        };
        let instances = instances.max(1);
        Sequencer {
            model: config.name.clone(),
            max_batch_size: config.max_batch_size,
            direct,
            slots_per_instance: slots,
            idle: Duration::from_micros(cfg.max_sequence_idle_us),
            policy,
            min_slot_utilization: util,
            initial,
            control_names: cfg.controls.iter().map(|c| c_name(&c.name)).collect(),
            state_names: cfg.states.iter().map(|s| c_name(&s.input_name)).collect(),
            st: Mutex::new(SeqState {
                seqs: HashMap::new(),
                open: HashMap::new(),
                next_seq_id: 1,
                slots: vec![vec![None; slots]; instances],
                backlog: VecDeque::new(),
                ending: Vec::new(),
                notes: Vec::new(),
                queued: 0,
                executing: 0,
                paused: false,
                closed: false,
                next_batch_seq: 0,
                next_idle_check: None,
                backlog_deadline: None,
                armed: None,
            }),
            cvs: (0..instances).map(|_| Condvar::new()).collect(),
            cfg: cfg.clone(),
        }
    }

    fn wake_all(&self) {
        for cv in &self.cvs {
            cv.notify_all();
        }
    }

    /// The checks that need no lock: the correlation ID and the batch size.
    fn check(&self, req: &Request) -> Result<()> {
        let m = &self.model;
        let corr = &req.correlation_id;
        let empty = match corr {
            CorrelationId::None => true,
            CorrelationId::U64(v) => *v == 0,
            CorrelationId::Str(s) => s.is_empty(),
        };
        if empty {
            return Err(Error::invalid(format!(
                "inference request to model '{m}' must specify a non-zero or non-empty correlation ID (request {}: the model uses sequence batching, and 0 and \"\" are not IDs)",
                req.id
            )));
        }
        if let CorrelationId::Str(s) = corr {
            if s.len() > crate::request::MAX_CORRELATION_ID_BYTES {
                return Err(Error::invalid(format!(
                    "model '{m}': correlation ID of {} bytes is longer than the limit of {}",
                    s.len(),
                    crate::request::MAX_CORRELATION_ID_BYTES
                )));
            }
        }
        if let Some(c) = self.cfg.control(ControlKind::CorrId) {
            let given = match corr {
                CorrelationId::Str(_) => "STRING",
                _ => "UINT64",
            };
            let fits = match (corr, c.data_type) {
                (CorrelationId::Str(_), DataType::Bytes) => true,
                (CorrelationId::U64(_), DataType::Uint64) => true,
                (CorrelationId::U64(v), DataType::Int64) => *v <= i64::MAX as u64,
                (CorrelationId::U64(v), DataType::Uint32) => *v <= u64::from(u32::MAX),
                (CorrelationId::U64(v), DataType::Int32) => *v <= i32::MAX as u64,
                _ => false,
            };
            let same_kind =
                matches!(corr, CorrelationId::Str(_)) == (c.data_type == DataType::Bytes);
            if !fits && !same_kind {
                // Triton's text, with its protocol type names (BYTES for strings).
                return Err(Error::invalid(format!(
                    "sequence batching control '{}' data-type is '{}', but model '{m}' expects '{}' (correlation ID {corr} of request {})",
                    c.name,
                    if given == "STRING" { "BYTES" } else { given },
                    c.data_type.as_str(),
                    req.id
                )));
            }
            if !fits {
                return Err(Error::invalid(format!(
                    "model '{m}': correlation ID {} ({given}) does not fit the CORRID control '{}' of type {}",
                    corr,
                    c.name,
                    type_name(c.data_type)
                )));
            }
        }
        if self.max_batch_size > 0 && req.batch_size != 1 {
            return Err(Error::invalid(format!(
                "inference request to model '{m}' must specify batch-size 1 due to requirements of sequence batcher (request {} of sequence {} has batch size {})",
                req.id, corr, req.batch_size
            )));
        }
        Ok(())
    }

    pub(super) fn enqueue(
        &self,
        req: Box<Request>,
        key: Option<ShapeKey>,
    ) -> std::result::Result<Enqueued, (Box<Request>, Error)> {
        if let Err(e) = self.check(&req) {
            return Err((req, e));
        }
        let m = &self.model;
        let start = req.flags & FLAG_START != 0;
        let end = req.flags & FLAG_END != 0;
        let now = req.enqueued_at;
        let deadline = (req.timeout_us > 0).then(|| now + Duration::from_micros(req.timeout_us));
        let pending = Pending {
            deadline,
            key: key.unwrap_or_default(),
            req,
        };
        let mut st = self.st.lock();
        if st.closed {
            drop(st);
            return Err((
                pending.req,
                Error::unavailable(format!("model '{m}' is unloading")),
            ));
        }
        let mut warning = None;
        let st = &mut *st;
        let corr = &pending.req.correlation_id;
        let open = st.open.get(corr).copied();
        let place = match open.and_then(|id| st.seqs.get_mut(&id).map(|q| (id, q))) {
            Some((_, seq)) => {
                if start {
                    warning = Some(format!(
                        "model '{m}': sequence {corr} restarted by a new START before its END"
                    ));
                }
                if end {
                    st.open.remove(corr);
                }
                seq.last_activity = now;
                seq.queue.push_back(pending);
                seq.place
            }
            None => {
                if !start {
                    let why = if st.seqs.values().any(|q| q.corr == *corr) {
                        "has ended: its END is queued"
                    } else {
                        "is not active: never started, ended, or idle too long"
                    };
                    let e = Error::invalid(format!(
                        "inference request for sequence {} to model '{m}' must specify the START flag on the first request of the sequence (sequence {corr} {why})",
                        corr.bare()
                    ));
                    return Err((pending.req, e));
                }
                let corr = corr.clone();
                let id = st.next_seq_id;
                st.next_seq_id += 1;
                let place = free_slot(&st.slots);
                match place {
                    Some((i, s)) => st.slots[i][s] = Some(id),
                    None => st.backlog.push_back(id),
                }
                if !end {
                    st.open.insert(corr.clone(), id);
                }
                let mut queue = VecDeque::new();
                queue.push_back(pending);
                st.seqs.insert(
                    id,
                    Seq {
                        corr,
                        place,
                        queue,
                        in_flight: false,
                        last_activity: now,
                        states: None,
                    },
                );
                place
            }
        };
        st.queued += 1;
        let mut arm = None;
        match place {
            Some((i, _)) => {
                self.cvs[i].notify_one();
            }
            None => {
                if let Some(d) = deadline {
                    st.backlog_deadline = Some(st.backlog_deadline.map_or(d, |b| b.min(d)));
                    // The timer answers it on time even when every worker is busy; a
                    // free worker wakes for it too.
                    if st.armed.is_none_or(|a| d < a) {
                        st.armed = Some(d);
                        arm = Some(d);
                    }
                    self.wake_all();
                }
            }
        }
        Ok(Enqueued { warning, arm })
    }

    pub(super) fn queued(&self) -> usize {
        self.st.lock().queued
    }

    pub(super) fn set_paused(&self, paused: bool) {
        self.st.lock().paused = paused;
        self.wake_all();
    }

    pub(super) fn close(&self) {
        self.st.lock().closed = true;
        self.wake_all();
    }

    pub(super) fn is_idle(&self) -> bool {
        let st = self.st.lock();
        st.queued == 0 && st.ending.is_empty() && st.executing == 0
    }

    /// Ends every queued request with CANCELLED; backlogged sequences are dropped.
    pub(super) fn cancel_all(&self, why: &str) {
        let mut st = self.st.lock();
        let st = &mut *st;
        for seq in st.seqs.values_mut() {
            for p in seq.queue.drain(..) {
                st.ending.push((p.req, Error::cancelled(why.to_owned())));
            }
        }
        for id in std::mem::take(&mut st.backlog) {
            remove_seq(st, id);
        }
        // The sequences left in slots are idle now.
        let due = Instant::now() + self.idle;
        st.next_idle_check = Some(st.next_idle_check.map_or(due, |t| t.min(due)));
        st.queued = 0;
        st.backlog_deadline = None;
        self.wake_all();
    }

    /// Removes a queued request; returns false when it is not queued here. The caller
    /// checks the running lists under the same lock (`running` runs under it).
    pub(super) fn cancel(&self, request_id: u64, running: impl FnOnce() -> bool) -> Option<bool> {
        let mut st = self.st.lock();
        let st = &mut *st;
        for seq in st.seqs.values_mut() {
            if let Some(i) = seq.queue.iter().position(|p| p.req.id == request_id) {
                if let Some(p) = seq.queue.remove(i) {
                    if seq.queue.is_empty() && !seq.in_flight {
                        // Idle from now on: the reaper must look at it.
                        let due = seq.last_activity + self.idle;
                        st.next_idle_check = Some(st.next_idle_check.map_or(due, |t| t.min(due)));
                    }
                    let msg = format!(
                        "request {request_id} of sequence {} for model '{}' was cancelled",
                        p.req.correlation_id, self.model
                    );
                    st.ending.push((p.req, Error::cancelled(msg)));
                    st.queued -= 1;
                    self.wake_all();
                    return Some(true);
                }
            }
        }
        if running() {
            return Some(false);
        }
        None
    }

    /// Blocks until worker `index` has work. `record` is called with the ids of a formed
    /// batch while the lock is held (for cancel).
    pub(super) fn next_work(
        &self,
        index: usize,
        record: &dyn Fn(&mut [Box<Request>]),
    ) -> (Work, Vec<(u32, String)>) {
        let mut st = self.st.lock();
        loop {
            let now = Instant::now();
            self.expire_backlog(&mut st, now);
            self.reap(&mut st, now);
            let notes = std::mem::take(&mut st.notes);
            if !st.ending.is_empty() {
                return (Work::End(std::mem::take(&mut st.ending)), notes);
            }
            if st.closed && st.queued == 0 {
                return (Work::Exit, notes);
            }
            if !notes.is_empty() {
                // Log outside the lock, then look again.
                drop(st);
                return (Work::End(Vec::new()), notes);
            }
            let mut wait = [st.next_idle_check, st.backlog_deadline]
                .into_iter()
                .flatten()
                .min();
            if !st.paused {
                match self.form(&mut st, index, now) {
                    Ok(mut f) => {
                        record(&mut f.requests);
                        st.executing += 1;
                        return (Work::Batch(f), Vec::new());
                    }
                    Err(Some(t)) => wait = Some(wait.map_or(t, |w| w.min(t))),
                    Err(None) => {}
                }
            }
            match wait {
                Some(t) => {
                    self.cvs[index].wait_until(&mut st, t);
                }
                None => self.cvs[index].wait(&mut st),
            }
        }
    }

    /// The requests waiting for their error FINAL.
    fn take_ending(&self) -> Vec<(Box<Request>, Error)> {
        std::mem::take(&mut self.st.lock().ending)
    }

    /// For the timer: the requests of backlogged sequences whose deadline passed (and
    /// any other request waiting for its error FINAL), and the next deadline to arm.
    fn expire(&self, now: Instant) -> (Vec<(Box<Request>, Error)>, Option<Instant>) {
        let mut st = self.st.lock();
        self.expire_backlog(&mut st, now);
        st.armed = st.backlog_deadline;
        let ending = std::mem::take(&mut st.ending);
        (ending, st.armed)
    }

    /// Backlogged sequences with an expired request deadline end: every queued request
    /// gets DEADLINE_EXCEEDED.
    fn expire_backlog(&self, st: &mut MutexGuard<'_, SeqState>, now: Instant) {
        if st.backlog_deadline.is_none_or(|d| d > now) {
            return;
        }
        let st = &mut **st;
        let mut next: Option<Instant> = None;
        let (seqs, ending, open) = (&mut st.seqs, &mut st.ending, &mut st.open);
        let mut removed = 0usize;
        st.backlog.retain(|id| {
            let Some(seq) = seqs.get_mut(id) else {
                return false;
            };
            let corr = seq.corr.clone();
            let expired = seq.queue.iter().any(|p| p.deadline.is_some_and(|d| d <= now));
            if !expired {
                if let Some(d) = seq.queue.iter().filter_map(|p| p.deadline).min() {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
                return true;
            }
            for p in seq.queue.drain(..) {
                let msg = format!(
                    "timeout of the corresponding sequence has been expired: model '{}': sequence {corr} timed out in the backlog waiting for a free slot (request {})",
                    self.model, p.req.id
                );
                ending.push((p.req, Error::deadline(msg)));
                removed += 1;
            }
            seqs.remove(id);
            if open.get(&corr) == Some(id) {
                open.remove(&corr);
            }
            false
        });
        st.queued -= removed;
        st.backlog_deadline = next;
    }

    /// Frees the slots of sequences idle for longer than the idle timeout (all idle ones
    /// once closed).
    fn reap(&self, st: &mut MutexGuard<'_, SeqState>, now: Instant) {
        let closed = st.closed;
        if !closed && st.next_idle_check.is_none_or(|t| t > now) {
            return;
        }
        let mut next: Option<Instant> = None;
        let mut free = Vec::new();
        for (i, slots) in st.slots.iter().enumerate() {
            for (s, id) in slots.iter().enumerate() {
                let Some(id) = id else { continue };
                let Some(seq) = st.seqs.get(id) else {
                    continue;
                };
                if !seq.queue.is_empty() || seq.in_flight {
                    continue;
                }
                let due = seq.last_activity + self.idle;
                if closed || due <= now {
                    free.push((i, s));
                } else {
                    next = Some(next.map_or(due, |n| n.min(due)));
                }
            }
        }
        st.next_idle_check = next;
        for (i, s) in free {
            if let Some(seq) = st.slots[i][s].take().and_then(|id| remove_seq(st, id)) {
                let corr = seq.corr;
                if !closed {
                    let msg = format!(
                        "model '{}': sequence {corr} was idle for {} us and lost its slot",
                        self.model,
                        self.idle.as_micros()
                    );
                    st.notes.push((crate::log::LEVEL_INFO, msg));
                }
            }
            self.give_slot(st, i, s);
        }
    }

    /// Hands a free slot to the oldest backlogged sequence.
    fn give_slot(&self, st: &mut SeqState, i: usize, s: usize) {
        while let Some(id) = st.backlog.pop_front() {
            if let Some(seq) = st.seqs.get_mut(&id) {
                seq.place = Some((i, s));
                if seq.queue.is_empty() {
                    // Its requests were cancelled while it waited: idle from now on.
                    let due = Instant::now() + self.idle;
                    st.next_idle_check = Some(st.next_idle_check.map_or(due, |t| t.min(due)));
                    self.wake_all();
                }
                st.slots[i][s] = Some(id);
                self.cvs[i].notify_one();
                return;
            }
        }
    }

    /// The state signature of a sequence's next request (requests whose states differ in
    /// shape cannot share a batch).
    fn state_shapes<'a>(&'a self, seq: &'a Seq, start: bool) -> impl Iterator<Item = &'a [i64]> {
        let states = if start { None } else { seq.states.as_ref() };
        states
            .unwrap_or(&self.initial)
            .iter()
            .map(|s| s.shape.as_slice())
    }

    /// Forms the next batch of instance `index`, or says until when nothing will be
    /// ready (Err(None): until something changes).
    fn form(
        &self,
        st: &mut MutexGuard<'_, SeqState>,
        index: usize,
        now: Instant,
    ) -> std::result::Result<Formed, Option<Instant>> {
        // Ready sequences of this instance: (slot, enqueued_at).
        let mut ready: SmallVec<[(usize, Instant); 16]> = SmallVec::new();
        let mut highest = None;
        for (s, id) in st.slots[index].iter().enumerate() {
            let Some(id) = id else { continue };
            highest = Some(s);
            if let Some(seq) = st.seqs.get(id) {
                if let (false, Some(p)) = (seq.in_flight, seq.queue.front()) {
                    ready.push((s, p.req.enqueued_at));
                }
            }
        }
        let Some(highest) = highest else {
            return Err(None);
        };
        if ready.is_empty() {
            return Err(None);
        }
        let chosen: SmallVec<[usize; 16]> = if self.direct {
            let oldest = ready.iter().map(|r| r.1).min().unwrap_or(now);
            let needed = self.min_slot_utilization * self.slots_per_instance as f32;
            if (ready.len() as f32) < needed {
                let until = oldest + self.policy.max_queue_delay;
                if now < until {
                    return Err(Some(until));
                }
            }
            // The oldest ready request sets the shapes; others must match them.
            let Some(&(first, _)) = ready.iter().min_by_key(|r| r.1) else {
                return Err(None);
            };
            let template = self.signature(st, index, first);
            ready
                .iter()
                .map(|r| r.0)
                .filter(|&s| s == first || self.signature(st, index, s) == template)
                .collect()
        } else {
            ready.sort_by_key(|r| r.1);
            let keys: SmallVec<[SmallVec<[i64; 8]>; 16]> = ready
                .iter()
                .map(|r| self.signature(st, index, r.0))
                .collect();
            let candidates = keys.iter().zip(ready.iter()).map(|(k, r)| Candidate {
                batch_size: 1,
                shape_key: Some(k.as_slice()),
                enqueued_at: r.1,
            });
            match decide(&self.policy, candidates, now) {
                Decision::Execute(n) => ready.iter().take(n).map(|r| r.0).collect(),
                Decision::WaitUntil(t) => return Err(Some(t)),
                Decision::Idle => return Err(None),
            }
        };

        let st = &mut **st;
        let mut requests = Vec::with_capacity(chosen.len());
        let mut rows = Vec::with_capacity(chosen.len());
        let mut freed = SmallVec::<[usize; 4]>::new();
        // Direct: rows are slots. Oldest: rows in arrival order, no padding.
        let mut chosen = chosen;
        if self.direct {
            chosen.sort_unstable();
        }
        for (n, &s) in chosen.iter().enumerate() {
            let Some(id) = st.slots[index][s] else {
                continue;
            };
            let Some(seq) = st.seqs.get_mut(&id) else {
                continue;
            };
            let corr = seq.corr.clone();
            let Some(p) = seq.queue.pop_front() else {
                continue;
            };
            st.queued -= 1;
            let flags = p.req.flags;
            // The state travels with the batch; `complete` puts the new (or on failure
            // this) one back. START resets it.
            let held = seq.states.take();
            let state_in = match held {
                Some(v) if flags & FLAG_START == 0 => v,
                _ => self.initial.clone(),
            };
            seq.in_flight = true;
            let mut kept = true;
            if flags & FLAG_END != 0 && seq.queue.is_empty() {
                remove_seq(st, id);
                st.slots[index][s] = None;
                freed.push(s);
                kept = false;
            }
            let row = if self.direct { s as u32 } else { n as u32 };
            requests.push(p.req);
            rows.push(RowInfo {
                row,
                seq: id,
                corr,
                flags,
                kept,
                state_in,
            });
        }
        for s in freed {
            self.give_slot(st, index, s);
        }
        let size = if self.direct {
            highest as u32 + 1
        } else {
            requests.len() as u32
        };
        let seq_no = st.next_batch_seq;
        st.next_batch_seq += 1;
        Ok(Formed {
            seq_no,
            size,
            requests,
            rows,
        })
    }

    /// Shape key of the next request in slot `s` plus its state shapes.
    fn signature(&self, st: &SeqState, index: usize, s: usize) -> SmallVec<[i64; 8]> {
        let mut key = SmallVec::new();
        let Some(seq) = st.slots[index][s].as_ref().and_then(|id| st.seqs.get(id)) else {
            return key;
        };
        let Some(p) = seq.queue.front() else {
            return key;
        };
        key.extend_from_slice(&p.key);
        for shape in self.state_shapes(seq, p.req.flags & FLAG_START != 0) {
            key.push(-5);
            key.extend_from_slice(shape);
        }
        key
    }

    /// Builds the control and state inputs of a formed batch.
    pub(super) fn add_inputs(
        &self,
        batch: &mut crate::backend::Batch,
        rows: &[RowInfo],
    ) -> Result<()> {
        let size = batch.size as usize;
        let batched = self.max_batch_size > 0;
        let row_shape = |per_row: &[i64]| -> Shape {
            let mut s = Shape::new();
            if batched {
                s.push(size as i64);
            }
            s.extend_from_slice(per_row);
            s
        };
        for (c, c_name) in self.cfg.controls.iter().zip(&self.control_names) {
            let data = control_tensor(c, rows, size);
            let shape = if batched {
                Shape::from_slice(&[size as i64, 1])
            } else {
                Shape::from_slice(&[1])
            };
            batch.push_input(c.name.clone(), c_name.clone(), c.data_type, shape, data);
        }
        for (k, (st, c_name)) in self.cfg.states.iter().zip(&self.state_names).enumerate() {
            let Some(first) = rows.first().and_then(|r| r.state_in.get(k)) else {
                return Err(Error::internal(format!(
                    "model '{}': no state '{}' for the batch",
                    self.model, st.input_name
                )));
            };
            let per_row = first.data.len();
            let mut data = vec![0u8; per_row * size.max(1)];
            for r in rows {
                let Some(v) = r.state_in.get(k) else { continue };
                let at = r.row as usize * per_row;
                if v.data.len() != per_row || at + per_row > data.len() {
                    return Err(Error::internal(format!(
                        "model '{}': state '{}' rows differ in size within a batch",
                        self.model, st.input_name
                    )));
                }
                data[at..at + per_row].copy_from_slice(&v.data);
            }
            batch.push_input(
                st.input_name.clone(),
                c_name.clone(),
                st.data_type,
                row_shape(&first.shape),
                data,
            );
        }
        Ok(())
    }

    /// The output states of a finished batch, one list per row (None for rows whose
    /// state does not change: failed rows). An output state the model did not write
    /// leaves that state as it was fed to each row (Triton: the state is not updated);
    /// one written with a shape that does not fit the configured dims fails the batch.
    pub(super) fn take_states(
        &self,
        batch: &crate::backend::Batch,
        rows: &[RowInfo],
    ) -> Result<Vec<Option<Vec<StateValue>>>> {
        let mut out: Vec<Option<Vec<StateValue>>> = rows
            .iter()
            .map(|_| (!self.cfg.states.is_empty()).then(Vec::new))
            .collect();
        let batched = self.max_batch_size > 0;
        let m = &self.model;
        for (k, st) in self.cfg.states.iter().enumerate() {
            let Some(o) = batch.outputs.iter().find(|o| o.name == st.output_name) else {
                for (r, slot) in rows.iter().zip(out.iter_mut()) {
                    if let (Some(list), Some(v)) = (slot.as_mut(), r.state_in.get(k)) {
                        list.push(v.clone());
                    }
                }
                continue;
            };
            let per_row_shape: &[i64] = if batched {
                &o.shape[1.min(o.shape.len())..]
            } else {
                &o.shape
            };
            let fits = per_row_shape.len() == st.dims.len()
                && per_row_shape
                    .iter()
                    .zip(&st.dims)
                    .all(|(&d, &c)| c == -1 || c == d);
            if !fits {
                return Err(Error::internal(format!(
                    "model '{m}': output state '{}' has shape {} (per row), the config says {}",
                    st.output_name,
                    shape_string(per_row_shape),
                    shape_string(&st.dims)
                )));
            }
            let rows_in = if batched { batch.size as usize } else { 1 };
            let per_row = o.data.len() / rows_in.max(1);
            for (r, slot) in rows.iter().zip(out.iter_mut()) {
                let at = r.row as usize * per_row;
                let (Some(list), Some(bytes)) = (slot.as_mut(), o.data.get(at..at + per_row))
                else {
                    continue;
                };
                list.push(StateValue {
                    shape: Shape::from_slice(per_row_shape),
                    data: bytes.to_vec(),
                });
            }
        }
        for (r, slot) in rows.iter().zip(out.iter_mut()) {
            let failed = batch.row_errors.iter().any(|(row, _)| *row == r.row);
            if failed {
                *slot = None;
            }
        }
        Ok(out)
    }

    /// Finishes a batch: the sequences of its rows may run again, with their new state
    /// (or, when the batch failed, the state they had).
    pub(super) fn complete(
        &self,
        rows: Vec<RowInfo>,
        states: Option<Vec<Option<Vec<StateValue>>>>,
    ) {
        let now = Instant::now();
        let mut st = self.st.lock();
        let mut states = states.map(|s| s.into_iter());
        for r in rows {
            let new = states.as_mut().and_then(|s| s.next()).flatten();
            if !r.kept {
                continue;
            }
            let Some(seq) = st.seqs.get_mut(&r.seq) else {
                continue;
            };
            seq.in_flight = false;
            seq.last_activity = now;
            seq.states = Some(new.unwrap_or(r.state_in));
            if seq.queue.is_empty() {
                let due = now + self.idle;
                st.next_idle_check = Some(st.next_idle_check.map_or(due, |t| t.min(due)));
            }
        }
    }

    /// A formed batch has been answered.
    pub(super) fn done(&self) {
        let mut st = self.st.lock();
        st.executing -= 1;
        let closed = st.closed;
        drop(st);
        if closed {
            self.wake_all();
        }
    }
}

/// Removes sequence `id`, and its correlation ID's entry if it is still the one that
/// ID's requests join.
fn remove_seq(st: &mut SeqState, id: SeqId) -> Option<Seq> {
    let seq = st.seqs.remove(&id)?;
    if st.open.get(&seq.corr) == Some(&id) {
        st.open.remove(&seq.corr);
    }
    Some(seq)
}

/// The lowest free slot number over all instances, ties to the lowest instance.
fn free_slot(slots: &[Vec<Option<SeqId>>]) -> Option<(usize, usize)> {
    let per = slots.first().map_or(0, |s| s.len());
    (0..per).find_map(|s| {
        (0..slots.len())
            .find(|&i| slots[i][s].is_none())
            .map(|i| (i, s))
    })
}

fn type_name(d: DataType) -> &'static str {
    match d {
        DataType::Bytes => "STRING",
        other => other.as_str(),
    }
}

/// One control tensor of a batch: one element per row, padding rows false / 0 / "".
fn control_tensor(c: &ControlInput, rows: &[RowInfo], size: usize) -> Vec<u8> {
    let value = |r: &RowInfo| -> bool {
        match c.kind {
            ControlKind::Start => r.flags & FLAG_START != 0,
            ControlKind::End => r.flags & FLAG_END != 0,
            _ => true, // READY: a row with a request
        }
    };
    match (&c.false_true, c.kind) {
        (Some([f, t]), _) => {
            let mut data = Vec::with_capacity(size * f.len());
            let mut next = rows.iter().peekable();
            for row in 0..size as u32 {
                match next.peek() {
                    Some(r) if r.row == row => {
                        data.extend_from_slice(if value(r) { t } else { f });
                        next.next();
                    }
                    _ => data.extend_from_slice(f),
                }
            }
            data
        }
        _ => {
            // CORRID
            let mut data = Vec::new();
            let mut next = rows.iter().peekable();
            for row in 0..size as u32 {
                let corr = match next.peek() {
                    Some(r) if r.row == row => {
                        let c = &r.corr;
                        next.next();
                        Some(c)
                    }
                    _ => None,
                };
                match (c.data_type, corr) {
                    (DataType::Bytes, Some(CorrelationId::Str(s))) => {
                        data.extend_from_slice(&(s.len() as u32).to_le_bytes());
                        data.extend_from_slice(s.as_bytes());
                    }
                    (DataType::Bytes, _) => data.extend_from_slice(&0u32.to_le_bytes()),
                    (dt, corr) => {
                        let v = match corr {
                            Some(CorrelationId::U64(v)) => *v,
                            _ => 0,
                        };
                        match dt.byte_size() {
                            4 => data.extend_from_slice(&(v as u32).to_le_bytes()),
                            _ => data.extend_from_slice(&v.to_le_bytes()),
                        }
                    }
                }
            }
            data
        }
    }
}

/// The sequence batcher as a scheduling kind: the [`Sequencer`]'s slots and backlog, and
/// the bookkeeping of the batches its workers execute.
pub struct SequenceBatcher {
    pub(super) seq: Sequencer,
    pub(super) batches: Batches,
}

impl SequenceBatcher {
    pub(super) fn new(seq: Sequencer, batches: Batches) -> SequenceBatcher {
        SequenceBatcher { seq, batches }
    }
}

impl Kind for SequenceBatcher {
    fn enqueue(
        &self,
        s: &Scheduler,
        req: Box<Request>,
        shape_key: Option<ShapeKey>,
    ) -> std::result::Result<(), (Box<Request>, Error)> {
        let Enqueued { warning, arm } = self.seq.enqueue(req, shape_key)?;
        if let Some(warning) = warning {
            s.log.warn(&warning);
        }
        if let Some(d) = arm {
            s.arm(d);
        }
        Ok(())
    }

    fn pending(&self) -> usize {
        self.seq.queued()
    }

    fn set_paused(&self, paused: bool) {
        self.seq.set_paused(paused)
    }

    fn close(&self) {
        self.seq.close()
    }

    fn is_idle(&self) -> bool {
        self.seq.is_idle() && self.batches.none_outstanding()
    }

    fn cancel_all(&self, why: &str) {
        self.seq.cancel_all(why)
    }

    fn abandon(&self, why: &str) -> Vec<super::Abandoned> {
        self.seq.cancel_all(why);
        let mut out: Vec<super::Abandoned> = self
            .seq
            .take_ending()
            .into_iter()
            .map(|(req, e)| super::Abandoned::Queued(req, e))
            .collect();
        self.batches.abandon_running(why, &mut out);
        out
    }

    fn expire(&self, s: &Scheduler, now: Instant) {
        let (ending, next) = self.seq.expire(now);
        if let Some(d) = next {
            s.arm(d);
        }
        for (req, err) in ending {
            s.fail(req, err);
        }
    }

    fn cancel(&self, _s: &Scheduler, request_id: u64) -> CancelOutcome {
        match self
            .seq
            .cancel(request_id, || self.batches.is_running_or_cancel(request_id))
        {
            Some(true) => CancelOutcome::Cancelled,
            Some(false) => CancelOutcome::Running,
            None => CancelOutcome::NotFound,
        }
    }

    fn stats_json(&self, out: &mut String) {
        self.batches.stats_json(out);
    }

    fn stats_prometheus(&self, out: &mut crate::stats::PromText, labels: &str) {
        self.batches.stats_prometheus(out, labels);
    }

    fn delivered_apart(&self) -> u64 {
        (self.batches.outstanding.delivered).load(std::sync::atomic::Ordering::Relaxed)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(row: u32, corr: CorrelationId, flags: u32) -> RowInfo {
        RowInfo {
            row,
            seq: 1,
            corr,
            flags,
            kept: true,
            state_in: Vec::new(),
        }
    }

    #[test]
    fn free_slots_fill_lower_slots_of_every_instance_first() {
        let mut slots = vec![vec![None; 2]; 3];
        let mut order = Vec::new();
        while let Some((i, s)) = free_slot(&slots) {
            slots[i][s] = Some(1);
            order.push((i, s));
        }
        assert_eq!(order, vec![(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]);
        slots[1][0] = None;
        assert_eq!(free_slot(&slots), Some((1, 0)));
    }

    #[test]
    fn control_tensors_mark_padding_rows_false() {
        let start = ControlInput {
            name: "S".into(),
            kind: ControlKind::Start,
            data_type: DataType::Fp32,
            false_true: Some([0f32.to_le_bytes().to_vec(), 1f32.to_le_bytes().to_vec()]),
        };
        let ready = ControlInput {
            kind: ControlKind::Ready,
            ..start.clone()
        };
        let rows = [
            row(1, CorrelationId::U64(7), FLAG_START),
            row(3, CorrelationId::U64(8), FLAG_END),
        ];
        let f32s = |b: Vec<u8>| -> Vec<f32> { bytemuck::pod_collect_to_vec(&b) };
        assert_eq!(f32s(control_tensor(&start, &rows, 4)), [0.0, 1.0, 0.0, 0.0]);
        assert_eq!(f32s(control_tensor(&ready, &rows, 4)), [0.0, 1.0, 0.0, 1.0]);

        let corr = ControlInput {
            name: "C".into(),
            kind: ControlKind::CorrId,
            data_type: DataType::Uint32,
            false_true: None,
        };
        let u32s: Vec<u32> = bytemuck::pod_collect_to_vec(&control_tensor(&corr, &rows, 4));
        assert_eq!(u32s, [0, 7, 0, 8]);

        let corr = ControlInput {
            data_type: DataType::Bytes,
            ..corr
        };
        let rows = [row(0, CorrelationId::Str("ab".into()), 0)];
        assert_eq!(
            control_tensor(&corr, &rows, 2),
            [2, 0, 0, 0, b'a', b'b', 0, 0, 0, 0]
        );
    }
}
