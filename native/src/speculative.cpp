#include "speculative.h"

#include "error.h"
#include "sampling.h"

#include <algorithm>
#include <chrono>
#include <unordered_map>

namespace dflash {

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

void validate(const dflash_generate_params & params, const SpeculativeParams & spec) {
    validate_sampling_params(params.sampling);
    if (params.n_stop < 0 || (params.n_stop > 0 && !params.stop)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "invalid stop string list");
    }
    for (int32_t i = 0; i < params.n_stop; ++i) {
        if (!params.stop[i] || !params.stop[i][0]) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "stop string %d is empty", i);
        }
    }
    if (spec.n_max < 0 || spec.n_min < 0 || spec.n_min > spec.n_max) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "need 0 <= n_min <= n_max (got n_min %d, n_max %d)", spec.n_min, spec.n_max);
    }
    if (!(spec.p_min >= 0.0f && spec.p_min <= 1.0f)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "p_min must be in [0, 1] (got %g)", spec.p_min);
    }
}

// Tap rows [first, first + n) of the last decode, one pointer per tap.
std::vector<const float *> tap_slices(Target & target, int32_t first) {
    std::vector<const float *> out;
    for (size_t k = 0; k < target.taps().size(); ++k) {
        int32_t n_rows = 0;
        out.push_back(target.tap_rows(int32_t(k), &n_rows) + size_t(first) * size_t(target.n_embd()));
    }
    return out;
}

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

}  // namespace

bool accept_or_resample(const Distribution & p, const Distribution & q, int32_t y, Rng & rng, int32_t * resampled) {
    std::unordered_map<int32_t, float> q_of;
    for (size_t i = 0; i < q.ids.size(); ++i) {
        q_of[q.ids[i]] += q.probs[i];
    }
    float p_y = 0.0f;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        if (p.ids[i] == y) {
            p_y = p.probs[i];
        }
    }
    const float q_y = q_of.count(y) ? q_of[y] : 0.0f;
    if (q_y > 0.0f && rng.uniform() * q_y < p_y) {
        return true;
    }
    // residual distribution max(0, p - q) over p's support (q outside it only removes mass)
    Distribution residual;
    double mass = 0.0;
    for (size_t i = 0; i < p.ids.size(); ++i) {
        const auto it = q_of.find(p.ids[i]);
        const float r = std::max(0.0f, p.probs[i] - (it == q_of.end() ? 0.0f : it->second));
        if (r > 0.0f) {
            residual.ids.push_back(p.ids[i]);
            residual.probs.push_back(r);
            mass += r;
        }
    }
    if (mass <= 0.0) {
        *resampled = draw(p, rng);
        return false;
    }
    for (auto & r : residual.probs) {
        r = float(r / mass);
    }
    *resampled = draw(residual, rng);
    return false;
}

namespace {

// One sequence of a (batched) generation: its prompt, drafter, RNG, committed state and output.
struct Sequence {
    int32_t         seq_id = 0;
    const int32_t * prompt = nullptr;
    int32_t         n_prompt = 0;
    DraftSource *   drafter = nullptr;
    Rng             rng;
    std::unique_ptr<dflash_output> out = std::make_unique<dflash_output>();
    std::unique_ptr<Committer>     committer;
    int32_t n_past = 0;   // positions < n_past are committed and decoded
    int32_t anchor = -1;  // the last committed token, not yet decoded
    bool    running = false;
    Draft   draft;
    int32_t row0 = 0;     // first row of this sequence's block in the step's batch
};

void prefill(Target & target, Sequence & s, const dflash_generate_params & params, Distribution & scratch) {
    auto & st = s.out->stats;
    st.n_prompt = s.n_prompt;
    const auto t0 = clock_type::now();
    target.rollback(s.seq_id, 0);
    if (s.drafter) {
        s.drafter->begin(s.prompt, s.n_prompt);
    }
    for (int32_t i = 0; i < s.n_prompt; i += target.n_batch()) {
        const int32_t n = std::min(target.n_batch(), s.n_prompt - i);
        target.decode(s.seq_id, s.prompt + i, nullptr, n, false);
        if (s.drafter) {
            s.drafter->commit(i, n, tap_slices(target, 0));
        }
    }
    // the first token comes from the prompt's last row
    s.n_past = s.n_prompt;
    s.anchor = sample_token(target.logits(-1), target.n_vocab(), params.sampling, s.rng, scratch);
    s.running = params.max_tokens != 0;
    if (!s.running) {
        st.stop_reason = DFLASH_STOP_MAX_TOKENS;
    } else {
        s.running = s.committer->push(s.anchor);
    }
    st.t_prefill_ms = ms_since(t0);
}

// How many drafts sequence s may verify this step, or -1 when its context is full.
int32_t draft_budget(const Target & target, const Sequence & s, const SpeculativeParams & spec,
                     const dflash_generate_params & params) {
    if (s.n_past >= target.n_ctx()) {
        return -1;
    }
    int32_t k = std::min(spec.n_max, target.n_ctx() - 1 - s.n_past);
    if (params.max_tokens >= 0) {
        k = std::min(k, params.max_tokens - s.out->stats.n_generated - 1);
    }
    return std::max(k, 0);
}

// Accept the longest verified prefix of s's draft and the target's own next token; commit them.
void accept(Target & target, Sequence & s, const dflash_generate_params & params, Distribution & p_row) {
    auto & st = s.out->stats;
    const auto t0 = clock_type::now();
    const int32_t n_draft = int32_t(s.draft.tokens.size());
    const float temperature = params.sampling.temperature;
    int32_t n_acc = 0;
    int32_t next = -1;
    for (; n_acc < n_draft; ++n_acc) {
        const float * row = target.logits(s.row0 + n_acc);
        const int32_t y = s.draft.tokens[size_t(n_acc)];
        if (temperature <= 0.0f) {
            next = argmax(row, target.n_vocab());
            if (next != y) {
                break;
            }
        } else {
            build_distribution(row, target.n_vocab(), params.sampling, p_row);
            if (!accept_or_resample(p_row, s.draft.q.at(size_t(n_acc)), y, s.rng, &next)) {
                break;
            }
        }
        next = -1;
    }
    if (next < 0) {  // all drafts accepted (or none proposed): the bonus token
        next = sample_token(target.logits(s.row0 + n_draft), target.n_vocab(), params.sampling, s.rng, p_row);
    }
    st.n_accepted += n_acc;
    for (int32_t i = 0; i < std::min(n_acc, 16); ++i) {
        st.n_accepted_per_pos[i]++;
    }
    // rows 0..n_acc of the block stay in both caches, the rest is rolled back
    const int32_t n_commit = n_acc + 1;
    if (s.drafter) {
        s.drafter->commit(s.n_past, n_commit, tap_slices(target, s.row0));
    }
    if (n_commit < n_draft + 1) {
        target.rollback(s.seq_id, s.n_past + n_commit);
    }
    s.n_past += n_commit;
    st.t_accept_ms += ms_since(t0);
    for (int32_t i = 0; i < n_acc && s.running; ++i) {
        s.running = s.committer->push(s.draft.tokens[size_t(i)]);
    }
    if (s.running) {
        s.running = s.committer->push(next);
    }
    s.anchor = next;
}

}  // namespace

std::vector<std::unique_ptr<dflash_output>> generate_batch(Target & target, const std::vector<DraftSource *> & drafters,
                                                           const SpeculativeParams & spec,
                                                           const std::vector<const int32_t *> & prompts,
                                                           const std::vector<int32_t> & n_prompts,
                                                           const dflash_generate_params & params,
                                                           dflash_token_callback callback,
                                                           const std::vector<void *> & user_data) {
    validate(params, spec);
    const size_t n_seq = prompts.size();
    if (n_seq == 0 || n_prompts.size() != n_seq || drafters.size() != n_seq || user_data.size() != n_seq) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "need one prompt (and drafter slot) per sequence");
    }
    if (int32_t(n_seq) > target.info().n_seq_max) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%zu sequences but the target was created for %d (n_seq_max)", n_seq,
             target.info().n_seq_max);
    }
    if (int32_t(n_seq) * (spec.n_max + 1) > target.n_batch()) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%zu sequences x %d rows per block exceed the batch size %d", n_seq,
             spec.n_max + 1, target.n_batch());
    }
    for (size_t i = 0; i < n_seq; ++i) {
        if (n_prompts[i] <= 0) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "prompt %zu is empty", i);
        }
        if (n_prompts[i] >= target.n_ctx()) {
            fail(DFLASH_ERR_CONTEXT_FULL, "prompt %zu has %d tokens but the context holds %d (leave room to generate)",
                 i, n_prompts[i], target.n_ctx());
        }
    }
    std::vector<int32_t> taps;
    for (auto * d : drafters) {
        if (d) {
            if (!taps.empty() && d->tap_layers() != taps) {
                fail(DFLASH_ERR_INVALID_ARGUMENT, "all drafters of a batch must tap the same target layers");
            }
            taps = d->tap_layers();
        }
    }
    target.set_taps(taps);

    const auto t_start = clock_type::now();
    Distribution p_row;
    std::vector<Sequence> seqs(n_seq);
    for (size_t i = 0; i < n_seq; ++i) {
        auto & s = seqs[i];
        s.seq_id = int32_t(i);
        s.prompt = prompts[i];
        s.n_prompt = n_prompts[i];
        s.drafter = drafters[i];
        s.rng.reseed(params.sampling.seed + i);  // sequence i samples with seed + i
        s.committer = std::make_unique<Committer>(target, params, callback, user_data[i], *s.out);
        prefill(target, s, params, p_row);
    }

    std::vector<int32_t> rows;
    std::vector<Target::Chunk> chunks;
    std::vector<Sequence *> active;
    while (true) {
        // -- draft: every running sequence proposes its block [anchor, d_1..d_k]
        active.clear();
        for (auto & s : seqs) {
            if (!s.running) {
                continue;
            }
            const int32_t k = draft_budget(target, s, spec, params);
            if (k < 0) {
                s.out->stats.stop_reason = DFLASH_STOP_CONTEXT;
                s.running = false;
                continue;
            }
            s.draft = Draft{};
            if (s.drafter && k > 0) {
                const auto t0 = clock_type::now();
                s.draft = s.drafter->draft(s.anchor, s.n_past, k, params.sampling.temperature, s.rng);
                s.out->stats.t_draft_ms += ms_since(t0);
                if (int32_t(s.draft.tokens.size()) > k) {
                    s.draft.tokens.resize(size_t(k));
                }
                if (spec.p_min > 0.0f && params.sampling.temperature <= 0.0f) {
                    const auto & conf = s.draft.confidence;
                    for (size_t j = 0; j < std::min(conf.size(), s.draft.tokens.size()); ++j) {
                        if (conf[j] < spec.p_min) {
                            s.draft.tokens.resize(j);
                            break;
                        }
                    }
                }
                if (int32_t(s.draft.tokens.size()) < std::max(spec.n_min, 1)) {
                    s.draft.tokens.clear();
                }
            }
            active.push_back(&s);
        }
        if (active.empty()) {
            break;
        }

        // -- verify: all blocks in one target batch
        rows.clear();
        chunks.clear();
        bool any_draft = false;
        for (auto * s : active) {
            s->row0 = int32_t(rows.size());
            rows.push_back(s->anchor);
            rows.insert(rows.end(), s->draft.tokens.begin(), s->draft.tokens.end());
            any_draft = any_draft || !s->draft.tokens.empty();
        }
        for (auto * s : active) {
            chunks.push_back({s->seq_id, rows.data() + s->row0, int32_t(s->draft.tokens.size()) + 1});
        }
        const auto t_verify = clock_type::now();
        target.decode_chunks(chunks, any_draft);
        const double verify_ms = ms_since(t_verify);
        for (auto * s : active) {
            auto & st = s->out->stats;
            st.t_verify_ms += verify_ms;
            st.n_verify_steps++;
            st.n_drafted += int32_t(s->draft.tokens.size());
        }

        // -- accept, per sequence
        for (auto * s : active) {
            accept(target, *s, params, p_row);
        }
    }

    std::vector<std::unique_ptr<dflash_output>> outs;
    for (auto & s : seqs) {
        s.committer->finish();
        s.out->stats.t_total_ms = ms_since(t_start);
        outs.push_back(std::move(s.out));
    }
    return outs;
}

std::unique_ptr<dflash_output> generate(Target & target, DraftSource * drafter, const SpeculativeParams & spec,
                                        const int32_t * prompt, int32_t n_prompt,
                                        const dflash_generate_params & params, dflash_token_callback callback,
                                        void * user_data) {
    auto outs = generate_batch(target, {drafter}, spec, {prompt}, {n_prompt}, params, callback, {user_data});
    return std::move(outs.front());
}

Draft ReplayDraftSource::draft(int32_t anchor, int32_t pos, int32_t n_max, float temperature, Rng & rng) {
    Draft d;
    // the anchor sits at pos, i.e. continuation index pos - n_prompt; propose what follows it
    const int32_t first = pos - n_prompt_ + 1;
    for (int32_t i = 0; i < n_max; ++i) {
        const int32_t j = first + i;
        if (j < 0 || j >= int32_t(script_.size())) {
            break;
        }
        const int32_t token = (script_[size_t(j)] + offset_) % n_vocab_;
        d.tokens.push_back(token);
        if (temperature > 0.0f) {
            d.q.push_back(Distribution{{token}, {1.0f}});
        }
    }
    return d;
}

}  // namespace dflash
