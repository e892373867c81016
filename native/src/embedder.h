// Embeddings of a target model (llama-server's /embedding, /v1/embeddings): a second libllama
// context on the same weights with embeddings on and the requested pooling, made when first asked
// for and kept while the pooling and the length fit. Generation never waits on it: it has its own
// KV cache.
#pragma once

#include "llama.h"

#include <cstdint>
#include <vector>

namespace dflash {

class Target;

class Embedder {
public:
    Embedder(const Target & target, int32_t n_threads) : target_(target), n_threads_(n_threads) {}
    ~Embedder();
    Embedder(const Embedder &) = delete;
    Embedder & operator=(const Embedder &) = delete;

    // pooling: a llama_pooling_type (NONE gives one row per token, the others one row). Returns
    // the rows [n_rows x n_embd], un-normalised, as libllama computes them.
    std::vector<float> embed(const int32_t * tokens, int32_t n, int32_t pooling, int32_t * n_rows);

private:
    void ensure(int32_t n, int32_t pooling);

    const Target & target_;
    int32_t n_threads_;
    llama_context * ctx_ = nullptr;
    int32_t n_ctx_ = 0;
    int32_t pooling_ = -2;
};

}  // namespace dflash
