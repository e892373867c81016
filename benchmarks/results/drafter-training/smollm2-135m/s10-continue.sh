#!/usr/bin/env bash
# session 10: continue the shipped hard-label run (step 15,304, optimizer state kept) on the same
# session-9 capture: its validation loss was still falling and each continuation position had been
# an anchor only ~2 times
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s10 --no-capture \
  --layers 1 --block-size 8 --max-new 192 --threads 2 \
  --steps 28500 --seqs-per-step 4 --anchors-per-seq 32 --lr 6e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-75} --quant Q4_K_M \
  --save-portable /work/runs/s10/portable.pt \
  --curve /work/runs/s10/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
