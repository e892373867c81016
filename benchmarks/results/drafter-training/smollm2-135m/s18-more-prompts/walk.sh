#!/usr/bin/env bash
# walk + copy diagnosis of a portable checkpoint on the held-out text, outputs in /work/runs/s18: walk.sh NAME CK
RUN=/work/runs/s18 exec bash "$(dirname "$0")/../s15-new-prompts/walk.sh" "$@"
