"""Training data from the GGUF target alone: its own continuations, tap features and labels.

The target writes continuations of the prompts (greedy, and optionally sampled) through the
native scheduler, many sequences per step, and captures while it generates (one pass: nothing is
decoded twice), for every position p it decodes:

* ``features[p]``: the L tapped hidden states (HF layer ids ``l``, i.e. the *inputs* of target
  layers ``l + 1``, spec 3.1), and
* ``labels[p]``: the target's own argmax prediction for position p + 1. On a greedy continuation
  this is the next token itself; on a sampled one it is what greedy decoding would have said
  there. Prompt rows carry -1 (no logits are computed there) except the last one, whose label is
  the target's first greedy token.

The last generated token is never decoded, so a sequence keeps its tokens up to the last row with
features (one token fewer than was generated).

The cache stores features compactly as float16 *scaled per row and tap* (each row divided by its
absolute maximum, kept as float32): hidden states carry "massive activations" (a few channels
hundreds of times larger than the rest) that overflow or flush plain float16, while the scaled
form keeps ~11 significant bits for every value within 2**14 of its row's maximum.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

__all__ = [
    "FeatureCache",
    "CapturedSequence",
    "Continuation",
    "capture_continuations",
    "decode_features",
    "encode_features",
]

CACHE_VERSION = 1


def encode_features(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[n, L, H]`` float32 -> (``[n, L, H]`` float16 in [-1, 1], ``[n, L]`` float32 row scales)."""
    feats = np.asarray(features, dtype=np.float32)
    scale = np.abs(feats).max(axis=-1)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return (feats / scale[..., None]).astype(np.float16), scale


def decode_features(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_features` (float32)."""
    return values.astype(np.float32) * np.asarray(scale, dtype=np.float32)[..., None]


@dataclass
class CapturedSequence:
    """One training sequence: tokens, where the continuation starts, features and labels."""

    id: str
    tokens: np.ndarray  # [n] int32
    prompt_len: int
    features: np.ndarray  # [n, L, H] float32
    labels: np.ndarray  # [n] int32: target argmax at each row (prediction for the next position)


@dataclass(frozen=True)
class Continuation:
    """One sequence to capture: an id, the prompt's tokens and how to continue it."""

    id: str
    prompt: Sequence[int]
    temperature: float = 0.0
    seed: int = 0


def capture_continuations(target, jobs: Iterable[Continuation], tap_layers: Sequence[int], *, max_tokens: int,
                          n_parallel: int, step_rows: int = 64, top_k: int = 0,
                          top_p: float = 1.0) -> Iterator[CapturedSequence]:  # type: ignore[no-untyped-def]
    """Generate every job's continuation and capture its rows in the same pass.

    Runs plain decoding through one native ``Scheduler`` over ``target`` (which needs
    ``n_seq_max >= n_parallel``), keeping ``n_parallel`` sequences in flight (continuous batching:
    a finished one is replaced at once), so each step decodes many rows through the multi-row
    kernels. Yields each sequence as it finishes (not in job order).

    ``step_rows`` caps the rows of one step (decode rows first, then prompt chunks): a new prompt
    is prefilled in slices that stay on pydflash's multi-row kernels (64 rows by default, their
    ``PYDFLASH_KERNELS_MAX_ROWS``) instead of one long ubatch on ggml's prefill kernels, which on
    a 2-core AVX2 machine cost about twice as much per row for SmolLM2 (measured: 170 -> 255-300
    captured tokens/s at 16 in parallel). 0 = the target's ``n_batch``.
    """
    from ..runtime.generation import SamplingOptions
    from ..runtime.scheduler import Scheduler

    sched = Scheduler(target, None, n_max=0, n_batch=max(step_rows, n_parallel) if step_rows > 0 else 0)
    try:
        sched.set_capture([int(layer) + 1 for layer in tap_layers])
        pending = iter(jobs)
        running: dict[int, Continuation] = {}

        def refill() -> None:
            while len(running) < n_parallel:
                job = next(pending, None)
                if job is None:
                    return
                opts = SamplingOptions.build(max_tokens=max_tokens, temperature=job.temperature, seed=job.seed,
                                             top_k=top_k, top_p=top_p, min_p=0.0)
                running[sched.add(list(job.prompt), opts, cache_prompt=False, capture=True)] = job

        refill()
        while running:
            sched.step()
            for sid in sched.finished():
                job = running.pop(sid)
                result = sched.take(sid)
                cap = result.capture
                n = len(cap.labels)
                tokens = np.asarray(list(job.prompt) + list(result.tokens), dtype=np.int32)[:n]
                if n >= 2:
                    yield CapturedSequence(job.id, tokens, len(job.prompt), cap.features, cap.labels)
            refill()
    finally:
        sched.close()


def _map_npz(path: Path, names: Sequence[str]) -> tuple[np.ndarray, ...] | None:
    """Read-only arrays over the members ``names`` of an uncompressed ``.npz`` (what ``np.savez``
    writes: a zip of stored ``.npy`` files), mapped from the file instead of read; None when a
    member is compressed or not a plain array, so the caller reads it."""
    import mmap
    import zipfile

    with open(path, "rb") as f:
        with zipfile.ZipFile(f) as zf:
            infos = [zf.getinfo(f"{n}.npy") for n in names]
        if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
            return None
        arrays = []
        for info in infos:
            f.seek(info.header_offset)
            local = f.read(30)  # the local file header: name and extra field lengths at 26 and 28
            if local[:4] != b"PK\x03\x04":
                return None
            start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
            f.seek(start)
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                return None
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            if dtype.hasobject or fortran:
                return None
            arrays.append((shape, dtype, f.tell()))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # one mapping per shard, shared by its arrays
    return tuple(np.ndarray(shape, dtype=dtype, buffer=mm, offset=off) for shape, dtype, off in arrays)


class FeatureCache:
    """A directory of captured sequences: ``meta.json`` plus one ``.npz`` shard per sequence group.

    Appending is crash-safe (each shard is written to a temporary name and renamed, then
    ``meta.json`` is rewritten the same way), so an interrupted capture resumes where it stopped.
    """

    def __init__(self, directory: str | os.PathLike, *, tap_layers: Sequence[int] | None = None,
                 target_name: str | None = None) -> None:
        self.dir = Path(directory)
        meta_path = self.dir / "meta.json"
        if meta_path.exists():
            self.meta = json.loads(meta_path.read_text())
            if self.meta.get("version") != CACHE_VERSION:
                raise ValueError(f"{self.dir}: feature cache version {self.meta.get('version')} != {CACHE_VERSION}")
            if tap_layers is not None and list(tap_layers) != self.meta["tap_layers"]:
                raise ValueError(f"{self.dir} holds taps {self.meta['tap_layers']}, not {list(tap_layers)}: "
                                 "use another --cache directory")
            if target_name is not None and target_name != self.meta.get("target"):
                raise ValueError(f"{self.dir} was captured from {self.meta.get('target')!r}, not {target_name!r}")
        else:
            if tap_layers is None:
                raise FileNotFoundError(f"no feature cache in {self.dir}")
            self.meta = {"version": CACHE_VERSION, "tap_layers": [int(x) for x in tap_layers],
                         "target": target_name, "format": "float16 scaled per row and tap", "shards": []}

    @property
    def tap_layers(self) -> list[int]:
        return list(self.meta["tap_layers"])

    @property
    def ids(self) -> set[str]:
        return {s for shard in self.meta["shards"] for s in shard["ids"]}

    @property
    def n_tokens(self) -> int:
        return sum(shard["n_tokens"] for shard in self.meta["shards"])

    def append(self, sequences: Iterable[CapturedSequence]) -> None:
        """Write one shard holding ``sequences``."""
        seqs = list(sequences)
        if not seqs:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        values, scales = encode_features(np.concatenate([s.features for s in seqs], axis=0))
        lengths = np.asarray([len(s.tokens) for s in seqs], dtype=np.int64)
        name = f"shard-{len(self.meta['shards']):05d}.npz"
        tmp = self.dir / f".{name}.tmp.npz"
        np.savez(tmp, tokens=np.concatenate([s.tokens for s in seqs]).astype(np.int32),
                 labels=np.concatenate([s.labels for s in seqs]).astype(np.int32),
                 lengths=lengths, prompt_lens=np.asarray([s.prompt_len for s in seqs], dtype=np.int64),
                 values=values, scales=scales)
        os.replace(tmp, self.dir / name)
        self.meta["shards"].append({"file": name, "ids": [s.id for s in seqs], "n_tokens": int(lengths.sum())})
        self._write_meta()

    def _write_meta(self) -> None:
        tmp = self.dir / ".meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1))
        os.replace(tmp, self.dir / "meta.json")

    def sequences(self, *, decode: bool = True) -> list[CapturedSequence]:
        """Every cached sequence (features decoded to float32 unless ``decode=False``,
        then ``features`` is the (values, scales) pair, memory-mapped from the shard files: a cache
        larger than RAM trains, each batch reading only its sequences' rows)."""
        out = []
        for shard in self.meta["shards"]:
            path = self.dir / shard["file"]
            with np.load(path) as z:
                tokens, labels, lengths, plens = z["tokens"], z["labels"], z["lengths"], z["prompt_lens"]
                mapped = None if decode else _map_npz(path, ("values", "scales"))
                values, scales = mapped if mapped is not None else (z["values"], z["scales"])
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            for i, sid in enumerate(shard["ids"]):
                a, b = int(offsets[i]), int(offsets[i + 1])
                feats = decode_features(values[a:b], scales[a:b]) if decode else (values[a:b], scales[a:b])
                out.append(CapturedSequence(sid, tokens[a:b], int(plens[i]), feats, labels[a:b]))
        return out
