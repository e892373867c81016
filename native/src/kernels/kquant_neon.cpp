// K-quants (Q4_K, Q5_K, Q6_K), arm64 NEON + dot-product extension path (chosen at run time by
// dispatch.cpp; this file is compiled with per-function target attributes, so the baseline
// arm64 build needs no flags).
//
// Per weight row and super-block: decode the scales/mins once, derive the int8 weight vectors of
// 4 sub-blocks at a time once per group of up to 8 activation rows (straight from the block, in
// registers), and run the group's rows over them:
//   p_s = sdot(w_s, a_s)                            int32 x4 per sub-block s (16 weights per SDOT)
//   isum += {sum p_s0 .. sum p_s3} * {sc_s0 .. sc_s3}   lane totals (2 ADDP levels), one MLA
// Q6_K's -32 offset is subtracted in int8 (q - 32 fits; SDOT is signed x signed), which is the
// scalar path's  dot - 32 * bsum  exactly. The float work (d * d_a) happens once per super-block
// and row; Q4_K/Q5_K's mins are, as in the AVX2 path, one float dot of K/32 terms per row
//   sum_{b,s} (dmin_b * m_bs) * (d_a,b * sum_32(q_a))
// with the weight side collected in wmin[] during the block loop.
#include "kernels.h"

#if defined(__aarch64__) || defined(_M_ARM64)

#include <arm_neon.h>

#include <cstring>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
// gcc's arm_neon.h declares vdotq_s32 under this target and inlines it only into supersets; SDOT
// exists only on Armv8.2+ cores, and these functions use nothing else of v8.2
#pragma GCC target("arch=armv8.2-a+dotprod")
// gcc's pre-allocation scheduler hoists the activation loads of all rows and spills the sums
// (Q6_K, 8 rows: ~280 stack accesses per super-block); without it the groups fit the registers
#pragma GCC optimize("no-schedule-insns")
#endif

#include "neon_common.h"

namespace dflash::kern::neon {

namespace {

enum class KQ { q4, q5, q6 };

// Per super-block state shared by all activation rows of a group.
struct Head {
    int32x4_t       sc[2];  // Q4_K/Q5_K: the scales of sub-blocks 4q .. 4q+3 in sc[q]
    uint8x16_t      qh[2];  // Q5_K: the 32 high-bit bytes
    float           d;
    const uint8_t * blk;
};

// The 12 scale bytes of Q4_K/Q5_K -> 8 scales, 8 mins (bytes, sub-block order), 32-bit word ops.
inline void kq_scales(const uint8_t * s, uint8x8_t & sc, uint8x8_t & m) {
    uint64_t sc8, m8;
    kq_scale_min_bytes(s, sc8, m8);
    sc = vcreate_u8(sc8);
    m  = vcreate_u8(m8);
}

// Decode a super-block's header; Q4_K/Q5_K also write dmin * m for its 8 sub-blocks to wmin.
template <KQ k>
inline void head(const uint8_t * blk, Head & h, float * wmin) {
    h.blk = blk;
    if constexpr (k == KQ::q6) {
        h.d = h2f(blk + 208);  // the 16 scales are widened per quad (qscales): fewer live registers
    } else {
        h.d              = h2f(blk);
        const float dmin = h2f(blk + 2);
        uint8x8_t   sc8, m8;
        kq_scales(blk + 4, sc8, m8);
        const uint16x8_t sc16 = vmovl_u8(sc8), m16 = vmovl_u8(m8);
        h.sc[0] = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(sc16)));
        h.sc[1] = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(sc16)));
        vst1q_f32(wmin, vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(m16))), dmin));
        vst1q_f32(wmin + 4, vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_high_u16(m16))), dmin));
        if constexpr (k == KQ::q5) {
            h.qh[0] = vld1q_u8(blk + 16);
            h.qh[1] = vld1q_u8(blk + 32);
        }
    }
}

// The int32 scales of the sub-blocks of quad q.
template <KQ k>
inline int32x4_t qscales(const Head & h, int q) {
    if constexpr (k == KQ::q6) {
        uint32_t s4;
        std::memcpy(&s4, h.blk + 192 + 4 * q, 4);
        const int8x8_t sc = vreinterpret_s8_u32(vdup_n_u32(s4));
        return vmovl_s16(vget_low_s16(vmovl_s8(sc)));
    } else {
        return h.sc[q];
    }
}

template <KQ k> constexpr int kQuads = k == KQ::q6 ? 4 : 2;     // quads of sub-blocks per super-block
template <KQ k> constexpr int kSubVecs = k == KQ::q6 ? 1 : 2;   // 16-byte vectors per sub-block

// The int8 weights of quad q (sub-blocks 4q .. 4q+3, in element order), straight from the block:
// Q4_K/Q5_K 8 vectors (0..15 / 0..31), Q6_K 4 vectors (q - 32: -32..31).
template <KQ k>
inline void wquad(const Head & h, int q, int8x16_t * w) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    if constexpr (k == KQ::q6) {
        // elements 64q..64q+63: 32-element chunks g = 2*(q&1) and g+1 of half hh = q/2; low 4 bits
        // from ql (nibble q&1 of ql[64hh + 32(g&1) + l]), high 2 bits from bits 2g.. of qh[32hh + l]
        const int        hh = q >> 1, hi_nib = q & 1;
        const uint8_t *  ql = h.blk + 64 * hh;
        const uint8_t *  qh = h.blk + 128 + 32 * hh;
        const uint8x16_t m2 = vdupq_n_u8(0x30);
        const int8x16_t  o  = vdupq_n_s8(32);
        DFLASH_UNROLL
        for (int v = 0; v < 2; ++v) {
            const uint8x16_t l0 = vld1q_u8(ql + 16 * v), l1 = vld1q_u8(ql + 32 + 16 * v);
            const uint8x16_t hb = vld1q_u8(qh + 16 * v);
            uint8x16_t       lo0, lo1, hi0, hi1;
            if (hi_nib) {
                lo0 = vshrq_n_u8(l0, 4);
                lo1 = vshrq_n_u8(l1, 4);
                hi0 = vandq_u8(hb, m2);
                hi1 = vandq_u8(vshrq_n_u8(hb, 2), m2);
            } else {
                lo0 = vandq_u8(l0, m4);
                lo1 = vandq_u8(l1, m4);
                hi0 = vandq_u8(vshlq_n_u8(hb, 4), m2);
                hi1 = vandq_u8(vshlq_n_u8(hb, 2), m2);
            }
            w[v]     = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo0, hi0)), o);
            w[2 + v] = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo1, hi1)), o);
        }
    } else {
        // qs[64q .. 64q+31]: low nibbles = sub-block 4q, high = 4q+1; the next 32 bytes 4q+2, 4q+3
        const uint8_t * qs = h.blk + (k == KQ::q4 ? 16 : 48) + 64 * q;
        DFLASH_UNROLL
        for (int c = 0; c < 2; ++c) {
            DFLASH_UNROLL
            for (int v = 0; v < 2; ++v) {
                const uint8x16_t x  = vld1q_u8(qs + 32 * c + 16 * v);
                uint8x16_t       lo = vandq_u8(x, m4), hi = vshrq_n_u8(x, 4);
                if constexpr (k == KQ::q5) {
                    // bit s of qh[l] is bit 4 of element l of sub-block s
                    const int        s  = 4 * q + 2 * c;
                    const uint8x16_t b0 = vdupq_n_u8(uint8_t(1u << s)), b1 = vdupq_n_u8(uint8_t(1u << (s + 1)));
                    const uint8x16_t x10 = vdupq_n_u8(0x10);
                    lo = vorrq_u8(lo, vandq_u8(vtstq_u8(h.qh[v], b0), x10));
                    hi = vorrq_u8(hi, vandq_u8(vtstq_u8(h.qh[v], b1), x10));
                }
                w[4 * c + v]     = vreinterpretq_s8_u8(lo);
                w[4 * c + 2 + v] = vreinterpretq_s8_u8(hi);
            }
        }
    }
}

// G activation rows against one weight row, block by block:
//   isum += lane_totals(sdot(w, a) per sub-block) * scales     per quad of sub-blocks and row
//   acc  += float(isum) * (d_w * d_a)                          per block and row
template <int G, int kBlockBytes, KQ k>
inline void group_rows(const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K, float * wmin,
                       float * out) {
    constexpr int kVecs = 4 * kSubVecs<k>;  // weight vectors per quad
    float32x4_t   accf[G];
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) accf[g] = vdupq_n_f32(0.0f);
    const int32x4_t zero = vdupq_n_s32(0);
    Head            h;
    for (int64_t b = 0; b < nb; ++b) {
        head<k>(wr + b * kBlockBytes, h, wmin + b * 8);
        int32x4_t isum[G];
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) isum[g] = zero;
        const size_t qoff = size_t(b) * 256;
        DFLASH_UNROLL
        for (int q = 0; q < kQuads<k>; ++q) {
            int8x16_t w[kVecs];
            wquad<k>(h, q, w);
            const int32x4_t sc = qscales<k>(h, q);
            DFLASH_UNROLL
            for (int g = 0; g < G; ++g) {
                const int8_t * a = reinterpret_cast<const int8_t *>(arow[g]) + qoff + 16 * kVecs * q;
                int32x4_t      p[4];
                DFLASH_UNROLL
                for (int s = 0; s < 4; ++s) {
                    p[s] = sdot(zero, w[kSubVecs<k> * s], vld1q_s8(a + 16 * kSubVecs<k> * s));
                    if constexpr (kSubVecs<k> == 2) p[s] = sdot(p[s], w[2 * s + 1], vld1q_s8(a + 32 * s + 16));
                }
                isum[g] = vmlaq_s32(isum[g], lane_totals(p[0], p[1], p[2], p[3]), sc);
            }
        }
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) {
            const float da = reinterpret_cast<const float *>(arow[g] + K)[b];
            accf[g]        = vfmaq_n_f32(accf[g], vcvtq_f32_s32(isum[g]), h.d * da);
        }
    }
    const int64_t ds_off = K + (K / 256) * 4 + (K / 16) * 2;
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        float r = vaddvq_f32(accf[g]);
        if constexpr (k != KQ::q6) r -= dot_f32(wmin, reinterpret_cast<const float *>(arow[g] + ds_off), nb * 8);
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
        default: group_rows<8, kBlockBytes, k>(wr, nb, arow, K, wmin, out); break;
    }
}

// 8 rows: 8 int32 sums + 8 float accumulators + up to 8 weight vectors + loads fit the 32
// vector registers
constexpr int kGroup = 8;

template <int kBlockBytes, KQ k>
void matmul_kq(const MatMulArgs & A) {
    const int64_t   nb = A.K / 256;
    const uint8_t * arow[kMaxRows];
    for (int j = 0; j < A.n; ++j) arow[j] = A.a + j * A.a_row_bytes;
    // split the rows into groups of at most kGroup, as even as possible (16 -> 8+8, 12 -> 6+6)
    const int n_groups = (A.n + kGroup - 1) / kGroup;
    float     wmin_small[512];
    float *   wmin     = wmin_small;
    float *   wmin_big = nullptr;
    if (nb * 8 > 512) wmin = wmin_big = new float[size_t(nb) * 8];
    float out[kMaxRows];
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
#if defined(__GNUC__)
        __builtin_prefetch(wr + 2 * A.w_row_bytes);
#endif
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

void quantize_a256(const float * x, uint8_t * row, int64_t K) {
    A256View v = a256_view(row, K);
    for (int64_t b = 0; b < K / 256; ++b) {
        const float * xb   = x + b * 256;
        const float   amax = amax_f32(xb, 256);
        const float   id   = amax > 0.0f ? 127.0f / amax : 0.0f;
        v.d[b]             = amax / 127.0f;
        const float32x4_t idv = vdupq_n_f32(id);
        int16_t           s16[16];
        for (int g = 0; g < 16; ++g) {
            const int8x16_t q = quant16(xb + 16 * g, idv);
            vst1q_s8(v.q + b * 256 + 16 * g, q);
            s16[g] = vaddlvq_s8(q);  // |sum| <= 16 * 127: exact in int16
        }
        std::memcpy(v.bsum + b * 16, s16, sizeof(s16));
        for (int g = 0; g < 8; ++g) v.ds[b * 8 + g] = v.d[b] * float(s16[2 * g] + s16[2 * g + 1]);
    }
}

void matmul_q4_K(const MatMulArgs & A) { matmul_kq<144, KQ::q4>(A); }
void matmul_q5_K(const MatMulArgs & A) { matmul_kq<176, KQ::q5>(A); }
void matmul_q6_K(const MatMulArgs & A) { matmul_kq<210, KQ::q6>(A); }

}  // namespace dflash::kern::neon

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif  // __aarch64__ || _M_ARM64
