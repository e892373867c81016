"""Console-script launchers for the pinned upstream tools shipped inside the wheel.

``pydflash-llama-server`` and ``pydflash-llama-quantize`` exec the binaries built from the same
llama.cpp commit as the native core, so upstream behaviour can be compared in the same install.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

BIN_DIR = Path(__file__).resolve().parent / "bin"


def tool_path(name: str) -> Path:
    """Path of a shipped upstream tool (``llama-server`` or ``llama-quantize``)."""
    path = BIN_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{name} is not part of this pydflash install (expected at {path}); "
            "rebuild with -DPYDFLASH_BUILD_TOOLS=ON"
        )
    return path


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
