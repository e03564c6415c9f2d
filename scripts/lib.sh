# Shared by scripts/demo.sh and scripts/test.sh (sourced, not run). Installs a missing
# tool only when it is absent, and builds the C examples with CMake.

# The cargo target folder (CARGO_TARGET_DIR or target/), relative to the repository root.
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
LIB_DIR="$TARGET_DIR/release"
case "$LIB_DIR" in /*) ;; *) LIB_DIR="$PWD/$LIB_DIR" ;; esac

_apt_updated=0
apt_install() { # apt_install PACKAGE...
    local sudo=""
    if [[ "$(id -u)" -ne 0 ]]; then
        command -v sudo >/dev/null || { echo "error: need root or sudo to install $*" >&2; return 1; }
        sudo="sudo"
    fi
    command -v apt-get >/dev/null || { echo "error: $* missing and no apt-get to install it" >&2; return 1; }
    if [[ $_apt_updated -eq 0 ]]; then
        $sudo apt-get update -qq
        _apt_updated=1
    fi
    echo "-- installing $*"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# ensure_tool COMMAND PACKAGE: installs PACKAGE with apt-get when COMMAND is not found.
ensure_tool() {
    command -v "$1" >/dev/null || apt_install "$2"
}

ensure_build_tools() {
    if ! command -v cargo >/dev/null; then
        echo "error: cargo not found; install Rust from https://rustup.rs (rustup, stable toolchain)" >&2
        exit 1
    fi
    ensure_tool gcc gcc
    ensure_tool g++ g++
    ensure_tool cmake cmake
    ensure_tool nm binutils
    ensure_tool ninja ninja-build || echo "-- ninja unavailable; CMake will use make"
    if ! command -v ninja >/dev/null; then ensure_tool make make; fi
}

# ensure_rust_component NAME (rustfmt or clippy): adds it with rustup when cargo lacks it.
ensure_rust_component() {
    local sub="$1"
    [[ "$sub" == rustfmt ]] && sub=fmt
    if ! cargo "$sub" --version >/dev/null 2>&1; then
        command -v rustup >/dev/null || { echo "error: cargo $sub missing and no rustup to add $1" >&2; exit 1; }
        echo "-- adding rustup component $1"
        rustup component add "$1"
    fi
}

# Configures and builds cpp_examples/ against $LIB_DIR in cpp_examples/build.
build_cpp_examples() {
    local gen="Unix Makefiles" dir="cpp_examples/build"
    command -v ninja >/dev/null && gen="Ninja"
    # A build folder made with another generator cannot be reused.
    if [[ -f "$dir/CMakeCache.txt" ]] && ! grep -qx "CMAKE_GENERATOR:INTERNAL=$gen" "$dir/CMakeCache.txt"; then
        rm -rf "$dir"
    fi
    # The chat example's test talks to a generated Llama model when there is one.
    local chat="${INFER_CHAT_MODEL:-${TARGET_DIR:-target}/llm-models/tiny-llama/model-q8_0.gguf}"
    [[ -f "$chat" ]] || chat=""
    case "$chat" in /* | "") ;; *) chat="$PWD/$chat" ;; esac
    cmake -S cpp_examples -B "$dir" -G "$gen" -DCMAKE_BUILD_TYPE=Release \
        -DINFER_LIB_DIR="$LIB_DIR" -DINFER_INCLUDE_DIR="$PWD/include" -DINFER_CHAT_MODEL="$chat"
    cmake --build "$dir"
}

# The ONNX Runtime release the demo and the tests load (the `onnxruntime` wheel from PyPI
# ships libonnxruntime.so.$ORT_VERSION; nothing of it is needed to build libinfer).
ORT_VERSION=1.32.0

# python_with_pip DIR: prints a Python that has pip: python3, else a venv made in DIR/venv
# (Debian and Ubuntu ship pip separately: a venv brings its own).
python_with_pip() {
    local dir="$1"
    ensure_tool python3 python3 >&2
    if python3 -m pip --version >/dev/null 2>&1; then
        echo python3
        return
    fi
    [[ -x "$dir/venv/bin/python" ]] || python3 -m venv "$dir/venv" >/dev/null 2>&1 ||
        { apt_install python3-venv >&2 && python3 -m venv "$dir/venv" >&2; }
    echo "$dir/venv/bin/python"
}

# wheel_libraries DIR PACKAGE VERSION FILE...: downloads the wheel PACKAGE==VERSION and
# extracts the FILEs of its onnxruntime/capi/ into DIR, in that order (so the last one's
# presence says all are there); the wheel is not kept. Returns 1, with a line saying so,
# where PyPI cannot be reached.
wheel_libraries() {
    local dir="$1" package="$2" version="$3" py rc
    shift 3
    py=$(python_with_pip "$dir")
    echo "-- downloading $package==$version ($*) into $dir"
    mkdir -p "$dir/wheel"
    if ! "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        -d "$dir/wheel" "$package==$version"; then
        echo "$package==$version could not be downloaded from PyPI"
        rm -rf "$dir/wheel"
        return 1
    fi
    "$py" - "$dir" "$@" <<'PY'
import glob, os, sys, zipfile
dir, names = sys.argv[1], sys.argv[2:]
wheel = sorted(glob.glob(os.path.join(dir, "wheel", "*.whl")))[-1]
with zipfile.ZipFile(wheel) as z:
    for n in names:
        with z.open(f"onnxruntime/capi/{n}") as src, open(os.path.join(dir, n + ".tmp"), "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(os.path.join(dir, n + ".tmp"), os.path.join(dir, n))
PY
    rc=$?
    rm -rf "$dir/wheel"
    return $rc
}

# ensure_onnxruntime DIR: extracts libonnxruntime.so.$ORT_VERSION from the pinned wheel
# into DIR (once) and sets ORT_LIB to its path (empty, and returns 1, where it cannot).
ensure_onnxruntime() {
    local dir="$1"
    case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
    ORT_LIB="$dir/libonnxruntime.so.$ORT_VERSION"
    [[ -f "$ORT_LIB" ]] && return 0
    wheel_libraries "$dir" onnxruntime "$ORT_VERSION" "libonnxruntime.so.$ORT_VERSION" ||
        { ORT_LIB=""; return 1; }
}

# onnxruntime-gpu, whose library lists ONNX Runtime's CUDA and TensorRT providers: the
# tests load it where CUDA is the stand-in's (its CUDA provider cannot start there, for
# want of cuDNN, cuBLASLt and the CUDA runtime), to check which engine runs GPU instances.
ORT_GPU_VERSION=1.31.1

# ensure_onnxruntime_gpu DIR: extracts libonnxruntime.so.$ORT_GPU_VERSION and its provider
# libraries from the pinned onnxruntime-gpu wheel (255 MB) into DIR (once) and sets
# ORT_GPU_LIB to the library's path (empty, and returns 1, where it cannot).
ensure_onnxruntime_gpu() {
    local dir="$1"
    case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
    ORT_GPU_LIB="$dir/libonnxruntime.so.$ORT_GPU_VERSION"
    [[ -f "$ORT_GPU_LIB" ]] && return 0
    wheel_libraries "$dir" onnxruntime-gpu "$ORT_GPU_VERSION" libonnxruntime_providers_shared.so \
        libonnxruntime_providers_cuda.so "libonnxruntime.so.$ORT_GPU_VERSION" ||
        { ORT_GPU_LIB=""; return 1; }
}

# The onnx release whose node test cases tests/onnx_conformance.rs runs (its wheel ships
# them); tests/onnx_conformance_known.txt is true for this version.
ONNX_VERSION=1.19.1

# make_venv VENV: a Python venv with pip at VENV (kept when it works), installing Debian's
# python3 / python3-venv when they are missing.
make_venv() {
    local venv="$1"
    ensure_tool python3 python3
    if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
        rm -rf "$venv"
        if ! python3 -m venv "$venv" >/dev/null 2>&1; then
            # Debian and Ubuntu ship venv's pip bootstrap separately.
            rm -rf "$venv"
            apt_install python3-venv
            python3 -m venv "$venv"
        fi
    fi
}

# onnx_python VENV: makes VENV (once) with the pinned onnx in it, installing Debian's
# python3 / python3-venv when they are missing.
onnx_python() {
    local venv="$1"
    if "$venv/bin/python" -c "import onnx, sys; sys.exit(onnx.__version__ != '$ONNX_VERSION')" 2>/dev/null; then
        return 0
    fi
    make_venv "$venv"
    echo "-- installing onnx==$ONNX_VERSION into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "onnx==$ONNX_VERSION"
}

# The packages scripts/make_llama.py needs (it writes the Llama / Qwen2 test models and
# computes their reference logits with numpy).
LLM_NUMPY_VERSION=2.2.6
LLM_GGUF_VERSION=0.19.0
LLM_SAFETENSORS_VERSION=0.8.0
LLM_TOKENIZERS_VERSION=0.23.3
LLM_JINJA2_VERSION=3.1.6
LLM_SENTENCEPIECE_VERSION=0.2.3

# llm_python VENV: makes VENV (once) with the pinned numpy, gguf, safetensors and
# tokenizers (and jinja2 for chat templates, sentencepiece for Llama 2-style vocabularies) in it, installing Debian's python3 / python3-venv when they are missing.
llm_python() {
    local venv="$1"
    if "$venv/bin/python" - "$LLM_NUMPY_VERSION" "$LLM_GGUF_VERSION" "$LLM_SAFETENSORS_VERSION" \
        "$LLM_TOKENIZERS_VERSION" "$LLM_JINJA2_VERSION" "$LLM_SENTENCEPIECE_VERSION" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
want = dict(zip(["numpy", "gguf", "safetensors", "tokenizers", "jinja2", "sentencepiece"], sys.argv[1:]))
sys.exit(any(version(name) != v for name, v in want.items()))
PY
    then
        return 0
    fi
    make_venv "$venv"
    echo "-- installing numpy==$LLM_NUMPY_VERSION gguf==$LLM_GGUF_VERSION safetensors==$LLM_SAFETENSORS_VERSION tokenizers==$LLM_TOKENIZERS_VERSION jinja2==$LLM_JINJA2_VERSION sentencepiece==$LLM_SENTENCEPIECE_VERSION into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "numpy==$LLM_NUMPY_VERSION" \
        "gguf==$LLM_GGUF_VERSION" "safetensors==$LLM_SAFETENSORS_VERSION" "tokenizers==$LLM_TOKENIZERS_VERSION" \
        "jinja2==$LLM_JINJA2_VERSION" "sentencepiece==$LLM_SENTENCEPIECE_VERSION"
}
