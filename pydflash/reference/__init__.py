"""Reference (PyTorch) implementation of the DFlash v1 / DFlash2 drafters.

The native engine is checked against this package. ``DFlashConfig`` is torch-free; the
model and selector import torch on first use, so ``pydflash.reference.config`` stays cheap
for the converter.

Example::

    from pydflash.reference import DFlashDrafter, TargetWeights

    drafter = DFlashDrafter.from_pretrained("path/to/dflash2", dtype=torch.float64)
    target = TargetWeights.from_gguf("target.gguf", dtype=torch.float64)
    hidden, logits = drafter.forward_block(features, positions, [anchor] + [mask] * 7, s, target)
    proposal = drafter.propose(hidden, logits, anchor, temperature=0.0)
"""

from __future__ import annotations

from typing import Any

from .config import ARCH_DFLASH, ARCH_DFLASH2, DFlashConfig

__all__ = [
    "ARCH_DFLASH",
    "ARCH_DFLASH2",
    "CandidateSelector",
    "DFlashConfig",
    "DFlashDrafter",
    "Proposal",
    "TargetWeights",
    "build_lattice",
    "greedy_verify",
    "greedy_walk",
    "grouped_dynamic_causal_conv",
    "rejection_sample",
    "sampled_walk",
    "sampling_probs",
    "top_k_candidates",
]

_LAZY = {
    "DFlashDrafter": "model",
    "TargetWeights": "model",
    "grouped_dynamic_causal_conv": "model",
    "CandidateSelector": "selector",
    "Proposal": "selector",
    "build_lattice": "selector",
    "greedy_verify": "selector",
    "greedy_walk": "selector",
    "rejection_sample": "selector",
    "sampled_walk": "selector",
    "sampling_probs": "selector",
    "top_k_candidates": "selector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)
