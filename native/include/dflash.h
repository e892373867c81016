/*
 * dflash.h - the C API of pydflash's native core (the only boundary to Python).
 *
 * The core drives a GGUF target model through libllama (tokenize, chat template, batched
 * decode, hidden-state taps for DFlash drafters, KV rollback) and runs generation loops in C++
 * so that no Python runs per token.
 *
 * Usage:
 *
 *     dflash_target_params tp = dflash_target_default_params();
 *     tp.n_ctx = 2048;
 *     dflash_target * target = NULL;
 *     if (dflash_target_load("model.gguf", &tp, &target) != DFLASH_OK) {
 *         fprintf(stderr, "%s\n", dflash_last_error());
 *     }
 *     ...
 *     dflash_target_free(target);
 *
 * Errors: every function that can fail returns a dflash_status; on failure a human-readable
 * message is kept per thread and read with dflash_last_error(). No function aborts the process
 * on bad input.
 *
 * Threads: a handle may be used from one thread at a time (the caller serialises); different
 * handles may be used from different threads.
 *
 * Ownership: objects returned through `**out` are owned by the caller and released with their
 * `_free` function. Pointers returned by accessors are borrowed and stay valid until the next
 * call that changes that object (documented per function).
 *
 * The header is plain C99 and parsed by cffi: no macros inside declarations.
 */
#ifndef DFLASH_H
#define DFLASH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dflash_status {
    DFLASH_OK                   = 0,
    DFLASH_ERR_INVALID_ARGUMENT = 1,  /* a parameter is out of range or inconsistent */
    DFLASH_ERR_IO               = 2,  /* file missing or unreadable */
    DFLASH_ERR_FORMAT           = 3,  /* not a (valid, complete) GGUF model of the expected kind */
    DFLASH_ERR_CONTEXT_FULL     = 4,  /* the tokens do not fit in the context window */
    DFLASH_ERR_MISMATCH         = 5,  /* drafter and target do not belong together */
    DFLASH_ERR_BUFFER_TOO_SMALL = 6,  /* output buffer too small; the needed size was returned */
    DFLASH_ERR_BACKEND          = 7,  /* the compute backend failed (llama_decode error, OOM) */
    DFLASH_ERR_CANCELLED        = 8,  /* a callback asked to stop */
    DFLASH_ERR_UNSUPPORTED      = 9,  /* valid request this build/model cannot do */
    DFLASH_ERR_BUSY             = 10, /* the resource is in use (e.g. a slot running a request) */
    DFLASH_ERR_INTERNAL         = 99  /* a bug: please report */
} dflash_status;

/* Message of the last failed call on this thread ("" if none). Borrowed, valid until the next
 * failing call on the same thread. */
const char * dflash_last_error(void);

/* Version of this C API; the Python package checks it at import. */
int32_t dflash_abi_version(void);

/* The llama.cpp commit the core was built against. */
const char * dflash_llama_commit(void);

/* Route libllama/ggml log output: false (default) = only errors to stderr, true = everything. */
void dflash_set_verbose(bool verbose);

/* ---------------------------------------------------------------------------------------------
 * Compute devices: what this build of ggml can run on (CPU always; CUDA / Metal / Vulkan devices
 * when built with them; RPC devices once a server is added). A target offloads layers to them
 * with n_gpu_layers, a drafter picks one by name (dflash_drafter_params.device).
 * ------------------------------------------------------------------------------------------- */

typedef enum dflash_device_type {
    DFLASH_DEVICE_CPU   = 0,
    DFLASH_DEVICE_GPU   = 1,  /* dedicated memory (CUDA, Vulkan, RPC, ...) */
    DFLASH_DEVICE_IGPU  = 2,  /* memory shared with the host (Metal, integrated GPUs) */
    DFLASH_DEVICE_ACCEL = 3   /* an accelerator that works next to the CPU (BLAS, AMX) */
} dflash_device_type;

typedef struct dflash_device_info {
    const char *       name;          /* as dflash_drafter_params.device takes it (borrowed) */
    const char *       description;   /* borrowed */
    dflash_device_type type;
    uint64_t           memory_free;   /* bytes (0 if unknown) */
    uint64_t           memory_total;  /* bytes (0 if unknown) */
} dflash_device_info;

int32_t       dflash_device_count(void);
dflash_status dflash_device_get_info(int32_t index, dflash_device_info * out);

/* Add the devices of a ggml RPC server ("host:port", protocol of the pinned ggml; the shipped
 * `ggml-rpc-server` tool is one) to the device list; adding one endpoint twice is a no-op.
 * DFLASH_ERR_UNSUPPORTED in a build without RPC. Beware: ggml's RPC client aborts the process
 * when the endpoint cannot be reached or does not speak its protocol (the Python layer probes it
 * in a child process first), and when the server goes away while a device of it is in use. */
dflash_status dflash_add_rpc_server(const char * endpoint);

/* ---------------------------------------------------------------------------------------------
 * CPU verification kernels: multi-row quantized mat-mul (weights x 1..16 activation rows, each
 * weight block unpacked once for all rows), plugged into ggml-cpu as an extra buffer type. A
 * target (or CPU drafter) loaded while they are on places its Q4_K/Q5_K/Q6_K/Q8_0/Q5_0/Q4_1/Q4_0
 * mat-mul weights there; other weights and shapes run through ggml's own kernels.
 * Environment: PYDFLASH_KERNELS=0 (off for models loaded from then on), PYDFLASH_KERNELS_ISA=
 * scalar|avx2|avx512|neon|auto, PYDFLASH_KERNELS_MAX_ROWS=N (larger batches go to ggml; default 512, scalar 64; attention at most 64).
 * The attention of those models (fp16 KV cache, up to that many tokens) runs through our
 * multi-query kernel too: every query sharing a KV head in one pass over the cache, each row
 * bit-identical whatever the batch; PYDFLASH_KERNELS_ATTN=0 leaves it to ggml.
 * ------------------------------------------------------------------------------------------- */

/* Whether a model loaded now would use them (registered with ggml-cpu and not switched off). */
bool dflash_kernels_active(void);

/* The ISA the kernels run now, and the best this CPU and build allow ("scalar", "avx2",
 * "avx512" = AVX-512 VNNI, "neon" = arm64 dot-product; static strings). */
const char * dflash_kernels_isa(void);
const char * dflash_kernels_best_isa(void);

/* Whether this CPU and build can run `isa` (false for unknown names). */
bool dflash_kernels_isa_available(const char * isa);

/* Force an ISA for the mat-muls from now on (one of the above or "auto" = best), for tests and
 * comparisons. DFLASH_ERR_UNSUPPORTED if this CPU/build lacks it (nothing changes then). */
dflash_status dflash_kernels_set_isa(const char * isa);

/* Our attention for the models that use the kernels from now on (true, the default unless
 * PYDFLASH_KERNELS_ATTN=0) or ggml's (false), for comparisons. */
void dflash_kernels_set_attention(bool on);

/* Check every kernel of `isa` ("auto" = best) against ggml's own CPU mat-mul on the same tensors
 * (NMSE <= 5e-4) and a float64 dequantize-and-multiply reference, for all row counts 1..16 (and
 * 17, 40, 70: chunked and fallback paths), odd shapes, through ggml-cpu with n_threads threads;
 * quick = fewer shapes. *n_failed gets the failed cases, *worst_nmse the worst NMSE against ggml,
 * report (may be NULL) a per-type summary, NUL-terminated and truncated to report_size. */
dflash_status dflash_kernels_selftest(const char * isa, int32_t n_threads, bool quick, int32_t * n_failed,
                                      double * worst_nmse, char * report, size_t report_size);

/* ---------------------------------------------------------------------------------------------
 * Target model
 * ------------------------------------------------------------------------------------------- */

typedef struct dflash_target dflash_target;

typedef enum dflash_tap_source {
    DFLASH_TAP_AUTO        = 0,  /* layer-input API where the target's graph supports it */
    DFLASH_TAP_LAYER_INPUT = 1,  /* llama_set_embeddings_layer_inp (the archs whose graph records
                                  * layer inputs: derived from the llama.cpp tree at build time) */
    DFLASH_TAP_EVAL        = 2   /* graph eval callback on the "l_out-<il>" layer outputs */
} dflash_tap_source;

/* How rejected verify rows leave the target's memory (chosen at load from its memory type). */
typedef enum dflash_rollback {
    DFLASH_ROLLBACK_KV         = 0,  /* attention KV: the rejected cells are removed */
    DFLASH_ROLLBACK_SNAPSHOTS  = 1,  /* recurrent state snapshots per verified row (n_rs_seq) */
    DFLASH_ROLLBACK_CHECKPOINT = 2   /* recurrent state saved before a verify block, restored after
                                      * a rejection and the accepted rows decoded again */
} dflash_rollback;

typedef struct dflash_target_params {
    int32_t n_ctx;          /* context window in tokens (0 = 4096, capped to the trained size) */
    int32_t n_batch;        /* most tokens one decode call takes (0 = 512) */
    int32_t n_seq_max;      /* sequences decoded together (>= 1) */
    int32_t n_threads;      /* CPU threads (<= 0: all cores) */
    int32_t n_gpu_layers;   /* layers offloaded to a GPU build's device (-1: all) */
    int32_t tap_source;     /* a dflash_tap_source */
    int32_t n_verify_max;   /* recurrent memory: drafts per verify block its snapshots must cover
                             * (0 = 15; memory grows by one recurrent state per draft) */
} dflash_target_params;

typedef struct dflash_target_info {
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_ctx;          /* context window actually allocated */
    int32_t n_ctx_train;
    int32_t n_seq_max;
    int32_t token_bos;      /* -1 if none */
    int32_t token_eos;      /* -1 if none */
    bool    add_bos;        /* the vocab wants BOS prepended */
    bool    add_eos;        /* the vocab wants EOS appended */
    /* fill-in-the-middle tokens (-1 if the vocab has none) */
    int32_t token_fim_pre, token_fim_suf, token_fim_mid, token_fim_pad, token_fim_rep, token_fim_sep;
    int32_t token_sep;      /* -1 if none */
    int32_t rollback;       /* a dflash_rollback */
    int32_t n_verify_max;   /* most drafts one verify block may carry and be rolled back */
    int32_t tap_source;     /* DFLASH_TAP_LAYER_INPUT or DFLASH_TAP_EVAL: how taps are read */
} dflash_target_info;

dflash_target_params dflash_target_default_params(void);

/* Load a GGUF target and create its context. */
dflash_status dflash_target_load(const char * path, const dflash_target_params * params,
                                 dflash_target ** out);
void          dflash_target_free(dflash_target * target);

dflash_status dflash_target_get_info(const dflash_target * target, dflash_target_info * out);

/* A string metadata value of the GGUF ("" + DFLASH_ERR_INVALID_ARGUMENT if absent); writes at
 * most buf_size bytes including the terminator. */
dflash_status dflash_target_meta(const dflash_target * target, const char * key, char * buf,
                                 size_t buf_size);

/* Text -> tokens. On DFLASH_ERR_BUFFER_TOO_SMALL *n_out holds the needed count. */
dflash_status dflash_target_tokenize(const dflash_target * target, const char * text, size_t len,
                                     bool add_special, bool parse_special, int32_t * tokens,
                                     int32_t n_tokens_max, int32_t * n_out);

/* Tokens -> text. On DFLASH_ERR_BUFFER_TOO_SMALL *n_out holds the needed byte count. */
dflash_status dflash_target_detokenize(const dflash_target * target, const int32_t * tokens,
                                       int32_t n_tokens, bool render_special, char * buf,
                                       size_t buf_size, size_t * n_out);

/* Format chat messages with the model's own chat template (NULL template = the model's).
 * On DFLASH_ERR_BUFFER_TOO_SMALL *n_out holds the needed byte count. */
dflash_status dflash_target_apply_chat_template(const dflash_target * target,
                                                const char * const * roles,
                                                const char * const * contents, size_t n_messages,
                                                bool add_assistant, char * buf, size_t buf_size,
                                                size_t * n_out);

bool dflash_target_token_is_eog(const dflash_target * target, int32_t token);

/* Embeddings of tokens with libllama's own pooling (a llama_pooling_type: 0 none = one row per
 * token, 1 mean, 2 cls, 3 last = one row), un-normalised, into out [n_rows x n_embd_out].
 * Runs on a second context of the same weights (made on first use; generation is not
 * disturbed). On DFLASH_ERR_BUFFER_TOO_SMALL *n_out holds the needed float count. */
dflash_status dflash_target_embed(dflash_target * target, const int32_t * tokens, int32_t n_tokens,
                                  int32_t pooling, float * out, size_t n_out_max, size_t * n_out,
                                  int32_t * n_rows);

/* ---------------------------------------------------------------------------------------------
 * Chat templates and structured output, with llama.cpp's common chat library (its Jinja engine
 * and JSON-schema converter), as llama-server uses them. Strings it returns are freed with
 * dflash_string_free.
 * ------------------------------------------------------------------------------------------- */

typedef struct dflash_chat dflash_chat;

void dflash_string_free(char * s);

/* GBNF grammar for a JSON schema (JSON text). */
dflash_status dflash_json_schema_to_grammar(const char * schema_json, char ** out);

/* options_json (NULL = defaults): {"template": Jinja source or a built-in template name ("" =
 * the GGUF's), "use_jinja": true, "reasoning": "auto"|"on"|"off", "reasoning_format": name,
 * "prefill_assistant": true, "chat_template_kwargs": {...}} (llama-server's flags). A template
 * the engine cannot use fails here. */
dflash_status dflash_chat_create(const dflash_target * target, const char * options_json, dflash_chat ** out);
void          dflash_chat_free(dflash_chat * chat);
/* The template source in use. */
dflash_status dflash_chat_source(const dflash_chat * chat, char ** out);
/* Render an OpenAI chat request (JSON: messages, tools, tool_choice, add_generation_prompt,
 * continue_final_message, chat_template_kwargs, reasoning_format, reasoning_effort, grammar,
 * json_schema, response_format ...) with llama-server's checks (DFLASH_ERR_INVALID_ARGUMENT
 * with its message). *out: JSON {prompt, grammar, grammar_lazy, grammar_triggers,
 * preserved_tokens, additional_stops, json_schema, format, format_name, generation_prompt,
 * parser, parse_tool_calls, reasoning_format, is_continuation}. */
dflash_status dflash_chat_render(const dflash_chat * chat, const char * request_json, char ** out);
/* Split generated text into an OpenAI assistant message (content, reasoning_content,
 * tool_calls) with the parser of a render (render_json: what dflash_chat_render gave). */
dflash_status dflash_chat_parse(const dflash_chat * chat, const char * render_json, const char * text,
                                bool is_partial, char ** out);

/* -- low-level decoding (tests, training-data capture, research) ------------------------------ */

/* Capture the hidden state entering each of `layers` (0..n_layer; i.e. the output of layer-1)
 * for every row of every following decode. n_layers = 0 turns capture off. */
dflash_status dflash_target_set_taps(dflash_target * target, const int32_t * layers,
                                     int32_t n_layers);

/* Decode tokens at positions pos[i] of sequence seq_id (pos = NULL: continue after the
 * sequence's last position). all_logits: keep logits of every row (else only the last). */
dflash_status dflash_target_decode(dflash_target * target, int32_t seq_id, const int32_t * tokens,
                                   const int32_t * pos, int32_t n_tokens, bool all_logits);

/* Logits [n_vocab] of row `row` of the last decode (-1 = last row). Borrowed until the next
 * decode. */
dflash_status dflash_target_logits(dflash_target * target, int32_t row, const float ** out);

/* Captured features of tap `tap_index` from the last decode: [n_rows x n_embd] row-major F32.
 * Borrowed until the next decode. */
dflash_status dflash_target_tap_rows(dflash_target * target, int32_t tap_index,
                                     const float ** out, int32_t * n_rows);

/* Highest position held for seq_id (-1 if empty). */
int32_t dflash_target_seq_pos_max(const dflash_target * target, int32_t seq_id);

/* Forget positions >= pos of seq_id (pos = 0 clears it). */
dflash_status dflash_target_rollback(dflash_target * target, int32_t seq_id, int32_t pos);

/* ---------------------------------------------------------------------------------------------
 * Sampling and generation
 * ------------------------------------------------------------------------------------------- */

/* Applied in llama.cpp's default order: top-k, top-p, min-p on the raw logits, then
 * temperature, then a draw. temperature <= 0 is greedy (argmax, first index on ties). */
typedef struct dflash_sampling_params {
    float    temperature;   /* default 0.8 */
    int32_t  top_k;         /* <= 0: off; default 40 */
    float    top_p;         /* >= 1: off; default 0.95 */
    float    min_p;         /* <= 0: off; default 0.05 */
    uint64_t seed;          /* RNG seed */
} dflash_sampling_params;

typedef enum dflash_stop_reason {
    DFLASH_STOP_NONE       = 0,
    DFLASH_STOP_EOS        = 1,   /* an end-of-generation token */
    DFLASH_STOP_STRING     = 2,   /* one of the stop strings appeared */
    DFLASH_STOP_MAX_TOKENS = 3,
    DFLASH_STOP_CONTEXT    = 4,   /* the context window is full */
    DFLASH_STOP_CANCELLED  = 5    /* the token callback returned false */
} dflash_stop_reason;

typedef struct dflash_generate_params {
    int32_t               max_tokens;   /* < 0: until EOS / context full */
    dflash_sampling_params sampling;
    const char * const *  stop;         /* stop strings (may be NULL) */
    int32_t               n_stop;
    bool                  ignore_eos;
    /* Constraints on the target's logits, applied before every pick (so speculative decoding
     * verifies drafts against the constrained distribution and stays exact). Copied. */
    const char *          grammar;            /* GBNF with a "root" rule (NULL/"": none); one
                                                 that does not parse fails the call */
    const char *          grammar_prefix;     /* text the grammar consumes first (a chat
                                                 template's generation prompt), or NULL */
    const int32_t *       logit_bias_tokens;  /* added to these tokens' logits ... */
    const float *         logit_bias;         /* ... (-INFINITY bans a token) */
    int32_t               n_logit_bias;
    /* Probabilities of the generated tokens (llama-server's n_probs), see dflash_output_probs */
    int32_t               n_probs;            /* top candidates kept per token (0: none) */
    bool                  post_sampling_probs;  /* of the sampler's final distribution (else the
                                                   softmax of the raw logits) */
} dflash_generate_params;

typedef struct dflash_stats {
    int32_t n_prompt;               /* prompt tokens */
    int32_t n_generated;            /* generated tokens (including a trailing EOS) */
    int32_t n_verify_steps;         /* target decode calls after prefill */
    int32_t n_drafted;              /* draft tokens proposed */
    int32_t n_accepted;             /* draft tokens accepted */
    int32_t stop_reason;            /* a dflash_stop_reason */
    double  t_prefill_ms;
    double  t_draft_ms;
    double  t_verify_ms;
    double  t_accept_ms;
    double  t_total_ms;
    int32_t n_accepted_per_pos[16];  /* how often the draft at position i+1 was accepted */
    int32_t n_cached;               /* prompt tokens whose KV was reused from the slot (cache_prompt) */
    int32_t n_lookup_drafted;       /* of n_drafted: tokens proposed from the sequence's own history */
    int32_t n_lookup_accepted;      /* of n_accepted: such tokens accepted */
    int32_t n_trimmed;              /* drafter drafts not verified: cut by auto's trim (or p_min), not in n_drafted */
    double  t_rollback_ms;          /* recurrent targets' checkpoint rollback: saves, restores, replays */
    int32_t n_replayed;             /* rows decoded again after a rejection (checkpoint rollback) */
} dflash_stats;

/* Streaming: called once per committed token with the newly releasable UTF-8 text (may be empty
 * while a character is incomplete or the text could still become a stop string), and once more
 * with token -1 if text was still held back at the end. Return false to stop. */
typedef bool (*dflash_token_callback)(void * user_data, int32_t token, const char * piece,
                                      size_t n_piece);

typedef struct dflash_output dflash_output;

dflash_generate_params dflash_generate_default_params(void);

/* Plain autoregressive generation on sequence 0 of the target (the KV cache is cleared first).
 * Text stops before a stop string; tokens include the token that completed it. */
dflash_status dflash_target_generate(dflash_target * target, const int32_t * prompt,
                                     int32_t n_prompt, const dflash_generate_params * params,
                                     dflash_token_callback callback, void * user_data,
                                     dflash_output ** out);

/* Speculative-loop settings (llama.cpp's --spec-draft-n-max / --spec-draft-n-min). */
typedef struct dflash_spec_params {
    int32_t n_max;   /* most drafts verified per step */
    int32_t n_min;   /* shorter drafts are not verified */
    float   p_min;   /* greedy: cut a draft before the first pick its drafter gave p < p_min */
} dflash_spec_params;

/* Testing hook for the speculative loop, independent of any neural drafter: drafts replay
 * `continuation` (what plain decoding produced after the prompt) with every token shifted by
 * `offset` (0: drafts are always right; 1: always wrong). At T > 0 the drafts are proposed
 * with q = 1. */
dflash_status dflash_target_generate_replay(dflash_target * target, const int32_t * prompt,
                                            int32_t n_prompt, const int32_t * continuation,
                                            int32_t n_continuation, int32_t offset,
                                            const dflash_spec_params * spec,
                                            const dflash_generate_params * params,
                                            dflash_token_callback callback, void * user_data,
                                            dflash_output ** out);

const int32_t *      dflash_output_tokens(const dflash_output * output, int32_t * n_tokens);
const char *         dflash_output_text(const dflash_output * output, size_t * n_bytes);
const dflash_stats * dflash_output_stats(const dflash_output * output);
/* n_probs > 0: per generated token its log-probability (logprob[n_tokens]) and its n_probs most
 * likely candidates (top_ids / top_logprobs [n_tokens x n_probs], id -1 past the candidates).
 * *n_probs = 0 when none were asked for. Borrowed from the output. */
void                 dflash_output_probs(const dflash_output * output, int32_t * n_tokens, int32_t * n_probs,
                                         const float ** logprob, const int32_t ** top_ids,
                                         const float ** top_logprobs);
/* Training rows of a sequence added with dflash_request_params.capture (NULL / zeros otherwise):
 * features [n_rows x n_taps x n_embd], row p = the hidden states entering the scheduler's capture
 * layers at position p (p = 0 .. n_rows-1: the prompt, then every generated token the target
 * decoded), and labels [n_rows] = the target's argmax at row p, i.e. its greedy prediction for
 * position p + 1 (-1 where the target computed no logits: prompt rows before the last).
 * Borrowed from the output. */
const float *        dflash_output_capture(const dflash_output * output, int32_t * n_rows, int32_t * n_taps,
                                           int32_t * n_embd, const int32_t ** labels);
void                 dflash_output_free(dflash_output * output);

/* ---------------------------------------------------------------------------------------------
 * Model inspection
 * ------------------------------------------------------------------------------------------- */

/* What libllama itself makes of a GGUF (any arch, drafters included): loading it through
 * llama_model_load_from_file validates the arch, hyper-parameters and every tensor's shape. */
typedef struct dflash_model_summary {
    char     arch[64];             /* general.architecture */
    int32_t  n_layer;
    int32_t  n_embd;
    int32_t  n_head;
    int32_t  n_head_kv;
    int32_t  n_vocab;
    int32_t  token_mask;           /* tokenizer.ggml.mask_token_id as loaded (-1 if none) */
    int32_t  selector_top_k;       /* DFlash2 selector top-k as loaded (0: not DFlash2) */
    int32_t  n_target_layers;
    int32_t  target_layers[64];    /* dflash.target_layers as loaded (stored ids, = HF id + 1) */
    uint64_t n_params;
} dflash_model_summary;

dflash_status dflash_model_summarize(const char * path, dflash_model_summary * out);

/* ---------------------------------------------------------------------------------------------
 * Drafter (DFlash v1 / DFlash2, a `dflash` GGUF next to its target GGUF)
 *
 * One drafting round with anchor token x_s (the last committed token) at position s:
 *
 *     dflash_drafter_inject(d, F, pos, n);          committed rows' target features (once each)
 *     dflash_drafter_propose(d, x_s, s, B, T, ...); block [x_s, MASK x (B-1)] -> B-1 drafts + q
 *     ... target verifies; a drafts accepted ...
 *     dflash_drafter_crop(d, n_rows_committed);      drop rows that did not become committed
 *
 * Features F are [n x (n_target_layers * n_embd)] row-major F32: for each committed position p the
 * hidden states entering the target layers listed by dflash_drafter_target_layers(), concatenated
 * in that order (exactly what dflash_target_set_taps() with those layers captures). Each row is
 * stored at its own position; the block's own rows never enter the drafter cache.
 * ------------------------------------------------------------------------------------------- */

typedef struct dflash_drafter dflash_drafter;

typedef struct dflash_drafter_params {
    int32_t  n_ctx;         /* context rows the drafter cache holds (0 = 4096) */
    int32_t  n_threads;     /* CPU threads (<= 0: all cores) */
    uint64_t seed;          /* RNG of sampled proposals */
    bool     exact_head;    /* logits with F32 activations, the target's head rows dequantized on
                             * the fly (CPU; slower). false: ggml's quantized mat-mul as llama.cpp
                             * does, which rounds the activations to 8 bits for a quantized head */
    const char * device;    /* ggml device the drafter computes on, by name as dflash_device_get_info
                             * lists it ("CPU", "CUDA0", "Metal", "RPC0", ...); NULL or "" = CPU.
                             * Ops the device cannot run fall back to the CPU. */
} dflash_drafter_params;

typedef struct dflash_drafter_info {
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    int32_t n_vocab;            /* the target's vocabulary */
    int32_t block_size;         /* trained block length B (anchor + B-1 masks); most slots per block */
    int32_t mask_token_id;
    int32_t n_target_layers;    /* L: feature rows are L * n_embd wide */
    int32_t conv_kernel_size;   /* DFlash2 (0 for v1) */
    int32_t conv_group_size;    /* DFlash2 (0 for v1) */
    int32_t selector_rank;      /* DFlash2 (0 for v1) */
    int32_t selector_top_k;     /* K, DFlash2 (0 for v1) */
    int32_t n_ctx;              /* context rows the cache can hold */
    int32_t n_ctx_used;         /* context rows held now */
    bool    is_dflash2;
    int32_t n_vocab_draft;      /* rows of the draft head: n_vocab, or N for a reduced draft
                                 * vocabulary (a `d2t` map + own output.weight in the GGUF) */
    const char * device;        /* the device it computes on (borrowed, valid as long as the drafter) */
} dflash_drafter_info;

dflash_drafter_params dflash_drafter_default_params(void);

/* Load a drafter GGUF and pair it with its target GGUF (whose token embedding and lm_head are
 * mapped read-only, not copied). Drafter and target that do not belong together (hidden size,
 * vocabulary, mask id, tapped layers) give DFLASH_ERR_MISMATCH. */
dflash_status dflash_drafter_load(const char * path, const char * target_gguf_path,
                                  const dflash_drafter_params * params, dflash_drafter ** out);
void          dflash_drafter_free(dflash_drafter * drafter);

dflash_status dflash_drafter_get_info(const dflash_drafter * drafter, dflash_drafter_info * out);

/* The target layers whose inputs the drafter reads (= HF layer id + 1; pass them to
 * dflash_target_set_taps). Borrowed, valid as long as the drafter. */
dflash_status dflash_drafter_target_layers(const dflash_drafter * drafter, const int32_t ** layers,
                                           int32_t * n_layers);

/* The draft vocabulary as target token ids (ascending as pydflash writes it, any order as read):
 * draft head row i scores target token ids[i]. *ids = NULL, *n = 0 when the drafter drafts over
 * the full vocabulary. Borrowed, valid as long as the drafter. */
dflash_status dflash_drafter_draft_vocab(const dflash_drafter * drafter, const int32_t ** ids, int32_t * n);

/* The drafter's measured acceptance profile (GGUF `dflash.acceptance_profile`, written by
 * `pydflash drafter-profile`): rates[j] = P(draft j accepted | drafts before it accepted), greedy,
 * on held-out prompts; *n_drafts (may be NULL): the drafts measured. *rates = NULL, *n = 0 when the
 * file has none. Under auto n_max the scheduler takes it as its acceptance prior and prices a
 * probe with it before anything was verified. Borrowed, valid as long as the drafter. */
dflash_status dflash_drafter_acceptance_profile(const dflash_drafter * drafter, const float ** rates, int32_t * n,
                                                int64_t * n_drafts);

/* Append n feature rows [n x n_target_layers*n_embd] at positions[n] to the context. NaN
 * features become 0, others are clamped to +-65504. DFLASH_ERR_CONTEXT_FULL if they do not fit. */
dflash_status dflash_drafter_inject(dflash_drafter * drafter, const float * features,
                                    const int32_t * positions, int32_t n_rows);

/* The same rows given per tap: taps[k] is [n_rows x n_embd] for target layer k of
 * dflash_drafter_target_layers() (as dflash_target_tap_rows() returns them); n_taps must equal
 * n_target_layers. */
dflash_status dflash_drafter_inject_taps(dflash_drafter * drafter, const float * const * taps,
                                         int32_t n_taps, const int32_t * positions, int32_t n_rows);

/* Keep only the first n_keep context rows (no-op if fewer are held). */
dflash_status dflash_drafter_crop(dflash_drafter * drafter, int32_t n_keep);

/* Run the block [anchor, MASK x (n_block-1)] at positions start_pos.. (1 <= n_block <=
 * block_size) and copy out the final-normed hidden [n_block x n_embd] and the transformed logits
 * [n_block x n_vocab_draft] (over the draft vocabulary; either may be NULL). Row 0 is the anchor slot. */
dflash_status dflash_drafter_forward(dflash_drafter * drafter, int32_t anchor, int32_t start_pos,
                                     int32_t n_block, float * hidden, float * logits);

/* Run the block and draft tokens for slots 1..n_block-1: DFlash2 walks the candidate selector,
 * v1 takes each slot independently; temperature <= 0 is greedy.
 *   tokens     [n_block-1]                        drafted tokens (required)
 *   q          [(n_block-1) x q_width] or NULL    the distribution each slot was drawn from,
 *              q_width = selector_top_k (DFlash2, over `candidates`) or n_vocab_draft (v1, over
 *              the draft vocabulary); one-hot at the chosen entry when greedy
 *   candidates [(n_block-1) x selector_top_k] or NULL (DFlash2 only, target ids; ignored for v1)
 * tokens are always target ids. Sampling draws from the drafter's RNG (seeded by params.seed / dflash_drafter_set_seed). */
dflash_status dflash_drafter_propose(dflash_drafter * drafter, int32_t anchor, int32_t start_pos,
                                     int32_t n_block, float temperature, int32_t * tokens, float * q,
                                     int32_t * candidates);

void dflash_drafter_set_seed(dflash_drafter * drafter, uint64_t seed);

/* Context caches: a drafter serves several sequences (weights once), one context each; context 0
 * exists from load. inject / inject_taps / crop / forward / propose act on the selected one. */
dflash_status dflash_drafter_set_contexts(dflash_drafter * drafter, int32_t n_contexts);  /* grow to n */
dflash_status dflash_drafter_use_context(dflash_drafter * drafter, int32_t context);

/* Blocks of n_block slots for n_jobs contexts in one graph (the weights read once for all):
 * job i runs [anchors[i], MASK...] at start_pos[i].. over context contexts[i] (all distinct).
 * hidden [n_jobs x n_block x n_embd] and logits [n_jobs x n_block x n_vocab_draft] (either may
 * be NULL), job after job. */
dflash_status dflash_drafter_forward_batch(dflash_drafter * drafter, const int32_t * contexts,
                                           const int32_t * anchors, const int32_t * start_pos,
                                           int32_t n_jobs, int32_t n_block, float * hidden, float * logits);

/* ---------------------------------------------------------------------------------------------
 * Speculative generation
 * ------------------------------------------------------------------------------------------- */

/* DFlash speculative generation on sequence 0 of the target: prefill with the drafter's taps,
 * then draft a block, verify it in one target batch, accept (greedy: while the draft equals the
 * target's argmax; T > 0: exact rejection sampling with the drafter's q, residual resampling,
 * bonus token), roll rejected rows back in both caches, repeat. The output has the target's
 * distribution exactly (greedy: the target's argmax chain). spec->n_max is clamped to the
 * drafter's block_size - 1. The drafter must have been loaded next to this target's GGUF. */
dflash_status dflash_generate_speculative(dflash_target * target, dflash_drafter * drafter,
                                          const int32_t * prompt, int32_t n_prompt,
                                          const dflash_spec_params * spec,
                                          const dflash_generate_params * params,
                                          dflash_token_callback callback, void * user_data,
                                          dflash_output ** out);

/* Several sequences at once through one scheduler (sequence i in slot i, sampling seed = params
 * seed + i, fixed n_max): each step drafts one block per running sequence with the one drafter
 * (NULL: plain decoding; one context per sequence) and verifies all blocks in one target batch.
 * The target needs n_seq_max >= n_seq. callback (may be NULL) streams every sequence, called with
 * user_data[i] for sequence i; returning false stops that sequence only. outs receives n_seq
 * outputs (free each). */
dflash_status dflash_generate_batch(dflash_target * target, dflash_drafter * drafter,
                                    const int32_t * const * prompts, const int32_t * n_prompts,
                                    int32_t n_seq, const dflash_spec_params * spec,
                                    const dflash_generate_params * params,
                                    dflash_token_callback callback, void * const * user_data,
                                    dflash_output ** outs);

/* ---------------------------------------------------------------------------------------------
 * Scheduler: the one generation loop (plain and speculative, one sequence or many)
 *
 * A scheduler holds up to the target's n_seq_max sequences ("slots") over a target and an
 * optional drafter (its weights once, one context cache per slot). Sequences are added and
 * cancelled between steps; each dflash_scheduler_step():
 *   - admits queued sequences to free slots, reusing the KV of a slot's longest common prompt
 *     prefix (cache_prompt, as llama-server);
 *   - picks the draft width: fixed n_max, or under auto (n_max = -1) the width that maximises
 *     expected committed tokens per second over the whole batch, from costs and acceptance the
 *     loop measures itself (0: the drafter is not run), with occasional probes;
 *   - drafts one block per decoding sequence (capped by its own n_max / max_tokens / context),
 *     decodes one target batch holding every block plus prefill chunks of new sequences within
 *     the n_batch row budget, then per sequence accepts the verified prefix (greedy: argmax;
 *     T > 0: exact rejection sampling), commits tokens (callback, stop strings, EOS, max tokens)
 *     and rolls rejected rows back.
 * Finished sequences are collected with dflash_scheduler_finished / dflash_scheduler_take.
 * The scheduler uses the target's sequences (and the drafter's contexts) as it likes while it
 * exists: do not decode on them directly in between.
 * ------------------------------------------------------------------------------------------- */

typedef struct dflash_scheduler dflash_scheduler;

typedef struct dflash_scheduler_params {
    int32_t n_max;    /* drafts per sequence per step: -1 = auto (default), 0 = plain decoding */
    int32_t n_min;    /* shorter drafts are not verified */
    float   p_min;    /* greedy: cut a draft before the first pick its drafter gave p < p_min */
    int32_t n_batch;  /* most target rows per step (0 = the target's n_batch) */
    int32_t lookup;   /* greedy sequences also draft from their own history: the tokens after
                       * the latest earlier occurrence of their last `lookup`..4 tokens, verified
                       * in place of the drafter's block where that is priced to pay; with no
                       * drafter (NULL), these are the only drafts (default 2; 0 = off) */
} dflash_scheduler_params;

typedef struct dflash_request_params {
    dflash_generate_params gen;   /* max tokens, sampling (seed), stop strings (copied), EOS */
    int32_t n_max;                /* this sequence's drafts per step, fixed (-1 = the scheduler's) */
    int32_t n_min;                /* -1 = the scheduler's */
    float   p_min;                /* < 0 = the scheduler's */
    int32_t slot;                 /* slot to run in (-1 = any free one; the request waits for it) */
    bool    cache_prompt;         /* reuse the slot's KV of the longest common prompt prefix */
    bool    capture;              /* keep the target's features and argmax of every row this
                                   * sequence decodes (dflash_output_capture; training data): needs
                                   * dflash_scheduler_set_capture; the whole prompt is decoded */
} dflash_request_params;

typedef struct dflash_step_info {
    int32_t width;           /* most drafts a sequence verified in this step (0: plain) */
    bool    probe;           /* auto: a probe step (speculation is off by the estimates) */
    int32_t n_rows;          /* target rows decoded (blocks + prefill chunks) */
    int32_t n_prefill_rows;  /* of which prompt rows */
    int32_t n_decoding;      /* sequences that decoded (verified) in this step */
    int32_t n_drafting;      /* of which drafted */
    int32_t n_committed;     /* tokens committed in this step */
    int32_t n_finished;      /* finished sequences not yet taken */
    int32_t n_waiting;       /* sequences queued or running after this step */
    double  t_draft_ms, t_verify_ms, t_step_ms;
} dflash_step_info;

typedef struct dflash_slot_info {
    int32_t id;           /* sequence in the slot (0: free) */
    int32_t state;        /* 0 idle, 1 prefilling, 2 decoding */
    int32_t n_prompt, n_prefilled, n_generated, n_past;
    int32_t n_cached;     /* tokens whose KV the slot holds (reusable by the next request) */
    int32_t n_prompt_cached;  /* of the running sequence's prompt: tokens reused from the cache */
} dflash_slot_info;

/* What auto mode has learned (to remember across processes): target step time by total rows
 * (t_rows_ms[r-1], 0 = unknown), one sequence's drafter block by width (t_draft_ms[w-1]),
 * acceptance counts by draft position, and what auto's trim of greedy blocks learned. */
typedef struct dflash_tuning {
    float t_rows_ms[256];
    float t_draft_ms[16];
    float offered[16];
    float accepted[16];
    float trim_offered[16];   /* auto's trim: verified picks by the drafter's confidence (bin i: [i/10, (i+1)/10)) */
    float trim_accepted[16];  /* ... of those accepted */
    float trim_drafted[16];   /* blocks that proposed draft i + 1 having kept draft i */
    float trim_kept[16];      /* ... of those that kept it */
    float trim_blocks[16];    /* trimmed blocks by width (index = width) */
    float trim_block_kept[16];      /* ... their drafts kept */
    float trim_block_accepted[16];  /* ... their drafts accepted */
} dflash_tuning;

dflash_scheduler_params dflash_scheduler_default_params(void);
dflash_request_params   dflash_request_default_params(void);

/* drafter may be NULL (plain decoding); it must have been loaded next to this target's GGUF. The
 * target's n_batch must hold one row per slot. */
dflash_status dflash_scheduler_create(dflash_target * target, dflash_drafter * drafter,
                                      const dflash_scheduler_params * params, dflash_scheduler ** out);
void          dflash_scheduler_free(dflash_scheduler * scheduler);

/* Queue a sequence. callback (may be NULL) streams it with user_data; returning false stops it.
 * *id receives its id (> 0). */
dflash_status dflash_scheduler_add(dflash_scheduler * scheduler, const int32_t * prompt, int32_t n_prompt,
                                   const dflash_request_params * params, dflash_token_callback callback,
                                   void * user_data, int32_t * id);
/* A queued, running or finished sequence's output so far (tokens, probabilities): borrowed,
 * valid until the next step / take. A token callback may read it for the token it was given. */
dflash_status dflash_scheduler_peek(const dflash_scheduler * scheduler, int32_t id, const dflash_output ** out);
/* Stop a queued or running sequence at the next step (its stop reason: cancelled). */
dflash_status dflash_scheduler_cancel(dflash_scheduler * scheduler, int32_t id);
/* One step (returns at once when there is nothing to do). */
dflash_status dflash_scheduler_step(dflash_scheduler * scheduler, dflash_step_info * info);
/* Ids of finished sequences not taken yet; returns how many there are (writes at most n_ids). */
int32_t       dflash_scheduler_finished(const dflash_scheduler * scheduler, int32_t * ids, int32_t n_ids);
/* The output of a finished sequence (caller frees it); the sequence is forgotten. */
dflash_status dflash_scheduler_take(dflash_scheduler * scheduler, int32_t id, dflash_output ** out);
dflash_status dflash_scheduler_slot_info(const dflash_scheduler * scheduler, int32_t slot, dflash_slot_info * out);
/* Slot files (llama-server's /slots/{id}?action=save|restore|erase): an idle slot's KV and tokens
 * (DFLASH_ERR_BUSY while it runs a request). *n_tokens: tokens saved / restored / dropped;
 * *n_bytes (may be NULL): the file's size. After a restore a plain request reuses the restored
 * prefix; a speculative one re-decodes it (the drafter has no features for it). */
dflash_status dflash_scheduler_slot_save(dflash_scheduler * scheduler, int32_t slot, const char * path,
                                         int32_t * n_tokens, size_t * n_bytes);
dflash_status dflash_scheduler_slot_restore(dflash_scheduler * scheduler, int32_t slot, const char * path,
                                            int32_t * n_tokens, size_t * n_bytes);
dflash_status dflash_scheduler_slot_erase(dflash_scheduler * scheduler, int32_t slot, int32_t * n_tokens);
/* Target layers (as dflash_target_set_taps: the hidden state entering each) whose features
 * requests with `capture` keep; with a drafter they must be the drafter's own tap layers (the
 * target captures one set). n = 0 turns capture off. Between steps, while no capture request runs. */
/* Why the drafter given to dflash_scheduler_create is not used ("" when it is): e.g. the target's
 * graph exposes no hidden states at its tap layers. The scheduler then decodes plainly (and from
 * the history, if lookup is on). Valid while the scheduler lives. */
const char * dflash_scheduler_notice(const dflash_scheduler * scheduler);

dflash_status dflash_scheduler_set_capture(dflash_scheduler * scheduler, const int32_t * layers, int32_t n);
dflash_status dflash_scheduler_get_tuning(const dflash_scheduler * scheduler, dflash_tuning * out);
/* Fixed costs for auto's width policy in place of measured ones (tests, reproducible runs):
 * t_rows_ms[r - 1] = a target step of r rows, t_draft_ms[w - 1] = a drafter block of width w.
 * From then on it learns no timing (acceptance still), so its decisions do not depend on how busy
 * the machine is. */
dflash_status dflash_scheduler_fix_costs(dflash_scheduler * scheduler, const float * t_rows_ms, int32_t n_rows,
                                        const float * t_draft_ms, int32_t n_widths);
dflash_status dflash_scheduler_set_tuning(dflash_scheduler * scheduler, const dflash_tuning * tuning);

/* ---------------------------------------------------------------------------------------------
 * Quantization
 * ------------------------------------------------------------------------------------------- */

/* Progress of a long operation: `done` of `total` steps (tensors) finished. */
typedef void (*dflash_progress_callback)(void * user_data, int32_t done, int32_t total);

/* Quantize a GGUF (target or drafter) with libllama's own quantizer and its per-tensor type
 * rules, so the output is byte-identical to the pinned `llama-quantize IN OUT TYPE`.
 * type: "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "F16" or "BF16".
 * Refuses already-quantized input unless allow_requantize. The output is written to
 * "<out_path>.partial" and renamed into place on success. n_threads <= 0: all cores. */
dflash_status dflash_quantize(const char * in_path, const char * out_path, const char * type,
                              int32_t n_threads, bool allow_requantize,
                              dflash_progress_callback progress, void * user_data);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_H */
