"""Acceptance profile of a drafter: measured once, written into its GGUF, read by ``auto``.

``pydflash drafter-profile DRAFTER --target TARGET`` generates greedily with the drafter at its
full width (n_max = block_size - 1) on held-out prompts and counts, for every draft position j,
how often draft j was verified with drafts 0..j-1 accepted (offered) and how often it was
accepted. The conditional rates ``accepted[j] / offered[j]`` go into the drafter's metadata:

- ``dflash.acceptance_profile``: F32 array, one rate per draft position (block_size - 1 of them);
- ``dflash.acceptance_profile_drafts``: U32, the drafts measured.

The scheduler's ``auto`` width takes the profile as its acceptance prior (in place of a blind
0.5) and, with one timed drafter block at load and the target's measured one-row time, prices
the first probe: a drafter that would not pay is not probed on a cold start. Everything else in
the file is copied unchanged, so the profile is rewritten in place whenever the drafter changes:

    pydflash drafter-profile pydflash/drafters/smollm2-135m-instruct-dflash2.gguf --target smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from .convert import read_gguf_header
from .gguf_rewrite import rewrite_gguf
from .gguf_layout import ARCH

__all__ = ["PROFILE", "PROFILE_DRAFTS", "measure", "read_profile", "write_profile", "main"]

PROFILE = f"{ARCH}.acceptance_profile"
PROFILE_DRAFTS = f"{ARCH}.acceptance_profile_drafts"
# held out from the shipped drafters' training (HumanEval 0..131) and from the first 20 held-out
# prompts benchmarks/auto_cold_start.py measures on
DEFAULT_PROMPTS, DEFAULT_OFFSET, DEFAULT_LIMIT = "humaneval", 152, 12
SMOOTHING = 8.0


def measure(target_path: str | os.PathLike, drafter_path: str | os.PathLike, prompts: Sequence, *,
            max_tokens: int = 128, n_ctx: int = 4096, n_threads: int | None = None,
            log=None) -> tuple[list[float], int, dict]:  # type: ignore[no-untyped-def]
    """Greedy generations at the drafter's full width: (rates by position, drafts, report)."""
    from ..runtime.drafter import Drafter
    from ..runtime.generation import SamplingOptions
    from ..runtime.scheduler import Scheduler
    from ..runtime.target import Target

    with Target(target_path, n_ctx=n_ctx, n_threads=n_threads) as target, \
            Drafter(drafter_path, target, n_ctx=target.info.n_ctx, n_threads=n_threads) as drafter:
        width = drafter.info.block_size - 1
        if width < 1:
            raise ValueError(f"{drafter_path}: block size {drafter.info.block_size} leaves no draft position")
        offered, accepted = np.zeros(width, np.int64), np.zeros(width, np.int64)
        opts = SamplingOptions.build(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        n_tokens = 0
        sched = Scheduler(target, drafter, n_max=width, lookup=0)  # the drafter's own acceptance
        try:
            for p in prompts:
                sid = sched.add(target.tokenize(p.render(target)), opts, cache_prompt=False)
                while sid not in sched.finished():
                    info = sched.step()
                    if info.n_prefill_rows or info.width <= 0:
                        continue
                    n_acc = info.n_committed - 1  # one sequence: the accepted drafts + the target's token
                    for j in range(min(info.width, width)):
                        if n_acc < j:
                            break
                        offered[j] += 1
                        accepted[j] += n_acc > j
                n_tokens += sched.take(sid).stats.n_generated
                if log:
                    log(f"[drafter-profile] {p.id}: {int(offered[0])} drafts so far")
        finally:
            sched.close()
    if offered[0] == 0:
        raise ValueError("no draft was verified: give prompts and --max-tokens >= 2")
    # a deep position is reached rarely: its rate is shrunk toward the one before (worth SMOOTHING
    # drafts), so a position seen once does not claim 0 or 1
    rates, last = [], float(accepted[0] / offered[0])
    for j in range(width):
        last = float((accepted[j] + SMOOTHING * last) / (offered[j] + SMOOTHING))
        rates.append(round(last, 4))
    report = {"prompts": len(prompts), "tokens": n_tokens, "drafts": int(offered[0]),
              "tau": round(1.0 + float(accepted.sum()) / float(offered[0]), 3),
              "offered": offered.tolist(), "accepted": accepted.tolist(), "rates": rates}
    return rates, int(offered[0]), report


def read_profile(path: str | os.PathLike) -> tuple[list[float], int] | None:
    """The profile a drafter GGUF carries, or None."""
    kv = read_gguf_header(path).kv
    if PROFILE not in kv:
        return None
    drafts = kv.get(PROFILE_DRAFTS)
    return [float(x) for x in kv[PROFILE].value], int(drafts.value) if drafts is not None else 0


def write_profile(drafter_in: str | os.PathLike, out: str | os.PathLike | None, rates: Sequence[float] | None,
                  n_drafts: int = 0) -> Path:
    """Copy ``drafter_in`` to ``out`` (None: in place) with the profile ``rates`` (None: without one)."""
    src = read_gguf_header(drafter_in)
    arch = src.kv.get("general.architecture")
    if arch is None or arch.value != ARCH.encode():
        raise ValueError(f"{drafter_in} is not a DFlash drafter GGUF (general.architecture != {ARCH!r})")
    if rates is not None:
        rates = [float(a) for a in rates]
        if not rates or not all(0.0 <= a <= 1.0 for a in rates):
            raise ValueError(f"acceptance rates must be 1+ probabilities in [0, 1], got {rates}")
    add = [] if rates is None else [(PROFILE, rates, GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
                                    (PROFILE_DRAFTS, int(n_drafts), GGUFValueType.UINT32)]
    return rewrite_gguf(src, out if out is not None else drafter_in, drop_keys=(PROFILE, PROFILE_DRAFTS), add_kv=add)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "pydflash drafter-profile",
        description="Measure a drafter's acceptance by draft position (greedy, full width, on held-out "
                    "prompts) and write it into the drafter GGUF, where `auto` n_max prices its first "
                    "probe with it.")
    p.add_argument("drafter", help="DFlash drafter GGUF")
    p.add_argument("out", nargs="?", help="GGUF to write (omit: rewrite the drafter in place)")
    p.add_argument("--target", required=True, help="target GGUF path or `pydflash models` name")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="humaneval, gsm_symbolic or a .jsonl file")
    p.add_argument("--offset", type=int, default=DEFAULT_OFFSET,
                   help=f"first prompt (default {DEFAULT_OFFSET}: held-out HumanEval)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="prompts (per source)")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--dry-run", action="store_true", help="measure and report, write nothing")
    p.add_argument("--remove", action="store_true", help="write the drafter without a profile (no measuring)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from .. import errors
    from ..fetch import prompt_sets, registry as models

    args = build_parser(prog).parse_args(argv)
    try:
        if not Path(args.drafter).is_file():
            raise ValueError(f"drafter {args.drafter} not found")
        if args.remove:
            print(f"wrote {write_profile(args.drafter, args.out, None)} (no acceptance profile)")
            return 0
        if args.max_tokens < 2 or args.limit < 1:
            raise ValueError("--max-tokens must be >= 2 and --limit >= 1")
        read_gguf_header(args.drafter)  # a broken file fails before the (slow) measurement
        prompts = prompt_sets.load(args.prompts, limit=args.limit, offset=args.offset)
        rates, drafts, report = measure(models.resolve(args.target), args.drafter, prompts,
                                        max_tokens=args.max_tokens, n_ctx=args.n_ctx, n_threads=args.threads,
                                        log=lambda m: print(m, file=sys.stderr))
        report["command"] = "pydflash drafter-profile " + " ".join(sys.argv[2:] if argv is None else argv)
        print(json.dumps(report))
        if not args.dry_run:
            print(f"wrote {write_profile(args.drafter, args.out, rates, drafts)}")
    except (ValueError, OSError, errors.PydflashError) as exc:
        print(f"pydflash: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
