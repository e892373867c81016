"""Tiny, seeded DFlash / DFlash2 checkpoints and targets for tests (no downloads).

Checkpoints are written exactly like published ones: ``config.json`` with the drafter keys
under ``dflash_config`` and one ``model.safetensors`` whose tensor names are the HF names of
the reference header (``tests/data/dflash2-safetensors-header.json``, from the project's shared reference), codebooks
without ``.weight``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from pydflash.reference.config import DFlashConfig
from pydflash.reference.model import DFlashDrafter, TargetWeights

# copies of the published layout in ../shared/reference (config + safetensors header, no weights)
REFERENCE_DIR = Path(__file__).resolve().parent / "data"
REFERENCE_CONFIG = REFERENCE_DIR / "dflash2-config.json"
REFERENCE_HEADER = REFERENCE_DIR / "dflash2-safetensors-header.json"


def tiny_config(kind: str = "dflash2", **overrides: Any) -> DFlashConfig:
    """A small config shaped like the published one (5 layers, sliding layers, mu, softcap).

    Every matrix row is a multiple of 32 so the same checkpoint also converts to Q8_0.
    """
    base: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=96,
        target_layer_ids=(0, 2, 3),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        block_size=4,
        mask_token_id=95,
        sliding_window=512,
        is_causal=False,
        output_multiplier=0.5,
        final_logit_softcapping=3.0,
        input_embedding_scale=1.5,
        num_target_layers=4,
    )
    if kind == "dflash2":
        base.update(conv_kernel_size=2, conv_group_size=8, selector_rank=32, selector_top_k=4)
    elif kind != "dflash":
        raise ValueError(kind)
    base.update(overrides)
    if "layer_types" not in overrides:
        base["layer_types"] = ("sliding_attention",) * base["num_hidden_layers"]
    return DFlashConfig(**base)


def smollm2_drafter_config(**overrides: Any) -> DFlashConfig:
    """A one-layer DFlash2 drafter shaped for SmolLM2-135M (H 576, 30 layers, vocab 49152)."""
    base: dict[str, Any] = dict(
        hidden_size=576,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=64,
        vocab_size=49152,
        target_layer_ids=(1, 10, 27),
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        block_size=4,
        mask_token_id=49151,
        is_causal=False,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=32,
        selector_top_k=8,
        num_target_layers=30,
    )
    base.update(overrides)
    return DFlashConfig(**base)


def checkpoint_tensors(config: DFlashConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded float32 tensors by HF name (the reference model's state_dict)."""
    model = DFlashDrafter.from_config(config, seed=seed, dtype=torch.float32)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def write_checkpoint(
    directory: Path,
    config: DFlashConfig | Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    drop: Iterable[str] = (),
    extra: Mapping[str, torch.Tensor] | None = None,
    replace: Mapping[str, torch.Tensor] | None = None,
    rename: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Write ``config.json`` + ``model.safetensors``; returns the tensors as written (by written name).

    ``config`` may be a DFlashConfig or a raw config.json dict (to test parsing variants).
    ``drop``/``extra``/``replace``/``rename`` corrupt the checkpoint for validation tests.
    """
    directory.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf() if isinstance(config, DFlashConfig) else dict(config)
    cfg = config if isinstance(config, DFlashConfig) else DFlashConfig.from_hf(hf)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    tensors = {k: v.to(dtype) for k, v in checkpoint_tensors(cfg, seed).items()}
    for name in drop:
        del tensors[name]
    tensors.update({k: v.to(dtype) for k, v in (replace or {}).items()})
    tensors.update({k: v.to(dtype) for k, v in (extra or {}).items()})
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def write_hf_target_dir(directory: Path, *, vocab_size: int, hidden_size: int, n_layers: int) -> list[str]:
    """An HF target directory with a byte-level BPE ``tokenizer.json``; returns the token strings by id.

    The last two ids are special added tokens (bos/eos); ids missing from the tokenizer are
    padded by the converter.
    """
    directory.mkdir(parents=True, exist_ok=True)
    n_plain = vocab_size - 2
    plain = [f"t{i}" for i in range(n_plain)]
    specials = ["<|bos|>", "<|eos|>"]
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {"id": n_plain + i, "content": s, "special": True} for i, s in enumerate(specials)
        ],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(plain)}, "merges": [["t", "0"], ["t", "1"]]},
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": specials[0], "eos_token": {"content": specials[1]}, "add_bos_token": False,
         "chat_template": "{{ messages }}"}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden_size, "num_hidden_layers": n_layers,
        "vocab_size": vocab_size, "rope_theta": 10000.0,
    }))
    return plain + specials


def random_target(vocab_size: int, hidden_size: int, seed: int = 0, dtype: torch.dtype = torch.float64,
                  tied: bool = False) -> TargetWeights:
    """Seeded target embedding / head matrices with O(1) logits."""
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((vocab_size, hidden_size))
    head = None if tied else rng.standard_normal((vocab_size, hidden_size)) / np.sqrt(hidden_size)
    return TargetWeights.from_arrays(embed, head, dtype=dtype)


def with_changes(config: DFlashConfig, **changes: Any) -> DFlashConfig:
    """``dataclasses.replace`` that re-runs validation."""
    return dataclasses.replace(config, **changes)
