#!/usr/bin/env python3
"""Throughput of ONNX models on a GPU at batch 1, 8 and 64: libinfer against ONNX
Runtime's CUDA execution provider on the same files, interleaved (scripts/gpu-check.sh's
`throughput` step).

Usage: gpu_throughput.py --infer-perf BIN --models DIR --out DIR [--names resnet50,bert_base]
       [--batches 1,8,64] [--rounds 2] [--window-ms 500] [--stand-in]

DIR holds model folders as scripts/random_models.py writes them (`<name>/1/model.onnx`).
For each, OUT/repo gets a model served by libinfer's own CUDA executor (one KIND_GPU
instance, max_batch_size the largest batch, `gpu_executor: "libinfer"`) and, where the
onnxruntime package of this Python has the CUDA execution provider (onnxruntime-gpu), the
same file as `<name>_ort` (`gpu_executor: "onnxruntime"`), served by libinfer on that
package's own library (infer-perf --onnxruntime-library).

Every figure is samples per second with one request of the batch in flight (what a caller
that waits for each answer gets), zeros as inputs:
* libinfer: infer-perf (tools/infer-perf), one process per point: a warm-up window, then
  windows of --window-ms until three agree within 10 % (at most four);
* libinfer on ORT CUDA: the same, for `<name>_ort`;
* ORT CUDA: onnxruntime.InferenceSession(providers=[CUDA, CPU]).run on numpy arrays in this
  process (one session per model, kept across rounds), warmed up, then timed for three
  windows.
Each round takes every model and batch in turn, A then B then C, so the machine's drift
falls on all columns alike. The table gives each column's median over the rounds and the
ratio libinfer / ORT CUDA as the median of the rounds' ratios with their range. It is
printed and written to OUT/throughput.md, the raw figures to OUT/throughput.json.

Without onnxruntime-gpu here, ORT's columns say so and only libinfer's figures are taken.
--stand-in (the script's own test, against the stand-in CUDA libraries): the reference is
ONNX Runtime's CPU provider, and the figures mean nothing.

Exit status: 1 when a measurement fails (a load, a run, a missing engine that was asked
for), never for a ratio: speed targets live in the benchmarks.
"""
import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


def config_text(name, max_batch, executor):
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch}\n'
            'instance_group [ { kind: KIND_GPU count: 1 } ]\n'
            f'parameters {{ key: "gpu_executor" value: {{ string_value: "{executor}" }} }}\n')


def make_repo(models, names, repo, max_batch, with_ort):
    """OUT/repo: each model under libinfer's executor, and under ORT's CUDA provider."""
    shutil.rmtree(repo, ignore_errors=True)
    served = {}
    for name in names:
        src = os.path.join(models, name, "1", "model.onnx")
        if not os.path.isfile(src):
            raise SystemExit(f"gpu_throughput: no {src}")
        variants = [(name, "libinfer")] + ([(name + "_ort", "onnxruntime")] if with_ort else [])
        for served_as, executor in variants:
            os.makedirs(os.path.join(repo, served_as, "1"))
            # A hard link (else a copy): a model folder is read through itself, and
            # symbolic links out of it are refused.
            dst = os.path.join(repo, served_as, "1", "model.onnx")
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            with open(os.path.join(repo, served_as, "config.pbtxt"), "w") as f:
                f.write(config_text(served_as, max_batch, executor))
        served[name] = src
    return served


def nvidia_wheel_libs():
    """The library folders of the nvidia-* wheels this Python has (cuDNN, cuBLAS, the CUDA
    runtime: what onnxruntime-gpu's CUDA provider loads), for infer-perf's loader path."""
    try:
        import nvidia
    except ImportError:
        return []
    out = []
    for root in nvidia.__path__:
        for sub in sorted(os.listdir(root)):
            for lib in (os.path.join(root, sub, "lib"), os.path.join(root, sub, "lib64")):
                if os.path.isdir(lib):
                    out.append(lib)
    return out


def infer_perf(args, repo, model, batch, ort_library, log):
    """Samples/s of `model` at `batch` through infer-perf; raises on failure."""
    out_csv = os.path.join(args.out, f"perf_{model}_b{batch}.csv")
    cmd = [args.infer_perf, "--model-repository", repo, "-m", model, "-b", str(batch),
           "--concurrency-range", "1", "--gpu", "required", "--input-data", "zero",
           "-p", str(args.window_ms), "--max-trials", "4", "-f", out_csv]
    if ort_library:
        cmd += ["--onnxruntime-library", ort_library]
    env = None
    if ort_library:
        libs = nvidia_wheel_libs() + [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
        env = dict(os.environ, LD_LIBRARY_PATH=":".join(libs))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    log.write(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}\n")
    if p.returncode != 0:
        # Its error may span lines (ONNX Runtime's messages do): from its start, folded.
        err = p.stderr[p.stderr.find("infer-perf: error"):] if "infer-perf: error" in p.stderr \
            else p.stderr
        raise RuntimeError(f"infer-perf {model} batch {batch}: exit {p.returncode}: "
                           + " ".join(err.split())[:600])
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    if not rows or int(rows[0].get("Errors", "0") or 0) != 0:
        raise RuntimeError(f"infer-perf {model} batch {batch}: no point, or requests failed: {rows}")
    return float(rows[0]["Inferences/Second"])


class OrtModel:
    """One onnxruntime session of a file, with zero inputs per batch size."""

    def __init__(self, ort, np, path, provider):
        providers = [provider, "CPUExecutionProvider"] if provider != "CPUExecutionProvider" \
            else [provider]
        self.session = ort.InferenceSession(path, providers=providers)
        if self.session.get_providers()[0] != provider:
            raise RuntimeError(f"{path}: onnxruntime did not take {provider} "
                               f"(it runs on {self.session.get_providers()})")
        self.np = np
        self.inputs = self.session.get_inputs()

    def feeds(self, batch):
        types = {"tensor(float)": self.np.float32, "tensor(int64)": self.np.int64,
                 "tensor(int32)": self.np.int32, "tensor(float16)": self.np.float16}
        feeds = {}
        for i in self.inputs:
            dims = [batch if k == 0 else d for k, d in enumerate(i.shape)]
            if any(not isinstance(d, int) for d in dims):
                raise RuntimeError(f"input {i.name} has a symbolic dim other than the batch: {i.shape}")
            feeds[i.name] = self.np.zeros(dims, types[i.type])
        return feeds

    def samples_per_s(self, batch, window_s):
        feeds = self.feeds(batch)
        end = time.perf_counter() + window_s
        while time.perf_counter() < end:  # warm-up, as infer-perf's first window
            self.session.run(None, feeds)
        n, start = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - start < 3 * window_s:
            self.session.run(None, feeds)
            n += 1
        return n * batch / (time.perf_counter() - start)


def table(names, batches, results, columns, ref):
    lines = ["| model | batch | " + " | ".join(columns) + f" | libinfer / {ref} |",
             "|---|---|" + "---|" * (len(columns) + 1)]
    for name in names:
        for b in batches:
            r = results[name][str(b)]
            cells = []
            for c in columns:
                v = r.get(c, [])
                cells.append(f"{statistics.median(v):,.1f}" if v else "n/a")
            ratios = [a / o for a, o in zip(r.get("libinfer", []), r.get(ref, [])) if o > 0]
            ratio = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                     if ratios else "n/a")
            lines.append(f"| {name} | {b} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--infer-perf", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--names", default="resnet50,bert_base")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window-ms", type=int, default=500)
    ap.add_argument("--stand-in", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.names.split(",") if n]
    batches = [int(b) for b in args.batches.split(",") if b]
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "throughput.log"), "w")

    try:
        import numpy as np
        import onnxruntime as ort
    except ImportError as e:
        ort = np = None
        print(f"gpu_throughput: no onnxruntime here ({e}): libinfer's figures only")
    ort_cuda = ort is not None and "CUDAExecutionProvider" in ort.get_available_providers()
    ort_library = None
    if ort_cuda and not args.stand_in:
        # onnxruntime-gpu loads the CUDA libraries of the nvidia-* wheels where they are.
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        capi = os.path.join(os.path.dirname(ort.__file__), "capi")
        libs = sorted(f for f in os.listdir(capi) if f.startswith("libonnxruntime.so"))
        ort_library = os.path.join(capi, libs[-1]) if libs else None
    if ort is None:
        ref, provider = "ORT CUDA", None
    elif args.stand_in:
        ref, provider = "ORT CPU (stand-in run)", "CPUExecutionProvider"
    elif ort_cuda:
        ref, provider = "ORT CUDA", "CUDAExecutionProvider"
    else:
        ref, provider = "ORT CUDA", None
        print(f"gpu_throughput: onnxruntime {ort.__version__} here has no CUDA execution provider "
              f"({', '.join(ort.get_available_providers())}; onnxruntime-gpu has it): "
              "libinfer's figures only")
    columns = ["libinfer"] + (["libinfer on ORT CUDA"] if ort_library else []) + [ref]

    repo = os.path.join(args.out, "repo")
    files = make_repo(args.models, names, repo, max(batches), bool(ort_library))
    sessions = {}
    failed = []
    results = {n: {str(b): {} for b in batches} for n in names}
    for rnd in range(1, args.rounds + 1):
        for name in names:
            for b in batches:
                r = results[name][str(b)]
                runs = [("libinfer", lambda: infer_perf(args, repo, name, b, None, log))]
                if ort_library:
                    runs.append(("libinfer on ORT CUDA",
                                 lambda: infer_perf(args, repo, name + "_ort", b, ort_library, log)))
                if provider:
                    def ort_run():
                        if name not in sessions:
                            sessions[name] = OrtModel(ort, np, files[name], provider)
                        return sessions[name].samples_per_s(b, args.window_ms / 1000)
                    runs.append((ref, ort_run))
                for column, run in runs:
                    try:
                        v = run()
                    except Exception as e:  # noqa: BLE001 -- every failure is reported
                        failed.append(f"round {rnd}, {name}, batch {b}, {column}: {e}")
                        print(f"FAILED: {failed[-1]}")
                        continue
                    r.setdefault(column, []).append(v)
                    print(f"round {rnd}: {name} batch {b}: {column} {v:,.1f} samples/s", flush=True)
    text = table(names, batches, results, columns, ref)
    note = ("\n(stand-in CUDA libraries: kernels run on the host; the figures mean nothing)"
            if args.stand_in else "")
    print(f"\nSamples/s, one request in flight, median of {args.rounds} round(s){note}\n\n{text}")
    with open(os.path.join(args.out, "throughput.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "throughput.json"), "w") as f:
        json.dump({"rounds": args.rounds, "window_ms": args.window_ms, "results": results,
                   "onnxruntime": getattr(ort, "__version__", None), "ort_library": ort_library,
                   "failed": failed}, f, indent=1)
    if failed:
        print(f"gpu_throughput: {len(failed)} measurement(s) failed:\n  " + "\n  ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
