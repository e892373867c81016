"""Convert a Hugging Face DFlash / DFlash2 drafter to a llama.cpp ``dflash`` GGUF.

Usage::

    pydflash convert <draft_dir> --target-gguf target.gguf --outtype f16 -o draft.gguf
    pydflash convert <draft_dir> --target-model-dir <hf_target_dir> --outtype bf16 -o draft.gguf

What the file holds (names and shapes: :mod:`pydflash.formats.gguf_layout`):

* metadata, ``general.architecture = "dflash"``:
  ``dflash.block_count``, ``.context_length``, ``.embedding_length``, ``.feed_forward_length``,
  ``.attention.head_count``, ``.attention.head_count_kv``, ``.attention.key_length``,
  ``.attention.value_length``, ``.attention.layer_norm_rms_epsilon``, ``.rope.freq_base``
  (+ ``.rope.scaling.*`` for linear/yarn), ``.attention.causal`` (when the config sets it),
  ``.attention.sliding_window`` + ``.attention.sliding_window_pattern`` (sliding layers),
  ``dflash.block_size``, ``dflash.target_layers`` (i32, **HF layer id + 1**: llama.cpp taps
  layer inputs), DFlash2: ``dflash.conv_kernel_size``, ``.conv_group_size``,
  ``.selector_rank``, ``.selector_top_k``; ``dflash.logit_scale`` (output_multiplier),
  ``dflash.final_logit_softcapping`` (if > 0), ``dflash.embedding_scale``
  (input_embedding_scale); ``general.name``, ``general.file_type``,
  ``general.quantization_version``; every ``tokenizer.*`` key of the target plus
  ``tokenizer.ggml.mask_token_id``.
* tensors: ``fc.weight`` [L*H, H], ``enc.output_norm.weight`` [H], ``output_norm.weight`` [H],
  per layer ``blk.i.attn_norm/attn_q/attn_k/attn_v/attn_output/attn_q_norm/attn_k_norm/
  ffn_norm/ffn_gate/ffn_up/ffn_down.weight``, DFlash2 per layer ``blk.i.attn_conv_base``,
  ``blk.i.attn_conv_proj.weight``, ``blk.i.ffn_conv_base``, ``blk.i.ffn_conv_proj.weight``
  and ``selector_predecessor.weight`` [r, V], ``selector_successor.weight`` [r, V],
  ``selector_hidden.weight`` [H, r]; optional ``token_embd.weight`` / ``output.weight``.
  Norms and conv bases are F32, ``fc`` is F32 (BF16 for --outtype bf16), matrices take
  ``--outtype``.

The tokenizer comes from the target: a target GGUF (every ``tokenizer.*`` key copied with
its type) or, best effort, an HF target directory with a byte-level BPE ``tokenizer.json``.
Everything is validated before anything is written (tensor names/shapes, hidden size and
layer ids against the target, mask id against the vocabulary); the output appears
atomically (temp file in the same directory, then ``os.replace``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, GGUFWriter, TokenType
from gguf.quants import quant_shape_to_byte_shape, quantize
from tqdm.auto import tqdm

from .gguf_layout import (
    ARCH,
    KV,
    Keys,
    OutType,
    PlannedTensor,
    drafter_metadata,
    file_type,
    plan_tensors,
    storage_type,
)
from ..reference.config import DFlashConfig, normalize_hf_name

__all__ = [
    "TargetInfo",
    "convert",
    "GGUFHeader",
    "GGUFTensorInfo",
    "read_gguf_header",
    "read_gguf_tensor",
    "read_target_gguf",
    "read_target_hf",
    "validate_against_target",
]

logger = logging.getLogger(__name__)


# --- reading the checkpoint without torch ------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


@dataclass(frozen=True)
class _StTensor:
    """Where one tensor's bytes sit in a safetensors file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data
    nbytes: int


def _read_safetensors_header(path: Path) -> dict[str, _StTensor]:
    """The tensors a safetensors file declares; anything malformed (an untrusted file) is a ValueError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file (only {len(prefix)} bytes)")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise ValueError(f"{path}: the header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{path}: the header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    data_size = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        out[name] = _st_tensor(path, name, info, 8 + n, data_size)
    return out


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _st_tensor(path: Path, name: str, info: object, data_start: int, data_size: int) -> _StTensor:
    """One header entry, checked: known fields, a shape, offsets inside the data, matching sizes."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"{where} needs dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise ValueError(f"{where}: dtype {dtype!r} is not a string")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ValueError(f"{where}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1] <= data_size):
        raise ValueError(f"{where}: data_offsets {offsets!r} do not lie inside the file's {data_size} data bytes")
    begin, end = offsets
    if dtype in _ST_DTYPES and math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize != end - begin:
        raise ValueError(f"{where}: shape {shape} of {dtype} does not match its {end - begin} data bytes")
    return _StTensor(path, dtype, tuple(shape), data_start + begin, end - begin)


def _index_checkpoint(model_dir: Path) -> dict[str, _StTensor]:
    """All tensors of ``model_dir/*.safetensors`` by normalised HF name."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    index: dict[str, _StTensor] = {}
    for path in files:
        for raw, entry in _read_safetensors_header(path).items():
            name = normalize_hf_name(raw)
            if name in index:
                raise ValueError(f"tensor {raw!r} appears in both {index[name].file.name} and {path.name}")
            if entry.dtype not in _ST_DTYPES:
                raise ValueError(f"tensor {raw!r} has dtype {entry.dtype}; only F32/F16/BF16/F64 are supported")
            index[name] = entry
    return index


def _load_f32(entry: _StTensor) -> np.ndarray:
    """The tensor as float32 (BF16 widened bit-exactly)."""
    np_dtype = np.dtype(_ST_DTYPES[entry.dtype])
    count = entry.nbytes // np_dtype.itemsize
    with open(entry.file, "rb") as f:
        f.seek(entry.offset)
        raw = np.fromfile(f, dtype=np_dtype.newbyteorder("<"), count=count)
    if entry.dtype == "BF16":
        arr = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        arr = raw.astype(np.float32)
    return arr.reshape(entry.shape)


# --- the target ----------------------------------------------------------------------------


@dataclass
class TargetInfo:
    """What the converter needs from the target: sizes to validate against and its tokenizer."""

    source: str
    arch: str
    hidden_size: int
    n_layers: int
    vocab_size: int
    rope_theta: float | None = None
    tokenizer: list[KV] = field(default_factory=list)
    hidden_key: str = "hidden_size"  # where the sizes came from, for error messages
    layers_key: str = "num_hidden_layers"


_GGUF_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: ggml shape (``ne``), type and absolute byte offset."""

    name: str
    ne: tuple[int, ...]
    type: GGMLQuantizationType
    offset: int

    @property
    def nbytes(self) -> int:
        return _nbytes(tuple(reversed(self.ne)), self.type)


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata (exact types; strings as raw ``bytes``) and tensor directory of a GGUF file."""

    path: Path
    kv: dict[str, KV]
    tensors: dict[str, GGUFTensorInfo]


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a little-endian GGUF's metadata and tensor infos with ``struct`` over an mmap.

    ``gguf.GGUFReader`` builds a numpy view per string and needs seconds for a 150k-token
    vocabulary; this reads the same header in tens of milliseconds. The file is untrusted: any
    malformation is a ValueError.
    """
    path = Path(path)
    if path.stat().st_size < 24:
        raise ValueError(f"{path} is not a GGUF file (too short)")
    try:
        return _parse_gguf_header(path)
    except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as exc:
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated header: {exc})") from None


def _parse_gguf_header(path: Path) -> GGUFHeader:
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise ValueError(f"{path} is a big-endian GGUF; only little-endian files are supported")
        pos = 24

        def unpack(fmt: str) -> tuple:
            nonlocal pos
            out = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return out

        def string() -> bytes:
            nonlocal pos
            (n,) = unpack("<Q")
            pos += n
            return bytes(buf[pos - n:pos])

        kv: dict[str, KV] = {}
        for _ in range(n_kv):
            key = string().decode("utf-8")
            vtype = GGUFValueType(unpack("<I")[0])
            if vtype == GGUFValueType.STRING:
                kv[key] = KV(key, string(), vtype)
            elif vtype != GGUFValueType.ARRAY:
                kv[key] = KV(key, unpack(_GGUF_SCALARS[vtype])[0], vtype)
            else:
                sub_raw, count = unpack("<IQ")
                sub = GGUFValueType(sub_raw)
                if sub == GGUFValueType.ARRAY:
                    raise ValueError(f"{path}: nested array in key {key!r} is not supported")
                if count > len(buf) - pos:  # every item takes at least one byte
                    raise ValueError(f"{path}: array {key!r} claims {count} items, more than the file holds")
                if sub == GGUFValueType.STRING:
                    items: list = [string() for _ in range(count)]
                else:
                    dt = np.dtype(_GGUF_SCALARS[sub].replace("?", "b1"))
                    items = np.frombuffer(buf, dtype=dt, count=count, offset=pos).tolist()
                    pos += dt.itemsize * count
                kv[key] = KV(key, items, vtype, sub)

        raw_infos = []
        for _ in range(n_tensors):
            name = string().decode("utf-8")
            (n_dims,) = unpack("<I")
            if n_dims > 4:
                raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions (GGUF allows at most 4)")
            ne = unpack(f"<{n_dims}Q")
            qtype, offset = unpack("<IQ")
            raw_infos.append((name, tuple(int(n) for n in ne), GGMLQuantizationType(qtype), offset))
    align_kv = kv.get("general.alignment")
    align = align_kv.value if align_kv is not None else 32
    if not isinstance(align, int) or align <= 0:
        raise ValueError(f"{path}: general.alignment {align!r} is not a positive integer")
    data_start = (pos + align - 1) // align * align
    tensors = {n: GGUFTensorInfo(n, ne, q, data_start + off) for n, ne, q, off in raw_infos}
    return GGUFHeader(path, kv, tensors)


def read_gguf_tensor(header: GGUFHeader, name: str) -> np.ndarray:
    """A tensor of the file as float32 in PyTorch order (``ne`` reversed), dequantized with gguf-py."""
    from gguf.quants import dequantize

    info = header.tensors[name]
    shape = tuple(reversed(info.ne))
    with open(header.path, "rb") as f:
        f.seek(info.offset)
        raw = np.fromfile(f, dtype=np.uint8, count=info.nbytes)
    data = dequantize(raw.reshape(quant_shape_to_byte_shape(shape, info.type)), info.type)
    return np.asarray(data, dtype=np.float32).reshape(shape)


def read_target_gguf(path: str | os.PathLike[str]) -> TargetInfo:
    """Sizes and every ``tokenizer.*`` key (except the mask id, which the drafter sets) of a target GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"target GGUF {path} not found")
    meta = read_gguf_header(path).kv

    def scalar(key: str) -> object:
        if key not in meta:
            raise ValueError(f"target GGUF {path.name} has no {key!r}; is it a llama.cpp model file?")
        v = meta[key].value
        return v.decode("utf-8") if isinstance(v, bytes) else v

    arch = str(scalar("general.architecture"))
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"target GGUF {path.name} has no tokenizer.ggml.tokens (vocab-less file?)")
    # empty arrays (e.g. the merges of a word-level vocab) carry nothing, and gguf-py's writer
    # refuses them: they are left out
    tokenizer = [kv for key, kv in meta.items() if key.startswith(Keys.TOKENIZER_PREFIX) and key != Keys.MASK_TOKEN_ID
                 and not (kv.type == GGUFValueType.ARRAY and len(kv.value) == 0)]
    rope_key = f"{arch}.rope.freq_base"
    return TargetInfo(
        source=str(path),
        arch=arch,
        hidden_size=int(scalar(f"{arch}.embedding_length")),  # type: ignore[arg-type]
        n_layers=int(scalar(f"{arch}.block_count")),  # type: ignore[arg-type]
        vocab_size=len(meta["tokenizer.ggml.tokens"].value),
        rope_theta=float(meta[rope_key].value) if rope_key in meta else None,
        tokenizer=tokenizer,
        hidden_key=f"{arch}.embedding_length",
        layers_key=f"{arch}.block_count",
    )


def read_target_hf(model_dir: str | os.PathLike[str]) -> TargetInfo:
    """Best effort: sizes from ``config.json`` and a GPT-2-style vocab from a byte-level BPE ``tokenizer.json``.

    Anything else (SentencePiece/Unigram/WordPiece) raises ``ValueError``: convert the
    target with llama.cpp and pass ``--target-gguf`` instead.
    """
    model_dir = Path(model_dir)
    cfg_path, tok_path = model_dir / "config.json", model_dir / "tokenizer.json"
    for p in (cfg_path, tok_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: --target-model-dir needs config.json and tokenizer.json "
                                    "(or use --target-gguf)")
    hp = json.loads(cfg_path.read_text(encoding="utf-8"))
    hp = {**hp, **hp.get("text_config", {})}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in hp]
    if missing:
        raise ValueError(f"{cfg_path} has no {missing}; pass the target as --target-gguf instead")
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    model = tok.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(tok.get("pre_tokenizer")) or "ByteLevel" in json.dumps(tok.get("decoder"))
    if model.get("type") != "BPE" or not byte_level:
        raise ValueError(
            f"{tok_path}: only byte-level BPE tokenizers are supported from an HF directory "
            f"(found model type {model.get('type')!r}); convert the target with llama.cpp and pass --target-gguf"
        )

    vocab_size = int(hp["vocab_size"])
    by_id: dict[int, tuple[str, int]] = {i: (t, int(TokenType.NORMAL)) for t, i in model["vocab"].items()}
    for added in tok.get("added_tokens", []):
        kind = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], int(kind))
    n_tokens = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, (f"[PAD{i}]", int(TokenType.UNUSED))) for i in range(n_tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    arr, s = GGUFValueType.ARRAY, GGUFValueType.STRING
    kv = [
        KV("tokenizer.ggml.model", "gpt2", s),
        KV("tokenizer.ggml.pre", "default", s),
        KV("tokenizer.ggml.tokens", [t for t, _ in tokens], arr, s),
        KV("tokenizer.ggml.token_type", [k for _, k in tokens], arr, GGUFValueType.INT32),
    ]
    if merges:
        kv.append(KV("tokenizer.ggml.merges", merges, arr, s))
    kv += _hf_special_tokens(model_dir, hp, {t: i for i, (t, _) in enumerate(tokens)})
    return TargetInfo(
        source=str(model_dir),
        arch=str((hp.get("architectures") or ["?"])[0]),
        hidden_size=int(hp["hidden_size"]),
        n_layers=int(hp["num_hidden_layers"]),
        vocab_size=n_tokens,
        rope_theta=hp.get("rope_theta", (hp.get("rope_parameters") or {}).get("rope_theta")),
        tokenizer=kv,
    )


def _hf_special_tokens(model_dir: Path, hp: dict, ids: dict[str, int]) -> list[KV]:
    """bos/eos/unk/pad ids, add_bos_token and chat_template from tokenizer_config.json / config.json."""
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else {}
    kv: list[KV] = []
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        token = tc.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        tid = ids.get(token) if isinstance(token, str) else hp.get(f"{role}_token_id")
        if isinstance(tid, int):
            kv.append(KV(f"tokenizer.ggml.{key}", tid, GGUFValueType.UINT32))
    if isinstance(tc.get("add_bos_token"), bool):
        kv.append(KV("tokenizer.ggml.add_bos_token", tc["add_bos_token"], GGUFValueType.BOOL))
    if isinstance(tc.get("chat_template"), str):
        kv.append(KV("tokenizer.chat_template", tc["chat_template"], GGUFValueType.STRING))
    return kv


# --- validation ----------------------------------------------------------------------------


def _validate_config(config: DFlashConfig) -> None:
    """Constraints of the dflash GGUF / llama.cpp loader that the HF config alone may violate."""
    if config.mask_token_id is None:
        raise ValueError("config.json has no dflash_config.mask_token_id; the GGUF needs it for "
                         "tokenizer.ggml.mask_token_id (add it to dflash_config)")
    if config.is_dflash2:
        k = config.selector_top_k
        assert k is not None
        if config.hidden_size < k * (k + 1):
            raise ValueError(f"selector_top_k {k} needs hidden_size >= K*(K+1) = {k * (k + 1)} in llama.cpp "
                             f"(hidden_size is {config.hidden_size}); lower selector_top_k")


def validate_against_target(config: DFlashConfig, plan: Sequence[PlannedTensor], target: TargetInfo) -> None:
    """Raise one ``ValueError`` listing every mismatch between the drafter and the target."""
    problems: list[str] = []
    where = f"target {target.source} ({target.arch})"
    if config.hidden_size != target.hidden_size:
        problems.append(
            f"drafter hidden_size {config.hidden_size} != target embedding_length {target.hidden_size} "
            f"({target.hidden_key}) in {where}: the drafter must be converted against the target it was trained for")
    bad = [i for i in config.target_layer_ids if i >= target.n_layers]
    if bad:
        problems.append(
            f"target_layer_ids {bad} do not exist in {where} with {target.n_layers} layers ({target.layers_key}); "
            "fix dflash_config.target_layer_ids or use the right target")
    if config.mask_token_id is not None and not 0 <= config.mask_token_id < target.vocab_size:
        problems.append(
            f"mask_token_id {config.mask_token_id} is outside the target vocabulary ({target.vocab_size} tokens in "
            f"{where}); fix dflash_config.mask_token_id or use the right target")
    vocab_rows = ("selector_predecessor.weight", "selector_successor.weight", "token_embd.weight", "output.weight")
    vocab_tensors = [t.hf_name for t in plan if t.gguf_name in vocab_rows]  # [vocab_size, ...] by the plan
    if vocab_tensors and config.vocab_size != target.vocab_size:
        problems.append(
            f"{vocab_tensors} have {config.vocab_size} rows but {where} has {target.vocab_size} tokens; "
            "the selector tables must cover the target's full vocabulary")
    if config.num_target_layers is not None and config.num_target_layers != target.n_layers:
        logger.warning("config says num_target_layers=%d but %s has %d layers",
                       config.num_target_layers, where, target.n_layers)
    if target.rope_theta is not None and abs(float(target.rope_theta) - config.rope_theta) > 1e-6 * config.rope_theta:
        logger.warning("drafter rope_theta %g differs from the target's %g", config.rope_theta, target.rope_theta)
    if problems:
        raise ValueError("drafter does not fit the target:\n  " + "\n  ".join(problems))


# --- writing ---------------------------------------------------------------------------------


def _encode(data: np.ndarray, qtype: GGMLQuantizationType, name: str) -> np.ndarray:
    """float32 data -> the bytes/array to store as ``qtype``."""
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        out = data.astype(np.float16)
        if np.any(np.isinf(out) & np.isfinite(data)):
            raise ValueError(f"tensor {name!r} has values beyond the F16 range; use --outtype bf16 or f32")
        return out
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    return int(np.prod(quant_shape_to_byte_shape(shape, qtype)))


def convert(
    model_dir: str | os.PathLike[str],
    outfile: str | os.PathLike[str],
    *,
    target_gguf: str | os.PathLike[str] | None = None,
    target_model_dir: str | os.PathLike[str] | None = None,
    outtype: str = "f16",
    progress: bool | None = None,
    name: str | None = None,
    tokenizer: bool = True,
) -> Path:
    """Convert the HF DFlash / DFlash2 checkpoint in ``model_dir`` to a ``dflash`` GGUF at ``outfile``.

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors``.
        outfile: output path (written atomically; an existing file is replaced).
        target_gguf: the target as a llama.cpp GGUF (tokenizer copied verbatim). Exactly one
            of ``target_gguf`` / ``target_model_dir`` is required.
        target_model_dir: the target as an HF directory (byte-level BPE tokenizer.json only).
        outtype: ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the weight matrices.
        progress: progress bar on stderr (default: only when stderr is a terminal).
        name: ``general.name`` of the drafter (default: the checkpoint directory's name).
        tokenizer: copy the target's ``tokenizer.*`` keys. Tools that load the drafter as a
            llama.cpp model need them; pydflash does not (it pairs drafter and target on their
            tensor shapes), so a shipped file may leave them out: 6 MB for Qwen2.5's 151,936 tokens.
    Returns:
        The output path.
    Raises:
        ValueError: the checkpoint, config or target do not fit (nothing is written).
    """
    model_dir, outfile = Path(model_dir), Path(outfile)
    out = OutType(outtype.lower()) if outtype.lower() in {o.value for o in OutType} else None
    if out is None:
        raise ValueError(f"unknown outtype {outtype!r}; choose one of {[o.value for o in OutType]}")
    if (target_gguf is None) == (target_model_dir is None):
        raise ValueError("pass exactly one of target_gguf (--target-gguf) or target_model_dir (--target-model-dir): "
                         "the drafter GGUF carries the target's tokenizer")

    config = DFlashConfig.from_pretrained(model_dir)
    _validate_config(config)
    index = _index_checkpoint(model_dir)
    plan = plan_tensors(config, {name: entry.shape for name, entry in index.items()})
    target = read_target_gguf(target_gguf) if target_gguf is not None else read_target_hf(target_model_dir)
    validate_against_target(config, plan, target)

    metadata = [KV(Keys.NAME, name or model_dir.resolve().name, GGUFValueType.STRING), *drafter_metadata(config)]
    metadata += [
        KV(Keys.FILE_TYPE, int(file_type(out)), GGUFValueType.UINT32),
        KV(Keys.QUANTIZATION_VERSION, GGML_QUANT_VERSION, GGUFValueType.UINT32),
        *(target.tokenizer if tokenizer else ()),
        KV(Keys.MASK_TOKEN_ID, config.mask_token_id, GGUFValueType.UINT32),
    ]
    _check_storable(metadata)
    types = [storage_type(t, out) for t in plan]

    outfile.parent.mkdir(parents=True, exist_ok=True)
    # a unique sibling (same filesystem for os.replace); created by open(), so the umask applies
    tmp = outfile.with_name(f".{outfile.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _write(tmp, metadata, plan, types, index, progress)
        os.replace(tmp, outfile)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("wrote %s (%d tensors, %s)", outfile, len(plan), out.value)
    return outfile


def _check_storable(metadata: Sequence[KV]) -> None:
    """Every value fits its GGUF type (a config can hold -1 or 1e308 where a u32 / f32 goes)."""
    for kv in metadata:
        fmt = _GGUF_SCALARS.get(kv.sub_type if kv.type == GGUFValueType.ARRAY else kv.type)
        if fmt is None:
            continue
        for v in kv.value if kv.type == GGUFValueType.ARRAY else [kv.value]:
            try:
                struct.pack(fmt, v)
            except (struct.error, OverflowError, TypeError):
                raise ValueError(f"{kv.key} = {v!r} does not fit its GGUF type {kv.type.name}") from None


def _write(path: Path, metadata: list[KV], plan: Sequence[PlannedTensor], types: Sequence[GGMLQuantizationType],
           index: dict[str, _StTensor], progress: bool | None) -> None:
    """Stream header, metadata, tensor infos, then each tensor (one in memory at a time)."""
    writer = GGUFWriter(path=None, arch=ARCH)
    for kv in metadata:
        writer.add_key_value(kv.key, kv.value, kv.type, kv.sub_type)
    sizes = [_nbytes(t.torch_shape, q) for t, q in zip(plan, types)]
    for t, q, n in zip(plan, types, sizes):
        writer.add_tensor_info(t.gguf_name, t.torch_shape, np.dtype(np.float32), n, raw_dtype=q)
    bar = tqdm(total=sum(sizes), desc="dflash gguf", unit="B", unit_scale=True, unit_divisor=1024,
               disable=None if progress is None else not progress)
    try:
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, q in zip(plan, types):
            data = _encode(_load_f32(index[t.hf_name]), q, t.hf_name)
            writer.write_tensor_data(data)
            bar.update(data.nbytes)
        writer.flush()
        assert writer.fout is not None
        os.fsync(writer.fout[0].fileno())
    finally:
        writer.close()
        bar.close()
