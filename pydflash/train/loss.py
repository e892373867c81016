"""Training losses and the teacher-forced acceptance metric.

Drafter loss (DFlash recipe): slot j of a block (j = 1..B-1, same-position labels) is trained
with cross-entropy against the target's token at position s + j, weighted by
``w_j = exp(-(j - 1) / gamma)``: early slots matter most, because a draft is only as long as
its accepted prefix. Weights are normalised over the valid (in-sequence) slots of the batch.

Selector loss (DFlash2): for each slot the K candidates are the drafter's top-K tokens
(detached), the predecessor is the *true* previous token (the anchor for slot 1), and the score
of candidate k is the selector's lattice score

    score_j(k) = u_j[k] + < P[y_{j-1}] * (W_h h_j), Q[C_j[k]] >

with the unary ``u`` and the hidden ``h`` detached, so this loss trains only the codebooks P, Q
and the projection W_h. It is the cross-entropy of ``softmax_k(score_j)`` against the index of
the true token y_j among the candidates, over the slots where y_j is a candidate at all (the
selector cannot recover a token the drafter did not rank in its top K), with the same slot
weights. Teacher forcing on y_{j-1} matches what the walk sees whenever the previous draft was
accepted, which is the only case in which slot j's draft can count.

Draft vocabulary: with ``vocab_ids`` (the N kept target ids, ascending) the logits are the N
kept head rows only; the drafter loss is the softmax over those rows, the selector's top-K runs
over them and its candidates are mapped to target ids before anything reads them (codebook rows,
comparisons with labels), exactly as the native engine drafts with a ``d2t`` drafter. Every
function takes its slots as any leading shape (``[N, B-1]`` blocks or ``[M]`` gathered rows);
``weights`` broadcasts against the labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from ..reference.selector import CandidateSelector, top_k_candidates

__all__ = ["LossParts", "slot_weights", "drafter_loss", "selector_loss", "greedy_acceptance"]


def slot_weights(block_size: int, gamma: float) -> Tensor:
    """``[B-1]`` weights exp(-(j-1)/gamma) for slots j = 1..B-1."""
    j = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(j - 1) / gamma)


@dataclass
class LossParts:
    total: Tensor
    drafter: Tensor
    selector: Tensor


def drafter_loss(logits: Tensor, labels: Tensor, valid: Tensor, weights: Tensor) -> Tensor:
    """Position-decayed CE. ``logits`` [..., V], ``labels``/``valid`` [...] (labels are column
    indices of ``logits``: draft ids with a draft vocabulary), ``weights`` broadcasting to [...]
    ([B-1] per slot for [N, B-1] blocks, [M] per row for gathered rows)."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).clamp(min=0),
                         reduction="none").view(labels.shape)
    w = weights * valid
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


def copy_loss(probs: Tensor, rows: Tensor, counted: Tensor) -> Tensor:
    """Attention supervision of one "copy" head: -log of the attention mass that slot 1 puts on the
    context rows ``rows`` (``Batch.copy_rows``: the earlier rows ending the longest match of the
    anchor's last tokens, or the rows after them), averaged over the ``counted`` blocks that have
    such a row.

    Why: the target's continuations repeat themselves (on held-out code, the latest earlier match of
    the last tokens predicts the next one more often than the drafter does), yet no head of a
    trained drafter attends to those rows: the hard labels alone do not teach it to look them up.
    A row j ending such a match carries the target's prediction for j + 1, which is the copy.
    ``probs`` [S, A, n] (``forward_blocks(probe=...)``), ``rows`` [S, A, n] bool, ``counted`` [S, A]
    bool."""
    has = rows.any(-1) & counted
    if not bool(has.any()):
        return probs.sum() * 0.0
    mass = (probs.float() * rows).sum(-1)[has]
    return -torch.log(mass.clamp(min=1e-6)).mean()


def selector_loss(selector: CandidateSelector, hidden: Tensor, logits: Tensor, prev_tokens: Tensor,
                  labels: Tensor, valid: Tensor, weights: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
    """Candidate-lattice CE (module docstring). hidden [..., H], logits [..., V] (V = N draft rows
    when ``vocab_ids`` maps them to target ids), prev_tokens/labels/valid [...] (target ids)."""
    unary, cands = torch.topk(logits.detach(), selector.top_k, dim=-1)  # [..., K]
    if vocab_ids is not None:
        cands = vocab_ids[cands]
    proj = selector.hidden_projection(hidden.detach())  # [..., r]
    cond = selector.predecessor_codebook[prev_tokens.clamp(min=0)] * proj  # [..., r]
    succ = selector.successor_codebook[cands]  # [..., K, r]
    scores = unary.float() + torch.einsum("...r,...kr->...k", cond, succ).float()
    hit = cands == labels[..., None]
    present = hit.any(-1) & valid
    target = hit.float().argmax(-1)
    ce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1), reduction="none").view(labels.shape)
    w = weights[None, :] * present
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


@torch.no_grad()
def greedy_acceptance(selector: CandidateSelector | None, hidden: Tensor, logits: Tensor, anchors_tok: Tensor,
                      labels: Tensor, valid: Tensor, vocab_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Teacher-forced greedy drafting of each block, compared with the target's tokens.

    Walks the selector lattice greedily (argmax of each slot for a v1 drafter) exactly as the
    engine does, then counts the accepted prefix. With ``vocab_ids`` the logits are the draft
    rows: top-K (ties to the lower draft id = the lower target id, ids being ascending) and argmax
    run over them and picks are mapped to target ids, as the engine drafts with a ``d2t`` file.
    Returns (accepted drafts per block [N], per-slot "accepted up to here" counts [B-1]);
    tau = 1 + mean accepted.
    """
    n, slots, _ = logits.shape
    if selector is None:
        drafts = logits.argmax(-1)
        if vocab_ids is not None:
            drafts = vocab_ids[drafts]
    else:
        cands, unary = top_k_candidates(logits, selector.top_k)
        if vocab_ids is not None:
            cands = vocab_ids[cands]
        proj = selector.hidden_projection(hidden)
        succ = selector.successor_codebook[cands]  # [N, S, K, r]
        drafts = torch.empty(n, slots, dtype=torch.int64)
        prev = anchors_tok.clone()
        for j in range(slots):
            cond = selector.predecessor_codebook[prev] * proj[:, j]  # [N, r]
            score = unary[:, j] + torch.einsum("nr,nkr->nk", cond, succ[:, j])
            pick = cands[:, j].gather(1, score.argmax(-1, keepdim=True))[:, 0]
            drafts[:, j] = pick
            prev = pick
    ok = (drafts == labels) & valid
    prefix = torch.cumprod(ok.long(), dim=1)
    return prefix.sum(1), prefix.sum(0)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
