"""The raw cffi bindings of native/include/dflash.h and the one place C errors become exceptions.

The extension is built in cffi's API (out-of-line) mode at build time: the C compiler checks
every declaration against the real header, so the bindings cannot silently drift from the
library (ABI mode would mis-call instead).
"""

from __future__ import annotations

import os
from typing import Callable

from .. import NativeExtensionError, errors

_BUILD_HINT = ("build it with `pip install .` (or `pip install -e .` for a development checkout) in the "
               "pydflash source tree; converting a checkpoint (pydflash.formats.convert, "
               "convert_hf_to_gguf_dflash.py) needs no native build")

# Libraries a GPU build links that come with the GPU's driver, not with pydflash: rebuilding
# pydflash the same way would not help, installing the driver (or a CPU build) does.
_GPU_DRIVER_LIBS = {
    "libcuda.so": "this pydflash was built with CUDA (-DGGML_CUDA=ON) and needs the NVIDIA driver's libcuda.so.1",
    "libvulkan.so": "this pydflash was built with Vulkan (-DGGML_VULKAN=ON) and needs the Vulkan loader (libvulkan1)",
}


def _gpu_driver_hint(message: str) -> str | None:
    for lib_name, why in _GPU_DRIVER_LIBS.items():
        if lib_name in message:
            return (f"{why}: install the driver, or build a CPU-only pydflash "
                    f"(`pip install .` without the GPU CMAKE_ARGS)")
    return None


try:
    from .._native import ffi, lib
except ImportError as exc:
    _pkg_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pydflash/, above runtime/
    if isinstance(exc, ModuleNotFoundError) and exc.name == "pydflash._native":
        _msg = f"pydflash's native extension (pydflash._native) is not built in {_pkg_dir}: {_BUILD_HINT}"
    elif _gpu_driver_hint(str(exc)):  # a GPU build on a machine without that GPU's driver
        _msg = f"pydflash's native extension (pydflash._native) does not load ({exc}): {_gpu_driver_hint(str(exc))}"
    else:  # present but does not load (missing libdflash/libllama, cffi, wrong platform)
        _msg = f"pydflash's native extension (pydflash._native) does not load ({exc}): {_BUILD_HINT}"
    raise NativeExtensionError(_msg, name="pydflash._native") from exc

ABI_VERSION = 7

if lib.dflash_abi_version() != ABI_VERSION:  # pragma: no cover - a broken install
    raise NativeExtensionError(
        f"pydflash native library has ABI {lib.dflash_abi_version()}, the Python package expects "
        f"{ABI_VERSION}: rebuild it (`pip install .`, or `pip install -e .` in a checkout)",
        name="pydflash._native",
    )

_STATUS_TO_ERROR: dict[int, type[errors.PydflashError]] = {
    lib.DFLASH_ERR_INVALID_ARGUMENT: errors.InvalidArgumentError,
    lib.DFLASH_ERR_IO: errors.ModelNotFoundError,
    lib.DFLASH_ERR_FORMAT: errors.ModelFormatError,
    lib.DFLASH_ERR_CONTEXT_FULL: errors.ContextFullError,
    lib.DFLASH_ERR_MISMATCH: errors.MismatchError,
    lib.DFLASH_ERR_BUFFER_TOO_SMALL: errors.InternalError,
    lib.DFLASH_ERR_BACKEND: errors.BackendError,
    lib.DFLASH_ERR_CANCELLED: errors.CancelledError,
    lib.DFLASH_ERR_UNSUPPORTED: errors.UnsupportedError,
    lib.DFLASH_ERR_BUSY: errors.BusyError,
    lib.DFLASH_ERR_INTERNAL: errors.InternalError,
}


def error_for(status: int, message: str) -> errors.PydflashError:
    """The exception matching a dflash_status (also one reported by a child process)."""
    return _STATUS_TO_ERROR.get(status, errors.InternalError)(message or f"native error {status}")


def check(status: int) -> None:
    """Raise the exception matching a dflash_status, with the native error message."""
    if status == lib.DFLASH_OK:
        return
    raise error_for(status, ffi.string(lib.dflash_last_error()).decode("utf-8", "replace"))


def read_string(call: Callable[[object, int, object], int], initial: int = 4096) -> str:
    """Call a ``f(buf, buf_size, n_out)`` native function, growing the buffer once if needed."""
    size = initial
    for _ in range(2):
        buf = ffi.new("char[]", size)
        n_out = ffi.new("size_t *")
        status = call(buf, size, n_out)
        if status == lib.DFLASH_ERR_BUFFER_TOO_SMALL:
            size = n_out[0] + 1
            continue
        check(status)
        return ffi.unpack(buf, n_out[0]).decode("utf-8", "replace")
    raise errors.InternalError("native string kept growing")


@ffi.def_extern(onerror=lambda *exc: None)
def _pydflash_on_token(user_data, token, piece, n_piece):  # type: ignore[no-untyped-def]
    """Trampoline for dflash_token_callback: forwards to the Python callable behind user_data."""
    on_token = ffi.from_handle(user_data)
    return bool(on_token(int(token), ffi.unpack(piece, n_piece) if n_piece else b""))


@ffi.def_extern(onerror=lambda *exc: None)
def _pydflash_on_progress(user_data, done, total):  # type: ignore[no-untyped-def]
    """Trampoline for dflash_progress_callback."""
    ffi.from_handle(user_data)(int(done), int(total))


TOKEN_CALLBACK = lib._pydflash_on_token

__all__ = ["ffi", "lib", "check", "read_string", "TOKEN_CALLBACK"]
