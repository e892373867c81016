"""The training loop: random anchors over cached sequences, checkpoint / resume, logs.

One step draws ``seqs_per_step`` cached sequences and ``anchors_per_seq`` anchor positions in
each (uniformly over positions 1 .. n-2; the seeded generator's state is checkpointed, so an
interrupted run resumes bit for bit). The block of anchor s is ``[x_s, MASK, ...]`` and slot j
is labelled with the target's greedy token at s + j. On the prompt part of a sequence the
target's teacher-forced argmax is only its greedy chain while the prompt agrees with it, so a
slot counts only while every earlier token of the block equals the target's prediction.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..reference.config import DFlashConfig
from ..reference.model import DFlashDrafter, TargetWeights
from .features import CapturedSequence, decode_features
from .forward import check_trainable, forward_blocks
from .loss import drafter_loss, greedy_acceptance, lr_at, selector_loss, slot_weights

__all__ = ["TrainSettings", "Trainer", "Batch", "make_batch"]


@dataclass
class TrainSettings:
    steps: int = 2000
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    gamma: float = 4.0  # slot-weight decay exp(-(j-1)/gamma)
    selector_weight: float = 1.0
    max_len: int = 512  # context rows kept per sequence (the last max_len tokens)
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 100
    max_minutes: float | None = None


@dataclass
class Batch:
    features: torch.Tensor  # [S, n, L*H]
    block_tokens: torch.Tensor  # [S, A, B]
    anchors: torch.Tensor  # [S, A]
    labels: torch.Tensor  # [S, A, B-1]
    prev_tokens: torch.Tensor  # [S, A, B-1] true predecessor of each slot
    valid: torch.Tensor  # [S, A, B-1] bool


def _features(seq: CapturedSequence) -> np.ndarray:
    f = seq.features
    if isinstance(f, tuple):
        f = decode_features(*f)
    return f.reshape(f.shape[0], -1)


def make_batch(seqs: list[CapturedSequence], anchors: list[np.ndarray], block_size: int, mask_id: int) -> Batch:
    """Blocks for given anchors of given sequences (labels per the module docstring)."""
    n_ctx = max(len(s.tokens) for s in seqs)
    width = _features(seqs[0]).shape[1]
    feats = np.zeros((len(seqs), n_ctx, width), dtype=np.float32)
    a_max = len(anchors[0])
    blk = np.full((len(seqs), a_max, block_size), mask_id, dtype=np.int64)
    labels = np.zeros((len(seqs), a_max, block_size - 1), dtype=np.int64)
    prev = np.zeros_like(labels)
    valid = np.zeros(labels.shape, dtype=bool)
    for i, (seq, anc) in enumerate(zip(seqs, anchors)):
        f = _features(seq)
        feats[i, : len(f)] = f
        tokens, lab = seq.tokens.astype(np.int64), seq.labels.astype(np.int64)
        n = len(tokens)
        for a, s in enumerate(anc):
            blk[i, a, 0] = tokens[s]
            ok = True
            for j in range(1, block_size):
                p = s + j - 1  # the row whose argmax predicts position s + j
                if p >= n or not ok:
                    break
                labels[i, a, j - 1] = lab[p]
                prev[i, a, j - 1] = tokens[s] if j == 1 else tokens[p]
                valid[i, a, j - 1] = True
                # the next slot's label is the greedy chain only if token s+j is what the target says
                ok = p + 1 < n and tokens[p + 1] == lab[p]
    return Batch(torch.from_numpy(feats), torch.from_numpy(blk), torch.from_numpy(np.stack(anchors).astype(np.int64)),
                 torch.from_numpy(labels), torch.from_numpy(prev), torch.from_numpy(valid))


def _logits(model: DFlashDrafter, h: torch.Tensor, target: TargetWeights) -> torch.Tensor:
    """The drafter's logits of ``[N, B-1, H]`` hidden rows as one 2-D mat-mul (3-D inputs take a
    much slower batched path on CPU)."""
    return model.logits(h.reshape(-1, h.shape[-1]), target).view(*h.shape[:-1], -1)


def _crop(seq: CapturedSequence, max_len: int) -> CapturedSequence:
    """Keep the first ``max_len`` rows (positions stay absolute from 0)."""
    if len(seq.tokens) <= max_len:
        return seq
    f = seq.features
    f = (f[0][:max_len], f[1][:max_len]) if isinstance(f, tuple) else f[:max_len]
    return CapturedSequence(seq.id, seq.tokens[:max_len], min(seq.prompt_len, max_len), f, seq.labels[:max_len])


class Trainer:
    """Train ``model`` on cached sequences; checkpoints live in ``out_dir``.

    ``train_seqs`` / ``val_seqs`` are cached sequences (features may stay encoded); ``target``
    provides the frozen embedding rows and head.
    """

    def __init__(self, model: DFlashDrafter, target: TargetWeights, train_seqs: list[CapturedSequence],
                 val_seqs: list[CapturedSequence], settings: TrainSettings, out_dir: str | os.PathLike,
                 log: Callable[[str], None] | None = None) -> None:
        check_trainable(model)
        if model.config.mask_token_id is None:
            raise ValueError("the drafter config needs a mask_token_id")
        self.model, self.target, self.settings = model, target, settings
        self.train_seqs = [_crop(s, settings.max_len) for s in train_seqs if len(s.tokens) >= 3]
        self.val_seqs = [_crop(s, settings.max_len) for s in val_seqs if len(s.tokens) >= 3]
        if not self.train_seqs:
            raise ValueError("no training sequences (need at least 3 tokens each)")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                           betas=(0.9, 0.95))
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step = 0
        self.history: list[dict] = []
        self.weights = slot_weights(model.config.block_size, settings.gamma)
        self._val_batch: Batch | None = None

    # -- checkpoints --

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / "checkpoint.pt"

    def save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "config": self.model.config.to_hf(),
            "settings": asdict(self.settings),
            "history": self.history,
        }
        tmp = self.checkpoint_path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_path)
        return self.checkpoint_path

    def load_checkpoint(self) -> bool:
        """Resume from ``out_dir/checkpoint.pt`` if present; returns whether it did."""
        if not self.checkpoint_path.exists():
            return False
        state = torch.load(self.checkpoint_path, weights_only=False)
        if state["config"] != self.model.config.to_hf():
            raise ValueError(f"{self.checkpoint_path} was trained with another drafter config; "
                             "use a new --out directory")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self.history = list(state["history"])
        return True

    # -- steps --

    def sample_batch(self) -> Batch:
        st, cfg = self.settings, self.model.config
        idx = torch.randint(len(self.train_seqs), (st.seqs_per_step,), generator=self.generator).tolist()
        seqs = [self.train_seqs[i] for i in idx]
        anchors = []
        for s in seqs:
            hi = len(s.tokens) - 1  # anchors 1 .. n-2: at least one context row and one label
            anchors.append((1 + torch.randint(hi - 1, (st.anchors_per_seq,), generator=self.generator)).numpy())
        return make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id)

    def losses(self, batch: Batch):  # type: ignore[no-untyped-def]
        hidden, _ = forward_blocks(self.model, batch.features, batch.block_tokens, batch.anchors, self.target,
                                   with_logits=False)
        h = hidden[:, :, 1:].reshape(-1, hidden.shape[2] - 1, hidden.shape[3])
        logits = _logits(self.model, h, self.target)
        labels = batch.labels.reshape(h.shape[0], -1)
        valid = batch.valid.reshape(h.shape[0], -1)
        lm = drafter_loss(logits, labels, valid, self.weights)
        sel = torch.zeros(())
        if self.model.candidate_selector is not None:
            prev = batch.prev_tokens.reshape(h.shape[0], -1)
            sel = selector_loss(self.model.candidate_selector, h, logits, prev, labels, valid, self.weights)
        return lm, sel

    def train_step(self, batch: Batch | None = None) -> dict:
        st = self.settings
        batch = self.sample_batch() if batch is None else batch
        lr = lr_at(self.step, st.steps, st.lr, st.warmup)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        lm, sel = self.losses(batch)
        loss = lm + st.selector_weight * sel
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return {"step": self.step, "loss": float(loss.detach()), "drafter": float(lm.detach()), "selector": float(sel.detach()),
                "lr": lr}

    @torch.no_grad()
    def validate(self, max_blocks: int = 256) -> dict:
        """Teacher-forced greedy acceptance on held-out cached sequences.

        Fixed anchors on the *continuations* (where drafting happens at inference and the labels
        are exactly the target's greedy chain); a draft past the sequence end counts as rejected.
        """
        if not self.val_seqs:
            return {}
        if self._val_batch is None:
            gen = np.random.default_rng(1234)
            per = max(1, max_blocks // len(self.val_seqs))
            anchors = [np.sort(gen.integers(min(s.prompt_len, len(s.tokens) - 2), len(s.tokens) - 1, size=per))
                       for s in self.val_seqs]
            self._val_batch = make_batch(self.val_seqs, anchors, self.model.config.block_size,
                                         self.model.config.mask_token_id)
        b = self._val_batch
        self.model.eval()
        hidden, _ = forward_blocks(self.model, b.features, b.block_tokens, b.anchors, self.target, with_logits=False)
        h = hidden[:, :, 1:].reshape(-1, hidden.shape[2] - 1, hidden.shape[3])
        logits = _logits(self.model, h, self.target)
        labels, valid = b.labels.reshape(h.shape[0], -1), b.valid.reshape(h.shape[0], -1)
        accepted, per_slot = greedy_acceptance(self.model.candidate_selector, h, logits,
                                               b.block_tokens[:, :, 0].reshape(-1), labels, valid)
        n_blocks = accepted.shape[0]
        return {"val_tau": 1.0 + float(accepted.float().mean()),
                "val_accept_per_slot": [round(float(x) / n_blocks, 4) for x in per_slot],
                "val_loss": float(drafter_loss(logits, labels, valid, self.weights))}

    def fit(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Run until ``settings.steps`` (or ``max_minutes``), checkpointing and validating."""
        st = self.settings
        t0 = time.monotonic()
        start_step = self.step
        if self.step == 0 and self.val_seqs:
            rec = {"step": 0, **self.validate()}
            self.history.append(rec)
            self.log(json.dumps(rec))
        while self.step < st.steps:
            rec = self.train_step()
            elapsed = time.monotonic() - t0
            rec["s_per_step"] = elapsed / (self.step - start_step)
            done = self.step >= st.steps
            out_of_time = st.max_minutes is not None and elapsed > 60 * st.max_minutes
            if self.step % st.eval_every == 0 or done or out_of_time:
                rec.update(self.validate())
            self.history.append(rec)
            if on_step is not None:
                on_step(rec)
            if self.step % st.checkpoint_every == 0 or done or out_of_time:
                self.save_checkpoint()
            if "val_tau" in rec:
                self.log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}))
            if out_of_time:
                self.log(f"time budget of {st.max_minutes} min reached at step {self.step}")
                break
        return self.history
