// Where draft tokens come from. The speculative loop only sees this interface: the DFlash2
// drafter implements it, and so do two test-only sources (a replay of a known continuation,
// always accepted, and its off-by-one twin, always rejected) that pin the loop's losslessness
// independently of any neural drafter.
#pragma once

#include "sampling.h"

#include <cstdint>
#include <vector>

namespace dflash {

struct Draft {
    std::vector<int32_t> tokens;  // d_1 .. d_k
    // proposal distribution per slot (T > 0): candidate ids and their probabilities q
    std::vector<Distribution> q;
    // per slot: the probability the drafter itself gave its pick (softmax at T = 1); empty if
    // unknown. Used for llama.cpp's p_min early stop of greedy drafts.
    std::vector<float> confidence;
};

class DraftSource {
public:
    virtual ~DraftSource() = default;

    // Target layers whose input the source needs for every committed row (empty: none).
    virtual std::vector<int32_t> tap_layers() const { return {}; }
    // A new generation starts: keep the context rows of positions < n_keep (a reused prompt
    // prefix), forget the rest; `seed` makes its proposals reproducible per request.
    virtual void begin(const int32_t * prompt, int32_t n_prompt, int32_t n_keep, uint64_t seed) {}
    // Rows [pos, pos + n) were committed; features[k] holds tap k's rows ([n, n_embd]).
    virtual void commit(int32_t pos, int32_t n, const std::vector<const float *> & features) {}
    // Propose up to n_max tokens following `anchor`, which sits at position `pos`.
    virtual Draft draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng & rng) = 0;
};

// Proposes the continuation it was given (the plain-decoding output after the prompt).
class ReplayDraftSource : public DraftSource {
public:
    ReplayDraftSource(std::vector<int32_t> continuation, int32_t offset, int32_t n_vocab)
        : script_(std::move(continuation)), offset_(offset), n_vocab_(n_vocab) {}
    void begin(const int32_t *, int32_t n_prompt, int32_t, uint64_t) override { n_prompt_ = n_prompt; }
    Draft draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng & rng) override;

private:
    std::vector<int32_t> script_;
    int32_t offset_;  // 0: replay as is (always accepted); 1: each token + 1 (always rejected)
    int32_t n_vocab_;
    int32_t n_prompt_ = 0;
};

}  // namespace dflash
