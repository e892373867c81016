"""Models from the Hugging Face Hub, as llama.cpp's ``-hf``: targets, drafters, checkpoints.

A reference names a repository and, optionally, what to take from it::

    hf:ORG/NAME                 the default GGUF (Q4_K_M, else Q8_0, else the first one)
    hf:ORG/NAME:Q4_1            the GGUF whose file name carries Q4_1 (case-insensitive)
    hf:ORG/NAME/sub/file.gguf   that file
    hf:ORG/NAME@REV:Q8_0        at a branch, tag or commit (REV without "/" or ":")

``Target("hf:...")``, ``Engine("hf:...", "hf:...")``, ``pydflash generate -hf ORG/NAME:QUANT
-hfd ORG/NAME`` and ``pydflash convert ORG/NAME`` all come here. GGUF files are chosen as
llama.cpp's ``common/download.cpp`` chooses them (the tag followed by ``.`` or ``-`` in the path,
sidecars such as ``mmproj`` left out, every part ``-0000i-of-0000N`` of a split file fetched; the
first part is the one to load).

A drafter repository is either GGUF (used as is; a ``dflash-`` sidecar is preferred) or a
DFlash / DFlash2 checkpoint as published (``config.json`` + ``*.safetensors``), converted on first
use for the target it is paired with and kept under ``<pydflash cache>/drafters/``, keyed by the
repository's commit, the target file (its blob sha256 in the HF cache, else path + size + mtime)
and the output type (``f16`` default; ``bf16``, ``f32``, ``q8_0`` from the converter, ``Q4_K_M``
etc. converted then quantized). For a checkpoint repository ``:QUANT`` is that output type.

Everything goes through ``huggingface_hub`` (``pip install 'pydflash[hub]'``): files land in the
standard HF cache, and ``HF_HOME`` / ``HF_HUB_CACHE`` (``LLAMA_CACHE`` first, as llama.cpp),
``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``HF_ENDPOINT`` apply. Downloads show tqdm bars, resume after a dropped connection, and are
renamed into the cache only when complete. Offline (or with the Hub unreachable) the repository
is listed from the cache, as llama.cpp does. Failures are ``pydflash.errors.Hub*Error``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .. import errors
from .cache import cache_dir, locked

__all__ = ["HubRef", "checkpoint_dir", "convert_checkpoint", "drafter_file", "is_hub_ref", "model_file", "parse", "pick_gguf", "pick_sidecar", "sidecar_drafter"]

log = logging.getLogger(__name__)

PREFIX = "hf:"
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when no quant is given
_CONVERT_FORMAT = 1  # bump when the converter's output for the same inputs changes: old cache entries are ignored
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_RE = re.compile(rf"{_NAME}/{_NAME}")
_SPLIT_RE = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # sidecars, not models
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CHECKPOINT_FILES = re.compile(r"(config\.json|[^/]*\.safetensors|model\.safetensors\.index\.json)")


@dataclass(frozen=True)
class HubRef:
    """A repository and what to take from it: a quantization tag or a file, at a revision."""

    repo_id: str
    tag: str | None = None
    filename: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{rev}" + (f"/{self.filename}" if self.filename else f":{self.tag}" if self.tag else "")


def is_hub_ref(value: object) -> bool:
    """True for a string ``hf:...`` (a Hub reference rather than a path or a model name)."""
    return isinstance(value, str) and value.startswith(PREFIX)


def parse(spec: str, *, filename: str | None = None) -> HubRef:
    """``[hf:]ORG/NAME[@REV][:QUANT]`` or ``[hf:]ORG/NAME[@REV]/FILE`` as a HubRef.

    ``filename`` (llama.cpp's ``-hff``) overrides the quant. InvalidArgumentError if malformed.
    """
    text = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    tag: str | None = None
    if ":" in text:
        text, tag = text.rsplit(":", 1)
    parts = text.split("/")
    name, _, revision = parts[1].partition("@") if len(parts) > 1 else ("", "", "")
    repo_id = f"{parts[0]}/{name}"
    if len(parts) < 2 or not _REPO_RE.fullmatch(repo_id) or (tag is not None and not re.fullmatch(r"[\w.-]+", tag)):
        raise errors.InvalidArgumentError(
            f"{spec!r} is not a Hugging Face repository: expected ORG/NAME[:QUANT] (e.g. ggml-org/gemma-3-1b-it-GGUF:Q4_K_M)")
    in_spec = "/".join(parts[2:]) or None
    if in_spec and tag:
        raise errors.InvalidArgumentError(f"{spec!r} names both a file and a quant; give one")
    return HubRef(repo_id, None if (filename or in_spec) else tag, filename or in_spec, revision or None)


# --- choosing files (llama.cpp's rules) --------------------------------------------------------------------


def _split_info(path: str) -> tuple[str, int, int]:
    """(prefix, part, parts) of a GGUF path; (path without .gguf, 1, 1) when it is not split."""
    m = _SPLIT_RE.fullmatch(path)
    if m:
        return m.group(1), int(m.group(2)), int(m.group(3))
    return path[:-5], 1, 1


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(k in name for k in _NOT_MODELS)


def _parts(files: Sequence[str], primary: str, repo: str) -> list[str]:
    """Every part of a split GGUF in order (just ``primary`` if it is not split); all must be listed."""
    prefix, _, count = _split_info(primary)
    if count == 1:
        return [primary]
    found = {idx: f for f in files for p, idx, n in [_split_info(f)] if p == prefix and n == count}
    missing = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1) if i not in found]
    if missing:
        raise errors.HubFileNotFoundError(f"{repo}: split GGUF {primary} lacks part(s) {', '.join(missing)}")
    return [found[i] for i in range(1, count + 1)]


def pick_gguf(files: Sequence[str], tag: str | None = None, *, repo: str = "the repository",
              drafter: bool = False) -> list[str]:
    """The GGUF file(s) to fetch for ``tag`` from a repository listing, first part first.

    As llama.cpp: the first model GGUF (sorted paths) whose path has ``TAG.`` or ``TAG-``
    (case-insensitive); without a tag Q4_K_M, then Q8_0, then the first model GGUF. Sidecars
    (mmproj, imatrix, mtp-, eagle3-, dflash-, dspark-) are not models and only first parts are
    candidates. ``drafter``: ``dflash-`` sidecars first, then the model GGUFs.
    HubFileNotFoundError listing the GGUF files when nothing matches.
    """
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    groups = [[f for f in ggufs if _is_model(f)]]
    if drafter:
        groups.insert(0, [f for f in ggufs if "dflash-" in f.rsplit("/", 1)[-1]])
    groups = [[f for f in g if _split_info(f)[1] == 1] for g in groups]
    for candidates in groups:
        for t in [tag] if tag else DEFAULT_TAGS:
            pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
            for f in candidates:
                if pattern.search(f):
                    return _parts(files, f, repo)
    first = next((g[0] for g in groups if g), None)
    if not tag and first is not None:
        return _parts(files, first, repo)
    if not ggufs:
        raise errors.HubFileNotFoundError(f"{repo} has no GGUF files (files: {_short(files)})")
    raise errors.HubFileNotFoundError(f"{repo} has no GGUF file matching {tag!r}; GGUF files: {_short(ggufs)}")


def _short(files: Sequence[str], n: int = 12) -> str:
    shown = ", ".join(files[:n]) or "none"
    return shown + (f", ... ({len(files)} in all)" if len(files) > n else "")


# --- talking to the Hub -------------------------------------------------------------------------------------


def _hf() -> ModuleType:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download  # noqa: F401 - the submodules used below
    except ImportError:
        raise errors.HubNotInstalledError(
            "models from the Hugging Face Hub need huggingface_hub: pip install 'pydflash[hub]'") from None
    return huggingface_hub


def _offline(offline: bool) -> bool:
    constants = _hf().constants
    return offline or bool(getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)())


@dataclass(frozen=True)
class _Listing:
    repo_id: str
    revision: str          # what to download at: the ref asked for (online) or its cached commit (offline)
    files: tuple[str, ...]
    cached_only: bool      # listed from the local cache: download nothing


def cache_root() -> Path:
    """The Hugging Face cache in use: ``LLAMA_CACHE`` if set (llama.cpp's own override, so its
    ``-hf`` downloads and ours are the same files), else huggingface_hub's (``HF_HUB_CACHE``, ``HF_HOME``)."""
    return Path(os.environ.get("LLAMA_CACHE") or _hf().constants.HF_HUB_CACHE).expanduser()


def _cache_folder(repo_id: str) -> Path:
    return cache_root() / _hf().file_download.repo_folder_name(repo_id=repo_id, repo_type="model")


def _cached_listing(ref: HubRef) -> _Listing | None:
    """The files of the cached snapshot of ``ref`` (only files actually present), None if none is."""
    folder = _cache_folder(ref.repo_id)
    rev = ref.revision or "main"
    commit = rev if _COMMIT_RE.fullmatch(rev) else None
    if commit is None:
        with contextlib.suppress(OSError):
            commit = (folder / "refs" / rev).read_text().strip()
    snapshot = folder / "snapshots" / (commit or "")
    if not commit or not snapshot.is_dir():
        return None
    files = tuple(sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()))
    return _Listing(ref.repo_id, commit, files, True) if files else None


def _explain(exc: BaseException, ref: HubRef, token: str | None, what: str = "") -> errors.HubError:
    """A huggingface_hub failure as one of our typed errors, one line."""
    hf = _hf()
    he = hf.errors
    endpoint = hf.constants.ENDPOINT
    if isinstance(exc, he.GatedRepoError):
        return _gated(ref, token)
    if isinstance(exc, he.RevisionNotFoundError):
        return errors.HubRepoNotFoundError(f"{ref.repo_id} has no revision {ref.revision!r} on {endpoint}")
    if isinstance(exc, he.RepositoryNotFoundError):
        private = "" if token or hf.get_token() else " (if it is private, set HF_TOKEN or -hft)"
        return errors.HubRepoNotFoundError(f"repository {ref.repo_id} not found on {endpoint}{private}")
    if isinstance(exc, he.EntryNotFoundError) and not isinstance(exc, he.LocalEntryNotFoundError):
        return errors.HubFileNotFoundError(f"{ref.repo_id} has no file {what}")
    if isinstance(exc, (he.OfflineModeIsEnabled, he.LocalEntryNotFoundError)):
        return _not_cached(ref, what)
    if isinstance(exc, he.HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return errors.HubAccessError(f"{endpoint} refused {ref.repo_id} ({exc.response.status_code}): set HF_TOKEN "
                                     "(or -hft) to a token with access")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return errors.HubError(f"{ref.repo_id}: {first}")


def _gated(ref: HubRef, token: str | None) -> errors.HubAccessError:
    hf = _hf()
    page = f"{hf.constants.ENDPOINT}/{ref.repo_id}"
    how = "the token given has no access" if token or hf.get_token() else "no token was given"
    return errors.HubAccessError(f"{ref.repo_id} is a gated repository and {how}: accept its conditions on {page} "
                                 "and set HF_TOKEN (or -hft) to a token of that account")


def _not_cached(ref: HubRef, what: str = "", reason: str = "") -> errors.HubOfflineError:
    why = reason or ("offline (HF_HUB_OFFLINE=1 or --offline)")
    thing = f"{what} of {ref}" if what else str(ref)
    return errors.HubOfflineError(f"{why} and {thing} is not in the Hugging Face cache ({cache_root()})")


def _list(ref: HubRef, token: str | None, offline: bool) -> _Listing:
    """The repository's files: from the Hub, or from the cache when offline or the Hub is unreachable."""
    hf = _hf()
    reason = ""
    if not _offline(offline):
        try:
            info = hf.HfApi().model_info(ref.repo_id, revision=ref.revision, token=token)
        except (hf.errors.RepositoryNotFoundError, hf.errors.RevisionNotFoundError) as exc:
            raise _explain(exc, ref, token) from None
        except hf.errors.HfHubHTTPError as exc:
            if exc.response is not None and exc.response.status_code in (401, 403):
                raise _explain(exc, ref, token) from None
            reason = f"{hf.constants.ENDPOINT} answered {_first_line(exc)}"
        except Exception as exc:  # noqa: BLE001 - no connection, timeouts, proxies: fall back to the cache
            reason = f"cannot reach {hf.constants.ENDPOINT} ({type(exc).__name__})"
        else:
            if info.gated and not (token or hf.get_token()):
                raise _gated(ref, token)
            files = tuple(sorted(s.rfilename for s in info.siblings or ()))
            return _Listing(ref.repo_id, ref.revision or "main", files, False)
    cached = _cached_listing(ref)
    if cached is None:
        raise _not_cached(ref, reason=reason)
    if reason:
        log.warning("%s; using the cached copy of %s", reason, ref)
    return cached


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _download(listing: _Listing, files: Sequence[str], ref: HubRef, token: str | None) -> list[Path]:
    """Each file through the HF cache (hf_hub_download: resumable, renamed into place when complete)."""
    hf = _hf()
    paths = []
    for name in files:
        try:
            paths.append(Path(hf.hf_hub_download(ref.repo_id, name, revision=listing.revision, token=token,
                                                 local_files_only=listing.cached_only, cache_dir=cache_root())))
        except Exception as exc:  # noqa: BLE001 - every failure becomes one typed line
            raise _explain(exc, ref, token, name) from None
    return paths


def model_file(spec: str | HubRef, *, token: str | None = None, offline: bool = False) -> Path:
    """A GGUF model from the Hub (every part of a split file); the path of the (first) part to load."""
    ref = parse(spec) if isinstance(spec, str) else spec
    listing = _list(ref, token, offline)
    if ref.filename:
        if ref.filename not in listing.files:
            ggufs = [f for f in listing.files if f.lower().endswith(".gguf")]
            where = " in the cache" if listing.cached_only else ""
            raise errors.HubFileNotFoundError(f"{ref.repo_id} has no file {ref.filename}{where}; GGUF files: {_short(ggufs)}")
        names = _parts(listing.files, ref.filename, ref.repo_id) if ref.filename.lower().endswith(".gguf") else [ref.filename]
    else:
        names = pick_gguf(listing.files, ref.tag, repo=ref.repo_id)
    return _download(listing, names, ref, token)[0]


def _quant_bits(path: str) -> int:
    """The bits of a file's quantization tag (Q4_K_M -> 4, F16 -> 16), 0 when it has none."""
    m = re.search(r"[-.]([A-Za-z0-9_]+)$", _split_info(path)[0])
    bits = re.search(r"\d+", m.group(1)) if m else None
    return int(bits.group()) if bits else 0


def pick_sidecar(files: Sequence[str], model: str, tag: str | None = None, keyword: str = "dflash-") -> str | None:
    """The ``keyword`` GGUF (a drafter shipped next to a model) to take with ``model``, as llama.cpp picks
    its sidecars: in the model's directory or above it, the deepest first, then one carrying ``-TAG.``,
    then the closest quantization bits (to the tag's, else the model's). None when there is none."""
    model_dirs = model.split("/")[:-1]
    want_bits = _quant_bits(f"x-{tag}.gguf") if tag else _quant_bits(model)
    best: tuple[int, bool, int] | None = None
    choice = None
    for f in sorted(files):
        dirs = f.split("/")[:-1]
        if not f.lower().endswith(".gguf") or keyword not in f or dirs != model_dirs[:len(dirs)]:
            continue
        exact = bool(tag) and f"-{tag.upper()}." in f.upper()
        score = (len(dirs), exact, -abs(_quant_bits(f) - want_bits))
        if best is None or score > best:
            best, choice = score, f
    return choice


def sidecar_drafter(spec: str | HubRef, model: str | os.PathLike[str], *, token: str | None = None,
                    offline: bool = False) -> Path | None:
    """The ``dflash-`` GGUF a target repository ships next to ``model`` (its downloaded file), if any."""
    ref = parse(spec) if isinstance(spec, str) else spec
    listing = _list(ref, token, offline)
    snapshot = next((p for p in Path(model).parents if p.parent.name == "snapshots"), None)
    relative = Path(model).relative_to(snapshot).as_posix() if snapshot else Path(model).name
    name = pick_sidecar(listing.files, relative, ref.tag)
    if name is None:
        return None
    log.info("drafter: %s of %s", name, ref.repo_id)
    return _download(listing, [name], ref, token)[0]


def checkpoint_dir(spec: str | HubRef, *, token: str | None = None, offline: bool = False) -> Path:
    """A DFlash / DFlash2 checkpoint repository (config.json + *.safetensors) as a local snapshot directory."""
    ref = parse(spec) if isinstance(spec, str) else spec
    return _checkpoint(ref, _list(ref, token, offline), token)


def _checkpoint(ref: HubRef, listing: _Listing, token: str | None) -> Path:
    names = [f for f in listing.files if _CHECKPOINT_FILES.fullmatch(f)]
    if "config.json" not in names or not any(f.endswith(".safetensors") for f in names):
        raise errors.HubFileNotFoundError(
            f"{ref.repo_id} is neither a GGUF repository nor a DFlash checkpoint (config.json + *.safetensors); "
            f"files: {_short(list(listing.files))}")
    return _download(listing, names, ref, token)[names.index("config.json")].parent


# --- drafters ----------------------------------------------------------------------------------------------


def _draft_type(value: str) -> str:
    """An output type: the converter's (f16, bf16, f32, q8_0) or a quantizer type (Q4_K_M, ...)."""
    from ..formats.gguf_layout import OutType

    if value.lower() in {o.value for o in OutType}:
        return value.lower()
    quant_types = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K")  # the rest of pydflash.formats.quantize.TYPES
    if value.upper() in quant_types:
        return value.upper()
    raise errors.InvalidArgumentError(
        f"unknown drafter type {value!r}; choose from f16, bf16, f32, q8_0, {', '.join(quant_types)}")


def _target_identity(path: Path) -> str:
    """What the converted drafter depends on in the target: the sha256 an HF cache blob is named by,
    else the resolved path, size and mtime."""
    p = path
    for _ in range(16):
        if p.parent.name == "blobs" and _SHA256_RE.fullmatch(p.name):
            return f"sha256:{p.name}"
        if not p.is_symlink():
            break
        p = p.parent / os.readlink(p)
    real = path.resolve()
    st = real.stat()
    return f"file:{real}:{st.st_size}:{st.st_mtime_ns}"


def _commit_of(snapshot: Path) -> str:
    return snapshot.name if snapshot.parent.name == "snapshots" else "local"


@contextlib.contextmanager
def _held_back(logger: logging.Logger) -> Iterator[list[str]]:
    """The messages ``logger`` emits inside, collected instead of shown."""
    notes: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    handler, propagate = _Collect(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield notes
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def converted_path(repo_id: str, commit: str, target: str | os.PathLike[str], out_type: str) -> Path:
    """Where the drafter converted from ``repo_id`` at ``commit`` for ``target`` as ``out_type`` is cached."""
    key = {"format": _CONVERT_FORMAT, "repo": repo_id, "commit": commit,
           "target": _target_identity(Path(target)), "type": out_type}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "drafters" / repo_id.replace("/", "--") / f"{commit[:12]}-{digest}-{out_type}.gguf"


def convert_checkpoint(checkpoint: Path, repo_id: str, target: str | os.PathLike[str], out_type: str = "f16") -> Path:
    """The checkpoint converted (and quantized) for ``target``, from the cache or made now, atomically."""
    from ..formats import convert

    commit = _commit_of(checkpoint)
    final = converted_path(repo_id, commit, target, out_type)
    if final.is_file():
        log.info("drafter %s (%s, %s) for %s: cached %s", repo_id, commit[:12], out_type, Path(target).name, final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with locked(final.with_name(final.name + ".lock")):
        if final.is_file():  # another process converted it while we waited
            return final
        stem = final.with_name(f".{final.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        converted, quantized = (stem.with_name(stem.name + suffix) for suffix in (".convert.tmp", ".quantize.tmp"))
        direct = out_type == out_type.lower()  # the converter writes f16/bf16/f32/q8_0 itself
        t0 = time.monotonic()
        try:
            with _held_back(logging.getLogger(convert.__name__)) as notes:
                try:
                    convert.convert(checkpoint, converted, target_gguf=target, outtype=out_type if direct else "f16",
                                    name=repo_id.split("/")[1])
                except (ValueError, FileNotFoundError) as exc:
                    text = str(exc).strip().replace(str(target), Path(target).name)
                    if text.startswith("drafter does not fit the target"):
                        problems = "; ".join(line.strip() for line in text.splitlines()[1:])
                        raise errors.MismatchError(f"{repo_id} does not fit {Path(target).name}: {problems}") from None
                    raise errors.ModelFormatError(f"{repo_id}: {' '.join(text.split())}") from None
            for note in notes:  # the converter's warnings, for a drafter that does fit
                log.warning("%s: %s", repo_id, note.replace(str(target), Path(target).name))
            if not direct:
                from ..formats.quantize import quantize

                quantize(converted, quantized, out_type)
                os.replace(quantized, converted)
            os.replace(converted, final)
        finally:
            converted.unlink(missing_ok=True)
            quantized.unlink(missing_ok=True)
    log.info("converted drafter %s (%s) for %s to %s in %.1f s: %s", repo_id, commit[:12], Path(target).name,
             out_type, time.monotonic() - t0, final)
    return final


def drafter_file(spec: str | HubRef, target: str | os.PathLike[str], *, draft_type: str | None = None,
                 token: str | None = None, offline: bool = False) -> Path:
    """A drafter for ``target`` from the Hub: a GGUF repository's file as is, or a checkpoint converted.

    ``draft_type`` (else the reference's ``:QUANT``, else f16) is the type of a converted drafter.
    """
    ref = parse(spec) if isinstance(spec, str) else spec
    listing = _list(ref, token, offline)
    has_gguf = any(f.lower().endswith(".gguf") for f in listing.files)
    if ref.filename or has_gguf:
        if draft_type:
            warnings.warn(f"{ref.repo_id} is a GGUF repository: --draft-type {draft_type} is ignored", stacklevel=2)
        if ref.filename:
            return model_file(ref, token=token, offline=offline)
        return _download(listing, pick_gguf(listing.files, ref.tag, repo=ref.repo_id, drafter=True), ref, token)[0]
    out_type = _draft_type(draft_type or ref.tag or "f16")
    if draft_type and ref.tag and _draft_type(ref.tag) != out_type:
        raise errors.InvalidArgumentError(f"{ref} asks for {ref.tag} but --draft-type is {draft_type}")
    return convert_checkpoint(_checkpoint(ref, listing, token), ref.repo_id, target, out_type)
