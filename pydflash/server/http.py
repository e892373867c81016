"""The HTTP side: aiohttp routes, the API-key / error middleware, SSE streaming.

Handlers parse a request into jobs (``requests.py``), hand them to the step loop (``loop.py``)
and turn its events into OpenAI / llama.cpp responses (``responses.py``). A handler waits until
its jobs passed the step loop's prompt checks before it answers, so a bad prompt is a plain
HTTP 400 even when streaming. A client that disconnects cancels its jobs: aiohttp cancels the
handler (``handler_cancellation``), a failed stream write raises, and either way the handler's
``finally`` asks the step loop to cancel what has not finished.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from .. import errors
from .command_line import ServerConfig
from .loop import SlotView, StepLoop
from .metrics import Metrics
from . import api_vertex, cors_proxy
from .api_llama import NativeRoutes
from .api_anthropic import (anthropic_message, anthropic_stop, anthropic_to_chat, random_id, responses_body,
                     responses_to_chat)
from .jobs import (APIError, Job, answer_of, check_continuation, client_input, from_engine_error, make_jobs,
                       parse_body, parse_common, parse_messages, parse_prompts)
from .jobs import field_value as _field
from .features import check_infill, infill_tokens, oai_logprobs, parse_constraints, probs_json
from .text import detokenize, piece_json, token_bytes, tokenize_mixed
from .answers import (FINISH_REASONS, STOP_TYPES, SYSTEM_FINGERPRINT, nested_fields, now, settings, sse, timings,
                        usage)

__all__ = ["HTTPServer"]

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})
# answered from what was published at load: they do not wake a sleeping server (as llama-server's)
NO_WAKE_PATHS = PUBLIC_PATHS | {"/props", "/models", "/v1/models", "/metrics", "/cors-proxy"}
INDEX_HTML = ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>pydflash serve</title></head>"
              "<body><p>pydflash serve: an OpenAI / llama-server compatible API (no web UI is shipped).</p>"
              "</body></html>\n")


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _timed(msg: dict, timings: dict | None) -> dict:
    """A streamed message with the timings so far (``timings_per_token``), as llama-server's."""
    if timings is not None:
        msg["timings"] = timings
    return msg


def _is_localhost_origin(origin: str) -> bool:
    from urllib.parse import urlsplit

    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class HTTPServer:
    """The aiohttp application over a ``StepLoop``."""

    def __init__(self, config: ServerConfig, metrics: Metrics, steps: StepLoop) -> None:
        from aiohttp import web

        self.web = web
        self.config = config
        self.metrics = metrics
        self.steps = steps
        self.ready = False                # loaded and warmed up: /health answers 200
        self.load_error: str | None = None
        self.created = int(time.time())
        self.started = int(time.time())   # llama-server's Process-Start-Time-Unix
        self.app = web.Application(middlewares=[self._middleware()], client_max_size=256 * 1024 * 1024)
        self.app.on_response_prepare.append(self._cors)
        r = self.app.router
        if config.webui:
            r.add_get("/", self.index)
        r.add_get("/health", self.health)
        r.add_get("/v1/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/models", self.models)
        r.add_post("/v1/completions", self.oai_completions)
        r.add_post("/completions", self.completion)  # llama-server: the native endpoint, not OpenAI's
        r.add_post("/v1/chat/completions", self.oai_chat)
        r.add_post("/chat/completions", self.oai_chat)
        r.add_post("/completion", self.completion)
        r.add_post("/chat/completions/input_tokens", self.chat_input_tokens)
        r.add_post("/v1/chat/completions/input_tokens", self.chat_input_tokens)
        r.add_post("/v1/messages", self.anthropic_messages)
        r.add_post("/v1/messages/count_tokens", self.anthropic_count_tokens)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/responses", self.responses)
        r.add_post("/v1/responses/input_tokens", self.responses_input_tokens)
        r.add_post("/responses/input_tokens", self.responses_input_tokens)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/infill", self.infill)
        NativeRoutes(self).register(r)  # /apply-template, embeddings, slot files
        r.add_get("/slots", self.slots)
        r.add_get("/props", self.props)
        r.add_get("/metrics", self.prometheus)
        cors_proxy.register(self, r)  # --ui-mcp-proxy
        api_vertex.register(self, r)  # AIP_MODE=PREDICTION: Vertex AI's /predict over the routes above

    # -- names -----------------------------------------------------------------------------------------

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self.steps.engine

    @property
    def speculative(self) -> bool:
        return self.engine is not None and self.engine.drafter is not None

    @property
    def model_path(self) -> str:
        return self.engine.target.path if self.engine is not None else ""

    @property
    def model_id(self) -> str:
        if self.config.aliases:
            return sorted(self.config.aliases)[0]  # as llama-server (a set of names)
        return os.path.basename(self.model_path or self.config.model)

    def _settings(self, job: Job | None) -> dict:
        c = self.config
        if job is None:  # the server's defaults of a request (--seed, --temp, --n-predict)
            options = {"seed": None if c.seed == -1 else c.seed, "temperature": c.temperature,
                       "max_tokens": c.n_predict}
        else:
            options = {**job.options, "seed": job.seed if job.seed is not None else job.options.get("seed")}
        return settings(options, *self.steps.spec_of(job), speculative=self.speculative,
                        logit_bias=job.logit_bias if job is not None else None, eog=self.steps.eog_tokens())

    # -- middleware ----------------------------------------------------------------------------------

    def _json_error(self, err: APIError):  # type: ignore[no-untyped-def]
        return self.web.json_response(err.body(), status=err.status)

    def _middleware(self):  # type: ignore[no-untyped-def]
        """API key check, 503 while loading, and every error as an OpenAI-style JSON body."""
        web = self.web

        @web.middleware
        async def middleware(request, handler):  # type: ignore[no-untyped-def]
            if request.method == "OPTIONS":  # a CORS preflight: answered before any check (no key is sent)
                c = self.config
                return web.Response(status=200, text="", content_type="text/html", headers={
                    "Access-Control-Allow-Credentials": "true" if c.cors_credentials else "false",
                    "Access-Control-Allow-Methods": c.cors_methods, "Access-Control-Allow-Headers": c.cors_headers})
            try:
                keys = self.config.api_keys
                if keys and request.path not in PUBLIC_PATHS and request.method != "OPTIONS":
                    given = request.headers.get("Authorization", "") or request.headers.get("X-Api-Key", "")
                    given = given.removeprefix("Bearer ")
                    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
                        raise APIError(401, "Invalid API Key", "authentication_error")
                if request.path not in PUBLIC_PATHS and not self.ready:
                    raise APIError(503, self.load_error or "Loading model", "unavailable_error")
                if request.path in NO_WAKE_PATHS:
                    return await handler(request)
                async with self.steps.awake():
                    return await handler(request)
            except APIError as err:
                return self._json_error(err)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return self._json_error(APIError(exc.status, exc.reason or "error"))
            except ConnectionError:
                raise
            except Exception as exc:  # noqa: BLE001 - a bug answers a logged 500, the server keeps serving
                return self._json_error(answer_of(exc))

        return middleware

    async def _cors(self, request, response) -> None:  # type: ignore[no-untyped-def]
        """Every answer's ``Access-Control-Allow-Origin`` (as llama-server's --cors-origins) and, on
        /metrics, the process start time."""
        origins, origin = self.config.cors_origins, request.headers.get("Origin", "")
        if origins == "*" and self.config.cors_credentials:
            allow = origin or None  # with credentials, "*" is not allowed: echo the origin
        elif origins == "localhost":
            allow = origin if origin and _is_localhost_origin(origin) else None
        else:
            allow = origins
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
        if request.path == "/metrics":
            response.headers["Process-Start-Time-Unix"] = str(self.started)

    # -- simple endpoints ------------------------------------------------------------------------------

    async def index(self, request):  # type: ignore[no-untyped-def]
        return self.web.Response(text=INDEX_HTML, content_type="text/html")

    async def health(self, request):  # type: ignore[no-untyped-def]
        if not self.ready:
            raise APIError(503, self.load_error or "Loading model", "unavailable_error")
        return self.web.json_response({"status": "ok"})

    async def models(self, request):  # type: ignore[no-untyped-def]
        info = self.engine.target.info
        meta = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                "n_ctx_slot": self.steps.n_ctx_slot, "speculative": self.speculative}
        data = [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llamacpp",
                 "meta": meta, "aliases": list(self.config.aliases), "tags": list(self.config.tags)}]
        return self.web.json_response({"object": "list", "data": data})

    def _slot(self, index: int, view: SlotView) -> dict:
        """One slot as llama-server's /slots shows it (idle slots: the first four fields only)."""
        info, job = view.info, view.job
        out: dict[str, Any] = {"id": index, "n_ctx": self.steps.n_ctx_slot,
                               "speculative": self.speculative, "is_processing": job is not None}
        if job is None:
            return out
        max_tokens = job.options["max_tokens"]
        out.update({
            "id_task": job.seq_id,
            "n_prompt_tokens": info.n_prompt,
            "n_prompt_tokens_processed": info.n_prefilled,
            "n_prompt_tokens_cache": info.n_prompt_cached,
            "params": self._settings(job),
            "next_token": [{"has_next_token": info.state != "idle", "has_new_line": job.has_new_line,
                            "n_remain": max_tokens - info.n_generated if max_tokens >= 0 else -1,
                            "n_decoded": info.n_generated}],
        })
        return out

    async def slots(self, request):  # type: ignore[no-untyped-def]
        if not self.config.slots:
            raise APIError(501, "This server does not support slots endpoint.")
        return self.web.json_response([self._slot(i, v) for i, v in enumerate(self.steps.slots)])

    async def props(self, request):  # type: ignore[no-untyped-def]
        return self.web.json_response({
            "default_generation_settings": {"n_ctx": self.steps.n_ctx_slot, "params": self._settings(None)},
            "total_slots": self.config.n_slots, "model_path": self.model_path,
            "model_alias": self.model_id, "build_info": f"pydflash {SYSTEM_FINGERPRINT}",
            "endpoint_slots": self.config.slots, "endpoint_props": True, "endpoint_metrics": self.config.metrics,
            "is_sleeping": self.steps.sleeping, "cors_proxy_enabled": self.config.ui_mcp_proxy,
        })

    async def prometheus(self, request):  # type: ignore[no-untyped-def]
        if not self.config.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`.")
        n_pos = max(self.engine.n_max, 1) if self.speculative else 1
        text = self.metrics.render(self.steps.n_processing, self.steps.n_deferred, n_pos)
        return self.web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- tokenizer ---------------------------------------------------------------------------------------

    async def _on_target(self, fn: Callable):  # type: ignore[no-untyped-def]
        """Run ``fn(target)`` off the event loop (it waits for the running step: the target's lock)."""
        target = self.engine.target
        return await asyncio.get_running_loop().run_in_executor(None, fn, target)

    async def tokenize(self, request):  # type: ignore[no-untyped-def]
        """llama-server's /tokenize: ``content`` (a string or a mixed list of strings and ids),
        ``add_special`` (default false), ``parse_special`` (default true), ``with_pieces``."""
        body = await self._body(request)
        content = body.get("content")
        add_special = _field(body, ["add_special"], _is_bool, "a boolean", False)
        parse_special = _field(body, ["parse_special"], _is_bool, "a boolean", True)
        with_pieces = _field(body, ["with_pieces"], _is_bool, "a boolean", False)
        if content is None:
            return self.web.json_response({"tokens": []})
        if isinstance(content, str):
            pieces: list = [content]
        elif isinstance(content, list) and all(isinstance(p, str) or _is_int(p) for p in content):
            pieces = content
        else:
            raise APIError(400, "'content' must be a string or a list of strings and token ids")

        def run(target):  # type: ignore[no-untyped-def]
            tokens = tokenize_mixed(target, pieces, add_special=add_special, parse_special=parse_special)
            if not with_pieces:
                return tokens
            return [{"id": t, "piece": piece_json(target, t)} for t in tokens]

        return self.web.json_response({"tokens": await self._on_target(run)})

    async def detokenize(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        tokens = body.get("tokens")
        if tokens is None:
            return self.web.json_response({"content": ""})
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise APIError(400, "'tokens' must be a list of token ids")
        return self.web.json_response({"content": await self._on_target(lambda t: detokenize(t, tokens))})

    # -- generation ------------------------------------------------------------------------------------

    async def _body(self, request) -> dict:  # type: ignore[no-untyped-def]
        return parse_body(await request.read())

    @property
    def _defaults(self) -> dict:
        c = self.config
        return {"max_tokens": c.n_predict, "temperature": c.temperature, "seed": c.seed}

    def _jobs(self, body: dict, prompts: list, max_names: list[str], *, piece_tokens: bool = False,  # type: ignore[no-untyped-def]
              chat_request: dict | None = None):
        """Every field the step loop needs, parsed here into the jobs (it never reads the body);
        ``chat_request``: what the chat templates render for a chat prompt."""
        common = parse_common(body, max_names, self._defaults, self.config.n_slots)
        constraints = parse_constraints(body, chat=chat_request is not None)
        jobs, out = make_jobs(prompts, common)
        progress = common.stream and _field(body, ["return_progress"], _is_bool, "a boolean", False)
        per_token = common.stream and _field(body, ["timings_per_token"], _is_bool, "a boolean", False)
        for job in jobs:
            job.return_progress = progress
            job.timings_per_token = per_token
            job.piece_tokens = piece_tokens and common.stream
            job.constraints = constraints
            job.chat_request = chat_request
        return common, jobs, out

    async def _started(self, jobs: list[Job], out: asyncio.Queue) -> list:
        """Submit and wait until every job passed its checks; returns events that came early."""
        self.steps.submit(jobs)
        early, n_started = [], 0
        while n_started < len(jobs):
            ev = await out.get()
            if ev[0] == "error":
                raise ev[2]
            if ev[0] == "start":
                n_started += 1
            else:
                early.append(ev)
        return early

    async def _events(self, early: list, out: asyncio.Queue, n: int):  # type: ignore[no-untyped-def]
        """Events until every job is done (errors raise)."""
        n_done = 0
        queue = list(early)
        while n_done < n:
            ev = queue.pop(0) if queue else await out.get()
            if ev[0] == "error":
                raise ev[2]
            if ev[0] == "done":
                n_done += 1
            yield ev

    async def _collect(self, jobs: list[Job], out: asyncio.Queue) -> list:
        early = await self._started(jobs, out)
        results: list = [None] * len(jobs)
        async for kind, i, payload in self._events(early, out, len(jobs)):
            if kind == "done":
                results[i] = payload
        return results

    @staticmethod
    def _stream_usage(body: dict) -> bool:
        so = body.get("stream_options")
        return isinstance(so, dict) and so.get("include_usage") is True

    async def _stream(self, request, jobs: list[Job], out: asyncio.Queue, emit: Callable,  # type: ignore[no-untyped-def]
                      tail: Callable | None = None, done_marker: bool = True):
        """SSE: ``emit(kind, i, payload)`` gives the messages of each event ("piece", "progress",
        "done"), ``tail(results)`` the last ones; a message is a dict or an (event name, dict) pair."""
        early = await self._started(jobs, out)  # errors before this point are plain HTTP errors
        resp = self.web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        results: list = [None] * len(jobs)
        try:
            async for kind, i, payload in self._events(early, out, len(jobs)):
                if kind == "done":
                    results[i] = payload
                for msg in emit(kind, i, payload):
                    await resp.write(sse(msg))
            for msg in (tail(results) if tail is not None else ()):
                await resp.write(sse(msg))
        except APIError as err:
            await resp.write(sse(err.body()))
        if done_marker:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _serve(self, jobs: list[Job], run: Callable):  # type: ignore[no-untyped-def]
        try:
            return await run()
        finally:  # disconnect, error or normal end: nothing of these jobs may keep running
            unfinished = [j for j in jobs if not j.answered]
            if unfinished:
                self.steps.cancel(unfinished)

    def _timings(self, result) -> dict:  # type: ignore[no-untyped-def]
        return timings(result.stats, self.speculative)

    def _piece_bytes(self, token: int) -> bytes:
        return token_bytes(self.engine.target, [token])

    def _assistant_message(self, job: Job, res) -> dict:  # type: ignore[no-untyped-def]
        """The reply as an OpenAI message: the template's parser splits content / reasoning /
        tool calls (plain content when the template has no such format)."""
        chat = self.steps.chat
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

    def _probs(self, job: Job, probs) -> list:  # type: ignore[no-untyped-def]
        return probs_json(probs, self._piece_bytes, bool(job.constraints.post_sampling_probs))

    def _native(self, job: Job, res, content: str, tokens: list[int], stops: tuple) -> dict:  # type: ignore[no-untyped-def]
        """llama.cpp's final /completion object (also the ``__verbose`` of the OpenAI answers)."""
        st = res.stats
        extra = {"completion_probabilities": self._probs(job, res.probs)} if res.probs is not None and content else {}
        return {**extra,
            "index": job.index, "content": content, "tokens": tokens, "id_slot": job.slot,
            "stop": True, "model": self.model_id, "tokens_predicted": st.n_generated,
            "tokens_evaluated": st.n_prompt, "generation_settings": self._settings(job),
            "prompt": job.prompt_text, "has_new_line": "\n" in res.text,
            "truncated": st.stop_reason == "context", "stop_type": STOP_TYPES[st.stop_reason],
            "stopping_word": stops[0] if st.stop_reason == "stop" and len(stops) == 1 else "",
            # what the slot's KV holds now: the prompt and every generated token but the last
            "tokens_cached": st.n_prompt + max(st.n_generated - 1, 0), "timings": self._timings(res),
        }

    @staticmethod
    def _returned_tokens(res) -> list[int]:  # type: ignore[no-untyped-def]
        tokens = list(res.tokens)
        if res.stats.stop_reason == "eos" and tokens:
            tokens = tokens[:-1]  # as llama-server: the end-of-generation token is not returned
        return tokens

    async def oai_completions(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = parse_prompts(body["prompt"])
        common, jobs, out = self._jobs(body, prompts, ["max_tokens", "n_predict"])
        # as llama-server: --verbose (its debug mode) adds __verbose to every OpenAI answer
        verbose = _field(body, ["verbose"], _is_bool, "a boolean", False) or self.config.verbose
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": now(),
                "model": self.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

        def choice(i: int, text: str, finish: str | None) -> dict:
            return {"text": text, "index": i, "logprobs": None, "finish_reason": finish}

        if common.stream:
            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                if kind == "piece":
                    return [_timed({**base, "choices": [choice(i, payload.text, None)]}, payload.timings)]
                if kind == "progress":
                    return [_timed({**base, "choices": [choice(i, "", None)], "prompt_progress": payload.report},
                                   payload.timings)]
                return [{**base, "choices": [choice(i, "", FINISH_REASONS[payload.stats.stop_reason])],
                         "timings": self._timings(payload)}]

            def tail(results: list) -> list:
                return [{**base, "choices": [], "usage": usage(results)}] if self._stream_usage(body) else []

            return await self._serve(jobs, lambda: self._stream(request, jobs, out, emit, tail))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(jobs, out)
            data = {**base, "choices": [choice(i, r.text, FINISH_REASONS[r.stats.stop_reason])
                                        for i, r in enumerate(results)], "usage": usage(results)}
            if verbose and len(results) == 1:
                data["__verbose"] = self._native(jobs[0], results[0], results[0].text, [], common.options["stop"])
            return self._reply(data, results)

        return await self._serve(jobs, run)

    def _reply(self, data: dict, results: list):  # type: ignore[no-untyped-def]
        """A non-streamed OpenAI answer; one choice also carries llama-server's ``timings``."""
        if len(results) == 1:
            data["timings"] = self._timings(results[0])
        return self.web.json_response(data)

    def _chat_jobs(self, body: dict, max_names: list[str], *, allow_empty: bool = False):  # type: ignore[no-untyped-def]
        """Jobs of a chat request (OpenAI's, or Anthropic's / Responses' converted to it): checked
        here, rendered whole (tools, tool calls, reasoning, response_format, kwargs) by the Jinja
        templates, as its token count renders it."""
        if allow_empty and body.get("messages") == []:
            messages: list[dict] = []
        else:
            messages = parse_messages(body.get("messages"))
        check_continuation(body, messages)
        return self._jobs(body, [("chat", messages)], max_names, chat_request=body)

    async def oai_chat(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        common, jobs, out = self._chat_jobs(body, ["max_completion_tokens", "max_tokens", "n_predict"])
        # as llama-server: --verbose (its debug mode) adds __verbose to every OpenAI answer
        verbose = _field(body, ["verbose"], _is_bool, "a boolean", False) or self.config.verbose
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", now()
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
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
                    msgs.append(_timed(chunk(i, {"content": payload.text}), payload.timings))
                    if payload.probs:
                        msgs[-1]["choices"][0]["logprobs"] = oai_logprobs(payload.probs, self._piece_bytes)
                elif kind == "progress":
                    msgs[-1:] = [_timed({**(msgs[-1] if msgs else chunk(i, {})), "prompt_progress": payload.report},
                                        payload.timings)]
                elif kind == "done":
                    if i not in began:
                        began.add(i)
                        msgs.append(chunk(i, {"role": "assistant", "content": None}))
                    final = {**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                  "finish_reason": FINISH_REASONS[payload.stats.stop_reason]}]}
                    if not self._stream_usage(body):
                        final["timings"] = self._timings(payload)
                    msgs.append(final)
                return msgs

            def tail(results: list) -> list:
                if not self._stream_usage(body):
                    return []
                last = {**base, "choices": [], "usage": usage(results)}
                if len(results) == 1:
                    last["timings"] = self._timings(results[0])
                return [last]

            return await self._serve(jobs, lambda: self._stream(request, jobs, out, emit, tail))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(jobs, out)
            data = {"id": cid, "object": "chat.completion", "created": created, "model": self.model_id,
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [{"index": i, "message": self._assistant_message(jobs[i], r),
                                 "logprobs": oai_logprobs(r.probs, self._piece_bytes) if r.probs is not None else None,
                                 "finish_reason": FINISH_REASONS[r.stats.stop_reason]}
                                for i, r in enumerate(results)],
                    "usage": usage(results)}
            if verbose and len(results) == 1:
                data["__verbose"] = self._native(jobs[0], results[0], results[0].text, [], common.options["stop"])
            return self._reply(data, results)

        return await self._serve(jobs, run)

    async def completion(self, request, body: dict | None = None):  # type: ignore[no-untyped-def]
        """llama.cpp's native /completion (and /completions): one object per prompt, a list when
        the request has several. ``body``: an already parsed one (/infill)."""
        body = await self._body(request) if body is None else body
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = parse_prompts(body["prompt"])
        common, jobs, out = self._jobs(body, prompts, ["n_predict", "max_tokens", "max_completion_tokens"],
                                       piece_tokens=True)
        return_tokens = _field(body, ["return_tokens"], _is_bool, "a boolean", False)
        fields = body.get("response_fields") or []
        if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
            raise APIError(400, "'response_fields' must be a list of strings")
        stops = common.options["stop"]

        def final(job: Job, res, content: str, tokens: list[int]) -> dict:  # type: ignore[no-untyped-def]
            data = self._native(job, res, content, tokens, stops)
            return nested_fields(fields, data) if fields else data

        if common.stream:
            counts = [0] * len(jobs)

            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                job = jobs[i]
                if kind == "done":
                    return [final(job, payload, "", [])]
                msg = {"index": i, "content": "", "tokens": [], "stop": False, "id_slot": job.slot,
                       "tokens_predicted": counts[i], "tokens_evaluated": job.n_prompt}
                _timed(msg, payload.timings)
                if kind == "progress":
                    msg["prompt_progress"] = payload.report
                else:
                    counts[i] += max(len(payload.tokens), 1)
                    msg.update(content=payload.text, tokens=list(payload.tokens), tokens_predicted=counts[i])
                    if payload.probs:
                        msg["completion_probabilities"] = self._probs(job, payload.probs)
                return [msg]

            return await self._serve(jobs, lambda: self._stream(request, jobs, out, emit, None, False))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(jobs, out)
            items = [final(job, res, res.text, self._returned_tokens(res) if return_tokens else [])
                     for job, res in zip(jobs, results)]
            return self.web.json_response(items[0] if len(items) == 1 else items)

        return await self._serve(jobs, run)

    async def infill(self, request):  # type: ignore[no-untyped-def]
        """llama-server's /infill: a /completion whose prompt is the repo-level FIM prompt."""
        body = await self._body(request)
        if self.engine is None:
            raise APIError(503, "Loading model")
        info = self.engine.target.info
        check_infill(body, info)

        def build(target):  # type: ignore[no-untyped-def]
            def tok(text: str) -> list[int]:
                return target.tokenize(text, add_special=False, parse_special=False)

            n_predict = body.get("n_predict", self.config.n_predict)
            n_predict = n_predict if isinstance(n_predict, int) and n_predict > 0 else 0
            return infill_tokens(body, info, tok, self.config.n_batch_fim, n_predict, self.steps.n_ctx_slot,
                                 self.config.spm_infill)

        tokens = await self._on_target(build)
        return await self.completion(request, {**body, "prompt": tokens})

    # -- token counts ----------------------------------------------------------------------------------

    async def _count_chat(self, body: dict) -> int:
        """The prompt tokens of a checked chat request (no messages: 0), rendered as its generation
        renders it (the raw messages: tools, tool calls and reasoning included)."""
        if not body.get("messages"):
            return 0

        def run(engine):  # type: ignore[no-untyped-def]
            try:
                return len(self.steps.render_chat(body)[1])
            except (errors.InvalidArgumentError, RecursionError) as exc:
                raise from_engine_error(exc) from None

        return await asyncio.wrap_future(self.steps.call(run))

    async def chat_input_tokens(self, request):  # type: ignore[no-untyped-def]
        """/chat/completions/input_tokens: the prompt tokens a chat request would have."""
        body = await self._body(request)
        messages = parse_messages(body.get("messages"))
        check_continuation(body, messages)
        return self.web.json_response({"input_tokens": await self._count_chat(body),
                                       "object": "response.input_tokens"})

    async def responses_input_tokens(self, request):  # type: ignore[no-untyped-def]
        chat = responses_to_chat(await self._body(request))
        parse_messages(chat["messages"])  # checked as for generation
        return self.web.json_response({"input_tokens": await self._count_chat(chat),
                                       "object": "response.input_tokens"})

    async def anthropic_count_tokens(self, request):  # type: ignore[no-untyped-def]
        chat = anthropic_to_chat(await self._body(request))
        if chat["messages"]:
            parse_messages(chat["messages"])  # checked as for generation
        return self.web.json_response({"input_tokens": await self._count_chat(chat)})  # no "object" here

    # -- Anthropic Messages and OpenAI Responses --------------------------------------------------------

    async def anthropic_messages(self, request):  # type: ignore[no-untyped-def]
        chat = anthropic_to_chat(await self._body(request))
        common, jobs, out = self._chat_jobs(chat, ["max_tokens", "n_predict"], allow_empty=True)
        if common.n != 1:
            raise APIError(400, "Anthropic messages take one choice")
        mid = f"msg_{random_id()}"
        stops = common.options["stop"]

        def stopping_word(res) -> str:  # type: ignore[no-untyped-def]
            return stops[0] if res.stats.stop_reason == "stop" and len(stops) == 1 else ""

        if common.stream:
            state = {"started": False, "text": False}

            def start(job: Job) -> tuple:
                state["started"] = True
                return ("message_start", {"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "content": [], "model": self.model_id,
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"cache_read_input_tokens": 0, "input_tokens": job.n_prompt, "output_tokens": 0}}})

            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                msgs = [] if state["started"] or kind == "progress" else [start(jobs[0])]
                if kind == "piece" and payload.text:
                    if not state["text"]:
                        state["text"] = True
                        msgs.append(("content_block_start", {"type": "content_block_start", "index": 0,
                                                             "content_block": {"type": "text", "text": ""}}))
                    msgs.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": payload.text}}))
                elif kind == "done":
                    st = payload.stats
                    if state["text"]:
                        msgs.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
                    msgs.append(("message_delta", {"type": "message_delta",
                                                   "delta": {"stop_reason": anthropic_stop(st),
                                                             "stop_sequence": stopping_word(payload) or None},
                                                   "usage": {"output_tokens": st.n_generated}}))
                    msgs.append(("message_stop", {"type": "message_stop"}))
                return msgs

            return await self._serve(jobs, lambda: self._stream(request, jobs, out, emit, None, False))

        async def run():  # type: ignore[no-untyped-def]
            res = (await self._collect(jobs, out))[0]
            return self.web.json_response(anthropic_message(mid, self.model_id, res, stopping_word(res)))

        return await self._serve(jobs, run)

    async def responses(self, request):  # type: ignore[no-untyped-def]
        chat = responses_to_chat(await self._body(request))
        common, jobs, out = self._chat_jobs(chat, ["max_tokens"])
        if common.n != 1:
            raise APIError(400, "responses take one choice")
        rid, msg_id, created = f"resp_{random_id()}", f"msg_{random_id()}", now()

        if common.stream:
            state = {"created": False, "text": False, "content": []}
            stub = {"id": rid, "object": "response", "status": "in_progress"}

            def emit(kind: str, i: int, payload) -> list:  # type: ignore[no-untyped-def]
                msgs: list = []
                if not state["created"]:
                    state["created"] = True
                    msgs += [("response.created", {"type": "response.created", "response": stub}),
                             ("response.in_progress", {"type": "response.in_progress", "response": stub})]
                elif kind == "progress":
                    msgs.append(("response.in_progress", {"type": "response.in_progress", "response": stub}))
                if kind == "progress":
                    msgs[-1] = (msgs[-1][0], _timed({**msgs[-1][1], "prompt_progress": payload.report},
                                                    payload.timings))
                elif kind == "piece" and payload.text:
                    if not state["text"]:
                        state["text"] = True
                        msgs += [("response.output_item.added", {"type": "response.output_item.added", "item": {
                                     "content": [], "id": msg_id, "role": "assistant", "status": "in_progress",
                                     "type": "message"}}),
                                 ("response.content_part.added", {"type": "response.content_part.added",
                                                                  "item_id": msg_id,
                                                                  "part": {"type": "output_text", "text": ""}})]
                    state["content"].append(payload.text)
                    msgs.append(("response.output_text.delta", _timed({"type": "response.output_text.delta",
                                                                       "item_id": msg_id, "delta": payload.text},
                                                                      payload.timings)))
                elif kind == "done":
                    body = responses_body(rid, msg_id, self.model_id, created, payload, now())
                    if payload.text:
                        part = body["output"][0]["content"][0]
                        msgs += [("response.output_text.done", {"type": "response.output_text.done",
                                                                "item_id": msg_id, "text": payload.text}),
                                 ("response.content_part.done", {"type": "response.content_part.done",
                                                                 "item_id": msg_id, "part": part}),
                                 ("response.output_item.done", {"type": "response.output_item.done",
                                                                "item": body["output"][0]})]
                    body.pop("completed_at")
                    msgs.append(("response.completed", {"type": "response.completed", "response": body,
                                                        "timings": self._timings(payload)}))
                return msgs

            return await self._serve(jobs, lambda: self._stream(request, jobs, out, emit, None, False))

        async def run():  # type: ignore[no-untyped-def]
            res = (await self._collect(jobs, out))[0]
            return self.web.json_response(responses_body(rid, msg_id, self.model_id, created, res, now()))

        return await self._serve(jobs, run)
