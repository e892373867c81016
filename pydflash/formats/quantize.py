"""GGUF quantization (targets and drafters) through the native core.

The work is done by libllama's own quantizer, called in-process through dflash.h (no shelling
out), so the output is byte-identical to the pinned ``llama-quantize`` and its per-tensor type
rules (use_more_bits for attn_v / ffn_down, fallbacks for rows not divisible by 256, 1-D tensors
left unquantized) exist exactly once.

DFlash2 tensors under those rules (Q4_K_M; checked on a drafter of the Qwen2.5-Coder-1.5B shape):
the selector codebooks ``selector_predecessor`` / ``selector_successor`` ([r, V], rows of r=256)
and ``selector_hidden`` are ordinary 2-D weights and get the file type's default, Q4_K (rows not a
multiple of 256 fall back to a 32-element block type, as for any tensor); the conv projections
``*_conv_proj.weight`` get Q4_K as well; the conv base kernels ``*_conv_base`` stay F32 (their
names carry no ``.weight`` suffix, and llama.cpp quantizes only weight tensors), as do all norms.
``attn_v`` / ``ffn_down`` get Q6_K on the layers llama.cpp's use_more_bits picks. ``fc.weight``
follows the default rule (Q4_K): upstream does the same, and our byte-identity with upstream
matters more than a special case; the native drafter dequantizes ``fc`` to F32 at load and
sanitises the features it multiplies (the f16-overflow pitfall is about activations, not weights).
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import errors
from ..runtime._bindings import check, ffi, lib
from tqdm.auto import tqdm

TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "F16", "BF16")


def quantize(
    in_path: str | os.PathLike,
    out_path: str | os.PathLike,
    type: str = "Q4_K_M",
    *,
    n_threads: int | None = None,
    allow_requantize: bool = False,
    progress: bool | None = None,
) -> Path:
    """Quantize a GGUF file.

    Args:
        in_path: F32/F16/BF16 GGUF (already-quantized input is refused unless allow_requantize).
        out_path: where to write (atomically).
        type: one of ``TYPES``.
        progress: progress line on stderr (None: only on a terminal).
    Returns:
        the output path.
    """
    if type.upper() not in TYPES:
        raise errors.InvalidArgumentError(f"unknown quantization type {type!r}; choose from {', '.join(TYPES)}")
    if Path(in_path).resolve() == Path(out_path).resolve():
        raise errors.InvalidArgumentError("input and output are the same file")
    bar = tqdm(total=1, desc=f"quantize {Path(in_path).name} -> {type}", unit="tensor",
               disable=None if progress is None else not progress)

    def on_progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    handle = ffi.new_handle(on_progress)
    try:
        check(lib.dflash_quantize(str(in_path).encode(), str(out_path).encode(), type.upper().encode(),
                                  n_threads or 0, allow_requantize, lib._pydflash_on_progress, handle))
    finally:
        bar.close()
    return Path(out_path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="pydflash quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="F32/F16/BF16 GGUF")
    p.add_argument("output", help="output GGUF")
    p.add_argument("type", nargs="?", default="Q4_K_M", help=f"one of {', '.join(TYPES)} (default Q4_K_M)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--allow-requantize", action="store_true", help="accept already-quantized input")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    args = p.parse_args(argv)
    out = quantize(args.input, args.output, args.type, n_threads=args.threads,
                   allow_requantize=args.allow_requantize, progress=False if args.quiet else None)
    print(out)
    return 0
