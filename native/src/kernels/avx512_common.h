// Shared by the AVX-512 kernel files (AVX-512 F/BW/VL/DQ + VNNI). Each file opens the target
// pragma before including this, so the baseline build needs no flags; dispatch.cpp calls these
// paths only on CPUs that have them.
//
// DFLASH_KERNELS_EMULATED_AVX512 builds the same code against SIMDe's portable implementation of
// the intrinsics (tests/test_kernels_emulated.py), which is how the path is checked on machines
// without AVX-512.
#pragma once

#include "kernels.h"

#include <cstdint>
#include <cstring>

#if defined(DFLASH_KERNELS_EMULATED_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
// The few intrinsics SIMDe 0.7 lacks, element by element (emulated test builds only).
namespace dflash::kern::avx512::emu {
inline __m512 cvtepi32_ps(__m512i v) {
    alignas(64) int32_t i[16];
    alignas(64) float   f[16];
    _mm512_store_si512(i, v);
    for (int k = 0; k < 16; ++k) f[k] = float(i[k]);
    return _mm512_load_ps(f);
}
inline __m256 extractf32x8_ps(__m512 v, int hi) {
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    return _mm256_load_ps(f + 8 * hi);
}
inline __m512i zextsi256_si512(__m256i v) { return _mm512_inserti64x4(_mm512_setzero_si512(), v, 0); }
inline __m512i zextsi128_si512(__m128i v) { return _mm512_inserti32x4(_mm512_setzero_si512(), v, 0); }
}  // namespace dflash::kern::avx512::emu
#define _mm512_cvtepi32_ps     dflash::kern::avx512::emu::cvtepi32_ps
#define _mm512_extractf32x8_ps dflash::kern::avx512::emu::extractf32x8_ps
#define _mm512_zextsi256_si512 dflash::kern::avx512::emu::zextsi256_si512
#define _mm512_zextsi128_si512 dflash::kern::avx512::emu::zextsi128_si512
#define _cvtu64_mask64(x)      ((simde__mmask64) (x))
#else
#include <immintrin.h>
#endif

#if defined(__clang__)
#define DFLASH_UNROLL _Pragma("unroll")
#else
#define DFLASH_UNROLL _Pragma("GCC unroll 16")
#endif

namespace dflash::kern::avx512 {

inline float hsum16(__m512 v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128       s  = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s               = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s               = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// one IEEE half (a block scale) to float
inline float h2f(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(DFLASH_KERNELS_EMULATED_AVX512)
    return half_to_float(h);
#else
    return _cvtsh_ss(h);
#endif
}

// float dot of n terms (the mins / offsets, once per weight row and activation row)
inline float dot_f32(const float * x, const float * y, int64_t n) {
    __m512  acc = _mm512_setzero_ps();
    int64_t i   = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
    float s = hsum16(acc);
    for (; i < n; ++i) s += x[i] * y[i];
    return s;
}

}  // namespace dflash::kern::avx512
