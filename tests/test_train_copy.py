"""The copy-head loss (``pydflash train --copy-weight``): one attention head is taught to look at the
earlier context rows holding the anchor's token.

References: a plain Python loop over the tokens (which rows hold the anchor's token), the reference
drafter's own float64 attention (the probed weights), and -log of a hand-summed mass (the loss).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydflash.reference import DFlashDrafter
from pydflash.train.features import CapturedSequence
from pydflash.train.forward import forward_blocks
from pydflash.train.loss import copy_loss
from pydflash.train.trainer import Trainer, TrainSettings, make_batch

from fixtures_tiny import random_target
from test_train import full_attention_config as _config

torch.set_num_threads(1)


def _repeating_sequences(cfg, n_seqs: int, length: int, seed: int = 0) -> list[CapturedSequence]:
    """Tokens from a small alphabet, so most anchors have earlier rows holding their token."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_seqs):
        tokens = rng.integers(0, 6, size=length + 1).astype(np.int32)
        feats = rng.standard_normal((length, cfg.num_taps, cfg.hidden_size)).astype(np.float32)
        out.append(CapturedSequence(f"s{i}", tokens[:-1], 3, feats, tokens[1:]))
    return out


def test_copy_rows_are_the_earlier_rows_holding_the_anchor_token():
    cfg = _config()
    seqs = _repeating_sequences(cfg, 2, 20)
    anchors = [np.array([1, 6, 17]), np.array([3, 4, 12])]
    b = make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id)
    assert b.copy_rows.shape == (2, 3, 17)
    for i, seq in enumerate(seqs):
        for a, s in enumerate(anchors[i]):
            want = [j < s and seq.tokens[j] == seq.tokens[s] for j in range(17)]
            assert b.copy_rows[i, a].tolist() == want


def test_copy_rows_with_a_longer_match_keep_the_longest_one():
    cfg = _config()
    seqs = _repeating_sequences(cfg, 3, 30, seed=4)
    anchors = [np.arange(0, 29)] * 3
    b = make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id, copy_match=3)
    succ = make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id, copy_match=3, copy_successor=True)
    longer = 0
    for i, seq in enumerate(seqs):
        t = seq.tokens.tolist()
        for a, s in enumerate(anchors[i]):
            def ends_match(j, k):  # the k tokens ending at j equal the k ending at s
                return j - k + 1 >= 0 and s - k + 1 >= 0 and t[j - k + 1:j + 1] == t[s - k + 1:s + 1]
            best = max([k for k in (1, 2, 3) if any(ends_match(j, k) for j in range(s))], default=1)
            longer += best > 1
            want = [j < s and ends_match(j, best) for j in range(b.copy_rows.shape[-1])]
            assert b.copy_rows[i, a].tolist() == want, (i, s)
            # successor rows: the row after each match, if the block can still see it
            want_succ = [0 < j < s and want[j - 1] for j in range(len(want))]
            assert succ.copy_rows[i, a].tolist() == want_succ, (i, s)
    assert longer >= 20  # the case is exercised


def test_probe_is_the_reference_attention_of_slot_1(monkeypatch):
    cfg = _config()
    model = DFlashDrafter.from_config(cfg, seed=1, dtype=torch.float64)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=2)
    seqs = _repeating_sequences(cfg, 2, 16, seed=3)
    anchors = [np.array([2, 9, 14]), np.array([5, 7, 11])]
    b = make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    both: list[torch.Tensor] = []
    with torch.no_grad():
        forward_blocks(model, b.features.double(), b.block_tokens, b.anchors, target, probe=((0, rep + 1), both))
    assert len(both) == 2
    for k, head in enumerate((0, rep + 1)):  # a head of the first and of the second KV group
        out: list[torch.Tensor] = []
        with torch.no_grad():
            forward_blocks(model, b.features.double(), b.block_tokens, b.anchors, target, probe=(head, out))
        (probs,) = out
        torch.testing.assert_close(both[k], probs, rtol=0, atol=0)
        n = int(b.anchors.max())
        assert probs.shape == (2, 3, n)
        seen: list[torch.Tensor] = []
        softmax = torch.softmax
        monkeypatch.setattr(torch, "softmax", lambda x, dim=-1, **kw: seen.append(softmax(x, dim=dim, **kw)) or seen[-1])
        for i, seq in enumerate(seqs):
            feats = seq.features.reshape(len(seq.tokens), -1).astype(np.float64)
            for a, s in enumerate(anchors[i]):
                seen.clear()
                model.forward(feats[:s], np.arange(s), b.block_tokens[i, a], int(s), target)
                want = seen[-1][head, 1, :s]  # the last layer's [heads, block rows, context + block]
                torch.testing.assert_close(probs[i, a, :s], want, rtol=1e-10, atol=1e-12)
                assert float(probs[i, a, s:].abs().sum()) == 0.0  # rows at or past the anchor
        monkeypatch.setattr(torch, "softmax", softmax)


def test_copy_loss_is_minus_log_of_the_mass_on_the_rows():
    probs = torch.tensor([[[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]], [[0.6, 0.4, 0.0], [0.25, 0.25, 0.5]]])
    rows = torch.tensor([[[True, False, True], [False, False, False]], [[False, True, False], [True, True, False]]])
    counted = torch.tensor([[True, True], [True, False]])
    # block (0, 1) has no such row and block (1, 1) is not counted: two blocks remain
    want = -(np.log(0.8) + np.log(0.4)) / 2
    assert float(copy_loss(probs, rows, counted)) == pytest.approx(want, rel=1e-6)
    assert float(copy_loss(probs, rows & False, counted)) == 0.0


def test_training_with_the_copy_loss_moves_the_head_onto_the_rows(tmp_path):
    cfg = _config(final_logit_softcapping=None)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = _repeating_sequences(cfg, 4, 24)
    masses = {}
    for weight in (0.0, 1.0):
        model = DFlashDrafter.from_config(cfg, seed=0)
        tr = Trainer(model, target, seqs, [], TrainSettings(steps=30, lr=3e-3, warmup=1, copy_weight=weight,
                                                            copy_heads=(2,), draft_vocab=0), tmp_path / str(weight))
        batch = tr.sample_batch()
        for _ in range(30):
            tr.train_step(batch)
        out: list[torch.Tensor] = []
        with torch.no_grad():
            forward_blocks(model, batch.features, batch.block_tokens, batch.anchors, target, probe=(2, out))
        has = batch.copy_rows.any(-1)
        masses[weight] = float((out[0] * batch.copy_rows).sum(-1)[has].mean())
    assert masses[1.0] > 0.9 and masses[1.0] > masses[0.0] + 0.2, masses


@pytest.mark.parametrize("argv, message", [
    (["--copy-weight", "-1"], "--copy-weight must be >= 0"),
    (["--repeat-keep", "1.5"], "--repeat-keep must be within [0, 1]"),
    (["--repeat-keep", "nan"], "--repeat-keep must be within [0, 1]"),
    (["--repeat-ngram", "0"], "--repeat-ngram must be >= 1"),
    (["--copy-head", "9", "--no-capture"], "--copy-head must name distinct heads within [0, 9)"),
    (["--copy-head", "1,1", "--no-capture"], "--copy-head must name distinct heads within [0, 9)"),
    (["--copy-head", "one", "--no-capture"], "--copy-head takes comma-separated head numbers"),
])
def test_pydflash_train_refuses_bad_copy_options(argv, message, tmp_path, capsys):
    from pydflash.train.pipeline import main

    with pytest.raises(SystemExit) as e:
        main(["--target", "smollm2-135m", "--out", str(tmp_path / "run"), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
