"""Endpoints served by the model's native machinery rather than by generation: ``/apply-template``
(llama.cpp's Jinja chat templates), ``/embedding`` + ``/v1/embeddings``, and slot files
(``POST /slots/{id}?action=save|restore|erase``). ``/infill`` is a completion with a FIM prompt
and lives with the other completion handlers; its prompt is built in ``features.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from .. import errors
from .features import base64_floats, embedding_rows
from .jobs import INT32_MAX, APIError, check_model, client_input, from_engine_error

__all__ = ["NativeRoutes"]

POOLING = {"none": "none", "mean": "mean", "cls": "cls", "last": "last"}


class NativeRoutes:
    """Registered next to the HTTPServer's own routes; ``http`` is that HTTPServer."""

    def __init__(self, http) -> None:  # type: ignore[no-untyped-def]
        self.http = http

    def register(self, router) -> None:  # type: ignore[no-untyped-def]
        router.add_post("/apply-template", self.apply_template)
        router.add_post("/embedding", self.embedding)
        router.add_post("/embeddings", self.embedding)
        router.add_post("/v1/embeddings", self.oai_embeddings)
        router.add_post("/slots/{id}", self.slot_action)

    @property
    def config(self):  # type: ignore[no-untyped-def]
        return self.http.config

    # -- /apply-template ----------------------------------------------------------------------------

    async def apply_template(self, request):  # type: ignore[no-untyped-def]
        body = await self.http._body(request)
        chat = self.http.steps.chat
        if chat is None:
            raise APIError(503, "Loading model")
        try:
            rendered = await asyncio.get_running_loop().run_in_executor(None, chat.render, body)
        except (errors.InvalidArgumentError, RecursionError) as exc:  # RecursionError: the body, serialised
            raise from_engine_error(exc) from None
        return self.http.web.json_response({"prompt": rendered["prompt"]})

    # -- embeddings ---------------------------------------------------------------------------------

    def _check_embeddings(self) -> None:
        if not self.config.embeddings:
            raise APIError(501, "This server does not support embeddings. Start it with `--embeddings`",
                           "not_supported_error")

    @client_input
    def _inputs(self, value: Any, name: str) -> list[list[int]]:
        target = self.http.engine.target
        from .text import tokenize_mixed

        def one(v: Any) -> list[int]:
            if isinstance(v, dict):  # {"prompt_string": ...} or {"content": [text parts]}
                if "prompt_string" in v:
                    return one(v["prompt_string"])
                parts = v.get("content")
                if not isinstance(parts, list) or not parts or not all(
                        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                        for p in parts):
                    raise APIError(400, f"'{name}' objects need 'prompt_string' or 'content' text parts "
                                        "(this server has no multimodal projector)")
                return one("".join(p["text"] for p in parts))
            if isinstance(v, str):
                return tokenize_mixed(target, [v], add_special=True, parse_special=True)
            if isinstance(v, list) and v and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in v):
                return tokenize_mixed(target, v, add_special=True, parse_special=True) if any(
                    isinstance(t, str) for t in v) else list(v)
            raise APIError(400, f"'{name}' must be a string, a list of token ids, or a list of those")

        # a list is several prompts when it holds lists or objects, or only strings; a list with
        # token ids (and maybe strings) is one mixed prompt (llama-server's forms)
        many = isinstance(value, list) and bool(value) and (
            any(isinstance(v, (list, dict)) for v in value) or all(isinstance(v, str) for v in value))
        if many:
            inputs = [one(v) for v in value]
        else:
            inputs = [one(value)]
        for toks in inputs:
            if not toks:
                raise APIError(400, "Input content cannot be empty")
            bad = [t for t in toks if not 0 <= t < target.info.n_vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{target.info.n_vocab - 1})")
            if len(toks) > self.http.steps.n_ctx_slot:
                raise APIError(400, f"input is too large to process ({len(toks)} tokens, the context is "
                                    f"{self.http.steps.n_ctx_slot})", "exceed_context_size_error")
        return inputs

    async def _embed(self, inputs: list[list[int]], pooling: str):  # type: ignore[no-untyped-def]
        target = self.http.engine.target
        loop = asyncio.get_running_loop()
        out = []
        for toks in inputs:  # a second context of the same weights: generation keeps running
            t0 = time.monotonic()
            try:
                out.append(await loop.run_in_executor(None, lambda t=toks: target.embed(t, pooling=pooling)))
            except errors.InvalidArgumentError as exc:
                raise APIError(400, str(exc)) from None
            self.http.metrics.add_embedding(len(toks), time.monotonic() - t0)
        return out

    async def embedding(self, request):  # type: ignore[no-untyped-def]
        """llama-server's native /embedding: [{index, embedding}], a list of per-token rows under
        --pooling none, otherwise [[...]] with one pooled row."""
        self._check_embeddings()
        body = await self.http._body(request)
        value = body.get("content", body.get("input"))
        if value is None:
            raise APIError(400, "\"input\" or \"content\" must be provided")
        inputs = self._inputs(value, "content")
        norm = body.get("embd_normalize", 2)
        if not isinstance(norm, int) or isinstance(norm, bool) or not -INT32_MAX - 1 <= norm <= INT32_MAX:
            raise APIError(400, "'embd_normalize' must be a 32-bit int")
        pooling = self.config.pooling
        rows = await self._embed(inputs, pooling)
        data = [{"index": i, "embedding": embedding_rows(r, norm if pooling != "none" else -1)}
                for i, r in enumerate(rows)]
        return self.http.web.json_response(data)

    async def oai_embeddings(self, request):  # type: ignore[no-untyped-def]
        self._check_embeddings()
        body = await self.http._body(request)
        check_model(body)
        if self.config.pooling == "none":
            raise APIError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        value = body.get("input", body.get("content"))
        if value is None:
            raise APIError(400, "\"input\" must be provided")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise APIError(400, "The format to return the embeddings in. Can be either float or base64")
        inputs = self._inputs(value, "input")
        rows = await self._embed(inputs, self.config.pooling)
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
        return self.http.web.json_response({
            "model": body.get("model") or self.http.model_id, "object": "list",
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})

    # -- slot files ---------------------------------------------------------------------------------

    async def slot_action(self, request):  # type: ignore[no-untyped-def]
        action = request.query.get("action", "")
        try:
            slot = int(request.match_info["id"])
        except ValueError:
            raise APIError(400, "Invalid slot id") from None
        if action not in ("save", "restore", "erase"):
            raise APIError(400, "Invalid action")
        body = await self.http._body(request) if request.can_read_body else {}
        if action != "erase" and not self.config.slot_save_path:
            raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                           "not_supported_error")
        path = None
        if action != "erase":
            filename = body.get("filename")
            if not isinstance(filename, str) or not _valid_filename(filename):
                raise APIError(400, "Invalid filename")
            path = os.path.join(self.config.slot_save_path, filename)
        t0 = time.monotonic()

        def run(engine):  # type: ignore[no-untyped-def]
            sched = engine.scheduler
            if not 0 <= slot < sched.n_slots:
                raise APIError(400, "Invalid slot id")
            if action == "save":
                return sched.slot_save(slot, path)
            if action == "restore":
                return sched.slot_restore(slot, path)
            return sched.slot_erase(slot), 0

        try:
            n_tokens, n_bytes = await asyncio.wrap_future(self.http.steps.call(run))
        except errors.BusyError as exc:
            raise APIError(400, str(exc)) from None
        except errors.ModelNotFoundError as exc:
            raise APIError(400 if action == "restore" else 500, str(exc)) from None
        ms = (time.monotonic() - t0) * 1000.0
        if action == "save":
            out = {"id_slot": slot, "filename": body["filename"], "n_saved": n_tokens, "n_written": n_bytes,
                   "timings": {"save_ms": ms}}
        elif action == "restore":
            out = {"id_slot": slot, "filename": body["filename"], "n_restored": n_tokens, "n_read": n_bytes,
                   "timings": {"restore_ms": ms}}
        else:
            out = {"id_slot": slot, "n_erased": n_tokens}
        return self.http.web.json_response(out)


def _valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename in spirit: one plain path component."""
    if not name or len(name) > 255 or name in (".", "..") or name.startswith("."):
        return False
    return not any(c in name for c in '/\\:*?"<>|\0') and name == name.strip()
