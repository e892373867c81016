// Legacy 32-element block types (Q4_0, Q4_1, Q5_0, Q8_0), portable scalar path and reference for
// the SIMD paths (same integer dots per block, same activation quantization).
//
// Weight block layouts (ggml's, read in place); element l < 16 is the low nibble of qs[l],
// element l >= 16 the high nibble of qs[l-16]:
//   Q4_0 18 B: half d, u8 qs[16]                    w = d*(q-8)
//   Q4_1 20 B: half d, half m, u8 qs[16]            w = d*q + m
//   Q5_0 22 B: half d, u32 qh, u8 qs[16]            w = d*(q-16), bit 4 of element l = bit l of qh
//   Q8_0 34 B: half d, i8 qs[32]                    w = d*q
// Activations: layout A32 (kernels.h): per block d (scale) and s = d*sum(q).
// Per block, with dot = sum(q_w * q_a) over the unsigned (or, for Q8_0, signed) weight quants:
//   Q4_0: d_w*(d_a*dot - 8*s)   Q5_0: d_w*(d_a*dot - 16*s)   Q4_1: d_w*d_a*dot + m_w*s
//   Q8_0: d_w*d_a*dot
#include "kernels.h"

#include <cmath>
#include <cstring>

namespace dflash::kern::scalar {

void quantize_a32(const float * x, uint8_t * row, int64_t K) {
    A32View v = a32_view(row, K);
    for (int64_t b = 0; b < K / 32; ++b) {
        const float * xb   = x + b * 32;
        float         amax = 0.0f;
        for (int i = 0; i < 32; ++i) {
            amax = std::fmax(amax, std::fabs(xb[i]));
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float d  = amax / 127.0f;
        int8_t *    q  = v.q + b * 32;
        int         sum = 0;
        for (int i = 0; i < 32; ++i) {
            float t = std::nearbyint(xb[i] * id);
            t       = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
            q[i]    = int8_t(t);
            sum += q[i];
        }
        v.d[b] = d;
        v.s[b] = d * float(sum);
    }
}

namespace {

inline float rdh(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
}

enum class Kind { q4_0, q4_1, q5_0, q8_0 };

template <Kind kKind>
void matmul_legacy(const MatMulArgs & A) {
    constexpr int kBytes = kKind == Kind::q4_0 ? 18 : kKind == Kind::q4_1 ? 20 : kKind == Kind::q5_0 ? 22 : 34;
    const int64_t nb = A.K / 32;
    int           wq[32];
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        float           acc[kMaxRows] = {};
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t * blk = wr + b * kBytes;
            const float     dw  = rdh(blk);
            float           mw  = 0.0f;
            if (kKind == Kind::q8_0) {
                for (int l = 0; l < 32; ++l) {
                    wq[l] = int8_t(blk[2 + l]);
                }
            } else {
                const uint8_t * qs = blk + (kKind == Kind::q4_0 ? 2 : kKind == Kind::q4_1 ? 4 : 6);
                uint32_t        qh = 0;
                if (kKind == Kind::q5_0) {
                    std::memcpy(&qh, blk + 2, 4);
                }
                if (kKind == Kind::q4_1) {
                    mw = rdh(blk + 2);
                }
                for (int l = 0; l < 16; ++l) {
                    wq[l]      = qs[l] & 0x0F;
                    wq[l + 16] = qs[l] >> 4;
                }
                if (kKind == Kind::q5_0) {
                    for (int l = 0; l < 32; ++l) {
                        wq[l] |= int((qh >> l) & 1) << 4;
                    }
                }
            }
            for (int j = 0; j < A.n; ++j) {
                const A32View  a   = a32_view(A.a + j * A.a_row_bytes, A.K);
                const int8_t * aq  = a.q + b * 32;
                int32_t        dot = 0;
                for (int l = 0; l < 32; ++l) {
                    dot += wq[l] * aq[l];
                }
                const float da = a.d[b], sa = a.s[b];
                switch (kKind) {
                    case Kind::q4_0: acc[j] += dw * (da * float(dot) - 8.0f * sa); break;
                    case Kind::q5_0: acc[j] += dw * (da * float(dot) - 16.0f * sa); break;
                    case Kind::q4_1: acc[j] += dw * da * float(dot) + mw * sa; break;
                    case Kind::q8_0: acc[j] += dw * da * float(dot); break;
                }
            }
        }
        for (int j = 0; j < A.n; ++j) {
            A.c[j * A.c_row_floats + r] = acc[j];
        }
    }
}

}  // namespace

void matmul_q4_0(const MatMulArgs & A) { matmul_legacy<Kind::q4_0>(A); }
void matmul_q4_1(const MatMulArgs & A) { matmul_legacy<Kind::q4_1>(A); }
void matmul_q5_0(const MatMulArgs & A) { matmul_legacy<Kind::q5_0>(A); }
void matmul_q8_0(const MatMulArgs & A) { matmul_legacy<Kind::q8_0>(A); }

}  // namespace dflash::kern::scalar
