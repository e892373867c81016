// Multi-row quantized mat-mul kernels (issue #15): C[j][r] = sum_k W[r][k] * X[j][k] for a
// quantized weight matrix W (ggml block layout, untouched) and 1..16 F32 activation rows X that
// are first quantized to int8 in one of our own activation layouts.
//
// The point of these kernels: every weight block is unpacked ONCE (nibbles, high bits, 6-bit
// scales and mins) and then applied to all activation rows, so an extra row costs roughly the
// int8 dot product alone. ggml's CPU mat-mul calls vec_dot once per (weight row, activation row)
// and re-unpacks every block for each row.
//
// Layout of this directory:
//   kernels.h          this interface (internal to libdflash)
//   dispatch.cpp       CPUID detection, PYDFLASH_KERNELS / PYDFLASH_KERNELS_ISA, kernel tables:
//                      the ONLY place that chooses an ISA
//   kquant_*.cpp       Q4_K, Q5_K, Q6_K (256-element super-blocks), activations in layout A256
//   legacy_*.cpp       Q4_0, Q4_1, Q5_0, Q8_0 (32-element blocks), activations in layout A32
//                      (*_scalar.cpp is the portable reference; *_avx2.cpp, *_avx512.cpp
//                      (AVX-512 VNNI) and *_neon.cpp (arm64 dotprod) the SIMD paths, built
//                      with per-function target attributes so the baseline build needs no flags)
//   cpu_buffer.cpp     the CPU "extra buffer type" that puts these kernels inside ggml-cpu's
//                      graph compute (no scheduler splits), and its registration
//   selftest.cpp       checks against ggml's own CPU mat-mul and a float64 reference
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dflash::kern {

// avx512 = AVX-512 F/BW/VL/DQ + VNNI; neon = arm64 Advanced SIMD + the dot-product extension
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, neon = 3 };
const char * isa_name(Isa isa);

// Activation layouts (one quantized row; rows are stored at a fixed stride):
//   A256 (K-quants): int8 q[K] | float d[K/256] | int16 bsum[K/16] | float ds[K/32]   x ~= d[b] * q
//                    (bsum: sums of q per 16; ds: d[b] * sum of q per 32, for the Q4_K/Q5_K mins)
//   A32  (legacy)  : int8 q[K] | float d[K/32]  | float s[K/32]          s[b] = d[b] * sum(q of b)
// Scales: d = amax/127 of the block, q = round-to-nearest-even(x * 127/amax), |q| <= 127; every
// ISA's quantizer gives bit-identical rows.
enum class Act : int { a256 = 0, a32 = 1 };
size_t act_row_bytes(Act act, int64_t K);  // padded to 64 bytes

struct MatMulArgs {
    const uint8_t * w;           // weight row r at w + r * w_row_bytes
    size_t          w_row_bytes;
    const uint8_t * a;           // activation row j at a + j * a_row_bytes (layout of the type)
    size_t          a_row_bytes;
    float *         c;           // result row j at c + j * c_row_floats, element r
    size_t          c_row_floats;
    int64_t         K;           // row length (multiple of the type's block size)
    int64_t         r0, r1;      // weight rows [r0, r1)
    int             n;           // activation rows, 1..kMaxRows
};

constexpr int kMaxRows = 16;

// Software prefetch of the weight stream. One core's stream of weight rows does not reach DRAM
// speed on the hardware prefetchers alone (measured on a 2-vCPU AVX-512 Xeon VM: the
// Qwen2.5-Coder-1.5B one-row step 71.8 ms -> 45.0 ms with the lines 1 KiB ahead fetched, ggml's
// own 61 ms; 2 KiB gave the same). Call once per block (or block pair) read, in address order:
// consecutive calls then cover every line of the stream once, kPrefetchAhead bytes early.
constexpr int64_t kPrefetchAhead = 1024;

template <int kBytes>
inline void prefetch_ahead(const uint8_t * blk) {
#if defined(__GNUC__) || defined(__clang__)
    for (int o = 0; o < kBytes; o += 64) __builtin_prefetch(blk + kPrefetchAhead + o, 0, 3);
#else
    (void) blk;  // MSVC: the hardware prefetchers alone
#endif
}

using MatMulFn = void (*)(const MatMulArgs & args);
using QuantFn  = void (*)(const float * x, uint8_t * row, int64_t K);

struct TypeKernels {
    int       ggml_type;  // enum ggml_type
    int       block;      // elements per block (32 or 256)
    Act       act;
    MatMulFn  matmul;
    QuantFn   quantize;   // one F32 row -> activation layout `act`
};

// The kernels for a ggml type with the active ISA (nullptr: type not covered).
const TypeKernels * kernels_for(int ggml_type);
const TypeKernels * kernels_for(int ggml_type, Isa isa);  // nullptr if `isa` not built / not on this CPU

// Active ISA: best the CPU has, unless PYDFLASH_KERNELS_ISA or set_isa() says otherwise.
Isa  active_isa();
Isa  best_isa();                 // what CPUID (and OS register support) allows
bool isa_available(Isa isa);     // built in and supported by this CPU
bool set_isa(Isa isa);           // false (and no change) if not available
bool parse_isa(const char * s, Isa * out);

// Whether new weights go into our buffer type (PYDFLASH_KERNELS, read at each model load).
bool enabled_from_env();

// ---- per-family entry points (defined in the family files, used only by dispatch.cpp) ----
// Every ISA namespace declares the same set.
#define DFLASH_KERNEL_ENTRY_POINTS                                   \
    void quantize_a256(const float * x, uint8_t * row, int64_t K); \
    void quantize_a32(const float * x, uint8_t * row, int64_t K);  \
    void matmul_q4_K(const MatMulArgs & a);                         \
    void matmul_q5_K(const MatMulArgs & a);                         \
    void matmul_q6_K(const MatMulArgs & a);                         \
    void matmul_q4_0(const MatMulArgs & a);                         \
    void matmul_q4_1(const MatMulArgs & a);                         \
    void matmul_q5_0(const MatMulArgs & a);                         \
    void matmul_q8_0(const MatMulArgs & a);
namespace scalar {
DFLASH_KERNEL_ENTRY_POINTS
}  // namespace scalar

#if defined(__x86_64__) || defined(_M_X64)
#define DFLASH_KERNELS_X86 1
namespace avx2 {
DFLASH_KERNEL_ENTRY_POINTS
}  // namespace avx2
namespace avx512 {
DFLASH_KERNEL_ENTRY_POINTS
}  // namespace avx512
#endif

#if defined(__aarch64__) || defined(_M_ARM64)
#define DFLASH_KERNELS_ARM64 1
namespace neon {
DFLASH_KERNEL_ENTRY_POINTS
}  // namespace neon
#endif

// ---- activation layout helpers shared by all files ----
struct A256View {
    int8_t *  q;
    float *   d;
    int16_t * bsum;
    float *   ds;
};
struct A32View {
    int8_t * q;
    float *  d;
    float *  s;
};
inline A256View a256_view(uint8_t * row, int64_t K) {
    return {reinterpret_cast<int8_t *>(row), reinterpret_cast<float *>(row + K),
            reinterpret_cast<int16_t *>(row + K + (K / 256) * 4),
            reinterpret_cast<float *>(row + K + (K / 256) * 4 + (K / 16) * 2)};
}
inline A32View a32_view(uint8_t * row, int64_t K) {
    return {reinterpret_cast<int8_t *>(row), reinterpret_cast<float *>(row + K),
            reinterpret_cast<float *>(row + K + (K / 32) * 4)};
}
inline A256View a256_view(const uint8_t * row, int64_t K) { return a256_view(const_cast<uint8_t *>(row), K); }
inline A32View  a32_view(const uint8_t * row, int64_t K) { return a32_view(const_cast<uint8_t *>(row), K); }

// fp16 -> fp32 without ggml's tables (exact for every finite half, incl. subnormals)
float half_to_float(uint16_t h);

// 6-bit scale and min j (0..7) of a Q4_K / Q5_K super-block's 12 scale bytes
inline void kq_scale_min(int j, const uint8_t * s, int & sc, int & m) {
    if (j < 4) {
        sc = s[j] & 63;
        m  = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        m  = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The 12 scale bytes of a Q4_K / Q5_K super-block -> its 8 six-bit scales and 8 mins, one per
// byte in sub-block order, with 32-bit word operations (shared by the SIMD paths)
inline void kq_scale_min_bytes(const uint8_t * s, uint64_t & sc8, uint64_t & m8) {
    uint32_t w0, w1, w2;
    std::memcpy(&w0, s, 4);
    std::memcpy(&w1, s + 4, 4);
    std::memcpy(&w2, s + 8, 4);
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu;
    const uint32_t m_lo  = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    const uint32_t m_hi  = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
    sc8                  = uint64_t(sc_lo) | (uint64_t(sc_hi) << 32);
    m8                   = uint64_t(m_lo) | (uint64_t(m_hi) << 32);
}

}  // namespace dflash::kern
