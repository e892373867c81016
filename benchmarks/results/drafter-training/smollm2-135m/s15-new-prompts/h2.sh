#!/usr/bin/env bash
# session 15: the shipped weights (h1b, step 29,140) continued on the session-15 capture only (new prompts,
# fresh AVX2 machine), h1b's options, a new schedule peaking at 3e-4
# (since session 27: START= replaces the --resume-from and --new-schedule options, e.g. START="--grow-from CK")
cd /work/main
pydflash train --target smollm2-135m --out ${RUN:-/work/runs/s15/h2} --no-capture \
  --layers 2 --block-size 8 --max-new 192 --threads 2 \
  --steps ${STEPS:?} --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-55} --quant Q4_K_M \
  --copy-weight 1.0 --copy-head 1,4,7 --copy-match 2 --copy-successor \
  ${START:---resume-from /work/main/benchmarks/results/drafter-training/smollm2-135m/portable-checkpoint.pt --new-schedule} \
  ${EXTRA_ARGS:-} --save-portable ${RUN:-/work/runs/s15/h2}/portable.pt \
  --curve ${RUN:-/work/runs/s15/h2}/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
