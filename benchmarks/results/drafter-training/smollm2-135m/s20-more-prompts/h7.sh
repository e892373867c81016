#!/usr/bin/env bash
# session 20 (the same AVX2 machine): the shipped weights (h6, step 51,460) continued on the whole session-15
# cache (the session-15 to -20 captures), h6's options (--repeat-keep 0.25). Run as FROM=25 STEPS=55460 MINUTES=52:
# the trainer read the whole cache into RAM then, and all 4.29 M tokens (20 GB) did not fit in 24 GiB; it maps it now
RUN=${RUN:-/work/runs/s20/h7} exec bash "$(dirname "$0")/../s17-more-prompts/h4.sh"
