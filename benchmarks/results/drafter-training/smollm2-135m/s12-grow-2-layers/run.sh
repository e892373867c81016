#!/usr/bin/env bash
# session 12: the capacity test. Train loss ~ validation loss (3.0 vs 3.1) and 5,857 more steps on the
# same data left held-out tau flat, so the 1-layer drafter looks capacity-bound, not data-bound:
# grow the shipped run (s10, step 21,161) to 2 layers (the new one on top, starting as the identity)
# and train on the same session-9 capture.
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s12-2l --no-capture \
  --layers 2 --block-size 8 --max-new 192 --threads 2 \
  --steps 28500 --seqs-per-step 4 --anchors-per-seq 32 --lr 5e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-62} --quant Q4_K_M \
  --grow-from /work/runs/s10/portable.pt --save-portable /work/runs/s12-2l/portable.pt \
  --curve /work/runs/s12-2l/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
