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
    if (k <= 0 || min_match < 1 || n < min_match + 1) {
        return out;
    }
    for (int32_t m = std::min(max_match, n - 1); m >= min_match; --m) {
        // the most recent earlier start i (i + m <= n - 1) whose m tokens equal the last m
        for (int32_t i = n - m - 1; i >= 0; --i) {
            if (at(i + m - 1) != anchor) {
                continue;  // cheap first check: the token before the proposal is the anchor
            }
            bool same = true;
            for (int32_t t = 0; t < m - 1 && same; ++t) {
                same = at(i + t) == at(n - m + t);
            }
            if (!same) {
                continue;
            }
            for (int32_t t = i + m; t < n && int32_t(out.tokens.size()) < k; ++t) {
                out.tokens.push_back(at(t));
            }
            out.match = m;
            return out;
        }
    }
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
    std::vector<double> a(c.offered.size());
    for (size_t j = 0; j < a.size(); ++j) {
        a[j] = (c.accepted[j] + kPrior * kPriorWeight) / (c.offered[j] + kPriorWeight);
    }
    return a;
}

}  // namespace dflash
