// Loading a `dflash` GGUF (DFlash v1 and DFlash2) next to its target GGUF: metadata, tensor
// declarations with expected shapes, the drafter/target compatibility checks, weight upload,
// the borrowed (mapped) target embedding/head and the context cache.
#include "drafter.h"

#include "error.h"
#include "gguf_meta.h"
#include "kernels/kernels_backend.h"

#include "ggml-cpu.h"
#include "gguf.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <unistd.h>

namespace dflash {

namespace {

std::string shape_str(const ggml_tensor * t) {
    std::string s = "[";
    for (int i = 0; i < ggml_n_dims(t); ++i) {
        s += (i ? ", " : "") + std::to_string(t->ne[i]);
    }
    return s + "]";
}

const char * kArch = "dflash";
// Far above trained DFlash blocks (16); bounds the per-block graph and cache a file can ask for.
constexpr int32_t kMaxBlockSize = 1024;
constexpr int32_t kMaxLayers    = 1024;  // drafters have 1-8
// Tensors of one drafter graph (nodes + leafs + views), with room: sizes the scheduler's tables.
constexpr size_t  kSchedGraphSize = 8192;

}  // namespace

// Declares the drafter's tensors from the file (expected ggml shapes, required/optional) into a
// weights context, then uploads them. Norms and conv bases are kept F32 whatever the file holds.
struct DrafterLoader {
    Drafter &          d;
    const char *       path;
    ParsedGguf         file;
    GgufMeta           meta{nullptr, ""};
    std::set<std::string> used;

    struct Planned {
        ggml_tensor * dst;
        const ggml_tensor * src;  // in file.meta
        int64_t index;            // gguf tensor index
    };
    std::vector<Planned> planned;
    // The target's head (read-only metadata) and, for a d2t drafter that ships no head rows, the
    // tensor those rows are gathered into once the target is mapped (Drafter::load).
    const ggml_tensor * target_head = nullptr;
    ggml_tensor *       head_from_target = nullptr;

    DrafterLoader(Drafter & d, const char * path) : d(d), path(path), file(open_gguf(path, "drafter")) {
        meta = GgufMeta{file.gguf.get(), path};
    }

    void read_hparams() {
        DrafterHparams & hp = d.hp_;
        const std::string arch = meta.has("general.architecture") ? meta.str("general.architecture") : "";
        if (arch != kArch) {
            fail(DFLASH_ERR_FORMAT, "'%s' is not a DFlash drafter (general.architecture = '%s', expected '%s')",
                 path, arch.c_str(), kArch);
        }
        const std::string p = std::string(kArch) + ".";
        hp.n_embd    = int32_t(meta.integer(p + "embedding_length"));
        hp.n_layer   = int32_t(meta.integer(p + "block_count"));
        if (hp.n_layer <= 0 || hp.n_layer > kMaxLayers) {  // before anything is sized by it
            fail(DFLASH_ERR_FORMAT, "'%s': %sblock_count %d is outside 1..%d", path, p.c_str(), hp.n_layer, kMaxLayers);
        }
        hp.n_ff      = int32_t(meta.integer(p + "feed_forward_length"));
        hp.n_head    = int32_t(meta.integer(p + "attention.head_count"));
        hp.n_head_kv = int32_t(meta.integer(p + "attention.head_count_kv", hp.n_head));
        hp.head_dim  = int32_t(meta.integer(p + "attention.key_length", hp.n_head > 0 && hp.n_embd > 0 ? hp.n_embd / hp.n_head : 0));
        if (meta.integer(p + "attention.value_length", hp.head_dim) != hp.head_dim) {
            fail(DFLASH_ERR_UNSUPPORTED, "'%s': key_length != value_length is not supported", path);
        }
        meta.need(p + "attention.layer_norm_rms_epsilon");
        hp.rms_eps   = meta.real(p + "attention.layer_norm_rms_epsilon", 1e-6f);
        hp.rope_base = meta.real(p + "rope.freq_base", 10000.0f);
        if (meta.has(p + "rope.scaling.type")) {
            const std::string kind = meta.str(p + "rope.scaling.type");
            if (kind == "linear") {
                hp.rope_freq_scale = 1.0f / meta.real(p + "rope.scaling.factor", 1.0f);
            } else if (kind != "none") {
                fail(DFLASH_ERR_UNSUPPORTED, "'%s': rope scaling '%s' is not supported", path, kind.c_str());
            }
        }
        hp.block_size = int32_t(meta.integer(p + "block_size"));
        for (int64_t l : meta.int_array(p + "target_layers")) {
            hp.target_layers.push_back(int32_t(l));
        }
        if (hp.target_layers.empty()) {
            fail(DFLASH_ERR_FORMAT, "'%s': %starget_layers is empty", path, p.c_str());
        }
        hp.causal = meta.flag(p + "attention.causal", false);
        hp.n_swa  = int32_t(meta.integer(p + "attention.sliding_window", 0));
        hp.swa_layers.assign(hp.n_layer, false);
        if (hp.n_swa > 0) {
            if (meta.has(p + "attention.sliding_window_pattern")) {
                const auto pattern = meta.int_array(p + "attention.sliding_window_pattern");
                for (int il = 0; il < hp.n_layer && il < int(pattern.size()); ++il) {
                    hp.swa_layers[il] = pattern[il] != 0;
                }
            } else {
                hp.swa_layers.assign(hp.n_layer, true);
            }
        }
        hp.mask_token_id = int32_t(meta.has("tokenizer.ggml.mask_token_id") ? meta.integer("tokenizer.ggml.mask_token_id")
                                                                             : meta.integer(p + "mask_token_id", -1));
        if (hp.mask_token_id < 0) {
            fail(DFLASH_ERR_FORMAT, "'%s' has no tokenizer.ggml.mask_token_id", path);
        }
        hp.logit_scale     = meta.real(p + "logit_scale", 1.0f);
        hp.softcap         = meta.real(p + "final_logit_softcapping", 0.0f);
        hp.embedding_scale = meta.real(p + "embedding_scale", 1.0f);
        hp.selector_top_k  = int32_t(meta.integer(p + "selector_top_k", 0));
        read_acceptance_profile(p);
        if (hp.is_dflash2()) {
            hp.conv_kernel   = int32_t(meta.integer(p + "conv_kernel_size"));
            hp.conv_group    = int32_t(meta.integer(p + "conv_group_size"));
            hp.selector_rank = int32_t(meta.integer(p + "selector_rank"));
            if (hp.selector_rank < 1) {
                fail(DFLASH_ERR_FORMAT, "'%s': DFlash2 selector_rank %d must be >= 1", path, hp.selector_rank);
            }
            if (hp.conv_kernel < 1 || hp.conv_group < 1 || hp.n_embd % hp.conv_group != 0) {
                fail(DFLASH_ERR_FORMAT, "'%s': DFlash2 hidden size %d must be divisible by conv_group_size %d (kernel %d)",
                     path, hp.n_embd, hp.conv_group, hp.conv_kernel);
            }
        }
        // ggml asserts on these (rms_norm needs eps >= 0, rope an even head size): refuse them here
        const float reals[]       = {hp.rms_eps, hp.rope_base, hp.rope_freq_scale};
        const char * real_names[] = {"attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"};
        for (int i = 0; i < 3; ++i) {
            if (!(std::isfinite(reals[i]) && reals[i] > 0.0f)) {
                fail(DFLASH_ERR_FORMAT, "'%s': %s%s = %g must be a positive finite number", path, p.c_str(),
                     real_names[i], double(reals[i]));
            }
        }
        if (!std::isfinite(hp.logit_scale) || !std::isfinite(hp.embedding_scale) || !std::isfinite(hp.softcap) ||
            hp.softcap < 0.0f) {
            fail(DFLASH_ERR_FORMAT, "'%s': logit_scale %g, embedding_scale %g and softcapping %g must be finite (softcap >= 0)",
                 path, double(hp.logit_scale), double(hp.embedding_scale), double(hp.softcap));
        }
        if (hp.head_dim % 2 != 0) {
            fail(DFLASH_ERR_FORMAT, "'%s': head size %d must be even for RoPE", path, hp.head_dim);
        }
        if (hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.head_dim <= 0 ||
            hp.n_head % hp.n_head_kv != 0 || hp.block_size <= 0 || hp.block_size > kMaxBlockSize) {
            fail(DFLASH_ERR_FORMAT, "'%s': invalid drafter dimensions (embd %d, layers %d, heads %d/%d, head_dim %d, "
                 "block %d; the block must be 1..%d)", path, hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim,
                 hp.block_size, kMaxBlockSize);
        }
    }

    // Optional measured acceptance profile (pydflash drafter-profile): one conditional rate per
    // draft position (at most block_size - 1 of them), each in [0, 1], and the drafts behind it.
    void read_acceptance_profile(const std::string & p) {
        DrafterHparams & hp = d.hp_;
        const std::string key = p + "acceptance_profile";
        if (!meta.has(key)) {
            return;
        }
        hp.acceptance = meta.real_array(key);
        const size_t most = size_t(std::max(hp.block_size - 1, 1));
        if (hp.acceptance.empty() || hp.acceptance.size() > std::min<size_t>(most, 64)) {
            fail(DFLASH_ERR_FORMAT, "'%s': %s has %zu rates, expected 1..%zu (block_size - 1)", path, key.c_str(),
                 hp.acceptance.size(), most);
        }
        for (size_t j = 0; j < hp.acceptance.size(); ++j) {
            const float a = hp.acceptance[j];
            if (!(std::isfinite(a) && a >= 0.0f && a <= 1.0f)) {
                fail(DFLASH_ERR_FORMAT, "'%s': %s[%zu] = %g is not a probability", path, key.c_str(), j, double(a));
            }
        }
        hp.acceptance_drafts = meta.integer(p + "acceptance_profile_drafts", 0);
        if (hp.acceptance_drafts < 0) {
            fail(DFLASH_ERR_FORMAT, "'%s': %sacceptance_profile_drafts is negative", path, p.c_str());
        }
    }

    // Declare tensor `name` with ggml shape `ne` (n_dims entries); nullptr if optional and absent.
    // host: placed in host memory (tensors only the CPU reads, e.g. the selector codebooks).
    ggml_tensor * tensor(const std::string & name, std::initializer_list<int64_t> ne, bool required = true,
                         bool force_f32 = false, bool host = false) {
        const ggml_tensor * src = ggml_get_tensor(file.meta.get(), name.c_str());
        if (!src) {
            if (required) {
                fail(DFLASH_ERR_FORMAT, "'%s' is missing tensor '%s'", path, name.c_str());
            }
            return nullptr;
        }
        int i = 0;
        bool ok = ggml_n_dims(src) <= int(ne.size());
        for (int64_t n : ne) {  // -1: any size (checked by the caller)
            ok = ok && (n < 0 || src->ne[i] == n);
            ++i;
        }
        if (!ok) {
            std::string want = "[";
            i = 0;
            for (int64_t n : ne) {
                want += (i++ ? ", " : "") + std::to_string(n);
            }
            fail(DFLASH_ERR_FORMAT, "'%s': tensor '%s' has shape %s, expected %s]", path, name.c_str(),
                 shape_str(src).c_str(), want.c_str());
        }
        const ggml_type type = force_f32 ? GGML_TYPE_F32 : src->type;
        ggml_tensor * dst = ggml_new_tensor((host ? d.ctx_host_ : d.ctx_weights_).get(), type, int(ne.size()), src->ne);
        ggml_set_name(dst, name.c_str());
        planned.push_back({dst, src, gguf_find_tensor(file.gguf.get(), name.c_str())});
        used.insert(name);
        return dst;
    }

    void declare_tensors() {
        const DrafterHparams & hp = d.hp_;
        const int64_t H = hp.n_embd, qd = int64_t(hp.n_head) * hp.head_dim, kvd = int64_t(hp.n_head_kv) * hp.head_dim;
        const size_t n_tensors = gguf_get_n_tensors(file.gguf.get());
        ggml_init_params ip = {ggml_tensor_overhead() * (n_tensors + 8), nullptr, /*no_alloc*/ true};
        d.ctx_weights_.reset(ggml_init(ip));
        d.ctx_host_.reset(ggml_init(ip));

        DrafterWeights & w = d.w_;
        // F32 whatever the file holds: raw target features carry massive activations that an 8-bit
        // activation rounding (quantized mul_mat) would smear over their whole block
        w.fc              = tensor("fc.weight", {hp.n_feat(), H}, true, true);
        w.enc_output_norm = tensor("enc.output_norm.weight", {H}, true, true);
        w.output_norm     = tensor("output_norm.weight", {H}, true, true);
        w.layers.resize(hp.n_layer);
        for (int il = 0; il < hp.n_layer; ++il) {
            DrafterLayer & L = w.layers[il];
            const std::string b = "blk." + std::to_string(il) + ".";
            L.attn_norm   = tensor(b + "attn_norm.weight", {H}, true, true);
            L.wq          = tensor(b + "attn_q.weight", {H, qd});
            L.wk          = tensor(b + "attn_k.weight", {H, kvd});
            L.wv          = tensor(b + "attn_v.weight", {H, kvd});
            L.wo          = tensor(b + "attn_output.weight", {qd, H});
            L.attn_q_norm = tensor(b + "attn_q_norm.weight", {hp.head_dim}, true, true);
            L.attn_k_norm = tensor(b + "attn_k_norm.weight", {hp.head_dim}, true, true);
            L.ffn_norm    = tensor(b + "ffn_norm.weight", {H}, true, true);
            L.ffn_gate    = tensor(b + "ffn_gate.weight", {H, hp.n_ff});
            L.ffn_up      = tensor(b + "ffn_up.weight", {H, hp.n_ff});
            L.ffn_down    = tensor(b + "ffn_down.weight", {hp.n_ff, H});
            if (hp.is_dflash2()) {
                const int64_t T = hp.conv_kernel, proj = 2 * T * (H / hp.conv_group);
                L.attn_conv_base = tensor(b + "attn_conv_base", {H, T, 2}, true, true);
                L.attn_conv_proj = tensor(b + "attn_conv_proj.weight", {H, proj});
                L.ffn_conv_base  = tensor(b + "ffn_conv_base", {H, T, 2}, true, true);
                L.ffn_conv_proj  = tensor(b + "ffn_conv_proj.weight", {H, proj});
            }
        }
        if (hp.is_dflash2()) {
            const int64_t r = hp.selector_rank;
            w.selector_hidden      = tensor("selector_hidden.weight", {H, r});
            w.selector_predecessor = tensor("selector_predecessor.weight", {r, -1}, true, false, /*host*/ true);
            w.selector_successor   = tensor("selector_successor.weight", {r, -1}, true, false, /*host*/ true);
        } else if (ggml_get_tensor(file.meta.get(), "selector_hidden.weight")) {
            fail(DFLASH_ERR_FORMAT, "'%s' has selector tensors but no %s.selector_top_k", path, kArch);
        }
        declare_draft_vocab();
        reject_unknown_tensors();
    }

    // Reduced draft vocabulary (upstream's layout): `d2t` I64 [N] holds the absolute target id of
    // every draft row and `output.weight` [H, N] is the drafter's own head over those rows.
    // Without d2t the drafter uses the target's head and a shipped output.weight is ignored.
    // A d2t drafter without output.weight takes those rows of the target's head at load time
    // (the same bytes `pydflash draft-vocab` would store: a shipped file 7.8 MB smaller for
    // Qwen2.5's Q8_0 head at N = 8192).
    void declare_draft_vocab() {
        DrafterHparams & hp = d.hp_;
        const ggml_tensor * map = ggml_get_tensor(file.meta.get(), "d2t");
        if (!map) {
            return;
        }
        if (map->type != GGML_TYPE_I64 || ggml_n_dims(map) != 1 || map->ne[0] < 1 || map->ne[0] > hp.n_vocab) {
            fail(DFLASH_ERR_FORMAT, "'%s': d2t must be a 1-D I64 tensor of 1..%d target ids (got %s %s)", path,
                 hp.n_vocab, ggml_type_name(map->type), shape_str(map).c_str());
        }
        const int64_t N = map->ne[0];
        if (ggml_get_tensor(file.meta.get(), "output.weight")) {
            d.w_.output_draft = tensor("output.weight", {hp.n_embd, N});
        } else {
            if (!target_head) {
                fail(DFLASH_ERR_FORMAT, "'%s' has a d2t draft vocabulary but no output.weight (its draft head)", path);
            }
            const int64_t ne[2] = {hp.n_embd, N};
            head_from_target = ggml_new_tensor(d.ctx_weights_.get(), target_head->type, 2, ne);
            ggml_set_name(head_from_target, "output.weight (target rows at d2t)");
            d.w_.output_draft = head_from_target;
        }
        used.insert("d2t");

        std::vector<int64_t> ids(static_cast<size_t>(N));
        read_raw(gguf_find_tensor(file.gguf.get(), "d2t"), ids.data(), ids.size() * sizeof(int64_t), "d2t");
        std::vector<bool> seen(size_t(hp.n_vocab), false);
        d.d2t_.resize(size_t(N));
        for (int64_t i = 0; i < N; ++i) {
            const int64_t id = ids[size_t(i)];
            if (id < 0 || id >= hp.n_vocab || seen[size_t(id)]) {
                fail(DFLASH_ERR_FORMAT, "'%s': d2t[%lld] = %lld is %s", path, (long long) i, (long long) id,
                     id < 0 || id >= hp.n_vocab ? "outside the target's vocabulary" : "a duplicate target id");
            }
            seen[size_t(id)] = true;
            d.d2t_[size_t(i)] = int32_t(id);
        }
        hp.n_vocab_draft = int32_t(N);
    }

    // Read n_bytes of tensor `index` from the file.
    void read_raw(int64_t index, void * dst, size_t n_bytes, const char * name) const {
        FILE * f = fopen(path, "rb");
        if (!f) {
            fail(DFLASH_ERR_IO, "drafter '%s': %s", path, strerror(errno));
        }
        const size_t offset = gguf_get_data_offset(file.gguf.get()) + gguf_get_tensor_offset(file.gguf.get(), index);
        const bool ok = fseek(f, long(offset), SEEK_SET) == 0 && fread(dst, 1, n_bytes, f) == n_bytes;
        fclose(f);
        if (!ok) {
            fail(DFLASH_ERR_IO, "drafter '%s': cannot read tensor '%s'", path, name);
        }
    }

    // A tensor this engine does not use would change the math (fc.scale, attention sinks, ...):
    // refuse rather than compute something else. A shipped token_embd (and, without d2t, output)
    // is ignored: the drafter reads the target's raw embedding rows and head, as the reference does.
    void reject_unknown_tensors() const {
        for (int64_t i = 0; i < gguf_get_n_tensors(file.gguf.get()); ++i) {
            const std::string name = gguf_get_tensor_name(file.gguf.get(), i);
            if (used.count(name) == 0 && name != "token_embd.weight" && name != "output.weight") {
                fail(DFLASH_ERR_UNSUPPORTED, "'%s': tensor '%s' is not supported by this drafter engine", path,
                     name.c_str());
            }
        }
    }

    // Upload every declared tensor from the file (converting to F32 where forced).
    void upload() {
        // on the CPU the weights go to our multi-row kernels' buffer type (plain host memory in
        // ggml's layout; ggml-cpu runs everything else on it as usual)
        ggml_backend_buffer_type_t wbuft = ggml_backend_get_default_buffer_type(d.backend_weights());
        if (!d.backend_dev_ && kern::install() && kern::placement_enabled()) {
            wbuft = kern::buffer_type();
        }
        d.buf_weights_.reset(ggml_backend_alloc_ctx_tensors_from_buft(d.ctx_weights_.get(), wbuft));
        if (!d.buf_weights_) {
            fail(DFLASH_ERR_BACKEND, "cannot allocate the drafter weights on %s", d.device_name_.c_str());
        }
        ggml_backend_buffer_set_usage(d.buf_weights_.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        if (ggml_get_first_tensor(d.ctx_host_.get())) {
            d.buf_host_.reset(ggml_backend_alloc_ctx_tensors(d.ctx_host_.get(), d.backend_cpu_.get()));
            if (!d.buf_host_) {
                fail(DFLASH_ERR_BACKEND, "cannot allocate the drafter's host tensors");
            }
            ggml_backend_buffer_set_usage(d.buf_host_.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        }
        FILE * f = fopen(path, "rb");
        if (!f) {
            fail(DFLASH_ERR_IO, "drafter '%s': %s", path, strerror(errno));
        }
        std::vector<uint8_t> bytes;
        std::vector<float> f32;
        const size_t data_offset = gguf_get_data_offset(file.gguf.get());
        for (const Planned & p : planned) {
            const size_t n_bytes = ggml_nbytes(p.src);
            bytes.resize(n_bytes);
            const size_t offset = data_offset + gguf_get_tensor_offset(file.gguf.get(), p.index);
            if (fseek(f, long(offset), SEEK_SET) != 0 || fread(bytes.data(), 1, n_bytes, f) != n_bytes) {
                fclose(f);
                fail(DFLASH_ERR_IO, "drafter '%s': cannot read tensor '%s'", path, ggml_get_name(p.dst));
            }
            if (p.dst->type == p.src->type) {
                ggml_backend_tensor_set(p.dst, bytes.data(), 0, n_bytes);
                continue;
            }
            const ggml_type_traits * tt = ggml_get_type_traits(p.src->type);
            if (!tt->to_float) {
                fclose(f);
                fail(DFLASH_ERR_FORMAT, "'%s': tensor '%s' has type %s, which cannot be read as F32", path,
                     ggml_get_name(p.dst), ggml_type_name(p.src->type));
            }
            f32.resize(size_t(ggml_nelements(p.src)));
            tt->to_float(bytes.data(), f32.data(), ggml_nelements(p.src));
            ggml_backend_tensor_set(p.dst, f32.data(), 0, f32.size() * sizeof(float));
        }
        fclose(f);
    }
};

namespace {

struct TargetFacts {
    std::string arch;
    int32_t     n_embd = 0, n_layer = 0, n_vocab = 0;
    size_t      n_tokens = 0;  // tokenizer list length (0 if none)
};

}  // namespace

// The compute device by ggml name ("CPU", "CUDA0", "Metal", "RPC0", ...; NULL or "" = CPU), plus
// the CPU backend every sched needs last, for inputs and for what the device cannot run.
void Drafter::init_backends(const char * device) {
    const std::string want = device && *device ? device : "CPU";
    ggml_backend_dev_t dev = ggml_backend_dev_by_name(want.c_str());
    if (!dev) {
        std::string names;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            names += std::string(i ? ", " : "") + ggml_backend_dev_name(ggml_backend_dev_get(i));
        }
        fail(DFLASH_ERR_INVALID_ARGUMENT, "no device named '%s' in this build (devices: %s)", want.c_str(),
             names.c_str());
    }
    device_name_ = ggml_backend_dev_name(dev);
    backend_cpu_.reset(ggml_backend_cpu_init());
    if (!backend_cpu_) {
        fail(DFLASH_ERR_BACKEND, "cannot initialise the CPU backend");
    }
    ggml_backend_cpu_set_n_threads(backend_cpu_.get(), n_threads_);
    std::vector<ggml_backend_t> backends;
    if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        backend_dev_.reset(ggml_backend_dev_init(dev, nullptr));
        if (!backend_dev_) {
            fail(DFLASH_ERR_BACKEND, "cannot initialise device %s", device_name_.c_str());
        }
        backends.push_back(backend_dev_.get());
    }
    backends.push_back(backend_cpu_.get());
    // op_offload off: a mat-mul with host weights (the borrowed embedding) stays on the CPU
    // instead of uploading the whole weight for every block
    sched_.reset(ggml_backend_sched_new(backends.data(), nullptr, int(backends.size()), kSchedGraphSize,
                                        /*parallel*/ false, /*op_offload*/ false));
    if (!sched_) {
        fail(DFLASH_ERR_BACKEND, "cannot create the drafter's scheduler on %s", device_name_.c_str());
    }
}

std::unique_ptr<Drafter> Drafter::load(const char * path, const char * target_path, const dflash_drafter_params & params) {
    std::unique_ptr<Drafter> d(new Drafter());
    d->n_threads_ = params.n_threads > 0 ? params.n_threads : int32_t(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
    d->rng_.seed(params.seed);
    d->exact_head_ = params.exact_head;
    const int32_t n_ctx = params.n_ctx > 0 ? params.n_ctx : 4096;

    d->init_backends(params.device);

    DrafterLoader loader(*d, path);
    loader.read_hparams();
    DrafterHparams & hp = d->hp_;

    // -- the target: shape facts, then its embedding/head borrowed from a read-only mapping --
    ParsedGguf tgt = open_gguf(target_path, "target");
    GgufMeta tm{tgt.gguf.get(), target_path};
    TargetFacts tf;
    tf.arch    = tm.str("general.architecture");
    tf.n_embd  = int32_t(tm.integer(tf.arch + ".embedding_length"));
    tf.n_layer = int32_t(tm.integer(tf.arch + ".block_count"));
    tf.n_tokens = tm.array_len("tokenizer.ggml.tokens");
    const ggml_tensor * t_embd = ggml_get_tensor(tgt.meta.get(), "token_embd.weight");
    if (!t_embd) {
        fail(DFLASH_ERR_FORMAT, "target '%s' has no token_embd.weight", target_path);
    }
    const ggml_tensor * t_out = ggml_get_tensor(tgt.meta.get(), "output.weight");
    if (!t_out) {
        t_out = t_embd;  // tied embeddings
    }
    tf.n_vocab = int32_t(t_embd->ne[1]);
    hp.n_vocab = tf.n_vocab;
    hp.n_vocab_draft = tf.n_vocab;  // unless the drafter has a d2t (declare_tensors)

    // -- drafter vs target --
    if (hp.n_embd != tf.n_embd || t_embd->ne[0] != hp.n_embd || t_out->ne[0] != hp.n_embd) {
        fail(DFLASH_ERR_MISMATCH, "drafter '%s' has hidden size %d but target '%s' (%s) has %d: the drafter belongs to "
             "another target", path, hp.n_embd, target_path, tf.arch.c_str(), tf.n_embd);
    }
    if (t_out->ne[1] != tf.n_vocab) {
        fail(DFLASH_ERR_FORMAT, "target '%s': output.weight has %lld rows, token_embd.weight %d", target_path,
             (long long) t_out->ne[1], tf.n_vocab);
    }
    if (hp.is_dflash2() && hp.selector_top_k > tf.n_vocab) {
        fail(DFLASH_ERR_FORMAT, "drafter selector_top_k %d exceeds the target's vocabulary of %d tokens",
             hp.selector_top_k, tf.n_vocab);
    }
    if (hp.mask_token_id >= tf.n_vocab) {
        fail(DFLASH_ERR_MISMATCH, "drafter mask token id %d is outside the target's vocabulary of %d tokens",
             hp.mask_token_id, tf.n_vocab);
    }
    const size_t n_tokens_drafter = loader.meta.array_len("tokenizer.ggml.tokens");
    if (n_tokens_drafter && tf.n_tokens && n_tokens_drafter != tf.n_tokens) {
        fail(DFLASH_ERR_MISMATCH, "drafter vocabulary has %zu tokens, the target's %zu: the drafter belongs to another target",
             n_tokens_drafter, tf.n_tokens);
    }
    for (int32_t l : hp.target_layers) {
        if (l < 1 || l > tf.n_layer) {
            fail(DFLASH_ERR_MISMATCH, "drafter taps target layer %d (stored id + 1 = %d) but target '%s' has %d layers",
                 l - 1, l, target_path, tf.n_layer);
        }
    }

    loader.target_head = t_out;
    loader.declare_tensors();
    if (hp.is_dflash2()) {
        for (const ggml_tensor * cb : {d->w_.selector_predecessor, d->w_.selector_successor}) {
            if (cb->ne[1] != tf.n_vocab) {
                fail(DFLASH_ERR_MISMATCH, "drafter selector table '%s' covers %lld tokens, the target's vocabulary %d",
                     ggml_get_name(cb), (long long) cb->ne[1], tf.n_vocab);
            }
        }
    }
    loader.upload();

    // Borrow token_embd / output: same type and shape, data inside the mapping (no copy).
    d->target_map_ = std::make_unique<MappedFile>(target_path, "target");
    {
        ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
        d->ctx_target_.reset(ggml_init(ip));
        d->buf_target_.reset(ggml_backend_cpu_buffer_from_ptr(d->target_map_->addr, d->target_map_->size));
        const size_t data_offset = gguf_get_data_offset(tgt.gguf.get());
        auto borrow = [&](const ggml_tensor * src) {
            ggml_tensor * t = ggml_new_tensor(d->ctx_target_.get(), src->type, 2, src->ne);
            ggml_set_name(t, src->name);
            const size_t off = data_offset + gguf_get_tensor_offset(tgt.gguf.get(), gguf_find_tensor(tgt.gguf.get(), src->name));
            if (off + ggml_nbytes(t) > d->target_map_->size) {
                fail(DFLASH_ERR_FORMAT, "target '%s': tensor '%s' lies outside the file", target_path, src->name);
            }
            if (ggml_backend_tensor_alloc(d->buf_target_.get(), t, static_cast<char *>(d->target_map_->addr) + off) != GGML_STATUS_SUCCESS) {
                fail(DFLASH_ERR_BACKEND, "cannot wrap target tensor '%s'", src->name);
            }
            return t;
        };
        ggml_backend_buffer_set_usage(d->buf_target_.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        d->w_.tok_embd = borrow(t_embd);
        d->w_.output = t_out == t_embd ? d->w_.tok_embd : borrow(t_out);
    }
    if (loader.head_from_target) {  // the target head's rows at d2t, byte for byte, in its own type
        const size_t row = ggml_row_size(t_out->type, t_out->ne[0]);
        const auto * head = static_cast<const uint8_t *>(d->w_.output->data);  // in the target's mapping
        std::vector<uint8_t> rows(row * d->d2t_.size());
        for (size_t i = 0; i < d->d2t_.size(); ++i) {
            std::memcpy(rows.data() + i * row, head + size_t(d->d2t_[i]) * row, row);
        }
        ggml_backend_tensor_set(loader.head_from_target, rows.data(), 0, rows.size());
    }
    // A device drafter multiplies by the head on the device: a head in host memory would pull
    // the block's hidden states back to the CPU for the biggest mat-mul of the block. The exact
    // head is a CPU op and keeps reading the mapping; a reduced vocabulary has its own head.
    if (d->backend_dev_ && !d->exact_head_ && !d->w_.output_draft) {
        ggml_init_params ip = {ggml_tensor_overhead(), nullptr, true};
        d->ctx_head_.reset(ggml_init(ip));
        ggml_tensor * head = ggml_dup_tensor(d->ctx_head_.get(), d->w_.output);
        ggml_set_name(head, "output.weight (device copy)");
        d->buf_head_.reset(ggml_backend_alloc_ctx_tensors(d->ctx_head_.get(), d->backend_dev_.get()));
        if (!d->buf_head_) {
            fail(DFLASH_ERR_BACKEND, "cannot allocate the target's head (%zu MiB) on %s", ggml_nbytes(head) >> 20,
                 d->device_name_.c_str());
        }
        ggml_backend_buffer_set_usage(d->buf_head_.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_tensor_set(head, d->w_.output->data, 0, ggml_nbytes(head));
        d->w_.output = head;
    }

    // Context cache 0 (committed rows only); more are added per served sequence.
    d->n_ctx_rows_ = n_ctx;
    d->add_context();

    return d;
}

}  // namespace dflash
