// The stepped scheduler: every generation - plain or speculative, one sequence or many, from the
// API, the CLI or the server - runs through it.
//
// It holds up to n_seq_max sequences on a target (and optionally one drafter, weights once, one
// context cache per slot). Sequences are added and cancelled between steps. One step:
//   1. admit waiting sequences to free slots (reusing the KV of a slot's longest common prefix
//      when the request allows it, as llama-server's cache_prompt);
//   2. choose the draft width (fixed n_max, or the WidthPolicy under auto) and draft one block
//      per decoding sequence, each capped by its own limits;
//   3. decode one target batch: every decoding sequence's [anchor, drafts] followed by prefill
//      chunks of new sequences under the row budget (continuous batching);
//   4. per sequence: accept the verified prefix (greedy argmax / exact rejection sampling),
//      commit tokens (stop strings, EOS, max tokens, streaming callback), roll rejected rows back
//      in the target; committed rows' target features are kept for the drafter, which takes them
//      in (lazily, only when it drafts again) before its next block.
#pragma once

#include "dflash.h"
#include "draft_source.h"
#include "drafter.h"
#include "lookup.h"
#include "output.h"
#include "sampling.h"
#include "target.h"
#include "width_policy.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace dflash {

struct SchedulerParams {
    int32_t n_max = -1;    // drafts per sequence per step; -1: chosen per step (auto); 0: plain
    int32_t n_min = 0;     // drafts shorter than this are not verified
    float   p_min = 0.0f;  // greedy: cut the draft before the first pick the drafter gives < p_min
    int32_t n_batch = 0;   // most target rows per step (0: the target's batch size)
    int32_t lookup = 0;    // shortest history match that proposes a lookup draft (0: none; lookup.h)
};

struct RequestParams {
    dflash_generate_params gen{};
    std::vector<std::string> stop;  // owned copies of gen.stop
    int32_t n_max = -1;             // this sequence's drafts per step, fixed (-1: the scheduler's)
    int32_t n_min = -1;             // -1: the scheduler's
    float   p_min = -1.0f;          // < 0: the scheduler's
    int32_t slot = -1;              // target sequence slot (-1: any free one)
    bool    cache_prompt = true;
    bool    capture = false;        // keep every decoded row's features and argmax (training data)
    DraftSource * draft_source = nullptr;  // testing: overrides the drafter (replay sources)
};

class Scheduler {
public:
    Scheduler(Target & target, Drafter * drafter, const SchedulerParams & params);
    ~Scheduler();

    // Queue a sequence; returns its id. The callback streams it (as dflash_token_callback).
    int32_t add(const int32_t * prompt, int32_t n_prompt, RequestParams req, dflash_token_callback callback,
                void * user_data);
    // Stop a sequence (queued or running) before the next step; its output ends "cancelled".
    void cancel(int32_t id);
    // One step; fills `info`. A step with nothing to do returns at once.
    void step(dflash_step_info * info);
    // Finished sequences whose output was not taken yet.
    std::vector<int32_t> finished() const;
    std::unique_ptr<dflash_output> take(int32_t id);
    const dflash_output & peek(int32_t id) const;
    void slot_info(int32_t slot, dflash_slot_info * out) const;
    // An idle slot's KV and tokens to / from a file (llama-server's slot save / restore), or
    // forgotten (erase). Return the number of tokens written / read / dropped.
    int32_t slot_save(int32_t slot, const char * path, size_t * n_bytes);
    int32_t slot_restore(int32_t slot, const char * path, size_t * n_bytes);
    int32_t slot_erase(int32_t slot);

    // Layers whose features `capture` requests keep (with a drafter: its own tap layers).
    void set_capture(std::vector<int32_t> layers);

    int32_t n_pending() const;  // sequences queued or running
    WidthPolicy & policy() { return policy_; }
    // Why the drafter given at creation is not used (empty: it is), said once for the user.
    const std::string & notice() const { return notice_; }

private:
    struct Sequence;
    struct Slot;
    using clock_type = std::chrono::steady_clock;

    void admit();
    void start_prefill(Sequence & s, Slot & slot);
    bool lookup_allowed(const Sequence & s) const;
    int32_t draft_cap(const Sequence & s, int32_t limit) const;
    int32_t lookup_width(Sequence & s, int32_t cap);
    void trim_draft(Sequence & s, int32_t k);
    double draft_all(const std::vector<Sequence *> & decoding, const std::vector<int32_t> & k);
    void accept(Sequence & s);
    void replay_rejected();
    void finish(Sequence & s);
    void keep_features(Slot & slot, int32_t first_row, int32_t pos, int32_t n);
    void flush_features(Slot & slot, DraftSource & src);
    void capture_rows(Sequence & s, int32_t first_row, int32_t n, int32_t n_labelled);
    bool capturing(const std::vector<Sequence *> & seqs) const;
    Sequence * find(int32_t id) const;
    Slot & idle_slot(int32_t slot, const char * action);

    Target & target_;
    std::string notice_;  // set before drafter_: the drafter is dropped where its taps are missing
    Drafter * drafter_;
    SchedulerParams params_;
    int32_t n_batch_;
    int32_t max_width_;
    int32_t max_lookup_width_;
    WidthPolicy policy_;
    LookupStats lookup_;
    std::vector<std::unique_ptr<Slot>> slots_;
    std::vector<std::unique_ptr<Sequence>> seqs_;  // queued, running and finished-not-taken
    int32_t next_id_ = 1;
    uint64_t n_steps_ = 0;
    std::vector<int32_t> tap_layers_;  // the drafter's, else the capture layers (empty: none)
    std::vector<int32_t> capture_layers_;  // for `capture` requests (empty: none allowed)
    bool taps_on_ = false;             // the target captures them in this step's decode
    Distribution p_row_;
    std::vector<int32_t> rows_;
    std::vector<int32_t> positions_;
    // checkpoint rollback: the accepted rows of sequences whose block was rejected, decoded again
    // at the end of the step (their recurrent state was restored to before the block)
    struct Replay {
        int32_t slot;
        std::vector<int32_t> tokens;
        Sequence * seq;  // null once it finished
    };
    std::vector<Replay> replays_;
    double step_rollback_ms_ = 0.0;  // this step's checkpoints, restores and replays
};

}  // namespace dflash
