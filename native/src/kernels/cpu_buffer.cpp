// How the kernels plug into ggml without patching it: a CPU "extra buffer type" (the mechanism
// ggml-cpu uses for its own REPACK / AMX buffers, ggml-cpu/traits.h). We put ours at the FRONT of
// ggml-cpu's extra-buffer list before any model loads, so llama.cpp's weight placement
// (make_cpu_buft_list -> select_weight_buft) asks our supports_op first. Weights we accept are
// stored in ggml's normal block layout in plain host memory; at graph compute time ggml-cpu
// calls our tensor_traits::compute_forward for every MUL_MAT whose weight lives in our buffer,
// INSIDE its own graph compute and thread pool: no extra backend, no scheduler splits. Shapes we
// decline (compute_forward returns false) run through ggml's own mul_mat on the same bytes.
//
// What we give up: ggml's REPACK buffer (Q4_0/Q4_K/IQ4_NL on AVX2) no longer gets the weights we
// take, so every shape of those weights must be at least as fast in our kernels (the benchmark
// checks decode and prefill).
//
// Switches (read at each model load / each mat-mul):
//   PYDFLASH_KERNELS=0|off      new models' weights are not placed in our buffer (stock ggml)
//   PYDFLASH_KERNELS_ISA=...    scalar | avx2 | avx512 | neon | auto (dispatch.cpp)
//   PYDFLASH_KERNELS_MAX_ROWS=N activation-row batches above N go to ggml's kernels (default 512
//                               with a SIMD path, 64 scalar; our attention takes at most 64)
//   PYDFLASH_KERNELS_ATTN=0|off the attention of our models stays ggml's (attention.h)
//
// Attention: ggml-cpu asks every extra buffer type for tensor traits of EVERY op it computes
// (traits.cpp), not just of ops on our weights, so FLASH_ATTN_EXT can be ours although the KV cache
// is llama.cpp's. We take it only for models whose weights are in our buffer: the Q input is
// traced back to the mat-mul that made it (attention_is_ours).
#include "kernels_backend.h"

#include "attention.h"
#include "kernels.h"

#include "ggml-backend-impl.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "tiled/tiled.h"
#include "traits.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace dflash::kern {

namespace {

std::atomic<int> g_placement{-1};  // -1: follow PYDFLASH_KERNELS; 0 off; 1 on
std::atomic<int> g_max_rows{-1};
std::atomic<bool> g_legacy_single{true};  // tests: run one-row legacy mat-muls in our kernels too
// -1: our models' attention unless PYDFLASH_KERNELS_ATTN=0; 0 off; 1 every covered op; 2 our models'
std::atomic<int> g_attention{-1};

// Mat-muls of up to a whole default ubatch (prefill) run through our kernels in 16-row groups:
// on a 2-vCPU AVX-512 VNNI Xeon that prefills 256 tokens at 120.7 vs 80.0 tok/s (1.5B), 261.8 vs
// 163.3 (0.5B), 581.8 vs 348.1 (SmolLM2) against ggml's REPACK kernels, and the AVX2 path forced
// there at 90.8 vs 75.4 and 206.8 vs 158.2 (benchmarks/results/verify-kernels-avx512). The scalar
// reference keeps 64. Our attention is for verify-sized batches: at most kAttnMaxRows queries.
constexpr int kDefaultMaxRows = 512;
constexpr int kAttnMaxRows    = 64;

int max_rows() {
    int v = g_max_rows.load(std::memory_order_relaxed);
    if (v == -1) {
        const char * env = std::getenv("PYDFLASH_KERNELS_MAX_ROWS");
        v                = env && *env ? std::max(0, atoi(env)) : -2;
        g_max_rows.store(v);
    }
    if (v == -2) return active_isa() == Isa::scalar ? 64 : kDefaultMaxRows;  // by the ISA in use now
    return v;
}

ggml_backend_buffer_type_t our_buft();

bool in_our_buffer(const ggml_tensor * t) {
    return t && t->buffer && t->buffer->buft == our_buft();
}

// The shapes our compute_forward takes (anything else falls back to ggml on the same bytes).
const TypeKernels * covered(const ggml_tensor * op) {
    const ggml_tensor * w = op->src[0];
    const ggml_tensor * x = op->src[1];
    if (op->op != GGML_OP_MUL_MAT || !w || !x) return nullptr;
    const TypeKernels * tk = kernels_for(int(w->type));
    if (!tk) return nullptr;
    if (x->type != GGML_TYPE_F32 || op->type != GGML_TYPE_F32) return nullptr;
    if (w->ne[2] != 1 || w->ne[3] != 1 || w->ne[0] % tk->block != 0) return nullptr;
    if (w->nb[0] != ggml_type_size(w->type) || w->nb[1] != ggml_row_size(w->type, w->ne[0])) return nullptr;
    if (x->nb[0] != sizeof(float) || op->nb[0] != sizeof(float)) return nullptr;
    // activation rows may be strided; result rows must be evenly spaced
    if (op->nb[2] != op->nb[1] * op->ne[1] || op->nb[3] != op->nb[2] * op->ne[2]) return nullptr;
    const int64_t rows = x->ne[1] * x->ne[2] * x->ne[3];
    if (rows < 1 || rows > max_rows()) return nullptr;
    // One row runs through our kernels too (g_legacy_single stays on): ggml's vec_dot would be a
    // few % faster for one row of the legacy types, but then a plain step and a verify batch would
    // use different numerics, and greedy speculative output would no longer equal plain decoding
    // bit for bit (tests/test_speculative_loop.py asserts that).
    if (rows == 1 && tk->block == 32 && !g_legacy_single.load(std::memory_order_relaxed)) return nullptr;
    if (ggml_get_op_params_i32(op, 1) != 0) return nullptr;  // a hint we do not implement
    return tk;
}

// What ggml-cpu's own mul_mat needs (ggml_graph_plan's MUL_MAT case): the fallback runs on it.
size_t ggml_own_wsize(int n_threads, const ggml_tensor * op) {
    const ggml_type vdt = ggml_get_type_traits_cpu(op->src[0]->type)->vec_dot_type;
    size_t          cur = op->src[1]->type == vdt ? 0 : ggml_row_size(vdt, ggml_nelements(op->src[1]));
    cur = (cur + 63) & ~size_t(63);
    return cur + ggml_tiled_wdata_size(n_threads, const_cast<ggml_tensor *>(op));
}

bool attention_env_on() {
    static const bool on = [] {
        const char * env = std::getenv("PYDFLASH_KERNELS_ATTN");
        return !(env && (strcmp(env, "0") == 0 || strcmp(env, "off") == 0 || strcmp(env, "false") == 0 ||
                         strcmp(env, "no") == 0));
    }();
    return on;
}

// Q comes from a mat-mul through views, reshapes, RoPE and bias adds, all of which keep their
// main input in src[0]: the attention is our model's if that mat-mul's weight is in our buffer.
bool from_our_model(const ggml_tensor * t) {
    for (int depth = 0; t && depth < 16; ++depth, t = t->src[0]) {
        if (t->op == GGML_OP_MUL_MAT) return in_our_buffer(t->src[0]);
    }
    return false;
}

bool attention_is_ours(const ggml_tensor * op) {
    if (op->op != GGML_OP_FLASH_ATTN_EXT) return false;
    const int mode = g_attention.load(std::memory_order_relaxed);
    if (mode == 0 || (mode < 0 && !attention_env_on())) return false;
    if (!attn_shape_covered(op, std::min(max_rows(), kAttnMaxRows))) return false;
    return mode == 1 || from_our_model(op->src[0]);
}

class AttnTraits final : public ggml::cpu::tensor_traits {
  public:
    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        size = attn_work_size(n_threads, op);
        return true;
    }
    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        attn_compute(params, op);
        return true;
    }
};

AttnTraits g_attn_traits;

class Traits final : public ggml::cpu::tensor_traits {
  public:
    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        size_t need = ggml_own_wsize(n_threads, op);
        if (const TypeKernels * tk = covered(op)) {
            const int64_t rows = op->src[1]->ne[1] * op->src[1]->ne[2] * op->src[1]->ne[3];
            need = std::max(need, size_t(rows) * act_row_bytes(tk->act, op->src[0]->ne[0]) + 64);
        }
        size = need;
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        const TypeKernels * tk = covered(op);
        if (!tk) return false;
        const ggml_tensor * w  = op->src[0];
        const ggml_tensor * x  = op->src[1];
        const int64_t       K  = w->ne[0];
        const int64_t       nr = w->ne[1];
        const int64_t       n1 = x->ne[1], n2 = x->ne[2];
        const int64_t       rows = n1 * n2 * x->ne[3];
        const size_t        arb  = act_row_bytes(tk->act, K);
        uint8_t * abuf = reinterpret_cast<uint8_t *>((reinterpret_cast<uintptr_t>(params->wdata) + 63) & ~uintptr_t(63));
        const int ith = params->ith, nth = params->nth;

        // 1. quantize the activation rows once (rows split over the threads)
        for (int64_t t = ith; t < rows; t += nth) {
            const int64_t i1 = t % n1, i2 = (t / n1) % n2, i3 = t / (n1 * n2);
            const float * xr = reinterpret_cast<const float *>(static_cast<const char *>(x->data) + i1 * x->nb[1] +
                                                               i2 * x->nb[2] + i3 * x->nb[3]);
            tk->quantize(xr, abuf + t * arb, K);
        }
        // 2. weight rows in chunks, handed out dynamically (a busy core does not hold the others up)
        const int64_t chunk   = std::max<int64_t>(8, ((nr / (int64_t(nth) * 8)) + 7) & ~int64_t(7));
        const int64_t nchunks = (nr + chunk - 1) / chunk;
        if (ith == 0) ggml_threadpool_chunk_set(params->threadpool, nth);
        ggml_barrier(params->threadpool);

        MatMulArgs A;
        A.w            = static_cast<const uint8_t *>(w->data);
        A.w_row_bytes  = w->nb[1];
        A.a_row_bytes  = arb;
        A.c_row_floats = op->nb[1] / sizeof(float);
        A.K            = K;
        for (int64_t ci = ith; ci < nchunks;) {
            A.r0 = ci * chunk;
            A.r1 = std::min(nr, A.r0 + chunk);
            for (int64_t j0 = 0; j0 < rows; j0 += kMaxRows) {
                A.n = int(std::min<int64_t>(kMaxRows, rows - j0));
                A.a = abuf + j0 * arb;
                A.c = reinterpret_cast<float *>(op->data) + j0 * A.c_row_floats;
                tk->matmul(A);
            }
            ci = ggml_threadpool_chunk_add(params->threadpool, 1);
        }
        return true;
    }
};

Traits g_traits;

class Extra final : public ggml::cpu::extra_buffer_type {
  public:
    bool supports_op(ggml_backend_dev_t, const ggml_tensor * op) override {
        // ggml-cpu asks the buffer type of the first of src[0..3] that is an extra buffer
        const ggml_tensor * ours = nullptr;
        for (int i = 0; i < 4 && !ours; ++i) {
            if (in_our_buffer(op->src[i])) ours = op->src[i];
        }
        if (!ours) return false;
        const ggml_tensor * w = op->src[0];
        if (ggml_backend_buffer_get_size(ours->buffer) == 0) {
            // llama.cpp's placement probe (a 0-byte buffer): take a weight only for the mat-muls
            // we have kernels for
            const TypeKernels * tk = kernels_for(int(w->type));
            return placement_enabled() && op->op == GGML_OP_MUL_MAT && ours == w && tk && w->ne[2] == 1 &&
                   w->ne[3] == 1 && op->src[1]->type == GGML_TYPE_F32 && w->ne[0] % tk->block == 0;
        }
        // a tensor already in our buffer is in ggml's own layout in host memory, so whatever
        // ggml-cpu runs on host tensors is fine
        for (int i = 0; i < GGML_MAX_SRC; ++i) {
            if (op->src[i] && op->src[i]->buffer && !ggml_backend_buft_is_host(op->src[i]->buffer->buft)) return false;
        }
        if (op->op == GGML_OP_MUL_MAT && ours == w) {
            const ggml_type vdt = ggml_get_type_traits_cpu(w->type)->vec_dot_type;
            return op->src[1]->type == GGML_TYPE_F32 || op->src[1]->type == vdt;
        }
        return true;
    }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        if (op->op == GGML_OP_MUL_MAT && in_our_buffer(op->src[0])) return &g_traits;
        if (attention_is_ours(op)) return &g_attn_traits;
        return nullptr;
    }
};

const char * buft_name(ggml_backend_buffer_type_t) { return "CPU_DFLASH"; }

ggml_backend_buffer_t buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (!buf) return nullptr;
    buf->buft = buft;  // plain host memory in ggml's layout: the CPU buffer's functions all apply
    return buf;
}

size_t buft_alignment(ggml_backend_buffer_type_t) { return 64; }
bool   buft_is_host(ggml_backend_buffer_type_t) { return true; }

ggml_backend_buffer_type_t our_buft() {
    static ggml_backend_buffer_type buft = {
        /* .iface   = */ {
            /* .get_name       = */ buft_name,
            /* .alloc_buffer   = */ buft_alloc,
            /* .get_alignment  = */ buft_alignment,
            /* .get_max_size   = */ nullptr,
            /* .get_alloc_size = */ nullptr,
            /* .is_host        = */ buft_is_host,
        },
        /* .device  = */ ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0),
        /* .context = */ new Extra(),
    };
    return &buft;
}

bool g_registered = false;

}  // namespace

bool placement_enabled() {
    const int v = g_placement.load(std::memory_order_relaxed);
    return v < 0 ? enabled_from_env() : v == 1;
}

void set_placement(int mode) { g_placement.store(mode < 0 ? -1 : (mode ? 1 : 0)); }
void set_max_rows(int n) { g_max_rows.store(n); }
void set_legacy_single_row(bool on) { g_legacy_single.store(on); }
void set_attention(int mode) { g_attention.store(mode < 0 || mode > 2 ? -1 : mode); }

ggml_backend_buffer_type_t buffer_type() { return our_buft(); }

bool install() {
    static std::once_flag once;
    std::call_once(once, [] {
        ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (!cpu) return;
        auto & list = ggml_backend_cpu_get_extra_buffer_types();
        if (std::find(list.begin(), list.end(), our_buft()) == list.end()) {
            list.insert(list.begin(), our_buft());
        }
        // llama.cpp reads the list through this proc; ggml-cpu copies it on the first call, so we
        // must have been first. Check.
        auto fn = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
        if (fn) {
            for (ggml_backend_buffer_type_t * p = fn(cpu); p && *p; ++p) {
                if (*p == our_buft()) g_registered = true;
            }
        }
        if (!g_registered) {
            fprintf(stderr, "pydflash: the multi-row kernels could not be registered (ggml-cpu's extra "
                            "buffer list was read before); models use ggml's kernels\n");
        }
    });
    return g_registered;
}

bool installed() { return g_registered; }

}  // namespace dflash::kern
