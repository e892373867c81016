// The target model: a GGUF loaded through libllama plus one context, with the hidden-state taps
// a DFlash drafter feeds on and exact rollback of rejected rows, whatever memory the model has:
//   - attention KV: the rejected cells are removed;
//   - recurrent / hybrid memory whose graph keeps per-token state snapshots (llama.cpp's n_rs_seq,
//     sized at load to the widest verify block): the state is read back from the snapshot of the
//     last accepted row, at no extra cost;
//   - other recurrent / hybrid memory: the sequence's recurrent state is saved before a verify
//     block (checkpoint) and, after a rejection, restored; the caller decodes the accepted rows
//     again (replay).
#pragma once

#include "dflash.h"

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

enum class Rollback : int32_t { kv = 0, snapshots = 1, checkpoint = 2 };

class Target {
public:
    Target(const char * path, const dflash_target_params & params);
    ~Target();
    Target(const Target &) = delete;
    Target & operator=(const Target &) = delete;

    dflash_target_info info() const;
    std::string meta(const char * key) const;  // throws if absent
    const llama_vocab * vocab() const { return vocab_; }
    llama_model * model() const { return model_; }
    llama_context * ctx() const { return ctx_; }

    std::vector<int32_t> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const int32_t * tokens, int32_t n, bool render_special) const;
    std::string token_piece(int32_t token) const;  // raw bytes, as llama-server streams them
    std::string apply_chat_template(const std::vector<std::string> & roles,
                                    const std::vector<std::string> & contents, bool add_assistant) const;
    bool is_eog(int32_t token) const;
    void check_token(int32_t token) const;

    // Taps: layer l = the hidden state entering target layer l (= output of layer l-1).
    void set_taps(const std::vector<int32_t> & layers);
    const std::vector<int32_t> & taps() const { return tap_layers_; }
    const float * tap_rows(int32_t tap_index, int32_t * n_rows) const;

    // Decode one batch on one sequence; pos == nullptr continues after the sequence's end.
    void decode(int32_t seq_id, const int32_t * tokens, const int32_t * pos, int32_t n, bool all_logits);

    // Several sequences in one batch: each chunk continues its sequence. Rows are laid out chunk
    // after chunk; each chunk keeps logits of all its rows, its last row, or none.
    enum ChunkLogits : int8_t { LOGITS_NONE = 0, LOGITS_LAST = 1, LOGITS_ALL = 2 };
    struct Chunk {
        int32_t         seq_id;
        const int32_t * tokens;
        int32_t         n;
        ChunkLogits     logits = LOGITS_LAST;
    };
    void decode_chunks(const std::vector<Chunk> & chunks);

    const float * logits(int32_t row) const;  // row of the last decode; -1 = last
    int32_t last_n_rows() const { return last_n_rows_; }

    int32_t seq_pos_max(int32_t seq_id) const;
    // Drop positions >= pos of the sequence. pos 0 always works; a recurrent memory rolls back
    // only the rows of its last decode (snapshots) or to a restored checkpoint.
    void    rollback(int32_t seq_id, int32_t pos);

    Rollback rollback_kind() const { return rollback_; }
    // Most drafts one verify block may carry and still be rolled back (snapshots: their depth).
    int32_t max_verify_drafts() const { return max_verify_drafts_; }
    // The memory holds recurrent state: a prefix of a sequence cannot be kept by cutting its end.
    bool recurrent() const { return rollback_ != Rollback::kv; }
    // Checkpoint rollback: save the sequence's recurrent state (before a verify block), and put
    // it back, dropping every position >= pos (pos: the first verified row's).
    void checkpoint(int32_t seq_id);
    void restore_checkpoint(int32_t seq_id, int32_t pos);
    // Decode one row with the taps on and check that each tap layer's hidden states come out
    // (then clears sequence 0): false + why when this graph exposes none at some layer.
    bool probe_taps(const std::vector<int32_t> & layers, std::string * why);
    const char * tap_mode() const { return eval_taps_ ? "eval-callback" : "layer-input"; }

    int32_t n_vocab() const { return n_vocab_; }
    int32_t n_embd() const { return n_embd_; }
    int32_t n_ctx() const { return n_ctx_; }
    int32_t n_batch() const { return n_batch_; }

private:
    static bool eval_callback(struct ggml_tensor * t, bool ask, void * user);
    void add_row(int32_t seq_id, int32_t token, int32_t pos, bool logits);
    void run_batch();
    void keep_outputs(int32_t first_row);  // copy the last decode's logits and taps (merged decodes)
    bool arch_has_layer_inputs() const;
    void check_seq(int32_t seq_id) const;

    llama_model *       model_ = nullptr;
    llama_context *     ctx_ = nullptr;
    const llama_vocab * vocab_ = nullptr;
    llama_batch         batch_{};
    int32_t n_vocab_ = 0, n_embd_ = 0, n_layer_ = 0, n_ctx_ = 0, n_batch_ = 0, n_seq_max_ = 1;
    bool    eval_taps_ = false;  // true: taps come from the graph eval callback
    int32_t n_streams_ = 1;      // residual streams of a graph with hyper-connections

    std::vector<int32_t>            tap_layers_;
    std::vector<std::string>        tap_names_;  // eval mode: "l_out-<layer-1>"
    std::vector<std::string>        tap_alt_names_;  // the same layer's "l_last-<layer-1>"
    std::vector<std::vector<float>> tap_data_;   // eval mode: rows of the last decode
    int32_t last_n_rows_ = 0;
    std::vector<bool> last_has_logits_;  // per row of the last decode

    Rollback rollback_ = Rollback::kv;
    int32_t  max_verify_drafts_ = 0;
    std::vector<std::vector<uint8_t>> checkpoints_;  // per sequence (checkpoint rollback)

    // several sequences on recurrent memory are decoded one by one (llama.cpp splits them into
    // equal-length ubatches, whose taps would come out in ubatch order): outputs are copied here
    bool merged_ = false;
    std::vector<int32_t> merged_logit_row_;  // per row: index into merged_logits_, -1 none
    std::vector<float> merged_logits_;
    std::vector<std::vector<float>> merged_taps_;
};

}  // namespace dflash
