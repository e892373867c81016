"""Rewrite a GGUF file: its metadata and tensors copied byte for byte, some dropped, some added.

The one place the drafter tools (``draft_vocab``, ``drafter_profile``) write a changed copy of a
drafter: the output is written to ``<out>.part`` and renamed, so a reader never sees half a file
and ``out`` may be the source itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter

__all__ = ["rewrite_gguf"]

# written by GGUFWriter itself
_OWN_KEYS = ("general.architecture", "general.alignment")


def rewrite_gguf(src: Any, out: str | os.PathLike, *, drop_keys: Iterable[str] = (),
                 add_kv: Sequence[tuple] = (), drop_tensors: Iterable[str] = (),
                 add_tensors: Sequence[tuple] = ()) -> Path:
    """Copy the GGUF whose header is ``src`` (``convert.read_gguf_header``) to ``out``.

    ``add_kv``: ``(key, value, GGUFValueType[, sub_type])`` after the kept keys;
    ``add_tensors``: ``(name, shape in torch order, numpy dtype, raw GGMLQuantizationType, bytes)``
    after the kept tensors, whose bytes are copied unchanged.
    """
    drop_k, drop_t = set(_OWN_KEYS) | set(drop_keys), set(drop_tensors)
    arch = src.kv["general.architecture"].value
    writer = GGUFWriter(path=None, arch=arch.decode() if isinstance(arch, bytes) else str(arch))
    for key, kv in src.kv.items():
        if key not in drop_k:
            writer.add_key_value(kv.key, kv.value, kv.type, kv.sub_type)
    for key, value, vtype, *sub in add_kv:
        writer.add_key_value(key, value, vtype, *sub)
    kept = [t for name, t in src.tensors.items() if name not in drop_t]
    for t in kept:  # element shapes (torch order) + raw type: the bytes are copied unchanged
        writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes, raw_dtype=t.type)
    for name, shape, dtype, raw_type, data in add_tensors:
        writer.add_tensor_info(name, tuple(shape), np.dtype(dtype), np.asarray(data).nbytes, raw_dtype=raw_type)
    out = Path(out)
    tmp = out.with_name(out.name + ".part")
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        src_map = np.memmap(src.path, dtype=np.uint8, mode="r")
        for t in kept:
            writer.write_tensor_data(np.asarray(src_map[t.offset:t.offset + t.nbytes]))
        del src_map
        for *_, data in add_tensors:
            writer.write_tensor_data(np.ascontiguousarray(data))
        writer.flush()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
