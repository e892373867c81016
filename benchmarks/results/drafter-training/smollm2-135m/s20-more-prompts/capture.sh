#!/usr/bin/env bash
# session 20: session 16's capture continued again (run as MINUTES=25)
exec bash "$(dirname "$0")/../s16-more-prompts/capture.sh"
