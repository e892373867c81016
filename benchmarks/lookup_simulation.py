"""Drafts from the history alone, simulated on the target's greedy held-out continuations.

For HumanEval/132..163 (never trained on) the target's plain greedy continuation (128 tokens) is
generated once; then every step proposes the tokens that followed the latest earlier occurrence of
the context's last 4..min_n tokens (up to n_max) and commits the matching prefix plus one token.
It answers "does the history pay on this target?" without the engine (session 10, SmolLM2-135M:
tau 2.17 / 1.91 / 1.74 for min_n 1 / 2 / 3, against 1.72 for the shipped neural drafter; the
engine's lookup, native/src/lookup.*, does the same search).

    python benchmarks/lookup_simulation.py -m smollm2-135m
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable


def propose(ctx: list[int], n_max: int, min_n: int) -> list[int]:
    for n in range(4, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == suffix:
                return ctx[i + n:i + n + n_max]
    return []


def accepted(draft: list[int], cont: list[int], i: int) -> int:
    """How many of ``draft`` greedy verification keeps at position ``i`` of the text ``cont``."""
    a = 0
    while a < len(draft) and i + a < len(cont) and draft[a] == cont[i + a]:
        a += 1
    return a


def simulate(data: list[tuple[list[int], list[int]]], n_max: int, min_n: int,
             fallback: Callable[[list[int], int], int] | None = None) -> dict:
    """``fallback(cont, i)``: drafts accepted at position ``i`` where the history has no match (a
    stand-in for a drafter beside it; ``None``: plain decoding there)."""
    tokens = steps = with_match = accepted_on_match = long_matches = from_fallback = 0
    for prompt, cont in data:
        i = 0
        while i < len(cont):
            draft = propose(prompt + cont[:i], n_max, min_n)
            if draft:
                a = accepted(draft, cont, i)
                with_match += 1
                accepted_on_match += a
                long_matches += a >= 5
            else:
                a = fallback(cont, i) if fallback is not None else 0
                from_fallback += a
            i += a + 1
            steps += 1
        tokens += len(cont)
    return {"min_n": min_n, "tau": tokens / steps, "steps": steps, "steps_with_a_match": with_match,
            "accepted_per_match": accepted_on_match / max(with_match, 1), "accepted_from_history": accepted_on_match,
            "history_steps_accepting_5_or_more": long_matches, "accepted_from_fallback": from_fallback}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    from pydflash.runtime.target import Target
    from pydflash.train.prompts import held_out_humaneval

    data = []
    with Target(args.model, n_ctx=1024, n_threads=args.threads) as target:
        for p in held_out_humaneval():
            tokens = target.tokenize(p.text)
            data.append((tokens, list(target.generate(tokens, max_tokens=args.n_predict, temperature=0).tokens)))
    print("| min match | tau | steps with a match | accepted per match |\n|---|---|---|---|")
    for min_n in (1, 2, 3):
        r = simulate(data, args.n_max, min_n)
        print(f"| {min_n} | {r['tau']:.3f} | {r['steps_with_a_match']} / {r['steps']} | {r['accepted_per_match']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
