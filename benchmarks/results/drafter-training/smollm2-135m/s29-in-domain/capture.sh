#!/usr/bin/env bash
# session 29: HumanEval 0-131 (132-163 are always left out) with 20 sampled continuations per prompt at
# temperature 0.7 next to the greedy one, for SmolLM2: completions shaped like the held-out ones, other problems.
# The prompts are taken in a fixed pseudo-random order, so a capture cut short by MINUTES covers them all evenly.
# Run as OUT=/work/runs/sN/he-data MINUTES=30 EXTRA_ARGS="--exclude-ids ../s26-union/seen-ids.txt.gz"
# (that list holds no HumanEval id: it only keeps the command the one that ran)
OUT=${OUT:?}
pydflash train --target ${TARGET:-smollm2-135m} --prompts humaneval --out $OUT --layers 1 --block-size 8 \
  --max-new 192 --parallel 16 --step-rows 64 --threads 2 --capture-only --max-minutes ${MINUTES:-30} \
  --samples ${SAMPLES:-20} --sample-temp ${TEMP:-0.7} ${EXTRA_ARGS:-} 2>&1 \
  | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
