"""Acceptance (tau) and speed of trained drafters on held-out prompts, next to plain decoding.

    python benchmarks/drafter_tau.py --target smollm2-135m \\
        --drafter BF16=run/x-BF16.gguf --drafter Q8_0=run/x-Q8_0.gguf --n-max 7,3 \\
        --prompts humaneval-heldout --max-tokens 128 --threads 1 --json tau.json

``humaneval-heldout`` (default) is HumanEval/132..163, the tasks ``pydflash train`` never trains
on; a ``.jsonl`` path also works. Every configuration runs the same prompts in the same process:
plain decoding first, then each drafter at T = 0 for every n_max, and at T = 1 (pure sampling,
no top-k/top-p/min-p) at the largest n_max. Reported per configuration: tau (tokens per target
verification, summed over all prompts), accepted drafts per position, decode tok/s and the
speed-up over plain decoding. ``--lookup 0,2`` runs every drafter alone and with drafts from the
sequence's own history (``Engine(lookup=2)``, the engine's default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def load_prompts(spec: str) -> list:
    from pydflash.train import prompts

    if spec == "humaneval-heldout":
        return prompts.held_out_humaneval()
    rows = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
    return [prompts.TrainPrompt(str(r.get("id", i)), text=r["prompt"]) for i, r in enumerate(rows)]


def run(engine, prompts, *, max_tokens: int, n_max: int | None, temperature: float, seed: int) -> dict:  # type: ignore[no-untyped-def]
    gen = ver = drafted = accepted = 0
    decode_ms = 0.0
    per_pos = [0] * 16
    sampling = dict(top_k=0, top_p=1.0, min_p=0.0) if temperature > 0 else {}
    for i, p in enumerate(prompts):
        kwargs = {} if n_max is None else {"n_max": n_max}
        r = engine.generate(p.text, max_tokens=max_tokens, temperature=temperature, seed=seed + i, **kwargs,
                            **sampling)
        st = r.stats
        gen += st.n_generated
        ver += st.n_verify_steps
        drafted += st.n_drafted
        accepted += st.n_accepted
        decode_ms += st.t_total_ms - st.t_prefill_ms
        per_pos = [a + b for a, b in zip(per_pos, st.accepted_per_position)]
    return {"tokens": gen, "verify_steps": ver, "tau": gen / max(ver, 1), "drafted": drafted, "accepted": accepted,
            "accepted_per_position": per_pos[: n_max or 0], "tok_s": gen / (decode_ms / 1000.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", action="append", default=[], help="LABEL=path.gguf (repeatable)")
    ap.add_argument("--prompts", default="humaneval-heldout")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-max", default="7", help="comma-separated n_max values for T=0")
    ap.add_argument("--lookup", default="0",
                    help="comma-separated Engine(lookup=) values: 0 = the drafter alone, 2 = also drafts from "
                         "the history, as the engine's default (T=0 only: sampled requests never use them)")
    ap.add_argument("--no-t1", action="store_true", help="skip the T=1 runs")
    ap.add_argument("--no-plain", action="store_true", help="skip plain decoding (no speed-up column)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from pydflash import Engine

    prompts = load_prompts(args.prompts)[: args.limit]
    n_maxes = [int(x) for x in args.n_max.split(",")]
    rows = []

    def report(label: str, res: dict, base: float | None) -> None:
        res["label"] = label
        res["speedup"] = res["tok_s"] / base if base else 1.0
        rows.append(res)
        print(f"{label:32s} tau {res['tau']:.3f}  {res['tok_s']:6.1f} tok/s  x{res['speedup']:.2f}  "
              f"per position {res['accepted_per_position']}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    base0, base1 = {"tok_s": None}, None
    if not args.no_plain:
        with Engine(args.target, None, n_threads=args.threads, n_max=None) as plain:
            base0 = run(plain, prompts, max_tokens=args.max_tokens, n_max=None, temperature=0.0, seed=args.seed)
            report("plain T=0", base0, None)
            if not args.no_t1:
                base1 = run(plain, prompts, max_tokens=args.max_tokens, n_max=None, temperature=1.0, seed=args.seed)
                report("plain T=1", base1, None)
    lookups = [int(x) for x in args.lookup.split(",")]
    for spec in args.drafter:
        label, _, path = spec.partition("=")
        for lookup in lookups:
            tag = f" lookup={lookup}" if lookup else ""
            with Engine(args.target, path, n_threads=args.threads, n_max=max(n_maxes), lookup=lookup) as engine:
                for n in n_maxes:
                    res = run(engine, prompts, max_tokens=args.max_tokens, n_max=n, temperature=0.0, seed=args.seed)
                    report(f"{label}{tag} T=0 n_max={n}", res, base0["tok_s"])
        if not args.no_t1:
            with Engine(args.target, path, n_threads=args.threads, n_max=max(n_maxes), lookup=0) as engine:
                n = max(n_maxes)
                res = run(engine, prompts, max_tokens=args.max_tokens, n_max=n, temperature=1.0, seed=args.seed)
                report(f"{label} T=1 n_max={n}", res, base1["tok_s"] if base1 else None)
    out = {"target": args.target, "prompts": args.prompts, "n_prompts": len(prompts), "max_tokens": args.max_tokens,
           "threads": args.threads, "wall_s": time.monotonic() - t0, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("| configuration | tau | accepted per position | tok/s | speed-up |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['tau']:.2f} | {r['accepted_per_position']} | {r['tok_s']:.1f} | "
              f"{r['speedup']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
