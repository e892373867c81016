"""Write a random-weight GGUF target of a real model's shape (llama architecture), then quantize it.

The GPU machine this project borrows has no network and takes at most 64 MiB of files along, so
benchmark targets are generated there. Shapes:

  smollm2-135m  H 576,  30 layers, 9/3 heads,  FFN 1536,  vocab 49152, tied  (named so the shipped
                SmolLM2 drafter pairs with it: the device tests run on it)
  qwen2.5-1.5b  H 1536, 28 layers, 12/2 heads, FFN 8960,  vocab 151936, tied
  llama-8b      H 4096, 32 layers, 32/8 heads, FFN 14336, vocab 128256 (Llama-3-8B)

All are written as llama-architecture files (no QKV bias, unlike Qwen2): llama is the arch where
both tap sources (layer-input API and eval callback) exist, so both can be timed on one file.
Weights are N(0, 1/fan_in) (embeddings N(0, 0.5²)): outputs are deterministic and peaked enough
for greedy comparisons; values come from one seeded pool, so generation is fast and costs no
memory beyond one tensor. The vocabulary is synthetic (SentencePiece-style: <unk>, <s>, </s>, 256
byte tokens, then pieces); text tokenizes to bytes. The F16 file is quantized with pydflash's
quantizer (libllama's, in-process) and deleted.

    python benchmarks/gpu/make_target.py qwen2.5-1.5b -o target.gguf --type Q4_K_M [--layers N]
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied: bool
    rope_base: float
    basename: str
    size_label: str


SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True, 100000.0, "SmolLM2", "135M"),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 151936, True, 1000000.0, "Qwen2.5-shape", "1.5B"),
    "llama-8b": Shape(4096, 32, 32, 8, 14336, 128256, False, 500000.0, "Llama-3-shape", "8B"),
}
POOL = 1 << 24  # random f16 values every tensor is cut from


def vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    if n < len(tokens) + 1:
        raise SystemExit(f"vocabulary of {n} is too small")
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    types += [TokenType.NORMAL] * (n - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, [int(t) for t in types]


def tensors(s: Shape) -> list[tuple[str, tuple[int, ...], float]]:
    """(name, numpy shape [rows, cols], std); cols = fan-in."""
    hd = s.n_embd // s.n_head
    out: list[tuple[str, tuple[int, ...], float]] = [("token_embd.weight", (s.n_vocab, s.n_embd), 0.5)]
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.n_embd,), 0.0),
                (p + "attn_q.weight", (s.n_head * hd, s.n_embd), s.n_embd ** -0.5),
                (p + "attn_k.weight", (s.n_head_kv * hd, s.n_embd), s.n_embd ** -0.5),
                (p + "attn_v.weight", (s.n_head_kv * hd, s.n_embd), s.n_embd ** -0.5),
                (p + "attn_output.weight", (s.n_embd, s.n_head * hd), (s.n_head * hd) ** -0.5),
                (p + "ffn_norm.weight", (s.n_embd,), 0.0),
                (p + "ffn_gate.weight", (s.n_ff, s.n_embd), s.n_embd ** -0.5),
                (p + "ffn_up.weight", (s.n_ff, s.n_embd), s.n_embd ** -0.5),
                (p + "ffn_down.weight", (s.n_embd, s.n_ff), s.n_ff ** -0.5)]
    out.append(("output_norm.weight", (s.n_embd,), 0.0))
    if not s.tied:
        out.append(("output.weight", (s.n_vocab, s.n_embd), s.n_embd ** -0.5))
    return out


def write_f16(path: Path, shape_name: str, s: Shape, seed: int) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(POOL, dtype=np.float32).astype(np.float16)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"{s.basename} {s.size_label} (random weights, pydflash benchmarks/gpu)")
    w.add_basename(s.basename)
    w.add_size_label(s.size_label)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(8192)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(s.n_embd // s.n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(s.rope_base)
    w.add_vocab_size(s.n_vocab)
    tokens, scores, types = vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    specs = tensors(s)
    for name, shp, std in specs:
        dtype = np.float32 if len(shp) == 1 else np.float16
        n = int(np.prod(shp))
        w.add_tensor_info(name, shp, np.dtype(dtype), n * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, std in specs:
        n = int(np.prod(shp))
        if len(shp) == 1:  # norms: around 1
            data = (1.0 + 0.1 * pool[:n].astype(np.float32)).reshape(shp)
        else:
            off = int(rng.integers(0, POOL))
            data = np.resize(np.roll(pool, -off)[: min(n, POOL)], n)
            data *= np.float16(std)
            data = data.reshape(shp)
        w.write_tensor_data(data)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("-o", "--out", required=True, type=Path)
    ap.add_argument("--type", default="Q4_K_M", help="pydflash quantize type, or F16 to keep the F16 file")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the real model (rehearsals)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    s = SHAPES[args.shape]
    if args.layers < 0:
        ap.error("--layers must be >= 0")
    if args.layers:
        s = replace(s, n_layer=args.layers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    f16 = args.out if args.type.upper() == "F16" else args.out.with_name(args.out.name + ".f16.tmp")
    t0 = time.perf_counter()
    write_f16(f16, args.shape, s, args.seed)
    t1 = time.perf_counter()
    print(f"make_target: {args.shape} ({s.n_layer} layers) F16 written in {t1 - t0:.1f} s "
          f"({f16.stat().st_size / 2**30:.2f} GiB)", flush=True)
    if f16 != args.out:
        from pydflash.formats.quantize import quantize

        try:
            quantize(f16, args.out, args.type.upper(), n_threads=args.threads, progress=False)
        finally:
            f16.unlink(missing_ok=True)
        print(f"make_target: quantized to {args.type.upper()} in {time.perf_counter() - t1:.1f} s "
              f"({args.out.stat().st_size / 2**30:.2f} GiB)", flush=True)


if __name__ == "__main__":
    main()
