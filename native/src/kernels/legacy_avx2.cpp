// Legacy 32-element block types (Q4_0, Q4_1, Q5_0, Q8_0), AVX2 + FMA + F16C path (chosen at run
// time by dispatch.cpp; per-function target attributes, no file flags).
//
// Per weight row, per block: unpack the 32 quants once into a register, then for every
// activation row: int32 lanes = madd16(maddubs(w, a), 1), acc += float(lanes) * (d_w * d_a).
// The per-block offset terms (Q4_0's -8, Q5_0's -16, Q4_1's min) do not touch the inner loop:
// they are  sum_b coef_w[b] * s_a[b]  over the row (s_a = d_a * sum(q_a)), one short float dot per
// (weight row, activation row).
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

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m        = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m        = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

enum class Kind { q4_0, q4_1, q5_0, q8_0 };

template <Kind k> constexpr int block_bytes() {
    return k == Kind::q4_0 ? 18 : k == Kind::q4_1 ? 20 : k == Kind::q5_0 ? 22 : 34;
}

// nibbles of 16 bytes -> 32 unsigned bytes, low nibbles first (the 16 bytes loaded into both
// lanes, the high lane shifted by 4: three instructions)
inline __m256i nibbles(const uint8_t * qs) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(qs)));
    return _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// bit l of the 32-bit word at p -> 0x10 in byte l
inline __m256i bits_to_0x10(const uint8_t * p) {
    const __m256i v   = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float *>(p)));
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i b   = _mm256_and_si256(_mm256_shuffle_epi8(v, idx), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10));
}

template <Kind kKind>
inline __m256i unpack(const uint8_t * blk) {
    if constexpr (kKind == Kind::q8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 2));
    } else if constexpr (kKind == Kind::q4_0) {
        return nibbles(blk + 2);
    } else if constexpr (kKind == Kind::q4_1) {
        return nibbles(blk + 4);
    } else {
        return _mm256_or_si256(nibbles(blk + 6), bits_to_0x10(blk + 2));
    }
}

// int32 lanes of one block's dot: w unpacked (wu = |w| for Q8_0, whose sign moves onto a)
template <Kind kKind>
inline __m256i block_dot(__m256i w, __m256i wu, __m256i a) {
    if constexpr (kKind == Kind::q8_0) a = _mm256_sign_epi8(a, w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wu, a), _mm256_set1_epi16(1));
}

template <Kind kKind>
inline __m256i unsigned_side(__m256i w) {
    if constexpr (kKind == Kind::q8_0) return _mm256_sign_epi8(w, w);  // |w|
    return w;
}

// coef[b]: the weight side of block b's offset term (Q4_0, Q5_0: the block scale, the -8 / -16
// applied after the dot; Q4_1: the min), collected in the block loop (no second pass over the
// block headers)
template <Kind kKind>
inline void take_coef(const uint8_t * blk, float dw, float * coef, int64_t b) {
    if constexpr (kKind == Kind::q4_1) {
        coef[b] = h2f(blk + 2);
    } else if constexpr (kKind != Kind::q8_0) {
        coef[b] = dw;
    }
}

template <int G, Kind kKind>
inline void rows_block(__m256i w, float dw, const uint8_t * const * arow, int64_t K, int64_t b, __m256 * accf) {
    const __m256i wu  = unsigned_side<kKind>(w);
    const __m256  dwv = _mm256_set1_ps(dw);
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        const __m256i a   = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow[g] + b * 32));
        const __m256i dot = block_dot<kKind>(w, wu, a);
        const float   da  = reinterpret_cast<const float *>(arow[g] + K)[b];
        accf[g]           = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dwv), _mm256_set1_ps(da), accf[g]);
    }
}

template <int G, Kind kKind>
inline void rows_all(const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K, __m256 * accf,
                     float * coef) {
    constexpr int kBytes = block_bytes<kKind>();
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) accf[g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t * blk = wr + b * kBytes;
        prefetch_ahead<kBytes>(blk);
        const float     dw  = h2f(blk);
        take_coef<kKind>(blk, dw, coef, b);
        rows_block<G, kKind>(unpack<kKind>(blk), dw, arow, K, b, accf);
    }
}

template <Kind kKind>
inline void rows_dispatch(int G, const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K, __m256 * accf,
                          float * coef) {
    switch (G) {
        case 1: rows_all<1, kKind>(wr, nb, arow, K, accf, coef); break;
        case 2: rows_all<2, kKind>(wr, nb, arow, K, accf, coef); break;
        case 3: rows_all<3, kKind>(wr, nb, arow, K, accf, coef); break;
        case 4: rows_all<4, kKind>(wr, nb, arow, K, accf, coef); break;
        case 5: rows_all<5, kKind>(wr, nb, arow, K, accf, coef); break;
        case 6: rows_all<6, kKind>(wr, nb, arow, K, accf, coef); break;
        case 7: rows_all<7, kKind>(wr, nb, arow, K, accf, coef); break;
        default: rows_all<8, kKind>(wr, nb, arow, K, accf, coef); break;
    }
}

constexpr int kGroup = 8;

inline float dot_f32(const float * x, const float * y, int64_t n) {
    __m256  acc = _mm256_setzero_ps();
    int64_t i   = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    float s = hsum8(acc);
    for (; i < n; ++i) s += x[i] * y[i];
    return s;
}

// One activation row (a plain decode step), two weight rows at a time: two independent
// accumulation chains (one row's chain is bound by the FMA latency) and one activation load for
// both. Each weight row gets exactly the float steps of rows_block<1>, so a row's result does not
// depend on the batch it came in.
template <Kind kKind>
inline void two_weight_rows(const uint8_t * w0, const uint8_t * w1, int64_t nb, const uint8_t * arow, int64_t K,
                            float * coef0, float * coef1, __m256 & acc0, __m256 & acc1) {
    constexpr int kBytes = block_bytes<kKind>();
    const float * da     = reinterpret_cast<const float *>(arow + K);
    const int64_t ahead  = 2 * (w1 - w0);
    acc0 = _mm256_setzero_ps();
    acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t * b0 = w0 + b * kBytes;
        const uint8_t * b1 = w1 + b * kBytes;
        // two interleaved streams: the hardware prefetcher alone falls behind (measured); fetch
        // the next pair's bytes at the same offset
        _mm_prefetch(reinterpret_cast<const char *>(b0 + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char *>(b1 + ahead), _MM_HINT_T0);
        const float dw0 = h2f(b0), dw1 = h2f(b1);
        take_coef<kKind>(b0, dw0, coef0, b);
        take_coef<kKind>(b1, dw1, coef1, b);
        const __m256i q0  = unpack<kKind>(b0), q1 = unpack<kKind>(b1);
        const __m256i a   = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow + b * 32));
        const __m256i d0  = block_dot<kKind>(q0, unsigned_side<kKind>(q0), a);
        const __m256i d1  = block_dot<kKind>(q1, unsigned_side<kKind>(q1), a);
        const __m256  dav = _mm256_set1_ps(da[b]);
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(dw0)), dav, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(dw1)), dav, acc1);
    }
}

template <Kind kKind>
void matmul_legacy(const MatMulArgs & A) {
    const int64_t   nb = A.K / 32;
    const uint8_t * arow[kMaxRows];
    for (int j = 0; j < A.n; ++j) arow[j] = A.a + j * A.a_row_bytes;
    const int n_groups = (A.n + kGroup - 1) / kGroup;
    float     coef_small[1024];
    float *   coef     = coef_small;
    float *   coef_big = nullptr;
    if (nb > 1024) coef = coef_big = new float[size_t(nb)];
    // Q4_0 / Q5_0: the offset -8 / -16 times the block scale; a power of two, so applying it after
    // the dot gives the same bits as scaling each coefficient
    constexpr float kOff = kKind == Kind::q4_0 ? -8.0f : kKind == Kind::q5_0 ? -16.0f : 1.0f;
    int64_t         r0   = A.r0;
    if (A.n == 1 && nb <= 512) {
        const float * sa = reinterpret_cast<const float *>(arow[0] + A.K + nb * 4);
        float *       c1 = coef_small + 512;  // nb <= 512: the second weight row's coefficients
        for (; r0 + 2 <= A.r1; r0 += 2) {
            __m256 acc0, acc1;
            two_weight_rows<kKind>(A.w + r0 * A.w_row_bytes, A.w + (r0 + 1) * A.w_row_bytes, nb, arow[0], A.K, coef,
                                   c1, acc0, acc1);
            float y0 = hsum8(acc0), y1 = hsum8(acc1);
            if constexpr (kKind != Kind::q8_0) {
                y0 += kOff * dot_f32(coef, sa, nb);
                y1 += kOff * dot_f32(c1, sa, nb);
            }
            A.c[r0]     = y0;
            A.c[r0 + 1] = y1;
        }
    }
    for (int64_t r = r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        __m256          accf[kMaxRows];
        int             j0 = 0;
        for (int gi = 0; gi < n_groups; ++gi) {
            const int G = (A.n - j0) / (n_groups - gi);
            rows_dispatch<kKind>(G, wr, nb, arow + j0, A.K, accf + j0, coef);
            j0 += G;
        }
        for (int j = 0; j < A.n; ++j) {
            float r_j = hsum8(accf[j]);
            if constexpr (kKind != Kind::q8_0) {
                const float * sa = reinterpret_cast<const float *>(arow[j] + A.K + nb * 4);
                r_j += kOff * dot_f32(coef, sa, nb);
            }
            A.c[j * A.c_row_floats + r] = r_j;
        }
    }
    delete[] coef_big;
}

inline __m256 abs_ps(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

}  // namespace

void quantize_a32(const float * x, uint8_t * row, int64_t K) {
    A32View v = a32_view(row, K);
    for (int64_t b = 0; b < K / 32; ++b) {
        const float * xb = x + b * 32;
        const __m256  x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
        const __m256  x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
        const __m256  mx = _mm256_max_ps(_mm256_max_ps(abs_ps(x0), abs_ps(x1)), _mm256_max_ps(abs_ps(x2), abs_ps(x3)));
        const float   amax = hmax8(mx);
        const float   id   = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float   d    = amax / 127.0f;
        const __m256  idv  = _mm256_set1_ps(id);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, idv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, idv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, idv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, idv));
        __m256i       q  = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        q                = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(v.q + b * 32), q);
        const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8(char(0x80))), _mm256_setzero_si256());
        const __m128i s2  = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
        const int     sum = int(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
        v.d[b]            = d;
        v.s[b]            = d * float(sum);
    }
}

void matmul_q4_0(const MatMulArgs & A) { matmul_legacy<Kind::q4_0>(A); }
void matmul_q4_1(const MatMulArgs & A) { matmul_legacy<Kind::q4_1>(A); }
void matmul_q5_0(const MatMulArgs & A) { matmul_legacy<Kind::q5_0>(A); }
void matmul_q8_0(const MatMulArgs & A) { matmul_legacy<Kind::q8_0>(A); }

}  // namespace dflash::kern::avx2

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
