#!/usr/bin/env bash
# session 27 (the session-23 machine a fifth time, all four captures on disk): the 2-layer curve has flattened
# (fixed-text tau 2.44-2.47 over the last five chunks), so add capacity: h12 (step 70,600, the committed portable
# checkpoint) grown to 3 layers (the new top layer starts as the identity: pydflash.train.init.grow_layers), a new
# schedule peaking at 2e-4, on the union of the four captures (3.24 M tokens; session 26's h14 ran on the same
# union with 2 layers). Run as it was run here:
#   SRCS="/work/runs/s23/data/cache /work/runs/s24/data/cache /work/runs/s25/data/cache /work/runs/s25/data2/cache" \
#   RUN=/work/runs/s27/h15 STEPS=$((70600 + N)) MINUTES=M bash h15.sh
HERE=$(cd "$(dirname "$0")" && pwd)
PORTABLE=$HERE/../portable-checkpoint.pt
LR=${LR:-2e-4} START="--grow-from $PORTABLE" MORE_ARGS="--layers 3 ${MORE_ARGS:-}" exec bash "$HERE/../s24-union/h11.sh"
