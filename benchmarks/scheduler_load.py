"""What the auto draft width does under load: n sequences decoded together (1, 4, 8, 16).

For each n, ``generate_batch`` of n held-out HumanEval prompts runs on one engine with the drafter
under ``n_max="auto"`` (starting from nothing learned) and on a plain engine (no drafter), each
twice, interleaved; reported: aggregate tok/s (all sequences' tokens / wall time), the ratio,
the widths the scheduler chose (steps per width) and rows per step.

    python benchmarks/scheduler_load.py -m smollm2-135m -n 64 -t 2 --seqs 1,4,8,16 \
        --out benchmarks/results/scheduler-load-smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-md", "--model-draft", default="auto")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="context per sequence")
    ap.add_argument("--seqs", default="1,4,8,16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    os.environ["PYDFLASH_AUTOTUNE_CACHE"] = "0"

    from pydflash import Engine
    from pydflash.fetch import prompt_sets as prompts

    counts = [int(x) for x in args.seqs.split(",")]
    n_max_seq = max(counts)
    texts = [p.text for p in prompts.load("humaneval", offset=132, limit=n_max_seq)]
    common = dict(n_ctx=args.ctx_size, n_threads=args.threads, n_seq_max=n_max_seq)
    rows = []
    with Engine(args.model, None, **common) as plain:
        for n in counts:
            runs: dict[str, list[float]] = {"plain": [], "auto": []}
            widths: dict[int, int] = {}
            n_rows = []
            for _ in range(args.repeats):
                for mode in ("plain", "auto"):
                    if mode == "auto":  # a fresh engine: nothing learned
                        eng = Engine(args.model, args.model_draft, **common)
                    else:
                        eng = plain
                    sched = eng.scheduler
                    ids = [sched.add(eng.target.tokenize(t), _opts(args.n_predict), slot=i, cache_prompt=False)
                           for i, t in enumerate(texts[:n])]
                    t0 = time.perf_counter()
                    done: set[int] = set()
                    with eng.target._lock:
                        while not set(ids) <= done:
                            info = sched.step()
                            done |= set(sched.finished())
                            if mode == "auto" and info.n_decoding:
                                widths[info.width] = widths.get(info.width, 0) + 1
                                n_rows.append(info.n_rows)
                        results = [sched.take(i) for i in ids]
                    wall = time.perf_counter() - t0
                    runs[mode].append(sum(r.stats.n_generated for r in results) / wall)
                    if mode == "auto":
                        eng.close()
            row = {"n_seq": n, "plain_tok_s": statistics.median(runs["plain"]),
                   "auto_tok_s": statistics.median(runs["auto"]),
                   "ratio": statistics.median(a / p for a, p in zip(runs["auto"], runs["plain"])),
                   "widths": dict(sorted(widths.items())), "mean_rows_per_step": statistics.mean(n_rows)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"Command: `{' '.join(sys.argv)}`", "",
             "| sequences | plain tok/s | auto tok/s | auto / plain | steps per width (auto) | rows per step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n_seq']} | {r['plain_tok_s']:.1f} | {r['auto_tok_s']:.1f} | {r['ratio']:.3f} | "
                     f"{r['widths']} | {r['mean_rows_per_step']:.1f} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


def _opts(n: int):  # type: ignore[no-untyped-def]
    from pydflash import SamplingOptions

    return SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True)


if __name__ == "__main__":
    sys.exit(main())
