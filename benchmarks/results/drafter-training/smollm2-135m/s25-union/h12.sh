#!/usr/bin/env bash
# session 25 (the session-23 machine a third time, both earlier captures still on disk): session 24's h11.sh as
# run, h11 (step 67,600, the committed portable checkpoint) continued on the union of the three captures
# (2,354,466 tokens), peak lr 1.5e-4. Run as it was run here:
#   SRCS="/work/runs/s23/data/cache /work/runs/s24/data/cache /work/runs/s25/data/cache" \
#   RUN=/work/runs/s25/h12 STEPS=70600 MINUTES=50 bash h12.sh
# h12 shipped, so the committed portable checkpoint is its step 70,600 now (h11's is in commit 16eaf9e): run again,
# this starts from h12, and the next chunk runs as STEPS=$((70600 + N)).
HERE=$(cd "$(dirname "$0")" && pwd)
exec bash "$HERE/../s24-union/h11.sh"
