//! `instance_group { cpus: [ ... ] }` (a libinfer extension): each instance's worker
//! thread is pinned to the listed cores; a core the process may not use fails the load.
#![cfg(target_os = "linux")]

mod common;
use common::*;
use infer::ffi::*;
use std::sync::Mutex;

/// The cores this test thread may run on (the process's mask: CI has 2 cores, and the
/// tests may run under `taskset`).
fn allowed_cpus() -> Vec<u32> {
    // SAFETY: a zeroed cpu_set_t is the empty set; the size passed is its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .map(|c| c as u32)
        .collect()
}

/// (worker thread name, CPU it executed on) for every batch the probe backend ran.
static SEEN: Mutex<Vec<(String, i32)>> = Mutex::new(Vec::new());

/// Answers each row with the CPU the worker thread runs on, and records it.
fn cpu_probe(batch: &mut Batch) -> infer::status::Result<()> {
    // SAFETY: no preconditions.
    let cpu = unsafe { libc::sched_getcpu() };
    let name = std::thread::current().name().unwrap_or("").to_owned();
    SEEN.lock().unwrap().push((name, cpu));
    let shape = batch.inputs[0].shape.clone();
    let out = batch.alloc_output("OUT", &shape, None)?;
    let rows = vec![cpu as f32; out.len() / 4];
    out.copy_from_slice(bytemuck::cast_slice(&rows));
    Ok(())
}

fn probe_config(name: &str, groups: &str) -> String {
    format!(
        r#"
name: "{name}" backend: "cpu_probe" max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {groups} ]
"#
    )
}

/// Sends `n` requests at once (so that every instance gets work) and returns the CPU each
/// answer reports.
fn probe(s: &Server, model: &str, n: usize) -> Vec<i32> {
    let c = Collector::new();
    for _ in 0..n {
        let r = s.request(model).input_f32("IN", &[1, 1], &[0.0]);
        s.enqueue(r, &c).unwrap();
    }
    c.wait(n);
    c.take()
        .iter()
        .map(|r| {
            assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
            r.output_f32("OUT")[0] as i32
        })
        .collect()
}

/// The CPUs the workers of `model` ran on, by instance index.
fn seen_by_instance(model: &str) -> Vec<(usize, i32)> {
    let prefix = format!("infer-{model}-");
    SEEN.lock()
        .unwrap()
        .iter()
        .filter_map(|(name, cpu)| {
            let i = name.strip_prefix(&prefix)?.parse().ok()?;
            Some((i, *cpu))
        })
        .collect()
}

#[test]
fn pinned_instances_load_answer_and_run_on_their_cores() {
    let allowed = allowed_cpus();
    let core = *allowed.last().unwrap();

    // add_sub with two instances pinned to one allowed core.
    let s = Server::new();
    s.load(
        "pinned_add_sub",
        &add_sub_config(
            "pinned_add_sub",
            &format!("instance_group [ {{ count: 2 kind: KIND_CPU cpus: [ {core} ] }} ]"),
        ),
    );
    for k in 0..8 {
        let k = k as f32;
        let r = s.infer(add_sub_request(
            &s,
            "pinned_add_sub",
            [k, 1.0, 2.0, 3.0],
            [1.0; 4],
        ));
        assert_eq!(r.status(), INFER_STATUS_OK, "{}", r.error());
        assert_eq!(r.output_f32("OUTPUT0"), vec![k + 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(r.output_f32("OUTPUT1"), vec![k - 1.0, 0.0, 1.0, 2.0]);
    }

    // The backend runs on the pinned cores: group 0 (instances 0 and 1) on `core`, group
    // 1 (instance 2) on the first allowed core, group 2 (instance 3) unpinned.
    s.register_fn_backend("cpu_probe", cpu_probe);
    let first = allowed[0];
    s.load(
        "probe",
        &probe_config(
            "probe",
            &format!(
                "{{ count: 2 kind: KIND_CPU cpus: [ {core} ] }}, \
                 {{ count: 1 kind: KIND_CPU cpus: [ {first} ] }}, \
                 {{ count: 1 kind: KIND_CPU }}"
            ),
        ),
    );
    let answers = probe(&s, "probe", 64);
    assert_eq!(answers.len(), 64);
    let seen = seen_by_instance("probe");
    assert!(!seen.is_empty());
    for (i, cpu) in &seen {
        match i {
            0 | 1 => assert_eq!(*cpu, core as i32, "instance {i}"),
            2 => assert_eq!(*cpu, first as i32, "instance {i}"),
            _ => assert!(allowed.contains(&(*cpu as u32)), "instance {i} on {cpu}"),
        }
    }
    for cpu in answers {
        assert!(allowed.contains(&(cpu as u32)), "answered from CPU {cpu}");
    }
}

#[test]
fn unavailable_core_fails_the_load() {
    let allowed = allowed_cpus();
    let s = Server::new();

    // A core the process may not use: INVALID_ARGUMENT naming the model, the instance and
    // the cpu; no model is left behind.
    let not_allowed = (0..).find(|c| !allowed.contains(c)).unwrap();
    for cpu in [1000, not_allowed] {
        let cfg = add_sub_config(
            "bad_cpu",
            &format!(
                "instance_group [ {{ count: 1 kind: KIND_CPU }}, \
                 {{ count: 2 kind: KIND_CPU cpus: [ {}, {cpu} ] }} ]",
                allowed[0]
            ),
        );
        let msg = expect_status(s.try_load("bad_cpu", &cfg), INFER_STATUS_INVALID_ARGUMENT);
        assert!(msg.contains("'bad_cpu'"), "{msg}");
        assert!(msg.contains("instance 1"), "{msg}");
        assert!(msg.contains(&format!("CPU {cpu} ")), "{msg}");
        assert!(
            msg.contains(&format!("cpus [{}, {cpu}]", allowed[0])),
            "{msg}"
        );
        let st =
            unsafe { infer::ffi::server::infer_server_unload_model(s.0, cs("bad_cpu").as_ptr()) };
        assert_eq!(st, INFER_STATUS_NOT_FOUND, "the failed load left a model");
    }

    // Beyond the OS's CPU set: rejected by config validation, naming the field.
    let cfg = add_sub_config("bad_cpu", "instance_group [ { count: 1 cpus: [ 1024 ] } ]");
    let msg = expect_status(s.try_load("bad_cpu", &cfg), INFER_STATUS_INVALID_ARGUMENT);
    assert!(msg.contains("instance_group[0].cpus[0]"), "{msg}");
    assert!(msg.contains("1024"), "{msg}");

    // The same name then loads with a valid list.
    let cfg = add_sub_config(
        "bad_cpu",
        &format!(
            "instance_group [ {{ count: 2 kind: KIND_CPU cpus: [ {} ] }} ]",
            allowed[0]
        ),
    );
    s.load("bad_cpu", &cfg);
    let r = s.infer(add_sub_request(&s, "bad_cpu", [1.0; 4], [2.0; 4]));
    assert_eq!(r.output_f32("OUTPUT0"), vec![3.0; 4]);
}
