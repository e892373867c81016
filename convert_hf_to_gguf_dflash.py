#!/usr/bin/env python3
"""Convert a Hugging Face DFlash / DFlash2 drafter to a llama.cpp ``dflash`` GGUF.

Thin wrapper around :func:`pydflash.formats.convert_cli.main` (same flags as ``pydflash convert``)::

    python convert_hf_to_gguf_dflash.py <draft_dir> --target-gguf target.gguf --outtype f16 -o draft.gguf

Like upstream's ``convert_hf_to_gguf.py`` it runs from a plain checkout with only ``numpy`` and
``gguf`` installed: it uses the ``pydflash/`` next to it (also under ``python -P`` / ``-I``), and
the converter imports nothing native, so nothing has to be compiled.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isfile(os.path.join(_HERE, "pydflash", "__init__.py")) and _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # the checkout's package, even where the script dir is not on sys.path

try:
    from pydflash.formats.convert_cli import main
except ModuleNotFoundError as exc:  # numpy or gguf missing: say what to install
    if exc.name is None or exc.name.split(".")[0] not in {"numpy", "gguf"}:
        raise
    sys.exit(f"error: the converter needs numpy and gguf ({exc}): pip install numpy gguf")

if __name__ == "__main__":
    sys.exit(main(prog="convert_hf_to_gguf_dflash.py"))
