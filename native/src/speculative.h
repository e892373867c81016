// Whole generations through the scheduler (scheduler.h), and the exact acceptance rule.
#pragma once

#include "dflash.h"
#include "draft_source.h"
#include "output.h"
#include "drafter.h"
#include "target.h"

#include <memory>
#include <vector>

namespace dflash {

struct SpeculativeParams {
    int32_t n_max = 7;     // most drafts verified per step
    int32_t n_min = 0;     // drafts shorter than this are not verified
    float   p_min = 0.0f;  // greedy: cut the draft before the first pick the drafter gives < p_min
};

// Run prompts to completion through one Scheduler (sequence i in slot i, sampling with seed + i)
// with a fixed n_max: drafts come from `drafter` (may be null: plain decoding) or, for tests, from
// `source`. The callback streams sequence i with user_data[i]; returning false stops it only.
std::vector<std::unique_ptr<dflash_output>> generate_batch(Target & target, Drafter * drafter, DraftSource * source,
                                                           const SpeculativeParams & spec,
                                                           const std::vector<const int32_t *> & prompts,
                                                           const std::vector<int32_t> & n_prompts,
                                                           const dflash_generate_params & params,
                                                           dflash_token_callback callback,
                                                           const std::vector<void *> & user_data);

// Exact speculative sampling of one slot: accept draft token y (proposed with probability
// q(y)) with probability min(1, p(y)/q(y)); on rejection draw from normalize(max(0, p - q)).
// Returns true if accepted; otherwise *resampled holds the replacement token.
bool accept_or_resample(const Distribution & p, const Distribution & q, int32_t y, Rng & rng, int32_t * resampled);

}  // namespace dflash
