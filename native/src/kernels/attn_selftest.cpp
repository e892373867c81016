// Self-test of our attention (attention.h), run from selftest() after the mat-mul checks. The op is
// built as llama.cpp builds it (Q [D, heads, tokens, streams] and K/V views of a cache
// [D x kv heads, cells, streams] from stream s0 on, permuted; an fp16 mask [n_kv, tokens, 1,
// streams]) and computed through ggml-cpu's backend with n_threads threads. Cases:
//   - one stream, one sequence: GQA groups of 1..7, head sizes 32..128, 1..17 tokens, 256 and 700
//     positions (one and two KV chunks), causal masks with holes and a masked tail; and no mask
//   - one stream holding several sequences whose cells interleave (llama.cpp's unified cache with
//     several sequences decoding: prompts, then one cell per sequence per step, some cells freed),
//     a batch with tokens of each
//   - 2..3 streams (ne[3] > 1: the non-unified cache) from a stream offset s0, different sequences
//     and masks per stream, one or several sequences in a stream
// and compares
//   (a) ours (the requested ISA)  vs ggml's own CPU flash attention:  NMSE <= 5e-4
//   (b) ours                      vs a float64 softmax(QK^T) V:       NMSE <= 1e-8 (and never
//       worse than ggml's: ggml rounds Q to fp16 and sums V in fp16)
//   (c) ours                      vs our scalar path:                 bit-identical
//   (d) every token again alone, its visible positions (in order) in another cache: masked cells
//       of other data between them and after them: bit-identical to its row in the batch (what
//       makes verify rows equal one-by-one decoding, whatever shares the cache)
//   (e) with several streams, each stream's tokens alone (one stream): bit-identical
#include "attention.h"
#include "kernels.h"
#include "kernels_backend.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace dflash::kern {

namespace {

constexpr uint16_t kNegInfHalf = 0xFC00;

// One FLASH_ATTN_EXT: the op sees streams s0 .. s0 + ns - 1 of a cache of n_stream streams of
// kv_size cells, n_kv cells of each, N tokens per stream.
struct Problem {
    int                   D = 0, n_head = 0, n_kvh = 0;
    int                   ns = 1, n_stream = 1, s0 = 0, kv_size = 0, n_kv = 0, N = 0;
    bool                  masked = true;
    std::vector<float>    q;     // [ns][N][n_head][D]
    std::vector<uint16_t> k, v;  // [n_stream][kv_size][n_kvh][D]
    std::vector<uint16_t> mask;  // [ns][N][n_kv], 0 or -inf

    size_t kv_at(int stream, int cell, int h) const {
        return ((size_t(stream) * kv_size + cell) * n_kvh + h) * D;
    }
    bool visible(int s, int t, int j) const { return !masked || mask[(size_t(s) * N + t) * n_kv + j] == 0; }
};

// y [ns][N][n_head][D] through ggml-cpu's backend
bool graph_attention(ggml_backend_t cpu, const Problem & P, float scale, std::vector<float> & y) {
    ggml_init_params ip  = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
    ggml_context *   ctx = ggml_init(ip);
    if (!ctx) return false;
    const size_t  h2 = sizeof(uint16_t);
    ggml_tensor * Qs = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, P.D, P.n_head, P.N, P.ns);
    ggml_tensor * Ks = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, int64_t(P.D) * P.n_kvh, P.kv_size, P.n_stream);
    ggml_tensor * Vs = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, int64_t(P.D) * P.n_kvh, P.kv_size, P.n_stream);
    ggml_tensor * M  = P.masked ? ggml_new_tensor_4d(ctx, GGML_TYPE_F16, P.n_kv, P.N, 1, P.ns) : nullptr;
    const size_t  row = h2 * P.D * P.n_kvh, strm = row * P.kv_size;
    ggml_tensor * K = ggml_view_4d(ctx, Ks, P.D, P.n_kvh, P.n_kv, P.ns, h2 * P.D, row, strm, strm * P.s0);
    ggml_tensor * V = ggml_view_4d(ctx, Vs, P.D, P.n_kvh, P.n_kv, P.ns, h2 * P.D, row, strm, strm * P.s0);
    ggml_tensor * Y = ggml_flash_attn_ext(ctx, ggml_permute(ctx, Qs, 0, 2, 1, 3), ggml_permute(ctx, K, 0, 2, 1, 3),
                                          ggml_permute(ctx, V, 0, 2, 1, 3), M, scale, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(Y, GGML_PREC_F32);
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, Y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    bool                  ok  = buf != nullptr;
    if (ok) {
        ggml_backend_tensor_set(Qs, P.q.data(), 0, ggml_nbytes(Qs));
        ggml_backend_tensor_set(Ks, P.k.data(), 0, ggml_nbytes(Ks));
        ggml_backend_tensor_set(Vs, P.v.data(), 0, ggml_nbytes(Vs));
        if (M) ggml_backend_tensor_set(M, P.mask.data(), 0, ggml_nbytes(M));
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

std::vector<double> reference(const Problem & P, float scale) {
    const int           g = P.n_head / P.n_kvh;
    std::vector<double> ref(size_t(P.ns) * P.N * P.n_head * P.D, 0.0);
    std::vector<double> sc(P.n_kv);
    for (int s = 0; s < P.ns; ++s) {
        for (int t = 0; t < P.N; ++t) {
            for (int h = 0; h < P.n_head; ++h) {
                const float * qr = &P.q[((size_t(s) * P.N + t) * P.n_head + h) * P.D];
                double        mx = -1e300;
                for (int j = 0; j < P.n_kv; ++j) {
                    if (!P.visible(s, t, j)) continue;
                    const uint16_t * kr  = &P.k[P.kv_at(P.s0 + s, j, h / g)];
                    double           dot = 0;
                    for (int d = 0; d < P.D; ++d) dot += double(qr[d]) * ggml_fp16_to_fp32(kr[d]);
                    sc[j] = dot * scale;
                    mx    = std::max(mx, sc[j]);
                }
                double   sum = 0;
                double * out = &ref[((size_t(s) * P.N + t) * P.n_head + h) * P.D];
                for (int j = 0; j < P.n_kv; ++j) {
                    if (!P.visible(s, t, j)) continue;
                    const uint16_t * vr = &P.v[P.kv_at(P.s0 + s, j, h / g)];
                    const double     p  = std::exp(sc[j] - mx);
                    sum += p;
                    for (int d = 0; d < P.D; ++d) out[d] += p * ggml_fp16_to_fp32(vr[d]);
                }
                if (sum > 0) {
                    for (int d = 0; d < P.D; ++d) out[d] /= sum;
                }
            }
        }
    }
    return ref;
}

// The sequences of one stream: each a prompt of `prompt` cells, then `steps` decode steps that take
// one cell per sequence in turn (a cell is freed with probability `hole`: masked for all), then the
// batch: `batch` tokens of each sequence, sequence after sequence, in the cells after.
struct SeqSpec {
    int prompt, batch;
};
struct StreamSpec {
    std::vector<SeqSpec> seqs;
    int                  steps = 0;
    double               hole  = 0.0;
};

// Mask rows [N][n_kv] for a stream; returns the cells used (or -1 if they do not fit)
int build_stream(const StreamSpec & sp, int n_kv, std::mt19937 & rng, std::vector<uint16_t> & rows) {
    std::vector<int> owner;  // per cell: sequence (or -1: freed / never used)
    std::vector<int> pos;    // per cell: position in its sequence
    std::vector<int> len(sp.seqs.size(), 0);
    auto             take = [&](int sq, bool may_free) {
        std::uniform_real_distribution<double> u(0.0, 1.0);
        owner.push_back(may_free && u(rng) < sp.hole ? -1 : sq);
        pos.push_back(owner.back() < 0 ? -1 : len[sq]++);
    };
    for (size_t sq = 0; sq < sp.seqs.size(); ++sq) {
        for (int i = 0; i < sp.seqs[sq].prompt; ++i) take(int(sq), false);
    }
    for (int st = 0; st < sp.steps; ++st) {
        for (size_t sq = 0; sq < sp.seqs.size(); ++sq) take(int(sq), true);
    }
    std::vector<std::pair<int, int>> batch;  // (sequence, cell)
    for (size_t sq = 0; sq < sp.seqs.size(); ++sq) {
        for (int i = 0; i < sp.seqs[sq].batch; ++i) {
            batch.emplace_back(int(sq), int(owner.size()));
            take(int(sq), false);
        }
    }
    if (int(owner.size()) > n_kv) return -1;
    rows.assign(batch.size() * size_t(n_kv), kNegInfHalf);
    for (size_t t = 0; t < batch.size(); ++t) {
        const int sq = batch[t].first, p = pos[batch[t].second];
        for (size_t j = 0; j < owner.size(); ++j) {
            if (owner[j] == sq && pos[j] <= p) rows[t * n_kv + j] = 0;
        }
    }
    return int(owner.size());
}

void fill_random(std::vector<uint16_t> & x, std::mt19937 & rng) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto & e : x) e = ggml_fp32_to_fp16(nd(rng));
}

// token t of stream s alone: its visible positions in order, 0..3 masked cells of other data
// before each and 1..40 after, in a one-stream cache with a few cells beyond the view
Problem alone_token(const Problem & P, int s, int t, std::mt19937 & rng) {
    Problem A;
    A.D      = P.D;
    A.n_head = P.n_head;
    A.n_kvh  = P.n_kvh;
    A.N      = 1;
    A.masked = true;
    A.q.assign(&P.q[(size_t(s) * P.N + t) * P.n_head * P.D], &P.q[(size_t(s) * P.N + t + 1) * P.n_head * P.D]);
    std::vector<int> cells;  // cell of P for each of A's cells (-1: other data)
    for (int j = 0; j < P.n_kv; ++j) {
        if (!P.visible(s, t, j)) continue;
        for (int e = int(rng() % 4); e > 0; --e) cells.push_back(-1);
        cells.push_back(j);
    }
    for (int e = 1 + int(rng() % 40); e > 0; --e) cells.push_back(-1);
    A.n_kv    = int(cells.size());
    A.kv_size = A.n_kv + 7;
    A.k.resize(size_t(A.kv_size) * A.n_kvh * A.D);
    A.v.resize(A.k.size());
    fill_random(A.k, rng);
    fill_random(A.v, rng);
    A.mask.assign(A.n_kv, kNegInfHalf);
    for (int j = 0; j < A.n_kv; ++j) {
        if (cells[j] < 0) continue;
        A.mask[j] = 0;
        std::memcpy(&A.k[A.kv_at(0, j, 0)], &P.k[P.kv_at(P.s0 + s, cells[j], 0)], size_t(A.n_kvh) * A.D * 2);
        std::memcpy(&A.v[A.kv_at(0, j, 0)], &P.v[P.kv_at(P.s0 + s, cells[j], 0)], size_t(A.n_kvh) * A.D * 2);
    }
    return A;
}

// stream s of P alone: the same cells, tokens and mask, a one-stream cache
Problem alone_stream(const Problem & P, int s) {
    Problem A  = P;
    A.ns       = 1;
    A.n_stream = 1;
    A.s0       = 0;
    const size_t qs = size_t(P.N) * P.n_head * P.D, ks = size_t(P.kv_size) * P.n_kvh * P.D;
    A.q.assign(P.q.begin() + s * qs, P.q.begin() + (s + 1) * qs);
    A.k.assign(P.k.begin() + (P.s0 + s) * ks, P.k.begin() + (P.s0 + s + 1) * ks);
    A.v.assign(P.v.begin() + (P.s0 + s) * ks, P.v.begin() + (P.s0 + s + 1) * ks);
    if (P.masked) {
        const size_t ms = size_t(P.N) * P.n_kv;
        A.mask.assign(P.mask.begin() + s * ms, P.mask.begin() + (s + 1) * ms);
    }
    return A;
}

struct Case {
    std::string name;
    Problem     P;
};

}  // namespace

int attn_selftest(Isa isa, ggml_backend_t cpu, int n_threads, int quick, std::string & report, double & worst) {
    char line[640];
    if (isa == Isa::neon) {
        report += "attn  neon: no NEON attention kernel, ggml's runs\n";
        return 0;
    }
    set_isa(isa);
    std::mt19937                    rng(4321);
    std::normal_distribution<float> nd(0.0f, 1.0f);

    auto base = [&](int D, int n_head, int n_kvh) {
        Problem P;
        P.D      = D;
        P.n_head = n_head;
        P.n_kvh  = n_kvh;
        return P;
    };
    auto finish = [&](Problem & P) {  // random Q, K, V
        P.q.resize(size_t(P.ns) * P.N * P.n_head * P.D);
        for (auto & x : P.q) x = nd(rng) * 1.5f;
        P.k.resize(size_t(P.n_stream) * P.kv_size * P.n_kvh * P.D);
        P.v.resize(P.k.size());
        fill_random(P.k, rng);
        fill_random(P.v, rng);
    };

    std::vector<Case> cases;
    const int         heads[][3] = {{64, 9, 3}, {128, 12, 2}, {64, 14, 2}, {32, 4, 4}};
    const int         Ns_full[]  = {1, 2, 3, 5, 8, 16, 17};
    const int         Ns_quick[] = {1, 3, 8, 17};
    char              nm[160];
    // one stream, one sequence: the batch's tokens are the last N of `used` cells, holes at j % 37 == 5
    for (const auto & h : heads) {
        for (int n_kv : {256, 700}) {
            const int * Ns = quick ? Ns_quick : Ns_full;
            const int   nN = quick ? 4 : 7;
            for (int i = 0; i < nN; ++i) {
                Problem P = base(h[0], h[1], h[2]);
                P.N       = Ns[i];
                P.n_kv = P.kv_size = n_kv;
                const int used     = n_kv - 40;
                P.mask.resize(size_t(P.N) * n_kv);
                for (int t = 0; t < P.N; ++t) {
                    for (int j = 0; j < n_kv; ++j) {
                        P.mask[size_t(t) * n_kv + j] = j <= used - P.N + t && j % 37 != 5 ? 0 : kNegInfHalf;
                    }
                }
                finish(P);
                snprintf(nm, sizeof nm, "D=%d heads=%d/%d N=%d n_kv=%d", h[0], h[1], h[2], P.N, n_kv);
                cases.push_back({nm, std::move(P)});
            }
        }
        Problem P = base(h[0], h[1], h[2]);
        P.N       = 3;
        P.n_kv = P.kv_size = 90;
        P.masked           = false;
        finish(P);
        snprintf(nm, sizeof nm, "D=%d heads=%d/%d N=3 n_kv=90 (no mask)", h[0], h[1], h[2]);
        cases.push_back({nm, std::move(P)});
    }
    // several streams (the first stream of the op at s0 > 0 of the cache), each its own sequences
    struct MultiCase {
        int                     D, n_head, n_kvh, n_stream, s0, kv_size, n_kv;
        std::vector<StreamSpec> streams;
        bool                    in_quick;
    };
    const std::vector<MultiCase> multi = {
        // a unified cache, two sequences decoding (the scheduler's steps), and one verifying
        {64, 9, 3, 1, 0, 512, 256, {{{{15, 1}, {12, 1}}, 20, 0.0}}, true},
        {64, 14, 2, 1, 0, 1024, 1024, {{{{100, 4}, {150, 3}}, 300, 0.05}}, true},
        {128, 12, 2, 1, 0, 768, 768, {{{{40, 1}, {10, 5}, {200, 2}}, 150, 0.1}}, false},
        {32, 4, 4, 1, 0, 300, 300, {{{{0, 2}, {30, 1}, {5, 3}}, 60, 0.0}}, false},
        // several streams: one sequence each, or several in one
        {64, 9, 3, 3, 1, 256, 256, {{{{30, 2}}, 0, 0.0}, {{{5, 1}, {7, 1}}, 10, 0.0}}, true},
        {128, 12, 2, 4, 1, 1024, 768, {{{{300, 5}}, 0, 0.0}, {{{100, 2}, {120, 3}}, 200, 0.05}, {{{20, 5}}, 0, 0.0}}, true},
        {64, 14, 2, 4, 2, 600, 512, {{{{400, 1}}, 0, 0.0}, {{{200, 1}}, 0, 0.0}}, false},
        {32, 4, 4, 2, 0, 300, 300, {{{{250, 3}}, 0, 0.0}, {{{60, 1}, {70, 2}}, 40, 0.0}}, false},
    };
    size_t n_multi = 0;
    for (const MultiCase & mc : multi) {
        if (quick && !mc.in_quick) continue;
        ++n_multi;
        Problem P  = base(mc.D, mc.n_head, mc.n_kvh);
        P.ns       = int(mc.streams.size());
        P.n_stream = mc.n_stream;
        P.s0       = mc.s0;
        P.kv_size  = mc.kv_size;
        P.n_kv     = mc.n_kv;
        std::string desc;
        bool        fits = true;
        for (const StreamSpec & sp : mc.streams) {
            std::vector<uint16_t> rows;
            int                   n = 0;
            for (const SeqSpec & q : sp.seqs) n += q.batch;
            P.N            = n;  // the same in every stream
            const int used = build_stream(sp, P.n_kv, rng, rows);
            fits           = fits && used > 0;
            P.mask.insert(P.mask.end(), rows.begin(), rows.end());
            snprintf(nm, sizeof nm, "%s%zu seq/%d cells", desc.empty() ? "" : ", ", sp.seqs.size(), used);
            desc += nm;
        }
        if (!fits || P.mask.size() != size_t(P.ns) * P.N * P.n_kv) {
            snprintf(line, sizeof line, "FAIL attention: a multi-sequence case does not fit its cache (%s)\n", desc.c_str());
            report += line;
            return 1;
        }
        finish(P);
        snprintf(nm, sizeof nm, "D=%d heads=%d/%d streams=%d (s0=%d of %d) N=%d n_kv=%d [%s]", mc.D, mc.n_head,
                 mc.n_kvh, P.ns, P.s0, P.n_stream, P.N, P.n_kv, desc.c_str());
        cases.push_back({nm, std::move(P)});
    }

    int    failures = 0, n_cases = 0;
    double w_ggml = 0, w_ref = 0, w_gref = 0;
    for (const Case & c : cases) {
        const Problem &           P     = c.P;
        const float               scale = 1.0f / std::sqrt(float(P.D));
        const std::vector<double> ref   = reference(P, scale);

        std::vector<float> y_ggml, y_ours, y_scalar;
        set_attention(0);
        bool ok = graph_attention(cpu, P, scale, y_ggml);
        set_attention(1);
        ok = ok && graph_attention(cpu, P, scale, y_ours);
        set_isa(Isa::scalar);
        ok = ok && graph_attention(cpu, P, scale, y_scalar);
        set_isa(isa);

        const double e_ggml = ok ? nmse_of(y_ours, y_ggml) : 1.0;
        const double e_ref  = ok ? nmse_of(y_ours, ref) : 1.0;
        const double g_ref  = ok ? nmse_of(y_ggml, ref) : 1.0;
        const bool   same_s = ok && std::memcmp(y_ours.data(), y_scalar.data(), y_ours.size() * sizeof(float)) == 0;

        const size_t row = size_t(P.n_head) * P.D;
        // (d) each token alone, its visible positions laid out differently
        bool alone_ok = ok;
        for (int s = 0; s < P.ns && alone_ok; ++s) {
            for (int t = 0; t < P.N && alone_ok; ++t) {
                const Problem      A = alone_token(P, s, t, rng);
                std::vector<float> y1;
                alone_ok = graph_attention(cpu, A, scale, y1) &&
                           std::memcmp(y1.data(), &y_ours[(size_t(s) * P.N + t) * row], row * sizeof(float)) == 0;
                if (!alone_ok) {
                    snprintf(line, sizeof line, "FAIL attention %s: stream %d token %d alone differs from its batch\n",
                             c.name.c_str(), s, t);
                    report += line;
                }
            }
        }
        // (e) each stream alone
        for (int s = 0; s < P.ns && P.ns > 1 && alone_ok; ++s) {
            std::vector<float> ys;
            alone_ok = graph_attention(cpu, alone_stream(P, s), scale, ys) &&
                       std::memcmp(ys.data(), &y_ours[size_t(s) * P.N * row], ys.size() * sizeof(float)) == 0;
            if (!alone_ok) {
                snprintf(line, sizeof line, "FAIL attention %s: stream %d alone differs from its batch\n", c.name.c_str(), s);
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
            snprintf(line, sizeof line, "FAIL attention %s: nmse vs ggml %.3g, vs f64 %.3g (ggml's %.3g), scalar %s%s\n",
                     c.name.c_str(), e_ggml, e_ref, g_ref, same_s ? "same" : "DIFFERS", ok ? "" : " (compute failed)");
            report += line;
        }
    }
    snprintf(line, sizeof line,
             "attn  %-6s threads=%d: %3d cases (%zu with interleaved sequences or streams), %d failed; worst nmse vs "
             "ggml %.2e, vs f64 %.2e (ggml's own %.2e); vs scalar, rows alone, streams alone: bit for bit\n",
             isa_name(isa), n_threads, n_cases, n_multi, failures, w_ggml, w_ref, w_gref);
    report += line;
    return failures;
}

}  // namespace dflash::kern
