// The native DFlash v1 / DFlash2 drafter (spec §1-§4): a `dflash` GGUF on a ggml backend.
//
// * Device: the drafter computes on one ggml device (CPU by default; a GPU, Metal or RPC device
//   by name) through a ggml_backend_sched that also holds the CPU backend, so an op the device
//   cannot run, or one whose weights live in host memory, runs on the CPU.
// * Weights: the drafter's own tensors are loaded into one buffer of that device; the selector
//   codebooks, which only the host-side lattice walk reads, into host memory. The target's
//   `token_embd.weight` / `output.weight` (tied: token_embd) are borrowed: the target GGUF is
//   mapped read-only and those two tensors point into the mapping (no second host copy; any
//   ggml type get_rows / mul_mat accept). On a device other than the CPU the head is copied to
//   the device (device memory, not host memory), unless the exact head (a CPU op) is asked for.
// * Context: `inject` fuses target feature rows (fc -> hidden_norm) and stores every layer's
//   K = RoPE(k_norm(W_k g), p) and V = W_v g at the row's own position in a KV cache that holds
//   committed context rows only; `crop` forgets rows.
// * Block: `forward_block` runs [anchor, MASK, ...] at positions s.. over [context ; block]
//   (non-causal unless the GGUF says causal) and returns the final-normed hidden and the
//   transformed logits; the block's own K/V never enter the cache.
// * Proposal: `select` / `propose` walk the DFlash2 candidate selector (selector.h) or, for v1,
//   take each slot independently.
#pragma once

#include "dflash.h"
#include "gguf_meta.h"
#include "selector.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace dflash {

// Metadata of a `dflash` GGUF (names: pydflash/gguf_layout.py Keys) plus the target facts it needs.
struct DrafterHparams {
    int32_t n_embd = 0, n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n_ff = 0;
    float   rms_eps = 1e-6f, rope_base = 10000.0f, rope_freq_scale = 1.0f;
    int32_t block_size = 0;
    std::vector<int32_t> target_layers;  // as stored: target layer *input* index = HF layer id + 1
    bool    causal = false;
    int32_t n_swa = 0;                   // sliding window (0: none)
    std::vector<bool> swa_layers;        // per drafter layer
    int32_t mask_token_id = -1;
    float   logit_scale = 1.0f, softcap = 0.0f, embedding_scale = 1.0f;
    // DFlash2 only (0 for v1)
    int32_t conv_kernel = 0, conv_group = 0, selector_rank = 0, selector_top_k = 0;
    // from the target
    int32_t n_vocab = 0;
    // rows of the draft head: n_vocab, or the size of the reduced draft vocabulary (d2t)
    int32_t n_vocab_draft = 0;
    // measured acceptance profile (optional, `dflash.acceptance_profile`): the probability that
    // draft j is accepted given drafts 0..j-1 were, greedy, on held-out prompts; the drafts behind it
    std::vector<float> acceptance;
    int64_t acceptance_drafts = 0;

    bool    is_dflash2() const { return selector_top_k > 0; }
    int32_t n_feat() const { return n_embd * int32_t(target_layers.size()); }
};

// Tensor fields are named after the GGUF tensors (blk.<il>.<name>).
struct DrafterLayer {
    ggml_tensor * attn_norm = nullptr;
    ggml_tensor * wq = nullptr, * wk = nullptr, * wv = nullptr, * wo = nullptr;
    ggml_tensor * attn_q_norm = nullptr, * attn_k_norm = nullptr;
    ggml_tensor * ffn_norm = nullptr, * ffn_gate = nullptr, * ffn_up = nullptr, * ffn_down = nullptr;
    // DFlash2 grouped dynamic convs: base [H, T, 2] (F32), proj [H, 2*T*G]
    ggml_tensor * attn_conv_base = nullptr, * attn_conv_proj = nullptr;
    ggml_tensor * ffn_conv_base = nullptr, * ffn_conv_proj = nullptr;
};

struct DrafterWeights {
    ggml_tensor * fc = nullptr;               // [L*H, H]
    ggml_tensor * enc_output_norm = nullptr;  // hidden_norm [H]
    ggml_tensor * output_norm = nullptr;      // [H]
    std::vector<DrafterLayer> layers;
    ggml_tensor * selector_predecessor = nullptr;  // [r, V]
    ggml_tensor * selector_successor = nullptr;    // [r, V]
    ggml_tensor * selector_hidden = nullptr;       // [H, r]
    // borrowed from the target GGUF
    ggml_tensor * tok_embd = nullptr;  // [H, V]
    ggml_tensor * output = nullptr;    // [H, V]
    // reduced draft vocabulary: the drafter's own head [H, N] (rows = target ids d2t[0..N-1])
    ggml_tensor * output_draft = nullptr;

    ggml_tensor * head() const { return output_draft ? output_draft : output; }
};

// Context K/V of committed rows per layer: k [head_dim, n_head_kv, rows], v transposed
// [rows, head_dim, n_head_kv] (F32). rows = n_ctx + block_size: a block's own K/V use the
// scratch rows after the committed ones during its forward.
struct DrafterCache {
    std::vector<ggml_tensor *> k, v;
    std::vector<int32_t>       pos;  // position of every committed row, in injection order
    int32_t                    n_ctx = 0;  // most committed rows
};

// What one block forward produced (rows = block slots; slot 0 = anchor).
struct BlockOutput {
    int32_t            n_block = 0;
    int32_t            anchor = -1;
    std::vector<float> hidden;     // [n_block, H] final-normed
    std::vector<float> logits;     // [n_block, N] with logit scale + softcap (N = n_vocab_draft)
    std::vector<float> projected;  // [n_block, r] = W_h hidden (DFlash2)
};

class Drafter {
public:
    static std::unique_ptr<Drafter> load(const char * path, const char * target_path,
                                         const dflash_drafter_params & params);
    ~Drafter();

    const DrafterHparams & hparams() const { return hp_; }
    dflash_drafter_info info() const;
    int32_t n_context() const { return int32_t(cache().pos.size()); }

    // Context caches: one per sequence the drafter serves (weights are shared). Context 0 exists
    // from load; the C API's inject/crop/propose work on the selected context.
    int32_t n_contexts() const { return int32_t(caches_.size()); }
    void    ensure_contexts(int32_t n);   // allocate contexts up to n (each n_ctx rows)
    void    use_context(int32_t index);   // later inject/crop/forward calls act on this one
    int32_t context() const { return active_; }
    // Rows of the selected context at positions < pos (rows are injected in position order).
    int32_t n_context_before(int32_t pos) const;

    // Append feature rows [n, L*H] (row-major F32) at `positions` to the context cache.
    // Non-finite values are sanitised (NaN -> 0, clamp to +-65504) before fusing.
    void inject(const float * features, const int32_t * positions, int32_t n);
    // The same from per-tap arrays: taps[k] is [n, H] for target layer target_layers[k] (what the
    // target's tap capture returns), so the loop needs no concatenation copy of its own.
    void inject_taps(const float * const * taps, int32_t n_taps, const int32_t * positions, int32_t n);
    // Keep only the first n_keep context rows (no-op when fewer are held).
    void crop(int32_t n_keep);

    // Block [anchor, MASK x (n_block-1)] at positions start_pos.. over the held context.
    const BlockOutput & forward_block(int32_t anchor, int32_t start_pos, int32_t n_block);
    // Several blocks of the same length in one graph, each over its own context (weights read
    // once for all); outs[i] receives job i's output.
    struct BlockJob {
        int32_t context, anchor, start_pos;
    };
    void forward_blocks(const std::vector<BlockJob> & jobs, int32_t n_block, std::vector<BlockOutput> & outs);
    // Proposal for slots 1..n-1 of a block output (T <= 0: greedy).
    Proposal select(const BlockOutput & out, float temperature, std::mt19937_64 & rng) const;
    const BlockOutput & last_output() const { return out_; }

    // Proposal for slots 1..n-1 from the last forward (T <= 0: greedy).
    Proposal select(float temperature, std::mt19937_64 & rng) const;
    // forward_block + select.
    Proposal propose(int32_t anchor, int32_t start_pos, int32_t n_block, float temperature, std::mt19937_64 & rng);

    std::mt19937_64 & rng() { return rng_; }

    // Target ids of the draft vocabulary (d2t); empty when the drafter drafts over the full vocabulary.
    const std::vector<int32_t> & draft_vocab() const { return d2t_; }
    int32_t to_target(int32_t draft_id) const { return d2t_.empty() ? draft_id : d2t_[size_t(draft_id)]; }

private:
    Drafter() = default;
    void init_backends(const char * device);
    void compute(ggml_cgraph * gf);
    // fill(first_row, n_rows, out) writes rows [first_row, first_row + n_rows) as [n_rows, L*H] F32
    template <typename Fill> void inject_rows(const int32_t * positions, int32_t n, Fill && fill);
    void read_codebook_row(const ggml_tensor * t, int32_t id, float * out) const;

    DrafterHparams hp_;
    DrafterWeights w_;
    // one context cache per served sequence (its tensors live in its own device buffer)
    struct ContextSlot {
        DrafterCache            cache;
        ggml_context_ptr        ctx;
        ggml_backend_buffer_ptr buf;
    };
    std::vector<std::unique_ptr<ContextSlot>> caches_;
    int32_t        active_ = 0;
    int32_t        n_ctx_rows_ = 0;  // rows each context holds
    DrafterCache & cache() { return caches_[size_t(active_)]->cache; }
    const DrafterCache & cache() const { return caches_[size_t(active_)]->cache; }
    void add_context();
    BlockOutput    out_;
    std::vector<int32_t> d2t_;  // draft id -> target id (empty: identity)
    int32_t        n_threads_ = 1;
    int32_t        n_batch_ = 512;  // most context rows per injection graph
    bool           exact_head_ = false;
    std::mt19937_64 rng_;

    // Allocates a graph's intermediates over the backends; inputs are set after this.
    void alloc_graph(ggml_cgraph * gf, const char * what);
    // The backend that holds weights and cache: the device's, or the CPU's when it is the CPU.
    ggml_backend_t backend_weights() const { return backend_dev_ ? backend_dev_.get() : backend_cpu_.get(); }

    std::string                 device_name_;   // the ggml device the drafter computes on
    ggml_backend_ptr            backend_cpu_;   // always: inputs, borrowed host weights, CPU-only ops
    ggml_backend_ptr            backend_dev_;   // null when the device is the CPU
    ggml_backend_sched_ptr      sched_;
    ggml_context_ptr            ctx_weights_;   // on the device
    ggml_backend_buffer_ptr     buf_weights_;
    ggml_context_ptr            ctx_host_;      // selector codebooks: read by the host walk
    ggml_backend_buffer_ptr     buf_host_;
    std::unique_ptr<MappedFile> target_map_;
    ggml_context_ptr            ctx_target_;    // borrowed target tensors (host mapping)
    ggml_backend_buffer_ptr     buf_target_;
    ggml_context_ptr            ctx_head_;      // the target's head copied to a non-CPU device
    ggml_backend_buffer_ptr     buf_head_;
    std::vector<uint8_t>        graph_meta_;  // scratch for graph tensor headers

    friend struct DrafterLoader;
};

// Graph builders (drafter_graph.cpp): one function per graph, top to bottom like spec §1.
struct GraphInputs {
    ggml_tensor * features = nullptr;   // inject: [L*H, n] F32
    ggml_tensor * tokens = nullptr;     // block:  [n] I32
    ggml_tensor * positions = nullptr;  // [n] I32
};

struct BlockGraph {
    ggml_cgraph * gf = nullptr;
    GraphInputs   in;
    std::vector<ggml_tensor *> masks_full, masks_swa;  // per block [n_past_b + n, n] (nullptr: unused)
    ggml_tensor * hidden = nullptr;     // [H, n]
    ggml_tensor * logits = nullptr;     // [V, n]
    ggml_tensor * projected = nullptr;  // [r, n] (DFlash2)
};

struct InjectGraph {
    ggml_cgraph * gf = nullptr;
    GraphInputs   in;
};

InjectGraph build_inject_graph(ggml_context * ctx, const DrafterHparams & hp, const DrafterWeights & w,
                               const DrafterCache & cache, int32_t n_past, int32_t n);
// B blocks of n rows in one graph, block b over caches[b] (n_past[b] committed rows); rows are
// laid out block after block. exact_head: logits with F32 activations (see head_exact_op)
// instead of ggml's quantized mul_mat.
BlockGraph  build_block_graph(ggml_context * ctx, const DrafterHparams & hp, const DrafterWeights & w,
                              const std::vector<const DrafterCache *> & caches, const std::vector<int32_t> & n_past,
                              int32_t n, bool exact_head);

}  // namespace dflash
