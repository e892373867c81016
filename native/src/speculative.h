// The draft -> verify -> accept loop (one sequence), in C++ so no Python runs per token.
// With no draft source it is plain autoregressive decoding through the very same code.
#pragma once

#include "dflash.h"
#include "draft_source.h"
#include "output.h"
#include "target.h"

#include <memory>

namespace dflash {

struct SpeculativeParams {
    int32_t n_max = 7;     // most drafts verified per step
    int32_t n_min = 0;     // drafts shorter than this are not verified
};

std::unique_ptr<dflash_output> generate(Target & target, DraftSource * drafter, const SpeculativeParams & spec,
                                        const int32_t * prompt, int32_t n_prompt,
                                        const dflash_generate_params & params, dflash_token_callback callback,
                                        void * user_data);

// Exact speculative sampling of one slot: accept draft token y (proposed with probability
// q(y)) with probability min(1, p(y)/q(y)); on rejection draw from normalize(max(0, p - q)).
// Returns true if accepted; otherwise *resampled holds the replacement token.
bool accept_or_resample(const Distribution & p, const Distribution & q, int32_t y, Rng & rng, int32_t * resampled);

}  // namespace dflash
