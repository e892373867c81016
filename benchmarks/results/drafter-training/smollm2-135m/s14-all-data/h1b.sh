#!/usr/bin/env bash
# session 14, second chunk: h1 (step 24,435) continued on the same 1.88 M tokens with a new schedule (peak 3e-4) and
# the copy loss on one head per KV group (1, 4, 7), successor rows
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s14/h1b --no-capture \
  --layers 2 --block-size 8 --max-new 192 --threads 2 \
  --steps 29400 --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-40} --quant Q4_K_M \
  --copy-weight 1.0 --copy-head 1,4,7 --copy-match 2 --copy-successor \
  --resume-from /work/runs/s14/h1/portable.pt --new-schedule --save-portable /work/runs/s14/h1b/portable.pt \
  --curve /work/runs/s14/h1b/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
