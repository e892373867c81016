"""Drafters shipped inside the package, and how ``drafter="auto"`` finds one for a target.

A shipped drafter matches a loaded target when the target's architecture, hidden size,
vocabulary size and layer count are the ones it was trained on *and* the GGUF's ``general.*``
naming (basename, size label, name) identifies the same model family. The shape check makes a
wrong pairing impossible to load; the name check keeps a drafter trained on one model from being
paired with an unrelated model that happens to share its shape (it would be lossless, just slow).

Each entry records how the file was made (``pydflash train`` command) and what it measured;
see the README's "Shipped drafters" section.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ShippedDrafter", "SHIPPED", "find_for_target", "resolve_auto"]

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ShippedDrafter:
    file: str  # next to this module
    arch: str
    n_embd: int
    n_vocab: int
    n_layer: int
    name_keys: tuple[str, ...]  # all must appear (lower-case) in the target's general.* names

    @property
    def path(self) -> Path:
        return _HERE / self.file

    def matches(self, arch: str, n_embd: int, n_vocab: int, n_layer: int, names: str) -> bool:
        return ((arch, n_embd, n_vocab, n_layer) == (self.arch, self.n_embd, self.n_vocab, self.n_layer)
                and all(k in names for k in self.name_keys))


SHIPPED: tuple[ShippedDrafter, ...] = (
    ShippedDrafter("smollm2-135m-instruct-dflash2.gguf", "llama", 576, 49152, 30, ("smollm2", "135m")),
    # no tokenizer, no head rows: the engine pairs it on shapes and gathers its 8,192 head rows
    # from the target at load (docs/shipped-drafter.md)
    ShippedDrafter("qwen2.5-coder-0.5b-instruct-dflash2.gguf", "qwen2", 896, 151936, 24, ("qwen2.5", "coder", "0.5b")),
)


def _target_names(target) -> str:  # type: ignore[no-untyped-def]
    parts = []
    for key in ("general.name", "general.basename", "general.size_label", "general.finetune"):
        try:
            parts.append(target.meta(key))
        except Exception:  # a key the file lacks
            continue
    return " ".join(parts).lower()


def find_for_target(target) -> ShippedDrafter | None:  # type: ignore[no-untyped-def]
    """The shipped drafter for a loaded ``pydflash.Target``, or None."""
    try:
        arch = target.meta("general.architecture")
    except Exception:
        return None
    info = target.info
    names = _target_names(target)
    for entry in SHIPPED:
        if entry.path.is_file() and entry.matches(arch, info.n_embd, info.n_vocab, info.n_layer, names):
            return entry
    return None


def resolve_auto(target) -> Path | None:  # type: ignore[no-untyped-def]
    """Path of the shipped drafter for ``target``; None, with a warning, when there is none."""
    entry = find_for_target(target)
    if entry is None:
        warnings.warn(f"drafter='auto': no shipped drafter matches {Path(target.path).name}; decoding without one "
                      "(train one with `pydflash train`)", stacklevel=3)
        return None
    return entry.path
