#include "selector.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dflash {

namespace {

// Index drawn from unnormalised probabilities by inverse CDF (the reference's sample_index).
int32_t sample_index(const double * probs, int32_t n, std::mt19937_64 & rng) {
    double total = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        total += probs[i];
    }
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng) * total;
    double cdf = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        cdf += probs[i];
        if (u < cdf) {
            return i;
        }
    }
    return n - 1;
}

// softmax(x / T) in double, written as floats to `q`; returns the draw.
int32_t softmax_draw(const float * x, int32_t n, float temperature, std::mt19937_64 & rng, float * q) {
    std::vector<double> p(n);
    const double mx = *std::max_element(x, x + n);
    double sum = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        p[i] = std::exp((double(x[i]) - mx) / temperature);
        sum += p[i];
    }
    for (int32_t i = 0; i < n; ++i) {
        p[i] /= sum;
        q[i] = float(p[i]);
    }
    return sample_index(p.data(), n, rng);
}

int32_t first_argmax(const float * x, int32_t n) { return int32_t(std::max_element(x, x + n) - x); }

// argmax with ties going to the lower target id d2t[i]
int32_t argmax_mapped(const float * x, int32_t n, const int32_t * d2t) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i) {
        if (x[i] > x[best] || (x[i] == x[best] && d2t[i] < d2t[best])) {
            best = i;
        }
    }
    return best;
}

}  // namespace

std::vector<int32_t> top_k_ids(const float * logits, int32_t n_vocab, int32_t k, const int32_t * d2t) {
    std::vector<int32_t> ids(n_vocab);
    std::iota(ids.begin(), ids.end(), 0);
    k = std::min(k, n_vocab);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [logits, d2t](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && (d2t ? d2t[a] < d2t[b] : a < b));
    });
    ids.resize(k);
    return ids;
}

void build_lattice(const SelectorInputs & in, const CodebookRow & predecessor, const CodebookRow & successor,
                   Proposal & out) {
    const int32_t n = in.n_slots, K = in.top_k, r = in.rank;
    out.candidates.assign(size_t(n) * K, 0);
    out.lattice.assign(size_t(n) * K * K, 0.0f);
    out.q_width = K;

    std::vector<float> succ(size_t(K) * r), pred(size_t(K) * r), cond(r);
    for (int32_t j = 0; j < n; ++j) {
        const float * z  = in.logits + size_t(j) * in.n_vocab;
        const float * hh = in.projected + size_t(j) * r;
        const std::vector<int32_t> rows = top_k_ids(z, in.n_vocab, K, in.d2t);  // draft ids
        int32_t * cand = out.candidates.data() + size_t(j) * K;                 // target ids
        for (int32_t k = 0; k < K; ++k) {
            cand[k] = in.d2t ? in.d2t[rows[k]] : rows[k];
            successor(cand[k], succ.data() + size_t(k) * r);
        }
        // predecessor rows: the anchor for the first slot (all K rows equal), else the previous candidates
        const int32_t n_prev = j == 0 ? 1 : K;
        for (int32_t p = 0; p < n_prev; ++p) {
            predecessor(j == 0 ? in.anchor : out.candidates[size_t(j - 1) * K + p], pred.data() + size_t(p) * r);
        }
        for (int32_t p = 0; p < K; ++p) {
            const float * P = pred.data() + size_t(j == 0 ? 0 : p) * r;
            for (int32_t i = 0; i < r; ++i) {
                cond[i] = P[i] * hh[i];
            }
            float * row = out.lattice.data() + (size_t(j) * K + p) * K;
            for (int32_t k = 0; k < K; ++k) {
                const float * Q = succ.data() + size_t(k) * r;
                double acc = 0.0;
                for (int32_t i = 0; i < r; ++i) {
                    acc += double(cond[i]) * double(Q[i]);
                }
                row[k] = float(double(z[rows[k]]) + acc);
            }
        }
    }
}

void walk_lattice(Proposal & p, int32_t top_k, float temperature, std::mt19937_64 & rng) {
    const int32_t K = top_k;
    const int32_t n = int32_t(p.candidates.size() / size_t(K));
    p.tokens.assign(n, 0);
    p.indices.assign(n, 0);
    p.q.assign(size_t(n) * K, 0.0f);
    int32_t prev = 0;  // first slot: every lattice row holds the anchor's scores
    for (int32_t j = 0; j < n; ++j) {
        const float * scores = p.lattice.data() + (size_t(j) * K + prev) * K;
        float * q = p.q.data() + size_t(j) * K;
        int32_t k;
        if (temperature <= 0.0f) {
            k = first_argmax(scores, K);
            q[k] = 1.0f;
        } else {
            k = softmax_draw(scores, K, temperature, rng, q);
        }
        p.indices[j] = k;
        p.tokens[j]  = p.candidates[size_t(j) * K + k];
        prev = k;
    }
}

Proposal propose_independent(const float * logits, int32_t n_slots, int32_t n_vocab, float temperature,
                             std::mt19937_64 & rng, const int32_t * d2t) {
    Proposal p;
    p.q_width = n_vocab;
    p.tokens.assign(n_slots, 0);
    p.indices.assign(n_slots, 0);
    p.q.assign(size_t(n_slots) * n_vocab, 0.0f);
    for (int32_t j = 0; j < n_slots; ++j) {
        const float * z = logits + size_t(j) * n_vocab;
        float * q = p.q.data() + size_t(j) * n_vocab;
        int32_t pick;
        if (temperature <= 0.0f) {
            pick = d2t ? argmax_mapped(z, n_vocab, d2t) : first_argmax(z, n_vocab);
            q[pick] = 1.0f;
        } else {
            pick = softmax_draw(z, n_vocab, temperature, rng, q);
        }
        p.indices[j] = pick;
        p.tokens[j]  = d2t ? d2t[pick] : pick;
    }
    return p;
}

}  // namespace dflash
