"""Fuzz the native drafter GGUF loader (``dflash_drafter_load``, then one inject + propose).

Each input is the *header* of a drafter GGUF (metadata + tensor infos); the harness appends a
zero-filled data section the size the seed drafters need and loads the file next to a tiny real
target. Mutations are both byte-level (libFuzzer's) and structural (a key set to 0 / -1 / huge /
another type, a tensor's shape, type or offset changed, an entry dropped), so values a drafter
file could really carry reach every check of the loader. Seeds are drafters converted by our
converter (see tiny_models.py).

Expected outcome for every input: the drafter loads and drafts, or a ``pydflash`` error other
than ``InternalError``. Anything else (another exception, a crash, a sanitizer report, a hang)
is a finding.

    python fuzz/fuzz_drafter_gguf.py -atheris_runs=100000 fuzz/corpus/drafter   # see fuzz/README.md
"""

from __future__ import annotations

import os
import random
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
    import numpy as np

    import pydflash
    from pydflash import Drafter

SEEDS = Path(os.environ.get("PYDFLASH_FUZZ_SEEDS", Path(tempfile.gettempdir()) / "pydflash-fuzz-seeds"))
WORK = Path(os.environ.get("PYDFLASH_FUZZ_WORK", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
FILE = WORK / f"pydflash-fuzz-drafter-{os.getpid()}.gguf"
TARGET: Path
DATA_SIZE = 0  # zero bytes appended after a header: enough for every seed's tensors
INTERESTING = [0, 1, 2, 3, 7, 16, 31, 32, 255, 4096, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]


def header_of(path: Path) -> bytes:
    h = gguf_edit.load(path)
    return gguf_edit.header_bytes(h)


def setup_seeds(corpus: Path | None) -> None:
    """Build the seed files and, if the corpus folder is empty, fill it with their headers."""
    global TARGET, DATA_SIZE
    TARGET, drafters, _ = tiny_models.build(SEEDS)
    DATA_SIZE = max(len(gguf_edit.load(d).data) for d in drafters)
    if corpus is not None:
        corpus.mkdir(parents=True, exist_ok=True)
        if not any(corpus.iterdir()):
            for d in drafters:
                (corpus / (d.stem + ".hdr")).write_bytes(header_of(d))


def _fit(v: int, vtype: int) -> int:
    fmt = gguf_edit._SCALAR[vtype]
    bits = struct.calcsize(fmt) * 8
    signed = fmt[-1].islower() and fmt[-1] != "?"
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def mutate_structure(data: bytes, rng: random.Random) -> bytes | None:
    """One structural edit of a parsable header; None if the header does not parse."""
    try:
        h = gguf_edit.parse(data + b"\0" * 64)
    except Exception:
        return None
    ints = [k for k, v in h.kv.items() if v.type in gguf_edit._SCALAR and v.type not in (gguf_edit.FLOAT32,
                                                                                           gguf_edit.FLOAT64)]
    choice = rng.randrange(8)
    if choice == 0 and ints:  # an integer key to an interesting value
        k = rng.choice(ints)
        v = h.kv[k]
        v.value = bool(rng.randrange(2)) if v.type == gguf_edit.BOOL else _fit(rng.choice(INTERESTING) * rng.choice(
            [1, -1]), v.type)
    elif choice == 1:  # a float key to nan / inf / 0 / huge
        floats = [k for k, v in h.kv.items() if v.type in (gguf_edit.FLOAT32, gguf_edit.FLOAT64)]
        if floats:
            h.kv[rng.choice(floats)].value = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30])
    elif choice == 2 and h.kv:  # drop a key
        del h.kv[rng.choice(list(h.kv))]
    elif choice == 3 and h.kv:  # change a key's type (int <-> string <-> array)
        k = rng.choice(list(h.kv))
        h.kv[k] = rng.choice([gguf_edit.Value(gguf_edit.STRING, b"llama"),
                              gguf_edit.Value(gguf_edit.INT32, rng.choice([0, -1, 5])),
                              gguf_edit.Value(gguf_edit.ARRAY, [rng.randrange(-2, 40) for _ in range(rng.randrange(4))],
                                              gguf_edit.INT32),
                              gguf_edit.Value(gguf_edit.FLOAT32, 0.5)])
    elif choice == 4 and h.tensors:  # a tensor's shape
        t = rng.choice(h.tensors)
        if t.ne and rng.randrange(3):
            t.ne[rng.randrange(len(t.ne))] = rng.choice(INTERESTING)
        else:
            t.ne = [rng.choice([1, 2, 64, 96]) for _ in range(rng.randrange(0, 5))]
    elif choice == 5 and h.tensors:  # a tensor's type
        rng.choice(h.tensors).type = rng.choice([0, 1, 2, 8, 12, 14, 15, 30, 39, 40, 1000])
    elif choice == 6 and h.tensors:  # a tensor's offset
        rng.choice(h.tensors).offset = rng.choice(INTERESTING)
    elif h.tensors:  # drop or duplicate a tensor
        t = rng.choice(h.tensors)
        if rng.randrange(2):
            h.tensors.remove(t)
        else:
            h.tensors.append(gguf_edit.TensorInfo(t.name if rng.randrange(2) else "blk.9.x.weight", list(t.ne),
                                                  t.type, t.offset))
    return gguf_edit.header_bytes(h)


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.randrange(3):
        out = mutate_structure(data, rng)
        if out is not None and len(out) <= max_size:
            return out
    return atheris.Mutate(data, max_size)


def run_one(header: bytes) -> None:
    # a few inputs also lose part of their data section (truncated downloads)
    tail = DATA_SIZE if (len(header) % 7) else (len(header) * 131) % (DATA_SIZE + 1)
    pad = -len(header) % 32
    FILE.write_bytes(header + b"\0" * (pad + tail))
    try:
        with Drafter(FILE, TARGET, n_ctx=16, n_threads=1) as d:
            d.inject(np.ones((2, d.info.n_target_layers * d.info.n_embd), np.float32), [0, 1])
            d.propose(3, 2, min(d.info.block_size, 4), temperature=0.0)
            d.propose(3, 2, min(d.info.block_size, 4), temperature=1.0)
            note(f"loaded v2={d.info.is_dflash2} layers={d.info.n_layer} block={min(d.info.block_size, 5)}")
    except pydflash.InternalError:
        raise
    except pydflash.PydflashError as exc:
        note(f"{type(exc).__name__}: {exc}")


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    run_one(data)


def main() -> None:
    corpus = next((Path(a) for a in sys.argv[1:] if not a.startswith("-") and not Path(a).is_file()), None)
    setup_seeds(corpus)
    argv = list(sys.argv)
    if not any(a.startswith("-max_len=") for a in argv):
        argv.append("-max_len=65536")
    atheris.Setup(argv, TestOneInput, custom_mutator=custom_mutator)
    try:
        atheris.Fuzz()
    finally:
        FILE.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
