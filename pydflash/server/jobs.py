"""Request bodies -> ``Job``s: every request field the step loop uses, parsed once, here.

Everything here is checked on the event loop before anything is queued; what needs the model
(tokenizing, the context size) is checked by the step loop (``loop.py``), which answers 400 the
same way. A ``Job`` is one sequence to generate (a request with ``n`` choices or a list of
prompts makes several) and carries every field the step loop uses, parsed: the loop thread reads
no request body (a chat job carries only the fields its template renders, ``TEMPLATE_FIELDS``);
the step loop reports back on the job's ``out`` queue. Each API family (``api_*.py``) turns its
own request shape into these calls.

Errors: a check that fails raises ``APIError`` (4xx, its own message); a parser is a
``client_input`` function, so what Python raises on a value of a shape no check foresaw (a
ValueError, TypeError, OverflowError, or RecursionError for nesting) is a 400 too. Only what
escapes elsewhere is a server bug: ``answer_of`` logs its traceback and answers 500. Ints bound
for the C API are range-checked here (int32), as llama-server checks them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import errors
from ..runtime.chat import json_schema_to_grammar

__all__ = ["APIError", "Common", "Constraints", "IMAGE_REFUSED", "Job", "Piece", "Progress", "Speculative",
           "TEMPLATE_FIELDS", "answer_of", "check_continuation", "check_model", "client_input", "constraint_options",
           "field_value", "from_engine_error", "is_bool", "is_int", "make_jobs", "parse_body", "parse_chat",
           "parse_common", "parse_constraints", "parse_jobs", "parse_messages", "parse_prompts", "template_input"]

# llama-server's answer to an image (no multimodal projector here; a 400, where it answers 500)
IMAGE_REFUSED = "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
INT32_MAX = 2**31 - 1  # the C API's int32 fields (max_tokens, top_k, n_max, ...)
# what parsing a client's value can raise: a value of the wrong shape (ValueError, TypeError), one
# nested too deeply for Python's recursion limit (RecursionError), a number too large (OverflowError)
CLIENT_INPUT_ERRORS = (ValueError, TypeError, RecursionError, OverflowError)

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


def bad_input(exc: BaseException) -> APIError:
    """The 400 for a value a parser could not take (one of ``CLIENT_INPUT_ERRORS``)."""
    if isinstance(exc, RecursionError):
        return APIError(400, "the request nests too deeply")
    if isinstance(exc, OverflowError):
        return APIError(400, f"a number in the request is out of range ({exc})")
    return APIError(400, f"invalid request: {exc}")


def client_input(fn: Callable) -> Callable:
    """Decorator of a request parser: what it raises on the client's value (``CLIENT_INPUT_ERRORS``)
    is answered 400; the parser's own checks raise ``APIError`` with their message."""
    @functools.wraps(fn)
    def parse(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CLIENT_INPUT_ERRORS as exc:
            raise bad_input(exc) from None

    return parse


def answer_of(exc: BaseException) -> APIError:
    """The HTTP answer to an exception that escaped a handler: an ``APIError`` as it is; anything
    else is a server bug, logged with its traceback and answered 500 (parsing happens in
    ``client_input`` parsers, so the client's bad values never get here)."""
    if isinstance(exc, APIError):
        return exc
    traceback.print_exception(exc)
    return APIError(500, f"{type(exc).__name__}: {exc}")


def from_engine_error(exc: BaseException) -> APIError:
    """The HTTP answer to an exception of the engine (bad input: 4xx; anything else: a logged 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, errors.ContextFullError):
        return APIError(400, str(exc), "exceed_context_size_error")
    if isinstance(exc, (errors.InvalidArgumentError, errors.MismatchError)):
        return APIError(400, str(exc))
    if isinstance(exc, errors.UnsupportedError):
        return APIError(501, str(exc))
    if isinstance(exc, RecursionError):  # the client's JSON serialised for the chat templates / schema converter
        return bad_input(exc)
    return answer_of(exc)


@dataclass(frozen=True)
class Speculative:
    """A request's ``speculative.*`` overrides (None: the server's)."""

    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None


@dataclass(frozen=True)
class Constraints:
    """A request's constraints and probability fields, parsed on the event loop (the step loop only
    resolves texts to tokens and clamps to the vocabulary: ``constraint_options``)."""

    grammar: str | None = None        # GBNF: the client's, or its json_schema / response_format converted
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # a token id or a text (all its tokens), the bias
    n_probs: int | None = None        # candidates per token (n_probs, logprobs, top_logprobs)
    post_sampling_probs: bool | None = None
    probs_per_piece: bool = False     # streamed pieces carry their tokens' probabilities


class Piece(NamedTuple):
    """Streamed text and, when the job asked for them, its token ids (and their probabilities)."""

    text: str
    tokens: tuple[int, ...] = ()
    probs: tuple = ()  # pydflash.runtime.generation.TokenProbs of those tokens (n_probs)
    timings: dict | None = None  # the timings so far, with ``timings_per_token``


class Progress(NamedTuple):
    """A prompt-progress report (llama-server's ``prompt_progress``) and the timings so far."""

    report: dict  # {total, cache, processed, time_ms}
    timings: dict | None = None  # with ``timings_per_token``


@dataclass
class Job:
    """One sequence to generate, from the handler that submitted it to the step loop and back.

    Events put on ``out`` (on the event loop): ("start", index, n_prompt) once the prompt passed
    its checks and the sequence is queued, ("piece", index, Piece), ("progress", index, Progress)
    with ``return_progress``, ("done", index, Result), ("error", index, APIError). The fields below the line are the step loop's."""

    index: int                        # choice index within its HTTP request
    prompt: Any                       # str, list[int], or a list of chat messages
    kind: str                         # "text", "mixed" (strings and ids), "tokens" or "chat"
    options: dict                     # SamplingOptions keyword arguments (seed None: drawn per job)
    spec: Speculative
    cache_prompt: bool
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    return_progress: bool = False     # stream ("progress", index, Progress) events
    timings_per_token: bool = False   # streamed pieces and progress reports carry the timings so far
    piece_tokens: bool = False        # pieces carry token ids (llama.cpp's streamed ``tokens``)
    constraints: Constraints = Constraints()
    slot_request: int | None = None   # llama-server's ``id_slot`` (None: any free slot)
    template_input: dict | None = None  # a chat job: what the Jinja templates render (TEMPLATE_FIELDS)
    # -- set by the step loop
    seq_id: int = 0                   # the scheduler's sequence id (0: not queued yet)
    seed: int | None = None           # the seed it samples with
    n_prompt: int = 0
    prompt_text: str = ""             # the prompt tokens as text, special tokens rendered
    t_start: float = 0.0              # time.monotonic() when it was queued
    progress: tuple[int, int] = (-1, -1)  # (cache, processed) last reported
    t_prefilled: float = 0.0          # time.monotonic() of its first piece (the prompt was done)
    slot: int = -1                    # the slot it was seen running in
    has_new_line: bool = False
    widths: Counter = field(default_factory=Counter)  # draft width -> steps it decoded in
    render: dict | None = None        # the chat template's render (grammar, stops, parser)
    n_seen: int = 0                   # tokens already handed out in pieces
    logit_bias: list = field(default_factory=list)  # (token, bias) pairs it samples with
    # -- set on the event loop
    answered: bool = False            # its "done" or "error" event was delivered

    def put(self, kind: str, payload: Any) -> None:
        """On the event loop: deliver an event to the waiting handler."""
        self.answered = self.answered or kind in ("done", "error")
        self.out.put_nowait((kind, self.index, payload))


@dataclass(frozen=True)
class Common:
    """The fields shared by the completion endpoints."""

    options: dict
    spec: Speculative
    n: int
    stream: bool
    cache_prompt: bool
    slot: int | None = None           # id_slot (None: any free slot)


def is_int(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    """A finite number (an int too large for a float is not one)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) if isinstance(v, float) else abs(v) <= 2**1023


def int_in(lo: int, hi: int) -> Callable[[Any], bool]:
    """A check for ``field_value``: an int in [lo, hi]."""
    return lambda v: is_int(v) and lo <= v <= hi


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def field_value(body: dict, names: Sequence[str], check: Callable[[Any], bool], what: str,
                default: Any = None) -> Any:
    """The first of ``names`` present in ``body`` (400 when it fails ``check``), else ``default``."""
    for name in names:
        if name in body and body[name] is not None:
            value = body[name]
            if not check(value):
                raise APIError(400, f"'{name}' must be {what}, got {_shown(value)}")
            return value
    return default


def _shown(value: Any, limit: int = 80) -> str:
    """A client's value in an error message, cut short (deep or huge values too)."""
    try:
        text = json.dumps(value)
    except CLIENT_INPUT_ERRORS:
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object. Refused (400) as llama-server's JSON parser refuses them: bad
    JSON, and a \\uD800-\\uDFFF escape that is not half of a pair (no UTF-8 text has it; it
    would fail at the tokenizer); also a body nested deeper than Python's parser goes."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise APIError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object")
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then look at every string
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "malformed JSON body: a lone UTF-16 surrogate escape (\\uD800-\\uDFFF)") from None
        except RecursionError:
            raise APIError(400, "malformed JSON body: nested too deeply") from None
    return body


def check_model(body: dict) -> None:
    """As llama-server serving one model: any name is accepted (the answer names the served model)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string")


def _speculative(body: dict) -> Speculative:
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
            v = float(v)
        elif not is_int(v) or not 0 <= v <= INT32_MAX:
            raise APIError(400, f"'speculative.{name}' must be an int in [0, {INT32_MAX}]")
        values[name] = v
    spec = Speculative(**values)
    if spec.n_max is not None and spec.n_min is not None and spec.n_min > spec.n_max:
        raise APIError(400, "'speculative.n_min' must not exceed 'speculative.n_max'")
    return spec


def _sampling(body: dict, max_names: Sequence[str], defaults: dict) -> dict:
    opts: dict[str, Any] = {}
    # as llama-server: between -1 (until the end of the context) and the C API's int32 maximum
    max_tokens = field_value(body, max_names, int_in(-1, INT32_MAX), f"an int between -1 and {INT32_MAX}",
                             defaults.get("max_tokens", -1))
    if max_tokens == 0 and max_names[0] != "n_predict":
        raise APIError(400, f"'{max_names[0]}' must be a positive int (or -1: until the end of the context)")
    opts["max_tokens"] = max_tokens
    temperature = field_value(body, ["temperature"], _is_num, "a number", defaults.get("temperature", 0.8))
    if temperature < 0:
        raise APIError(400, "'temperature' must be >= 0")
    opts["temperature"] = float(temperature)
    top_k = field_value(body, ["top_k"], int_in(-INT32_MAX - 1, INT32_MAX), "a 32-bit int", 40)
    opts["top_k"] = max(top_k, 0)
    top_p = field_value(body, ["top_p"], _is_num, "a number", 0.95)
    if not 0.0 <= top_p <= 1.0:
        raise APIError(400, "'top_p' must be in [0, 1]")
    opts["top_p"] = float(top_p) if top_p > 0 else 1.0
    min_p = field_value(body, ["min_p"], _is_num, "a number", 0.05)
    if not 0.0 <= min_p <= 1.0:
        raise APIError(400, "'min_p' must be in [0, 1]")
    opts["min_p"] = float(min_p)
    seed = field_value(body, ["seed"], is_int, "an int", defaults.get("seed", -1))
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
    opts["ignore_eos"] = field_value(body, ["ignore_eos"], is_bool, "a boolean", False)
    return opts


@client_input
def parse_common(body: dict, max_names: Sequence[str], defaults: dict | None = None, n_slots: int = 1) -> Common:
    """Sampling, speculative overrides, ``n``, ``stream``, ``cache_prompt``, ``id_slot`` (and the
    model check). ``defaults``: the server's ``max_tokens`` / ``temperature`` / ``seed`` (--n-predict,
    --temp, --seed); ``n_slots``: the server's slots (-np)."""
    check_model(body)
    options = _sampling(body, max_names, defaults or {})
    spec = _speculative(body)
    n = field_value(body, ["n"], is_int, "an int", 1)
    if not 1 <= n <= 128:
        raise APIError(400, "'n' must be in 1..128")
    stream = field_value(body, ["stream"], is_bool, "a boolean", False)
    cache_prompt = field_value(body, ["cache_prompt"], is_bool, "a boolean", True)
    slot = field_value(body, ["id_slot"], is_int, "an int", -1)
    if slot != -1 and not 0 <= slot < n_slots:
        raise APIError(400, f"Invalid id_slot {_shown(slot)} (0..{n_slots - 1})")
    return Common(options=options, spec=spec, n=n, stream=stream, cache_prompt=cache_prompt,
                  slot=None if slot == -1 else slot)


PROMPT_FORMS = ("'prompt' must be a string, a list of token ids, a list of strings and token ids, an object "
                "{'prompt_string': ...}, or a non-empty list of those")


def _subprompt(value: Any, name: str) -> tuple[str, Any]:
    """One sequence's prompt: ("tokens", ids) or ("mixed", [str | id, ...]) (tokenized by the step loop)."""
    if isinstance(value, str):
        return "mixed", [value]
    if isinstance(value, list) and value and all(is_int(t) or isinstance(t, str) for t in value):
        if all(is_int(t) for t in value):
            return "tokens", list(value)
        return "mixed", list(value)
    if isinstance(value, dict) and "prompt_string" in value:
        if value.get("multimodal_data") is not None:
            raise APIError(400, "Multimodal data provided, but model does not support multimodal requests.")
        inner = value["prompt_string"]
        if isinstance(inner, str) or (isinstance(inner, list) and inner and all(
                is_int(t) or isinstance(t, str) for t in inner)):
            return _subprompt(inner, name)
    raise APIError(400, PROMPT_FORMS.replace("'prompt'", f"'{name}'"))


@client_input
def parse_prompts(value: Any, name: str = "prompt") -> list[tuple[str, Any]]:
    """A completion prompt as llama-server takes it: one sequence (a string, token ids, a mixed list
    of strings and ids, a ``{"prompt_string": ...}`` object), or a list of those (one choice each).
    A list holding any id is one sequence."""
    if isinstance(value, list) and not any(is_int(t) for t in value):
        if not value:
            raise APIError(400, f"'{name}' must not be empty")
        return [_subprompt(p, name) for p in value]
    return [_subprompt(value, name)]


@client_input
def parse_messages(value: Any) -> list[dict]:
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


@client_input
def check_continuation(body: dict, messages: list[dict]) -> None:
    """llama-server's checks of a final assistant message (a prefill to continue) and of
    ``add_generation_prompt`` / ``continue_final_message`` (400 where it refuses)."""
    add_prompt = field_value(body, ["add_generation_prompt"], is_bool, "a boolean", True)
    cont = body.get("continue_final_message")
    if cont is not None and not isinstance(cont, (bool, str)):
        raise APIError(400, "'continue_final_message' must be a boolean or a string")
    if not cont and len(messages) >= 2 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
        raise APIError(400, "Cannot have 2 or more assistant messages at the end of the list.")
    if cont and add_prompt:
        raise APIError(400, "Cannot set both add_generation_prompt and continue_final_message to true.")


def make_jobs(prompts: list[tuple[str, Any]], common: Common) -> tuple[list[Job], asyncio.Queue]:
    """One job per (prompt, choice), sharing one event queue; choice j of a seeded request samples
    with seed + j."""
    out: asyncio.Queue = asyncio.Queue()
    jobs = []
    for p_i, (kind, prompt) in enumerate(prompts):
        for j in range(common.n):
            opts = dict(common.options)
            if opts["seed"] is not None:
                opts["seed"] += j
            jobs.append(Job(index=p_i * common.n + j, prompt=prompt, kind=kind, options=opts, spec=common.spec,
                            cache_prompt=common.cache_prompt, out=out, slot_request=common.slot))
    return jobs, out


# -- constraints: grammar, JSON schema, logit bias, token probabilities ------------------------------

def _schema_grammar(schema: Any) -> str:
    try:
        return json_schema_to_grammar(schema)
    except errors.InvalidArgumentError as exc:
        raise APIError(400, str(exc)) from None


def _logit_bias(value: Any) -> tuple[tuple[int | str, float], ...]:
    """llama-server's forms: {"id": bias} (OpenAI), [[id, bias], ...], [["text", bias], ...];
    a bias of false bans the token. Texts stay texts (the step loop tokenizes them)."""
    pairs: list[tuple[Any, Any]]
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list):
        pairs = []
        for item in value:
            if not isinstance(item, list) or len(item) != 2:
                raise APIError(400, "'logit_bias' entries must be [token or text, bias] pairs")
            pairs.append((item[0], item[1]))
    else:
        raise APIError(400, "'logit_bias' must be an object or a list of [token, bias] pairs")
    out: list[tuple[int | str, float]] = []
    for key, bias in pairs:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias):
            b = float(bias)
        else:
            raise APIError(400, f"a logit bias must be a number or false, got {str(bias)[:80]}")
        if isinstance(key, str) and not key.lstrip("-").isdigit():
            out.append((key, b))  # a text: every one of its tokens
            continue
        try:
            out.append((int(key), b))
        except (TypeError, ValueError, OverflowError):
            raise APIError(400, f"'logit_bias' key {str(key)[:80]} is not a token id") from None
    return tuple(out)


@client_input
def parse_constraints(body: dict, *, chat: bool = False) -> Constraints:
    """``grammar`` / ``json_schema`` / ``response_format`` (completion endpoints: converted to GBNF
    here; a chat request's come from its template render, its own ``grammar`` is the fallback),
    ``logit_bias``, ``n_probs`` / ``logprobs`` / ``top_logprobs`` and ``post_sampling_probs``."""
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise APIError(400, "'grammar' must be a string")
    grammar = grammar or None
    if not chat:
        schema = body.get("json_schema")
        if schema is not None and grammar:
            raise APIError(400, "Cannot use both json_schema and grammar")
        rf = body.get("response_format")
        if isinstance(rf, dict) and schema is None:
            kind = rf.get("type")
            if kind == "json_object":
                schema = rf.get("schema") or {"type": "object"}
            elif kind == "json_schema":
                inner = rf.get("json_schema") or {}
                if not isinstance(inner, dict):
                    raise APIError(400, "'response_format.json_schema' must be an object")
                schema = inner.get("schema") or {"type": "object"}
            elif kind not in (None, "text"):
                raise APIError(400, f'response_format type must be one of "text" or "json_object", but got: '
                                    f'{str(kind)[:80]}')
        if schema is not None:
            if isinstance(schema, dict) and not schema:
                schema = {"type": "object"}
            grammar = _schema_grammar(schema)
    bias = _logit_bias(body["logit_bias"]) if body.get("logit_bias") is not None else ()
    n_probs = body.get("n_probs")
    if chat:
        if body.get("logprobs"):
            n_probs = body.get("top_logprobs")
            n_probs = 20 if n_probs is None else n_probs
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "top_logprobs requires logprobs to be set to true")
    elif body.get("logprobs") is not None and n_probs is None and is_int(body.get("logprobs")):
        n_probs = body["logprobs"]  # OpenAI /v1/completions: logprobs = number of candidates
    if n_probs is not None and (not is_int(n_probs) or n_probs < 0):
        raise APIError(400, "'n_probs' must be an int >= 0")
    # llama-server reports the chosen token even with n_probs 0 once probabilities are asked for
    post = body.get("post_sampling_probs")
    if post is not None and not isinstance(post, bool):
        raise APIError(400, "'post_sampling_probs' must be a boolean")
    return Constraints(grammar=grammar, logit_bias=bias, n_probs=n_probs, post_sampling_probs=post,
                       probs_per_piece=bool(body.get("n_probs")) or bool(body.get("logprobs")))


def constraint_options(c: Constraints, n_vocab: int, tokenize) -> dict:  # type: ignore[no-untyped-def]
    """SamplingOptions keywords of parsed constraints (on the step loop: texts of ``logit_bias``
    tokenized, ids outside the vocabulary left out as llama-server does, ``n_probs`` clamped)."""
    opts: dict[str, Any] = {}
    if c.grammar:
        opts["grammar"] = c.grammar
    if c.logit_bias:
        bias: list[tuple[int, float]] = []
        for key, b in c.logit_bias:
            bias += [(t, b) for t in (tokenize(key) if isinstance(key, str) else [key]) if 0 <= t < n_vocab]
        opts["logit_bias"] = bias
    if c.n_probs is not None:
        opts["n_probs"] = min(c.n_probs, n_vocab)
    if c.post_sampling_probs is not None:
        opts["post_sampling_probs"] = c.post_sampling_probs
    return opts


# -- chat requests -----------------------------------------------------------------------------------

# What the chat templates read of an OpenAI chat request (native/src/chat_request.cpp): a chat job
# carries these, not the body.
TEMPLATE_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "json_schema",
                   "grammar", "add_generation_prompt", "continue_final_message", "reasoning_format",
                   "reasoning_effort", "chat_template_kwargs")


def template_input(body: dict) -> dict:
    """The fields of a chat request the Jinja templates render (tools, tool calls, reasoning,
    response_format, template kwargs included)."""
    return {k: body[k] for k in TEMPLATE_FIELDS if k in body}


def parse_chat(body: dict, *, allow_empty: bool = False) -> list[dict]:
    """A chat request's messages, checked (with llama-server's continuation rules)."""
    if allow_empty and body.get("messages") == []:
        messages: list[dict] = []
    else:
        messages = parse_messages(body.get("messages"))
    check_continuation(body, messages)
    return messages


# -- jobs ------------------------------------------------------------------------------------------------

def parse_jobs(body: dict, prompts: list[tuple[str, Any]], max_names: Sequence[str], defaults: dict, n_slots: int,
               *, piece_tokens: bool = False, chat: bool = False) -> tuple[Common, list[Job], asyncio.Queue]:
    """The jobs of a completion request (``prompts`` from ``parse_prompts``, or one ``("chat",
    messages)``), every field the step loop needs parsed into them. ``defaults``: the server's
    ``max_tokens`` / ``temperature`` / ``seed``; ``piece_tokens``: streamed pieces carry token ids."""
    common = parse_common(body, max_names, defaults, n_slots)
    constraints = parse_constraints(body, chat=chat)
    jobs, out = make_jobs(prompts, common)
    progress = common.stream and field_value(body, ["return_progress"], is_bool, "a boolean", False)
    per_token = common.stream and field_value(body, ["timings_per_token"], is_bool, "a boolean", False)
    rendered = template_input(body) if chat else None
    for job in jobs:
        job.return_progress = progress
        job.timings_per_token = per_token
        job.piece_tokens = piece_tokens and common.stream
        job.constraints = constraints
        job.template_input = rendered
    return common, jobs, out
