//! Triton's local response cache: a server-wide byte budget shared by the models whose
//! config says `response_cache { enable: true }`. A request whose key (model, version,
//! inputs with their names, types, shapes and bytes, requested outputs, parameters) was
//! answered before gets the stored outputs without queueing or running its backend; a
//! miss runs as usual and its successful response is stored, the least recently used
//! entries going when the budget is full. Hits are delivered on a library thread of the
//! cache's own (callbacks never run on the caller's thread).

use crate::request::{OutputTensor, ParamValue, Request, Response, ResponseSink};
use crate::scheduler::Scheduler;
use crate::tensor::{DataType, Shape, TensorData};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an entry costs beyond its bytes (names, shapes, bookkeeping).
const ENTRY_OVERHEAD: usize = 128;

/// An output as stored: shared by every hit.
struct Stored {
    name: Arc<CString>,
    dtype: DataType,
    shape: Shape,
    data: Arc<Vec<u8>>,
}

struct Entry {
    outputs: Arc<[Stored]>,
    bytes: usize,
    /// Its place in `Inner::lru`.
    tick: u64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<u128, Entry>,
    /// Least recently used first.
    lru: BTreeMap<u64, u128>,
    tick: u64,
    bytes: usize,
}

/// A hit's response on its way to the delivery thread.
type Delivery = (ResponseSink, Box<Response>);

pub(crate) struct ResponseCache {
    budget: usize,
    inner: Mutex<Inner>,
    /// Two independently keyed SipHash states: a 128-bit key, so that two different
    /// requests meeting on one key is not a concern.
    hashers: (
        std::collections::hash_map::RandomState,
        std::collections::hash_map::RandomState,
    ),
    queue: Mutex<std::collections::VecDeque<Delivery>>,
    /// Wakes the delivery thread; `idle` wakes those waiting for the queue to empty.
    wake: Condvar,
    idle: Condvar,
    /// Hits queued or being delivered.
    pending: AtomicU64,
    pub evictions: AtomicU64,
    pub inserts: AtomicU64,
}

impl ResponseCache {
    /// A cache of `budget` bytes, with its delivery thread (which ends when the cache
    /// goes).
    pub(crate) fn start(budget: usize) -> crate::status::Result<Arc<ResponseCache>> {
        let cache = Arc::new(ResponseCache {
            budget,
            inner: Mutex::new(Inner::default()),
            hashers: Default::default(),
            queue: Mutex::new(Default::default()),
            wake: Condvar::new(),
            idle: Condvar::new(),
            pending: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            inserts: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&cache);
        std::thread::Builder::new()
            .name("infer-cache".into())
            .spawn(move || deliver(weak))
            .map_err(|e| {
                crate::status::Error::unavailable(format!(
                    "cannot start the response cache's thread: {e}"
                ))
            })?;
        Ok(cache)
    }

    /// The request's key for `sched`'s model version; None when it cannot be cached (an
    /// input in GPU memory, outputs wanted on a GPU).
    pub(crate) fn key(&self, sched: &Scheduler, req: &Request) -> Option<u128> {
        if req.output_device.is_some() {
            return None;
        }
        let mut inputs: Vec<&crate::tensor::Tensor> = req.inputs.iter().collect();
        if inputs
            .iter()
            .any(|t| matches!(t.data, TensorData::Device(_)))
        {
            return None;
        }
        inputs.sort_by(|a, b| a.name.cmp(&b.name));
        let mut outputs: Vec<&str> = req.requested_outputs.iter().map(|o| &**o).collect();
        outputs.sort_unstable();
        let hash = |mut h: std::collections::hash_map::DefaultHasher| {
            sched.model.name_str().hash(&mut h);
            sched.model.version.hash(&mut h);
            for t in &inputs {
                t.name.hash(&mut h);
                (t.dtype as u32).hash(&mut h);
                t.shape.as_slice().hash(&mut h);
                t.data.as_slice().hash(&mut h);
            }
            outputs.hash(&mut h);
            for (k, v) in &req.parameters {
                k.hash(&mut h);
                match v {
                    ParamValue::Int(i) => (0u8, *i).hash(&mut h),
                    ParamValue::Double(d) => (1u8, d.to_bits()).hash(&mut h),
                    ParamValue::Bool(b) => (2u8, *b).hash(&mut h),
                    ParamValue::Str(s) => (3u8, s.as_bytes()).hash(&mut h),
                }
            }
            h.finish()
        };
        let a = hash(self.hashers.0.build_hasher());
        let b = hash(self.hashers.1.build_hasher());
        Some((u128::from(a) << 64) | u128::from(b))
    }

    /// The stored outputs for `key`, now the most recently used.
    fn lookup(&self, key: u128) -> Option<Arc<[Stored]>> {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let e = inner.map.get_mut(&key)?;
        inner.lru.remove(&e.tick);
        inner.tick += 1;
        e.tick = inner.tick;
        inner.lru.insert(e.tick, key);
        Some(e.outputs.clone())
    }

    /// Stores a successful response's host outputs (a response with an output in GPU
    /// memory is not stored), evicting the least recently used entries to fit.
    fn insert(&self, key: u128, resp: &Response) {
        let mut stored = Vec::with_capacity(resp.outputs.len());
        let mut bytes = ENTRY_OVERHEAD;
        for o in &resp.outputs {
            if matches!(o.data, TensorData::Device(_)) {
                return;
            }
            let data = o.data.as_slice().to_vec();
            bytes += data.len() + o.name.as_bytes().len() + 8 * o.shape.len();
            stored.push(Stored {
                name: o.name.clone(),
                dtype: o.dtype,
                shape: o.shape.clone(),
                data: Arc::new(data),
            });
        }
        if bytes > self.budget {
            return;
        }
        let mut g = self.inner.lock();
        let inner = &mut *g;
        if inner.map.contains_key(&key) {
            return;
        }
        while inner.bytes + bytes > self.budget {
            let Some((_, old)) = inner.lru.pop_first() else {
                break;
            };
            if let Some(e) = inner.map.remove(&old) {
                inner.bytes -= e.bytes;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.lru.insert(tick, key);
        inner.bytes += bytes;
        inner.map.insert(
            key,
            Entry {
                outputs: stored.into(),
                bytes,
                tick,
            },
        );
        self.inserts.fetch_add(1, Ordering::Relaxed);
    }

    /// (entries, bytes used, budget).
    pub(crate) fn usage(&self) -> (usize, usize, usize) {
        let g = self.inner.lock();
        (g.map.len(), g.bytes, self.budget)
    }

    /// Answers `req` from the cache when its key is stored: the response is queued for
    /// the delivery thread, the hit counted, and None returned. Otherwise the request
    /// comes back, its sink set to store its successful FINAL response under the key.
    pub(crate) fn serve(
        self: &Arc<Self>,
        sched: &Arc<Scheduler>,
        mut req: Box<Request>,
    ) -> Option<Box<Request>> {
        let t0 = Instant::now();
        let Some(key) = self.key(sched, &req) else {
            return Some(req);
        };
        match self.lookup(key) {
            Some(outputs) => {
                let corr = req.correlation_id.clone();
                let mut resp = Response::ok(req.id, &sched.model, &corr);
                resp.outputs.extend(outputs.iter().map(|s| OutputTensor {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    data: TensorData::Shared {
                        len: s.data.len(),
                        buf: s.data.clone(),
                        offset: 0,
                    },
                }));
                let stats = &sched.stats;
                stats.success_count.fetch_add(1, Ordering::Relaxed);
                stats.cache_hit_us.record(t0.elapsed().as_micros() as u64);
                if let Some(sink) = req.sink.take() {
                    self.pending.fetch_add(1, Ordering::AcqRel);
                    self.queue.lock().push_back((sink, resp));
                    self.wake.notify_one();
                }
                crate::request::pool::recycle_request(req);
                None
            }
            None => {
                let lookup_us = t0.elapsed().as_micros() as u64;
                let cache = Arc::downgrade(self);
                let sched = sched.clone();
                if let Some(sink) = req.sink.as_mut() {
                    sink.set_store_hook(Box::new(move |resp: &Response| {
                        let t1 = Instant::now();
                        if let Some(c) = cache.upgrade() {
                            c.insert(key, resp);
                        }
                        sched
                            .stats
                            .cache_miss_us
                            .record(lookup_us + t1.elapsed().as_micros() as u64);
                    }));
                }
                Some(req)
            }
        }
    }

    /// Waits up to `limit` for the queued hits to be delivered.
    pub(crate) fn drain(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        let mut q = self.queue.lock();
        while self.pending.load(Ordering::Acquire) > 0 {
            if self.idle.wait_until(&mut q, deadline).timed_out() {
                break;
            }
        }
    }
}

/// The delivery thread: sends queued hits' responses, with no lock held, until the
/// cache goes and its queue is empty.
fn deliver(cache: std::sync::Weak<ResponseCache>) {
    loop {
        let Some(c) = cache.upgrade() else { return };
        let next = {
            let mut q = c.queue.lock();
            if q.is_empty() {
                // Wakes up now and then to notice the cache going.
                c.wake.wait_for(&mut q, Duration::from_millis(100));
            }
            q.pop_front()
        };
        if let Some((sink, resp)) = next {
            sink.send_final(resp);
            if c.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                let _q = c.queue.lock();
                c.idle.notify_all();
            }
        }
    }
}
