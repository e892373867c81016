#!/usr/bin/env bash
# export a portable checkpoint (e.g. a weight average) to BF16 + Q4_K_M GGUF with its draft vocabulary: export.sh CK RUN
# (QUANT= for other quantizations, LAYERS= for another depth; RUN/cache only has to be a feature cache: the held-out one)
set -euo pipefail
CK=$1; RUN=$2
mkdir -p "$RUN"; [ -e "$RUN/cache" ] || ln -s /work/runs/s15/heldout-cache "$RUN/cache"
cd /work/main
pydflash train --target smollm2-135m --out "$RUN" --no-capture --export-only \
  --layers ${LAYERS:-2} --block-size 8 --max-new 192 --threads 2 --draft-vocab 8192 --quant ${QUANT:-Q4_K_M} \
  --copy-weight 1.0 --copy-head 1,4,7 --copy-match 2 --copy-successor \
  --resume-from "$CK" 2>&1 | grep -v "^llama\|^load\|^print_info" | tail -3
