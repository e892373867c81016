"""Generation results and the plumbing shared by every generate/stream entry point.

The token loop runs in C++; Python only converts arguments, receives streamed text pieces through
one callback, and wraps the native output in a ``Result``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .. import errors
from ._bindings import TOKEN_CALLBACK, check, ffi, lib

STOP_REASONS = {
    lib.DFLASH_STOP_NONE: "none",
    lib.DFLASH_STOP_EOS: "eos",
    lib.DFLASH_STOP_STRING: "stop",
    lib.DFLASH_STOP_MAX_TOKENS: "length",
    lib.DFLASH_STOP_CONTEXT: "context",
    lib.DFLASH_STOP_CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class Stats:
    """Counters and timings of one generation (milliseconds)."""

    n_prompt: int
    n_generated: int
    n_verify_steps: int
    n_drafted: int
    n_accepted: int
    stop_reason: str
    t_prefill_ms: float
    t_draft_ms: float
    t_verify_ms: float
    t_accept_ms: float
    t_total_ms: float
    accepted_per_position: tuple[int, ...] = ()
    n_cached: int = 0  # prompt tokens whose KV was reused from the slot (cache_prompt)
    n_lookup_drafted: int = 0  # of n_drafted: proposed from the sequence's own history (lookup)
    n_lookup_accepted: int = 0  # of n_accepted: such tokens accepted
    n_trimmed: int = 0  # drafter drafts not verified (auto's trim by the drafter's confidence, or p_min)
    t_rollback_ms: float = 0.0  # recurrent targets' checkpoint rollback: saves, restores, replays
    n_replayed: int = 0  # rows decoded again after a rejection (checkpoint rollback)
    notice: str = ""  # why speculation is off for this target / drafter pair ("" when it is not)

    @property
    def tokens_per_second(self) -> float:
        """Generation speed after prefill."""
        decode_ms = self.t_total_ms - self.t_prefill_ms
        return self.n_generated / (decode_ms / 1000.0) if decode_ms > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verification step (1.0 for plain decoding)."""
        steps = max(self.n_verify_steps, 1)
        return self.n_generated / steps

    @classmethod
    def from_native(cls, st) -> "Stats":  # type: ignore[no-untyped-def]
        return cls(
            n_prompt=st.n_prompt,
            n_generated=st.n_generated,
            n_verify_steps=st.n_verify_steps,
            n_drafted=st.n_drafted,
            n_accepted=st.n_accepted,
            stop_reason=STOP_REASONS.get(st.stop_reason, "none"),
            t_prefill_ms=st.t_prefill_ms,
            t_draft_ms=st.t_draft_ms,
            t_verify_ms=st.t_verify_ms,
            t_accept_ms=st.t_accept_ms,
            t_total_ms=st.t_total_ms,
            accepted_per_position=tuple(st.n_accepted_per_pos[i] for i in range(16)),
            n_cached=st.n_cached,
            n_lookup_drafted=st.n_lookup_drafted,
            n_lookup_accepted=st.n_lookup_accepted,
            n_trimmed=st.n_trimmed,
            t_rollback_ms=st.t_rollback_ms,
            n_replayed=st.n_replayed,
        )


@dataclass(frozen=True)
class TokenProbs:
    """A generated token's log-probability and the most likely candidates at its position
    (``SamplingOptions.n_probs``): the softmax of the raw logits, or with
    ``post_sampling_probs`` the distribution the sampler drew from."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


@dataclass(frozen=True)
class Capture:
    """Training rows of a sequence generated with ``capture=True`` (``Scheduler.set_capture``).

    Row p is position p of prompt + generated tokens (every row the target decoded: the last
    generated token is never decoded, so there is one row fewer than tokens)."""

    features: np.ndarray  # [n_rows, n_taps, n_embd] float32: hidden states entering the capture layers
    labels: np.ndarray    # [n_rows] int32: the target's argmax at row p (its prediction for p + 1), -1 unknown


@dataclass(frozen=True)
class Result:
    """The generated text, its tokens and the statistics of the run."""

    text: str
    tokens: list[int]
    stats: Stats = field(repr=False)
    probs: list[TokenProbs] | None = field(default=None, repr=False)  # with n_probs > 0
    capture: Capture | None = field(default=None, repr=False)  # with capture=True


_INT32_MAX = 2**31 - 1  # the C API's counts are int32


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling and stopping options, validated in Python before reaching C."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None       # GBNF with a "root" rule: every token obeys it (also drafts)
    grammar_prefix: str | None = None  # text the grammar consumes first (a template's generation prompt)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans the token
    n_probs: int = 0                 # > 0: Result.probs with this many candidates per token
    post_sampling_probs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or not -1 <= self.max_tokens <= _INT32_MAX:
            raise errors.InvalidArgumentError(f"max_tokens must be an int in [-1, {_INT32_MAX}], got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise errors.InvalidArgumentError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise errors.InvalidArgumentError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= _INT32_MAX:
            raise errors.InvalidArgumentError(f"top_k must be an int in [0, {_INT32_MAX}], got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise errors.InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise errors.InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise errors.InvalidArgumentError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise errors.InvalidArgumentError(f"stop strings must be non-empty str, got {self.stop!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise errors.InvalidArgumentError(f"grammar must be a GBNF string, got {type(self.grammar).__name__}")
        for item in self.logit_bias:
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], int)
                    or isinstance(item[0], bool) or not isinstance(item[1], (int, float)) or item[1] != item[1]):
                raise errors.InvalidArgumentError(f"logit_bias entries must be (token, number), got {item!r}")
        if not isinstance(self.n_probs, int) or isinstance(self.n_probs, bool) or not 0 <= self.n_probs <= _INT32_MAX:
            raise errors.InvalidArgumentError(f"n_probs must be an int in [0, {_INT32_MAX}], got {self.n_probs!r}")

    @classmethod
    def build(cls, stop: str | Sequence[str] | None = None, logit_bias=None, json_schema=None,  # type: ignore[no-untyped-def]
              **kwargs) -> "SamplingOptions":
        """Options from keyword arguments: ``stop`` a str or list, ``logit_bias`` a dict or pairs,
        ``json_schema`` (a dict or JSON text) turned into ``grammar`` by llama.cpp's converter."""
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if isinstance(logit_bias, dict):
            logit_bias = logit_bias.items()
        try:
            bias = tuple((t, float(b)) for t, b in (logit_bias or ()))
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError(f"logit_bias must map token ids to numbers, got {logit_bias!r}") from None
        if json_schema is not None:
            if kwargs.get("grammar"):
                raise errors.InvalidArgumentError("give a grammar or a json_schema, not both")
            from .chat import json_schema_to_grammar  # local: chat needs the native library

            kwargs["grammar"] = json_schema_to_grammar(json_schema)
        return cls(stop=stops, logit_bias=bias, **kwargs)

    def to_native(self, keepalive: list) -> object:
        """A ``dflash_generate_params *``; ``keepalive`` holds the C strings for the call."""
        params = ffi.new("dflash_generate_params *", lib.dflash_generate_default_params())
        params.max_tokens = self.max_tokens
        params.ignore_eos = self.ignore_eos
        params.sampling.temperature = self.temperature
        params.sampling.top_k = self.top_k
        params.sampling.top_p = self.top_p
        params.sampling.min_p = self.min_p
        params.sampling.seed = self.seed
        if self.stop:
            c_strings = [ffi.new("char[]", s.encode("utf-8")) for s in self.stop]
            array = ffi.new("const char *[]", c_strings)
            keepalive.extend([c_strings, array])
            params.stop = array
            params.n_stop = len(self.stop)
        if self.grammar:
            grammar = ffi.new("char[]", self.grammar.encode("utf-8"))
            keepalive.append(grammar)
            params.grammar = grammar
            if self.grammar_prefix:
                prefix = ffi.new("char[]", self.grammar_prefix.encode("utf-8"))
                keepalive.append(prefix)
                params.grammar_prefix = prefix
        if self.logit_bias:
            tokens = ffi.new("int32_t[]", [t for t, _ in self.logit_bias])
            biases = ffi.new("float[]", [float(b) for _, b in self.logit_bias])
            keepalive.extend([tokens, biases])
            params.logit_bias_tokens = tokens
            params.logit_bias = biases
            params.n_logit_bias = len(self.logit_bias)
        params.n_probs = self.n_probs
        params.post_sampling_probs = self.post_sampling_probs
        keepalive.append(params)
        return params


NativeCall = Callable[[object, object, object, object], int]  # (params, callback, user_data, out**)


def run(call: NativeCall, options: SamplingOptions, on_piece: Callable[[str], bool] | None = None) -> Result:
    """Run one native generation; ``on_piece`` receives streamed text and may return False to stop."""
    keepalive: list = []
    params = options.to_native(keepalive)
    failure: list[BaseException] = []
    on_token = piece_forwarder(on_piece, failure)

    handle = ffi.new_handle(on_token)
    out = ffi.new("dflash_output **")
    check(call(params, TOKEN_CALLBACK if on_piece else ffi.NULL, handle if on_piece else ffi.NULL, out))
    result = take_output(out[0])
    if failure:
        raise failure[0]
    return result


def piece_forwarder(on_piece: Callable[[str], bool | None] | None,
                    failure: list[BaseException] | None = None) -> Callable[[int, bytes], bool]:
    """The per-token callable behind a native token callback: decodes streamed UTF-8 bytes and
    forwards text to ``on_piece``; an exception stops the native loop (kept in ``failure``)."""
    decoder = _Utf8Pieces()

    def on_token(token: int, piece: bytes) -> bool:
        if on_piece is None:
            return True
        try:
            text = decoder.feed(piece)
            return on_piece(text) is not False if text else True
        except BaseException as exc:
            if failure is not None:
                failure.append(exc)
            return False

    return on_token


def take_output(output) -> Result:  # type: ignore[no-untyped-def]
    """Copy a native ``dflash_output`` into a ``Result`` and free it."""
    try:
        n = ffi.new("int32_t *")
        tokens_ptr = lib.dflash_output_tokens(output, n)
        tokens = list(ffi.unpack(tokens_ptr, n[0])) if n[0] else []
        n_bytes = ffi.new("size_t *")
        text_ptr = lib.dflash_output_text(output, n_bytes)
        text = ffi.unpack(text_ptr, n_bytes[0]).decode("utf-8", "replace")
        stats = Stats.from_native(lib.dflash_output_stats(output))
        probs = read_probs(output, tokens)
        capture = read_capture(output)
    finally:
        lib.dflash_output_free(output)
    return Result(text=text, tokens=tokens, stats=stats, probs=probs, capture=capture)


def read_capture(output) -> Capture | None:  # type: ignore[no-untyped-def]
    """A copy of a native output's captured training rows (None: not asked for)."""
    n_rows, n_taps, n_embd = ffi.new("int32_t *"), ffi.new("int32_t *"), ffi.new("int32_t *")
    labels = ffi.new("int32_t **")
    feats = lib.dflash_output_capture(output, n_rows, n_taps, n_embd, labels)
    if n_taps[0] <= 0:
        return None
    n, shape = n_rows[0], (n_rows[0], n_taps[0], n_embd[0])
    if n == 0:
        return Capture(np.zeros(shape, dtype=np.float32), np.zeros(0, dtype=np.int32))
    values = np.frombuffer(ffi.buffer(feats, 4 * n * n_taps[0] * n_embd[0]), dtype=np.float32).reshape(shape).copy()
    return Capture(values, np.frombuffer(ffi.buffer(labels[0], 4 * n), dtype=np.int32).copy())


def read_probs(output, tokens: Sequence[int], first: int = 0) -> list[TokenProbs] | None:  # type: ignore[no-untyped-def]
    """The per-token probabilities of a native output from token ``first`` on (None: not asked)."""
    n_tok, n_probs = ffi.new("int32_t *"), ffi.new("int32_t *")
    lp, ids, tlp = ffi.new("float **"), ffi.new("int32_t **"), ffi.new("float **")
    lib.dflash_output_probs(output, n_tok, n_probs, lp, ids, tlp)
    k = n_probs[0]
    if k <= 0:
        return None
    n = min(n_tok[0], len(tokens))
    out = []
    for i in range(first, n):
        top = tuple((int(ids[0][i * k + j]), float(tlp[0][i * k + j])) for j in range(k) if ids[0][i * k + j] >= 0)
        out.append(TokenProbs(token=int(tokens[i]), logprob=float(lp[0][i]), top=top))
    return out


def stream(call: NativeCall, options: SamplingOptions, lock: threading.Lock,
           on_result: Callable[[Result], None] | None = None) -> Iterator[str]:
    """Yield text pieces of one native generation call (see ``stream_call``)."""
    return stream_call(lambda on_piece: run(call, options, on_piece), lock, on_result)


def stream_call(call: Callable[[Callable[[str], bool]], Result], lock: threading.Lock,
                on_result: Callable[[Result], None] | None = None) -> Iterator[str]:
    """Yield text pieces as they are produced; closing the iterator cancels the generation.
    ``call(on_piece)`` runs the generation, feeding ``on_piece``; ``on_result`` receives the
    finished ``Result`` (statistics included).

    The generation runs on a worker thread under ``lock`` (cffi releases the GIL during native
    calls) and hands pieces over a queue, so the caller sees tokens as soon as they are committed.
    """
    pieces: queue.Queue = queue.Queue()
    cancelled = threading.Event()
    done = object()
    outcome: list = []

    def on_piece(text: str) -> bool:
        pieces.put(text)
        return not cancelled.is_set()

    def worker() -> None:
        try:
            with lock:
                outcome.append(call(on_piece))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            pieces.put(done)

    thread = threading.Thread(target=worker, name="pydflash-stream", daemon=True)
    thread.start()
    try:
        while True:
            item = pieces.get()
            if item is done:
                break
            yield item
    finally:
        cancelled.set()
        thread.join()
    if outcome and isinstance(outcome[0], BaseException):
        raise outcome[0]
    if outcome and on_result is not None:
        on_result(outcome[0])


class _Utf8Pieces:
    """Incremental UTF-8 decoding of streamed bytes (pieces may split a character)."""

    def __init__(self) -> None:
        import codecs

        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)
