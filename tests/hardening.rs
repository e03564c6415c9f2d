//! Hardening: what a careless or hostile caller or config can do must end in a clear
//! error, never in a file read from outside the repository, an abort or a hang.

mod common;
use common::*;
use infer::backend::Batch;
use infer::ffi::server::*;
use infer::ffi::*;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A server on `repo` (explicit model control: nothing loads at start) or the error of
/// its creation (with every model loaded at start when `explicit` is false).
fn server_on(repo: &Path, explicit: bool, trusted: bool) -> Result<Server, (infer_status, String)> {
    let mut opts = std::ptr::null_mut();
    ok(unsafe { infer_server_options_new(&mut opts) });
    ok(unsafe {
        infer_server_options_set_model_repository(opts, cs(repo.to_str().unwrap()).as_ptr())
    });
    ok(unsafe { infer_server_options_set_model_control_explicit(opts, explicit) });
    ok(unsafe { infer_server_options_set_trusted_repository(opts, trusted) });
    let mut s = std::ptr::null_mut();
    let st = unsafe { infer_server_new(opts, &mut s) };
    unsafe { infer_server_options_free(opts) };
    if st != INFER_STATUS_OK {
        return Err((st, last_error()));
    }
    Ok(Server(s))
}

/// Loads `name` from the repository (no config text, no folder).
fn load_from_repo(s: &Server, name: &str) -> infer_status {
    unsafe { infer_server_load_model(s.0, cs(name).as_ptr(), std::ptr::null(), std::ptr::null()) }
}

/// The ONNX add_sub model's config without its name (the folder names the model).
fn add_sub_onnx_config() -> String {
    std::fs::read_to_string(root().join("models/add_sub/config.pbtxt"))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("name:"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `<tmp>/repo/add_sub` (the ONNX add_sub model), `<tmp>/outside/add_sub` (the same,
/// outside the repository) and `<tmp>/secret.txt`.
fn layout(tag: &str) -> PathBuf {
    let t = temp_dir(tag);
    for at in ["repo/add_sub/1", "outside/add_sub/1"] {
        std::fs::create_dir_all(t.join(at)).unwrap();
        std::fs::copy(
            root().join("models/add_sub/1/model.onnx"),
            t.join(at).join("model.onnx"),
        )
        .unwrap();
        let cfg = t.join(at).parent().unwrap().join("config.pbtxt");
        std::fs::write(cfg, add_sub_onnx_config()).unwrap();
    }
    std::fs::write(t.join("secret.txt"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    t
}

#[test]
fn model_names_cannot_leave_the_repository() {
    let t = layout("names");
    let s = server_on(&t.join("repo"), true, false).unwrap();
    ok(load_from_repo(&s, "add_sub"));
    let outside = t.join("outside/add_sub");
    for name in [
        "../outside/add_sub",
        "..",
        ".",
        "add_sub/1",
        outside.to_str().unwrap(),
    ] {
        let msg = expect_status(load_from_repo(&s, name), INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains("not a folder name"), "{name}: {msg}");
    }
    // At start-up too.
    for name in ["../outside/add_sub", outside.to_str().unwrap()] {
        let mut opts = std::ptr::null_mut();
        ok(unsafe { infer_server_options_new(&mut opts) });
        let repo = cs(t.join("repo").to_str().unwrap());
        ok(unsafe { infer_server_options_set_model_repository(opts, repo.as_ptr()) });
        ok(unsafe { infer_server_options_set_model_control_explicit(opts, true) });
        ok(unsafe { infer_server_options_add_startup_model(opts, cs(name).as_ptr()) });
        let mut p = std::ptr::null_mut();
        let st = unsafe { infer_server_new(opts, &mut p) };
        unsafe { infer_server_options_free(opts) };
        let msg = expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains("not a folder name"), "{name}: {msg}");
    }
    let _ = std::fs::remove_dir_all(&t);
}

#[test]
fn model_names_have_a_length_limit() {
    let s = Server::new();
    let long = "m".repeat(1 << 20);
    let msg = expect_status(
        s.try_load(&long, &add_sub_config(&long, "")),
        INFER_STATUS_INVALID_ARGUMENT,
    );
    assert!(msg.contains("longer than the limit of 255"), "{msg}");
    let ok_name = "m".repeat(255);
    ok(s.try_load(&ok_name, &add_sub_config(&ok_name, "")));
}

#[test]
fn links_out_of_the_repository_are_refused_unless_it_is_trusted() {
    let t = layout("links");
    let repo = t.join("repo");
    // A model folder, a version folder, a model file and a config that lead out.
    symlink(t.join("outside/add_sub"), repo.join("linked_folder")).unwrap();
    std::fs::create_dir_all(repo.join("linked_version")).unwrap();
    std::fs::write(
        repo.join("linked_version/config.pbtxt"),
        add_sub_onnx_config(),
    )
    .unwrap();
    symlink(t.join("outside/add_sub/1"), repo.join("linked_version/1")).unwrap();
    std::fs::create_dir_all(repo.join("linked_file/1")).unwrap();
    std::fs::write(repo.join("linked_file/config.pbtxt"), add_sub_onnx_config()).unwrap();
    symlink(
        t.join("outside/add_sub/1/model.onnx"),
        repo.join("linked_file/1/model.onnx"),
    )
    .unwrap();
    std::fs::create_dir_all(repo.join("linked_config/1")).unwrap();
    std::fs::copy(
        root().join("models/add_sub/1/model.onnx"),
        repo.join("linked_config/1/model.onnx"),
    )
    .unwrap();
    symlink(
        t.join("outside/add_sub/config.pbtxt"),
        repo.join("linked_config/config.pbtxt"),
    )
    .unwrap();
    // A link inside the repository is fine.
    symlink(repo.join("add_sub"), repo.join("alias")).unwrap();

    let s = server_on(&repo, true, false).unwrap();
    for name in [
        "linked_folder",
        "linked_version",
        "linked_file",
        "linked_config",
    ] {
        let msg = expect_status(load_from_repo(&s, name), INFER_STATUS_INVALID_ARGUMENT);
        assert!(
            msg.contains("outside") && msg.contains(name),
            "{name}: {msg}"
        );
    }
    ok(load_from_repo(&s, "alias"));
    // Every model at start-up: the first link out fails the start.
    let (st, msg) = match server_on(&repo, false, false) {
        Ok(_) => panic!("the server started with links out of its repository"),
        Err(e) => e,
    };
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("outside"), "{msg}");
    // A trusted repository follows them.
    let s = server_on(&repo, false, true).unwrap();
    for name in [
        "linked_folder",
        "linked_version",
        "linked_file",
        "linked_config",
    ] {
        let r = s.infer(add_sub_onnx_request(&s, name));
        assert_eq!(r.status(), 0, "{name}: {}", r.error());
    }
    let _ = std::fs::remove_dir_all(&t);
}

/// A request of add_sub (FP32 [1,16] twice).
fn add_sub_onnx_request(s: &Server, model: &str) -> Req {
    s.request(model)
        .input_f32("INPUT0", &[1, 16], &[1.0; 16])
        .input_f32("INPUT1", &[1, 16], &[2.0; 16])
}

#[test]
fn default_model_filename_stays_in_the_version_folder() {
    let t = layout("filename");
    let s = server_on(&t.join("repo"), true, false).unwrap();
    let secret = t.join("secret.txt");
    for file in ["../../../secret.txt", secret.to_str().unwrap()] {
        let cfg = add_sub_onnx_config() + &format!("default_model_filename: \"{file}\"\n");
        let dir = cs(t.join("repo/add_sub").to_str().unwrap());
        let st = unsafe {
            infer_server_load_model(s.0, cs("add_sub").as_ptr(), cs(&cfg).as_ptr(), dir.as_ptr())
        };
        let msg = expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains("default_model_filename"), "{file}: {msg}");
        assert!(!msg.contains("root:x"), "{msg}");
    }
    let _ = std::fs::remove_dir_all(&t);
}

#[test]
fn special_files_are_refused_without_hanging() {
    let t = layout("fifo");
    let dir = t.join("repo/acc");
    std::fs::create_dir_all(dir.join("initial_state")).unwrap();
    let fifo = cs(dir.join("initial_state/init.bin").to_str().unwrap());
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let cfg = r#"
name: "acc" backend: "accumulator" max_batch_size: 1
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  direct { }
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state: { data_type: TYPE_INT32 dims: [ 1 ] data_file: "init.bin" name: "f" } } ]
}
"#;
    let (tx, rx) = std::sync::mpsc::channel();
    let d = dir.clone();
    std::thread::spawn(move || {
        let s = Server::new();
        let st = s.try_load_dir("acc", cfg, &d);
        let _ = tx.send((st, last_error()));
    });
    let (st, msg) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("loading a FIFO as initial state hangs");
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("FIFO"), "{msg}");
    // A model file that is a FIFO too.
    std::fs::remove_file(t.join("repo/add_sub/1/model.onnx")).unwrap();
    let model = cs(t.join("repo/add_sub/1/model.onnx").to_str().unwrap());
    assert_eq!(unsafe { libc::mkfifo(model.as_ptr(), 0o600) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let repo = t.join("repo");
    std::thread::spawn(move || {
        let s = server_on(&repo, true, false).unwrap();
        let st = load_from_repo(&s, "add_sub");
        let _ = tx.send((st, last_error()));
    });
    let (st, msg) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("loading a FIFO as model file hangs");
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("FIFO"), "{msg}");
    let _ = std::fs::remove_dir_all(&t);
}

#[test]
fn generative_files_stay_in_the_repository() {
    let t = temp_dir("gpt2links");
    let repo = t.join("repo");
    std::fs::create_dir_all(repo.join("g/1")).unwrap();
    std::fs::copy(
        root().join("models/tiny_gpt2/config.pbtxt"),
        repo.join("g/config.pbtxt"),
    )
    .unwrap();
    std::fs::write(
        repo.join("g/config.pbtxt"),
        std::fs::read_to_string(repo.join("g/config.pbtxt"))
            .unwrap()
            .replace("name: \"tiny_gpt2\"", "name: \"g\""),
    )
    .unwrap();
    symlink(
        root().join("models/tiny_gpt2/1/config.json"),
        repo.join("g/1/config.json"),
    )
    .unwrap();
    symlink(
        root().join("models/tiny_gpt2/1/model.safetensors"),
        repo.join("g/1/model.safetensors"),
    )
    .unwrap();
    let s = server_on(&repo, true, false).unwrap();
    let msg = expect_status(load_from_repo(&s, "g"), INFER_STATUS_INVALID_ARGUMENT);
    assert!(
        msg.contains("config.json") && msg.contains("outside"),
        "{msg}"
    );
    let s = server_on(&repo, true, true).unwrap();
    ok(load_from_repo(&s, "g"));
    let _ = std::fs::remove_dir_all(&t);
}

/// Registers a custom C backend that has only `execute`.
fn register(
    s: &Server,
    name: &std::ffi::CStr,
    execute: unsafe extern "C" fn(*mut std::ffi::c_void, *mut Batch) -> u32,
) {
    let vt = infer::ffi::custom::infer_backend {
        struct_size: std::mem::size_of::<infer::ffi::custom::infer_backend>() as u32,
        instance_init: None,
        execute: Some(execute),
        instance_fini: None,
        finalize: None,
    };
    ok(unsafe { infer_server_register_backend(s.0, name.as_ptr(), &vt, std::ptr::null_mut()) });
}

/// What `greedy_execute` saw: (what it asked for, status, message).
static GREEDY: std::sync::Mutex<Vec<(&'static str, infer_status, String)>> =
    std::sync::Mutex::new(Vec::new());

/// Asks for outputs no host can give or the config does not allow, then a valid one.
unsafe extern "C" fn greedy_execute(_state: *mut std::ffi::c_void, b: *mut Batch) -> u32 {
    use infer::ffi::backend::infer_batch_output;
    let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
    let asks: [(&'static str, Vec<i64>, usize); 4] = [
        ("12 TiB", vec![1, 1 << 40, 3], 3),
        ("2^40 dims", vec![1, 2, 3], 1 << 40),
        ("wrong rank", vec![1, 2, 3, 4], 4),
        ("wrong dim", vec![1, 2, 4], 3),
    ];
    for (what, shape, ndim) in asks {
        let st = unsafe { infer_batch_output(b, c"OUT".as_ptr(), shape.as_ptr(), ndim, &mut out) };
        GREEDY.lock().unwrap().push((what, st, last_error()));
    }
    let shape = [1i64, 2, 3];
    unsafe { infer_batch_output(b, c"OUT".as_ptr(), shape.as_ptr(), 3, &mut out) }
}

#[test]
fn impossible_outputs_fail_the_call_not_the_process() {
    let s = Server::new();
    register(&s, c"greedy", greedy_execute);
    s.load(
        "greedy",
        r#"name: "greedy" backend: "greedy" max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]"#,
    );
    let r = s.infer(s.request("greedy").input_f32("IN", &[1, 1], &[1.0]));
    assert_eq!(r.status(), 0, "{}", r.error());
    let seen = GREEDY.lock().unwrap().clone();
    let want = [
        ("12 TiB", INFER_STATUS_RESOURCE_EXHAUSTED, "cannot allocate"),
        (
            "2^40 dims",
            INFER_STATUS_INVALID_ARGUMENT,
            "the most a tensor may have is 64",
        ),
        (
            "wrong rank",
            INFER_STATUS_INVALID_ARGUMENT,
            "does not match the config's dims",
        ),
        (
            "wrong dim",
            INFER_STATUS_INVALID_ARGUMENT,
            "does not match the config's dims",
        ),
    ];
    assert_eq!(seen.len(), want.len(), "{seen:?}");
    for ((what, st, msg), (w, code, text)) in seen.iter().zip(want) {
        assert_eq!(*what, w);
        assert_eq!(*st, code, "{what}: {msg}");
        assert!(msg.contains(text), "{what}: {msg}");
    }
}

#[test]
fn config_numbers_that_would_exhaust_the_host_are_refused() {
    let s = Server::new();
    let base = |extra: &str, mbs: i64| {
        format!(
            r#"name: "big" backend: "identity" max_batch_size: {mbs}
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
{extra}"#
        )
    };
    let cases = [
        (base("", 2_147_483_647), "max_batch_size"),
        (
            base("dynamic_batching { priority_levels: 4000000000 }", 4),
            "priority_levels",
        ),
        (base("instance_group [ { count: 100000 kind: KIND_CPU } ]", 4), "instance_group"),
        (
            base(
                "instance_group [ { count: 200 kind: KIND_CPU }, { count: 100 kind: KIND_CPU } ]",
                4,
            ),
            "instance_group",
        ),
        (
            base(
                "sequence_batching { oldest { max_candidate_sequences: 1000000000 } }",
                4,
            ),
            "max_candidate_sequences",
        ),
        (
            r#"name: "big" backend: "accumulator" max_batch_size: 1
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { direct { }
  state [ { input_name: "S" output_name: "S_OUT" data_type: TYPE_INT32 dims: [ 100000, 100000 ] } ] }"#
                .to_owned(),
            "larger than the limit",
        ),
    ];
    for (cfg, field) in cases {
        let msg = expect_status(s.try_load("big", &cfg), INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains(field), "{field}: {msg}");
    }
    let gpt2 = std::fs::read_to_string(root().join("models/tiny_gpt2/config.pbtxt")).unwrap();
    for (key, value) in [
        ("intra_op_thread_count", "100000"),
        ("max_num_sequences", "100000000"),
        ("tokens_per_block", "100000000"),
    ] {
        let cfg = gpt2
            .lines()
            .filter(|l| !l.contains(&format!("\"{key}\"")))
            .collect::<Vec<_>>()
            .join("\n")
            + &format!("\nparameters {{ key: \"{key}\" value {{ string_value: \"{value}\" }} }}\n");
        let dir = cs(root().join("models/tiny_gpt2").to_str().unwrap());
        let st = unsafe {
            infer_server_load_model(
                s.0,
                cs("tiny_gpt2").as_ptr(),
                cs(&cfg).as_ptr(),
                dir.as_ptr(),
            )
        };
        let msg = expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains(key) && msg.contains("at most"), "{key}: {msg}");
    }
}

#[test]
fn queue_timeouts_fire_while_every_instance_is_busy() {
    let s = Server::new();
    s.load(
        "slow",
        &add_sub_config(
            "slow",
            r#"instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { default_timeout_microseconds: 100000 } }
parameters { key: "execute_delay_us" value { string_value: "2000000" } }"#,
        ),
    );
    let busy = Collector::new();
    s.enqueue(add_sub_request(&s, "slow", [1.; 4], [1.; 4]), &busy)
        .unwrap();
    // Let the worker take the first request into its 2 s batch.
    std::thread::sleep(Duration::from_millis(100));
    let waiting = Collector::new();
    let start = std::time::Instant::now();
    s.enqueue(add_sub_request(&s, "slow", [2.; 4], [2.; 4]), &waiting)
        .unwrap();
    assert!(
        waiting.wait_for(1, Duration::from_millis(1500)),
        "a 100 ms queue timeout did not fire while the instance was busy"
    );
    let took = start.elapsed();
    let r = waiting.take().remove(0);
    assert_eq!(r.status(), INFER_STATUS_DEADLINE_EXCEEDED, "{}", r.error());
    assert!(
        r.error().contains("timed out in the queue"),
        "{}",
        r.error()
    );
    assert!(took < Duration::from_millis(1500), "{took:?}");
    busy.wait(1);
    assert_eq!(busy.take().remove(0).status(), 0);
}

#[test]
fn backlogged_sequences_time_out_while_every_slot_is_busy() {
    let s = Server::new();
    s.load(
        "seq",
        r#"name: "seq" backend: "accumulator" max_batch_size: 1
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
parameters { key: "execute_delay_us" value { string_value: "2000000" } }"#,
    );
    let seq_req = |corr: u64| {
        s.request("seq")
            .input_i32("INPUT", &[1, 1], &[1])
            .correlation_id(corr)
            .flags(INFER_REQUEST_FLAG_SEQUENCE_START)
    };
    let busy = Collector::new();
    s.enqueue(seq_req(1), &busy).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let waiting = Collector::new();
    let start = std::time::Instant::now();
    s.enqueue(seq_req(2).timeout_us(100_000), &waiting).unwrap();
    assert!(
        waiting.wait_for(1, Duration::from_millis(1500)),
        "a backlogged sequence's 100 ms timeout did not fire while the slot was busy"
    );
    let r = waiting.take().remove(0);
    assert_eq!(r.status(), INFER_STATUS_DEADLINE_EXCEEDED, "{}", r.error());
    assert!(start.elapsed() < Duration::from_millis(1500));
    busy.wait(1);
}

#[test]
fn requests_belong_to_the_server_that_made_them() {
    let a = Server::new();
    let b = Server::new();
    a.load("m", &add_sub_config("m", ""));
    b.load("m", &add_sub_config("m", ""));
    let c = Collector::new();
    let (st, msg) = b
        .enqueue(add_sub_request(&a, "m", [1.; 4], [1.; 4]), &c)
        .unwrap_err();
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("another server"), "{msg}");
    // A server that lacks the model refuses it too.
    let empty = Server::new();
    let (st, msg) = empty
        .enqueue(add_sub_request(&a, "m", [1.; 4], [1.; 4]), &c)
        .unwrap_err();
    assert_eq!(st, INFER_STATUS_INVALID_ARGUMENT, "{msg}");
    // Its own server runs it.
    let r = a.infer(add_sub_request(&a, "m", [1.; 4], [2.; 4]));
    assert_eq!(r.status(), 0, "{}", r.error());
}

#[test]
fn versions_follow_one_rule() {
    let s = Server::new();
    s.load("m", &add_sub_config("m", ""));
    for v in [-7i64, 0, i64::MIN] {
        let mut ready = true;
        let st = unsafe { infer_server_model_ready(s.0, c"m".as_ptr(), v, &mut ready) };
        let msg = expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains("is invalid"), "{v}: {msg}");
        let mut r = std::ptr::null_mut();
        let st = unsafe { infer::ffi::request::infer_request_new(s.0, c"m".as_ptr(), v, &mut r) };
        expect_status(st, INFER_STATUS_INVALID_ARGUMENT);
    }
    let mut ready = false;
    ok(unsafe { infer_server_model_ready(s.0, c"m".as_ptr(), -1, &mut ready) });
    assert!(ready);
}

/// The server the `selfish` backend calls back into.
static SELFISH_SERVER: std::sync::atomic::AtomicPtr<ServerHandle> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());
static SELFISH_SEEN: std::sync::Mutex<Vec<(infer_status, String)>> =
    std::sync::Mutex::new(Vec::new());

/// Calls infer_server_infer for its own model from inside execute, then answers.
unsafe extern "C" fn selfish_execute(_state: *mut std::ffi::c_void, b: *mut Batch) -> u32 {
    use infer::ffi::backend::infer_batch_output;
    use infer::ffi::request::{infer_request_add_input, infer_request_new};
    let s = SELFISH_SERVER.load(std::sync::atomic::Ordering::Acquire);
    let mut r = std::ptr::null_mut();
    ok(unsafe { infer_request_new(s, c"selfish".as_ptr(), -1, &mut r) });
    let v = [1.0f32];
    let shape = [1i64, 1];
    ok(unsafe {
        infer_request_add_input(
            r,
            c"IN".as_ptr(),
            INFER_DATATYPE_FP32,
            shape.as_ptr(),
            2,
            v.as_ptr().cast(),
            4,
        )
    });
    let mut resp = std::ptr::null_mut();
    let st = unsafe { infer_server_infer(s, r, &mut resp) };
    SELFISH_SEEN.lock().unwrap().push((st, last_error()));
    let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
    unsafe { infer_batch_output(b, c"OUT".as_ptr(), shape.as_ptr(), 2, &mut out) }
}

#[test]
fn blocking_infer_from_a_models_own_execute_is_refused() {
    let s = Server::new();
    SELFISH_SERVER.store(s.0, std::sync::atomic::Ordering::Release);
    register(&s, c"selfish", selfish_execute);
    s.load(
        "selfish",
        r#"name: "selfish" backend: "selfish" max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]"#,
    );
    let c = Collector::new();
    s.enqueue(s.request("selfish").input_f32("IN", &[1, 1], &[1.0]), &c)
        .unwrap();
    assert!(
        c.wait_for(1, Duration::from_secs(10)),
        "infer_server_infer from the model's own execute hangs"
    );
    let seen = SELFISH_SEEN.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, INFER_STATUS_INVALID_ARGUMENT, "{}", seen[0].1);
    assert!(seen[0].1.contains("would wait for itself"), "{}", seen[0].1);
    assert_eq!(c.take().remove(0).status(), 0);
}

/// Two models whose response callbacks unload each other, both at once.
struct Crossed {
    server: *mut ServerHandle,
    other: std::ffi::CString,
    both_in: std::sync::Arc<std::sync::Barrier>,
    status: std::sync::atomic::AtomicU32,
    done: std::sync::mpsc::SyncSender<()>,
}

unsafe extern "C" fn unload_other(ud: *mut std::ffi::c_void, resp: *mut Response, flags: u32) {
    unsafe { infer::ffi::response::infer_response_free(resp) };
    if flags & INFER_RESPONSE_FLAG_FINAL == 0 {
        return;
    }
    let c = unsafe { &*(ud as *const Crossed) };
    c.both_in.wait();
    let st = unsafe { infer_server_unload_model(c.server, c.other.as_ptr()) };
    c.status.store(st, std::sync::atomic::Ordering::Release);
    let _ = c.done.send(());
}

#[test]
fn callbacks_that_unload_each_others_models_do_not_deadlock() {
    let s = Server::new();
    s.load("a", &add_sub_config("a", ""));
    s.load("b", &add_sub_config("b", ""));
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let (tx, rx) = std::sync::mpsc::sync_channel(2);
    let make = |other: &str| {
        Box::new(Crossed {
            server: s.0,
            other: cs(other),
            both_in: barrier.clone(),
            status: std::sync::atomic::AtomicU32::new(u32::MAX),
            done: tx.clone(),
        })
    };
    let (ca, cb) = (make("b"), make("a"));
    for (model, ud) in [("a", &ca), ("b", &cb)] {
        let r = add_sub_request(&s, model, [1.; 4], [1.; 4]);
        let mut id = 0;
        ok(unsafe {
            infer_server_enqueue(
                s.0,
                r.take(),
                Some(unload_other),
                &**ud as *const Crossed as *mut std::ffi::c_void,
                &mut id,
            )
        });
    }
    for _ in 0..2 {
        rx.recv_timeout(Duration::from_secs(10))
            .expect("two callbacks unloading each other's models deadlock");
    }
    assert_eq!(ca.status.load(std::sync::atomic::Ordering::Acquire), 0);
    assert_eq!(cb.status.load(std::sync::atomic::Ordering::Acquire), 0);
    let mut ready = true;
    ok(unsafe { infer_server_model_ready(s.0, c"a".as_ptr(), -1, &mut ready) });
    assert!(!ready);
    drop(s);
}

/// Released at the end of `shutdown_gives_up_on_a_stuck_backend`.
static UNSTUCK: (std::sync::Mutex<bool>, std::sync::Condvar) =
    (std::sync::Mutex::new(false), std::sync::Condvar::new());

/// Blocks until UNSTUCK, then answers.
unsafe extern "C" fn stuck_execute(_state: *mut std::ffi::c_void, b: *mut Batch) -> u32 {
    use infer::ffi::backend::{infer_batch_output, infer_batch_size};
    let mut go = UNSTUCK.0.lock().unwrap();
    while !*go {
        go = UNSTUCK.1.wait(go).unwrap();
    }
    drop(go);
    let shape = [unsafe { infer_batch_size(b) } as i64, 1];
    let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
    unsafe { infer_batch_output(b, c"OUT".as_ptr(), shape.as_ptr(), 2, &mut out) }
}

#[test]
fn shutdown_gives_up_on_a_stuck_backend() {
    let s = Server::new();
    register(&s, c"stuck", stuck_execute);
    s.load(
        "stuck",
        r#"name: "stuck" backend: "stuck" max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]"#,
    );
    let c = Collector::new();
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            s.enqueue(s.request("stuck").input_f32("IN", &[1, 1], &[1.0]), &c)
                .unwrap(),
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    let start = std::time::Instant::now();
    ok(unsafe { infer_server_shutdown(s.0, 100) });
    let took = start.elapsed();
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    assert!(
        c.wait_for(3, Duration::from_secs(5)),
        "not every request was answered"
    );
    for (r, _) in c.0.state.lock().unwrap().responses.iter() {
        assert_eq!(r.status(), INFER_STATUS_CANCELLED, "{}", r.error());
    }
    // The stuck call returns later: its answers are dropped, nothing is answered twice.
    *UNSTUCK.0.lock().unwrap() = true;
    UNSTUCK.1.notify_all();
    std::thread::sleep(Duration::from_millis(100));
    drop(s);
    c.assert_exactly_once(&ids);
}

#[test]
fn an_input_the_host_cannot_copy_is_resource_exhausted() {
    // The limit is set in a fresh process: this test binary run again for this test
    // alone (a fork of this process could inherit a lock another test holds).
    if std::env::var_os("INFER_HARDENING_CHILD").is_some() {
        big_input_child();
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "an_input_the_host_cannot_copy_is_resource_exhausted",
            "--test-threads=1",
        ])
        .env("INFER_HARDENING_CHILD", "1")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the child process hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let code = status.code().expect("the child process died of a signal");
    assert_ne!(code, 100, "mmap of 2 GiB failed");
    assert_eq!(
        code as u32, INFER_STATUS_RESOURCE_EXHAUSTED,
        "status {code}"
    );
}

/// In the child: a 2 GiB input (zero pages, mapped but never backed) under an
/// address-space limit that leaves room for less than its copy; exits with the status.
fn big_input_child() -> ! {
    const SIZE: usize = 2 << 30;
    // SAFETY: plain system calls and library calls; the process then exits.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            libc::_exit(100);
        }
        let s = Server::new();
        s.load(
            "big",
            r#"name: "big" backend: "identity" max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]"#,
        );
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        let pages: u64 = statm
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let limit = pages * 4096 + (1 << 30);
        let rl = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        libc::setrlimit(libc::RLIMIT_AS, &rl);
        let r = s.request("big");
        let shape = [(SIZE / 4) as i64];
        let st = infer::ffi::request::infer_request_add_input(
            r.0,
            c"IN".as_ptr(),
            INFER_DATATYPE_FP32,
            shape.as_ptr(),
            1,
            p,
            SIZE,
        );
        libc::_exit(st as i32);
    }
}
