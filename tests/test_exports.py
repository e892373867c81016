"""The extension exports PyInit__native and nothing else we define (its ggml, llama.cpp and C++
template copies stay private), and loads beside another library carrying its own (torch)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest


def _extension_path() -> str:
    import pydflash._native  # type: ignore[import-not-found]

    return str(pydflash._native.__file__)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF dynamic symbol table")
def test_extension_exports_only_its_init_symbol():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm on PATH")
    out = subprocess.run([nm, "-D", "--defined-only", _extension_path()], capture_output=True, text=True, check=True)
    names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert names == {"PyInit__native"}, sorted(names)[:20]


def test_imports_and_generates_after_torch(smollm2_path):  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    code = ("import torch, pydflash; t = pydflash.Target(%r, n_ctx=128, n_threads=1); "
            "r = t.generate([1, 2, 3], max_tokens=4, temperature=0); assert len(r.tokens) == 4; print('ok')"
            % str(smollm2_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
