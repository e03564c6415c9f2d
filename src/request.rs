//! Requests, responses and the exactly-once FINAL guard.
//!
//! A [`Request`] is owned by exactly one place at a time (the caller, a queue, a batch),
//! and its [`ResponseSink`] travels with it. The sink's `send_final` consumes the sink, and
//! a sink dropped without a FINAL sends one (INTERNAL) from its destructor, so "exactly one
//! FINAL per accepted request" holds by construction rather than by bookkeeping.

use crate::config::ModelConfig;
use crate::status::{Code, Error};
use crate::tensor::{DataType, Tensor};
use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::Instant;

pub use crate::tensor::Shape;

/// The response callback as the C API defines it.
pub type ResponseFn = unsafe extern "C" fn(*mut c_void, *mut Response, u32);

pub(crate) const RESPONSE_FLAG_FINAL: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum CorrelationId {
    #[default]
    None,
    U64(u64),
    Str(String),
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
    /// The model version resolved when the request was created, if it was.
    pub target: Option<Arc<crate::scheduler::Scheduler>>,
    /// Rows this request contributes to a batch (its dim 0 when the model batches).
    pub batch_size: u32,
    pub enqueued_at: Instant,
    pub sink: Option<ResponseSink>,
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
            batch_size: 1,
            enqueued_at: Instant::now(),
            sink: None,
        }
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
    pub fn ok(request_id: u64, model: &ModelIdentity, corr: &CorrelationId) -> Response {
        Response {
            request_id,
            status: Code::Ok,
            error: None,
            model: model.clone(),
            correlation_id: match corr {
                CorrelationId::U64(v) => *v,
                _ => 0,
            },
            outputs: Vec::new(),
            parameters: Vec::new(),
        }
    }

    pub fn error(
        request_id: u64,
        model: &ModelIdentity,
        corr: &CorrelationId,
        err: Error,
    ) -> Response {
        let mut r = Response::ok(request_id, model, corr);
        r.status = err.code;
        r.error = Some(CString::new(err.message.replace('\0', " ")).unwrap_or_default());
        r
    }

    pub fn output(&self, name: &str) -> Option<&OutputTensor> {
        self.outputs
            .iter()
            .find(|o| o.name.as_bytes() == name.as_bytes())
    }
}

/// The caller's callback plus the promise to call it with FINAL exactly once.
pub struct ResponseSink {
    func: ResponseFn,
    user_data: *mut c_void,
    /// Filled in when the request is accepted, so the destructor's safety-net FINAL can
    /// say which request and model it is about.
    fallback: Option<(u64, ModelIdentity)>,
}

// SAFETY: the C API states that callbacks run on library-owned threads and that
// `user_data` is handed back untouched; the caller is responsible for its thread safety.
unsafe impl Send for ResponseSink {}

thread_local! {
    static IN_CALLBACK: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// True while the current thread runs a response callback (used to refuse blocking calls
/// that would deadlock).
pub fn in_callback() -> bool {
    IN_CALLBACK.with(|c| c.get() > 0)
}

impl ResponseSink {
    pub fn new(func: ResponseFn, user_data: *mut c_void) -> ResponseSink {
        ResponseSink {
            func,
            user_data,
            fallback: None,
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

    fn call(&self, resp: Response, flags: u32) {
        let ptr = Box::into_raw(Box::new(resp));
        IN_CALLBACK.with(|c| c.set(c.get() + 1));
        // A C callback must not unwind; if a foreign exception tries, stop it here.
        let _ = std::panic::catch_unwind(|| unsafe { (self.func)(self.user_data, ptr, flags) });
        IN_CALLBACK.with(|c| c.set(c.get() - 1));
    }

    /// A non-final response (streaming models).
    pub fn send(&mut self, resp: Response) {
        self.call(resp, 0);
    }

    /// The FINAL response; after it the library never touches `user_data` again.
    pub fn send_final(mut self, resp: Response) {
        self.fallback = None;
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
