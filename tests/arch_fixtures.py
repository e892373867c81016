"""Random-weight targets of every architecture the pinned llama.cpp knows, and a DFlash2 drafter
shaped for each.

The targets come from the pinned tree's own fixture generator (``tests/test-llama-archs.cpp -o
DIR``), compiled here against the static libraries the package build made (one file, seconds).
The drafters are seeded checkpoints of the published DFlash2 layout, converted by our converter.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / ".cache" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
CACHE = ROOT / ".cache" / "arch-fixtures"

# the static libraries of the pinned tree, in link order, relative to the build's llama.cpp folder
_LIBS = ["common/libllama-common.a", "common/libllama-common-base.a", "src/libllama.a", "ggml/src/libggml.a",
         "ggml/src/ggml-rpc/libggml-rpc.a", "ggml/src/libggml-cpu.a", "ggml/src/libggml-base.a",
         "vendor/hash/libvendor-hash.a"]


class Unavailable(RuntimeError):
    """The fixtures cannot be made here (no compiler, no build tree): tests skip with this reason."""


def _build_dir() -> Path:
    for lib in sorted((ROOT / "build").glob("*/llama.cpp/src/libllama.a")):
        return lib.parents[1]
    raise Unavailable("no build tree with libllama.a under build/ (install with pip install -e .)")


def generator() -> Path:
    """The pinned tree's fixture generator, compiled once per build of the static libraries."""
    src = TREE / "tests" / "test-llama-archs.cpp"
    if not src.is_file():
        raise Unavailable(f"the pinned llama.cpp tree is not at {TREE}")
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise Unavailable("no C++ compiler on PATH")
    build = _build_dir()
    libs = [build / lib for lib in _LIBS]
    missing = [str(p) for p in libs if not p.is_file()]
    if missing:
        raise Unavailable(f"static libraries missing: {missing}")
    stamp = hashlib.sha256(b"".join(str(p.stat().st_mtime_ns).encode() for p in [src, *libs])).hexdigest()[:12]
    exe = CACHE / f"test-llama-archs-{stamp}"
    if exe.is_file():
        return exe
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [cxx, "-std=c++17", "-O1", str(src), f"-I{TREE}/include", f"-I{TREE}/common", f"-I{TREE}/ggml/include",
           f"-I{TREE}/src", "-o", str(exe) + ".tmp", *map(str, libs), "-lpthread", "-fopenmp", "-ldl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise Unavailable(f"could not compile the fixture generator: {r.stderr[-2000:]}")
    Path(str(exe) + ".tmp").rename(exe)
    return exe


def targets(stdev: float = 0.5, seed: int = 42) -> dict[str, Path]:
    """{fixture name: GGUF} of every architecture; stdev 0.5 gives peaked logits (testing-notes)."""
    exe = generator()
    out = CACHE / f"{exe.name}-d{stdev}-s{seed}"
    done = out / ".complete"
    if not done.is_file():
        out.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([str(exe), "-o", str(out), "-d", str(stdev), "-s", str(seed)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise Unavailable(f"the fixture generator failed: {r.stderr[-2000:]}")
        done.write_text("")
    return {p.name.removesuffix(".gguf"): p for p in sorted(out.glob("*.gguf"))}


def drafter_for(target: Path, block_size: int = 8, seed: int = 0) -> Path:
    """A seeded DFlash2 drafter (published naming and layout, one sliding layer) shaped for target,
    tapping the output of its first layer, converted by our converter (f32, no tokenizer)."""
    import tempfile

    from fixtures_tiny import tiny_config, write_checkpoint  # type: ignore[import-not-found]

    from pydflash.formats.convert import convert, read_target_gguf

    info = read_target_gguf(target)
    out = target.parent.with_name(target.parent.name + "-drafters") / f"{target.stem}.dflash2-b{block_size}-s{seed}.gguf"
    if out.is_file():
        return out
    cfg = tiny_config(
        "dflash2", hidden_size=info.hidden_size, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=info.hidden_size // 4, intermediate_size=64, vocab_size=info.vocab_size,
        target_layer_ids=(0,), num_target_layers=info.n_layers, block_size=block_size,
        mask_token_id=info.vocab_size - 1, conv_group_size=8, selector_rank=16, selector_top_k=4,
    )
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp) / "ckpt", cfg, seed=seed)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(Path(tmp) / "ckpt", out, target_gguf=target, outtype="f32", tokenizer=False)
    return out
