#!/usr/bin/env bash
# session 24 (the session-23 machine again, its capture still on disk): the shipped weights (h10, step 64,800, the
# committed portable checkpoint) continued on the union of session 23's capture (a third of an anchor pass drawn
# by h10) and this session's fresh one (../s23-fresh-avx2/capture.sh: sequences never trained on), with h10's
# options (peak lr 1.5e-4). SRCS: the capture caches, space-separated; their shards are linked into RUN/union
# under distinct names. Run as SRCS="A/cache B/cache" RUN=... STEPS=$((64800 + N)) MINUTES=M
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${RUN:?}; SRCS=${SRCS:?}
mkdir -p "$RUN/union"
python - "$RUN/union" $SRCS <<'PY'
import json, os, sys
dst, srcs = sys.argv[1], sys.argv[2:]
merged = None
for i, src in enumerate(srcs):
    meta = json.load(open(os.path.join(src, "meta.json")))
    if merged is None:
        merged = dict(meta, shards=[])
    assert meta["tap_layers"] == merged["tap_layers"] and meta["target"] == merged["target"], src
    for s in meta["shards"]:
        name = f"c{i}-{s['file']}"
        if not os.path.lexists(os.path.join(dst, name)):
            os.symlink(os.path.join(os.path.abspath(src), s["file"]), os.path.join(dst, name))
        merged["shards"].append(dict(s, file=name))
json.dump(merged, open(os.path.join(dst, "meta.json"), "w"))
print(f"{dst}: {len(merged['shards'])} shards, {sum(len(s['ids']) for s in merged['shards'])} sequences, "
      f"{sum(s['n_tokens'] for s in merged['shards'])} tokens")
PY
RUN=$RUN SRC=$RUN/union exec bash "$HERE/../s23-fresh-avx2/h10.sh"
