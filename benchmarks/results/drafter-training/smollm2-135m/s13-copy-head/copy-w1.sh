#!/usr/bin/env bash
# start-portable.pt = benchmarks/results/drafter-training/smollm2-135m/portable-checkpoint.pt of commit 3b3000a (the shipped weights, step 15,304);
# cache = a link to the s12-new-data cache (runs/s12-1l/cache)
# session 13: session 12's new-data chunk (s12-new-data/run.sh: shipped weights, the session-12 capture only,
# new schedule, 3,696 steps) plus the copy-head loss (--copy-weight 1.0 on query head 1): equal steps, same seed
# its cache: the s12-new-data cache (links to shards 67+ of the session-9 cache)
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s13/copy-w1 --no-capture \
  --layers 1 --block-size 8 --max-new 192 --threads 2 \
  --steps 19000 --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-40} --quant Q4_K_M \
  --copy-weight ${COPY_WEIGHT:-1.0} --copy-head 1 \
  --resume-from /work/runs/s13/start-portable.pt --new-schedule --save-portable /work/runs/s13/copy-w1/portable.pt \
  --curve /work/runs/s13/copy-w1/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
