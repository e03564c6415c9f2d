#!/usr/bin/env python3
"""PyTorch eager on CUDA: the reference for `cargo bench --bench gpu`.

Run with `python3 benches/torch_reference.py` (needs torch with CUDA; without them it
prints `SKIP: <reason>` and exits 0). Same architectures as benches/gpu.rs, random
weights (the timings do not depend on them):

* mlp: 4 Linear layers 4096 -> 4096 with ReLU between, input [batch, 4096];
* cnn: Conv 3x3 8ch pad 1, ReLU, MaxPool 2, Conv 3x3 16ch pad 1, ReLU, MaxPool 2,
  Flatten, Linear 784 -> 10, input [batch, 1, 28, 28] (models/cnn).

FP32 with TF32 off (torch.backends.cuda.matmul.allow_tf32 = False,
torch.backends.cudnn.allow_tf32 = False), as libinfer's GPU executor by default; eval
mode under torch.inference_mode(). Each call is timed with a pair of torch.cuda.Event
(synchronized after every call, one call in flight as with infer_server_infer) after a
warm-up. Tables, with the columns of benches/gpu.rs's latency table:

* host tensors: the input starts in (pageable) host memory and the output is copied back
  to the host inside the timed region, as a libinfer caller's request does;
* device tensors: input and output stay on the GPU (the model alone);
* torch.mm: the MLP's GEMM alone ([batch, 4096] x [4096, 4096]), for the cuBLAS table.

Knobs: the environment variables of benches/gpu.rs (INFER_BENCH_SECONDS,
INFER_BENCH_WARMUP_SECONDS, INFER_BENCH_MIN_ITERS, INFER_BENCH_BATCHES,
INFER_BENCH_MODELS, INFER_BENCH_MLP_WIDTH, INFER_BENCH_TF32), or the flags below.
"""
import argparse
import os
import sys
import time


def env_list(name, default):
    v = os.environ.get(name)
    if not v:
        return default
    return [s.strip() for s in v.split(",") if s.strip()]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--secs", type=float, default=float(os.environ.get("INFER_BENCH_SECONDS", 2.0)),
                    help="measured seconds per row (INFER_BENCH_SECONDS, 2)")
    ap.add_argument("--warmup-secs", type=float,
                    default=float(os.environ.get("INFER_BENCH_WARMUP_SECONDS", 0.5)),
                    help="warm-up seconds per row (INFER_BENCH_WARMUP_SECONDS, 0.5)")
    ap.add_argument("--min-iters", type=int, default=int(os.environ.get("INFER_BENCH_MIN_ITERS", 20)),
                    help="at least this many timed calls per row (INFER_BENCH_MIN_ITERS, 20)")
    ap.add_argument("--batches", default=",".join(env_list("INFER_BENCH_BATCHES", ["1", "8", "64", "256"])),
                    help="batch sizes (INFER_BENCH_BATCHES, 1,8,64,256)")
    ap.add_argument("--models", default=",".join(env_list("INFER_BENCH_MODELS", ["mlp", "cnn"])),
                    help="models (INFER_BENCH_MODELS, mlp,cnn)")
    ap.add_argument("--width", type=int, default=int(os.environ.get("INFER_BENCH_MLP_WIDTH", 4096)),
                    help="the MLP's width (INFER_BENCH_MLP_WIDTH, 4096)")
    ap.add_argument("--tf32", action="store_true",
                    default=os.environ.get("INFER_BENCH_TF32", "0").lower() in ("1", "true"),
                    help="allow TF32 (INFER_BENCH_TF32=1); off by default, as in libinfer")
    ap.add_argument("--precision", default=os.environ.get("INFER_BENCH_PRECISION", "FP32") or "FP32",
                    choices=["FP32", "FP16", "BF16", "fp32", "fp16", "bf16"],
                    help="compute type (INFER_BENCH_PRECISION, FP32); FP16/BF16 convert the model and "
                         "the inputs, and outputs back to FP32, as libinfer's `precision` parameter")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.precision = args.precision.upper()
    return args


MLP_LAYERS = 4


def build(torch, name, width):
    nn = torch.nn
    if name == "mlp":
        layers = []
        for i in range(MLP_LAYERS):
            layers.append(nn.Linear(width, width))
            if i < MLP_LAYERS - 1:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers), (width,), 2.0 * width * width * MLP_LAYERS
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(784, 10),
        ), (1, 28, 28), None
    raise SystemExit(f"unknown model {name!r} (mlp, cnn)")


def time_calls(torch, fn, args):
    """Per-call CUDA-event times (us, sorted) and mean wall-clock time (us) of `fn`."""
    start_ev = torch.cuda.Event(enable_timing=True)
    end_ev = torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    n = 0
    while n < 3 or time.perf_counter() - t < args.warmup_secs:
        fn()
        n += 1
    torch.cuda.synchronize()
    times, walls = [], []
    t0 = time.perf_counter()
    while len(times) < args.min_iters or time.perf_counter() - t0 < args.secs:
        w = time.perf_counter()
        start_ev.record()
        fn()
        end_ev.record()
        end_ev.synchronize()
        walls.append((time.perf_counter() - w) * 1e6)
        times.append(start_ev.elapsed_time(end_ev) * 1e3)
    times.sort()
    return times, sum(walls) / len(walls)


def pct(v, p):
    return v[min(int(len(v) * p), len(v) - 1)]


def row(name, batch, times, wall, flop):
    mean = sum(times) / len(times)
    tf = f"{flop * batch / mean / 1e6:.2f}" if flop else "-"
    print(f"| {name} | {batch} | {len(times)} | {pct(times, 0.5):.1f} | {mean:.1f} | "
          f"{pct(times, 0.99):.1f} | {batch / mean * 1e6:.0f} | {tf} | {wall:.1f} |", flush=True)


HEADER = ("| model | batch | iters | p50 (us) | mean (us) | p99 (us) | samples/s | TFLOP/s | wall mean (us) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def main():
    args = parse_args()
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no reference here
        print(f"SKIP: torch is not available ({e})")
        return 0
    if not torch.cuda.is_available():
        print(f"SKIP: torch {torch.__version__} sees no CUDA device "
              f"(torch.version.cuda = {torch.version.cuda})")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    dev = torch.device("cuda", 0)
    dtype = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[args.precision]
    torch.manual_seed(0)
    print("# PyTorch eager reference")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"GPU 0: {torch.cuda.get_device_name(0)}")
    print(f"measured {args.secs} s per row after {args.warmup_secs} s of warm-up (at least "
          f"{args.min_iters} calls); batches {args.batches}; "
          f"{args.precision if args.precision != 'FP32' else ('TF32 allowed' if args.tf32 else 'FP32 (no TF32)')}; cudnn.benchmark "
          f"{torch.backends.cudnn.benchmark}")
    print()

    models = []
    for name in args.models:
        model, row_shape, flop = build(torch, name, args.width)
        models.append((name, model.to(device=dev, dtype=dtype).eval(), row_shape, flop))

    with torch.inference_mode():
        print("## host tensors: input from pageable host memory, output copied back (as infer_server_infer)")
        print(HEADER)
        for name, model, row_shape, flop in models:
            for batch in args.batches:
                x_host = torch.rand((batch, *row_shape)) * 2 - 1

                def call(model=model, x_host=x_host):
                    return model(x_host.to(dev).to(dtype)).float().cpu()

                times, wall = time_calls(torch, call, args)
                row(name, batch, times, wall, flop)
        print()

        print("## device tensors: input and output on the GPU (the model alone)")
        print(HEADER)
        for name, model, row_shape, flop in models:
            for batch in args.batches:
                x = (torch.rand((batch, *row_shape), device=dev) * 2 - 1).to(dtype)

                def call(model=model, x=x):
                    return model(x)

                times, wall = time_calls(torch, call, args)
                row(name, batch, times, wall, flop)
        print()

        if any(m[0] == "mlp" for m in models):
            w = args.width
            print(f"## torch.mm: the MLP's GEMM alone, [batch, {w}] x [{w}, {w}], device tensors")
            print(HEADER)
            weight = (torch.rand((w, w), device=dev) * 2 - 1).to(dtype)
            for batch in args.batches:
                x = (torch.rand((batch, w), device=dev) * 2 - 1).to(dtype)

                def call(x=x):
                    return torch.mm(x, weight)

                times, wall = time_calls(torch, call, args)
                row("mm", batch, times, wall, 2.0 * w * w)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
