// K-quants (Q4_K, Q5_K, Q6_K), AVX-512 VNNI path (chosen at run time by dispatch.cpp; per-function
// target attributes, no file flags).
//
// Same scheme as kquant_avx2.cpp on 64 weights per register: per weight row and super-block the
// scales are expanded once, each 64-quant vector is derived once per group of up to 8
// activation rows, and every row of the group runs over it with
//   int32 lanes = vpdpwssd(lanes, vpmaddubsw(w_u8, a_s8), scale16)    (2 ops per 64 weights)
// against 3 ops per 32 weights on AVX2. The float work (d_w * d_a, Q6_K's -32 through the
// activation's 16-sums) stays once per super-block and row; the Q4_K/Q5_K mins are one float dot
// per (weight row, activation row), outside the block loop.
// Ranges: vpmaddubsw pairs stay within int16 (Q6_K: 2 * 63 * 127 = 16002), so nothing saturates
// and the integer sums equal the scalar path's.
#include "kernels.h"

#if defined(DFLASH_KERNELS_X86)

#if !defined(DFLASH_KERNELS_EMULATED_AVX512)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
// gcc 12 warns about its own intrinsic headers' "undefined" registers under a target pragma
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

#include "avx512_common.h"

namespace dflash::kern::avx512 {

namespace {

enum class KQ { q4, q5, q6 };

// Per super-block weight state shared by the rows of a group.
struct Head {
    __m512i         sc16;  // the 8 (Q4_K/Q5_K) or 16 (Q6_K) scales as int16 in lanes 0..15
    __m256i         mexp;  // Q6_K: -32 * scale per 16-group, int16
    __m512i         qh;    // Q5_K: the 32 high-bit bytes in both halves; Q6_K unused
    float           d;
    const uint8_t * blk;
};

template <KQ k>
inline void head(const uint8_t * blk, Head & h, float * wmin) {
    h.blk = blk;
    if constexpr (k == KQ::q6) {
        h.d              = h2f(blk + 208);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk + 192)));
        h.sc16           = _mm512_zextsi256_si512(s16);
        h.mexp           = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));
    } else {
        h.d              = h2f(blk);
        const float dmin = h2f(blk + 2);
        uint64_t    sc8, m8;
        kq_scale_min_bytes(blk + 4, sc8, m8);
        h.sc16 = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8))));
        // mins -> dmin * m as 8 floats, for the per-row float dot after the block loop
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m8))));
        _mm256_storeu_ps(wmin, _mm256_mul_ps(mf, _mm256_set1_ps(dmin)));
        if constexpr (k == KQ::q5) {
            h.qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16)));
        }
    }
}

// The scale of every int16 lane of register c (elements 64c .. 64c+63): lane i holds elements
// 2i, 2i+1, so Q4_K/Q5_K (32-element sub-blocks) need scale 2c + i/16, Q6_K (16) 4c + i/8.
template <KQ k>
inline __m512i scale_lanes(const Head & h, int c) {
    alignas(64) static const int16_t idx[2][4][32] = {
        {{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
         {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3},
         {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5},
         {6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}},
        {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
         {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
         {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
         {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}},
    };
    const __m512i i = _mm512_load_si512(idx[k == KQ::q6 ? 1 : 0][c]);
    return _mm512_permutexvar_epi16(i, h.sc16);
}

// The 64 unsigned quants of register c (elements 64c .. 64c+63, natural order), from the block.
template <KQ k>
inline __m512i wvec(const Head & h, int c) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if constexpr (k == KQ::q6) {
        // low 32 elements from ql[64hh + l], high 32 from ql[64hh + 32 + l]; nibble g2; the two
        // high bits from qh[32hh + l] at bit pairs (0,2) for g2 = 0 and (4,6) for g2 = 1
        const int     hh = c >> 1, g2 = c & 1;
        const __m512i l  = _mm512_loadu_si512(h.blk + 64 * hh);
        const __m512i qv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(h.blk + 128 + 32 * hh)));
        const __m512i m2 = _mm512_set1_epi8(0x30);
        const __m512i lo = g2 ? _mm512_and_si512(_mm512_srli_epi16(l, 4), m4) : _mm512_and_si512(l, m4);
        __m512i       hi;
        if (g2 == 0) {
            hi = _mm512_sllv_epi16(qv, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
        } else {
            hi = _mm512_srlv_epi16(qv, _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1));
        }
        return _mm512_or_si512(lo, _mm512_and_si512(hi, m2));
    } else {
        // qs[32c .. 32c+31]: low nibbles = elements 64c.., high nibbles = 64c+32..
        const uint8_t * qs = h.blk + (k == KQ::q4 ? 16 : 48);
        const __m256i   y  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qs + 32 * c));
        __m512i         w  = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1), m4);
        if constexpr (k == KQ::q5) {
            // bit 2c of qh[l] is bit 4 of element l (low half), bit 2c+1 of element 32+l (high)
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))), _mm256_set1_epi8(char(1 << (2 * c + 1))), 1);
            w                 = _mm512_mask_add_epi8(w, _mm512_test_epi8_mask(h.qh, bit), w, _mm512_set1_epi8(0x10));
        }
        return w;
    }
}

// G activation rows against one weight row, super-block by super-block.
template <int G, int kBlockBytes, KQ k>
inline void group_rows(const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K, float * wmin,
                       float * out) {
    __m512        accf[G];
    const int64_t bs_off = K + (K / 256) * 4;
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) accf[g] = _mm512_setzero_ps();
    Head h;
    for (int64_t b = 0; b < nb; ++b) {
        prefetch_ahead<kBlockBytes>(wr + b * kBlockBytes);
        head<k>(wr + b * kBlockBytes, h, wmin + b * 8);
        __m512i isum[G];
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) isum[g] = _mm512_setzero_si512();
        const size_t qoff = size_t(b) * 256;
        DFLASH_UNROLL
        for (int c = 0; c < 4; ++c) {
            const __m512i w = wvec<k>(h, c);
            const __m512i s = scale_lanes<k>(h, c);
            DFLASH_UNROLL
            for (int g = 0; g < G; ++g) {
                const __m512i a = _mm512_loadu_si512(arow[g] + qoff + 64 * c);
                isum[g]         = _mm512_dpwssd_epi32(isum[g], _mm512_maddubs_epi16(w, a), s);
            }
        }
        if constexpr (k == KQ::q6) {
            // the -32 offset: sum over 16-groups of (-32 * scale) * (sum of the group's a)
            DFLASH_UNROLL
            for (int g = 0; g < G; ++g) {
                const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow[g] + bs_off + b * 32));
                isum[g]           = _mm512_add_epi32(isum[g], _mm512_zextsi256_si512(_mm256_madd_epi16(bsv, h.mexp)));
            }
        }
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) {
            const float da = reinterpret_cast<const float *>(arow[g] + K)[b];
            accf[g]        = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[g]), _mm512_set1_ps(h.d * da), accf[g]);
        }
    }
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        float r = hsum16(accf[g]);
        if constexpr (k != KQ::q6) {
            const float * ds = reinterpret_cast<const float *>(arow[g] + bs_off + (K / 16) * 2);
            r -= dot_f32(wmin, ds, nb * 8);
        }
        out[g] = r;
    }
}

template <int kBlockBytes, KQ k>
inline void group_dispatch(int G, const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K,
                           float * wmin, float * out) {
    switch (G) {
        case 1: group_rows<1, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 2: group_rows<2, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 3: group_rows<3, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 4: group_rows<4, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 5: group_rows<5, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 6: group_rows<6, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 7: group_rows<7, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 8: group_rows<8, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 9: group_rows<9, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 10: group_rows<10, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        case 11: group_rows<11, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
        default: group_rows<12, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
    }
}

// 8 rows: 8 integer + 8 float accumulators + weights, scales, temporaries stay in 32 registers
// (12 spilled with gcc 12)
constexpr int kGroup = 8;

template <int kBlockBytes, KQ k>
void matmul_kq(const MatMulArgs & A) {
    const int64_t   nb = A.K / 256;
    const uint8_t * arow[kMaxRows];
    for (int j = 0; j < A.n; ++j) arow[j] = A.a + j * A.a_row_bytes;
    // rows in groups of at most kGroup, as even as possible (16 -> 8+8)
    const int n_groups = (A.n + kGroup - 1) / kGroup;
    float     wmin_small[512];
    float *   wmin     = wmin_small;
    float *   wmin_big = nullptr;
    if (nb * 8 > 512) wmin = wmin_big = new float[size_t(nb) * 8];
    float out[kMaxRows];
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        int j0 = 0;
        for (int gi = 0; gi < n_groups; ++gi) {
            const int G = (A.n - j0) / (n_groups - gi);
            group_dispatch<kBlockBytes, k>(G, wr, nb, arow + j0, A.K, wmin, out + j0);
            j0 += G;
        }
        for (int j = 0; j < A.n; ++j) A.c[j * A.c_row_floats + r] = out[j];
    }
    delete[] wmin_big;
}

}  // namespace

// Activation rows are bit-identical on every ISA; AVX2's quantizer is the one to use here.
void quantize_a256(const float * x, uint8_t * row, int64_t K) { avx2::quantize_a256(x, row, K); }

void matmul_q4_K(const MatMulArgs & A) { matmul_kq<144, KQ::q4>(A); }
void matmul_q5_K(const MatMulArgs & A) { matmul_kq<176, KQ::q5>(A); }
void matmul_q6_K(const MatMulArgs & A) { matmul_kq<210, KQ::q6>(A); }

}  // namespace dflash::kern::avx512

#if !defined(DFLASH_KERNELS_EMULATED_AVX512)
#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif

#endif  // DFLASH_KERNELS_X86
