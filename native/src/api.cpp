// The extern "C" shims of dflash.h: argument checks, exception -> status translation. No logic
// of its own lives here.
#include "dflash.h"

#include "chat_request.h"
#include "devices.h"
#include "drafter.h"
#include "embedder.h"
#include "error.h"
#include "dflash_draft_source.h"
#include "scheduler.h"
#include "speculative.h"
#include "output.h"
#include "quantize.h"
#include "target.h"
#include "kernels/kernels.h"
#include "kernels/kernels_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace dflash {
const char * last_error_cstr();
void summarize_model(const char * path, dflash_model_summary & out);
}

using dflash::Error;
using dflash::fail;

struct dflash_target {
    dflash::Target impl;
    std::unique_ptr<dflash::Embedder> embedder;  // made on the first dflash_target_embed
    dflash_target(const char * path, const dflash_target_params & p) : impl(path, p) {}
};

struct dflash_chat {
    std::unique_ptr<dflash::Chat> impl;
};

struct dflash_drafter {
    std::unique_ptr<dflash::Drafter> impl;
};

struct dflash_scheduler {
    std::unique_ptr<dflash::Scheduler> impl;
};

namespace {

template <typename F>
dflash_status guarded(F && body) {
    try {
        body();
        dflash::clear_last_error();
        return DFLASH_OK;
    } catch (const Error & e) {
        return dflash::set_last_error(e.status(), e.what());
    } catch (const std::bad_alloc &) {
        return dflash::set_last_error(DFLASH_ERR_BACKEND, "out of memory");
    } catch (const std::exception & e) {
        return dflash::set_last_error(DFLASH_ERR_INTERNAL, std::string("internal error: ") + e.what());
    } catch (...) {
        return dflash::set_last_error(DFLASH_ERR_INTERNAL, "internal error");
    }
}

void require(bool ok, const char * what) {
    if (!ok) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%s", what);
    }
}

// Copy `s` into a caller buffer with a terminator; report the needed size when it doesn't fit.
void copy_out(const std::string & s, char * buf, size_t buf_size, size_t * n_out) {
    if (n_out) {
        *n_out = s.size();
    }
    if (!buf || buf_size < s.size() + 1) {
        fail(DFLASH_ERR_BUFFER_TOO_SMALL, "buffer of %zu bytes is too small (%zu needed)", buf_size, s.size() + 1);
    }
    memcpy(buf, s.data(), s.size());
    buf[s.size()] = '\0';
}

}  // namespace

extern "C" {

const char * dflash_last_error(void) { return dflash::last_error_cstr(); }

int32_t dflash_abi_version(void) { return 7; }

int32_t dflash_device_count(void) { return dflash::device_count(); }

dflash_status dflash_device_get_info(int32_t index, dflash_device_info * out) {
    return guarded([&] {
        require(out != nullptr, "out is NULL");
        *out = dflash::device_info(index);
    });
}

dflash_status dflash_add_rpc_server(const char * endpoint) {
    return guarded([&] {
        require(endpoint != nullptr, "endpoint is NULL");
        dflash::add_rpc_server(endpoint);
    });
}

const char * dflash_llama_commit(void) { return PYDFLASH_LLAMA_COMMIT; }

void dflash_set_verbose(bool verbose) { dflash::set_llama_log_verbose(verbose); }

bool dflash_kernels_active(void) {
    try {
        return dflash::kern::install() && dflash::kern::placement_enabled();
    } catch (...) {
        return false;
    }
}

const char * dflash_kernels_isa(void) { return dflash::kern::isa_name(dflash::kern::active_isa()); }
const char * dflash_kernels_best_isa(void) { return dflash::kern::isa_name(dflash::kern::best_isa()); }

bool dflash_kernels_isa_available(const char * isa) {
    dflash::kern::Isa want;
    return isa && dflash::kern::parse_isa(isa, &want) && dflash::kern::isa_available(want);
}

void dflash_kernels_set_attention(bool on) { dflash::kern::set_attention(on ? 2 : 0); }

dflash_status dflash_kernels_set_isa(const char * isa) {
    return guarded([&] {
        require(isa != nullptr, "isa is NULL");
        dflash::kern::Isa want = dflash::kern::best_isa();
        if (strcmp(isa, "auto") != 0 && !dflash::kern::parse_isa(isa, &want)) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "unknown ISA '%s' (scalar, avx2, avx512, neon, auto)", isa);
        }
        if (!dflash::kern::set_isa(want)) {
            fail(DFLASH_ERR_UNSUPPORTED, "ISA '%s' is not available on this CPU/build (best: %s)", isa,
                 dflash::kern::isa_name(dflash::kern::best_isa()));
        }
    });
}

dflash_status dflash_kernels_selftest(const char * isa, int32_t n_threads, bool quick, int32_t * n_failed,
                                      double * worst_nmse, char * report, size_t report_size) {
    return guarded([&] {
        require(n_failed != nullptr && worst_nmse != nullptr, "n_failed / worst_nmse is NULL");
        require(n_threads >= 1 && n_threads <= 256, "n_threads must be in 1..256");
        std::string text;
        const int   failed = dflash::kern::selftest(isa ? isa : "auto", n_threads, quick ? 1 : 0, text, *worst_nmse);
        if (failed < 0) {
            fail(DFLASH_ERR_UNSUPPORTED, "%s", text.c_str());
        }
        *n_failed = failed;
        if (report && report_size > 0) {
            const size_t n = std::min(report_size - 1, text.size());
            std::memcpy(report, text.data(), n);
            report[n] = '\0';
        }
    });
}

dflash_target_params dflash_target_default_params(void) {
    dflash_target_params p{};
    p.n_ctx        = 4096;
    p.n_batch      = 512;
    p.n_seq_max    = 1;
    p.n_threads    = 0;
    p.n_gpu_layers = 0;
    p.tap_source   = DFLASH_TAP_AUTO;
    p.n_verify_max = 0;
    return p;
}

dflash_status dflash_target_load(const char * path, const dflash_target_params * params, dflash_target ** out) {
    return guarded([&] {
        require(out != nullptr, "out is NULL");
        *out = nullptr;
        dflash::install_llama_log();
        const dflash_target_params p = params ? *params : dflash_target_default_params();
        *out = new dflash_target(path, p);
    });
}

void dflash_target_free(dflash_target * target) { delete target; }

dflash_status dflash_target_get_info(const dflash_target * target, dflash_target_info * out) {
    return guarded([&] {
        require(target && out, "target or out is NULL");
        *out = target->impl.info();
    });
}

dflash_status dflash_target_meta(const dflash_target * target, const char * key, char * buf, size_t buf_size) {
    return guarded([&] {
        require(target && key, "target or key is NULL");
        copy_out(target->impl.meta(key), buf, buf_size, nullptr);
    });
}

dflash_status dflash_target_tokenize(const dflash_target * target, const char * text, size_t len, bool add_special,
                                     bool parse_special, int32_t * tokens, int32_t n_tokens_max, int32_t * n_out) {
    return guarded([&] {
        require(target && (text || len == 0) && n_out, "target, text or n_out is NULL");
        const auto toks = target->impl.tokenize(std::string(text ? text : "", len), add_special, parse_special);
        *n_out = int32_t(toks.size());
        if (!tokens || n_tokens_max < int32_t(toks.size())) {
            fail(DFLASH_ERR_BUFFER_TOO_SMALL, "token buffer of %d is too small (%zu needed)", n_tokens_max, toks.size());
        }
        std::copy(toks.begin(), toks.end(), tokens);
    });
}

dflash_status dflash_target_detokenize(const dflash_target * target, const int32_t * tokens, int32_t n_tokens,
                                       bool render_special, char * buf, size_t buf_size, size_t * n_out) {
    return guarded([&] {
        require(target && (tokens || n_tokens == 0) && n_tokens >= 0, "invalid tokens");
        copy_out(target->impl.detokenize(tokens, n_tokens, render_special), buf, buf_size, n_out);
    });
}

dflash_status dflash_target_apply_chat_template(const dflash_target * target, const char * const * roles,
                                                const char * const * contents, size_t n_messages, bool add_assistant,
                                                char * buf, size_t buf_size, size_t * n_out) {
    return guarded([&] {
        require(target && (n_messages == 0 || (roles && contents)), "invalid messages");
        std::vector<std::string> r, c;
        for (size_t i = 0; i < n_messages; ++i) {
            require(roles[i] && contents[i], "a message role or content is NULL");
            r.emplace_back(roles[i]);
            c.emplace_back(contents[i]);
        }
        copy_out(target->impl.apply_chat_template(r, c, add_assistant), buf, buf_size, n_out);
    });
}

bool dflash_target_token_is_eog(const dflash_target * target, int32_t token) {
    return target && token >= 0 && token < target->impl.n_vocab() && target->impl.is_eog(token);
}

dflash_status dflash_target_set_taps(dflash_target * target, const int32_t * layers, int32_t n_layers) {
    return guarded([&] {
        require(target && n_layers >= 0 && (layers || n_layers == 0), "invalid tap layers");
        target->impl.set_taps(std::vector<int32_t>(layers, layers + n_layers));
    });
}

dflash_status dflash_target_decode(dflash_target * target, int32_t seq_id, const int32_t * tokens, const int32_t * pos,
                                   int32_t n_tokens, bool all_logits) {
    return guarded([&] {
        require(target && tokens, "target or tokens is NULL");
        target->impl.decode(seq_id, tokens, pos, n_tokens, all_logits);
    });
}

dflash_status dflash_target_logits(dflash_target * target, int32_t row, const float ** out) {
    return guarded([&] {
        require(target && out, "target or out is NULL");
        *out = target->impl.logits(row);
    });
}

dflash_status dflash_target_tap_rows(dflash_target * target, int32_t tap_index, const float ** out, int32_t * n_rows) {
    return guarded([&] {
        require(target && out && n_rows, "NULL argument");
        *out = target->impl.tap_rows(tap_index, n_rows);
    });
}

int32_t dflash_target_seq_pos_max(const dflash_target * target, int32_t seq_id) {
    if (!target || seq_id < 0 || seq_id >= target->impl.info().n_seq_max) {
        return -1;
    }
    return target->impl.seq_pos_max(seq_id);
}

dflash_status dflash_target_rollback(dflash_target * target, int32_t seq_id, int32_t pos) {
    return guarded([&] {
        require(target != nullptr, "target is NULL");
        target->impl.rollback(seq_id, pos);
    });
}

dflash_generate_params dflash_generate_default_params(void) {
    dflash_generate_params p{};
    p.max_tokens           = -1;
    p.sampling.temperature = 0.8f;
    p.sampling.top_k       = 40;
    p.sampling.top_p       = 0.95f;
    p.sampling.min_p       = 0.05f;
    p.sampling.seed        = 0;
    return p;
}

dflash_status dflash_target_generate(dflash_target * target, const int32_t * prompt, int32_t n_prompt,
                                     const dflash_generate_params * params, dflash_token_callback callback,
                                     void * user_data, dflash_output ** out) {
    return guarded([&] {
        require(target && prompt && params && out, "NULL argument");
        *out = nullptr;
        dflash::SpeculativeParams plain{0, 0, 0.0f};
        *out = dflash::generate_batch(target->impl, nullptr, nullptr, plain, {prompt}, {n_prompt}, *params, callback,
                                      {user_data})
                   .front()
                   .release();
    });
}

dflash_status dflash_target_generate_replay(dflash_target * target, const int32_t * prompt, int32_t n_prompt,
                                            const int32_t * continuation, int32_t n_continuation, int32_t offset,
                                            const dflash_spec_params * spec, const dflash_generate_params * params,
                                            dflash_token_callback callback, void * user_data, dflash_output ** out) {
    return guarded([&] {
        require(target && prompt && params && spec && out && (continuation || n_continuation == 0) &&
                    n_continuation >= 0 && (offset == 0 || offset == 1),
                "invalid replay arguments");
        *out = nullptr;
        dflash::ReplayDraftSource source(std::vector<int32_t>(continuation, continuation + n_continuation), offset,
                                         target->impl.n_vocab());
        const dflash::SpeculativeParams sp{spec->n_max, spec->n_min, spec->p_min};
        *out = dflash::generate_batch(target->impl, nullptr, &source, sp, {prompt}, {n_prompt}, *params, callback,
                                      {user_data})
                   .front()
                   .release();
    });
}

namespace {

// Checks a drafter against the target and the spec; returns the loop settings.
dflash::SpeculativeParams spec_for(const dflash_target * target, const dflash_drafter * drafter,
                                   const dflash_spec_params & spec) {
    if (spec.n_max < 0 || spec.n_min < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_max and n_min must be >= 0 (got %d, %d)", spec.n_max, spec.n_min);
    }
    int32_t block = 2;
    if (drafter) {
        require(drafter->impl != nullptr, "drafter is closed");
        const auto & hp = drafter->impl->hparams();
        const auto & t = target->impl;
        if (hp.n_embd != t.n_embd() || hp.n_vocab != t.n_vocab()) {
            fail(DFLASH_ERR_MISMATCH,
                 "the drafter (hidden %d, vocab %d) does not belong to this target (hidden %d, vocab %d)",
                 hp.n_embd, hp.n_vocab, t.n_embd(), t.n_vocab());
        }
        block = std::max(hp.block_size, 2);
    }
    dflash::SpeculativeParams sp{std::min(spec.n_max, block - 1), 0, spec.p_min};
    sp.n_min = std::min(spec.n_min, sp.n_max);
    return sp;
}

}  // namespace

dflash_status dflash_generate_speculative(dflash_target * target, dflash_drafter * drafter, const int32_t * prompt,
                                          int32_t n_prompt, const dflash_spec_params * spec,
                                          const dflash_generate_params * params, dflash_token_callback callback,
                                          void * user_data, dflash_output ** out) {
    return guarded([&] {
        require(target && drafter && prompt && spec && params && out, "NULL argument");
        *out = nullptr;
        const auto sp = spec_for(target, drafter, *spec);
        *out = dflash::generate_batch(target->impl, drafter->impl.get(), nullptr, sp, {prompt}, {n_prompt}, *params,
                                      callback, {user_data})
                   .front()
                   .release();
    });
}

dflash_status dflash_generate_batch(dflash_target * target, dflash_drafter * drafter, const int32_t * const * prompts,
                                    const int32_t * n_prompts, int32_t n_seq, const dflash_spec_params * spec,
                                    const dflash_generate_params * params, dflash_token_callback callback,
                                    void * const * user_data, dflash_output ** outs) {
    return guarded([&] {
        require(target && prompts && n_prompts && spec && params && outs && n_seq > 0, "invalid batch arguments");
        std::vector<const int32_t *> p(prompts, prompts + n_seq);
        std::vector<int32_t> n(n_prompts, n_prompts + n_seq);
        for (int32_t i = 0; i < n_seq; ++i) {
            require(p[size_t(i)] != nullptr, "a prompt is NULL");
        }
        const auto sp = spec_for(target, drafter, *spec);
        std::vector<void *> users(size_t(n_seq), nullptr);
        if (callback) {
            require(user_data != nullptr, "user_data is NULL");
            users.assign(user_data, user_data + n_seq);
        }
        auto results = dflash::generate_batch(target->impl, drafter ? drafter->impl.get() : nullptr, nullptr, sp, p, n,
                                              *params, callback, users);
        for (int32_t i = 0; i < n_seq; ++i) {
            outs[i] = results[size_t(i)].release();
        }
    });
}

// -- scheduler ---------------------------------------------------------------------------------

dflash_scheduler_params dflash_scheduler_default_params(void) {
    dflash_scheduler_params p{};
    p.n_max = -1;
    p.lookup = 2;
    return p;
}

dflash_request_params dflash_request_default_params(void) {
    dflash_request_params p{};
    p.gen = dflash_generate_default_params();
    p.n_max = -1;
    p.n_min = -1;
    p.p_min = -1.0f;
    p.slot = -1;
    p.cache_prompt = true;
    p.capture = false;
    return p;
}

dflash_status dflash_scheduler_create(dflash_target * target, dflash_drafter * drafter,
                                      const dflash_scheduler_params * params, dflash_scheduler ** out) {
    return guarded([&] {
        require(target && params && out, "NULL argument");
        *out = nullptr;
        if (drafter) {
            dflash_spec_params probe{std::max(params->n_max, 0), 0, 0.0f};
            spec_for(target, drafter, probe);  // the pair must belong together
        }
        dflash::SchedulerParams sp;
        sp.n_max = params->n_max;
        sp.n_min = params->n_min;
        sp.p_min = params->p_min;
        sp.n_batch = params->n_batch;
        sp.lookup = params->lookup;
        auto s = std::make_unique<dflash_scheduler>();
        s->impl = std::make_unique<dflash::Scheduler>(target->impl, drafter ? drafter->impl.get() : nullptr, sp);
        *out = s.release();
    });
}

void dflash_scheduler_free(dflash_scheduler * scheduler) { delete scheduler; }

const char * dflash_scheduler_notice(const dflash_scheduler * scheduler) {
    return scheduler ? scheduler->impl->notice().c_str() : "";
}

dflash_status dflash_scheduler_add(dflash_scheduler * scheduler, const int32_t * prompt, int32_t n_prompt,
                                   const dflash_request_params * params, dflash_token_callback callback,
                                   void * user_data, int32_t * id) {
    return guarded([&] {
        require(scheduler && params && id, "NULL argument");
        *id = 0;
        dflash::RequestParams req;
        req.gen = params->gen;
        req.n_max = params->n_max;
        req.n_min = params->n_min;
        req.p_min = params->p_min;
        req.slot = params->slot;
        req.cache_prompt = params->cache_prompt;
        req.capture = params->capture;
        *id = scheduler->impl->add(prompt, n_prompt, std::move(req), callback, user_data);
    });
}

dflash_status dflash_scheduler_cancel(dflash_scheduler * scheduler, int32_t id) {
    return guarded([&] {
        require(scheduler != nullptr, "NULL argument");
        scheduler->impl->cancel(id);
    });
}

dflash_status dflash_scheduler_step(dflash_scheduler * scheduler, dflash_step_info * info) {
    return guarded([&] {
        require(scheduler && info, "NULL argument");
        scheduler->impl->step(info);
    });
}

int32_t dflash_scheduler_finished(const dflash_scheduler * scheduler, int32_t * ids, int32_t n_ids) {
    if (!scheduler) {
        return 0;
    }
    const auto done = scheduler->impl->finished();
    for (int32_t i = 0; ids && i < n_ids && i < int32_t(done.size()); ++i) {
        ids[i] = done[size_t(i)];
    }
    return int32_t(done.size());
}

dflash_status dflash_scheduler_take(dflash_scheduler * scheduler, int32_t id, dflash_output ** out) {
    return guarded([&] {
        require(scheduler && out, "NULL argument");
        *out = nullptr;
        *out = scheduler->impl->take(id).release();
    });
}

dflash_status dflash_scheduler_slot_info(const dflash_scheduler * scheduler, int32_t slot, dflash_slot_info * out) {
    return guarded([&] {
        require(scheduler && out, "NULL argument");
        scheduler->impl->slot_info(slot, out);
    });
}

dflash_status dflash_scheduler_peek(const dflash_scheduler * scheduler, int32_t id, const dflash_output ** out) {
    return guarded([&] {
        require(scheduler && out, "NULL argument");
        *out = &scheduler->impl->peek(id);
    });
}

dflash_status dflash_scheduler_slot_save(dflash_scheduler * scheduler, int32_t slot, const char * path,
                                         int32_t * n_tokens, size_t * n_bytes) {
    return guarded([&] {
        require(scheduler && path && n_tokens, "NULL argument");
        size_t bytes = 0;
        *n_tokens = scheduler->impl->slot_save(slot, path, &bytes);
        if (n_bytes) {
            *n_bytes = bytes;
        }
    });
}

dflash_status dflash_scheduler_slot_restore(dflash_scheduler * scheduler, int32_t slot, const char * path,
                                            int32_t * n_tokens, size_t * n_bytes) {
    return guarded([&] {
        require(scheduler && path && n_tokens, "NULL argument");
        size_t bytes = 0;
        *n_tokens = scheduler->impl->slot_restore(slot, path, &bytes);
        if (n_bytes) {
            *n_bytes = bytes;
        }
    });
}

dflash_status dflash_scheduler_slot_erase(dflash_scheduler * scheduler, int32_t slot, int32_t * n_tokens) {
    return guarded([&] {
        require(scheduler && n_tokens, "NULL argument");
        *n_tokens = scheduler->impl->slot_erase(slot);
    });
}

dflash_status dflash_scheduler_get_tuning(const dflash_scheduler * scheduler, dflash_tuning * out) {
    return guarded([&] {
        require(scheduler && out, "NULL argument");
        const_cast<dflash::Scheduler &>(*scheduler->impl).policy().save(out);
    });
}

dflash_status dflash_scheduler_set_capture(dflash_scheduler * scheduler, const int32_t * layers, int32_t n) {
    return guarded([&] {
        require(scheduler && (layers || n == 0), "NULL argument");
        require(n >= 0, "n must be >= 0");
        scheduler->impl->set_capture(std::vector<int32_t>(layers, layers + n));
    });
}

dflash_status dflash_scheduler_fix_costs(dflash_scheduler * scheduler, const float * t_rows_ms, int32_t n_rows,
                                        const float * t_draft_ms, int32_t n_widths) {
    return guarded([&] {
        require(scheduler && (t_rows_ms || n_rows == 0) && (t_draft_ms || n_widths == 0) && n_rows >= 0 &&
                n_widths >= 0, "invalid argument");
        scheduler->impl->policy().fix_costs(std::vector<double>(t_rows_ms, t_rows_ms + n_rows),
                                            std::vector<double>(t_draft_ms, t_draft_ms + n_widths));
    });
}

dflash_status dflash_scheduler_set_tuning(dflash_scheduler * scheduler, const dflash_tuning * tuning) {
    return guarded([&] {
        require(scheduler && tuning, "NULL argument");
        scheduler->impl->policy().load(*tuning);
    });
}

const int32_t * dflash_output_tokens(const dflash_output * output, int32_t * n_tokens) {
    if (n_tokens) {
        *n_tokens = output ? int32_t(output->tokens.size()) : 0;
    }
    return output ? output->tokens.data() : nullptr;
}

const char * dflash_output_text(const dflash_output * output, size_t * n_bytes) {
    if (n_bytes) {
        *n_bytes = output ? output->text.size() : 0;
    }
    return output ? output->text.c_str() : "";
}

const dflash_stats * dflash_output_stats(const dflash_output * output) { return output ? &output->stats : nullptr; }

void dflash_output_probs(const dflash_output * output, int32_t * n_tokens, int32_t * n_probs, const float ** logprob,
                         const int32_t ** top_ids, const float ** top_logprobs) {
    const bool have = output && output->n_probs > 0;
    if (n_tokens) {
        *n_tokens = have ? int32_t(output->logprob.size()) : 0;
    }
    if (n_probs) {
        *n_probs = have ? output->n_probs : 0;
    }
    if (logprob) {
        *logprob = have ? output->logprob.data() : nullptr;
    }
    if (top_ids) {
        *top_ids = have ? output->top_ids.data() : nullptr;
    }
    if (top_logprobs) {
        *top_logprobs = have ? output->top_logprobs.data() : nullptr;
    }
}

const float * dflash_output_capture(const dflash_output * output, int32_t * n_rows, int32_t * n_taps, int32_t * n_embd,
                                   const int32_t ** labels) {
    const bool have = output && output->cap_taps > 0;
    if (n_rows) {
        *n_rows = have ? int32_t(output->cap_labels.size()) : 0;
    }
    if (n_taps) {
        *n_taps = have ? output->cap_taps : 0;
    }
    if (n_embd) {
        *n_embd = have ? output->cap_embd : 0;
    }
    if (labels) {
        *labels = have ? output->cap_labels.data() : nullptr;
    }
    return have ? output->cap_features.data() : nullptr;
}

void dflash_output_free(dflash_output * output) { delete output; }

dflash_status dflash_target_embed(dflash_target * target, const int32_t * tokens, int32_t n_tokens, int32_t pooling,
                                  float * out, size_t n_out_max, size_t * n_out, int32_t * n_rows) {
    return guarded([&] {
        require(target && n_out && n_rows, "NULL argument");
        require(out || n_out_max == 0, "out is NULL");
        if (!target->embedder) {
            target->embedder = std::make_unique<dflash::Embedder>(target->impl, llama_n_threads(target->impl.ctx()));
        }
        const std::vector<float> e = target->embedder->embed(tokens, n_tokens, pooling, n_rows);
        *n_out = e.size();
        if (e.size() > n_out_max) {
            dflash::fail(DFLASH_ERR_BUFFER_TOO_SMALL, "the embeddings need %zu floats (buffer: %zu)", e.size(), n_out_max);
        }
        std::copy(e.begin(), e.end(), out);
    });
}

namespace {
char * c_string(const std::string & s) {
    char * out = static_cast<char *>(std::malloc(s.size() + 1));
    if (!out) {
        dflash::fail(DFLASH_ERR_BACKEND, "out of memory");
    }
    std::memcpy(out, s.c_str(), s.size() + 1);
    return out;
}
}  // namespace

void dflash_string_free(char * s) { std::free(s); }

dflash_status dflash_json_schema_to_grammar(const char * schema_json, char ** out) {
    return guarded([&] {
        require(schema_json && out, "NULL argument");
        *out = c_string(dflash::json_schema_grammar(schema_json));
    });
}

dflash_status dflash_chat_create(const dflash_target * target, const char * options_json, dflash_chat ** out) {
    return guarded([&] {
        require(target && out, "NULL argument");
        *out = nullptr;
        auto chat = std::make_unique<dflash_chat>();
        chat->impl = std::make_unique<dflash::Chat>(target->impl, options_json);
        *out = chat.release();
    });
}

void dflash_chat_free(dflash_chat * chat) { delete chat; }

dflash_status dflash_chat_source(const dflash_chat * chat, char ** out) {
    return guarded([&] {
        require(chat && out, "NULL argument");
        *out = c_string(chat->impl->source());
    });
}

dflash_status dflash_chat_render(const dflash_chat * chat, const char * request_json, char ** out) {
    return guarded([&] {
        require(chat && request_json && out, "NULL argument");
        *out = c_string(chat->impl->render(request_json));
    });
}

dflash_status dflash_chat_parse(const dflash_chat * chat, const char * render_json, const char * text, bool is_partial,
                                char ** out) {
    return guarded([&] {
        require(chat && render_json && text && out, "NULL argument");
        *out = c_string(chat->impl->parse(render_json, text, is_partial));
    });
}

dflash_status dflash_model_summarize(const char * path, dflash_model_summary * out) {
    return guarded([&] {
        require(out != nullptr, "out is NULL");
        dflash::install_llama_log();
        dflash::summarize_model(path, *out);
    });
}

dflash_status dflash_quantize(const char * in_path, const char * out_path, const char * type, int32_t n_threads,
                              bool allow_requantize, dflash_progress_callback progress, void * user_data) {
    return guarded([&] {
        dflash::install_llama_log();
        dflash::quantize_gguf(in_path, out_path, type, n_threads, allow_requantize, progress, user_data);
    });
}

dflash_drafter_params dflash_drafter_default_params(void) {
    dflash_drafter_params p{};
    p.n_ctx     = 4096;
    p.n_threads = 0;
    p.seed      = 0;
    p.exact_head = false;
    p.device    = nullptr;
    return p;
}

dflash_status dflash_drafter_load(const char * path, const char * target_gguf_path,
                                  const dflash_drafter_params * params, dflash_drafter ** out) {
    return guarded([&] {
        require(out != nullptr, "out is NULL");
        *out = nullptr;
        dflash::install_llama_log();
        const dflash_drafter_params p = params ? *params : dflash_drafter_default_params();
        require(p.n_ctx >= 0, "n_ctx must not be negative");
        auto d = std::make_unique<dflash_drafter>();
        d->impl = dflash::Drafter::load(path, target_gguf_path, p);
        *out = d.release();
    });
}

void dflash_drafter_free(dflash_drafter * drafter) { delete drafter; }

dflash_status dflash_drafter_get_info(const dflash_drafter * drafter, dflash_drafter_info * out) {
    return guarded([&] {
        require(drafter && out, "drafter or out is NULL");
        *out = drafter->impl->info();
    });
}

dflash_status dflash_drafter_target_layers(const dflash_drafter * drafter, const int32_t ** layers, int32_t * n_layers) {
    return guarded([&] {
        require(drafter && layers && n_layers, "NULL argument");
        const auto & tl = drafter->impl->hparams().target_layers;
        *layers = tl.data();
        *n_layers = int32_t(tl.size());
    });
}

dflash_status dflash_drafter_draft_vocab(const dflash_drafter * drafter, const int32_t ** ids, int32_t * n) {
    return guarded([&] {
        require(drafter && ids && n, "NULL argument");
        const auto & map = drafter->impl->draft_vocab();
        *ids = map.empty() ? nullptr : map.data();
        *n = int32_t(map.size());
    });
}

dflash_status dflash_drafter_acceptance_profile(const dflash_drafter * drafter, const float ** rates, int32_t * n,
                                                int64_t * n_drafts) {
    return guarded([&] {
        require(drafter && rates && n, "NULL argument");
        const auto & hp = drafter->impl->hparams();
        *rates = hp.acceptance.empty() ? nullptr : hp.acceptance.data();
        *n = int32_t(hp.acceptance.size());
        if (n_drafts) {
            *n_drafts = hp.acceptance_drafts;
        }
    });
}

dflash_status dflash_drafter_inject(dflash_drafter * drafter, const float * features, const int32_t * positions,
                                    int32_t n_rows) {
    return guarded([&] {
        require(drafter != nullptr, "drafter is NULL");
        require(n_rows >= 0 && (n_rows == 0 || (features && positions)), "features or positions is NULL");
        drafter->impl->inject(features, positions, n_rows);
    });
}

dflash_status dflash_drafter_inject_taps(dflash_drafter * drafter, const float * const * taps, int32_t n_taps,
                                         const int32_t * positions, int32_t n_rows) {
    return guarded([&] {
        require(drafter != nullptr, "drafter is NULL");
        require(n_rows >= 0 && (n_rows == 0 || (taps && positions)), "taps or positions is NULL");
        drafter->impl->inject_taps(taps, n_taps, positions, n_rows);
    });
}

dflash_status dflash_drafter_crop(dflash_drafter * drafter, int32_t n_keep) {
    return guarded([&] {
        require(drafter != nullptr, "drafter is NULL");
        drafter->impl->crop(n_keep);
    });
}

dflash_status dflash_drafter_forward(dflash_drafter * drafter, int32_t anchor, int32_t start_pos, int32_t n_block,
                                     float * hidden, float * logits) {
    return guarded([&] {
        require(drafter != nullptr, "drafter is NULL");
        const dflash::BlockOutput & o = drafter->impl->forward_block(anchor, start_pos, n_block);
        if (hidden) {
            std::copy(o.hidden.begin(), o.hidden.end(), hidden);
        }
        if (logits) {
            std::copy(o.logits.begin(), o.logits.end(), logits);
        }
    });
}

dflash_status dflash_drafter_set_contexts(dflash_drafter * drafter, int32_t n_contexts) {
    return guarded([&] {
        require(drafter != nullptr, "drafter is NULL");
        drafter->impl->ensure_contexts(n_contexts);
    });
}

dflash_status dflash_drafter_use_context(dflash_drafter * drafter, int32_t context) {
    return guarded([&] {
        require(drafter != nullptr, "drafter is NULL");
        drafter->impl->use_context(context);
    });
}

dflash_status dflash_drafter_forward_batch(dflash_drafter * drafter, const int32_t * contexts, const int32_t * anchors,
                                           const int32_t * start_pos, int32_t n_jobs, int32_t n_block, float * hidden,
                                           float * logits) {
    return guarded([&] {
        require(drafter && contexts && anchors && start_pos && n_jobs > 0, "invalid batch arguments");
        std::vector<dflash::Drafter::BlockJob> jobs;
        for (int32_t i = 0; i < n_jobs; ++i) {
            jobs.push_back({contexts[i], anchors[i], start_pos[i]});
        }
        std::vector<dflash::BlockOutput> outs;
        drafter->impl->forward_blocks(jobs, n_block, outs);
        for (const auto & o : outs) {
            if (hidden) {
                hidden = std::copy(o.hidden.begin(), o.hidden.end(), hidden);
            }
            if (logits) {
                logits = std::copy(o.logits.begin(), o.logits.end(), logits);
            }
        }
    });
}

dflash_status dflash_drafter_propose(dflash_drafter * drafter, int32_t anchor, int32_t start_pos, int32_t n_block,
                                     float temperature, int32_t * tokens, float * q, int32_t * candidates) {
    return guarded([&] {
        require(drafter && tokens, "drafter or tokens is NULL");
        require(std::isfinite(temperature), "temperature must be finite");
        dflash::Drafter & d = *drafter->impl;
        const dflash::Proposal p = d.propose(anchor, start_pos, n_block, temperature, d.rng());
        std::copy(p.tokens.begin(), p.tokens.end(), tokens);
        if (q) {
            std::copy(p.q.begin(), p.q.end(), q);
        }
        if (candidates && !p.candidates.empty()) {
            std::copy(p.candidates.begin(), p.candidates.end(), candidates);
        }
    });
}

void dflash_drafter_set_seed(dflash_drafter * drafter, uint64_t seed) {
    if (drafter) {
        drafter->impl->rng().seed(seed);
    }
}

}  // extern "C"
