"""Many training blocks at once through the reference drafter's own modules.

``DFlashDrafter.forward`` runs one block against one context; training needs dozens of blocks
per step drawn from a few sequences. This module evaluates exactly the same math (same
parameters, same sub-modules) for ``A`` anchors of each of ``S`` padded sequences in one pass:

* the fused context ``g = RMSNorm(W_fc F)`` and its per-layer K/V are computed once per sequence,
  for the rows below its batch's largest anchor only (no block reads the others);
* block ``a`` of sequence ``s`` (anchor at position ``anchors[s, a]``) attends to the context
  rows at positions ``< anchor`` plus all rows of its own block (non-causal), as at inference.

``tests/test_train.py`` checks it against ``DFlashDrafter.forward`` block by block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..reference.model import DFlashDrafter, TargetWeights, apply_rope, rope_cos_sin

__all__ = ["check_trainable", "forward_blocks", "batched_conv"]


def check_trainable(model: DFlashDrafter) -> None:
    """The batched path covers full, non-causal attention without rope scaling (our drafters)."""
    cfg = model.config
    if cfg.rope_scaling:
        raise ValueError("training a drafter with rope scaling is not supported")
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_is_causal(i) or cfg.layer_window(i) is not None:
            raise ValueError(f"layer {i} is causal or sliding: training supports full non-causal drafter layers")


def batched_conv(z: Tensor, coeff: Tensor, base: Tensor, group_size: int) -> Tensor:
    """``grouped_dynamic_causal_conv`` over ``[N, B, H]`` blocks (padding at each block's start).

    ``coeff`` is ``[N, B, T, G]`` (one side), ``base`` ``[T, H]``.
    """
    n_rows = z.shape[1]
    weight = base[None, None].to(z.dtype) + coeff.repeat_interleave(group_size, dim=-1)  # [N, B, T, H]
    out = weight[:, :, 0] * z
    for t in range(1, min(base.shape[0], n_rows)):
        shifted = torch.cat([z.new_zeros(z.shape[0], t, z.shape[2]), z[:, :-t]], dim=1)
        out = out + weight[:, :, t] * shifted
    return out


def _layer(layer, h: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_visible: Tensor, rope_blk: tuple[Tensor, Tensor],
           n_anchor: int, probe_heads: Sequence[int] = ()) -> tuple[Tensor, list[Tensor]]:
    """One decoder layer for blocks ``h`` [S*A, B, H] (see ``DecoderLayer.forward``); ``ctx_k`` /
    ``ctx_v`` [S, n, kv, d], ``ctx_visible`` [S*A, n]. Also returns, for each of ``probe_heads``,
    that query head's attention weights from slot 1 over the context rows, [S, A, n]."""
    attn = layer.self_attn
    n_blocks, blk, hidden = h.shape
    a = layer.input_layernorm(h)
    conv = layer.attention_conv
    if conv is not None:
        coeffs = conv.kernel_projection(a).view(n_blocks, blk, 2, conv.kernel_size, hidden // conv.group_size)
        a = batched_conv(a, coeffs[:, :, 0], conv.base_kernel[0], conv.group_size)
    cos, sin = rope_blk  # [S*A, B, d]
    q = attn.q_norm(attn.q_proj(a).view(n_blocks, blk, attn.n_head, attn.head_dim))
    q = _rope(q, cos, sin)
    kb = attn.k_norm(attn.k_proj(a).view(n_blocks, blk, attn.n_head_kv, attn.head_dim))
    kb = _rope(kb, cos, sin)
    vb = attn.v_proj(a).view(n_blocks, blk, attn.n_head_kv, attn.head_dim)
    n_seq, n_ctx, n_kv, d = ctx_k.shape
    rep = attn.n_head // n_kv
    # Query head kv*rep + r reads KV head kv. Context keys are shared by the A blocks of a sequence,
    # so scores are batched per (sequence, KV head) against the one copy of them: no per-block or
    # per-query-head copies of K/V. Layout of every score tensor: [S, kv, A, B, rep, keys].
    q6 = q.view(n_seq, n_anchor, blk, n_kv, rep, d) * d**-0.5
    kb6 = kb.view(n_seq, n_anchor, blk, n_kv, d)
    s_ctx = torch.einsum("sabkrd,snkd->skabrn", q6, ctx_k)
    s_blk = torch.einsum("sabkrd,sackd->skabrc", q6, kb6)
    hidden_ctx = ~ctx_visible.view(n_seq, 1, n_anchor, 1, 1, n_ctx)
    s_ctx = s_ctx.masked_fill(hidden_ctx, float("-inf"))
    probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)
    p_ctx, p_blk = probs[..., :n_ctx], probs[..., n_ctx:]
    probes = [p_ctx[:, head // rep, :, 1, head % rep, :] for head in probe_heads]
    o = (torch.einsum("skabrn,snkd->sabkrd", p_ctx, ctx_v)
         + torch.einsum("skabrc,sackd->sabkrd", p_blk, vb.view(n_seq, n_anchor, blk, n_kv, d)))
    o = attn.o_proj(o.reshape(n_blocks, blk, attn.n_head * d))
    if conv is not None:
        o = batched_conv(o, coeffs[:, :, 1], conv.base_kernel[1], conv.group_size)
    h = h + o

    m = layer.post_attention_layernorm(h)
    conv = layer.mlp_conv
    if conv is not None:
        coeffs = conv.kernel_projection(m).view(n_blocks, blk, 2, conv.kernel_size, hidden // conv.group_size)
        m = batched_conv(m, coeffs[:, :, 0], conv.base_kernel[0], conv.group_size)
    f = layer.mlp(m)
    if conv is not None:
        f = batched_conv(f, coeffs[:, :, 1], conv.base_kernel[1], conv.group_size)
    return h + f, probes


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on ``[N, B, heads, d]`` with tables ``[N, B, d]``."""
    n, b = x.shape[:2]
    return apply_rope(x.reshape(n * b, *x.shape[2:]), cos.reshape(n * b, -1), sin.reshape(n * b, -1)).view(x.shape)


def forward_blocks(model: DFlashDrafter, features: Tensor, block_tokens: Tensor, anchors: Tensor,
                   target: TargetWeights, *, with_logits: bool = True,
                   probe: tuple[int | Sequence[int], list[Tensor]] | None = None) -> tuple[Tensor, Tensor | None]:
    """Final-normed hidden (and logits) of ``S*A`` blocks.

    Args:
        features: ``[S, n, L*H]`` target features of S sequences (padded rows may hold anything:
            a block only sees context positions below its anchor).
        block_tokens: ``[S, A, B]`` block inputs ([anchor, MASK, ...]).
        anchors: ``[S, A]`` anchor positions (the block of anchor s sits at s .. s+B-1; it sees
            context rows 0 .. s-1).
        probe: ``(heads, out)``: appends to ``out`` the last layer's attention weights of each
            query head in ``heads`` (one int or several) from slot 1 over the context rows,
            ``[S, A, n]`` each (n = the rows read).
    Returns:
        (hidden ``[S, A, B, H]``, logits ``[S, A, B, V]`` or None).
    """
    cfg = model.config
    n_seq, n_anchor, blk = block_tokens.shape
    # no block sees a context row at or past its anchor: rows >= the largest anchor are never read
    n_ctx = min(features.shape[1], max(1, int(anchors.max())))
    features = features[:, :n_ctx]
    dtype = model.dtype
    g = model.hidden_norm(model.fc(features.to(dtype)))  # [S, n, H]
    ctx_pos = torch.arange(n_ctx, dtype=torch.int64)
    ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, cfg.head_dim, cfg.rope_theta, dtype)
    blk_pos = anchors.reshape(-1, 1) + torch.arange(blk, dtype=torch.int64)[None, :]  # [S*A, B]
    cos, sin = rope_cos_sin(blk_pos.reshape(-1), cfg.head_dim, cfg.rope_theta, dtype)
    rope_blk = (cos.view(n_seq * n_anchor, blk, -1), sin.view(n_seq * n_anchor, blk, -1))
    ctx_visible = ctx_pos[None, :] < anchors.reshape(-1, 1)  # [S*A, n]

    h = model.embed(block_tokens.reshape(-1, blk), target)  # [S*A, B, H]
    heads: Sequence[int] = () if probe is None else ((probe[0],) if isinstance(probe[0], int) else tuple(probe[0]))
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        k = attn.k_norm(attn.k_proj(g).view(n_seq, n_ctx, attn.n_head_kv, attn.head_dim))
        k = apply_rope(k.reshape(n_seq * n_ctx, attn.n_head_kv, -1),
                       ctx_cos.repeat(n_seq, 1), ctx_sin.repeat(n_seq, 1)).view(k.shape)
        v = attn.v_proj(g).view(n_seq, n_ctx, attn.n_head_kv, attn.head_dim)
        last = i == len(model.layers) - 1
        h, probs = _layer(layer, h, k, v, ctx_visible, rope_blk, n_anchor, heads if last else ())
        if probe is not None:
            probe[1].extend(probs)
    hidden = model.norm(h)
    logits = model.logits(hidden, target) if with_logits else None
    shape = (n_seq, n_anchor, blk)
    return hidden.view(*shape, -1), None if logits is None else logits.view(*shape, -1)
