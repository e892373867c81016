#!/usr/bin/env bash
# Build and run the kernel micro-benchmark (no Python, no ggml library): micro.sh [isa] [type...]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
L="$(ls -d "$root"/.cache/llama-cpp-python-*/vendor/llama.cpp | head -1)"
out="${TMPDIR:-/tmp}/pydflash-kernels-micro"
k="$root/native/src/kernels"
srcs=("$k/dispatch.cpp" "$k/kquant_scalar.cpp" "$k/legacy_scalar.cpp")
for f in "$k"/*_avx2.cpp "$k"/*_avx512.cpp; do [ -e "$f" ] && srcs+=("$f"); done
${CXX:-g++} -std=c++17 -O3 -DNDEBUG -I"$root/native/src" -I"$L/ggml/include" \
    "$root/benchmarks/kernels/micro.cpp" "${srcs[@]}" -o "$out"
exec "$out" "$@"
