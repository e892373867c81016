// Token sampling shared by plain and speculative decoding.
//
// The target's sampling distribution p is built explicitly (ids + probabilities) because exact
// rejection sampling needs it: llama.cpp's default order is kept - top-k, top-p and min-p
// filter on the raw logits, then temperature, then softmax over what is left.
#pragma once

#include "dflash.h"

#include <cstdint>
#include <vector>

namespace dflash {

struct Distribution {
    std::vector<int32_t> ids;    // candidate token ids, by descending logit
    std::vector<float>   probs;  // their probabilities (sum to 1)
};

// Deterministic across platforms (std distributions are not): splitmix64-seeded xoshiro256**.
class Rng {
public:
    explicit Rng(uint64_t seed = 0) { reseed(seed); }
    void     reseed(uint64_t seed);
    uint64_t next();
    double   uniform();  // [0, 1)

private:
    uint64_t s_[4];
};

void validate_sampling_params(const dflash_sampling_params & params);

// argmax over logits; the first index wins ties (same as llama.cpp's greedy sampler).
int32_t argmax(const float * logits, int32_t n_vocab);

// The filtered, tempered distribution of one logits row. Requires temperature > 0.
void build_distribution(const float * logits, int32_t n_vocab, const dflash_sampling_params & params,
                        Distribution & out);

// Draw from a distribution by inverse CDF.
int32_t draw(const Distribution & dist, Rng & rng);

// One token from a logits row: greedy when temperature <= 0.
int32_t sample_token(const float * logits, int32_t n_vocab, const dflash_sampling_params & params,
                     Rng & rng, Distribution & scratch);

}  // namespace dflash
