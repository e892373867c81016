// Legacy 32-element block types (Q4_0, Q4_1, Q5_0, Q8_0), arm64 NEON + dot-product extension
// path (chosen at run time by dispatch.cpp; per-function target attributes, no file flags).
//
// Per weight row, 4 blocks at a time: unpack the 4 x 32 quants once into int8 registers, then for
// every activation row: p_b = sdot(w_b, a_b) per block, the 4 blocks' lane totals as one vector
// (2 ADDP levels), acc += float(totals) * (d_w * d_a) for the 4 blocks in one FMA.
// SDOT is signed x signed, so the Q4_0 / Q5_0 offsets are subtracted in int8 (q - 8, q - 16 fit):
// that integer dot is exactly the scalar path's  dot - 8 * sum(q_a)  (resp. 16). Q4_1's min stays
// out of the inner loop: sum_b m_w[b] * s_a[b] (s_a = d_a * sum(q_a)), one short float dot per
// (weight row, activation row).
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

enum class Kind { q4_0, q4_1, q5_0, q8_0 };

template <Kind k> constexpr int block_bytes() {
    return k == Kind::q4_0 ? 18 : k == Kind::q4_1 ? 20 : k == Kind::q5_0 ? 22 : 34;
}

// The 32 quants of a block as int8 (element order: w0 = elements 0..15, w1 = 16..31):
// Q8_0 as stored, Q4_0 q - 8, Q4_1 q (0..15), Q5_0 q - 16.
template <Kind kKind>
inline void unpack(const uint8_t * blk, int8x16_t & w0, int8x16_t & w1) {
    if constexpr (kKind == Kind::q8_0) {
        w0 = vld1q_s8(reinterpret_cast<const int8_t *>(blk + 2));
        w1 = vld1q_s8(reinterpret_cast<const int8_t *>(blk + 18));
    } else {
        const uint8x16_t q  = vld1q_u8(blk + (kKind == Kind::q4_0 ? 2 : kKind == Kind::q4_1 ? 4 : 6));
        uint8x16_t       lo = vandq_u8(q, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(q, 4);
        if constexpr (kKind == Kind::q4_0) {
            w0 = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(8));
            w1 = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(8));
        } else if constexpr (kKind == Kind::q4_1) {
            w0 = vreinterpretq_s8_u8(lo);
            w1 = vreinterpretq_s8_u8(hi);
        } else {
            // bit l of qh -> byte l (table lookup of its byte, then test of its bit); q - 16 is the
            // nibble with 0xF0 over it where the bit is clear, the nibble alone where it is set
            uint32_t qh;
            std::memcpy(&qh, blk + 2, 4);
            const uint8x16_t bytes = vreinterpretq_u8_u32(vdupq_n_u32(qh));
            const uint8x16_t idx0  = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
            const uint8x16_t idx1  = {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
            const uint8x16_t bit   = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull));
            const uint8x16_t set0  = vtstq_u8(vqtbl1q_u8(bytes, idx0), bit);
            const uint8x16_t set1  = vtstq_u8(vqtbl1q_u8(bytes, idx1), bit);
            const uint8x16_t f0    = vdupq_n_u8(0xF0);
            w0 = vreinterpretq_s8_u8(vorrq_u8(lo, vbicq_u8(f0, set0)));
            w1 = vreinterpretq_s8_u8(vorrq_u8(hi, vbicq_u8(f0, set1)));
        }
    }
}

// G rows over blocks [b, b+4): one weight unpack, per row 8 SDOT, the lane totals, one FMA
template <int G, Kind kKind>
inline void rows_quad(const uint8_t * wr, int64_t b, const uint8_t * const * arow, int64_t K, float32x4_t * accf) {
    constexpr int kBytes = block_bytes<kKind>();
    int8x16_t     w[8];
    uint16_t      dh[4];
    DFLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
        const uint8_t * blk = wr + (b + i) * kBytes;
        unpack<kKind>(blk, w[2 * i], w[2 * i + 1]);
        std::memcpy(&dh[i], blk, 2);
    }
    const float32x4_t dw   = h2f4(dh);
    const int32x4_t   zero = vdupq_n_s32(0);
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        const int8_t * a = reinterpret_cast<const int8_t *>(arow[g]) + b * 32;
        int32x4_t      p[4];
        DFLASH_UNROLL
        for (int i = 0; i < 4; ++i) {
            p[i] = sdot(sdot(zero, w[2 * i], vld1q_s8(a + 32 * i)), w[2 * i + 1], vld1q_s8(a + 32 * i + 16));
        }
        const float32x4_t da = vld1q_f32(reinterpret_cast<const float *>(arow[g] + K) + b);
        accf[g] = vfmaq_f32(accf[g], vcvtq_f32_s32(lane_totals(p[0], p[1], p[2], p[3])), vmulq_f32(dw, da));
    }
}

// the last nb % 4 blocks, one at a time
template <int G, Kind kKind>
inline void rows_one(const uint8_t * wr, int64_t b, const uint8_t * const * arow, int64_t K, float32x4_t * accf) {
    const uint8_t * blk = wr + b * block_bytes<kKind>();
    int8x16_t       w0, w1;
    unpack<kKind>(blk, w0, w1);
    const float     dw   = h2f(blk);
    const int32x4_t zero = vdupq_n_s32(0);
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        const int8_t *  a  = reinterpret_cast<const int8_t *>(arow[g]) + b * 32;
        const int32x4_t p  = sdot(sdot(zero, w0, vld1q_s8(a)), w1, vld1q_s8(a + 16));
        const float     da = reinterpret_cast<const float *>(arow[g] + K)[b];
        accf[g]            = vfmaq_n_f32(accf[g], vcvtq_f32_s32(p), dw * da);
    }
}

template <int G, Kind kKind>
inline void rows_all(const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K, float32x4_t * accf) {
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) accf[g] = vdupq_n_f32(0.0f);
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) rows_quad<G, kKind>(wr, b, arow, K, accf);
    for (; b < nb; ++b) rows_one<G, kKind>(wr, b, arow, K, accf);
}

template <Kind kKind>
inline void rows_dispatch(int G, const uint8_t * wr, int64_t nb, const uint8_t * const * arow, int64_t K,
                          float32x4_t * accf) {
    switch (G) {
        case 1: rows_all<1, kKind>(wr, nb, arow, K, accf); break;
        case 2: rows_all<2, kKind>(wr, nb, arow, K, accf); break;
        case 3: rows_all<3, kKind>(wr, nb, arow, K, accf); break;
        case 4: rows_all<4, kKind>(wr, nb, arow, K, accf); break;
        case 5: rows_all<5, kKind>(wr, nb, arow, K, accf); break;
        case 6: rows_all<6, kKind>(wr, nb, arow, K, accf); break;
        case 7: rows_all<7, kKind>(wr, nb, arow, K, accf); break;
        default: rows_all<8, kKind>(wr, nb, arow, K, accf); break;
    }
}

// 8 rows: 8 float accumulators + 8 weight vectors + the 4 dots and loads of a row fit the 32
// vector registers
constexpr int kGroup = 8;

template <Kind kKind>
void matmul_legacy(const MatMulArgs & A) {
    constexpr int   kBytes = block_bytes<kKind>();
    const int64_t   nb     = A.K / 32;
    const uint8_t * arow[kMaxRows];
    for (int j = 0; j < A.n; ++j) arow[j] = A.a + j * A.a_row_bytes;
    const int n_groups = (A.n + kGroup - 1) / kGroup;
    // Q4_1: the per-block weight mins, the coefficients of the activation block sums s_a
    float   mins_small[1024];
    float * mins     = mins_small;
    float * mins_big = nullptr;
    if (kKind == Kind::q4_1 && nb > 1024) mins = mins_big = new float[size_t(nb)];
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
#if defined(__GNUC__)
        __builtin_prefetch(wr + 2 * A.w_row_bytes);
#endif
        float32x4_t accf[kMaxRows];
        int         j0 = 0;
        for (int gi = 0; gi < n_groups; ++gi) {
            const int G = (A.n - j0) / (n_groups - gi);
            rows_dispatch<kKind>(G, wr, nb, arow + j0, A.K, accf + j0);
            j0 += G;
        }
        if constexpr (kKind == Kind::q4_1) {
            for (int64_t b = 0; b < nb; ++b) mins[b] = h2f(wr + b * kBytes + 2);
            for (int j = 0; j < A.n; ++j) {
                const float * sa = reinterpret_cast<const float *>(arow[j] + A.K + nb * 4);
                A.c[j * A.c_row_floats + r] = vaddvq_f32(accf[j]) + dot_f32(mins, sa, nb);
            }
        } else {
            for (int j = 0; j < A.n; ++j) A.c[j * A.c_row_floats + r] = vaddvq_f32(accf[j]);
        }
    }
    delete[] mins_big;
}

}  // namespace

void quantize_a32(const float * x, uint8_t * row, int64_t K) {
    A32View v = a32_view(row, K);
    for (int64_t b = 0; b < K / 32; ++b) {
        const float *     xb   = x + b * 32;
        const float       amax = amax_f32(xb, 32);
        const float       id   = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float       d    = amax / 127.0f;
        const float32x4_t idv  = vdupq_n_f32(id);
        const int8x16_t   q0   = quant16(xb, idv), q1 = quant16(xb + 16, idv);
        vst1q_s8(v.q + b * 32, q0);
        vst1q_s8(v.q + b * 32 + 16, q1);
        const int sum = int(vaddlvq_s8(q0)) + int(vaddlvq_s8(q1));
        v.d[b]        = d;
        v.s[b]        = d * float(sum);
    }
}

void matmul_q4_0(const MatMulArgs & A) { matmul_legacy<Kind::q4_0>(A); }
void matmul_q4_1(const MatMulArgs & A) { matmul_legacy<Kind::q4_1>(A); }
void matmul_q5_0(const MatMulArgs & A) { matmul_legacy<Kind::q5_0>(A); }
void matmul_q8_0(const MatMulArgs & A) { matmul_legacy<Kind::q8_0>(A); }

}  // namespace dflash::kern::neon

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

#endif  // __aarch64__ || _M_ARM64
