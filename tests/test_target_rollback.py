"""KV rollback: rolled-back rows leave no trace (regenerating gives the same tokens)."""

from __future__ import annotations

import numpy as np


def _greedy(target, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(np.argmax(target.logits()))
        out.append(tok)
        target.decode([tok])
    return out


def test_rollback_then_regenerate_is_identical(smollm2):
    prompt = smollm2.tokenize("The three primary colors are")
    smollm2.rollback(0)
    smollm2.decode(prompt)
    first = _greedy(smollm2, 24)
    seq = prompt + first
    assert smollm2.seq_pos_max() == len(seq) - 1  # every sampled token was decoded too

    p = len(prompt) + 9
    smollm2.rollback(p)
    assert smollm2.seq_pos_max() == p - 1
    # pollute the cache beyond p with a different continuation, then roll back again
    smollm2.decode([11, 12, 13, 14])
    smollm2.rollback(p)
    smollm2.decode([seq[p]])
    again = _greedy(smollm2, len(seq) - p - 1)
    assert again == seq[p + 1 :]


def test_logits_after_rollback_equal_fresh_prefill(smollm2):
    prompt = smollm2.tokenize("Once upon a time, in a small village,")
    smollm2.rollback(0)
    smollm2.decode(prompt)
    smollm2.decode([1, 2, 3, 4, 5, 6], all_logits=True)  # rows to be rejected
    smollm2.rollback(len(prompt))
    smollm2.decode([278])
    after_rollback = smollm2.logits()

    smollm2.rollback(0)
    smollm2.decode(prompt)
    smollm2.decode([278])
    fresh = smollm2.logits()
    np.testing.assert_allclose(after_rollback, fresh, rtol=1e-4, atol=1e-4)
