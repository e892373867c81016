#!/usr/bin/env bash
# session 23 (a fresh AVX2-only machine, empty cache): the shipped weights (h8, step 62,300, the committed portable
# checkpoint) continued on this session's capture (../s22-fresh-avx512/capture.sh with OUT= and MINUTES=60: sequences
# never trained on), h8's options, but kept to ~1/3 of an anchor pass over the capture and a new schedule peaking at
# 1.5e-4 instead of 3e-4: session 22's h9 (1.3 anchor passes over 0.64 M tokens at 3e-4) over-fitted its capture
# (validation loss 1.68 -> 1.87) and lost 0.24 tau. Run as STEPS=$((62300 + N)) MINUTES=M; it starts from the
# committed portable checkpoint, h10 (step 64,800) since session 23, so the next chunk runs as STEPS=$((64800 + N))
# (since session 27, MORE_ARGS= passes further trainer options after these, e.g. --layers 3; a --grow-from start goes through h2.sh's START=)
# (as run, this script linked the shards itself; since the same session it hands that to h4.sh, which does the same)
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${RUN:-/work/runs/s23/h10} SRC=${SRC:-/work/runs/s23/data/cache} MORE_ARGS="--lr ${LR:-1.5e-4} ${MORE_ARGS:-}" \
  exec bash "$HERE/../s17-more-prompts/h4.sh"
