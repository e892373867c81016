"""Reduced draft vocabulary: a drafter whose head scores only the N tokens its target emits most.

On CPU a DFlash drafter's cost is dominated by its full-vocabulary head (151,936 rows for Qwen2.5)
applied to every block slot. A reduced-vocabulary drafter keeps the N most frequent tokens of the
target's *own* greedy outputs on a calibration prompt set; its head is those N rows of the
target's head (same quant type: no training, no new weights). Verification stays over the full
vocabulary, so output stays the target's own: greedy drafts outside the draft vocabulary are
simply never proposed, and at T > 0 the draft distribution q is zero there, which rejection
sampling handles exactly (such tokens come from the residual).

GGUF layout (upstream llama.cpp's, so ``dflash`` / ``eagle3`` loaders that know it read the file):

- ``d2t``: I64 ``[N]``, the absolute target token id of every draft row, written ascending (so a
  draft-id tie-break is the target-id tie-break);
- ``output.weight``: ``[H, N]`` ggml shape, row i = the target head's row ``d2t[i]``, in the
  target head's own storage type (raw bytes copied: GET_ROWS of the quantized rows). Optional
  for pydflash (``store_head=False``, ``--head-from-target``): without it the engine gathers the
  same rows from the target's head at load time, so a shipped file is that much smaller (7.8 MB
  for Qwen2.5's Q8_0 head at N = 8192); loaders that know only upstream's layout need it.

Everything else is copied unchanged (the selector codebooks stay full-vocabulary). Files without
``d2t`` are not touched by any of this.

    counts = calibrate(target, prompts, max_tokens=128)
    print(coverage(counts, [4096, 8192, 16384, 32768]))
    ids = choose(counts, 16384, always=eog_ids)
    write_reduced_drafter("drafter.gguf", "drafter-v16k.gguf", "target.gguf", ids)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from .convert import read_gguf_header
from .gguf_rewrite import rewrite_gguf
from .gguf_layout import ARCH

__all__ = ["TokenCounts", "calibrate", "choose", "coverage", "load_prompts", "main", "write_reduced_drafter"]

D2T = "d2t"
HEAD = "output.weight"
DEFAULT_COVERAGE_AT = (2048, 4096, 8192, 16384, 32768)


@dataclass
class TokenCounts:
    """How often the target emitted (``output``) and was fed (``prompt``) each token id."""

    output: np.ndarray  # [n_vocab] int64
    prompt: np.ndarray  # [n_vocab] int64
    n_prompts: int = 0
    sources: list[str] = field(default_factory=list)

    @property
    def n_vocab(self) -> int:
        return int(self.output.shape[0])

    @property
    def n_output(self) -> int:
        return int(self.output.sum())


def load_prompts(spec: str, *, limit: int | None = None) -> list:
    """Prompts of ``spec`` (``humaneval``, ``gsm_symbolic``, a ``.jsonl`` file, comma-joined)."""
    from ..fetch import prompt_sets

    return list(prompt_sets.load(spec, limit=limit))


def calibrate(target, prompts: Iterable, *, max_tokens: int = 128) -> TokenCounts:  # type: ignore[no-untyped-def]
    """Count the tokens of the target's own greedy continuations of ``prompts``.

    ``target`` is a loaded ``pydflash.Target``; ``prompts`` are strings, token lists or objects
    with ``render(target)``. Greedy decoding is deterministic, so the same prompts give the same
    counts (the calibration is reproducible).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n_vocab = target.info.n_vocab
    out = np.zeros(n_vocab, dtype=np.int64)
    fed = np.zeros(n_vocab, dtype=np.int64)
    n = 0
    for p in prompts:
        if isinstance(p, str):
            tokens = target.tokenize(p)
        elif hasattr(p, "render"):
            tokens = target.tokenize(p.render(target), parse_special=bool(getattr(p, "messages", ())))
        else:
            tokens = [int(t) for t in p]
        if not tokens:
            continue
        tokens = tokens[-(target.info.n_ctx - max_tokens - 1):] if len(tokens) + max_tokens >= target.info.n_ctx else tokens
        result = target.generate(tokens, max_tokens=max_tokens, temperature=0)
        np.add.at(out, np.asarray(result.tokens, dtype=np.int64), 1)
        np.add.at(fed, np.asarray(tokens, dtype=np.int64), 1)
        n += 1
    if n == 0:
        raise ValueError("no calibration prompts")
    return TokenCounts(output=out, prompt=fed, n_prompts=n)


def _ranking(counts: TokenCounts) -> np.ndarray:
    """Token ids by descending output count, then prompt count, then ascending id."""
    ids = np.arange(counts.n_vocab)
    return np.lexsort((ids, -counts.prompt, -counts.output))


def coverage(counts: TokenCounts, sizes: Sequence[int]) -> dict[int, float]:
    """Share of the calibration outputs that a draft vocabulary of each size would contain."""
    total = counts.n_output
    ranked = counts.output[_ranking(counts)]
    cum = np.cumsum(ranked)
    return {int(n): float(cum[min(int(n), counts.n_vocab) - 1] / total) if total else 0.0 for n in sizes}


def choose(counts: TokenCounts, n: int, *, always: Iterable[int] = ()) -> np.ndarray:
    """The draft vocabulary: ``n`` target ids (ascending, int64) - ``always`` (e.g. end-of-generation
    ids, so the drafter can propose the end) plus the most frequent outputs, then prompt tokens."""
    if not 1 <= n <= counts.n_vocab:
        raise ValueError(f"draft vocabulary size must be in 1..{counts.n_vocab}, got {n}")
    forced = sorted({int(t) for t in always if 0 <= int(t) < counts.n_vocab})
    if len(forced) > n:
        raise ValueError(f"{len(forced)} forced tokens do not fit a draft vocabulary of {n}")
    chosen = list(forced)
    taken = set(forced)
    for t in _ranking(counts):
        if len(chosen) == n:
            break
        if int(t) not in taken:
            chosen.append(int(t))
            taken.add(int(t))
    return np.array(sorted(chosen), dtype=np.int64)


def _full_drafter_header(path: str | os.PathLike):  # type: ignore[no-untyped-def]
    """The header of a full-vocabulary DFlash drafter GGUF, or a ValueError saying why not."""
    if not Path(path).is_file():
        raise ValueError(f"drafter {path} not found")
    src = read_gguf_header(path)
    arch = src.kv.get("general.architecture")
    if arch is None or arch.value != ARCH.encode():
        raise ValueError(f"{path} is not a DFlash drafter GGUF (general.architecture != {ARCH!r})")
    if D2T in src.tensors:
        raise ValueError(f"{path} already has a reduced draft vocabulary (d2t); start from the full drafter")
    return src


def write_reduced_drafter(drafter_in: str | os.PathLike, out: str | os.PathLike, target_gguf: str | os.PathLike,
                          ids: Sequence[int] | np.ndarray, *, extra_metadata: dict[str, float | str] | None = None,
                          store_head: bool = True) -> Path:
    """Copy ``drafter_in`` to ``out`` with a draft head over ``ids`` (target token ids).

    ``output.weight`` gets the target head's rows at ``ids`` in its own storage type and ``d2t``
    the ids themselves (I64, ascending). The input must be a full-vocabulary drafter (no ``d2t``);
    a shipped full-vocabulary ``output.weight`` (which our engine ignores) is replaced.
    ``store_head=False`` writes ``d2t`` only: the engine takes the rows from the target at load.
    """
    src, tgt = _full_drafter_header(drafter_in), read_gguf_header(target_gguf)
    head = tgt.tensors.get(HEAD) or tgt.tensors.get("token_embd.weight")
    if head is None:
        raise ValueError(f"target {target_gguf} has neither output.weight nor token_embd.weight")
    n_embd, n_vocab = int(head.ne[0]), int(head.ne[1])
    drafter_embd = src.kv.get(f"{ARCH}.embedding_length")
    if drafter_embd is None or int(drafter_embd.value) != n_embd:
        raise ValueError(f"drafter hidden size {getattr(drafter_embd, 'value', None)} != the target head's {n_embd}: "
                         "the drafter belongs to another target")
    d2t = np.asarray(ids, dtype=np.int64).reshape(-1)
    if d2t.size == 0 or d2t.min() < 0 or d2t.max() >= n_vocab:
        raise ValueError(f"draft vocabulary ids must be within 0..{n_vocab - 1}")
    d2t = np.unique(d2t)  # ascending, no duplicates
    if d2t.size != np.asarray(ids).size:
        raise ValueError("draft vocabulary ids contain duplicates")

    row_bytes = head.nbytes // n_vocab
    tgt_map = np.memmap(tgt.path, dtype=np.uint8, mode="r")
    rows = np.asarray(tgt_map[head.offset:head.offset + head.nbytes]).reshape(n_vocab, row_bytes)[d2t]
    del tgt_map
    extra = [(key, value, GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.STRING)
             for key, value in (extra_metadata or {}).items()]
    head_rows = [(HEAD, (int(d2t.size), n_embd), np.float32, head.type, rows)] if store_head else []
    return rewrite_gguf(src, out, add_kv=extra, drop_tensors=(HEAD,), add_tensors=[
        *head_rows, (D2T, (int(d2t.size),), np.int64, GGMLQuantizationType.I64, d2t)])


# --- CLI -----------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "pydflash draft-vocab",
        description="Make a reduced-vocabulary drafter: calibrate the target on a prompt set (its own "
                    "greedy outputs), report the coverage of several vocabulary sizes, write the drafter "
                    "with the N most frequent tokens (own output.weight rows + d2t).")
    p.add_argument("drafter", help="full-vocabulary DFlash drafter GGUF")
    p.add_argument("out", nargs="?", help="reduced-vocabulary drafter GGUF to write (omit: report only)")
    p.add_argument("--target", required=True, help="target GGUF path or `pydflash models` name")
    p.add_argument("--prompts", required=True, help="humaneval, gsm_symbolic or a .jsonl file (comma-joined)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per source")
    p.add_argument("--n", type=int, default=16384, help="draft vocabulary size N (default 16384)")
    p.add_argument("--max-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    p.add_argument("--coverage-at", default=",".join(map(str, DEFAULT_COVERAGE_AT)),
                   help="vocabulary sizes to report the coverage of")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--head-from-target", action="store_true",
                   help="store d2t only: the engine takes the head rows from the target at load time (a smaller "
                        "file; loaders that know only upstream's layout need the rows)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from ..fetch import registry as models
    from ..runtime.target import Target

    args = build_parser(prog).parse_args(argv)
    try:
        sizes = [int(s) for s in args.coverage_at.split(",") if s.strip()]
    except ValueError:
        print(f"pydflash: error: --coverage-at must be comma-separated integers, got {args.coverage_at!r}",
              file=sys.stderr)
        return 2
    try:
        if args.n < 1:
            raise ValueError(f"--n must be >= 1, got {args.n}")
        _full_drafter_header(args.drafter)  # fail before the (slow) calibration
        target_path = models.resolve(args.target)
        prompts = load_prompts(args.prompts, limit=args.limit)
        with Target(target_path, n_ctx=args.n_ctx, n_threads=args.threads) as target:
            counts = calibrate(target, prompts, max_tokens=args.max_tokens)
            eog = [t for t in range(target.info.n_vocab) if target.is_eog(t)]
        cover = coverage(counts, sorted(set(sizes + [args.n])))
        report = {"prompts": counts.n_prompts, "output_tokens": counts.n_output,
                  "distinct_output_tokens": int(np.count_nonzero(counts.output)),
                  "coverage": {str(k): round(v, 4) for k, v in cover.items()}, "n": args.n}
        if args.out:
            ids = choose(counts, args.n, always=eog)
            write_reduced_drafter(args.drafter, args.out, target_path, ids, extra_metadata={
                "pydflash.draft_vocab.coverage": float(cover[args.n]),
                "pydflash.draft_vocab.calibration": f"{args.prompts} ({counts.n_prompts} prompts, "
                                                    f"{counts.n_output} greedy tokens)"},
                store_head=not args.head_from_target)
            report["out"] = str(args.out)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"pydflash: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report))
    else:
        print(f"calibration: {report['prompts']} prompts, {report['output_tokens']} greedy output tokens, "
              f"{report['distinct_output_tokens']} distinct")
        for k, v in cover.items():
            print(f"  N = {k:>6}: coverage {100 * v:6.2f} %")
        if args.out:
            print(f"wrote {args.out} (N = {args.n})")
    return 0
