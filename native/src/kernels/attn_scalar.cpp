// Attention block kernel, portable scalar path and reference for attn_avx2.cpp: the same
// operations in the same order per lane (explicit fmaf, the same exp), so the two give the same
// bits; this file and the AVX2 one are built with -ffp-contract=off for that.
//
// For one block of nj positions and the queries of a unit (attention.h):
//   s[jj][i]  = fma(dot(q_i, k_jj), scale, mask[jj][i])      dot: acc = fma(q[d], k[d], acc), d = 0..D-1
//   M'        = max(M, max_jj s),  Ms = M' (0 if M' = -inf: nothing seen yet)
//   alpha     = exp(M - Ms),  p = exp(s - Ms),  L = fma(L, alpha, sum_jj p)
//   o[i][d]   = o[i][d] * alpha, then o = fma(p[jj][i], v_jj[d], o) for jj = 0..nj-1
#include "attention.h"
#include "kernels.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace dflash::kern {

// exp(x) for x <= 0: x = n ln2 + r (|r| <= ln2/2, ln2 in two parts), e^r by its degree-7 Taylor
// polynomial (relative error < 3e-9 on that range), times 2^n built in the exponent bits.
// exp(0) = 1 exactly; below -87 (and -inf) it returns 0.
float attn_exp(float x) {
    if (!(x >= -87.0f)) return 0.0f;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float       r = std::fma(n, -0.693359375f, x);
    r             = std::fma(n, 2.12194440e-4f, r);
    float p       = 1.98412698e-4f;
    p             = std::fma(p, r, 1.38888889e-3f);
    p             = std::fma(p, r, 8.33333333e-3f);
    p             = std::fma(p, r, 4.16666667e-2f);
    p             = std::fma(p, r, 1.66666667e-1f);
    p             = std::fma(p, r, 0.5f);
    p             = std::fma(p, r, 1.0f);
    p             = std::fma(p, r, 1.0f);
    const int32_t bits = (int32_t(n) + 127) << 23;
    float         two_n;
    std::memcpy(&two_n, &bits, 4);
    return p * two_n;
}

namespace scalar {

void attn_block(const AttnBlockArgs & a) {
    const int D = a.D, qp = a.qp, nj = a.nj;
    for (int jj = 0; jj < nj; ++jj) {
        for (int d = 0; d < D; ++d) a.kf[jj * D + d] = half_to_float(a.k[jj][d]);
    }
    for (int jj = 0; jj < nj; ++jj) {
        for (int i = 0; i < qp; ++i) {
            float acc = 0.0f;
            for (int d = 0; d < D; ++d) acc = std::fma(a.qt[d * qp + i], a.kf[jj * D + d], acc);
            a.p[jj * qp + i] = std::fma(acc, a.scale, a.mask[jj * qp + i]);
        }
    }
    const float ninf = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < qp; ++i) {
        float bm = ninf;
        for (int jj = 0; jj < nj; ++jj) bm = std::fmax(bm, a.p[jj * qp + i]);
        const float mn = std::fmax(a.m[i], bm);
        const float ms = mn == ninf ? 0.0f : mn;
        a.alpha[i]     = attn_exp(a.m[i] - ms);
        float lsum     = 0.0f;
        for (int jj = 0; jj < nj; ++jj) {
            const float e    = attn_exp(a.p[jj * qp + i] - ms);
            a.p[jj * qp + i] = e;
            lsum += e;
        }
        a.l[i] = std::fma(a.l[i], a.alpha[i], lsum);
        a.m[i] = mn;
    }
    for (int i = 0; i < a.nq; ++i) {
        for (int d = 0; d < D; ++d) {
            float acc = a.o[i * D + d] * a.alpha[i];
            for (int jj = 0; jj < nj; ++jj) acc = std::fma(a.p[jj * qp + i], half_to_float(a.v[jj][d]), acc);
            a.o[i * D + d] = acc;
        }
    }
}

}  // namespace scalar
}  // namespace dflash::kern
