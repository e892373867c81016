#!/usr/bin/env bash
# Build and run the kernel micro-benchmark (no Python, no ggml library): micro.sh [isa] [type...]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
L="$(ls -d "$root"/.cache/llama-cpp-python-*/vendor/llama.cpp | head -1)"
out="${TMPDIR:-/tmp}/pydflash-kernels-micro"
k="$root/native/src/kernels"
srcs=("$k/dispatch.cpp" "$k/kquant_scalar.cpp" "$k/legacy_scalar.cpp")
for f in "$k"/*_avx2.cpp "$k"/*_avx512.cpp; do [ -e "$f" ] && srcs+=("$f"); done
# with a built tree (pip install -e .), also time ggml-cpu's own one-row vec_dot on the same weights
b="$(ls -d "$root"/build/*/llama.cpp/ggml/src 2>/dev/null | head -1 || true)"
extra=()
if [ -n "$b" ] && [ -f "$b/libggml-cpu.a" ]; then
    extra=(-DDFLASH_MICRO_GGML "$b/libggml-cpu.a" "$b/libggml-base.a" -fopenmp -lpthread)
fi
${CXX:-g++} -std=c++17 -O3 -DNDEBUG -I"$root/native/src" -I"$L/ggml/include" \
    "$root/benchmarks/kernels/micro.cpp" "${srcs[@]}" "${extra[@]}" -o "$out"
exec "$out" "$@"
