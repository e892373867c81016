// K-quants (Q4_K, Q5_K, Q6_K: 256-element super-blocks), portable scalar path. This is also the
// reference the SIMD paths are checked against: same integer arithmetic per sub-block, same
// activation quantization; only the float summation order differs.
//
// Weight block layouts (ggml's, read in place):
//   Q4_K 144 B: half d, half dmin, u8 scales[12] (8 x 6-bit scale + 8 x 6-bit min), u8 qs[128]
//               64-element chunk c uses qs[32c..32c+31]: low nibbles = sub-block 2c, high = 2c+1
//               w = d*sc*q - dmin*m
//   Q5_K 176 B: as Q4_K plus u8 qh[32] before qs: bit (2c+hi) of qh[l] is bit 4 of element l of
//               sub-block 2c+hi
//   Q6_K 210 B: u8 ql[128], u8 qh[64], i8 scales[16], half d; 16-element sub-blocks,
//               w = d*sc*(q-32) with q 6-bit
// Activations: layout A256 (kernels.h).
#include "kernels.h"

#include <cmath>
#include <cstring>

namespace dflash::kern::scalar {

void quantize_a256(const float * x, uint8_t * row, int64_t K) {
    A256View v = a256_view(row, K);
    for (int64_t b = 0; b < K / 256; ++b) {
        const float * xb   = x + b * 256;
        float         amax = 0.0f;
        for (int i = 0; i < 256; ++i) {
            amax = std::fmax(amax, std::fabs(xb[i]));
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        v.d[b]         = amax / 127.0f;
        int8_t * q     = v.q + b * 256;
        for (int i = 0; i < 256; ++i) {
            float t = std::nearbyint(xb[i] * id);
            t       = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);
            q[i]    = int8_t(t);
        }
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int i = 0; i < 16; ++i) {
                s += q[g * 16 + i];
            }
            v.bsum[b * 16 + g] = int16_t(s);
        }
        for (int g = 0; g < 8; ++g) {
            v.ds[b * 8 + g] = v.d[b] * float(v.bsum[b * 16 + 2 * g] + v.bsum[b * 16 + 2 * g + 1]);
        }
    }
}

namespace {

inline uint16_t rd16(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return h;
}

// Unpacked super-block: 256 unsigned quants, integer scales per 32 (or 16) and mins.
struct Unpacked {
    uint8_t q[256];
    int     sc[16];
    int     m[8];
    float   d, dmin;
};

void unpack_q4_K(const uint8_t * blk, Unpacked & u) {
    u.d    = half_to_float(rd16(blk));
    u.dmin = half_to_float(rd16(blk + 2));
    const uint8_t * scales = blk + 4;
    const uint8_t * qs     = blk + 16;
    for (int s = 0; s < 8; ++s) {
        kq_scale_min(s, scales, u.sc[s], u.m[s]);
        const uint8_t * q     = qs + 32 * (s / 2);
        const int       shift = (s & 1) * 4;
        for (int l = 0; l < 32; ++l) {
            u.q[s * 32 + l] = uint8_t((q[l] >> shift) & 0x0F);
        }
    }
}

void unpack_q5_K(const uint8_t * blk, Unpacked & u) {
    u.d    = half_to_float(rd16(blk));
    u.dmin = half_to_float(rd16(blk + 2));
    const uint8_t * scales = blk + 4;
    const uint8_t * qh     = blk + 16;
    const uint8_t * qs     = blk + 48;
    for (int s = 0; s < 8; ++s) {
        kq_scale_min(s, scales, u.sc[s], u.m[s]);
        const uint8_t * q     = qs + 32 * (s / 2);
        const int       shift = (s & 1) * 4;
        for (int l = 0; l < 32; ++l) {
            u.q[s * 32 + l] = uint8_t(((q[l] >> shift) & 0x0F) | (((qh[l] >> s) & 1) << 4));
        }
    }
}

void unpack_q6_K(const uint8_t * blk, Unpacked & u) {
    const uint8_t * ql = blk;
    const uint8_t * qh = blk + 128;
    const int8_t *  sc = reinterpret_cast<const int8_t *>(blk + 192);
    u.d = half_to_float(rd16(blk + 208));
    for (int s = 0; s < 16; ++s) {
        u.sc[s] = sc[s];
    }
    for (int e = 0; e < 256; ++e) {
        const int h = e / 128, l = e % 32, g = (e % 128) / 32;
        const int lo = (ql[h * 64 + l + (g & 1) * 32] >> ((g >> 1) * 4)) & 0x0F;
        const int hi = (qh[h * 32 + l] >> (2 * g)) & 3;
        u.q[e] = uint8_t(lo | (hi << 4));
    }
}

template <int kBlockBytes, void (*Unpack)(const uint8_t *, Unpacked &)>
void matmul_kq_mins(const MatMulArgs & A) {  // Q4_K, Q5_K
    const int64_t nb = A.K / 256;
    Unpacked      u;
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        float           acc[kMaxRows] = {};
        for (int64_t b = 0; b < nb; ++b) {
            Unpack(wr + b * kBlockBytes, u);
            for (int j = 0; j < A.n; ++j) {
                const A256View a    = a256_view(A.a + j * A.a_row_bytes, A.K);
                const int8_t * aq   = a.q + b * 256;
                int32_t        isum = 0, imin = 0;
                for (int s = 0; s < 8; ++s) {
                    int32_t dot = 0;
                    for (int l = 0; l < 32; ++l) {
                        dot += int32_t(u.q[s * 32 + l]) * aq[s * 32 + l];
                    }
                    isum += u.sc[s] * dot;
                    imin += u.m[s] * (a.bsum[b * 16 + 2 * s] + a.bsum[b * 16 + 2 * s + 1]);
                }
                acc[j] += a.d[b] * (u.d * float(isum) - u.dmin * float(imin));
            }
        }
        for (int j = 0; j < A.n; ++j) {
            A.c[j * A.c_row_floats + r] = acc[j];
        }
    }
}

}  // namespace

void matmul_q4_K(const MatMulArgs & A) { matmul_kq_mins<144, unpack_q4_K>(A); }
void matmul_q5_K(const MatMulArgs & A) { matmul_kq_mins<176, unpack_q5_K>(A); }

void matmul_q6_K(const MatMulArgs & A) {
    const int64_t nb = A.K / 256;
    Unpacked      u;
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        float           acc[kMaxRows] = {};
        for (int64_t b = 0; b < nb; ++b) {
            unpack_q6_K(wr + b * 210, u);
            for (int j = 0; j < A.n; ++j) {
                const A256View a    = a256_view(A.a + j * A.a_row_bytes, A.K);
                const int8_t * aq   = a.q + b * 256;
                int32_t        isum = 0;
                for (int s = 0; s < 16; ++s) {
                    int32_t dot = 0;
                    for (int l = 0; l < 16; ++l) {
                        dot += int32_t(u.q[s * 16 + l]) * aq[s * 16 + l];
                    }
                    isum += u.sc[s] * (dot - 32 * a.bsum[b * 16 + s]);
                }
                acc[j] += a.d[b] * u.d * float(isum);
            }
        }
        for (int j = 0; j < A.n; ++j) {
            A.c[j * A.c_row_floats + r] = acc[j];
        }
    }
}

}  // namespace dflash::kern::scalar
