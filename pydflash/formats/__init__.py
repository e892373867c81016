"""The file-format layer: drafter GGUFs written, quantized, reduced and inspected.

``gguf_layout`` (keys, tensor names, shapes), ``convert`` (Hugging Face checkpoint -> GGUF, numpy
and gguf only), ``quantize`` and ``inspect_gguf`` (through the native core), ``draft_vocab``
(reduced-vocabulary drafters).
"""
