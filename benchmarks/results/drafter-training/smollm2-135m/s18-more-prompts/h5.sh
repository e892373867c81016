#!/usr/bin/env bash
# session 18 (the same AVX2 machine): the shipped weights (h4, step 43,120) continued on the whole session-15
# cache (3.23 M tokens: the session-15, -16, -17 captures and this session's 0.65 M), h4's options
# (--repeat-keep 0.25). Run as STEPS=47210 MINUTES=75 (the training was paused while benchmarks ran)
RUN=${RUN:-/work/runs/s18/h5} exec bash "$(dirname "$0")/../s17-more-prompts/h4.sh"
