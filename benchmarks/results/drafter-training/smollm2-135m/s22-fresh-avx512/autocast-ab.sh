#!/usr/bin/env bash
# session 22: h9 (bf16 autocast, this session's 0.64 M-token capture only) regressed (held-out walk 2.452 -> 2.216).
# A/B at equal steps: h8 continued 800 steps on the same cache with h9's options, --autocast fp32 against bf16,
# then the walk of each on the held-out text (outputs in /work/runs/s20, walk-ab-fp32/-bf16.json)
set -e
T=$(cd "$(dirname "$0")/.." && pwd)
for A in fp32 bf16; do
  R=/work/runs/s22/ab-$A; mkdir -p $R; ln -sfn /work/runs/s22/h9/cache $R/cache
  pydflash train --target smollm2-135m --out $R --no-capture --layers 2 --block-size 8 --max-new 192 --threads 2 \
    --steps 63100 --seqs-per-step 4 --anchors-per-seq 32 --lr 3e-4 --draft-vocab 8192 --autocast $A \
    --eval-every 400 --checkpoint-every 400 --max-minutes 15 --quant '' --copy-weight 1.0 --copy-head 1,4,7 \
    --copy-match 2 --copy-successor --repeat-keep 0.25 --repeat-ngram 16 --seed 0 \
    --resume-from $T/portable-checkpoint.pt --new-schedule --save-portable $R/portable.pt 2>&1 \
    | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
  bash $T/s20-more-prompts/walk.sh ab-$A $R/portable.pt
done
