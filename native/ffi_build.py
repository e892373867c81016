"""Generate the cffi extension's C source from native/include/dflash.h (build-time only).

API (out-of-line) mode: the C compiler checks every declaration against the real header, so a
drift between dflash.h and the bindings is a build error, not a crash (ABI mode would silently
mis-call). dflash.h is written to be cffi-parsable: the cdef is the header minus preprocessor
lines and the extern "C" guard.
"""

import re
import sys
from pathlib import Path

import cffi


def cdef_from_header(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        line = line.split("//", 1)[0].rstrip()
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped in ('extern "C" {', "}") and not lines_open_struct(lines):
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def lines_open_struct(lines: list[str]) -> bool:
    """True while inside a struct/enum body (a lone '}' there belongs to the declaration)."""
    depth = 0
    for line in lines:
        depth += line.count("{") - line.count("}")
    return depth > 0


def main(header: str, out: str) -> None:
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(Path(header).read_text()))
    # The streaming callback is implemented in Python (pydflash/_bindings.py).
    ffi.cdef('extern "Python" bool _pydflash_on_token(void *, int32_t, const char *, size_t);')
    ffi.cdef('extern "Python" void _pydflash_on_progress(void *, int32_t, int32_t);')
    ffi.set_source("pydflash._native", '#include "dflash.h"')
    ffi.emit_c_code(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
