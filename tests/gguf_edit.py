"""Read a GGUF header into editable Python values and write it back: for bad-input tests and the
fuzzer, which need files that are wrong in one precise place (a key, a shape, an offset).

Only the header is modelled (metadata + tensor infos); the tensor data section is kept as raw
bytes. Values keep their GGUF type, so an unchanged header serialises to the same bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

# GGUF value type ids and their struct codes (the format's own numbering)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


@dataclass
class Value:
    """One metadata value: ``type`` is a GGUF type id; arrays carry ``item_type`` and a list."""

    type: int
    value: object
    item_type: int | None = None


@dataclass
class TensorInfo:
    name: str
    ne: list[int]
    type: int  # ggml type id
    offset: int  # relative to the data section


@dataclass
class Header:
    version: int
    kv: dict[str, Value]
    tensors: list[TensorInfo]
    data: bytes = field(repr=False, default=b"")  # everything after the aligned header

    @property
    def alignment(self) -> int:
        a = self.kv.get("general.alignment")
        return int(a.value) if a is not None and a.type == UINT32 and int(a.value) > 0 else 32

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):  # type: ignore[no-untyped-def]
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out[0] if len(out) == 1 else out

    def string(self) -> bytes:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int):  # type: ignore[no-untyped-def]
        if vtype == STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        raise ValueError(f"bad value type {vtype}")


def parse(buf: bytes) -> Header:
    """Parse a whole GGUF file image (raises ValueError / struct.error on malformed input)."""
    r = _Reader(buf)
    if r.take("4s") != b"GGUF":
        raise ValueError("not GGUF")
    version, n_tensors, n_kv = r.take("<IQQ")
    if n_tensors > 1 << 16 or n_kv > 1 << 16:
        raise ValueError("too many entries")
    kv: dict[str, Value] = {}
    for _ in range(n_kv):
        key = r.string().decode("utf-8")
        vtype = r.take("<I")
        if vtype == ARRAY:
            item_type, count = r.take("<IQ")
            if count > len(buf):
                raise ValueError("array longer than the file")
            kv[key] = Value(ARRAY, [r.value(item_type) for _ in range(count)], item_type)
        else:
            kv[key] = Value(vtype, r.value(vtype))
    tensors = []
    for _ in range(n_tensors):
        name = r.string().decode("utf-8")
        n_dims = r.take("<I")
        if n_dims > 8:
            raise ValueError("too many dims")
        ne = [r.take("<Q") for _ in range(n_dims)]
        ttype, offset = r.take("<IQ")
        tensors.append(TensorInfo(name, ne, ttype, offset))
    h = Header(version, kv, tensors)
    start = -(-r.pos // h.alignment) * h.alignment
    h.data = buf[start:]
    return h


def _value_bytes(vtype: int, value: object) -> bytes:
    if vtype == STRING:
        s = value if isinstance(value, bytes) else str(value).encode()
        return struct.pack("<Q", len(s)) + s
    return struct.pack(_SCALAR[vtype], value)


def header_bytes(h: Header) -> bytes:
    """The header alone (magic .. last tensor info), unpadded."""
    out = [b"GGUF", struct.pack("<IQQ", h.version, len(h.tensors), len(h.kv))]
    for key, v in h.kv.items():
        out.append(_value_bytes(STRING, key.encode()) + struct.pack("<I", v.type))
        if v.type == ARRAY:
            items = list(v.value)  # type: ignore[call-overload]
            out.append(struct.pack("<IQ", v.item_type, len(items)))
            out.extend(_value_bytes(v.item_type, x) for x in items)  # type: ignore[arg-type]
        else:
            out.append(_value_bytes(v.type, v.value))
    for t in h.tensors:
        out.append(_value_bytes(STRING, t.name.encode()) + struct.pack("<I", len(t.ne)))
        out.append(struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", t.type, t.offset))
    return b"".join(out)


def serialize(h: Header) -> bytes:
    """Header, alignment padding, then the kept data section."""
    head = header_bytes(h)
    pad = -len(head) % h.alignment
    return head + b"\0" * pad + h.data


def load(path: str | Path) -> Header:
    return parse(Path(path).read_bytes())


def save(h: Header, path: str | Path) -> Path:
    Path(path).write_bytes(serialize(h))
    return Path(path)
