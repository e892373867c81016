#include "dflash_draft_source.h"

#include <algorithm>
#include <numeric>

namespace dflash {

void DFlashDraftSource::begin(const int32_t *, int32_t) {
    drafter_.crop(0);
    drafter_.rng().seed(seed_ ^ 0x85ebca6bULL);  // drafts are reproducible per request seed
}

void DFlashDraftSource::commit(int32_t pos, int32_t n, const std::vector<const float *> & features) {
    positions_.resize(size_t(n));
    std::iota(positions_.begin(), positions_.end(), pos);
    drafter_.inject_taps(features.data(), int32_t(features.size()), positions_.data(), n);
}

Draft DFlashDraftSource::draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng &) {
    const int32_t n_block = std::min(n_max + 1, std::max(drafter_.hparams().block_size, 2));
    Proposal p = drafter_.propose(anchor, pos, n_block, temperature, drafter_.rng());
    Draft out;
    out.tokens = p.tokens;
    if (temperature > 0.0f) {
        // q per slot as a sparse distribution: over the K candidates (DFlash2) or the vocabulary
        const size_t width = size_t(p.q_width);
        for (size_t j = 0; j < p.tokens.size(); ++j) {
            Distribution q;
            for (size_t k = 0; k < width; ++k) {
                const float prob = p.q[j * width + k];
                if (prob > 0.0f) {
                    q.ids.push_back(p.candidates.empty() ? int32_t(k) : p.candidates[j * width + k]);
                    q.probs.push_back(prob);
                }
            }
            out.q.push_back(std::move(q));
        }
    }
    return out;
}

}  // namespace dflash
