#!/usr/bin/env bash
# Runs every check: formatting, clippy, the Rust tests (release, including the header
# test), ONNX conformance (on the ONNX backend, and on the GPU executor against the
# stand-in CUDA libraries), real ONNX models from PyPI packages against onnxruntime, the
# kernels through NVRTC (installed from PyPI), the
# exported-symbol check, the C API tests, the C and C++
# examples under CTest, the C++ (GoogleTest) and Go binding tests, the installed package,
# and the C tests and examples under AddressSanitizer and valgrind.
# Installs gcc, cmake, ninja (apt-get) and rustfmt, clippy (rustup) only when missing.
# Each step's full output is kept in $TARGET_DIR/test-logs/; the closing summary repeats
# the runners' own result lines.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

LOGS="$TARGET_DIR/test-logs"
# The GPU executor's compiled kernels (src/cuda/kernel_cache.rs) stay in the build folder,
# not in the user's ~/.cache.
case "$TARGET_DIR" in /*) kernel_cache="$TARGET_DIR/kernel-cache" ;; *) kernel_cache="$PWD/$TARGET_DIR/kernel-cache" ;; esac
export INFER_KERNEL_CACHE="${INFER_KERNEL_CACHE:-$kernel_cache}"
C_TESTS="$TARGET_DIR/c-tests"
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log

steps=()    # "name|status"
bold="" plain=""
if [[ -t 1 ]]; then bold=$'\033[1m' plain=$'\033[0m'; fi
current=""

# step NAME COMMAND...: runs one step, its output both shown and logged to $LOGS/NAME.log.
step() {
    local name="$1"
    shift
    current="$name"
    printf '\n%s== %s%s\n' "$bold" "$name" "$plain"
    "$@" 2>&1 | tee "$LOGS/$name.log"
    steps+=("$name|ok")
    current=""
}

build_c_tests() {
    mkdir -p "$C_TESTS"
    gcc -std=c11 -Wall -Wextra -Werror -O1 -g -pthread -Iinclude \
        tests/c/test_api.c tests/c/test_scheduling.c tests/c/test_sequence.c \
        -L"$LIB_DIR" -linfer -Wl,-rpath,'$ORIGIN' -o "$C_TESTS/c_api_tests"
    # The programs ask for the soname, libinfer.so.0; cargo writes libinfer.so.
    ln -sf "$LIB_DIR/libinfer.so" "$C_TESTS/libinfer.so.0"
    echo "built $C_TESTS/c_api_tests"
}

# ONNX's node test cases on the ONNX backend: prepares them into $TARGET_DIR/onnx-conformance
# (again only when onnx or the script changed) and runs tests/onnx_conformance.rs on them.
onnx_conformance() {
    local venv="$TARGET_DIR/onnx-venv" out="$TARGET_DIR/onnx-conformance"
    case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
    onnx_python "$venv"
    "$venv/bin/python" scripts/onnx_conformance.py "$out"
    # On tract (`backend: "tract"`).
    env -u INFER_ONNXRUNTIME_LIBRARY INFER_ONNX_CONFORMANCE_DIR="$out" \
        cargo test --release --workspace --test onnx_conformance -- --nocapture
    # On ONNX Runtime (required: a run that cannot load it fails).
    if ensure_onnxruntime "$TARGET_DIR/onnxruntime"; then
        INFER_ONNXRUNTIME_LIBRARY="$ORT_LIB" INFER_ONNX_CONFORMANCE_ENGINE=onnxruntime \
            INFER_ONNX_CONFORMANCE_DIR="$out" cargo test --release --workspace --test onnx_conformance -- --nocapture
    else
        echo "SKIP: the ONNX Runtime conformance run (no ONNX Runtime)"
    fi
    # The same cases on the GPU executor: in the gpu-check step (scripts/gpu-check.sh).
}

# scripts/gpu-check.sh against the stand-in CUDA libraries (the kernels built for the
# host): the GPU suite, the node cases on the GPU executor, real models on KIND_GPU and the
# ONNX suites as a GPU machine runs them; the script that validates a real GPU, tested.
gpu_check_standin() {
    local fakes="$TARGET_DIR/fake-cuda"
    case "$fakes" in /*) ;; *) fakes="$PWD/$fakes" ;; esac
    sh tests/fixtures/build_fakes.sh "$fakes"
    scripts/gpu-check.sh --stand-in "$fakes" --out "$TARGET_DIR/gpu-check-standin"
}

# Every suite as a machine with one GPU runs it: against the stand-in CUDA libraries,
# KIND_AUTO places ONNX models on the GPU executor and tests/gpu.rs takes its GPU branches.
standin_gpu_tests() {
    local fakes="$TARGET_DIR/fake-cuda"
    case "$fakes" in /*) ;; *) fakes="$PWD/$fakes" ;; esac
    sh tests/fixtures/build_fakes.sh "$fakes"
    env -u INFER_ONNXRUNTIME_LIBRARY LD_LIBRARY_PATH="$fakes" INFER_FAKE_CUDA=one \
        cargo test --release --workspace
}

# The kernels of the GPU executor through the real NVRTC (from PyPI; no GPU needed): NVRTC
# 13 for every architecture the library serves, and NVRTC 12.2 (what a machine with a
# CUDA 12 driver compiles with) for those it knows. Where PyPI cannot be reached, says so
# and skips.
NVRTC_VERSION=13.0.88
NVRTC12_VERSION=12.2.140
# Installs pip package $2 into folder $1 (in the onnx venv's pip) unless $3 is there.
install_nvrtc() {
    local dir=$1 package=$2 marker=$3
    [[ -f $marker ]] && return 0
    onnx_python "$TARGET_DIR/onnx-venv"
    echo "-- installing $package into $dir"
    "$TARGET_DIR/onnx-venv/bin/python" -m pip install -q --disable-pip-version-check \
        --target "$dir" "$package"
}

nvrtc_check() {
    local dir="$TARGET_DIR/nvrtc" dir12="$TARGET_DIR/nvrtc12"
    case "$dir" in /*) ;; *) dir="$PWD/$dir" dir12="$PWD/$dir12" ;; esac
    if ! install_nvrtc "$dir" "nvidia-cuda-nvrtc==$NVRTC_VERSION" \
        "$dir/nvidia/cu13/lib/libnvrtc.so.13"; then
        echo "SKIP: NVRTC could not be installed from PyPI; the kernels were not compiled"
        return 0
    fi
    INFER_NVRTC_LIB_DIR="$dir/nvidia/cu13/lib" \
        cargo test --release --workspace --test gpu kernels_compile_with_nvrtc -- --nocapture || return 1
    if ! install_nvrtc "$dir12" "nvidia-cuda-nvrtc-cu12==$NVRTC12_VERSION" \
        "$dir12/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"; then
        echo "SKIP: NVRTC 12 could not be installed from PyPI; the kernels were not compiled with it"
        return 0
    fi
    INFER_NVRTC_LIB_DIR="$dir12/nvidia/cuda_nvrtc/lib" INFER_NVRTC_ARCHS=75,80,86,89,90 \
        cargo test --release --workspace --test gpu kernels_compile_with_nvrtc -- --nocapture
}

# Real ONNX models shipped inside public PyPI packages (tests/onnx_packaged.rs), against
# onnxruntime's outputs: the pinned wheels are downloaded once into $TARGET_DIR/packaged,
# onnxruntime goes into the onnx venv to compute the references. Where PyPI cannot be
# reached, says so and skips.
DDDDOCR_VERSION=1.6.1
# The other wheels scripts/packaged_models.py takes its models from.
RAPIDOCR_ORT_VERSION=1.4.4
SILERO_VAD_VERSION=6.2.3
MAGIKA_VERSION=1.0.3
packaged_models() {
    local venv="$TARGET_DIR/onnx-venv" wheels="$TARGET_DIR/packaged/wheels"
    local out="$TARGET_DIR/packaged/models"
    case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
    onnx_python "$venv"
    if ! "$venv/bin/python" -c "import onnxruntime, sys; sys.exit(onnxruntime.__version__ != '$ORT_VERSION')" 2>/dev/null; then
        echo "-- installing onnxruntime==$ORT_VERSION into $venv"
        if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "onnxruntime==$ORT_VERSION"; then
            echo "SKIP: onnxruntime could not be installed from PyPI; the packaged models were not run"
            return 0
        fi
    fi
    # package==version and the wheel's file name (a glob: magika's wheels are per platform).
    local pin spec file
    for pin in "ddddocr==$DDDDOCR_VERSION|ddddocr-$DDDDOCR_VERSION-py3-none-any.whl" \
        "rapidocr-onnxruntime==$RAPIDOCR_ORT_VERSION|rapidocr_onnxruntime-$RAPIDOCR_ORT_VERSION-py3-none-any.whl" \
        "silero-vad==$SILERO_VAD_VERSION|silero_vad-$SILERO_VAD_VERSION-py3-none-any.whl" \
        "magika==$MAGIKA_VERSION|magika-$MAGIKA_VERSION-*.whl"; do
        spec="${pin%%|*}" file="${pin#*|}"
        compgen -G "$wheels/$file" >/dev/null && continue
        echo "-- downloading $spec into $wheels"
        if ! "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
            --only-binary=:all: -d "$wheels" "$spec"; then
            echo "SKIP: $spec could not be downloaded from PyPI; the packaged models were not run"
            return 0
        fi
    done
    "$venv/bin/python" scripts/packaged_models.py "$wheels" "$out"
    if ! ensure_onnxruntime "$TARGET_DIR/onnxruntime"; then
        echo "SKIP: no ONNX Runtime; the packaged models were not run"
        return 0
    fi
    INFER_ONNXRUNTIME_LIBRARY="$ORT_LIB" INFER_PACKAGED_MODELS_DIR="$out" \
        cargo test --release --workspace --test onnx_packaged -- --nocapture
    # The same models on tract: each matches or is refused at load (UNSUPPORTED).
    env -u INFER_ONNXRUNTIME_LIBRARY INFER_PACKAGED_ENGINE=tract INFER_PACKAGED_MODELS_DIR="$out" \
        cargo test --release --workspace --test onnx_packaged -- --nocapture
}

# Llama-family decoders (tests/llama.rs and the Llama cases of tests/generative.rs)
# against an independent numpy reference: scripts/make_llama.py writes random-weight
# Llama and Qwen2 models as Hugging Face folders and GGUF files in every weight type
# (seconds, in the pinned Python packages), then the reference of each set of weights.
llama_models() {
    local venv="$TARGET_DIR/llm-venv" out="$TARGET_DIR/llm-models"
    case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
    if ! llm_python "$venv"; then
        echo "SKIP: the Python packages could not be installed from PyPI; the Llama reference checks were not run"
        return 0
    fi
    local py="$venv/bin/python" prompt="3,17,101,45,200,7,9,311,42,5,77,128" spec name args d r
    for spec in "tiny-llama|--arch llama --shape tiny --rope-scaling llama3 --attention-bias"         "small-llama|--arch llama --shape small --pre gpt-2"         "small-qwen2|--arch qwen2 --shape small" \
        "small-qwen2-quantized|--arch qwen2 --shape small --weights q8_0 --weights q4_k" \
        "tiny-llama2|--arch llama --shape tiny --vocab spm --weights f16 --weights q8_0 --weights q4_k"; do
        name="${spec%%|*}" args="${spec#*|}" d="$out/$name"
        # shellcheck disable=SC2086
        [[ -f "$d/text-cases.json" ]] || "$py" scripts/make_llama.py make --out "$d" $args
        for r in "$d"/hf "$d"/hf-*; do
            [[ -f "$d/ref-$(basename "$r").json" ]] && continue
            "$py" scripts/make_llama.py reference --model "$r" --tokens "$prompt" --generate 12 --all \
                --out "$d/ref-$(basename "$r").json" >/dev/null
        done
    done
    INFER_LLAMA_MODELS_DIR="$out" cargo test --release --workspace --test llama -- --nocapture
    INFER_LLAMA_MODELS_DIR="$out" cargo test --release --workspace --test generative llama_family -- --nocapture
}

# The ONNX backend's behaviour tests again, with ONNX Runtime as the engine (the main
# cargo test run has none: ONNX models run on tract there).
onnxruntime_tests() {
    if ! ensure_onnxruntime "$TARGET_DIR/onnxruntime"; then
        echo "SKIP: no ONNX Runtime; the ONNX backend tests ran on tract only"
        return 0
    fi
    # onnxruntime-gpu's library too, for which engine runs GPU instances where it loads.
    local gpu_env=()
    if ensure_onnxruntime_gpu "$TARGET_DIR/onnxruntime-gpu"; then
        gpu_env=(INFER_ONNXRUNTIME_GPU_LIBRARY="$ORT_GPU_LIB")
    else
        echo "SKIP: no onnxruntime-gpu; its engine choice is not checked"
    fi
    env "${gpu_env[@]}" INFER_ONNXRUNTIME_LIBRARY="$ORT_LIB" \
        cargo test --release --workspace --test onnx_backend --test onnx_models --test onnxruntime
}

summary() {
    local rc=$?
    [[ -n "$current" ]] && steps+=("$current|FAILED")
    printf '\n%s== summary%s\n' "$bold" "$plain"
    for s in "${steps[@]}"; do
        printf '  %-14s %s\n' "${s%%|*}" "${s##*|}"
    done
    if [[ -f "$LOGS/cargo-test.log" ]]; then
        echo "cargo test --release:"
        # Each "test result:" line, after the name of the test binary it belongs to.
        awk '/^ *Running / { name = ($2 == "unittests") ? $3 : $2 }
             /^ *Doc-tests / { name = "doc-tests " $2 }
             /^test result:/ { printf "  %-28s %s\n", name, $0 }' "$LOGS/cargo-test.log"
    fi
    if [[ -f "$LOGS/onnx-conformance.log" ]]; then
        echo "ONNX node test cases (onnx $ONNX_VERSION):"
        grep -E '^onnx conformance( \([A-Za-z ]+\))?: passed' "$LOGS/onnx-conformance.log" | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/gpu-check.log" ]]; then
        echo "scripts/gpu-check.sh against the stand-in CUDA libraries:"
        grep -E '^onnx conformance \(GPU\): passed|^\| [a-z_]+ \| (pass|FAIL) ' "$LOGS/gpu-check.log" | cut -c1-160 | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/packaged-models.log" ]]; then
        echo "ONNX models from PyPI packages, against onnxruntime $ORT_VERSION:"
        grep -E '^[a-z_]+( \(tract\))?: ([0-9]+ requests over|refused)|^SKIP' "$LOGS/packaged-models.log" | cut -c1-160 | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/llama-models.log" ]]; then
        echo "Llama-family models against the numpy reference:"
        grep -E 'model runs matched|tokenizers matched|^SKIP' "$LOGS/llama-models.log" | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/nvrtc.log" ]]; then
        echo "kernels through NVRTC $NVRTC_VERSION:"
        grep -E '^(sm_[0-9]+: CUBIN|kernels compiled|SKIP)' "$LOGS/nvrtc.log" | sed 's/^/  /' || true
    fi
    [[ -f "$LOGS/symbols.log" ]] && sed 's/^/  /' "$LOGS/symbols.log"
    if [[ -f "$LOGS/c-tests.log" ]]; then
        echo "C API tests:"
        grep -E '^[0-9]+ passed, [0-9]+ failed$' "$LOGS/c-tests.log" | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/ctest.log" ]]; then
        echo "ctest:"
        grep -E 'tests passed|tests failed' "$LOGS/ctest.log" | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/cpp-binding.log" ]]; then
        echo "C++ binding (GoogleTest + examples):"
        grep -E 'tests passed|tests failed' "$LOGS/cpp-binding.log" | sed 's/^/  /' || true
    fi
    if [[ -f "$LOGS/go.log" ]]; then
        echo "Go:"
        grep -E '^(ok|FAIL|---) |^Go binding:' "$LOGS/go.log" | sed 's/^/  /' || true
    fi
    for s in package memcheck; do
        if [[ -f "$LOGS/$s.log" ]]; then
            grep -E "^$s: [0-9]+ passed, [0-9]+ failed" "$LOGS/$s.log" | sed 's/^/  /' || true
        fi
    done
    if [[ $rc -eq 0 ]]; then
        echo "ALL CHECKS PASSED"
    else
        echo "FAILED (exit $rc); full logs in $LOGS/"
    fi
}
trap summary EXIT

ensure_build_tools
ensure_rust_component rustfmt
ensure_rust_component clippy

step fmt cargo fmt --all --check
step clippy cargo clippy --workspace --all-targets -- -D warnings
step cargo-test env -u INFER_ONNXRUNTIME_LIBRARY cargo test --release --workspace
step cargo-test-gpu-standin standin_gpu_tests
step onnxruntime onnxruntime_tests
step onnx-conformance onnx_conformance
step packaged-models packaged_models
step llama-models llama_models
step gpu-check gpu_check_standin
step nvrtc nvrtc_check
step build cargo build --release --workspace
step symbols tests/symbols.sh "$LIB_DIR/libinfer.so"
step c-build build_c_tests
step c-tests "$C_TESTS/c_api_tests"
step cpp-examples build_cpp_examples
step ctest ctest --test-dir cpp_examples/build --output-on-failure
step cpp-binding scripts/test_cpp.sh
step go scripts/test_go.sh
step package scripts/test_package.sh
step memcheck env INFER_MEMCHECK_NO_BUILD=1 scripts/test_memcheck.sh
