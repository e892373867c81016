// Our FLASH_ATTN_EXT for verify batches and decode steps (attention.h): which ops we take, how the
// work is split over ggml's threads, the masks, and the merge of KV chunks.
//
// Work units: (batch index i3, KV head, chunk of up to kAttnQueries queries, KV chunk). The
// queries of a KV head are its g heads x the N tokens, token-major. KV chunks are fixed runs of
// KC positions (KC depends only on the size of the KV cache, never on the batch or on n_kv), so a
// long context spreads over all threads even at one token, and a query's arithmetic does not
// depend on how many tokens share its batch: a chunk or block that is fully masked for it adds
// exactly nothing.
#include "attention.h"

#include "kernels.h"

#include "ggml-cpu-impl.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace dflash::kern {

namespace {

AttnBlockFn block_fn() {
    switch (active_isa()) {
        case Isa::scalar: return scalar::attn_block;
#if defined(__x86_64__) || defined(_M_X64)
        case Isa::avx2:
        case Isa::avx512: return avx2::attn_block;  // the AVX2 kernel runs on AVX-512 machines too
#endif
        default: return nullptr;  // NEON: ggml's own attention
    }
}

struct Shape {
    int64_t D, N, n_head, n_kvh, g, n_kv, ne3, rk3;
    int64_t nqc;    // query chunks per KV head
    int64_t kc, C;  // KV chunk length and count
    int64_t units;
};

Shape shape_of(const ggml_tensor * op) {
    const ggml_tensor * q = op->src[0];
    const ggml_tensor * k = op->src[1];
    Shape               s;
    s.D      = k->ne[0];
    s.N      = q->ne[1];
    s.n_head = q->ne[2];
    s.n_kvh  = k->ne[2];
    s.g      = s.n_head / s.n_kvh;
    s.n_kv   = k->ne[1];
    s.ne3    = q->ne[3];
    s.rk3    = q->ne[3] / k->ne[3];
    s.nqc    = (s.g * s.N + kAttnQueries - 1) / kAttnQueries;
    // positions the cache holds (k is a view of it): chunks of 256 positions, at most ~16 for a
    // full cache; one token's attention spreads over up to 16 x n_kv_heads threads, and short
    // chunks keep the threads evenly busy when the KV heads do not split evenly over them
    // (SmolLM2: 3 KV heads on 2 threads)
    const int64_t cap = k->view_src ? int64_t(ggml_nbytes(k->view_src) / k->nb[1]) : s.n_kv;
    const int64_t kc  = ((cap + 15) / 16 + kAttnBlock - 1) / kAttnBlock * kAttnBlock;
    s.kc              = std::max<int64_t>(256, kc);
    s.C               = (s.n_kv + s.kc - 1) / s.kc;
    s.units           = s.ne3 * s.n_kvh * s.nqc * s.C;
    return s;
}

// floats of one thread's scratch: qt, kf, p, mask, alpha/m/l, o (64-byte multiples)
int64_t per_thread_floats(int64_t D) {
    const int64_t n = int64_t(kAttnQueries) * D + int64_t(kAttnBlock) * D + 2 * kAttnBlock * kAttnQueries +
                      3 * kAttnQueries + int64_t(kAttnQueries) * D;
    return (n + 15) & ~int64_t(15);
}

float * aligned(void * p) {
    return reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

const float kNegInf = -std::numeric_limits<float>::infinity();

// the mask of a block every query sees
alignas(64) const float kZeroMask[kAttnBlock * kAttnQueries] = {};

// llama.cpp's masks are 0 (visible) or -inf (hidden) almost everywhere: those without a call
inline float mask_value(uint16_t h) {
    return h == 0 ? 0.0f : h == 0xFC00 ? kNegInf : half_to_float(h);
}

}  // namespace

bool attn_shape_covered(const ggml_tensor * op, int max_rows) {
    if (op->op != GGML_OP_FLASH_ATTN_EXT) return false;
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];
    if (!q || !k || !v || op->src[4]) return false;  // src[4]: attention sinks
    if (q->type != GGML_TYPE_F32 || k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16 || op->type != GGML_TYPE_F32) {
        return false;
    }
    float max_bias, softcap;
    std::memcpy(&max_bias, reinterpret_cast<const float *>(op->op_params) + 1, sizeof(float));
    std::memcpy(&softcap, reinterpret_cast<const float *>(op->op_params) + 2, sizeof(float));
    if (max_bias != 0.0f || softcap != 0.0f) return false;
    const int64_t D = k->ne[0];
    if (v->ne[0] != D || q->ne[0] != D || D % 8 != 0 || D > 256) return false;
    if (q->nb[0] != sizeof(float) || k->nb[0] != 2 || v->nb[0] != 2 || k->nb[1] % 2 || v->nb[1] % 2) return false;
    if (k->ne[1] != v->ne[1] || k->ne[2] != v->ne[2] || k->ne[3] != v->ne[3] || k->ne[1] < 1) return false;
    if (q->ne[2] % k->ne[2] != 0 || q->ne[3] % k->ne[3] != 0) return false;
    if (op->ne[0] != D || op->ne[1] != q->ne[2] || op->ne[2] != q->ne[1] || op->nb[0] != sizeof(float)) return false;
    if (op->nb[1] != D * int64_t(sizeof(float))) return false;
    if (mask) {
        if (mask->type != GGML_TYPE_F16 || mask->nb[0] != 2 || mask->ne[0] < k->ne[1] || mask->ne[1] < q->ne[1]) {
            return false;
        }
        if (q->ne[2] % mask->ne[2] != 0 || q->ne[3] % mask->ne[3] != 0) return false;
    }
    if (q->ne[1] < 1 || q->ne[1] > max_rows) return false;
    return block_fn() != nullptr;
}

size_t attn_work_size(int n_threads, const ggml_tensor * op) {
    const Shape   s        = shape_of(op);
    const int64_t partials = s.C > 1 ? s.units * kAttnQueries * (s.D + 2) : 0;
    return 64 + sizeof(float) * size_t(n_threads * per_thread_floats(s.D) + partials);
}

void attn_compute(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];
    const Shape         s    = shape_of(op);
    const int64_t       D    = s.D;
    float               scale;
    std::memcpy(&scale, op->op_params, sizeof(float));
    AttnBlockFn fn = block_fn();
    if (!fn) fn = scalar::attn_block;  // the ISA was switched between plan and compute

    const int ith = params->ith, nth = params->nth;
    float *   base     = aligned(params->wdata);
    float *   mine     = base + ith * per_thread_floats(D);
    float *   partials = base + nth * per_thread_floats(D);
    float *   qt       = mine;
    float *   kf       = qt + kAttnQueries * D;
    float *   p        = kf + kAttnBlock * D;
    float *   mbuf     = p + kAttnBlock * kAttnQueries;
    float *   alpha    = mbuf + kAttnBlock * kAttnQueries;
    float *   m        = alpha + kAttnQueries;
    float *   l        = m + kAttnQueries;
    float *   o        = l + kAttnQueries;
    const int64_t gn   = s.g * s.N;

    auto dst_row = [&](int64_t i3, int64_t h, int64_t t) {
        return reinterpret_cast<float *>(static_cast<char *>(op->data) +
                                         (i3 * op->ne[2] * op->ne[1] + h + t * op->ne[1]) * op->nb[1]);
    };

    if (ith == 0) ggml_threadpool_chunk_set(params->threadpool, nth);
    ggml_barrier(params->threadpool);

    for (int64_t u = ith; u < s.units; u = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t c = u % s.C, qc = (u / s.C) % s.nqc, kvh = (u / (s.C * s.nqc)) % s.n_kvh;
        const int64_t i3 = u / (s.C * s.nqc * s.n_kvh);
        const int64_t qi0 = qc * kAttnQueries;
        const int     nq  = int(std::min<int64_t>(kAttnQueries, gn - qi0));
        const int     qp  = nq > 8 ? 16 : 8;

        const uint16_t * mrow[kAttnQueries] = {};
        std::fill(qt, qt + qp * D, 0.0f);
        for (int i = 0; i < nq; ++i) {
            const int64_t t = (qi0 + i) / s.g, h = kvh * s.g + (qi0 + i) % s.g;
            const float * qr = reinterpret_cast<const float *>(static_cast<const char *>(q->data) + t * q->nb[1] +
                                                               h * q->nb[2] + i3 * q->nb[3]);
            for (int64_t d = 0; d < D; ++d) qt[d * qp + i] = qr[d];
            if (mask) {
                mrow[i] = reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + t * mask->nb[1] +
                                                             (h % mask->ne[2]) * mask->nb[2] +
                                                             (i3 % mask->ne[3]) * mask->nb[3]);
            }
        }
        std::fill(m, m + qp, kNegInf);
        std::fill(l, l + qp, 0.0f);
        std::fill(o, o + nq * D, 0.0f);

        const int64_t ik3 = i3 / s.rk3;
        AttnBlockArgs a;
        a.qt       = qt;
        a.qp       = qp;
        a.nq       = nq;
        a.D        = int(D);
        a.k_stride = k->nb[1] / 2;
        a.v_stride = v->nb[1] / 2;
        a.scale    = scale;
        a.kf       = kf;
        a.p        = p;
        a.alpha    = alpha;
        a.m        = m;
        a.l        = l;
        a.o        = o;
        const char * kb = static_cast<const char *>(k->data) + kvh * k->nb[2] + ik3 * k->nb[3];
        const char * vb = static_cast<const char *>(v->data) + kvh * v->nb[2] + ik3 * v->nb[3];
        const int64_t j_end = std::min(s.n_kv, (c + 1) * s.kc);
        for (int64_t j0 = c * s.kc; j0 < j_end; j0 += kAttnBlock) {
            const int nj = int(std::min<int64_t>(kAttnBlock, j_end - j0));
            // most blocks are visible to (or hidden from) every query of the unit: look at each
            // token's mask row once (lanes of one token share it) before filling lanes
            bool visible = true, hidden = true;
            for (int i = 0; i < nq && mask && (visible || hidden); ++i) {
                if (i > 0 && mrow[i] == mrow[i - 1]) continue;
                const uint16_t * r = mrow[i] + j0;
                for (int jj = 0; jj < nj; ++jj) {
                    visible &= r[jj] == 0;
                    hidden &= r[jj] == 0xFC00;
                }
            }
            if (mask && hidden) continue;  // masked for every query here: adds exactly nothing
            if (mask && !visible) {
                for (int jj = 0; jj < nj; ++jj) {
                    float * mr = mbuf + jj * qp;
                    for (int i = 0; i < nq; ++i) mr[i] = mask_value(mrow[i][j0 + jj]);
                    for (int i = nq; i < qp; ++i) mr[i] = 0.0f;
                }
            }
            a.mask = visible ? kZeroMask : mbuf;
            a.nj   = nj;
            a.k  = reinterpret_cast<const uint16_t *>(kb + j0 * k->nb[1]);
            a.v  = reinterpret_cast<const uint16_t *>(vb + j0 * v->nb[1]);
            fn(a);
        }

        for (int i = 0; i < nq; ++i) {
            const int64_t t = (qi0 + i) / s.g, h = kvh * s.g + (qi0 + i) % s.g;
            if (s.C == 1) {
                const float inv = l[i] == 0.0f ? 0.0f : 1.0f / l[i];
                float *     y   = dst_row(i3, h, t);
                for (int64_t d = 0; d < D; ++d) y[d] = o[i * D + d] * inv;
            } else {
                float * part = partials + (u * kAttnQueries + i) * (D + 2);
                part[0]      = m[i];
                part[1]      = l[i];
                std::memcpy(part + 2, o + i * D, D * sizeof(float));
            }
        }
    }
    if (s.C == 1) return;

    // merge the KV chunks of each query, in chunk order
    ggml_barrier(params->threadpool);
    for (int64_t r = ith; r < s.ne3 * s.n_head * s.N; r += nth) {
        const int64_t t = r % s.N, h = (r / s.N) % s.n_head, i3 = r / (s.N * s.n_head);
        const int64_t kvh = h / s.g, qi = t * s.g + h % s.g;
        const int64_t u0  = ((i3 * s.n_kvh + kvh) * s.nqc + qi / kAttnQueries) * s.C;
        auto          part = [&](int64_t c) { return partials + ((u0 + c) * kAttnQueries + qi % kAttnQueries) * (D + 2); };
        float         mx   = kNegInf;
        for (int64_t c = 0; c < s.C; ++c) mx = std::fmax(mx, part(c)[0]);
        const float ms = mx == kNegInf ? 0.0f : mx;
        float *     y  = dst_row(i3, h, t);
        std::fill(y, y + D, 0.0f);
        float sum = 0.0f;
        for (int64_t c = 0; c < s.C; ++c) {
            const float * pc = part(c);
            const float   w  = attn_exp(pc[0] - ms);
            sum += pc[1] * w;
            for (int64_t d = 0; d < D; ++d) y[d] += pc[2 + d] * w;
        }
        const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) y[d] *= inv;
    }
}

}  // namespace dflash::kern
