// Drafter runtime: context injection, crop, block forward and proposals (graphs: drafter_graph.cpp,
// loading: drafter_load.cpp, selector walk: selector.cpp).
#include "drafter.h"

#include "error.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace dflash {

namespace {

// Largest finite F16 value: target features are clamped to it (and NaN -> 0) before fusing, as
// later upstream does, so "massive activations" cannot poison the drafter.
constexpr float kFeatureLimit = 65504.0f;

float sanitize(float x) {
    if (std::isnan(x)) {
        return 0.0f;
    }
    return std::min(std::max(x, -kFeatureLimit), kFeatureLimit);
}

}  // namespace

Drafter::~Drafter() = default;

dflash_drafter_info Drafter::info() const {
    dflash_drafter_info i{};
    i.n_embd          = hp_.n_embd;
    i.n_layer         = hp_.n_layer;
    i.n_head          = hp_.n_head;
    i.n_head_kv       = hp_.n_head_kv;
    i.head_dim        = hp_.head_dim;
    i.n_ff            = hp_.n_ff;
    i.n_vocab         = hp_.n_vocab;
    i.n_vocab_draft   = hp_.n_vocab_draft;
    i.block_size      = hp_.block_size;
    i.mask_token_id   = hp_.mask_token_id;
    i.n_target_layers = int32_t(hp_.target_layers.size());
    i.conv_kernel_size = hp_.conv_kernel;
    i.conv_group_size = hp_.conv_group;
    i.selector_rank   = hp_.selector_rank;
    i.selector_top_k  = hp_.selector_top_k;
    i.n_ctx           = cache().n_ctx;
    i.n_ctx_used      = n_context();
    i.is_dflash2      = hp_.is_dflash2();
    i.device          = device_name_.c_str();
    return i;
}

void Drafter::add_context() {
    const DrafterHparams & hp = hp_;
    auto slot = std::make_unique<ContextSlot>();
    ggml_init_params ip = {ggml_tensor_overhead() * size_t(2 * hp.n_layer + 2), nullptr, true};
    slot->ctx.reset(ggml_init(ip));
    for (int il = 0; il < hp.n_layer; ++il) {
        const int64_t rows = int64_t(n_ctx_rows_) + hp.block_size;  // + scratch rows of one block
        slot->cache.k.push_back(ggml_new_tensor_3d(slot->ctx.get(), GGML_TYPE_F32, hp.head_dim, hp.n_head_kv, rows));
        slot->cache.v.push_back(ggml_new_tensor_3d(slot->ctx.get(), GGML_TYPE_F32, rows, hp.head_dim, hp.n_head_kv));
        ggml_format_name(slot->cache.k.back(), "cache_k-%d", il);
        ggml_format_name(slot->cache.v.back(), "cache_v-%d", il);
    }
    slot->buf.reset(ggml_backend_alloc_ctx_tensors(slot->ctx.get(), backend_weights()));
    if (!slot->buf) {
        fail(DFLASH_ERR_BACKEND, "cannot allocate a drafter context cache (%d rows) on %s", n_ctx_rows_,
             device_name_.c_str());
    }
    ggml_backend_buffer_clear(slot->buf.get(), 0);
    slot->cache.n_ctx = n_ctx_rows_;
    caches_.push_back(std::move(slot));
}

void Drafter::ensure_contexts(int32_t n) {
    if (n < 1 || n > 256) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "drafter contexts must be 1..256 (got %d)", n);
    }
    while (n_contexts() < n) {
        add_context();
    }
}

int32_t Drafter::n_context_before(int32_t pos) const {
    const auto & p = cache().pos;
    int32_t n = 0;
    while (n < int32_t(p.size()) && p[size_t(n)] < pos) {
        ++n;
    }
    return n;
}

void Drafter::use_context(int32_t index) {
    if (index < 0 || index >= n_contexts()) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "drafter context %d does not exist (%d allocated)", index, n_contexts());
    }
    active_ = index;
}

void Drafter::alloc_graph(ggml_cgraph * gf, const char * what) {
    ggml_backend_sched_reset(sched_.get());
    if (!ggml_backend_sched_alloc_graph(sched_.get(), gf)) {
        fail(DFLASH_ERR_BACKEND, "cannot allocate the %s graph on %s", what, device_name_.c_str());
    }
}

void Drafter::compute(ggml_cgraph * gf) {
    if (ggml_backend_sched_graph_compute(sched_.get(), gf) != GGML_STATUS_SUCCESS) {
        fail(DFLASH_ERR_BACKEND, "drafter graph computation failed on %s", device_name_.c_str());
    }
}

// A fresh no_alloc context for one graph's tensor headers.
static ggml_context_ptr graph_context(std::vector<uint8_t> & scratch) {
    const size_t size = ggml_tensor_overhead() * 4096 + ggml_graph_overhead_custom(4096, false);
    scratch.resize(size);
    ggml_init_params ip = {size, scratch.data(), /*no_alloc*/ true};
    return ggml_context_ptr(ggml_init(ip));
}

template <typename Fill>
void Drafter::inject_rows(const int32_t * positions, int32_t n, Fill && fill) {
    if (n < 0 || (n > 0 && !positions)) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "inject: invalid rows (n = %d)", n);
    }
    if (n_context() + n > cache().n_ctx) {
        fail(DFLASH_ERR_CONTEXT_FULL, "drafter context holds %d rows, %d more do not fit its %d", n_context(), n,
             cache().n_ctx);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (positions[i] < 0) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "inject: negative position %d at row %d", positions[i], i);
        }
    }
    std::vector<float> rows;
    for (int32_t done = 0; done < n;) {
        const int32_t chunk = std::min(n_batch_, n - done);
        ggml_context_ptr ctx = graph_context(graph_meta_);
        InjectGraph g = build_inject_graph(ctx.get(), hp_, w_, cache(), n_context(), chunk);
        alloc_graph(g.gf, "injection");
        rows.resize(size_t(chunk) * hp_.n_feat());
        fill(done, chunk, rows.data());
        std::transform(rows.begin(), rows.end(), rows.begin(), sanitize);
        ggml_backend_tensor_set(g.in.features, rows.data(), 0, rows.size() * sizeof(float));
        ggml_backend_tensor_set(g.in.positions, positions + done, 0, size_t(chunk) * sizeof(int32_t));
        compute(g.gf);
        cache().pos.insert(cache().pos.end(), positions + done, positions + done + chunk);
        done += chunk;
    }
}

void Drafter::inject(const float * features, const int32_t * positions, int32_t n) {
    if (n > 0 && !features) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "inject: features is NULL");
    }
    const size_t width = size_t(hp_.n_feat());
    inject_rows(positions, n, [&](int32_t first, int32_t count, float * out) {
        std::copy(features + size_t(first) * width, features + size_t(first + count) * width, out);
    });
}

void Drafter::inject_taps(const float * const * taps, int32_t n_taps, const int32_t * positions, int32_t n) {
    if (n_taps != int32_t(hp_.target_layers.size())) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "inject: %d tap arrays given, the drafter reads %zu target layers", n_taps,
             hp_.target_layers.size());
    }
    for (int32_t k = 0; n > 0 && k < n_taps; ++k) {
        if (!taps || !taps[k]) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "inject: tap array %d is NULL", k);
        }
    }
    const size_t H = size_t(hp_.n_embd);
    inject_rows(positions, n, [&](int32_t first, int32_t count, float * out) {
        for (int32_t i = 0; i < count; ++i) {
            for (int32_t k = 0; k < n_taps; ++k) {  // row i = [tap 0 | tap 1 | ...]
                const float * src = taps[k] + size_t(first + i) * H;
                std::copy(src, src + H, out + (size_t(i) * n_taps + k) * H);
            }
        }
    });
}

void Drafter::crop(int32_t n_keep) {
    if (n_keep < 0) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "crop: negative row count %d", n_keep);
    }
    if (n_keep < n_context()) {
        cache().pos.resize(n_keep);  // rows past n_keep are simply overwritten by later injections
    }
}

const BlockOutput & Drafter::forward_block(int32_t anchor, int32_t start_pos, int32_t n_block) {
    std::vector<BlockOutput> outs;
    forward_blocks({{active_, anchor, start_pos}}, n_block, outs);
    out_ = std::move(outs.front());
    return out_;
}

void Drafter::forward_blocks(const std::vector<BlockJob> & jobs, int32_t n_block, std::vector<BlockOutput> & outs) {
    if (n_block < 1 || n_block > hp_.block_size) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "block length %d is outside 1..%d (the drafter's block size)", n_block,
             hp_.block_size);
    }
    if (jobs.empty()) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no block to run");
    }
    const size_t B = jobs.size();
    std::vector<const DrafterCache *> caches;
    std::vector<int32_t> n_past;
    std::vector<int32_t> tokens(B * size_t(n_block), hp_.mask_token_id), pos(B * size_t(n_block));
    for (size_t b = 0; b < B; ++b) {
        const BlockJob & j = jobs[b];
        if (j.context < 0 || j.context >= n_contexts()) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "drafter context %d does not exist (%d allocated)", j.context, n_contexts());
        }
        if (j.anchor < 0 || j.anchor >= hp_.n_vocab) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "anchor token %d is outside the vocabulary (%d)", j.anchor, hp_.n_vocab);
        }
        if (j.start_pos < 0) {
            fail(DFLASH_ERR_INVALID_ARGUMENT, "negative block position %d", j.start_pos);
        }
        for (size_t b2 = 0; b2 < b; ++b2) {
            if (jobs[b2].context == j.context) {
                fail(DFLASH_ERR_INVALID_ARGUMENT, "two blocks on drafter context %d", j.context);
            }
        }
        caches.push_back(&caches_[size_t(j.context)]->cache);
        n_past.push_back(int32_t(caches.back()->pos.size()));
        tokens[b * size_t(n_block)] = j.anchor;
        for (int32_t i = 0; i < n_block; ++i) {
            pos[b * size_t(n_block) + size_t(i)] = j.start_pos + i;
        }
    }

    ggml_context_ptr ctx = graph_context(graph_meta_);
    BlockGraph g = build_block_graph(ctx.get(), hp_, w_, caches, n_past, n_block, exact_head_);
    alloc_graph(g.gf, "block");
    ggml_backend_tensor_set(g.in.tokens, tokens.data(), 0, tokens.size() * sizeof(int32_t));
    ggml_backend_tensor_set(g.in.positions, pos.data(), 0, pos.size() * sizeof(int32_t));
    const float inf = std::numeric_limits<float>::infinity();
    for (size_t b = 0; b < B; ++b) {
        // visibility of key j (context rows, then block rows) from block query i
        const int32_t n_kv = n_past[b] + n_block;
        const int32_t * bpos = pos.data() + b * size_t(n_block);
        std::vector<int32_t> k_pos(caches[b]->pos);
        k_pos.insert(k_pos.end(), bpos, bpos + n_block);
        std::vector<float> mask_full(size_t(n_kv) * n_block), mask_swa(size_t(n_kv) * n_block);
        for (int32_t i = 0; i < n_block; ++i) {
            for (int32_t j = 0; j < n_kv; ++j) {
                const int64_t dq = int64_t(bpos[i]) - k_pos[size_t(j)];  // q_pos - k_pos
                bool visible = !hp_.causal || dq >= 0;
                mask_full[size_t(i) * n_kv + j] = visible ? 0.0f : -inf;
                if (hp_.n_swa > 0) {
                    visible = visible && dq < hp_.n_swa && (hp_.causal || -dq < hp_.n_swa);
                }
                mask_swa[size_t(i) * n_kv + j] = visible ? 0.0f : -inf;
            }
        }
        if (g.masks_full[b]) {
            ggml_backend_tensor_set(g.masks_full[b], mask_full.data(), 0, mask_full.size() * sizeof(float));
        }
        if (g.masks_swa[b]) {
            ggml_backend_tensor_set(g.masks_swa[b], mask_swa.data(), 0, mask_swa.size() * sizeof(float));
        }
    }
    compute(g.gf);

    outs.assign(B, BlockOutput{});
    const size_t H = size_t(hp_.n_embd), N = size_t(hp_.n_vocab_draft), r = size_t(hp_.selector_rank);
    for (size_t b = 0; b < B; ++b) {
        BlockOutput & o = outs[b];
        o.n_block = n_block;
        o.anchor  = jobs[b].anchor;
        o.hidden.resize(size_t(n_block) * H);
        o.logits.resize(size_t(n_block) * N);
        const size_t row0 = b * size_t(n_block);
        ggml_backend_tensor_get(g.hidden, o.hidden.data(), row0 * H * sizeof(float), o.hidden.size() * sizeof(float));
        ggml_backend_tensor_get(g.logits, o.logits.data(), row0 * N * sizeof(float), o.logits.size() * sizeof(float));
        if (g.projected) {
            o.projected.resize(size_t(n_block) * r);
            ggml_backend_tensor_get(g.projected, o.projected.data(), row0 * r * sizeof(float),
                                    o.projected.size() * sizeof(float));
        }
    }
}

void Drafter::read_codebook_row(const ggml_tensor * t, int32_t id, float * out) const {
    const size_t row_bytes = ggml_row_size(t->type, t->ne[0]);
    if (t->type == GGML_TYPE_F32) {
        ggml_backend_tensor_get(t, out, size_t(id) * t->nb[1], row_bytes);
        return;
    }
    std::vector<uint8_t> raw(row_bytes);
    ggml_backend_tensor_get(t, raw.data(), size_t(id) * t->nb[1], row_bytes);
    ggml_get_type_traits(t->type)->to_float(raw.data(), out, t->ne[0]);
}

Proposal Drafter::select(float temperature, std::mt19937_64 & rng) const { return select(out_, temperature, rng); }

Proposal Drafter::select(const BlockOutput & out, float temperature, std::mt19937_64 & rng) const {
    if (out.n_block < 1) {
        fail(DFLASH_ERR_INVALID_ARGUMENT, "select: no block has been run yet");
    }
    const int32_t n_slots = out.n_block - 1;
    const int32_t N = hp_.n_vocab_draft;
    const int32_t * d2t = d2t_.empty() ? nullptr : d2t_.data();
    const float * logits = out.logits.data() + N;  // slot 0 (the anchor) proposes nothing
    if (!hp_.is_dflash2()) {
        return propose_independent(logits, n_slots, N, temperature, rng, d2t);
    }
    Proposal p;
    SelectorInputs in{n_slots, N, hp_.selector_rank, std::min(hp_.selector_top_k, N), logits,
                      out.projected.data() + hp_.selector_rank, out.anchor, d2t};
    build_lattice(
        in, [this](int32_t id, float * row) { read_codebook_row(w_.selector_predecessor, id, row); },
        [this](int32_t id, float * row) { read_codebook_row(w_.selector_successor, id, row); }, p);
    walk_lattice(p, in.top_k, temperature, rng);
    return p;
}

Proposal Drafter::propose(int32_t anchor, int32_t start_pos, int32_t n_block, float temperature, std::mt19937_64 & rng) {
    forward_block(anchor, start_pos, n_block);
    return select(temperature, rng);
}

}  // namespace dflash
