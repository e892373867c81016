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

std::unique_ptr<dflash_output> generate(Target & target, DraftSource * drafter, const SpeculativeParams & spec,
                                        const int32_t * prompt, int32_t n_prompt,
                                        const dflash_generate_params & params, dflash_token_callback callback,
                                        void * user_data) {
    validate(params, spec);
    if (n_prompt <= 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the prompt is empty");
    }
    if (n_prompt >= target.n_ctx()) {
        fail(DFLASH_ERR_CONTEXT_FULL, "the prompt has %d tokens but the context holds %d (leave room to generate)",
             n_prompt, target.n_ctx());
    }
    auto out = std::make_unique<dflash_output>();
    auto & st = out->stats;
    st.n_prompt = n_prompt;
    const auto t_start = clock_type::now();
    const float temperature = params.sampling.temperature;
    Rng rng(params.sampling.seed);
    Distribution p_row;
    Committer committer(target, params, callback, user_data, *out);

    // -- prefill: the prompt, with the drafter's taps on so it sees every committed row
    target.set_taps(drafter ? drafter->tap_layers() : std::vector<int32_t>{});
    target.rollback(0, 0);
    if (drafter) {
        drafter->begin(prompt, n_prompt);
    }
    for (int32_t i = 0; i < n_prompt; i += target.n_batch()) {
        const int32_t n = std::min(target.n_batch(), n_prompt - i);
        target.decode(0, prompt + i, nullptr, n, false);
        if (drafter) {
            drafter->commit(i, n, tap_slices(target, 0));
        }
    }
    st.t_prefill_ms = ms_since(t_start);

    // the first token comes from the prompt's last row
    int32_t n_past = n_prompt;  // positions < n_past are committed and decoded
    int32_t anchor = sample_token(target.logits(-1), target.n_vocab(), params.sampling, rng, p_row);
    bool running = params.max_tokens != 0;
    if (!running) {
        st.stop_reason = DFLASH_STOP_MAX_TOKENS;
    } else {
        running = committer.push(anchor);
    }

    std::vector<int32_t> batch;
    while (running) {
        // room for the block [anchor, d_1..d_k] at positions n_past .. n_past + k
        if (n_past >= target.n_ctx()) {
            st.stop_reason = DFLASH_STOP_CONTEXT;
            break;
        }
        int32_t k = std::min(spec.n_max, target.n_ctx() - 1 - n_past);
        if (params.max_tokens >= 0) {
            k = std::min(k, params.max_tokens - st.n_generated - 1);
        }
        k = std::max(k, 0);

        // -- draft
        Draft draft;
        if (drafter && k > 0) {
            const auto t0 = clock_type::now();
            draft = drafter->draft(anchor, n_past, k, temperature, rng);
            st.t_draft_ms += ms_since(t0);
            if (int32_t(draft.tokens.size()) > k) {
                draft.tokens.resize(size_t(k));
            }
            if (int32_t(draft.tokens.size()) < std::max(spec.n_min, 1)) {
                draft.tokens.clear();
            }
        }
        const int32_t n_draft = int32_t(draft.tokens.size());

        // -- verify: one target batch
        const auto t_verify = clock_type::now();
        batch.assign(1, anchor);
        batch.insert(batch.end(), draft.tokens.begin(), draft.tokens.end());
        target.decode(0, batch.data(), nullptr, int32_t(batch.size()), n_draft > 0);
        st.t_verify_ms += ms_since(t_verify);
        st.n_verify_steps++;
        st.n_drafted += n_draft;

        // -- accept: the longest verified prefix, then one token from the target itself
        const auto t_accept = clock_type::now();
        int32_t n_acc = 0;
        int32_t next = -1;
        for (; n_acc < n_draft; ++n_acc) {
            const float * row = target.logits(n_acc);
            const int32_t y = draft.tokens[size_t(n_acc)];
            if (temperature <= 0.0f) {
                next = argmax(row, target.n_vocab());
                if (next != y) {
                    break;
                }
            } else {
                build_distribution(row, target.n_vocab(), params.sampling, p_row);
                if (!accept_or_resample(p_row, draft.q.at(size_t(n_acc)), y, rng, &next)) {
                    break;
                }
            }
            next = -1;
        }
        if (next < 0) {  // all drafts accepted (or none proposed): the bonus token
            next = sample_token(target.logits(n_draft > 0 ? n_draft : -1), target.n_vocab(), params.sampling, rng,
                                p_row);
        }
        st.n_accepted += n_acc;
        for (int32_t i = 0; i < std::min(n_acc, 16); ++i) {
            st.n_accepted_per_pos[i]++;
        }

        // -- commit: rows 0..n_acc of the batch stay in both caches, the rest is rolled back
        const int32_t n_commit = n_acc + 1;
        if (drafter) {
            drafter->commit(n_past, n_commit, tap_slices(target, 0));
        }
        if (n_commit < int32_t(batch.size())) {
            target.rollback(0, n_past + n_commit);
        }
        n_past += n_commit;
        st.t_accept_ms += ms_since(t_accept);
        for (int32_t i = 0; i < n_acc && running; ++i) {
            running = committer.push(draft.tokens[size_t(i)]);
        }
        if (running) {
            running = committer.push(next);
        }
        anchor = next;
    }
    committer.finish();
    st.t_total_ms = ms_since(t_start);
    return out;
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
