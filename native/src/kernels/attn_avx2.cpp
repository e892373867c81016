// Attention block kernel, AVX2 + FMA + F16C path (attention.h; chosen at run time by
// attention.cpp, per-function target attributes, no ISA flags). Lane i of a vector is query i of
// the unit, so scores need no horizontal sums: per key position and dimension one broadcast of the
// key element and one FMA per 8 queries. The operations per lane are those of attn_scalar.cpp.
#include "attention.h"

#include <immintrin.h>

#include <algorithm>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "avx2_common.h"

namespace dflash::kern::avx2 {

namespace {

// attn_exp (attn_scalar.cpp) on 8 lanes, the same operations
inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 ok = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x               = _mm256_max_ps(x, lo);
    const __m256 n  = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r        = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.98412698e-4f);
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888889e-3f));
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p        = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), ok);
}

// scores of NT vectors of 8 queries against NJ = 8 / NT key rows at a time (8 FMA chains)
template <int NT> void scores(const AttnBlockArgs & a) {
    constexpr int NJ = 8 / NT;
    const int     D = a.D, qp = a.qp, nj = a.nj;
    const __m256  scale = _mm256_set1_ps(a.scale);
    for (int j0 = 0; j0 < nj; j0 += NJ) {
        const float * kr[NJ];
        for (int u = 0; u < NJ; ++u) kr[u] = a.kf + std::min(j0 + u, nj - 1) * D;
        __m256 acc[NT][NJ];
        for (int t = 0; t < NT; ++t) {
            for (int u = 0; u < NJ; ++u) acc[t][u] = _mm256_setzero_ps();
        }
        for (int d = 0; d < D; ++d) {
            __m256 q[NT];
            for (int t = 0; t < NT; ++t) q[t] = _mm256_loadu_ps(a.qt + d * qp + 8 * t);
            for (int u = 0; u < NJ; ++u) {
                const __m256 kb = _mm256_broadcast_ss(kr[u] + d);
                for (int t = 0; t < NT; ++t) acc[t][u] = _mm256_fmadd_ps(q[t], kb, acc[t][u]);
            }
        }
        for (int u = 0; u < NJ && j0 + u < nj; ++u) {
            for (int t = 0; t < NT; ++t) {
                const int o = (j0 + u) * qp + 8 * t;
                _mm256_storeu_ps(a.p + o, _mm256_fmadd_ps(acc[t][u], scale, _mm256_loadu_ps(a.mask + o)));
            }
        }
    }
}

// o[i][d0 .. d0 + 8 DW) of NI queries from i0: scale by alpha, then add p * v over the block
template <int NI, int DW> void accumulate(const AttnBlockArgs & a, int i0, int d0) {
    const int D = a.D, qp = a.qp;
    __m256    acc[NI][DW];
    for (int i = 0; i < NI; ++i) {
        const __m256 al = _mm256_broadcast_ss(a.alpha + i0 + i);
        for (int w = 0; w < DW; ++w) acc[i][w] = _mm256_mul_ps(_mm256_loadu_ps(a.o + (i0 + i) * D + d0 + 8 * w), al);
    }
    for (int jj = 0; jj < a.nj; ++jj) {
        __m256 vv[DW];
        for (int w = 0; w < DW; ++w) {
            vv[w] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(a.v[jj] + d0 + 8 * w)));
        }
        for (int i = 0; i < NI; ++i) {
            const __m256 pb = _mm256_broadcast_ss(a.p + jj * qp + i0 + i);
            for (int w = 0; w < DW; ++w) acc[i][w] = _mm256_fmadd_ps(pb, vv[w], acc[i][w]);
        }
    }
    for (int i = 0; i < NI; ++i) {
        for (int w = 0; w < DW; ++w) _mm256_storeu_ps(a.o + (i0 + i) * D + d0 + 8 * w, acc[i][w]);
    }
}

// queries in groups of up to 6 (12 accumulators of 16 dimensions each)
template <int DW> void accumulate_all(const AttnBlockArgs & a, int d0) {
    for (int i0 = 0; i0 < a.nq; i0 += 6) {
        switch (std::min(6, a.nq - i0)) {
            case 1: accumulate<1, DW>(a, i0, d0); break;
            case 2: accumulate<2, DW>(a, i0, d0); break;
            case 3: accumulate<3, DW>(a, i0, d0); break;
            case 4: accumulate<4, DW>(a, i0, d0); break;
            case 5: accumulate<5, DW>(a, i0, d0); break;
            default: accumulate<6, DW>(a, i0, d0); break;
        }
    }
}

}  // namespace

void attn_block(const AttnBlockArgs & a) {
    const int D = a.D, qp = a.qp, nj = a.nj;
    for (int jj = 0; jj < nj; ++jj) {
        for (int d = 0; d < D; d += 8) {
            const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a.k[jj] + d));
            _mm256_storeu_ps(a.kf + jj * D + d, _mm256_cvtph_ps(h));
        }
    }
    if (qp == 8) {
        scores<1>(a);
    } else {
        scores<2>(a);
    }

    const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
    for (int t = 0; t < qp; t += 8) {
        const __m256 mo = _mm256_loadu_ps(a.m + t);
        __m256       bm = ninf;
        for (int jj = 0; jj < nj; ++jj) bm = _mm256_max_ps(bm, _mm256_loadu_ps(a.p + jj * qp + t));
        const __m256 mn = _mm256_max_ps(mo, bm);
        const __m256 ms = _mm256_blendv_ps(mn, _mm256_setzero_ps(), _mm256_cmp_ps(mn, ninf, _CMP_EQ_OQ));
        const __m256 al = exp_nonpos(_mm256_sub_ps(mo, ms));
        _mm256_storeu_ps(a.alpha + t, al);
        __m256 lsum = _mm256_setzero_ps();
        for (int jj = 0; jj < nj; ++jj) {
            const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(a.p + jj * qp + t), ms));
            _mm256_storeu_ps(a.p + jj * qp + t, e);
            lsum = _mm256_add_ps(lsum, e);
        }
        _mm256_storeu_ps(a.l + t, _mm256_fmadd_ps(_mm256_loadu_ps(a.l + t), al, lsum));
        _mm256_storeu_ps(a.m + t, mn);
    }

    int d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) accumulate_all<2>(a, d0);
    if (d0 < D) accumulate_all<1>(a, d0);
}

}  // namespace dflash::kern::avx2

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
