//! The layers of `src/` point one way: a module imports only from its own room or from a
//! room below it (ARCHITECTURE "Layers"). This test reads every source file of `src/`,
//! resolves each `crate::` and `super::` path to the module file it names, and fails on
//! an import that points up (or sideways, between two rooms of one level) and on an
//! import cycle between files. Raw CUDA (the `cudarc` bindings) is named in the `cuda`
//! room only.
//!
//! The order is written once, in [`ROOMS`] and [`LEVELS`]: which files make which room
//! (longest path prefix wins), and each room's level. What `src/` still does against it is
//! listed in `tests/layers_known.txt` (one `file -> room` or `cycle: a b ...` per line,
//! with its reason after `#`); an entry that no longer holds fails the test too, so the
//! list only shrinks. Test code (`#[cfg(test)]` onwards, `tests.rs`, `*_tests.rs`) is not
//! read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Files (path prefixes under `src/`, without `.rs`) and the room they belong to. The
/// longest matching prefix wins.
const ROOMS: &[(&str, &str)] = &[
    ("status", "ground"),
    ("log", "ground"),
    ("stats", "ground"),
    ("affinity", "ground"),
    ("callback", "ground"),
    ("folder", "ground"),
    // Every raw CUDA call: the probe, the driver, modules, NVRTC, cuBLAS, graphs.
    ("cuda", "cuda"),
    ("tensor", "tensor"),
    ("config", "config"),
    ("request", "request"),
    ("backend", "backend"),
    ("onnx", "onnx"),
    ("llm", "llm"),
    ("scheduler", "scheduler"),
    ("server", "server"),
    ("ffi", "ffi"),
    ("lib", "crate"),
];

/// Each room's level: a room may import rooms of lower levels only.
const LEVELS: &[(&str, u32)] = &[
    ("ground", 0),
    ("cuda", 1),
    ("tensor", 2),
    ("config", 3),
    ("request", 4),
    ("backend", 5),
    ("onnx", 6),
    ("llm", 6),
    ("scheduler", 7),
    ("server", 8),
    ("ffi", 9),
    ("crate", 10),
];

const KNOWN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/layers_known.txt");

/// A module path (`["onnx", "gpu", "plan"]`) and the file that holds it.
struct Module {
    path: Vec<String>,
    file: PathBuf,
}

fn modules(src: &Path) -> Vec<Module> {
    let mut out = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if p.extension().is_none_or(|x| x != "rs")
                || stem == "tests"
                || stem.ends_with("_tests")
            {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut path: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if path.last().is_some_and(|l| l == "mod") || path == ["lib"] {
                path.pop();
            }
            out.push(Module { path, file: p });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// The file's name as the rules and the known list write it: `onnx/gpu/plan.rs`.
fn rel(src: &Path, file: &Path) -> String {
    file.strip_prefix(src)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

fn room_of(rel_file: &str) -> &'static str {
    let stem = rel_file.trim_end_matches(".rs");
    ROOMS
        .iter()
        .filter(|(prefix, _)| {
            stem == *prefix
                || stem.starts_with(&format!("{prefix}/"))
                || stem.starts_with(&format!("{prefix}_"))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map_or("?", |(_, room)| room)
}

fn level(room: &str) -> Option<u32> {
    LEVELS.iter().find(|(r, _)| *r == room).map(|(_, l)| *l)
}

/// The source without comments, cut at the first `#[cfg(test)]`.
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" //").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// Every path the code names from `crate::` or `super::`, as absolute module paths
/// (`use crate::{a, b::c}` gives `a` and `b::c`).
fn named_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let bytes: Vec<char> = code.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let starts = |w: &str| code_at(&bytes, i, w) && (i == 0 || !ident(bytes[i - 1]));
        let (mut base, mut j) = if starts("crate::") {
            (Vec::new(), i + "crate::".len())
        } else if starts("super::") {
            let mut up = module.to_vec();
            let mut j = i;
            while code_at(&bytes, j, "super::") {
                up.pop();
                j += "super::".len();
            }
            (up, j)
        } else {
            i += 1;
            continue;
        };
        // One path, or a brace group of them.
        if bytes.get(j) == Some(&'{') {
            let mut depth = 0;
            let mut item = String::new();
            let mut items = Vec::new();
            while j < bytes.len() {
                let c = bytes[j];
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 1 && (c == ',' || c == '{') || depth == 0 {
                    if !item.trim().is_empty() {
                        items.push(item.trim().to_owned());
                    }
                    item.clear();
                } else {
                    item.push(c);
                }
                j += 1;
                if depth == 0 {
                    break;
                }
            }
            for it in items {
                let head: String = it.chars().take_while(|&c| ident(c) || c == ':').collect();
                let mut p = base.clone();
                p.extend(head.split("::").filter(|s| !s.is_empty()).map(String::from));
                out.push(p);
            }
        } else {
            let mut seg = String::new();
            while j < bytes.len() && (ident(bytes[j]) || bytes[j] == ':') {
                seg.push(bytes[j]);
                j += 1;
            }
            base.extend(seg.split("::").filter(|s| !s.is_empty()).map(String::from));
            out.push(base);
        }
        i = j;
    }
    out
}

fn code_at(chars: &[char], i: usize, w: &str) -> bool {
    w.chars()
        .enumerate()
        .all(|(k, c)| chars.get(i + k) == Some(&c))
}

/// The module file a path points into: the longest prefix of it that is a module.
fn target<'m>(mods: &'m [Module], path: &[String]) -> Option<&'m Module> {
    (0..=path.len())
        .rev()
        .find_map(|n| mods.iter().find(|m| m.path == path[..n]))
}

/// (file, room) imports that break the order, and the file cycles, of the tree at `src`.
fn check(src: &Path) -> (BTreeSet<String>, BTreeSet<String>) {
    let mods = modules(src);
    let mut bad = BTreeSet::new();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in &mods {
        let from = rel(src, &m.file);
        let room = room_of(&from);
        let text = std::fs::read_to_string(&m.file).unwrap();
        // Raw CUDA (cudarc's bindings) is the cuda room's alone.
        if room != "cuda" && code(&text).contains("cudarc::") {
            bad.insert(format!("{from} -> cudarc"));
        }
        for p in named_paths(&code(&text), &m.path) {
            let Some(t) = target(&mods, &p) else { continue };
            let to = rel(src, &t.file);
            if to == from || t.path.is_empty() {
                continue;
            }
            edges.entry(from.clone()).or_default().insert(to.clone());
            let to_room = room_of(&to);
            let ok = room == to_room
                || matches!((level(room), level(to_room)), (Some(a), Some(b)) if b < a);
            if !ok {
                bad.insert(format!("{from} -> {to_room}"));
            }
        }
    }
    (bad, cycles(&edges))
}

/// The strongly connected groups of more than one file, each as `cycle: a b ...`.
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    let nodes: BTreeSet<&String> = edges
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a).chain(bs))
        .collect();
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(n) = stack.pop() {
            for m in edges.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    stack.push(m.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out = BTreeSet::new();
    for n in &nodes {
        let group: Vec<&str> = nodes
            .iter()
            .filter(|m| reached[*n].contains(**m) && reached[*m].contains(*n))
            .map(|m| m.as_str())
            .collect();
        if group.len() > 1 {
            out.insert(format!("cycle: {}", group.join(" ")));
        }
    }
    out
}

fn known() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(KNOWN).unwrap_or_else(|e| panic!("{KNOWN}: {e}"));
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (entry, why) = line.split_once('#').unwrap_or((line, ""));
        assert!(!why.trim().is_empty(), "{KNOWN}:{}: no reason given", n + 1);
        out.insert(entry.trim().to_owned(), why.trim().to_owned());
    }
    out
}

#[test]
fn src_imports_point_down_the_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for m in modules(&src) {
        let f = rel(&src, &m.file);
        assert!(
            level(room_of(&f)).is_some(),
            "{f} is in no room: add it to ROOMS"
        );
    }
    let (bad, cycles) = check(&src);
    let found: BTreeSet<String> = bad.into_iter().chain(cycles).collect();
    let known = known();
    let new: Vec<&String> = found.iter().filter(|f| !known.contains_key(*f)).collect();
    let gone: Vec<&String> = known.keys().filter(|k| !found.contains(*k)).collect();
    assert!(
        new.is_empty(),
        "imports against the layers (a room imports only its own and lower rooms; see ROOMS and LEVELS in tests/layers.rs):\n  {}",
        new.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n  ")
    );
    assert!(
        gone.is_empty(),
        "these entries of tests/layers_known.txt no longer hold: remove them\n  {}",
        gone.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    println!(
        "layers: {} modules, {} known exceptions left",
        modules(&src).len(),
        known.len()
    );
}

/// The checker itself: an upward import, a sideways one, a cycle, and what is allowed.
#[test]
fn the_checker_finds_upward_imports_and_cycles() {
    let dir = std::env::temp_dir().join(format!("infer-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = [
        (
            "lib.rs",
            "pub mod status; pub mod tensor; pub mod config; pub mod llm;",
        ),
        (
            "status.rs",
            "// crate::tensor in a comment is no import\npub struct E;",
        ),
        (
            "tensor.rs",
            "use crate::status::E;\nuse crate::config::Model;",
        ),
        ("config/mod.rs", "mod parse; pub use crate::tensor::T;"),
        (
            "config/parse.rs",
            "use super::super::status::E; use crate::{tensor, config::X};",
        ),
        ("llm/mod.rs", "use crate::no_such_module;"),
        (
            "onnx/mod.rs",
            "fn f() { crate::llm::g(); }\n#[cfg(test)]\nmod tests { use crate::ffi; }",
        ),
        ("cuda/mod.rs", "use cudarc::driver::sys;"),
        (
            "llm/kv.rs",
            "// cudarc::driver in a comment\nfn f(s: cudarc::driver::sys::CUstream) {}",
        ),
    ];
    for (f, text) in files {
        let p = dir.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let (bad, cycles) = check(&dir);
    let bad: Vec<&str> = bad.iter().map(|s| s.as_str()).collect();
    // tensor (2) -> config (3) is up; config/parse -> tensor is down; onnx (6) -> llm (6)
    // is sideways; llm/kv names raw CUDA outside cuda/; the test module's import and the
    // comments are not read.
    assert_eq!(
        bad,
        [
            "llm/kv.rs -> cudarc",
            "onnx/mod.rs -> llm",
            "tensor.rs -> config"
        ],
        "{bad:?}"
    );
    assert_eq!(
        cycles.into_iter().collect::<Vec<_>>(),
        ["cycle: config/mod.rs tensor.rs"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
