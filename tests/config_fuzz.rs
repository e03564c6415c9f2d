//! A bounded config fuzzer: mutated configs (numbers swapped for extremes, lines dropped
//! or repeated, fields added) are loaded by a fresh server in a forked child with a
//! 3 GiB address-space limit and 20 s to finish. A child may load or refuse its config;
//! it must never abort, crash or hang. `INFER_CONFIG_FUZZ_CASES` sets the number of cases
//! (default 1500), `INFER_CONFIG_FUZZ_SEED` the first seed.

mod common;
use common::*;
use infer::ffi::server::*;
use std::time::{Duration, Instant};

const SEEDS: &[&str] = &[
    r#"name: "m" backend: "identity" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 priority_levels: 3 default_priority_level: 2
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 1000 allow_timeout_override: true max_queue_size: 10 }
  priority_queue_policy { key: 1 value { max_queue_size: 4 } } }
"#,
    r#"name: "m" backend: "add_sub" max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
version_policy { latest { num_versions: 2 } }
parameters { key: "execute_delay_us" value { string_value: "0" } }
"#,
    r#"name: "m" backend: "accumulator" max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 8 preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 10 }
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "z" } } ]
}
"#,
    r#"name: "m" backend: "accumulator" max_batch_size: 2
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  direct { max_queue_delay_microseconds: 10 minimum_slot_utilization: 0.5 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
"#,
    r#"name: "m" platform: "onnxruntime_onnx" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"#,
];

/// Numbers a mutation puts in place of one in the config.
const EXTREMES: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "65536",
    "65537",
    "1000000",
    "2147483647",
    "-2147483648",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615",
    "1e30",
    "0.0",
];

/// Fields a mutation adds.
const FIELDS: &[&str] = &[
    "max_batch_size: N",
    "instance_group [ { count: N kind: KIND_CPU } ]",
    "instance_group [ { count: N kind: KIND_GPU gpus: [ N ] } ]",
    "dynamic_batching { priority_levels: N default_priority_level: N max_queue_delay_microseconds: N }",
    "dynamic_batching { preferred_batch_size: [ N, N ] }",
    "sequence_batching { oldest { max_candidate_sequences: N } }",
    "sequence_batching { direct { } state [ { input_name: \"S\" output_name: \"T\" data_type: TYPE_FP32 dims: [ N, N ] } ] }",
    "version_policy { specific { versions: [ N ] } }",
    "version_policy { latest { num_versions: N } }",
    "parameters { key: \"execute_delay_us\" value { string_value: \"N\" } }",
    "input [ { name: \"X\" data_type: TYPE_FP32 dims: [ N, N, N ] reshape { shape: [ N ] } } ]",
    "output [ { name: \"Y\" data_type: TYPE_STRING dims: [ N ] } ]",
    "optimization { priority: PRIORITY_MAX }",
    "model_warmup [ { name: \"w\" batch_size: N inputs { key: \"IN\" value { data_type: TYPE_FP32 dims: [ N ] zero_data: true } } } ]",
    "default_model_filename: \"../../../etc/passwd\"",
    "ensemble_scheduling { step [ { model_name: \"m\" model_version: N input_map { key: \"a\" value: \"b\" } output_map { key: \"c\" value: \"d\" } } ] }",
];

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, list: &[&'a str]) -> &'a str {
        list[self.below(list.len())]
    }
}

/// One mutated config.
fn mutate(rng: &mut Rng) -> String {
    let mut text = rng.pick(SEEDS).to_owned();
    for _ in 0..1 + rng.below(4) {
        match rng.below(4) {
            // Swap a number for an extreme.
            0 | 1 => {
                let spans: Vec<(usize, usize)> = number_spans(&text);
                if let Some(&(a, b)) = spans.get(rng.below(spans.len().max(1))) {
                    text.replace_range(a..b, rng.pick(EXTREMES));
                }
            }
            // Drop or repeat a line.
            2 => {
                let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
                let i = rng.below(lines.len());
                if rng.below(2) == 0 {
                    lines.remove(i);
                } else {
                    let l = lines[i].clone();
                    lines.insert(i, l);
                }
                text = lines.join("\n");
            }
            // Add a field.
            _ => {
                let mut f = rng.pick(FIELDS).to_owned();
                while let Some(i) = f.find('N') {
                    let n = rng.pick(EXTREMES);
                    f.replace_range(i..i + 1, n);
                }
                text.push('\n');
                text.push_str(&f);
            }
        }
    }
    text
}

/// Byte ranges of the unsigned integers in `text` (not inside names).
fn number_spans(text: &str) -> Vec<(usize, usize)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit()
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            let s = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            out.push((s, i));
        } else {
            i += 1;
        }
    }
    out
}

enum Outcome {
    /// Loaded (true) or refused the config.
    Exited(bool),
    Crashed(i32),
    Hung,
}

/// Loads `config` in a forked child; how the child ended.
fn run_child(config: &str, model_dir: &std::ffi::CStr) -> Outcome {
    let cfg = cs(config);
    // SAFETY: the child only calls into the library and then _exit; no lock of the
    // parent's other threads is needed (this test binary runs nothing else meanwhile).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain system calls in the child.
        unsafe {
            let limit = libc::rlimit {
                rlim_cur: 3 << 30,
                rlim_max: 3 << 30,
            };
            libc::setrlimit(libc::RLIMIT_AS, &limit);
            let mut opts = std::ptr::null_mut();
            infer_server_options_new(&mut opts);
            infer_server_options_set_gpu(opts, 1);
            let mut s = std::ptr::null_mut();
            infer_server_new(opts, &mut s);
            let st = infer_server_load_model(s, c"m".as_ptr(), cfg.as_ptr(), model_dir.as_ptr());
            infer_server_free(s);
            infer_server_options_free(opts);
            libc::_exit(if st == 0 { 0 } else { 1 });
        }
    }
    let start = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            if libc::WIFSIGNALED(status) {
                return Outcome::Crashed(libc::WTERMSIG(status));
            }
            return Outcome::Exited(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        }
        if start.elapsed() > Duration::from_secs(20) {
            // SAFETY: our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return Outcome::Hung;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn mutated_configs_never_abort_or_hang_the_host() {
    let cases: u64 = std::env::var("INFER_CONFIG_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    let first: u64 = std::env::var("INFER_CONFIG_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    // The ONNX seed reads its model file from here; the others need no folder.
    let dir = cs(concat!(env!("CARGO_MANIFEST_DIR"), "/models/add_sub"));
    let (mut crashed, mut hung, mut loaded) = (Vec::new(), Vec::new(), 0u64);
    let start = Instant::now();
    for seed in first..first + cases {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let config = mutate(&mut rng);
        match run_child(&config, &dir) {
            Outcome::Exited(ok) => loaded += u64::from(ok),
            Outcome::Crashed(sig) => crashed.push((seed, sig, config)),
            Outcome::Hung => hung.push((seed, config)),
        }
    }
    eprintln!(
        "config fuzz: {cases} configs in {:.1}s: {loaded} loaded, the others refused; {} crashed, {} hung",
        start.elapsed().as_secs_f64(),
        crashed.len(),
        hung.len()
    );
    for (seed, sig, config) in crashed.iter().take(3) {
        eprintln!("seed {seed}: signal {sig}:\n{config}\n");
    }
    for (seed, config) in hung.iter().take(3) {
        eprintln!("seed {seed}: hung:\n{config}\n");
    }
    assert!(crashed.is_empty() && hung.is_empty());
}
