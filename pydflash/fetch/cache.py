"""pydflash's cache folder and the file lock processes take turns with when they fill it.

The root is ``$PYDFLASH_CACHE`` or ``~/.cache/pydflash``: test models in ``models/``, drafters
converted from Hub checkpoints in ``drafters/``, prompt sets in ``datasets/``, auto mode's learned
costs in ``autotune/``.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["cache_dir", "locked"]


def cache_dir() -> Path:
    """Cache root: ``$PYDFLASH_CACHE`` if set, else ``~/.cache/pydflash``. Models live in ``<root>/models``."""
    env = os.environ.get("PYDFLASH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pydflash"


@contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Exclusive flock so concurrent processes filling the same cache entry take turns."""
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
