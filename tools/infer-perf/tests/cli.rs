//! infer-perf run as a user runs it: on model repositories written here and on the
//! shipped `models/`, its table and CSV parsed, its figures compared with a closed loop
//! written by hand against the C API, and its config sweep checked on models whose best
//! config is known by construction (built-in backends with `execute_delay_us`).

use infer::ffi::request::*;
use infer::ffi::response::*;
use infer::ffi::server::*;
use infer::ffi::*;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The tests measure throughput and latency, so they run one at a time even when the
/// harness runs tests in parallel (the README's test command runs the whole workspace in
/// one `cargo test`).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn tool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_infer-perf"))
        .args(args)
        .output()
        .expect("infer-perf runs")
}

/// Runs the tool on `model` of `repo` with `extra` arguments: (status, stdout, stderr).
fn perf(repo: &Path, model: &str, extra: &[&str]) -> (Output, String, String) {
    let mut a = vec!["--model-repository", repo.to_str().unwrap(), "-m", model];
    a.extend_from_slice(extra);
    let o = tool(&a);
    let (out, err) = text(&o);
    (o, out, err)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A fresh repository folder holding `models` (name, config.pbtxt).
fn repository(tag: &str, models: &[(&str, String)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("infer-perf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (name, cfg) in models {
        std::fs::create_dir_all(dir.join(name)).unwrap();
        std::fs::write(dir.join(name).join("config.pbtxt"), cfg).unwrap();
    }
    dir
}

/// An identity model over FP32 [4] taking `delay_us` per execution.
fn identity(name: &str, max_batch_size: u32, delay_us: u32, extra: &str) -> String {
    format!(
        r#"name: "{name}"
backend: "identity"
max_batch_size: {max_batch_size}
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "execute_delay_us" value {{ string_value: "{delay_us}" }} }}
{extra}
"#
    )
}

/// The CSV as (header, rows), each row's cells by column name.
fn csv(path: &Path) -> Vec<std::collections::BTreeMap<String, String>> {
    let t = std::fs::read_to_string(path).unwrap();
    let mut lines = t.lines();
    let header: Vec<String> = lines
        .next()
        .unwrap()
        .split(',')
        .map(str::to_owned)
        .collect();
    lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), header.len(), "{l}");
            header
                .iter()
                .cloned()
                .zip(cells.iter().map(|c| c.to_string()))
                .collect()
        })
        .collect()
}

fn num(row: &std::collections::BTreeMap<String, String>, col: &str) -> f64 {
    row.get(col)
        .unwrap_or_else(|| panic!("no column {col}: {row:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{col} is not a number: {row:?}"))
}

/// (requests/s, p50 latency in microseconds) of `clients` threads each sending one
/// request at a time through `infer_server_infer` for `secs`.
fn hand_made_closed_loop(repo: &Path, model: &str, clients: usize, secs: f64) -> (f64, f64) {
    struct S(*mut ServerHandle);
    // SAFETY: the server handle is used from any thread.
    unsafe impl Send for S {}
    // SAFETY: as above.
    unsafe impl Sync for S {}
    impl S {
        fn h(&self) -> *mut ServerHandle {
            self.0
        }
    }
    let name = CString::new(model).unwrap();
    let s = serve(repo, model, None);
    let server = S(s);
    let input = CString::new("IN").unwrap();
    let data = [0.5f32; 4];
    // The model does not batch: no batch dim.
    let shape = [4i64];
    let warm = Duration::from_millis(200);
    let run = |record: bool| -> Vec<u64> {
        let until = Instant::now()
            + if record {
                Duration::from_secs_f64(secs)
            } else {
                warm
            };
        let mut lat = Vec::new();
        while Instant::now() < until {
            let t = Instant::now();
            // SAFETY: a request built and run through the C API, its response freed.
            unsafe {
                let mut r = std::ptr::null_mut();
                assert_eq!(infer_request_new(server.h(), name.as_ptr(), -1, &mut r), 0);
                assert_eq!(
                    infer_request_add_input(
                        r,
                        input.as_ptr(),
                        INFER_DATATYPE_FP32,
                        shape.as_ptr(),
                        1,
                        data.as_ptr().cast(),
                        16
                    ),
                    0
                );
                let mut resp = std::ptr::null_mut();
                assert_eq!(infer_server_infer(server.h(), r, &mut resp), 0);
                assert_eq!(infer_response_status(resp), 0);
                infer_response_free(resp);
            }
            lat.push(t.elapsed().as_nanos() as u64);
        }
        lat
    };
    let all: Vec<u64> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..clients)
            .map(|_| {
                sc.spawn(|| {
                    run(false);
                    run(true)
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    // SAFETY: every request finished; freed once.
    unsafe { infer_server_free(server.0) };
    let mut sorted = all.clone();
    sorted.sort_unstable();
    let p50 = sorted[(sorted.len() - 1) / 2] as f64 / 1e3;
    (all.len() as f64 / secs, p50)
}

/// A new server over `repo` (explicit model control) with model `name` loaded from the
/// repository, or from `config` (JSON or config.pbtxt text) and the model's folder.
fn serve(repo: &Path, name: &str, config: Option<&str>) -> *mut ServerHandle {
    let repo_c = CString::new(repo.to_str().unwrap()).unwrap();
    let n = CString::new(name).unwrap();
    let c = config.map(|c| CString::new(c).unwrap());
    let dir = CString::new(repo.join(name).to_str().unwrap()).unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: valid pointers; the options are freed here, the server by the caller.
    unsafe {
        let mut opts = std::ptr::null_mut();
        assert_eq!(infer_server_options_new(&mut opts), 0);
        assert_eq!(
            infer_server_options_set_model_repository(opts, repo_c.as_ptr()),
            0
        );
        assert_eq!(
            infer_server_options_set_model_control_explicit(opts, true),
            0
        );
        assert_eq!(infer_server_new(opts, &mut s), 0);
        infer_server_options_free(opts);
        let st = match &c {
            Some(c) => infer_server_load_model(s, n.as_ptr(), c.as_ptr(), dir.as_ptr()),
            None => infer_server_load_model(s, n.as_ptr(), std::ptr::null(), std::ptr::null()),
        };
        let msg = std::ffi::CStr::from_ptr(infer_last_error_message())
            .to_string_lossy()
            .into_owned();
        assert_eq!(st, 0, "{msg}");
    }
    s
}

#[test]
fn ensembles_report_their_steps() {
    let _serial = one_at_a_time();
    let step = |model: &str, input: &str, output: &str| {
        format!(
            r#"{{ model_name: "{model}" model_version: -1 input_map {{ key: "IN" value: "{input}" }} output_map {{ key: "IN" value: "{output}" }} }}"#
        )
    };
    let ens = format!(
        r#"name: "ens"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
ensemble_scheduling {{ step [ {}, {} ] }}
"#,
        step("first", "IN", "mid"),
        step("second", "mid", "OUT")
    );
    let repo = repository(
        "ens",
        &[
            ("first", identity("first", 8, 1000, "dynamic_batching { }")),
            (
                "second",
                identity("second", 8, 2000, "dynamic_batching { }"),
            ),
            ("ens", ens),
        ],
    );
    let csv_path = repo.join("ens.csv");
    let (o, out, err) = perf(
        &repo,
        "ens",
        &[
            "--concurrency-range",
            "2",
            "-p",
            "300",
            "-f",
            csv_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("Composing model first:") && out.contains("Composing model second:"),
        "{out}"
    );
    let r = &csv(&csv_path)[0];
    // The steps' compute adds up: 1 ms + 2 ms an execution.
    assert!(num(r, "Server Compute Infer") >= 3000.0, "{r:?}");
    assert!(num(r, "Avg latency") >= 3000.0, "{r:?}");
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn table_and_csv_parse_and_agree_with_a_hand_made_closed_loop() {
    let _serial = one_at_a_time();
    // One instance, no batching, 2 ms an execution: two requests in flight take turns,
    // so the throughput is about 500/s and the latency about 4 ms, whoever measures.
    let repo = repository("loop", &[("ident", identity("ident", 0, 2000, ""))]);
    let csv_path = repo.join("out.csv");
    let svg_path = repo.join("out.svg");
    let (o, out, err) = perf(
        &repo,
        "ident",
        &[
            "--concurrency-range",
            "1:2:1",
            "-p",
            "400",
            "-f",
            csv_path.to_str().unwrap(),
            "--plot",
            svg_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    // The summary table: a header, then one row per point, numbers in every column.
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("Concurrency  "))
        .collect();
    assert!(table.len() >= 3, "{out}");
    let cols: Vec<&str> = table[0].split_whitespace().collect();
    assert_eq!(&cols[..3], ["Concurrency", "Infer/s", "p50"], "{out}");
    for (row, want) in table[1..3].iter().zip(["1", "2"]) {
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[0].trim_end_matches('*'), want, "{out}");
        for c in &cells[1..11] {
            c.parse::<f64>()
                .unwrap_or_else(|_| panic!("'{c}' in {row}"));
        }
        assert!(cells[11].starts_with("1:"), "{row}");
    }
    let rows = csv(&csv_path);
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["Errors"], "0", "{r:?}");
        for c in ["p50 latency", "p90 latency", "p95 latency", "p99 latency"] {
            assert!(num(r, c) > 0.0, "{c}: {r:?}");
        }
        assert!(num(r, "p50 latency") <= num(r, "p99 latency"), "{r:?}");
        // The server's own figures: the delay is in compute infer.
        assert!(num(r, "Server Compute Infer") >= 2000.0, "{r:?}");
        assert!(r["Batch Sizes"].starts_with("1:"), "{r:?}");
    }
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("Latency vs throughput"),
        "{}",
        &svg[..200.min(svg.len())]
    );

    let (thr, p50) = hand_made_closed_loop(&repo, "ident", 2, 2.0);
    let at2 = &rows[1];
    let ratio_t = num(at2, "Inferences/Second") / thr;
    let ratio_l = num(at2, "p50 latency") / p50;
    eprintln!(
        "tool/hand-made: throughput {ratio_t:.3}, p50 {ratio_l:.3} ({thr:.1}/s, {p50:.0} us)"
    );
    assert!(
        (0.8..1.25).contains(&ratio_t),
        "throughput: tool {at2:?} vs hand-made {thr}/s"
    );
    assert!(
        (0.8..1.25).contains(&ratio_l),
        "p50: tool {at2:?} vs hand-made {p50} us"
    );
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn sweep_picks_the_config_that_is_best_by_construction() {
    let _serial = one_at_a_time();
    // 5 ms an execution and 8 requests in flight: batches of 4 on two instances serve
    // 1600/s at 5 ms; one instance 800/s at 10 ms; without batching 400/s at 20 ms and
    // 200/s at 40 ms.
    let repo = repository(
        "sweep",
        &[("ident", identity("ident", 8, 5000, "dynamic_batching { }"))],
    );
    let csv_path = repo.join("sweep.csv");
    let args = |budget: &'static str| {
        vec![
            "--model-repository".to_owned(),
            repo.to_str().unwrap().to_owned(),
            "-m".into(),
            "ident".into(),
            "--concurrency-range".into(),
            "8".into(),
            "-p".into(),
            "250".into(),
            "--sweep".into(),
            "max_batch_size=1,4".into(),
            "--sweep".into(),
            "instance_count=1,2".into(),
            "--latency-budget-ms".into(),
            budget.into(),
            "-f".into(),
            csv_path.to_str().unwrap().to_owned(),
        ]
    };
    let exported = repo.join("best.json");
    let mut a = args("30");
    a.extend([
        "--export-config".to_owned(),
        exported.to_str().unwrap().to_owned(),
    ]);
    let o = tool(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("Best config: max_batch_size=4 instance_count=2 ("),
        "{out}"
    );
    // The best config, exported, is that combination and loads as it is.
    let best: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&exported).unwrap()).unwrap();
    assert_eq!(best["max_batch_size"], 4, "{best}");
    assert_eq!(best["instance_group"][0]["count"], 2, "{best}");
    // SAFETY: a server from `serve`, freed once.
    unsafe { infer_server_free(serve(&repo, "ident", Some(&best.to_string()))) };
    let rows = csv(&csv_path);
    assert_eq!(rows.len(), 4, "one row per config");
    let thr = |cfg: &str| {
        rows.iter()
            .find(|r| r["Config"].trim_matches('"') == cfg)
            .map(|r| num(r, "Inferences/Second"))
            .unwrap_or_else(|| panic!("{cfg}: {rows:?}"))
    };
    assert!(
        thr("max_batch_size=4 instance_count=2") > 1.5 * thr("max_batch_size=4 instance_count=1")
    );
    assert!(
        thr("max_batch_size=4 instance_count=1") > 1.5 * thr("max_batch_size=1 instance_count=2")
    );
    // The unbatched single instance (40 ms) is over the budget.
    assert!(
        out.contains("max_batch_size=1 instance_count=1")
            && out.contains("no point within the budget"),
        "{out}"
    );

    // No config serves within 2 ms: said so, exit code 2.
    let a = args("2");
    let o = tool(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let (out, _) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains("Best config: none meets the latency budget"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn sequences_send_start_and_end() {
    let _serial = one_at_a_time();
    // The own-state accumulator fails a request whose sequence was not started, and
    // without ENDs its two slots would stay taken: no errors and steady completions
    // mean each sequence began with START and ended with END.
    let cfg = r#"name: "acc"
backend: "accumulator"
max_batch_size: 2
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
parameters { key: "execute_delay_us" value { string_value: "200" } }
"#;
    let repo = repository("seq", &[("acc", cfg.to_owned())]);
    let csv_path = repo.join("seq.csv");
    let (o, out, err) = perf(
        &repo,
        "acc",
        &[
            "--concurrency-range",
            "2:4:2",
            "--sequence-length",
            "3",
            "-p",
            "300",
            "-f",
            csv_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    for r in csv(&csv_path) {
        assert_eq!(r["Errors"], "0", "{r:?}\n{out}");
        assert!(num(&r, "Request Count") > 100.0, "{r:?}");
    }
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn request_rate_mode_sends_at_the_rate() {
    let _serial = one_at_a_time();
    let repo = repository("rate", &[("ident", identity("ident", 0, 0, ""))]);
    let csv_path = repo.join("rate.csv");
    let (o, out, err) = perf(
        &repo,
        "ident",
        &[
            "--request-rate-range",
            "200:400:200",
            "--request-distribution",
            "poisson",
            "-p",
            "500",
            "-s",
            "25",
            "-f",
            csv_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    let rows = csv(&csv_path);
    assert_eq!(rows.len(), 2);
    for (r, want) in rows.iter().zip([200.0, 400.0]) {
        assert_eq!(num(r, "Request Rate"), want);
        let got = num(r, "Requests/Second");
        assert!((0.7 * want..1.3 * want).contains(&got), "{r:?}");
    }
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn generative_model_reports_tokens() {
    let _serial = one_at_a_time();
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
    let csv_path = std::env::temp_dir().join(format!("infer-perf-gen-{}.csv", std::process::id()));
    let (o, out, err) = perf(
        &models,
        "tiny_gpt2",
        &[
            "--shape",
            "input_ids:8",
            "--output-tokens",
            "8",
            "--concurrency-range",
            "2",
            "-p",
            "300",
            "-s",
            "30",
            "-f",
            csv_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("Time to first token"), "{out}");
    let rows = csv(&csv_path);
    let r = &rows[0];
    assert_eq!(r["Errors"], "0", "{r:?}");
    assert!(num(r, "Output Token Throughput (per sec)") > 0.0, "{r:?}");
    // Every request streamed its 8 tokens: 8 per request.
    let per_request = num(r, "Output Token Throughput (per sec)") / num(r, "Requests/Second");
    assert!((per_request - 8.0).abs() < 0.01, "{r:?}");
    assert!(
        num(r, "Time To First Token Avg (ms)") * 1e3 < num(r, "Avg latency"),
        "{r:?}"
    );
    let _ = std::fs::remove_file(&csv_path);
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let _serial = one_at_a_time();
    let repo = repository(
        "bad",
        &[
            ("ident", identity("ident", 8, 0, "")),
            (
                "var",
                identity("var", 0, 0, "").replace("dims: [ 4 ]", "dims: [ -1 ]"),
            ),
        ],
    );
    let bad_json = repo.join("bad.json");
    std::fs::write(&bad_json, r#"{"data": [{"IN": [1, 2, 3]}]}"#).unwrap();
    let not_json = repo.join("not.json");
    std::fs::write(&not_json, "{").unwrap();
    let r = repo.to_str().unwrap();
    for (args, want) in [
        (vec!["-m", "nope"], "model 'nope' is not in repository"),
        (vec!["-m", "var"], "give its shape with --shape IN:"),
        (
            vec!["-m", "var", "--shape", "IN:x"],
            "'x' is not a dimension",
        ),
        (
            vec!["-m", "ident", "--shape", "IN:5"],
            "does not fit the dims [4]",
        ),
        (
            vec!["-m", "ident", "-b", "9"],
            "exceeds model 'ident''s max_batch_size 8",
        ),
        (
            vec!["-m", "ident", "--input-data", bad_json.to_str().unwrap()],
            "data[0].IN: 3 values",
        ),
        (
            vec!["-m", "ident", "--input-data", not_json.to_str().unwrap()],
            "not JSON",
        ),
        (
            vec!["-m", "ident", "--concurrency-range", "4:2"],
            "END is below START",
        ),
        (
            vec!["-m", "ident", "--sweep", "threads=2"],
            "'threads' cannot be swept",
        ),
    ] {
        let mut a = vec!["--model-repository", r, "-p", "50"];
        a.extend(args.iter().copied());
        let o = tool(&a);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {out}\n{err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // A missing repository.
    let o = tool(&["--model-repository", "/nonexistent/repo", "-m", "x"]);
    assert!(text(&o).1.contains("'/nonexistent/repo' is not a folder"));
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn settings_and_the_library_log_are_shown() {
    let _serial = one_at_a_time();
    let repo = repository("log", &[("ident", identity("ident", 8, 0, ""))]);
    let (o, out, err) = perf(
        &repo,
        "ident",
        &[
            "-p",
            "50",
            "--max-trials",
            "3",
            "--gpu",
            "off",
            "--log-level",
            "info",
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.starts_with(
            "*** Measurement Settings ***\n  Model: ident (identity), max_batch_size 8"
        ),
        "{out}"
    );
    assert!(out.contains("instances 1 x KIND_CPU"), "{out}");
    assert!(err.contains("libinfer info: model 'ident' loaded"), "{err}");
    let _ = std::fs::remove_dir_all(&repo);
}

#[test]
fn help_shows_examples() {
    let _serial = one_at_a_time();
    let o = tool(&["--help"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    for s in [
        "--concurrency-range",
        "--request-rate-range",
        "--sweep",
        "--plot",
        "Examples:",
    ] {
        assert!(out.contains(s), "{s}: {out}");
    }
}

#[test]
fn latency_threshold_ends_the_range() {
    let _serial = one_at_a_time();
    // 4 ms an execution, one at a time: 1 in flight waits 4 ms, 2 wait 8 ms (p50 over
    // 6 ms), so the third point is never measured. p50, not p99: a scheduling hiccup of
    // the machine must not end the range at the first point.
    let repo = repository("threshold", &[("ident", identity("ident", 0, 4000, ""))]);
    let csv_path = repo.join("t.csv");
    let (o, out, err) = perf(
        &repo,
        "ident",
        &[
            "--concurrency-range",
            "1:3",
            "-p",
            "200",
            "-l",
            "6",
            "--percentile",
            "50",
            "-f",
            csv_path.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(
        out.contains("the 1 higher load point(s) are skipped"),
        "{out}"
    );
    let rows = csv(&csv_path);
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(num(&rows[1], "p50 latency") > 6000.0, "{rows:?}");
    let _ = std::fs::remove_dir_all(&repo);
}
