// Self-test of our attention (attention.h), run from selftest() after the mat-mul checks. For
// several head layouts (GQA groups of 1..7, head sizes 32..128), token counts 1..17, contexts
// below and above one KV chunk, causal masks with holes and a masked tail, and no mask, it
// computes FLASH_ATTN_EXT through ggml-cpu's backend with n_threads threads and compares
//   (a) ours (the requested ISA)  vs ggml's own CPU flash attention:  NMSE <= 5e-4
//   (b) ours                      vs a float64 softmax(QK^T) V:       NMSE <= 1e-8 (and never
//       worse than ggml's: ggml rounds Q to fp16 and sums V in fp16)
//   (c) ours                      vs our scalar path:                 bit-identical
//   (d) every token again alone, with 320 more (masked) cache positions: bit-identical to its row
//       in the batch (what makes verify rows equal one-by-one decoding)
#include "attention.h"
#include "kernels.h"
#include "kernels_backend.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace dflash::kern {

namespace {

struct AttnCase {
    int D, n_head, n_kvh, N, n_kv;
    bool masked;
};

// Q [n_head][N][D] f32, K/V [n_kvh][n_kv][D] fp16, mask [N][n_kv] fp16 (or empty)
// -> y [N][n_head][D] through ggml-cpu's backend
bool graph_attention(ggml_backend_t cpu, const AttnCase & c, const std::vector<float> & q,
                     const std::vector<uint16_t> & k, const std::vector<uint16_t> & v,
                     const std::vector<uint16_t> & mask, float scale, std::vector<float> & y) {
    ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context *   ctx = ggml_init(ip);
    if (!ctx) return false;
    ggml_tensor * Q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.D, c.N, c.n_head);
    ggml_tensor * K = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c.D, c.n_kv, c.n_kvh);
    ggml_tensor * V = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c.D, c.n_kv, c.n_kvh);
    ggml_tensor * M = c.masked ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c.n_kv, c.N) : nullptr;
    ggml_tensor * Y = ggml_flash_attn_ext(ctx, Q, K, V, M, scale, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(Y, GGML_PREC_F32);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, Y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    bool                  ok  = buf != nullptr;
    if (ok) {
        ggml_backend_tensor_set(Q, q.data(), 0, ggml_nbytes(Q));
        ggml_backend_tensor_set(K, k.data(), 0, ggml_nbytes(K));
        ggml_backend_tensor_set(V, v.data(), 0, ggml_nbytes(V));
        if (M) ggml_backend_tensor_set(M, mask.data(), 0, ggml_nbytes(M));
        ok = ggml_backend_graph_compute(cpu, gf) == GGML_STATUS_SUCCESS;
        y.resize(ggml_nelements(Y));
        if (ok) ggml_backend_tensor_get(Y, y.data(), 0, ggml_nbytes(Y));
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return ok;
}

// sum (a-b)^2 / sum b^2, b a float or float64 reference
template <typename R> double nmse_of(const std::vector<float> & a, const std::vector<R> & b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double d = double(a[i]) - double(b[i]);
        num += d * d;
        den += double(b[i]) * double(b[i]);
    }
    return den > 0 ? num / den : num;
}

}  // namespace

int attn_selftest(Isa isa, ggml_backend_t cpu, int n_threads, int quick, std::string & report, double & worst) {
    char line[512];
    if (isa == Isa::neon) {
        report += "attn  neon: no NEON attention kernel, ggml's runs\n";
        return 0;
    }
    set_isa(isa);
    std::mt19937                    rng(4321);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const uint16_t                  kNegInfHalf = 0xFC00;

    std::vector<AttnCase> cases;
    const int             heads[][3] = {{64, 9, 3}, {128, 12, 2}, {64, 14, 2}, {32, 4, 4}};
    const int             Ns_full[]  = {1, 2, 3, 5, 8, 16, 17};
    const int             Ns_quick[] = {1, 3, 8, 17};
    for (const auto & h : heads) {
        for (int n_kv : {256, 700}) {
            const int * Ns = quick ? Ns_quick : Ns_full;
            const int   nN = quick ? 4 : 7;
            for (int i = 0; i < nN; ++i) cases.push_back({h[0], h[1], h[2], Ns[i], n_kv, true});
        }
        cases.push_back({h[0], h[1], h[2], 3, 90, false});
    }

    int    failures = 0, n_cases = 0;
    double w_ggml = 0, w_ref = 0, w_gref = 0;
    for (const AttnCase & c : cases) {
        // the cache holds `used` positions; the batch's tokens are the last N of them
        const int   used  = c.masked ? c.n_kv - 40 : c.n_kv;
        const float scale = 1.0f / std::sqrt(float(c.D));
        std::vector<float>    q(size_t(c.n_head) * c.N * c.D);
        std::vector<uint16_t> k(size_t(c.n_kvh) * c.n_kv * c.D), v(k.size());
        std::vector<float>    kf(k.size()), vf(v.size());
        for (auto & x : q) x = nd(rng) * 1.5f;
        for (size_t i = 0; i < k.size(); ++i) {
            k[i]  = ggml_fp32_to_fp16(nd(rng));
            v[i]  = ggml_fp32_to_fp16(nd(rng));
            kf[i] = ggml_fp16_to_fp32(k[i]);
            vf[i] = ggml_fp16_to_fp32(v[i]);
        }
        std::vector<uint16_t> mask;
        auto visible = [&](int t, int j) {  // causal, holes (other sequences' cells), masked tail
            return !c.masked || (j <= used - c.N + t && j % 37 != 5);
        };
        if (c.masked) {
            mask.resize(size_t(c.N) * c.n_kv);
            for (int t = 0; t < c.N; ++t) {
                for (int j = 0; j < c.n_kv; ++j) mask[size_t(t) * c.n_kv + j] = visible(t, j) ? 0 : kNegInfHalf;
            }
        }
        // float64 reference
        const int           g = c.n_head / c.n_kvh;
        std::vector<double> ref(size_t(c.N) * c.n_head * c.D, 0.0);
        for (int t = 0; t < c.N; ++t) {
            for (int h = 0; h < c.n_head; ++h) {
                const float *       qr = &q[(size_t(h) * c.N + t) * c.D];
                const int           kh = h / g;
                std::vector<double> s(c.n_kv);
                double              mx = -1e300;
                for (int j = 0; j < c.n_kv; ++j) {
                    if (!visible(t, j)) continue;
                    double dot = 0;
                    for (int d = 0; d < c.D; ++d) dot += double(qr[d]) * kf[(size_t(kh) * c.n_kv + j) * c.D + d];
                    s[j] = dot * scale;
                    mx   = std::max(mx, s[j]);
                }
                double  sum = 0;
                double * out = &ref[(size_t(t) * c.n_head + h) * c.D];
                for (int j = 0; j < c.n_kv; ++j) {
                    if (!visible(t, j)) continue;
                    const double p = std::exp(s[j] - mx);
                    sum += p;
                    for (int d = 0; d < c.D; ++d) out[d] += p * vf[(size_t(kh) * c.n_kv + j) * c.D + d];
                }
                for (int d = 0; d < c.D; ++d) out[d] /= sum;
            }
        }

        std::vector<float> y_ggml, y_ours, y_scalar;
        set_attention(0);
        bool ok = graph_attention(cpu, c, q, k, v, mask, scale, y_ggml);
        set_attention(1);
        ok = ok && graph_attention(cpu, c, q, k, v, mask, scale, y_ours);
        set_isa(Isa::scalar);
        ok = ok && graph_attention(cpu, c, q, k, v, mask, scale, y_scalar);
        set_isa(isa);

        const double e_ggml = ok ? nmse_of(y_ours, y_ggml) : 1.0;
        const double e_ref  = ok ? nmse_of(y_ours, ref) : 1.0;
        const double g_ref  = ok ? nmse_of(y_ggml, ref) : 1.0;
        const bool   same_s = ok && std::memcmp(y_ours.data(), y_scalar.data(), y_ours.size() * sizeof(float)) == 0;

        // (d) each token alone, in a cache with 320 more positions (masked for it)
        bool alone_ok = ok;
        for (int t = 0; t < c.N && alone_ok; ++t) {
            AttnCase c1 = c;
            c1.N        = 1;
            c1.n_kv     = c.n_kv + 320;
            c1.masked   = true;
            std::vector<float>    q1(size_t(c.n_head) * c.D);
            std::vector<uint16_t> k1(size_t(c.n_kvh) * c1.n_kv * c.D), v1(k1.size()), m1(c1.n_kv, kNegInfHalf);
            for (int h = 0; h < c.n_head; ++h) {
                std::memcpy(&q1[size_t(h) * c.D], &q[(size_t(h) * c.N + t) * c.D], c.D * sizeof(float));
            }
            for (int h = 0; h < c.n_kvh; ++h) {
                for (int j = 0; j < c1.n_kv; ++j) {
                    for (int d = 0; d < c.D; ++d) {
                        const size_t o1 = (size_t(h) * c1.n_kv + j) * c.D + d;
                        const size_t o  = (size_t(h) * c.n_kv + j) * c.D + d;
                        k1[o1]          = j < c.n_kv ? k[o] : ggml_fp32_to_fp16(nd(rng));
                        v1[o1]          = j < c.n_kv ? v[o] : ggml_fp32_to_fp16(nd(rng));
                    }
                }
            }
            for (int j = 0; j < c.n_kv; ++j) m1[j] = visible(t, j) ? 0 : kNegInfHalf;
            std::vector<float> y1;
            alone_ok = graph_attention(cpu, c1, q1, k1, v1, m1, scale, y1) &&
                       std::memcmp(y1.data(), &y_ours[size_t(t) * c.n_head * c.D], y1.size() * sizeof(float)) == 0;
            if (!alone_ok) {
                snprintf(line, sizeof line, "FAIL attention D=%d heads=%d/%d N=%d n_kv=%d: token %d alone differs from its batch\n",
                         c.D, c.n_head, c.n_kvh, c.N, c.n_kv, t);
                report += line;
            }
        }
        set_attention(-1);

        const bool pass = ok && e_ggml <= 5e-4 && e_ref <= 1e-8 && e_ref <= std::max(g_ref, 1e-12) && same_s && alone_ok;
        ++n_cases;
        w_ggml = std::max(w_ggml, e_ggml);
        w_ref  = std::max(w_ref, e_ref);
        w_gref = std::max(w_gref, g_ref);
        worst  = std::max(worst, e_ggml);
        if (!pass) {
            ++failures;
            snprintf(line, sizeof line,
                     "FAIL attention D=%d heads=%d/%d N=%d n_kv=%d%s: nmse vs ggml %.3g, vs f64 %.3g (ggml's %.3g), scalar %s%s\n",
                     c.D, c.n_head, c.n_kvh, c.N, c.n_kv, c.masked ? "" : " (no mask)", e_ggml, e_ref, g_ref,
                     same_s ? "same" : "DIFFERS", ok ? "" : " (compute failed)");
            report += line;
        }
    }
    snprintf(line, sizeof line,
             "attn  %-6s threads=%d: %3d cases, %d failed; worst nmse vs ggml %.2e, vs f64 %.2e (ggml's own %.2e); vs scalar and rows alone: bit for bit\n",
             isa_name(isa), n_threads, n_cases, failures, w_ggml, w_ref, w_gref);
    report += line;
    return failures;
}

}  // namespace dflash::kern
