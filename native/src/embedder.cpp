#include "embedder.h"

#include "error.h"
#include "target.h"

#include <algorithm>
#include <cstring>

namespace dflash {

Embedder::~Embedder() {
    if (ctx_) {
        llama_free(ctx_);
    }
}

void Embedder::ensure(int32_t n, int32_t pooling) {
    if (ctx_ && pooling == pooling_ && n <= n_ctx_) {
        return;
    }
    if (ctx_) {
        llama_free(ctx_);
        ctx_ = nullptr;
    }
    // every token of a request in one ubatch: pooled (and non-causal) embeddings need that
    const int32_t n_ctx = std::max(512, (n + 255) / 256 * 256);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = uint32_t(n_ctx);
    cp.n_batch         = uint32_t(n_ctx);
    cp.n_ubatch        = uint32_t(n_ctx);
    cp.n_seq_max       = 1;
    cp.n_threads       = n_threads_;
    cp.n_threads_batch = n_threads_;
    cp.embeddings      = true;
    cp.pooling_type    = static_cast<enum llama_pooling_type>(pooling);
    cp.no_perf         = true;
    take_llama_log_errors();
    ctx_ = llama_init_from_model(target_.model(), cp);
    if (!ctx_) {
        const std::string why = take_llama_log_errors();
        fail(DFLASH_ERR_BACKEND, "could not create the embedding context (n_ctx %d): %s", n_ctx, why.c_str());
    }
    n_ctx_ = n_ctx;
    pooling_ = pooling;
}

std::vector<float> Embedder::embed(const int32_t * tokens, int32_t n, int32_t pooling, int32_t * n_rows) {
    if (n <= 0 || !tokens) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "nothing to embed: the input has no tokens");
    }
    if (pooling < LLAMA_POOLING_TYPE_NONE || pooling > LLAMA_POOLING_TYPE_LAST) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "unknown pooling %d (0 none, 1 mean, 2 cls, 3 last)", pooling);
    }
    if (n > target_.info().n_ctx_train && target_.info().n_ctx_train > 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "input of %d tokens is longer than the model's trained context (%d)", n,
             target_.info().n_ctx_train);
    }
    for (int32_t i = 0; i < n; ++i) {
        target_.check_token(tokens[i]);
    }
    ensure(n, pooling);
    llama_memory_clear(llama_get_memory(ctx_), true);
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int32_t i = 0; i < n; ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = true;
    }
    batch.n_tokens = n;
    const int rc = llama_decode(ctx_, batch);
    llama_batch_free(batch);
    if (rc != 0) {
        fail(DFLASH_ERR_BACKEND, "llama_decode failed (%d) while embedding %d tokens", rc, n);
    }
    const int32_t n_embd = llama_model_n_embd_out(target_.model());
    std::vector<float> out;
    if (pooling == LLAMA_POOLING_TYPE_NONE) {
        out.resize(size_t(n) * size_t(n_embd));
        for (int32_t i = 0; i < n; ++i) {
            const float * e = llama_get_embeddings_ith(ctx_, i);
            if (!e) {
                fail(DFLASH_ERR_BACKEND, "libllama returned no embedding for token %d", i);
            }
            std::memcpy(out.data() + size_t(i) * size_t(n_embd), e, sizeof(float) * size_t(n_embd));
        }
        *n_rows = n;
    } else {
        const float * e = llama_get_embeddings_seq(ctx_, 0);
        if (!e) {
            fail(DFLASH_ERR_BACKEND, "libllama returned no pooled embedding");
        }
        out.assign(e, e + n_embd);
        *n_rows = 1;
    }
    return out;
}

}  // namespace dflash
