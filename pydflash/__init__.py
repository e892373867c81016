"""pydflash: DFlash2 block speculative decoding next to GGUF target models.

The heavy lifting happens in a C++/ggml core (``native/``) reached through one C header; this
package holds the bindings, the high-level API and the tools.
"""

from .errors import (
    BackendError,
    CancelledError,
    ClosedError,
    ContextFullError,
    InternalError,
    InvalidArgumentError,
    MismatchError,
    ModelFormatError,
    ModelNotFoundError,
    PydflashError,
    UnsupportedError,
)
from .drafter import Drafter, DrafterInfo
from .engine import Engine
from .generation import Result, SamplingOptions, Stats
from .target import Target, TargetInfo

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "Drafter",
    "DrafterInfo",
    "Target",
    "TargetInfo",
    "Result",
    "Stats",
    "SamplingOptions",
    "PydflashError",
    "InvalidArgumentError",
    "ModelNotFoundError",
    "ModelFormatError",
    "ContextFullError",
    "MismatchError",
    "BackendError",
    "CancelledError",
    "UnsupportedError",
    "InternalError",
    "ClosedError",
]
