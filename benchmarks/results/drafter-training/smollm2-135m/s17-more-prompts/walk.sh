#!/usr/bin/env bash
# walk + copy diagnosis of a portable checkpoint on the held-out text, outputs in /work/runs/s17: walk.sh NAME CK
RUN=/work/runs/s17 exec bash "$(dirname "$0")/../s15-new-prompts/walk.sh" "$@"
