#!/usr/bin/env bash
# session 22 (a fresh AVX-512 VNNI machine, empty cache): the session-15 sources with session 16's --limit 1777,
# minus the 15,121 sequences h8 (and every drafter before it) trained on, into a new cache. Run as MINUTES=30
HERE=$(cd "$(dirname "$0")" && pwd)
LIMIT=${LIMIT:-1777} OUT=${OUT:-/work/runs/s22/data} EXTRA_ARGS="--exclude-ids $HERE/../s20-more-prompts/trained-ids.txt.gz" \
  exec bash "$HERE/../s15-new-prompts/capture.sh"
