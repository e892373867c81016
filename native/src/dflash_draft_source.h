// The DFlash drafter as a draft source of the speculative loop: committed target rows go into
// its context cache, each round drafts one block [anchor, MASK...] through the selector.
#pragma once

#include "draft_source.h"
#include "drafter.h"

namespace dflash {

class DFlashDraftSource : public DraftSource {
public:
    // Drafts on the drafter's context cache `context` (one per sequence slot; weights shared).
    DFlashDraftSource(Drafter & drafter, int32_t context) : drafter_(drafter), context_(context) {}

    std::vector<int32_t> tap_layers() const override { return drafter_.hparams().target_layers; }
    void begin(const int32_t * prompt, int32_t n_prompt, int32_t n_keep, uint64_t seed) override;
    void commit(int32_t pos, int32_t n, const std::vector<const float *> & features) override;
    Draft draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng & rng) override;

    // One drafter graph for the blocks of several sources of the same drafter (each its own
    // context), n_max drafts each: the weights are read once for all of them.
    struct Job {
        DFlashDraftSource * source;
        int32_t anchor, pos;
        float   temperature;
    };
    static std::vector<Draft> draft_batch(const std::vector<Job> & jobs, int32_t n_max);

private:
    Draft to_draft(const Proposal & p, const BlockOutput & block, float temperature) const;

    Drafter & drafter_;
    int32_t   context_;
    std::mt19937_64 rng_;
    std::vector<int32_t> positions_;
};

}  // namespace dflash
