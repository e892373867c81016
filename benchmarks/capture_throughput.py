"""Training-data capture throughput: captured tokens per second, old recipe vs new, interleaved.

    python benchmarks/capture_throughput.py -m smollm2-135m --prompts 48 --max-new 128 --rounds 2 \\
        --parallel 16:0,16:64,8:64 \\
        --out benchmarks/results/capture-throughput

* ``two-pass, stock``: what ``pydflash train`` did before: greedy continuations 8 sequences at a
  time (plain decoding through the scheduler), then every whole sequence decoded once more with
  the taps on; ggml's stock kernels (the default then).
* ``one-pass, default kernels, P in parallel, S rows a step``: ``train.features.capture_continuations``:
  the scheduler generates P sequences together and keeps every decoded row's taps and argmax as
  it goes (continuous batching, nothing decoded twice); pydflash's kernels (the default now). At
  most S rows a step (``step_rows``, the default 64): new prompts are prefilled in slices that stay
  on the multi-row kernels; "whole prompts" = a prompt in one ubatch, on ggml's prefill kernels.

Each round runs every mode once on the same prompts (stdlib function headers + docstrings),
modes interleaved; the table gives the median over rounds. Tokens counted = rows captured.
A "CPU-hour" here is one hour of this whole 2-core machine (both threads busy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np


def cpu_flags() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return platform.machine()
    return ",".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags) or "none"


def load_target(path: str, kernels: bool, **kwargs):  # type: ignore[no-untyped-def]
    from pydflash import Target

    os.environ["PYDFLASH_KERNELS"] = "1" if kernels else "0"
    try:
        return Target(path, **kwargs)
    finally:
        os.environ.pop("PYDFLASH_KERNELS", None)


# the recipe before session 4, kept here as the benchmark's baseline
def generate_continuations(target, prompts: list[list[int]], *, max_tokens: int,
                           batch: int = 8) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The target's greedy continuations of token prompts, ``batch`` sequences at a time.

    ``target`` is a ``pydflash.Engine`` without drafter (plain batched decoding); sequences stop
    at the target's end-of-generation token or after ``max_tokens``.
    """
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i: i + batch]]
        results = target.generate_batch(chunk, max_tokens=max_tokens, temperature=0.0)
        out.extend(list(r.tokens) for r in results)
    return out


def capture_sequence(target, tokens: Sequence[int], tap_layers: Sequence[int], *,
                     chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """Decode ``tokens`` on sequence 0 from position 0 with taps on.

    Args:
        target: a ``pydflash.Target`` (its KV cache of sequence 0 is cleared).
        tap_layers: HF layer ids (the drafter's ``target_layer_ids``).
        chunk: rows per decode call (<= the target's n_batch).
    Returns:
        (features ``[n, L, H]`` float32, labels ``[n]`` int32 = argmax of each row's logits).
    """
    tokens = [int(t) for t in tokens]
    target.rollback(0)
    target.set_taps([int(layer) + 1 for layer in tap_layers])
    feats, labels = [], []
    try:
        for start in range(0, len(tokens), chunk):
            part = tokens[start: start + chunk]
            target.decode(part, all_logits=True)
            feats.append(np.stack([target.tap_rows(k) for k in range(len(tap_layers))], axis=1))
            labels.extend(int(np.argmax(target.logits(r))) for r in range(len(part)))
    finally:
        target.set_taps([])
        target.rollback(0)
    return np.concatenate(feats, axis=0), np.asarray(labels, dtype=np.int32)


def two_pass(path: str, prompts: list[list[int]], taps: list[int], max_new: int, threads: int) -> int:
    from pydflash import Engine

    os.environ["PYDFLASH_KERNELS"] = "0"
    try:
        engine = Engine(path, None, n_ctx=(max(map(len, prompts)) + max_new + 8) * 8, n_threads=threads, n_seq_max=8)
    finally:
        os.environ.pop("PYDFLASH_KERNELS", None)
    n = 0
    with engine:
        conts = generate_continuations(engine, prompts, max_tokens=max_new, batch=8)
        for sid in range(8):
            engine.target.rollback(0, seq_id=sid)
        for toks, cont in zip(prompts, conts):
            feats, _ = capture_sequence(engine.target, list(toks) + list(cont), taps)
            n += len(feats)
    return n


def one_pass(path: str, prompts: list[list[int]], taps: list[int], max_new: int, threads: int, parallel: int,
             step_rows: int) -> int:
    from pydflash.train.features import Continuation, capture_continuations

    n_ctx = max(map(len, prompts)) + max_new + 8  # per sequence
    with load_target(path, True, n_ctx=n_ctx, n_threads=threads, n_seq_max=parallel,
                     n_batch=max(512, parallel)) as target:
        jobs = [Continuation(str(i), p) for i, p in enumerate(prompts)]
        return sum(len(s.tokens) for s in capture_continuations(target, jobs, taps, max_tokens=max_new,
                                                                n_parallel=parallel, step_rows=step_rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--parallel", default="16:0,16:64",
                    help="one-pass modes, comma-separated P:S = P sequences in parallel, at most S rows a step "
                         "(0 = a whole prompt in one step)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from pydflash.fetch import registry as models
    from pydflash.train.pipeline import default_taps
    from pydflash.train.init import target_facts
    from pydflash.train.prompts import load

    path = str(models.resolve(args.model))
    taps = default_taps(target_facts(path)["num_layers"])
    with load_target(path, False, n_ctx=512, n_threads=1) as t:
        prompts = [t.tokenize(p.text) for p in load("stdlib", limit=args.prompts)]
    prompts = [p for p in prompts if len(p) <= 384]
    modes = [("two-pass, stock kernels", lambda: two_pass(path, prompts, taps, args.max_new, args.threads))]
    for spec in args.parallel.split(","):
        par, _, rows = spec.partition(":")
        par, rows = int(par), int(rows or 0)
        step = f"{rows} rows a step" if rows else "whole prompts a step"
        modes.append((f"one-pass, default kernels, {par} in parallel, {step}",
                      lambda par=par, rows=rows: one_pass(path, prompts, taps, args.max_new, args.threads, par, rows)))
    runs: dict[str, list[float]] = {name: [] for name, _ in modes}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        for name, fn in modes:
            t0 = time.monotonic()
            n = fn()
            dt = time.monotonic() - t0
            runs[name].append(n / dt)
            tokens[name] = n
            print(f"round {r}: {name}: {n} tokens in {dt:.1f} s = {n / dt:.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(runs[modes[0][0]])
    lines = [f"# Capture throughput: {args.model}", "",
             f"Command: `python benchmarks/capture_throughput.py -m {args.model} --prompts {args.prompts} "
             f"--max-new {args.max_new} --parallel {args.parallel} --rounds {args.rounds} -t {args.threads}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, flags {cpu_flags()}, "
             f"{args.threads} threads; {len(prompts)} stdlib prompts, {args.max_new} new tokens each; "
             f"medians of {args.rounds} interleaved rounds.", "",
             "| mode | captured tokens | tok/s (median) | tokens per hour | vs two-pass |", "|---|---|---|---|---|"]
    for name, _ in modes:
        med = statistics.median(runs[name])
        lines.append(f"| {name} | {tokens[name]} | {med:.0f} | {med * 3600 / 1e6:.2f} M | {med / base:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.model}.md").write_text(report)
        (out / f"{args.model}.json").write_text(json.dumps({"model": args.model, "runs": runs, "tokens": tokens,
                                                            "prompts": len(prompts), "max_new": args.max_new,
                                                            "threads": args.threads, "cpu": cpu_flags()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
