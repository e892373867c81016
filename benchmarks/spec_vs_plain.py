"""Speculative vs plain decoding in one run: tau, tokens/s, the share of a cycle spent drafting,
and the Python overhead per token (wall time of the call minus the native loop's own time).

    python benchmarks/spec_vs_plain.py -m qwen2.5-coder-1.5b -md drafter.gguf -n 64 -t 2 --n-max 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pydflash import Engine

PROMPTS = [
    "def quicksort(arr):",
    "def is_prime(n: int) -> bool:",
    "import numpy as np\n\ndef normalize(x):",
    "class Stack:\n    def __init__(self):",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", "--model-draft", required=True)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--n-max", type=int, default=7)
    args = ap.parse_args()
    rows = []
    with Engine(args.model, args.model_draft, n_ctx=2048, n_threads=args.t, n_max=args.n_max) as engine:
        engine.generate("warm up", max_tokens=4, temperature=0)
        for prompt in PROMPTS:  # interleave plain and speculative per prompt
            t0 = time.perf_counter()
            plain = engine.target.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
            plain_wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            spec = engine.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
            spec_wall = time.perf_counter() - t0
            s = spec.stats
            cycle = s.t_draft_ms + s.t_verify_ms + s.t_accept_ms
            rows.append({
                "plain_tok_s": plain.stats.tokens_per_second,
                "spec_tok_s": s.tokens_per_second,
                "tau": s.tau,
                "accepted": s.n_accepted,
                "drafted": s.n_drafted,
                "draft_share": s.t_draft_ms / cycle if cycle else 0.0,
                "verify_share": s.t_verify_ms / cycle if cycle else 0.0,
                "python_overhead_ms_per_token": 1000 * (spec_wall - s.t_total_ms / 1000) / max(s.n_generated, 1),
                "plain_python_overhead_ms_per_token":
                    1000 * (plain_wall - plain.stats.t_total_ms / 1000) / max(plain.stats.n_generated, 1),
                "same_tokens": plain.tokens == spec.tokens,
            })
    med = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0] if k != "same_tokens"}
    med["same_tokens"] = sum(r["same_tokens"] for r in rows)
    med["speedup"] = round(med["spec_tok_s"] / med["plain_tok_s"], 3)
    print(json.dumps({"model": args.model, "drafter": args.model_draft, "n_max": args.n_max, "median": med,
                      "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
