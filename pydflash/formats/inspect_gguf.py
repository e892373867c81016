"""What libllama makes of a GGUF file: used to prove our drafter files load upstream."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..runtime._bindings import check, ffi, lib


@dataclass(frozen=True)
class ModelSummary:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    token_mask: int
    selector_top_k: int
    target_layers: tuple[int, ...]  # as stored (HF layer id + 1)
    n_params: int


def summarize(path: str | os.PathLike) -> ModelSummary:
    """Load ``path`` with the pinned libllama (weights included, CPU) and report its hparams."""
    out = ffi.new("dflash_model_summary *")
    check(lib.dflash_model_summarize(os.fspath(path).encode(), out))
    return ModelSummary(
        arch=ffi.string(out.arch).decode(),
        n_layer=out.n_layer,
        n_embd=out.n_embd,
        n_head=out.n_head,
        n_head_kv=out.n_head_kv,
        n_vocab=out.n_vocab,
        token_mask=out.token_mask,
        selector_top_k=out.selector_top_k,
        target_layers=tuple(out.target_layers[i] for i in range(out.n_target_layers)),
        n_params=int(out.n_params),
    )
