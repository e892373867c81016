// The DFlash drafter as a draft source of the speculative loop: committed target rows go into
// its context cache, each round drafts one block [anchor, MASK...] through the selector.
#pragma once

#include "draft_source.h"
#include "drafter.h"

namespace dflash {

class DFlashDraftSource : public DraftSource {
public:
    DFlashDraftSource(Drafter & drafter, uint64_t seed) : drafter_(drafter), seed_(seed) {}

    std::vector<int32_t> tap_layers() const override { return drafter_.hparams().target_layers; }
    void begin(const int32_t * prompt, int32_t n_prompt) override;
    void commit(int32_t pos, int32_t n, const std::vector<const float *> & features) override;
    Draft draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng & rng) override;

private:
    Drafter & drafter_;
    uint64_t  seed_;
    std::vector<int32_t> positions_;
};

}  // namespace dflash
