//! Decoupled custom backends (`model_transaction_policy { decoupled: true }`): a backend
//! takes a request's [`Sender`] inside `execute` and sends that request 0..n responses
//! and then the FINAL, from any thread, during `execute` or after it returned, as
//! Triton's decoupled backends do through a response factory.
//!
//! Until `execute` returns the request's response sink belongs to the worker, so what
//! the backend sends meanwhile is queued; the worker attaches the sink when it splits the
//! batch ([`Sender::attach`]) and the queue is delivered then. Each response is delivered
//! on the thread that sends it (or attaches the sink), with no lock held. A request whose
//! batch failed, or that a shutdown answered, is ended: later sends say so.

use crate::config::ModelConfig;
use crate::request::{CorrelationId, ModelIdentity, OutputTensor, Response, ResponseSink};
use crate::status::{Error, Result};
use crate::tensor::{element_count, shape_string, DataType, TensorData};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// One response waiting to be delivered.
struct Pending {
    outputs: Vec<OutputTensor>,
    error: Option<Error>,
    last: bool,
}

#[derive(Default)]
struct State {
    /// The caller's sink, once the worker attached it (None also while a thread is
    /// delivering with it: `busy`).
    sink: Option<ResponseSink>,
    model: Option<ModelIdentity>,
    registry: Option<Arc<Outstanding>>,
    busy: bool,
    queue: VecDeque<Pending>,
    /// Outputs allocated for the next response.
    building: Vec<(OutputTensor, Vec<u8>)>,
    /// A FINAL was sent (queued): nothing more may be.
    finished: bool,
    /// Why the request ended without the backend's FINAL (its batch failed, a shutdown
    /// answered it): every later send fails with this.
    ended: Option<Error>,
    /// A shutdown gave up on the request while a thread was delivering: that thread ends
    /// it with this error when its response is delivered.
    cancel_after: Option<Error>,
}

/// What a decoupled backend holds for one request.
pub struct Sender {
    request_id: u64,
    correlation: CorrelationId,
    /// The outputs the request asked for (empty: all).
    requested: Vec<Arc<str>>,
    config: Arc<ModelConfig>,
    /// The caller cancelled the request; the backend may stop early.
    cancelled: AtomicBool,
    state: Mutex<State>,
}

/// The requests of one model whose backend holds their sender after the batch was
/// split: shutdown and unload wait for them (and abandon them when the backend is
/// stuck), cancel reaches them.
#[derive(Default)]
pub struct Outstanding {
    live: Mutex<HashMap<u64, Arc<Sender>>>,
    /// Responses delivered so far (an unload sees the backend making progress).
    pub delivered: AtomicU64,
}

impl Outstanding {
    pub fn is_empty(&self) -> bool {
        self.live.lock().is_empty()
    }

    /// Marks request `id` cancelled; false when it is not outstanding.
    pub fn cancel(&self, id: u64) -> bool {
        match self.live.lock().get(&id) {
            Some(s) => {
                s.cancelled.store(true, Ordering::Release);
                true
            }
            None => false,
        }
    }

    /// Ends every outstanding request with `err`: the sinks not in use come back to be
    /// answered by the caller; a thread delivering now answers its own.
    pub fn abandon(&self, err: &Error) -> Vec<(u64, ResponseSink)> {
        let all: Vec<Arc<Sender>> = self.live.lock().drain().map(|(_, s)| s).collect();
        let mut out = Vec::new();
        for s in all {
            let mut st = s.state.lock();
            st.ended = Some(err.clone());
            st.queue.clear();
            st.building.clear();
            st.registry = None;
            match st.sink.take() {
                Some(sink) => out.push((s.request_id, sink)),
                None if st.busy => st.cancel_after = Some(err.clone()),
                None => {}
            }
        }
        out
    }
}

impl Sender {
    pub(crate) fn new(
        request_id: u64,
        correlation: CorrelationId,
        requested: Vec<Arc<str>>,
        config: Arc<ModelConfig>,
    ) -> Sender {
        Sender {
            request_id,
            correlation,
            requested,
            config,
            cancelled: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        }
    }

    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    fn closed(&self, st: &State) -> Option<Error> {
        if let Some(e) = &st.ended {
            return Some(Error::unavailable(format!(
                "request {} for model '{}' was already answered: {}",
                self.request_id, self.config.name, e.message
            )));
        }
        st.finished.then(|| {
            Error::invalid(format!(
                "request {} for model '{}': its FINAL response was already sent",
                self.request_id, self.config.name
            ))
        })
    }

    /// Allocates output `name` of the next response (datatype from the config) and
    /// returns its zeroed bytes; they stay valid until the response is sent. `byte_size`
    /// is required for BYTES outputs.
    pub fn alloc_output(
        &self,
        name: &str,
        shape: &[i64],
        byte_size: Option<usize>,
    ) -> Result<*mut u8> {
        let cfg = &self.config;
        let tc = cfg.output(name).ok_or_else(|| {
            Error::invalid(format!("model '{}' has no output '{name}'", cfg.name))
        })?;
        let elems = super::output_elements(cfg, name, shape)?;
        super::check_output_dims(cfg, name, shape, &tc.dims)?;
        let bytes = super::output_bytes(cfg, name, tc.data_type, shape, elems, byte_size)?;
        let mut st = self.state.lock();
        if let Some(e) = self.closed(&st) {
            return Err(e);
        }
        if st
            .building
            .iter()
            .any(|(o, _)| o.name.as_bytes() == name.as_bytes())
        {
            return Err(Error::invalid(format!(
                "output '{name}' of model '{}' was already allocated in this response",
                cfg.name
            )));
        }
        let mut data = super::zeroed_output(cfg, name, bytes)?;
        let ptr = data.as_mut_ptr();
        let out = OutputTensor {
            name: Arc::new(CString::new(name).unwrap_or_default()),
            dtype: tc.data_type,
            shape: crate::request::Shape::from_slice(shape),
            data: TensorData::Owned(Vec::new()),
        };
        // The Vec's heap buffer does not move when `building` grows.
        st.building.push((out, data));
        Ok(ptr)
    }

    /// Sends the outputs allocated since the last send as one response; `last` makes it
    /// the FINAL. The caller drops its handle after a FINAL.
    pub fn send(self: &Arc<Self>, last: bool) -> Result<()> {
        let mut st = self.state.lock();
        if let Some(e) = self.closed(&st) {
            return Err(e);
        }
        let mut outputs = Vec::with_capacity(st.building.len());
        for (mut o, data) in st.building.drain(..) {
            if self.wanted(&o) {
                if o.dtype == DataType::Bytes {
                    let n = crate::tensor::count_bytes_elements(&data).map_err(|e| {
                        e.context(format!(
                            "output '{}' of model '{}'",
                            o.name.to_string_lossy(),
                            self.config.name
                        ))
                    })?;
                    if element_count(&o.shape) != Some(n) {
                        return Err(Error::invalid(format!(
                            "output '{}' of model '{}' has shape {} but holds {n} BYTES elements",
                            o.name.to_string_lossy(),
                            self.config.name,
                            shape_string(&o.shape)
                        )));
                    }
                }
                o.data = TensorData::Owned(data);
                outputs.push(o);
            }
        }
        st.finished = last;
        st.queue.push_back(Pending {
            outputs,
            error: None,
            last,
        });
        drop(st);
        self.pump();
        Ok(())
    }

    /// Ends the request with an error response (FINAL).
    pub fn send_error(self: &Arc<Self>, err: Error) -> Result<()> {
        let mut st = self.state.lock();
        if let Some(e) = self.closed(&st) {
            return Err(e);
        }
        st.building.clear();
        st.finished = true;
        st.queue.push_back(Pending {
            outputs: Vec::new(),
            error: Some(err),
            last: true,
        });
        drop(st);
        self.pump();
        Ok(())
    }

    fn wanted(&self, o: &OutputTensor) -> bool {
        self.requested.is_empty()
            || (self.requested.iter()).any(|w| w.as_bytes() == o.name.as_bytes())
    }

    /// The batch succeeded: the worker hands over the request's sink, and what the
    /// backend sent meanwhile is delivered (on this thread).
    pub(crate) fn attach(
        self: &Arc<Self>,
        sink: ResponseSink,
        model: &ModelIdentity,
        registry: &Arc<Outstanding>,
    ) {
        let mut st = self.state.lock();
        st.model = Some(model.clone());
        st.sink = Some(sink);
        if !(st.finished && st.queue.is_empty()) {
            st.registry = Some(registry.clone());
            registry.live.lock().insert(self.request_id, self.clone());
        }
        drop(st);
        self.pump();
    }

    /// The batch failed (or a shutdown answered the request): later sends fail with
    /// `err`; nothing queued is delivered.
    pub(crate) fn end(&self, err: &Error) {
        let mut st = self.state.lock();
        st.ended = Some(err.clone());
        st.queue.clear();
        st.building.clear();
    }

    /// Delivers queued responses while this thread may: one thread at a time holds the
    /// sink, outside the lock.
    fn pump(&self) {
        loop {
            let mut st = self.state.lock();
            if st.busy {
                return; // the delivering thread will see what was queued
            }
            let Some(model) = st.model.clone() else {
                return; // not attached yet: the worker delivers at attach
            };
            let Some(p) = st.queue.pop_front() else {
                return;
            };
            let Some(mut sink) = st.sink.take() else {
                return;
            };
            st.busy = true;
            let registry = st.registry.clone();
            drop(st);
            let resp = match p.error {
                Some(e) => Response::error(self.request_id, &model, &self.correlation, e),
                None => {
                    let mut r = Response::ok(self.request_id, &model, &self.correlation);
                    r.outputs = p.outputs;
                    r
                }
            };
            if let Some(r) = &registry {
                r.delivered.fetch_add(1, Ordering::Relaxed);
            }
            if p.last {
                sink.send_final(resp);
                let mut st = self.state.lock();
                st.busy = false;
                if let Some(r) = st.registry.take() {
                    r.live.lock().remove(&self.request_id);
                }
                return;
            }
            sink.send(resp);
            let mut st = self.state.lock();
            st.busy = false;
            if let Some(e) = st.cancel_after.take() {
                drop(st);
                sink.send_final(Response::error(
                    self.request_id,
                    &model,
                    &self.correlation,
                    e,
                ));
                return;
            }
            st.sink = Some(sink);
        }
    }
}
