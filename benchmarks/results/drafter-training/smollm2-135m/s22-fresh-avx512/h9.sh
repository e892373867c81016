#!/usr/bin/env bash
# session 22 (a fresh AVX-512 VNNI machine): the shipped weights (h8, step 62,300, the committed portable checkpoint)
# continued on this session's capture only (capture.sh), h8's options (bf16 autocast: `auto` picks it on this
# AVX512-BF16 CPU: 0.46 s/step against 0.75 in float32 on session 21's AVX2 CPU). Started as STEPS=67700 MINUTES=65,
# stopped at step 63,500 once the step time was known and resumed from RUN/checkpoint.pt as STEPS=69000 MINUTES=50
# (a resumed run recomputes the cosine from STEPS)
RUN=${RUN:-/work/runs/s22/h9} SRC=${SRC:-/work/runs/s22/data/cache} exec bash "$(dirname "$0")/../s17-more-prompts/h4.sh"
