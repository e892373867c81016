#include "error.h"

#include "llama.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <mutex>

namespace dflash {

namespace {
thread_local std::string g_last_error;
thread_local std::string g_llama_errors;
std::atomic<bool> g_verbose{false};
thread_local dflash_progress_callback g_progress = nullptr;
thread_local void * g_progress_user = nullptr;

void report_progress(const char * text) {
    int done = 0, total = 0;
    if (g_progress && sscanf(text, "[%d/%d]", &done, &total) == 2 && total > 0) {
        g_progress(g_progress_user, done, total);
    }
}

void llama_log(ggml_log_level level, const char * text, void * /*user*/) {
    if (level == GGML_LOG_LEVEL_INFO) {
        report_progress(text);
    }
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        if (level == GGML_LOG_LEVEL_ERROR) {
            g_llama_errors += text;
            if (g_llama_errors.size() > 4096) {
                g_llama_errors.erase(0, g_llama_errors.size() - 4096);
            }
        }
    }
    if (g_verbose.load() || level == GGML_LOG_LEVEL_ERROR) {
        if (g_verbose.load()) {
            fputs(text, stderr);
        }
    }
}
}  // namespace

void fail(dflash_status status, const char * fmt, ...) {
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    throw Error(status, buf);
}

dflash_status set_last_error(dflash_status status, const std::string & message) {
    g_last_error = message;
    return status;
}

void clear_last_error() { g_last_error.clear(); }

const char * last_error_cstr() { return g_last_error.c_str(); }

std::string take_llama_log_errors() {
    std::string out;
    out.swap(g_llama_errors);
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) {
        out.pop_back();
    }
    return out;
}

void set_quantize_progress(dflash_progress_callback callback, void * user_data) {
    g_progress = callback;
    g_progress_user = user_data;
}

void set_llama_log_verbose(bool verbose) {
    g_verbose.store(verbose);
    install_llama_log();
}

void install_llama_log() {
    static std::once_flag once;
    std::call_once(once, [] { llama_log_set(llama_log, nullptr); });
}

}  // namespace dflash
