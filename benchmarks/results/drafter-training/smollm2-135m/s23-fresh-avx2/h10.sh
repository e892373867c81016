#!/usr/bin/env bash
# session 23 (a fresh AVX2-only machine, empty cache): the shipped weights (h8, step 62,300, the committed portable
# checkpoint) continued on this session's capture (../s22-fresh-avx512/capture.sh with OUT= and MINUTES=60: sequences
# never trained on), h8's options, but kept to ~1/3 of an anchor pass over the capture and a new schedule peaking at
# 1.5e-4 instead of 3e-4: session 22's h9 (1.3 anchor passes over 0.64 M tokens at 3e-4) over-fitted its capture
# (validation loss 1.68 -> 1.87) and lost 0.24 tau. Run as STEPS=$((62300 + N)) MINUTES=M
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${RUN:-/work/runs/s23/h10}; SRC=${SRC:-/work/runs/s23/data/cache}
mkdir -p "$RUN/cache"
# link the capture's shards as they are when the run starts (the capture may still be writing)
python - "$SRC" "$RUN/cache" <<'PY'
import json, os, sys
src, dst = sys.argv[1], sys.argv[2]
meta = json.load(open(os.path.join(src, "meta.json")))
for s in meta["shards"]:
    link = os.path.join(dst, s["file"])
    if not os.path.lexists(link):
        os.symlink(os.path.join(src, s["file"]), link)
json.dump(meta, open(os.path.join(dst, "meta.json"), "w"))
print(f"{dst}: {len(meta['shards'])} shards, {sum(len(s['ids']) for s in meta['shards'])} sequences, "
      f"{sum(s['n_tokens'] for s in meta['shards'])} tokens")
PY
RUN=$RUN EXTRA_ARGS="--repeat-keep 0.25 --repeat-ngram 16 --lr ${LR:-1.5e-4}" exec bash "$HERE/../s15-new-prompts/h2.sh"
