#include "generate.h"

#include "error.h"
#include "sampling.h"

#include <chrono>

namespace dflash {

namespace {
using clock_type = std::chrono::steady_clock;
double ms_since(clock_type::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}
}  // namespace

void validate_generate_params(const dflash_generate_params & params) {
    validate_sampling_params(params.sampling);
    if (params.n_stop < 0 || (params.n_stop > 0 && !params.stop)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "invalid stop string list");
    }
    for (int32_t i = 0; i < params.n_stop; ++i) {
        if (!params.stop[i] || !params.stop[i][0]) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "stop string %d is empty", i);
        }
    }
}

// Prefill the prompt on sequence 0 from an empty cache; leaves the last row's logits.
static void prefill(Target & target, const int32_t * prompt, int32_t n_prompt) {
    if (n_prompt <= 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the prompt is empty");
    }
    if (n_prompt >= target.n_ctx()) {
        fail(DFLASH_ERR_CONTEXT_FULL, "the prompt has %d tokens but the context holds %d (leave room to generate)",
             n_prompt, target.n_ctx());
    }
    target.rollback(0, 0);
    for (int32_t i = 0; i < n_prompt; i += target.n_batch()) {
        const int32_t n = std::min(target.n_batch(), n_prompt - i);
        target.decode(0, prompt + i, nullptr, n, false);
    }
}

std::unique_ptr<dflash_output> generate_plain(Target & target, const int32_t * prompt, int32_t n_prompt,
                                              const dflash_generate_params & params,
                                              dflash_token_callback callback, void * user_data) {
    validate_generate_params(params);
    auto out = std::make_unique<dflash_output>();
    auto & st = out->stats;
    const auto t_start = clock_type::now();

    std::vector<std::string> stop(params.stop, params.stop + params.n_stop);
    TextStream stream(std::move(stop));
    Rng rng(params.sampling.seed);
    Distribution scratch;

    prefill(target, prompt, n_prompt);
    st.n_prompt = n_prompt;
    st.t_prefill_ms = ms_since(t_start);

    int32_t n_past = n_prompt;
    std::string released;
    if (params.max_tokens == 0) {
        st.stop_reason = DFLASH_STOP_MAX_TOKENS;
    }
    while (st.stop_reason == DFLASH_STOP_NONE) {
        const auto t_sample = clock_type::now();
        const int32_t token = sample_token(target.logits(-1), target.n_vocab(), params.sampling, rng, scratch);
        st.t_accept_ms += ms_since(t_sample);
        out->tokens.push_back(token);
        st.n_generated++;

        const bool eos = !params.ignore_eos && target.is_eog(token);
        const bool hit_stop = eos ? false : stream.push(target.token_piece(token), released);
        if (eos) {
            released.clear();
        }
        if (callback && !callback(user_data, token, released.data(), released.size())) {
            st.stop_reason = DFLASH_STOP_CANCELLED;
            break;
        }
        if (eos) {
            st.stop_reason = DFLASH_STOP_EOS;
            break;
        }
        if (hit_stop) {
            st.stop_reason = DFLASH_STOP_STRING;
            break;
        }
        if (params.max_tokens >= 0 && st.n_generated >= params.max_tokens) {
            st.stop_reason = DFLASH_STOP_MAX_TOKENS;
            break;
        }
        if (n_past >= target.n_ctx()) {
            st.stop_reason = DFLASH_STOP_CONTEXT;
            break;
        }
        const auto t_decode = clock_type::now();
        target.decode(0, &token, nullptr, 1, false);
        st.t_verify_ms += ms_since(t_decode);
        st.n_verify_steps++;
        n_past++;
    }
    stream.flush(released);
    if (!released.empty() && callback && st.stop_reason != DFLASH_STOP_CANCELLED) {
        callback(user_data, -1, released.data(), released.size());
    }
    out->text = stream.text();
    st.t_total_ms = ms_since(t_start);
    return out;
}

}  // namespace dflash
