"""DFlash / DFlash2 drafter configuration, parsed from a Hugging Face ``config.json``.

Torch-free on purpose: the GGUF converter and layout tables import it without pulling in torch.

A DFlash checkpoint is a Qwen3-style config with the drafter's own keys under
``dflash_config`` (``block_size``, ``mask_token_id``, ``target_layer_ids``, and for DFlash2
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``, optionally
``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``). Like the
reference loader, every drafter key is looked up in ``dflash_config`` first and then at the
top level (older v1 checkpoints keep ``block_size`` at the top level).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

__all__ = ["ARCH_DFLASH", "ARCH_DFLASH2", "DFlashConfig", "DEFAULT_BLOCK_SIZE", "normalize_hf_name"]

ARCH_DFLASH = "DFlashDraftModel"
ARCH_DFLASH2 = "DFlash2DraftModel"

_F32_MAX = 3.4028234663852886e38
MAX_BLOCK_SIZE = 1024  # the native loader's limit too (trained blocks are 16)
MAX_LAYERS = 4096  # far above any drafter (they have 1-8); bounds what a hostile config can allocate
DEFAULT_BLOCK_SIZE = 16  # the reference and upstream converter default when the config has none
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# The four keys that make a drafter DFlash2 (all or none).
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Keys seen in other drafter families that change the math and that we do not implement.
_UNSUPPORTED_KEYS = ("attention_value_scale", "use_swa", "swa_window_size", "partial_rotary_factor")


@dataclass(frozen=True)
class DFlashConfig:
    """Everything the drafter math and the GGUF layout need, with the reference's defaults.

    ``sliding_window`` is the *effective* window: ``None`` unless the checkpoint enables
    sliding windows (``use_sliding_window``), as transformers' Qwen3 config does.
    ``is_causal`` keeps the three-valued reference semantics (see :meth:`layer_is_causal`).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # non-default rope_parameters (type + factors)
    max_position_embeddings: int = 32768
    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    num_target_layers: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.num_hidden_layers, int) or not 0 < self.num_hidden_layers <= MAX_LAYERS:
            raise ValueError(f"invalid DFlash config: num_hidden_layers {self.num_hidden_layers!r} is not in "
                             f"1..{MAX_LAYERS}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self._validate()

    # --- derived facts -----------------------------------------------------------------

    @property
    def is_dflash2(self) -> bool:
        """DFlash2 = grouped dynamic convs + candidate selector (all four keys present)."""
        return self.conv_kernel_size is not None

    @property
    def architecture(self) -> str:
        return ARCH_DFLASH2 if self.is_dflash2 else ARCH_DFLASH

    @property
    def num_taps(self) -> int:
        """L: number of tapped target layers; the fused feature row is L * hidden_size wide."""
        return len(self.target_layer_ids)

    @property
    def conv_groups(self) -> int:
        """G = H / S (DFlash2 only)."""
        if self.conv_group_size is None:
            raise ValueError("conv_groups is only defined for DFlash2 drafters")
        return self.hidden_size // self.conv_group_size

    @property
    def logit_scale(self) -> float:
        """mu: multiplier applied to the head's logits (1 when the checkpoint has none)."""
        return 1.0 if self.output_multiplier is None else float(self.output_multiplier)

    @property
    def softcap(self) -> float:
        """c: final logit softcap, 0 = off."""
        c = self.final_logit_softcapping
        return float(c) if c is not None and float(c) > 0 else 0.0

    @property
    def embedding_scale(self) -> float:
        """alpha: multiplier on the target's raw embedding rows (1 when absent)."""
        return 1.0 if self.input_embedding_scale is None else float(self.input_embedding_scale)

    def layer_is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None = full attention)."""
        return self.sliding_window if self.layer_is_sliding(layer) else None

    def layer_is_causal(self, layer: int) -> bool:
        """Reference rule: ``is_causal`` if set, else causal exactly on sliding layers."""
        return self.layer_is_sliding(layer) if self.is_causal is None else bool(self.is_causal)

    # --- parsing -----------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DFlashConfig:
        """Parse a Hugging Face DFlash / DFlash2 ``config.json`` dict."""
        hp = dict(config)
        dc = hp.get("dflash_config") or {}
        if not isinstance(dc, Mapping):
            raise ValueError(f"dflash_config must be an object, got {type(dc).__name__}")
        dc = dict(dc)
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        absent = [k for k in required if k not in hp]
        if absent:
            raise ValueError(f"config.json lacks {absent}: not a DFlash drafter config")

        def value(name: str, default: Any = None) -> Any:
            return dc[name] if name in dc else hp.get(name, default)

        rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
        for key in _UNSUPPORTED_KEYS:
            v = rope.get(key, value(key))
            if v not in (None, False) and not (key == "partial_rotary_factor" and float(v) == 1.0):
                raise ValueError(f"config key {key}={v!r} is not supported by the DFlash reference/converter")
        if hp.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported: DFlash drafters have bias-free projections")
        act = hp.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (DFlash drafters use silu)")

        present = [k for k in _DFLASH2_KEYS if value(k) is not None]
        if present and len(present) != len(_DFLASH2_KEYS):
            missing = [k for k in _DFLASH2_KEYS if k not in present]
            raise ValueError(f"DFlash2 config has {present} but is missing {missing} (add them to dflash_config)")
        archs = hp.get("architectures") or []
        if ARCH_DFLASH2 in archs and not present:
            raise ValueError(f"architectures says {ARCH_DFLASH2} but dflash_config has none of {list(_DFLASH2_KEYS)}")

        target_layer_ids = value("target_layer_ids")
        if not target_layer_ids:
            raise ValueError("config has no dflash_config.target_layer_ids (the tapped target layers)")

        n_layers = int(hp["num_hidden_layers"])
        if not 0 < n_layers <= MAX_LAYERS:  # before building per-layer lists from it
            raise ValueError(f"num_hidden_layers {n_layers} is not in 1..{MAX_LAYERS}")
        n_heads = int(hp["num_attention_heads"])
        hidden = int(hp["hidden_size"])
        head_dim = hp.get("head_dim") or hidden // n_heads

        rope_theta = float(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type not in (None, "default"):
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            rope_scaling["rope_type"] = rope_type

        # transformers' Qwen3Config: the window only exists when use_sliding_window is on,
        # and missing layer_types are derived from max_window_layers.
        window = hp.get("sliding_window") if hp.get("use_sliding_window", False) else None
        layer_types = hp.get("layer_types")
        if not layer_types:
            first_swa = int(hp.get("max_window_layers", 28))
            layer_types = [
                SLIDING_ATTENTION if window is not None and i >= first_swa else FULL_ATTENTION
                for i in range(n_layers)
            ]

        is_causal = hp.get("is_causal")
        if is_causal is None:
            is_causal = dc.get("causal")

        def opt_int(name: str) -> int | None:
            v = value(name)
            return None if v is None else int(v)

        def opt_float(name: str) -> float | None:
            v = value(name)
            return None if v is None else float(v)

        known = {
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_parameters",
            "rope_scaling", "max_position_embeddings", "layer_types", "sliding_window",
            "use_sliding_window", "is_causal", "dflash_config", "block_size", "num_target_layers",
        }
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(hp.get("num_key_value_heads", n_heads)),
            head_dim=int(head_dim),
            intermediate_size=int(hp["intermediate_size"]),
            vocab_size=int(hp["vocab_size"]),
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            rms_norm_eps=float(hp.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hp.get("max_position_embeddings", 32768)),
            block_size=int(value("block_size", DEFAULT_BLOCK_SIZE)),
            mask_token_id=opt_int("mask_token_id"),
            layer_types=tuple(layer_types),
            sliding_window=None if window is None else int(window),
            is_causal=None if is_causal is None else bool(is_causal),
            conv_kernel_size=opt_int("conv_kernel_size"),
            conv_group_size=opt_int("conv_group_size"),
            selector_rank=opt_int("selector_rank"),
            selector_top_k=opt_int("selector_top_k"),
            output_multiplier=opt_float("output_multiplier"),
            final_logit_softcapping=opt_float("final_logit_softcapping"),
            input_embedding_scale=opt_float("input_embedding_scale"),
            num_target_layers=opt_int("num_target_layers"),
            extra={k: v for k, v in hp.items() if k not in known},
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | PathLike[str]) -> DFlashConfig:
        """Read ``<model_dir>/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: expected a Hugging Face DFlash checkpoint directory")
        # an untrusted file: every way it can be malformed is a ValueError naming it
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, Mapping):
                raise ValueError(f"the top level is a {type(config).__name__}, not an object")
            return cls.from_hf(config)
        except (TypeError, KeyError, AttributeError, IndexError, OverflowError, ZeroDivisionError,
                RecursionError, ValueError) as exc:
            raise ValueError(f"{path} is not a valid DFlash config: {exc}") from None

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict in the published DFlash2 layout (drafter keys under dflash_config)."""
        dc: dict[str, Any] = {"block_size": self.block_size, "target_layer_ids": list(self.target_layer_ids)}
        if self.mask_token_id is not None:
            dc["mask_token_id"] = self.mask_token_id
        for name in (*_DFLASH2_KEYS, "output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
            if getattr(self, name) is not None:
                dc[name] = getattr(self, name)
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        hp: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "attention_bias": False,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "dflash_config": dc,
        }
        if self.is_causal is not None:
            hp["is_causal"] = self.is_causal
        if self.num_target_layers is not None:
            hp["num_target_layers"] = self.num_target_layers
        return hp

    # --- checks ------------------------------------------------------------------------

    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid DFlash config: {msg}")

        # every size is stored as a 32-bit GGUF integer and every scale as a float32
        sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "block_size", "mask_token_id",
                 "sliding_window", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                 "num_target_layers")
        for name in sizes:
            v = getattr(self, name)
            need(v is None or 0 <= v < 2**31, f"{name} {v} is not an integer in 0..2^31-1")
        need(all(0 <= i < 2**31 for i in self.target_layer_ids), "target_layer_ids must be integers in 0..2^31-1")
        for name in ("rms_norm_eps", "rope_theta", "output_multiplier", "final_logit_softcapping",
                     "input_embedding_scale"):
            v = getattr(self, name)
            need(v is None or (math.isfinite(v) and abs(v) <= _F32_MAX), f"{name} {v} is not a finite float32")
        need(self.hidden_size > 0 and self.num_hidden_layers > 0, "hidden_size and num_hidden_layers must be > 0")
        need(self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
             f"{self.num_key_value_heads}")
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        need(not bad, f"unknown layer_types {bad}")
        need(len(self.target_layer_ids) > 0 and min(self.target_layer_ids) >= 0,
             f"target_layer_ids {list(self.target_layer_ids)} must be a non-empty list of ids >= 0")
        need(1 <= self.block_size <= MAX_BLOCK_SIZE, f"block_size {self.block_size} must be in 1..{MAX_BLOCK_SIZE}")
        need(self.sliding_window is None or self.sliding_window > 0, "sliding_window must be > 0")
        need(math.isfinite(self.rope_theta) and self.rope_theta > 0, "rope_theta must be > 0")
        if self.mask_token_id is not None:
            need(0 <= self.mask_token_id < self.vocab_size,
                 f"mask_token_id {self.mask_token_id} is outside the drafter vocab (vocab_size {self.vocab_size})")
        if self.is_dflash2:
            assert self.conv_kernel_size is not None and self.conv_group_size is not None
            assert self.selector_rank is not None and self.selector_top_k is not None
            need(self.conv_kernel_size >= 1, "conv_kernel_size must be >= 1")
            need(self.conv_group_size >= 1 and self.hidden_size % self.conv_group_size == 0,
                 f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
            need(self.selector_rank >= 1, "selector_rank must be >= 1")
            need(1 <= self.selector_top_k <= self.vocab_size,
                 f"selector_top_k {self.selector_top_k} must be in [1, vocab_size]")


def normalize_hf_name(name: str) -> str:
    """Canonical HF tensor name: no ``model.`` prefix, codebooks without ``.weight``.

    Published DFlash2 checkpoints store ``candidate_selector.*_codebook`` bare; re-saved
    ``nn.Embedding`` codebooks and some exporters add ``.weight`` or a ``model.`` prefix.
    """
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("candidate_selector.") and name.endswith("_codebook.weight"):
        name = name[: -len(".weight")]
    return name
