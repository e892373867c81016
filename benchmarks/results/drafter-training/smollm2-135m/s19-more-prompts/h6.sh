#!/usr/bin/env bash
# session 19 (the same AVX2 machine): the shipped weights (h5, step 47,210) continued on the whole session-15
# cache (the session-15 to -19 captures), h5's options (--repeat-keep 0.25). Run as STEPS=<47210 + N> MINUTES=M
RUN=${RUN:-/work/runs/s19/h6} exec bash "$(dirname "$0")/../s17-more-prompts/h4.sh"
