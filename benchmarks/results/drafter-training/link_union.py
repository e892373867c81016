"""Link several feature caches into one that `pydflash train --no-capture` reads: DST SRC [SRC ...].

The trainer reads one cache (RUN/cache); a chunk over several captures gets a cache whose meta.json lists
every source's shards, linked under distinct names (c<i>-<file>), nothing copied. The sources must come from
the same target with the same taps.
"""
import json
import os
import sys


def link_union(dst: str, srcs: list[str]) -> dict:
    os.makedirs(dst, exist_ok=True)
    merged: dict | None = None
    for i, src in enumerate(srcs):
        with open(os.path.join(src, "meta.json")) as f:
            meta = json.load(f)
        if merged is None:
            merged = dict(meta, shards=[])
        if (meta["tap_layers"], meta["target"]) != (merged["tap_layers"], merged["target"]):
            sys.exit(f"{src}: another target or other taps than {srcs[0]}")
        for shard in meta["shards"]:
            name = f"c{i}-{shard['file']}"
            if not os.path.lexists(os.path.join(dst, name)):
                os.symlink(os.path.join(os.path.abspath(src), shard["file"]), os.path.join(dst, name))
            merged["shards"].append(dict(shard, file=name))
    with open(os.path.join(dst, "meta.json"), "w") as f:
        json.dump(merged, f)
    return merged


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    union = link_union(sys.argv[1], sys.argv[2:])
    print(f"{sys.argv[1]}: {len(union['shards'])} shards, {sum(len(s['ids']) for s in union['shards'])} sequences, "
          f"{sum(s['n_tokens'] for s in union['shards'])} tokens")
