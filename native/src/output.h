// What a generation returns, and the incremental text stream that decides what text a caller may
// see so far (complete UTF-8 only, never a possible beginning of a stop string).
#pragma once

#include "dflash.h"

#include <string>
#include <vector>

namespace dflash {

class TextStream {
public:
    explicit TextStream(std::vector<std::string> stop) : stop_(std::move(stop)) {}

    // Append a token's bytes. Returns true when a stop string is now complete (the text is then
    // cut before it). `released` receives the newly releasable bytes.
    bool push(const std::string & piece, std::string & released);
    // At the end: release whatever is still held back.
    void flush(std::string & released);
    const std::string & text() const { return text_; }

private:
    size_t safe_end() const;

    std::vector<std::string> stop_;
    std::string text_;
    size_t      released_ = 0;
    bool        stopped_ = false;
};

}  // namespace dflash

struct dflash_output {
    std::vector<int32_t> tokens;
    std::string          text;
    dflash_stats         stats{};
    // n_probs > 0: per token its log-probability and the n_probs most likely tokens
    int32_t              n_probs = 0;
    std::vector<float>   logprob;       // [n_tokens]
    std::vector<int32_t> top_ids;       // [n_tokens x n_probs], -1 past the candidates
    std::vector<float>   top_logprobs;  // [n_tokens x n_probs]
    // request `capture`: every decoded row's target features and argmax (training data)
    int32_t              cap_taps = 0, cap_embd = 0;
    std::vector<float>   cap_features;  // [n_rows x cap_taps x cap_embd]
    std::vector<int32_t> cap_labels;    // [n_rows], -1 where no logits were computed
};
