#include "target.h"

#include "error.h"
#include "gguf_check.h"
#include "kernels/kernels_backend.h"
#include "layer_input_archs.h"

#include "ggml.h"
#include "llama-ext.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace dflash {

namespace {
// Drafts per verify block a recurrent memory keeps snapshots for when the caller does not say:
// the widest block the scheduler verifies (a drafter block of 16, or history drafts).
constexpr int32_t kDefaultVerifyDrafts = 15;
// What a checkpoint holds of a hybrid memory: its recurrent part only (the attention KV is rolled
// back by removing cells, as on a dense target).
constexpr llama_state_seq_flags kCheckpointFlags = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
}  // namespace

Target::Target(const char * path, const dflash_target_params & params) {
    if (params.n_ctx < 0 || params.n_batch < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_ctx and n_batch must be >= 0 (got %d, %d)", params.n_ctx, params.n_batch);
    }
    if (params.n_seq_max < 1 || params.n_seq_max > 256) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_seq_max must be in 1..256 (got %d)", params.n_seq_max);
    }
    if (params.n_verify_max < 0 || params.n_verify_max > 255) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_verify_max must be in 0..255 (got %d)", params.n_verify_max);
    }
    if (params.tap_source < DFLASH_TAP_AUTO || params.tap_source > DFLASH_TAP_EVAL) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "unknown tap_source %d", params.tap_source);
    }
    check_gguf_file(path, "target model");

    // our multi-row CPU kernels must be in ggml-cpu's extra buffer list before llama.cpp reads it
    kern::install();
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = params.n_gpu_layers;
    take_llama_log_errors();
    model_ = llama_model_load_from_file(path, mp);
    if (!model_) {
        const std::string why = take_llama_log_errors();
        fail(DFLASH_ERR_FORMAT, "llama.cpp could not load the model '%s'%s%s", path,
             why.empty() ? "" : ": ", why.c_str());
    }
    vocab_   = llama_model_get_vocab(model_);
    n_vocab_ = llama_vocab_n_tokens(vocab_);
    n_embd_  = llama_model_n_embd(model_);
    n_layer_ = llama_model_n_layer(model_);

    const int32_t n_ctx_train = llama_model_n_ctx_train(model_);
    n_ctx_ = params.n_ctx > 0 ? params.n_ctx : 4096;
    if (n_ctx_train > 0) {
        n_ctx_ = std::min(n_ctx_, n_ctx_train);
    }
    n_batch_   = std::min(params.n_batch > 0 ? params.n_batch : 512, n_ctx_);
    n_seq_max_ = params.n_seq_max;

    {  // hyper-connections: the residual is several streams of n_embd (their mean is the hidden state)
        char arch[64] = {0}, value[32] = {0};
        llama_model_meta_val_str(model_, "general.architecture", arch, sizeof(arch));
        const std::string key = std::string(arch) + ".hyper_connection.count";
        if (llama_model_meta_val_str(model_, key.c_str(), value, sizeof(value)) > 0) {
            n_streams_ = std::max(1, atoi(value));
        }
    }
    eval_taps_ = params.tap_source == DFLASH_TAP_EVAL ||
                 (params.tap_source == DFLASH_TAP_AUTO && !arch_has_layer_inputs());
    if (params.tap_source == DFLASH_TAP_LAYER_INPUT && !arch_has_layer_inputs()) {
        const std::string arch = meta("general.architecture");
        llama_model_free(model_);
        fail(DFLASH_ERR_UNSUPPORTED, "the '%s' graph of this llama.cpp does not expose layer inputs; "
             "use tap_source=auto or eval", arch.c_str());
    }

    const int n_threads = params.n_threads > 0 ? params.n_threads
                                               : int(std::max(1u, std::thread::hardware_concurrency()));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = uint32_t(n_ctx_) * uint32_t(n_seq_max_);
    cp.n_batch         = uint32_t(n_batch_);
    cp.n_ubatch        = uint32_t(n_batch_);  // one ubatch per decode: rows stay in batch order
    cp.n_seq_max       = uint32_t(n_seq_max_);
    cp.n_threads       = n_threads;
    cp.n_threads_batch = n_threads;
    cp.kv_unified      = true;
    cp.no_perf         = true;
    // recurrent state: ask for per-token snapshots deep enough for the widest verify block (the
    // graph keeps the last n_rs_seq + 1 tokens of a decode in one ubatch: n_ubatch > n_rs_seq + 1);
    // llama.cpp clamps it to 0 for archs whose graph does not write them
    const bool recurrent_memory = llama_model_is_recurrent(model_) || llama_model_is_hybrid(model_);
    const int32_t want_drafts = params.n_verify_max > 0 ? params.n_verify_max : kDefaultVerifyDrafts;
    if (recurrent_memory) {
        cp.n_rs_seq = uint32_t(std::max(0, std::min(want_drafts, n_batch_ - 2)));
    }
    if (eval_taps_) {
        cp.cb_eval           = &Target::eval_callback;
        cp.cb_eval_user_data = this;
    }
    ctx_ = llama_init_from_model(model_, cp);
    if (!ctx_) {
        const std::string why = take_llama_log_errors();
        llama_model_free(model_);
        fail(DFLASH_ERR_BACKEND, "could not create a llama.cpp context (n_ctx %d): %s", n_ctx_, why.c_str());
    }
    batch_ = llama_batch_init(n_batch_, 0, 1);
    if (llama_model_is_diffusion(model_)) {
        // non-causal attention: a verify block's rows would see the drafts after them
        rollback_ = recurrent_memory ? Rollback::checkpoint : Rollback::kv;
        max_verify_drafts_ = 0;
    } else if (!recurrent_memory) {
        rollback_ = Rollback::kv;
        max_verify_drafts_ = n_batch_ - 1;
    } else if (llama_n_rs_seq(ctx_) > 0) {
        rollback_ = Rollback::snapshots;
        max_verify_drafts_ = int32_t(llama_n_rs_seq(ctx_));
    } else {
        rollback_ = Rollback::checkpoint;
        max_verify_drafts_ = n_batch_ - 1;
    }
    if (rollback_ == Rollback::checkpoint) {
        checkpoints_.resize(size_t(n_seq_max_));
    }
}

Target::~Target() {
    llama_batch_free(batch_);
    if (ctx_) {
        llama_free(ctx_);
    }
    if (model_) {
        llama_model_free(model_);
    }
}

bool Target::arch_has_layer_inputs() const {
    char arch[64] = {0};
    llama_model_meta_val_str(model_, "general.architecture", arch, sizeof(arch));
    for (const char * a : k_layer_input_archs) {
        if (strcmp(arch, a) == 0) {
            return true;
        }
    }
    return false;
}

dflash_target_info Target::info() const {
    dflash_target_info out{};
    out.n_vocab     = n_vocab_;
    out.n_embd      = n_embd_;
    out.n_layer     = n_layer_;
    out.n_ctx       = n_ctx_;
    out.n_ctx_train = llama_model_n_ctx_train(model_);
    out.n_seq_max   = n_seq_max_;
    out.token_bos   = llama_vocab_bos(vocab_);
    out.token_eos   = llama_vocab_eos(vocab_);
    out.add_bos     = llama_vocab_get_add_bos(vocab_);
    out.add_eos     = llama_vocab_get_add_eos(vocab_);
    out.token_fim_pre = llama_vocab_fim_pre(vocab_);
    out.token_fim_suf = llama_vocab_fim_suf(vocab_);
    out.token_fim_mid = llama_vocab_fim_mid(vocab_);
    out.token_fim_pad = llama_vocab_fim_pad(vocab_);
    out.token_fim_rep = llama_vocab_fim_rep(vocab_);
    out.token_fim_sep = llama_vocab_fim_sep(vocab_);
    out.token_sep     = llama_vocab_sep(vocab_);
    out.rollback      = int32_t(rollback_);
    out.n_verify_max  = max_verify_drafts_;
    out.tap_source    = eval_taps_ ? DFLASH_TAP_EVAL : DFLASH_TAP_LAYER_INPUT;
    return out;
}

std::string Target::meta(const char * key) const {
    int32_t n = llama_model_meta_val_str(model_, key, nullptr, 0);
    if (n < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "the model has no metadata key '%s'", key);
    }
    std::string out(size_t(n) + 1, '\0');
    llama_model_meta_val_str(model_, key, out.data(), out.size());
    out.resize(size_t(n));
    return out;
}

void Target::check_token(int32_t token) const {
    if (token < 0 || token >= n_vocab_) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "token id %d is outside the vocabulary (0..%d)", token, n_vocab_ - 1);
    }
}

void Target::check_seq(int32_t seq_id) const {
    if (seq_id < 0 || seq_id >= n_seq_max_) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "sequence id %d is outside 0..%d", seq_id, n_seq_max_ - 1);
    }
}

std::vector<int32_t> Target::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    if (text.size() > size_t(INT32_MAX / 2)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "text too long to tokenize");
    }
    std::vector<int32_t> out(text.size() + 2);
    int32_t n = llama_tokenize(vocab_, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()),
                               add_special, parse_special);
    if (n < 0) {
        out.resize(size_t(-n));
        n = llama_tokenize(vocab_, text.data(), int32_t(text.size()), out.data(), int32_t(out.size()),
                           add_special, parse_special);
    }
    if (n < 0) {
        fail(DFLASH_ERR_INTERNAL, "tokenization failed");
    }
    out.resize(size_t(n));
    return out;
}

std::string Target::detokenize(const int32_t * tokens, int32_t n, bool render_special) const {
    for (int32_t i = 0; i < n; ++i) {
        check_token(tokens[i]);
    }
    std::string out(size_t(n) * 8 + 16, '\0');
    int32_t m = llama_detokenize(vocab_, tokens, n, out.data(), int32_t(out.size()), false, render_special);
    if (m < 0) {
        out.resize(size_t(-m));
        m = llama_detokenize(vocab_, tokens, n, out.data(), int32_t(out.size()), false, render_special);
    }
    if (m < 0) {
        fail(DFLASH_ERR_INTERNAL, "detokenization failed");
    }
    out.resize(size_t(m));
    return out;
}

std::string Target::token_piece(int32_t token) const {
    check_token(token);
    char buf[256];
    int32_t n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, false);
    if (n >= 0) {
        return std::string(buf, size_t(n));
    }
    std::string out(size_t(-n), '\0');
    llama_token_to_piece(vocab_, token, out.data(), int32_t(out.size()), 0, false);
    return out;
}

std::string Target::apply_chat_template(const std::vector<std::string> & roles,
                                        const std::vector<std::string> & contents, bool add_assistant) const {
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    if (!tmpl) {
        fail(DFLASH_ERR_UNSUPPORTED, "the model has no chat template");
    }
    std::vector<llama_chat_message> chat(roles.size());
    size_t total = 0;
    for (size_t i = 0; i < roles.size(); ++i) {
        chat[i] = {roles[i].c_str(), contents[i].c_str()};
        total += roles[i].size() + contents[i].size();
    }
    std::string out(total * 2 + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), int32_t(out.size()));
    if (n > int32_t(out.size())) {
        out.resize(size_t(n));
        n = llama_chat_apply_template(tmpl, chat.data(), chat.size(), add_assistant, out.data(), int32_t(out.size()));
    }
    if (n < 0) {
        fail(DFLASH_ERR_UNSUPPORTED, "llama.cpp does not support this model's chat template");
    }
    out.resize(size_t(n));
    return out;
}

bool Target::is_eog(int32_t token) const { return llama_vocab_is_eog(vocab_, token); }

void Target::set_taps(const std::vector<int32_t> & layers) {
    const int32_t max_layer = n_layer_ - 1;  // the last layer's output is only kept for output rows
    for (int32_t l : layers) {
        if (l < 1 || l > max_layer) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "tap layer %d is outside 1..%d for this %d-layer target",
                 l, max_layer, n_layer_);
        }
    }
    if (!eval_taps_) {
        for (int32_t l : tap_layers_) {
            llama_set_embeddings_layer_inp(ctx_, uint32_t(l), false);
        }
        for (int32_t l : layers) {
            llama_set_embeddings_layer_inp(ctx_, uint32_t(l), true);
        }
    }
    tap_layers_ = layers;
    tap_names_.clear();
    tap_alt_names_.clear();
    for (int32_t l : layers) {
        tap_names_.push_back("l_out-" + std::to_string(l - 1));
        tap_alt_names_.push_back("l_last-" + std::to_string(l - 1));
    }
    tap_data_.assign(layers.size(), {});
    last_n_rows_ = 0;
}

bool Target::eval_callback(struct ggml_tensor * t, bool ask, void * user) {
    auto * self = static_cast<Target *>(user);
    const char * name = ggml_get_name(t);
    for (size_t i = 0; i < self->tap_names_.size(); ++i) {
        // a layer's output is "l_out-<il>"; graphs with hyper-connections (qwen4exp) call it "l_last-<il>"
        if (self->tap_names_[i] != name && self->tap_alt_names_[i] != name) {
            continue;
        }
        if (ask) {
            return true;
        }
        // one call per ubatch: append its rows (F32, [n_embd, n_rows]); a graph with
        // hyper-connections carries [n_embd, n_streams, n_rows]: the hidden state is their mean,
        // as the pinned tree's own layer input of such a graph (deepseek4's build_hc_mean)
        if (t->type != GGML_TYPE_F32 || t->ne[0] != self->n_embd_ || !ggml_is_contiguous(t) || t->ne[3] != 1) {
            return true;  // unexpected layout: leave the rows missing, decode() reports it
        }
        auto & dst = self->tap_data_[i];
        const size_t old = dst.size();
        const int64_t H = t->ne[0];
        if (self->n_streams_ <= 1 || t->ne[1] != self->n_streams_) {  // [n_embd, n_rows]
            dst.resize(old + size_t(ggml_nelements(t)));
            ggml_backend_tensor_get(t, dst.data() + old, 0, ggml_nbytes(t));
            return true;
        }
        const int64_t n_streams = t->ne[1], n_rows = t->ne[2];
        std::vector<float> all(size_t(ggml_nelements(t)));
        ggml_backend_tensor_get(t, all.data(), 0, ggml_nbytes(t));
        dst.resize(old + size_t(n_rows * H), 0.0f);
        for (int64_t r = 0; r < n_rows; ++r) {
            float * out = dst.data() + old + size_t(r * H);
            for (int64_t s = 0; s < n_streams; ++s) {
                const float * in = all.data() + size_t((r * n_streams + s) * H);
                for (int64_t h = 0; h < H; ++h) {
                    out[h] += in[h];
                }
            }
            for (int64_t h = 0; h < H; ++h) {
                out[h] /= float(n_streams);
            }
        }
        return true;
    }
    return !ask;  // not a tap: don't stop the graph for it
}

const float * Target::tap_rows(int32_t tap_index, int32_t * n_rows) const {
    if (tap_index < 0 || size_t(tap_index) >= tap_layers_.size()) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "tap index %d out of range (%zu taps set)", tap_index, tap_layers_.size());
    }
    if (last_n_rows_ == 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no decode has run since the taps were set");
    }
    *n_rows = last_n_rows_;
    if (merged_) {
        return merged_taps_[size_t(tap_index)].data();
    }
    if (eval_taps_) {
        return tap_data_[size_t(tap_index)].data();
    }
    return llama_get_embeddings_layer_inp(ctx_, uint32_t(tap_layers_[size_t(tap_index)]));
}

void Target::decode(int32_t seq_id, const int32_t * tokens, const int32_t * pos, int32_t n, bool all_logits) {
    check_seq(seq_id);
    if (n <= 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "nothing to decode (n_tokens = %d)", n);
    }
    if (n > n_batch_) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%d tokens exceed the batch size %d", n, n_batch_);
    }
    const int32_t start = llama_memory_seq_pos_max(llama_get_memory(ctx_), seq_id) + 1;
    batch_.n_tokens = 0;
    for (int32_t i = 0; i < n; ++i) {
        add_row(seq_id, tokens[i], pos ? pos[i] : start + i, all_logits || i == n - 1);
    }
    run_batch();
}

void Target::decode_chunks(const std::vector<Chunk> & chunks) {
    int32_t total = 0;
    for (const auto & c : chunks) {
        check_seq(c.seq_id);
        if (c.n <= 0) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "empty chunk for sequence %d", c.seq_id);
        }
        total += c.n;
    }
    if (total <= 0 || total > n_batch_) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "%d tokens do not fit the batch size %d", total, n_batch_);
    }
    const bool one_by_one = recurrent() && chunks.size() > 1;
    if (one_by_one) {
        merged_logit_row_.assign(size_t(total), -1);
        merged_logits_.clear();
        merged_taps_.assign(tap_layers_.size(), {});
    }
    int32_t first_row = 0;
    batch_.n_tokens = 0;
    for (const auto & c : chunks) {
        const int32_t start = llama_memory_seq_pos_max(llama_get_memory(ctx_), c.seq_id) + 1;
        for (int32_t i = 0; i < c.n; ++i) {
            add_row(c.seq_id, c.tokens[i], start + i,
                    c.logits == LOGITS_ALL || (c.logits == LOGITS_LAST && i == c.n - 1));
        }
        if (one_by_one) {
            run_batch();
            keep_outputs(first_row);
            first_row += c.n;
            batch_.n_tokens = 0;
        }
    }
    if (!one_by_one) {
        run_batch();
        return;
    }
    last_has_logits_.assign(size_t(total), false);
    for (int32_t r = 0; r < total; ++r) {
        last_has_logits_[size_t(r)] = merged_logit_row_[size_t(r)] >= 0;
    }
    last_n_rows_ = total;
    merged_ = true;
}

void Target::keep_outputs(int32_t first_row) {
    const int32_t n = last_n_rows_;
    for (int32_t r = 0; r < n; ++r) {
        if (!last_has_logits_[size_t(r)]) {
            continue;
        }
        const float * row = llama_get_logits_ith(ctx_, r);
        if (!row) {
            fail(DFLASH_ERR_INTERNAL, "llama.cpp returned no logits for row %d", r);
        }
        merged_logit_row_[size_t(first_row + r)] = int32_t(merged_logits_.size() / size_t(n_vocab_));
        merged_logits_.insert(merged_logits_.end(), row, row + n_vocab_);
    }
    for (size_t k = 0; k < tap_layers_.size(); ++k) {
        const float * rows = eval_taps_ ? tap_data_[k].data()
                                        : llama_get_embeddings_layer_inp(ctx_, uint32_t(tap_layers_[k]));
        merged_taps_[k].insert(merged_taps_[k].end(), rows, rows + size_t(n) * size_t(n_embd_));
    }
}

void Target::add_row(int32_t seq_id, int32_t token, int32_t pos, bool logits) {
    check_token(token);
    if (pos < 0 || pos >= n_ctx_) {
        fail(DFLASH_ERR_CONTEXT_FULL, "position %d is outside the context window (n_ctx %d)", pos, n_ctx_);
    }
    const int32_t i = batch_.n_tokens++;
    batch_.token[i]     = token;
    batch_.pos[i]       = pos;
    batch_.n_seq_id[i]  = 1;
    batch_.seq_id[i][0] = seq_id;
    batch_.logits[i]    = logits;
}

void Target::run_batch() {
    const int32_t n = batch_.n_tokens;
    merged_ = false;
    for (auto & rows : tap_data_) {
        rows.clear();
    }
    last_n_rows_ = 0;
    const int32_t rc = llama_decode(ctx_, batch_);
    if (rc != 0) {
        const std::string why = take_llama_log_errors();
        fail(DFLASH_ERR_BACKEND, "llama_decode failed (%d)%s%s", rc, why.empty() ? "" : ": ", why.c_str());
    }
    if (eval_taps_) {
        for (size_t i = 0; i < tap_data_.size(); ++i) {
            if (tap_data_[i].size() != size_t(n) * size_t(n_embd_)) {
                fail(DFLASH_ERR_INTERNAL, "tap %s captured %zu values, expected %d rows of %d",
                     tap_names_[i].c_str(), tap_data_[i].size(), n, n_embd_);
            }
        }
    }
    last_has_logits_.assign(batch_.logits, batch_.logits + n);
    last_n_rows_ = n;
}

const float * Target::logits(int32_t row) const {
    if (last_n_rows_ == 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no decode has run yet");
    }
    if (row == -1) {
        row = last_n_rows_ - 1;
    }
    if (row < 0 || row >= last_n_rows_ || !last_has_logits_[size_t(row)]) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no logits for row %d of the last decode (%d rows)", row, last_n_rows_);
    }
    if (merged_) {
        return merged_logits_.data() + size_t(merged_logit_row_[size_t(row)]) * size_t(n_vocab_);
    }
    const float * out = llama_get_logits_ith(ctx_, row);
    if (!out) {
        fail(DFLASH_ERR_INTERNAL, "llama.cpp returned no logits for row %d", row);
    }
    return out;
}

int32_t Target::seq_pos_max(int32_t seq_id) const {
    check_seq(seq_id);
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq_id);
}

void Target::rollback(int32_t seq_id, int32_t pos) {
    check_seq(seq_id);
    if (pos < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "rollback position must be >= 0 (got %d)", pos);
    }
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), seq_id, pos, -1)) {
        fail(DFLASH_ERR_UNSUPPORTED, "this target's memory cannot be rolled back to position %d", pos);
    }
    // the last decode's logits and taps stay readable: they are outputs, not cache state
}

void Target::checkpoint(int32_t seq_id) {
    check_seq(seq_id);
    if (rollback_ != Rollback::checkpoint) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "this target rolls back without checkpoints");
    }
    auto & buf = checkpoints_[size_t(seq_id)];
    const size_t n = llama_state_seq_get_size_ext(ctx_, seq_id, kCheckpointFlags);
    buf.resize(n);
    if (n == 0 || llama_state_seq_get_data_ext(ctx_, buf.data(), n, seq_id, kCheckpointFlags) != n) {
        buf.clear();
        fail(DFLASH_ERR_BACKEND, "could not save the recurrent state of sequence %d", seq_id);
    }
}

void Target::restore_checkpoint(int32_t seq_id, int32_t pos) {
    check_seq(seq_id);
    auto & buf = checkpoints_.at(size_t(seq_id));
    if (buf.empty()) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "sequence %d has no checkpoint", seq_id);
    }
    if (llama_state_seq_set_data_ext(ctx_, buf.data(), buf.size(), seq_id, kCheckpointFlags) != buf.size()) {
        fail(DFLASH_ERR_BACKEND, "could not restore the recurrent state of sequence %d", seq_id);
    }
    buf.clear();  // a checkpoint is used once: the next verify block takes a new one
    // the recurrent part now ends before pos; this drops the attention KV of the block
    rollback(seq_id, pos);
}

bool Target::probe_taps(const std::vector<int32_t> & layers, std::string * why) {
    if (layers.empty()) {
        return true;
    }
    const std::vector<int32_t> before = tap_layers_;
    set_taps(layers);
    rollback(0, 0);
    const int32_t token = 0;
    bool ok = true;
    try {
        decode(0, &token, nullptr, 1, false);
    } catch (const Error & e) {
        ok = false;
        if (why) {
            // decode() names the tap that came out empty: say it as the user should read it
            int32_t missing = layers.front();
            for (size_t i = 0; i < layers.size() && eval_taps_; ++i) {
                if (tap_data_[i].size() != size_t(n_embd_)) {
                    missing = layers[i];
                    break;
                }
            }
            const std::string arch = meta("general.architecture");
            char buf[256];
            snprintf(buf, sizeof(buf), "this target's graph (%s) exposes no hidden states at layer %d", arch.c_str(),
                     missing);
            *why = buf;
        }
    }
    rollback(0, 0);
    set_taps(before);
    return ok;
}

}  // namespace dflash
