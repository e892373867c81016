#!/usr/bin/env bash
# session 24 (the session-23 machine again, its capture still on disk): the shipped weights (h10, step 64,800, the
# committed portable checkpoint) continued on the union of session 23's capture (a third of an anchor pass drawn
# by h10) and this session's fresh one (../s23-fresh-avx2/capture.sh: sequences never trained on), with h10's
# options (peak lr 1.5e-4). SRCS: the capture caches, space-separated; their shards are linked into RUN/union
# under distinct names. Run as SRCS="A/cache B/cache" RUN=... STEPS=$((64800 + N)) MINUTES=M
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${RUN:?}; SRCS=${SRCS:?}
mkdir -p "$RUN/union"
python "$HERE/../link_union.py" "$RUN/union" $SRCS  # (as run, the same linking was written out here)
RUN=$RUN SRC=$RUN/union exec bash "$HERE/../s23-fresh-avx2/h10.sh"
