"""``Target``: a GGUF model driven through the native core (libllama underneath).

It owns one native handle: ``close()`` (or a ``with`` block) frees it; afterwards every method
raises ``ClosedError``. Calls on one Target are serialised by a lock, so it can be shared between
threads safely (they simply take turns).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .. import errors
from . import generation
from ._handle import NativeObject
from ._bindings import check, ffi, lib, read_string
from .generation import Result, SamplingOptions

_TAP_SOURCES = {"auto": lib.DFLASH_TAP_AUTO, "layer_input": lib.DFLASH_TAP_LAYER_INPUT, "eval": lib.DFLASH_TAP_EVAL}


@dataclass(frozen=True)
class TargetInfo:
    """Shape facts of a loaded target."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ctx: int
    n_ctx_train: int
    n_seq_max: int
    token_bos: int
    token_eos: int
    add_bos: bool
    add_eos: bool = False
    # fill-in-the-middle tokens (-1: the vocab has none), as /infill uses them
    token_fim_pre: int = -1
    token_fim_suf: int = -1
    token_fim_mid: int = -1
    token_fim_pad: int = -1
    token_fim_rep: int = -1
    token_fim_sep: int = -1
    token_sep: int = -1
    # how rejected verify rows leave the target's memory: "kv" (attention cells removed),
    # "snapshots" (recurrent state kept per verified row), "checkpoint" (recurrent state saved
    # before a block, restored and the accepted rows decoded again after a rejection)
    rollback: str = "kv"
    n_verify_max: int = 0  # most drafts one verify block may carry (0: the target cannot verify drafts)
    tap_source: str = "layer_input"  # how hidden states are read: "layer_input" or "eval"


_ROLLBACKS = {0: "kv", 1: "snapshots", 2: "checkpoint"}


Message = dict  # {"role": str, "content": str}


class Target(NativeObject):
    """A GGUF target model with plain autoregressive generation and the low-level hooks a DFlash
    drafter needs (hidden-state taps, batched decode, KV rollback).

    Args:
        model: path to a GGUF file, a ``pydflash models`` name (pulled on first use), or
            ``hf:ORG/NAME[:QUANT]`` (fetched into the Hugging Face cache, ``pydflash.fetch.hub``).
        n_ctx: context window in tokens.
        n_batch: most tokens per decode call.
        n_threads: CPU threads (None: all cores).
        n_gpu_layers: layers offloaded in GPU builds (-1: all).
        n_seq_max: sequences decoded together.
        tap_source: "auto", "layer_input" or "eval" (how hidden states are captured).
        verbose: let libllama log to stderr.

    Example:
        >>> with Target("smollm2-135m") as t:
        ...     print(t.generate("The capital of France is", max_tokens=8, temperature=0).text)
    """

    _free = staticmethod(lib.dflash_target_free)
    _chat = None  # ChatTemplates, made on the first apply_chat_template

    def close(self) -> None:
        if self._chat is not None:
            self._chat.close()
            self._chat = None
        super().close()

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        n_seq_max: int = 1,
        tap_source: str = "auto",
        verbose: bool = False,
    ) -> None:
        super().__init__()
        self._embed_lock = threading.Lock()
        from ..fetch import registry as models  # local import: models pulls only when asked

        for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_seq_max", n_seq_max)):
            if not isinstance(value, int) or value < 1:
                raise errors.InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise errors.InvalidArgumentError(f"n_threads must be a positive int or None, got {n_threads!r}")
        if tap_source not in _TAP_SOURCES:
            raise errors.InvalidArgumentError(f"tap_source must be one of {sorted(_TAP_SOURCES)}")
        try:
            self.path = str(models.resolve(model))
        except ValueError as exc:  # neither a file nor a known model name
            raise errors.ModelNotFoundError(str(exc)) from None
        lib.dflash_set_verbose(verbose)
        params = ffi.new("dflash_target_params *", lib.dflash_target_default_params())
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_threads = n_threads or 0
        params.n_gpu_layers = n_gpu_layers
        self.n_gpu_layers = n_gpu_layers  # as asked (where the target runs: part of the autotuner's cache key)
        params.n_seq_max = n_seq_max
        params.tap_source = _TAP_SOURCES[tap_source]
        out = ffi.new("dflash_target **")
        check(lib.dflash_target_load(self.path.encode(), params, out))
        self._handle = out[0]
        info = ffi.new("dflash_target_info *")
        check(lib.dflash_target_get_info(self._handle, info))
        self.info = TargetInfo(
            n_vocab=info.n_vocab,
            n_embd=info.n_embd,
            n_layer=info.n_layer,
            n_ctx=info.n_ctx,
            n_ctx_train=info.n_ctx_train,
            n_seq_max=info.n_seq_max,
            token_bos=info.token_bos,
            token_eos=info.token_eos,
            add_bos=bool(info.add_bos),
            add_eos=bool(info.add_eos),
            token_fim_pre=info.token_fim_pre,
            token_fim_suf=info.token_fim_suf,
            token_fim_mid=info.token_fim_mid,
            token_fim_pad=info.token_fim_pad,
            token_fim_rep=info.token_fim_rep,
            token_fim_sep=info.token_fim_sep,
            token_sep=info.token_sep,
            rollback=_ROLLBACKS.get(info.rollback, "kv"),
            n_verify_max=info.n_verify_max,
            tap_source={v: k for k, v in _TAP_SOURCES.items()}.get(info.tap_source, "eval"),
        )


    # -- text ----------------------------------------------------------------------------------

    def meta(self, key: str) -> str:
        """A metadata value of the GGUF, as a string (InvalidArgumentError if the key is absent)."""
        size = 4096
        with self._lock:
            for _ in range(3):  # dflash_target_meta reports no length: grow until the value fits
                buf = ffi.new("char[]", size)
                status = lib.dflash_target_meta(self._h(), key.encode(), buf, size)
                if status == lib.DFLASH_ERR_BUFFER_TOO_SMALL:
                    size *= 16
                    continue
                check(status)
                return ffi.string(buf).decode("utf-8", "replace")
        raise errors.InternalError(f"metadata value of {key!r} is too long")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids (BOS added when the model wants it and add_special is set)."""
        if not isinstance(text, str):
            raise errors.InvalidArgumentError(f"text must be str, got {type(text).__name__}")
        data = text.encode("utf-8")
        with self._lock:
            n_out = ffi.new("int32_t *")
            size = len(data) + 8
            for _ in range(2):
                buf = ffi.new("int32_t[]", size)
                status = lib.dflash_target_tokenize(self._h(), data, len(data), add_special, parse_special, buf, size, n_out)
                if status == lib.DFLASH_ERR_BUFFER_TOO_SMALL:
                    size = n_out[0]
                    continue
                check(status)
                return list(ffi.unpack(buf, n_out[0]))
        raise errors.InternalError("tokenize buffer kept growing")

    def detokenize(self, tokens: Sequence[int], *, render_special: bool = False) -> str:
        """Token ids to text."""
        array = self._token_array(tokens, allow_empty=True)
        with self._lock:
            return read_string(
                lambda buf, n, out: lib.dflash_target_detokenize(self._h(), array, len(tokens), render_special, buf, n, out)
            )

    def detokenize_bytes(self, tokens: Sequence[int], *, render_special: bool = False) -> bytes:
        """Token ids to the raw bytes of their pieces (``detokenize`` decodes them; a piece may
        stop inside a UTF-8 character, as a streamed one does)."""
        array = self._token_array(tokens, allow_empty=True)
        n = len(array)
        size = 16 * n + 64
        with self._lock:
            for _ in range(2):
                buf = ffi.new("char[]", size)
                n_out = ffi.new("size_t *")
                status = lib.dflash_target_detokenize(self._h(), array, n, render_special, buf, size, n_out)
                if status == lib.DFLASH_ERR_BUFFER_TOO_SMALL:
                    size = n_out[0] + 1
                    continue
                check(status)
                return ffi.unpack(buf, n_out[0])
        raise errors.InternalError("detokenize buffer kept growing")

    def apply_chat_template(self, messages: Sequence[Message], *, add_assistant: bool = True,
                            jinja: bool = True) -> str:
        """Format chat messages with the model's own template: by llama.cpp's Jinja engine, as
        llama-server (and ``pydflash serve``) do by default; ``jinja=False``: libllama's built-in
        template matcher (llama-server's ``--no-jinja``). A final assistant message is continued."""
        roles, contents = _split_messages(messages)
        if jinja:
            with self._lock:
                if self._chat is None:
                    from .chat import ChatTemplates  # local: a cycle otherwise

                    self._chat = ChatTemplates(self)
            body = {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents)],
                    "add_generation_prompt": add_assistant}
            return self._chat.render(body)["prompt"]
        c_roles = [ffi.new("char[]", r.encode()) for r in roles]
        c_contents = [ffi.new("char[]", c.encode()) for c in contents]
        r_array = ffi.new("const char *[]", c_roles) if roles else ffi.NULL
        c_array = ffi.new("const char *[]", c_contents) if roles else ffi.NULL
        with self._lock:
            return read_string(
                lambda buf, n, out: lib.dflash_target_apply_chat_template(
                    self._h(), r_array, c_array, len(roles), add_assistant, buf, n, out
                )
            )

    POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3}

    def embed(self, tokens: Sequence[int], *, pooling: str = "mean") -> np.ndarray:
        """Embeddings computed by libllama with its own pooling ("none": one row per token;
        "mean", "cls", "last": one row), un-normalised: float32 [n_rows, n_embd]. Runs on a
        second context of the same weights, made on first use."""
        if pooling not in self.POOLING:
            raise errors.InvalidArgumentError(f"pooling must be one of {sorted(self.POOLING)}, got {pooling!r}")
        array = self._token_array(tokens, allow_empty=False)
        n_rows = ffi.new("int32_t *")
        n_out = ffi.new("size_t *")
        rows = len(tokens) if pooling == "none" else 1
        size = rows * self.info.n_embd
        with self._embed_lock:  # one embedding context: calls take turns (generation does not wait)
            return self._embed(array, len(tokens), pooling, size, n_out, n_rows)

    def _embed(self, array, n_tokens: int, pooling: str, size: int, n_out, n_rows) -> np.ndarray:  # type: ignore[no-untyped-def]
        for _ in range(2):
            buf = np.empty(size, dtype=np.float32)
            status = lib.dflash_target_embed(self._h(), array, n_tokens, self.POOLING[pooling],
                                             ffi.cast("float *", buf.ctypes.data), size, n_out, n_rows)
            if status == lib.DFLASH_ERR_BUFFER_TOO_SMALL:
                size = n_out[0]
                continue
            check(status)
            return buf[: n_out[0]].reshape(n_rows[0], -1)
        raise errors.InternalError("embedding buffer size changed between calls")

    def is_eog(self, token: int) -> bool:
        with self._lock:
            return bool(lib.dflash_target_token_is_eog(self._h(), token))

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **options) -> Result:  # type: ignore[no-untyped-def]
        """Plain autoregressive generation.

        Args:
            prompt: text (tokenized with the model's BOS rule) or token ids.
            max_tokens, temperature, top_k, top_p, min_p, seed, stop, ignore_eos: see
                ``SamplingOptions``; temperature 0 is greedy.
        Returns:
            ``Result(text, tokens, stats)``.
        """
        call, opts = self._generation(prompt, options)
        with self._lock:
            return generation.run(call, opts)

    def stream(self, prompt: str | Sequence[int], **options) -> Iterator[str]:  # type: ignore[no-untyped-def]
        """Like ``generate`` but yields text pieces as they are produced."""
        call, opts = self._generation(prompt, options)
        return generation.stream(call, opts, self._lock)

    def chat(self, messages: Sequence[Message], **options) -> Result:  # type: ignore[no-untyped-def]
        """Generate the assistant's reply to chat messages (the model's chat template)."""
        prompt = self.apply_chat_template(messages)
        return self.generate(self.tokenize(prompt, parse_special=True), **options)

    def _generate_replay(self, prompt: Sequence[int], continuation: Sequence[int], *, offset: int,
                         n_max: int = 7, n_min: int = 0, **options) -> Result:  # type: ignore[no-untyped-def]
        """Testing hook: the speculative loop with scripted drafts (see dflash_target_generate_replay)."""
        opts = SamplingOptions.build(**options)
        tokens = list(prompt)
        array = self._token_array(tokens, allow_empty=False)
        script = self._token_array(continuation, allow_empty=True)
        spec = ffi.new("dflash_spec_params *", {"n_max": n_max, "n_min": n_min})

        def call(params, callback, user_data, out):  # type: ignore[no-untyped-def]
            return lib.dflash_target_generate_replay(self._h(), array, len(tokens), script, len(continuation), offset,
                                                     spec, params, callback, user_data, out)

        with self._lock:
            return generation.run(call, opts)

    def _generation(self, prompt: str | Sequence[int], options: dict):  # type: ignore[no-untyped-def]
        opts = SamplingOptions.build(**options)
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        array = self._token_array(tokens, allow_empty=False)
        self._h()  # fail early when closed

        def call(params, callback, user_data, out):  # type: ignore[no-untyped-def]
            # runs under the lock; the handle is read here so a close() in between is seen
            return lib.dflash_target_generate(self._h(), array, len(tokens), params, callback, user_data, out)

        return call, opts

    # -- low level: taps, decode, rollback -------------------------------------------------------

    def set_taps(self, layers: Sequence[int]) -> None:
        """Capture the hidden state entering each of ``layers`` for every decoded row."""
        layers = [int(x) for x in layers]
        with self._lock:
            check(lib.dflash_target_set_taps(self._h(), ffi.new("int32_t[]", layers), len(layers)))

    def decode(
        self, tokens: Sequence[int], *, pos: Sequence[int] | None = None, seq_id: int = 0, all_logits: bool = False
    ) -> None:
        """Decode a batch of tokens on one sequence (pos None: continue after its end)."""
        array = self._token_array(tokens, allow_empty=False)
        if pos is not None and len(pos) != len(tokens):
            raise errors.InvalidArgumentError("pos must have one entry per token")
        pos_array = ffi.new("int32_t[]", [int(p) for p in pos]) if pos is not None else ffi.NULL
        with self._lock:
            check(lib.dflash_target_decode(self._h(), seq_id, array, pos_array, len(tokens), all_logits))

    def logits(self, row: int = -1) -> np.ndarray:
        """Logits of one row of the last decode (a copy)."""
        with self._lock:
            out = ffi.new("const float **")
            check(lib.dflash_target_logits(self._h(), row, out))
            return np.frombuffer(ffi.buffer(out[0], 4 * self.info.n_vocab), dtype=np.float32).copy()

    def tap_rows(self, tap_index: int) -> np.ndarray:
        """Captured features [n_rows, n_embd] of one tap from the last decode (a copy)."""
        with self._lock:
            out = ffi.new("const float **")
            n_rows = ffi.new("int32_t *")
            check(lib.dflash_target_tap_rows(self._h(), tap_index, out, n_rows))
            size = n_rows[0] * self.info.n_embd
            return np.frombuffer(ffi.buffer(out[0], 4 * size), dtype=np.float32).reshape(n_rows[0], -1).copy()

    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Highest position held in the KV cache for a sequence (-1 when empty)."""
        with self._lock:
            return int(lib.dflash_target_seq_pos_max(self._h(), seq_id))

    def rollback(self, pos: int, *, seq_id: int = 0) -> None:
        """Forget positions >= pos of a sequence (0 clears it)."""
        with self._lock:
            check(lib.dflash_target_rollback(self._h(), seq_id, pos))

    def _token_array(self, tokens: Sequence[int], *, allow_empty: bool):  # type: ignore[no-untyped-def]
        try:
            values = [int(t) for t in tokens]
        except (TypeError, ValueError):
            raise errors.InvalidArgumentError("tokens must be a sequence of ints") from None
        if not values and not allow_empty:
            raise errors.InvalidArgumentError("the token list is empty")
        bad = [t for t in values if not 0 <= t < self.info.n_vocab]
        if bad:
            raise errors.InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary (0..{self.info.n_vocab - 1})")
        return ffi.new("int32_t[]", values)


def _split_messages(messages: Sequence[Message]) -> tuple[list[str], list[str]]:
    roles, contents = [], []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise errors.InvalidArgumentError(f"each message must be {{'role': str, 'content': str}}, got {m!r}")
        roles.append(m["role"])
        contents.append(m["content"])
    if not roles:
        raise errors.InvalidArgumentError("no messages")
    return roles, contents
