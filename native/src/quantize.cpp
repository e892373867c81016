#include "quantize.h"

#include "error.h"
#include "gguf_check.h"

#include "ggml.h"
#include "llama.h"

#include <cstdio>
#include <cstring>
#include <string>

namespace dflash {

namespace {

struct quant_type {
    const char * name;
    llama_ftype  ftype;
};

const quant_type k_types[] = {
    {"Q4_K_M", LLAMA_FTYPE_MOSTLY_Q4_K_M},
    {"Q4_K_S", LLAMA_FTYPE_MOSTLY_Q4_K_S},
    {"Q5_K_M", LLAMA_FTYPE_MOSTLY_Q5_K_M},
    {"Q5_K_S", LLAMA_FTYPE_MOSTLY_Q5_K_S},
    {"Q6_K",   LLAMA_FTYPE_MOSTLY_Q6_K},
    {"Q8_0",   LLAMA_FTYPE_MOSTLY_Q8_0},
    {"F16",    LLAMA_FTYPE_MOSTLY_F16},
    {"BF16",   LLAMA_FTYPE_MOSTLY_BF16},
};

bool is_float_type(ggml_type t) { return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16; }

}  // namespace

void quantize_gguf(const char * in_path, const char * out_path, const char * type_name, int32_t n_threads,
                   bool allow_requantize, dflash_progress_callback progress, void * user_data) {
    if (!out_path || !*out_path) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no output path given");
    }
    const quant_type * type = nullptr;
    for (const auto & t : k_types) {
        if (type_name && strcasecmp(type_name, t.name) == 0) {
            type = &t;
        }
    }
    if (!type) {
        std::string names;
        for (const auto & t : k_types) {
            names += names.empty() ? t.name : std::string(", ") + t.name;
        }
        fail(DFLASH_ERR_INVALID_ARGUMENT, "unknown quantization type '%s' (choose from %s)",
             type_name ? type_name : "(null)", names.c_str());
    }

    gguf_ptr meta = check_gguf_file(in_path, "input model");
    if (!allow_requantize) {
        for (int64_t i = 0; i < gguf_get_n_tensors(meta.get()); ++i) {
            const ggml_type t = gguf_get_tensor_type(meta.get(), i);
            if (!is_float_type(t) && t != GGML_TYPE_I64 && t != GGML_TYPE_I32) {
                fail(DFLASH_ERR_INVALID_ARGUMENT,
                     "'%s' is already quantized (tensor '%s' is %s); quantize from the F32/F16/BF16 file, "
                     "or allow requantizing (loses quality)",
                     in_path, gguf_get_tensor_name(meta.get(), i), ggml_type_name(t));
            }
        }
    }
    meta.reset();

    // write next to the target, then rename: a failed run never leaves a half file behind
    const std::string tmp = std::string(out_path) + ".partial";
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.ftype            = type->ftype;
    qp.nthread          = n_threads;
    qp.allow_requantize = allow_requantize;

    set_quantize_progress(progress, user_data);
    take_llama_log_errors();
    const uint32_t rc = llama_model_quantize(in_path, tmp.c_str(), &qp);
    set_quantize_progress(nullptr, nullptr);
    if (rc != 0) {
        std::remove(tmp.c_str());
        const std::string why = take_llama_log_errors();
        fail(DFLASH_ERR_FORMAT, "quantizing '%s' failed%s%s", in_path, why.empty() ? "" : ": ", why.c_str());
    }
    if (std::rename(tmp.c_str(), out_path) != 0) {
        std::remove(tmp.c_str());
        fail(DFLASH_ERR_IO, "could not write '%s'", out_path);
    }
}

}  // namespace dflash
