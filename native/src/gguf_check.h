// Up-front checks on a GGUF file so that bad files get a precise error (missing, not GGUF,
// truncated) before libllama/ggml see them.
#pragma once

#include "gguf.h"

#include <memory>

namespace dflash {

struct gguf_deleter {
    void operator()(gguf_context * ctx) const { gguf_free(ctx); }
};
using gguf_ptr = std::unique_ptr<gguf_context, gguf_deleter>;

// Throws DFLASH_ERR_IO / DFLASH_ERR_FORMAT; `what` names the file's role in messages.
// Returns the parsed metadata (no tensor data loaded).
gguf_ptr check_gguf_file(const char * path, const char * what);

}  // namespace dflash
