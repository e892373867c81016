// Kernel-level timing of pydflash's multi-row mat-mul kernels (issue #15), one thread, no ggml:
// ns per 256 weights for n = 1..16 activation rows, weights either cache-resident (the kernel's
// own speed) or streamed from DRAM (what a decode step sees). Build and run:
//   benchmarks/kernels/micro.sh [isa] [type...]
#include "kernels/kernels.h"

#include "ggml.h"
#if defined(DFLASH_MICRO_GGML)
#include "ggml-cpu.h"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace dflash::kern;

namespace {

struct TypeInfo {
    const char * name;
    int          type;
    int          block;
    int          bytes;
    int          half_offsets[2];  // fp16 fields to set to sane scales (-1: none)
};

const TypeInfo kTypes[] = {
    {"q4_K", GGML_TYPE_Q4_K, 256, 144, {0, 2}},   {"q5_K", GGML_TYPE_Q5_K, 256, 176, {0, 2}},
    {"q6_K", GGML_TYPE_Q6_K, 256, 210, {208, -1}}, {"q4_0", GGML_TYPE_Q4_0, 32, 18, {0, -1}},
    {"q4_1", GGML_TYPE_Q4_1, 32, 20, {0, 2}},      {"q5_0", GGML_TYPE_Q5_0, 32, 22, {0, -1}},
    {"q8_0", GGML_TYPE_Q8_0, 32, 34, {0, -1}},
};

double now_ns() {
    return double(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

}  // namespace

int main(int argc, char ** argv) {
    Isa isa = best_isa();
    if (argc > 1 && !parse_isa(argv[1], &isa)) {
        fprintf(stderr, "usage: micro [scalar|avx2|avx512] [type...]\n");
        return 2;
    }
    if (!set_isa(isa)) {
        fprintf(stderr, "isa %s not available\n", isa_name(isa));
        return 2;
    }
    std::vector<std::string> want;
    for (int i = 2; i < argc; ++i) want.push_back(argv[i]);
    // MICRO_K: the row length (a multiple of 256; 1536 = the 1.5B's hidden size, 8960 its FFN)
    const char *  k_env = std::getenv("MICRO_K");
    const int64_t K     = k_env ? std::atoll(k_env) : 1536;
    if (K <= 0 || K % 256 != 0) {
        fprintf(stderr, "MICRO_K must be a positive multiple of 256 (got '%s')\n", k_env);
        return 2;
    }
    std::mt19937  rng(1);
    printf("isa %s, K = %lld, one thread; ns per 256 weights (per call, per row)\n", isa_name(isa), (long long) K);
    printf("%-5s %-5s", "type", "mem");
    const int ns[] = {1, 2, 3, 4, 6, 8, 12, 16};
    for (int n : ns) printf(" %8s%-2d", "n=", n);
    printf("\n");
    for (const TypeInfo & ti : kTypes) {
        if (!want.empty() && std::find(want.begin(), want.end(), ti.name) == want.end()) continue;
        const TypeKernels * tk = kernels_for(ti.type);
        if (!tk) continue;
        const size_t row_bytes = size_t(K / ti.block) * ti.bytes;
        for (int mem = 0; mem < 2; ++mem) {
            // cache: 64 rows (~60 KB); dram: 96 MB of weights, streamed once per call
            const int64_t        N = mem == 0 ? 64 : int64_t((96u << 20) / row_bytes);
            std::vector<uint8_t> w(row_bytes * N);
            for (auto & b : w) b = uint8_t(rng());
            for (int64_t blk = 0; blk < N * (K / ti.block); ++blk) {
                for (int off : ti.half_offsets) {
                    if (off < 0) continue;
                    const uint16_t h = uint16_t(0x2000 + (rng() & 0x3ff));  // ~1e-2, positive
                    memcpy(&w[blk * ti.bytes + off], &h, 2);
                }
            }
            const size_t         arb = act_row_bytes(tk->act, K);
            std::vector<uint8_t> a(arb * kMaxRows + 64);
            std::vector<float>   x(K);
            for (int j = 0; j < kMaxRows; ++j) {
                for (auto & v : x) v = std::normal_distribution<float>()(rng);
                tk->quantize(x.data(), a.data() + j * arb, K);
            }
            std::vector<float> c(size_t(N) * kMaxRows);
            printf("%-5s %-5s", ti.name, mem == 0 ? "cache" : "dram");
            for (int n : ns) {
                MatMulArgs A{w.data(), row_bytes, a.data(), arb, c.data(), size_t(N), K, 0, N, n};
                const int  reps = mem == 0 ? 2000 / n + 20 : 3;
                tk->matmul(A);  // warm
                double best = 1e30;
                for (int t = 0; t < 5; ++t) {
                    const double t0 = now_ns();
                    for (int r = 0; r < reps; ++r) tk->matmul(A);
                    best = std::min(best, (now_ns() - t0) / reps);
                }
                const double per256 = best / (double(N) * K / 256.0);
                printf(" %5.1f/%4.1f", per256, per256 / n);
            }
            printf("\n");
#if defined(DFLASH_MICRO_GGML)
            // ggml-cpu's own one-row path on the same weights: vec_dot per weight row (what a
            // stock decode step runs for types without REPACK)
            {
                const auto *         tr  = ggml_get_type_traits_cpu(ggml_type(ti.type));
                const size_t         qrb = ggml_row_size(tr->vec_dot_type, K);
                std::vector<uint8_t> xq(qrb);
                for (auto & v : x) v = std::normal_distribution<float>()(rng);
                tr->from_float(x.data(), xq.data(), K);
                const int reps = mem == 0 ? 2000 : 3;
                double    best = 1e30;
                for (int t = 0; t < 5; ++t) {
                    const double t0 = now_ns();
                    for (int r = 0; r < reps; ++r) {
                        for (int64_t i = 0; i < N; ++i) tr->vec_dot(int(K), &c[size_t(i)], 0, w.data() + i * row_bytes, 0, xq.data(), 0, 1);
                    }
                    best = std::min(best, (now_ns() - t0) / reps);
                }
                printf("%-5s %-5s %5.1f  (ggml vec_dot, 1 row)\n", ti.name, mem == 0 ? "cache" : "dram", best / (double(N) * K / 256.0));
            }
#endif
            fflush(stdout);
        }
    }
    return 0;
}
