// Multi-query CPU attention for verify batches (issue #15): our FLASH_ATTN_EXT for fp16 K/V.
//
// ggml's CPU flash attention walks the whole KV cache once per query row and head: a verify batch
// of k tokens with g query heads per KV head reads and converts every K and V row k*g times, and
// at k = 8 that was 18-23 % of a verify. Here all queries that share a KV head (every token of the
// batch x the g heads of its group) are one unit: each K/V row is converted to f32 once per block
// and applied to all of them.
//
// Every query's result depends only on the run of KV positions visible to it, in cache order --
// not on where in the cache they are, nor on what else is in the batch or the cache. Blocks
// (softmax rescale) and chunks (threads) are counted in visible positions: kAttnBlock and
// kAttnChunk of them, from the first visible one. A unit holds only tokens whose visible sets are
// prefixes of one another (the tokens of one sequence in a batch: the causal tail differs, the
// rest is equal), and walks the positions visible to the longest one, so each query's blocks and
// chunks are the ones it would have alone; positions hidden from a query inside its unit's blocks
// add exactly nothing (exp(0) == 1 and exp(-inf) == 0 exactly). So a verify row is bit-identical
// to decoding that token alone, also when other sequences' cells are interleaved with its own in
// a unified cache or several streams share the op -- which ggml's own path is not (one row at
// >= 512 positions takes its split-KV path).
//
//   attention.cpp   coverage, visible runs and chunks, work split (KV head x query chunk x KV
//                   chunk), masks, merge
//   attn_scalar.cpp the reference block kernel (explicit fmaf; the same operations in the same
//                   order as the AVX2 path, so the two agree bit for bit)
//   attn_avx2.cpp   AVX2 + FMA + F16C block kernel (also used on AVX-512 machines)
#pragma once

#include <cstddef>
#include <cstdint>

struct ggml_tensor;
struct ggml_compute_params;

namespace dflash::kern {

constexpr int kAttnQueries = 16;  // queries per unit (two vectors of 8 lanes)
constexpr int kAttnBlock   = 32;  // visible KV positions per block (one softmax rescale per block)
constexpr int kAttnChunk   = 256; // visible KV positions per chunk (work split; merged in order)

// One block of up to kAttnBlock KV positions for one unit of queries.
struct AttnBlockArgs {
    const float *    qt;        // queries transposed: element d of query i at qt[d * qp + i]
    int              qp;        // lanes: 8 or 16 (lanes >= nq hold zeros)
    int              nq;        // real queries
    int              D;         // head size of K and V, multiple of 8
    const uint16_t * const * k; // fp16 key of position jj at k[jj] (D halves)
    const uint16_t * const * v; // fp16 value of position jj at v[jj]
    int              nj;        // positions in this block, 1..kAttnBlock
    const float *    mask;      // mask[jj * qp + i], added to the scaled score (-inf: masked)
    float            scale;
    float *          kf;        // scratch, kAttnBlock * D floats
    float *          p;         // scratch, kAttnBlock * qp floats (scores, then probabilities)
    float *          alpha;     // scratch, qp floats
    float *          m;         // running max per lane (qp), starts at -inf
    float *          l;         // running sum per lane (qp), starts at 0
    float *          o;         // running output, o[i * D + d] for i < nq, starts at 0
};
using AttnBlockFn = void (*)(const AttnBlockArgs & a);

namespace scalar {
void attn_block(const AttnBlockArgs & a);
}
#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 {
void attn_block(const AttnBlockArgs & a);
}
#endif

// exp(x) for x <= 0 (and -inf -> 0) in the operations both block kernels use: exp(0) is exactly 1
float attn_exp(float x);

// The shapes attn_compute takes: fp16 K/V, F32 Q/output, fp16 mask (one for all heads) or none,
// no sinks/ALiBi/softcap, at most max_rows tokens, head size a multiple of 8 up to 256, and a block kernel for
// the active ISA (NEON machines keep ggml's). Does not look at who owns the op (cpu_buffer.cpp).
bool   attn_shape_covered(const ggml_tensor * op, int max_rows);
size_t attn_work_size(int n_threads, const ggml_tensor * op);
void   attn_compute(const ggml_compute_params * params, ggml_tensor * op);

}  // namespace dflash::kern
