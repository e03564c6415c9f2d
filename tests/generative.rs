//! Generative models through the C API: the tiny GPT-2 of `models/tiny_gpt2` against the
//! Hugging Face reference in `tests/fixtures/models/tiny_gpt2.json` (written by
//! `models/generate_gpt2.py`), in-flight batching invariance (chunked prefill, preemption
//! by a small KV cache, prefix reuse), streaming, cancellation, statistics and errors.

mod common;
use common::*;
use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use serde_json::Value;
use std::ffi::{c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny_gpt2")
}

fn fixture() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/tiny_gpt2.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run models/generate_gpt2.py)", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// The shipped config with `params` (key, value) replacing or adding parameters.
fn config(params: &[(&str, &str)]) -> String {
    let text = std::fs::read_to_string(model_dir().join("config.pbtxt")).unwrap();
    let mut out: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with("name:"))
        .filter(|l| {
            !params
                .iter()
                .any(|(k, _)| l.contains(&format!("key: \"{k}\"")))
        })
        .map(str::to_owned)
        .collect();
    for (k, v) in params {
        out.push(format!(
            "parameters {{ key: \"{k}\" value {{ string_value: \"{v}\" }} }}"
        ));
    }
    out.join("\n")
}

fn server_with(name: &str, config_text: &str) -> Server {
    let s = Server::new();
    let st = try_load_dir(&s, name, config_text);
    assert_eq!(st, INFER_STATUS_OK, "loading {name}: {}", last_error());
    s
}

fn try_load_dir(s: &Server, name: &str, config_text: &str) -> infer_status {
    let dir = cs(model_dir().to_str().unwrap());
    unsafe {
        infer_server_load_model(
            s.0,
            cs(name).as_ptr(),
            cs(config_text).as_ptr(),
            dir.as_ptr(),
        )
    }
}

/// What one request received.
#[derive(Default, Debug, Clone)]
struct Got {
    chunks: Vec<Vec<i32>>,
    log_probs: Vec<f32>,
    status: Option<infer_status>,
    message: String,
    reason: String,
    cached_tokens: i64,
    prompt_tokens: i64,
    /// `text_output` of each response.
    text: Vec<String>,
    responses_after_final: usize,
    /// What `infer_server_cancel` returned when the callback sent it (`Params::cancel_at`).
    cancel_status: Option<infer_status>,
}

impl Got {
    fn tokens(&self) -> Vec<i32> {
        self.chunks.concat()
    }
}

#[derive(Default)]
struct Slot {
    got: Mutex<Got>,
    cv: Condvar,
    /// The server's address and a token count: the callback that brings the count to it
    /// cancels the request.
    cancel_at: Option<(usize, usize)>,
}

unsafe extern "C" fn on_response(ud: *mut c_void, resp: *mut Response, flags: u32) {
    let slot = &*(ud as *const Slot);
    let r = Resp(resp);
    let mut g = slot.got.lock().unwrap();
    if g.status.is_some() {
        g.responses_after_final += 1;
    }
    if let Some((_, bytes)) = r.output("output_ids") {
        g.chunks.push(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        );
        if let Some((server, at)) = slot.cancel_at {
            let before = g.chunks[..g.chunks.len() - 1].concat().len();
            if before < at && g.tokens().len() >= at && flags & INFER_RESPONSE_FLAG_FINAL == 0 {
                let id = infer_response_request_id(r.0);
                g.cancel_status = Some(infer_server_cancel(server as *mut ServerHandle, id));
            }
        }
    }
    if let Some((shape, bytes)) = r.output("text_output") {
        assert_eq!(shape, vec![1]);
        let n = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(bytes.len(), 4 + n);
        g.text
            .push(String::from_utf8(bytes[4..].to_vec()).expect("text_output is UTF-8"));
    }
    if r.output("output_log_probs").is_some() {
        let lp = r.output_f32("output_log_probs");
        g.log_probs.extend(lp);
    }
    if flags & INFER_RESPONSE_FLAG_FINAL != 0 {
        let mut reason = std::ptr::null();
        if infer_response_parameter_string(r.0, cs("finish_reason").as_ptr(), &mut reason)
            == INFER_STATUS_OK
        {
            g.reason = CStr::from_ptr(reason).to_string_lossy().into_owned();
        }
        let mut cached = 0i64;
        if infer_response_parameter_int(r.0, cs("cached_tokens").as_ptr(), &mut cached)
            == INFER_STATUS_OK
        {
            g.cached_tokens = cached;
        }
        let mut prompt = 0i64;
        if infer_response_parameter_int(r.0, cs("prompt_tokens").as_ptr(), &mut prompt)
            == INFER_STATUS_OK
        {
            g.prompt_tokens = prompt;
        }
        g.status = Some(r.status());
        if r.status() != INFER_STATUS_OK {
            g.message = r.error();
        }
        drop(g);
        slot.cv.notify_all();
        // The library never touches user_data after FINAL: the test's Arc is released.
        drop(Arc::from_raw(ud as *const Slot));
    }
}

struct Pending(Arc<Slot>, u64);

impl Pending {
    fn wait(&self) -> Got {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut g = self.0.got.lock().unwrap();
        while g.status.is_none() {
            let now = std::time::Instant::now();
            assert!(now < deadline, "no FINAL for request {}", self.1);
            g = self.0.cv.wait_timeout(g, deadline - now).unwrap().0;
        }
        g.clone()
    }
}

#[derive(Clone, Default)]
struct Params {
    max_tokens: Option<i64>,
    end_id: Option<i64>,
    streaming: bool,
    temperature: Option<f64>,
    top_k: Option<i64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    /// Sent as `text_input` in place of the prompt's ids.
    text: Option<String>,
    bools: Vec<(&'static str, bool)>,
    strings: Vec<(&'static str, String)>,
    floats: Vec<(&'static str, f64)>,
    /// Cancel from the callback that brings the tokens received to this count.
    cancel_at: Option<usize>,
}

fn max_tokens(n: i64) -> Params {
    Params {
        max_tokens: Some(n),
        ..Default::default()
    }
}

fn try_enqueue(
    s: &Server,
    model: &str,
    prompt: &[i32],
    p: &Params,
) -> Result<Pending, (infer_status, String)> {
    let r = s.request(model);
    let r = match &p.text {
        None => r.input_i32("input_ids", &[prompt.len() as i64], prompt),
        Some(t) => {
            let mut b = (t.len() as u32).to_le_bytes().to_vec();
            b.extend_from_slice(t.as_bytes());
            ok(r.try_input("text_input", INFER_DATATYPE_BYTES, &[1], &b));
            r
        }
    };
    let set_i = |k: &str, v: Option<i64>| {
        if let Some(v) = v {
            ok(unsafe { infer_request_set_parameter_int(r.0, cs(k).as_ptr(), v) });
        }
    };
    set_i("max_tokens", p.max_tokens);
    set_i("end_id", p.end_id);
    set_i("top_k", p.top_k);
    set_i("seed", p.seed);
    for (k, v) in [("temperature", p.temperature), ("top_p", p.top_p)] {
        if let Some(v) = v {
            ok(unsafe { infer_request_set_parameter_double(r.0, cs(k).as_ptr(), v) });
        }
    }
    for (k, v) in &p.floats {
        ok(unsafe { infer_request_set_parameter_double(r.0, cs(k).as_ptr(), *v) });
    }
    for (k, v) in &p.bools {
        ok(unsafe { infer_request_set_parameter_bool(r.0, cs(k).as_ptr(), *v) });
    }
    for (k, v) in &p.strings {
        ok(unsafe { infer_request_set_parameter_string(r.0, cs(k).as_ptr(), cs(v).as_ptr()) });
    }
    if p.streaming {
        ok(unsafe { infer_request_set_parameter_bool(r.0, cs("streaming").as_ptr(), true) });
    }
    let slot = Arc::new(Slot {
        cancel_at: p.cancel_at.map(|n| (s.0 as usize, n)),
        ..Slot::default()
    });
    let ud = Arc::into_raw(slot.clone()) as *mut c_void;
    let mut id = 0u64;
    let st = unsafe { infer_server_enqueue(s.0, r.take(), Some(on_response), ud, &mut id) };
    if st != INFER_STATUS_OK {
        let msg = last_error();
        unsafe { drop(Arc::from_raw(ud as *const Slot)) };
        return Err((st, msg));
    }
    Ok(Pending(slot, id))
}

fn enqueue(s: &Server, model: &str, prompt: &[i32], p: &Params) -> Pending {
    try_enqueue(s, model, prompt, p).unwrap_or_else(|(st, m)| panic!("enqueue: {st}: {m}"))
}

fn run(s: &Server, model: &str, prompt: &[i32], p: &Params) -> Got {
    enqueue(s, model, prompt, p).wait()
}

fn ints(v: &Value) -> Vec<i32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap() as i32)
        .collect()
}

// ---------------------------------------------------------------------------------------
// Against the Hugging Face reference
// ---------------------------------------------------------------------------------------

#[test]
fn greedy_tokens_match_the_reference_streaming_or_not() {
    let fx = fixture();
    let s = server_with("gpt", &config(&[]));
    for case in fx["cases"].as_array().unwrap() {
        let prompt = ints(&case["prompt"]);
        let want = ints(&case["greedy"]);
        let n = want.len() as i64;
        let g = run(&s, "gpt", &prompt, &max_tokens(n));
        assert_eq!(g.status, Some(INFER_STATUS_OK), "{}", g.message);
        assert_eq!(g.tokens(), want, "prompt {prompt:?}");
        assert_eq!(g.reason, "length");
        assert_eq!(g.chunks.len(), 1, "not streaming: one response");
        let st = run(
            &s,
            "gpt",
            &prompt,
            &Params {
                streaming: true,
                ..max_tokens(n)
            },
        );
        assert_eq!(st.tokens(), want);
        assert_eq!(st.chunks.len(), want.len(), "one response per token");
        assert_eq!(st.responses_after_final, 0);
    }
}

#[test]
fn log_probs_of_greedy_tokens_match_the_reference_logits() {
    let fx = fixture();
    let s = server_with("gpt", &config(&[]));
    let case = fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c.get("step_logits").is_some())
        .expect("a case with the logits of each generated step");
    let prompt = ints(&case["prompt"]);
    let steps = case["step_logits"].as_array().unwrap();
    let g = run(&s, "gpt", &prompt, &max_tokens(steps.len() as i64));
    assert_eq!(g.log_probs.len(), steps.len());
    for (k, row) in steps.iter().enumerate() {
        let row: Vec<f64> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let max = row.iter().cloned().fold(f64::MIN, f64::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        let want = row[g.tokens()[k] as usize] - lse;
        let got = f64::from(g.log_probs[k]);
        assert!(
            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
            "step {k}: log-prob {got} vs reference {want}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// In-flight batching gives each request what it gets alone
// ---------------------------------------------------------------------------------------

/// 16 requests: prompts 1..90 tokens, several sharing a 40-token prefix, outputs 4..40.
fn workload() -> Vec<(Vec<i32>, i64)> {
    let shared: Vec<i32> = (0..40).map(|i| (i * 37 + 11) % 256).collect();
    (0..16)
        .map(|i: i32| {
            let len = [1, 5, 16, 17, 33, 50][i as usize % 6];
            let mut p = if i % 4 == 1 {
                shared.clone()
            } else {
                Vec::new()
            };
            p.extend((0..len).map(|k| (k * 13 + i * 29 + 7) % 256));
            (p, 4 + (i as i64 * 7) % 37)
        })
        .collect()
}

#[test]
fn in_flight_batching_equals_each_request_alone() {
    let w = workload();
    let alone_server = server_with("gpt", &config(&[("enable_kv_cache_reuse", "false")]));
    let want: Vec<Vec<i32>> = w
        .iter()
        .map(|(p, n)| run(&alone_server, "gpt", p, &max_tokens(*n)).tokens())
        .collect();
    drop(alone_server);
    let variants: Vec<(&str, Vec<(&str, &str)>)> = vec![
        (
            "guaranteed_no_evict",
            vec![("batch_scheduler_policy", "guaranteed_no_evict")],
        ),
        (
            "static_batch",
            vec![("batch_scheduler_policy", "static_batch")],
        ),
        (
            "chunked prefill, 24 tokens per iteration",
            vec![("max_num_tokens", "24"), ("enable_kv_cache_reuse", "false")],
        ),
        (
            "preemption: 12 blocks of 16 tokens",
            vec![
                ("kv_cache_blocks", "12"),
                ("enable_kv_cache_reuse", "false"),
            ],
        ),
        (
            "prefix reuse, 4 sequences at a time",
            vec![
                ("enable_kv_cache_reuse", "true"),
                ("max_num_sequences", "4"),
            ],
        ),
        (
            "all at once, two instances of 2 threads",
            vec![
                ("kv_cache_blocks", "12"),
                ("max_num_tokens", "24"),
                ("intra_op_thread_count", "2"),
            ],
        ),
    ];
    for (what, params) in variants {
        let mut text = config(&params);
        if what.contains("two instances") {
            text = text.replace("count: 1 kind: KIND_CPU", "count: 2 kind: KIND_CPU");
        }
        let s = server_with("gpt", &text);
        s.pause("gpt");
        let pending: Vec<Pending> = w
            .iter()
            .map(|(p, n)| enqueue(&s, "gpt", p, &max_tokens(*n)))
            .collect();
        s.resume("gpt");
        let got: Vec<Got> = pending.iter().map(Pending::wait).collect();
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                g.status,
                Some(INFER_STATUS_OK),
                "{what}: request {i}: {}",
                g.message
            );
            assert_eq!(g.tokens(), want[i], "{what}: request {i}");
        }
        let gen = &s.stats("gpt")["models"][0]["generation"];
        if what.contains("preemption") || what.contains("all at once") {
            assert!(gen["preemptions"].as_u64().unwrap() > 0, "{what}: {gen}");
        }
        if what.starts_with("prefix reuse") {
            assert!(
                got.iter().any(|g| g.cached_tokens >= 32),
                "{what}: nothing reused"
            );
            assert!(
                gen["reused_kv_blocks"].as_u64().unwrap() > 0,
                "{what}: {gen}"
            );
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible_under_batching() {
    let s = server_with("gpt", &config(&[]));
    let p = Params {
        temperature: Some(1.5),
        top_k: Some(50),
        top_p: Some(0.95),
        seed: Some(1234),
        ..max_tokens(24)
    };
    let a = run(&s, "gpt", &[10, 20, 30], &p).tokens();
    let greedy = run(&s, "gpt", &[10, 20, 30], &max_tokens(24)).tokens();
    assert_ne!(a, greedy);
    let other = run(
        &s,
        "gpt",
        &[10, 20, 30],
        &Params {
            seed: Some(99),
            ..p.clone()
        },
    )
    .tokens();
    assert_ne!(a, other, "another seed, another sample");
    s.pause("gpt");
    let many: Vec<Pending> = (0..6)
        .map(|_| enqueue(&s, "gpt", &[10, 20, 30], &p))
        .collect();
    let noise: Vec<Pending> = (0..4)
        .map(|i| {
            enqueue(
                &s,
                "gpt",
                &[i],
                &Params {
                    temperature: Some(1.0),
                    ..max_tokens(30)
                },
            )
        })
        .collect();
    s.resume("gpt");
    for m in &many {
        assert_eq!(m.wait().tokens(), a);
    }
    for n in &noise {
        assert_eq!(n.wait().status, Some(INFER_STATUS_OK));
    }
}

// ---------------------------------------------------------------------------------------
// Streaming, end_id, cancellation, limits
// ---------------------------------------------------------------------------------------

#[test]
fn end_id_and_context_length_end_generation() {
    let s = server_with("gpt", &config(&[]));
    let full = run(&s, "gpt", &[1, 2, 3], &max_tokens(20)).tokens();
    let k = (1..full.len())
        .find(|&k| !full[..k].contains(&full[k]))
        .unwrap();
    let g = run(
        &s,
        "gpt",
        &[1, 2, 3],
        &Params {
            end_id: Some(full[k] as i64),
            ..max_tokens(20)
        },
    );
    assert_eq!(
        (g.reason.as_str(), g.tokens()),
        ("end_id", full[..k].to_vec())
    );
    // Context 128: a prompt of 120 tokens gets 8.
    let prompt: Vec<i32> = (0..120).map(|i| i % 256).collect();
    let g = run(&s, "gpt", &prompt, &max_tokens(100));
    assert_eq!((g.reason.as_str(), g.tokens().len()), ("length", 8));
}

#[test]
fn cancel_a_streaming_request_midway() {
    let s = server_with("gpt", &config(&[]));
    // The callback of the third token cancels: callbacks run on the model's loop between
    // iterations, so the request is still running then, however fast the model is.
    let p = enqueue(
        &s,
        "gpt",
        &[5, 6, 7],
        &Params {
            streaming: true,
            cancel_at: Some(3),
            ..max_tokens(120)
        },
    );
    let g = p.wait();
    assert_eq!(g.cancel_status, Some(INFER_STATUS_OK), "{g:?}");
    assert_eq!(g.status, Some(INFER_STATUS_CANCELLED), "{g:?}");
    assert_eq!(g.reason, "cancelled");
    assert!(
        g.tokens().len() >= 3 && g.tokens().len() < 120,
        "{}",
        g.tokens().len()
    );
    let again = unsafe { infer_server_cancel(s.0, p.1) };
    assert_eq!(again, INFER_STATUS_NOT_FOUND);
}

#[test]
fn bad_requests_are_refused_at_enqueue_with_the_reason() {
    let s = server_with("gpt", &config(&[]));
    let cases: Vec<(Vec<i32>, Params, &str)> = vec![
        (vec![256], max_tokens(1), "not a token id"),
        (vec![1], max_tokens(0), "max_tokens"),
        (
            vec![1],
            Params {
                top_p: Some(1.5),
                ..max_tokens(1)
            },
            "top_p",
        ),
        ((0..128).collect(), max_tokens(1), "no room"),
        // Messages stay short whatever the value: floats as Rust writes them, long
        // strings with their middle cut out.
        (
            vec![1],
            Params {
                temperature: Some(-1e300),
                ..max_tokens(1)
            },
            "got -1e300",
        ),
        (
            vec![1],
            Params {
                strings: vec![("logit_bias", "x".repeat(100_000))],
                ..max_tokens(1)
            },
            "(100000 bytes) is not a JSON object",
        ),
        (
            vec![1],
            Params {
                strings: vec![(
                    "stop",
                    format!("[\"a\", {{\"k\": \"{}\"}}]", "y".repeat(1000)),
                )],
                ..max_tokens(1)
            },
            "is not a string",
        ),
    ];
    for (prompt, p, want) in cases {
        let (st, msg) = try_enqueue(&s, "gpt", &prompt, &p).err().expect("refused");
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{want}: {msg}");
        assert!(msg.contains(want) && msg.contains("gpt"), "{want}: {msg}");
        assert!(msg.len() < 300, "{want}: a message of {} bytes", msg.len());
    }
    // A top_k past the vocabulary keeps every token (as one just past it would).
    let p = Params {
        top_k: Some(1 << 40),
        temperature: Some(1.0),
        seed: Some(5),
        ..max_tokens(2)
    };
    let q = Params {
        top_k: Some(256),
        ..p.clone()
    };
    assert_eq!(
        run(&s, "gpt", &[1], &p).tokens(),
        run(&s, "gpt", &[1], &q).tokens()
    );
    // INT32 [n] only: a 2-D prompt is refused when added.
    let r = s.request("gpt");
    let st = unsafe {
        infer_request_add_input(
            r.0,
            cs("input_ids").as_ptr(),
            INFER_DATATYPE_INT32,
            [1i64, 2].as_ptr(),
            2,
            [0u8; 8].as_ptr() as *const c_void,
            8,
        )
    };
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{}", last_error());
}

#[test]
fn unload_and_shutdown_end_every_request_exactly_once() {
    let s = server_with("gpt", &config(&[("max_num_sequences", "4")]));
    let pending: Vec<Pending> = (0..12)
        .map(|i| {
            enqueue(
                &s,
                "gpt",
                &[i, i + 1],
                &Params {
                    streaming: i % 2 == 0,
                    ..max_tokens(30)
                },
            )
        })
        .collect();
    ok(unsafe { infer_server_unload_model(s.0, cs("gpt").as_ptr()) });
    for p in &pending {
        let g = p.wait();
        assert_eq!(
            g.status,
            Some(INFER_STATUS_OK),
            "unload lets requests finish: {}",
            g.message
        );
        assert_eq!(g.tokens().len(), 30);
    }
    let s = server_with("gpt", &config(&[("max_num_sequences", "4")]));
    let pending: Vec<Pending> = (0..12)
        .map(|i| enqueue(&s, "gpt", &[i], &max_tokens(100)))
        .collect();
    ok(unsafe { infer_server_shutdown(s.0, 0) });
    for p in &pending {
        let g = p.wait();
        assert!(
            g.status == Some(INFER_STATUS_OK) || g.status == Some(INFER_STATUS_CANCELLED),
            "{g:?}"
        );
        assert_eq!(g.responses_after_final, 0);
    }
}

// ---------------------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------------------

unsafe extern "C" fn on_stats(ud: *mut c_void, json: *const std::ffi::c_char) {
    let v = &*(ud as *const Mutex<Vec<Value>>);
    let text = CStr::from_ptr(json).to_str().unwrap();
    v.lock().unwrap().push(serde_json::from_str(text).unwrap());
}

/// A config without `tokens_per_block` gets TensorRT-LLM's 64 positions a block: the
/// iteration statistics say so, and `kv_cache_blocks` counts blocks of that length.
#[test]
fn kv_blocks_hold_64_positions_by_default() {
    let text: Vec<String> = config(&[])
        .lines()
        .filter(|l| !l.contains("\"tokens_per_block\""))
        .map(str::to_owned)
        .collect();
    let s = server_with("gpt", &text.join("\n"));
    let seen: Box<Mutex<Vec<Value>>> = Box::default();
    let ud = &*seen as *const _ as *mut c_void;
    ok(unsafe {
        infer_server_set_iteration_stats_callback(s.0, cs("gpt").as_ptr(), Some(on_stats), ud)
    });
    let prompt: Vec<i32> = (0..70).collect();
    let g = run(&s, "gpt", &prompt, &max_tokens(2));
    assert_eq!(g.tokens().len(), 2);
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty());
    for v in seen.iter() {
        assert_eq!(v["tokens_per_block"], 64, "{v}");
        assert_eq!(v["kv_blocks_max"], 64, "{v}");
    }
    // 70 prompt positions fill two blocks of 64.
    assert_eq!(seen[0]["kv_blocks_used"], 2, "{}", seen[0]);
}

#[test]
fn iteration_statistics_callback_statistics_json_and_prometheus() {
    let s = server_with("gpt", &config(&[]));
    let seen: Box<Mutex<Vec<Value>>> = Box::default();
    let ud = &*seen as *const _ as *mut c_void;
    ok(unsafe {
        infer_server_set_iteration_stats_callback(s.0, cs("gpt").as_ptr(), Some(on_stats), ud)
    });
    let g = run(&s, "gpt", &[1, 2, 3, 4, 5], &max_tokens(6));
    assert_eq!(g.tokens().len(), 6);
    ok(unsafe {
        infer_server_set_iteration_stats_callback(
            s.0,
            cs("gpt").as_ptr(),
            None,
            std::ptr::null_mut(),
        )
    });
    run(&s, "gpt", &[1], &max_tokens(3));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 6, "one per iteration while set: {seen:?}");
    assert_eq!(seen[0]["context_tokens"], 5);
    assert_eq!(seen[0]["context_requests"], 1);
    assert_eq!(seen[1]["generation_requests"], 1);
    for v in seen.iter() {
        for k in [
            "timestamp_us",
            "iteration",
            "active_requests",
            "max_requests",
            "kv_blocks_max",
            "kv_blocks_used",
            "kv_blocks_free",
            "tokens_per_block",
            "paused_requests",
        ] {
            assert!(v.get(k).is_some(), "{k} missing: {v}");
        }
        assert_eq!(v["max_requests"], 16);
        assert_eq!(v["tokens_per_block"], 16);
    }
    let m = &s.stats("gpt")["models"][0];
    assert_eq!(m["success_count"], 2);
    assert_eq!(m["generation"]["generated_tokens"], 9);
    assert!(m["generation"]["time_to_first_token_us"]["count"].as_u64() == Some(2));
    let mut text = std::ptr::null_mut();
    ok(unsafe { infer_server_metrics_prometheus(s.0, &mut text) });
    let prom = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
    unsafe { infer_string_free(text) };
    assert!(
        prom.contains("infer_generation_tokens_total{model=\"gpt\",version=\"1\"} 9"),
        "{prom}"
    );
    assert!(
        prom.contains("infer_kv_cache_blocks_max{model=\"gpt\",version=\"1\"} 64"),
        "{prom}"
    );
    // Unknown and non-generative models.
    let st = unsafe {
        infer_server_set_iteration_stats_callback(s.0, cs("nope").as_ptr(), Some(on_stats), ud)
    };
    assert_eq!(st, INFER_STATUS_NOT_FOUND);
    s.load("plain", &add_sub_config("plain", ""));
    let st = unsafe {
        infer_server_set_iteration_stats_callback(s.0, cs("plain").as_ptr(), Some(on_stats), ud)
    };
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("not a generative model"));
}

// ---------------------------------------------------------------------------------------
// Load errors
// ---------------------------------------------------------------------------------------

#[test]
fn load_errors_name_what_is_wrong() {
    let s = Server::new();
    let base = config(&[]);
    let cases: Vec<(String, infer_status, &str)> = vec![
        (
            base.replace("max_batch_size: 0", "max_batch_size: 8"),
            INFER_STATUS_INVALID_ARGUMENT,
            "max_batch_size",
        ),
        (
            base.replace("KIND_CPU", "KIND_GPU"),
            INFER_STATUS_UNSUPPORTED,
            "KIND_GPU",
        ),
        (
            config(&[("batch_scheduler_policy", "fastest")]),
            INFER_STATUS_INVALID_ARGUMENT,
            "batch_scheduler_policy",
        ),
        (
            config(&[("kv_cache_blocks", "many")]),
            INFER_STATUS_INVALID_ARGUMENT,
            "kv_cache_blocks",
        ),
        (
            config(&[("max_num_sequences", "32"), ("max_num_tokens", "16")]),
            INFER_STATUS_INVALID_ARGUMENT,
            "max_num_tokens",
        ),
        (
            base.replace("output_log_probs", "scores"),
            INFER_STATUS_INVALID_ARGUMENT,
            "'scores'",
        ),
        (
            base.replace(
                "TYPE_INT32 dims: [ -1 ] }\n]",
                "TYPE_FP32 dims: [ -1 ] }\n]",
            ),
            INFER_STATUS_INVALID_ARGUMENT,
            "input 'input_ids'",
        ),
        (
            base.replace("version_policy", "")
                + "\nversion_policy { specific { versions: [ 2 ] } }",
            INFER_STATUS_NOT_FOUND,
            "2",
        ),
    ];
    for (text, want, what) in cases {
        let st = try_load_dir(&s, "bad", &text);
        let msg = last_error();
        assert_eq!(st, want, "{what}: {msg}");
        assert!(msg.contains(what) && msg.contains("bad"), "{what}: {msg}");
    }
    // A config without tensors gets input_ids / output_ids (INT32).
    let minimal = "name: \"mini\" backend: \"gpt2\"";
    assert_eq!(
        try_load_dir(&s, "mini", minimal),
        INFER_STATUS_OK,
        "{}",
        last_error()
    );
    let g = run(&s, "mini", &[1, 2], &max_tokens(3));
    assert_eq!(g.tokens().len(), 3);
    // Without a model folder there are no weights.
    let st = s.try_load("nofolder", minimal);
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{}", last_error());
}

// ---------------------------------------------------------------------------------------
// Llama-family models (backend "llama") against the numpy reference
// ---------------------------------------------------------------------------------------

/// The models `scripts/make_llama.py` writes under `INFER_LLAMA_MODELS_DIR` (see
/// tests/llama.rs), served through the C API: a GGUF file and a Hugging Face folder, each
/// copied into a version folder `1/`, with requests running concurrently. Greedy tokens
/// must equal the reference's (float weights, F32 cache: the same arithmetic as the
/// reference up to rounding; the F16 file holds exactly the reference's values).
#[test]
fn llama_family_models_generate_the_reference_tokens() {
    let Ok(root) = std::env::var("INFER_LLAMA_MODELS_DIR") else {
        eprintln!("skipped: set INFER_LLAMA_MODELS_DIR (scripts/test.sh does)");
        return;
    };
    let root = PathBuf::from(root);
    for (model, file) in [("tiny-llama", "model-f16.gguf"), ("small-qwen2", "hf")] {
        let reference: Value = serde_json::from_str(
            &std::fs::read_to_string(root.join(model).join("ref-hf.json")).unwrap(),
        )
        .unwrap();
        let dir = temp_dir(&format!("llama-{model}"));
        let version = dir.join("1");
        std::fs::create_dir_all(&version).unwrap();
        let src = root.join(model).join(file);
        if src.is_dir() {
            for f in ["config.json", "model.safetensors"] {
                std::fs::copy(src.join(f), version.join(f)).unwrap();
            }
        } else {
            std::fs::copy(&src, version.join(file)).unwrap();
        }
        let config = r#"backend: "llama"
max_batch_size: 0
model_transaction_policy { decoupled: true }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "kv_cache_type" value { string_value: "f32" } }
parameters { key: "intra_op_thread_count" value { string_value: "2" } }
parameters { key: "max_num_sequences" value { string_value: "4" } }"#;
        let s = Server::new();
        let d = cs(dir.to_str().unwrap());
        let st = unsafe {
            infer_server_load_model(s.0, cs("lm").as_ptr(), cs(config).as_ptr(), d.as_ptr())
        };
        assert_eq!(st, INFER_STATUS_OK, "{model}/{file}: {}", last_error());
        let prompt = ints(&reference["prompt"]);
        let want = ints(&reference["greedy"]);
        // The reference does not stop at the model's end-of-sequence tokens.
        let p = Params {
            streaming: true,
            bools: vec![("ignore_eos", true)],
            ..max_tokens(want.len() as i64)
        };
        let pending: Vec<Pending> = (0..3).map(|_| enqueue(&s, "lm", &prompt, &p)).collect();
        for (i, r) in pending.iter().enumerate() {
            let g = r.wait();
            assert_eq!(g.status, Some(INFER_STATUS_OK), "{model}: {}", g.message);
            assert_eq!(g.tokens(), want, "{model}/{file}: request {i}");
            assert_eq!(g.chunks.len(), want.len());
        }
        // A token outside the vocabulary is refused with the model's limit named.
        let vocab = reference["logits_last"].as_array().unwrap().len() as i32;
        let Err((st, msg)) = try_enqueue(&s, "lm", &[vocab], &max_tokens(1)) else {
            panic!("{model}: token {vocab} was accepted");
        };
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        assert!(msg.contains("vocabulary"), "{msg}");
        drop(s);
        // The same GGUF file with bytes after its last tensor (what a tensor whose type
        // or shape was changed to a smaller one leaves) is refused, naming the tensor.
        if !src.is_dir() {
            let f = version.join(file);
            let mut bytes = std::fs::read(&f).unwrap();
            bytes.extend([0u8; 64]);
            std::fs::write(&f, bytes).unwrap();
            let s = Server::new();
            let st = unsafe {
                infer_server_load_model(s.0, cs("lm").as_ptr(), cs(config).as_ptr(), d.as_ptr())
            };
            let msg = last_error();
            assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{model}/{file}: {msg}");
            assert!(msg.contains("64 bytes follow the last tensor"), "{msg}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Text in and out of a Llama-family model whose folder holds a tokenizer (a Hugging
/// Face folder with `tokenizer.json` and a chat template; a GGUF file with its
/// vocabulary), loaded from `backend: "llama"` alone: the config gains `text_input` and
/// `text_output`; text prompts give the tokens the tokenizer's ids give; streamed text
/// pieces add up to the whole text; stop strings, the chat template, the model's
/// end-of-sequence tokens, min-p, penalties and logit bias act as documented.
#[test]
fn llama_family_text_in_and_out() {
    use infer::llm::{TextCodec, TextSource};
    let Ok(root) = std::env::var("INFER_LLAMA_MODELS_DIR") else {
        eprintln!("skipped: set INFER_LLAMA_MODELS_DIR (scripts/test.sh does)");
        return;
    };
    let root = PathBuf::from(root);
    for (model, file, turn_end) in [
        ("small-qwen2", "hf", "<|im_end|>"),
        ("tiny-llama", "model-q8_0.gguf", "<|eot_id|>"),
        // SentencePiece: spaces as "▁", byte fallback, a leading space stripped.
        ("tiny-llama2", "model-q8_0.gguf", "</s>"),
    ] {
        let cases: Value = serde_json::from_str(
            &std::fs::read_to_string(root.join(model).join("text-cases.json")).unwrap(),
        )
        .unwrap();
        let dir = temp_dir(&format!("llama-text-{model}"));
        let version = dir.join("1");
        std::fs::create_dir_all(&version).unwrap();
        let src = root.join(model).join(file);
        if src.is_dir() {
            for e in std::fs::read_dir(&src).unwrap().flatten() {
                std::fs::copy(e.path(), version.join(e.file_name())).unwrap();
            }
        } else {
            std::fs::copy(&src, version.join(file)).unwrap();
        }
        let codec =
            match TextCodec::load(&infer::folder::Folder::root(&version, false, "v").unwrap())
                .unwrap()
            {
                TextSource::Ready(c) => c,
                TextSource::Missing(why) => panic!("{model}: {why}"),
            };
        let config = r#"backend: "llama"
parameters { key: "intra_op_thread_count" value { string_value: "2" } }
parameters { key: "max_num_sequences" value { string_value: "8" } }"#;
        let s = Server::new();
        let d = cs(dir.to_str().unwrap());
        let st = unsafe {
            infer_server_load_model(s.0, cs("lm").as_ptr(), cs(config).as_ptr(), d.as_ptr())
        };
        assert_eq!(st, INFER_STATUS_OK, "{model}: {}", last_error());
        let at = |what: &str| format!("{model}: {what}");
        let greedy = |n: i64| Params {
            bools: vec![("ignore_eos", true)],
            ..max_tokens(n)
        };
        // Text prompts against the tokenizer's ids.
        let mut full = None;
        for case in cases["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let ids = ints(&case["ids"]);
            if text.is_empty() {
                continue;
            }
            let by_ids = run(&s, "lm", &ids, &greedy(16));
            let by_text = run(
                &s,
                "lm",
                &[],
                &Params {
                    text: Some(text.into()),
                    ..greedy(16)
                },
            );
            assert_eq!(by_text.status, Some(INFER_STATUS_OK), "{}", by_text.message);
            assert_eq!(by_text.prompt_tokens, ids.len() as i64, "{}", at(text));
            assert_eq!(by_text.tokens(), by_ids.tokens(), "{}", at(text));
            let tokens: Vec<u32> = by_text.tokens().iter().map(|&t| t as u32).collect();
            // Decoded as it streams; where the tokens are not valid UTF-8 (random weights
            // make such byte tokens), a one-shot decode may replace other bytes.
            let whole = codec.decode(&tokens, true);
            if !whole.contains('\u{FFFD}') {
                assert_eq!(by_text.text, vec![whole], "{}", at(text));
            }
            assert_eq!(by_ids.text, by_text.text, "{}", at(text));
            // Streamed: one piece per token at most, adding up to the same text.
            let streamed = run(
                &s,
                "lm",
                &[],
                &Params {
                    text: Some(text.into()),
                    streaming: true,
                    ..greedy(16)
                },
            );
            assert_eq!(streamed.text.concat(), by_text.text[0], "{}", at(text));
            assert_eq!(streamed.tokens(), by_text.tokens());
            if full.is_none() && by_text.text[0].chars().count() >= 6 {
                full = Some((text.to_owned(), by_text.clone()));
            }
        }
        // A stop string from the middle of a generated text: the text ends before it.
        let (prompt_text, whole) = full.expect("a generated text of at least 6 characters");
        let whole_text = &whole.text[0];
        let cut = whole_text.char_indices().nth(3).unwrap().0;
        let stop: String = whole_text[cut..].chars().take(2).collect();
        let at_stop = whole_text.find(&stop).unwrap();
        for streaming in [false, true] {
            let g = run(
                &s,
                "lm",
                &[],
                &Params {
                    text: Some(prompt_text.clone()),
                    streaming,
                    strings: vec![("stop", serde_json::json!([stop, "never seen"]).to_string())],
                    ..greedy(16)
                },
            );
            assert_eq!(g.status, Some(INFER_STATUS_OK), "{}", g.message);
            assert_eq!(g.reason, "stop", "{}", at("stop"));
            assert_eq!(g.text.concat(), whole_text[..at_stop], "{}", at("stop"));
            let n = g.tokens().len();
            assert!(n < whole.tokens().len());
            assert_eq!(g.tokens()[..], whole.tokens()[..n]);
        }
        // The chat template: a JSON list of messages.
        let chat = &cases["chat"];
        let g = run(
            &s,
            "lm",
            &[],
            &Params {
                text: Some(chat["messages"].to_string()),
                bools: vec![("apply_chat_template", true), ("ignore_eos", true)],
                ..max_tokens(4)
            },
        );
        assert_eq!(g.status, Some(INFER_STATUS_OK), "{}", g.message);
        assert_eq!(
            g.prompt_tokens,
            chat["ids"].as_array().unwrap().len() as i64
        );
        assert_eq!(
            g.tokens(),
            run(&s, "lm", &ints(&chat["ids"]), &greedy(4)).tokens()
        );
        // The end-of-turn token ends generation by default (forced here by a bias), and
        // is generated like any other with ignore_eos.
        let turn_end = codec.encode(turn_end, false).unwrap()[0];
        let bias = format!("{{\"{turn_end}\": 100}}");
        let g = run(
            &s,
            "lm",
            &[3, 4, 5],
            &Params {
                strings: vec![("logit_bias", bias.clone())],
                ..max_tokens(4)
            },
        );
        assert_eq!(
            (g.reason.as_str(), g.tokens().len()),
            ("end_id", 0),
            "{}",
            at("eos")
        );
        let g = run(
            &s,
            "lm",
            &[3, 4, 5],
            &Params {
                strings: vec![("logit_bias", bias)],
                ..greedy(2)
            },
        );
        assert_eq!(g.tokens(), vec![turn_end as i32; 2], "{}", at("ignore_eos"));
        // min_p 1 keeps only the most likely token: sampling becomes greedy.
        let g = run(
            &s,
            "lm",
            &[3, 4, 5],
            &Params {
                temperature: Some(1.0),
                seed: Some(7),
                floats: vec![("min_p", 1.0)],
                ..greedy(8)
            },
        );
        assert_eq!(g.tokens(), run(&s, "lm", &[3, 4, 5], &greedy(8)).tokens());
        // A strong repetition penalty: no token of the prompt or the output comes again.
        let prompt = [3, 4, 5, 6, 7];
        let g = run(
            &s,
            "lm",
            &prompt,
            &Params {
                floats: vec![("repetition_penalty", 1000.0)],
                ..greedy(12)
            },
        );
        let mut seen: Vec<i32> = prompt.to_vec();
        for t in g.tokens() {
            assert!(
                !seen.contains(&t),
                "{}: {t} repeated in {:?}",
                at("penalty"),
                g.tokens()
            );
            seen.push(t);
        }
        // Refusals name what is wrong.
        for (p, want) in [
            (
                Params {
                    text: Some("hi".into()),
                    bools: vec![("apply_chat_template", true)],
                    strings: vec![("logit_bias", "[1]".into())],
                    ..max_tokens(1)
                },
                "logit_bias",
            ),
            (
                Params {
                    floats: vec![("min_p", 1.5)],
                    ..max_tokens(1)
                },
                "min_p",
            ),
            (
                Params {
                    floats: vec![("presence_penalty", 3.0)],
                    ..max_tokens(1)
                },
                "presence_penalty",
            ),
            (
                Params {
                    bools: vec![("apply_chat_template", true)],
                    ..max_tokens(1)
                },
                "apply_chat_template",
            ),
        ] {
            let Err((st, msg)) = try_enqueue(&s, "lm", &[3], &p) else {
                panic!("{}: accepted", at(want));
            };
            assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
            assert!(msg.contains(want), "{want}: {msg}");
        }
        let r = s.request("lm").input_i32("input_ids", &[1], &[3]);
        let mut b = 2u32.to_le_bytes().to_vec();
        b.extend_from_slice(&[0xff, 0xfe]);
        ok(r.try_input("text_input", INFER_DATATYPE_BYTES, &[1], &b));
        let c = Collector::new();
        let Err((st, msg)) = s.enqueue(r, &c) else {
            panic!("both inputs accepted")
        };
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        assert!(msg.contains("not both"), "{msg}");
        let r = s.request("lm");
        ok(r.try_input("text_input", INFER_DATATYPE_BYTES, &[1], &b));
        let Err((st, msg)) = s.enqueue(r, &c) else {
            panic!("invalid UTF-8 accepted")
        };
        assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
        assert!(msg.contains("UTF-8"), "{msg}");
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A model folder without a tokenizer serves token ids only: its completed config has no
/// text tensors, a config that declares them is refused at load naming the tensor, and
/// text-only parameters are refused per request.
#[test]
fn text_needs_a_tokenizer() {
    let s = Server::new();
    let d = cs(model_dir().to_str().unwrap());
    let bare = "backend: \"gpt2\"\nparameters { key: \"intra_op_thread_count\" value { string_value: \"1\" } }";
    let st =
        unsafe { infer_server_load_model(s.0, cs("ids").as_ptr(), cs(bare).as_ptr(), d.as_ptr()) };
    assert_eq!(st, INFER_STATUS_OK, "{}", last_error());
    let Err((st, msg)) = try_enqueue(
        &s,
        "ids",
        &[1, 2],
        &Params {
            strings: vec![("stop", "x".into())],
            ..max_tokens(2)
        },
    ) else {
        panic!("stop strings accepted without a tokenizer");
    };
    assert_eq!(st, INFER_STATUS_UNSUPPORTED, "{msg}");
    assert!(msg.contains("tokenizer"), "{msg}");
    let g = run(&s, "ids", &[1, 2], &max_tokens(3));
    assert_eq!((g.status, g.tokens().len()), (Some(INFER_STATUS_OK), 3));
    let with_text = format!(
        "{}\ninput [ {{ name: \"input_ids\" data_type: TYPE_INT32 dims: [ -1 ] optional: true }},\n  {{ name: \"text_input\" data_type: TYPE_STRING dims: [ 1 ] optional: true }} ]\noutput [ {{ name: \"output_ids\" data_type: TYPE_INT32 dims: [ -1 ] }} ]",
        bare
    );
    let st = unsafe {
        infer_server_load_model(
            s.0,
            cs("text").as_ptr(),
            cs(&with_text).as_ptr(),
            d.as_ptr(),
        )
    };
    let msg = last_error();
    assert_eq!(st, INFER_STATUS_UNSUPPORTED, "{msg}");
    assert!(
        msg.contains("text_input") && msg.contains("tokenizer"),
        "{msg}"
    );
    // Both inputs declared, one of them required: refused, as no request could send one.
    let required = with_text.replacen(" optional: true", "", 1);
    let st = unsafe {
        infer_server_load_model(s.0, cs("both").as_ptr(), cs(&required).as_ptr(), d.as_ptr())
    };
    let msg = last_error();
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("optional"), "{msg}");
}
