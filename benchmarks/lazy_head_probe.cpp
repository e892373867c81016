// Would a lazy verification head pay? Measures, on the pinned libllama + ggml:
//   (a) one k-row verify decode with logits for the first m rows only (m = 1, 2, 4, k): the best
//       any lazy head can do is (a) at m = rows actually needed, since llama.cpp computes the
//       last layer's FFN and the head only for output rows;
//   (b) the target's head applied by ourselves (ggml mul_mat on the same quantized weight rows)
//       to m final hidden rows, i.e. the per-row price of evaluating the head outside libllama.
// Build (after `pip install -e .`, see benchmarks/lazy_head_probe.sh) and run:
//   lazy_head_probe TARGET.gguf [k=8] [threads=2] [reps=7]
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Time of one verify decode of k rows (logits for rows < m) on top of a prompt, KV rolled back after.
double verify_ms(llama_context * ctx, llama_batch & batch, int n_prompt, int k, int m) {
    batch.n_tokens = k;
    for (int i = 0; i < k; ++i) {
        batch.token[i] = 100 + i;
        batch.pos[i] = n_prompt + i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i < m;
    }
    const double t0 = now_ms();
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "decode failed\n");
        exit(1);
    }
    const double dt = now_ms() - t0;
    llama_memory_seq_rm(llama_get_memory(ctx), 0, n_prompt, -1);
    return dt;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s TARGET.gguf [k] [threads] [reps]\n", argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const int k = argc > 2 ? atoi(argv[2]) : 8;
    const int n_threads = argc > 3 ? atoi(argv[3]) : 2;
    const int reps = argc > 4 ? atoi(argv[4]) : 7;

    llama_backend_init();
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_model * model = llama_model_load_from_file(path, llama_model_default_params());
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_batch batch = llama_batch_init(512, 0, 1);

    // a 64-token prompt
    const int n_prompt = 64;
    batch.n_tokens = n_prompt;
    for (int i = 0; i < n_prompt; ++i) {
        batch.token[i] = 1000 + 7 * i;
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i == n_prompt - 1;
    }
    llama_decode(ctx, batch);

    // (b) the head by ourselves: the target's output (or tied embedding) rows, mapped read-only
    ggml_context * meta = nullptr;
    gguf_init_params gp = {true, &meta};
    gguf_context * g = gguf_init_from_file(path, gp);
    const ggml_tensor * src = ggml_get_tensor(meta, "output.weight");
    if (!src) {
        src = ggml_get_tensor(meta, "token_embd.weight");
    }
    const int64_t H = src->ne[0], V = src->ne[1];
    std::vector<uint8_t> head_bytes(ggml_nbytes(src));
    {
        FILE * f = fopen(path, "rb");
        fseek(f, long(gguf_get_data_offset(g) + gguf_get_tensor_offset(g, gguf_find_tensor(g, src->name))), SEEK_SET);
        if (fread(head_bytes.data(), 1, head_bytes.size(), f) != head_bytes.size()) {
            return 1;
        }
        fclose(f);
    }
    ggml_backend_t cpu = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(cpu, n_threads);
    auto head_ms = [&](int m) {
        ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead() + 1024, nullptr, true};
        ggml_context * gctx = ggml_init(ip);
        ggml_tensor * w = ggml_new_tensor_2d(gctx, src->type, H, V);
        ggml_tensor * h = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, H, m);
        ggml_tensor * out = ggml_mul_mat(gctx, w, h);
        ggml_cgraph * gf = ggml_new_graph(gctx);
        ggml_build_forward_expand(gf, out);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(gctx, cpu);
        ggml_backend_tensor_set(w, head_bytes.data(), 0, head_bytes.size());
        std::vector<float> hv(size_t(H) * m, 0.01f);
        ggml_backend_tensor_set(h, hv.data(), 0, hv.size() * sizeof(float));
        ggml_backend_graph_compute(cpu, gf);  // warm
        std::vector<double> t;
        for (int r = 0; r < reps; ++r) {
            const double t0 = now_ms();
            ggml_backend_graph_compute(cpu, gf);
            t.push_back(now_ms() - t0);
        }
        ggml_backend_buffer_free(buf);
        ggml_free(gctx);
        return median(t);
    };

    // single-token step (the unit)
    std::vector<double> step;
    std::vector<int> ms = {1, 2, 4, k};
    std::vector<std::vector<double>> by_m(ms.size());
    verify_ms(ctx, batch, n_prompt, k, k);  // warm
    for (int r = 0; r < reps; ++r) {  // interleaved
        step.push_back(verify_ms(ctx, batch, n_prompt, 1, 1));
        for (size_t i = 0; i < ms.size(); ++i) {
            by_m[i].push_back(verify_ms(ctx, batch, n_prompt, k, ms[i]));
        }
    }
    const double unit = median(step);
    printf("{\"target\": \"%s\", \"k\": %d, \"threads\": %d, \"head\": \"%s [%lld x %lld]\", \"step_ms\": %.2f,\n", path, k,
           n_threads, ggml_type_name(src->type), (long long) H, (long long) V, unit);
    printf(" \"verify_first_m_outputs\": {");
    for (size_t i = 0; i < ms.size(); ++i) {
        printf("%s\"%d\": {\"ms\": %.2f, \"steps\": %.2f}", i ? ", " : "", ms[i], median(by_m[i]), median(by_m[i]) / unit);
    }
    printf("},\n \"own_head_m_rows\": {");
    for (size_t i = 0; i < ms.size(); ++i) {
        const double t = head_ms(ms[i]);
        printf("%s\"%d\": {\"ms\": %.2f, \"steps\": %.2f}", i ? ", " : "", ms[i], t, t / unit);
    }
    printf("}}\n");
    ggml_backend_free(cpu);
    gguf_free(g);
    ggml_free(meta);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
