#!/usr/bin/env bash
# walk + copy diagnosis of a portable checkpoint on the held-out text, outputs in /work/runs/s20: walk.sh NAME CK
mkdir -p /work/runs/s20
RUN=/work/runs/s20 exec bash "$(dirname "$0")/../s15-new-prompts/walk.sh" "$@"
