#!/usr/bin/env bash
# session 28: the first Qwen2.5-Coder-0.5B drafter (issue #27, item 6), from the target's own last layer, on the
# sessions 26-27 capture (../s26-first-capture/capture.sh, 260,016 tokens) with the SmolLM2 recipe's options
# (../../smollm2-135m/s15-new-prompts/h2.sh) except, so that the shipped file stays <= 20 MB (a full 0.5B-shaped
# layer is ~9.6 MB at Q4_K_M, the 8,192-row head 7.8 MB, the rank-32 selector tables over 151,936 tokens 6.7 MB):
# 1 layer, its FFN half the target's width (--ffn 2432, the target's strongest neurons), selector rank 16; and
# --copy-match 1 (a match of 2 tokens needs a second layer to see the token before the anchor). (Rank 16 saved
# nothing: rows of 16 cannot be Q5_0, so its tables are F16, 9.7 MB against rank 32's 6.7 MB at Q5_0. What brings
# the file under 20 MB is leaving out the tokenizer and the head rows, which the engine takes from the target:
# --no-tokenizer --head-from-target, added to this script after the run; 26.3 -> 18.5 MB.) Run as RUN=... STEPS=N MINUTES=M [START="--resume-from CK --new-schedule"].
RUN=${RUN:?}; SRC=${SRC:-/work/runs/s26/qwen-data/cache}
mkdir -p "$RUN"; [ -e "$RUN/cache" ] || ln -s "$SRC" "$RUN/cache"
cd /work/main
pydflash train --target qwen2.5-coder-0.5b --out "$RUN" --no-capture \
  --layers 1 --ffn ${FFN:-2432} --selector-rank ${RANK:-16} --block-size 8 --max-new 192 --threads 2 \
  --steps ${STEPS:?} --seqs-per-step 4 --anchors-per-seq 32 --lr ${LR:-3e-4} --draft-vocab ${VOCAB:-8192} \
  --eval-every 250 --checkpoint-every 250 --max-minutes ${MINUTES:-55} --quant Q4_K_M \
  --copy-weight 1.0 --copy-head 1,4,7 --copy-match 1 --copy-successor --repeat-keep 0.25 \
  --no-tokenizer --head-from-target ${START:-} ${EXTRA_ARGS:-} --save-portable "$RUN/portable.pt" \
  --curve "$RUN/curve.jsonl" 2>&1 | grep -v "^llama\|^load\|^print_info" | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$"
