#!/usr/bin/env bash
# session 26: the first capture for a Qwen2.5-Coder-0.5B drafter (issue #27, item 6), started once SmolLM2's curve
# had flattened: the SmolLM2 recipe's capture command (../../smollm2-135m/s15-new-prompts/capture.sh: its sources,
# 16 sequences in flight, the target's default taps) at --limit ${LIMIT:-1777}, with HumanEval 0-131 (plain and as chat
# requests; 132-163 are held out by the loader) put first. Run as OUT=/work/runs/sN/qwen-data MINUTES=M; the same OUT
# continues (prompts already in its cache are skipped). (As run it spelled the command out with --layers 2, which a
# capture does not use: the taps are the target's defaults either way.)
HERE=$(cd "$(dirname "$0")" && pwd)
TARGET=qwen2.5-coder-0.5b MORE_SOURCES=humaneval,chat:humaneval LIMIT=${LIMIT:-1777} OUT=${OUT:?} \
  exec bash "$HERE/../../smollm2-135m/s15-new-prompts/capture.sh"
