#!/usr/bin/env python3
"""Times onnxruntime's CPU execution on the models `cargo bench --bench onnx` times.

Run `cargo bench --bench onnx` first (it writes target/onnx-bench/mlp_wide and lstm), then
`python3 benches/onnx_ort.py [--secs S]` (needs `pip install onnxruntime numpy`).
Prints a markdown table: mean microseconds per call at batch 1, 8, 64 with one thread
(as libinfer runs one plan per instance on one thread) and with onnxruntime's default
thread pool. Inputs are drawn like the Rust benchmark's (random, fixed seed).
"""
import argparse
import os
import time

import numpy as np
import onnxruntime as ort

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = [
    ("mlp", os.path.join(ROOT, "models", "mlp", "1", "model.onnx"), (64,)),
    ("cnn", os.path.join(ROOT, "models", "cnn", "1", "model.onnx"), (1, 28, 28)),
    ("mlp_wide", os.path.join(ROOT, "target", "onnx-bench", "mlp_wide", "1", "model.onnx"), (512,)),
    ("lstm", os.path.join(ROOT, "target", "onnx-bench", "lstm", "1", "model.onnx"), (16, 32)),
]


def mean_us(fn, secs):
    for _ in range(10):
        fn()
    n = 0
    start = time.perf_counter()
    while n < 20 or time.perf_counter() - start < secs:
        fn()
        n += 1
    return (time.perf_counter() - start) * 1e6 / n


def session(path, threads):
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--secs", type=float, default=3.0)
    args = ap.parse_args()
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs")
    print("| model | batch | onnxruntime 1 thread (us) | onnxruntime default threads (us) |")
    print("|---|---:|---:|---:|")
    for name, path, row in MODELS:
        if not os.path.exists(path):
            print(f"| {name} | - | missing {path} (run cargo bench --bench onnx first) | |")
            continue
        one, default = session(path, 1), session(path, 0)
        input_name = one.get_inputs()[0].name
        for batch in (1, 8, 64):
            x = np.random.default_rng(batch).uniform(-0.5, 0.5, (batch,) + row).astype(np.float32)
            feeds = {input_name: x}
            t1 = mean_us(lambda: one.run(None, feeds), args.secs / 2)
            td = mean_us(lambda: default.run(None, feeds), args.secs / 2)
            print(f"| {name} | {batch} | {t1:.1f} | {td:.1f} |")


if __name__ == "__main__":
    main()
