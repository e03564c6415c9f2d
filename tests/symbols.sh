#!/usr/bin/env bash
# Checks the exported interface of a built libinfer.so (builds nothing):
#   * every exported function symbol starts with infer_ (offenders are listed);
#   * the soname is libinfer.so.0.
# Usage: tests/symbols.sh path/to/libinfer.so
set -euo pipefail

lib="${1:?usage: $0 path/to/libinfer.so}"
if [[ ! -f "$lib" ]]; then
    echo "symbols: no such file: $lib" >&2
    exit 2
fi
for tool in nm readelf; do
    command -v "$tool" >/dev/null || { echo "symbols: '$tool' not found (binutils)" >&2; exit 2; }
done

failed=0

# Defined dynamic symbols: "<address> <type> <name>[@@version]". Functions are T/t
# (text), W/w (weak) and i (GNU indirect function); data symbols are not checked.
functions=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TtWwi]$/ { sub(/@.*/, "", $3); print $3 }' | sort -u)
count=$(grep -c . <<<"$functions" || true)
offenders=$(grep -v '^infer_' <<<"$functions" || true)
if [[ -n "$offenders" ]]; then
    echo "symbols: FAIL: exported functions without the infer_ prefix:"
    sed 's/^/    /' <<<"$offenders"
    failed=1
else
    echo "symbols: OK: all $count exported functions start with infer_"
fi

soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
if [[ "$soname" == "libinfer.so.0" ]]; then
    echo "symbols: OK: soname is $soname"
else
    echo "symbols: FAIL: soname is '${soname:-none}', expected 'libinfer.so.0'"
    failed=1
fi

exit "$failed"
