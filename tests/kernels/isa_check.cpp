// An ISA path of the multi-row kernels against our scalar path, standalone (no ggml library, no
// Python), for ISAs this machine cannot run natively: built against SIMDe's AVX-512 emulation or
// cross-built for arm64 and run under qemu-user (tests/test_kernels_emulated.py). The scalar
// path is itself held to ggml's CPU mat-mul and a float64 reference by the native self-test
// (tests/test_kernels.py), so this closes the chain for the paths nobody here can execute.
//
// Checked, for every covered type, odd K and N, row ranges and 1..16 activation rows:
//   - the ISA's activation quantizer writes the same bytes as the scalar one (every ISA must)
//   - the ISA's mat-mul vs the scalar mat-mul: NMSE <= 1e-9 (same integer arithmetic, only the
//     float summation order differs), and the untouched output entries stay untouched.
//   usage: isa_check ISA        exit 0 = all passed
#include "kernels/kernels.h"

#include "ggml.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace dflash::kern;

namespace {

struct TypeInfo {
    const char * name;
    int          type;
    int          bytes;            // per block
    int          half_offsets[2];  // fp16 fields of a block (-1: none)
};

const TypeInfo kTypes[] = {
    {"q4_K", GGML_TYPE_Q4_K, 144, {0, 2}}, {"q5_K", GGML_TYPE_Q5_K, 176, {0, 2}}, {"q6_K", GGML_TYPE_Q6_K, 210, {208, -1}},
    {"q4_0", GGML_TYPE_Q4_0, 18, {0, -1}}, {"q4_1", GGML_TYPE_Q4_1, 20, {0, 2}}, {"q5_0", GGML_TYPE_Q5_0, 22, {0, -1}},
    {"q8_0", GGML_TYPE_Q8_0, 34, {0, -1}},
};

uint16_t random_half(std::mt19937 & rng, bool allow_negative) {
    // exponent 5..16 (~1e-3 .. 2), any mantissa; a few exact zeros
    if ((rng() & 63) == 0) return 0;
    const uint16_t e = uint16_t(5 + rng() % 12);
    uint16_t       h = uint16_t((e << 10) | (rng() & 0x3ff));
    if (allow_negative && (rng() & 1)) h |= 0x8000;
    return h;
}

}  // namespace

int main(int argc, char ** argv) {
    Isa isa;
    if (argc != 2 || !parse_isa(argv[1], &isa)) {
        fprintf(stderr, "usage: isa_check ISA\n");
        return 2;
    }
    if (!isa_available(isa)) {
        fprintf(stderr, "isa_check: %s is not available in this build/CPU\n", argv[1]);
        return 2;
    }
    std::mt19937                    rng(4321);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    int                             failures = 0, checked = 0;
    for (const TypeInfo & ti : kTypes) {
        const TypeKernels * tk  = kernels_for(ti.type, isa);
        const TypeKernels * ref = kernels_for(ti.type, Isa::scalar);
        if (!tk) {
            printf("%-5s not covered by %s\n", ti.name, argv[1]);
            continue;
        }
        const bool           kq = tk->block == 256;
        std::vector<int64_t> Ks = kq ? std::vector<int64_t>{256, 768, 2304} : std::vector<int64_t>{32, 96, 896, 2080};
        double               worst = 0.0;
        int                  type_fail = 0;
        for (int64_t K : Ks) {
            for (int64_t N : {1, 5, 37}) {
                const size_t         rb = size_t(K / tk->block) * size_t(ti.bytes);
                std::vector<uint8_t> w(rb * size_t(N));
                for (auto & b : w) b = uint8_t(rng());
                for (size_t blk = 0; blk < w.size() / size_t(ti.bytes); ++blk) {
                    for (int i = 0; i < 2; ++i) {
                        const int off = ti.half_offsets[i];
                        if (off < 0) continue;
                        // Q4_1's min (offset 2) may be negative; scales are signed in ggml too
                        const uint16_t h = random_half(rng, true);
                        memcpy(&w[blk * size_t(ti.bytes) + size_t(off)], &h, 2);
                    }
                }
                const size_t         arb = act_row_bytes(tk->act, K);
                std::vector<uint8_t> a_isa(arb * kMaxRows, 0xAB), a_ref(arb * kMaxRows, 0xAB);
                std::vector<float>   x(static_cast<size_t>(K));
                for (int j = 0; j < kMaxRows; ++j) {
                    const float scale = j == 3 ? 0.0f : std::exp(nd(rng));  // row 3: all zeros
                    for (int64_t k = 0; k < K; ++k) {
                        float v = nd(rng) * scale;
                        if (k % 97 == 13) v *= 20.0f;  // outlier channels, as in LLM activations
                        if (j == 5 && k % 64 < 32) v = 0.0f;  // whole zero blocks
                        x[size_t(k)] = v;
                    }
                    tk->quantize(x.data(), a_isa.data() + size_t(j) * arb, K);
                    ref->quantize(x.data(), a_ref.data() + size_t(j) * arb, K);
                }
                // the bytes the layout defines must agree (the padding may differ)
                for (int j = 0; j < kMaxRows; ++j) {
                    const uint8_t * p = a_isa.data() + size_t(j) * arb;
                    const uint8_t * q = a_ref.data() + size_t(j) * arb;
                    const size_t    n_def = tk->act == Act::a256
                                                ? size_t(K) + size_t(K / 256) * 4 + size_t(K / 16) * 2 + size_t(K / 32) * 4
                                                : size_t(K) + size_t(K / 32) * 8;
                    if (memcmp(p, q, n_def) != 0) {
                        printf("FAIL %-5s K=%lld row %d: activation bytes differ from scalar\n", ti.name, (long long) K, j);
                        ++failures;
                        ++type_fail;
                        break;
                    }
                }
                for (int n = 1; n <= kMaxRows; ++n) {
                    for (int range = 0; range < 2; ++range) {
                        const int64_t r0 = range == 0 ? 0 : N / 3, r1 = range == 0 ? N : N - N / 4;
                        if (r1 <= r0) continue;
                        const size_t       ldc = size_t(N) + 3;
                        std::vector<float> c_isa(ldc * size_t(n), -7.0f), c_ref(ldc * size_t(n), -7.0f);
                        MatMulArgs         A{w.data(), rb, a_ref.data(), arb, c_isa.data(), ldc, K, r0, r1, n};
                        tk->matmul(A);
                        A.c = c_ref.data();
                        ref->matmul(A);
                        double num = 0, den = 0;
                        bool   outside_ok = true;
                        for (int j = 0; j < n; ++j) {
                            for (size_t r = 0; r < ldc; ++r) {
                                const float u = c_isa[size_t(j) * ldc + r], v = c_ref[size_t(j) * ldc + r];
                                if (int64_t(r) < r0 || int64_t(r) >= r1) {
                                    outside_ok = outside_ok && u == -7.0f;
                                    continue;
                                }
                                if (!std::isfinite(u) || !std::isfinite(v)) {
                                    num += 1e30;
                                    continue;
                                }
                                num += (double(u) - v) * (double(u) - v);
                                den += double(v) * v;
                            }
                        }
                        const double e = den > 0 ? num / den : num;
                        worst          = std::max(worst, e);
                        ++checked;
                        if (!(e <= 1e-9) || !outside_ok) {
                            if (type_fail < 5) {
                                printf("FAIL %-5s K=%lld N=%lld rows [%lld,%lld) n=%d: nmse %.3g%s\n", ti.name, (long long) K,
                                       (long long) N, (long long) r0, (long long) r1, n, e,
                                       outside_ok ? "" : ", wrote outside its rows");
                            }
                            ++failures;
                            ++type_fail;
                        }
                    }
                }
            }
        }
        printf("%-5s %s vs scalar: worst nmse %.3g, %s\n", ti.name, argv[1], worst, type_fail ? "FAILED" : "ok");
    }
    printf("%d cases, %d failed\n", checked, failures);
    return failures == 0 && checked > 0 ? 0 : 1;
}
