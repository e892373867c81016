#!/usr/bin/env bash
# sessions 20-21 (the same AVX2 machine): the shipped weights (h7, step 55,460) continued on the whole session-15
# cache (4.29 M tokens, mapped from the shard files), h7's options, no new capture: the test of more steps on the
# data already captured against a capture-plus-chunk round. Started at the end of session 20 (to step 55,750),
# resumed in session 21 from RUN/checkpoint.pt as STEPS=62300 MINUTES=94 (the schedule recomputed from STEPS)
RUN=${RUN:-/work/runs/s21/h8} exec bash "$(dirname "$0")/../s20-more-prompts/h7.sh"
