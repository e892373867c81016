#!/usr/bin/env bash
# session 12: the shipped drafter (step 15,304, the committed portable checkpoint) on this session's
# new capture only (shards 67+ of the session-9 cache: 0.70 M tokens it has never seen), with a new
# learning-rate schedule (warm-up, peak 3e-4, cosine over the chunk)
# its cache: a meta.json listing only the new shards, each a link to the session-9 cache's file:
#   python -c "import json,os; m=json.load(open('/work/runs/smollm2-s9/cache/meta.json')); \
#     m['shards']=[s for s in m['shards'] if int(s['file'][6:11])>=67]; os.makedirs('/work/runs/s12-1l/cache',exist_ok=True); \
#     json.dump(m,open('/work/runs/s12-1l/cache/meta.json','w')); \
#     [os.symlink('/work/runs/smollm2-s9/cache/'+s['file'],'/work/runs/s12-1l/cache/'+s['file']) for s in m['shards']]"
# start-portable.pt = benchmarks/results/drafter-training/smollm2-135m/portable-checkpoint.pt
cd /work/main
pydflash train --target smollm2-135m --out /work/runs/s12-1l --no-capture \
  --layers 1 --block-size 8 --max-new 192 --threads 2 \
  --steps 19000 --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 \
  --eval-every 500 --checkpoint-every 250 --max-minutes ${MINUTES:-29} --quant Q4_K_M \
  --resume-from /work/runs/s12-1l/start-portable.pt --new-schedule --save-portable /work/runs/s12-1l/portable.pt \
  --curve /work/runs/s12-1l/curve.jsonl 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
