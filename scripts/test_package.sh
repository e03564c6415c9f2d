#!/usr/bin/env bash
# Checks the installable package: `make install` into a temporary prefix, then builds and
# runs programs against what was installed, and nothing else:
#   * the installed files, symlinks and soname; pkg-config's view of infer and infer-static;
#   * find_package(infer VERSION) accepting the same major only, and version ranges;
#   * cpp_examples/ built with CMake against the prefix (INFER_LIB_DIR / INFER_INCLUDE_DIR)
#     and run with ctest;
#   * tests/package/, an out-of-tree consumer: find_package(infer) with infer::infer,
#     infer::static and (when the checkout has the C++ binding) infer::cpp, run with ctest;
#     the same sources built with plain `cc`/`c++ $(pkg-config --cflags --libs infer)`,
#     run once through an rpath and once through LD_LIBRARY_PATH;
#   * a C program linked with libinfer.a (pkg-config infer-static), run, and checked to
#     need no libinfer.so and to keep a non-executable stack;
#   * the CMake package still working after the prefix is moved elsewhere;
#   * `make uninstall` leaving no file behind.
# Installs gcc, cmake, make/ninja and pkg-config with apt-get when missing. The prefix and
# build folders are removed on success and kept (path printed) on failure, or with
# KEEP=1. Ends with "package: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

ensure_build_tools
ensure_tool pkg-config pkg-config
ensure_tool g++ g++
ensure_tool make make
ensure_tool readelf binutils

version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml | head -n 1)
soversion=$(sed -n 's/.*-soname,libinfer\.so\.\([0-9][0-9]*\).*/\1/p' build.rs | head -n 1)
cpp_header=bindings/cpp/include/infer/infer.hpp

work=$(mktemp -d "${TMPDIR:-/tmp}/infer-package.XXXXXX")
prefix="$work/prefix"
gen="Unix Makefiles"
command -v ninja >/dev/null && gen="Ninja"

results=() # "name|ok" or "name|FAILED"
failed=0
bold="" plain=""
if [[ -t 1 ]]; then bold=$'\033[1m' plain=$'\033[0m'; fi

finish() {
    local rc=$?
    [[ $rc -ne 0 && $failed -eq 0 ]] && failed=1
    printf '\n%s== package summary%s\n' "$bold" "$plain"
    local passed=0 nfailed=0
    for r in "${results[@]}"; do
        printf '  %-34s %s\n' "${r%%|*}" "${r##*|}"
        if [[ "${r##*|}" == ok ]]; then passed=$((passed + 1)); else nfailed=$((nfailed + 1)); fi
    done
    if [[ $failed -eq 0 && -z "${KEEP:-}" ]]; then
        rm -rf "$work"
    else
        echo "  kept: $work"
    fi
    if [[ $failed -ne 0 && $nfailed -eq 0 ]]; then
        echo "  stopped early (exit $rc)"
        nfailed=1
    fi
    echo "package: $passed passed, $nfailed failed"
    [[ $failed -eq 0 ]] || exit 1
}
trap finish EXIT

# check NAME COMMAND...: runs one check in a subshell that stops at its first failing
# command; a failure is recorded and the next check runs. (Not `if ( ... )`: bash ignores
# set -e inside a condition.)
check() {
    local name="$1" rc
    shift
    printf '\n%s== %s%s\n' "$bold" "$name" "$plain"
    set +e
    ( set -e; "$@" )
    rc=$?
    set -e
    if [[ $rc -eq 0 ]]; then
        results+=("$name|ok")
    else
        results+=("$name|FAILED")
        failed=1
    fi
}

# must NAME COMMAND...: like check, but the checks after it need it: stops on failure.
must() {
    check "$@"
    [[ "${results[-1]##*|}" == ok ]] || exit 1
}

do_install() {
    make --no-print-directory install PREFIX="$prefix"
}

installed_files() {
    local f missing=0
    for f in lib/libinfer.so.$version lib/libinfer.a include/infer.h bin/infer-perf \
        lib/pkgconfig/infer.pc lib/pkgconfig/infer-static.pc \
        lib/cmake/infer/inferConfig.cmake lib/cmake/infer/inferConfigVersion.cmake \
        lib/cmake/infer/inferTargets.cmake; do
        [[ -f "$prefix/$f" ]] || { echo "missing: $f"; missing=1; }
    done
    if [[ -f "$cpp_header" ]]; then
        [[ -f "$prefix/include/infer/infer.hpp" ]] || { echo "missing: include/infer/infer.hpp"; missing=1; }
    fi
    [[ "$(readlink "$prefix/lib/libinfer.so.$soversion")" == "libinfer.so.$version" ]] ||
        { echo "lib/libinfer.so.$soversion does not point to libinfer.so.$version"; missing=1; }
    [[ "$(readlink "$prefix/lib/libinfer.so")" == "libinfer.so.$soversion" ]] ||
        { echo "lib/libinfer.so does not point to libinfer.so.$soversion"; missing=1; }
    local soname
    soname=$(readelf -d "$prefix/lib/libinfer.so.$version" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
    [[ "$soname" == "libinfer.so.$soversion" ]] || { echo "soname is '$soname'"; missing=1; }
    (cd "$prefix" && find . \( -type f -o -type l \) | sort | sed 's|^\./|  |')
    return "$missing"
}

pkgconfig_view() {
    export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
    local v
    v=$(pkg-config --modversion infer)
    echo "pkg-config --modversion infer: $v"
    [[ "$v" == "$version" ]] || { echo "expected $version (Cargo.toml)"; return 1; }
    echo "pkg-config --cflags --libs infer: $(pkg-config --cflags --libs infer)"
    echo "pkg-config --static --libs infer: $(pkg-config --static --libs infer)"
    echo "pkg-config --libs infer-static: $(pkg-config --libs infer-static)"
    pkg-config --static --libs infer | grep -q -- '-lpthread' || { echo "Libs.private missing"; return 1; }
    [[ "$(pkg-config --variable=libdir infer)" == "$prefix/lib" ]]
}

# The cache variables of cpp_examples/CMakeLists.txt that name an include folder (the C
# header's, and the C++ binding's should it get its own) all point into the prefix.
examples() {
    local b="$work/build-examples" args=() var
    for var in $(sed -n 's/^ *set(\(INFER_[A-Z_]*INCLUDE_DIR\) .*CACHE.*/\1/p' cpp_examples/CMakeLists.txt); do
        args+=("-D$var=$prefix/include")
    done
    cmake -S cpp_examples -B "$b" -G "$gen" -DCMAKE_BUILD_TYPE=Release \
        -DINFER_LIB_DIR="$prefix/lib" "${args[@]}"
    # Built against the installed library and header, not the checkout's.
    grep -q "^INFER_LIB_DIR:PATH=$prefix/lib$" "$b/CMakeCache.txt"
    cmake --build "$b"
    ctest --test-dir "$b" --output-on-failure
}

# static_ok PROGRAM: PROGRAM needs no libinfer.so and its stack is not executable.
static_ok() {
    local needed
    needed=$(readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p' | tr '\n' ' ')
    echo "$(basename "$1") needs: $needed"
    if [[ "$needed" == *libinfer* ]]; then
        echo "$1 was linked with libinfer.so, not libinfer.a"
        return 1
    fi
    if readelf -lW "$1" | grep GNU_STACK | grep -q 'RWE'; then
        echo "$1 has an executable stack (GNU_STACK RWE)"
        return 1
    fi
}

consumer_cmake() { # consumer_cmake BUILD_DIR PREFIX [CMAKE_ARGS...]
    local b="$1" p="$2"
    shift 2
    local args=("$@")
    [[ -f "$cpp_header" ]] && args+=(-DINFER_CONSUMER_REQUIRE_CPP=ON)
    rm -rf "$b"
    cmake -S tests/package -B "$b" -G "$gen" -DCMAKE_PREFIX_PATH="$p" \
        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF "${args[@]}"
    cmake --build "$b"
    [[ ! -f "$b/consumer_c_static" ]] || static_ok "$b/consumer_c_static"
    ctest --test-dir "$b" --output-on-failure
}

cmake_versions() {
    local b="$work/build-version" args=()
    [[ -f "$cpp_header" ]] && args+=(-DINFER_EXPECT_CPP=ON)
    cmake -S tests/package/version -B "$b" -DCMAKE_PREFIX_PATH="$prefix" \
        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DINFER_VERSION="$version" "${args[@]}"
}

consumer_pkgconfig() {
    export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
    local b="$work/build-pkgconfig" libdir
    libdir=$(pkg-config --variable=libdir infer)
    mkdir -p "$b"
    local def="-DINFER_EXPECTED_VERSION=\"$(pkg-config --modversion infer)\""
    # shellcheck disable=SC2046
    cc -std=c11 -Wall -Wextra -Werror "$def" tests/package/consumer.c \
        $(pkg-config --cflags --libs infer) -Wl,-rpath,"$libdir" -o "$b/consumer_c"
    "$b/consumer_c" "C, pkg-config, rpath"
    # shellcheck disable=SC2046
    cc -std=c11 -Wall -Wextra -Werror "$def" tests/package/consumer.c \
        $(pkg-config --cflags --libs infer) -o "$b/consumer_c_norpath"
    LD_LIBRARY_PATH="$libdir" "$b/consumer_c_norpath" "C, pkg-config, LD_LIBRARY_PATH"
    if [[ -f "$cpp_header" ]]; then
        # shellcheck disable=SC2046
        c++ -std=c++17 -Wall -Wextra -Werror "$def" tests/package/consumer.cpp \
            $(pkg-config --cflags --libs infer) -Wl,-rpath,"$libdir" -o "$b/consumer_cpp"
        "$b/consumer_cpp"
    fi
}

consumer_static() {
    export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
    local b="$work/build-static"
    mkdir -p "$b"
    echo "cc consumer.c $(pkg-config --cflags --libs infer-static)"
    # shellcheck disable=SC2046
    cc -std=c11 -Wall -Wextra -Werror -DINFER_EXPECTED_VERSION="\"$(pkg-config --modversion infer)\"" \
        tests/package/consumer.c $(pkg-config --cflags --libs infer-static) -o "$b/consumer_static"
    static_ok "$b/consumer_static"
    # No libinfer.so anywhere it could be found.
    env -u LD_LIBRARY_PATH "$b/consumer_static" "C, libinfer.a, pkg-config infer-static"
}

# Moves the prefix (a relocated tarball, a staged DESTDIR): the CMake package finds its
# files relative to itself.
relocated() {
    local moved="$work/moved"
    mv "$prefix" "$moved"
    local rc
    set +e
    ( set -e; consumer_cmake "$work/build-consumer-moved" "$moved" -DINFER_CONSUMER_STATIC=OFF )
    rc=$?
    set -e
    if [[ $rc -eq 0 ]] && ! grep -rq "$moved/lib/libinfer.so.$version" "$work/build-consumer-moved"; then
        echo "the consumer was not linked with the moved library"
        rc=1
    fi
    mv "$moved" "$prefix"
    return "$rc"
}

# The installed infer-perf measures a shipped model (a short run: three windows).
perf_tool() {
    "$prefix/bin/infer-perf" --help | grep -q -- '--concurrency-range' || { echo "no --help"; return 1; }
    "$prefix/bin/infer-perf" --model-repository models -m add_sub -p 100 --max-trials 3 \
        -f "$work/perf.csv" || return 1
    head -n 2 "$work/perf.csv"
    [[ "$(head -c 27 "$work/perf.csv")" == "Concurrency,Inferences/Seco" ]]
}

uninstall() {
    make --no-print-directory uninstall PREFIX="$prefix"
    local left
    left=$(find "$prefix" \( -type f -o -type l \) | sed "s|^$prefix/|  |")
    if [[ -n "$left" ]]; then
        echo "left behind after make uninstall:"
        echo "$left"
        return 1
    fi
    echo "no file left under the prefix"
}

echo "libinfer $version (soname libinfer.so.$soversion), prefix $prefix"
must "make install" do_install
check "installed files" installed_files
check "pkg-config" pkgconfig_view
check "cpp_examples (installed)" examples
check "consumer: CMake find_package" consumer_cmake "$work/build-consumer" "$prefix"
check "CMake version rule" cmake_versions
check "consumer: pkg-config" consumer_pkgconfig
check "consumer: static libinfer.a" consumer_static
check "consumer: moved prefix" relocated
check "infer-perf (installed)" perf_tool
check "make uninstall" uninstall
