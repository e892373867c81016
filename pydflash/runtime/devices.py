"""The compute devices of this build (CPU, CUDA/Metal/Vulkan GPUs, ggml RPC servers).

A target offloads layers with ``n_gpu_layers``; a drafter computes on one device, by name::

    >>> [d.name for d in pydflash.runtime.devices.devices()]
    ['CPU']
    >>> pydflash.runtime.devices.add_rpc_server("10.0.0.2:50052")   # another machine's GPU, via ggml RPC
    [Device(name='RPC0', ...)]

``Engine(drafter_device="auto")`` puts the drafter where the target runs: on the first GPU when
the target offloads layers (``n_gpu_layers != 0``), on the CPU otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

from .. import errors

# the native bindings load on first use: building a CLI parser (add_arguments) needs none
_KIND_NAMES = {"DFLASH_DEVICE_CPU": "cpu", "DFLASH_DEVICE_GPU": "gpu", "DFLASH_DEVICE_IGPU": "igpu",
               "DFLASH_DEVICE_ACCEL": "accel"}


def _kind(value: int) -> str:
    from ._bindings import lib

    return next((k for name, k in _KIND_NAMES.items() if getattr(lib, name) == value), "gpu")


@dataclass(frozen=True)
class Device:
    """One ggml device: ``name`` is what ``Drafter(device=...)`` takes."""

    name: str
    description: str
    kind: str  # "cpu", "gpu" (own memory; RPC devices too), "igpu" (shared memory, Metal), "accel"
    memory_free: int  # bytes, 0 if unknown
    memory_total: int


def devices() -> list[Device]:
    """Every device ggml can run on in this process, in its registry order (CPU last on GPU builds)."""
    from ._bindings import check, ffi, lib
    out = []
    info = ffi.new("dflash_device_info *")
    for i in range(lib.dflash_device_count()):
        check(lib.dflash_device_get_info(i, info))
        out.append(Device(ffi.string(info.name).decode(), ffi.string(info.description).decode(),
                          _kind(info.type), int(info.memory_free), int(info.memory_total)))
    return out


def add_rpc_server(endpoint: str, *, timeout: float = 60.0) -> list[Device]:
    """Add the devices of a ggml RPC server (``host:port``, e.g. the shipped ``ggml-rpc-server``).

    ggml's RPC client aborts the whole process when it cannot reach the endpoint or the handshake
    fails, so the endpoint is first tried from a child process; only a server that answered there
    is added here. Returns the devices it added (none when the endpoint was added before).

    Raises:
        InvalidArgumentError: ``endpoint`` is not ``host:port``.
        BackendError: nothing answering the RPC protocol at ``endpoint`` (within ``timeout`` s).
        UnsupportedError: this build has no RPC backend.
    """
    from ._bindings import check, error_for, ffi, lib
    if not isinstance(endpoint, str):
        raise errors.InvalidArgumentError(f"RPC endpoint must be a 'host:port' string, got {endpoint!r}")
    before = {d.name for d in devices()}
    # the child exits with the native status and prints the native message (the endpoint check
    # itself lives in the C core); an abort inside ggml's client shows as a signal exit
    # (the child imports this very package: its folder goes first on the child's path, ahead of
    # a pydflash/ source tree in the working directory)
    probe = ("import sys; sys.path.insert(0, sys.argv[2]); from pydflash._native import ffi, lib; "
             "s = lib.dflash_add_rpc_server(sys.argv[1].encode()); "
             "print(ffi.string(lib.dflash_last_error()).decode(), file=sys.stderr); sys.exit(s)")
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above pydflash/runtime/
    try:
        run = subprocess.run([sys.executable, "-c", probe, endpoint, package_parent], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise errors.BackendError(f"RPC server {endpoint} did not answer within {timeout:g} s") from None
    lines = [line for line in (run.stderr or "").splitlines() if line.strip()]
    why = lines[-1] if lines else f"exit status {run.returncode}"
    if run.returncode in (lib.DFLASH_ERR_INVALID_ARGUMENT, lib.DFLASH_ERR_UNSUPPORTED):
        raise error_for(run.returncode, why)
    if run.returncode != 0:
        raise errors.BackendError(f"no ggml RPC server answers at {endpoint}: {why}")
    check(lib.dflash_add_rpc_server(endpoint.encode()))
    return [d for d in devices() if d.name not in before]


def add_rpc_servers(spec: str | None) -> None:
    """``--rpc a:1,b:2`` (as llama.cpp's): add each server's devices."""
    for endpoint in filter(None, (e.strip() for e in (spec or "").split(","))):
        add_rpc_server(endpoint)


def resolve_drafter_device(device: str | None, n_gpu_layers: int) -> str:
    """The device name for ``drafter_device``: ``"auto"`` follows the target (first GPU when it
    offloads layers, else the CPU); ``None`` / ``"cpu"`` is the CPU; anything else is a name."""
    if device is None or device.lower() == "cpu":
        return "CPU"
    if device != "auto":
        return device
    if n_gpu_layers != 0:
        for d in devices():
            if d.kind in ("gpu", "igpu"):
                return d.name
    return "CPU"


def n_gpu_layers_arg(value: str) -> int:
    """``-ngl`` as llama.cpp takes it: a count, or all/auto (= -1, every layer)."""
    return -1 if value in ("all", "auto") else int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``-ngl`` / ``-devd`` / ``--rpc``, spelled as llama.cpp's tools spell them."""
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=n_gpu_layers_arg, default=0,
                   help="target layers offloaded to the GPU in GPU builds (-1 or all: every layer; default 0)")
    p.add_argument("-devd", "--device-draft", dest="device_draft", default="auto",
                   help="device of the drafter (`pydflash devices`; default auto: the GPU when -ngl != 0)")
    p.add_argument("--rpc", default=None, help="comma-separated ggml RPC servers host:port whose devices to add")
