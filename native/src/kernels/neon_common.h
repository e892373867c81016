// Shared by the NEON kernel files: compiled with the dot-product extension through the target
// pragma that each file opens before including this (the baseline arm64 build has no +dotprod;
// dispatch.cpp calls these paths only where the OS reports SDOT: HWCAP_ASIMDDP, FEAT_DotProd).
#pragma once

#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#if defined(__clang__)
#define DFLASH_UNROLL _Pragma("unroll")
#else
#define DFLASH_UNROLL _Pragma("GCC unroll 16")
#endif

// clang before 16 (Apple clang before 15) declares vdotq_s32 only under a global +dotprod, so
// there SDOT is inline asm (its integrated assembler takes it in a target("dotprod") function).
#if defined(__clang__) && !defined(__ARM_FEATURE_DOTPROD) && \
    ((defined(__apple_build_version__) && __clang_major__ < 15) || (!defined(__apple_build_version__) && __clang_major__ < 16))
#define DFLASH_NEON_SDOT_ASM 1
#endif

namespace dflash::kern::neon {

// acc + per int32 lane the dot product of 4 signed byte pairs (SDOT)
inline int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(DFLASH_NEON_SDOT_ASM)
    __asm__("sdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
#else
    return vdotq_s32(acc, a, b);
#endif
}

// the 4 int32 lane totals of p0..p3 as one vector: {sum p0, sum p1, sum p2, sum p3}
inline int32x4_t lane_totals(int32x4_t p0, int32x4_t p1, int32x4_t p2, int32x4_t p3) {
    return vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3));
}

// IEEE halves (block scales) to float: FCVTL is base arm64, exact for every half
inline float h2f(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}
inline float32x4_t h2f4(const uint16_t * h) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h))); }

inline float dot_f32(const float * x, const float * y, int64_t n) {
    float32x4_t acc = vdupq_n_f32(0.0f);
    int64_t     i   = 0;
    for (; i + 4 <= n; i += 4) acc = vfmaq_f32(acc, vld1q_f32(x + i), vld1q_f32(y + i));
    float s = vaddvq_f32(acc);
    for (; i < n; ++i) s += x[i] * y[i];
    return s;
}

// |x| maximum of n floats (n multiple of 16); maxnm ignores NaN as the scalar path's fmax does
inline float amax_f32(const float * x, int n) {
    float32x4_t m0 = vdupq_n_f32(0.0f), m1 = m0;
    for (int i = 0; i < n; i += 8) {
        m0 = vmaxnmq_f32(m0, vabsq_f32(vld1q_f32(x + i)));
        m1 = vmaxnmq_f32(m1, vabsq_f32(vld1q_f32(x + i + 4)));
    }
    return vmaxnmvq_f32(vmaxnmq_f32(m0, m1));
}

// 16 floats -> 16 int8: x * id rounded to nearest even (vcvtnq, as the scalar nearbyint), clamped
// to [-127, 127] as the scalar path (the saturating narrows give [-128, 127])
inline int8x16_t quant16(const float * x, float32x4_t id) {
    const int32x4_t i0 = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + 0), id));
    const int32x4_t i1 = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + 4), id));
    const int32x4_t i2 = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + 8), id));
    const int32x4_t i3 = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x + 12), id));
    const int16x8_t lo = vcombine_s16(vqmovn_s32(i0), vqmovn_s32(i1));
    const int16x8_t hi = vcombine_s16(vqmovn_s32(i2), vqmovn_s32(i3));
    return vmaxq_s8(vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)), vdupq_n_s8(-127));
}

}  // namespace dflash::kern::neon
