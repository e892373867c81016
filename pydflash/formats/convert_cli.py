"""``pydflash convert`` (and ``convert_hf_to_gguf_dflash.py``): the converter's command line.

Beside :func:`pydflash.formats.convert.convert` it accepts a Hub repository (``ORG/NAME``,
``hf:ORG/NAME``) for the checkpoint and a ``pydflash models`` name or ``hf:`` reference for the
target; those are fetched (:mod:`pydflash.fetch`) only when given, so converting local files needs
numpy and gguf alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from .convert import convert
from .gguf_layout import OutType

__all__ = ["build_parser", "main"]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "pydflash convert",
        description="Convert a Hugging Face DFlash / DFlash2 drafter to a llama.cpp 'dflash' GGUF.",
    )
    p.add_argument("model_dir", type=Path,
                   help="HF checkpoint directory (config.json + *.safetensors), or a Hub repository ORG/NAME[@REV] "
                        "(fetched into the Hugging Face cache; needs pip install 'pydflash[hub]')")
    p.add_argument("-o", "--outfile", type=Path, default=None,
                   help="output GGUF (default: <model_dir name>-<outtype>.gguf in the current directory)")
    p.add_argument("--outtype", choices=[o.value for o in OutType], default="f16",
                   help="type of the weight matrices (norms stay F32, fc F32/BF16; default f16)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--target-gguf", type=Path,
                     help="target model GGUF: sizes to validate, tokenizer to copy (also a `pydflash models` name or "
                          "hf:ORG/NAME[:QUANT])")
    src.add_argument("--target-model-dir", type=Path,
                     help="target HF directory (config.json + byte-level BPE tokenizer.json; best effort)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="leave the target's tokenizer out (pydflash pairs drafter and target on tensor shapes; "
                        "tools loading the drafter as a llama.cpp model need it)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log details")
    return p


def _checkpoint_source(model_dir: Path) -> tuple[Path, str | None]:
    """A local checkpoint directory as is, or a Hub repository (ORG/NAME, hf:ORG/NAME) fetched into
    the HF cache: (directory, the repository's name for the GGUF, or None)."""
    text = str(model_dir)
    if model_dir.exists() or not (text.startswith("hf:") or text.count("/") == 1):
        return model_dir, None
    from ..fetch import hub

    ref = hub.parse(text)
    return hub.checkpoint_dir(ref), ref.repo_id.split("/")[1]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """CLI entry point; returns the exit status (errors are printed, not raised)."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s: %(message)s")
    from .. import errors

    try:
        model_dir, name = _checkpoint_source(args.model_dir)
        target_gguf = args.target_gguf
        if target_gguf is not None and not target_gguf.is_file():  # a model name or hf:ORG/NAME[:QUANT]
            from ..fetch import registry as models

            target_gguf = models.resolve(str(target_gguf))
        outfile = args.outfile or Path(f"{name or model_dir.resolve().name}-{args.outtype}.gguf")
        path = convert(model_dir, outfile, target_gguf=target_gguf,
                       target_model_dir=args.target_model_dir, outtype=args.outtype,
                       progress=False if args.quiet else None, name=name, tokenizer=not args.no_tokenizer)
    except (ValueError, FileNotFoundError, errors.PydflashError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
