"""Choosing the draft length (n_max) from measured costs and observed acceptance.

A speculative step with k drafts costs one drafter block of k + 1 slots plus one target batch of
k + 1 rows, and commits the accepted prefix plus one token. In units of one plain decoding step
(one target row without taps):

    expected tokens per step   E(k) = 1 + sum_{i=1..k} prod_{j=1..i} a_j
    cost of a step             C(k) = c_verify(k + 1) + c_draft(k)
    expected speedup           S(k) = E(k) / C(k),     S(0) = 1 (plain decoding)

where a_j is the probability that draft j is accepted given drafts 1..j-1 were. ``CostModel``
measures c_verify and c_draft on the running machine (cached on disk per files, threads and
machine); ``AcceptanceModel`` estimates a_j from the statistics of past generations; ``AutoTuner``
picks the k with the largest S(k), and k = 0 (speculation off) when no k beats plain decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from ..fetch import registry as models

__all__ = ["CostModel", "AcceptanceModel", "AutoTuner", "cached_costs", "expected_tokens", "measure_costs",
           "nondecreasing"]

_CACHE_VERSION = 2  # 2: timed after an untimed call of the same shape
_CALIBRATION_TEXT = (
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n"
)


@dataclass(frozen=True)
class CostModel:
    """Measured costs in units of one plain decoding step (``t_step_ms``).

    ``verify[r - 1]`` is c_verify(r): a target batch of r rows with all-row logits and the taps
    the drafter reads; ``draft[k - 1]`` is c_draft(k): one drafter block of k + 1 slots plus the
    injection of the committed rows."""

    t_step_ms: float
    verify: tuple[float, ...]
    draft: tuple[float, ...]
    n_context: int = 0
    n_threads: int = 0

    @property
    def max_drafts(self) -> int:
        return min(len(self.verify) - 1, len(self.draft))

    def step_cost(self, k: int) -> float:
        """C(k), the cost of one speculative step with k drafts (C(0) = 1: plain decoding)."""
        if k == 0:
            return 1.0
        return self.verify[k] + self.draft[k - 1]


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """E(k): tokens committed per step with k drafts and conditional acceptance ``alphas``."""
    total, run = 1.0, 1.0
    for j in range(k):
        run *= alphas[j]
        total += run
    return total


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance a_j, estimated from generation statistics.

    Counts decay by ``decay`` per observation so that the estimate follows the current workload;
    a position never offered takes the estimate of the last position that was (acceptance rates
    change slowly along a block), and with no data at all every a_j is ``prior``."""

    n_positions: int
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.9
    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.offered = list(self.offered) or [0.0] * self.n_positions
        self.accepted = list(self.accepted) or [0.0] * self.n_positions

    def observe(self, n_steps: int, n_max: int, accepted_per_position: Sequence[int]) -> None:
        """Add one generation: ``n_steps`` verify steps drafting ``n_max`` tokens each, and the
        number of steps that accepted at least j drafts (the engine's ``accepted_per_position``)."""
        if n_steps <= 0 or n_max <= 0:
            return
        self.offered = [x * self.decay for x in self.offered]
        self.accepted = [x * self.decay for x in self.accepted]
        reached = n_steps  # steps whose drafts 1..j-1 were all accepted
        for j in range(min(n_max, self.n_positions)):
            acc = min(int(accepted_per_position[j]) if j < len(accepted_per_position) else 0, reached)
            self.offered[j] += reached
            self.accepted[j] += acc
            reached = acc

    def alphas(self) -> list[float]:
        out: list[float] = []
        last = self.prior
        for off, acc in zip(self.offered, self.accepted):
            if off > 0:
                last = (acc + self.prior * self.prior_weight) / (off + self.prior_weight)
            out.append(last)
        return out

    @property
    def n_observed(self) -> float:
        return self.offered[0] if self.offered else 0.0


class AutoTuner:
    """Picks n_max before each generation; learns acceptance from each finished one.

    While speculation is off (best k = 0) every ``probe_every``-th generation still drafts with
    the best k >= 1, so a change of workload (or a drafter that does better on new prompts) is
    noticed."""

    def __init__(self, costs: CostModel, acceptance: AcceptanceModel, *, max_n_max: int | None = None,
                 probe_every: int = 16, margin: float = 1.02) -> None:
        self.costs = costs
        self.acceptance = acceptance
        self.max_n_max = costs.max_drafts if max_n_max is None else min(max_n_max, costs.max_drafts)
        self.probe_every = probe_every
        self.margin = margin  # speculation must beat plain by this factor to be switched on
        self._calls = 0

    def speedups(self) -> list[float]:
        """S(k) for k = 0..max_n_max under the current acceptance estimate."""
        alphas = self.acceptance.alphas()
        return [expected_tokens(alphas, k) / self.costs.step_cost(k) for k in range(self.max_n_max + 1)]

    def best(self) -> int:
        s = self.speedups()
        k = max(range(1, len(s)), key=lambda i: s[i], default=0)
        return k if k and s[k] >= self.margin * s[0] else 0

    def choose(self) -> int:
        """n_max for the next generation (0: decode plainly)."""
        self._calls += 1
        k = self.best()
        if k == 0 and self.max_n_max >= 1 and (self.acceptance.n_observed == 0 or self._calls % self.probe_every == 0):
            s = self.speedups()
            k = max(range(1, len(s)), key=lambda i: s[i])
        return k

    def observe(self, n_max: int, stats) -> None:  # type: ignore[no-untyped-def]
        """Learn from a finished generation's ``Stats`` that ran with ``n_max`` drafts."""
        if n_max > 0:
            self.acceptance.observe(stats.n_verify_steps, n_max, stats.accepted_per_position)


# -- measuring -----------------------------------------------------------------------------------

def _best_ms(fns: Sequence, repeats: int) -> list[float]:  # type: ignore[type-arg]
    """Fastest of ``repeats`` timings of each function, measured round-robin so that a busy spell
    on a shared machine slows all of them alike; the minimum is the least noisy estimate of a
    fixed amount of work. Each timed call follows an untimed call of the same function: a batch
    of another shape than the call before rebuilds llama.cpp's graph, which the loop pays only
    when the width changes (timed right after a switch, SmolLM2's plain step came out at 15 ms
    against 8.5 ms in the loop, and every c(k) too low)."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            fn()
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1000.0)
    return best


def measure_costs(target, drafter, *, n_context: int = 256, repeats: int = 5, n_threads: int = 0) -> CostModel:  # type: ignore[no-untyped-def]
    """Time plain steps, verify batches and drafter blocks on this machine.

    Uses sequence 0 of ``target`` and ``drafter``'s context: both are cleared afterwards (a
    generation starts by clearing them anyway)."""
    block = drafter.info.block_size
    n_ctx = target.info.n_ctx
    n_context = max(8, min(n_context, n_ctx - 2 * block - 2))
    base = target.tokenize(_CALIBRATION_TEXT)
    prompt = (base * (n_context // len(base) + 1))[:n_context]
    probe = prompt[:block]
    n_taps = len(drafter.target_layers)
    try:
        target.rollback(0)
        drafter.crop(0)
        target.set_taps(drafter.target_layers)
        target.decode(prompt)
        drafter.inject_taps([target.tap_rows(i) for i in range(n_taps)], range(n_context))
        inject_rows = [target.tap_rows(i)[:2] for i in range(n_taps)]
        target.set_taps([])
        target.rollback(n_context)

        def plain_step() -> None:  # one row, last logits, no taps
            target.decode(probe[:1])
            target.rollback(n_context)

        def verify(r: int) -> None:  # r rows, all logits, taps on (as in the speculative loop)
            target.set_taps(drafter.target_layers)
            target.decode(probe[:r], all_logits=True)
            target.set_taps([])
            target.rollback(n_context)

        def draft(k: int) -> None:  # a block of k + 1 slots, then commit ~2 rows and drop them
            drafter.propose(probe[0], n_context, k + 1)
            drafter.inject_taps(inject_rows, [n_context, n_context + 1])
            drafter.crop(n_context)

        fns = [plain_step] + [lambda r=r: verify(r) for r in range(1, block + 1)] + \
              [lambda k=k: draft(k) for k in range(1, block)]
        for fn in fns:  # warm up every shape once
            fn()
        times = _best_ms(fns, repeats)
    finally:
        target.set_taps([])
        target.rollback(0)
        drafter.crop(0)
    step_ms, verify_ms, draft_ms = times[0], times[1: block + 1], times[block + 1:]
    return CostModel(t_step_ms=step_ms, verify=tuple(v / step_ms for v in nondecreasing(verify_ms)),
                     draft=tuple(d / step_ms for d in nondecreasing(draft_ms)), n_context=n_context,
                     n_threads=n_threads)


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): more rows
    never cost less, so a timing that says otherwise is noise and is averaged with its neighbours."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _file_key(path: str | os.PathLike | None) -> str:
    if path is None:
        return "-"
    st = os.stat(path)
    return f"{Path(path).resolve()}:{st.st_size}:{int(st.st_mtime)}"


def cached_costs(target, drafter, target_path, drafter_path, *, n_threads: int, refresh: bool = False) -> CostModel:  # type: ignore[no-untyped-def]
    """``measure_costs`` once per (files, threads, context size, devices, machine); later calls
    read the cache under ``<cache>/autotune/``. ``PYDFLASH_AUTOTUNE_CACHE=0`` disables the cache."""
    key_src = "|".join([str(_CACHE_VERSION), _file_key(target_path), _file_key(drafter_path), str(n_threads),
                        str(target.info.n_ctx), f"ngl={target.n_gpu_layers}",
                        f"draft-device={drafter.info.device}",
                        platform.machine(), platform.node(), str(os.cpu_count())])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    use_cache = os.environ.get("PYDFLASH_AUTOTUNE_CACHE", "1") != "0"
    path = models.cache_dir() / "autotune" / f"{key}.json"
    if use_cache and not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            return CostModel(t_step_ms=data["t_step_ms"], verify=tuple(data["verify"]), draft=tuple(data["draft"]),
                             n_context=data.get("n_context", 0), n_threads=data.get("n_threads", 0))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    costs = measure_costs(target, drafter, n_threads=n_threads)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(costs)))
        os.replace(tmp, path)
    return costs
