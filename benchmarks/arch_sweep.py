"""Every architecture the pinned llama.cpp can write, as a random-weight target: does speculative
decoding (a DFlash2 drafter; history drafts) give the output of plain decoding?

    python benchmarks/arch_sweep.py [--arch qwen35-dense ...] [-n 48] [--json OUT]

Plain decoding is libllama one token at a time (Target.decode + argmax); speculative runs through
the scheduler. Prints one line per fixture and a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import arch_fixtures  # noqa: E402

import pydflash  # noqa: E402


MODES = ("drafter", "defaults", "history")  # n_max 7 with a drafter; auto with it; history drafts only


def plain_greedy(target: pydflash.Target, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    target.rollback(0)
    target.decode(prompt)
    out, rows = [], []
    for _ in range(n):
        z = np.asarray(target.logits(), dtype=np.float64).copy()
        rows.append(z)
        t = int(np.argmax(z))
        out.append(t)
        target.decode([t])
    target.rollback(0)
    return out, rows


def tie_ok(want: list[int], got: list[int], rows: list[np.ndarray], limit: float = 1e-3) -> tuple[bool, int, float]:
    """Equal, or first divergence at a near tie of the reference (relative logit gap)."""
    if want == got:
        return True, -1, 0.0
    i = next((k for k in range(min(len(want), len(got))) if want[k] != got[k]), min(len(want), len(got)))
    if i >= len(rows):
        return False, i, float("inf")
    z = rows[i]
    gap = float(z[want[i]] - z[got[i]]) if i < len(got) else float("inf")
    return gap < limit * max(1.0, abs(float(z.max()))), i, gap


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="*")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    fixtures = arch_fixtures.targets()
    names = args.arch or list(fixtures)
    results = {}
    for name in names:
        path = fixtures[name]
        row: dict[str, object] = {}
        try:
            t = pydflash.Target(str(path), n_ctx=256, n_threads=2)
            prompt = [1, 5, 9, 17, 33, 2, 7, 11, 3, 4, 6, 8]
            prompt = [p % t.info.n_vocab for p in prompt]
            want, rows = plain_greedy(t, prompt, args.n)
            t.close()
            row["plain"] = "ok"
        except Exception as e:  # noqa: BLE001
            row["plain"] = f"{type(e).__name__}: {e}"
            results[name] = row
            print(f"{name:28s} plain FAILED {row['plain']}")
            continue
        for mode in MODES:
            try:
                drafter = None if mode == "history" else str(arch_fixtures.drafter_for(path))
                with pydflash.Engine(str(path), drafter, n_ctx=256, n_threads=2,
                                     n_max="auto" if mode == "defaults" else 7,
                                     lookup=1 if mode == "history" else None) as e:
                    r = e.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
                    row["rollback"] = e.target.info.rollback
                    row["taps"] = e.target.info.tap_source
                    if r.stats.notice:
                        row["notice"] = r.stats.notice
                ok, i, gap = tie_ok(want, list(r.tokens), rows)
                row[mode] = "equal" if list(r.tokens) == want else (f"tie@{i}" if ok else f"DIFF@{i} gap {gap:.3g}")
                row[mode + "_drafted"] = r.stats.n_drafted
                row[mode + "_accepted"] = r.stats.n_accepted
                row[mode + "_replayed"] = r.stats.n_replayed
            except Exception as e:  # noqa: BLE001
                row[mode] = f"{type(e).__name__}: {str(e)[:160]}"
        results[name] = row
        print(f"{name:24s} {row.get('rollback', '-')!s:10s} {row.get('taps', '-')!s:11s} "
              + " ".join(f"{m}={str(row.get(m))[:40]} ({row.get(m + '_accepted', 0)}/{row.get(m + '_drafted', 0)})"
                         for m in MODES) + (" | " + str(row["notice"]) if "notice" in row else ""), flush=True)
    n = len(results)
    summary = {m: sum(1 for r in results.values() if str(r.get(m, "")).startswith(("equal", "tie"))) for m in MODES}
    summary["plain"] = sum(1 for r in results.values() if r.get("plain") == "ok")
    print(f"of {n}: plain ok {summary['plain']}, " + ", ".join(f"{m} == plain {summary[m]}" for m in MODES))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
