#!/usr/bin/env bash
# Builds libinfer (release) and the C and C++ examples, then serves the shipped model
# repository models/ (ONNX models, a sequence model and an ensemble), streams tokens from
# its generative tiny_gpt2, and runs the quickstarts (C and C++), the concurrent client,
# the dynamic batching, sequence and pipeline demos, the C++ custom backend and the C++
# chat example (with a generated model). Installs
# gcc, g++, cmake and ninja with apt-get only when they are missing, and ONNX Runtime's
# library from its PyPI wheel (pinned, cached in target/onnxruntime).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

ensure_build_tools

echo "== cargo build --release"
cargo build --release

# ONNX models run on ONNX Runtime (the pinned wheel's library); without PyPI they run on
# tract, and the log says so.
if ensure_onnxruntime target/onnxruntime; then
    export INFER_ONNXRUNTIME_LIBRARY="$ORT_LIB"
fi

echo "== cpp_examples (CMake)"
build_cpp_examples

echo "== repository_demo (serves models/)"
cpp_examples/build/repository_demo

echo "== streaming_demo (generative models/tiny_gpt2: streaming, in-flight batching, cancel)"
cpp_examples/build/streaming_demo

echo "== quickstart"
cpp_examples/build/quickstart

echo "== quickstart_cpp"
cpp_examples/build/quickstart_cpp

echo "== concurrent_client"
cpp_examples/build/concurrent_client

echo "== dynamic_batching_demo"
cpp_examples/build/dynamic_batching_demo

echo "== sequence_demo"
cpp_examples/build/sequence_demo

echo "== pipeline_demo"
cpp_examples/build/pipeline_demo

echo "== custom_backend (C++)"
cpp_examples/build/custom_backend

# Text in and out: a random-weight Llama model with a trained tokenizer and a chat template
# (scripts/make_llama.py, with the pinned Python packages), so its replies are gibberish.
echo "== chat (C++: streaming text through the model's chat template)"
chat_model=target/llm-models/tiny-llama
if llm_python target/llm-venv && { [[ -f "$chat_model/text-cases.json" ]] ||
    target/llm-venv/bin/python scripts/make_llama.py make --out "$chat_model" --arch llama \
        --shape tiny --rope-scaling llama3 --attention-bias; }; then
    cpp_examples/build/chat "$chat_model/model-q8_0.gguf" --max-tokens 24 --ignore-eos \
        --system "You answer briefly." "Hello there!" "And what else?"
else
    echo "SKIP: the Python packages that make the model could not be installed from PyPI"
fi
