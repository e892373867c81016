#!/usr/bin/env bash
# after session 29: the next Qwen2.5-Coder-0.5B chunk (not run yet). q1 (the committed portable checkpoint, step
# 2,800) continued on the union of the library/chat capture (../s26-first-capture/capture.sh, 483,490 tokens after
# session 28; q1 trained on its first 245,893) and session 29's HumanEval 0-131 capture with sampled continuations
# (../../smollm2-135m/s29-in-domain/capture.sh with TARGET=qwen2.5-coder-0.5b): the data that took SmolLM2's
# drafter past 2.5 (../../smollm2-135m/README.md, "Session 29"). q1's options (../s28-first-drafter/q1.sh).
# Run as SRCS="/work/runs/s26/qwen-data/cache /work/runs/s29/qwen-he-data/cache" RUN=... STEPS=$((2800 + N)) MINUTES=M
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${RUN:?}; SRCS=${SRCS:?}
python "$HERE/../../link_union.py" "$RUN/union" $SRCS
RUN=$RUN SRC=$RUN/union START="--resume-from $HERE/../portable-checkpoint.pt --new-schedule" \
  exec bash "$HERE/../s28-first-drafter/q1.sh"
