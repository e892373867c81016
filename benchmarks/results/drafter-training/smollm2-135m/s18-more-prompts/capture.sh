#!/usr/bin/env bash
# session 18: session 16's capture again (run as MINUTES=35): 647,176 tokens at 307 tokens/s
exec bash "$(dirname "$0")/../s16-more-prompts/capture.sh"
