"""``pydflash profile``: how well a drafter does on *your* prompts, and what that buys here.

Every prompt is generated with the longest draft (n_max = block_size - 1), which observes the
acceptance of every draft position. Acceptance is reported per prompt, per category (the JSONL
``category`` field) and per position; combined with this machine's measured verify and draft costs
(``pydflash.tools.autotune``) it gives the expected speedup for each n_max and a verdict: the best n_max,
or plain decoding where no n_max pays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import autotune
from ..runtime import devices
from ..fetch import registry as models, prompt_sets as prompts
from .bench import pyplot, report_header
from ..runtime.engine import Engine

__all__ = ["profile", "main"]


def _acceptance(rows: list[dict], n_positions: int) -> autotune.AcceptanceModel:
    model = autotune.AcceptanceModel(n_positions=n_positions, decay=1.0)
    for r in rows:
        model.observe(r["steps"], n_positions, r["accepted_per_position"])
    return model


def _group(rows: list[dict], n_positions: int) -> dict:
    steps = sum(r["steps"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    reach = [sum(r["accepted_per_position"][j] for r in rows) for j in range(n_positions)]
    return {"prompts": len(rows), "tokens": tokens, "tau": round(tokens / steps, 3) if steps else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_position": [round(v / steps, 3) if steps else 0.0 for v in reach],
            "alphas": [round(a, 3) for a in _acceptance(rows, n_positions).alphas()]}


def profile(args: argparse.Namespace, log=print) -> dict:  # type: ignore[no-untyped-def]
    prompt_list = prompts.load(args.prompts, limit=args.limit, offset=args.offset)
    t0 = time.perf_counter()
    devices.add_rpc_servers(args.rpc)
    with Engine(models.resolve(args.model), args.model_draft, n_ctx=args.ctx_size, n_threads=args.threads,
                n_max=None, n_gpu_layers=args.n_gpu_layers, drafter_device=args.device_draft,
                lookup=0) as engine:  # the drafter's own acceptance
        assert engine.drafter is not None
        n_pos = engine.drafter.info.block_size - 1
        costs = autotune.cached_costs(engine.target, engine.drafter, engine.target.path, engine.drafter.path,
                                      n_threads=args.threads)
        rows = []
        for p in prompt_list:
            r = engine.generate(p.render(engine.target), n_max=n_pos, max_tokens=args.max_tokens,
                                temperature=args.temp, seed=args.seed)
            s = r.stats
            rows.append({"id": p.id, "category": p.category, "tokens": s.n_generated, "steps": s.n_verify_steps,
                         "drafted": s.n_drafted, "accepted": s.n_accepted, "tau": round(s.tau, 3),
                         "tok_s": round(s.tokens_per_second, 2),
                         "accepted_per_position": list(s.accepted_per_position[:n_pos])})
            log(f"[profile] {p.id:<28} tau {s.tau:5.2f}  accepted {s.n_accepted}/{s.n_drafted}")
    overall = _group(rows, n_pos)
    tuner = autotune.AutoTuner(costs, _acceptance(rows, n_pos), margin=1.0)
    speedups = tuner.speedups()
    best = tuner.best()
    verdict = (f"best n_max {best}: expected {speedups[best]:.2f}x plain decoding on this machine"
               if best else f"speculation does not pay here: the best n_max ({max(range(1, len(speedups)), key=lambda k: speedups[k])})"
                            f" would run at {max(speedups[1:]):.2f}x plain; decode plainly (n_max 0)")
    return {
        **report_header(args, "profile", t0),
        "overall": overall,
        "categories": {c: _group([r for r in rows if r["category"] == c], n_pos)
                       for c in sorted({r["category"] for r in rows})},
        "expected_speedup_by_n_max": [round(x, 3) for x in speedups],
        "best_n_max": best,
        "verdict": verdict,
        "costs": asdict(costs),
        "prompts": rows,
    }


def markdown(report: dict) -> str:
    o = report["overall"]
    lines = [f"# pydflash profile: {Path(str(report['config']['model'])).name} + {Path(str(report['config']['model_draft'])).name}",
             "", f"Command: `{report['command']}`", "",
             f"**Verdict:** {report['verdict']}.", "",
             f"Overall: {o['prompts']} prompts, τ {o['tau']}, acceptance {o['acceptance_rate']}, "
             f"conditional acceptance per position {o['alphas']}.", "",
             "Expected speedup vs plain decoding by n_max (0 = plain): "
             + ", ".join(f"{k}: {v}" for k, v in enumerate(report["expected_speedup_by_n_max"])) + ".", "",
             "| category | prompts | τ | acceptance | reached per position |", "|---|---|---|---|---|"]
    for c, g in report["categories"].items():
        lines.append(f"| {c} | {g['prompts']} | {g['tau']} | {g['acceptance_rate']} | {g['accepted_per_position']} |")
    lines += ["", "| prompt | category | tokens | τ | accepted/drafted | tok/s |", "|---|---|---|---|---|---|"]
    for r in report["prompts"]:
        lines.append(f"| {r['id']} | {r['category']} | {r['tokens']} | {r['tau']} | {r['accepted']}/{r['drafted']} | {r['tok_s']} |")
    c = report["costs"]
    lines += ["", f"Costs on this machine (plain step {c['t_step_ms']:.2f} ms): c_verify = "
                  f"{[round(x, 2) for x in c['verify']]}, c_draft = {[round(x, 2) for x in c['draft']]}.",
              "Acceptance was observed with the longest draft; a shorter block may draft slightly differently."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Acceptance per position by category and expected speedup by n_max; False without matplotlib."""
    if (mpl := pyplot()) is None:
        return False
    plt, MaxNLocator = mpl
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c, g in report["categories"].items():
        v = g["accepted_per_position"]
        ax1.plot(range(1, len(v) + 1), v, marker="o", label=c)
    ax1.set_xlabel("draft position")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_ylabel("fraction of verify steps accepting it")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    s = report["expected_speedup_by_n_max"]
    ax2.bar(range(len(s)), s, color=["tab:gray"] + ["tab:blue"] * (len(s) - 1))
    ax2.axhline(1.0, color="black", linewidth=0.8)
    ax2.set_xlabel("n_max (0 = plain)")
    ax2.set_ylabel("expected speedup on this machine")
    fig.suptitle(report["verdict"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="a .jsonl file (prompt or messages, optional category), "
                                                    "humaneval, gsm_symbolic, or a comma list")
    p.add_argument("-m", "--model", default=None, help="target GGUF path or `pydflash models` name (or -hf)")
    p.add_argument("-md", "--model-draft", default=None, help="DFlash drafter GGUF (or -hfd)")
    p.add_argument("--limit", type=int, default=None, help="prompts per source (default: all)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=min(os.cpu_count() or 1, 4))
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    devices.add_arguments(p)
    p.add_argument("-o", "--out", default="profile-results", help="directory for profile.json / .md / .png")


def main(args: argparse.Namespace) -> int:
    if not Path(args.model_draft).is_file():
        print(f"pydflash profile: drafter not found: {args.model_draft}", file=sys.stderr)
        return 2
    if args.max_tokens < 1 or args.threads < 1 or args.temp < 0 or (args.limit is not None and args.limit < 1):
        print("pydflash profile: --max-tokens, --threads, --limit must be >= 1 and --temp >= 0", file=sys.stderr)
        return 2
    report = profile(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "profile.md").write_text(markdown(report))
    plotted = plot(report, out / "profile.png")
    print(markdown(report))
    print(f"[profile] wrote {out}/profile.json, profile.md" + (", profile.png" if plotted else ""), file=sys.stderr)
    return 0
