#!/usr/bin/env bash
# session 17 (the same AVX2 machine as sessions 15-16): a third 45-min capture appended to the session-15 cache,
# the same sources and --limit 1777 as session 16; cached ids are skipped, so every sequence is a new prompt
LIMIT=1777 exec bash "$(dirname "$0")/../s15-new-prompts/capture.sh"
