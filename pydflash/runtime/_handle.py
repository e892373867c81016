"""The one pattern every Python object owning a native handle follows."""

from __future__ import annotations

import threading
from typing import Any, Callable

from .. import errors
from ._bindings import ffi


class NativeObject:
    """Owns one native pointer: idempotent ``close()``, ``with`` blocks, a per-object lock that
    serialises calls (so sharing between threads is safe), and ``ClosedError`` after close.

    Subclasses set ``_free`` (the native destructor) and assign ``self._handle`` once loaded;
    ``__del__`` tolerates an ``__init__`` that failed half way.
    """

    _free: Callable[[Any], None]
    _handle: Any = ffi.NULL

    def __init__(self) -> None:
        self._handle = ffi.NULL
        # re-entrant: an owner (Engine) holds it across a generation and across closing its parts
        self._lock = threading.RLock()

    def close(self) -> None:
        """Free the native object (idempotent)."""
        handle, self._handle = getattr(self, "_handle", ffi.NULL), ffi.NULL
        if handle != ffi.NULL:
            with self._lock:
                type(self)._free(handle)

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._handle == ffi.NULL

    @property
    def lock(self) -> threading.RLock:
        """The lock every call on this object takes: hold it to run several calls as one (the
        server's step loop holds the target's for a whole step)."""
        return self._lock

    def _h(self):  # type: ignore[no-untyped-def]
        if self._handle == ffi.NULL:
            raise errors.ClosedError(f"this {type(self).__name__} is closed")
        return self._handle
