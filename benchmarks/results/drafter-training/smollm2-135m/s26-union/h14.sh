#!/usr/bin/env bash
# session 26 (the session-23 machine a fourth time, all earlier captures still on disk): session 24's h11.sh as
# run, h12 (step 70,600, the committed portable checkpoint) continued on the union of the four captures: sessions
# 23, 24 and 25's, and session 25's second one (s25/data2), which this session extended (the same OUT: prompts
# already in it are skipped). Peak lr 1.5e-4. Run as it was run here:
#   SRCS="/work/runs/s23/data/cache /work/runs/s24/data/cache /work/runs/s25/data/cache /work/runs/s25/data2/cache" \
#   RUN=/work/runs/s26/h14 STEPS=$((70600 + N)) MINUTES=M bash h14.sh
HERE=$(cd "$(dirname "$0")" && pwd)
exec bash "$HERE/../s24-union/h11.sh"
