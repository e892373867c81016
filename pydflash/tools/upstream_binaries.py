"""Console-script launchers for the pinned upstream tools shipped inside the wheel.

``pydflash-llama-server``, ``pydflash-llama-quantize`` and ``pydflash-rpc-server`` exec the
binaries built from the same llama.cpp commit as the native core, so upstream behaviour can be
compared in the same install (and an RPC server speaks exactly this build's protocol).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pydflash


def tool_path(name: str) -> Path:
    """Path of a shipped upstream tool (``llama-server``, ``llama-quantize``, ``ggml-rpc-server``).

    The binaries live in ``pydflash/bin`` of the installed package; an editable install splits
    the package over several directories, so every entry of ``pydflash.__path__`` is searched.
    """
    for root in pydflash.__path__:
        path = Path(root) / "bin" / name
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{name} is not part of this pydflash install (looked in {list(pydflash.__path__)}); "
        "rebuild with -DPYDFLASH_BUILD_TOOLS=ON"
    )


def _exec(name: str) -> None:
    try:
        path = tool_path(name)
    except FileNotFoundError as exc:
        sys.exit(f"pydflash: {exc}")
    os.execv(path, [str(path), *sys.argv[1:]])


def llama_server() -> None:
    _exec("llama-server")


def llama_quantize() -> None:
    _exec("llama-quantize")


def rpc_server() -> None:
    _exec("ggml-rpc-server")
