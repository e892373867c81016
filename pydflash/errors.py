"""Exceptions raised by pydflash.

Each native status code maps to one class. Classes also derive from the matching built-in
exception (PyNaCl style) so callers can catch either ``pydflash.ModelFormatError`` or plain
``ValueError``.
"""


class PydflashError(Exception):
    """Base class of every error raised by pydflash."""


class InvalidArgumentError(PydflashError, ValueError):
    """A parameter is out of range or inconsistent."""


class ModelNotFoundError(PydflashError, FileNotFoundError):
    """A model file is missing or unreadable."""


class ModelFormatError(PydflashError, ValueError):
    """A file is not a valid (or complete) GGUF model of the expected kind."""


class ContextFullError(PydflashError, ValueError):
    """The tokens do not fit into the context window."""


class MismatchError(PydflashError, ValueError):
    """A drafter does not belong to the target it was paired with."""


class BackendError(PydflashError, RuntimeError):
    """The compute backend failed (decode error, out of memory)."""


class CancelledError(PydflashError):
    """Generation was stopped by a callback."""


class UnsupportedError(PydflashError, NotImplementedError):
    """A valid request that this build or model cannot serve."""


class BusyError(PydflashError, RuntimeError):
    """The resource is in use (a slot running a request)."""


class InternalError(PydflashError, RuntimeError):
    """A bug in pydflash: please report it."""


class ClosedError(PydflashError, ValueError):
    """The object was already closed."""


class HubError(PydflashError):
    """A model could not be fetched from the Hugging Face Hub (``pydflash.fetch.hub``)."""


class HubNotInstalledError(HubError, ImportError):
    """``huggingface_hub`` is not installed: ``pip install 'pydflash[hub]'``."""


class HubRepoNotFoundError(HubError, FileNotFoundError):
    """The repository (or the revision asked for) does not exist, or is private and no token was given."""


class HubFileNotFoundError(HubError, FileNotFoundError):
    """The repository holds no file matching the quantization / file name asked for."""


class HubAccessError(HubError, PermissionError):
    """The repository is gated (or private) and the token given has no access to it."""


class HubOfflineError(HubError, ConnectionError):
    """Offline (``HF_HUB_OFFLINE=1`` / ``--offline``, or the Hub unreachable) and no cached copy."""
