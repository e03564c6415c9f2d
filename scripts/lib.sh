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
    cmake -S cpp_examples -B "$dir" -G "$gen" -DCMAKE_BUILD_TYPE=Release \
        -DINFER_LIB_DIR="$LIB_DIR" -DINFER_INCLUDE_DIR="$PWD/include"
    cmake --build "$dir"
}
