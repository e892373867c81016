"""The SIMD kernel paths this machine cannot execute, checked under emulation (issue #15).

tests/kernels/isa_check.cpp compares an ISA path with our scalar path (activation bytes
identical, mat-mul NMSE <= 1e-9, rows outside [r0, r1) untouched, 1..16 rows, odd shapes); the
scalar path itself is held to ggml's CPU mat-mul and a float64 reference by tests/test_kernels.py.
- AVX-512 VNNI: the same kernel sources built against SIMDe's portable implementation of the
  intrinsics (Debian: libsimde-dev), run here.
Each check skips, saying what is missing, where its toolchain is absent (.ci/run installs it).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "native" / "src" / "kernels"
CHECK = ROOT / "tests" / "kernels" / "isa_check.cpp"


def _ggml_include() -> Path:
    found = sorted(glob.glob(str(ROOT / ".cache" / "llama-cpp-python-*" / "vendor" / "llama.cpp" / "ggml" / "include")))
    if not found:
        pytest.skip("the pinned llama.cpp tree (.cache/llama-cpp-python-*) is not unpacked: build the package first")
    return Path(found[-1])


def _build(compiler: str, sources: list[Path], out: Path, extra: list[str]) -> None:
    cmd = [compiler, "-std=c++17", "-O1", f"-I{ROOT / 'native' / 'src'}", f"-I{_ggml_include()}", *extra,
           str(CHECK), *map(str, sources), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"build failed: {' '.join(cmd)}\n{res.stderr[-4000:]}"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _has_simde(cxx: str) -> bool:
    res = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", "-"], input="#include <simde/x86/avx512.h>\n",
                         capture_output=True, text=True)
    return res.returncode == 0


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="the x86 kernel files build on x86-64")
def test_avx512_path_matches_scalar_under_simde(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("no C++ compiler")
    if not _has_simde(cxx):
        pytest.skip("SIMDe headers missing (Debian: apt-get install libsimde-dev)")
    srcs = [KERNELS / f for f in ("dispatch.cpp", "kquant_scalar.cpp", "legacy_scalar.cpp", "kquant_avx2.cpp",
                                  "legacy_avx2.cpp", "kquant_avx512.cpp", "legacy_avx512.cpp")]
    exe = tmp_path / "isa_check_avx512"
    _build(cxx, srcs, exe, ["-DDFLASH_KERNELS_EMULATED_AVX512"])
    res = _run([str(exe), "avx512"])
    print(res.stdout)
    assert res.returncode == 0, res.stdout + res.stderr
    for t in ("q4_K", "q5_K", "q6_K", "q4_0", "q4_1", "q5_0", "q8_0"):
        assert f"{t}  avx512 vs scalar" in res.stdout and "FAILED" not in res.stdout
