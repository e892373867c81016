"""pydflash's own multi-row CPU mat-mul kernels (verification batches; docs/verify-kernels.md).

On by default wherever the CPU has a SIMD path (AVX2, AVX-512 VNNI, arm64 dot-product; a
scalar-only CPU keeps ggml's): targets (and CPU drafters) loaded while the kernels are on keep
their Q4_K/Q5_K/Q6_K/Q8_0/Q5_0/Q4_1/Q4_0 mat-mul weights in the kernels' ggml-cpu buffer type;
batches of up to PYDFLASH_KERNELS_MAX_ROWS rows (default 512, a whole default ubatch: prefill
too; 64 on the scalar path; our attention takes at most 64 query rows) then run through them,
larger batches through ggml's kernels. ``PYDFLASH_KERNELS=0`` (``off``, ``false``, ``no``): ggml's
stock kernels for models loaded afterwards, whose output is then llama.cpp's bit for bit (ours
round activations their own way, so greedy text can part from llama.cpp's at near-ties, while
speculative decoding stays exactly plain decoding's on the same kernels); ``PYDFLASH_KERNELS=1``
forces them on, even the scalar path. ``PYDFLASH_KERNELS_ISA=scalar|avx2|avx512|neon`` forces a
code path (default: the best the CPU has: avx512 = AVX-512 VNNI, neon = arm64 dot-product). Those
models' attention (fp16 KV cache) runs through our multi-query kernel unless
``PYDFLASH_KERNELS_ATTN=0`` / ``set_attention(False)``.
"""

from __future__ import annotations

from ._bindings import check, ffi, lib

__all__ = ["active", "isa", "best_isa", "available_isas", "set_isa", "set_attention", "selftest"]

ISAS = ("scalar", "avx2", "avx512", "neon")


def active() -> bool:
    """Whether a model loaded now would use the kernels."""
    return bool(lib.dflash_kernels_active())


def isa() -> str:
    """The code path the kernels run now: "scalar", "avx2", "avx512" or "neon"."""
    return ffi.string(lib.dflash_kernels_isa()).decode()


def best_isa() -> str:
    """The best code path this CPU and build allow."""
    return ffi.string(lib.dflash_kernels_best_isa()).decode()


def available_isas() -> list[str]:
    """The code paths this CPU and build can run (always including "scalar")."""
    return [name for name in ISAS if lib.dflash_kernels_isa_available(name.encode())]


def set_isa(name: str) -> None:
    """Force a code path (one of available_isas(), or "auto" = best) for the mat-muls from now on.
    UnsupportedError if this CPU/build lacks it."""
    check(lib.dflash_kernels_set_isa(name.encode()))


def set_attention(on: bool) -> None:
    """Our multi-query attention (on, the default unless ``PYDFLASH_KERNELS_ATTN=0``) or ggml's
    (off) for the models that use the kernels, from the next decode on."""
    lib.dflash_kernels_set_attention(bool(on))


def selftest(isa: str = "auto", n_threads: int = 1, quick: bool = False) -> tuple[int, float, str]:
    """Check the kernels of ``isa`` against ggml's CPU mat-mul and a float64 reference on random
    tensors (every type, rows 1..16 and more, odd shapes). Returns (failed cases, worst NMSE
    against ggml, report)."""
    n_failed = ffi.new("int32_t *")
    worst = ffi.new("double *")
    buf = ffi.new("char[]", 16384)
    check(lib.dflash_kernels_selftest(isa.encode(), n_threads, quick, n_failed, worst, buf, len(buf)))
    return int(n_failed[0]), float(worst[0]), ffi.string(buf).decode()
