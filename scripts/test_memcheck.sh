#!/usr/bin/env bash
# Runs the C API tests (tests/c/*.c) and the examples (cpp_examples/*.c, and *.cpp when
# the C++ binding is in the checkout) under memory checkers, failing on any leak, invalid
# memory access or undefined behaviour:
#
#   1. AddressSanitizer + LeakSanitizer + UndefinedBehaviorSanitizer. The C/C++ side is
#      compiled with -fsanitize=address,undefined; libinfer.so is not instrumented, so
#      ASan checks every access the programs make (to their own memory and to what the
#      library hands out), and LeakSanitizer sees every malloc, the library's included,
#      since the library allocates through the intercepted malloc. Leak reports use the
#      slow unwinder, so their stacks go through the library's frames.
#   2. valgrind memcheck on the same programs built without sanitizers, which also checks
#      the library's own accesses. Counts definitely and indirectly lost blocks and every
#      memcheck error. "Possibly lost" is not counted: those are blocks reachable only
#      through a pointer into their middle, which every live Rust HashMap keeps (hashbrown
#      points at its control bytes, inside its allocation), e.g. in the global descriptor
#      pool; LeakSanitizer, which does count them, treats such pointers as references.
#      valgrind is installed with apt-get when missing; if that fails, this pass is
#      skipped (and says so), and the sanitizer pass still decides.
#
# Before the real programs, canaries prove that each checker works here: a program that
# leaks a string the library returned must be reported, and (ASan) one that reads past
# the end of such a string must be stopped.
#
# Leak suppressions: tests/lsan.supp, and only for the Rust runtime's one-time process
# allocations (each entry is justified there). A suppression that was used is listed in
# the summary.
#
# Builds into $TARGET_DIR/memcheck/{asan,valgrind}; each run's full output is kept in
# $TARGET_DIR/memcheck/logs/. Runs `cargo build --release` first unless
# INFER_MEMCHECK_NO_BUILD=1. INFER_MEMCHECK_TOOLS="asan valgrind" (the default) picks the
# passes. Ends with "memcheck: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

OUT="$TARGET_DIR/memcheck"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
LOGS="$OUT/logs"
SUPP="$PWD/tests/lsan.supp"
TOOLS="${INFER_MEMCHECK_TOOLS:-asan valgrind}"
RUN_TIMEOUT=600 # seconds, per program
CPP_INCLUDE=bindings/cpp/include

bold="" plain=""
if [[ -t 1 ]]; then bold=$'\033[1m' plain=$'\033[0m'; fi

ensure_build_tools
ensure_tool g++ g++
if [[ "${INFER_MEMCHECK_NO_BUILD:-}" != 1 ]]; then
    cargo build --release
fi
[[ -f "$LIB_DIR/libinfer.so" ]] || { echo "memcheck: $LIB_DIR/libinfer.so missing" >&2; exit 2; }
[[ -f "$SUPP" ]] || { echo "memcheck: $SUPP missing" >&2; exit 2; }

rm -rf "$LOGS"
mkdir -p "$LOGS"

results=()      # "section|name|verdict|note"
failed=0
suppressed=""   # LeakSanitizer's "Suppressions used" lines, all runs
vg_suppressed="" # valgrind's "used_suppression" lines, all runs

record() { # record SECTION NAME VERDICT [NOTE]
    results+=("$1|$2|$3|${4:-}")
    [[ "$3" == ok ]] || failed=1
}

# The programs: NAME:LANG:SOURCE... (sources relative to the repository root).
programs=("c_api_tests:c:$(echo tests/c/*.c | tr ' ' ':')")
for src in cpp_examples/*.c; do
    programs+=("$(basename "$src" .c):c:$src")
done
# The chat example talks to a generated Llama model (scripts/test.sh makes it); without
# one it is not run.
chat_model="${INFER_CHAT_MODEL:-$TARGET_DIR/llm-models/tiny-llama/model-q8_0.gguf}"
case "$chat_model" in /*) ;; *) chat_model="$PWD/$chat_model" ;; esac
if [[ -d "$CPP_INCLUDE/infer" ]]; then
    for src in cpp_examples/*.cpp; do
        [[ "$src" == cpp_examples/chat.cpp && ! -f "$chat_model" ]] && continue
        [[ -f "$src" ]] && programs+=("$(basename "$src" .cpp):cpp:$src")
    done
fi

# The arguments a program runs with.
program_args() { # program_args NAME -> sets args
    args=()
    if [[ "$1" == chat ]]; then
        args=("$chat_model" --max-tokens 8 --ignore-eos --system "Be brief." "Hello there!" "More?")
    fi
}

# build VARIANT NAME LANG SOURCE...: compiles one program into $OUT/VARIANT (with
# -fsanitize for asan), linked against $LIB_DIR/libinfer.so and found at run time through
# a libinfer.so.0 link beside it. The compiler's output goes to $LOGS/build-VARIANT-NAME.log.
build() {
    local log="$LOGS/build-$1-$2.log"
    rm -f "$OUT/$1/$2"
    if compile "$@" >"$log" 2>&1; then
        return 0
    fi
    echo "  build of $2 failed ($log):"
    tail -n 40 "$log"
    return 1
}

compile() {
    local variant="$1" name="$2" lang="$3"
    shift 3
    # No -Werror: scripts/test.sh holds the sources to that; here GCC's
    # -Wmaybe-uninitialized gives false positives inside libstdc++ under -fsanitize.
    local dir="$OUT/$variant" flags=(-O1 -g -fno-omit-frame-pointer -pthread -Wall -Wextra -Iinclude)
    mkdir -p "$dir"
    ln -sf "$LIB_DIR/libinfer.so" "$dir/libinfer.so.0"
    if [[ "$variant" == asan ]]; then
        flags+=(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
    fi
    # Examples that serve the shipped model repository find it through INFER_MODELS_DIR,
    # as cpp_examples/CMakeLists.txt sets it.
    if grep -q INFER_MODELS_DIR "$@"; then
        flags+=("-DINFER_MODELS_DIR=\"$PWD/models\"")
    fi
    local cc=(gcc -std=c11)
    if [[ "$lang" == cpp ]]; then
        cc=(g++ -std=c++17 -I"$CPP_INCLUDE")
    fi
    "${cc[@]}" "${flags[@]}" "$@" -L"$LIB_DIR" -linfer -lm -Wl,-rpath,'$ORIGIN' -o "$dir/$name"
}

export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:exitcode=86:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:fast_unwind_on_malloc=0:malloc_context_size=40:symbolize=1"
export LSAN_OPTIONS="suppressions=$SUPP:print_suppressions=1:exitcode=87"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=88"

# Sanitizer verdict of one finished run: ok, LEAK, INVALID ACCESS (kind), UNDEFINED
# BEHAVIOUR, TIMEOUT or FAILED (exit N).
asan_verdict() { # asan_verdict RC LOG
    local rc="$1" log="$2" kind
    if grep -q 'ERROR: LeakSanitizer' "$log"; then
        echo "LEAK"
    elif grep -q 'ERROR: AddressSanitizer' "$log"; then
        kind=$(sed -n 's/.*ERROR: AddressSanitizer: \([a-z-]*\).*/\1/p' "$log" | head -n 1)
        echo "INVALID ACCESS (${kind:-unknown})"
    elif grep -q 'runtime error:' "$log"; then
        echo "UNDEFINED BEHAVIOUR"
    elif [[ "$rc" -eq 124 ]]; then
        echo "TIMEOUT"
    elif [[ "$rc" -ne 0 ]]; then
        echo "FAILED (exit $rc)"
    else
        echo "ok"
    fi
}

# The sanitizer's report: from its first ==PID==ERROR line on (leak stacks included).
print_report() { # print_report LOG
    local log="$1" start
    start=$(grep -n -m 1 -E '^==[0-9]+==ERROR|runtime error:|^FAIL ' "$log" | cut -d: -f1 || true)
    if [[ -n "$start" ]]; then
        tail -n +"$start" "$log" | head -n 400
    else
        tail -n 60 "$log"
    fi
}

# The program's own "N passed, N failed" line, when it prints one.
test_note() {
    grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -n 1 || true
}

# collect_suppressions LOG: keeps the "Suppressions used" table of one run.
collect_suppressions() {
    local used
    used=$(sed -n '/^Suppressions used:/,/^-*$/p' "$1" | grep -E '^ *[0-9]+ +[0-9]+ +' || true)
    if [[ -n "$used" ]]; then
        suppressed+="$(basename "$1" .log): $used"$'\n'
    fi
}

write_canaries() {
    mkdir -p "$OUT/canary"
    # Leaks the statistics JSON the library allocated (never given to infer_string_free).
    cat > "$OUT/canary/leak.c" <<'EOF'
#include <stdio.h>
#include <string.h>
#include "infer.h"
__attribute__((noinline)) static int leak(void) {
    infer_server *s = NULL;
    char *json = NULL;
    if (infer_server_new(NULL, &s) != INFER_STATUS_OK) return 2;
    if (infer_server_statistics_json(s, NULL, &json) != INFER_STATUS_OK) return 2;
    printf("statistics: %zu bytes\n", strlen(json));
    infer_server_free(s);
    memset(&json, 0, sizeof json);
    return 0;
}
int main(void) { return leak(); }
EOF
    # Reads one byte past the end of a string the library allocated, then frees it.
    cat > "$OUT/canary/overflow.c" <<'EOF'
#include <stdio.h>
#include <string.h>
#include "infer.h"
int main(void) {
    infer_server *s = NULL;
    char *json = NULL;
    if (infer_server_new(NULL, &s) != INFER_STATUS_OK) return 2;
    if (infer_server_statistics_json(s, NULL, &json) != INFER_STATUS_OK) return 2;
    volatile char past_end = json[strlen(json) + 1];
    printf("read %d\n", past_end);
    infer_string_free(json);
    infer_server_free(s);
    return 0;
}
EOF
}

# build_programs VARIANT: builds every program; one that does not build is recorded as
# BUILD FAILED and not run.
build_programs() {
    local entry name lang srcs
    for entry in "${programs[@]}"; do
        IFS=: read -r name lang srcs <<<"$entry"
        IFS=: read -r -a srcs <<<"$srcs"
        echo "  $name"
        build "$1" "$name" "$lang" "${srcs[@]}" || true
    done
}

# built VARIANT SECTION NAME: whether NAME was built; records BUILD FAILED otherwise.
built() {
    [[ -x "$OUT/$1/$3" ]] && return 0
    record "$2" "$3" "BUILD FAILED" "$LOGS/build-$1-$3.log"
    return 1
}

# collect_vg_suppressions LOG: keeps valgrind's "used_suppression" lines of one run.
collect_vg_suppressions() {
    local used
    used=$(grep -E '^--[0-9]+-- used_suppression:' "$1" | sed 's/^--[0-9]*-- used_suppression: *//' || true)
    if [[ -n "$used" ]]; then
        vg_suppressed+="$(basename "$1" .log): $used"$'\n'
    fi
}

section() { printf '\n%s== %s%s\n' "$bold" "$1" "$plain"; }

asan_pass() {
    local S="asan" entry name lang srcs rc log verdict
    section "AddressSanitizer + LeakSanitizer + UBSan: building"
    build asan canary_leak c "$OUT/canary/leak.c"
    build asan canary_overflow c "$OUT/canary/overflow.c"
    build_programs asan

    section "AddressSanitizer: canaries"
    log="$LOGS/asan-canary_leak.log"
    rc=0; (cd "$OUT/asan" && timeout "$RUN_TIMEOUT" ./canary_leak) >"$log" 2>&1 || rc=$?
    if [[ "$(asan_verdict "$rc" "$log")" == LEAK ]]; then
        local where="no library frame symbolized"
        grep -q 'infer_server_statistics_json' "$log" && where="stack reaches infer_server_statistics_json"
        echo "  canary_leak: leak of a library-allocated string reported ($where)"
        record "$S" "canary: leak is reported" ok "$where"
    else
        echo "  canary_leak: NOT reported (exit $rc); LeakSanitizer does not work here:"
        tail -n 30 "$log"
        record "$S" "canary: leak is reported" "FAILED" "LeakSanitizer missed it"
    fi
    log="$LOGS/asan-canary_overflow.log"
    rc=0; (cd "$OUT/asan" && timeout "$RUN_TIMEOUT" ./canary_overflow) >"$log" 2>&1 || rc=$?
    if [[ "$(asan_verdict "$rc" "$log")" == "INVALID ACCESS (heap-buffer-overflow)" ]]; then
        echo "  canary_overflow: read past a library-allocated string stopped"
        record "$S" "canary: overflow is stopped" ok
    else
        echo "  canary_overflow: NOT stopped (exit $rc):"
        tail -n 30 "$log"
        record "$S" "canary: overflow is stopped" "FAILED" "AddressSanitizer missed it"
    fi

    for entry in "${programs[@]}"; do
        IFS=: read -r name lang srcs <<<"$entry"
        built asan "$S" "$name" || continue
        section "AddressSanitizer: $name"
        log="$LOGS/asan-$name.log"
        program_args "$name"
        rc=0; (cd "$OUT/asan" && timeout "$RUN_TIMEOUT" "./$name" "${args[@]}") >"$log" 2>&1 || rc=$?
        verdict=$(asan_verdict "$rc" "$log")
        collect_suppressions "$log"
        if [[ "$verdict" == ok ]]; then
            tail -n 3 "$log" | sed 's/^/  | /'
        else
            echo "  $verdict; the report (full output in $log):"
            print_report "$log"
        fi
        record "$S" "$name" "$verdict" "$(test_note "$log")"
    done
}

# valgrind verdict: LEAK (definitely/indirectly lost), MEMCHECK ERRORS, TIMEOUT, FAILED.
vg_verdict() { # vg_verdict RC LOG
    local rc="$1" log="$2" errors
    if grep -Eq '(definitely|indirectly) lost: [1-9]' "$log"; then
        echo "LEAK"
    else
        errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) errors.*/\1/p' "$log" | tail -n 1)
        if [[ -n "$errors" && "$errors" -ne 0 ]]; then
            echo "MEMCHECK ERRORS ($errors)"
        elif [[ "$rc" -eq 124 ]]; then
            echo "TIMEOUT"
        elif [[ "$rc" -ne 0 ]]; then
            echo "FAILED (exit $rc)"
        elif [[ -z "$errors" ]]; then
            echo "FAILED (no valgrind summary)"
        else
            echo "ok"
        fi
    fi
}

VALGRIND=(valgrind --tool=memcheck --error-exitcode=99 --leak-check=full
    --show-leak-kinds=definite,indirect --errors-for-leak-kinds=definite,indirect
    --track-origins=yes --num-callers=40 --fair-sched=try
    --suppressions="$OUT/valgrind.supp" --show-error-list=yes)

# valgrind's suppressions: false positives in third-party code only, each matched by its
# whole call path. Never a leak (leaks have tests/lsan.supp's rule), never a frame of
# libinfer's own code as the place of the error.
write_valgrind_supp() {
    cat > "$OUT/valgrind.supp" <<'SUPP'
# tract-core, OptMatMul::output_facts: `self.mmm.iter().map(|m| m.internal_type()).all_equal()`
# compares tract_data::DatumType values (an enum whose quantized variants QI8/QU8/QI32
# carry a QParams payload) in safe code. LLVM's loop unswitching hoists the test of the
# payload's own discriminant out of the comparison loop, before the test that the variant
# has a payload; for F32 and the other payload-free variants those bytes were never
# written (the stack slot internal_type() returns into), so valgrind sees a conditional
# jump on uninitialised bits. Both unswitched loop bodies read the payload only after
# checking the variant, so the result never depends on them (LLVM freezes the hoisted
# value). Seen once per optimized matmul when repository_demo loads the ONNX models.
{
   tract-core OptMatMul::output_facts: all_equal over DatumType, unswitched payload test
   Memcheck:Cond
   ...
   fun:_ZN9itertools9Itertools9all_equal*
   fun:*OptMatMul*TypedOp*output_facts*
}
SUPP
}

valgrind_pass() {
    local S="valgrind" entry name lang srcs rc log verdict
    if ! command -v valgrind >/dev/null; then
        apt_install valgrind || true
    fi
    if ! command -v valgrind >/dev/null; then
        section "valgrind: not available, pass skipped"
        record "$S" "(valgrind not installed)" skipped
        return 0
    fi
    write_valgrind_supp
    section "valgrind: building (no sanitizers)"
    build valgrind canary_leak c "$OUT/canary/leak.c"
    build_programs valgrind

    section "valgrind: canary"
    log="$LOGS/valgrind-canary_leak.log"
    rc=0; (cd "$OUT/valgrind" && timeout "$RUN_TIMEOUT" "${VALGRIND[@]}" ./canary_leak) >"$log" 2>&1 || rc=$?
    if [[ "$(vg_verdict "$rc" "$log")" == LEAK ]]; then
        echo "  canary_leak: definitely lost block reported"
        record "$S" "canary: leak is reported" ok
    else
        echo "  canary_leak: NOT reported (exit $rc):"
        tail -n 30 "$log"
        record "$S" "canary: leak is reported" "FAILED" "valgrind missed it"
    fi

    for entry in "${programs[@]}"; do
        IFS=: read -r name lang srcs <<<"$entry"
        built valgrind "$S" "$name" || continue
        section "valgrind: $name"
        log="$LOGS/valgrind-$name.log"
        program_args "$name"
        rc=0; (cd "$OUT/valgrind" && timeout "$RUN_TIMEOUT" "${VALGRIND[@]}" "./$name" "${args[@]}") >"$log" 2>&1 || rc=$?
        verdict=$(vg_verdict "$rc" "$log")
        collect_vg_suppressions "$log"
        if [[ "$verdict" == ok ]]; then
            grep -E 'ERROR SUMMARY|definitely lost|indirectly lost' "$log" | sed 's/^==[0-9]*== */  | /'
        else
            echo "  $verdict; the report (full output in $log):"
            local start
            start=$(grep -n -m 1 -E '^==[0-9]+== (Invalid|Conditional|Use of|Syscall|Mismatched|[0-9,]+ .*bytes in)|^FAIL ' "$log" | cut -d: -f1 || true)
            tail -n +"${start:-1}" "$log" | head -n 400
        fi
        local note reachable
        note=$(test_note "$log")
        # What the process still holds at exit: one-time state (the config parser's
        # descriptor pool, ...), the same whether a program sends 1 request or 4000.
        reachable=$(sed -n 's/.*still reachable: \([0-9,]*\) bytes.*/\1/p' "$log" | tail -n 1)
        [[ -n "$reachable" ]] && note="${note:+$note; }${reachable} bytes reachable at exit"
        record "$S" "$name" "$verdict" "$note"
    done
}

summary() {
    local rc=$? passed=0 nfailed=0 r sec name verdict note last=""
    [[ $rc -ne 0 && ${#results[@]} -eq 0 ]] && failed=1
    printf '\n%s== memcheck summary%s\n' "$bold" "$plain"
    for r in "${results[@]}"; do
        IFS='|' read -r sec name verdict note <<<"$r"
        if [[ "$sec" != "$last" ]]; then
            case "$sec" in
            asan) echo "AddressSanitizer + LeakSanitizer + UBSan (programs instrumented, libinfer.so not):" ;;
            valgrind) echo "valgrind memcheck (definite/indirect leaks, every error):" ;;
            esac
            last="$sec"
        fi
        printf '  %-30s %-26s %s\n' "$name" "$verdict" "$note"
        case "$verdict" in
        ok) passed=$((passed + 1)) ;;
        skipped) ;;
        *) nfailed=$((nfailed + 1)) ;;
        esac
    done
    if [[ -n "$suppressed" ]]; then
        echo "leak suppressions used (tests/lsan.supp):"
        printf '%s' "$suppressed" | sed 's/^/  /'
    else
        echo "leak suppressions used: none"
    fi
    if [[ -n "$vg_suppressed" ]]; then
        echo "valgrind suppressions used (false positives in third-party code, see $OUT/valgrind.supp):"
        printf '%s' "$vg_suppressed" | sed 's/^/  /'
    fi
    echo "logs: $LOGS/"
    if [[ $rc -ne 0 && $nfailed -eq 0 ]]; then
        nfailed=1
        echo "memcheck: stopped early (exit $rc)"
    fi
    echo "memcheck: $passed passed, $nfailed failed"
    [[ $nfailed -eq 0 && $failed -eq 0 ]] || exit 1
}
trap summary EXIT

write_canaries
for tool in $TOOLS; do
    case "$tool" in
    asan) asan_pass ;;
    valgrind) valgrind_pass ;;
    *) echo "memcheck: unknown tool '$tool' in INFER_MEMCHECK_TOOLS" >&2; exit 2 ;;
    esac
done
