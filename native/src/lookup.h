// Drafts from a sequence's own history ("prompt lookup"): the tokens that followed the most recent
// earlier occurrence of its last n tokens. Code repeats itself - names, argument lists, whole
// lines and blocks - and small targets repeat themselves more: on the held-out HumanEval prompts
// SmolLM2-135M's greedy continuations hold a match of >= 2 tokens at ~40 % of the steps, where
// the tokens after it are accepted 2.4 at a time, against 0.7 for the shipped neural drafter
// (benchmarks/results/lookup-drafts/). The scheduler verifies such a draft in place of the
// drafter's block, for greedy sequences, at a width priced from its own measured acceptance.
#pragma once

#include "width_policy.h"

#include <cstdint>
#include <vector>

namespace dflash {

struct LookupDraft {
    std::vector<int32_t> tokens;  // proposed continuation (empty: no match)
    int32_t match = 0;            // length of the matched suffix (min_match .. max_match)
};

// history[0..n_history) then `anchor` is the sequence; the longest suffix of it of length
// max_match down to min_match that also occurs earlier proposes up to k of the tokens after its
// most recent earlier occurrence.
LookupDraft lookup_draft(const int32_t * history, int32_t n_history, int32_t anchor, int32_t min_match,
                         int32_t max_match, int32_t k);

// Measured acceptance of lookup drafts, by match length (1, 2, 3, >= 4): a longer match repeats
// more reliably. Chooses how many of a proposal to verify.
class LookupStats {
public:
    static constexpr int32_t kBuckets = 4;
    LookupStats();
    // the width that maximizes expected committed tokens per unit of target time, 1 + E(j) over
    // cost(1 + j), given cost(rows) = target time of `rows` rows / one row (0: none pays)
    template <class Cost> int32_t choose(int32_t match, int32_t n_proposed, Cost cost) const;
    void observe(int32_t match, int32_t n_offered, int32_t n_accepted);
    std::vector<double> alphas(int32_t match) const;

private:
    std::vector<AcceptanceCounts> counts_;
};

template <class Cost> int32_t LookupStats::choose(int32_t match, int32_t n_proposed, Cost cost) const {
    const std::vector<double> a = alphas(match);
    constexpr double kMargin = 1.02;  // as the width policy: a draft must beat plain by 2 %
    double best = kMargin, expected = 1.0, reach = 1.0;
    int32_t best_j = 0;
    for (int32_t j = 1; j <= n_proposed && j <= int32_t(a.size()); ++j) {
        reach *= a[size_t(j - 1)];
        expected += reach;
        const double c = cost(1 + j);
        if (c > 0.0 && expected / c > best) {
            best = expected / c;
            best_j = j;
        }
    }
    return best_j;
}

}  // namespace dflash
