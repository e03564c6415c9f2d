#!/usr/bin/env bash
# libinfer against llama.cpp on the same GGUF files: builds llama.cpp from source
# (scripts/llama_cpp.sh), writes a Llama-2-shaped random-weight model of ~0.44 B
# parameters (scripts/make_llama.py, shape bench-llama: width 1024, 24 layers, 16 heads,
# 8 key/value heads, MLP 4096, vocabulary 32000) as an F16 GGUF, quantizes it with
# llama.cpp's own llama-quantize to Q8_0 and Q4_K_M, then runs benches/generation.rs's
# `llama-cpp` scenario: single-stream generation, prompt processing and concurrent streams,
# same threads, interleaved runs. Everything is cached under $TARGET_DIR/llm-bench.
#
# Usage: scripts/bench_llama.sh [--threads N] [--rounds N] [--streams 8,32]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

bin="$(scripts/llama_cpp.sh | tail -1)"
venv="$TARGET_DIR/llm-venv"
llm_python "$venv"
out="$TARGET_DIR/llm-bench/llama-0.4b"
if [[ ! -f "$out/model-f16.gguf" ]]; then
    "$venv/bin/python" scripts/make_llama.py make --out "$out" --arch llama --shape bench-llama
fi
for q in Q8_0 Q4_K_M; do
    f="$out/model-$(echo "$q" | tr 'A-Z' 'a-z').gguf"
    [[ -f "$f" ]] || "$bin/llama-quantize" "$out/model-f16.gguf" "$f" "$q" >/dev/null 2>&1
done
cargo bench --bench generation -- llama-cpp --llama-bin "$bin" \
    --gguf "$out/model-q8_0.gguf" --gguf "$out/model-q4_k_m.gguf" --threads 2 --rounds 3 "$@"
