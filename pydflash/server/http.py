"""The HTTP application: aiohttp app, API keys, CORS, and the plumbing between handlers and the loop.

Each API family registers its routes from its own module (``api_openai``, ``api_llama``,
``api_anthropic``, ``api_responses``, ``cors_proxy``, then ``api_vertex`` over the POST routes of
the others); this module keeps what they share: the middleware (API key, 503 while loading, every
error as a JSON body), CORS headers, ``/health``, and the job plumbing. A handler parses its
request into jobs (``jobs.py``), hands them to the step loop (``loop.py``) and shapes the events
into its API's answer. It waits until its jobs passed the step loop's prompt checks before it
answers, so a bad prompt is a plain HTTP 400 even when streaming. A client that disconnects
cancels its jobs: aiohttp cancels the handler (``handler_cancellation``), a failed stream write
raises, and either way ``serve``'s ``finally`` asks the step loop to cancel what has not finished.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from . import api_anthropic, api_llama, api_openai, api_responses, api_vertex, cors_proxy
from .answers import settings, sse, timings
from .command_line import ServerConfig
from .jobs import APIError, Common, Job, answer_of, parse_body, parse_jobs
from .loop import StepLoop
from .metrics import Metrics
from .text import token_bytes

__all__ = ["HTTPServer"]

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})
# answered from what was published at load: they do not wake a sleeping server (as llama-server's)
NO_WAKE_PATHS = PUBLIC_PATHS | {"/props", "/models", "/v1/models", "/metrics", "/cors-proxy"}
INDEX_HTML = ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>pydflash serve</title></head>"
              "<body><p>pydflash serve: an OpenAI / llama-server compatible API (no web UI is shipped).</p>"
              "</body></html>\n")
# the route families, in registration order (api_vertex last: it serves the POST routes of the others)
FAMILIES = (api_openai, api_llama, api_anthropic, api_responses, cors_proxy, api_vertex)


def _is_localhost_origin(origin: str) -> bool:
    from urllib.parse import urlsplit

    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class HTTPServer:
    """The aiohttp application over a ``StepLoop``; what the route families share."""

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
        for family in FAMILIES:
            family.register(self, r)

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

    def settings(self, job: Job | None) -> dict:
        """llama-server's ``generation_settings`` of a job (None: the server's defaults)."""
        c = self.config
        if job is None:  # the server's defaults of a request (--seed, --temp, --n-predict)
            options = {"seed": None if c.seed == -1 else c.seed, "temperature": c.temperature,
                       "max_tokens": c.n_predict}
        else:
            options = {**job.options, "seed": job.seed if job.seed is not None else job.options.get("seed")}
        return settings(options, *self.steps.spec_of(job), speculative=self.speculative,
                        logit_bias=job.logit_bias if job is not None else None, eog=self.steps.eog_tokens())

    def timings(self, result) -> dict:  # type: ignore[no-untyped-def]
        return timings(result.stats, self.speculative)

    def piece_bytes(self, token: int) -> bytes:
        return token_bytes(self.engine.target, [token])

    def json(self, data: Any, status: int = 200):  # type: ignore[no-untyped-def]
        return self.web.json_response(data, status=status)

    # -- middleware ----------------------------------------------------------------------------------

    def _json_error(self, err: APIError):  # type: ignore[no-untyped-def]
        return self.json(err.body(), err.status)

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

    # -- the server's own routes ---------------------------------------------------------------------

    async def index(self, request):  # type: ignore[no-untyped-def]
        return self.web.Response(text=INDEX_HTML, content_type="text/html")

    async def health(self, request):  # type: ignore[no-untyped-def]
        if not self.ready:
            raise APIError(503, self.load_error or "Loading model", "unavailable_error")
        return self.json({"status": "ok"})

    # -- requests, the target, jobs -----------------------------------------------------------------

    async def read_body(self, request) -> dict:  # type: ignore[no-untyped-def]
        """The request's JSON object (400 otherwise)."""
        return parse_body(await request.read())

    async def on_target(self, fn: Callable):  # type: ignore[no-untyped-def]
        """Run ``fn(target)`` off the event loop (it waits for the running step: the target's lock)."""
        target = self.engine.target
        return await asyncio.get_running_loop().run_in_executor(None, fn, target)

    async def on_loop(self, fn: Callable):  # type: ignore[no-untyped-def]
        """Run ``fn(engine)`` on the step loop's thread, between two steps."""
        return await asyncio.wrap_future(self.steps.call(fn))

    def jobs(self, body: dict, prompts: list, max_names: list[str], *, piece_tokens: bool = False,
             chat: bool = False) -> tuple[Common, list[Job], asyncio.Queue]:
        """The request's jobs with the server's defaults (``jobs.parse_jobs``)."""
        c = self.config
        defaults = {"max_tokens": c.n_predict, "temperature": c.temperature, "seed": c.seed}
        return parse_jobs(body, prompts, max_names, defaults, c.n_slots, piece_tokens=piece_tokens, chat=chat)

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

    async def _events(self, early: list, out: asyncio.Queue, n: int) -> AsyncIterator[tuple]:
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

    async def collect(self, jobs: list[Job], out: asyncio.Queue) -> list:
        """Run the jobs to the end: their results, in order."""
        early = await self._started(jobs, out)
        results: list = [None] * len(jobs)
        async for kind, i, payload in self._events(early, out, len(jobs)):
            if kind == "done":
                results[i] = payload
        return results

    async def stream(self, request, jobs: list[Job], out: asyncio.Queue, emit: Callable,  # type: ignore[no-untyped-def]
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

    async def serve(self, jobs: list[Job], run: Callable[[], Awaitable]):  # type: ignore[no-untyped-def]
        """``await run()`` (collect or stream); whatever ends it, nothing of these jobs keeps running."""
        try:
            return await run()
        finally:  # disconnect, error or normal end: nothing of these jobs may keep running
            unfinished = [j for j in jobs if not j.answered]
            if unfinished:
                self.steps.cancel(unfinished)
