"""Verification cost c(k) with ggml's stock CPU kernels vs pydflash's multi-row kernels (issue #15).

c(k) = time of one target decode of k rows with all logits and the taps on (what the speculative
loop verifies) / time of one plain decode step (1 row, last logits, no taps), after n_context
tokens of context. Each timed call follows an untimed call of the same shape, so llama.cpp reuses
its graph as it does in the loop (--rebuild: time the first call after a shape change, graph
rebuild included, as the runs before 2026-12-02 did). All modes live in ONE process and are
interleaved round by round (the order rotates), so the ratios come from the same minutes of the
same machine; medians are quoted.

    python benchmarks/verify_kernels.py -m qwen2.5-coder-1.5b -t 2 --k-max 16 --rounds 7

Stock = a target loaded with PYDFLASH_KERNELS=0 (ggml's kernels, REPACK included); ours = loaded
with the kernels on (our mat-muls and our attention). --attn-ab adds a third mode, "ours_ggml_attn":
the same target as "ours" with ggml's flash attention (kernels.set_attention(False)), which shows
what the attention kernel alone brings. Also reported: plain decode tok/s and prefill tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from pydflash import Target
from pydflash._native import ffi, lib

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "class Matrix:\n    def __init__(self, rows):\n        self.rows = rows\n\n    def transpose(self):\n"
    "        return Matrix([list(r) for r in zip(*self.rows)])\n\n"
)


def load(model: str, on: bool, n_ctx: int, n_threads: int) -> Target:
    os.environ["PYDFLASH_KERNELS"] = "1" if on else "0"
    try:
        return Target(model, n_ctx=n_ctx, n_threads=n_threads)
    finally:
        os.environ.pop("PYDFLASH_KERNELS", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--ks", default="", help="comma-separated k values (default 1..k-max)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=256, help="prefill length timed (0 = skip)")
    ap.add_argument("--out", default="", help="write the JSON result here")
    ap.add_argument("--attn-ab", action="store_true", help="also time ours with ggml's attention")
    ap.add_argument("--rebuild", action="store_true",
                    help="time each call right after a call of another shape (graph rebuild included), "
                         "as runs before 2026-12-02 did")
    args = ap.parse_args()

    ks = [int(x) for x in args.ks.split(",")] if args.ks else list(range(1, args.k_max + 1))
    n_ctx = args.n_context + max(ks) + 64
    targets = {"stock": load(args.model, False, max(n_ctx, args.prefill + 8), args.threads),
               "ours": load(args.model, True, max(n_ctx, args.prefill + 8), args.threads)}
    modes = list(targets) + (["ours_ggml_attn"] if args.attn_ab else [])

    def target_of(mode: str) -> Target:
        lib.dflash_kernels_set_attention(mode != "ours_ggml_attn")
        return targets["ours" if mode == "ours_ggml_attn" else mode]

    t0 = targets["stock"]
    n_layer = t0.info.n_layer
    taps = sorted({1, n_layer // 4, n_layer // 2, (3 * n_layer) // 4, n_layer - 2})
    base = t0.tokenize(TEXT)
    prompt = (base * (args.n_context // len(base) + 1))[: args.n_context]
    probe = (base * 2)[: max(ks)]

    for t in targets.values():
        t.rollback(0)
        t.decode(prompt)

    # llama.cpp rebuilds its graph when the shape or the taps change from the previous decode of
    # that context (~5-6 ms here); the loop verifies at a fixed width with the taps left on and
    # plain decoding repeats one shape, so each timed call follows an untimed one of its shape
    def plain(t: Target) -> float:
        if not args.rebuild:
            t.decode(probe[:1])
            t.rollback(args.n_context)
        a = time.perf_counter()
        t.decode(probe[:1])
        dt = time.perf_counter() - a
        t.rollback(args.n_context)
        return dt

    def verify(t: Target, k: int) -> float:
        t.set_taps(taps)
        if not args.rebuild:
            t.decode(probe[:k], all_logits=True)
            t.rollback(args.n_context)
        a = time.perf_counter()
        t.decode(probe[:k], all_logits=True)
        dt = time.perf_counter() - a
        t.set_taps([])
        t.rollback(args.n_context)
        return dt

    times: dict[str, dict[str, list[float]]] = {m: {"plain": [], **{str(k): [] for k in ks}} for m in modes}
    for m in modes:  # warm up every shape
        plain(target_of(m))
        for k in ks:
            verify(target_of(m), k)
    for rnd in range(args.rounds):
        order = modes[rnd % len(modes):] + modes[: rnd % len(modes)]
        if rnd % 2:
            order.reverse()
        for k in ["plain"] + ks:
            for m in order:
                t = target_of(m)
                times[m][str(k)].append(plain(t) if k == "plain" else verify(t, int(k)))
    lib.dflash_kernels_set_attention(True)

    prefill: dict[str, float] = {}
    if args.prefill:
        ptoks = (base * (args.prefill // len(base) + 1))[: args.prefill]
        pt: dict[str, list[float]] = {m: [] for m in targets}
        for rnd in range(3):
            for m in (["stock", "ours"] if rnd % 2 == 0 else ["ours", "stock"]):
                t = targets[m]
                t.rollback(0)
                a = time.perf_counter()
                t.decode(ptoks)
                pt[m].append(time.perf_counter() - a)
        prefill = {m: round(args.prefill / statistics.median(v), 1) for m, v in pt.items()}

    med = {m: {k: statistics.median(v) for k, v in tm.items()} for m, tm in times.items()}
    result = {
        "model": args.model,
        "threads": args.threads,
        "n_context": args.n_context,
        "rounds": args.rounds,
        "graph_rebuild_timed": args.rebuild,
        "kernels_isa": ffi.string(lib.dflash_kernels_isa()).decode(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_start": os.getloadavg()[0],
        "t1_ms": {m: round(1000 * med[m]["plain"], 2) for m in modes},
        "plain_tok_s": {m: round(1 / med[m]["plain"], 1) for m in modes},
        "prefill_tok_s": prefill,
        "c": {m: {k: round(med[m][str(k)] / med[m]["plain"], 3) for k in ks} for m in modes},
        "verify_ms": {m: {k: round(1000 * med[m][str(k)], 2) for k in ks} for m in modes},
    }
    print(f"{args.model}: {args.threads} threads, {args.n_context} tokens of context, kernels "
          f"{result['kernels_isa']}, medians of {args.rounds} interleaved rounds")
    print(f"plain step: stock {result['t1_ms']['stock']} ms ({result['plain_tok_s']['stock']} tok/s), "
          f"ours {result['t1_ms']['ours']} ms ({result['plain_tok_s']['ours']} tok/s)")
    if prefill:
        print(f"prefill {args.prefill}: stock {prefill['stock']} tok/s, ours {prefill['ours']} tok/s")
    if args.attn_ab:
        print(f"plain step, ours with ggml's attention: {result['t1_ms']['ours_ggml_attn']} ms")
    print("   k   " + "  ".join(f"c_{m}" for m in modes) + "   verify_ms " + " / ".join(modes))
    for k in ks:
        print(f"{k:4d}   " + "  ".join(f"{result['c'][m][k]:{len(m) + 2}.2f}" for m in modes) + "   "
              + " / ".join(f"{result['verify_ms'][m][k]:.2f}" for m in modes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
