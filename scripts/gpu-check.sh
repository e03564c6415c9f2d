#!/usr/bin/env bash
# Validates libinfer on a real NVIDIA GPU: the GPU test suite (tests/gpu.rs, which runs its
# device checks only where a GPU is usable), ONNX's node test cases on the GPU executor
# (and under compute-sanitizer's memcheck, racecheck and synccheck where it is installed),
# real packaged models and random-weight ResNet-50- and BERT-base-shaped networks against
# onnxruntime, a GEMM under each precision (FP32, TF32, FP16, BF16) against float64 within
# the precision's error bound (scripts/random_models.py), the ONNX suites a default
# server runs (GPU use AUTO) on a machine that has a GPU, and the throughput of those
# networks at batch 1, 8 and 64 against ONNX Runtime's CUDA execution provider where the
# onnxruntime package here has it (scripts/gpu_throughput.py).
#
#   scripts/gpu-check.sh                       build here (cargo) and run here
#   scripts/gpu-check.sh --pack DIR            build here, write to DIR what a GPU machine
#                                              without Rust needs (stripped test binaries and
#                                              infer-perf in one archive, the prepared ONNX
#                                              cases, the packaged models and the stand-in
#                                              run's conformance report: about 40 MiB)
#   scripts/gpu-check.sh --prebuilt DIR        run what --pack wrote to DIR
#   scripts/gpu-check.sh --stand-in DIR        build here, run against the stand-in CUDA
#                                              libraries of tests/fixtures/build_fakes.sh DIR
#                                              (scripts/test.sh does: the script's own test)
#
# On a machine without an NVIDIA driver (and not --stand-in) it says so in one line and
# exits 0.
# Options: --out DIR (logs and reports; default target/gpu-check), --quick (the GPU suite
# and the conformance only), --bench (also benches/gpu.rs and benches/torch_reference.py,
# interleaved, two rounds; GPU_CHECK_TORCH=0 leaves PyTorch out), --bench-only (the
# benchmarks alone). Needs on the GPU machine: the NVIDIA driver (CUDA 12 or newer),
# NVRTC and cuBLAS (found by the loader, or in the CUDA toolkit's or the nvidia-* Python
# wheels' folders, which this script adds), a C compiler for the stand-in checks, a Python
# with numpy, onnx and onnxruntime for the random-weight models (GPU_CHECK_PYTHON names
# one; without onnxruntime only the GEMMs run, without onnx none; with onnxruntime-gpu,
# the throughput step also times ONNX Runtime's CUDA provider).
#
# Steps, smallest first: the machine (driver, compute capability, the CUDA files found);
# gpu (the probe, NVRTC for the device's architecture, timed, and the GPU suite);
# conformance_gpu (every node case) and conformance_diff (by kernel family, and each case
# against the stand-in run's outcome); memcheck, racecheck, synccheck; packaged_gpu;
# random_models_* (the GEMM precisions, ResNet-50 and BERT-base against onnxruntime);
# throughput; onnx_backend and onnx_models.
# Exit status 0 only when every step passed; the summary names each step's outcome.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODE=build PACK_DIR="" PREBUILT="" OUT="$ROOT/target/gpu-check" QUICK=0 BENCH=0 CHECKS=1
STAND_IN=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pack) MODE=pack PACK_DIR=$2; shift 2 ;;
        --prebuilt) MODE=prebuilt PREBUILT=$2; shift 2 ;;
        --stand-in) STAND_IN=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --bench) BENCH=1; shift ;;
        --bench-only) BENCH=1 CHECKS=0; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [[ -n $STAND_IN ]]; then
    STAND_IN=$(cd "$STAND_IN" && pwd) || exit 2
    export LD_LIBRARY_PATH="$STAND_IN" INFER_FAKE_CUDA=one
elif [[ $MODE != pack ]] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 ' &&
    ! compgen -G "/usr/local/nvidia/lib64/libcuda.so.1" >/dev/null &&
    ! command -v nvidia-smi >/dev/null; then
    echo "gpu-check: no NVIDIA driver on this machine (no libcuda.so.1, no nvidia-smi): nothing to check"
    exit 0
fi

SUITES=(gpu onnx_conformance onnx_backend onnx_models onnx_packaged)
# The real models of tests/onnx_packaged.rs (scripts/test.sh downloads them) that --pack
# takes along; those on operators the GPU executor lacks (LSTM, If) are left behind.
PACKAGED=${GPU_CHECK_PACKAGED:-ppocr_cls ppocr_det ppocr_rec magika}

# Builds the suites in release and prints "name path" for each test binary.
build_suites() {
    local args=() s
    for s in "${SUITES[@]}"; do args+=(--test "$s"); done
    cargo test --release --workspace --no-run --message-format=json "${args[@]}" 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])'
}

# The GPU benchmark's binary (benches/gpu.rs).
build_bench() {
    cargo bench --bench gpu --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "bench" in m["target"]["kind"]:
        print(m["executable"])'
}

# infer-perf (tools/infer-perf), which the throughput step drives.
build_perf() {
    cargo build --release --workspace --bin infer-perf --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "infer-perf":
        print(m["executable"])'
}

# The ONNX node cases, prepared as scripts/test.sh prepares them.
prepare_conformance() {
    # shellcheck source=scripts/lib.sh
    source scripts/lib.sh
    TARGET_DIR=${CARGO_TARGET_DIR:-target}
    local venv="$TARGET_DIR/onnx-venv" out="$ROOT/$TARGET_DIR/onnx-conformance"
    onnx_python "$venv" >&2
    "$venv/bin/python" scripts/onnx_conformance.py "$out" >&2
    echo "$out"
}

if [[ $MODE == pack ]]; then
    mkdir -p "$PACK_DIR"
    PACK_DIR=$(cd "$PACK_DIR" && pwd)
    cargo build --release --workspace >/dev/null 2>&1 || true
    # The test binaries are mostly the same library: one archive, compressed in one
    # stream with a dictionary wider than a binary, stores it about once (19 MiB for six
    # binaries of 41 MiB, where one file each took 48 MiB).
    bins=$(mktemp -d)
    build_suites | while read -r name exe; do
        echo "-- $name: $exe"
        strip -o "$bins/$name" "$exe"
    done
    bench=$(build_bench)
    [[ -n $bench ]] && strip -o "$bins/bench_gpu" "$bench"
    perf=$(build_perf)
    [[ -n $perf ]] && strip -o "$bins/infer_perf" "$perf"
    rm -f "$PACK_DIR"/*.xz
    (cd "$bins" && tar -cf - ./*) | xz -T1 --lzma2=preset=6,dict=96MiB >"$PACK_DIR/binaries.tar.xz"
    rm -rf "$bins"
    cases=$(prepare_conformance)
    tar -C "$(dirname "$cases")" --exclude='report*.tsv' -cJf "$PACK_DIR/onnx-conformance.tar.xz" \
        "$(basename "$cases")"
    packaged="$ROOT/${CARGO_TARGET_DIR:-target}/packaged/models"
    if [[ -d $packaged ]]; then
        # shellcheck disable=SC2086
        tar -C "$packaged" -cJf "$PACK_DIR/packaged.tar.xz" $PACKAGED
    else
        echo "-- no $packaged (run scripts/test.sh first): the packaged models stay behind"
    fi
    # The node cases' outcomes against the stand-in (scripts/test.sh's gpu-check step), for
    # the device run to be compared with.
    standin_report="$ROOT/${CARGO_TARGET_DIR:-target}/gpu-check-standin/report_gpu.tsv"
    rm -f "$PACK_DIR/standin_report_gpu.tsv"
    if [[ -f $standin_report ]]; then
        cp "$standin_report" "$PACK_DIR/standin_report_gpu.tsv"
    else
        echo "-- no $standin_report (run scripts/test.sh first): the device run's conformance is not compared with the stand-in's"
    fi
    # The test binaries read fixtures and models from the checkout they were built in.
    echo "$ROOT" >"$PACK_DIR/manifest_dir"
    du -sh "$PACK_DIR"/*
    exit 0
fi

mkdir -p "$OUT"
declare -A BIN
CASES="" MODELS="" STANDIN_REPORT=""
if [[ $MODE == prebuilt ]]; then
    PREBUILT=$(cd "$PREBUILT" && pwd)
    work=$(mktemp -d)
    tar -C "$work" -xJf "$PREBUILT/binaries.tar.xz" || echo "gpu-check: cannot unpack $PREBUILT/binaries.tar.xz"
    for s in "${SUITES[@]}" bench_gpu infer_perf; do
        [[ -f $work/$s ]] && chmod +x "$work/$s" && BIN[$s]=$work/$s
    done
    tar -C "$work" -xJf "$PREBUILT/onnx-conformance.tar.xz" && CASES=$work/onnx-conformance
    [[ -f $PREBUILT/standin_report_gpu.tsv ]] && STANDIN_REPORT=$PREBUILT/standin_report_gpu.tsv
    if [[ -f $PREBUILT/packaged.tar.xz ]]; then
        mkdir -p "$work/packaged" && tar -C "$work/packaged" -xJf "$PREBUILT/packaged.tar.xz" &&
            MODELS=$work/packaged
    fi
    built_in=$(cat "$PREBUILT/manifest_dir")
    if [[ $built_in != "$ROOT" && ! -e $built_in ]]; then
        mkdir -p "$(dirname "$built_in")" && ln -s "$ROOT" "$built_in" ||
            echo "gpu-check: cannot link $built_in to $ROOT; suites that read fixtures will fail"
    fi
else
    while read -r name exe; do BIN[$name]=$exe; done < <(build_suites)
    [[ $BENCH == 1 ]] && BIN[bench_gpu]=$(build_bench)
    BIN[infer_perf]=$(build_perf)
    if [[ -z $STAND_IN ]]; then
        r="$ROOT/${CARGO_TARGET_DIR:-target}/gpu-check-standin/report_gpu.tsv"
        [[ -f $r ]] && STANDIN_REPORT=$r
    fi
    CASES=$(prepare_conformance)
    packaged="$ROOT/${CARGO_TARGET_DIR:-target}/packaged/models"
    if [[ -d $packaged && -n $STAND_IN ]]; then
        # The stand-in runs kernels on the host: the two quickest models.
        MODELS=$(mktemp -d)
        for m in ${GPU_CHECK_STANDIN_PACKAGED:-ppocr_cls magika}; do
            [[ -d $packaged/$m ]] && ln -s "$packaged/$m" "$MODELS/$m"
        done
    elif [[ -d $packaged ]]; then
        MODELS=$packaged
    fi
fi

# The Python that writes scripts/random_models.py's models: one with numpy and onnx (and
# onnxruntime for the networks' references): the GPU machine's own python3 where the
# binaries were built elsewhere, else the conformance's environment.
RANDOM_PY=""
for py in ${GPU_CHECK_PYTHON:-} $([[ $MODE == prebuilt ]] && echo python3) \
    "$ROOT/${CARGO_TARGET_DIR:-target}/onnx-venv/bin/python" python3; do
    if "$py" -c 'import numpy, onnx' 2>/dev/null; then RANDOM_PY=$py; break; fi
done
[[ -z $RANDOM_PY ]] && echo "gpu-check: no Python with numpy and onnx here: the random-weight models are left out"

# ---- the machine
NVRTC_DIR=""
if [[ -n $STAND_IN ]]; then
    echo "== $(date -u +%FT%TZ) $(uname -srm): the stand-in CUDA libraries of $STAND_IN" |
        tee "$OUT/machine.txt"
else
    {
        echo "== $(date -u +%FT%TZ) $(uname -srm)"
        nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 ||
            echo "nvidia-smi: not available"
        echo "libcuda: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1 ' || echo 'not in the loader cache')"
    } | tee "$OUT/machine.txt"

    # NVRTC and cuBLAS: where the loader finds them, else the toolkit's or the wheels'
    # folders (added to LD_LIBRARY_PATH).
    have_lib() {
        ldconfig -p 2>/dev/null | grep -q "$1" && return 0
        local d
        IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
        for d in "${dirs[@]}"; do compgen -G "$d/$1*" >/dev/null && return 0; done
        return 1
    }
    extra=()
    for d in ${CUDA_HOME:+$CUDA_HOME/lib64} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        $(python3 -c 'import nvidia, os; [print(os.path.join(p, s)) for p in nvidia.__path__ for s in ("cu13/lib", "cuda_nvrtc/lib", "cublas/lib")]' 2>/dev/null); do
        [[ -d $d ]] || continue
        d=$(cd "$d" && pwd -P)
        [[ " ${extra[*]} " == *" $d "* ]] && continue
        if compgen -G "$d/libnvrtc.so*" >/dev/null || compgen -G "$d/libcublas.so*" >/dev/null; then
            extra+=("$d")
        fi
    done
    if ! have_lib libnvrtc.so || ! have_lib libcublas.so; then
        for d in "${extra[@]}"; do LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; done
        export LD_LIBRARY_PATH
    fi
    for d in "${extra[@]}"; do compgen -G "$d/libnvrtc.so*" >/dev/null && NVRTC_DIR=$d && break; done
    {
        echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        for d in "${extra[@]}"; do echo "found in $d: $(cd "$d" && ls libnvrtc.so* libcublas.so* 2>/dev/null | tr '\n' ' ')"; done
    } | tee -a "$OUT/machine.txt"
fi
[[ -z $STAND_IN ]] && unset INFER_FAKE_CUDA
unset INFER_ONNXRUNTIME_LIBRARY

declare -A RESULT
step() { # name timeout command...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T))"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    RESULT[$name]="rc $rc, $((SECONDS - t0)) s"
    [[ $rc == 124 || $rc == 137 ]] && RESULT[$name]+=" (timed out)"
    grep -E '^test result|SKIP|passed|FAILED|panicked|\(gpu\)|CUBIN of|^kernels compiled' "$OUT/$name.log" |
        cut -c1-300 | tail -25
    return 0
}

if [[ $CHECKS == 1 ]]; then
# kernels_compile_with_nvrtc compiles for every architecture through NVRTC_DIR's NVRTC.
nvrtc_env=()
[[ -n $NVRTC_DIR ]] && nvrtc_env=(INFER_NVRTC_LIB_DIR="$NVRTC_DIR")
step gpu 200 env "${nvrtc_env[@]}" "${BIN[gpu]}" --test-threads=4 --nocapture
if [[ -n $CASES ]]; then
    step conformance_gpu 300 env INFER_ONNX_CONFORMANCE_GPU=1 INFER_ONNX_CONFORMANCE_DIR="$CASES" \
        INFER_ONNX_CONFORMANCE_TIMEOUT_S=10 "${BIN[onnx_conformance]}" --nocapture
    cp "$CASES/report_gpu.tsv" "$OUT/" 2>/dev/null
    # The cases by kernel family, and each case's outcome against the stand-in run's.
    if [[ -f $OUT/report_gpu.tsv ]]; then
        step conformance_diff 60 python3 scripts/gpu_conformance.py "$OUT/report_gpu.tsv" \
            ${STANDIN_REPORT:+--stand-in "$STANDIN_REPORT"}
        grep -E '^\| \(all\)|differ|^  test_|failed here|no stand-in' "$OUT/conformance_diff.log" | head -30
    fi
fi
# compute-sanitizer's memcheck over the node cases of the kernel families (where the
# CUDA toolkit is installed): out-of-bounds and misaligned accesses, which the GPU may
# otherwise let pass unnoticed.
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [[ -n $CASES && -n $SANITIZER && $QUICK == 0 && -z $STAND_IN ]]; then
    step memcheck 240 env INFER_ONNX_CONFORMANCE_GPU=1 INFER_ONNX_CONFORMANCE_DIR="$CASES" \
        INFER_ONNX_CONFORMANCE_TIMEOUT_S=60 \
        INFER_ONNX_CONFORMANCE_FILTER="${GPU_CHECK_MEMCHECK_FILTER:-conv,gemm,matmul,pool,reduce,softmax,gather,scatter,resize,pad,slice,concat,transpose,layer_norm,attention,topk,cumsum,lstm,einsum,split,tile,where,cast}" \
        "$SANITIZER" --tool memcheck --error-exitcode 1 --print-limit 20 \
        "${BIN[onnx_conformance]}" --nocapture
    grep -E "ERROR SUMMARY|Invalid|Misaligned" "$OUT/memcheck.log" | head -20
    # racecheck (shared-memory hazards between a block's threads) and synccheck (barriers
    # that not every thread reaches) over the families whose kernels share memory.
    for tool in racecheck synccheck; do
        step "$tool" 120 env INFER_ONNX_CONFORMANCE_GPU=1 INFER_ONNX_CONFORMANCE_DIR="$CASES" \
            INFER_ONNX_CONFORMANCE_TIMEOUT_S=60 \
            INFER_ONNX_CONFORMANCE_FILTER="${GPU_CHECK_RACECHECK_FILTER:-gemm,matmul,reduce,softmax,layer_norm,topk,cumsum,conv,attention,einsum}" \
            "$SANITIZER" --tool "$tool" --error-exitcode 1 --print-limit 20 \
            "${BIN[onnx_conformance]}" --nocapture
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|Barrier" "$OUT/$tool.log" | head -10
    done
fi
if [[ -n $MODELS ]]; then
    # Real models on KIND_GPU instances against onnxruntime's outputs (the references
    # were computed where the models were prepared).
    step packaged_gpu 200 env INFER_PACKAGED_ENGINE=gpu INFER_PACKAGED_MODELS_DIR="$MODELS" \
        "${BIN[onnx_packaged]}" --nocapture
fi
if [[ $QUICK == 0 && -n $RANDOM_PY ]]; then
    # Random-weight ResNet-50- and BERT-base-shaped networks against onnxruntime on the
    # CPU, and a GEMM under each precision (FP32, TF32, FP16, BF16) against float64 with
    # the precision's error bound (scripts/random_models.py; smaller shapes on the
    # stand-in, which computes on the host). Every model must load on the GPU.
    random_dir=$(mktemp -d)
    small=()
    [[ -n $STAND_IN ]] && small=(--small)
    step random_models_prepare 300 "$RANDOM_PY" scripts/random_models.py "$random_dir" "${small[@]}"
    cat "$OUT/random_models_prepare.log"
    if [[ ${RESULT[random_models_prepare]} == "rc 0,"* ]]; then
        step random_models_gpu 300 env INFER_PACKAGED_ENGINE=gpu INFER_PACKAGED_ALL_LOAD=1 \
            INFER_PACKAGED_MODELS_DIR="$random_dir" "${BIN[onnx_packaged]}" --nocapture
        # The two networks at batch 1, 8 and 64: libinfer's executor, and ONNX Runtime's
        # CUDA provider (in Python, and under libinfer) where onnxruntime-gpu is here.
        if [[ -n ${BIN[infer_perf]:-} && -f $random_dir/resnet50/1/model.onnx ]]; then
            tput=(--batches 1,8,64 --rounds 2 --window-ms 500)
            [[ -n $STAND_IN ]] && tput=(--batches 1,8 --rounds 1 --window-ms 300 --stand-in)
            step throughput 600 "$RANDOM_PY" scripts/gpu_throughput.py \
                --infer-perf "${BIN[infer_perf]}" --models "$random_dir" --out "$OUT/throughput" \
                "${tput[@]}"
            sed -n '/^Samples\/s/,$p' "$OUT/throughput.log"
        fi
    fi
fi
if [[ $QUICK == 0 ]]; then
    step onnx_backend 100 "${BIN[onnx_backend]}" --test-threads=4
    step onnx_models 100 "${BIN[onnx_models]}" --test-threads=4
fi

fi # CHECKS

if [[ $BENCH == 1 ]]; then
    # libinfer's GPU executor and PyTorch eager on the same architectures, interleaved
    # (A, B, A, B): docs/PERFORMANCE.md "GPU" says what each table means.
    for round in 1 2; do
        if [[ -n ${BIN[bench_gpu]:-} ]]; then
            step "bench_libinfer_$round" 240 "${BIN[bench_gpu]}" --bench
            cat "$OUT/bench_libinfer_$round.log"
        fi
        if [[ ${GPU_CHECK_TORCH:-1} == 1 ]] &&
            python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
            step "bench_torch_$round" 240 python3 benches/torch_reference.py
            cat "$OUT/bench_torch_$round.log"
        fi
    done
fi

echo "== summary${STAND_IN:+ (against the stand-in CUDA libraries of $STAND_IN)}"
{
    echo "| step | verdict | exit status, seconds |"
    echo "|---|---|---|"
    for k in "${!RESULT[@]}"; do
        verdict=FAIL
        [[ ${RESULT[$k]} == "rc 0,"* ]] && verdict=pass
        echo "| $k | $verdict | ${RESULT[$k]} |"
    done | sort
} | tee "$OUT/summary.txt"
grep -q '| FAIL |' "$OUT/summary.txt" && exit 1
[[ ${#RESULT[@]} -gt 0 ]] || { echo "gpu-check: no step ran"; exit 1; }
exit 0
