#include "sampling.h"

#include "error.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dflash {

namespace {
uint64_t splitmix64(uint64_t & x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

void Rng::reseed(uint64_t seed) {
    for (auto & s : s_) {
        s = splitmix64(seed);
    }
}

uint64_t Rng::next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
}

double Rng::uniform() { return double(next() >> 11) * 0x1.0p-53; }

void validate_sampling_params(const dflash_sampling_params & p) {
    if (!std::isfinite(p.temperature)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "temperature must be a finite number (got %g)", p.temperature);
    }
    if (!(p.top_p > 0.0f) || !std::isfinite(p.top_p)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "top_p must be in (0, 1] (got %g)", p.top_p);
    }
    if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "min_p must be in [0, 1] (got %g)", p.min_p);
    }
}

int32_t argmax(const float * logits, int32_t n_vocab) {
    return int32_t(std::max_element(logits, logits + n_vocab) - logits);
}

void build_distribution(const float * logits, int32_t n_vocab, const dflash_sampling_params & params,
                        Distribution & out) {
    auto & ids = out.ids;
    auto & probs = out.probs;
    ids.resize(n_vocab);
    std::iota(ids.begin(), ids.end(), 0);
    auto by_logit = [logits](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };

    // top-k (a partial sort keeps this cheap for large vocabularies)
    size_t n = ids.size();
    if (params.top_k > 0 && size_t(params.top_k) < n) {
        n = size_t(params.top_k);
        std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), by_logit);
    } else {
        std::sort(ids.begin(), ids.end(), by_logit);
    }
    ids.resize(n);

    // softmax of the raw logits for the top-p / min-p filters
    const float max_logit = logits[ids[0]];
    probs.resize(n);
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) {
        probs[i] = std::exp(logits[ids[i]] - max_logit);
        sum += probs[i];
    }
    if (params.top_p < 1.0f) {
        double cum = 0.0;
        size_t keep = n;
        for (size_t i = 0; i < n; ++i) {
            cum += probs[i] / sum;
            if (cum >= params.top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (params.min_p > 0.0f) {
        // probs[0] is the largest (= 1 before normalisation)
        size_t keep = 1;
        while (keep < n && probs[keep] >= params.min_p * probs[0]) {
            ++keep;
        }
        n = keep;
    }
    ids.resize(n);

    // temperature, then the final softmax
    sum = 0.0;
    for (size_t i = 0; i < n; ++i) {
        probs[i] = std::exp((logits[ids[i]] - max_logit) / params.temperature);
        sum += probs[i];
    }
    probs.resize(n);
    for (auto & p : probs) {
        p = float(p / sum);
    }
}

int32_t draw(const Distribution & dist, Rng & rng) {
    const double u = rng.uniform();
    double cum = 0.0;
    for (size_t i = 0; i < dist.ids.size(); ++i) {
        cum += dist.probs[i];
        if (u < cum) {
            return dist.ids[i];
        }
    }
    return dist.ids.back();  // rounding: u beyond the accumulated mass
}

int32_t sample_token(const float * logits, int32_t n_vocab, const dflash_sampling_params & params,
                     Rng & rng, Distribution & scratch) {
    if (params.temperature <= 0.0f) {
        return argmax(logits, n_vocab);
    }
    build_distribution(logits, n_vocab, params, scratch);
    return draw(scratch, rng);
}

}  // namespace dflash
