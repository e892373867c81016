"""Distillation targets from the cached taps (``LastLayerTeacher``) and the trainer's soft loss.

Reference: the native target's own logits (libllama, every row) for the same tokens: the
teacher's distribution, computed in torch from the tap entering the last layer (as the feature
cache stores it, float16-coded), must agree with it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydflash import Target
from pydflash.reference import DFlashDrafter, TargetWeights
from pydflash.train.features import CapturedSequence, decode_features, encode_features
from pydflash.train.teacher import LastLayerTeacher
from pydflash.train.trainer import Trainer, TrainSettings

from fixtures_tiny import smollm2_drafter_config

torch.set_num_threads(1)
TAPS = [1, 10, 19, 28]  # the default taps of SmolLM2's 30 layers: 28 enters the last layer
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def decoded(smollm2_path):
    """Tokens (prompt + 24 greedy ones), tap rows [n, L, H] as the cache stores them, native logits [n, V]."""
    with Target(smollm2_path, n_ctx=256, n_threads=2) as target:
        prompt = target.tokenize(PROMPT)
        tokens = list(prompt) + list(target.generate(prompt, max_tokens=24, temperature=0.0).tokens)
    with Target(smollm2_path, n_ctx=256, n_threads=2) as target:
        target.set_taps([t + 1 for t in TAPS])
        target.decode(tokens, all_logits=True)
        feats = np.stack([target.tap_rows(k) for k in range(len(TAPS))], axis=1)
        logits = np.stack([target.logits(r) for r in range(len(tokens))])
    return np.asarray(tokens), len(prompt), decode_features(*encode_features(feats)), logits


def test_teacher_reproduces_the_targets_distribution(decoded, smollm2_path):
    tokens, _, feats, native = decoded
    teacher = LastLayerTeacher(smollm2_path, TargetWeights.from_gguf(smollm2_path).lm_head)
    assert teacher.tap_layer == 28
    n = len(tokens)
    lp = teacher.log_probs(torch.from_numpy(feats[None, :, 3]), torch.arange(n), torch.zeros(n, dtype=torch.long))
    p_teacher = lp.exp().numpy()
    p_native = torch.softmax(torch.from_numpy(native).double(), -1).numpy()
    agree = (p_teacher.argmax(-1) == native.argmax(-1)).mean()
    total_variation = 0.5 * np.abs(p_teacher - p_native).sum(-1)
    assert agree >= 0.95, agree
    assert np.median(total_variation) < 0.03 and total_variation.max() < 0.15, total_variation

    # restricted to some rows of the vocabulary: the same logits, renormalized over those rows
    rows = torch.unique(torch.from_numpy(native.argsort(-1)[:, -50:].reshape(-1).copy()))
    sub = teacher.log_probs(torch.from_numpy(feats[None, :, 3]), torch.arange(n), torch.zeros(n, dtype=torch.long), rows)
    np.testing.assert_allclose(sub.numpy(), torch.log_softmax(lp[:, rows], -1).numpy(), atol=1e-4)


def test_soft_loss_trains_and_refuses_a_drafter_without_the_last_tap(decoded, smollm2_path, tmp_path):
    tokens, n_prompt, feats, native = decoded
    seq = CapturedSequence("s", tokens.astype(np.int32), n_prompt, feats, native.argmax(-1).astype(np.int32))
    target = TargetWeights.from_gguf(smollm2_path)
    teacher = LastLayerTeacher(smollm2_path, target.lm_head)
    cfg = smollm2_drafter_config(block_size=8, target_layer_ids=tuple(TAPS), mask_token_id=0)
    settings = TrainSettings(steps=30, lr=3e-3, warmup=1, seqs_per_step=1, anchors_per_seq=8, draft_vocab=0,
                             soft_weight=1.0, autocast="fp32")
    trainer = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, [seq], [], settings, tmp_path / "a",
                      teacher=teacher)
    batch = trainer.sample_batch()
    assert batch.features.shape[1] == int(batch.anchors.max()) + 7  # the label rows too (past the end: zeros)
    with torch.no_grad():
        before = float(trainer.losses(batch)[0])
    for _ in range(30):
        trainer.train_step(batch)
    with torch.no_grad():
        after = float(trainer.losses(batch)[0])
    assert after < 0.7 * before, (before, after)

    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="within"):
            Trainer(DFlashDrafter.from_config(cfg, seed=0), target, [seq], [],
                    TrainSettings(soft_weight=bad, draft_vocab=0), tmp_path / "w", teacher=teacher)
    with pytest.raises(ValueError, match="needs a teacher"):
        Trainer(DFlashDrafter.from_config(cfg, seed=0), target, [seq], [], settings, tmp_path / "b")
    cfg3 = smollm2_drafter_config(block_size=8, target_layer_ids=(1, 10, 19), mask_token_id=0)
    seq3 = CapturedSequence("s", seq.tokens, n_prompt, feats[:, :3], seq.labels)
    with pytest.raises(ValueError, match="does not tap"):
        Trainer(DFlashDrafter.from_config(cfg3, seed=0), target, [seq3], [], settings, tmp_path / "c", teacher=teacher)
