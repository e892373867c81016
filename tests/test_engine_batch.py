"""Several sequences drafted and verified together in one target batch per step: each output is
still its target's own greedy continuation (checked against single-sequence plain decoding)."""

from __future__ import annotations

import pytest

import pydflash
from pydflash import Engine
from test_engine import drafter_path  # noqa: F401 - the module-scoped drafter fixture
from test_speculative_loop import _tie_aware_equal

PROMPTS = ["def add(a, b):", "The three laws of robotics are that a robot", "1, 2, 3,"]


@pytest.mark.parametrize("with_drafter", [True, False])
def test_batch_equals_single_sequence_greedy(smollm2_path, smollm2, drafter_path, with_drafter):  # noqa: F811
    with Engine(smollm2_path, drafter_path if with_drafter else None, n_ctx=1024, n_threads=2, n_seq_max=3,
                n_max=3) as engine:
        results = engine.generate_batch(PROMPTS, max_tokens=20, temperature=0)
    assert len(results) == 3
    for prompt, res in zip(PROMPTS, results):
        tokens = smollm2.tokenize(prompt)
        plain = smollm2.generate(tokens, max_tokens=20, temperature=0)
        _tie_aware_equal(smollm2, tokens, plain.tokens, res.tokens)
        assert res.text == smollm2.detokenize(res.tokens) or res.stats.stop_reason == "eos"
        if with_drafter:
            assert res.stats.n_drafted > 0


def test_batch_with_different_lengths_and_stops(smollm2_path, drafter_path):  # noqa: F811
    with Engine(smollm2_path, drafter_path, n_ctx=1024, n_threads=2, n_seq_max=2, n_max=3) as engine:
        a, b = engine.generate_batch(["Hi", "Write a long story about a dragon. Once upon a time"],
                                     max_tokens=12, temperature=0, stop=["\n"])
        single = engine.generate("Hi", max_tokens=12, temperature=0, stop=["\n"])
    assert a.tokens == single.tokens or a.text == single.text
    assert "\n" not in a.text and "\n" not in b.text
    assert a.stats.n_prompt != b.stats.n_prompt


def test_batch_larger_than_n_seq_max(smollm2_path):
    with Engine(smollm2_path, None, n_ctx=256, n_threads=2, n_seq_max=2) as engine:
        with pytest.raises(pydflash.InvalidArgumentError, match="n_seq_max"):
            engine.generate_batch(["a", "b", "c"], max_tokens=2)
        assert len(engine.generate_batch(["a", "b"], max_tokens=2, temperature=0)) == 2
