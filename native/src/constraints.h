// What a request adds on top of the sampler: logit biases, a GBNF grammar, and the per-token
// probabilities it asked to see (llama-server's logit_bias, grammar / json_schema, n_probs).
//
// Constraints act on the target's logits before a token is chosen, so under speculation a draft
// is verified against the constrained distribution: greedy accepts a draft iff it is the
// constrained argmax, T > 0 rejection-samples against the constrained p. The grammar state only
// moves along committed tokens (each verified row is judged with the state after the drafts
// accepted before it), so rejected drafts never touch it and nothing needs rolling back.
#pragma once

#include "dflash.h"
#include "sampling.h"

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

struct dflash_output;

namespace dflash {

class Target;

// A request's constraints, owned copies of what dflash_generate_params points to.
struct ConstraintSpec {
    std::string grammar;  // GBNF ("" = none)
    std::string grammar_prefix;  // text the grammar consumes before the first token
    std::vector<std::pair<int32_t, float>> logit_bias;
    int32_t n_probs = 0;
    bool    post_sampling_probs = false;

    // Copies and validates (token ids, n_probs); a grammar that does not parse fails here.
    static ConstraintSpec from_params(const dflash_generate_params & p, const Target & target);
    bool empty() const { return grammar.empty() && logit_bias.empty(); }
};

class Constraints {
public:
    Constraints(const ConstraintSpec & spec, const Target & target);
    ~Constraints();
    Constraints(const Constraints &) = delete;
    Constraints & operator=(const Constraints &) = delete;

    bool active() const { return grammar_ != nullptr || !spec_.logit_bias.empty(); }

    // The token this row gives: greedy (argmax of the constrained row) or a draw from the
    // constrained distribution. `dist` receives the distribution when temperature > 0.
    // -1: the constraints allow no token (a finished grammar whose end was refused).
    int32_t sample(const float * row, const dflash_sampling_params & sp, Rng & rng, Distribution & dist);
    // Greedy verification: the constrained argmax of a row (-1: no token allowed).
    int32_t greedy(const float * row);
    // The constrained row (the raw row when nothing constrains), valid until the next call.
    const float * apply(const float * row);
    // A committed token: the grammar moves on.
    void accept(int32_t token);

    // n_probs: record the token chosen from `row` (the raw row; post-sampling probabilities
    // rebuild the constrained distribution) into the output.
    void record_probs(const float * row, int32_t token, const dflash_sampling_params & sp,
                      dflash_output & out);

private:
    bool grammar_allows(int32_t token);

    ConstraintSpec spec_;
    int32_t n_vocab_;
    llama_sampler * grammar_ = nullptr;
    std::vector<float> row_;               // the constrained row
    std::vector<llama_token_data> cand_;   // the grammar's candidate array
    Distribution scratch_;
};

}  // namespace dflash
