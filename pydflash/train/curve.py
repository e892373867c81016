"""The learning curve: a drafter's acceptance on held-out prompts against what it was trained on.

Each point is measured the way users meet the drafter: the native engine, greedy, a fixed n_max,
on HumanEval/132..163 (never trained on), many prompts decoding together through the scheduler
(greedy output and per-sequence acceptance do not depend on the batching). ``pydflash train
--curve FILE`` appends a point after every run; ``render`` turns the file into a Markdown table
and a PNG plot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

__all__ = ["heldout_tau", "append_point", "load_points", "render"]


def heldout_tau(target: str, drafter: str, *, prompts: Sequence | None = None, max_tokens: int = 128,
                n_max: int = 7, threads: int | None = None, parallel: int = 16,
                lookup: int = 0) -> dict:  # type: ignore[type-arg]
    """tau (committed tokens per target verification) and accepted drafts per position, greedy.
    ``lookup`` 0 (the default) measures the drafter alone; 2 as the engine's default drafts, with
    drafts from the sequences' own history as well (``Engine(lookup=)``)."""
    from ..runtime.engine import Engine
    from .prompts import held_out_humaneval

    prompts = list(prompts) if prompts is not None else held_out_humaneval()
    t0 = time.monotonic()
    gen = steps = 0
    per_pos = [0] * n_max
    with Engine(target, drafter, n_ctx=512 + max_tokens, n_threads=threads, n_max=n_max,
                n_seq_max=parallel, n_batch=max(512, parallel * (n_max + 1)), lookup=lookup) as engine:
        for i in range(0, len(prompts), parallel):
            group = [p.text for p in prompts[i: i + parallel]]
            for r in engine.generate_batch(group, max_tokens=max_tokens, temperature=0.0, n_max=n_max):
                gen += r.stats.n_generated
                steps += r.stats.n_verify_steps
                per_pos = [a + b for a, b in zip(per_pos, r.stats.accepted_per_position)]
    return {"tau": gen / max(steps, 1), "accepted_per_position": per_pos, "verify_steps": steps, "tokens": gen,
            "lookup": lookup,
            "n_prompts": len(prompts), "max_tokens": max_tokens, "n_max": n_max,
            "eval_s": round(time.monotonic() - t0, 1)}


def append_point(path: str | os.PathLike, point: dict) -> None:  # type: ignore[type-arg]
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(point) + "\n")


def load_points(path: str | os.PathLike) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def render(path: str | os.PathLike, out_dir: str | os.PathLike, *, title: str = "") -> tuple[Path, Path | None]:
    """``learning-curve.md`` (table) and ``learning-curve.png`` (tau against blocks trained, one
    marker per data size) from a curve file; the PNG needs matplotlib (the bench extra)."""
    points = load_points(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Learning curve{': ' + title if title else ''}", "",
             "tau = committed tokens per target verification on the held-out prompts (greedy, native engine).",
             "The engine's text differs a little between drafters (near-ties break differently in batched",
             "verification), which moves its tau by a few hundredths; where measured, the fixed-text tau walks the",
             "drafter's acceptances over one text, the plain greedy continuations",
             "(benchmarks/drafter_train_vs_engine.py), and compares drafters without that noise.", "",
             "| run | step | blocks trained | training tokens (captured) | val tau (log) | held-out tau | "
             "fixed-text tau | accepted at positions 1.. (of all verify steps) |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        steps = max(p.get("verify_steps", 1), 1)
        share = ", ".join(f"{a / steps:.2f}" for a in p.get("accepted_per_position", []))
        walk = f"{p['walk_tau']:.3f}" if "walk_tau" in p else ""
        lines.append(f"| {p.get('run', '')} | {p['step']} | {p['blocks_trained']:,} | {p['train_tokens']:,} | "
                     f"{p.get('val_tau', float('nan')):.3f} | **{p['tau']:.3f}** | {walk} | {share} |")
    table = out_dir / "learning-curve.md"
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table, None
    fig, ax = plt.subplots(figsize=(7, 4))
    by_data: dict[int, list[dict]] = {}
    for p in points:
        by_data.setdefault(p["train_tokens"], []).append(p)
    for n_tok, pts in sorted(by_data.items()):
        ax.plot([p["blocks_trained"] for p in pts], [p["tau"] for p in pts], "o-", label=f"{n_tok / 1e3:.0f}k tokens")
    ax.set_xscale("log")
    ax.set_xlabel("blocks trained")
    ax.set_ylabel("held-out tau (greedy)")
    ax.set_title(title or "learning curve")
    ax.grid(True, alpha=0.3)
    ax.legend(title="captured training data")
    png = out_dir / "learning-curve.png"
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return table, png
