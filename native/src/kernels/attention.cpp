// Our FLASH_ATTN_EXT for verify batches and decode steps (attention.h): which ops we take, the
// runs of tokens and their visible positions, how the work is split over ggml's threads, the masks,
// and the merge of KV chunks.
//
// 1. Visible positions (all threads, one token each): from each token's mask row, where each of its
//    chunks of kAttnChunk visible positions starts, and whether the token before it sees a prefix
//    of what it sees (the rows are equal up to that token's last visible position).
// 2. Runs: consecutive tokens chained by that relation (one sequence's tokens in a batch). Every
//    thread derives the same runs from step 1.
// 3. Work units: (batch index i3, run, KV head, chunk of up to kAttnQueries queries, KV chunk), taken
//    dynamically. The queries of a run are its tokens x the g heads of the KV head, token-major. A
//    unit walks the positions visible to the run's last token (a superset of the others', with the
//    same order) in blocks of kAttnBlock of them; a position hidden from one query of the unit adds
//    exactly nothing to it. So a query's blocks and chunks are the ones it would have alone, at any
//    place in any cache.
// 4. Chunks merged in order per query (when a run has more than one).
#include "attention.h"

#include "kernels.h"

#include "ggml-cpu-impl.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

constexpr uint16_t kHiddenHalf = 0xFC00;  // fp16 -inf: a position the query does not see

struct Shape {
    int64_t D, N, n_head, n_kvh, g, n_kv, ne3;
    int64_t cmax;  // most chunks a token can have (all n_kv positions visible)
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
    s.cmax   = (s.n_kv + kAttnChunk - 1) / kAttnChunk;
    return s;
}

// A run of tokens [t0, t1] of batch index i3: nqc query chunks x C KV chunks per KV head, its units
// numbered from `first`.
struct Run {
    int32_t i3, t0, t1, nqc, C;
    int64_t first;
};

// The work buffer: per thread its float scratch (qt, kf, p, mask, alpha/m/l, o) and its copy of the
// runs; shared, the per-token chunk table of step 1 and the chunk partials (64-byte aligned parts).
struct Layout {
    size_t thr_floats;  // floats of one thread's scratch
    size_t thr_bytes;   // one thread's scratch and runs
    size_t info_ints;   // ints per token in the chunk table: joined, chunks, starts (chunks + 1)
    size_t info_bytes, part_bytes;
};

size_t round64(size_t n) { return (n + 63) & ~size_t(63); }

Layout layout_of(const Shape & s) {
    Layout L;
    L.thr_floats = size_t(kAttnQueries) * s.D + size_t(kAttnBlock) * s.D + 2 * kAttnBlock * kAttnQueries +
                   3 * kAttnQueries + size_t(kAttnQueries) * s.D;
    const size_t tokens = size_t(s.ne3 * s.N);
    L.thr_bytes  = round64(L.thr_floats * sizeof(float)) + round64(tokens * (sizeof(Run) + sizeof(int32_t)));
    L.info_ints  = size_t(s.cmax) + 3;
    L.info_bytes = round64(tokens * L.info_ints * sizeof(int32_t));
    L.part_bytes = s.cmax > 1 ? round64(tokens * s.n_head * s.cmax * (s.D + 2) * sizeof(float)) : 0;
    return L;
}

char * aligned(void * p) {
    return reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

const float kNegInf = -std::numeric_limits<float>::infinity();

// the mask of a block every query sees
alignas(64) const float kZeroMask[kAttnBlock * kAttnQueries] = {};

// llama.cpp's masks are 0 (visible) or -inf (hidden) almost everywhere: those without a call
inline float mask_value(uint16_t h) {
    return h == 0 ? 0.0f : h == kHiddenHalf ? kNegInf : half_to_float(h);
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
    if (q->ne[2] % k->ne[2] != 0 || q->ne[3] != k->ne[3]) return false;
    if (k->ne[1] > INT32_MAX / 2) return false;
    if (op->ne[0] != D || op->ne[1] != q->ne[2] || op->ne[2] != q->ne[1] || op->nb[0] != sizeof(float)) return false;
    if (op->nb[1] != D * int64_t(sizeof(float))) return false;
    if (mask) {
        // one mask for all heads (llama.cpp's): the runs of tokens are found per token
        if (mask->type != GGML_TYPE_F16 || mask->nb[0] != 2 || mask->ne[0] < k->ne[1] || mask->ne[1] < q->ne[1]) {
            return false;
        }
        if (mask->ne[2] != 1 || q->ne[3] % mask->ne[3] != 0) return false;
    }
    if (q->ne[1] < 1 || q->ne[1] > max_rows) return false;
    return block_fn() != nullptr;
}

size_t attn_work_size(int n_threads, const ggml_tensor * op) {
    const Layout L = layout_of(shape_of(op));
    return 64 + size_t(n_threads) * L.thr_bytes + L.info_bytes + L.part_bytes;
}

void attn_compute(const ggml_compute_params * params, ggml_tensor * op) {
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];
    const Shape         s    = shape_of(op);
    const Layout        L    = layout_of(s);
    const int64_t       D    = s.D;
    float               scale;
    std::memcpy(&scale, op->op_params, sizeof(float));
    AttnBlockFn fn = block_fn();
    if (!fn) fn = scalar::attn_block;  // the ISA was switched between plan and compute

    const int ith = params->ith, nth = params->nth;
    char *    base  = aligned(params->wdata);
    char *    mine_ = base + size_t(ith) * L.thr_bytes;
    int32_t * info  = reinterpret_cast<int32_t *>(base + size_t(nth) * L.thr_bytes);
    float *   partials = reinterpret_cast<float *>(base + size_t(nth) * L.thr_bytes + L.info_bytes);
    float *   qt       = reinterpret_cast<float *>(mine_);
    float *   kf       = qt + kAttnQueries * D;
    float *   p        = kf + kAttnBlock * D;
    float *   mbuf     = p + kAttnBlock * kAttnQueries;
    float *   alpha    = mbuf + kAttnBlock * kAttnQueries;
    float *   m        = alpha + kAttnQueries;
    float *   l        = m + kAttnQueries;
    float *   o        = l + kAttnQueries;
    Run *     runs     = reinterpret_cast<Run *>(mine_ + round64(L.thr_floats * sizeof(float)));
    const int64_t n_tok = s.ne3 * s.N;
    int32_t *     tok_chunks = reinterpret_cast<int32_t *>(runs + n_tok);  // C of each token's run

    auto mask_row = [&](int64_t i3, int64_t t) -> const uint16_t * {
        if (!mask) return nullptr;
        return reinterpret_cast<const uint16_t *>(static_cast<const char *>(mask->data) + t * mask->nb[1] +
                                                  (i3 % mask->ne[3]) * mask->nb[3]);
    };
    auto info_of = [&](int64_t x) { return info + size_t(x) * L.info_ints; };
    auto dst_row = [&](int64_t i3, int64_t h, int64_t t) {
        return reinterpret_cast<float *>(static_cast<char *>(op->data) +
                                         (i3 * op->ne[2] * op->ne[1] + h + t * op->ne[1]) * op->nb[1]);
    };
    auto part_of = [&](int64_t x, int64_t h, int64_t c) {
        return partials + ((size_t(x) * s.n_head + h) * s.cmax + c) * (D + 2);
    };

    if (ith == 0) ggml_threadpool_chunk_set(params->threadpool, nth);

    // 1. per token: [0] joined (the token before sees a prefix of what this one sees), [1] chunks C,
    //    [2 + c] the position its chunk c starts at, [2 + C] one past its last visible position
    for (int64_t x = ith; x < n_tok; x += nth) {
        const int64_t    i3 = x / s.N, t = x % s.N;
        const uint16_t * r  = mask_row(i3, t);
        int32_t *        in = info_of(x);
        int32_t *        st = in + 2;
        if (!r) {
            in[0] = t > 0;
            in[1] = int32_t(s.cmax);
            for (int64_t c = 0; c < s.cmax; ++c) st[c] = int32_t(c * kAttnChunk);
            st[s.cmax] = int32_t(s.n_kv);
            continue;
        }
        int64_t count = 0, last = -1;
        for (int64_t j = 0; j < s.n_kv; ++j) {
            if (r[j] == kHiddenHalf) continue;
            if (count % kAttnChunk == 0) st[count / kAttnChunk] = int32_t(j);
            ++count;
            last = j;
        }
        const int64_t C = (count + kAttnChunk - 1) / kAttnChunk;
        in[1]           = int32_t(C);
        st[C]           = int32_t(last + 1);
        in[0]           = 0;
        if (t > 0) {
            const uint16_t * prev = mask_row(i3, t - 1);
            int64_t          e    = s.n_kv - 1;
            while (e >= 0 && prev[e] == kHiddenHalf) --e;
            in[0] = std::memcmp(prev, r, size_t(e + 1) * sizeof(uint16_t)) == 0;
        }
    }
    ggml_barrier(params->threadpool);

    // 2. the runs (every thread the same)
    int64_t n_runs = 0, n_units = 0;
    for (int64_t x = 0; x < n_tok; ++x) {
        const int64_t i3 = x / s.N, t = x % s.N;
        if (t == 0 || !info_of(x)[0]) {
            runs[n_runs++] = Run{int32_t(i3), int32_t(t), int32_t(t), 0, 0, 0};
        } else {
            runs[n_runs - 1].t1 = int32_t(t);
        }
    }
    for (int64_t r = 0; r < n_runs; ++r) {
        Run & R  = runs[r];
        R.nqc    = int32_t((s.g * (R.t1 - R.t0 + 1) + kAttnQueries - 1) / kAttnQueries);
        R.C      = std::max<int32_t>(1, info_of(R.i3 * s.N + R.t1)[1]);  // one (empty) chunk when nothing is visible
        R.first  = n_units;
        n_units += s.n_kvh * R.nqc * R.C;
        for (int32_t t = R.t0; t <= R.t1; ++t) tok_chunks[R.i3 * s.N + t] = R.C;
    }

    // 3. the units
    const uint16_t * kp[kAttnBlock];
    const uint16_t * vp[kAttnBlock];
    int32_t          idx[kAttnBlock];
    int64_t          ri = 0;
    for (int64_t u = ith; u < n_units; u = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        while (ri + 1 < n_runs && runs[ri + 1].first <= u) ++ri;  // u grows in each thread
        const Run &   R   = runs[ri];
        const int64_t w   = u - R.first;
        const int64_t c   = w % R.C, qc = (w / R.C) % R.nqc, kvh = w / (int64_t(R.C) * R.nqc);
        const int64_t i3  = R.i3;
        const int64_t gq  = s.g * (R.t1 - R.t0 + 1);
        const int64_t qi0 = qc * kAttnQueries;
        const int     nq  = int(std::min<int64_t>(kAttnQueries, gq - qi0));
        const int     qp  = nq > 8 ? 16 : 8;

        const uint16_t * mrow[kAttnQueries] = {};
        std::fill(qt, qt + qp * D, 0.0f);
        for (int i = 0; i < nq; ++i) {
            const int64_t t = R.t0 + (qi0 + i) / s.g, h = kvh * s.g + (qi0 + i) % s.g;
            const float * qr = reinterpret_cast<const float *>(static_cast<const char *>(q->data) + t * q->nb[1] +
                                                               h * q->nb[2] + i3 * q->nb[3]);
            for (int64_t d = 0; d < D; ++d) qt[d * qp + i] = qr[d];
            mrow[i] = mask_row(i3, t);
        }
        std::fill(m, m + qp, kNegInf);
        std::fill(l, l + qp, 0.0f);
        std::fill(o, o + nq * D, 0.0f);

        AttnBlockArgs a;
        a.qt    = qt;
        a.qp    = qp;
        a.nq    = nq;
        a.D     = int(D);
        a.k     = kp;
        a.v     = vp;
        a.scale = scale;
        a.kf    = kf;
        a.p     = p;
        a.alpha = alpha;
        a.m     = m;
        a.l     = l;
        a.o     = o;
        const char * kb = static_cast<const char *>(k->data) + kvh * k->nb[2] + i3 * k->nb[3];
        const char * vb = static_cast<const char *>(v->data) + kvh * v->nb[2] + i3 * v->nb[3];

        auto run_block = [&](int nj) {
            for (int jj = 0; jj < nj; ++jj) {
                kp[jj] = reinterpret_cast<const uint16_t *>(kb + idx[jj] * k->nb[1]);
                vp[jj] = reinterpret_cast<const uint16_t *>(vb + idx[jj] * v->nb[1]);
            }
            // most blocks are visible to every query of the unit: look at each token's mask row
            // once (the lanes of one token share it) before filling lanes
            bool visible = true;
            for (int i = 0; i < nq && mask && visible; ++i) {
                if (i > 0 && mrow[i] == mrow[i - 1]) continue;
                for (int jj = 0; jj < nj; ++jj) visible &= mrow[i][idx[jj]] == 0;
            }
            if (!visible) {
                for (int jj = 0; jj < nj; ++jj) {
                    float * mr = mbuf + jj * qp;
                    for (int i = 0; i < nq; ++i) mr[i] = mask_value(mrow[i][idx[jj]]);
                    for (int i = nq; i < qp; ++i) mr[i] = 0.0f;
                }
            }
            a.mask = visible ? kZeroMask : mbuf;
            a.nj   = nj;
            fn(a);
        };

        // the positions the run's last token sees, from its chunk c on (its superset of the others')
        const uint16_t * rmax = mask_row(i3, R.t1);
        const int32_t *  in   = info_of(i3 * s.N + R.t1);
        if (c < in[1]) {
            const int64_t j_end = in[2 + c + 1];
            int           nj    = 0;
            for (int64_t j = in[2 + c]; j < j_end; ++j) {
                if (rmax && rmax[j] == kHiddenHalf) continue;
                idx[nj++] = int32_t(j);
                if (nj == kAttnBlock) {
                    run_block(nj);
                    nj = 0;
                }
            }
            if (nj > 0) run_block(nj);
        }

        for (int i = 0; i < nq; ++i) {
            const int64_t t = R.t0 + (qi0 + i) / s.g, h = kvh * s.g + (qi0 + i) % s.g;
            if (R.C == 1) {
                const float inv = l[i] == 0.0f ? 0.0f : 1.0f / l[i];
                float *     y   = dst_row(i3, h, t);
                for (int64_t d = 0; d < D; ++d) y[d] = o[i * D + d] * inv;
            } else {
                float * part = part_of(i3 * s.N + t, h, c);
                part[0]      = m[i];
                part[1]      = l[i];
                std::memcpy(part + 2, o + i * D, D * sizeof(float));
            }
        }
    }
    if (s.cmax == 1) return;

    // 4. merge the KV chunks of each query, in chunk order (chunks a token does not reach hold
    //    m = -inf, l = 0, o = 0 and add exactly nothing; one chunk gives the bits of C == 1)
    ggml_barrier(params->threadpool);
    for (int64_t r = ith; r < n_tok * s.n_head; r += nth) {
        const int64_t x = r / s.n_head, h = r % s.n_head;
        const int64_t C = tok_chunks[x];
        if (C == 1) continue;
        float mx = kNegInf;
        for (int64_t c = 0; c < C; ++c) mx = std::fmax(mx, part_of(x, h, c)[0]);
        const float ms = mx == kNegInf ? 0.0f : mx;
        float *     y  = dst_row(x / s.N, h, x % s.N);
        std::fill(y, y + D, 0.0f);
        float sum = 0.0f;
        for (int64_t c = 0; c < C; ++c) {
            const float * pc = part_of(x, h, c);
            const float   w  = attn_exp(pc[0] - ms);
            sum += pc[1] * w;
            for (int64_t d = 0; d < D; ++d) y[d] += pc[2 + d] * w;
        }
        const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) y[d] *= inv;
    }
}

}  // namespace dflash::kern
