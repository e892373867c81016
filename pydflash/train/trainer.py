"""The training loop: random anchors over cached sequences, checkpoint / resume, logs.

One step draws ``seqs_per_step`` cached sequences and ``anchors_per_seq`` anchor positions in
each, on the *continuation* (positions prompt_len-1 .. n-2: where the engine drafts; the seeded
generator's state is checkpointed, so an interrupted run resumes bit for bit). The block of
anchor s is ``[x_s, MASK, ...]`` and slot j is labelled with the target's greedy token for
position s + j, ``labels[s + j - 1]``. A slot counts only while its label is known (>= 0: caches
label prompt rows -1 except the last) and every earlier token of the block equals the target's
prediction (on a sampled continuation, or the prompt of an old cache, the teacher-forced argmax
is the greedy chain only while the text agrees with it).

Draft vocabulary (``TrainSettings.draft_vocab`` = N > 0): the drafter loss is the softmax over the
N head rows the exported drafter keeps (its ``d2t``), chosen from the training labels'
frequencies (plus end-of-generation ids), stored in the checkpoint and exported with
:func:`export_draft_vocab`. The head is applied to the counted slots only (gathered rows).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..reference.config import DFlashConfig
from ..reference.model import DFlashDrafter, TargetWeights
from .features import CapturedSequence, decode_features
from .forward import check_trainable, forward_blocks
from .loss import copy_loss, drafter_loss, greedy_acceptance, lr_at, selector_loss, slot_weights
from .teacher import LastLayerTeacher

__all__ = ["TrainSettings", "Trainer", "Batch", "make_batch", "choose_draft_vocab", "export_draft_vocab",
           "cpu_has_fast_bf16"]

COVERAGE_AT = (2048, 4096, 8192, 16384, 32768)


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
    # draft vocabulary size N (0 or >= the target's vocabulary = the full head); coverage: benchmarks/results/train-throughput/
    draft_vocab: int = 8192
    # "auto": bf16 autocast iff the CPU has native bf16 math (AVX512-BF16 / AMX), else float32;
    # "bf16" / "fp32" force it (measured: benchmarks/results/train-throughput/)
    autocast: str = "auto"
    # weight of the distillation term (cross-entropy to the target's own distribution over the
    # draft vocabulary, from LastLayerTeacher); 0 = hard greedy labels only
    soft_weight: float = 0.0
    # weight of the copy-head attention supervision (loss.copy_loss, averaged over the heads) and
    # the query heads it trains (of the last layer); 0 = off
    copy_weight: float = 0.0
    copy_heads: tuple[int, ...] = (1,)
    copy_match: int = 1  # rows to look at: those ending the longest match (up to this many tokens) of the anchor's suffix
    copy_successor: bool = False  # look at the row after each match instead (it holds the token that followed)
    # anchors whose last repeat_ngram tokens already occurred earlier in the sequence (the text loops:
    # the history lookup drafts it) are drawn with this weight against 1 for the others; a small
    # target's greedy captures loop far more than its answers to real prompts (README of
    # benchmarks/results/drafter-training/smollm2-135m, session 17). 1 = uniform anchors
    repeat_keep: float = 1.0
    repeat_ngram: int = 16


@dataclass
class Batch:
    features: torch.Tensor  # [S, n, L*H]
    block_tokens: torch.Tensor  # [S, A, B]
    anchors: torch.Tensor  # [S, A]
    labels: torch.Tensor  # [S, A, B-1]
    prev_tokens: torch.Tensor  # [S, A, B-1] true predecessor of each slot
    valid: torch.Tensor  # [S, A, B-1] bool
    copy_rows: torch.Tensor  # [S, A, n] bool: the context rows the copy loss points at (_copy_rows; n = max anchor)


def _features(seq: CapturedSequence, rows: int | None = None) -> np.ndarray:
    """The first ``rows`` feature rows (all by default) as float32 ``[rows, L*H]``."""
    f = seq.features
    if isinstance(f, tuple):
        f = decode_features(f[0][:rows], f[1][:rows])
    else:
        f = f[:rows]
    return f.reshape(f.shape[0], -1)


def make_batch(seqs: list[CapturedSequence], anchors: list[np.ndarray], block_size: int, mask_id: int,
               label_rows: bool = False, copy_match: int = 1, copy_successor: bool = False) -> Batch:
    """Blocks for given anchors of given sequences (labels per the module docstring).

    Features are decoded only for the rows a block can see (below the largest anchor), or with
    ``label_rows`` also for the rows its slots are labelled at (the distillation teacher's input)."""
    anc = np.stack([np.asarray(a, dtype=np.int64) for a in anchors])  # [S, A]
    n_seq = len(seqs)
    n_max = max(len(s.tokens) for s in seqs)
    n_feat = max(1, int(anc.max()) + (block_size - 1 if label_rows else 0))
    f0 = seqs[0].features
    width = int(np.prod((f0[0] if isinstance(f0, tuple) else f0).shape[1:]))
    feats = np.zeros((n_seq, n_feat, width), dtype=np.float32)
    # tokens / labels padded past the end: -2 never equals a label, -1 is "no label"
    tok = np.full((n_seq, n_max + block_size), -2, dtype=np.int64)
    lab = np.full((n_seq, n_max + block_size), -1, dtype=np.int64)
    for i, seq in enumerate(seqs):
        n = len(seq.tokens)
        tok[i, :n], lab[i, :n] = seq.tokens, seq.labels
        f = _features(seq, min(n, n_feat))
        feats[i, : len(f)] = f
    rows = np.arange(n_seq)[:, None, None]
    pos = anc[:, :, None] + np.arange(block_size - 1)[None, None, :]  # slot j's label row s + j - 1
    lab_p, tok_p = lab[rows, pos], tok[rows, pos]
    # slot j+1's label is the greedy chain only if token s+j is what the target said at row s+j-1
    chain = lab_p == tok[rows, pos + 1]
    before = np.cumprod(np.concatenate([np.ones_like(chain[..., :1]), chain[..., :-1]], axis=-1), axis=-1)
    valid = (lab_p >= 0) & before.astype(bool)
    blk = np.full((n_seq, anc.shape[1], block_size), mask_id, dtype=np.int64)
    blk[..., 0] = tok[rows[..., 0], anc]
    copy_rows = _copy_rows(tok, anc, copy_match, copy_successor)
    return Batch(torch.from_numpy(feats), torch.from_numpy(blk), torch.from_numpy(anc),
                 torch.from_numpy(np.where(valid, lab_p, 0)), torch.from_numpy(np.where(valid, tok_p, 0)),
                 torch.from_numpy(valid), torch.from_numpy(copy_rows))


def _copy_rows(tok: np.ndarray, anc: np.ndarray, match: int, successor: bool = False) -> np.ndarray:
    """[S, A, n] (n = the context rows ``forward_blocks`` reads): the rows j < s that end the
    longest match, up to ``match`` tokens, of the tokens ending at anchor s (j's token is s's,
    j-1's is s-1's, ...); all rows holding s's token when no longer match exists. ``successor``:
    the rows j + 1 instead (those still below s), whose own token is the one that followed the
    match: the target's early taps carry a row's own token almost as its embedding, which a head
    started from tied embedding rows reads more directly than row j's prediction of it."""
    n_ctx = max(1, int(anc.max()))
    rows_ = np.arange(tok.shape[0])[:, None, None]
    j = np.arange(n_ctx)[None, None, :]
    best = np.zeros((*anc.shape, n_ctx), dtype=bool)
    same = j < anc[:, :, None]
    for k in range(match):  # same: the k + 1 tokens ending at j equal those ending at s
        back = j - k
        same = same & (back >= 0) & (anc[:, :, None] - k >= 0)
        same = same & (tok[rows_, np.maximum(back, 0)] == tok[rows_[..., 0], np.maximum(anc - k, 0)][..., None])
        found = same.any(-1, keepdims=True)
        best = np.where(found, same, best)
    if successor:
        best = np.concatenate([np.zeros_like(best[..., :1]), best[..., :-1]], axis=-1)
        best &= j < anc[:, :, None]
    return best


def _copy_mass(probs: torch.Tensor, b: Batch) -> float:
    has = b.copy_rows.any(-1) & b.valid[:, :, 0]
    return round(float((probs.float() * b.copy_rows).sum(-1)[has].mean()), 4) if bool(has.any()) else 0.0


def repeated_anchors(tokens: np.ndarray, lo: int, hi: int, n: int) -> np.ndarray:
    """For anchors s = lo .. hi: whether tokens[s-n+1 .. s] also end at an earlier row r < s."""
    t = np.ascontiguousarray(tokens, dtype=np.int64)
    seen: set[bytes] = set()
    out = np.zeros(max(0, hi - lo + 1), dtype=bool)
    for s in range(n - 1, hi + 1):
        key = t[s - n + 1:s + 1].tobytes()
        if s >= lo and key in seen:
            out[s - lo] = True
        seen.add(key)
    return out


def _anchor_range(seq: CapturedSequence) -> tuple[int, int]:
    """Anchors s = lo .. hi: on the continuation (slot 1's label, row s, is the target's first
    continuation argmax at s = prompt_len - 1), with at least one context row and one label."""
    return max(1, seq.prompt_len - 1), len(seq.tokens) - 2


def choose_draft_vocab(seqs: list[CapturedSequence], n_vocab: int, n: int, *, always: Sequence[int] = (),
                       held_out: list[CapturedSequence] | None = None) -> tuple[np.ndarray, dict]:
    """The ``n`` target ids (ascending) the drafter's softmax keeps: ``always`` (end-of-generation
    ids), then by descending frequency among the training labels on the continuations, then by
    prompt-token frequency, then by id (``pydflash.formats.draft_vocab.choose``). Returns the ids and a
    report: the share of training labels each vocabulary size covers, and of ``held_out`` labels
    the chosen vocabulary covers (an out-of-sample estimate of what the drafter can draft)."""
    from ..formats.draft_vocab import TokenCounts, choose, coverage

    def count(group: list[CapturedSequence]) -> tuple[np.ndarray, np.ndarray]:
        out = np.zeros(n_vocab, dtype=np.int64)
        fed = np.zeros(n_vocab, dtype=np.int64)
        for s in group:
            lo = max(0, s.prompt_len - 1)
            lab = np.asarray(s.labels[lo:], dtype=np.int64)
            out += np.bincount(lab[(lab >= 0) & (lab < n_vocab)], minlength=n_vocab)
            tok = np.asarray(s.tokens[:lo], dtype=np.int64)
            fed += np.bincount(tok[(tok >= 0) & (tok < n_vocab)], minlength=n_vocab)
        return out, fed

    out, fed = count(seqs)
    counts = TokenCounts(output=out, prompt=fed, n_prompts=len(seqs))
    ids = choose(counts, n, always=always)
    report = {"n": int(n), "train_labels": counts.n_output, "distinct_train_labels": int(np.count_nonzero(out)),
              "train_coverage": {str(k): round(v, 4) for k, v in coverage(counts, sorted({*COVERAGE_AT, n})).items()
                                 if k <= n_vocab}}
    if held_out:
        ho, _ = count(held_out)
        if ho.sum():
            report["held_out_coverage"] = round(float(ho[ids].sum() / ho.sum()), 4)
    return ids, report


def export_draft_vocab(files: Sequence[str | os.PathLike], target_gguf: str | os.PathLike, ids: np.ndarray,
                       report: dict | None = None, store_head: bool = True) -> list[Path]:
    """Rewrite each exported full-vocabulary drafter GGUF in place as its reduced-vocabulary form
    (``d2t`` = ``ids``, own ``output.weight`` = those rows of the target's head:
    ``pydflash.formats.draft_vocab.write_reduced_drafter``), the vocabulary the drafter was trained with."""
    from ..formats.draft_vocab import write_reduced_drafter

    extra: dict[str, float | str] = {"pydflash.draft_vocab.calibration": "training labels (pydflash train)"}
    cover = (report or {}).get("held_out_coverage")
    if cover is not None:
        extra["pydflash.draft_vocab.coverage"] = float(cover)
    out = []
    for f in files:
        f = Path(f)
        tmp = f.with_name(f.stem + ".d2t.gguf")
        write_reduced_drafter(f, tmp, target_gguf, ids, extra_metadata=extra, store_head=store_head)
        os.replace(tmp, f)
        out.append(f)
    return out


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX-BF16; arm64 BF16): only
    then is bf16 autocast faster than float32 (without it torch converts and is slower)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


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
    provides the frozen embedding rows and head; ``eog_ids`` (the target's end-of-generation
    tokens) are always in the draft vocabulary.
    """

    def __init__(self, model: DFlashDrafter, target: TargetWeights, train_seqs: list[CapturedSequence],
                 val_seqs: list[CapturedSequence], settings: TrainSettings, out_dir: str | os.PathLike,
                 log: Callable[[str], None] | None = None, eog_ids: Sequence[int] = (),
                 teacher: LastLayerTeacher | None = None) -> None:
        check_trainable(model)
        if model.config.mask_token_id is None:
            raise ValueError("the drafter config needs a mask_token_id")
        if settings.autocast not in ("auto", "bf16", "fp32"):
            raise ValueError(f"autocast must be auto, bf16 or fp32, got {settings.autocast!r}")
        n_vocab = model.config.vocab_size
        if settings.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0 or >= the vocabulary: the full head), got {settings.draft_vocab}")
        self.model, self.target, self.settings = model, target, settings
        self.teacher, self.teacher_tap = teacher, -1
        if not 0.0 <= settings.soft_weight <= 1.0:
            raise ValueError(f"soft_weight must be within [0, 1], got {settings.soft_weight}")
        if settings.soft_weight > 0:
            if teacher is None:
                raise ValueError("soft_weight > 0 needs a teacher (LastLayerTeacher of the target)")
            if teacher.tap_layer not in model.config.target_layer_ids:
                raise ValueError(f"distillation reads tap {teacher.tap_layer} (the target's last layer input), "
                                 f"which the drafter does not tap ({list(model.config.target_layer_ids)})")
            self.teacher_tap = list(model.config.target_layer_ids).index(teacher.tap_layer)

        def usable(s: CapturedSequence) -> bool:
            lo, hi = _anchor_range(s)
            return hi >= lo  # a sequence whose continuation is empty gives no anchor

        self.train_seqs = [c for c in (_crop(s, settings.max_len) for s in train_seqs) if usable(c)]
        self.val_seqs = [c for c in (_crop(s, settings.max_len) for s in val_seqs) if usable(c)]
        if not self.train_seqs:
            raise ValueError("no training sequences (each needs a continuation and at least 3 tokens)")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        # fused: one pass over each parameter (the full-vocabulary codebooks make the optimizer ~10 % of a step)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                           betas=(0.9, 0.95), fused=True)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.step = 0
        self.schedule_start = 0  # the step where the learning-rate schedule began (--grow-from / --new-schedule restart it)
        self.history: list[dict] = []
        self._weights_cache: dict[int, torch.Tensor] = {}
        self.weights = slot_weights(model.config.block_size, settings.gamma)
        self._val_batch: Batch | None = None
        # "auto" autocasts float32 training only: a float64 model (the reference checks) stays exact,
        # and bf16 autocast inside it would hand float32 activations to float64 layers
        float32_model = next(model.parameters()).dtype == torch.float32
        self.bf16 = settings.autocast == "bf16" or (settings.autocast == "auto" and float32_model and cpu_has_fast_bf16())
        self.draft_vocab_report: dict = {}
        ids = None
        if 0 < settings.draft_vocab < n_vocab:
            ids, self.draft_vocab_report = choose_draft_vocab(self.train_seqs, n_vocab, settings.draft_vocab,
                                                              always=eog_ids, held_out=self.val_seqs)
        self._set_draft_vocab(ids)

    def _set_draft_vocab(self, ids: np.ndarray | torch.Tensor | None) -> None:
        """Use the target ids ``ids`` (ascending) as the softmax's rows (None: the full head)."""
        if ids is None:
            self.draft_vocab, self.head, self.to_draft = None, self.target, None
            return
        ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
        self.draft_vocab = ids_t
        self.head = TargetWeights(self.target.embed_tokens, self.target.lm_head[ids_t].contiguous())
        self.to_draft = torch.full((self.model.config.vocab_size,), -1, dtype=torch.int64)
        self.to_draft[ids_t] = torch.arange(len(ids_t))

    # -- checkpoints --

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / "checkpoint.pt"

    def save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "schedule_start": self.schedule_start,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "config": self.model.config.to_hf(),
            "settings": asdict(self.settings),
            "history": self.history,
            "draft_vocab": None if self.draft_vocab is None else self.draft_vocab.clone(),
            "draft_vocab_report": self.draft_vocab_report,
        }
        tmp = self.checkpoint_path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_path)
        return self.checkpoint_path

    def load_checkpoint(self) -> bool:
        """Resume from ``out_dir/checkpoint.pt`` if present; returns whether it did.

        The draft vocabulary stays the checkpoint's (the one the optimizer state was built on),
        unless ``settings.draft_vocab`` asks for another size (the weights do not depend on it:
        the head is the target's)."""
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
        self.schedule_start = int(state.get("schedule_start", 0))
        self.history = list(state["history"])
        saved = state.get("draft_vocab")
        wanted = self.settings.draft_vocab
        if saved is not None and len(saved) == wanted:
            self._set_draft_vocab(saved)
            self.draft_vocab_report = dict(state.get("draft_vocab_report") or {})
        return True

    # -- steps --

    def sample_batch(self) -> Batch:
        st, cfg = self.settings, self.model.config
        idx = torch.randint(len(self.train_seqs), (st.seqs_per_step,), generator=self.generator).tolist()
        seqs = [self.train_seqs[i] for i in idx]
        anchors = []
        for i, s in zip(idx, seqs):
            lo, hi = _anchor_range(s)
            if st.repeat_keep < 1.0:
                pick = torch.multinomial(self._anchor_weights(i), st.anchors_per_seq, replacement=True,
                                         generator=self.generator)
            else:
                pick = torch.randint(hi - lo + 1, (st.anchors_per_seq,), generator=self.generator)
            anchors.append((lo + pick).numpy())
        return make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id, label_rows=st.soft_weight > 0,
                          copy_match=st.copy_match, copy_successor=st.copy_successor)

    def _anchor_weights(self, i: int) -> torch.Tensor:
        """Sampling weights of train sequence i's anchors (``repeat_keep`` on repeated ones), cached."""
        w = self._weights_cache.get(i)
        if w is None:
            s = self.train_seqs[i]
            lo, hi = _anchor_range(s)
            rep = repeated_anchors(s.tokens, lo, hi, self.settings.repeat_ngram)
            w = torch.from_numpy(np.where(rep, self.settings.repeat_keep, 1.0))
            if not bool((w > 0).any()):  # every anchor repeats and repeat_keep is 0: fall back to uniform
                w = torch.ones_like(w)
            self._weights_cache[i] = w
        return w

    def _autocast(self):  # type: ignore[no-untyped-def]
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)

    def _slots(self, batch: Batch, keep: torch.Tensor, probe: list | None = None):  # type: ignore[no-untyped-def]
        """Final hidden rows of the slots ``keep`` [S, A, B-1] (gathered, [M, H]) and their logits
        over the draft vocabulary (or the full head) [M, V']. ``probe``: receives the copy head's
        slot-1 attention weights (``forward_blocks``)."""
        hidden, _ = forward_blocks(self.model, batch.features, batch.block_tokens, batch.anchors, self.target,
                                   with_logits=False,
                                   probe=None if probe is None else (self.settings.copy_heads, probe))
        h = hidden[:, :, 1:][keep]
        cfg = self.model.config
        if cfg.logit_scale == 1.0 and not cfg.softcap > 0:  # DFlashDrafter.logits without its no-op multiply
            return h, h @ self.head.lm_head.to(h.dtype).T
        return h, self.model.logits(h, self.head)

    def losses(self, batch: Batch):  # type: ignore[no-untyped-def]
        """(drafter loss, selector loss, copy-head loss) of ``batch``; the last is 0 unless
        ``settings.copy_weight`` > 0. The head runs on the counted slots only.

        With a draft vocabulary, slots whose label is outside it are dropped from both losses: the
        engine can never draft that token (a reduced head has no row for it), so there is nothing
        to teach that slot; mapping them to an extra "miss" class would need a head row that the
        exported drafter does not have. ``draft_vocab_report`` gives the share this drops.
        """
        keep = batch.valid
        if self.to_draft is not None:
            keep = keep & (self.to_draft[batch.labels] >= 0)
        w = self.weights.expand_as(keep)[keep]
        labels = batch.labels[keep]
        probe: list | None = [] if self.settings.copy_weight > 0 else None
        with self._autocast():
            h, logits = self._slots(batch, keep, probe)
        copy = torch.zeros(()) if not probe else torch.stack(
            [copy_loss(p, batch.copy_rows, batch.valid[:, :, 0]) for p in probe]).mean()
        if self.bf16:
            h, logits = h.float(), logits.float()
        ones = torch.ones_like(labels, dtype=torch.bool)
        lm = drafter_loss(logits, labels if self.to_draft is None else self.to_draft[labels], ones, w)
        if self.settings.soft_weight > 0:
            lm = (1 - self.settings.soft_weight) * lm + self.settings.soft_weight * self._distillation(batch, keep, logits, w)
        sel = torch.zeros(())
        if self.model.candidate_selector is not None:
            sel = selector_loss(self.model.candidate_selector, h, logits, batch.prev_tokens[keep], labels, ones, w,
                                self.draft_vocab)
        return lm, sel, copy

    def _distillation(self, batch: Batch, keep: torch.Tensor, logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Weighted cross-entropy from the target's distribution at each counted slot's label row
        (s + j - 1, the row whose argmax is the label) to the drafter's, over the same head rows."""
        h = self.model.config.hidden_size
        n_seq, n_anchor, slots = keep.shape
        rows = batch.anchors[:, :, None] + torch.arange(slots)[None, None, :]
        seq_of = torch.arange(n_seq)[:, None, None].expand_as(rows)
        taps = batch.features[:, :, self.teacher_tap * h:(self.teacher_tap + 1) * h]
        teacher = self.teacher.log_probs(taps, rows[keep], seq_of[keep], self.draft_vocab)  # type: ignore[union-attr]
        ce = -(teacher.exp() * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        return (ce * w).sum() / w.sum().clamp(min=1e-9)

    def train_step(self, batch: Batch | None = None) -> dict:
        st = self.settings
        batch = self.sample_batch() if batch is None else batch
        lr = lr_at(self.step - self.schedule_start, st.steps - self.schedule_start, st.lr, st.warmup)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.model.train()
        lm, sel, copy = self.losses(batch)
        loss = lm + st.selector_weight * sel + st.copy_weight * copy
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        return {"step": self.step, "loss": float(loss.detach()), "drafter": float(lm.detach()), "selector": float(sel.detach()),
                **({"copy": float(copy.detach())} if st.copy_weight > 0 else {}), "lr": lr}

    @torch.no_grad()
    def accepted_drafts(self, b: Batch) -> tuple[torch.Tensor, list]:  # type: ignore[type-arg]
        """Teacher-forced greedy acceptance of every block of ``b``, in float32: drafts accepted
        per block ([S*A], the engine's walk over the block's slots) and per slot position (totals)."""
        self.model.eval()
        h_rows, z_rows = self._slots(b, b.valid)
        return self._acceptance(b, h_rows, z_rows)

    def _acceptance(self, b: Batch, h_rows: torch.Tensor, z_rows: torch.Tensor) -> tuple[torch.Tensor, list]:  # type: ignore[type-arg]
        # the walk needs every slot of a block: rows that do not count get zeros (never accepted)
        n_blocks, slots = b.valid.shape[0] * b.valid.shape[1], b.valid.shape[2]
        h = h_rows.new_zeros(b.valid.shape + h_rows.shape[-1:]).float()
        h[b.valid] = h_rows.float()
        logits = z_rows.new_zeros(b.valid.shape + z_rows.shape[-1:]).float()
        logits[b.valid] = z_rows.float()
        labels, valid = b.labels.reshape(n_blocks, slots), b.valid.reshape(n_blocks, slots)
        return greedy_acceptance(self.model.candidate_selector, h.view(n_blocks, slots, -1),
                                 logits.view(n_blocks, slots, -1), b.block_tokens[:, :, 0].reshape(-1),
                                 labels, valid, self.draft_vocab)

    @torch.no_grad()
    def validate(self, max_blocks: int = 256) -> dict:
        """Teacher-forced greedy acceptance on held-out cached sequences.

        Fixed anchors on the *continuations* (where drafting happens at inference and the labels
        are exactly the target's greedy chain); a draft past the sequence end counts as rejected.
        With a draft vocabulary the walk runs over it as the engine runs a ``d2t`` drafter (a
        label outside it is a rejection).
        """
        if not self.val_seqs:
            return {}
        if self._val_batch is None:
            gen = np.random.default_rng(1234)
            per = max(1, max_blocks // len(self.val_seqs))
            anchors = [np.sort(gen.integers(min(s.prompt_len, len(s.tokens) - 2), len(s.tokens) - 1, size=per))
                       for s in self.val_seqs]
            self._val_batch = make_batch(self.val_seqs, anchors, self.model.config.block_size,
                                         self.model.config.mask_token_id, copy_match=self.settings.copy_match,
                                         copy_successor=self.settings.copy_successor)
        b = self._val_batch
        self.model.eval()
        probe: list = []
        with self._autocast():
            h_rows, z_rows = self._slots(b, b.valid, probe)  # the copy heads' weights
        accepted, per_slot = self._acceptance(b, h_rows, z_rows)
        n_blocks = b.valid.shape[0] * b.valid.shape[1]
        lab = b.labels[b.valid]
        known = torch.ones_like(lab, dtype=torch.bool)
        if self.to_draft is not None:
            known = self.to_draft[lab] >= 0
            lab = self.to_draft[lab]
        w = self.weights.expand_as(b.valid)[b.valid]
        return {"val_tau": 1.0 + float(accepted.float().mean()),
                "val_accept_per_slot": [round(float(x) / n_blocks, 4) for x in per_slot],
                "val_loss": float(drafter_loss(z_rows.float(), lab, known, w)),
                # slot 1's attention mass on the rows the copy loss points at (the copy heads' job)
                "val_copy_mass": [_copy_mass(p, b) for p in probe]}

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
