"""OpenAI's Responses API: ``/v1/responses`` (``/responses``) and its ``/input_tokens``.

A request is turned into an OpenAI chat body (``instructions`` a system message, ``input`` items
messages or tool outputs, ``max_output_tokens`` max_tokens), generated as a chat completion
(``api_openai.chat_jobs``) and answered as a Responses object (SSE events included), as
llama-server does.
"""

from __future__ import annotations

import json
from typing import Any

from .answers import now, random_id, timed
from .api_openai import chat_jobs, count_chat_tokens
from .jobs import IMAGE_REFUSED, APIError, client_input, parse_messages

__all__ = ["register", "responses_body", "responses_to_chat"]


def register(http, router) -> None:  # type: ignore[no-untyped-def]
    routes = _Responses(http)
    router.add_post("/v1/responses", routes.responses)
    router.add_post("/responses", routes.responses)
    router.add_post("/v1/responses/input_tokens", routes.input_tokens)
    router.add_post("/responses/input_tokens", routes.input_tokens)


def _response_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: 'content' must be a string or a list of parts")
    parts = []
    for p in content:
        if not isinstance(p, dict):
            raise APIError(400, f"{where}: a content part must be an object")
        kind = p.get("type")
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(p.get("text"), str):
                raise APIError(400, f"{where}: '{kind}' requires a string 'text'")
            parts.append(p["text"])
        elif kind == "input_image":
            raise APIError(400, IMAGE_REFUSED)
        elif kind == "input_file":
            raise APIError(400, "'input_file' is not supported by llamacpp at this moment")
        else:
            raise APIError(400, "'type' must be one of 'input_text', 'input_image', or 'input_file'")
    return "".join(parts)


@client_input
def responses_to_chat(body: dict) -> dict:
    """An OpenAI Responses request as an OpenAI chat body."""
    if "input" not in body:
        raise APIError(400, "'input' is required")
    if body.get("previous_response_id"):
        raise APIError(400, "llama.cpp does not support 'previous_response_id'.")
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(400, "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, dict):
                raise APIError(400, "each 'input' item must be an object")
            role = item.get("role")
            if item.get("type") == "function_call_output":
                out = item.get("output")
                messages.append({"role": "tool", "content": out if isinstance(out, str) else json.dumps(out)})
            elif item.get("type") in ("function_call", "reasoning"):
                continue  # no tool-call / reasoning rendering in pydflash's templates
            elif isinstance(role, str) and role in ("user", "system", "developer", "assistant"):
                text = _response_content(item.get("content", ""), "input")
                messages.append({"role": "system" if role == "developer" else role, "content": text})
            else:
                raise APIError(400, "an 'input' item must be a message (role + content) or a function call output")
    else:
        raise APIError(400, "'input' must be a string or a list of items")
    out: dict[str, Any] = {"messages": messages}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stream", "cache_prompt", "speculative",
                 "verbose", "return_progress", "timings_per_token", "stop"):
        if name in body:
            out[name] = body[name]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def responses_body(rid: str, msg_id: str, model: str, created: int, result: Any, completed_at: int) -> dict:
    st = result.stats
    output = []
    if result.text:
        output.append({"content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": result.text}],
                       "id": msg_id, "role": "assistant", "status": "completed", "type": "message"})
    return {"completed_at": completed_at, "created_at": created, "id": rid, "model": model, "object": "response",
            "output": output, "status": "completed",
            "usage": {"input_tokens": st.n_prompt, "output_tokens": st.n_generated,
                      "total_tokens": st.n_prompt + st.n_generated,
                      "input_tokens_details": {"cached_tokens": st.n_cached}}}


class _Responses:
    def __init__(self, http) -> None:  # type: ignore[no-untyped-def]
        self.http = http

    async def responses(self, request):  # type: ignore[no-untyped-def]
        chat = responses_to_chat(await self.http.read_body(request))
        common, jobs, out = chat_jobs(self.http, chat, ["max_tokens"])
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
                    msgs[-1] = (msgs[-1][0], timed({**msgs[-1][1], "prompt_progress": payload.report},
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
                    msgs.append(("response.output_text.delta", timed({"type": "response.output_text.delta",
                                                                      "item_id": msg_id, "delta": payload.text},
                                                                     payload.timings)))
                elif kind == "done":
                    body = responses_body(rid, msg_id, self.http.model_id, created, payload, now())
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
                                                        "timings": self.http.timings(payload)}))
                return msgs

            return await self.http.serve(jobs, lambda: self.http.stream(request, jobs, out, emit, None, False))

        async def run():  # type: ignore[no-untyped-def]
            res = (await self.http.collect(jobs, out))[0]
            return self.http.json(responses_body(rid, msg_id, self.http.model_id, created, res, now()))

        return await self.http.serve(jobs, run)
    async def input_tokens(self, request):  # type: ignore[no-untyped-def]
        chat = responses_to_chat(await self.http.read_body(request))
        parse_messages(chat["messages"])  # checked as for generation
        return self.http.json({"input_tokens": await count_chat_tokens(self.http, chat),
                                       "object": "response.input_tokens"})
