#!/usr/bin/env bash
# session 31: a fresh machine (empty cache; the 706k tokens q2 and the session-30 capture held are not here), so
# new data only: every id any earlier Qwen capture took (../*/captured-ids.txt.gz) is skipped. First the library/chat
# sources (../s26-first-capture/capture.sh) at --limit 4000, so the even spread reaches prompts the --limit 1777
# list never held; then HumanEval 0-131 with sampled continuations (../../smollm2-135m/s29-in-domain/capture.sh),
# the two kinds of data q2 trained on. Run as BASE=/work/runs/sN LIB_MINUTES=M HE_MINUTES=M.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:?}; mkdir -p "$BASE"
zcat "$HERE"/../*/captured-ids.txt.gz | sort -u > "$BASE/qwen-seen-ids.txt"
OUT=$BASE/qwen-lib MINUTES=${LIB_MINUTES:-22} LIMIT=4000 EXTRA_ARGS="--exclude-ids $BASE/qwen-seen-ids.txt" \
  bash "$HERE/../s26-first-capture/capture.sh"
TARGET=qwen2.5-coder-0.5b OUT=$BASE/qwen-he MINUTES=${HE_MINUTES:-14} EXTRA_ARGS="--exclude-ids $BASE/qwen-seen-ids.txt" \
  bash "$HERE/../../smollm2-135m/s29-in-domain/capture.sh"
