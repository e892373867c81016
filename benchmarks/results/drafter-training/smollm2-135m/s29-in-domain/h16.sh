#!/usr/bin/env bash
# session 29 (the session-23 machine a seventh time, every earlier capture still on disk): h12 (step 70,600, the
# committed portable checkpoint) continued on the union of two captures h12 never trained on: session 29's
# HumanEval 0-131 capture with sampled continuations (capture.sh: the same prompt shape as the held-out
# 132-163, other problems; labels are the target's greedy predictions on every row) and session 25's second
# capture (s25/data2, 0.89 M tokens of the usual library/chat sources), h12's options and schedule (peak 1.5e-4).
# Run as it was run here:
#   SRCS="/work/runs/s29/he-data/cache /work/runs/s25/data2/cache" RUN=/work/runs/s29/h16 STEPS=$((70600 + N)) MINUTES=M bash h16.sh
HERE=$(cd "$(dirname "$0")" && pwd)
exec bash "$HERE/../s24-union/h11.sh"
