"""pydflash: DFlash2 block speculative decoding next to GGUF target models.

The heavy lifting happens in a C++/ggml core (``native/``) reached through one C header; this
package holds the bindings, the high-level API and the tools.

``import pydflash`` loads nothing native: the errors and ``__version__`` are plain Python, and
``Engine``, ``Target``, ``Drafter`` and the other native-backed names (and every submodule) are
imported on first attribute access. So the converter (``pydflash.formats.convert``, also run as
``convert_hf_to_gguf_dflash.py`` from a checkout) needs only numpy and gguf. Using a native name
without a built extension raises :class:`NativeExtensionError`, which says how to build it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BackendError,
    CancelledError,
    ClosedError,
    ContextFullError,
    HubAccessError,
    HubError,
    HubFileNotFoundError,
    HubNotInstalledError,
    HubOfflineError,
    HubRepoNotFoundError,
    InternalError,
    InvalidArgumentError,
    MismatchError,
    ModelFormatError,
    ModelNotFoundError,
    PydflashError,
    UnsupportedError,
    BusyError,
)

__version__ = "0.1.0"


class NativeExtensionError(PydflashError, ImportError):
    """The native extension ``pydflash._native`` is missing or does not load.

    Raised on first use of anything native (``pydflash.Target``, ``pydflash.Engine``, ...) in a
    source checkout that was never built, or next to a broken build. The converter and the
    reference config reader never need it.
    """


# native-backed public names -> the submodule that defines them (imported on first access)
_LAZY = {
    "Drafter": "runtime.drafter",
    "DrafterInfo": "runtime.drafter",
    "Engine": "runtime.engine",
    "Result": "runtime.generation",
    "SamplingOptions": "runtime.generation",
    "Scheduler": "runtime.scheduler",
    "Stats": "runtime.generation",
    "Target": "runtime.target",
    "TargetInfo": "runtime.target",
}

if TYPE_CHECKING:  # static checkers and IDEs see the names as before
    from .runtime.drafter import Drafter, DrafterInfo
    from .runtime.engine import Engine
    from .runtime.generation import Result, SamplingOptions, Stats
    from .runtime.scheduler import Scheduler
    from .runtime.target import Target, TargetInfo


def __getattr__(name: str) -> Any:
    """PEP 562: the native-backed names, then submodules (``pydflash.runtime.engine``, ...), on first use."""
    from importlib import import_module

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(import_module(f"{__name__}.{module}"), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:  # before, `import pydflash` imported engine, target, ...; keep `pydflash.<submodule>` working
        return import_module(f"{__name__}.{name}")  # the import binds it as an attribute
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Engine",
    "Drafter",
    "DrafterInfo",
    "Target",
    "TargetInfo",
    "Result",
    "Stats",
    "SamplingOptions",
    "Scheduler",
    "PydflashError",
    "InvalidArgumentError",
    "ModelNotFoundError",
    "ModelFormatError",
    "ContextFullError",
    "MismatchError",
    "BackendError",
    "CancelledError",
    "UnsupportedError",
    "BusyError",
    "InternalError",
    "ClosedError",
    "NativeExtensionError",
    "HubError",
    "HubNotInstalledError",
    "HubRepoNotFoundError",
    "HubFileNotFoundError",
    "HubAccessError",
    "HubOfflineError",
]
