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
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from .config import ServerConfig
from .loop import SlotView, StepLoop
from .metrics import Metrics
from .requests import APIError, Job, make_jobs, parse_body, parse_common, parse_messages, parse_prompts
from .requests import field_value as _field
from .responses import FINISH_REASONS, STOP_TYPES, SYSTEM_FINGERPRINT, now, settings, sse, timings, usage

__all__ = ["HTTPServer"]

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


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
        r.add_get("/metrics", self.prometheus)

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
            return self.config.aliases[0]
        return os.path.basename(self.model_path or self.config.model)

    def _settings(self, job: Job | None) -> dict:
        options = {} if job is None else {**job.options, "seed": job.seed if job.seed is not None else
                                          job.options.get("seed")}
        return settings(options, *self.steps.spec_of(job), speculative=self.speculative)

    # -- middleware ----------------------------------------------------------------------------------

    def _json_error(self, err: APIError):  # type: ignore[no-untyped-def]
        return self.web.json_response(err.body(), status=err.status)

    def _middleware(self):  # type: ignore[no-untyped-def]
        """API key check, 503 while loading, and every error as an OpenAI-style JSON body."""
        web = self.web

        @web.middleware
        async def middleware(request, handler):  # type: ignore[no-untyped-def]
            try:
                keys = self.config.api_keys
                if keys and request.path not in PUBLIC_PATHS and request.method != "OPTIONS":
                    given = request.headers.get("Authorization", "") or request.headers.get("X-Api-Key", "")
                    given = given.removeprefix("Bearer ")
                    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
                        raise APIError(401, "Invalid API Key", "authentication_error")
                if request.path not in PUBLIC_PATHS and not self.ready:
                    raise APIError(503, self.load_error or "Loading model", "unavailable_error")
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

    # -- simple endpoints ------------------------------------------------------------------------------

    async def health(self, request):  # type: ignore[no-untyped-def]
        if not self.ready:
            raise APIError(503, self.load_error or "Loading model", "unavailable_error")
        return self.web.json_response({"status": "ok"})

    async def models(self, request):  # type: ignore[no-untyped-def]
        info = self.engine.target.info
        meta = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                "n_ctx_slot": self.steps.n_ctx_slot, "speculative": self.speculative}
        data = [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "llamacpp",
                 "meta": meta, "aliases": list(self.config.aliases)}]
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
        })

    async def prometheus(self, request):  # type: ignore[no-untyped-def]
        if not self.config.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`.")
        n_pos = max(self.engine.n_max, 1) if self.speculative else 1
        text = self.metrics.render(self.steps.n_processing, self.steps.n_deferred, n_pos)
        return self.web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- generation ------------------------------------------------------------------------------------

    async def _body(self, request) -> dict:  # type: ignore[no-untyped-def]
        return parse_body(await request.read())

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

    async def _stream(self, request, jobs: list[Job], out: asyncio.Queue, chunk: Callable,  # type: ignore[no-untyped-def]
                      final: Callable, tail: Callable | None, done_marker: bool):
        """SSE: chunk(i, text) per piece, final(i, result) per finished job, tail(results) last."""
        early = await self._started(jobs, out)  # errors before this point are plain HTTP errors
        resp = self.web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        results: list = [None] * len(jobs)
        try:
            async for kind, i, payload in self._events(early, out, len(jobs)):
                if kind == "piece":
                    await resp.write(sse(chunk(i, payload)))
                elif kind == "done":
                    results[i] = payload
                    await resp.write(sse(final(i, payload)))
            if tail is not None:
                extra = tail(results)
                if extra is not None:
                    await resp.write(sse(extra))
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

    async def oai_completions(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = parse_prompts(body["prompt"])
        common = parse_common(body, ["max_tokens"])
        jobs, out = make_jobs(prompts, common)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": now(),
                "model": self.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

        def choice(i: int, text: str, finish: str | None) -> dict:
            return {"text": text, "index": i, "logprobs": None, "finish_reason": finish}

        if common.stream:
            def tail(results: list) -> dict | None:
                return {**base, "choices": [], "usage": usage(results)} if self._stream_usage(body) else None

            return await self._serve(jobs, lambda: self._stream(
                request, jobs, out,
                lambda i, text: {**base, "choices": [choice(i, text, None)]},
                lambda i, res: {**base, "choices": [choice(i, "", FINISH_REASONS[res.stats.stop_reason])],
                                "timings": self._timings(res)},
                tail, True))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(jobs, out)
            return self._reply({**base, "choices": [choice(i, r.text, FINISH_REASONS[r.stats.stop_reason])
                                                    for i, r in enumerate(results)],
                                "usage": usage(results)}, results)

        return await self._serve(jobs, run)

    def _reply(self, data: dict, results: list):  # type: ignore[no-untyped-def]
        """A non-streamed OpenAI answer; one choice also carries llama-server's ``timings``."""
        if len(results) == 1:
            data["timings"] = self._timings(results[0])
        return self.web.json_response(data)

    async def oai_chat(self, request):  # type: ignore[no-untyped-def]
        body = await self._body(request)
        messages = parse_messages(body.get("messages"))
        common = parse_common(body, ["max_completion_tokens", "max_tokens"])
        jobs, out = make_jobs([("chat", messages)], common)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", now()

        if common.stream:
            base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
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
                        "timings": self._timings(res)}

            def tail(results: list) -> dict | None:
                return {**base, "choices": [], "usage": usage(results)} if self._stream_usage(body) else None

            return await self._serve(jobs, lambda: self._stream(request, jobs, out, delta, final, tail, True))

        async def run():  # type: ignore[no-untyped-def]
            results = await self._collect(jobs, out)
            data = {"id": cid, "object": "chat.completion", "created": created, "model": self.model_id,
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": r.text},
                                 "logprobs": None, "finish_reason": FINISH_REASONS[r.stats.stop_reason]}
                                for i, r in enumerate(results)],
                    "usage": usage(results)}
            return self._reply(data, results)

        return await self._serve(jobs, run)

    async def completion(self, request):  # type: ignore[no-untyped-def]
        """llama.cpp's native /completion."""
        body = await self._body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required")
        prompts = parse_prompts(body["prompt"])
        if len(prompts) != 1:
            raise APIError(400, "/completion takes one prompt (a string or a list of token ids)")
        common = parse_common(body, ["n_predict", "max_tokens"])
        return_tokens = _field(body, ["return_tokens"], lambda v: isinstance(v, bool), "a boolean", False)
        jobs, out = make_jobs(prompts, common)
        job = jobs[0]

        def final(res, content: str) -> dict:  # type: ignore[no-untyped-def]
            st = res.stats
            tokens = list(res.tokens)
            if st.stop_reason == "eos" and tokens:
                tokens = tokens[:-1]  # as llama-server: the end-of-generation token is not returned
            stops = common.options["stop"]
            return {
                "index": 0, "content": content, "tokens": tokens if return_tokens else [], "id_slot": job.slot,
                "stop": True, "model": self.model_id, "tokens_predicted": st.n_generated,
                "tokens_evaluated": st.n_prompt, "generation_settings": self._settings(job),
                "prompt": job.prompt if job.kind == "text" else "", "has_new_line": "\n" in res.text,
                "truncated": False, "stop_type": STOP_TYPES[st.stop_reason],
                "stopping_word": stops[0] if st.stop_reason == "stop" and len(stops) == 1 else "",
                # what the slot's KV holds now: the prompt and every generated token but the last
                "tokens_cached": st.n_prompt + max(st.n_generated - 1, 0), "timings": self._timings(res),
            }

        if common.stream:
            count = [0]

            def chunk(i: int, text: str) -> dict:
                count[0] += 1
                return {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": job.slot,
                        "tokens_predicted": count[0], "tokens_evaluated": job.n_prompt}

            return await self._serve(jobs, lambda: self._stream(
                request, jobs, out, chunk, lambda i, res: final(res, ""), None, False))

        async def run():  # type: ignore[no-untyped-def]
            res = (await self._collect(jobs, out))[0]
            return self.web.json_response(final(res, res.text))

        return await self._serve(jobs, run)
