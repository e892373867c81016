#!/usr/bin/env bash
# session 14: copys-2l (the committed portable checkpoint, step 19,000) continued on the whole session-9 + session-12 capture, 1.88 M tokens (OUT/cache is a link to
# runs/smollm2-s9/cache, shards 0..104), new schedule peaking at 3e-4, copy loss on the successor rows, heads 1
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s14/h1 --no-capture \
  --layers 2 --block-size 8 --max-new 192 --threads 2 \
  --steps 24500 --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-44} --quant Q4_K_M \
  --copy-weight 1.0 --copy-head 1 --copy-match 2 --copy-successor \
  --resume-from /work/runs/s14/start-portable.pt --new-schedule --save-portable /work/runs/s14/h1/portable.pt \
  --curve /work/runs/s14/h1/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
