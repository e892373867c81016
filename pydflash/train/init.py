"""Starting weights for a new drafter, taken from the target GGUF where shapes allow.

* every drafter layer starts as a copy of one of the target's last layers (attention, SwiGLU,
  both norms) when the head counts and head size match; q/k norms start at 1; a drafter FFN
  narrower than the target's keeps the neurons with the largest ``|gate| * |up| * |down|`` norms
  (a pruned copy: the layer's output changes least without its weakest neurons);
* ``fc`` starts as the identity on the last tap (so the fused context ``g`` is the normed hidden
  state of the deepest tapped layer, i.e. what the copied layer normally reads) plus small noise
  on the other taps; ``hidden_norm`` starts as that layer's input norm;
* the final ``norm`` is the target's output norm (the target's head follows it);
* convs are the identity (W_cv = 0, tap 0 = 1), so the DFlash2 layer starts as a DFlash v1 layer;
* the selector starts neutral: ``hidden_projection = 0`` makes every transition score 0, so the
  walk is the drafter's own argmax until the selector learns; codebooks are small random.

llama.cpp stores llama-arch Q/K rows permuted for its interleaved RoPE; they are permuted back to
the rotate-half (NeoX) order the drafter uses.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from ..formats.convert import read_gguf_header, read_gguf_tensor
from ..reference.config import DFlashConfig
from ..reference.model import DFlashDrafter

__all__ = ["grow_layers", "init_from_target", "target_facts"]

_INTERLEAVED_ROPE_ARCHS = {"llama"}


def target_facts(path: str | os.PathLike) -> dict[str, Any]:
    """Shape facts of a target GGUF: arch, name, hidden, layers, heads, ffn, vocab, rope, eps."""
    header = read_gguf_header(path)
    def value(key: str, default: Any = None) -> Any:
        entry = header.kv.get(key)
        if entry is None:
            return default
        v = entry.value
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else v

    arch = str(value("general.architecture"))

    def get(key: str, default: Any = None) -> Any:
        return value(f"{arch}.{key}", default)

    embd = header.tensors["token_embd.weight"]
    n_head = int(get("attention.head_count"))
    return {
        "arch": arch,
        "name": str(value("general.name", "")),
        "hidden_size": int(get("embedding_length")),
        "num_layers": int(get("block_count")),
        "num_heads": n_head,
        "num_kv_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": int(get("attention.key_length", int(get("embedding_length")) // n_head)),
        "intermediate_size": int(get("feed_forward_length")),
        "vocab_size": int(embd.ne[1]),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    }


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a llama.cpp Q/K matrix [n_head*d, H] from interleaved back to rotate-half order."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _strongest_neurons(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (ascending) of the ``n`` SwiGLU neurons with the largest weight-norm product."""
    if n >= gate.shape[0]:
        return torch.arange(gate.shape[0])
    score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)
    return torch.sort(torch.topk(score, n).indices).values


def init_from_target(model: DFlashDrafter, target_gguf: str | os.PathLike, *, seed: int = 0) -> list[str]:
    """Overwrite ``model``'s weights in place (see module docstring); returns what was copied."""
    cfg: DFlashConfig = model.config
    facts = target_facts(target_gguf)
    header = read_gguf_header(target_gguf)
    gen = torch.Generator().manual_seed(seed)
    copied: list[str] = []

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(read_gguf_tensor(header, name))

    with torch.no_grad():
        for p in model.parameters():  # defaults for anything not copied below
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                p.fill_(1.0)
        model.set_identity_convs()
        same_attn = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
            facts["num_heads"], facts["num_kv_heads"], facts["head_dim"])
        narrower_ffn = cfg.intermediate_size <= facts["intermediate_size"]
        n_t = facts["num_layers"]
        for i, layer in enumerate(model.layers):
            src = n_t - cfg.num_hidden_layers + i  # the target's last layers, in order
            blk = f"blk.{src}."
            layer.input_layernorm.weight.copy_(tensor(blk + "attn_norm.weight"))
            layer.post_attention_layernorm.weight.copy_(tensor(blk + "ffn_norm.weight"))
            if same_attn:
                q, k = tensor(blk + "attn_q.weight").numpy(), tensor(blk + "attn_k.weight").numpy()
                if facts["arch"] in _INTERLEAVED_ROPE_ARCHS:
                    q = _unpermute_rope_rows(q, facts["num_heads"])
                    k = _unpermute_rope_rows(k, facts["num_kv_heads"])
                attn = layer.self_attn
                attn.q_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(q)))
                attn.k_proj.weight.copy_(torch.from_numpy(np.ascontiguousarray(k)))
                attn.v_proj.weight.copy_(tensor(blk + "attn_v.weight"))
                attn.o_proj.weight.copy_(tensor(blk + "attn_output.weight"))
                attn.q_norm.weight.fill_(1.0)
                attn.k_norm.weight.fill_(1.0)
                copied.append(f"layers.{i}.self_attn <- {blk}attn_*")
            if narrower_ffn:
                gate, up = tensor(blk + "ffn_gate.weight"), tensor(blk + "ffn_up.weight")
                down = tensor(blk + "ffn_down.weight")
                keep = _strongest_neurons(gate, up, down, cfg.intermediate_size)
                layer.mlp.gate_proj.weight.copy_(gate[keep])
                layer.mlp.up_proj.weight.copy_(up[keep])
                layer.mlp.down_proj.weight.copy_(down[:, keep])
                pruned = "" if len(keep) == gate.shape[0] else f" ({len(keep)} of {gate.shape[0]} neurons)"
                copied.append(f"layers.{i}.mlp <- {blk}ffn_*{pruned}")
        # fc: identity on the deepest tap, small noise elsewhere
        h = cfg.hidden_size
        fc = torch.randn(model.fc.weight.shape, generator=gen) * (0.02 / math.sqrt(h))
        deepest = int(np.argmax(cfg.target_layer_ids))
        fc[:, deepest * h:(deepest + 1) * h] += torch.eye(h)
        model.fc.weight.copy_(fc)
        first = n_t - cfg.num_hidden_layers
        model.hidden_norm.weight.copy_(tensor(f"blk.{first}.attn_norm.weight"))
        model.norm.weight.copy_(tensor("output_norm.weight"))
        copied += ["fc <- identity on the deepest tap", f"hidden_norm <- blk.{first}.attn_norm", "norm <- output_norm"]
        sel = model.candidate_selector
        if sel is not None:
            r = sel.predecessor_codebook.shape[1]
            sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=gen) / r**0.25)
            sel.successor_codebook.copy_(torch.randn(sel.successor_codebook.shape, generator=gen) / r**0.25)
            sel.hidden_projection.weight.zero_()
    return copied


def grow_layers(model: DFlashDrafter, trained: dict[str, torch.Tensor], trained_layers: int) -> list[str]:
    """Start ``model`` from a trained drafter with fewer layers (otherwise the same config).

    The trained layers keep their place at the bottom; each new layer on top is a copy of the top
    trained layer with its two residual branches closed (``o_proj`` and ``down_proj`` zero), so it
    is the identity and the deeper drafter starts with exactly the trained drafter's outputs.
    Gradients still reach the closed projections (their inputs are not zero), so the new layers
    open up as training goes on. Returns what was set.
    """
    n = model.config.num_hidden_layers
    if not 0 < trained_layers < n:
        raise ValueError(f"can only grow to more layers: {trained_layers} -> {n}")
    state = model.state_dict()
    top = f"layers.{trained_layers - 1}."
    grown = {}
    for name in state:
        if not name.startswith("layers."):
            src = name
        else:
            i, rest = name[len("layers."):].split(".", 1)
            src = name if int(i) < trained_layers else top + rest
        if src not in trained or trained[src].shape != state[name].shape:
            raise ValueError(f"the trained drafter has no {src} of shape {tuple(state[name].shape)}")
        grown[name] = trained[src].to(state[name].dtype)
    for i in range(trained_layers, n):
        grown[f"layers.{i}.self_attn.o_proj.weight"] = torch.zeros_like(grown[f"layers.{i}.self_attn.o_proj.weight"])
        grown[f"layers.{i}.mlp.down_proj.weight"] = torch.zeros_like(grown[f"layers.{i}.mlp.down_proj.weight"])
    model.load_state_dict(grown)
    return [f"layers.0..{trained_layers - 1} and the rest <- the trained drafter",
            f"layers.{trained_layers}..{n - 1} <- layers.{trained_layers - 1} with o_proj = down_proj = 0 (identity)"]
