"""PyTorch reference of the DFlash v1 and DFlash2 drafters (spec sections 1-2).

Written for clarity and exactness, not speed: one sequence, one block, explicit attention,
any float dtype (run it in float64 to get a gold reference for the native engine).

Data flow for one drafting round with anchor token x_s at position s:

    g_p   = RMSNorm(W_fc F_p; hidden_norm)                    fused target features, one per context row
    h^0_i = E[x_i] * alpha,  x = [x_s, MASK, ..., MASK]       E = the target's raw embedding rows
    per layer:  a = norm(h); [conv_0]; attention over [K/V(g) ; K/V(a')]; [conv_1]; residual
                m = norm(h); [conv_0]; SwiGLU;                              [conv_1]; residual
    h^fin = RMSNorm(h; norm);  z = mu * (W_out h^fin), softcapped        W_out = the target's lm_head

The drafter does not own the embedding matrix or the head: both come in through
:class:`TargetWeights`. Parameter names (``state_dict()``) are exactly the HF checkpoint
names, so checkpoints load with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import DFlashConfig, normalize_hf_name
from .selector import CandidateSelector, Proposal, sample_index, sampling_probs

__all__ = [
    "DFlashDrafter",
    "GroupedDynamicCausalConv",
    "TargetWeights",
    "apply_rope",
    "grouped_dynamic_causal_conv",
    "rms_norm",
    "rope_cos_sin",
]

ArrayLike = Any  # numpy array, torch tensor or nested sequence


# --- small functional pieces -----------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (statistics in >= FP32, like HF Qwen3)."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """NeoX-style (rotate-half) RoPE tables ``[n, head_dim]``; angles computed in FP64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [n, heads, d] by per-row tables [n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def grouped_dynamic_causal_conv(z: Tensor, coeff: Tensor, base: Tensor, group_size: int) -> Tensor:
    """Block-local causal depthwise conv with per-row, per-group dynamic taps.

    ``out[i, c] = sum_t (base[t, c] + coeff[i, t, c // S]) * z[i - t, c]`` with z[<0] = 0.

    Args:
        z: ``[B, H]`` one block's rows (slot 0 = anchor first).
        coeff: ``[B, T, G]`` dynamic coefficients of ONE side, produced at the output row.
        base: ``[T, H]`` that side's base kernel.
        group_size: S, channels per group; group g owns channels g*S .. g*S+S-1.
    """
    n_rows = z.shape[0]
    weight = base[None, :, :].to(z.dtype) + coeff.repeat_interleave(group_size, dim=-1)  # [B, T, H]
    out = torch.zeros_like(z)
    for t in range(min(base.shape[0], n_rows)):  # taps at or past the block length only see padding
        shifted = z if t == 0 else torch.cat([z.new_zeros(t, z.shape[1]), z[:-t]], dim=0)
        out = out + weight[:, t] * shifted
    return out


# --- modules, named after the HF checkpoint --------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class GroupedDynamicCausalConv(nn.Module):
    """One conv site (``attention_conv`` or ``mlp_conv``): base kernel [2, T, H] + coefficient projection.

    Coefficients are computed once from the sublayer's normed input; side 0 feeds the conv
    before the sublayer, side 1 the conv after it.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def coefficients(self, normed: Tensor) -> Tensor:
        """``[B, 2, T, G]``: flat projection index side*T*G + t*G + g."""
        n_rows, hidden = normed.shape
        return self.kernel_projection(normed).view(n_rows, 2, self.kernel_size, hidden // self.group_size)

    def conv(self, z: Tensor, coeffs: Tensor, side: int) -> Tensor:
        return grouped_dynamic_causal_conv(z, coeffs[:, side], self.base_kernel[side], self.group_size)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.n_head, self.n_head_kv = d, nh, nkv
        self.q_proj = nn.Linear(cfg.hidden_size, nh * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K = RoPE(k_norm(W_k x)), V = W_v x, both ``[n, n_kv, d]`` (context and block rows alike)."""
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.n_head_kv, self.head_dim))
        v = self.v_proj(x).view(x.shape[0], self.n_head_kv, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, ctx: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        """Block rows ``x`` [B, H] attend to [context ; block]; ``rope`` covers context rows then block rows."""
        cos, sin = rope
        n_ctx, n_blk = ctx.shape[0], x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n_blk, self.n_head, self.head_dim))
        q = apply_rope(q, cos[n_ctx:], sin[n_ctx:])
        k, v = self.keys_values(torch.cat([ctx, x], dim=0), cos, sin)
        rep = self.n_head // self.n_head_kv  # GQA: q head h reads kv head h // rep
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("bhd,nhd->hbn", q, k) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores.to(_acc_dtype(scores)), dim=-1).to(v.dtype)
        out = torch.einsum("hbn,nhd->bhd", probs, v).reshape(n_blk, self.n_head * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Qwen3 layer whose attention also reads the context K/V; DFlash2 wraps both sublayers in convs."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv: GroupedDynamicCausalConv | None = None
        self.mlp_conv: GroupedDynamicCausalConv | None = None
        if cfg.is_dflash2:
            assert cfg.conv_kernel_size is not None and cfg.conv_group_size is not None
            self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h: Tensor, ctx: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:
        a = self.input_layernorm(h)
        if self.attention_conv is not None:
            coeffs = self.attention_conv.coefficients(a)
            a = self.attention_conv.conv(a, coeffs, 0)
        o = self.self_attn(a, ctx, rope, mask)
        if self.attention_conv is not None:
            o = self.attention_conv.conv(o, coeffs, 1)
        h = h + o

        m = self.post_attention_layernorm(h)
        if self.mlp_conv is not None:
            coeffs = self.mlp_conv.coefficients(m)
            m = self.mlp_conv.conv(m, coeffs, 0)
        f = self.mlp(m)
        if self.mlp_conv is not None:
            f = self.mlp_conv.conv(f, coeffs, 1)
        return h + f


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# --- the target's borrowed weights ----------------------------------------------------


@dataclass
class TargetWeights:
    """The target's raw token embedding ``[V, H]`` and lm_head ``[V, H]`` (HF layout)."""

    embed_tokens: Tensor
    lm_head: Tensor

    @classmethod
    def from_arrays(
        cls, embed_tokens: ArrayLike, lm_head: ArrayLike | None = None, dtype: torch.dtype = torch.float32
    ) -> TargetWeights:
        """From numpy/torch arrays; ``lm_head=None`` means tied embeddings."""
        embed = torch.as_tensor(np.asarray(embed_tokens) if not isinstance(embed_tokens, Tensor) else embed_tokens)
        head = embed if lm_head is None else torch.as_tensor(
            np.asarray(lm_head) if not isinstance(lm_head, Tensor) else lm_head
        )
        if embed.ndim != 2 or head.ndim != 2 or embed.shape[1] != head.shape[1]:
            raise ValueError(f"expected [V, H] matrices, got embed {tuple(embed.shape)} and head {tuple(head.shape)}")
        return cls(embed.to(dtype), head.to(dtype))

    @classmethod
    def from_gguf(cls, path: str | PathLike[str], dtype: torch.dtype = torch.float32) -> TargetWeights:
        """Dequantize ``token_embd.weight`` and ``output.weight`` (tied if absent) from a target GGUF."""
        from ..formats.convert import read_gguf_header, read_gguf_tensor  # numpy + gguf only

        header = read_gguf_header(path)
        if "token_embd.weight" not in header.tensors:
            raise ValueError(f"target GGUF {path} has no token_embd.weight")
        embed = read_gguf_tensor(header, "token_embd.weight")
        head = read_gguf_tensor(header, "output.weight") if "output.weight" in header.tensors else None
        return cls.from_arrays(embed, head, dtype)

    def to(self, dtype: torch.dtype) -> TargetWeights:
        return TargetWeights(self.embed_tokens.to(dtype), self.lm_head.to(dtype))


# --- the drafter ---------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """DFlash v1 / DFlash2 drafter (DFlash2 iff ``config.is_dflash2``)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.candidate_selector: CandidateSelector | None = None
        if config.is_dflash2:
            assert config.selector_rank is not None and config.selector_top_k is not None
            self.candidate_selector = CandidateSelector(
                config.vocab_size, config.hidden_size, config.selector_rank, config.selector_top_k
            )

    # --- construction ---

    @classmethod
    def from_config(
        cls, config: DFlashConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | None = None
    ) -> DFlashDrafter:
        """A drafter with seeded random weights (the same values for every dtype).

        Scales keep activations O(1): matrices ~ N(0, 1/fan_in), norm weights ~ 1 + 0.1 N,
        conv tap 0 ~ 1 + 0.1 N and later taps ~ 0.1 N, codebooks ~ N(0, 1/sqrt(r)).
        ``device="meta"`` builds the module without allocating weights (shape checks).
        """
        if device == "meta":
            with torch.device("meta"):
                return cls(config).to(dtype)
        model = cls(config).to(torch.float64)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_init_value(name, tuple(p.shape), gen))
        return model.to(dtype)

    @classmethod
    def from_pretrained(cls, model_dir: str | PathLike[str], dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        """Load ``config.json`` + ``*.safetensors`` from an HF DFlash / DFlash2 checkpoint directory.

        Accepts names with or without a ``model.`` prefix and codebooks with or without
        ``.weight``; ignores shipped ``embed_tokens`` / ``lm_head`` (the target's are used).
        """
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = DFlashConfig.from_pretrained(model_dir)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        state: dict[str, Tensor] = {}
        for f in files:
            for name, t in load_file(str(f)).items():
                state[normalize_hf_name(name)] = t
        for name in ("embed_tokens.weight", "lm_head.weight"):
            state.pop(name, None)
        model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {model_dir} does not match its config ({config.architecture}): "
                f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        return model.to(dtype)

    def set_identity_convs(self) -> None:
        """Make every conv the identity (W_cv = 0, tap 0 = 1, later taps = 0): the layer becomes DFlash v1."""
        with torch.no_grad():
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    if conv is not None:
                        conv.kernel_projection.weight.zero_()
                        conv.base_kernel.zero_()
                        conv.base_kernel[:, 0, :] = 1.0

    # --- forward pieces ---

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def _tensor(self, x: ArrayLike, dtype: torch.dtype | None = None) -> Tensor:
        t = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
        return t.to(self.dtype if dtype is None else dtype)

    def fuse_context(self, context_features: ArrayLike) -> Tensor:
        """g = RMSNorm(W_fc F; hidden_norm) for feature rows ``[n, L*H]``."""
        feats = self._tensor(context_features).reshape(-1, self.fc.in_features)
        return self.hidden_norm(self.fc(feats))

    def embed(self, tokens: ArrayLike, target: TargetWeights) -> Tensor:
        """h^0 = E[x] * input_embedding_scale (the target's raw rows, no target embed scale)."""
        ids = self._tensor(tokens, torch.int64)
        return target.embed_tokens.to(self.dtype)[ids] * self.config.embedding_scale

    def logits(self, hidden: Tensor, target: TargetWeights) -> Tensor:
        """z = mu * (W_out h); if softcap c > 0: z = c * tanh(z / c)."""
        z = (hidden @ target.lm_head.to(hidden.dtype).T) * self.config.logit_scale
        c = self.config.softcap
        return c * torch.tanh(z / c) if c > 0 else z

    def attention_mask(self, layer: int, ctx_pos: Tensor, blk_pos: Tensor) -> Tensor:
        """``[B, n_ctx + B]`` visibility: non-causal unless the layer is causal; sliding window on positions."""
        k_pos = torch.cat([ctx_pos, blk_pos])[None, :]
        q_pos = blk_pos[:, None]
        visible = torch.ones(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool)
        causal = self.config.layer_is_causal(layer)
        if causal:
            visible &= k_pos <= q_pos
        window = self.config.layer_window(layer)
        if window is not None:
            visible &= (q_pos - k_pos) < window
            if not causal:
                visible &= (k_pos - q_pos) < window
        return visible

    def forward_block(
        self,
        context_features: ArrayLike,
        context_positions: ArrayLike,
        block_tokens: ArrayLike,
        block_start_pos: int,
        target: TargetWeights,
    ) -> tuple[Tensor, Tensor]:
        """Run one block without autograd (see :meth:`forward` for the arguments).

        Returns (final-normed hidden ``[B, H]``, transformed logits ``[B, V]``) in the model dtype.
        """
        with torch.no_grad():
            return self.forward(context_features, context_positions, block_tokens, block_start_pos, target)

    def forward(
        self,
        context_features: ArrayLike,
        context_positions: ArrayLike,
        block_tokens: ArrayLike,
        block_start_pos: int,
        target: TargetWeights,
    ) -> tuple[Tensor, Tensor]:
        """Run one block (differentiable).

        Args:
            context_features: ``[n_ctx, L*H]`` target features F_p of the committed rows
                (layer k at column offset k*H; n_ctx may be 0).
            context_positions: ``[n_ctx]`` each row's own absolute position.
            block_tokens: ``[B]`` = [anchor, MASK, ..., MASK].
            block_start_pos: position s of the anchor; slot i sits at s + i.
            target: the target's embedding rows and lm_head.
        Returns:
            (final-normed hidden ``[B, H]``, transformed logits ``[B, V]``), in the model dtype.
        """
        if self.config.rope_scaling:
            raise NotImplementedError(f"rope scaling {dict(self.config.rope_scaling)} is not implemented")
        ctx_pos = self._tensor(context_positions, torch.int64).reshape(-1)
        ctx = self.fuse_context(context_features)
        if ctx.shape[0] != ctx_pos.shape[0]:
            raise ValueError(f"{ctx.shape[0]} context feature rows but {ctx_pos.shape[0]} positions")
        h = self.embed(block_tokens, target).reshape(-1, self.config.hidden_size)
        blk_pos = block_start_pos + torch.arange(h.shape[0], dtype=torch.int64)
        rope = rope_cos_sin(torch.cat([ctx_pos, blk_pos]), self.config.head_dim, self.config.rope_theta, self.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, rope, self.attention_mask(i, ctx_pos, blk_pos))
        hidden = self.norm(h)
        return hidden, self.logits(hidden, target)

    @torch.no_grad()
    def propose(
        self,
        hidden: Tensor,
        logits: Tensor,
        anchor: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Draft tokens for slots 1..B-1 from a block's outputs (slot 0 = anchor is skipped).

        DFlash2 runs the candidate selector; v1 takes each slot's argmax (T <= 0) or samples
        softmax(z / T) over the full vocabulary independently per slot.
        """
        hidden, logits = hidden[1:], logits[1:]
        if self.candidate_selector is not None:
            return self.candidate_selector.select(hidden, logits, int(anchor), temperature, generator)
        if temperature <= 0:
            return Proposal(tokens=torch.argmax(logits, dim=-1))
        q = sampling_probs(logits, temperature)
        tokens = torch.tensor([sample_index(row, generator) for row in q], dtype=torch.int64)
        return Proposal(tokens=tokens, q=q)

    def draft(
        self,
        context_features: ArrayLike,
        context_positions: ArrayLike,
        anchor: int,
        anchor_pos: int,
        target: TargetWeights,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        block_size: int | None = None,
    ) -> Proposal:
        """One full drafting round: block [anchor, MASK * (B-1)] at anchor_pos, then :meth:`propose`."""
        if self.config.mask_token_id is None:
            raise ValueError("config has no mask_token_id")
        n = self.config.block_size if block_size is None else block_size
        tokens = torch.full((n,), self.config.mask_token_id, dtype=torch.int64)
        tokens[0] = int(anchor)
        hidden, logits = self.forward_block(context_features, context_positions, tokens, anchor_pos, target)
        return self.propose(hidden, logits, anchor, temperature, generator)


def _init_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Seeded FP64 initial value for parameter ``name`` (see :meth:`DFlashDrafter.from_config`)."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float64)
    if name.endswith("base_kernel"):
        value = 0.1 * noise
        value[:, 0, :] += 1.0
        return value
    if len(shape) == 1:  # norm weights
        return 1.0 + 0.1 * noise
    if name.endswith("codebook"):
        return noise / math.sqrt(math.sqrt(shape[1]))
    if name.endswith("kernel_projection.weight"):
        return 0.1 * noise / math.sqrt(shape[1])
    return noise / math.sqrt(shape[1])


def parameter_names(config: DFlashConfig) -> Iterable[str]:
    """The HF tensor names of a drafter with this config (no weights allocated)."""
    return DFlashDrafter.from_config(config, device="meta").state_dict().keys()
