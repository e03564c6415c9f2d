#!/usr/bin/env bash
# Builds libinfer (release) and the C and C++ examples, then serves the shipped model
# repository models/ (ONNX models, a sequence model and an ensemble), streams tokens from
# its generative tiny_gpt2, and runs the quickstarts (C and C++), the concurrent client,
# the dynamic batching, sequence and pipeline demos and the C++ custom backend. Installs
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
