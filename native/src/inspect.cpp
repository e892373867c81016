// dflash_model_summarize: load a GGUF with libllama and report what it understood.
#include "kernels/kernels_backend.h"
#include "error.h"
#include "gguf_check.h"

#include "llama-ext.h"
#include "llama.h"

#include <algorithm>
#include <cstring>
#include <memory>

namespace dflash {

void summarize_model(const char * path, dflash_model_summary & out) {
    check_gguf_file(path, "model");
    kern::install();  // before llama.cpp reads ggml-cpu's extra buffer list (kernels/cpu_buffer.cpp)
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    take_llama_log_errors();
    std::unique_ptr<llama_model, decltype(&llama_model_free)> model(llama_model_load_from_file(path, mp),
                                                                    &llama_model_free);
    if (!model) {
        const std::string why = take_llama_log_errors();
        fail(DFLASH_ERR_FORMAT, "llama.cpp could not load '%s'%s%s", path, why.empty() ? "" : ": ", why.c_str());
    }
    out = dflash_model_summary{};
    llama_model_meta_val_str(model.get(), "general.architecture", out.arch, sizeof(out.arch));
    out.n_layer   = llama_model_n_layer(model.get());
    out.n_embd    = llama_model_n_embd(model.get());
    out.n_head    = llama_model_n_head(model.get());
    out.n_head_kv = llama_model_n_head_kv(model.get());
    const llama_vocab * vocab = llama_model_get_vocab(model.get());
    out.n_vocab    = llama_vocab_n_tokens(vocab);
    out.token_mask = llama_vocab_mask(vocab);
    out.n_params   = llama_model_n_params(model.get());
    if (strcmp(out.arch, "dflash") == 0) {
        out.selector_top_k = llama_model_dflash_selector_top_k(model.get());
        const uint32_t n = llama_model_target_layer_ids_n(model.get());
        const int32_t * ids = llama_model_target_layer_ids(model.get());
        out.n_target_layers = int32_t(std::min<uint32_t>(n, 64));
        for (int32_t i = 0; i < out.n_target_layers; ++i) {
            out.target_layers[i] = ids[i];
        }
    }
}

}  // namespace dflash
