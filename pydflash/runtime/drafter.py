"""``Drafter``: a DFlash v1 / DFlash2 drafter GGUF run natively (ggml) next to its target GGUF.

It owns one native handle: ``close()`` (or a ``with`` block) frees it. The target's token
embedding and lm_head are mapped from the target GGUF file, not copied.

One drafting round (anchor token ``x`` at position ``s``)::

    with Drafter("draft.gguf", "target.gguf") as d:
        d.inject(features, positions)        # committed rows: [n, L*H] target features
        p = d.propose(x, s, temperature=0)   # B-1 drafted tokens (+ q, candidates)
        ...                                  # the target verifies
        d.crop(n_committed)                  # keep committed rows only
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .. import errors
from ._handle import NativeObject
from ._bindings import check, ffi, lib


@dataclass(frozen=True)
class DrafterInfo:
    """Shape facts of a loaded drafter (DFlash2 fields are 0 for v1)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    block_size: int
    mask_token_id: int
    n_target_layers: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    n_ctx: int
    is_dflash2: bool
    n_vocab_draft: int  # draft head rows: n_vocab, or N of a reduced draft vocabulary
    device: str  # the ggml device it computes on


@dataclass(frozen=True)
class Proposal:
    """Drafts for slots 1..n_block-1 of one block.

    ``q`` is the distribution each slot was drawn from: over ``candidates`` ([n-1, K], DFlash2)
    or over the draft vocabulary ([n-1, N], v1; column i is target token ``draft_vocab[i]``);
    one-hot at the chosen entry for greedy drafts. ``tokens`` and ``candidates`` are target ids.
    """

    tokens: np.ndarray  # [n-1] int32
    q: np.ndarray  # [n-1, K] or [n-1, V] float32
    candidates: np.ndarray | None  # [n-1, K] int32 (DFlash2)


class Drafter(NativeObject):
    """A drafter GGUF paired with its target GGUF.

    Args:
        model: path to the drafter GGUF (``general.architecture = "dflash"``), or ``hf:ORG/NAME[:QUANT]``
            (``pydflash.fetch.hub``: a GGUF repository's file, or a DFlash checkpoint converted for this target).
        target: the target GGUF path, a ``pydflash models`` name, or a loaded ``pydflash.Target``.
        n_ctx: context rows the drafter cache holds.
        n_threads: CPU threads (None: all cores).
        seed: RNG seed of sampled proposals.
        exact_head: compute the logits with F32 activations (the target's quantized head rows
            dequantized on the fly; slower). Default: ggml's quantized mat-mul, as llama.cpp,
            which rounds the activations to 8 bits (~1e-3 relative error per logit).
        device: the ggml device to compute on (``pydflash.runtime.devices.devices()`` lists them: "CPU",
            "CUDA0", "Metal", "RPC0", ...). Ops the device cannot run fall back to the CPU.
    Raises:
        MismatchError: the drafter does not belong to the target (hidden size, vocabulary, layers).
    """

    _free = staticmethod(lib.dflash_drafter_free)

    def __init__(
        self,
        model: str | os.PathLike,
        target: object,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        seed: int = 0,
        exact_head: bool = False,
        device: str = "CPU",
    ) -> None:
        super().__init__()
        from ..fetch import registry as models

        if not isinstance(n_ctx, int) or n_ctx < 1:
            raise errors.InvalidArgumentError(f"n_ctx must be a positive int, got {n_ctx!r}")
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise errors.InvalidArgumentError(f"n_threads must be a positive int or None, got {n_threads!r}")
        target_path = getattr(target, "path", target)
        try:
            self.target_path = str(models.resolve(target_path))  # type: ignore[arg-type]
        except ValueError as exc:
            raise errors.ModelNotFoundError(str(exc)) from None
        self.path = str(models.resolve_drafter(model, self.target_path))  # a path, or hf:ORG/NAME[:QUANT]
        params = ffi.new("dflash_drafter_params *", lib.dflash_drafter_default_params())
        params.n_ctx = n_ctx
        params.n_threads = n_threads or 0
        params.seed = seed & 0xFFFFFFFFFFFFFFFF
        params.exact_head = bool(exact_head)
        if not isinstance(device, str) or not device:
            raise errors.InvalidArgumentError(f"device must be a device name such as 'CPU', got {device!r}")
        device_name = ffi.new("char[]", device.encode())  # kept alive through the load call
        params.device = device_name
        out = ffi.new("dflash_drafter **")
        check(lib.dflash_drafter_load(self.path.encode(), self.target_path.encode(), params, out))
        self._handle = out[0]
        info = ffi.new("dflash_drafter_info *")
        check(lib.dflash_drafter_get_info(self._handle, info))
        self.info = DrafterInfo(
            **{f: getattr(info, f) for f in DrafterInfo.__dataclass_fields__ if f not in ("is_dflash2", "device")},
            is_dflash2=bool(info.is_dflash2),
            device=ffi.string(info.device).decode(),
        )
        layers, n = ffi.new("int32_t **"), ffi.new("int32_t *")
        check(lib.dflash_drafter_target_layers(self._handle, layers, n))
        #: target layers whose *inputs* the drafter reads (HF id + 1): pass to ``Target.set_taps``
        self.target_layers: tuple[int, ...] = tuple(layers[0][i] for i in range(n[0]))
        ids = ffi.new("int32_t **")
        check(lib.dflash_drafter_draft_vocab(self._handle, ids, n))
        #: target ids of the draft head's rows ([N] int32), or None when it covers the full vocabulary
        self.draft_vocab: np.ndarray | None = (
            np.frombuffer(ffi.buffer(ids[0], 4 * n[0]), dtype=np.int32).copy() if n[0] else None)
        rates, drafts = ffi.new("float **"), ffi.new("int64_t *")
        check(lib.dflash_drafter_acceptance_profile(self._handle, rates, n, drafts))
        #: measured acceptance by draft position (``pydflash drafter-profile``; () when the file has
        #: none): the prior of ``auto`` n_max, which prices its first probe with it
        self.acceptance_profile: tuple[float, ...] = tuple(float(rates[0][i]) for i in range(n[0]))
        self.acceptance_profile_drafts = int(drafts[0])


    # -- context -------------------------------------------------------------------------------

    @property
    def n_context(self) -> int:
        """Context rows held now."""
        info = ffi.new("dflash_drafter_info *")
        with self._lock:
            check(lib.dflash_drafter_get_info(self._h(), info))
        return int(info.n_ctx_used)

    def inject(self, features: np.ndarray, positions: np.ndarray | list[int]) -> None:
        """Append committed rows: ``features`` [n, L*H] (float32) at ``positions`` [n]."""
        width = self.info.n_target_layers * self.info.n_embd
        feats = np.ascontiguousarray(features, dtype=np.float32)
        if feats.ndim == 1:
            feats = feats.reshape(1, -1)
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        if feats.ndim != 2 or feats.shape[1] != width:
            raise errors.InvalidArgumentError(f"features must be [n, {width}], got {list(np.shape(features))}")
        if feats.shape[0] != pos.shape[0]:
            raise errors.InvalidArgumentError(f"{feats.shape[0]} feature rows but {pos.shape[0]} positions")
        with self._lock:
            check(lib.dflash_drafter_inject(self._h(), ffi.from_buffer("float[]", feats),
                                            ffi.from_buffer("int32_t[]", pos), feats.shape[0]))

    def inject_taps(self, taps: "list[np.ndarray]", positions: np.ndarray | list[int]) -> None:
        """Append committed rows given per tap: ``taps[k]`` [n, H] for ``target_layers[k]``
        (what ``Target.tap_rows(k)`` returns after ``Target.set_taps(drafter.target_layers)``)."""
        arrays = [np.ascontiguousarray(t, dtype=np.float32) for t in taps]
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        if len(arrays) != self.info.n_target_layers:
            raise errors.InvalidArgumentError(
                f"{len(arrays)} tap arrays given, the drafter reads {self.info.n_target_layers} target layers")
        for a in arrays:
            if a.shape != (pos.shape[0], self.info.n_embd):
                raise errors.InvalidArgumentError(
                    f"each tap must be [{pos.shape[0]}, {self.info.n_embd}], got {list(a.shape)}")
        pointers = ffi.new("float *[]", [ffi.from_buffer("float[]", a) for a in arrays])
        with self._lock:
            check(lib.dflash_drafter_inject_taps(self._h(), pointers, len(arrays),
                                                 ffi.from_buffer("int32_t[]", pos), pos.shape[0]))

    def crop(self, n_keep: int) -> None:
        """Keep only the first ``n_keep`` context rows."""
        with self._lock:
            check(lib.dflash_drafter_crop(self._h(), int(n_keep)))

    # -- blocks --------------------------------------------------------------------------------

    def _n_block(self, n_block: int | None) -> int:
        return self.info.block_size if n_block is None else int(n_block)

    def forward(self, anchor: int, start_pos: int, n_block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Run [anchor, MASK...] at ``start_pos``: (final-normed hidden [n, H], logits [n, N]).

        N = ``info.n_vocab_draft``: logits column i scores target token ``draft_vocab[i]``."""
        n = self._n_block(n_block)
        hidden = np.empty((max(n, 0), self.info.n_embd), dtype=np.float32)
        logits = np.empty((max(n, 0), self.info.n_vocab_draft), dtype=np.float32)
        with self._lock:
            check(lib.dflash_drafter_forward(self._h(), int(anchor), int(start_pos), n,
                                             ffi.from_buffer("float[]", hidden), ffi.from_buffer("float[]", logits)))
        return hidden, logits

    def use_context(self, context: int, *, create: bool = True) -> None:
        """Select the context cache later inject/crop/forward/propose calls act on (one per
        sequence the drafter serves; 0 exists from load, others are created on demand)."""
        with self._lock:
            if create:
                check(lib.dflash_drafter_set_contexts(self._h(), int(context) + 1))
            check(lib.dflash_drafter_use_context(self._h(), int(context)))

    def forward_batch(self, contexts: list[int], anchors: list[int], start_pos: list[int],
                      n_block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Blocks over several contexts in one graph: (hidden [n_jobs, n, H], logits [n_jobs, n, N])."""
        n = self._n_block(n_block)
        jobs = len(contexts)
        if not (jobs == len(anchors) == len(start_pos)) or jobs == 0:
            raise errors.InvalidArgumentError("contexts, anchors and start_pos need one entry per block")
        hidden = np.empty((jobs, max(n, 0), self.info.n_embd), dtype=np.float32)
        logits = np.empty((jobs, max(n, 0), self.info.n_vocab_draft), dtype=np.float32)
        ints = [ffi.new("int32_t[]", [int(x) for x in v]) for v in (contexts, anchors, start_pos)]
        with self._lock:
            check(lib.dflash_drafter_forward_batch(self._h(), *ints, jobs, n, ffi.from_buffer("float[]", hidden),
                                                   ffi.from_buffer("float[]", logits)))
        return hidden, logits

    def propose(self, anchor: int, start_pos: int, n_block: int | None = None, temperature: float = 0.0) -> Proposal:
        """Run the block and draft slots 1..n-1 (greedy when ``temperature <= 0``)."""
        n = self._n_block(n_block)
        slots = max(n - 1, 0)
        k = self.info.selector_top_k if self.info.is_dflash2 else self.info.n_vocab_draft
        tokens = np.zeros(slots, dtype=np.int32)
        q = np.zeros((slots, k), dtype=np.float32)
        cands = np.zeros((slots, self.info.selector_top_k), dtype=np.int32) if self.info.is_dflash2 else None
        with self._lock:
            check(lib.dflash_drafter_propose(
                self._h(), int(anchor), int(start_pos), n, float(temperature),
                ffi.from_buffer("int32_t[]", tokens) if slots else ffi.new("int32_t[1]"),
                ffi.from_buffer("float[]", q) if q.size else ffi.NULL,
                ffi.from_buffer("int32_t[]", cands) if cands is not None and cands.size else ffi.NULL))
        return Proposal(tokens=tokens, q=q, candidates=cands)

    def set_seed(self, seed: int) -> None:
        with self._lock:
            lib.dflash_drafter_set_seed(self._h(), seed & 0xFFFFFFFFFFFFFFFF)
