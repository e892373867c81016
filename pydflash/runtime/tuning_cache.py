"""Where auto mode's learned costs and acceptance are remembered across processes.

One small JSON file per (target file, drafter file, threads, context, devices, machine) under
``<cache>/autotune/``; ``PYDFLASH_AUTOTUNE_CACHE=0`` turns reading and writing off (a cold start
every time). A damaged or foreign file is ignored, never fatal.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from ..fetch import registry as models

_VERSION = 3  # the scheduler's dflash_tuning layout (3: the trim's calibration and survival)


def enabled() -> bool:
    return os.environ.get("PYDFLASH_AUTOTUNE_CACHE", "1") != "0"


def _file_key(path: str | os.PathLike | None) -> str:
    if path is None:
        return "-"
    st = os.stat(path)
    return f"{Path(path).resolve()}:{st.st_size}:{int(st.st_mtime)}"


def key(target, drafter, *, n_threads: int) -> str:  # type: ignore[no-untyped-def]
    """The cache key of a (target, drafter) pair as loaded on this machine."""
    src = "|".join([str(_VERSION), _file_key(target.path), _file_key(drafter.path if drafter else None),
                    str(n_threads), str(target.info.n_ctx), str(target.info.n_seq_max),
                    f"ngl={target.n_gpu_layers}", f"draft-device={drafter.info.device if drafter else '-'}",
                    platform.machine(), platform.node(), str(os.cpu_count())])
    return hashlib.sha256(src.encode()).hexdigest()[:24]


def _path(k: str) -> Path:
    return models.cache_dir() / "autotune" / f"tuning-{k}.json"


def load(k: str) -> dict | None:
    if not enabled():
        return None
    try:
        data = json.loads(_path(k).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save(k: str, state: dict) -> None:
    if not enabled():
        return
    path = _path(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
