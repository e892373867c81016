"""Fuzz the converter's inputs: a checkpoint's ``config.json`` and ``model.safetensors`` header,
and the target GGUF header it reads the tokenizer from (``pydflash.formats.convert``).

An input is three length-prefixed parts: config.json bytes, the safetensors JSON header, and a
target GGUF header (may be empty: the seed target is used). The harness writes them as a
checkpoint folder (the safetensors data section zero-filled to what the header claims, capped)
and runs ``convert`` against the target. Seeds are real checkpoints from tests/fixtures_tiny
and tests/data/*.json, and the tiny real target.

Expected outcome: a GGUF, or ``ValueError`` / ``FileNotFoundError`` with a message, and no output
file after a failure. Anything else is a finding.

    python fuzz/fuzz_convert_input.py -runs=100000 fuzz/corpus/convert   # see fuzz/README.md
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import atheris

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import gguf_edit  # noqa: E402
import tiny_models  # noqa: E402
from outcomes import note  # noqa: E402

with atheris.instrument_imports():
    import pydflash.formats.convert
    import pydflash.formats.gguf_layout
    import pydflash.reference.config
    from pydflash.formats.convert import convert

SEEDS = Path(os.environ.get("PYDFLASH_FUZZ_SEEDS", Path(tempfile.gettempdir()) / "pydflash-fuzz-seeds"))
WORK = Path(os.environ.get("PYDFLASH_FUZZ_WORK", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
DIR = WORK / f"pydflash-fuzz-convert-{os.getpid()}"
DATA_CAP = 1 << 20  # most safetensors data bytes written (a header may claim more: then the file is short)
TARGET: Path
TARGET_DATA = b""


def pack(config: bytes, st_header: bytes, target_header: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in (config, st_header, target_header))


def unpack(data: bytes) -> tuple[bytes, bytes, bytes]:
    parts, pos = [], 0
    for _ in range(3):
        n = struct.unpack_from("<I", data, pos)[0] if pos + 4 <= len(data) else 0
        parts.append(data[pos + 4:pos + 4 + n])
        pos += 4 + n
    return parts[0], parts[1], parts[2]


def setup_seeds(corpus: Path | None) -> None:
    global TARGET, TARGET_DATA
    TARGET, _, checkpoints = tiny_models.build(SEEDS)
    TARGET_DATA = gguf_edit.load(TARGET).data
    if corpus is None:
        return
    corpus.mkdir(parents=True, exist_ok=True)
    if any(corpus.iterdir()):
        return
    target_header = gguf_edit.header_bytes(gguf_edit.load(TARGET))
    for i, ckpt in enumerate(checkpoints):
        st = (ckpt / "model.safetensors").read_bytes()
        n = struct.unpack_from("<Q", st)[0]
        config = (ckpt / "config.json").read_bytes()
        (corpus / f"ckpt{i}").write_bytes(pack(config, st[8:8 + n], b""))
        (corpus / f"ckpt{i}-target").write_bytes(pack(config, st[8:8 + n], target_header))
    # the published DFlash2 layout (config + header, no weights)
    data = HERE.parent / "tests" / "data"
    (corpus / "published").write_bytes(pack((data / "dflash2-config.json").read_bytes(),
                                            (data / "dflash2-safetensors-header.json").read_bytes(), b""))


ODD_VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 2**31, 2**63, -2**63, 1e308, -0.5, float("nan"), "", "x",
              "full_attention", "sliding_attention", "BF16", "F32", "I64", [], [0], [-1, 5, 1000], [[1]], {}, {"a": 1}]


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    """Every (dict key / list index) path inside a JSON value."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:8]):
            out += _paths(v, prefix + (i,))
    return out


def mutate_json(text: bytes, rng: random.Random) -> bytes | None:
    """Set one value somewhere in the document to an odd one (or drop it); None if not JSON."""
    try:
        doc = json.loads(text)
    except Exception:
        return None
    paths = [p for p in _paths(doc) if p]
    if not paths:
        return None
    path = rng.choice(paths)
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if rng.randrange(5) == 0 and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(ODD_VALUES)
    return json.dumps(doc).encode()


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    parts = list(unpack(data))
    if rng.randrange(3):
        i = rng.randrange(2)  # config.json or the safetensors header
        out = mutate_json(parts[i], rng)
        if out is not None:
            parts[i] = out
            packed = pack(*parts)
            if len(packed) <= max_size:
                return packed
    return atheris.Mutate(data, max_size)


def _claimed_size(st_header: bytes) -> int:
    try:
        header = json.loads(st_header)
        return max(int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__")
    except Exception:
        return 0


def run_one(data: bytes) -> None:
    config, st_header, target_header = unpack(data)
    ckpt = DIR / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_bytes(config)
    size = min(max(_claimed_size(st_header), 0), DATA_CAP)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(st_header)) + st_header + b"\0" * size)
    target = TARGET
    if target_header:
        target = DIR / "target.gguf"
        target.write_bytes(target_header + b"\0" * (-len(target_header) % 32) + TARGET_DATA)
    out = DIR / "out.gguf"
    out.unlink(missing_ok=True)
    try:
        convert(ckpt, out, target_gguf=target, outtype="f32", progress=False)
        note("converted")
    except (ValueError, FileNotFoundError) as exc:
        note(f"{type(exc).__name__}: {str(exc).replace(str(DIR), '')}")
        if not str(exc):
            raise AssertionError(f"{type(exc).__name__} without a message") from exc
        leftovers = [p.name for p in DIR.iterdir() if p.name not in ("ckpt", "target.gguf")]
        if leftovers:
            raise AssertionError(f"a failed conversion left {leftovers}") from exc


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    run_one(data)


def main() -> None:
    logging.disable(logging.WARNING)  # the converter's warnings on odd but valid configs
    corpus = next((Path(a) for a in sys.argv[1:] if not a.startswith("-") and not Path(a).is_file()), None)
    setup_seeds(corpus)
    argv = list(sys.argv)
    if not any(a.startswith("-max_len=") for a in argv):
        argv.append("-max_len=65536")
    atheris.Setup(argv, TestOneInput, custom_mutator=custom_mutator)
    try:
        atheris.Fuzz()
    finally:
        shutil.rmtree(DIR, ignore_errors=True)


if __name__ == "__main__":
    main()
