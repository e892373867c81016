#!/usr/bin/env bash
# session 31: q2 (the committed portable checkpoint, step 6,800) continued on this session's fresh capture only
# (capture.sh: new library/chat prompts and new HumanEval 0-131 samples). A cache of new data only is small against
# what q2 trained on, so the chunk stays under one anchor pass over it and the peak lr is lower than q2's (SmolLM2,
# session 22: 1.3 passes over a fresh-only cache made the drafter forget; session 23: a third of a pass at 1.5e-4
# gained). q1's options (../s28-first-drafter/q1.sh); bf16 autocast where `auto` picks it.
# Run as BASE=/work/runs/sN RUN=... STEPS=$((6800 + N)) MINUTES=M [LR=2e-4]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${RUN:?}; BASE=${BASE:?}
python "$HERE/../../link_union.py" "$RUN/union" "$BASE/qwen-lib/cache" "$BASE/qwen-he/cache"
RUN=$RUN SRC=$RUN/union LR=${LR:-2e-4} START="--resume-from $HERE/../portable-checkpoint.pt --new-schedule" \
  exec bash "$HERE/../s28-first-drafter/q1.sh"
