#include "dflash_draft_source.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dflash {

namespace {
// softmax probability of `pick` among `scores` (T = 1)
float softmax_prob(const float * scores, size_t n, size_t pick) {
    const float mx = *std::max_element(scores, scores + n);
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) {
        sum += std::exp(double(scores[i] - mx));
    }
    return float(std::exp(double(scores[pick] - mx)) / sum);
}

// How sure the drafter was of each pick: over the selector's K candidates given the previous pick
// (DFlash2), or over the draft vocabulary (v1; N logits per row).
std::vector<float> pick_confidence(const Proposal & p, const BlockOutput & block, int32_t n_vocab) {
    std::vector<float> conf;
    const size_t n = p.tokens.size();
    if (!p.candidates.empty()) {
        const size_t k = p.candidates.size() / n;
        for (size_t j = 0; j < n; ++j) {
            const size_t prev = j == 0 ? 0 : size_t(p.indices[j - 1]);  // slot 1: every row is the anchor's
            conf.push_back(softmax_prob(&p.lattice[(j * k + prev) * k], k, size_t(p.indices[j])));
        }
    } else {
        for (size_t j = 0; j < n; ++j) {  // slot j+1's logits sit at block row j+1
            conf.push_back(softmax_prob(&block.logits[(j + 1) * size_t(n_vocab)], size_t(n_vocab), size_t(p.indices[j])));
        }
    }
    return conf;
}
}  // namespace

void DFlashDraftSource::begin(const int32_t *, int32_t, int32_t n_keep, uint64_t seed) {
    drafter_.use_context(context_);
    drafter_.crop(drafter_.n_context_before(n_keep));
    rng_.seed(seed ^ 0x85ebca6bULL);  // drafts are reproducible per request seed
}

void DFlashDraftSource::commit(int32_t pos, int32_t n, const std::vector<const float *> & features) {
    drafter_.use_context(context_);
    positions_.resize(size_t(n));
    std::iota(positions_.begin(), positions_.end(), pos);
    drafter_.inject_taps(features.data(), int32_t(features.size()), positions_.data(), n);
}

Draft DFlashDraftSource::draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng &) {
    return draft_batch({{this, anchor, pos, temperature}}, n_max).front();
}

std::vector<Draft> DFlashDraftSource::draft_batch(const std::vector<Job> & jobs, int32_t n_max) {
    std::vector<Draft> out;
    if (jobs.empty()) {
        return out;
    }
    Drafter & drafter = jobs.front().source->drafter_;
    const int32_t n_block = std::min(n_max + 1, std::max(drafter.hparams().block_size, 2));
    std::vector<Drafter::BlockJob> blocks;
    for (const auto & j : jobs) {
        blocks.push_back({j.source->context_, j.anchor, j.pos});
    }
    std::vector<BlockOutput> outputs;
    drafter.forward_blocks(blocks, n_block, outputs);
    for (size_t i = 0; i < jobs.size(); ++i) {
        DFlashDraftSource & src = *jobs[i].source;
        const Proposal p = drafter.select(outputs[i], jobs[i].temperature, src.rng_);
        out.push_back(src.to_draft(p, outputs[i], jobs[i].temperature));
    }
    return out;
}

Draft DFlashDraftSource::to_draft(const Proposal & p, const BlockOutput & block, float temperature) const {
    Draft out;
    out.tokens = p.tokens;
    out.confidence = pick_confidence(p, block, drafter_.hparams().n_vocab_draft);
    if (temperature > 0.0f) {
        // q per slot as a sparse distribution: over the K candidates (DFlash2) or the draft
        // vocabulary (v1); q is zero outside the draft vocabulary, which rejection sampling
        // handles exactly (a token with q = 0 is only ever reached through the residual)
        const size_t width = size_t(p.q_width);
        for (size_t j = 0; j < p.tokens.size(); ++j) {
            Distribution q;
            for (size_t k = 0; k < width; ++k) {
                const float prob = p.q[j * width + k];
                if (prob > 0.0f) {
                    q.ids.push_back(p.candidates.empty() ? drafter_.to_target(int32_t(k)) : p.candidates[j * width + k]);
                    q.probs.push_back(prob);
                }
            }
            out.q.push_back(std::move(q));
        }
    }
    return out;
}

}  // namespace dflash
