"""The portable training checkpoint (``pydflash train --save-portable`` / ``--resume-from``): what a
training run commits so the next one continues (weights in bf16, draft vocabulary, step, log).

Reference: the trainer it was saved from (weights equal to bf16 rounding, the same draft vocabulary,
step and log), and refusals of a file of another kind or another drafter config.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydflash.reference import DFlashDrafter
from pydflash.train.pipeline import load_portable, save_portable
from pydflash.train.forward import forward_blocks
from pydflash.train.trainer import Trainer, TrainSettings, make_batch

from fixtures_tiny import random_target
from test_train import full_attention_config, random_sequences


def _saved_after_three_steps(cfg, tmp_path, *, warmup: int):  # type: ignore[no-untyped-def]
    """A drafter of ``cfg`` trained 3 steps and saved portable: (trainer, file, target, seqs, settings)."""
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = random_sequences(cfg, 4, 20)
    settings = TrainSettings(steps=3, lr=1e-3, warmup=warmup, eval_every=3, seed=2, draft_vocab=48)
    trained = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, seqs[:1], settings, tmp_path / "a")
    trained.fit()
    return trained, save_portable(trained, tmp_path / "portable.pt"), target, seqs, settings


def test_portable_checkpoint_round_trip(tmp_path):
    cfg = full_attention_config()
    trained, path, target, seqs, settings = _saved_after_three_steps(cfg, tmp_path, warmup=1)

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


def _one_layer_config():
    return full_attention_config(num_hidden_layers=1, layer_types=("full_attention",))


def test_a_grown_drafter_starts_as_the_trained_one_and_trains_its_new_layers(tmp_path):
    """--grow-from: the deeper drafter's blocks equal the shallow drafter's (the float64 reference
    forward of the saved bf16 weights), the schedule restarts, and the new layers start learning."""
    cfg = _one_layer_config()
    shallow, path, target, seqs, settings = _saved_after_three_steps(cfg, tmp_path, warmup=2)

    deep_cfg = full_attention_config(num_hidden_layers=3, layer_types=("full_attention",) * 3)
    deep = Trainer(DFlashDrafter.from_config(deep_cfg, seed=5), target, seqs, seqs[:1],
                   TrainSettings(**{**settings.__dict__, "steps": 6}), tmp_path / "b")
    with pytest.raises(ValueError, match="another drafter config"):
        load_portable(deep, path)  # a deeper config needs grow=True
    assert load_portable(deep, path, grow=True) == 3 and deep.schedule_start == 3
    assert torch.equal(deep.draft_vocab, shallow.draft_vocab)

    reference = DFlashDrafter.from_config(cfg, seed=9, dtype=torch.float64)
    reference.load_state_dict({k: v.to(torch.bfloat16).to(torch.float64) for k, v in shallow.model.state_dict().items()})
    grown = deep.model.double()
    batch = make_batch(seqs[:2], [np.array([3, 7, 12]), np.array([4, 9, 15])], cfg.block_size, cfg.mask_token_id)
    target64 = random_target(cfg.vocab_size, cfg.hidden_size, seed=1)
    want_h, want_z = forward_blocks(reference, batch.features.double(), batch.block_tokens, batch.anchors, target64)
    got_h, got_z = forward_blocks(grown, batch.features.double(), batch.block_tokens, batch.anchors, target64)
    torch.testing.assert_close(got_h, want_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_z, want_z, rtol=1e-12, atol=1e-12)

    deep.model.float()
    rec = deep.train_step()
    assert rec["lr"] == pytest.approx(settings.lr / settings.warmup)  # warm-up again, from the grown step
    for i in (1, 2):
        assert deep.model.layers[i].self_attn.o_proj.weight.abs().max() > 0
        assert deep.model.layers[i].mlp.down_proj.weight.abs().max() > 0
    deep.save_checkpoint()
    again = Trainer(DFlashDrafter.from_config(deep_cfg, seed=6), target, seqs, seqs[:1], deep.settings, tmp_path / "b")
    assert again.load_checkpoint() and again.schedule_start == 3 and again.step == 4

    with pytest.raises(ValueError, match="more layers"):
        load_portable(Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, [], settings, tmp_path / "c"),
                      deep_path := save_portable(deep, tmp_path / "deep.pt"), grow=True)
    assert deep_path.exists()


@pytest.mark.parametrize("argv, message", [
    (["--resume-from", "a.pt", "--grow-from", "b.pt"], "not both"),
    (["--new-schedule"], "restarts the schedule of a --resume-from run"),
    (["--grow-from", "b.pt", "--new-schedule"], "restarts the schedule of a --resume-from run"),
])
def test_pydflash_train_refuses_contradictory_start_options(argv, message, tmp_path, capsys):
    from pydflash.train.pipeline import main

    with pytest.raises(SystemExit) as e:
        main(["--target", "smollm2-135m", "--out", str(tmp_path / "run"), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
