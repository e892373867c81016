// Legacy 32-element block types (Q4_0, Q5_0, Q8_0), AVX-512 VNNI path (chosen at run time by
// dispatch.cpp; per-function target attributes, no file flags). Q4_1 runs AVX2's kernel (below).
//
// Two blocks per register. The weights are taken as SIGNED bytes (Q4_0 q-8, Q5_0 q-16, Q8_0 q)
// and the activations as unsigned (a + 128, prepared once per call), so vpdpbusd gives
//   sum (a + 128) * w  per 4 weights;  starting each sum at -128 * sum(w) (weight side, computed
// once per block pair for all rows) leaves exactly sum a * w: one instruction per 64 weights and
// row, and no offset terms.
// The float step per block pair and row multiplies by d_w and by d_a expanded to the lanes (also
// prepared once per call).
#include "kernels.h"

// Standard headers before the target pragma: under it, gcc 13 compiles their always_inline members
// for AVX-512 and then refuses to inline them into the untargeted callers ("target specific option
// mismatch"). Only intrinsic headers belong inside.
#include <vector>

#if defined(DFLASH_KERNELS_X86)

#if !defined(DFLASH_KERNELS_EMULATED_AVX512)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
// gcc 12 warns about its own intrinsic headers' "undefined" registers under a target pragma
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

#include "avx512_common.h"

namespace dflash::kern::avx512 {

namespace {

enum class Kind { q4_0, q5_0, q8_0 };

template <Kind k> constexpr int block_bytes() {
    return k == Kind::q4_0 ? 18 : k == Kind::q5_0 ? 22 : 34;
}

// the 16 quant bytes of two blocks -> 64 values: [lo(a) | hi(a) | lo(b) | hi(b)] by 128-bit lane
inline __m512i nibbles2(const uint8_t * qa, const uint8_t * qb) {
    const __m256i x  = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(qa))),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i *>(qb)), 1);
    const __m512i z  = _mm512_castsi256_si512(x);
    const __m512i zz = _mm512_shuffle_i32x4(z, z, 0x50);  // lanes a, a, b, b
    const __m512i sh = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                         0x0004000400040004LL, 0x0004000400040004LL);
    return _mm512_and_si512(_mm512_srlv_epi16(zz, sh), _mm512_set1_epi8(0x0F));
}

// Signed quants of blocks b and b+1 (the second may be absent: zeros).
template <Kind k>
inline __m512i wvec2(const uint8_t * ba, const uint8_t * bb) {
    static const uint8_t zeros[34] = {};
    if (!bb) bb = zeros;
    if constexpr (k == Kind::q8_0) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(ba + 2));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(bb + 2));
        return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    } else if constexpr (k == Kind::q4_0) {
        return _mm512_sub_epi8(nibbles2(ba + 2, bb + 2), _mm512_set1_epi8(8));
    } else {
        uint32_t ha, hb;
        std::memcpy(&ha, ba + 2, 4);
        std::memcpy(&hb, bb + 2, 4);
        const auto      hi = _cvtu64_mask64(uint64_t(ha) | (uint64_t(hb) << 32));
        const __m512i   q  = nibbles2(ba + 6, bb + 6);
        return _mm512_sub_epi8(_mm512_mask_add_epi8(q, hi, q, _mm512_set1_epi8(0x10)), _mm512_set1_epi8(16));
    }
}

// Per call: each activation row as unsigned bytes (a + 128) and its block scales expanded to
// the 8 lanes of each block, padded to whole block pairs with zeros.
struct Prepared {
    std::vector<uint8_t> au;   // n rows x kp bytes
    std::vector<float>   dx;   // n rows x (kp / 4) floats
    int64_t              kp = 0;
};

void prepare(const MatMulArgs & A, Prepared & P) {
    const int64_t nb = A.K / 32;
    P.kp             = (nb + 1) / 2 * 64;
    P.au.assign(size_t(A.n) * size_t(P.kp), 0);
    P.dx.assign(size_t(A.n) * size_t(P.kp / 4), 0.0f);
    for (int j = 0; j < A.n; ++j) {
        const A32View  v  = a32_view(A.a + j * A.a_row_bytes, A.K);
        uint8_t *      au = P.au.data() + size_t(j) * size_t(P.kp);
        float *        dx = P.dx.data() + size_t(j) * size_t(P.kp / 4);
        const __m512i  fl = _mm512_set1_epi8(char(0x80));
        int64_t        i  = 0;
        for (; i + 64 <= A.K; i += 64) {
            _mm512_storeu_si512(au + i, _mm512_xor_si512(_mm512_loadu_si512(v.q + i), fl));
        }
        for (; i < A.K; ++i) au[i] = uint8_t(v.q[i] ^ 0x80);
        for (int64_t b = 0; b < nb; ++b) _mm256_storeu_ps(dx + 8 * b, _mm256_set1_ps(v.d[b]));
        // padding of a last odd block: a = 0 (128 unsigned) against zero weights adds nothing
        for (int64_t t = A.K; t < P.kp; ++t) au[t] = 0x80;
    }
}

template <int G, Kind k>
inline void rows_all(const uint8_t * wr, int64_t nb, const Prepared & P, int j0, float * out) {
    constexpr int kBytes = block_bytes<k>();
    const uint8_t * au[G];
    const float *   dx[G];
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) {
        au[g] = P.au.data() + size_t(j0 + g) * size_t(P.kp);
        dx[g] = P.dx.data() + size_t(j0 + g) * size_t(P.kp / 4);
    }
    __m512 accf[G];
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) accf[g] = _mm512_setzero_ps();
    const __m512i u128 = _mm512_set1_epi8(char(0x80));
    for (int64_t b = 0; b < nb; b += 2) {
        const uint8_t * ba  = wr + b * kBytes;
        prefetch_ahead<2 * kBytes>(ba);
        const uint8_t * bb  = b + 1 < nb ? ba + kBytes : nullptr;
        const __m512i   w   = wvec2<k>(ba, bb);
        // start every row's sums at -128 * sum(w) per lane: then vpdpbusd leaves sum a * w
        const __m512i   neg = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, w));
        const float     da_ = h2f(ba);
        const float     db_ = bb ? h2f(bb) : 0.0f;
        const __m512    dw  = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(da_)), _mm256_set1_ps(db_), 1);
        DFLASH_UNROLL
        for (int g = 0; g < G; ++g) {
            const __m512i p = _mm512_dpbusd_epi32(neg, _mm512_loadu_si512(au[g] + b * 32), w);
            accf[g]         = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(p), dw), _mm512_loadu_ps(dx[g] + b * 8), accf[g]);
        }
    }
    DFLASH_UNROLL
    for (int g = 0; g < G; ++g) out[g] = hsum16(accf[g]);
}

template <Kind k>
inline void rows_dispatch(int G, const uint8_t * wr, int64_t nb, const Prepared & P, int j0, float * out) {
    switch (G) {
        case 1: rows_all<1, k>(wr, nb, P, j0, out); break;
        case 2: rows_all<2, k>(wr, nb, P, j0, out); break;
        case 3: rows_all<3, k>(wr, nb, P, j0, out); break;
        case 4: rows_all<4, k>(wr, nb, P, j0, out); break;
        case 5: rows_all<5, k>(wr, nb, P, j0, out); break;
        case 6: rows_all<6, k>(wr, nb, P, j0, out); break;
        case 7: rows_all<7, k>(wr, nb, P, j0, out); break;
        case 8: rows_all<8, k>(wr, nb, P, j0, out); break;
        case 9: rows_all<9, k>(wr, nb, P, j0, out); break;
        case 10: rows_all<10, k>(wr, nb, P, j0, out); break;
        case 11: rows_all<11, k>(wr, nb, P, j0, out); break;
        case 12: rows_all<12, k>(wr, nb, P, j0, out); break;
        case 13: rows_all<13, k>(wr, nb, P, j0, out); break;
        case 14: rows_all<14, k>(wr, nb, P, j0, out); break;
        case 15: rows_all<15, k>(wr, nb, P, j0, out); break;
        default: rows_all<16, k>(wr, nb, P, j0, out); break;
    }
}

template <Kind k>
void matmul_legacy(const MatMulArgs & A) {
    const int64_t nb = A.K / 32;
    // per thread: ggml's pool calls this from its worker threads, one chunk of rows at a time
    thread_local Prepared P;
    prepare(A, P);
    float out[kMaxRows];
    for (int64_t r = A.r0; r < A.r1; ++r) {
        const uint8_t * wr = A.w + r * A.w_row_bytes;
        // all rows in one group: 16 float accumulators + weights, offsets, scales fit 32 registers
        rows_dispatch<k>(A.n, wr, nb, P, 0, out);
        for (int j = 0; j < A.n; ++j) A.c[j * A.c_row_floats + r] = out[j];
    }
}

}  // namespace

// Activation rows are bit-identical on every ISA; AVX2's quantizer is the one to use here.
void quantize_a32(const float * x, uint8_t * row, int64_t K) { avx2::quantize_a32(x, row, K); }

void matmul_q4_0(const MatMulArgs & A) { matmul_legacy<Kind::q4_0>(A); }
// Q4_1: AVX2's kernel, whose one-row loop (two weight rows at a time) is faster on AVX-512 machines
// for the rows that matter on a CPU (measured on a 2-vCPU AVX-512 VNNI Xeon, SmolLM2-135M Q4_1,
// two interleaved runs: one-row step 7.6 vs 8.4-8.6 ms with this file's kernel, 2-4 rows the same
// within noise; this file's was ahead only from ~8 rows, 19.4 vs 20.9 ms). One kernel for every
// row count, so a verify row still equals the one-row step bit for bit.
void matmul_q4_1(const MatMulArgs & A) { avx2::matmul_q4_1(A); }
void matmul_q5_0(const MatMulArgs & A) { matmul_legacy<Kind::q5_0>(A); }
void matmul_q8_0(const MatMulArgs & A) { matmul_legacy<Kind::q8_0>(A); }

}  // namespace dflash::kern::avx512

#if !defined(DFLASH_KERNELS_EMULATED_AVX512)
#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif

#endif  // DFLASH_KERNELS_X86
