//! Helpers for behaviour tests that drive libinfer through its C API from Rust.
#![allow(dead_code, unused_imports)]

use infer::ffi::backend::*;
use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

pub use infer::backend::Batch;
pub use infer::ffi::server::ServerHandle;
pub use infer::request::{Request, Response};
pub use infer::server::ServerOptions;

pub fn cs(s: &str) -> CString {
    CString::new(s).unwrap()
}

pub fn last_error() -> String {
    unsafe { CStr::from_ptr(infer_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts a status and returns the last error message for message checks.
#[track_caller]
pub fn expect_status(got: infer_status, want: infer_status) -> String {
    let msg = last_error();
    assert_eq!(got, want, "expected status {want}, got {got} ({msg})");
    msg
}

#[track_caller]
pub fn ok(st: infer_status) {
    expect_status(st, INFER_STATUS_OK);
}

/// A server handle freed on drop.
pub struct Server(pub *mut ServerHandle);
unsafe impl Send for Server {}
unsafe impl Sync for Server {}

impl Server {
    pub fn new() -> Server {
        Server::with_options(std::ptr::null())
    }
    pub fn with_options(opts: *const ServerOptions) -> Server {
        let mut s = std::ptr::null_mut();
        ok(unsafe { infer_server_new(opts, &mut s) });
        Server(s)
    }
    pub fn load(&self, name: &str, config: &str) {
        ok(self.try_load(name, config));
    }
    pub fn try_load(&self, name: &str, config: &str) -> infer_status {
        unsafe {
            infer_server_load_model(
                self.0,
                cs(name).as_ptr(),
                cs(config).as_ptr(),
                std::ptr::null(),
            )
        }
    }
    pub fn request(&self, model: &str) -> Req {
        let mut r = std::ptr::null_mut();
        ok(unsafe { infer_request_new(self.0, cs(model).as_ptr(), -1, &mut r) });
        Req(r)
    }
    pub fn stats(&self, model: &str) -> serde_json::Value {
        let mut out = std::ptr::null_mut();
        ok(unsafe { infer_server_statistics_json(self.0, cs(model).as_ptr(), &mut out) });
        let s = unsafe { CStr::from_ptr(out) }.to_str().unwrap().to_owned();
        unsafe { infer_string_free(out) };
        serde_json::from_str(&s).unwrap()
    }
    pub fn pause(&self, model: &str) {
        ok(unsafe { infer_server_pause_model(self.0, cs(model).as_ptr()) });
    }
    pub fn resume(&self, model: &str) {
        ok(unsafe { infer_server_resume_model(self.0, cs(model).as_ptr()) });
    }
    /// Enqueues with a collecting callback.
    pub fn enqueue(&self, r: Req, c: &Collector) -> Result<u64, (infer_status, String)> {
        let mut id = 0u64;
        let ud = Arc::into_raw(c.0.clone()) as *mut c_void;
        let st = unsafe { infer_server_enqueue(self.0, r.take(), Some(collect), ud, &mut id) };
        if st != INFER_STATUS_OK {
            let msg = last_error();
            unsafe { drop(Arc::from_raw(ud as *const Inner)) };
            return Err((st, msg));
        }
        Ok(id)
    }
    pub fn infer(&self, r: Req) -> Resp {
        let mut out = std::ptr::null_mut();
        ok(unsafe { infer_server_infer(self.0, r.take(), &mut out) });
        Resp(out)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe { infer_server_free(self.0) };
    }
}

pub struct Req(pub *mut Request);
impl Req {
    pub fn take(mut self) -> *mut Request {
        std::mem::replace(&mut self.0, std::ptr::null_mut())
    }
    pub fn input_f32(self, name: &str, shape: &[i64], data: &[f32]) -> Self {
        ok(self.try_input(name, INFER_DATATYPE_FP32, shape, bytemuck::cast_slice(data)));
        self
    }
    pub fn input_i32(self, name: &str, shape: &[i64], data: &[i32]) -> Self {
        ok(self.try_input(
            name,
            INFER_DATATYPE_INT32,
            shape,
            bytemuck::cast_slice(data),
        ));
        self
    }
    pub fn try_input(
        &self,
        name: &str,
        dt: infer_datatype,
        shape: &[i64],
        bytes: &[u8],
    ) -> infer_status {
        unsafe {
            infer_request_add_input(
                self.0,
                cs(name).as_ptr(),
                dt,
                shape.as_ptr(),
                shape.len(),
                bytes.as_ptr() as *const c_void,
                bytes.len(),
            )
        }
    }
    pub fn priority(self, p: u32) -> Self {
        ok(unsafe { infer_request_set_priority(self.0, p) });
        self
    }
    pub fn timeout_us(self, us: u64) -> Self {
        ok(unsafe { infer_request_set_timeout_us(self.0, us) });
        self
    }
    pub fn output(self, name: &str) -> Self {
        ok(unsafe { infer_request_add_requested_output(self.0, cs(name).as_ptr()) });
        self
    }
}
impl Drop for Req {
    fn drop(&mut self) {
        unsafe { infer_request_free(self.0) };
    }
}

/// A response freed on drop.
pub struct Resp(pub *mut Response);
unsafe impl Send for Resp {}
impl Resp {
    pub fn status(&self) -> infer_status {
        unsafe { infer_response_status(self.0) }
    }
    pub fn error(&self) -> String {
        let p = unsafe { infer_response_error_message(self.0) };
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }
    pub fn id(&self) -> u64 {
        unsafe { infer_response_request_id(self.0) }
    }
    pub fn output_count(&self) -> usize {
        unsafe { infer_response_output_count(self.0) }
    }
    /// (shape, bytes) of an output.
    pub fn output(&self, name: &str) -> Option<(Vec<i64>, Vec<u8>)> {
        let (mut dt, mut shape, mut nd, mut data, mut bs) =
            (0, std::ptr::null(), 0usize, std::ptr::null(), 0usize);
        let st = unsafe {
            infer_response_output_by_name(
                self.0,
                cs(name).as_ptr(),
                &mut dt,
                &mut shape,
                &mut nd,
                &mut data,
                &mut bs,
            )
        };
        if st != INFER_STATUS_OK {
            return None;
        }
        let shape = unsafe { std::slice::from_raw_parts(shape, nd) }.to_vec();
        let bytes = if bs == 0 {
            Vec::new()
        } else {
            unsafe { std::slice::from_raw_parts(data as *const u8, bs) }.to_vec()
        };
        Some((shape, bytes))
    }
    pub fn output_f32(&self, name: &str) -> Vec<f32> {
        let (_, b) = self
            .output(name)
            .unwrap_or_else(|| panic!("no output {name}: {}", self.error()));
        bytemuck::pod_collect_to_vec(&b)
    }
}
impl Drop for Resp {
    fn drop(&mut self) {
        unsafe { infer_response_free(self.0) };
    }
}

/// Collects responses; counts FINALs per request id to check exactly-once.
#[derive(Default)]
pub struct Inner {
    pub state: Mutex<Collected>,
    pub cv: Condvar,
}

#[derive(Default)]
pub struct Collected {
    pub responses: Vec<(Resp, u32)>,
    pub finals: usize,
    /// FINAL responses per request id.
    pub finals_by_id: std::collections::HashMap<u64, usize>,
    /// Request ids that got a response after their FINAL.
    pub after_final: Vec<u64>,
}

#[derive(Clone, Default)]
pub struct Collector(pub Arc<Inner>);

unsafe extern "C" fn collect(ud: *mut c_void, resp: *mut Response, flags: u32) {
    let inner = &*(ud as *const Inner);
    let resp = Resp(resp);
    let id = resp.id();
    let mut st = inner.state.lock().unwrap();
    if st.finals_by_id.contains_key(&id) {
        st.after_final.push(id);
    }
    if flags & INFER_RESPONSE_FLAG_FINAL != 0 {
        st.finals += 1;
        *st.finals_by_id.entry(id).or_default() += 1;
    }
    st.responses.push((resp, flags));
    drop(st);
    inner.cv.notify_all();
    if flags & INFER_RESPONSE_FLAG_FINAL != 0 {
        drop(Arc::from_raw(ud as *const Inner));
    }
}

impl Collector {
    pub fn new() -> Collector {
        Collector::default()
    }
    pub fn finals(&self) -> usize {
        self.0.state.lock().unwrap().finals
    }
    /// Waits until `n` FINAL responses arrived (panics after 60 s).
    pub fn wait(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut g = self.0.state.lock().unwrap();
        while g.finals < n {
            let now = std::time::Instant::now();
            assert!(
                now < deadline,
                "timed out waiting for {n} responses, have {}",
                g.finals
            );
            g = self.0.cv.wait_timeout(g, deadline - now).unwrap().0;
        }
    }
    pub fn take(&self) -> Vec<Resp> {
        let mut g = self.0.state.lock().unwrap();
        std::mem::take(&mut g.responses)
            .into_iter()
            .map(|(r, _)| r)
            .collect()
    }
    /// Checks that every request id got exactly one FINAL and nothing after it, and that
    /// no other request was answered.
    pub fn assert_exactly_once(&self, ids: &[u64]) {
        let g = self.0.state.lock().unwrap();
        for id in ids {
            let finals = g.finals_by_id.get(id).copied().unwrap_or(0);
            assert_eq!(finals, 1, "request {id} got {finals} FINAL responses");
        }
        assert!(
            g.after_final.is_empty(),
            "responses after FINAL: {:?}",
            g.after_final
        );
        assert_eq!(
            g.finals_by_id.len(),
            ids.len(),
            "responses for unexpected requests"
        );
        assert_eq!(g.responses.len(), ids.len(), "unexpected extra responses");
    }
}

pub fn add_sub_config(name: &str, extra: &str) -> String {
    format!(
        r#"
name: "{name}"
backend: "add_sub"
max_batch_size: 64
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
{extra}
"#
    )
}

pub fn add_sub_request(s: &Server, model: &str, a: [f32; 4], b: [f32; 4]) -> Req {
    s.request(model)
        .input_f32("INPUT0", &[1, 4], &a)
        .input_f32("INPUT1", &[1, 4], &b)
}

/// Batch sizes executed so far, as (size, count).
pub fn batch_sizes(stats: &serde_json::Value) -> Vec<(u64, u64)> {
    stats["models"][0]["batch_sizes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["size"].as_u64().unwrap(), b["count"].as_u64().unwrap()))
        .collect()
}

/// A Rust backend whose every instance runs `execute` (for tests of backend behaviour).
pub struct FnBackend(pub fn(&mut Batch) -> infer::status::Result<()>);

struct FnInstance(fn(&mut Batch) -> infer::status::Result<()>);

impl infer::backend::Backend for FnBackend {
    fn create_instance(
        self: Arc<Self>,
        _: &Arc<infer::config::ModelConfig>,
        _: u32,
        _: i32,
    ) -> infer::status::Result<Box<dyn infer::backend::ModelInstance>> {
        Ok(Box::new(FnInstance(self.0)))
    }
}

impl infer::backend::ModelInstance for FnInstance {
    fn execute(&mut self, batch: &mut Batch) -> infer::status::Result<()> {
        (self.0)(batch)
    }
}

impl Server {
    /// Registers `execute` as the backend called `name`.
    pub fn register_fn_backend(
        &self,
        name: &str,
        execute: fn(&mut Batch) -> infer::status::Result<()>,
    ) {
        unsafe { &*self.0 }
            .server()
            .register_backend(name, Arc::new(FnBackend(execute)))
            .unwrap();
    }
}

// ---- sequence batching helpers ----

impl Req {
    pub fn correlation_id(self, id: u64) -> Self {
        ok(unsafe { infer_request_set_correlation_id(self.0, id) });
        self
    }
    pub fn correlation_id_str(self, id: &str) -> Self {
        ok(self.try_correlation_id_str(id));
        self
    }
    pub fn try_correlation_id_str(&self, id: &str) -> infer_status {
        unsafe { infer_request_set_correlation_id_str(self.0, cs(id).as_ptr()) }
    }
    pub fn flags(self, flags: u32) -> Self {
        ok(unsafe { infer_request_set_flags(self.0, flags) });
        self
    }
    pub fn input_i64(self, name: &str, shape: &[i64], data: &[i64]) -> Self {
        ok(self.try_input(
            name,
            INFER_DATATYPE_INT64,
            shape,
            bytemuck::cast_slice(data),
        ));
        self
    }
    pub fn input_f64(self, name: &str, shape: &[i64], data: &[f64]) -> Self {
        ok(self.try_input(name, INFER_DATATYPE_FP64, shape, bytemuck::cast_slice(data)));
        self
    }
}

impl Resp {
    pub fn output_i32(&self, name: &str) -> Vec<i32> {
        let (_, b) = self
            .output(name)
            .unwrap_or_else(|| panic!("no output {name}: {}", self.error()));
        bytemuck::pod_collect_to_vec(&b)
    }
    pub fn output_i64(&self, name: &str) -> Vec<i64> {
        let (_, b) = self
            .output(name)
            .unwrap_or_else(|| panic!("no output {name}: {}", self.error()));
        bytemuck::pod_collect_to_vec(&b)
    }
    pub fn output_f64(&self, name: &str) -> Vec<f64> {
        let (_, b) = self
            .output(name)
            .unwrap_or_else(|| panic!("no output {name}: {}", self.error()));
        bytemuck::pod_collect_to_vec(&b)
    }
    /// The request's numeric correlation ID as the response reports it.
    pub fn correlation_id(&self) -> u64 {
        unsafe { infer_response_correlation_id(self.0) }
    }
}

impl Server {
    /// Loads a model from config text with a model directory (for files the config names).
    pub fn try_load_dir(&self, name: &str, config: &str, dir: &std::path::Path) -> infer_status {
        let d = cs(dir.to_str().unwrap());
        unsafe {
            infer_server_load_model(self.0, cs(name).as_ptr(), cs(config).as_ptr(), d.as_ptr())
        }
    }
    pub fn unload(&self, name: &str) {
        ok(unsafe { infer_server_unload_model(self.0, cs(name).as_ptr()) });
    }
    pub fn shutdown(&self, timeout_ms: u64) {
        ok(unsafe { infer_server_shutdown(self.0, timeout_ms) });
    }
}

impl Collector {
    /// Like [`Collector::wait`] with a custom limit; returns whether `n` FINALs arrived.
    pub fn wait_for(&self, n: usize, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut g = self.0.state.lock().unwrap();
        while g.finals < n {
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            g = self.0.cv.wait_timeout(g, deadline - now).unwrap().0;
        }
        true
    }
    /// The responses received so far (each with its flags), leaving them collected.
    pub fn ids_in_order(&self) -> Vec<u64> {
        let g = self.0.state.lock().unwrap();
        g.responses.iter().map(|(r, _)| r.id()).collect()
    }
}

/// A unique empty folder under the system temp folder (removed by the caller or left).
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("libinfer-test-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Builds the stand-ins of tests/fixtures/build_fakes.sh into `dir`: the driver (of CUDA
/// `driver_major`) with the kernels built for the host, NVRTC and cuBLAS.
pub fn build_fakes(dir: &std::path::Path, driver_major: u32) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/build_fakes.sh");
    let out = std::process::Command::new("sh")
        .arg(script)
        .arg(dir)
        .env("FAKE_DRIVER_MAJOR", driver_major.to_string())
        .output()
        .map_err(|e| format!("sh: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(())
}

/// Runs the test `test` of the current test binary alone in a fresh process with `envs`
/// added (for what a process loads once: the CUDA driver, ONNX Runtime); asserts that it
/// passed and returns all it printed.
pub fn run_test_child(test: &str, envs: &[(&str, &std::ffi::OsStr)]) -> String {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = std::process::Command::new(exe)
        .args(["--exact", test, "--nocapture"])
        .envs(envs.iter().copied())
        .output()
        .expect("running the test binary again");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{test}: {all}");
    all
}
