"""The server's command line: llama-server's flags, parsed into a ``ServerConfig``."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ..runtime import devices
from ..flags import add_hub_arguments, apply_hub_arguments, n_max_arg

__all__ = ["ServerConfig", "build_parser", "config_from_args", "n_ctx_train"]


@dataclass(frozen=True)
class ServerConfig:
    model: str
    drafter: str | None
    n_ctx_total: int        # -c: split evenly over the slots (0: the model's training context)
    n_slots: int            # -np
    n_batch: int            # -b: most target rows per step (blocks + prompt chunks)
    n_threads: int | None
    n_gpu_layers: int
    device_draft: str
    rpc: str | None
    n_max: int | str        # an int, or "auto"
    n_min: int
    p_min: float
    cache_prompt: bool      # requests may reuse a slot's KV of their common prefix
    host: str
    port: int
    api_keys: tuple[str, ...]
    metrics: bool
    slots: bool
    aliases: tuple[str, ...]
    warmup: bool
    verbose: bool
    hosts: tuple[str, ...] = ("127.0.0.1",)  # --host, comma-separated: one listener each
    seed: int = -1              # --seed: a request's default seed (-1: drawn per request)
    temperature: float = 0.8    # --temp: a request's default temperature
    n_predict: int = -1         # --n-predict: a request's default n_predict / max_tokens
    tags: tuple[str, ...] = ()  # --tags: shown in /v1/models
    lookup: int | None = None   # --draft-lookup: greedy requests also draft from their own history (0: off;
                                # None: 2 with a drafter, 0 without)
    cors_origins: str = "*"     # "*" (with credentials: the request's Origin is echoed), "localhost", or a list
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    webui: bool = True          # a placeholder page at / (no web UI is shipped)
    # chat templates (llama.cpp's Jinja engine, as llama-server's flags)
    jinja: bool = True
    chat_template: str | None = None        # a built-in name or Jinja source
    chat_template_file: str | None = None
    reasoning: str = "auto"
    reasoning_format: str | None = None
    chat_template_kwargs: dict | None = None
    embeddings: bool = False    # --embedding(s): /embedding and /v1/embeddings
    pooling: str = "mean"       # --pooling (rank is not supported: no reranking models)
    slot_save_path: str | None = None
    spm_infill: bool = False
    n_batch_fim: int = 2048     # -b as /infill's prompt budget (llama-server's default batch when not given)
    ui_mcp_proxy: bool = False  # --ui-mcp-proxy: GET/POST /cors-proxy forwards to other servers
    sleep_idle_seconds: float = -1  # --sleep-idle-seconds: unload the models after that long idle (-1: never)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pydflash serve",
        description="OpenAI / llama-server compatible HTTP server on the pydflash engine "
                    "(continuous batching: a request joins the running batch at the next step).",
    )
    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="target GGUF path, a `pydflash models` name or hf:ORG/NAME[:QUANT] (or -hf)")
    p.add_argument("-md", "--spec-draft-model", "--model-draft", dest="model_draft", default=None,
                   help="DFlash/DFlash2 drafter GGUF converted for this target")
    p.add_argument("--spec-type", default=None,
                   help="draft-dflash (default when -md is given) or none (ignore -md, plain decoding)")
    p.add_argument("--spec-draft-n-max", type=n_max_arg, default="auto",
                   help="drafts verified per step, or 'auto' (default): chosen every step from this machine's "
                        "measured costs, the acceptance seen so far and the load, 0 where speculation would lose")
    p.add_argument("--spec-draft-n-min", type=int, default=0, help="shorter drafts are not verified (default 0)")
    p.add_argument("--spec-draft-p-min", "--draft-p-min", type=float, default=0.0,
                   help="greedy: cut drafts at the first pick the drafter gives p < P (default 0 = off)")
    p.add_argument("--draft-lookup", type=int, default=None, choices=range(5), metavar="N",
                   help="greedy requests also draft the tokens that followed the latest earlier occurrence of "
                        "their last N..4 tokens, where the loop prices it to pay (0 = off; default 2 with a "
                        "drafter, 0 without: given without -md, these are the only drafts)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="total context, split evenly over the slots (default 4096; 0: the model's training "
                        "context)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: sequences generated together (default 1)")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="most target rows per step: every slot's draft block plus prompt chunks of new requests "
                        "(default 512)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    devices.add_arguments(p)
    p.add_argument("--cache-prompt", dest="cache_prompt", action="store_true", default=True,
                   help="reuse a slot's KV of a request's common prompt prefix (default; per request: "
                        "'cache_prompt')")
    p.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false",
                   help="always prefill whole prompts")
    p.add_argument("--host", default=os.environ.get("LLAMA_ARG_HOST", "127.0.0.1"),
                   help="address(es) to listen on, comma-separated (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="API key(s), comma-separated; clients send `Authorization: Bearer KEY`")
    p.add_argument("-s", "--seed", type=int, default=-1, help="default seed of a request (default -1: random)")
    p.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8,
                   help="default temperature of a request (default 0.8)")
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1,
                   help="default tokens to predict of a request (default -1: until the end of the context)")
    p.add_argument("--tags", default=None, help="model tags, comma-separated (shown in /v1/models)")
    p.add_argument("--cors-origins", default=os.environ.get("LLAMA_ARG_CORS_ORIGINS", "*"),
                   help="allowed CORS origins, comma-separated, or 'localhost' (default *)")
    p.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", help="allowed CORS methods")
    p.add_argument("--cors-headers", default="*", help="allowed CORS headers")
    p.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True,
                   help="allow CORS credentials (default; with origins *, the Origin header is echoed)")
    p.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false")
    p.add_argument("--metrics", action="store_true", help="enable the Prometheus /metrics endpoint")
    p.add_argument("--slots", dest="slots", action="store_true", default=True, help="expose /slots (default)")
    p.add_argument("--no-slots", dest="slots", action="store_false", help="disable /slots")
    p.add_argument("-a", "--alias", default=None, help="model name(s) for the API, comma-separated")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=True,
                   help="skip the warm-up generation on every slot at start")
    p.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="accepted for compatibility with earlier pydflash versions; no effect (a request joins "
                        "the running batch at the next step)")
    p.add_argument("--no-webui", "--no-ui", dest="no_webui", action="store_true",
                   help="no placeholder page at / (pydflash ships no web UI)")
    p.add_argument("--sleep-idle-seconds", type=float, default=-1,
                   help="free the target and the drafter after this many idle seconds, load them again on the "
                        "next request that needs them (default -1: never)")
    p.add_argument("--ui-mcp-proxy", "--webui-mcp-proxy", dest="ui_mcp_proxy", action="store_true",
                   default=os.environ.get("LLAMA_ARG_UI_MCP_PROXY", "").lower() in ("1", "true", "on", "enabled"),
                   help="experimental, as llama-server's: /cors-proxy?url=... forwards requests to other servers "
                        "(for MCP in a browser UI); do not enable in untrusted environments (default off)")
    p.add_argument("--no-ui-mcp-proxy", "--no-webui-mcp-proxy", dest="ui_mcp_proxy", action="store_false")
    p.add_argument("--jinja", dest="jinja", action="store_true", default=True,
                   help="chat templates with llama.cpp's Jinja engine (default)")
    p.add_argument("--no-jinja", dest="jinja", action="store_false",
                   help="libllama's built-in template matcher instead of the Jinja engine")
    p.add_argument("--chat-template", default=None, help="a built-in template name or Jinja source")
    p.add_argument("--chat-template-file", default=None, help="a Jinja template file")
    p.add_argument("--chat-template-kwargs", default=None, help="extra template variables: a JSON object")
    p.add_argument("-rea", "--reasoning", default="auto", choices=["on", "off", "auto"],
                   help="reasoning/thinking in the chat (default auto: as the template supports)")
    p.add_argument("--reasoning-format", default=None, help="none, deepseek (default), deepseek-legacy, auto")
    p.add_argument("--embedding", "--embeddings", dest="embeddings", action="store_true",
                   help="serve /embedding and /v1/embeddings")
    p.add_argument("--pooling", default=None, choices=["none", "mean", "cls", "last", "rank"],
                   help="pooling of embeddings (default: the model's; mean for generative models here)")
    p.add_argument("--slot-save-path", default=None, help="folder for slot files (POST /slots/ID?action=save)")
    p.add_argument("--spm-infill", action="store_true", help="suffix/prefix/middle order for /infill")
    p.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's log and an access log")
    add_hub_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """A validated config; raises SystemExit with the message on a bad combination.

    -hf / -hfd are resolved here (downloads, a drafter converted on first use), so the config holds
    local paths and an engine reloaded after ``--sleep-idle-seconds`` touches no network;
    ``pydflash.errors.HubError`` on failure."""
    apply_hub_arguments(args)
    spec_type = args.spec_type
    if spec_type is None:
        spec_type = "draft-dflash" if args.model_draft else "none"
    types = [t.strip() for t in spec_type.split(",") if t.strip()]
    unsupported = [t for t in types if t not in ("none", "draft-dflash")]
    if unsupported:
        raise SystemExit(f"pydflash serve: --spec-type {','.join(unsupported)} is not supported "
                         "(use draft-dflash or none)")
    use_draft = "draft-dflash" in types
    if use_draft and not args.model_draft:
        raise SystemExit("pydflash serve: --spec-type draft-dflash needs a drafter: -md DRAFTER.gguf")
    if args.parallel < 1:
        raise SystemExit("pydflash serve: -np must be >= 1")
    n_batch_fim = args.batch_size or 2048  # /infill's prompt budget: llama-server's logical batch (default 2048)
    if args.batch_size is None:
        args.batch_size = 512
    if args.batch_size < args.parallel:
        raise SystemExit(f"pydflash serve: -b {args.batch_size} must hold one row of each of the -np "
                         f"{args.parallel} slots")
    if args.ctx_size < 0:
        raise SystemExit("pydflash serve: -c must be >= 0")
    if args.ctx_size and args.ctx_size // args.parallel < 16:
        raise SystemExit(f"pydflash serve: -c {args.ctx_size} leaves fewer than 16 tokens per slot with "
                         f"-np {args.parallel}")
    if args.sleep_idle_seconds != -1 and args.sleep_idle_seconds <= 0:
        raise SystemExit("pydflash serve: --sleep-idle-seconds must be > 0 (or -1: never)")
    if args.spec_draft_n_min < 0:
        raise SystemExit("pydflash serve: --spec-draft-n-min must be >= 0")
    if not 0.0 <= args.spec_draft_p_min <= 1.0:
        raise SystemExit("pydflash serve: --spec-draft-p-min must be in [0, 1]")
    hosts = tuple(h.strip() for h in args.host.split(",") if h.strip())
    if not hosts:
        raise SystemExit("pydflash serve: --host needs at least one address")
    if args.port == 0 and len(hosts) > 1:
        raise SystemExit("pydflash serve: --port 0 cannot be used with several --host addresses")
    keys = tuple(k.strip() for k in (args.api_key or "").split(",") if k.strip())
    aliases = tuple(a.strip() for a in (args.alias or "").split(",") if a.strip())
    return ServerConfig(
        model=args.model, drafter=args.model_draft if use_draft else None, n_ctx_total=args.ctx_size,
        n_slots=args.parallel, n_batch=args.batch_size, n_batch_fim=n_batch_fim, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers,
        device_draft=args.device_draft, rpc=args.rpc,
        n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min, p_min=args.spec_draft_p_min, lookup=args.draft_lookup,
        cache_prompt=args.cache_prompt, host=hosts[0], hosts=hosts, port=args.port, api_keys=keys, metrics=args.metrics,
        slots=args.slots, aliases=aliases, warmup=args.warmup, verbose=args.verbose,
        seed=args.seed, temperature=args.temp, n_predict=args.n_predict,
        tags=tuple(t.strip() for t in (args.tags or "").split(",") if t.strip()),
        cors_origins=args.cors_origins, cors_methods=args.cors_methods, cors_headers=args.cors_headers,
        cors_credentials=args.cors_credentials, webui=not args.no_webui,
        jinja=args.jinja, chat_template=args.chat_template, chat_template_file=args.chat_template_file,
        reasoning=args.reasoning, reasoning_format=args.reasoning_format,
        chat_template_kwargs=_template_kwargs(args.chat_template_kwargs),
        embeddings=args.embeddings, pooling=args.pooling or "mean",
        slot_save_path=args.slot_save_path, spm_infill=args.spm_infill, ui_mcp_proxy=args.ui_mcp_proxy,
        sleep_idle_seconds=args.sleep_idle_seconds,
    )


def _template_kwargs(text: str | None) -> dict | None:
    import json

    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"pydflash serve: --chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit("pydflash serve: --chat-template-kwargs must be a JSON object")
    return value


def n_ctx_train(model: str) -> int:
    """The training context of a target GGUF (what ``-c 0`` means), 4096 when it does not say."""
    from ..fetch import registry as models
    from ..formats.convert import read_gguf_header

    try:
        kv = read_gguf_header(models.resolve(model)).kv
        arch = kv["general.architecture"].value
        arch = arch.decode() if isinstance(arch, bytes) else str(arch)
        return int(kv[f"{arch}.context_length"].value)
    except (KeyError, OSError, ValueError):
        return 4096
