"""What rolling a verify block back costs on each kind of target memory, against a dense target
of the same (fixture) size: plain decoding, always-right replay drafts (the ceiling of the loop)
at n_max 3 and 7, and always-wrong ones (every block rejected at its first draft: a rollback
every step). Modes are interleaved, medians of --repeats runs.

    python benchmarks/hybrid_rollback_cost.py [--arch llama-dense qwen35-dense mamba2-dense] [-n 128] [-t 2]

Targets are the pinned tree's random-weight fixtures (tests/arch_fixtures.py): 2 layers, n_embd
256, so the absolute numbers are those of tiny graphs; the ratios show the rollback's overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import arch_fixtures  # noqa: E402

import pydflash  # noqa: E402

PROMPT = [1, 5, 9, 17, 33, 2, 7, 11, 3, 4, 6, 8]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="*", default=["llama-dense", "qwen35-dense", "qwen3next-moe", "mamba2-dense"])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    fixtures = arch_fixtures.targets()
    out = {}
    for name in args.arch:
        with pydflash.Target(str(fixtures[name]), n_ctx=512, n_threads=args.threads) as t:
            runs: dict[str, list[float]] = {}
            extra: dict[str, list[float]] = {}
            plain = t.generate(PROMPT, max_tokens=args.n, temperature=0, ignore_eos=True)
            script = list(plain.tokens)
            for _ in range(args.repeats):
                for mode, kw in (("plain", None), ("replay-3", dict(offset=0, n_max=3)),
                                 ("replay-7", dict(offset=0, n_max=7)), ("wrong-7", dict(offset=1, n_max=7))):
                    if kw is None:
                        r = t.generate(PROMPT, max_tokens=args.n, temperature=0, ignore_eos=True)
                    else:
                        r = t._generate_replay(PROMPT, script, max_tokens=args.n, temperature=0, ignore_eos=True, **kw)
                    runs.setdefault(mode, []).append(r.stats.tokens_per_second)
                    steps = max(r.stats.n_verify_steps, 1)
                    extra.setdefault(mode + " ms/step", []).append((r.stats.t_total_ms - r.stats.t_prefill_ms) / steps)
                    extra.setdefault(mode + " rollback ms/step", []).append(r.stats.t_rollback_ms / steps)
            med = {k: statistics.median(v) for k, v in {**runs, **extra}.items()}
            row = {"rollback": t.info.rollback, **{k: round(v, 3) for k, v in med.items()}}
            for mode in ("replay-3", "replay-7"):
                row[mode + " / plain"] = round(med[mode] / med["plain"], 3)
            out[name] = row
            print(name, json.dumps(row), flush=True)
    dense = out.get("llama-dense")
    if dense:
        for name, row in out.items():
            row["replay-7 ratio vs dense"] = round(row["replay-7 / plain"] / dense["replay-7 / plain"], 3)
            print(f"{name:16s} {row['rollback']:10s} plain {row['plain']:8.1f} tok/s  replay-7/plain "
                  f"{row['replay-7 / plain']:.2f} (vs dense {row['replay-7 ratio vs dense']:.2f})  wrong-7 "
                  f"{row['wrong-7 ms/step']:.2f} ms/step, of it rollback {row['wrong-7 rollback ms/step']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
