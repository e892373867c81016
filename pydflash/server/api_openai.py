"""OpenAI's API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (and its
``/input_tokens``), ``/v1/embeddings``: routes, request parsing and answers (SSE chunks included).

A chat request is rendered whole by the model's Jinja chat templates (tools, tool calls,
reasoning, response_format, template kwargs); Anthropic's and the Responses API's requests are
converted to one and go through ``chat_jobs`` too. With ``verbose`` (or the server's --verbose)
an answer carries llama.cpp's native answer as ``__verbose``, as llama-server's debug mode does.
"""

from __future__ import annotations

import base64
import struct
import uuid
from collections.abc import Sequence
from typing import Any

from .. import errors
from .answers import FINISH_REASONS, SYSTEM_FINGERPRINT, now, timed, usage
from .api_llama import check_embeddings, embed, embedding_inputs, embedding_rows, native_answer
from .jobs import (APIError, Job, check_model, field_value, from_engine_error, is_bool, parse_chat, parse_prompts,
                   template_input)

__all__ = ["chat_jobs", "count_chat_tokens", "oai_logprobs", "register"]


def register(http, router) -> None:  # type: ignore[no-untyped-def]
    routes = _OpenAI(http)
    router.add_get("/v1/models", routes.models)
    router.add_get("/models", routes.models)
    router.add_post("/v1/completions", routes.completions)
    router.add_post("/v1/chat/completions", routes.chat)
    router.add_post("/chat/completions", routes.chat)
    router.add_post("/chat/completions/input_tokens", routes.chat_input_tokens)
    router.add_post("/v1/chat/completions/input_tokens", routes.chat_input_tokens)
    router.add_post("/v1/embeddings", routes.embeddings)


def chat_jobs(http, body: dict, max_names: list[str], *, allow_empty: bool = False):  # type: ignore[no-untyped-def]
    """Jobs of a chat request (OpenAI's, or Anthropic's / Responses' converted to it): checked
    here, rendered whole by the Jinja templates on the step loop, as its token count renders it."""
    messages = parse_chat(body, allow_empty=allow_empty)
    return http.jobs(body, [("chat", messages)], max_names, chat=True)


async def count_chat_tokens(http, body: dict) -> int:  # type: ignore[no-untyped-def]
    """The prompt tokens of a checked chat request (no messages: 0), rendered as its generation
    renders it (the raw messages: tools, tool calls and reasoning included)."""
    if not body.get("messages"):
        return 0
    rendered = template_input(body)

    def run(engine):  # type: ignore[no-untyped-def]
        try:
            return len(http.steps.render_chat(rendered)[1])
        except (errors.InvalidArgumentError, RecursionError) as exc:
            raise from_engine_error(exc) from None

    return await http.on_loop(run)


def stream_usage(body: dict) -> bool:
    """``stream_options.include_usage``: a last chunk with the usage."""
    so = body.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


def _piece(detok, token: int) -> tuple[str, list[int]]:  # type: ignore[no-untyped-def]
    raw = detok(token)
    return raw.decode("utf-8", "replace"), list(raw)


def oai_logprobs(probs: Sequence[Any], detok) -> dict:  # type: ignore[no-untyped-def]
    """OpenAI chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for tp in probs:
        text, raw = _piece(detok, tp.token)
        tops = []
        for t, lp in tp.top:
            tt, tr = _piece(detok, t)
            tops.append({"id": t, "token": tt, "bytes": tr, "logprob": lp})
        content.append({"id": tp.token, "token": text, "bytes": raw, "logprob": tp.logprob, "top_logprobs": tops})
    return {"content": content}


def base64_floats(row: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(row)}f", *row)).decode("ascii")


class _OpenAI:
    def __init__(self, http) -> None:  # type: ignore[no-untyped-def]
        self.http = http

    async def models(self, request):  # type: ignore[no-untyped-def]
        info = self.http.engine.target.info
        meta = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                "n_ctx_slot": self.http.steps.n_ctx_slot, "speculative": self.http.speculative}
        data = [{"id": self.http.model_id, "object": "model", "created": self.http.created, "owned_by": "llamacpp",
                 "meta": meta, "aliases": list(self.http.config.aliases), "tags": list(self.http.config.tags)}]
        return self.http.json({"object": "list", "data": data})

    async def completions(self, request):  # type: ignore[no-untyped-def]
        body = await self.http.read_body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = parse_prompts(body["prompt"])
        common, jobs, out = self.http.jobs(body, prompts, ["max_tokens", "n_predict"])
        # as llama-server: --verbose (its debug mode) adds __verbose to every OpenAI answer
        verbose = field_value(body, ["verbose"], is_bool, "a boolean", False) or self.http.config.verbose
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": now(),
                "model": self.http.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

        def choice(i: int, text: str, finish: str | None) -> dict:
            return {"text": text, "index": i, "logprobs": None, "finish_reason": finish}

        if common.stream:
            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                if kind == "piece":
                    return [timed({**base, "choices": [choice(i, payload.text, None)]}, payload.timings)]
                if kind == "progress":
                    return [timed({**base, "choices": [choice(i, "", None)], "prompt_progress": payload.report},
                                  payload.timings)]
                return [{**base, "choices": [choice(i, "", FINISH_REASONS[payload.stats.stop_reason])],
                         "timings": self.http.timings(payload)}]

            def tail(results: list) -> list:
                return [{**base, "choices": [], "usage": usage(results)}] if stream_usage(body) else []

            return await self.http.serve(jobs, lambda: self.http.stream(request, jobs, out, emit, tail))

        async def run():  # type: ignore[no-untyped-def]
            results = await self.http.collect(jobs, out)
            data = {**base, "choices": [choice(i, r.text, FINISH_REASONS[r.stats.stop_reason])
                                        for i, r in enumerate(results)], "usage": usage(results)}
            if verbose and len(results) == 1:
                data["__verbose"] = native_answer(self.http, jobs[0], results[0], results[0].text, [],
                                                  common.options["stop"])
            return self.reply(data, results)

        return await self.http.serve(jobs, run)

    def reply(self, data: dict, results: list):  # type: ignore[no-untyped-def]
        """A non-streamed OpenAI answer; one choice also carries llama-server's ``timings``."""
        if len(results) == 1:
            data["timings"] = self.http.timings(results[0])
        return self.http.json(data)

    def assistant_message(self, job: Job, res) -> dict:  # type: ignore[no-untyped-def]
        """The reply as an OpenAI message: the template's parser splits content / reasoning /
        tool calls (plain content when the template has no such format)."""
        chat = self.http.steps.chat
        if chat is None or job.render is None:
            return {"role": "assistant", "content": res.text}
        try:
            msg = chat.parse(job.render, res.text)
        except Exception:  # noqa: BLE001 - a reply the parser cannot split stays plain content
            return {"role": "assistant", "content": res.text}
        msg.setdefault("role", "assistant")
        if msg.get("content") is None and not msg.get("tool_calls"):
            msg["content"] = ""
        return msg

    async def chat(self, request):  # type: ignore[no-untyped-def]
        body = await self.http.read_body(request)
        common, jobs, out = chat_jobs(self.http, body, ["max_completion_tokens", "max_tokens", "n_predict"])
        # as llama-server: --verbose (its debug mode) adds __verbose to every OpenAI answer
        verbose = field_value(body, ["verbose"], is_bool, "a boolean", False) or self.http.config.verbose
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", now()
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.http.model_id,
                "system_fingerprint": SYSTEM_FINGERPRINT}

        if common.stream:
            began: set[int] = set()

            def chunk(i: int, delta: dict) -> dict:
                return {**base, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}

            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                msgs = []
                if i not in began and kind in ("piece", "progress"):
                    began.add(i)  # as llama-server: a role-only first chunk
                    msgs.append(chunk(i, {"role": "assistant", "content": None}))
                if kind == "piece" and payload.text:
                    msgs.append(timed(chunk(i, {"content": payload.text}), payload.timings))
                    if payload.probs:
                        msgs[-1]["choices"][0]["logprobs"] = oai_logprobs(payload.probs, self.http.piece_bytes)
                elif kind == "progress":
                    msgs[-1:] = [timed({**(msgs[-1] if msgs else chunk(i, {})), "prompt_progress": payload.report},
                                       payload.timings)]
                elif kind == "done":
                    if i not in began:
                        began.add(i)
                        msgs.append(chunk(i, {"role": "assistant", "content": None}))
                    final = {**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                  "finish_reason": FINISH_REASONS[payload.stats.stop_reason]}]}
                    if not stream_usage(body):
                        final["timings"] = self.http.timings(payload)
                    msgs.append(final)
                return msgs

            def tail(results: list) -> list:
                if not stream_usage(body):
                    return []
                last = {**base, "choices": [], "usage": usage(results)}
                if len(results) == 1:
                    last["timings"] = self.http.timings(results[0])
                return [last]

            return await self.http.serve(jobs, lambda: self.http.stream(request, jobs, out, emit, tail))

        async def run():  # type: ignore[no-untyped-def]
            results = await self.http.collect(jobs, out)
            data = {"id": cid, "object": "chat.completion", "created": created, "model": self.http.model_id,
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [{"index": i, "message": self.assistant_message(jobs[i], r),
                                 "logprobs": (oai_logprobs(r.probs, self.http.piece_bytes)
                                              if r.probs is not None else None),
                                 "finish_reason": FINISH_REASONS[r.stats.stop_reason]}
                                for i, r in enumerate(results)],
                    "usage": usage(results)}
            if verbose and len(results) == 1:
                data["__verbose"] = native_answer(self.http, jobs[0], results[0], results[0].text, [],
                                                  common.options["stop"])
            return self.reply(data, results)

        return await self.http.serve(jobs, run)

    async def chat_input_tokens(self, request):  # type: ignore[no-untyped-def]
        """/chat/completions/input_tokens: the prompt tokens a chat request would have."""
        body = await self.http.read_body(request)
        parse_chat(body)
        return self.http.json({"input_tokens": await count_chat_tokens(self.http, body),
                               "object": "response.input_tokens"})

    async def embeddings(self, request):  # type: ignore[no-untyped-def]
        check_embeddings(self.http.config)
        body = await self.http.read_body(request)
        check_model(body)
        if self.http.config.pooling == "none":
            raise APIError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        value = body.get("input", body.get("content"))
        if value is None:
            raise APIError(400, "\"input\" must be provided")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise APIError(400, "The format to return the embeddings in. Can be either float or base64")
        inputs = embedding_inputs(self.http, value, "input")
        rows = await embed(self.http, inputs, self.http.config.pooling)
        data = []
        n_tokens = 0
        for i, (toks, r) in enumerate(zip(inputs, rows)):
            vec = embedding_rows(r, 2)[0]
            item: dict[str, Any] = {"embedding": base64_floats(vec) if fmt == "base64" else vec, "index": i,
                                    "object": "embedding"}
            if fmt == "base64":
                item["encoding_format"] = "base64"
            data.append(item)
            n_tokens += len(toks)
        return self.http.json({
            "model": body.get("model") or self.http.model_id, "object": "list",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})
