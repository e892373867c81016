"""Soft targets without a second decode: the target's last layer, run in torch on the cached taps.

The deepest default tap (HF layer ``n - 2``) is the *input* of the target's last layer, so that
layer, the output norm and the head turn cached rows back into the target's next-token
distribution at every position (causal self-attention over the sequence's own rows: nothing else
is needed). The trainer uses it for distillation: the drafter's softmax over the draft vocabulary
is pulled toward the target's (renormalized over the same rows) next to the hard greedy labels.

Numerics differ from the native target (float32 over dequantized weights against ggml's
quantized dot products, and float16-coded cache rows), so the distribution is close, not equal:
``tests/test_train.py`` checks that its argmax is the target's own greedy label on real captures.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..formats.convert import read_gguf_header, read_gguf_tensor
from ..reference.model import apply_rope, rms_norm, rope_cos_sin
from .init import _INTERLEAVED_ROPE_ARCHS, _unpermute_rope_rows, target_facts

__all__ = ["LastLayerTeacher"]


class LastLayerTeacher:
    """The target's last layer + output norm + head, fed with the tap at HF layer ``n - 2``."""

    def __init__(self, target_gguf: str | os.PathLike, lm_head: Tensor) -> None:
        facts = target_facts(target_gguf)
        header = read_gguf_header(target_gguf)
        self.n_layers = facts["num_layers"]
        self.n_head, self.n_head_kv, self.head_dim = facts["num_heads"], facts["num_kv_heads"], facts["head_dim"]
        self.eps, self.theta = facts["rms_norm_eps"], facts["rope_theta"]
        blk = f"blk.{self.n_layers - 1}."

        def t(name: str) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(read_gguf_tensor(header, name)))

        q, k = read_gguf_tensor(header, blk + "attn_q.weight"), read_gguf_tensor(header, blk + "attn_k.weight")
        if facts["arch"] in _INTERLEAVED_ROPE_ARCHS:  # back to rotate-half order, as the drafter's init does
            q, k = _unpermute_rope_rows(q, self.n_head), _unpermute_rope_rows(k, self.n_head_kv)
        self.wq, self.wk = torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(np.ascontiguousarray(k))
        self.wv, self.wo = t(blk + "attn_v.weight"), t(blk + "attn_output.weight")
        # Qwen2 has q/k/v biases, llama none (a Q/K bias is permuted like its rows)
        zeros = {"q": self.n_head, "k": self.n_head_kv, "v": self.n_head_kv}
        self.bias = {}
        for name, heads in zeros.items():
            key = f"{blk}attn_{name}.bias"
            b = read_gguf_tensor(header, key) if key in header.tensors else np.zeros(heads * self.head_dim, np.float32)
            if name != "v" and facts["arch"] in _INTERLEAVED_ROPE_ARCHS:
                b = _unpermute_rope_rows(b, heads)
            self.bias[name] = torch.from_numpy(np.ascontiguousarray(b))
        self.attn_norm, self.ffn_norm = t(blk + "attn_norm.weight"), t(blk + "ffn_norm.weight")
        self.gate, self.up, self.down = t(blk + "ffn_gate.weight"), t(blk + "ffn_up.weight"), t(blk + "ffn_down.weight")
        self.out_norm = t("output_norm.weight")
        self.lm_head = lm_head
        self.tap_layer = self.n_layers - 2  # HF id of the tap this teacher reads

    @torch.no_grad()
    def final_hidden(self, x: Tensor) -> Tensor:
        """``x`` [n, H]: tap rows of positions 0..n-1 of one sequence -> output-normed [n, H]."""
        x = x.float()
        n = x.shape[0]
        h = rms_norm(x, self.attn_norm, self.eps)
        cos, sin = rope_cos_sin(torch.arange(n), self.head_dim, self.theta, torch.float32)
        q = apply_rope((h @ self.wq.T + self.bias["q"]).view(n, self.n_head, self.head_dim), cos, sin)
        k = apply_rope((h @ self.wk.T + self.bias["k"]).view(n, self.n_head_kv, self.head_dim), cos, sin)
        v = (h @ self.wv.T + self.bias["v"]).view(n, self.n_head_kv, self.head_dim)
        rep = self.n_head // self.n_head_kv
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                             v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True)
        x = x + att.transpose(0, 1).reshape(n, -1) @ self.wo.T
        h = rms_norm(x, self.ffn_norm, self.eps)
        x = x + (F.silu(h @ self.gate.T) * (h @ self.up.T)) @ self.down.T
        return rms_norm(x, self.out_norm, self.eps)

    @torch.no_grad()
    def log_probs(self, taps: Tensor, rows: Tensor, seq_of_row: Tensor, head_rows: Tensor | None = None) -> Tensor:
        """Log-softmax of the target's logits at ``rows`` (positions) of sequences ``seq_of_row``.

        ``taps`` [S, n, H] holds each sequence's rows of this teacher's tap (rows past a
        sequence's end may be anything: attention is causal, so they never reach earlier rows);
        ``head_rows`` restricts the softmax to those vocabulary ids (the draft vocabulary)."""
        final = torch.stack([self.final_hidden(taps[s]) for s in range(taps.shape[0])])
        head = self.lm_head if head_rows is None else self.lm_head[head_rows]
        return torch.log_softmax(final[seq_of_row, rows] @ head.float().T, dim=-1)
