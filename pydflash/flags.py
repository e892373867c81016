"""Command-line flags shared by ``pydflash`` (generate, bench, profile) and ``pydflash-server``.

The draft length (``--spec-draft-n-max``) and llama.cpp's Hugging Face flags (``-hf``, ``-hfd``,
...): adding them to a parser, and turning what was given into local files. The commands' own
flags live with each command (``cli.py``, ``server/config.py``, ``tools/bench.py``, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

from . import errors
from .fetch import hub

__all__ = ["add_hub_arguments", "apply_hub_arguments", "n_max_arg"]


def n_max_arg(value: str) -> int | str:
    """--spec-draft-n-max: an int >= 0 or 'auto'."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value!r}")
    return n


def add_hub_arguments(p: argparse.ArgumentParser, *, draft: bool = True) -> None:
    """llama.cpp's Hugging Face flags: -hf/-hfr, -hff, -hfd/-hfrd, -hffd, -hft, plus --draft-type, --offline."""
    g = p.add_argument_group("Hugging Face Hub (pip install 'pydflash[hub]')")
    g.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="<user>/<model>[:quant]",
                   default=os.environ.get("LLAMA_ARG_HF_REPO"),
                   help="target from a Hub repository; quant is case-insensitive, default Q4_K_M, else Q8_0, else "
                        "the first GGUF (overrides -m)")
    g.add_argument("-hff", "--hf-file", dest="hf_file", metavar="FILE", default=os.environ.get("LLAMA_ARG_HF_FILE"),
                   help="the file of the -hf repository to use (overrides the quant)")
    if draft:
        g.add_argument("-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", dest="hf_repo_draft",
                       metavar="<user>/<model>[:quant]", default=os.environ.get("LLAMA_ARG_SPEC_DRAFT_HF_REPO"),
                       help="drafter from a Hub repository: a GGUF repository (a dflash- file if there is one), or a "
                            "DFlash/DFlash2 checkpoint (config.json + safetensors) converted for the target on first "
                            "use and cached; for a checkpoint, quant is the output type (see --draft-type)")
        g.add_argument("-hffd", "--hf-file-draft", dest="hf_file_draft", metavar="FILE", default=None,
                       help="the file of the -hfd repository to use (as -md FILE next to -hfd)")
        g.add_argument("--draft-type", dest="draft_type", default=None,
                       help="type of a drafter converted from a checkpoint repository: f16 (default), bf16, f32, "
                            "q8_0, or Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K (converted, then quantized)")
    g.add_argument("-hft", "--hf-token", dest="hf_token", metavar="TOKEN", default=None,
                   help="Hugging Face access token (default: HF_TOKEN, else the stored `hf auth login` token)")
    g.add_argument("--offline", action="store_true",
                   default=os.environ.get("LLAMA_OFFLINE", "").lower() in ("1", "true", "on"),
                   help="use only the Hugging Face cache, never the network (as HF_HUB_OFFLINE=1)")


@contextlib.contextmanager
def _announced() -> Iterator[None]:
    """What the Hub module logs (downloads from the cache, conversions) and warns, as ``[pydflash]`` lines on stderr."""
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[pydflash] %(message)s"))
    log = hub.log
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            yield
        for note in notes:
            print(f"[pydflash] note: {note.message}", file=sys.stderr)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def apply_hub_arguments(args: argparse.Namespace, *, announce: bool = True) -> None:
    """Replace ``args.model`` / ``args.model_draft`` by local paths where -hf / -hfd were given
    (downloading, converting as needed; ``announce``: say so on stderr)."""
    with _announced() if announce else contextlib.nullcontext():
        _apply(args)


def _apply(args: argparse.Namespace) -> None:
    hf_repo = getattr(args, "hf_repo", None)
    hf_repo_draft = getattr(args, "hf_repo_draft", None)
    token, offline = getattr(args, "hf_token", None), bool(getattr(args, "offline", False))
    if getattr(args, "hf_file", None) and not hf_repo:
        raise errors.InvalidArgumentError("-hff FILE needs -hf REPO")
    if getattr(args, "hf_file_draft", None) and not hf_repo_draft:
        raise errors.InvalidArgumentError("-hffd FILE needs -hfd REPO")
    if hf_repo:
        args.model = str(hub.model_file(hub.parse(hf_repo, filename=args.hf_file), token=token, offline=offline))
    if hf_repo_draft and not getattr(args, "no_draft", False):
        # as llama.cpp: -md FILE next to -hfd names the file in the draft repository
        name = args.hf_file_draft or getattr(args, "model_draft", None)
        if args.model is None:
            raise errors.InvalidArgumentError("-hfd needs a target: -m or -hf")
        from .fetch import registry

        target = registry.resolve(args.model)
        args.model_draft = str(hub.drafter_file(hub.parse(hf_repo_draft, filename=name), target,
                                            draft_type=getattr(args, "draft_type", None), token=token,
                                            offline=offline))
    elif getattr(args, "draft_type", None):
        raise errors.InvalidArgumentError("--draft-type applies to a drafter converted from -hfd REPO")
    elif hf_repo and not getattr(args, "model_draft", None) and _wants_draft(args):
        # as llama.cpp with --spec-type draft-dflash: a dflash- GGUF shipped in the target's repository
        sidecar = hub.sidecar_drafter(hub.parse(hf_repo, filename=args.hf_file), args.model, token=token,
                                      offline=offline)
        if sidecar is not None:
            args.model_draft = str(sidecar)


def _wants_draft(args: argparse.Namespace) -> bool:
    """serve: --spec-type draft-dflash asked for; generate: unless --no-draft (bench, profile: never)."""
    if hasattr(args, "spec_type"):
        return "draft-dflash" in (args.spec_type or "")
    return hasattr(args, "no_draft") and not args.no_draft
