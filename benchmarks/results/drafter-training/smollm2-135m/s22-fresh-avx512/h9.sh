#!/usr/bin/env bash
# session 22 (a fresh AVX-512 VNNI machine): the shipped weights (h8, step 62,300, the committed portable checkpoint)
# continued on this session's capture only (capture.sh), h8's options (bf16 autocast: `auto` picks it on this
# AVX512-BF16 CPU). Run as STEPS=$((62300 + N)) MINUTES=M
RUN=${RUN:-/work/runs/s22/h9} SRC=${SRC:-/work/runs/s22/data/cache} exec bash "$(dirname "$0")/../s17-more-prompts/h4.sh"
