"""The native DFlash2 drafter inside the speculative loop: output is the target's own.

A random drafter is almost always rejected, which makes every step exercise drafting, batched
verification, rollback in both caches and context injection of the committed rows; losslessness
must hold regardless. (Acceptance-heavy paths are pinned by the replay-drafter tests.)
"""

from __future__ import annotations

import pytest

import pydflash
from pydflash import Engine
from pydflash.formats.convert import convert
from fixtures_tiny import smollm2_drafter_config, write_checkpoint
from test_speculative_loop import CHI2_CRIT_001, _chi2, _tie_aware_equal


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("engine")
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=8), seed=3)
    return convert(tmp / "hf", tmp / "drafter.gguf", target_gguf=smollm2_path, outtype="f32", progress=False)


@pytest.fixture(scope="module")
def engine(smollm2_path, drafter_path):
    with Engine(smollm2_path, drafter_path, n_ctx=1024, n_threads=2, n_max=7) as e:
        yield e


@pytest.mark.parametrize("n_max", [1, 3, 7])
def test_greedy_speculative_equals_plain(engine, n_max):
    for prompt in ("def add(a, b):", "The three laws of robotics are"):
        tokens = engine.target.tokenize(prompt)
        plain = engine.target.generate(tokens, max_tokens=24, temperature=0, ignore_eos=True)
        spec = engine.generate(tokens, n_max=n_max, max_tokens=24, temperature=0, ignore_eos=True)
        _tie_aware_equal(engine.target, tokens, plain.tokens, spec.tokens)
        st = spec.stats
        assert st.n_drafted > 0 and st.n_verify_steps >= 1
        assert st.n_drafted <= n_max * st.n_verify_steps


def test_sampled_speculative_preserves_the_distribution(engine):
    """The drafter's own q (spread over its top-K candidates) goes through exact rejection."""
    import numpy as np

    opts = dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, ignore_eos=True)
    tokens = engine.target.tokenize("1, 2, 3, 4, 5, 6,")
    first = engine.target.generate(tokens, max_tokens=1, temperature=0).tokens[0]
    engine.target.rollback(0)
    engine.target.decode(tokens + [first])
    logits = engine.target.logits().astype(np.float64)
    top = np.argsort(-logits, kind="stable")[:6]
    w = np.exp(logits[top] - logits[top].max())
    exact = {int(t): float(x) for t, x in zip(top, w / w.sum())}
    counts: dict[int, int] = {}
    for seed in range(300):
        out = engine.generate(tokens, n_max=3, max_tokens=2, seed=seed, **opts).tokens
        if out[0] == first:
            counts[out[1]] = counts.get(out[1], 0) + 1
    assert sum(counts.values()) > 150
    stat, df = _chi2(counts, exact)
    assert stat < CHI2_CRIT_001[df], (stat, df, counts, exact)


def test_plain_engine_equals_target(smollm2_path, smollm2):
    with Engine(smollm2_path, None, n_ctx=1024, n_threads=2) as e:
        a = e.generate("Once upon a time", max_tokens=16, temperature=0)
    b = smollm2.generate("Once upon a time", max_tokens=16, temperature=0)
    assert a.tokens == b.tokens and a.stats.n_drafted == 0


def test_stream_and_stop_with_drafter(engine):
    ref = engine.generate("Count: one, two, three,", max_tokens=20, temperature=0, ignore_eos=True)
    pieces = list(engine.stream("Count: one, two, three,", max_tokens=20, temperature=0, ignore_eos=True))
    assert "".join(pieces) == ref.text
    stop = ref.text[5:8]
    cut = engine.generate("Count: one, two, three,", max_tokens=20, temperature=0, stop=[stop], ignore_eos=True)
    assert cut.text == ref.text[: ref.text.index(stop)]


def test_mismatched_drafter_and_target(drafter_path, qwen05_path):
    with pytest.raises(pydflash.MismatchError):
        Engine(qwen05_path, drafter_path, n_ctx=256)


def test_bad_spec_arguments_leave_engine_usable(engine):
    with pytest.raises(pydflash.InvalidArgumentError):
        engine.generate("Hi", n_max=-1, max_tokens=2)
    with pytest.raises(pydflash.InvalidArgumentError):
        engine.generate("Hi", n_max=2, n_min=5, max_tokens=2)
    assert engine.generate("Hi", max_tokens=3, temperature=0).stats.n_generated == 3


def test_n_max_past_the_block_takes_n_min_along(smollm2_path, drafter_path):
    """n_max beyond what the drafter can draft (block - 1) means all of it, and an n_min that was
    valid for the asked n_max follows it down (llama-server's --spec-draft-n-min 8 -n-max 16)."""
    with Engine(smollm2_path, drafter_path, n_ctx=256, n_threads=2, n_max=64, n_min=40) as e:
        block = e.drafter.info.block_size
        assert (e.n_max, e.n_min) == (block - 1, block - 1)
        assert e.spec_overrides(99, 50, None) == {"n_max": block - 1, "n_min": block - 1}
        r = e.generate("def add(a, b):", max_tokens=8, temperature=0, ignore_eos=True, n_max=99, n_min=50)
        assert r.stats.n_generated == 8
        with pytest.raises(pydflash.InvalidArgumentError):  # n_min past the asked n_max stays an error
            e.generate("Hi", n_max=99, n_min=100, max_tokens=2)


def test_p_min_cuts_unsure_drafts_and_stays_lossless(smollm2_path, drafter_path):
    """A random drafter is never sure of its picks: p_min = 0.99 cuts every draft to nothing."""
    # lookup=0: drafts from the history carry no drafter probability, so p_min never cuts them
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, n_max=7, p_min=0.99, lookup=0) as e:
        r = e.generate("def add(a, b):", max_tokens=12, temperature=0, ignore_eos=True)
        plain = e.target.generate("def add(a, b):", max_tokens=12, temperature=0, ignore_eos=True)
    assert r.stats.n_drafted == 0 and r.tokens == plain.tokens
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, n_max=7, p_min=0.0) as e:
        assert e.generate("def add(a, b):", max_tokens=12, temperature=0, ignore_eos=True).stats.n_drafted > 0
    with pytest.raises(pydflash.InvalidArgumentError):
        Engine(smollm2_path, drafter_path, n_ctx=512, p_min=1.5)
