"""``pydflash serve`` / ``pydflash-server``: an OpenAI- and llama-server-compatible HTTP server
running the pydflash engine (a GGUF target plus an optional DFlash2 drafter).

It speaks llama-server's flags (``-m``, ``-md``, ``--spec-type draft-dflash``, ``-c``, ``-np``, ...)
and its API: ``/health``, ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE
streaming or not, with ``usage``), llama.cpp's ``/completion`` (with ``timings``), ``/slots``,
``/props`` and, with ``--metrics``, Prometheus ``/metrics``. HTTP is aiohttp's.

Scheduling is *static batching*: one scheduler task collects waiting requests and hands up to
``-np`` of them to ``Engine.generate_batch`` in one worker thread; all of them are drafted and
verified together in one target batch per step until the last one finishes. Requests that arrive
while a batch runs wait for the next batch (there is no continuous batching: a slot freed early
stays idle until the whole batch ends). A batch holds requests with the same sampling/stopping
options only (``generate_batch`` takes one set of options); requests with other options wait for
a later batch (greedy requests batch whatever their seed and filters; a sampled request with an
explicit seed runs alone, since in a batch sequence i samples with seed + i). When the server was
idle, the scheduler waits ``--batch-window-ms`` (default 20) for companions before starting a
batch. Prompts are tokenized and checked against the context on the worker thread right before
their batch starts (the target is busy while a batch runs), so a too-long prompt is answered 400
once the running batch ends. A client that disconnects cancels its sequence (aiohttp cancels the
handler; a failed stream write does too): its ``on_piece`` callback returns False and the engine
stops that sequence only; a request that is still queued is dropped. On shutdown every sequence
is cancelled and unfinished requests are answered 503.

Per-request ``speculative.n_max`` / ``n_min`` (llama.cpp's dotted keys or a nested
``"speculative": {...}`` object) override the server's values; n_max is capped at the drafter's
block size - 1 and at what -np slots fit into one target batch.

Context: as in llama-server, ``-c`` is the total context and each of the ``-np`` slots gets
``c / np`` tokens (``-c 0``: the model's training context, split the same way).

Definitions for the speculative counters: ``draft_n`` / ``spec_decode_num_draft_tokens_total``
are drafted tokens, ``draft_n_accepted`` / ``..._num_accepted_tokens_total`` the accepted ones,
``draft_n_verif_steps`` / ``spec_decode_num_drafts_total`` the target verification steps of
requests that drafted at all (every step verifies one drafted block per sequence), and
``spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` counts how often the draft at
position i+1 was accepted. ``--spec-draft-p-min`` / ``speculative.p_min`` cut greedy drafts at the
first pick the drafter itself gives a probability below p_min (as llama.cpp's DFlash2 path).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from . import devices, errors
from .cli import n_max_arg

__all__ = ["ServerConfig", "build_parser", "main"]

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop",
                  "none": "stop"}
STOP_TYPES = {"eos": "eos", "stop": "word", "length": "limit", "context": "limit", "cancelled": "none",
              "none": "none"}
SYSTEM_FINGERPRINT = "pydflash"


class APIError(Exception):
    """An error answered as ``{"error": {"code", "message", "type"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status, "invalid_request_error")
        self.extra = extra

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}


def _from_engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, errors.ContextFullError):
        return APIError(400, str(exc), "exceed_context_size_error")
    if isinstance(exc, (errors.InvalidArgumentError, errors.MismatchError)):
        return APIError(400, str(exc))
    if isinstance(exc, errors.UnsupportedError):
        return APIError(501, str(exc))
    return APIError(500, f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    model: str
    drafter: str | None
    n_ctx_total: int
    n_slots: int
    n_threads: int | None
    n_gpu_layers: int
    device_draft: str
    rpc: str | None
    n_max: int | None
    n_min: int
    p_min: float
    host: str
    port: int
    api_keys: tuple[str, ...]
    metrics: bool
    slots: bool
    aliases: tuple[str, ...]
    warmup: bool
    batch_window_ms: float
    verbose: bool


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pydflash serve",
        description="OpenAI / llama-server compatible HTTP server on the pydflash engine "
                    "(static batching of up to -np requests per target batch).",
    )
    p.add_argument("-m", "--model", default="smollm2-135m", help="target GGUF path or a `pydflash models` name")
    p.add_argument("-md", "--spec-draft-model", "--model-draft", dest="model_draft", default=None,
                   help="DFlash/DFlash2 drafter GGUF converted for this target")
    p.add_argument("--spec-type", default=None,
                   help="draft-dflash (default when -md is given) or none (ignore -md, plain decoding)")
    p.add_argument("--spec-draft-n-max", type=n_max_arg, default="auto",
                   help="drafts verified per step, or 'auto' (default): chosen from this machine's measured costs "
                        "and the acceptance seen so far, 0 where speculation would lose")
    p.add_argument("--spec-draft-n-min", type=int, default=0, help="shorter drafts are not verified (default 0)")
    p.add_argument("--spec-draft-p-min", "--draft-p-min", type=float, default=0.0,
                   help="accepted for llama-server compatibility; no effect on DFlash block drafts")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="total context, split evenly over the slots (default 4096; 0: the model's training "
                        "context)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests served together (default 1)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    devices.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="API key(s), comma-separated; clients send `Authorization: Bearer KEY`")
    p.add_argument("--metrics", action="store_true", help="enable the Prometheus /metrics endpoint")
    p.add_argument("--slots", dest="slots", action="store_true", default=True, help="expose /slots (default)")
    p.add_argument("--no-slots", dest="slots", action="store_false", help="disable /slots")
    p.add_argument("-a", "--alias", default=None, help="model name(s) for the API, comma-separated")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=True,
                   help="skip the warm-up batch (which also loads every slot's drafter) at start")
    p.add_argument("--batch-window-ms", type=float, default=20.0,
                   help="when idle, wait this long for more requests before starting a batch (default 20)")
    p.add_argument("--no-webui", action="store_true", help="accepted for llama-server compatibility (no web UI)")
    p.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's log and an access log")
    return p


def _config_from_args(args: argparse.Namespace) -> ServerConfig:
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
    if args.ctx_size < 0:
        raise SystemExit("pydflash serve: -c must be >= 0")
    if args.ctx_size and args.ctx_size // args.parallel < 16:
        raise SystemExit(f"pydflash serve: -c {args.ctx_size} leaves fewer than 16 tokens per slot with "
                         f"-np {args.parallel}")
    if args.batch_window_ms < 0:
        raise SystemExit("pydflash serve: --batch-window-ms must be >= 0")
    keys = tuple(k.strip() for k in (args.api_key or "").split(",") if k.strip())
    aliases = tuple(a.strip() for a in (args.alias or "").split(",") if a.strip())
    return ServerConfig(
        model=args.model, drafter=args.model_draft if use_draft else None, n_ctx_total=args.ctx_size,
        n_slots=args.parallel, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers,
        device_draft=args.device_draft, rpc=args.rpc,
        n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min, p_min=args.spec_draft_p_min,
        host=args.host, port=args.port, api_keys=keys, metrics=args.metrics, slots=args.slots,
        aliases=aliases, warmup=args.warmup, batch_window_ms=args.batch_window_ms, verbose=args.verbose,
    )


# ------------------------------------------------------------------------------------------------
# requests and their parsing
# ------------------------------------------------------------------------------------------------


@dataclass
class GenRequest:
    """One sequence to generate: what the handler submitted and how results come back.

    Events put on ``out`` (on the event loop): ("start", index, n_prompt), ("piece", index, text),
    ("done", index, Result), ("error", index, APIError)."""

    index: int
    prompt: Any                       # str, list[int], or list of chat messages
    kind: str                         # "text", "tokens" or "chat"
    options: dict                     # SamplingOptions keyword arguments (seed None: random)
    n_max: int | None
    n_min: int | None
    p_min: float | None
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    t_submit: float = field(default_factory=time.monotonic)

    def key(self) -> tuple:
        """Requests with equal keys can share one ``generate_batch`` call."""
        o = dict(self.options)
        o["stop"] = tuple(o.get("stop") or ())
        if o.get("temperature", 0.8) <= 0:  # greedy: the filters and the seed do not matter
            o.update(top_k=0, top_p=1.0, min_p=0.0, seed=None)
        return tuple(sorted(o.items())) + (("n_max", self.n_max), ("n_min", self.n_min), ("p_min", self.p_min))

    def solo(self) -> bool:
        """A seeded sampled request runs alone: in a batch sequence i samples with seed + i."""
        return self.options.get("temperature", 0.8) > 0 and self.options.get("seed") is not None

    def emit(self, kind: str, payload: Any) -> None:
        """Thread-safe: deliver an event to the waiting handler."""
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, self.index, payload))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field(body: dict, names: Sequence[str], check: Callable[[Any], bool], what: str, default: Any = None) -> Any:
    for name in names:
        if name in body and body[name] is not None:
            value = body[name]
            if not check(value):
                raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}")
            return value
    return default


def _speculative(body: dict) -> tuple[int | None, int | None, float | None]:
    """``speculative.n_max/n_min/p_min``: a nested object or llama.cpp's dotted keys."""
    nested = body.get("speculative")
    if nested is not None and not isinstance(nested, dict):
        raise APIError(400, "'speculative' must be an object")
    nested = nested or {}
    values: dict[str, Any] = {}
    for name in ("n_max", "n_min", "p_min"):
        v = body.get(f"speculative.{name}", nested.get(name))
        if v is None:
            continue
        if name == "p_min":
            if not _is_num(v) or not 0.0 <= v <= 1.0:
                raise APIError(400, "'speculative.p_min' must be a number in [0, 1]")
        elif not _is_int(v) or v < 0:
            raise APIError(400, f"'speculative.{name}' must be an int >= 0")
        values[name] = v
    n_max, n_min = values.get("n_max"), values.get("n_min")
    if n_max is not None and n_min is not None and n_min > n_max:
        raise APIError(400, "'speculative.n_min' must not exceed 'speculative.n_max'")
    return n_max, n_min, values.get("p_min")


def _sampling(body: dict, max_names: Sequence[str]) -> dict:
    opts: dict[str, Any] = {}
    max_tokens = _field(body, max_names, _is_int, "an int", -1)
    if max_tokens < -1 or max_tokens == 0 and max_names[0] != "n_predict":
        raise APIError(400, f"'{max_names[0]}' must be a positive int (or -1: until the end of the context)")
    opts["max_tokens"] = max_tokens
    temperature = _field(body, ["temperature"], _is_num, "a number", 0.8)
    if temperature < 0:
        raise APIError(400, "'temperature' must be >= 0")
    opts["temperature"] = float(temperature)
    top_k = _field(body, ["top_k"], _is_int, "an int", 40)
    opts["top_k"] = max(top_k, 0)
    top_p = _field(body, ["top_p"], _is_num, "a number", 0.95)
    if not 0.0 <= top_p <= 1.0:
        raise APIError(400, "'top_p' must be in [0, 1]")
    opts["top_p"] = float(top_p) if top_p > 0 else 1.0
    min_p = _field(body, ["min_p"], _is_num, "a number", 0.05)
    if not 0.0 <= min_p <= 1.0:
        raise APIError(400, "'min_p' must be in [0, 1]")
    opts["min_p"] = float(min_p)
    seed = _field(body, ["seed"], _is_int, "an int", -1)
    if not -1 <= seed < 2**63:
        raise APIError(400, "'seed' must be an int in [-1, 2**63)")
    opts["seed"] = None if seed == -1 else seed
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise APIError(400, "'stop' must be a string or a list of strings")
    opts["stop"] = tuple(s for s in stops if s)
    opts["ignore_eos"] = bool(_field(body, ["ignore_eos"], lambda v: isinstance(v, bool), "a boolean", False))
    return opts


def _prompts(value: Any, name: str = "prompt") -> list[tuple[str, Any]]:
    """A completion prompt: a string, a token list, or a list of either (one choice each)."""
    if isinstance(value, str):
        return [("text", value)]
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return [("tokens", list(value))]
    if isinstance(value, list) and value and all(isinstance(p, str) or (isinstance(p, list) and p and all(
            _is_int(t) for t in p)) for p in value):
        return [("text", p) if isinstance(p, str) else ("tokens", list(p)) for p in value]
    raise APIError(400, f"'{name}' must be a string, a list of token ids, or a non-empty list of those")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message must be an object with a string 'role'")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # OpenAI content parts: keep the text ones
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, "only text content parts ({'type': 'text', 'text': str}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(400, "a message 'content' must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


# ------------------------------------------------------------------------------------------------
# metrics and slots
# ------------------------------------------------------------------------------------------------


def verif_steps(stats: Any) -> int:
    """Verification steps that checked a draft (the definition behind draft_n_verif_steps)."""
    return stats.n_verify_steps if stats.n_drafted > 0 else 0


def timings(stats: Any) -> dict:
    predicted_ms = max(stats.t_total_ms - stats.t_prefill_ms, 0.0)
    return {
        "cache_n": 0,
        "prompt_n": stats.n_prompt,
        "prompt_ms": stats.t_prefill_ms,
        "prompt_per_token_ms": stats.t_prefill_ms / stats.n_prompt if stats.n_prompt else 0.0,
        "prompt_per_second": 1e3 * stats.n_prompt / stats.t_prefill_ms if stats.t_prefill_ms > 0 else 0.0,
        "predicted_n": stats.n_generated,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_generated if stats.n_generated else 0.0,
        "predicted_per_second": 1e3 * stats.n_generated / predicted_ms if predicted_ms > 0 else 0.0,
        "draft_n": stats.n_drafted,
        "draft_n_accepted": stats.n_accepted,
        "draft_n_verif_steps": verif_steps(stats),
    }


class Metrics:
    """Counters since start (only touched on the event loop)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.n_draft = 0
        self.n_accepted = 0
        self.n_drafts = 0
        self.accepted_per_pos = [0] * 16
        self.n_requests = 0
        self.n_batches = 0
        self.n_batched_requests = 0
        self.n_tokens_max = 0

    def add(self, stats: Any) -> None:
        self.n_requests += 1
        self.prompt_tokens += stats.n_prompt
        self.prompt_seconds += stats.t_prefill_ms / 1e3
        self.predicted_tokens += stats.n_generated
        self.predicted_seconds += max(stats.t_total_ms - stats.t_prefill_ms, 0.0) / 1e3
        self.n_draft += stats.n_drafted
        self.n_accepted += stats.n_accepted
        self.n_drafts += verif_steps(stats)
        for i, n in enumerate(stats.accepted_per_position[:16]):
            self.accepted_per_pos[i] += n
        self.n_tokens_max = max(self.n_tokens_max, stats.n_prompt + stats.n_generated)

    def render(self, processing: int, deferred: int, n_pos: int) -> str:
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed.", self.prompt_tokens),
            ("prompt_seconds_total", "Total time spent processing prompts.", self.prompt_seconds),
            ("tokens_predicted_total", "Number of generation tokens processed.", self.predicted_tokens),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens.", self.predicted_seconds),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation).", self.n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", self.n_draft),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             self.n_accepted),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             self.n_drafts),
        ]
        ours = [  # pydflash's own counters (under the pydflash: prefix)
            ("requests_total", "Requests finished (cancelled ones included).", self.n_requests),
            ("batches_total", "Static batches run (generate_batch calls).", self.n_batches),
            ("batched_requests_total", "Requests run inside those batches.", self.n_batched_requests),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
             self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
             self.predicted_tokens / self.predicted_seconds if self.predicted_seconds else 0.0),
            ("requests_processing", "Number of requests processing.", processing),
            ("requests_deferred", "Number of requests deferred.", deferred),
            ("n_busy_slots_per_decode", "Average number of requests per static batch (pydflash's definition).",
             self.n_batched_requests / self.n_batches if self.n_batches else 0.0),
        ]
        lines = []
        for prefix, kind, items in (("llamacpp", "counter", counters), ("llamacpp", "gauge", gauges),
                                    ("pydflash", "counter", ours)):
            for name, help_, value in items:
                lines += [f"# HELP {prefix}:{name} {help_}", f"# TYPE {prefix}:{name} {kind}",
                          f"{prefix}:{name} {value}"]
        lines += ["# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position",
                  "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter"]
        for i in range(n_pos):
            lines.append(f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} '
                         f"{self.accepted_per_pos[i]}")
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# the scheduler: static batches through Engine.generate_batch on one worker thread
# ------------------------------------------------------------------------------------------------


class Scheduler:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.pending: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.wakeup = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pydflash-batch")
        self.task: asyncio.Task | None = None

    def submit(self, reqs: Sequence[GenRequest]) -> None:
        self.pending.extend(reqs)
        self.wakeup.set()

    def cancel_all(self) -> None:
        for r in self.pending + self.running:
            r.cancelled.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            window = self.state.config.batch_window_ms / 1e3
            if window and len(self.pending) < self.state.config.n_slots:
                await asyncio.sleep(window)  # let concurrent clients' requests arrive
            while True:
                for r in [r for r in self.pending if r.cancelled.is_set()]:
                    self.pending.remove(r)
                    r.emit("error", APIError(499, "cancelled"))
                if not self.pending:
                    break
                batch = self._pick()
                self.running = batch
                for slot, r in enumerate(batch):
                    r.slot = slot
                self.state.metrics.n_batches += 1
                self.state.metrics.n_batched_requests += len(batch)
                try:
                    await loop.run_in_executor(self.executor, self._run_batch, batch)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a bug must not stop the scheduler
                    traceback.print_exc()
                    for r in batch:
                        r.emit("error", APIError(500, f"{type(exc).__name__}: {exc}"))
                finally:
                    self.running = []

    def _pick(self) -> list[GenRequest]:
        head = self.pending[0]
        limit = 1 if head.solo() else self.state.config.n_slots
        key = head.key()
        batch = [r for r in self.pending if r.key() == key and not r.solo()][:limit] if limit > 1 else [head]
        for r in batch:
            self.pending.remove(r)
        return batch

    # -- worker thread ---------------------------------------------------------------------------

    def _run_batch(self, batch: list[GenRequest]) -> None:
        state = self.state
        engine = state.engine
        ready: list[GenRequest] = []
        for r in batch:
            try:
                r.tokens = state.prompt_tokens(r)
                ready.append(r)
            except BaseException as exc:  # noqa: BLE001 - answered as an HTTP error
                r.emit("error", _from_engine_error(exc))
        if not ready:
            return
        for r in ready:
            r.emit("start", len(r.tokens))
        head = ready[0]
        options = dict(head.options)
        if options.get("seed") is None:
            options["seed"] = random.getrandbits(32)
        n_max, n_min = state.spec(head.n_max, head.n_min)

        def on_piece(i: int, text: str) -> bool:
            r = ready[i]
            if r.cancelled.is_set():
                return False
            r.emit("piece", text)
            return True

        try:
            results = engine.generate_batch([r.tokens for r in ready], n_max=n_max, n_min=n_min,
                                            p_min=head.p_min if engine.drafter is not None else None,
                                            on_piece=on_piece, **options)
        except BaseException as exc:  # noqa: BLE001
            if state.config.verbose:
                traceback.print_exc()
            for r in ready:
                r.emit("error", _from_engine_error(exc))
            return
        for r, res in zip(ready, results):
            state.loop.call_soon_threadsafe(state.metrics.add, res.stats)
            if res.stats.stop_reason == "cancelled":  # the client left (nobody listens) or the server stops
                r.emit("error", APIError(503, "generation cancelled: the server is shutting down"))
            else:
                r.emit("done", res)


def _n_ctx_train(model: str) -> int:
    """The training context of a target GGUF (what ``-c 0`` means), 4096 when it does not say."""
    from . import models
    from .convert import read_gguf_header

    try:
        kv = read_gguf_header(models.resolve(model)).kv
        arch = kv["general.architecture"].value
        arch = arch.decode() if isinstance(arch, bytes) else str(arch)
        return int(kv[f"{arch}.context_length"].value)
    except (KeyError, OSError, ValueError):
        return 4096


@dataclass
class ServerState:
    config: ServerConfig
    loop: asyncio.AbstractEventLoop
    metrics: Metrics = field(default_factory=Metrics)
    engine: Any = None
    ready: bool = False               # loaded and warmed up: /health answers 200
    load_error: str | None = None
    model_path: str = ""
    n_ctx_slot: int = 0
    n_max_limit: int = 0
    scheduler: Scheduler | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    # -- loading (worker thread) -------------------------------------------------------------------

    def load(self) -> None:
        from .engine import Engine

        c = self.config
        n_ctx_total = c.n_ctx_total or _n_ctx_train(c.model)
        n_ctx = max(n_ctx_total // c.n_slots, 16)
        devices.add_rpc_servers(c.rpc)
        engine = Engine(c.model, c.drafter, n_ctx=n_ctx, n_threads=c.n_threads, n_gpu_layers=c.n_gpu_layers,
                        n_max=c.n_max, n_min=c.n_min, p_min=c.p_min, n_seq_max=c.n_slots,
                        drafter_device=c.device_draft, verbose=c.verbose)
        try:
            self.n_ctx_slot = engine.target.info.n_ctx
            n_batch = min(512, self.n_ctx_slot)  # Engine's targets use n_batch 512 (capped at n_ctx)
            if engine.drafter is None:  # plain decoding: one row per sequence and step
                self.n_max_limit = 0
                if c.n_slots > n_batch:
                    raise errors.InvalidArgumentError(
                        f"-np {c.n_slots} exceeds the batch of {n_batch} rows: use a larger -c or fewer slots")
            else:  # every sequence verifies n_max + 1 rows per step, all in one target batch
                self.n_max_limit = max(min(engine.drafter.info.block_size - 1, n_batch // c.n_slots - 1), 0)
                if engine.auto_n_max and self.n_max_limit >= 1:
                    engine.n_max = min(engine.n_max, self.n_max_limit)  # the autotuner's ceiling
                    _ = engine.autotuner  # measure this machine's costs before /health says ready
                if engine.n_max > self.n_max_limit or self.n_max_limit < 1:
                    raise errors.InvalidArgumentError(
                        f"-np {c.n_slots} x (n_max {engine.n_max} + 1) rows exceed the batch of {n_batch}: "
                        + (f"use --spec-draft-n-max <= {self.n_max_limit}, " if self.n_max_limit >= 1 else "use ")
                        + "a larger -c or fewer slots")
            if c.warmup:  # also loads every slot's drafter context
                prompt = [max(engine.target.info.token_bos, 0)]
                self.engine = engine
                n_max, n_min = self.spec(None, None)
                engine.generate_batch([prompt] * c.n_slots, n_max=n_max, n_min=n_min, max_tokens=2, temperature=0,
                                      ignore_eos=True)
        except BaseException:
            self.engine = None
            engine.close()
            raise
        self.model_path = engine.target.path
        self.engine = engine
        self.ready = True

    def spec(self, n_max: int | None, n_min: int | None) -> tuple[int | None, int]:
        """A request's effective (n_max, n_min): n_max capped by the block size and the batch rows
        (a request may lower it, not raise it past what -np slots fit), n_min capped by n_max.
        n_max None: the engine's autotuner picks it for each batch."""
        engine = self.engine
        if engine.drafter is None:
            return 0, 0
        if n_max is None and engine.auto_n_max:
            return None, engine.n_min if n_min is None else n_min
        n_max = engine.n_max if n_max is None else min(n_max, self.n_max_limit)
        n_min = engine.n_min if n_min is None else n_min
        return n_max, min(n_min, n_max)

    # -- prompt preparation (worker thread, between batches) -------------------------------------

    def prompt_tokens(self, r: GenRequest) -> list[int]:
        target = self.engine.target
        if r.kind == "chat":
            text = target.apply_chat_template(r.prompt)
            tokens = target.tokenize(text, parse_special=True)
        elif r.kind == "text":
            tokens = target.tokenize(r.prompt)
        else:
            tokens = list(r.prompt)
            bad = [t for t in tokens if not 0 <= t < target.info.n_vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.info.n_vocab - 1})")
        if not tokens:
            raise APIError(400, "the prompt is empty")
        n_ctx = self.n_ctx_slot
        if len(tokens) >= n_ctx:
            raise APIError(400, f"the request ({len(tokens)} prompt tokens) exceeds the available context size "
                                f"({n_ctx} tokens per slot)", "exceed_context_size_error",
                           n_prompt_tokens=len(tokens), n_ctx=n_ctx)
        max_tokens = r.options["max_tokens"]
        if max_tokens > 0 and len(tokens) + max_tokens > n_ctx:
            raise APIError(400, f"max_tokens {max_tokens} + {len(tokens)} prompt tokens exceed the context size "
                                f"({n_ctx} tokens per slot)", "exceed_context_size_error",
                           n_prompt_tokens=len(tokens), n_ctx=n_ctx)
        return tokens

    # -- names ---------------------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        if self.config.aliases:
            return self.config.aliases[0]
        return os.path.basename(self.model_path or self.config.model)

    def known_model(self, name: str) -> bool:
        names = set(self.config.aliases) | {self.config.model, self.model_path}
        for path in (self.config.model, self.model_path):
            base = os.path.basename(path)
            names |= {base, base.removesuffix(".gguf")}
        return name in names


# ------------------------------------------------------------------------------------------------
# HTTP
# ------------------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class Server:
    def __init__(self, state: ServerState) -> None:
        from aiohttp import web

        self.web = web
        self.state = state
        self.app = web.Application(middlewares=[self._middleware()], client_max_size=256 * 1024 * 1024)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/models", self.models)
        r.add_post("/v1/completions", self.oai_completions)
        r.add_post("/completions", self.oai_completions)
        r.add_post("/v1/chat/completions", self.oai_chat)
        r.add_post("/chat/completions", self.oai_chat)
        r.add_post("/completion", self.completion)
        r.add_get("/slots", self.slots)
        r.add_get("/props", self.props)
        r.add_get("/metrics", self.metrics)

    # -- middleware ----------------------------------------------------------------------------------

    def _json_error(self, err: APIError):  # type: ignore[no-untyped-def]
        return self.web.json_response(err.body(), status=err.status)

    def _middleware(self):  # type: ignore[no-untyped-def]
        """API key check, 503 while loading, and every error as an OpenAI-style JSON body."""
        web = self.web

        @web.middleware
        async def middleware(request, handler):  # type: ignore[no-untyped-def]
            try:
                keys = self.state.config.api_keys
                if keys and request.path not in PUBLIC_PATHS and request.method != "OPTIONS":
                    given = request.headers.get("Authorization", "") or request.headers.get("X-Api-Key", "")
                    given = given.removeprefix("Bearer ")
                    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
                        raise APIError(401, "Invalid API Key", "authentication_error")
                if request.path not in PUBLIC_PATHS and not self.state.ready:
                    raise APIError(503, self.state.load_error or "Loading model", "unavailable_error")
                return await handler(request)
            except APIError as err:
                return self._json_error(err)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return self._json_error(APIError(exc.status, exc.reason or "error"))
            except ConnectionError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug answers 500, the server keeps serving
                traceback.print_exc()
                return self._json_error(APIError(500, f"{type(exc).__name__}: {exc}"))

        return middleware

    async def _body(self, request) -> dict:  # type: ignore[no-untyped-def]
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the JSON body must be an object")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None or model == "":
            return
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string")
        if not self.state.known_model(model):
            raise APIError(404, f"model '{model}' not found (this server serves '{self.state.model_id}')",
                           "not_found_error")

    # -- simple endpoints ------------------------------------------------------------------------------

    async def health(self, request):  # type: ignore[no-untyped-def]
        if not self.state.ready:
            raise APIError(503, self.state.load_error or "Loading model", "unavailable_error")
        return self.web.json_response({"status": "ok"})

    async def models(self, request):  # type: ignore[no-untyped-def]
        info = self.state.engine.target.info
        meta = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                "n_ctx_slot": self.state.n_ctx_slot, "speculative": self.state.engine.drafter is not None}
        data = [{"id": self.state.model_id, "object": "model", "created": self.state.created,
                 "owned_by": "llamacpp", "meta": meta, "aliases": list(self.state.config.aliases)}]
        return self.web.json_response({"object": "list", "data": data})

    def _settings(self, r: GenRequest | None = None) -> dict:
        engine = self.state.engine
        o = r.options if r else {}
        n_max, n_min = self.state.spec(r.n_max, r.n_min) if r else self.state.spec(None, None)
        return {
            "n_predict": o.get("max_tokens", -1), "temperature": o.get("temperature", 0.8),
            "top_k": o.get("top_k", 40), "top_p": o.get("top_p", 0.95), "min_p": o.get("min_p", 0.05),
            "seed": o.get("seed") if o.get("seed") is not None else -1, "stop": list(o.get("stop", ())),
            "ignore_eos": o.get("ignore_eos", False),
            "speculative.n_max": engine.last_n_max if n_max is None else n_max, "speculative.n_min": n_min,
            "speculative.p_min": r.p_min if r and r.p_min is not None else self.state.config.p_min,
            "speculative.types": "draft-dflash" if engine.drafter is not None else "none",
        }

    async def slots(self, request):  # type: ignore[no-untyped-def]
        if not self.state.config.slots:
            raise APIError(501, "This server does not support slots endpoint.")
        sched = self.state.scheduler
        running = {r.slot: r for r in sched.running}
        out = []
        for i in range(self.state.config.n_slots):
            r = running.get(i)
            out.append({"id": i, "id_task": -1, "n_ctx": self.state.n_ctx_slot,
                        "speculative": self.state.engine.drafter is not None, "is_processing": r is not None,
                        "params": self._settings(r), "prompt_tokens": len(r.tokens) if r else 0})
        return self.web.json_response(out)

    async def props(self, request):  # type: ignore[no-untyped-def]
        return self.web.json_response({
            "default_generation_settings": {"n_ctx": self.state.n_ctx_slot, "params": self._settings()},
            "total_slots": self.state.config.n_slots, "model_path": self.state.model_path,
            "model_alias": self.state.model_id, "build_info": f"pydflash {SYSTEM_FINGERPRINT}",
        })

    async def metrics(self, request):  # type: ignore[no-untyped-def]
        if not self.state.config.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`.")
        sched = self.state.scheduler
        n_pos = max(self.state.engine.n_max, 1) if self.state.engine.drafter is not None else 0
        text = self.state.metrics.render(len(sched.running), len(sched.pending), max(n_pos, 1))
        return self.web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- generation ------------------------------------------------------------------------------------

    def _requests(self, prompts: list[tuple[str, Any]], n: int, options: dict, spec: tuple) -> tuple[list, asyncio.Queue]:
        out: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        reqs = []
        for p_i, (kind, prompt) in enumerate(prompts):
            for j in range(n):
                opts = dict(options)
                if opts["seed"] is not None and j:
                    opts["seed"] += j
                reqs.append(GenRequest(index=p_i * n + j, prompt=prompt, kind=kind, options=opts, n_max=spec[0],
                                       n_min=spec[1], p_min=spec[2], out=out, loop=loop))
        return reqs, out

    async def _started(self, reqs: list[GenRequest], out: asyncio.Queue) -> list:
        """Submit and wait until every request passed its checks; returns events that came early."""
        self.state.scheduler.submit(reqs)
        early, n_started = [], 0
        while n_started < len(reqs):
            ev = await out.get()
            if ev[0] == "error":
                raise ev[2]
            if ev[0] == "start":
                n_started += 1
            else:
                early.append(ev)
        return early

    async def _events(self, early: list, out: asyncio.Queue, n: int):  # type: ignore[no-untyped-def]
        """Events until every request is done (errors raise)."""
        n_done = 0
        queue = list(early)
        while n_done < n:
            ev = queue.pop(0) if queue else await out.get()
            if ev[0] == "error":
                raise ev[2]
            if ev[0] == "done":
                n_done += 1
            yield ev

    async def _collect(self, reqs: list[GenRequest], out: asyncio.Queue) -> list:
        early = await self._started(reqs, out)
        results: list = [None] * len(reqs)
        async for kind, i, payload in self._events(early, out, len(reqs)):
            if kind == "done":
                results[i] = payload
        return results

    def _parse_common(self, body: dict, max_names: Sequence[str]) -> tuple[dict, tuple, int, bool]:
        self._check_model(body)
        options = _sampling(body, max_names)
        spec = _speculative(body)
        n = _field(body, ["n"], _is_int, "an int", 1)
        if not 1 <= n <= 128:
            raise APIError(400, "'n' must be in 1..128")
        stream = _field(body, ["stream"], lambda v: isinstance(v, bool), "a boolean", False)
        return options, spec, n, stream

    @staticmethod
    def _usage(results: list) -> dict:
        prompt = sum(r.stats.n_prompt for r in results)
        completion = sum(r.stats.n_generated for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0}}

    @staticmethod
    def _stream_usage(body: dict) -> bool:
        so = body.get("stream_options")
        return isinstance(so, dict) and so.get("include_usage") is True

    async def _stream(self, request, reqs: list[GenRequest], out: asyncio.Queue, chunk: Callable,  # type: ignore[no-untyped-def]
                      final: Callable, tail: Callable | None, done_marker: bool):
        """SSE: chunk(i, text) per piece, final(i, result) per finished request, tail(results) last."""
        early = await self._started(reqs, out)  # errors before this point are plain HTTP errors
        resp = self.web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        results: list = [None] * len(reqs)
        try:
            async for kind, i, payload in self._events(early, out, len(reqs)):
                if kind == "piece":
                    await resp.write(_sse(chunk(i, payload)))
                elif kind == "done":
                    results[i] = payload
                    await resp.write(_sse(final(i, payload)))
            if tail is not None:
                extra = tail(results)
                if extra is not None:
                    await resp.write(_sse(extra))
        except APIError as err:
            await resp.write(_sse(err.body()))
        if done_marker:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _serve(self, request, reqs, out, run):  # type: ignore[no-untyped-def]
        try:
            return await run()
        finally:
            for r in reqs:  # disconnect, error or normal end: nothing of these requests may keep running
                r.cancelled.set()

    async def oai_completions(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = _prompts(body["prompt"])
        options, spec, n, stream = self._parse_common(body, ["max_tokens"])
        reqs, out = self._requests(prompts, n, options, spec)
        cid, created, model = f"cmpl-{uuid.uuid4().hex}", _now(), self.state.model_id
        base = {"id": cid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

        def choice(i: int, text: str, finish: str | None) -> dict:
            return {"text": text, "index": i, "logprobs": None, "finish_reason": finish}

        if stream:
            def tail(results: list) -> dict | None:
                if not self._stream_usage(body):
                    return None
                return {**base, "choices": [], "usage": self._usage(results)}

            return await self._serve(request, reqs, out, lambda: self._stream(
                request, reqs, out,
                lambda i, text: {**base, "choices": [choice(i, text, None)]},
                lambda i, res: {**base, "choices": [choice(i, "", FINISH_REASONS[res.stats.stop_reason])],
                                "timings": timings(res.stats)},
                tail, True))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(reqs, out)
            data = {**base, "choices": [choice(i, r.text, FINISH_REASONS[r.stats.stop_reason])
                                        for i, r in enumerate(results)],
                    "usage": self._usage(results)}
            if len(results) == 1:
                data["timings"] = timings(results[0].stats)
            return self.web.json_response(data)

        return await self._serve(request, reqs, out, run)

    async def oai_chat(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        messages = _messages(body.get("messages"))
        options, spec, n, stream = self._parse_common(body, ["max_completion_tokens", "max_tokens"])
        reqs, out = self._requests([("chat", messages)], n, options, spec)
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", _now(), self.state.model_id

        if stream:
            base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": SYSTEM_FINGERPRINT}
            began: set[int] = set()

            def delta(i: int, text: str) -> dict:
                d: dict = {"content": text}
                if i not in began:
                    began.add(i)
                    d["role"] = "assistant"
                return {**base, "choices": [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}]}

            def final(i: int, res) -> dict:  # type: ignore[no-untyped-def]
                d: dict = {} if i in began else {"role": "assistant", "content": ""}
                began.add(i)
                return {**base, "choices": [{"index": i, "delta": d, "logprobs": None,
                                             "finish_reason": FINISH_REASONS[res.stats.stop_reason]}],
                        "timings": timings(res.stats)}

            def tail(results: list) -> dict | None:
                if not self._stream_usage(body):
                    return None
                return {**base, "choices": [], "usage": self._usage(results)}

            return await self._serve(request, reqs, out,
                                     lambda: self._stream(request, reqs, out, delta, final, tail, True))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(reqs, out)
            data = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": r.text},
                                 "logprobs": None, "finish_reason": FINISH_REASONS[r.stats.stop_reason]}
                                for i, r in enumerate(results)],
                    "usage": self._usage(results)}
            if len(results) == 1:
                data["timings"] = timings(results[0].stats)
            return self.web.json_response(data)

        return await self._serve(request, reqs, out, run)

    async def completion(self, request):  # type: ignore[no-untyped-def]
        """llama.cpp's native /completion."""
        body = await self._body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = _prompts(body["prompt"])
        if len(prompts) != 1:
            raise APIError(400, "/completion takes one prompt (a string or a list of token ids)")
        options, spec, _, stream = self._parse_common(body, ["n_predict", "max_tokens"])
        return_tokens = _field(body, ["return_tokens"], lambda v: isinstance(v, bool), "a boolean", False)
        reqs, out = self._requests(prompts, 1, options, spec)
        req = reqs[0]
        model = self.state.model_id

        def final(i: int, res, content: str) -> dict:  # type: ignore[no-untyped-def]
            st = res.stats
            tokens = list(res.tokens)
            if st.stop_reason == "eos" and tokens:
                tokens = tokens[:-1]  # as llama-server: the end-of-generation token is not returned
            stops = options["stop"]
            return {
                "index": 0, "content": content, "tokens": tokens if return_tokens else [], "id_slot": req.slot,
                "stop": True, "model": model, "tokens_predicted": st.n_generated, "tokens_evaluated": st.n_prompt,
                "generation_settings": self._settings(req),
                "prompt": req.prompt if req.kind == "text" else "", "has_new_line": "\n" in res.text,
                "truncated": False, "stop_type": STOP_TYPES[st.stop_reason],
                "stopping_word": stops[0] if st.stop_reason == "stop" and len(stops) == 1 else "",
                "tokens_cached": 0, "timings": timings(st),
            }

        if stream:
            count = [0]

            def chunk(i: int, text: str) -> dict:
                count[0] += 1
                return {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": req.slot,
                        "tokens_predicted": count[0], "tokens_evaluated": len(req.tokens)}

            return await self._serve(request, reqs, out, lambda: self._stream(
                request, reqs, out, chunk, lambda i, res: final(i, res, ""), None, False))

        async def run():  # type: ignore[no-untyped-def]
            res = (await self._collect(reqs, out))[0]
            return self.web.json_response(final(0, res, res.text))

        return await self._serve(request, reqs, out, run)


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------


async def _serve(config: ServerConfig) -> int:
    from aiohttp import web

    loop = asyncio.get_running_loop()
    state = ServerState(config=config, loop=loop)
    server = Server(state)
    state.scheduler = Scheduler(state)
    # handler_cancellation: a client that drops the connection cancels its handler (and so its sequence)
    runner = web.AppRunner(server.app, handler_cancellation=True, **({} if config.verbose else {"access_log": None}))
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as exc:
        print(f"pydflash serve: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
    port = config.port
    for sock in getattr(getattr(site, "_server", None), "sockets", None) or []:
        port = sock.getsockname()[1]
        break
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / Windows
            pass
    print(f"pydflash serve: loading {config.model}" + (f" with drafter {config.drafter}" if config.drafter else "")
          + f" ({config.n_slots} slot(s))", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc = 0
    try:
        await loop.run_in_executor(state.scheduler.executor, state.load)
    except BaseException as exc:  # noqa: BLE001
        state.load_error = f"{type(exc).__name__}: {exc}"
        print(f"pydflash serve: {state.load_error}", file=sys.stderr, flush=True)
        rc = 1
        stop.set()
    if rc == 0:
        e = state.engine
        print(f"pydflash serve: model loaded in {time.monotonic() - t0:.1f} s; n_ctx {state.n_ctx_slot} per slot, "
              f"speculative {'draft-dflash n_max ' + str(e.n_max) if e.drafter else 'none'}"
              + (f", p_min {config.p_min}" if config.p_min else ""), file=sys.stderr)
        print(f"pydflash serve: listening on http://{config.host}:{port}", file=sys.stderr, flush=True)
        state.scheduler.task = asyncio.create_task(state.scheduler.run())
    try:
        await stop.wait()
    finally:
        state.scheduler.cancel_all()
        if state.scheduler.task is not None:
            state.scheduler.task.cancel()
        await runner.cleanup()
        await loop.run_in_executor(None, state.scheduler.executor.shutdown, True)
        if state.engine is not None:
            state.engine.close()
    return rc


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM (``pydflash serve`` and ``pydflash-server``)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"pydflash serve: ignoring unsupported llama-server arguments: {' '.join(unknown)}", file=sys.stderr)
    try:
        __import__("aiohttp")
    except ImportError:
        print("pydflash serve: needs aiohttp: pip install 'pydflash[server]'", file=sys.stderr)
        return 1
    try:
        config = _config_from_args(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(config))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
