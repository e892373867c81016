// Shared by the AVX2 kernel files: compiled for AVX2/FMA/F16C through the target pragma that
// each file opens before including this (the baseline build needs no flags; dispatch.cpp calls
// these paths only on CPUs that have them).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__clang__)
#define DFLASH_UNROLL _Pragma("unroll")
#else
#define DFLASH_UNROLL _Pragma("GCC unroll 16")
#endif

// An empty asm that claims to change a vector register: the compiler must keep the value there
// and cannot reassociate the additions across it (no instruction is emitted).
#if defined(__GNUC__) || defined(__clang__)
#define DFLASH_PIN(v) __asm__("" : "+x"(v))
#else
#define DFLASH_PIN(v) ((void) 0)
#endif

namespace dflash::kern::avx2 {

// sum of the 8 lanes
inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// one IEEE half (a block scale) to float
inline float h2f(const uint8_t * p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

}  // namespace dflash::kern::avx2
