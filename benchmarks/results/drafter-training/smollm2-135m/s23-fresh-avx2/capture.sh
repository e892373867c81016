#!/usr/bin/env bash
# after session 23 (for a fresh machine, empty cache): the session-15 sources at --limit 1777, minus the 18,200
# sequences the shipped drafter (h10) and its lineage trained on (trained-ids.txt.gz: session 20's list plus
# session 23's capture), into a new cache. Run as OUT=/work/runs/sN/data MINUTES=M (IDS=: another list to leave out)
HERE=$(cd "$(dirname "$0")" && pwd)
LIMIT=${LIMIT:-1777} OUT=${OUT:?} EXTRA_ARGS="--exclude-ids ${IDS:-$HERE/trained-ids.txt.gz}" \
  exec bash "$HERE/../s15-new-prompts/capture.sh"
