"""Does a decode of k rows cost more on a GPU because its graph is not replayed as a CUDA graph?

The pinned ggml-cuda replays a graph as a captured CUDA graph only after two consecutive calls
with unchanged properties; otherwise it launches kernel by kernel. This times one decode of k
rows (all logits) on a target fully offloaded, three ways, medians of --rounds:

  repeated:    the same k rows, same position, taps as given, call after call (graphs can settle)
  interleaved: k rows alternating with a 1-row decode (the graph changes every call)
  taps:        repeated, with the drafter's taps on

Run it with and without ``GGML_CUDA_DISABLE_GRAPHS=1`` (ggml reads the variable once per process):
a gap between the two on "repeated" and none on "interleaved" says graph replay is what a verify
step misses.

    python benchmarks/gpu/graphs.py --target t.gguf --device CUDA0 --out graphs.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--device", default="CUDA0")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from pydflash import Target

    ngl = 0 if args.device == "CPU" else -1
    ks = [int(k) for k in args.ks.split(",")]
    with Target(args.target, n_ctx=args.n_context + max(ks) + 16, n_threads=args.threads, n_gpu_layers=ngl) as t:
        rng = np.random.default_rng(0)
        t.decode([int(x) for x in rng.integers(259, t.info.n_vocab, size=args.n_context)])
        probe = [int(x) for x in rng.integers(259, t.info.n_vocab, size=max(ks))]
        n = t.info.n_layer
        taps = sorted({round(1 + i * (n - 3) / 4) for i in range(5)})

        def once(k: int) -> float:
            a = time.perf_counter()
            t.decode(probe[:k], all_logits=True)
            dt = time.perf_counter() - a
            t.rollback(args.n_context)
            return dt

        res: dict = {"target": Path(args.target).name, "device": args.device, "rounds": args.rounds,
                     "graphs_disabled_by_env": "GGML_CUDA_DISABLE_GRAPHS" in os.environ, "ms": {}}
        for k in ks:
            row = {}
            t.set_taps([])
            for _ in range(3):
                once(k)
            row["repeated"] = statistics.median(once(k) for _ in range(args.rounds))
            inter = []
            for _ in range(args.rounds):
                once(1)
                inter.append(once(k))
            row["interleaved"] = statistics.median(inter)
            t.set_taps(taps)
            for _ in range(3):
                once(k)
            row["taps"] = statistics.median(once(k) for _ in range(args.rounds))
            t.set_taps([])
            res["ms"][k] = {m: round(1000 * v, 3) for m, v in row.items()}
            print(k, res["ms"][k], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
