#!/usr/bin/env python3
"""Convert a Hugging Face DFlash / DFlash2 drafter to a llama.cpp ``dflash`` GGUF.

Thin wrapper around :func:`pydflash.convert.main` (same flags as ``pydflash convert``)::

    python convert_hf_to_gguf_dflash.py <draft_dir> --target-gguf target.gguf --outtype f16 -o draft.gguf
"""

import sys

from pydflash.convert import main

if __name__ == "__main__":
    sys.exit(main(prog="convert_hf_to_gguf_dflash.py"))
