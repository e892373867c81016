"""The portable training checkpoint (``pydflash train --save-portable`` / ``--resume-from``): what a
training run commits so the next one continues (weights in bf16, draft vocabulary, step, log).

Reference: the trainer it was saved from (weights equal to bf16 rounding, the same draft vocabulary,
step and log), and refusals of a file of another kind or another drafter config.
"""

from __future__ import annotations

import pytest
import torch

from pydflash.reference import DFlashDrafter
from pydflash.train.pipeline import load_portable, save_portable
from pydflash.train.trainer import Trainer, TrainSettings

from fixtures_tiny import random_target
from test_train import full_attention_config, random_sequences


def test_portable_checkpoint_round_trip(tmp_path):
    cfg = full_attention_config()
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = random_sequences(cfg, 4, 20)
    settings = TrainSettings(steps=3, lr=1e-3, warmup=1, eval_every=3, seed=2, draft_vocab=48)
    trained = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, seqs[:1], settings, tmp_path / "a")
    trained.fit()
    path = save_portable(trained, tmp_path / "portable.pt")

    fresh = Trainer(DFlashDrafter.from_config(cfg, seed=7), target, seqs[1:], seqs[:1],
                    TrainSettings(**{**settings.__dict__, "steps": 5}), tmp_path / "b")
    assert load_portable(fresh, path) == 3
    assert fresh.step == 3 and fresh.history == trained.history
    assert torch.equal(fresh.draft_vocab, trained.draft_vocab)
    for (name, a), b in zip(trained.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).to(torch.float32), b), name
    fresh.fit()  # continues to the new step count
    assert fresh.step == 5

    other = Trainer(DFlashDrafter.from_config(full_attention_config(num_hidden_layers=1,
                                                                    layer_types=("full_attention",)), seed=0),
                    target, seqs, [], settings, tmp_path / "c")
    with pytest.raises(ValueError, match="another drafter config"):
        load_portable(other, path)
    torch.save({"step": 1}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a portable"):
        load_portable(fresh, tmp_path / "x.pt")
