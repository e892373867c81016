// K-quants (Q4_K, Q5_K, Q6_K), AVX2 + FMA + F16C path (chosen at run time by dispatch.cpp; this
// file is compiled with per-function target attributes, so the baseline build needs no flags).
//
// Per weight row and super-block: decode the scales/mins once, derive each 32-quant vector once
// per group of up to 8 activation rows (straight from the block, in registers), and run the
// group's rows over it:
//   int32 lanes += madd16(maddubs(w_u8, a_s8), scale16)        (3 ops per 32 weights and row)
// The float work (scale d*d_a, the mins / Q6_K's -32 offset via the activation's 16-sums) happens
// once per super-block and row. Rows are taken in groups of up to 8 (register budget).
#include "kernels.h"

#include <immintrin.h>

#include <cstring>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "avx2_common.h"

namespace dflash::kern::avx2 {

namespace {

enum class KQ { q4, q5, q6 };

// Per super-block state shared by all activation rows: integer scales, the mins (Q4_K/Q5_K) or
// -32*scale (Q6_K) per 16-element activation group, the float scales. Written with vector
// stores only (many small stores followed by one wide load would stall store forwarding).
struct alignas(32) Head {
    alignas(32) int16_t sc[16];    // Q4_K/Q5_K: 8 scales (per 32); Q6_K: 16 scales (per 16)
    alignas(32) int16_t mexp[16];  // per 16-group multiplier of the activation's 16-sums
    float           d, dmin;
    const uint8_t * blk;
    __m256i         qh;            // Q5_K: the high-bit bytes
};

// The 12 scale bytes of Q4_K/Q5_K -> 8 scales and 8 mins, with 32-bit word operations.
inline void kq_scales(const uint8_t * s, Head & h) {
    uint64_t sc8, m8;
    kq_scale_min_bytes(s, sc8, m8);
    const __m128i scv = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8)));
    const __m128i mv  = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(m8)));
    _mm_store_si128(reinterpret_cast<__m128i *>(h.sc), scv);
    _mm256_store_si256(reinterpret_cast<__m256i *>(h.mexp),
                       _mm256_set_m128i(_mm_unpackhi_epi16(mv, mv), _mm_unpacklo_epi16(mv, mv)));
}

template <KQ k>
inline void head(const uint8_t * blk, Head & h) {
    h.blk = blk;
    if constexpr (k == KQ::q6) {
        h.d    = h2f(blk + 208);
        h.dmin = 0.0f;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 192)));
        _mm256_store_si256(reinterpret_cast<__m256i *>(h.sc), sc16);
        _mm256_store_si256(reinterpret_cast<__m256i *>(h.mexp), _mm256_mullo_epi16(sc16, _mm256_set1_epi16(-32)));
        // sub-block c covers scales 2c (low 128 bits) and 2c+1 (high 128 bits)
    } else {
        h.d    = h2f(blk);
        h.dmin = h2f(blk + 2);
        kq_scales(blk + 4, h);
        if constexpr (k == KQ::q5) h.qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16));
    }
}

// The 32 unsigned quants of sub-block c (elements 32c .. 32c+31), straight from the block.
template <KQ k>
inline __m256i wvec(const Head & h, int c) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if constexpr (k == KQ::q6) {
        const int     hh = c >> 2, g = c & 3;
        const __m256i l  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(h.blk + 64 * hh + 32 * (g & 1)));
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(h.blk + 128 + 32 * hh));
        const __m256i m2 = _mm256_set1_epi8(0x30);
        const __m256i lo = (g >> 1) ? _mm256_and_si256(_mm256_srli_epi16(l, 4), m4) : _mm256_and_si256(l, m4);
        __m256i       hi;
        switch (g) {
            case 0: hi = _mm256_and_si256(_mm256_slli_epi16(qv, 4), m2); break;
            case 1: hi = _mm256_and_si256(_mm256_slli_epi16(qv, 2), m2); break;
            case 2: hi = _mm256_and_si256(qv, m2); break;
            default: hi = _mm256_and_si256(_mm256_srli_epi16(qv, 2), m2); break;
        }
        return _mm256_or_si256(lo, hi);
    } else {
        const uint8_t * qs = h.blk + (k == KQ::q4 ? 16 : 48);
        const __m256i   qv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * (c >> 1)));
        __m256i w = (c & 1) ? _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4) : _mm256_and_si256(qv, m4);
        if constexpr (k == KQ::q5) {
            const __m256i bit = _mm256_set1_epi8(char(1 << c));
            w = _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h.qh, bit), bit),
                                                    _mm256_set1_epi8(0x10)));
        }
        return w;
    }
}

// G activation rows against one weight row, block by block:
//   int32 lanes += madd16(maddubs(w, a), scale)          per 32 weights and row (3 ops)
//   acc += float(lanes) * (d_w * d_a)                     per block and row
// Q6_K's -32 offset goes into the integer sum through the activation's 16-sums (madd with
// -32*scale). Q4_K/Q5_K's mins do not touch the block loop: they are
//   sum_{b,s} (dmin_b * m_bs) * (d_a,b * sum_32(q_a))     one float dot of K/32 terms per row
// with the weight side collected in wmin[] during the loop.
template <int G, int kBlockBytes, KQ k>
inline void group_rows(const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K, float * wmin,
                       float * out, Head & h, __m256 * accf) {
    // accf and h live in the caller's memory: with 8 rows the integer sums take the registers
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) accf[g] = _mm256_setzero_ps();
    const int64_t bs_off = K + (K / 256) * 4;
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_ahead<kBlockBytes>(wr + b * kBlockBytes);
        head<k>(wr + b * kBlockBytes, h);
        if constexpr (k != KQ::q6) {
            // mins (odd entries of mexp, int16) -> dmin * m as 8 floats
            const __m256i m16 = _mm256_load_si256(reinterpret_cast<const __m256i *>(h.mexp));
            const __m256i m32 = _mm256_srli_epi32(m16, 16);  // the duplicated entries, as int32
            _mm256_storeu_ps(wmin + b * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(m32), _mm256_set1_ps(h.dmin)));
        }
        __m256i isum[G];
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) isum[g] = _mm256_setzero_si256();
        const size_t qoff = size_t(b) * 256;
        DFLASH_UNROLL
        for (int c = 0; c < 8; ++c) {
            const __m256i w = wvec<k>(h, c);
            __m256i       s;
            if constexpr (k == KQ::q6) {
                s = _mm256_set_m128i(_mm_set1_epi16(h.sc[2 * c + 1]), _mm_set1_epi16(h.sc[2 * c]));
            } else {
                s = _mm256_set1_epi16(h.sc[c]);
            }
            DFLASH_UNROLL
            for (int g = 0; g < G; ++g) {
                const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow[g] + qoff + 32 * c));
                isum[g]         = _mm256_add_epi32(isum[g], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), s));
                // keep each row's sum in its register: without this gcc adds the products of two
                // sub-blocks first and spills the sums (20-30% slower at 8 rows)
                DFLASH_PIN(isum[g]);
            }
        }
        const __m256 dv = _mm256_set1_ps(h.d);
        if constexpr (k == KQ::q6) {
            const __m256i mexp = _mm256_load_si256(reinterpret_cast<const __m256i *>(h.mexp));
            DFLASH_UNROLL
            for (int g = 0; g < G; ++g) {
                const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow[g] + bs_off + b * 32));
                isum[g]           = _mm256_add_epi32(isum[g], _mm256_madd_epi16(bsv, mexp));
            }
        }
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) {
            const __m256 da = _mm256_broadcast_ss(reinterpret_cast<const float *>(arow[g] + K) + b);
            accf[g]         = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[g]), _mm256_mul_ps(dv, da), accf[g]);
        }
    }
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        float r = hsum8(accf[g]);
        if constexpr (k != KQ::q6) {
            const float * ds = reinterpret_cast<const float *>(arow[g] + bs_off + (K / 16) * 2);
            __m256        m  = _mm256_setzero_ps();
            for (int64_t i = 0; i < nb * 8; i += 8) {
                m = _mm256_fmadd_ps(_mm256_loadu_ps(wmin + i), _mm256_loadu_ps(ds + i), m);
            }
            r -= hsum8(m);
        }
        out[g] = r;
    }
}

// byte shuffle that puts 16-bit word c of each 128-bit lane into all 8 words of that lane
struct Pick {
    alignas(32) int8_t m[8][32];
    constexpr Pick() : m() {
        for (int c = 0; c < 8; ++c) {
            for (int i = 0; i < 32; ++i) m[c][i] = int8_t(2 * c + (i & 1));
        }
    }
};
constexpr Pick kPick;

inline __m256i pick(__m256i sc, int c) {
    return _mm256_shuffle_epi8(sc, _mm256_load_si256(reinterpret_cast<const __m256i *>(kPick.m[c])));
}

// One activation row (a plain decode step): the same integer lane sums and the same float steps
// as group_rows<1>, so a row's result does not depend on the batch it came in, but with the
// scales kept in registers (one shuffle per sub-block instead of a store and a broadcast load)
// and two independent integer sums per block.
template <int kBlockBytes, KQ k>
inline void one_row(const uint8_t * wr, int64_t nb, const uint8_t * arow, int64_t K, float * wmin, float * out) {
    const __m256i m4     = _mm256_set1_epi8(0x0F);
    const int64_t bs_off = K + (K / 256) * 4;
    const float * da     = reinterpret_cast<const float *>(arow + K);
    __m256        accf   = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t * blk = wr + b * kBlockBytes;
        prefetch_ahead<kBlockBytes>(blk);
        const int8_t *  a   = reinterpret_cast<const int8_t *>(arow) + b * 256;
        __m256i         s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        float           d;
        auto dot = [&](__m256i & acc, __m256i w, __m256i sc, int c) {
            const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a + 32 * c));
            acc              = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, av), sc));
        };
        if constexpr (k == KQ::q6) {
            d                 = h2f(blk + 208);
            const __m128i b8  = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 192));
            // even scales in the low lane, odd in the high: pick(c) = (scale 2c | scale 2c+1)
            const __m256i sc  = _mm256_cvtepi8_epi16(
                _mm_shuffle_epi8(b8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
            const __m256i m2  = _mm256_set1_epi8(0x30);
            DFLASH_UNROLL
            for (int hh = 0; hh < 2; ++hh) {
                const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * hh));
                const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * hh + 32));
                const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 128 + 32 * hh));
                const int     c  = 4 * hh;
                dot(s0, _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qv, 4), m2)),
                    pick(sc, c), c);
                dot(s1, _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qv, 2), m2)),
                    pick(sc, c + 1), c + 1);
                dot(s0, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qv, m2)),
                    pick(sc, c + 2), c + 2);
                dot(s1,
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                    _mm256_and_si256(_mm256_srli_epi16(qv, 2), m2)),
                    pick(sc, c + 3), c + 3);
            }
            const __m256i mexp = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(b8), _mm256_set1_epi16(-32));
            const __m256i bsv  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow + bs_off + b * 32));
            s0                 = _mm256_add_epi32(s0, _mm256_madd_epi16(bsv, mexp));
        } else {
            d                    = h2f(blk);
            const float     dmin = h2f(blk + 2);
            uint64_t        sc8, m8;
            kq_scale_min_bytes(blk + 4, sc8, m8);
            _mm256_storeu_ps(wmin + b * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m8)))),
                                                         _mm256_set1_ps(dmin)));
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8))));
            const uint8_t * qs = blk + (k == KQ::q4 ? 16 : 48);
            __m256i         qh = _mm256_setzero_si256();
            if constexpr (k == KQ::q5) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16));
            DFLASH_UNROLL
            for (int p = 0; p < 4; ++p) {
                const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * p));
                __m256i       lo = _mm256_and_si256(qv, m4);
                __m256i       hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
                if constexpr (k == KQ::q5) {
                    const __m256i b0 = _mm256_set1_epi8(char(1 << (2 * p)));
                    const __m256i b1 = _mm256_set1_epi8(char(1 << (2 * p + 1)));
                    const __m256i x10 = _mm256_set1_epi8(0x10);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), x10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), x10));
                }
                dot(s0, lo, pick(sc, 2 * p), 2 * p);
                dot(s1, hi, pick(sc, 2 * p + 1), 2 * p + 1);
            }
        }
        const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_broadcast_ss(da + b));
        accf            = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), dd, accf);
    }
    float r = hsum8(accf);
    if constexpr (k != KQ::q6) {
        const float * ds = reinterpret_cast<const float *>(arow + bs_off + (K / 16) * 2);
        __m256        m  = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb * 8; i += 8) {
            m = _mm256_fmadd_ps(_mm256_loadu_ps(wmin + i), _mm256_loadu_ps(ds + i), m);
        }
        r -= hsum8(m);
    }
    *out = r;
}

template <int kBlockBytes, KQ k>
inline void group_dispatch(int G, const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K,
                           float * wmin, float * out, Head & h, __m256 * accf) {
    switch (G) {
        case 1: one_row<kBlockBytes, k>(wr, nb, arow[0], K, wmin, out); break;
        case 2: group_rows<2, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
        case 3: group_rows<3, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
        case 4: group_rows<4, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
        case 5: group_rows<5, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
        case 6: group_rows<6, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
        case 7: group_rows<7, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
        default: group_rows<8, kBlockBytes, k>(wr, nb, arow, K, wmin, out, h, accf); break;
    }
}

#ifndef DFLASH_KQ_GROUP
#define DFLASH_KQ_GROUP 8
#endif
constexpr int kGroup = DFLASH_KQ_GROUP;

template <int kBlockBytes, KQ k>
void matmul_kq(const MatMulArgs & A) {
    const int64_t   nb = A.K / 256;
    const uint8_t * arow[kMaxRows];
    for (int j = 0; j < A.n; ++j) arow[j] = A.a + j * A.a_row_bytes;
    // split the rows into groups of at most kGroup, as even as possible (16 -> 8+8, 12 -> 6+6)
    const int n_groups = (A.n + kGroup - 1) / kGroup;
    float     wmin_small[512];
    float *   wmin = wmin_small;
    float *   wmin_big = nullptr;
    if (nb * 8 > 512) wmin = wmin_big = new float[size_t(nb) * 8];
    float  out[kMaxRows];
    Head   h;
    __m256 accf[kGroup];
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        int             j0 = 0;
        for (int gi = 0; gi < n_groups; ++gi) {
            const int G = (A.n - j0) / (n_groups - gi);
            group_dispatch<kBlockBytes, k>(G, wr, nb, arow + j0, A.K, wmin, out + j0, h, accf);
            j0 += G;
        }
        for (int j = 0; j < A.n; ++j) A.c[j * A.c_row_floats + r] = out[j];
    }
    delete[] wmin_big;
}

inline __m256 abs_ps(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m        = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m        = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// 32 floats -> 32 int8 (RNE, as the scalar path), element order kept
inline __m256i quant32(const float * x, __m256 id) {
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 0), id));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    const __m256i p  = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    // packs work per 128-bit lane: dwords come out as 0 2 4 6 1 3 5 7 (in units of 4 elements)
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

}  // namespace

void quantize_a256(const float * x, uint8_t * row, int64_t K) {
    A256View v = a256_view(row, K);
    for (int64_t b = 0; b < K / 256; ++b) {
        const float * xb = x + b * 256;
        __m256        mx = _mm256_setzero_ps();
        for (int i = 0; i < 256; i += 8) mx = _mm256_max_ps(mx, abs_ps(_mm256_loadu_ps(xb + i)));
        const float amax = hmax8(mx);
        const float id   = amax > 0.0f ? 127.0f / amax : 0.0f;
        v.d[b]           = amax / 127.0f;
        const __m256 idv = _mm256_set1_ps(id);
        for (int c = 0; c < 8; ++c) {
            const __m256i q = quant32(xb + 32 * c, idv);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(v.q + b * 256 + 32 * c), q);
            // 16-sums: sad of (q ^ 0x80) against 0 gives 4 sums of 8 bytes, each +8*128
            const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(char(0x80))), _mm256_setzero_si256());
            alignas(32) uint64_t s4[4];
            _mm256_store_si256(reinterpret_cast<__m256i *>(s4), sad);
            const int s0 = int(s4[0] + s4[1]) - 2048, s1 = int(s4[2] + s4[3]) - 2048;
            v.bsum[b * 16 + 2 * c]     = int16_t(s0);
            v.bsum[b * 16 + 2 * c + 1] = int16_t(s1);
            v.ds[b * 8 + c]            = v.d[b] * float(s0 + s1);
        }
    }
}

void matmul_q4_K(const MatMulArgs & A) { matmul_kq<144, KQ::q4>(A); }
void matmul_q5_K(const MatMulArgs & A) { matmul_kq<176, KQ::q5>(A); }
void matmul_q6_K(const MatMulArgs & A) { matmul_kq<210, KQ::q6>(A); }

}  // namespace dflash::kern::avx2

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
