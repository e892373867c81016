#!/usr/bin/env bash
# session 17: the shipped weights (h3, step 38,450, the committed portable checkpoint) continued on the whole
# session-15 cache (the session-15, -16 and -17 captures), h3's options, a new schedule peaking at 3e-4, and
# --repeat-keep 0.25: anchors that repeat an earlier 16-gram of their sequence (41.5 % of the captured
# continuations' anchors, 14.8 % of the held-out text's) are drawn a quarter as often, which brings their share
# to the held-out text's. RUN/cache is a cache whose meta.json lists shards FROM.. (default 0: all) of the
# session-15 cache as they were when the chunk started, linked to its files. Run as STEPS=43120 MINUTES=55
set -euo pipefail
RUN=${RUN:-/work/runs/s17/h4}; SRC=${SRC:-/work/runs/s15/data/cache}
mkdir -p "$RUN/cache"
python - "$SRC" "$RUN/cache" "${FROM:-0}" <<'PY'
import json, os, sys
src, dst, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
meta = json.load(open(os.path.join(src, "meta.json")))
meta["shards"] = meta["shards"][first:]
for s in meta["shards"]:
    link = os.path.join(dst, s["file"])
    if not os.path.lexists(link):
        os.symlink(os.path.join(src, s["file"]), link)
json.dump(meta, open(os.path.join(dst, "meta.json"), "w"))
print(f"{dst}: {len(meta['shards'])} shards, {sum(len(s['ids']) for s in meta['shards'])} sequences, "
      f"{sum(s['n_tokens'] for s in meta['shards'])} tokens")
PY
# MORE_ARGS (since session 23): further trainer options, after these (a later --lr wins)
RUN=$RUN EXTRA_ARGS="--repeat-keep ${REPEAT_KEEP:-0.25} --repeat-ngram 16 ${MORE_ARGS:-}" exec bash "$(dirname "$0")/../s15-new-prompts/h2.sh"
