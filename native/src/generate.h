// Generation loops. Plain autoregressive decoding lives here; the speculative loop reuses the
// same stopping rules and text stream.
#pragma once

#include "dflash.h"
#include "output.h"
#include "target.h"

#include <memory>

namespace dflash {

void validate_generate_params(const dflash_generate_params & params);

std::unique_ptr<dflash_output> generate_plain(Target & target, const int32_t * prompt, int32_t n_prompt,
                                              const dflash_generate_params & params,
                                              dflash_token_callback callback, void * user_data);

}  // namespace dflash
