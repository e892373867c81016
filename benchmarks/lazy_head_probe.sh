#!/bin/sh
# Build and run benchmarks/lazy_head_probe.cpp against the static libllama/ggml of the editable
# build (build/<wheel tag>), e.g.: sh benchmarks/lazy_head_probe.sh qwen2.5-coder-1.5b 8 2 7
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(ls -d "$ROOT"/build/*/llama.cpp | head -n1)
SRC=$(grep -m1 "llama.cpp_SOURCE_DIR:STATIC=" "$BUILD/../CMakeCache.txt" | cut -d= -f2)
OUT=${TMPDIR:-/tmp}/lazy_head_probe
c++ -O2 -std=c++17 "$ROOT/benchmarks/lazy_head_probe.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
    "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" \
    "$BUILD/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -o "$OUT"
MODEL=$(python -c "import sys; from pydflash.fetch import registry as models; print(models.path(sys.argv[1]))" "${1:-qwen2.5-coder-1.5b}")
shift || true
"$OUT" "$MODEL" "$@"
