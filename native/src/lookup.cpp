#include "lookup.h"

#include <algorithm>

namespace dflash {

namespace {
// before any lookup draft was verified: the rate measured on held-out code (SmolLM2-135M, matches
// of >= 2 tokens: 2.4 of up to 7 accepted), worth a few observations so the first drafts decide
constexpr double kPrior = 0.7;
constexpr double kPriorWeight = 2.0;
constexpr double kDecay = 0.995;  // follows the workload (half-life ~140 drafts per bucket)
}  // namespace

LookupDraft lookup_draft(const int32_t * history, int32_t n_history, int32_t anchor, int32_t min_match,
                         int32_t max_match, int32_t k) {
    LookupDraft out;
    const int32_t n = n_history + 1;  // the sequence: history, then the anchor
    auto at = [&](int32_t i) { return i < n_history ? history[i] : anchor; };
    if (k <= 0 || min_match < 1 || max_match < min_match || n < min_match + 1) {
        return out;
    }
    // one backward pass (the decode loop runs this every step): each earlier occurrence e of the
    // anchor is a candidate; keep the longest match (capped at max_match), the most recent of those
    int32_t best = 0, best_end = -1;
    for (int32_t e = n - 2; e >= 0 && best < max_match; --e) {
        if (history[e] != anchor) {
            continue;
        }
        int32_t len = 1;
        while (len < max_match && len <= e && at(e - len) == at(n - 1 - len)) {
            ++len;
        }
        if (len > best) {
            best = len;
            best_end = e;
        }
    }
    if (best < min_match) {
        return out;
    }
    for (int32_t t = best_end + 1; t < n && int32_t(out.tokens.size()) < k; ++t) {
        out.tokens.push_back(at(t));
    }
    out.match = best;
    return out;
}

LookupStats::LookupStats() : counts_(size_t(kBuckets), AcceptanceCounts(16)) {}

void LookupStats::observe(int32_t match, int32_t n_offered, int32_t n_accepted) {
    if (n_offered <= 0 || match < 1) {
        return;
    }
    AcceptanceCounts & c = counts_[size_t(std::min(match, kBuckets) - 1)];
    c.decay(kDecay);
    c.observe(n_offered, n_accepted);
}

std::vector<double> LookupStats::alphas(int32_t match) const {
    const AcceptanceCounts & c = counts_[size_t(std::min(std::max(match, 1), kBuckets) - 1)];
    // position j's prior is the estimate of position j - 1: a repeat that held for j tokens tends
    // to hold on. A flat prior priced the positions never offered at kPrior each, so widths that
    // were never tried stayed unpriced (SmolLM2 repeating " YES" drafted 2 at a time, all accepted)
    std::vector<double> a(c.offered.size());
    double prior = kPrior;
    for (size_t j = 0; j < a.size(); ++j) {
        a[j] = (c.accepted[j] + prior * kPriorWeight) / (c.offered[j] + kPriorWeight);
        prior = a[j];
    }
    return a;
}

}  // namespace dflash
