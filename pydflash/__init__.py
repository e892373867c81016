"""pydflash: DFlash2 block speculative decoding next to GGUF target models."""

__version__ = "0.1.0"
