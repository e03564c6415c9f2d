#!/usr/bin/env bash
# Builds llama.cpp's CPU tools for the comparison benchmarks: llama-bench,
# llama-batched-bench, llama-quantize, llama-completion and llama-simple (one-shot
# generation from a prompt) and llama-tokenize. The source is the llama.cpp tree vendored
# in the PyPI sdist of llama-cpp-python (pinned version and sha256 below), so only PyPI is
# needed. Builds once into $TARGET_DIR/llama.cpp (CARGO_TARGET_DIR or target/), binaries in
# its bin/; a stamp there records the version, the CMake flags and the CPU, and a later run
# with the same ones does nothing. Installs cmake, g++ and ninja with apt-get only when
# they are missing.
#
# Usage: scripts/llama_cpp.sh      (LLAMA_CPP_JOBS=N sets the build jobs; default: nproc)
# Logs go to stderr; the last line on stdout is the bin folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

# Everything but the final path goes to stderr.
exec 3>&1 1>&2

# llama-cpp-python 0.3.36 vendors llama.cpp at ggml-org/llama.cpp@0c1e57098 (its
# CHANGELOG.md; the sdist has no git metadata, so the commit is passed to CMake).
LLAMA_CPP_PY_VERSION=0.3.36
LLAMA_CPP_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMA_CPP_COMMIT=0c1e57098
LLAMA_CPP_TARGETS=(llama-bench llama-batched-bench llama-quantize llama-completion llama-simple llama-tokenize)

root="$TARGET_DIR/llama.cpp"
case "$root" in /*) ;; *) root="$PWD/$root" ;; esac
bin="$root/bin"
stamp="$bin/.stamp"
src="$root/src-$LLAMA_CPP_COMMIT"
build="$root/build"
sdist_dir="$root/sdist"
sdist="$sdist_dir/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz"
jobs="${LLAMA_CPP_JOBS:-$(nproc)}"

cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DGGML_CUDA=OFF
    -DGGML_CCACHE=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_COMMON=ON
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_EXAMPLES=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_COMMIT="$LLAMA_CPP_COMMIT"
    -DLLAMA_BUILD_NUMBER=0
)

# GGML_NATIVE compiles for this CPU (-march=native): binaries from another CPU are rebuilt.
cpu_flags="$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr ' ' '\n' | sort | tr '\n' ' ' | md5sum | cut -c1-16 || true)"
stamp_text="llama-cpp-python $LLAMA_CPP_PY_VERSION
llama.cpp $LLAMA_CPP_COMMIT
targets ${LLAMA_CPP_TARGETS[*]}
cmake ${cmake_flags[*]}
patch amx-tilecfg-barrier
cpu $(uname -m) $cpu_flags"

up_to_date() {
    [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_text" ]] || return 1
    local t
    for t in "${LLAMA_CPP_TARGETS[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
}

if up_to_date; then
    echo "-- llama.cpp $LLAMA_CPP_COMMIT (llama-cpp-python $LLAMA_CPP_PY_VERSION) already built"
    echo "$bin" >&3
    exit 0
fi

ensure_tool gcc gcc
ensure_tool g++ g++
ensure_tool cmake cmake
ensure_tool ninja ninja-build || echo "-- ninja unavailable; CMake will use make"
if ! command -v ninja >/dev/null; then ensure_tool make make; fi
ensure_tool python3 python3

sdist_ok() { [[ -f "$sdist" ]] && echo "$LLAMA_CPP_SDIST_SHA256  $sdist" | sha256sum -c --status; }

# 1. The sdist (kept in sdist/, checked against its sha256).
if ! sdist_ok; then
    py=python3
    if ! python3 -m pip --version >/dev/null 2>&1; then
        # Debian and Ubuntu ship pip separately: a venv brings its own.
        [[ -x "$root/venv/bin/python" ]] || { mkdir -p "$root" && python3 -m venv "$root/venv" >/dev/null 2>&1; } ||
            { apt_install python3-venv && python3 -m venv "$root/venv"; }
        py="$root/venv/bin/python"
    fi
    echo "-- downloading the llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist into $sdist_dir"
    rm -rf "$sdist_dir"
    mkdir -p "$sdist_dir"
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$sdist_dir" "llama-cpp-python==$LLAMA_CPP_PY_VERSION"
    if ! sdist_ok; then
        echo "error: $sdist missing or not sha256 $LLAMA_CPP_SDIST_SHA256" >&2
        exit 1
    fi
fi

# 2. Its vendor/llama.cpp, extracted once (atomically) into src-COMMIT/.
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    echo "-- extracting vendor/llama.cpp into $src"
    rm -rf "$src" "$src.tmp"
    mkdir -p "$src.tmp"
    tar -xzf "$sdist" -C "$src.tmp" --strip-components=3 \
        "llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
    # A submodule's .git file pointing nowhere: without it, and with the ceiling below,
    # CMake's git queries find no repository (never the enclosing one).
    rm -f "$src.tmp/.git"
    mv "$src.tmp" "$src"
fi
export GIT_CEILING_DIRECTORIES="$root"

# 2b. GCC 12's `_tile_loadconfig` (amxtileintrin.h) tells the compiler that `ldtilecfg`
# reads 8 bytes of its 64-byte operand, so the stores of the tiles' rows and widths are
# dropped as dead: every tile is configured empty, and llama.cpp's AMX kernels (built
# with -march=native on a CPU with AMX) die of SIGILL at their first `tileloadd`. A
# compiler barrier before the call keeps the stores, as clang and later GCC headers do by
# themselves; nothing else in llama.cpp changes. Applied once, idempotently.
amx_mmq="$src/ggml/src/ggml-cpu/amx/mmq.cpp"
amx_fix='__asm__ volatile("" : : "r"(\&tc) : "memory"); _tile_loadconfig(\&tc);'
if [[ -f "$amx_mmq" ]] && ! grep -q '__asm__ volatile("" : : "r"(&tc)' "$amx_mmq"; then
    sed -i "s|^\( *\)_tile_loadconfig(&tc);|\1$amx_fix|" "$amx_mmq"
    grep -q '__asm__ volatile("" : : "r"(&tc)' "$amx_mmq" ||
        { echo "error: could not patch the tile configuration in $amx_mmq" >&2; exit 1; }
fi

# 3. Configure and build only the wanted targets.
gen="Unix Makefiles"
command -v ninja >/dev/null && gen="Ninja"
# A build folder made with another generator or from another source cannot be reused.
if [[ -f "$build/CMakeCache.txt" ]] && { ! grep -qx "CMAKE_GENERATOR:INTERNAL=$gen" "$build/CMakeCache.txt" ||
    ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$src" "$build/CMakeCache.txt"; }; then
    rm -rf "$build"
fi
echo "-- configuring llama.cpp $LLAMA_CPP_COMMIT ($gen): ${cmake_flags[*]}"
cmake -S "$src" -B "$build" -G "$gen" "${cmake_flags[@]}"
echo "-- building ${LLAMA_CPP_TARGETS[*]} with $jobs jobs"
start=$SECONDS
cmake --build "$build" -j "$jobs" --target "${LLAMA_CPP_TARGETS[@]}"
echo "-- built in $((SECONDS - start)) s"

# 4. Copy the binaries into bin/ and write the stamp last.
mkdir -p "$bin"
rm -f "$stamp"
for t in "${LLAMA_CPP_TARGETS[@]}"; do
    install -m 755 "$build/bin/$t" "$bin/$t.tmp"
    mv -f "$bin/$t.tmp" "$bin/$t"
done
printf '%s\n' "$stamp_text" >"$stamp"
echo "-- llama.cpp $LLAMA_CPP_COMMIT tools in $bin"
echo "$bin" >&3
