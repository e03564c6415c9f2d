#!/usr/bin/env bash
# Checks the C++ binding (bindings/cpp) against the library cargo built (release; built
# here when missing): configures bindings/cpp with CMake in $TARGET_DIR/cpp-binding,
# builds every header on its own, the GoogleTest tests and the C++ examples of
# cpp_examples/ (all with -Wall -Wextra -Werror), and runs them with ctest.
#
#   scripts/test_cpp.sh              # release build
#   scripts/test_cpp.sh --sanitize   # the same with AddressSanitizer + UBSan (Debug),
#                                    # in $TARGET_DIR/cpp-binding-sanitize
#
# Installs g++, cmake (and ninja when it can) and GoogleTest (libgtest-dev) with apt-get
# only when they are missing; nothing is downloaded at configure time.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

sanitize=OFF build_type=Release dir="$TARGET_DIR/cpp-binding"
for arg in "$@"; do
    case "$arg" in
        --sanitize) sanitize=ON build_type=Debug dir="$TARGET_DIR/cpp-binding-sanitize" ;;
        *) echo "usage: $0 [--sanitize]" >&2; exit 2 ;;
    esac
done

if [[ ! -f "$LIB_DIR/libinfer.so" ]]; then
    command -v cargo >/dev/null || { echo "error: $LIB_DIR/libinfer.so missing and no cargo to build it" >&2; exit 1; }
    cargo build --release
fi
ensure_tool g++ g++
ensure_tool cmake cmake
ensure_tool ninja ninja-build || echo "-- ninja unavailable; CMake will use make"
if ! command -v ninja >/dev/null; then ensure_tool make make; fi

# GoogleTest as Debian/Ubuntu's libgtest-dev installs it (CMake package files, or at
# least the header and the compiled library).
gtest_installed() {
    local d
    for d in /usr/lib/*/cmake/GTest /usr/lib/cmake/GTest /usr/local/lib/cmake/GTest \
             /usr/local/lib/*/cmake/GTest /usr/share/cmake/GTest; do
        [[ -f "$d/GTestConfig.cmake" ]] && return 0
    done
    [[ -f /usr/include/gtest/gtest.h ]] && compgen -G "/usr/lib/*/libgtest.*" >/dev/null
}
gtest_installed || apt_install libgtest-dev

gen="Unix Makefiles"
command -v ninja >/dev/null && gen="Ninja"
# A build folder made with another generator cannot be reused.
if [[ -f "$dir/CMakeCache.txt" ]] && ! grep -qx "CMAKE_GENERATOR:INTERNAL=$gen" "$dir/CMakeCache.txt"; then
    rm -rf "$dir"
fi

echo "-- configuring bindings/cpp in $dir (library $LIB_DIR/libinfer.so)"
cmake -S bindings/cpp -B "$dir" -G "$gen" -DCMAKE_BUILD_TYPE="$build_type" \
    -DINFER_LIB_DIR="$LIB_DIR" -DINFER_INCLUDE_DIR="$PWD/include" \
    -DINFER_CPP_BUILD_TESTS=ON -DINFER_CPP_BUILD_EXAMPLES=ON -DINFER_CPP_SANITIZE="$sanitize"
cmake --build "$dir"

jobs="$(nproc 2>/dev/null || echo 2)"
echo "-- ctest (the GoogleTest tests, one process each, and the examples)"
ctest --test-dir "$dir" --output-on-failure -j "$jobs"
echo "C++ binding: headers, GoogleTest tests and examples passed (sanitizers $sanitize)"
