"""Google Vertex AI's custom-container API (llama-server's, enabled by ``AIP_MODE=PREDICTION``):
``POST /predict`` (``AIP_PREDICT_ROUTE``) takes ``{"instances": [...]}``, each naming the endpoint
it is for with ``@requestFormat`` (a camelCase alias like ``chatCompletions`` or a path), runs
them concurrently through the ordinary handlers (never streamed) and answers
``{"predictions": [...]}``, one answer or error object per instance.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any

from .jobs import APIError, answer_of

__all__ = ["register"]

MAX_INSTANCES = 128
# an alias two paths share goes to one of them (upstream's pick depends on a hash map's order)
ALIAS_WINNERS = {"completions": "/v1/completions", "embeddings": "/embeddings"}


def _alias(path: str) -> str:
    """"/v1/chat/completions" -> "chatCompletions", "/apply-template" -> "applyTemplate"."""
    s = path[3:] if path.startswith("/v1") and len(path) > 3 else path
    s = s.lstrip("/").split("{", 1)[0]
    parts = re.split(r"[/_-]", s)
    return parts[0] + "".join(p[:1].upper() + p[1:] for p in parts[1:])


class _InternalRequest:
    """What a handler reads of a request, for an instance's payload."""

    def __init__(self, outer, payload: dict) -> None:  # type: ignore[no-untyped-def]
        self._raw = json.dumps(payload).encode()
        self.headers = outer.headers
        self.query = outer.query
        self.match_info: dict = {}
        self.method = "POST"
        self.can_read_body = True

    async def read(self) -> bytes:
        return self._raw


def register(http, router) -> None:  # type: ignore[no-untyped-def]
    if os.environ.get("AIP_MODE", "") != "PREDICTION":
        return
    route = os.environ.get("AIP_PREDICT_ROUTE") or "/predict"
    route = route if route.startswith("/") else "/" + route
    handlers: dict[str, Any] = {}
    for r in router.routes():
        info = r.resource.get_info() if r.resource is not None else {}
        path = info.get("path")
        if r.method == "POST" and path:
            handlers.setdefault(path, r.handler)
    for path, handler in list(handlers.items()):
        alias = _alias(path)
        handlers.setdefault(alias, handlers.get(ALIAS_WINNERS.get(alias, path), handler))

    async def one(request, instance: Any) -> Any:  # type: ignore[no-untyped-def]
        def error(status: int, message: str) -> dict:
            return APIError(status, message).body()

        if not isinstance(instance, dict):
            return error(400, "each instance must be a JSON object")
        fmt = instance.get("@requestFormat")
        if not isinstance(fmt, str):
            return error(400, "each instance must include a string @requestFormat")
        handler = handlers.get(fmt)
        if handler is None:
            return error(400, f"no handler registered for @requestFormat: {fmt}")
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        payload["stream"] = False
        try:
            resp = await handler(_InternalRequest(request, payload))
        except Exception as exc:  # noqa: BLE001 - one instance's failure is its own answer (a bug: logged)
            return answer_of(exc).body()
        try:
            return json.loads(resp.body)
        except (TypeError, ValueError):
            return error(500, "the handler gave no JSON answer")

    async def predict(request):  # type: ignore[no-untyped-def]
        body = await http.read_body(request)
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise APIError(400, "request body must include an array field named instances")
        if len(instances) > MAX_INSTANCES:
            raise APIError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}")
        predictions = await asyncio.gather(*(one(request, i) for i in instances))
        return http.json({"predictions": list(predictions)})

    router.add_post(route, predict)
    health = os.environ.get("AIP_HEALTH_ROUTE")
    if health:
        router.add_get(health if health.startswith("/") else "/" + health, http.health)
