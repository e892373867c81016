// GGUF quantization through libllama's own quantizer, so that our files are byte-identical to
// upstream llama-quantize's and its per-tensor type rules are not written a second time.
#pragma once

#include "dflash.h"

namespace dflash {

void quantize_gguf(const char * in_path, const char * out_path, const char * type_name, int32_t n_threads,
                   bool allow_requantize, dflash_progress_callback progress, void * user_data);

}  // namespace dflash
