#include "scheduler.h"

#include "constraints.h"

#include <cstdio>

#include "dflash_draft_source.h"
#include "error.h"
#include "speculative.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dflash {

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// One drafter block of max_width drafts after injecting two feature rows, as a step drafts
// (best of two: the first may allocate), on context 0, which is left empty (the scheduler clears
// a context before it serves a sequence anyway): the price of a draft before the loop ran one.
double time_drafter_block(Drafter & d, int32_t max_width) {
    const auto & hp = d.hparams();
    if (d.info().n_ctx < 2) {
        return -1.0;
    }
    const std::vector<float> zeros(size_t(2) * size_t(hp.n_embd), 0.0f);
    const std::vector<const float *> taps(hp.target_layers.size(), zeros.data());
    const int32_t pos[2] = {0, 1};
    std::vector<BlockOutput> outs;
    std::mt19937_64 rng(0);
    double best = -1.0;
    d.use_context(0);
    for (int rep = 0; rep < 2; ++rep) {
        d.crop(0);
        const auto t0 = clock_type::now();
        d.inject_taps(taps.data(), int32_t(taps.size()), pos, 2);
        d.forward_blocks({{0, 0, 2}}, max_width + 1, outs);
        d.select(outs.front(), 0.0f, rng);
        const double t = ms_since(t0);
        best = best < 0.0 ? t : std::min(best, t);
    }
    d.crop(0);
    return best;
}

// Feature rows kept for a drafter that is not drafting: past this many they are injected anyway
// (bounds host memory; injection is batched, so it costs little per row).
constexpr int32_t kMaxPendingRows = 1024;
// Drafts from the history are not bounded by the drafter's block: a long repeat is verified up to
// this many at a time (as with no drafter), at the width its measured acceptance prices best.
constexpr int32_t kMaxLookupWidth = 15;

// The drafter, if the target's graph gives it the hidden states it feeds on; else none (plain
// decoding and history drafts) and why, for the one notice the user gets.
Drafter * usable_drafter(Target & target, Drafter * drafter, bool lookup, std::string * notice) {
    if (target.max_verify_drafts() == 0) {
        if (drafter || lookup) {
            *notice = "this target's attention is not causal (a diffusion model): verified rows would see the "
                      "drafts after them, decoding plainly";
        }
        return nullptr;
    }
    if (!drafter) {
        return nullptr;
    }
    std::string why;
    if (!target.probe_taps(drafter->hparams().target_layers, &why)) {
        *notice = why + ": the drafter is not used, decoding plainly";
        return nullptr;
    }
    return drafter;
}

}  // namespace

// The committed-token side of a generation: output tokens, text stream, stop rules.
class Committer {
public:
    Committer(Target & target, const dflash_generate_params & params, dflash_token_callback callback,
              void * user_data, dflash_output & out)
        : target_(target), params_(params), callback_(callback), user_data_(user_data), out_(out),
          stream_(std::vector<std::string>(params.stop, params.stop + params.n_stop)) {}

    // Commit one token; returns false once generation must stop (stats.stop_reason set).
    bool push(int32_t token) {
        auto & st = out_.stats;
        out_.tokens.push_back(token);
        st.n_generated++;
        const bool eos = !params_.ignore_eos && target_.is_eog(token);
        const bool hit_stop = eos ? false : stream_.push(target_.token_piece(token), released_);
        if (eos) {
            released_.clear();
        }
        if (callback_ && !callback_(user_data_, token, released_.data(), released_.size())) {
            st.stop_reason = DFLASH_STOP_CANCELLED;
        } else if (eos) {
            st.stop_reason = DFLASH_STOP_EOS;
        } else if (hit_stop) {
            st.stop_reason = DFLASH_STOP_STRING;
        } else if (params_.max_tokens >= 0 && st.n_generated >= params_.max_tokens) {
            st.stop_reason = DFLASH_STOP_MAX_TOKENS;
        }
        return st.stop_reason == DFLASH_STOP_NONE;
    }

    void finish() {
        stream_.flush(released_);
        if (!released_.empty() && callback_ && out_.stats.stop_reason != DFLASH_STOP_CANCELLED) {
            callback_(user_data_, -1, released_.data(), released_.size());
        }
        out_.text = stream_.text();
    }

private:
    Target & target_;
    const dflash_generate_params & params_;
    dflash_token_callback callback_;
    void * user_data_;
    dflash_output & out_;
    TextStream stream_;
    std::string released_;
};

// A target sequence slot: its KV (what the target holds at positions 0..), the drafter context of
// the same index, and the target features of committed rows the drafter has not taken in yet.
struct Scheduler::Slot {
    int32_t index = 0;
    std::vector<int32_t> kv;       // tokens decoded at positions 0..kv.size()-1
    DraftSource * kv_source = nullptr;  // the draft source whose context matches kv (null: none)
    std::unique_ptr<DFlashDraftSource> dflash;
    int32_t pending_pos = 0;       // position of the first pending feature row
    int32_t n_pending = 0;
    std::vector<std::vector<float>> pending;  // per tap: [n_pending x n_embd]
    int32_t owner = 0;             // id of the sequence using it (0: free)
    uint64_t last_used = 0;
};

struct Scheduler::Sequence {
    enum State { QUEUED, PREFILL, DECODE, DONE };
    int32_t id = 0;
    State state = QUEUED;
    std::vector<int32_t> prompt;
    RequestParams req;
    std::vector<const char *> stop_ptrs;
    dflash_token_callback callback = nullptr;
    void * user_data = nullptr;
    Slot * slot = nullptr;
    DraftSource * source = nullptr;
    Rng rng;
    std::unique_ptr<Constraints> constraints;  // logit bias, grammar, n_probs
    std::unique_ptr<dflash_output> out = std::make_unique<dflash_output>();
    std::unique_ptr<Committer> committer;
    int32_t n_prefilled = 0;  // prompt tokens decoded
    int32_t n_past = 0;       // positions < n_past are committed and decoded
    int32_t anchor = -1;      // the last committed token, not yet decoded
    bool    cancel = false;
    Draft   draft;
    int32_t lookup_match = 0;      // > 0: this step's draft came from the history (match length)
    int32_t n_block_drafts = 0;    // > 0: the drafter ran for this step and proposed this many (before any cut)
    int32_t row0 = 0, n_rows = 0;  // this step's rows in the batch
    AcceptanceCounts counts{16};
    clock_type::time_point t_added, t_started;
};

Scheduler::Scheduler(Target & target, Drafter * drafter, const SchedulerParams & params)
    : target_(target), drafter_(usable_drafter(target, drafter, params.lookup > 0, &notice_)), params_(params),
      n_batch_(params.n_batch > 0 ? std::min(params.n_batch, target.n_batch()) : target.n_batch()),
      // a recurrent target rolls back at most its snapshots' depth of drafts
      max_width_(std::max(1, std::min(drafter_ ? std::min(drafter_->hparams().block_size - 1, 15) : kMaxLookupWidth,
                                      target.max_verify_drafts()))),
      max_lookup_width_(std::max(1, std::min(kMaxLookupWidth, target.max_verify_drafts()))),
      policy_(max_width_, n_batch_) {
    drafter = drafter_;
    if (params.n_max < -1) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_max must be >= 0, or -1 for auto (got %d)", params.n_max);
    }
    if (params.n_min < 0 || (params.n_max >= 0 && params.n_min > params.n_max)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "need 0 <= n_min <= n_max (got n_min %d, n_max %d)", params.n_min,
             params.n_max);
    }
    if (!(params.p_min >= 0.0f && params.p_min <= 1.0f)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "p_min must be in [0, 1] (got %g)", params.p_min);
    }
    if (params.n_batch < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_batch must be >= 0 (got %d)", params.n_batch);
    }
    const int32_t n_seq = target.info().n_seq_max;
    if (n_batch_ < n_seq) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the batch (%d rows) must hold one row of each of the %d sequences",
             n_batch_, n_seq);
    }
    if (drafter) {
        drafter->ensure_contexts(n_seq);
    }
    for (int32_t i = 0; i < n_seq; ++i) {
        auto slot = std::make_unique<Slot>();
        slot->index = i;
        if (drafter) {
            slot->dflash = std::make_unique<DFlashDraftSource>(*drafter, i);
        }
        slots_.push_back(std::move(slot));
    }
    // the target's KV of every slot starts empty: what another user of the target left is not ours
    for (int32_t i = 0; i < n_seq; ++i) {
        target_.rollback(i, 0);
    }
    if (drafter) {
        tap_layers_ = drafter->hparams().target_layers;
    }
    target_.set_taps({});
    // auto width with a drafter that carries a measured acceptance profile: the profile is the
    // acceptance prior, and one timed block prices the first probe (no profile: probed blind)
    if (drafter && params.n_max < 0 && !drafter->hparams().acceptance.empty()) {
        policy_.set_profile(drafter->hparams().acceptance);
        const double t_block = time_drafter_block(*drafter, max_width_);
        if (t_block > 0.0) {
            policy_.seed_draft(max_width_, t_block);
        }
    }
}

Scheduler::~Scheduler() = default;

Scheduler::Sequence * Scheduler::find(int32_t id) const {
    for (const auto & s : seqs_) {
        if (s->id == id) {
            return s.get();
        }
    }
    return nullptr;
}

int32_t Scheduler::add(const int32_t * prompt, int32_t n_prompt, RequestParams req, dflash_token_callback callback,
                       void * user_data) {
    validate_sampling_params(req.gen.sampling);
    if (n_prompt <= 0 || !prompt) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the prompt is empty");
    }
    if (n_prompt >= target_.n_ctx()) {  // before reading: n_prompt may not be the array's length
        fail(DFLASH_ERR_CONTEXT_FULL, "the prompt has %d tokens but the context holds %d (leave room to generate)",
             n_prompt, target_.n_ctx());
    }
    for (int32_t i = 0; i < n_prompt; ++i) {
        target_.check_token(prompt[i]);
    }
    if (req.gen.n_stop < 0 || (req.gen.n_stop > 0 && !req.gen.stop)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "invalid stop string list");
    }
    if (req.stop.empty()) {
        for (int32_t i = 0; i < req.gen.n_stop; ++i) {
            if (!req.gen.stop[i] || !req.gen.stop[i][0]) {
                fail(DFLASH_ERR_INVALID_ARGUMENT, "stop string %d is empty", i);
            }
            req.stop.emplace_back(req.gen.stop[i]);
        }
    }
    if (req.n_max < -1) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "a request's n_max must be >= 0, or -1 for the scheduler's (got %d)",
             req.n_max);
    }
    if (req.n_min < -1 || (req.n_min > 0 && req.n_max >= 0 && req.n_min > req.n_max)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "need 0 <= n_min <= n_max (got n_min %d, n_max %d)", req.n_min, req.n_max);
    }
    if (!(req.p_min <= 1.0f)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "p_min must be in [0, 1] (got %g)", req.p_min);
    }
    if (req.slot < -1 || req.slot >= int32_t(slots_.size())) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "slot %d is outside 0..%zu", req.slot, slots_.size() - 1);
    }
    if (req.capture && (tap_layers_.empty() || tap_layers_ != capture_layers_)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "a capture request needs the scheduler's capture layers (set_capture)");
    }
    if (req.capture) {
        req.cache_prompt = false;  // every prompt row is decoded, so every row has its features
    }
    auto s = std::make_unique<Sequence>();
    s->id = next_id_++;
    if (next_id_ <= 0) {
        next_id_ = 1;
    }
    s->prompt.assign(prompt, prompt + n_prompt);
    // copies the grammar and biases (the caller's pointers are only borrowed for this call)
    s->constraints = std::make_unique<Constraints>(ConstraintSpec::from_params(req.gen, target_), target_);
    req.gen.grammar = nullptr;
    req.gen.grammar_prefix = nullptr;
    req.gen.logit_bias_tokens = nullptr;
    req.gen.logit_bias = nullptr;
    req.gen.n_logit_bias = 0;
    s->req = std::move(req);
    for (const auto & st : s->req.stop) {
        s->stop_ptrs.push_back(st.c_str());
    }
    s->req.gen.stop = s->stop_ptrs.empty() ? nullptr : s->stop_ptrs.data();
    s->req.gen.n_stop = int32_t(s->stop_ptrs.size());
    s->callback = callback;
    s->user_data = user_data;
    s->rng.reseed(s->req.gen.sampling.seed);
    s->committer = std::make_unique<Committer>(target_, s->req.gen, callback, user_data, *s->out);
    s->out->stats.n_prompt = n_prompt;
    if (s->req.capture) {
        s->out->cap_taps = int32_t(capture_layers_.size());
        s->out->cap_embd = target_.n_embd();
    }
    s->t_added = clock_type::now();
    const int32_t id = s->id;
    seqs_.push_back(std::move(s));
    return id;
}

void Scheduler::set_capture(std::vector<int32_t> layers) {
    for (const auto & s : seqs_) {
        if (s->req.capture && s->state != Sequence::DONE) {
            fail(DFLASH_ERR_BUSY, "capture layers cannot change while a capture request runs");
        }
    }
    if (drafter_ && !layers.empty() && layers != drafter_->hparams().target_layers) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "with a drafter the capture layers must be the drafter's tap layers");
    }
    target_.set_taps(layers);  // validates them against the target
    target_.set_taps({});
    taps_on_ = false;
    capture_layers_ = std::move(layers);
    if (!drafter_) {
        tap_layers_ = capture_layers_;
    }
}

void Scheduler::cancel(int32_t id) {
    Sequence * s = find(id);
    if (!s) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no sequence %d", id);
    }
    s->cancel = true;
}

std::vector<int32_t> Scheduler::finished() const {
    std::vector<int32_t> out;
    for (const auto & s : seqs_) {
        if (s->state == Sequence::DONE) {
            out.push_back(s->id);
        }
    }
    return out;
}

std::unique_ptr<dflash_output> Scheduler::take(int32_t id) {
    for (auto it = seqs_.begin(); it != seqs_.end(); ++it) {
        if ((*it)->id == id) {
            if ((*it)->state != Sequence::DONE) {
                fail(DFLASH_ERR_INVALID_ARGUMENT, "sequence %d has not finished", id);
            }
            auto out = std::move((*it)->out);
            seqs_.erase(it);
            return out;
        }
    }
    fail(DFLASH_ERR_INVALID_ARGUMENT, "no sequence %d", id);
}

const dflash_output & Scheduler::peek(int32_t id) const {
    const Sequence * s = find(id);
    if (!s) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no sequence %d", id);
    }
    return *s->out;
}

int32_t Scheduler::n_pending() const {
    int32_t n = 0;
    for (const auto & s : seqs_) {
        n += s->state != Sequence::DONE ? 1 : 0;
    }
    return n;
}

void Scheduler::slot_info(int32_t slot, dflash_slot_info * out) const {
    if (slot < 0 || slot >= int32_t(slots_.size())) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "slot %d is outside 0..%zu", slot, slots_.size() - 1);
    }
    const Slot & sl = *slots_[size_t(slot)];
    *out = dflash_slot_info{};
    out->id = sl.owner;
    out->n_cached = int32_t(sl.kv.size());
    if (const Sequence * s = sl.owner ? find(sl.owner) : nullptr) {
        out->state = s->state == Sequence::PREFILL ? 1 : s->state == Sequence::DECODE ? 2 : 0;
        out->n_prompt = int32_t(s->prompt.size());
        out->n_prefilled = s->n_prefilled;
        out->n_generated = s->out->stats.n_generated;
        out->n_past = s->n_past;
        out->n_prompt_cached = s->out->stats.n_cached;
    }
}

// -- slot files ------------------------------------------------------------------------------

Scheduler::Slot & Scheduler::idle_slot(int32_t slot, const char * action) {
    if (slot < 0 || slot >= int32_t(slots_.size())) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "slot %d is outside 0..%zu", slot, slots_.size() - 1);
    }
    Slot & sl = *slots_[size_t(slot)];
    if (sl.owner != 0) {
        fail(DFLASH_ERR_BUSY, "slot %d is processing a request: cannot %s it now", slot, action);
    }
    if (target_.seq_pos_max(sl.index) + 1 != int32_t(sl.kv.size())) {
        sl.kv.clear();  // the target's sequence was used directly in between
        target_.rollback(sl.index, 0);
    }
    return sl;
}

int32_t Scheduler::slot_save(int32_t slot, const char * path, size_t * n_bytes) {
    Slot & sl = idle_slot(slot, "save");
    const size_t n = llama_state_seq_save_file(target_.ctx(), path, sl.index, sl.kv.data(), sl.kv.size());
    if (n == 0) {
        fail(DFLASH_ERR_IO, "could not write the slot file '%s'", path);
    }
    *n_bytes = n;
    return int32_t(sl.kv.size());
}

int32_t Scheduler::slot_restore(int32_t slot, const char * path, size_t * n_bytes) {
    Slot & sl = idle_slot(slot, "restore");
    if (FILE * f = std::fopen(path, "rb")) {  // a missing file leaves the slot as it was
        std::fclose(f);
    } else {
        fail(DFLASH_ERR_IO, "cannot read the slot file '%s'", path);
    }
    std::vector<int32_t> tokens(size_t(target_.n_ctx()));
    size_t n_tokens = 0;
    target_.rollback(sl.index, 0);
    sl.kv.clear();
    const size_t n = llama_state_seq_load_file(target_.ctx(), path, sl.index, tokens.data(), tokens.size(), &n_tokens);
    if (n == 0) {
        target_.rollback(sl.index, 0);
        fail(DFLASH_ERR_IO, "could not restore the slot from '%s' (missing, not a slot file of this model, "
             "or longer than the slot's context)", path);
    }
    tokens.resize(n_tokens);
    sl.kv = std::move(tokens);
    // the drafter context of this slot has no features for the restored rows: a speculative
    // request re-decodes them (see start_prefill), a plain one reuses them
    sl.kv_source = nullptr;
    sl.n_pending = 0;
    sl.pending_pos = 0;
    *n_bytes = n;
    return int32_t(sl.kv.size());
}

int32_t Scheduler::slot_erase(int32_t slot) {
    Slot & sl = idle_slot(slot, "erase");
    const int32_t n = int32_t(sl.kv.size());
    target_.rollback(sl.index, 0);
    sl.kv.clear();
    sl.kv_source = nullptr;
    sl.n_pending = 0;
    sl.pending_pos = 0;
    return n;
}

// -- admission -------------------------------------------------------------------------------

void Scheduler::admit() {
    for (auto & sp : seqs_) {
        Sequence & s = *sp;
        if (s.state != Sequence::QUEUED) {
            continue;
        }
        Slot * best = nullptr;
        size_t best_common = 0;
        for (auto & slot : slots_) {
            if (slot->owner != 0 || (s.req.slot >= 0 && slot->index != s.req.slot)) {
                continue;
            }
            size_t common = 0;
            if (s.req.cache_prompt) {
                const size_t n = std::min(slot->kv.size(), s.prompt.size());
                while (common < n && slot->kv[common] == s.prompt[common]) {
                    ++common;
                }
            }
            if (!best || common > best_common || (common == best_common && slot->last_used < best->last_used)) {
                best = slot.get();
                best_common = common;
            }
        }
        if (!best) {
            continue;  // every slot busy: waits for the next step
        }
        start_prefill(s, *best);
    }
}

void Scheduler::start_prefill(Sequence & s, Slot & slot) {
    slot.owner = s.id;
    s.slot = &slot;
    s.source = s.req.draft_source ? s.req.draft_source : slot.dflash.get();
    if (s.req.n_max == 0 || (s.req.n_max < 0 && params_.n_max == 0)) {
        s.source = s.req.draft_source;  // plain decoding: the drafter is not run at all
    }
    // the KV this slot holds is reused up to the longest common prefix, but never the whole
    // prompt: its last token is decoded again for the first token's logits
    if (target_.seq_pos_max(slot.index) + 1 != int32_t(slot.kv.size())) {
        slot.kv.clear();  // someone else used the target's sequence in between
    }
    size_t keep = 0;
    if (s.req.cache_prompt) {
        while (keep < slot.kv.size() && keep < s.prompt.size() && slot.kv[keep] == s.prompt[keep]) {
            ++keep;
        }
        keep = std::min(keep, s.prompt.size() - 1);
        if (target_.recurrent() && keep != slot.kv.size()) {
            keep = 0;  // recurrent state holds the whole sequence: it cannot be cut back to a prefix
        }
    }
    DraftSource * features_of = slot.dflash.get();  // the only source whose context needs features
    if (keep > 0 && s.source == features_of && slot.kv_source != features_of) {
        keep = 0;  // the drafter context does not cover the cached rows
    }
    target_.rollback(slot.index, int32_t(keep));
    slot.kv.resize(keep);
    slot.kv_source = s.source == features_of ? features_of : nullptr;
    slot.n_pending = std::max(0, std::min(slot.n_pending, int32_t(keep) - slot.pending_pos));
    if (slot.n_pending == 0) {
        slot.pending_pos = int32_t(keep);
    }
    if (s.source) {
        s.source->begin(s.prompt.data(), int32_t(s.prompt.size()), int32_t(keep), s.req.gen.sampling.seed);
    }
    s.n_prefilled = int32_t(keep);
    s.n_past = int32_t(keep);
    s.out->stats.n_cached = int32_t(keep);
    s.state = Sequence::PREFILL;
    s.t_started = clock_type::now();
}

// -- features for the drafter ------------------------------------------------------------------

void Scheduler::keep_features(Slot & slot, int32_t first_row, int32_t pos, int32_t n) {
    const auto & taps = target_.taps();
    if (!taps_on_ || taps.empty() || n <= 0) {
        return;  // rows decoded without capture stay missing from the drafter context
    }
    if (slot.n_pending > 0 && slot.pending_pos + slot.n_pending != pos) {
        flush_features(slot, *slot.dflash);  // after a gap: what was kept goes in first
    }
    if (slot.n_pending == 0) {
        slot.pending_pos = pos;
    }
    const size_t H = size_t(target_.n_embd());
    slot.pending.resize(taps.size());
    for (size_t k = 0; k < taps.size(); ++k) {
        int32_t n_rows = 0;
        const float * rows = target_.tap_rows(int32_t(k), &n_rows) + size_t(first_row) * H;
        auto & dst = slot.pending[k];
        dst.resize(size_t(slot.n_pending) * H);
        dst.insert(dst.end(), rows, rows + size_t(n) * H);
    }
    slot.n_pending += n;
    if (slot.n_pending > kMaxPendingRows && slot.dflash && slot.kv_source == slot.dflash.get()) {
        flush_features(slot, *slot.dflash);
    }
}

// Training rows of a `capture` request: the target features of rows first_row .. first_row+n-1 of
// this step's batch (the sequence's next n positions) and, for the last n_labelled of them (the
// rows that have logits), the target's argmax; -1 for the others.
void Scheduler::capture_rows(Sequence & s, int32_t first_row, int32_t n, int32_t n_labelled) {
    if (!s.req.capture || n <= 0) {
        return;
    }
    auto & out = *s.out;
    const size_t H = size_t(out.cap_embd), L = size_t(out.cap_taps);
    const size_t old = out.cap_labels.size();
    out.cap_features.resize((old + size_t(n)) * L * H);
    for (size_t k = 0; k < L; ++k) {
        int32_t n_rows = 0;
        const float * rows = target_.tap_rows(int32_t(k), &n_rows);
        for (int32_t i = 0; i < n; ++i) {
            const float * src = rows + size_t(first_row + i) * H;
            std::copy(src, src + H, out.cap_features.begin() + ptrdiff_t(((old + size_t(i)) * L + k) * H));
        }
    }
    const int32_t n_vocab = target_.n_vocab();
    for (int32_t i = 0; i < n; ++i) {
        int32_t label = -1;
        if (i >= n - n_labelled) {
            const float * row = target_.logits(first_row + i);
            label = int32_t(std::max_element(row, row + n_vocab) - row);
        }
        out.cap_labels.push_back(label);
    }
}

bool Scheduler::capturing(const std::vector<Sequence *> & seqs) const {
    return std::any_of(seqs.begin(), seqs.end(), [](const Sequence * s) { return s->req.capture; });
}

void Scheduler::flush_features(Slot & slot, DraftSource & src) {
    if (slot.n_pending <= 0) {
        return;
    }
    std::vector<const float *> taps;
    for (const auto & t : slot.pending) {
        taps.push_back(t.data());
    }
    src.commit(slot.pending_pos, slot.n_pending, taps);
    slot.pending_pos += slot.n_pending;
    slot.n_pending = 0;
}

// -- drafting and accepting ----------------------------------------------------------------------

// Whether s may verify drafts from its own history: a greedy sequence that drafts, on this
// scheduler's drafter or on none (a target loaded without a drafter still gains where its text
// repeats); a request's own draft source (tests' replays) keeps its drafts.
bool Scheduler::lookup_allowed(const Sequence & s) const {
    if (params_.lookup <= 0 || target_.max_verify_drafts() == 0 || s.req.n_max == 0 || (s.req.n_max < 0 && params_.n_max == 0) ||
        s.req.gen.sampling.temperature > 0.0f) {
        return false;
    }
    return s.source ? s.source == s.slot->dflash.get() : !s.req.draft_source && !s.slot->dflash;
}

// How many drafts s may verify this step (0: none), from its own limits and `limit`: the
// drafter's block (max_width_) or, for drafts from the history, kMaxLookupWidth.
int32_t Scheduler::draft_cap(const Sequence & s, int32_t limit) const {
    if ((!s.source && !lookup_allowed(s)) || target_.max_verify_drafts() == 0) {
        return 0;
    }
    int32_t k = s.req.n_max >= 0 ? s.req.n_max : params_.n_max >= 0 ? params_.n_max : limit;
    k = std::min(k, limit);
    k = std::min(k, target_.n_ctx() - 1 - s.n_past);
    if (s.req.gen.max_tokens >= 0) {
        k = std::min(k, s.req.gen.max_tokens - s.out->stats.n_generated - 1);
    }
    return std::max(k, 0);
}

// How many tokens of a draft from s's own history to verify this step (0: none; then the drafter
// drafts as the width says): a sequence lookup_allowed() admits whose history holds a match.
// With a fixed n_max the whole proposal (up to the cap), under auto the width that its
// measured acceptance prices best against the target's measured (else modelled) cost of rows.
// Fills s.draft and s.lookup_match when it returns > 0.
int32_t Scheduler::lookup_width(Sequence & s, int32_t cap) {
    if (cap <= 0 || !lookup_allowed(s)) {
        return 0;
    }
    const Slot & slot = *s.slot;
    const int32_t n_hist = std::min(int32_t(slot.kv.size()), s.n_past);
    LookupDraft d = lookup_draft(slot.kv.data(), n_hist, s.anchor, params_.lookup, 4, cap);
    if (d.tokens.empty()) {
        return 0;
    }
    int32_t k = int32_t(d.tokens.size());
    const bool fixed = s.req.n_max > 0 || params_.n_max > 0;
    if (!fixed) {
        k = lookup_.choose(d.match, k, [this](int32_t rows) { return policy_.row_cost(rows); });
    }
    if (k <= 0) {
        return 0;
    }
    d.tokens.resize(size_t(k));
    s.draft.tokens = std::move(d.tokens);
    s.lookup_match = d.match;
    return k;
}

// A sequence's proposed block, cut to what it may verify: k drafts, llama.cpp's p_min early
// stop (greedy) and n_min.
void Scheduler::trim_draft(Sequence & s, int32_t k) {
    if (int32_t(s.draft.tokens.size()) > k) {
        s.draft.tokens.resize(size_t(k));
    }
    const float p_min = s.req.p_min >= 0.0f ? s.req.p_min : params_.p_min;
    const int32_t n_min = s.req.n_min >= 0 ? s.req.n_min : params_.n_min;
    if (p_min > 0.0f && s.req.gen.sampling.temperature <= 0.0f) {
        const auto & conf = s.draft.confidence;
        for (size_t j = 0; j < std::min(conf.size(), s.draft.tokens.size()); ++j) {
            if (conf[j] < p_min) {
                s.draft.tokens.resize(j);
                break;
            }
        }
    }
    if (int32_t(s.draft.tokens.size()) < std::max(n_min, 1)) {
        s.draft.tokens.clear();
    }
}

// Draft k[i] tokens for decoding[i] (0: none). Sequences drafting on this scheduler's drafter
// with the same k share one drafter graph (weights read once); other sources draft alone.
// Returns the drafting time.
double Scheduler::draft_all(const std::vector<Sequence *> & decoding, const std::vector<int32_t> & k) {
    double total_ms = 0.0;
    std::vector<bool> done(decoding.size(), false);
    int32_t rows = 0;  // the step's decode rows so far: one per sequence, the history drafts, kept blocks
    for (const Sequence * s : decoding) {
        rows += 1 + (s->lookup_match > 0 ? int32_t(s->draft.tokens.size()) : 0);
    }
    for (size_t i = 0; i < decoding.size(); ++i) {
        Sequence & s = *decoding[i];
        if (done[i] || k[i] <= 0 || !s.source || s.lookup_match > 0) {
            continue;
        }
        const bool batched = s.source == s.slot->dflash.get();
        std::vector<size_t> group{i};
        for (size_t j = i + 1; batched && j < decoding.size(); ++j) {
            Sequence & o = *decoding[j];
            if (!done[j] && k[j] == k[i] && o.source && o.source == o.slot->dflash.get() && o.lookup_match == 0) {
                group.push_back(j);
            }
        }
        const auto t0 = clock_type::now();
        int32_t n_flushed = 0;
        for (size_t g : group) {  // features of rows committed since each one's last block
            Sequence & o = *decoding[g];
            n_flushed += o.slot->n_pending;
            flush_features(*o.slot, *o.source);
        }
        const double t_inject = ms_since(t0);
        const auto t_block0 = clock_type::now();
        if (batched) {
            std::vector<DFlashDraftSource::Job> jobs;
            for (size_t g : group) {
                Sequence & o = *decoding[g];
                jobs.push_back({o.slot->dflash.get(), o.anchor, o.n_past, o.req.gen.sampling.temperature});
            }
            auto drafts = DFlashDraftSource::draft_batch(jobs, k[i]);
            for (size_t n = 0; n < group.size(); ++n) {
                decoding[group[n]]->draft = std::move(drafts[n]);
            }
        } else {
            s.draft = s.source->draft(s.anchor, s.n_past, k[i], s.req.gen.sampling.temperature, s.rng);
        }
        const double t_block = ms_since(t_block0), t_ms = t_inject + t_block;
        total_ms += t_ms;
        for (size_t g : group) {
            Sequence & o = *decoding[g];
            o.out->stats.t_draft_ms += t_ms / double(group.size());
            o.n_block_drafts = std::max(1, std::min(k[i], int32_t(o.draft.tokens.size())));
            trim_draft(o, k[i]);
            if (params_.n_max < 0 && o.req.n_max < 0 && o.req.gen.sampling.temperature <= 0.0f) {
                // under auto: only the prefix of the block worth its rows is verified
                const int32_t kept = policy_.trim(o.draft.confidence, int32_t(o.draft.tokens.size()), rows,
                                                  int32_t(decoding.size()));
                o.draft.tokens.resize(size_t(kept));
            }
            o.out->stats.n_trimmed += o.n_block_drafts - int32_t(o.draft.tokens.size());
            rows += int32_t(o.draft.tokens.size());
            done[g] = true;
        }
        if (params_.n_max < 0) {
            const double n = double(group.size());
            policy_.observe_draft(k[i], t_block / n);
            policy_.observe_inject(int32_t(std::lround(n_flushed / n)), t_inject / n);
        }
    }
    return total_ms;
}

// Accept the longest verified prefix of s's draft and the target's own next token; commit them.
void Scheduler::accept(Sequence & s) {
    auto & st = s.out->stats;
    const auto t0 = clock_type::now();
    const int32_t n_draft = int32_t(s.draft.tokens.size());
    const dflash_sampling_params & sp = s.req.gen.sampling;
    Constraints & cons = *s.constraints;
    int32_t n_acc = 0;
    int32_t next = -1;
    bool decided = false;  // `next` came from a rejected draft's row
    for (; n_acc < n_draft; ++n_acc) {
        // each row is judged with the constraints (grammar state) after the drafts before it
        const float * row = target_.logits(s.row0 + n_acc);
        const int32_t y = s.draft.tokens[size_t(n_acc)];
        if (sp.temperature <= 0.0f) {
            next = cons.greedy(row);
            if (next != y) {
                decided = true;
                break;
            }
        } else {
            build_distribution(cons.apply(row), target_.n_vocab(), sp, p_row_);
            if (!accept_or_resample(p_row_, s.draft.q.at(size_t(n_acc)), y, s.rng, &next)) {
                decided = true;
                break;
            }
        }
        cons.record_probs(row, y, sp, *s.out);
        cons.accept(y);
        next = -1;
    }
    const float * last_row = target_.logits(s.row0 + n_acc);
    if (!decided) {  // all drafts accepted (or none proposed): the bonus token
        next = cons.sample(last_row, sp, s.rng, p_row_);
    }
    if (next >= 0) {
        cons.record_probs(last_row, next, sp, *s.out);
        cons.accept(next);
    }
    st.n_accepted += n_acc;
    st.n_drafted += n_draft;
    for (int32_t i = 0; i < std::min(n_acc, 16); ++i) {
        st.n_accepted_per_pos[i]++;
    }
    if (n_draft > 0 && s.lookup_match > 0) {  // the width policy learns the drafter's acceptance only
        lookup_.observe(s.lookup_match, n_draft, n_acc);
        st.n_lookup_drafted += n_draft;
        st.n_lookup_accepted += n_acc;
    } else if (n_draft > 0) {
        s.counts.observe(n_draft, n_acc);
        policy_.observe_accept(n_draft, n_acc);
    }
    if (s.n_block_drafts > 0 && s.lookup_match == 0 && params_.n_max < 0 && s.req.n_max < 0) {
        // the trim's survival rates; its calibration from greedy picks only (what it cuts)
        static const std::vector<float> kNone;
        policy_.observe_trim(sp.temperature <= 0.0f ? s.draft.confidence : kNone, s.n_block_drafts, n_draft, n_acc);
    }
    // rows 0..n_acc of the block stay in the caches, the rest is rolled back
    const int32_t n_commit = n_acc + 1;
    capture_rows(s, s.row0, n_commit, n_commit);
    Slot & slot = *s.slot;
    if (s.source && slot.kv_source == s.source) {
        keep_features(slot, s.row0, s.n_past, n_commit);
    } else if (s.source) {
        std::vector<const float *> none;
        s.source->commit(s.n_past, n_commit, none);
    }
    if (n_commit < n_draft + 1) {
        if (target_.rollback_kind() == Rollback::checkpoint) {
            const auto t_rb = clock_type::now();
            target_.restore_checkpoint(slot.index, s.n_past);
            std::vector<int32_t> rows{s.anchor};
            rows.insert(rows.end(), s.draft.tokens.begin(), s.draft.tokens.begin() + n_acc);
            replays_.push_back({slot.index, std::move(rows), &s});
            const double t = ms_since(t_rb);
            st.t_rollback_ms += t;
            step_rollback_ms_ += t;
        } else {
            target_.rollback(slot.index, s.n_past + n_commit);
        }
    }
    slot.kv.push_back(s.anchor);
    slot.kv.insert(slot.kv.end(), s.draft.tokens.begin(), s.draft.tokens.begin() + n_acc);
    s.n_past += n_commit;
    st.t_accept_ms += ms_since(t0);
    bool running = true;
    for (int32_t i = 0; i < n_acc && running; ++i) {
        running = s.committer->push(s.draft.tokens[size_t(i)]);
    }
    if (running && next < 0) {  // the grammar is complete and allows nothing more
        st.stop_reason = DFLASH_STOP_EOS;
        running = false;
    } else if (running) {
        running = s.committer->push(next);
    }
    s.anchor = next;
    if (!running) {
        finish(s);
    }
}

// Checkpoint rollback: decode the committed rows of every rejected block again, in one batch
// (logits and taps of the verify are already taken), so each sequence's recurrent state is the
// state after its last committed row.
void Scheduler::replay_rejected() {
    if (replays_.empty()) {
        return;
    }
    const auto t0 = clock_type::now();
    std::vector<Target::Chunk> chunks;
    int32_t rows = 0;
    for (const auto & r : replays_) {
        chunks.push_back({r.slot, r.tokens.data(), int32_t(r.tokens.size()), Target::LOGITS_NONE});
        rows += int32_t(r.tokens.size());
    }
    target_.decode_chunks(chunks);
    const double t = ms_since(t0);
    step_rollback_ms_ += t;
    for (const auto & r : replays_) {
        if (r.seq) {
            auto & st = r.seq->out->stats;
            st.t_rollback_ms += t * double(r.tokens.size()) / double(rows);
            st.n_replayed += int32_t(r.tokens.size());
        }
    }
    replays_.clear();
}

void Scheduler::finish(Sequence & s) {
    if (s.state == Sequence::DONE) {
        return;
    }
    s.committer->finish();
    if (s.out->n_probs > 0) {  // probabilities of tokens past a stop were recorded, not committed
        const size_t n = s.out->tokens.size(), k = size_t(s.out->n_probs);
        s.out->logprob.resize(std::min(s.out->logprob.size(), n));
        s.out->top_ids.resize(std::min(s.out->top_ids.size(), n * k));
        s.out->top_logprobs.resize(std::min(s.out->top_logprobs.size(), n * k));
    }
    s.out->stats.t_total_ms = ms_since(s.t_started == clock_type::time_point{} ? s.t_added : s.t_started);
    s.state = Sequence::DONE;
    for (auto & r : replays_) {
        if (r.seq == &s) {
            r.seq = nullptr;  // its stats are final; the replay still runs (the slot's KV needs it)
        }
    }
    if (s.slot) {
        s.slot->owner = 0;
        s.slot->last_used = n_steps_;
        s.slot = nullptr;
    }
}

// -- the step --------------------------------------------------------------------------------

void Scheduler::step(dflash_step_info * info) {
    *info = dflash_step_info{};
    const auto t_step = clock_type::now();
    step_rollback_ms_ = 0.0;
    n_steps_++;
    for (auto & s : seqs_) {
        if (s->cancel && s->state != Sequence::DONE) {
            s->out->stats.stop_reason = DFLASH_STOP_CANCELLED;
            finish(*s);
        }
    }
    admit();

    std::vector<Sequence *> decoding, prefilling;
    for (auto & sp : seqs_) {
        Sequence & s = *sp;
        if (s.state == Sequence::DECODE) {
            if (s.n_past >= target_.n_ctx()) {
                s.out->stats.stop_reason = DFLASH_STOP_CONTEXT;
                finish(s);
                continue;
            }
            decoding.push_back(&s);
        } else if (s.state == Sequence::PREFILL) {
            prefilling.push_back(&s);
        }
    }

    // -- the draft width of this step
    int32_t width = 0;
    bool probe = false;
    std::vector<WidthPolicy::Candidate> cands;
    bool any_source = false;
    std::vector<WidthPolicy::Candidate> auto_cands;  // sequences whose width the policy picks
    for (auto * s : decoding) {
        // greedy blocks of the DFlash drafter carry its confidence: the policy trims them
        const bool trimmed = s->source && s->source == s->slot->dflash.get() && s->req.gen.sampling.temperature <= 0.0f;
        cands.push_back({draft_cap(*s, max_width_), &s->counts, trimmed});
        any_source = any_source || s->source;
        if (s->source && s->req.n_max < 0) {
            auto_cands.push_back(cands.back());
        }
    }
    if (any_source) {
        width = params_.n_max >= 0 ? std::min(params_.n_max, max_width_)
                : auto_cands.empty() ? 0 : policy_.choose(auto_cands, &probe);
    }

    // -- capture the target's features in this step's decode when the drafter may use them. Under
    // auto the capture stays on while speculation is off: switching it rebuilds the target's graph
    // (SmolLM2-135M: 5-10 ms, over half a decode step, twice per probe), capturing costs nothing
    // measurable per step, and a probe then drafts over every committed row.
    bool need_taps = false;
    for (const auto * group : {&prefilling, &decoding}) {
        for (auto * s : *group) {
            if (s->source && s->slot->kv_source == s->source) {
                const bool fixed = s->req.n_max > 0 || params_.n_max > 0;
                need_taps = need_taps || fixed || (params_.n_max < 0 && s->req.n_max != 0);
            }
        }
    }
    need_taps = need_taps || capturing(prefilling) || capturing(decoding);
    if (need_taps != taps_on_) {
        target_.set_taps(need_taps ? tap_layers_ : std::vector<int32_t>{});
        taps_on_ = need_taps;
    }

    // -- draft: one block per decoding sequence, capped by its limits and the row budget
    rows_.clear();
    std::vector<Target::Chunk> chunks;
    int32_t budget = n_batch_ - int32_t(decoding.size());  // one row each is always there
    std::vector<int32_t> ks(decoding.size(), 0);
    int32_t n_drafting = 0, max_drafts = 0;
    for (size_t i = 0; i < decoding.size(); ++i) {
        Sequence & s = *decoding[i];
        s.draft = Draft{};
        s.lookup_match = 0;
        s.n_block_drafts = 0;
        // a request with its own n_max drafts exactly that (capped); the others take the width
        ks[i] = s.source ? std::min({s.req.n_max >= 0 ? cands[i].cap : std::min(width, cands[i].cap), budget}) : 0;
        const int32_t k_lookup = lookup_width(s, std::min(draft_cap(s, max_lookup_width_), budget));
        if (k_lookup > 0) {
            ks[i] = k_lookup;  // drafted from the history: the drafter skips this sequence
            trim_draft(s, k_lookup);
            if (s.draft.tokens.empty()) {
                s.lookup_match = 0;
                ks[i] = 0;
            }
        }
        budget -= ks[i];
    }
    info->t_draft_ms = draft_all(decoding, ks);
    for (auto * s : decoding) {
        n_drafting += s->draft.tokens.empty() ? 0 : 1;
        max_drafts = std::max(max_drafts, int32_t(s->draft.tokens.size()));
    }
    for (auto * s : decoding) {
        s->row0 = int32_t(rows_.size());
        rows_.push_back(s->anchor);
        rows_.insert(rows_.end(), s->draft.tokens.begin(), s->draft.tokens.end());
        s->n_rows = int32_t(s->draft.tokens.size()) + 1;
    }
    const int32_t n_decode_rows = int32_t(rows_.size());
    // -- prefill chunks of new sequences in the rows left (continuous batching)
    budget = n_batch_ - n_decode_rows;
    for (auto * s : prefilling) {
        const int32_t n = std::min(int32_t(s->prompt.size()) - s->n_prefilled, budget);
        if (n <= 0) {
            s->n_rows = 0;
            continue;
        }
        s->row0 = int32_t(rows_.size());
        rows_.insert(rows_.end(), s->prompt.begin() + s->n_prefilled, s->prompt.begin() + s->n_prefilled + n);
        s->n_rows = n;
        budget -= n;
    }
    for (auto * s : decoding) {
        chunks.push_back({s->slot->index, rows_.data() + s->row0, s->n_rows,
                          s->n_rows > 1 ? Target::LOGITS_ALL : Target::LOGITS_LAST});
    }
    for (auto * s : prefilling) {
        if (s->n_rows > 0) {
            const bool last = s->n_prefilled + s->n_rows == int32_t(s->prompt.size());
            chunks.push_back({s->slot->index, rows_.data() + s->row0, s->n_rows,
                              last ? Target::LOGITS_LAST : Target::LOGITS_NONE});
        }
    }
    if (chunks.empty()) {
        info->n_waiting = n_pending();
        info->t_step_ms = ms_since(t_step);
        return;
    }

    // -- checkpoint rollback: save the recurrent state of every sequence verifying drafts
    if (target_.rollback_kind() == Rollback::checkpoint) {
        for (auto * s : decoding) {
            if (s->n_rows > 1) {
                const auto t0 = clock_type::now();
                target_.checkpoint(s->slot->index);
                const double t = ms_since(t0);
                s->out->stats.t_rollback_ms += t;
                step_rollback_ms_ += t;
            }
        }
    }

    // -- verify (and prefill) in one target batch
    const auto t_verify = clock_type::now();
    target_.decode_chunks(chunks);
    const double verify_ms = ms_since(t_verify);
    info->t_verify_ms = verify_ms;
    const int32_t n_prefill_rows = int32_t(rows_.size()) - n_decode_rows;
    if (params_.n_max < 0) {
        if (n_prefill_rows == 0) {
            policy_.observe_target(n_decode_rows, verify_ms);
        } else {
            policy_.observe_prefill();
        }
    }

    // -- accept, per decoding sequence
    for (auto * s : decoding) {
        auto & st = s->out->stats;
        st.t_verify_ms += verify_ms;
        st.n_verify_steps++;
        const int32_t before = st.n_generated;
        accept(*s);
        info->n_committed += st.n_generated - before;
    }
    // what a drafting step's rollback costs beyond its verify (checkpoint: save, restore, replay)
    bool from_history = false, from_drafter = false;
    int32_t n_drafted_seqs = 0;
    for (const auto * s : decoding) {
        from_history = from_history || (!s->draft.tokens.empty() && s->lookup_match > 0);
        from_drafter = from_drafter || s->n_block_drafts > 0;  // a block cut to nothing was paid for too
        n_drafted_seqs += s->n_rows > 1 ? 1 : 0;
    }
    // -- prefill progress; a finished prompt gives the sequence its first token
    for (auto * s : prefilling) {
        if (s->n_rows <= 0) {
            continue;
        }
        Slot & slot = *s->slot;
        if (s->source && slot.kv_source == s->source) {
            keep_features(slot, s->row0, s->n_prefilled, s->n_rows);
        }
        const bool prompt_done = s->n_prefilled + s->n_rows == int32_t(s->prompt.size());
        capture_rows(*s, s->row0, s->n_rows, prompt_done ? 1 : 0);
        slot.kv.insert(slot.kv.end(), rows_.begin() + s->row0, rows_.begin() + s->row0 + s->n_rows);
        s->n_prefilled += s->n_rows;
        s->n_past = s->n_prefilled;
        if (s->n_prefilled < int32_t(s->prompt.size())) {
            continue;
        }
        auto & st = s->out->stats;
        const float * row = target_.logits(s->row0 + s->n_rows - 1);
        s->anchor = s->constraints->sample(row, s->req.gen.sampling, s->rng, p_row_);
        if (s->anchor >= 0) {
            s->constraints->record_probs(row, s->anchor, s->req.gen.sampling, *s->out);
            s->constraints->accept(s->anchor);
        }
        st.t_prefill_ms = ms_since(s->t_started);
        s->state = Sequence::DECODE;
        if (s->req.gen.max_tokens == 0) {
            st.stop_reason = DFLASH_STOP_MAX_TOKENS;
            finish(*s);
        } else if (s->anchor < 0) {  // the grammar allows no first token
            st.stop_reason = DFLASH_STOP_EOS;
            finish(*s);
        } else if (!s->committer->push(s->anchor)) {
            finish(*s);
        } else {
            info->n_committed++;
        }
    }
    if (target_.rollback_kind() == Rollback::checkpoint) {
        replay_rejected();
        if (params_.n_max < 0 && n_prefill_rows == 0 && n_drafted_seqs > 0) {
            policy_.observe_rollback(step_rollback_ms_ / double(n_drafted_seqs));
        }
    }
    if (params_.n_max < 0 && n_prefill_rows == 0 && !decoding.empty()) {
        using Kind = WidthPolicy::StepKind;
        policy_.observe_step(from_history ? Kind::kHistory : from_drafter ? Kind::kDrafted : Kind::kPlain,
                             info->n_committed, ms_since(t_step));
    }
    if (probe) {
        policy_.probe_done();
    }

    info->width = max_drafts;
    info->probe = probe;
    info->n_rows = int32_t(rows_.size());
    info->n_prefill_rows = n_prefill_rows;
    info->n_decoding = int32_t(decoding.size());
    info->n_drafting = n_drafting;
    for (const auto & s : seqs_) {
        info->n_finished += s->state == Sequence::DONE ? 1 : 0;
    }
    info->n_waiting = n_pending();
    info->t_step_ms = ms_since(t_step);
}

}  // namespace dflash
