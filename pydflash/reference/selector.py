"""DFlash2 candidate selector and the lossless verifier, as plain torch functions.

The selector turns the drafter's per-slot logits into one proposal chain (spec section 2):

    C_j       = TopK_K(z_j)                       candidates of slot j (j = 1..B-1)
    u_j[k]    = z_j[C_j[k]]                       unary = transformed logit (mu, softcap included)
    score_j(prev, k) = u_j[k] + < P[prev] * (W_h h_j), Q[C_j[k]] >

and walks it left to right from the anchor, greedily (T <= 0) or by sampling
softmax(score / T) over the K candidates. Because the walk only ever conditions on a
candidate of the previous slot, all scores fit in a [B-1, K, K] *lattice*
(``lattice[j, p, k]`` = score of candidate k at slot j+1 given candidate p was chosen at
slot j; the first slot's rows all use the anchor). The native engine produces the same
lattice, so it is exposed here for parity checks.

Slot indexing in this module: row i of every tensor is proposal slot j = i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "CandidateSelector",
    "Proposal",
    "build_lattice",
    "greedy_verify",
    "greedy_walk",
    "rejection_sample",
    "sample_index",
    "sampled_walk",
    "sampling_probs",
    "top_k_candidates",
]


@dataclass
class Proposal:
    """One drafted chain for slots 1..B-1.

    ``q`` is the per-slot proposal distribution the verifier needs at T > 0: over the K
    candidates (``[B-1, K]``, DFlash2) or over the vocabulary (``[B-1, V]``, DFlash v1);
    ``None`` for greedy drafts. ``candidates``/``lattice`` are DFlash2 only.
    """

    tokens: Tensor  # [B-1] int64
    q: Tensor | None = None
    candidates: Tensor | None = None  # [B-1, K] int64
    indices: Tensor | None = None  # [B-1] chosen candidate index per slot
    lattice: Tensor | None = None  # [B-1, K, K]


def _prob_dtype(t: Tensor) -> torch.dtype:
    """Softmax precision: at least FP32 (the reference samples in FP32), FP64 if given FP64."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def sampling_probs(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) along the last axis (T > 0)."""
    if temperature <= 0:
        raise ValueError("sampling_probs needs temperature > 0")
    return torch.softmax(logits.to(_prob_dtype(logits)) / temperature, dim=-1)


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample_index(probs: Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw of one index from a 1-D (unnormalised) probability vector."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    u = _uniform(generator) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True)), probs.numel() - 1)


def top_k_candidates(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k ids and values per row, sorted by descending value, ties broken by lower id.

    The reference leaves candidate order unspecified; a deterministic order makes greedy
    paths reproducible (the argmax then prefers the higher unary, then the lower id).
    """
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    return ids[..., :k].contiguous(), values[..., :k].contiguous()


def build_lattice(
    candidates: Tensor,
    unary: Tensor,
    projected_hidden: Tensor,
    anchor: int,
    predecessor: Tensor,
    successor: Tensor,
) -> Tensor:
    """All transition scores: ``[N, K, K]`` for N = B-1 proposal slots.

    Args:
        candidates: ``[N, K]`` candidate ids per slot.
        unary: ``[N, K]`` transformed logits of those candidates.
        projected_hidden: ``[N, r]`` = W_h h_j for each slot's own final-normed hidden.
        anchor: the anchor token (predecessor of the first slot).
        predecessor, successor: codebooks P, Q, ``[V, r]``.
    Returns:
        ``lattice[i, p, k] = unary[i, k] + sum_r P[prev(i, p), r] * hh[i, r] * Q[C[i, k], r]``
        with ``prev(0, p) = anchor`` and ``prev(i, p) = C[i-1, p]``.
    """
    n, k = candidates.shape
    prev_ids = torch.empty_like(candidates)
    prev_ids[0] = anchor
    if n > 1:
        prev_ids[1:] = candidates[:-1]
    cond = predecessor[prev_ids] * projected_hidden[:, None, :]  # [N, K(prev), r]
    succ = successor[candidates]  # [N, K(cand), r]
    return unary[:, None, :] + torch.einsum("npr,nkr->npk", cond, succ)


def greedy_walk(lattice: Tensor, candidates: Tensor) -> tuple[Tensor, Tensor]:
    """Left-to-right argmax walk (first index of the max). Returns (tokens, indices)."""
    indices = torch.empty(lattice.shape[0], dtype=torch.int64)
    prev = 0  # slot 1: all lattice rows are equal (anchor)
    for i in range(lattice.shape[0]):
        prev = int(torch.argmax(lattice[i, prev]))
        indices[i] = prev
    return candidates.gather(1, indices[:, None])[:, 0], indices


def sampled_walk(
    lattice: Tensor, candidates: Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample k_j ~ softmax(score_j(prev, .) / T) slot by slot.

    Returns (tokens, indices, q) where ``q[i]`` is the distribution the slot was actually
    sampled from (conditional on the realised path), as the verifier needs it.
    """
    n, k = candidates.shape
    indices = torch.empty(n, dtype=torch.int64)
    q = torch.empty((n, k), dtype=_prob_dtype(lattice))
    prev = 0
    for i in range(n):
        q[i] = sampling_probs(lattice[i, prev], temperature)
        prev = sample_index(q[i], generator)
        indices[i] = prev
    return candidates.gather(1, indices[:, None])[:, 0], indices, q


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Greedy verification: accept while y_{i+1} == argmax(target row i); bonus = argmax of the next row.

    ``target_logits`` is ``[n+1, V]`` for the verify batch ``[anchor, y_1..y_n]``.
    """
    posterior = torch.argmax(target_logits, dim=-1)
    n = draft_tokens.shape[0]
    accepted = 0
    while accepted < n and int(draft_tokens[accepted]) == int(posterior[accepted]):
        accepted += 1
    return accepted, int(posterior[accepted])


def rejection_sample(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_candidates: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless residual rejection sampling of one drafted chain.

    Args:
        draft_tokens: ``[n]`` drafted tokens y_1..y_n.
        target_probs: ``[n+1, V]``; row i is the target's p for position of y_{i+1}
            (row n is the bonus row).
        draft_probs: ``[n, K]`` over ``draft_candidates`` (DFlash2) or ``[n, V]`` (v1).
        draft_candidates: ``[n, K]`` candidate ids, or None when draft_probs is full-vocab.
    Returns:
        (number of accepted drafts a, next token): the correction at the first rejection
        (drawn from normalise(max(0, p - q)), falling back to p if that has no mass), or
        the bonus drawn from row n when all drafts are accepted.
    """
    n = draft_tokens.shape[0]
    vocab = target_probs.shape[-1]
    for i in range(n):
        y = int(draft_tokens[i])
        q_full = _scatter_q(draft_probs[i], None if draft_candidates is None else draft_candidates[i], vocab)
        p_y = float(target_probs[i, y])
        if _uniform(generator) * float(q_full[y]) < p_y:  # strict "<" as in the reference
            continue
        residual = torch.clamp(target_probs[i].to(torch.float64) - q_full, min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = target_probs[i].to(torch.float64)
        return i, sample_index(residual, generator)
    return n, sample_index(target_probs[n], generator)


def _scatter_q(q_row: Tensor, candidates: Tensor | None, vocab: int) -> Tensor:
    """A proposal row as a full-vocab FP64 distribution (q is zero outside the candidates)."""
    if candidates is None:
        return q_row.to(torch.float64)
    full = torch.zeros(vocab, dtype=torch.float64)
    full.index_add_(0, candidates.to(torch.int64), q_row.to(torch.float64))
    return full


class CandidateSelector(nn.Module):
    """The selector's parameters, named as in the HF checkpoint.

    The codebooks are bare parameters, so ``state_dict()`` yields
    ``predecessor_codebook`` / ``successor_codebook`` without ``.weight``, exactly as the
    published checkpoints store them.
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def lattice(self, hidden: Tensor, logits: Tensor, anchor: int) -> tuple[Tensor, Tensor]:
        """(candidates [N, K], lattice [N, K, K]) for proposal slots' hidden [N, H] and logits [N, V]."""
        if logits.shape[-1] != self.predecessor_codebook.shape[0]:
            raise ValueError(f"logits cover {logits.shape[-1]} tokens but the selector codebooks have "
                             f"{self.predecessor_codebook.shape[0]} rows: the target vocab must match the drafter's")
        candidates, unary = top_k_candidates(logits, self.top_k)
        projected = self.hidden_projection(hidden)
        lattice = build_lattice(
            candidates, unary, projected, anchor, self.predecessor_codebook, self.successor_codebook
        )
        return candidates, lattice

    def select(
        self,
        hidden: Tensor,
        logits: Tensor,
        anchor: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Walk the lattice: greedy when temperature <= 0, sampled otherwise."""
        candidates, lattice = self.lattice(hidden, logits, anchor)
        if temperature <= 0:
            tokens, indices = greedy_walk(lattice, candidates)
            return Proposal(tokens=tokens, candidates=candidates, indices=indices, lattice=lattice)
        tokens, indices, q = sampled_walk(lattice, candidates, temperature, generator)
        return Proposal(tokens=tokens, q=q, candidates=candidates, indices=indices, lattice=lattice)
