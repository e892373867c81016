#include "constraints.h"

#include "error.h"
#include "output.h"
#include "target.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <numeric>

namespace dflash {

namespace {
constexpr int32_t kMaxProbs = 1024;  // llama-server caps n_probs far lower; this bounds memory

llama_sampler * make_grammar(const Target & target, const std::string & gbnf) {
    llama_sampler * g = llama_sampler_init_grammar(target.vocab(), gbnf.c_str(), "root");
    if (!g) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the grammar does not parse (GBNF with a 'root' rule expected)");
    }
    return g;
}
}  // namespace

ConstraintSpec ConstraintSpec::from_params(const dflash_generate_params & p, const Target & target) {
    ConstraintSpec spec;
    if (p.grammar && p.grammar[0]) {
        spec.grammar = p.grammar;
        spec.grammar_prefix = p.grammar_prefix ? p.grammar_prefix : "";
        // parse now: a bad grammar (or a prefix it refuses) fails the request, not a later step
        Constraints check(spec, target);
    }
    if (p.n_logit_bias < 0 || (p.n_logit_bias > 0 && (!p.logit_bias_tokens || !p.logit_bias))) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "invalid logit bias list");
    }
    for (int32_t i = 0; i < p.n_logit_bias; ++i) {
        const int32_t t = p.logit_bias_tokens[i];
        if (t < 0 || t >= target.n_vocab()) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "logit bias for token %d outside the vocabulary (0..%d)", t,
                 target.n_vocab() - 1);
        }
        const float b = p.logit_bias[i];
        if (std::isnan(b) || b == INFINITY) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "logit bias of token %d must be a number or -inf", t);
        }
        spec.logit_bias.emplace_back(t, b);
    }
    if (p.n_probs < 0 || p.n_probs > kMaxProbs) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_probs must be in 0..%d (got %d)", kMaxProbs, p.n_probs);
    }
    spec.n_probs = std::min(p.n_probs, target.n_vocab());
    spec.post_sampling_probs = p.post_sampling_probs;
    return spec;
}

Constraints::Constraints(const ConstraintSpec & spec, const Target & target)
    : spec_(spec), n_vocab_(target.n_vocab()) {
    if (spec_.grammar.empty()) {
        return;
    }
    grammar_ = make_grammar(target, spec_.grammar);
    if (spec_.grammar_prefix.empty()) {
        return;
    }
    // A template's output-format grammar starts with the generation prompt the template already
    // put into the prompt: feed it those tokens (as llama.cpp's common sampler does), skipping a
    // leading space some tokenizers add before a special token.
    const std::vector<int32_t> toks = target.tokenize(spec_.grammar_prefix, false, true);
    try {
        for (size_t i = 0; i < toks.size(); ++i) {
            const std::string piece = target.token_piece(toks[i]);
            if (i == 0 && !piece.empty() && std::isspace(static_cast<unsigned char>(piece[0])) &&
                !std::isspace(static_cast<unsigned char>(spec_.grammar_prefix[0]))) {
                continue;
            }
            llama_sampler_accept(grammar_, toks[i]);
        }
    } catch (const std::exception & e) {
        llama_sampler_free(grammar_);
        grammar_ = nullptr;
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the grammar does not accept its prefix: %s", e.what());
    }
}

Constraints::~Constraints() {
    if (grammar_) {
        llama_sampler_free(grammar_);
    }
}

bool Constraints::grammar_allows(int32_t token) {
    llama_token_data one{token, 0.0f, 0.0f};
    llama_token_data_array arr{&one, 1, -1, false};
    llama_sampler_apply(grammar_, &arr);
    return std::isfinite(one.logit);
}

const float * Constraints::apply(const float * row) {
    if (!active()) {
        return row;
    }
    row_.assign(row, row + n_vocab_);
    for (const auto & [token, bias] : spec_.logit_bias) {
        row_[size_t(token)] += bias;
    }
    if (grammar_) {
        cand_.resize(size_t(n_vocab_));
        for (int32_t t = 0; t < n_vocab_; ++t) {
            cand_[size_t(t)] = llama_token_data{t, row_[size_t(t)], 0.0f};
        }
        llama_token_data_array arr{cand_.data(), cand_.size(), -1, false};
        llama_sampler_apply(grammar_, &arr);
        // the grammar sets disallowed logits to -inf in place (it neither sorts nor drops)
        for (const auto & c : cand_) {
            row_[size_t(c.id)] = c.logit;
        }
    }
    return row_.data();
}

int32_t Constraints::greedy(const float * row) {
    if (!active()) {
        return argmax(row, n_vocab_);
    }
    if (grammar_ && spec_.logit_bias.empty()) {
        // Masking only removes tokens: when the raw argmax is allowed it is the masked argmax too.
        // This saves running the grammar over the whole vocabulary on most rows.
        const int32_t best = argmax(row, n_vocab_);
        if (grammar_allows(best)) {
            return best;
        }
    }
    const float * r = apply(row);
    const int32_t best = argmax(r, n_vocab_);
    return std::isfinite(r[best]) ? best : -1;
}

int32_t Constraints::sample(const float * row, const dflash_sampling_params & sp, Rng & rng, Distribution & dist) {
    if (sp.temperature <= 0.0f) {
        return greedy(row);
    }
    const float * r = apply(row);
    if (active() && !std::isfinite(r[argmax(r, n_vocab_)])) {
        return -1;
    }
    build_distribution(r, n_vocab_, sp, dist);
    return draw(dist, rng);
}

void Constraints::accept(int32_t token) {
    if (grammar_) {
        llama_sampler_accept(grammar_, token);
    }
}

void Constraints::record_probs(const float * row, int32_t token, const dflash_sampling_params & sp,
                               dflash_output & out) {
    const int32_t n = spec_.n_probs;
    if (n <= 0) {
        return;
    }
    out.n_probs = n;
    if (spec_.post_sampling_probs) {
        // what the sampler drew from: the constrained, filtered, tempered distribution
        const float * r = apply(row);
        if (sp.temperature <= 0.0f) {
            scratch_.ids.assign(1, argmax(r, n_vocab_));
            scratch_.probs.assign(1, 1.0f);
        } else {
            build_distribution(r, n_vocab_, sp, scratch_);
        }
        float lp = -INFINITY;
        for (size_t i = 0; i < scratch_.ids.size(); ++i) {
            if (scratch_.ids[i] == token) {
                lp = std::log(scratch_.probs[i]);
            }
        }
        out.logprob.push_back(lp);
        for (int32_t i = 0; i < n; ++i) {
            const bool have = size_t(i) < scratch_.ids.size();
            out.top_ids.push_back(have ? scratch_.ids[size_t(i)] : -1);
            out.top_logprobs.push_back(have ? std::log(scratch_.probs[size_t(i)]) : -INFINITY);
        }
        return;
    }
    // the model's own distribution: softmax of the raw logits (as llama-server's n_probs)
    const float max_logit = row[argmax(row, n_vocab_)];
    double sum = 0.0;
    for (int32_t t = 0; t < n_vocab_; ++t) {
        sum += std::exp(double(row[t]) - max_logit);
    }
    const double log_z = max_logit + std::log(sum);
    out.logprob.push_back(float(row[token] - log_z));
    scratch_.ids.resize(size_t(n_vocab_));
    std::iota(scratch_.ids.begin(), scratch_.ids.end(), 0);
    std::partial_sort(scratch_.ids.begin(), scratch_.ids.begin() + n, scratch_.ids.end(), [row](int32_t a, int32_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    for (int32_t i = 0; i < n; ++i) {
        const int32_t t = scratch_.ids[size_t(i)];
        out.top_ids.push_back(t);
        out.top_logprobs.push_back(float(row[t] - log_z));
    }
}

}  // namespace dflash
