#!/usr/bin/env bash
# walk + copy diagnosis of a portable checkpoint on the held-out text, outputs in /work/runs/s19: walk.sh NAME CK
mkdir -p /work/runs/s19
RUN=/work/runs/s19 exec bash "$(dirname "$0")/../s15-new-prompts/walk.sh" "$@"
