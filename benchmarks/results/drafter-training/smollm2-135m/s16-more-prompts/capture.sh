#!/usr/bin/env bash
# session 16 (the same AVX2 machine as session 15): more new prompts appended to the session-15 cache (ids already
# captured are skipped). The session-15 sources with --limit 1777; the capture takes prompts in a fixed
# pseudo-random order, so a 45-min capture is a new random subset of ~29k uncaptured prompts
LIMIT=1777 exec bash "$(dirname "$0")/../s15-new-prompts/capture.sh"
