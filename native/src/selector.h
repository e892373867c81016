// The DFlash2 candidate selector on the host (spec §2, "CPU lattice" variant (c)).
//
// Per proposal slot j = 1..n-1 of one block:
//
//     C_j           = TopK_K(z_j)                  sorted by descending logit, ties -> lower id
//
// With a reduced draft vocabulary z_j covers the N draft ids only; candidates are mapped to
// target ids through d2t before anything else reads them (codebooks, q, tokens), and ties
// are broken by the lower *target* id, so the result equals the full-vocabulary selector run
// on logits that are -inf outside the draft vocabulary.
//     u_j[k]        = z_j[C_j[k]]                  unary = transformed logit (mu, softcap included)
//     score_j(p, k) = u_j[k] + sum_r P[prev(j,p), r] * hh_j[r] * Q[C_j[k], r],   hh_j = W_h h_j
//
// with prev(1, p) = anchor and prev(j, p) = C_{j-1}[p]. All scores of a block fit in a
// [n-1, K, K] lattice; the walk goes left to right through it (greedy: first index of the max;
// sampled: k ~ softmax(score / T) over the K candidates, q recorded per slot).
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace dflash {

// One drafted chain for slots 1..n-1 of a block.
struct Proposal {
    std::vector<int32_t> tokens;      // [n-1]
    std::vector<int32_t> candidates;  // [n-1, K] (DFlash2; empty for v1)
    std::vector<int32_t> indices;     // [n-1] chosen candidate per slot (DFlash2) or the chosen
                                      // draft-vocabulary id (v1)
    std::vector<float>   q;           // [n-1, K] (DFlash2) or [n-1, N] (v1, over the draft
                                      // vocabulary): the distribution each slot was drawn from;
                                      // one-hot on greedy walks
    std::vector<float>   lattice;     // [n-1, K, K] (DFlash2)
    int32_t              q_width = 0; // K or V
};

// Reads row `id` of a [V, r] codebook as r floats into `out` (dequantizing if needed).
using CodebookRow = std::function<void(int32_t id, float * out)>;

struct SelectorInputs {
    int32_t       n_slots;    // n-1 proposal slots
    int32_t       n_vocab;    // logits row width: the draft vocabulary size N
    int32_t       rank;       // r
    int32_t       top_k;      // K
    const float * logits;     // [n_slots, N]: slot j's transformed logits at row j-1
    const float * projected;  // [n_slots, r]: W_h h_j
    int32_t       anchor;
    const int32_t * d2t = nullptr;  // draft id -> target id (nullptr: identity)
};

// Top-K ids of one logits row: descending value, ties broken by the lower id (the lower
// d2t[id] when a map is given). Returns row indices (draft ids).
std::vector<int32_t> top_k_ids(const float * logits, int32_t n_vocab, int32_t k, const int32_t * d2t = nullptr);

// Candidates [n_slots, K] and the full lattice [n_slots, K, K] (scores accumulated in double).
void build_lattice(const SelectorInputs & in, const CodebookRow & predecessor, const CodebookRow & successor,
                   Proposal & out);

// Walk a built lattice: temperature <= 0 greedy, else sampled with `rng`.
void walk_lattice(Proposal & p, int32_t top_k, float temperature, std::mt19937_64 & rng);

// DFlash v1: each slot independently, argmax (T <= 0) or a draw from softmax(z / T) over the
// draft vocabulary (N = n_vocab logits per slot); tokens are mapped through d2t (nullptr: identity).
Proposal propose_independent(const float * logits, int32_t n_slots, int32_t n_vocab, float temperature,
                             std::mt19937_64 & rng, const int32_t * d2t = nullptr);

}  // namespace dflash
