"""Bootstrap confidence intervals for an ``auto_cold_start.py`` results.json.

Per mode: the median over prompts of tok/s against that prompt's plain run, with a 95 % interval
from resampling the prompts, and the summed verify steps; then the same for the per-prompt ratio of
two modes (``--pair A,B``, default ``auto-cold,history-cold``: does the drafter add to the history?
``auto-cold-cand,auto-cold``: does a candidate drafter beat the shipped one?), where both ran.

    python benchmarks/auto_cold_start_ci.py RESULTS.json [--pair A,B] [--resamples 2000] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics


def median_ci(xs: list[float], resamples: int, seed: int) -> tuple[float, float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return statistics.median(xs), meds[int(0.025 * resamples)], meds[int(0.975 * resamples)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--pair", default="auto-cold,history-cold", help="A,B: the per-prompt ratio A / B")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.results) as f:
        rows = json.load(f)["rows"]
    by_mode: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_mode.setdefault(r["mode"], {})[r["prompt"]] = r
    plain = by_mode["plain"]
    for mode, runs in by_mode.items():
        if mode == "plain":
            continue
        med, lo, hi = median_ci([runs[p]["tok_s"] / plain[p]["tok_s"] for p in plain], args.resamples, args.seed)
        steps = sum(r["steps"] for r in runs.values())
        print(f"{mode}: median ratio vs plain {med:.3f} (95 % CI {lo:.2f}-{hi:.2f}), verify steps {steps}")
    a_mode, _, b_mode = args.pair.partition(",")
    if a_mode in by_mode and b_mode in by_mode:
        a, b = by_mode[a_mode], by_mode[b_mode]
        xs = [a[p]["tok_s"] / b[p]["tok_s"] for p in plain]
        med, lo, hi = median_ci(xs, args.resamples, args.seed)
        drafter = sum(r["accepted"] - r["lookup_accepted"] for r in a.values())
        print(f"{a_mode} / {b_mode} per prompt: median {med:.3f} (95 % CI {lo:.2f}-{hi:.2f}), "
              f"ahead on {sum(x > 1 for x in xs)} of {len(xs)}; drafts accepted from {a_mode}'s drafter {drafter}")
    else:
        print(f"--pair {args.pair}: not both in the results (modes: {', '.join(by_mode)})")

if __name__ == "__main__":
    main()
