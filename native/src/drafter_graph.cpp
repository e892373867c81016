// The drafter's two ggml graphs, written to read like spec §1:
//
//   inject: g = RMSNorm(W_fc F; hidden_norm); per layer K = RoPE(k_norm(W_k g), p), V = W_v g
//           -> stored as context cache rows n_past..n_past+n-1
//   block:  h = E[x] * alpha; per layer
//               a = norm(h); [conv_0]; o = Attn(Q(a'), [K_ctx ; K(a')], [V_ctx ; V(a')]); [conv_1]; h += o
//               m = norm(h); [conv_0]; f = SwiGLU(m');                                   [conv_1]; h += f
//           hidden = norm(h); logits = softcap(mu * W_out hidden); projected = W_h hidden
//           (W_out: the target's head, or the drafter's own rows of a reduced draft vocabulary)
//
// Everything is F32 except the weights (any ggml type). Every intermediate gets a name
// ("attn_conv_in-0", ...) so graph dumps read like the spec.
#include "drafter.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace dflash {

namespace {

void cb(ggml_tensor * t, const char * name, int il) {
    if (il >= 0) {
        ggml_format_name(t, "%s-%d", name, il);
    } else {
        ggml_set_name(t, name);
    }
}

ggml_tensor * build_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * weight, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), weight);
}

ggml_tensor * build_rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos, const DrafterHparams & hp) {
    // NeoX (rotate-half) RoPE over the whole head, as Qwen3
    return ggml_rope_ext(ctx, x, pos, nullptr, hp.head_dim, GGML_ROPE_TYPE_NEOX, /*n_ctx_orig*/ 0, hp.rope_base,
                         hp.rope_freq_scale, /*ext_factor*/ 0.0f, /*attn_factor*/ 1.0f, /*beta_fast*/ 0.0f,
                         /*beta_slow*/ 0.0f);
}

// K = RoPE(k_norm(W_k x)), V = W_v x as [head_dim, n_head_kv, n]; the same for context and block rows.
void build_kv(ggml_context * ctx, const DrafterHparams & hp, const DrafterLayer & L, ggml_tensor * x,
              ggml_tensor * pos, int il, ggml_tensor ** k_out, ggml_tensor ** v_out) {
    const int64_t n = x->ne[1];
    ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wk, x), hp.head_dim, hp.n_head_kv, n);
    k = build_norm(ctx, k, L.attn_k_norm, hp.rms_eps);
    cb(k, "Kcur_normed", il);
    k = build_rope(ctx, k, pos, hp);
    cb(k, "Kcur", il);
    ggml_tensor * v = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wv, x), hp.head_dim, hp.n_head_kv, n);
    cb(v, "Vcur", il);
    *k_out = k;
    *v_out = v;
}

// One grouped dynamic causal conv over each block of z [H, n * B] (B blocks of n rows, spec §1.3):
//   out[i, c] = sum_t (base[side, t, c] + coeff[i, side*T*G + t*G + c/S]) * z[i - t, c],   z[< 0] = 0
// (i counted within its block). coeff [2*T*G, n * B] comes from the sublayer's normed input; group
// g owns channels g*S .. g*S+S-1.
ggml_tensor * build_conv(ggml_context * ctx, const DrafterHparams & hp, ggml_tensor * z, ggml_tensor * coeff,
                         ggml_tensor * base, int side, int64_t n) {
    const int64_t H = z->ne[0], B = z->ne[1] / n;
    const int64_t T = hp.conv_kernel, S = hp.conv_group, G = H / S;
    const size_t  es = ggml_element_size(coeff);
    ggml_tensor * z3 = ggml_reshape_3d(ctx, z, H, n, B);
    ggml_tensor * out = nullptr;
    for (int64_t t = 0; t < T && t < n; ++t) {  // taps at or past the block length only see padding
        // this side/tap's coefficients as [1, G, n, B], expanded to S consecutive channels per group
        ggml_tensor * c = ggml_view_4d(ctx, coeff, 1, G, n, B, es, coeff->nb[1], coeff->nb[1] * n,
                                       size_t(side * T * G + t * G) * es);
        c = ggml_reshape_3d(ctx, ggml_repeat_4d(ctx, c, S, G, n, B), H, n, B);
        ggml_tensor * b = ggml_view_1d(ctx, base, H, size_t(t) * base->nb[1] + size_t(side) * base->nb[2]);
        ggml_tensor * weight = ggml_add(ctx, c, b);  // [H, n, B]
        // each block shifted down by t rows, zero rows at its start
        ggml_tensor * zt = t == 0 ? z3
            : ggml_pad_ext(ctx, ggml_view_3d(ctx, z3, H, n - t, B, z3->nb[1], z3->nb[2], 0), 0, 0, int(t), 0, 0, 0, 0, 0);
        ggml_tensor * term = ggml_mul(ctx, weight, zt);
        out = out ? ggml_add(ctx, out, term) : term;
    }
    return ggml_reshape_2d(ctx, out, H, n * B);
}

// Store K [head_dim, n_head_kv, n] and V (same shape) as cache rows row0 .. row0+n-1 of layer il.
// V is kept transposed ([rows, head_dim, n_head_kv]) so attention reads it without a copy.
void build_cache_store(ggml_context * ctx, ggml_cgraph * gf, const DrafterCache & cache, int il, ggml_tensor * k,
                       ggml_tensor * v, int32_t row0) {
    ggml_tensor * ck = cache.k[il], * cv = cache.v[il];
    const int64_t n = k->ne[2];
    ggml_tensor * k_dst = ggml_view_3d(ctx, ck, ck->ne[0], ck->ne[1], n, ck->nb[1], ck->nb[2], size_t(row0) * ck->nb[2]);
    ggml_tensor * v_dst = ggml_view_3d(ctx, cv, n, cv->ne[1], cv->ne[2], cv->nb[1], cv->nb[2], size_t(row0) * cv->nb[0]);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, k, k_dst));
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_permute(ctx, v, 1, 2, 0, 3), v_dst));
}

// Non-causal (unless masked) GQA attention of each block's queries over [its context ; its block]:
// cur holds B blocks of n rows, block b drafting on caches[b] after n_past[b] committed rows. A
// block's K/V go to its cache's scratch rows right after the committed ones (they are not counted
// as context and the next injection overwrites them), so nothing is concatenated. The
// projections run once over all rows; only the attention itself is per block.
ggml_tensor * build_attention(ggml_context * ctx, ggml_cgraph * gf, const DrafterHparams & hp, const DrafterLayer & L,
                              const std::vector<const DrafterCache *> & caches, const std::vector<int32_t> & n_past,
                              ggml_tensor * cur, ggml_tensor * pos, const std::vector<ggml_tensor *> & kq_masks,
                              int64_t n, int il) {
    const int64_t N = cur->ne[1];
    ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wq, cur), hp.head_dim, hp.n_head, N);
    q = build_norm(ctx, q, L.attn_q_norm, hp.rms_eps);
    q = build_rope(ctx, q, pos, hp);
    cb(q, "Qcur", il);
    ggml_tensor * k_all, * v_all;
    build_kv(ctx, hp, L, cur, pos, il, &k_all, &v_all);

    ggml_tensor * out = nullptr;
    for (size_t b = 0; b < caches.size(); ++b) {
        const DrafterCache & cache = *caches[b];
        const int64_t n_kv = n_past[b] + n;
        auto rows = [&](ggml_tensor * t) {  // block b's rows of a [d, heads, N] tensor
            return ggml_view_3d(ctx, t, t->ne[0], t->ne[1], n, t->nb[1], t->nb[2], size_t(b) * size_t(n) * t->nb[2]);
        };
        build_cache_store(ctx, gf, cache, il, rows(k_all), rows(v_all), n_past[b]);  // expanded first: runs before the reads
        ggml_tensor * ck = cache.k[il], * cv = cache.v[il];
        ggml_tensor * k = ggml_view_3d(ctx, ck, hp.head_dim, hp.n_head_kv, n_kv, ck->nb[1], ck->nb[2], 0);  // [d, n_head_kv, n_kv]
        ggml_tensor * v = ggml_view_3d(ctx, cv, n_kv, hp.head_dim, hp.n_head_kv, cv->nb[1], cv->nb[2], 0);  // [n_kv, d, n_head_kv]

        // q head h reads kv head h / (n_head / n_head_kv): mul_mat broadcasts over dim 2
        ggml_tensor * kq = ggml_mul_mat(ctx, ggml_permute(ctx, k, 0, 2, 1, 3), ggml_permute(ctx, rows(q), 0, 2, 1, 3));
        kq = ggml_soft_max_ext(ctx, kq, kq_masks[b], 1.0f / std::sqrt(float(hp.head_dim)), 0.0f);  // [n_kv, n, n_head]
        cb(kq, "kq_soft_max", il);
        ggml_tensor * kqv = ggml_mul_mat(ctx, v, kq);  // [head_dim, n, n_head]
        ggml_tensor * o = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hp.head_dim * hp.n_head, n);
        out = out ? ggml_concat(ctx, out, o, 1) : o;
    }
    return ggml_mul_mat(ctx, L.wo, out);
}

// logits[v, i] = W[v] . h[i] with F32 activations: each weight row is dequantized on the fly
// (no copy of the head is kept) and dotted with ggml's F32 kernel. ggml's quantized mul_mat
// instead rounds the activations to the weight's 8-bit dot type, a ~1e-3 relative error on
// every logit that is enough to reorder near-tied selector candidates. CPU only.
void head_exact_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * w = dst->src[0];  // [H, V], any type
    const ggml_tensor * h = dst->src[1];  // [H, n] F32, contiguous
    const int64_t H = w->ne[0], V = w->ne[1], n = h->ne[1];
    const int64_t per_thread = (V + nth - 1) / nth;
    const int64_t v0 = per_thread * ith, v1 = std::min(V, v0 + per_thread);
    ggml_to_float_t to_float = w->type == GGML_TYPE_F32 ? nullptr : ggml_get_type_traits(w->type)->to_float;
    ggml_vec_dot_t dot = ggml_get_type_traits_cpu(GGML_TYPE_F32)->vec_dot;
    std::vector<float> row(to_float ? size_t(H) : 0);
    float * out = static_cast<float *>(dst->data);
    for (int64_t v = v0; v < v1; ++v) {
        const char * src = static_cast<const char *>(w->data) + v * w->nb[1];
        const float * wr = reinterpret_cast<const float *>(src);
        if (to_float) {
            to_float(src, row.data(), H);
            wr = row.data();
        }
        for (int64_t i = 0; i < n; ++i) {
            dot(int(H), out + i * V + v, 0, wr, 0, static_cast<const char *>(h->data) + i * h->nb[1], 0, 1);
        }
    }
}

ggml_tensor * build_head(ggml_context * ctx, ggml_tensor * w, ggml_tensor * h, bool exact) {
    if (!exact || w->type == GGML_TYPE_F32) {
        return ggml_mul_mat(ctx, w, h);
    }
    ggml_tensor * args[2] = {w, h};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], h->ne[1], 1, 1, args, 2, head_exact_op, GGML_N_TASKS_MAX, nullptr);
}

ggml_tensor * new_input(ggml_context * ctx, ggml_type type, int64_t ne0, int64_t ne1, const char * name) {
    ggml_tensor * t = ne1 > 0 ? ggml_new_tensor_2d(ctx, type, ne0, ne1) : ggml_new_tensor_1d(ctx, type, ne0);
    ggml_set_name(t, name);
    ggml_set_input(t);
    return t;
}

constexpr int kGraphSize = 4096;

}  // namespace

InjectGraph build_inject_graph(ggml_context * ctx, const DrafterHparams & hp, const DrafterWeights & w,
                               const DrafterCache & cache, int32_t n_past, int32_t n) {
    InjectGraph g;
    g.gf = ggml_new_graph_custom(ctx, kGraphSize, false);
    g.in.features  = new_input(ctx, GGML_TYPE_F32, hp.n_feat(), n, "features");
    g.in.positions = new_input(ctx, GGML_TYPE_I32, n, 0, "positions");

    ggml_tensor * cur = ggml_mul_mat(ctx, w.fc, g.in.features);
    cb(cur, "fc", -1);
    cur = build_norm(ctx, cur, w.enc_output_norm, hp.rms_eps);
    cb(cur, "hidden_norm", -1);

    for (int il = 0; il < hp.n_layer; ++il) {
        ggml_tensor * k, * v;
        build_kv(ctx, hp, w.layers[il], cur, g.in.positions, il, &k, &v);
        build_cache_store(ctx, g.gf, cache, il, k, v, n_past);
    }
    return g;
}

BlockGraph build_block_graph(ggml_context * ctx, const DrafterHparams & hp, const DrafterWeights & w,
                             const std::vector<const DrafterCache *> & caches, const std::vector<int32_t> & n_past,
                             int32_t n, bool exact_head) {
    BlockGraph g;
    const int64_t B = int64_t(caches.size()), N = int64_t(n) * B;
    g.gf = ggml_new_graph_custom(ctx, kGraphSize, false);
    g.in.tokens    = new_input(ctx, GGML_TYPE_I32, N, 0, "tokens");
    g.in.positions = new_input(ctx, GGML_TYPE_I32, N, 0, "positions");
    // only masks some layer reads: an input left out of the graph gets no buffer to be set
    bool any_swa = false, any_full = false;
    for (bool s : hp.swa_layers) {
        any_swa  = any_swa || s;
        any_full = any_full || !s;
    }
    for (int64_t i = 0; i < B; ++i) {  // one per block: each sees its own context
        g.masks_full.push_back(any_full ? new_input(ctx, GGML_TYPE_F32, n_past[size_t(i)] + n, n, "kq_mask") : nullptr);
        g.masks_swa.push_back(any_swa ? new_input(ctx, GGML_TYPE_F32, n_past[size_t(i)] + n, n, "kq_mask_swa") : nullptr);
    }

    // h^0 = E[x] * alpha (the target's raw embedding rows)
    ggml_tensor * inpL = ggml_get_rows(ctx, w.tok_embd, g.in.tokens);
    if (hp.embedding_scale != 1.0f) {
        inpL = ggml_scale(ctx, inpL, hp.embedding_scale);
    }
    cb(inpL, "inp_embd", -1);

    for (int il = 0; il < hp.n_layer; ++il) {
        const DrafterLayer & L = w.layers[il];
        const auto & kq_masks = hp.swa_layers[il] ? g.masks_swa : g.masks_full;

        ggml_tensor * cur = build_norm(ctx, inpL, L.attn_norm, hp.rms_eps);
        cb(cur, "attn_norm", il);
        ggml_tensor * coeff = nullptr;
        if (L.attn_conv_proj) {
            coeff = ggml_mul_mat(ctx, L.attn_conv_proj, cur);  // [2*T*G, n], both sides
            cur = build_conv(ctx, hp, cur, coeff, L.attn_conv_base, 0, n);
            cb(cur, "attn_conv_in", il);
        }
        cur = build_attention(ctx, g.gf, hp, L, caches, n_past, cur, g.in.positions, kq_masks, n, il);
        cb(cur, "attn_out", il);
        if (coeff) {
            cur = build_conv(ctx, hp, cur, coeff, L.attn_conv_base, 1, n);
            cb(cur, "attn_conv_out", il);
        }
        ggml_tensor * ffn_inp = ggml_add(ctx, cur, inpL);
        cb(ffn_inp, "ffn_inp", il);

        cur = build_norm(ctx, ffn_inp, L.ffn_norm, hp.rms_eps);
        cb(cur, "ffn_norm", il);
        if (L.ffn_conv_proj) {
            coeff = ggml_mul_mat(ctx, L.ffn_conv_proj, cur);
            cur = build_conv(ctx, hp, cur, coeff, L.ffn_conv_base, 0, n);
            cb(cur, "ffn_conv_in", il);
        }
        cur = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, L.ffn_gate, cur), ggml_mul_mat(ctx, L.ffn_up, cur));
        cur = ggml_mul_mat(ctx, L.ffn_down, cur);
        cb(cur, "ffn_out", il);
        if (L.ffn_conv_proj) {
            cur = build_conv(ctx, hp, cur, coeff, L.ffn_conv_base, 1, n);
            cb(cur, "ffn_conv_out", il);
        }
        inpL = ggml_add(ctx, cur, ffn_inp);
        cb(inpL, "l_out", il);
    }

    g.hidden = build_norm(ctx, inpL, w.output_norm, hp.rms_eps);
    cb(g.hidden, "result_norm", -1);
    ggml_set_output(g.hidden);
    ggml_build_forward_expand(g.gf, g.hidden);

    // z = mu * (W_out h); softcap c: z = c * tanh(z / c)
    ggml_tensor * logits = build_head(ctx, w.head(), g.hidden, exact_head);
    if (hp.logit_scale != 1.0f) {
        logits = ggml_scale(ctx, logits, hp.logit_scale);
    }
    if (hp.softcap > 0.0f) {
        logits = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / hp.softcap)), hp.softcap);
    }
    cb(logits, "result_output", -1);
    ggml_set_output(logits);
    ggml_build_forward_expand(g.gf, logits);
    g.logits = logits;

    if (w.selector_hidden) {
        g.projected = ggml_mul_mat(ctx, w.selector_hidden, g.hidden);  // [r, n]
        cb(g.projected, "selector_hidden", -1);
        ggml_set_output(g.projected);
        ggml_build_forward_expand(g.gf, g.projected);
    }
    return g;
}

}  // namespace dflash
