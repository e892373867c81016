"""The ``dflash`` GGUF layout: metadata keys, tensor names, ggml shapes and storage types.

Single source of truth on the Python side (converter, tests, quantizer). It mirrors what
the pinned llama.cpp loads for ``general.architecture = "dflash"`` (src/llama-arch.cpp,
src/models/dflash.cpp, gguf-py/gguf/constants.py) and what its HF converter writes
(conversion/qwen.py ``DFlashModel``), restated here from the spec (docs section 3).

Tensor shapes: ``torch_shape`` is the HF / PyTorch shape; the ggml shape (``ne``) is the
same list reversed, and the bytes are stored unchanged (row-major torch = ne[0] fastest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

from ..reference.config import DFlashConfig, normalize_hf_name

__all__ = [
    "ARCH",
    "Keys",
    "Need",
    "OutType",
    "PlannedTensor",
    "Role",
    "TENSOR_RULES",
    "TensorRule",
    "drafter_metadata",
    "expected_tensors",
    "file_type",
    "ggml_shape",
    "plan_from_header",
    "plan_tensors",
    "storage_type",
]

ARCH = "dflash"


class Keys:
    """Full metadata key strings of a ``dflash`` GGUF (llama.cpp's LLM_KV_* names, arch = dflash)."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"

    BLOCK_COUNT = f"{ARCH}.block_count"
    CONTEXT_LENGTH = f"{ARCH}.context_length"
    EMBEDDING_LENGTH = f"{ARCH}.embedding_length"
    FEED_FORWARD_LENGTH = f"{ARCH}.feed_forward_length"
    HEAD_COUNT = f"{ARCH}.attention.head_count"
    HEAD_COUNT_KV = f"{ARCH}.attention.head_count_kv"
    KEY_LENGTH = f"{ARCH}.attention.key_length"
    VALUE_LENGTH = f"{ARCH}.attention.value_length"
    RMS_EPS = f"{ARCH}.attention.layer_norm_rms_epsilon"
    CAUSAL = f"{ARCH}.attention.causal"
    SLIDING_WINDOW = f"{ARCH}.attention.sliding_window"
    SLIDING_WINDOW_PATTERN = f"{ARCH}.attention.sliding_window_pattern"
    ROPE_FREQ_BASE = f"{ARCH}.rope.freq_base"
    ROPE_SCALING_TYPE = f"{ARCH}.rope.scaling.type"
    ROPE_SCALING_FACTOR = f"{ARCH}.rope.scaling.factor"
    ROPE_SCALING_ORIG_CTX = f"{ARCH}.rope.scaling.original_context_length"

    BLOCK_SIZE = f"{ARCH}.block_size"
    TARGET_LAYERS = f"{ARCH}.target_layers"  # stored as HF layer id + 1 (llama.cpp taps layer *inputs*)
    CONV_KERNEL_SIZE = f"{ARCH}.conv_kernel_size"
    CONV_GROUP_SIZE = f"{ARCH}.conv_group_size"
    SELECTOR_RANK = f"{ARCH}.selector_rank"
    SELECTOR_TOP_K = f"{ARCH}.selector_top_k"  # > 0 marks DFlash2 for the speculative loop
    LOGIT_SCALE = f"{ARCH}.logit_scale"  # mu (output_multiplier)
    FINAL_LOGIT_SOFTCAPPING = f"{ARCH}.final_logit_softcapping"
    EMBEDDING_SCALE = f"{ARCH}.embedding_scale"  # alpha (input_embedding_scale)

    MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"
    TOKENIZER_PREFIX = "tokenizer."


class Need(Enum):
    """When a tensor must be present."""

    ALWAYS = "always"  # DFlash v1 and DFlash2
    DFLASH2 = "dflash2"  # exactly when the config is DFlash2 (and must be absent otherwise)
    OPTIONAL = "optional"  # may be shipped; llama.cpp borrows the target's when absent


class Role(Enum):
    """How a tensor is stored, independent of the requested output type."""

    NORM = "norm"  # 1-D RMSNorm weights: always F32 (ggml norm/mul paths want F32)
    CONV_BASE = "conv_base"  # [2, T, H] base kernels, added to F32 coefficients: always F32
    FC = "fc"  # feature fusion: sees raw target features (massive activations), never F16
    WEIGHT = "weight"  # matrices: the requested output type


@dataclass(frozen=True)
class TensorRule:
    """One HF -> GGUF tensor mapping. ``{bid}`` in a name is the drafter layer index."""

    hf: str
    gguf: str
    torch_shape: Callable[[DFlashConfig], tuple[int, ...]]
    need: Need
    role: Role

    @property
    def per_layer(self) -> bool:
        return "{bid}" in self.hf


def _h(c: DFlashConfig) -> int:
    return c.hidden_size


def _conv_proj(c: DFlashConfig) -> tuple[int, int]:
    assert c.conv_kernel_size is not None
    return (2 * c.conv_kernel_size * c.conv_groups, c.hidden_size)


def _conv_base(c: DFlashConfig) -> tuple[int, int, int]:
    assert c.conv_kernel_size is not None
    return (2, c.conv_kernel_size, c.hidden_size)


def _codebook(c: DFlashConfig) -> tuple[int, int]:
    assert c.selector_rank is not None
    return (c.vocab_size, c.selector_rank)


def _selector_hidden(c: DFlashConfig) -> tuple[int, int]:
    assert c.selector_rank is not None
    return (c.selector_rank, c.hidden_size)


_A, _2, _O = Need.ALWAYS, Need.DFLASH2, Need.OPTIONAL

# Provenance: names from llama.cpp llama-arch.cpp / gguf-py constants.py (LLM_TENSOR_*),
# HF names from the published DFlash2 safetensors header (tests/data, copied from the project's shared reference) and the
# v1 checkpoints; shapes as created in src/models/dflash.cpp load_arch_tensors.
TENSOR_RULES: tuple[TensorRule, ...] = (
    # shipped only by drafters with their own vocab handling (TENSOR_NOT_REQUIRED upstream)
    TensorRule("embed_tokens.weight", "token_embd.weight", lambda c: (c.vocab_size, _h(c)), _O, Role.WEIGHT),
    # feature fusion ("encoder"): LLM_TENSOR_FC, LLM_TENSOR_ENC_OUTPUT_NORM
    TensorRule("fc.weight", "fc.weight", lambda c: (_h(c), c.num_taps * _h(c)), _A, Role.FC),
    TensorRule("hidden_norm.weight", "enc.output_norm.weight", lambda c: (_h(c),), _A, Role.NORM),
    # Qwen3 decoder layer (LLM_TENSOR_ATTN_* / FFN_*)
    TensorRule("layers.{bid}.input_layernorm.weight", "blk.{bid}.attn_norm.weight", lambda c: (_h(c),), _A, Role.NORM),
    TensorRule("layers.{bid}.self_attn.q_proj.weight", "blk.{bid}.attn_q.weight",
               lambda c: (c.num_attention_heads * c.head_dim, _h(c)), _A, Role.WEIGHT),
    TensorRule("layers.{bid}.self_attn.k_proj.weight", "blk.{bid}.attn_k.weight",
               lambda c: (c.num_key_value_heads * c.head_dim, _h(c)), _A, Role.WEIGHT),
    TensorRule("layers.{bid}.self_attn.v_proj.weight", "blk.{bid}.attn_v.weight",
               lambda c: (c.num_key_value_heads * c.head_dim, _h(c)), _A, Role.WEIGHT),
    TensorRule("layers.{bid}.self_attn.o_proj.weight", "blk.{bid}.attn_output.weight",
               lambda c: (_h(c), c.num_attention_heads * c.head_dim), _A, Role.WEIGHT),
    TensorRule("layers.{bid}.self_attn.q_norm.weight", "blk.{bid}.attn_q_norm.weight",
               lambda c: (c.head_dim,), _A, Role.NORM),
    TensorRule("layers.{bid}.self_attn.k_norm.weight", "blk.{bid}.attn_k_norm.weight",
               lambda c: (c.head_dim,), _A, Role.NORM),
    TensorRule("layers.{bid}.post_attention_layernorm.weight", "blk.{bid}.ffn_norm.weight",
               lambda c: (_h(c),), _A, Role.NORM),
    TensorRule("layers.{bid}.mlp.gate_proj.weight", "blk.{bid}.ffn_gate.weight",
               lambda c: (c.intermediate_size, _h(c)), _A, Role.WEIGHT),
    TensorRule("layers.{bid}.mlp.up_proj.weight", "blk.{bid}.ffn_up.weight",
               lambda c: (c.intermediate_size, _h(c)), _A, Role.WEIGHT),
    TensorRule("layers.{bid}.mlp.down_proj.weight", "blk.{bid}.ffn_down.weight",
               lambda c: (_h(c), c.intermediate_size), _A, Role.WEIGHT),
    # DFlash2 grouped dynamic convs (LLM_TENSOR_DFLASH_{ATTN,FFN}_CONV_{BASE,PROJ}); bases have no suffix
    TensorRule("layers.{bid}.attention_conv.base_kernel", "blk.{bid}.attn_conv_base", _conv_base, _2, Role.CONV_BASE),
    TensorRule("layers.{bid}.attention_conv.kernel_projection.weight", "blk.{bid}.attn_conv_proj.weight",
               _conv_proj, _2, Role.WEIGHT),
    TensorRule("layers.{bid}.mlp_conv.base_kernel", "blk.{bid}.ffn_conv_base", _conv_base, _2, Role.CONV_BASE),
    TensorRule("layers.{bid}.mlp_conv.kernel_projection.weight", "blk.{bid}.ffn_conv_proj.weight",
               _conv_proj, _2, Role.WEIGHT),
    # final norm (LLM_TENSOR_OUTPUT_NORM) and an optional own head (LLM_TENSOR_OUTPUT)
    TensorRule("norm.weight", "output_norm.weight", lambda c: (_h(c),), _A, Role.NORM),
    TensorRule("lm_head.weight", "output.weight", lambda c: (c.vocab_size, _h(c)), _O, Role.WEIGHT),
    # DFlash2 candidate selector (LLM_TENSOR_DFLASH_SELECTOR_*); HF codebooks carry no ".weight"
    TensorRule("candidate_selector.predecessor_codebook", "selector_predecessor.weight", _codebook, _2, Role.WEIGHT),
    TensorRule("candidate_selector.successor_codebook", "selector_successor.weight", _codebook, _2, Role.WEIGHT),
    TensorRule("candidate_selector.hidden_projection.weight", "selector_hidden.weight", _selector_hidden, _2,
               Role.WEIGHT),
)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the output file: where it comes from, its name and shapes there."""

    hf_name: str
    gguf_name: str
    torch_shape: tuple[int, ...]
    role: Role
    need: Need

    @property
    def ggml_shape(self) -> tuple[int, ...]:
        return ggml_shape(self.torch_shape)


def ggml_shape(torch_shape: Sequence[int]) -> tuple[int, ...]:
    """ggml ``ne`` of a row-major tensor: the PyTorch shape reversed (bytes unchanged)."""
    return tuple(int(n) for n in reversed(torch_shape))


def expected_tensors(config: DFlashConfig) -> dict[str, PlannedTensor]:
    """Every tensor a checkpoint with this config may contain, by HF name (optional ones included)."""
    rules = [r for r in TENSOR_RULES if config.is_dflash2 or r.need is not Need.DFLASH2]
    first_layer_rule = next(i for i, r in enumerate(rules) if r.per_layer)
    ordered = [(r, None) for r in rules[:first_layer_rule] if not r.per_layer]
    ordered += [(r, bid) for bid in range(config.num_hidden_layers) for r in rules if r.per_layer]
    ordered += [(r, None) for r in rules[first_layer_rule:] if not r.per_layer]
    out: dict[str, PlannedTensor] = {}
    for rule, bid in ordered:  # file order: leading globals, then layer by layer, then trailing globals
        hf = rule.hf.format(bid=bid)
        shape = tuple(int(n) for n in rule.torch_shape(config))
        out[hf] = PlannedTensor(hf, rule.gguf.format(bid=bid), shape, rule.role, rule.need)
    return out


def plan_tensors(config: DFlashConfig, available: Mapping[str, Sequence[int]]) -> list[PlannedTensor]:
    """Map a checkpoint's tensors (HF name -> shape) to the GGUF, validating as we go.

    Raises one ``ValueError`` listing every missing, unexpected or misshaped tensor.
    Names may carry a ``model.`` prefix; codebooks may carry ``.weight``.
    """
    expected = expected_tensors(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for raw, shape in available.items():
        name = normalize_hf_name(raw)
        if name in shapes:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint (as {raw!r})")
        shapes[name] = tuple(int(n) for n in shape)

    kind = config.architecture
    problems: list[str] = []
    missing = [n for n, t in expected.items() if t.need is not Need.OPTIONAL and n not in shapes]
    if missing:
        problems.append(f"missing tensors for a {kind} with {config.num_hidden_layers} layers: {missing}")
    unexpected = sorted(n for n in shapes if n not in expected)
    if unexpected:
        hint = ""
        if not config.is_dflash2 and any("conv" in n or "candidate_selector" in n for n in unexpected):
            hint = " (DFlash2 tensors in a checkpoint whose config has no conv/selector keys: fix dflash_config)"
        problems.append(f"unexpected tensors: {unexpected}{hint}")
    for name, shape in shapes.items():
        if name in expected and shape != expected[name].torch_shape:
            implied = list(expected[name].torch_shape)
            problems.append(f"tensor {name!r} has shape {list(shape)}, config implies {implied}")
    if problems:
        raise ValueError("checkpoint does not match its config.json:\n  " + "\n  ".join(problems))
    return [t for n, t in expected.items() if n in shapes]


def plan_from_header(config: DFlashConfig, header: Mapping[str, Any]) -> list[PlannedTensor]:
    """Plan from a safetensors header dict (name -> {"shape": ...}); no weights needed."""
    return plan_tensors(config, {k: v["shape"] for k, v in header.items() if k != "__metadata__"})


# --- storage types ---------------------------------------------------------------------


class OutType(str, Enum):
    """``--outtype`` choices."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"


_MATRIX_TYPE = {
    OutType.F32: GGMLQuantizationType.F32,
    OutType.F16: GGMLQuantizationType.F16,
    OutType.BF16: GGMLQuantizationType.BF16,
    OutType.Q8_0: GGMLQuantizationType.Q8_0,
}

_FILE_TYPE = {
    OutType.F32: LlamaFileType.ALL_F32,
    OutType.F16: LlamaFileType.MOSTLY_F16,
    OutType.BF16: LlamaFileType.MOSTLY_BF16,
    OutType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
}

_Q8_0_BLOCK = 32


def file_type(outtype: OutType | str) -> LlamaFileType:
    return _FILE_TYPE[OutType(outtype)]


def storage_type(tensor: PlannedTensor, outtype: OutType | str) -> GGMLQuantizationType:
    """The ggml type a tensor is written as.

    Norms and conv bases are F32; ``fc`` is F32 (BF16 when the whole file is BF16) because it
    multiplies raw target features whose outliers overflow F16 activations; matrices take
    ``outtype``, except that Q8_0 falls back to F16 when a row is not a multiple of 32.
    """
    outtype = OutType(outtype)
    if tensor.role in (Role.NORM, Role.CONV_BASE):
        return GGMLQuantizationType.F32
    if tensor.role is Role.FC:
        return GGMLQuantizationType.BF16 if outtype is OutType.BF16 else GGMLQuantizationType.F32
    if outtype is OutType.Q8_0 and tensor.ggml_shape[0] % _Q8_0_BLOCK != 0:
        return GGMLQuantizationType.F16
    return _MATRIX_TYPE[outtype]


# --- metadata --------------------------------------------------------------------------


@dataclass(frozen=True)
class KV:
    """One metadata entry: key, value, GGUF type (and element type for arrays)."""

    key: str
    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None


def drafter_metadata(config: DFlashConfig) -> list[KV]:
    """The drafter's own ``dflash.*`` keys (no general.*, no tokenizer.*), in writing order.

    Raises ``ValueError`` for configs llama.cpp cannot represent (mixed causal layers,
    an unsupported rope scaling type).
    """
    c = config
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    kv = [
        KV(Keys.BLOCK_COUNT, c.num_hidden_layers, u32),
        KV(Keys.CONTEXT_LENGTH, c.max_position_embeddings, u32),
        KV(Keys.EMBEDDING_LENGTH, c.hidden_size, u32),
        KV(Keys.FEED_FORWARD_LENGTH, c.intermediate_size, u32),
        KV(Keys.HEAD_COUNT, c.num_attention_heads, u32),
        KV(Keys.HEAD_COUNT_KV, c.num_key_value_heads, u32),
        KV(Keys.KEY_LENGTH, c.head_dim, u32),
        KV(Keys.VALUE_LENGTH, c.head_dim, u32),
        KV(Keys.RMS_EPS, c.rms_norm_eps, f32),
        KV(Keys.ROPE_FREQ_BASE, c.rope_theta, f32),
    ]
    kv += _rope_scaling(c)
    causal = _causal_flag(c)
    if causal is not None:
        kv.append(KV(Keys.CAUSAL, causal, GGUFValueType.BOOL))
    if c.sliding_window is not None and any(c.layer_is_sliding(i) for i in range(c.num_hidden_layers)):
        kv.append(KV(Keys.SLIDING_WINDOW, c.sliding_window, u32))
        pattern = [c.layer_is_sliding(i) for i in range(c.num_hidden_layers)]
        kv.append(KV(Keys.SLIDING_WINDOW_PATTERN, pattern, GGUFValueType.ARRAY, GGUFValueType.BOOL))
    kv.append(KV(Keys.BLOCK_SIZE, c.block_size, u32))
    kv.append(KV(Keys.TARGET_LAYERS, [i + 1 for i in c.target_layer_ids], GGUFValueType.ARRAY, GGUFValueType.INT32))
    if c.is_dflash2:
        kv += [
            KV(Keys.CONV_KERNEL_SIZE, c.conv_kernel_size, u32),
            KV(Keys.CONV_GROUP_SIZE, c.conv_group_size, u32),
            KV(Keys.SELECTOR_RANK, c.selector_rank, u32),
            KV(Keys.SELECTOR_TOP_K, c.selector_top_k, u32),
        ]
    if c.output_multiplier is not None:
        kv.append(KV(Keys.LOGIT_SCALE, c.output_multiplier, f32))
    if c.softcap > 0:
        kv.append(KV(Keys.FINAL_LOGIT_SOFTCAPPING, c.softcap, f32))
    if c.input_embedding_scale is not None:
        kv.append(KV(Keys.EMBEDDING_SCALE, c.input_embedding_scale, f32))
    return kv


def _causal_flag(c: DFlashConfig) -> bool | None:
    """``dflash.attention.causal``: the config's is_causal, or derived when every layer agrees.

    With ``is_causal`` unset the reference makes exactly the sliding layers causal; llama.cpp
    has one flag for all layers (default non-causal), so a mixed drafter cannot be stored.
    """
    flags = {c.layer_is_causal(i) for i in range(c.num_hidden_layers)}
    if len(flags) > 1:
        raise ValueError(
            "is_causal is unset and the drafter mixes sliding (causal) and full (non-causal) layers; "
            "llama.cpp has a single causal flag: set is_causal in config.json"
        )
    flag = flags.pop()
    if c.is_causal is None and not flag:
        return None  # all non-causal: llama.cpp's default, nothing to write (as upstream)
    return flag


def _rope_scaling(c: DFlashConfig) -> list[KV]:
    if not c.rope_scaling:
        return []
    rope = dict(c.rope_scaling)
    kind = rope.get("rope_type")
    factor = rope.get("factor")
    if kind == "linear" and factor is not None:
        return [KV(Keys.ROPE_SCALING_TYPE, "linear", GGUFValueType.STRING),
                KV(Keys.ROPE_SCALING_FACTOR, float(factor), GGUFValueType.FLOAT32)]
    if kind == "yarn" and factor is not None and "original_max_position_embeddings" in rope:
        return [KV(Keys.ROPE_SCALING_TYPE, "yarn", GGUFValueType.STRING),
                KV(Keys.ROPE_SCALING_FACTOR, float(factor), GGUFValueType.FLOAT32),
                KV(Keys.ROPE_SCALING_ORIG_CTX, int(rope["original_max_position_embeddings"]), GGUFValueType.UINT32)]
    raise ValueError(f"rope scaling {rope} is not supported by the dflash GGUF converter")
