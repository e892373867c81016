#!/usr/bin/env bash
# start-portable.pt = benchmarks/results/drafter-training/smollm2-135m/portable-checkpoint.pt of commit 3b3000a (the shipped weights, step 15,304);
# cache = a link to the s12-new-data cache (runs/s12-1l/cache)
# session 13: the shipped 1-layer drafter grown to 2 layers (the new layer on top starts as the identity), the copy-head
# loss on the top layer's query head 1 with 2-token matches (layer 1 can bring the token before the anchor into slot 1),
# on the session-12 capture only (links to shards 67+ of the session-9 cache), 3,696 steps like copy-w1 and s12-new-data
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s13/copy2-2l --no-capture \
  --layers 2 --block-size 8 --max-new 192 --threads 2 \
  --steps 19000 --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-45} --quant Q4_K_M \
  --copy-weight ${COPY_WEIGHT:-1.0} --copy-head 1 --copy-match 2 \
  --grow-from /work/runs/s13/start-portable.pt --save-portable /work/runs/s13/copy2-2l/portable.pt \
  --curve /work/runs/s13/copy2-2l/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
