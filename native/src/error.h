// Errors inside the core are C++ exceptions carrying a dflash_status; the extern "C" shims in
// api.cpp turn them into a status code + the thread's last-error message. Nothing else crosses
// the C boundary.
#pragma once

#include "dflash.h"

#include <stdexcept>
#include <string>

namespace dflash {

class Error : public std::runtime_error {
public:
    Error(dflash_status status, const std::string & message)
        : std::runtime_error(message), status_(status) {}
    dflash_status status() const { return status_; }

private:
    dflash_status status_;
};

[[noreturn]] void fail(dflash_status status, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// Remember `message` as this thread's last error; returns `status` for convenience.
dflash_status set_last_error(dflash_status status, const std::string & message);
void clear_last_error();

// The last error lines libllama/ggml logged on this thread (to explain a failed load).
std::string take_llama_log_errors();

// Forward libllama's per-tensor quantization log lines ("[ i/ n] name ...") to a progress
// callback on this thread (nullptr: stop).
void set_quantize_progress(dflash_progress_callback callback, void * user_data);
// Route libllama/ggml logs through our handler (idempotent; keeps the verbosity as it is).
void install_llama_log();
// dflash_set_verbose: everything to stderr (true) or only errors (false, the default).
void set_llama_log_verbose(bool verbose);

}  // namespace dflash
