#!/usr/bin/env bash
# Builds libinfer (release) and the C examples, then runs the quickstart, the dynamic
# batching demo, the sequence demo and the ensemble pipeline demo. Installs gcc, cmake
# and ninja with apt-get only when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh

ensure_build_tools

echo "== cargo build --release"
cargo build --release

echo "== cpp_examples (CMake)"
build_cpp_examples

echo "== quickstart"
cpp_examples/build/quickstart

echo "== dynamic_batching_demo"
cpp_examples/build/dynamic_batching_demo

echo "== sequence_demo"
cpp_examples/build/sequence_demo

echo "== pipeline_demo"
cpp_examples/build/pipeline_demo
