// K-quants (Q4_K, Q5_K, Q6_K), AVX2 + FMA + F16C path (chosen at run time by dispatch.cpp; this
// file is compiled with per-function target attributes, so the baseline build needs no flags).
//
// Per weight row and super-block: unpack the 256 quants once into an L1 scratch (unsigned bytes,
// natural order), decode the scales/mins once, then run every activation row over it:
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

namespace dflash::kern::avx2 {

namespace {

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float h2f(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// One unpacked super-block.
struct alignas(32) Block {
    uint8_t q[256];     // unsigned quants in element order
    int16_t sc[16];     // Q4_K/Q5_K: 8 scales (per 32); Q6_K: 16 scales (per 16)
    int16_t mexp[16];   // Q4_K/Q5_K: mins expanded per 16-group; Q6_K: -32*scale per 16-group
    float   d, dmin;
};

inline void unpack_q4_K(const uint8_t * blk, Block & u) {
    u.d    = h2f(blk);
    u.dmin = h2f(blk + 2);
    for (int s = 0; s < 8; ++s) {
        int sc, m;
        kq_scale_min(s, blk + 4, sc, m);
        u.sc[s]           = int16_t(sc);
        u.mexp[2 * s]     = int16_t(m);
        u.mexp[2 * s + 1] = int16_t(m);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16 + 32 * c));
        _mm256_store_si256(reinterpret_cast<__m256i *>(u.q + 64 * c), _mm256_and_si256(qv, m4));
        _mm256_store_si256(reinterpret_cast<__m256i *>(u.q + 64 * c + 32),
                           _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4));
    }
}

inline void unpack_q5_K(const uint8_t * blk, Block & u) {
    u.d    = h2f(blk);
    u.dmin = h2f(blk + 2);
    for (int s = 0; s < 8; ++s) {
        int sc, m;
        kq_scale_min(s, blk + 4, sc, m);
        u.sc[s]           = int16_t(sc);
        u.mexp[2 * s]     = int16_t(m);
        u.mexp[2 * s + 1] = int16_t(m);
    }
    const __m256i m4  = _mm256_set1_epi8(0x0F);
    const __m256i b4  = _mm256_set1_epi8(0x10);
    const __m256i qh  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 16));
    for (int c = 0; c < 4; ++c) {
        const __m256i qv  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 48 + 32 * c));
        const __m256i ulo = _mm256_set1_epi8(char(1 << (2 * c)));
        const __m256i uhi = _mm256_set1_epi8(char(2 << (2 * c)));
        const __m256i hlo = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, ulo), ulo), b4);
        const __m256i hhi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, uhi), uhi), b4);
        _mm256_store_si256(reinterpret_cast<__m256i *>(u.q + 64 * c), _mm256_or_si256(_mm256_and_si256(qv, m4), hlo));
        _mm256_store_si256(reinterpret_cast<__m256i *>(u.q + 64 * c + 32),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4), hhi));
    }
}

inline void unpack_q6_K(const uint8_t * blk, Block & u) {
    const int8_t * sc = reinterpret_cast<const int8_t *>(blk + 192);
    u.d               = h2f(blk + 208);
    u.dmin            = 0.0f;
    for (int s = 0; s < 16; ++s) {
        u.sc[s]   = sc[s];
        u.mexp[s] = int16_t(-32 * sc[s]);
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 64 * h + 32));
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(blk + 128 + 32 * h));
        uint8_t *     q  = u.q + 128 * h;
        _mm256_store_si256(reinterpret_cast<__m256i *>(q + 0),
                           _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 4), m2)));
        _mm256_store_si256(reinterpret_cast<__m256i *>(q + 32),
                           _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 2), m2)));
        _mm256_store_si256(reinterpret_cast<__m256i *>(q + 64),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hv, m2)));
        _mm256_store_si256(reinterpret_cast<__m256i *>(q + 96),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(hv, 2), m2)));
    }
}

// G activation rows against one unpacked super-block b. Q4_K/Q5_K (kSixteen = false): scale per
// 32, mins with d_min. Q6_K (kSixteen = true): scale per 16, the -32 offset folded into the
// integer sum through the activation's 16-sums.
template <int G, bool kSixteen>
inline void rows_block(const Block & u, const uint8_t * const * arow, int64_t K, int64_t b, __m256 * accf) {
    __m256i isum[G];
    for (int g = 0; g < G; ++g) isum[g] = _mm256_setzero_si256();
    const size_t qoff = size_t(b) * 256;
    for (int c = 0; c < 8; ++c) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i *>(u.q + 32 * c));
        __m256i       s;
        if (kSixteen) {
            s = _mm256_set_m128i(_mm_set1_epi16(u.sc[2 * c + 1]), _mm_set1_epi16(u.sc[2 * c]));
        } else {
            s = _mm256_set1_epi16(u.sc[c]);
        }
        for (int g = 0; g < G; ++g) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(arow[g] + qoff + 32 * c));
            isum[g]         = _mm256_add_epi32(isum[g], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), s));
        }
    }
    const __m256i mexp = _mm256_load_si256(reinterpret_cast<const __m256i *>(u.mexp));
    for (int g = 0; g < G; ++g) {
        const float *   ad   = reinterpret_cast<const float *>(arow[g] + K);
        const int16_t * bs   = reinterpret_cast<const int16_t *>(arow[g] + K + (K / 256) * 4) + b * 16;
        const __m256i   bsv  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bs));
        const __m256i   corr = _mm256_madd_epi16(bsv, mexp);
        const float     da   = ad[b];
        if (kSixteen) {
            accf[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(isum[g], corr)), _mm256_set1_ps(u.d * da), accf[g]);
        } else {
            accf[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[g]), _mm256_set1_ps(u.d * da), accf[g]);
            accf[g] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(u.dmin * da), accf[g]);
        }
    }
}

template <bool kSixteen>
inline void rows_dispatch(int G, const Block & u, const uint8_t * const * arow, int64_t K, int64_t b, __m256 * accf) {
    switch (G) {
        case 1: rows_block<1, kSixteen>(u, arow, K, b, accf); break;
        case 2: rows_block<2, kSixteen>(u, arow, K, b, accf); break;
        case 3: rows_block<3, kSixteen>(u, arow, K, b, accf); break;
        case 4: rows_block<4, kSixteen>(u, arow, K, b, accf); break;
        case 5: rows_block<5, kSixteen>(u, arow, K, b, accf); break;
        case 6: rows_block<6, kSixteen>(u, arow, K, b, accf); break;
        case 7: rows_block<7, kSixteen>(u, arow, K, b, accf); break;
        default: rows_block<8, kSixteen>(u, arow, K, b, accf); break;
    }
}

constexpr int kGroup = 8;

template <int kBlockBytes, bool kSixteen, void (*Unpack)(const uint8_t *, Block &)>
void matmul_kq(const MatMulArgs & A) {
    const int64_t   nb = A.K / 256;
    Block           u;
    const uint8_t * arow[kMaxRows];
    for (int j = 0; j < A.n; ++j) arow[j] = A.a + j * A.a_row_bytes;
    // split the rows into groups of at most kGroup, as even as possible (16 -> 8+8, 12 -> 6+6)
    const int n_groups = (A.n + kGroup - 1) / kGroup;
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        __m256          accf[kMaxRows];
        for (int j = 0; j < A.n; ++j) accf[j] = _mm256_setzero_ps();
        if (r + 1 < A.r1) {
            _mm_prefetch(reinterpret_cast<const char *>(wr + A.w_row_bytes), _MM_HINT_T0);
        }
        for (int64_t b = 0; b < nb; ++b) {
            Unpack(wr + b * kBlockBytes, u);
            int j0 = 0;
            for (int gi = 0; gi < n_groups; ++gi) {
                const int G = (A.n - j0) / (n_groups - gi);
                rows_dispatch<kSixteen>(G, u, arow + j0, A.K, b, accf + j0);
                j0 += G;
            }
        }
        for (int j = 0; j < A.n; ++j) A.c[j * A.c_row_floats + r] = hsum8(accf[j]);
    }
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
            v.bsum[b * 16 + 2 * c]     = int16_t(int(s4[0] + s4[1]) - 2048);
            v.bsum[b * 16 + 2 * c + 1] = int16_t(int(s4[2] + s4[3]) - 2048);
        }
    }
}

void matmul_q4_K(const MatMulArgs & A) { matmul_kq<144, false, unpack_q4_K>(A); }
void matmul_q5_K(const MatMulArgs & A) { matmul_kq<176, false, unpack_q5_K>(A); }
void matmul_q6_K(const MatMulArgs & A) { matmul_kq<210, true, unpack_q6_K>(A); }

}  // namespace dflash::kern::avx2

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
