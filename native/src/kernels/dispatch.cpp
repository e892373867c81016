// The one place that chooses an ISA for the kernels: CPUID (+ XGETBV: the OS must save the
// vector registers) at first use, then PYDFLASH_KERNELS_ISA=scalar|avx2|avx512|neon (or set_isa(), for
// tests) may force a lower one. Asking for an ISA the CPU lacks is refused (falls back to the
// best available, with a warning), so no path can raise an illegal instruction.
#include "kernels.h"

#include "ggml.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(DFLASH_KERNELS_X86)
#include <cpuid.h>
#endif
#if defined(DFLASH_KERNELS_ARM64)
#if defined(__APPLE__)
#include <sys/sysctl.h>
#elif defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#elif defined(_WIN32)
#include <windows.h>
#endif
#endif

namespace dflash::kern {

const char * isa_name(Isa isa) {
    switch (isa) {
        case Isa::scalar: return "scalar";
        case Isa::avx2:   return "avx2";
        case Isa::avx512: return "avx512";
        case Isa::neon:   return "neon";
    }
    return "?";
}

bool parse_isa(const char * s, Isa * out) {
    if (!s) return false;
    if (!strcmp(s, "scalar")) { *out = Isa::scalar; return true; }
    if (!strcmp(s, "avx2"))   { *out = Isa::avx2;   return true; }
    if (!strcmp(s, "avx512")) { *out = Isa::avx512; return true; }
    if (!strcmp(s, "neon"))   { *out = Isa::neon;   return true; }
    return false;
}

size_t act_row_bytes(Act act, int64_t K) {
    size_t n = act == Act::a256 ? size_t(K) + size_t(K / 256) * 4 + size_t(K / 16) * 2 + size_t(K / 32) * 4
                                : size_t(K) + size_t(K / 32) * 8;
    return (n + 63) & ~size_t(63);
}

float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16;
    const uint32_t exp  = (h >> 10) & 0x1F;
    const uint32_t man  = h & 0x3FF;
    uint32_t       bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: value = man * 2^-24
        float f = float(man) * (1.0f / 16777216.0f);
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

namespace {

bool cpu_has_avx2() {
#if defined(DFLASH_KERNELS_X86)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
    if (!(fma && osxsave && avx && f16c)) return false;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & 0x6) != 0x6) return false;  // XMM and YMM state saved by the OS
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return b & (1u << 5);  // AVX2
#else
    return false;
#endif
}

// AVX-512 F, DQ, BW, VL and VNNI (Ice Lake / Zen 4 and later), with the OS saving the opmask and
// ZMM state. A build checked under SIMDe's emulation (tests/kernels/isa_check.cpp) claims it.
bool cpu_has_avx512_vnni() {
#if defined(DFLASH_KERNELS_EMULATED_AVX512)
    return true;
#elif defined(DFLASH_KERNELS_X86)
    if (!cpu_has_avx2()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const unsigned need_b = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);  // F DQ BW VL
    if ((b & need_b) != need_b || !(c & (1u << 11))) return false;            // VNNI
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    return (xlo & 0xE6) == 0xE6;  // XMM, YMM, opmask, ZMM_Hi256, Hi16_ZMM
#else
    return false;
#endif
}

// arm64 Advanced SIMD is architectural; the dot-product extension (SDOT, ARMv8.2+; every Apple
// M-series core) is asked of the OS.
bool cpu_has_neon_dotprod() {
#if !defined(DFLASH_KERNELS_ARM64)
    return false;
#elif defined(__APPLE__)
    int    v = 0;
    size_t n = sizeof(v);
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &n, nullptr, 0) == 0 && v != 0;
#elif defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(_WIN32)
    return IsProcessorFeaturePresent(PF_ARM_V82_DP_INSTRUCTIONS_AVAILABLE) != 0;
#else
    return false;
#endif
}

Isa detect() {
    if (cpu_has_avx512_vnni()) return Isa::avx512;
    if (cpu_has_avx2()) return Isa::avx2;
    if (cpu_has_neon_dotprod()) return Isa::neon;
    return Isa::scalar;
}

Isa best() {
    static const Isa b = detect();
    return b;
}

std::atomic<int> g_active{-1};

#define DFLASH_ROW(ns, type, blk, act, name) \
    {type, blk, act, ns::matmul_##name, act == Act::a256 ? ns::quantize_a256 : ns::quantize_a32}

// the seven covered types of one ISA namespace
#define DFLASH_TABLE(ns)                                        \
    {                                                           \
        DFLASH_ROW(ns, GGML_TYPE_Q4_K, 256, Act::a256, q4_K),   \
        DFLASH_ROW(ns, GGML_TYPE_Q5_K, 256, Act::a256, q5_K),   \
        DFLASH_ROW(ns, GGML_TYPE_Q6_K, 256, Act::a256, q6_K),   \
        DFLASH_ROW(ns, GGML_TYPE_Q4_0, 32, Act::a32, q4_0),     \
        DFLASH_ROW(ns, GGML_TYPE_Q4_1, 32, Act::a32, q4_1),     \
        DFLASH_ROW(ns, GGML_TYPE_Q5_0, 32, Act::a32, q5_0),     \
        DFLASH_ROW(ns, GGML_TYPE_Q8_0, 32, Act::a32, q8_0),     \
    }

const TypeKernels k_scalar[] = DFLASH_TABLE(scalar);
#if defined(DFLASH_KERNELS_X86)
const TypeKernels k_avx2[]   = DFLASH_TABLE(avx2);
const TypeKernels k_avx512[] = DFLASH_TABLE(avx512);
#endif
#if defined(DFLASH_KERNELS_ARM64)
const TypeKernels k_neon[] = DFLASH_TABLE(neon);
#endif
#undef DFLASH_TABLE
#undef DFLASH_ROW

template <size_t N>
const TypeKernels * find(const TypeKernels (&table)[N], int type) {
    for (const auto & k : table) {
        if (k.ggml_type == type) return &k;
    }
    return nullptr;
}

}  // namespace

Isa best_isa() { return best(); }

bool isa_available(Isa isa) {
    switch (isa) {
        case Isa::scalar: return true;
        // an AVX-512 machine runs the AVX2 path too; arm64 has only scalar and neon
        case Isa::avx2:   return best() == Isa::avx2 || best() == Isa::avx512;
        case Isa::avx512: return best() == Isa::avx512;
        case Isa::neon:   return best() == Isa::neon;
    }
    return false;
}

Isa active_isa() {
    int v = g_active.load(std::memory_order_relaxed);
    if (v >= 0) return Isa(v);
    Isa         isa = best();
    const char * env = std::getenv("PYDFLASH_KERNELS_ISA");
    if (env && *env && strcmp(env, "auto") != 0) {
        Isa want;
        if (!parse_isa(env, &want)) {
            fprintf(stderr, "pydflash: PYDFLASH_KERNELS_ISA=%s is not one of scalar, avx2, avx512, neon, auto; using %s\n",
                    env, isa_name(isa));
        } else if (!isa_available(want)) {
            fprintf(stderr, "pydflash: PYDFLASH_KERNELS_ISA=%s is not available on this CPU/build; using %s\n",
                    env, isa_name(isa));
        } else {
            isa = want;
        }
    }
    int expected = -1;
    g_active.compare_exchange_strong(expected, int(isa));
    return Isa(g_active.load());
}

bool set_isa(Isa isa) {
    if (!isa_available(isa)) return false;
    g_active.store(int(isa));
    return true;
}

const TypeKernels * kernels_for(int type, Isa isa) {
    if (!isa_available(isa)) return nullptr;
    switch (isa) {
        case Isa::scalar: return find(k_scalar, type);
#if defined(DFLASH_KERNELS_X86)
        case Isa::avx2:   return find(k_avx2, type);
        case Isa::avx512: return find(k_avx512, type);
#endif
#if defined(DFLASH_KERNELS_ARM64)
        case Isa::neon: return find(k_neon, type);
#endif
        default: return nullptr;
    }
}

const TypeKernels * kernels_for(int type) { return kernels_for(type, active_isa()); }

bool enabled_from_env() {
    // on by default wherever the CPU has a SIMD path (the multi-row verify is what makes drafting
    // pay on a CPU, and the one-row step is no slower than ggml's); a CPU with only the scalar
    // reference keeps ggml's. PYDFLASH_KERNELS=0 (off, false, no) is the way back to ggml's stock
    // kernels, e.g. for output bit-identical to llama.cpp's; =1 forces them on.
    const char * env = std::getenv("PYDFLASH_KERNELS");
    if (!env || !*env) return best() != Isa::scalar;
    return !(strcmp(env, "0") == 0 || strcmp(env, "off") == 0 || strcmp(env, "false") == 0 || strcmp(env, "no") == 0);
}

}  // namespace dflash::kern
