"""What the multi-row kernels (issue #15) change end to end: tok/s of plain decoding and of
speculative decoding, with ggml's stock CPU kernels and with ours, in one process, interleaved
prompt by prompt (medians over prompts).

Speculative modes:
- replay-nN: the loop with scripted drafts that are plain decoding's own continuation (always
  right): every step verifies N drafts and commits N + 1 tokens, the ceiling any drafter can reach
  at that width, set only by the verify cost c(N + 1).
- drafter-nN / drafter-auto: a real DFlash2 drafter (default: the one shipped for the target, if
  any) through Engine, fixed width N or the autotuner.

    python benchmarks/kernels_end_to_end.py -m smollm2-135m -t 2 -n 64 --limit 6 \
        --out benchmarks/results/kernels_end_to_end_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from pydflash import Engine, Target, drafters
from pydflash.runtime import kernels
from pydflash.fetch import registry as models

PROMPTS = [
    "def quicksort(arr):",
    "def is_prime(n: int) -> bool:",
    "import numpy as np\n\ndef normalize(x):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "# parse a CSV file into a list of dicts\ndef read_csv(path):",
    "def binary_search(xs, target):",
    "def merge_sorted(a, b):",
]


def load(on: bool, fn):  # type: ignore[no-untyped-def]
    os.environ["PYDFLASH_KERNELS"] = "1" if on else "0"
    try:
        assert kernels.active() == on
        return fn()
    finally:
        os.environ.pop("PYDFLASH_KERNELS", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-md", "--model-draft", default="auto", help="drafter GGUF, auto (shipped), or none")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--replay", default="3,7", help="replay widths N (comma list)")
    ap.add_argument("--drafter-n", default="1,3", help="fixed drafter widths (comma list)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    path = str(models.path(args.model)) if not os.path.exists(args.model) else args.model
    replay = [int(x) for x in args.replay.split(",") if x]
    dn = [int(x) for x in args.drafter_n.split(",") if x]
    prompts = PROMPTS[: args.limit]
    modes = ["stock", "ours"]
    targets = {m: load(m == "ours", lambda: Target(path, n_ctx=2048, n_threads=args.threads)) for m in modes}
    drafter = None
    if args.model_draft == "auto":
        drafter = drafters.resolve_auto(targets["stock"])
    elif args.model_draft != "none":
        drafter = args.model_draft
    engines = {}
    if drafter:
        engines = {m: load(m == "ours", lambda: Engine(path, str(drafter), n_ctx=2048, n_threads=args.threads))
                   for m in modes}

    names = ["plain"] + [f"replay-n{n}" for n in replay]
    if engines:
        names += [f"drafter-n{n}" for n in dn] + ["drafter-auto"]
    tps: dict[str, dict[str, list[float]]] = {m: {k: [] for k in names} for m in modes}
    same: dict[str, dict[str, int]] = {m: {k: 0 for k in names} for m in modes}
    opts = dict(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for pi, prompt in enumerate(prompts):
        order = modes if pi % 2 == 0 else modes[::-1]  # alternate who goes first
        for m in order:
            t = targets[m]
            toks = t.tokenize(prompt)
            t0 = time.perf_counter()
            plain = t.generate(toks, **opts)
            dt = time.perf_counter() - t0
            tps[m]["plain"].append(len(plain.tokens) / dt)
            same[m]["plain"] += 1
            for n in replay:
                t0 = time.perf_counter()
                spec = t._generate_replay(toks, plain.tokens, offset=0, n_max=n, **opts)
                dt = time.perf_counter() - t0
                tps[m][f"replay-n{n}"].append(len(spec.tokens) / dt)
                same[m][f"replay-n{n}"] += int(spec.tokens == plain.tokens)
            if engines:
                e = engines[m]
                for n in dn + [None]:
                    key = f"drafter-n{n}" if n is not None else "drafter-auto"
                    t0 = time.perf_counter()
                    r = e.generate(toks, n_max=n, **opts)
                    dt = time.perf_counter() - t0
                    tps[m][key].append(len(r.tokens) / dt)
                    same[m][key] += int(r.tokens == plain.tokens)

    res = {
        "command": "python benchmarks/kernels_end_to_end.py " + " ".join(
            f"{k.replace('_', '-')}={v}" for k, v in vars(args).items()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "kernels_isa": kernels.best_isa(),
        "model": args.model,
        "drafter": str(drafter) if drafter else None,
        "prompts": len(prompts),
        "tok_s": tps,
        "equal_to_plain": same,
    }
    print(f"{args.model}: {args.threads} threads, {len(prompts)} prompts x {args.max_tokens} tokens, greedy; "
          f"kernels {kernels.best_isa()}; medians; speedup vs the same mode's plain")
    print(f"{'mode':<14} {'stock tok/s':>11} {'speedup':>8} {'ours tok/s':>11} {'speedup':>8} {'= plain':>9}")
    for k in names:
        s_med = statistics.median(tps["stock"][k])
        o_med = statistics.median(tps["ours"][k])
        s_plain = statistics.median(tps["stock"]["plain"])
        o_plain = statistics.median(tps["ours"]["plain"])
        print(f"{k:<14} {s_med:>11.2f} {s_med / s_plain:>8.2f} {o_med:>11.2f} {o_med / o_plain:>8.2f} "
              f"{same['stock'][k]}/{len(prompts)},{same['ours'][k]}/{len(prompts)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
