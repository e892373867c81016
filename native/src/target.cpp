#include "target.h"

#include "error.h"
#include "gguf_check.h"
#include "kernels/kernels_backend.h"

#include "ggml.h"
#include "llama-ext.h"

#include <algorithm>
#include <cstring>
#include <thread>

namespace dflash {

namespace {
// Architectures whose graph in the pinned llama.cpp records the input of each layer
// (res->t_layer_inp), so llama_set_embeddings_layer_inp can be used. Others (qwen2, ...) are
// tapped through the eval callback on their "l_out-<il>" tensors.
const char * const k_layer_input_archs[] = {"llama", "qwen3", "qwen3moe"};
}  // namespace

Target::Target(const char * path, const dflash_target_params & params) {
    if (params.n_ctx < 0 || params.n_batch < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_ctx and n_batch must be >= 0 (got %d, %d)", params.n_ctx, params.n_batch);
    }
    if (params.n_seq_max < 1 || params.n_seq_max > 256) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "n_seq_max must be in 1..256 (got %d)", params.n_seq_max);
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
    for (int32_t l : layers) {
        tap_names_.push_back("l_out-" + std::to_string(l - 1));
    }
    tap_data_.assign(layers.size(), {});
    last_n_rows_ = 0;
}

bool Target::eval_callback(struct ggml_tensor * t, bool ask, void * user) {
    auto * self = static_cast<Target *>(user);
    const char * name = ggml_get_name(t);
    for (size_t i = 0; i < self->tap_names_.size(); ++i) {
        if (self->tap_names_[i] != name) {
            continue;
        }
        if (ask) {
            return true;
        }
        // one call per ubatch: append its rows (F32, [n_embd, n_rows])
        if (t->type != GGML_TYPE_F32 || t->ne[0] != self->n_embd_) {
            return true;  // unexpected layout: leave the rows missing, decode() reports it
        }
        auto & dst = self->tap_data_[i];
        const size_t old = dst.size();
        dst.resize(old + size_t(ggml_nelements(t)));
        ggml_backend_tensor_get(t, dst.data() + old, 0, ggml_nbytes(t));
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
    batch_.n_tokens = 0;
    for (const auto & c : chunks) {
        const int32_t start = llama_memory_seq_pos_max(llama_get_memory(ctx_), c.seq_id) + 1;
        for (int32_t i = 0; i < c.n; ++i) {
            add_row(c.seq_id, c.tokens[i], start + i,
                    c.logits == LOGITS_ALL || (c.logits == LOGITS_LAST && i == c.n - 1));
        }
    }
    run_batch();
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

}  // namespace dflash
