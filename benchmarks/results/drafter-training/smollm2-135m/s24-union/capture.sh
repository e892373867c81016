#!/usr/bin/env bash
# after session 24 (for a fresh machine, empty cache): the session-15 sources at --limit 1777, minus the 20,612
# sequences h11 and its lineage trained on (trained-ids.txt.gz: session 23's list plus session 24's capture),
# into a new cache. Run as OUT=/work/runs/sN/data MINUTES=M
HERE=$(cd "$(dirname "$0")" && pwd)
LIMIT=${LIMIT:-1777} OUT=${OUT:?} EXTRA_ARGS="--exclude-ids $HERE/trained-ids.txt.gz" \
  exec bash "$HERE/../s15-new-prompts/capture.sh"
