//! Requests, responses and the exactly-once FINAL guard; the checks of a request against
//! its model's config (`checks`) and the recycling of both objects (`pool`). This room
//! knows no scheduler, no GPU and no C handle: what runs before a response's callback is
//! a [`DeliveryHook`], and the model a request was resolved to is opaque here.
//!
//! A [`Request`] is owned by exactly one place at a time (the caller, a queue, a batch),
//! and its [`ResponseSink`] travels with it. The sink's `send_final` consumes the sink, and
//! a sink dropped without a FINAL sends one (INTERNAL) from its destructor, so "exactly one
//! FINAL per accepted request" holds by construction rather than by bookkeeping.

pub mod checks;
pub(crate) mod pool;

use crate::callback::InlineFn;
use crate::config::ModelConfig;
use crate::status::{Code, Error};
use crate::tensor::{DataType, Tensor};
use std::ffi::CString;
use std::sync::Arc;
use std::time::Instant;

pub use crate::tensor::Shape;

pub(crate) const RESPONSE_FLAG_FINAL: u32 = 1;

/// Longest string correlation ID, in bytes.
pub(crate) const MAX_CORRELATION_ID_BYTES: usize = 128;

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum CorrelationId {
    #[default]
    None,
    U64(u64),
    Str(String),
}

impl CorrelationId {
    /// The ID as Triton's messages print it: the number, or the string's bytes as they
    /// are (no quotes).
    pub fn bare(&self) -> impl std::fmt::Display + '_ {
        struct Bare<'a>(&'a CorrelationId);
        impl std::fmt::Display for Bare<'_> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match self.0 {
                    CorrelationId::Str(s) => f.write_str(s),
                    other => write!(f, "{other}"),
                }
            }
        }
        Bare(self)
    }
}

impl std::fmt::Display for CorrelationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CorrelationId::None => f.write_str("(none)"),
            CorrelationId::U64(v) => write!(f, "{v}"),
            CorrelationId::Str(s) => write!(f, "\"{s}\""),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ParamValue {
    Int(i64),
    Double(f64),
    Bool(bool),
    Str(CString),
}

/// An inference request on its way through the library.
pub struct Request {
    pub id: u64,
    pub model: String,
    pub version: i64,
    pub correlation_id: CorrelationId,
    pub flags: u32,
    /// 0 = the model's default level.
    pub priority: u32,
    /// 0 = none.
    pub timeout_us: u64,
    pub inputs: Vec<Tensor>,
    /// Empty = every output of the model.
    pub requested_outputs: Vec<Arc<str>>,
    pub parameters: Vec<(String, ParamValue)>,
    /// The config the inputs were checked against when added (None if the model was not
    /// loaded when the request was created).
    pub checked_against: Option<Arc<ModelConfig>>,
    /// What the server resolved the model version to when the request was created, if
    /// it did: opaque here (the server reads it back at enqueue, saving a lookup).
    pub target: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// The server that made this request (0: none, e.g. an ensemble step); another server
    /// refuses it.
    pub origin: u64,
    /// Rows this request contributes to a batch (its dim 0 when the model batches).
    pub batch_size: u32,
    pub enqueued_at: Instant,
    pub sink: Option<ResponseSink>,
    /// What the server that made this request may use of the GPUs (for device memory).
    pub gpu: crate::cuda::GpuState,
    /// The GPU this request wants its outputs on (`infer_request_set_output_memory`);
    /// None: host memory.
    pub output_device: Option<i32>,
    /// The GPU an ensemble step's outputs are read on next (every step that reads them
    /// runs there): outputs a GPU instance computes on that device stay there, and the
    /// others come as they are (unlike `output_device`, nothing is copied up for them).
    pub leave_on_device: Option<i32>,
    /// A requested output the backend does not produce is left out of the response
    /// instead of failing it (an ensemble's steps: Triton's ensembles go on without it).
    pub outputs_optional: bool,
    /// Input buffers of an earlier use of this (pooled) object, kept for reuse.
    spare_buffers: Vec<Vec<u8>>,
}

impl Request {
    pub fn new(model: &str, version: i64, checked_against: Option<Arc<ModelConfig>>) -> Request {
        Request {
            id: 0,
            model: model.to_owned(),
            version,
            correlation_id: CorrelationId::None,
            flags: 0,
            priority: 0,
            timeout_us: 0,
            inputs: Vec::new(),
            requested_outputs: Vec::new(),
            parameters: Vec::new(),
            checked_against,
            target: None,
            origin: 0,
            batch_size: 1,
            enqueued_at: Instant::now(),
            sink: None,
            gpu: crate::cuda::GpuState::Off,
            output_device: None,
            leave_on_device: None,
            outputs_optional: false,
            spare_buffers: Vec::new(),
        }
    }

    /// A request from the pool (see `pool`), or a new one.
    pub fn boxed(
        model: &str,
        version: i64,
        checked_against: Option<Arc<ModelConfig>>,
    ) -> Box<Request> {
        match pool::take_request() {
            Some(mut r) => {
                r.model.push_str(model);
                r.version = version;
                r.checked_against = checked_against;
                r
            }
            None => Box::new(Request::new(model, version, checked_against)),
        }
    }

    /// Copies `bytes` into a buffer, reusing one kept from an earlier use.
    /// Like [`Request::buffer_from`], or None when the allocator refuses.
    pub fn try_buffer_from(&mut self, bytes: &[u8]) -> Option<Vec<u8>> {
        let mut b = self.spare_buffers.pop().unwrap_or_default();
        b.clear();
        b.try_reserve_exact(bytes.len()).ok()?;
        b.extend_from_slice(bytes);
        Some(b)
    }

    pub fn buffer_from(&mut self, bytes: &[u8]) -> Vec<u8> {
        match self.spare_buffers.pop() {
            Some(mut b) => {
                b.clear();
                b.extend_from_slice(bytes);
                b
            }
            None => bytes.to_vec(),
        }
    }

    /// Back to the state of a new request, keeping allocated capacity.
    pub(crate) fn reset(&mut self) {
        use pool::{MAX_SPARE_BUFFER, MAX_SPARE_BUFFERS};
        self.id = 0;
        self.model.clear();
        self.correlation_id = CorrelationId::None;
        self.flags = 0;
        self.priority = 0;
        self.timeout_us = 0;
        for t in self.inputs.drain(..) {
            if let crate::tensor::TensorData::Owned(v) = t.data {
                if v.capacity() <= MAX_SPARE_BUFFER && self.spare_buffers.len() < MAX_SPARE_BUFFERS
                {
                    self.spare_buffers.push(v);
                }
            }
        }
        self.requested_outputs.clear();
        self.parameters.clear();
        self.checked_against = None;
        self.target = None;
        self.origin = 0;
        self.batch_size = 1;
        self.sink = None;
        self.gpu = crate::cuda::GpuState::Off;
        self.output_device = None;
        self.leave_on_device = None;
        self.outputs_optional = false;
    }

    /// The GPU where outputs a GPU instance computes there are to stay (wanted there by
    /// the caller, or read there by the next ensemble steps); None: host memory.
    pub fn outputs_on_device(&self) -> Option<i32> {
        self.output_device.or(self.leave_on_device)
    }

    pub fn input(&self, name: &str) -> Option<&Tensor> {
        self.inputs.iter().find(|t| &*t.name == name)
    }

    pub fn wants_output(&self, name: &str) -> bool {
        self.requested_outputs.is_empty() || self.requested_outputs.iter().any(|o| &**o == name)
    }

    /// Ends the request with an error FINAL response.
    pub fn fail(mut self, model: &ModelIdentity, err: Error) {
        if let Some(sink) = self.sink.take() {
            sink.send_final(Response::error(self.id, model, &self.correlation_id, err));
        }
    }
}

/// The model name (as a C string, shared by all its responses) and version.
#[derive(Clone, Debug)]
pub struct ModelIdentity {
    pub name: Arc<CString>,
    pub version: i64,
}

impl ModelIdentity {
    pub fn new(name: &str, version: i64) -> ModelIdentity {
        let name = CString::new(name.replace('\0', "")).unwrap_or_default();
        ModelIdentity {
            name: Arc::new(name),
            version,
        }
    }
    pub fn name_str(&self) -> &str {
        self.name.to_str().unwrap_or("")
    }
}

/// One output tensor of a response; its bytes are a window into the batch output.
pub struct OutputTensor {
    pub name: Arc<CString>,
    pub dtype: DataType,
    pub shape: Shape,
    pub data: crate::tensor::TensorData,
}

/// What the caller receives in its callback (`infer_response`).
pub struct Response {
    pub request_id: u64,
    pub status: Code,
    pub error: Option<CString>,
    pub model: ModelIdentity,
    pub correlation_id: u64,
    pub outputs: Vec<OutputTensor>,
    pub parameters: Vec<(CString, ParamValue)>,
}

impl Response {
    /// Holds the library's device buffers behind this response's GPU outputs back from
    /// reuse until the work queued on `stream` so far has run (see
    /// [`crate::cuda::DeviceBuf::release_after`]); NULL: the legacy default stream,
    /// which every blocking stream of the caller's synchronizes with.
    ///
    /// # Safety
    /// `stream` is NULL or a live stream handle.
    pub unsafe fn release_device_outputs_after(&self, stream: crate::cuda::CUstream) {
        let mut fenced: Vec<&std::sync::Arc<crate::cuda::DeviceBuf>> = Vec::new();
        for o in &self.outputs {
            if let crate::tensor::TensorData::Device(crate::tensor::DeviceData {
                keep: crate::tensor::DeviceKeep::Pooled(buf),
                ..
            }) = &o.data
            {
                if !fenced.iter().any(|b| std::sync::Arc::ptr_eq(b, buf)) {
                    // SAFETY: NULL or a live stream (this function's contract).
                    unsafe { buf.release_after(stream) };
                    fenced.push(buf);
                }
            }
        }
    }

    /// A successful response (outputs to be added), from the pool when one is there.
    pub fn ok(request_id: u64, model: &ModelIdentity, corr: &CorrelationId) -> Box<Response> {
        let correlation_id = match corr {
            CorrelationId::U64(v) => *v,
            _ => 0,
        };
        match pool::take_response() {
            Some(mut r) => {
                r.request_id = request_id;
                r.model = model.clone();
                r.correlation_id = correlation_id;
                r
            }
            None => Box::new(Response {
                request_id,
                status: Code::Ok,
                error: None,
                model: model.clone(),
                correlation_id,
                outputs: Vec::new(),
                parameters: Vec::new(),
            }),
        }
    }

    pub fn error(
        request_id: u64,
        model: &ModelIdentity,
        corr: &CorrelationId,
        err: Error,
    ) -> Box<Response> {
        let mut r = Response::ok(request_id, model, corr);
        r.status = err.code;
        r.error = Some(CString::new(err.message.replace('\0', " ")).unwrap_or_default());
        r
    }

    /// Back to an empty OK response, keeping the outputs vector's capacity.
    pub(crate) fn reset(&mut self) {
        self.request_id = 0;
        self.status = Code::Ok;
        self.error = None;
        self.correlation_id = 0;
        self.outputs.clear();
        self.parameters.clear();
    }

    pub fn output(&self, name: &str) -> Option<&OutputTensor> {
        self.outputs
            .iter()
            .find(|o| o.name.as_bytes() == name.as_bytes())
    }
}

/// The caller's callback plus the promise to call it with FINAL exactly once.
pub struct ResponseSink {
    target: Target,
    /// Filled in when the request is accepted, so the destructor's safety-net FINAL can
    /// say which request and model it is about.
    fallback: Option<(u64, ModelIdentity)>,
    /// Runs on each response before the callback: the GPU output placement of a request
    /// that wants its outputs on a GPU (the server's `OutputPlacer`).
    place: Option<Arc<dyn DeliveryHook>>,
    /// Runs on a successful FINAL response before anything else (the response cache
    /// stores it).
    store: Option<StoreHook>,
}

/// Sees a request's successful FINAL response first (see `ResponseSink::set_store_hook`).
pub type StoreHook = Box<dyn FnOnce(&Response) + Send>;

/// Work done on every response of a request on the delivering thread, with no lock held,
/// just before the response reaches its callback.
pub trait DeliveryHook: Send + Sync {
    /// May change the response (move its outputs, or turn it into an error).
    fn before_delivery(&self, resp: &mut Response);
}

/// Where responses go: a function kept inline (the application's callback, see `ffi`),
/// or library code (an ensemble step).
enum Target {
    Inline(InlineFn<(Box<Response>, u32)>),
    Rust(Box<dyn FnMut(Box<Response>, u32) + Send>),
}

impl ResponseSink {
    /// Responses go to `f` with their flags, on the thread that answers.
    pub fn inline(f: InlineFn<(Box<Response>, u32)>) -> ResponseSink {
        ResponseSink {
            target: Target::Inline(f),
            fallback: None,
            place: None,
            store: None,
        }
    }

    /// Responses go to `f` (library code; it runs on the thread that answers).
    pub fn rust(f: impl FnMut(Box<Response>, u32) + Send + 'static) -> ResponseSink {
        ResponseSink {
            target: Target::Rust(Box::new(f)),
            fallback: None,
            place: None,
            store: None,
        }
    }

    /// Arms the safety net: from now on the request is accepted, and dropping the sink
    /// without a FINAL sends one.
    pub fn set_fallback(&mut self, request_id: u64, model: ModelIdentity) {
        self.fallback = Some((request_id, model));
    }

    /// The request was not accepted after all: its callback must never run.
    pub fn disarm(&mut self) {
        self.fallback = None;
    }

    /// Every response from now on goes through `hook` before the callback runs (e.g. its
    /// host outputs, but BYTES, copied to the GPU the request asked for).
    pub fn set_delivery_hook(&mut self, hook: Arc<dyn DeliveryHook>) {
        self.place = Some(hook);
    }

    /// `hook` sees the request's FINAL response, if it succeeds, before the delivery hook
    /// and the callback (the response cache stores it).
    pub fn set_store_hook(&mut self, hook: StoreHook) {
        self.store = Some(hook);
    }

    fn call(&mut self, mut resp: Box<Response>, flags: u32) {
        // On the delivering thread, with no lock held (the callback runs next).
        if let Some(p) = &self.place {
            p.before_delivery(&mut resp);
        }
        match &mut self.target {
            Target::Inline(f) => f.call((resp, flags)),
            Target::Rust(f) => f(resp, flags),
        }
    }

    /// A non-final response (streaming models).
    pub fn send(&mut self, resp: Box<Response>) {
        self.call(resp, 0);
    }

    /// The FINAL response; after it the library never touches `user_data` again.
    pub fn send_final(mut self, resp: Box<Response>) {
        self.fallback = None;
        if let Some(store) = self.store.take() {
            if resp.status == Code::Ok {
                store(&resp);
            }
        }
        self.call(resp, RESPONSE_FLAG_FINAL);
    }
}

impl Drop for ResponseSink {
    fn drop(&mut self) {
        if let Some((id, model)) = self.fallback.take() {
            let err = Error::internal(format!(
                "request {id} for model '{}' was dropped without a response",
                model.name_str()
            ));
            self.call(
                Response::error(id, &model, &CorrelationId::None, err),
                RESPONSE_FLAG_FINAL,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::TensorData;

    #[test]
    fn reset_request_is_like_new_and_keeps_buffers() {
        let mut r = Request::new("m", 3, None);
        r.id = 7;
        r.correlation_id = CorrelationId::U64(9);
        r.flags = 3;
        r.priority = 2;
        r.timeout_us = 5;
        let buf = r.buffer_from(&[1, 2, 3]);
        r.inputs.push(Tensor {
            name: Arc::from("x"),
            dtype: DataType::Uint8,
            shape: Shape::from_slice(&[3]),
            data: TensorData::Owned(buf),
        });
        r.requested_outputs.push(Arc::from("y"));
        r.parameters.push(("k".into(), ParamValue::Int(1)));
        r.reset();
        assert_eq!(r.id, 0);
        assert!(r.model.is_empty());
        assert_eq!(r.correlation_id, CorrelationId::None);
        assert_eq!(
            (r.flags, r.priority, r.timeout_us, r.batch_size),
            (0, 0, 0, 1)
        );
        assert!(r.inputs.is_empty() && r.requested_outputs.is_empty() && r.parameters.is_empty());
        assert!(r.sink.is_none() && r.checked_against.is_none() && r.target.is_none());
        assert_eq!(r.buffer_from(&[4, 5]), vec![4, 5]);
        assert!(r.spare_buffers.is_empty(), "the kept buffer was reused");
    }

    #[test]
    fn reset_response_is_empty_ok() {
        let m = ModelIdentity::new("m", 1);
        let mut r = Response::error(5, &m, &CorrelationId::U64(2), Error::internal("x"));
        r.parameters
            .push((CString::new("k").unwrap(), ParamValue::Int(1)));
        r.reset();
        assert_eq!((r.request_id, r.status, r.correlation_id), (0, Code::Ok, 0));
        assert!(r.error.is_none() && r.outputs.is_empty() && r.parameters.is_empty());
    }
}
