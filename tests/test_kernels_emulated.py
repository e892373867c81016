"""Kernel ISA paths this machine cannot run natively, checked under emulation (issue #15).

tests/kernels/isa_check.cpp compares one ISA path of the multi-row kernels with our scalar path
(activation bytes identical, mat-mul NMSE <= 1e-9, rows outside [r0, r1) untouched, 1..16 rows,
odd K and N); the scalar path itself is held to ggml and a float64 reference by test_kernels.py.
It needs no ggml library, only ggml.h (type enums) from the llama.cpp tree that the build fetched
into .cache/.

AVX-512 VNNI: the same kernel sources built against SIMDe's portable implementation of the
intrinsics (-DDFLASH_KERNELS_EMULATED_AVX512; Debian: libsimde-dev) and run here.

arm64 NEON (dotprod): cross-built with aarch64-linux-gnu-g++ (static) and run under qemu-user,
`-cpu max` (has SDOT) and `-cpu cortex-a53` (Armv8.0, no dotprod: dispatch must refuse neon).
Each check skips, saying what is missing, where its toolchain is absent (.ci/run installs it).
"""

from __future__ import annotations

import glob
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "native" / "src" / "kernels"


def _llama_cpp_tree() -> Path | None:
    found = sorted(glob.glob(str(REPO / ".cache" / "llama-cpp-python-*" / "vendor" / "llama.cpp")))
    return Path(found[-1]) if found else None


def _build_isa_check(compiler: str, sources: list[str], out: Path, extra: list[str] = ()) -> Path:
    """Builds tests/kernels/isa_check.cpp with dispatch + the scalar files + `sources` (kernel files).

    One compiler process per file, all at once: the emulated builds are slow to compile and CI
    has more than one core."""
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    tree = _llama_cpp_tree()
    if tree is None:
        pytest.skip("no llama.cpp tree under .cache/llama-cpp-python-*/vendor (build the package first)")
    files = [REPO / "tests" / "kernels" / "isa_check.cpp",
             *[KERNELS / f for f in ["dispatch.cpp", "kquant_scalar.cpp", "legacy_scalar.cpp", *sources]]]
    flags = [compiler, "-std=c++17", "-O2", "-Wall", *extra,
             f"-I{REPO / 'native' / 'src'}", f"-I{tree / 'ggml' / 'include'}"]
    objects = [out.with_name(f"{out.name}.{f.stem}.o") for f in files]
    jobs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for cmd in ([*flags, "-c", str(f), "-o", str(o)] for f, o in zip(files, objects))]
    for cmd, job in jobs:
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, f"build failed: {' '.join(cmd)}\n{err}"
    cmd = [*flags, *map(str, objects), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"link failed: {' '.join(cmd)}\n{r.stderr}"
    return out


@pytest.fixture(scope="module")
def neon_isa_check(tmp_path_factory) -> Path:
    if shutil.which("qemu-aarch64") is None:
        pytest.skip("qemu-aarch64 not installed (Debian: qemu-user)")
    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("aarch64-linux-gnu-g++ not installed (Debian: g++-aarch64-linux-gnu)")
    out = tmp_path_factory.mktemp("neon") / "isa_check_arm64"
    return _build_isa_check("aarch64-linux-gnu-g++", ["kquant_neon.cpp", "legacy_neon.cpp"], out, ["-static"])


def _qemu(binary: Path, cpu: str, isa: str) -> subprocess.CompletedProcess:
    return subprocess.run(["qemu-aarch64", "-cpu", cpu, str(binary), isa], capture_output=True, text=True, timeout=300)


def test_neon_path_matches_scalar_under_qemu(neon_isa_check):
    r = _qemu(neon_isa_check, "max", "neon")
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout
    for t in ("q4_K", "q5_K", "q6_K", "q4_0", "q4_1", "q5_0", "q8_0"):  # every type ran on the neon path
        assert re.search(rf"^{t}\s+neon vs scalar: worst nmse \S+, ok$", r.stdout, re.M), t


def test_neon_refused_without_dotprod_under_qemu(neon_isa_check):
    # Armv8.0 core without SDOT: dispatch must not offer neon (no illegal instruction), scalar runs
    r = _qemu(neon_isa_check, "cortex-a53", "neon")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not available" in r.stderr
    r = _qemu(neon_isa_check, "cortex-a53", "scalar")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout


def _has_simde(cxx: str) -> bool:
    r = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", "-"], input="#include <simde/x86/avx512.h>\n",
                       capture_output=True, text=True)
    return r.returncode == 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86 kernel files build on x86-64")
def test_avx512_path_matches_scalar_under_simde(tmp_path):
    cxx = shutil.which("g++") or "c++"
    if not _has_simde(cxx):
        pytest.skip("SIMDe headers missing (Debian: libsimde-dev)")
    files = ["kquant_avx2.cpp", "legacy_avx2.cpp", "kquant_avx512.cpp", "legacy_avx512.cpp"]
    # -O1: SIMDe's element loops are slow to compile at -O2 and the check needs no speed.
    # ASan + UBSan: SIMDe turns every vector load/store into plain element accesses, so the
    # sanitizers also check the AVX-512 code's memory accesses (the sanitizer job cannot run them).
    flags = ["-O1", "-DDFLASH_KERNELS_EMULATED_AVX512", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    exe = _build_isa_check(cxx, files, tmp_path / "isa_check_avx512", flags)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([str(exe), "avx512"], capture_output=True, text=True, timeout=300, env=env)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 failed" in r.stdout
    for t in ("q4_K", "q5_K", "q6_K", "q4_0", "q4_1", "q5_0", "q8_0"):  # every type ran on the avx512 path
        assert re.search(rf"^{t}\s+avx512 vs scalar: worst nmse \S+, ok$", r.stdout, re.M), t
