"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

A request is turned into an OpenAI chat body (messages + the sampling fields the chat path reads),
generated as a chat completion (``api_openai.chat_jobs``), and the result is written in Anthropic's
shape (SSE events included), as llama-server does. Content blocks map as llama-server maps them:
text blocks are kept, thinking blocks become the message's ``reasoning_content``, tool-use blocks
its ``tool_calls``, tool results ``tool`` messages, and tools / tool_choice their OpenAI forms (the
chat template renders them); blocks of other types are skipped, as llama-server skips them. An
image is refused with llama-server's message, as a 400 (llama-server answers 500: the request, not
the server, is at fault).
"""

from __future__ import annotations

import json
from typing import Any

from .answers import random_id
from .api_openai import chat_jobs, count_chat_tokens
from .jobs import IMAGE_REFUSED, APIError, Job, client_input, parse_messages

__all__ = ["anthropic_message", "anthropic_stop", "anthropic_to_chat", "anthropic_usage", "register"]

def register(http, router) -> None:  # type: ignore[no-untyped-def]
    routes = _Anthropic(http)
    router.add_post("/v1/messages", routes.messages)
    router.add_post("/v1/messages/count_tokens", routes.count_tokens)


def _text_blocks(blocks: list, where: str) -> str:
    parts = []
    for b in blocks:
        if not isinstance(b, dict):
            raise APIError(400, f"{where}: a content block must be an object")
        kind = b.get("type")
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise APIError(400, f"{where}: a text block needs a string 'text'")
            parts.append(b["text"])
        elif kind == "image":
            raise APIError(400, IMAGE_REFUSED)
    return "".join(parts)


@client_input
def anthropic_to_chat(body: dict) -> dict:
    """An Anthropic Messages request as an OpenAI chat body (``messages`` may end up empty)."""
    if "messages" not in body:
        raise APIError(400, "'messages' is required")
    messages: list[dict] = []
    system = body.get("system")
    if isinstance(system, str):
        messages.append({"role": "system", "content": system})
    elif isinstance(system, list):
        messages.append({"role": "system", "content": _text_blocks(system, "system")})
    elif system is not None:
        raise APIError(400, "'system' must be a string or a list of text blocks")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise APIError(400, "'messages' must be a list")
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, "each message must be an object with a string 'role'")
        content = m.get("content")
        if content is None:
            if m["role"] != "assistant":
                messages.append({"role": m["role"], "content": ""})
            continue
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, "a message 'content' must be a string or a list of content blocks")
        text = _text_blocks(content, "messages")
        tool_results, tool_calls, reasoning = [], [], ""
        for b in content:
            kind = b.get("type")
            if kind == "thinking":
                reasoning += b.get("thinking") if isinstance(b.get("thinking"), str) else ""
            elif kind == "tool_use":
                tool_calls.append({"id": str(b.get("id", "")), "type": "function", "function": {
                    "name": str(b.get("name", "")), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result":
                inner = b.get("content")
                if isinstance(inner, list):
                    inner = _text_blocks(inner, "tool_result")
                elif inner is None:
                    inner = ""
                elif not isinstance(inner, str):
                    raise APIError(400, "a tool_result 'content' must be a string or a list of blocks")
                tool_results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": inner})
        if text or tool_calls or reasoning or not tool_results:
            msg: dict[str, Any] = {"role": m["role"], "content": text}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            if reasoning:
                msg["reasoning_content"] = reasoning
            messages.append(msg)
        messages.extend(tool_results)
    out: dict[str, Any] = {"messages": messages}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "n_predict",
                 "cache_prompt", "speculative", "verbose", "return_progress", "timings_per_token",
                 "chat_template_kwargs"):
        if name in body:
            out[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        out["stop"] = stops
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [{"type": "function", "function": {
            "name": str(t.get("name", "")), "description": str(t.get("description", "")),
            "parameters": t.get("input_schema", {})}} for t in tools if isinstance(t, dict)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool"):
        out["tool_choice"] = "auto" if choice["type"] == "auto" else "required"
    return out


def anthropic_usage(stats: Any) -> dict:
    return {"cache_read_input_tokens": stats.n_cached, "input_tokens": stats.n_prompt - stats.n_cached,
            "output_tokens": stats.n_generated}


def anthropic_stop(stats: Any) -> str:
    return "end_turn" if stats.stop_reason in ("eos", "stop") else "max_tokens"


def anthropic_message(mid: str, model: str, result: Any, stopping_word: str) -> dict:
    content = [{"type": "text", "text": result.text}] if result.text else []
    return {"id": mid, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": anthropic_stop(result.stats), "stop_sequence": stopping_word or None,
            "usage": anthropic_usage(result.stats)}


class _Anthropic:
    def __init__(self, http) -> None:  # type: ignore[no-untyped-def]
        self.http = http

    async def messages(self, request):  # type: ignore[no-untyped-def]
        chat = anthropic_to_chat(await self.http.read_body(request))
        common, jobs, out = chat_jobs(self.http, chat, ["max_tokens", "n_predict"], allow_empty=True)
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
                    "id": mid, "type": "message", "role": "assistant", "content": [], "model": self.http.model_id,
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

            return await self.http.serve(jobs, lambda: self.http.stream(request, jobs, out, emit, None, False))

        async def run():  # type: ignore[no-untyped-def]
            res = (await self.http.collect(jobs, out))[0]
            return self.http.json(anthropic_message(mid, self.http.model_id, res, stopping_word(res)))

        return await self.http.serve(jobs, run)

    async def count_tokens(self, request):  # type: ignore[no-untyped-def]
        chat = anthropic_to_chat(await self.http.read_body(request))
        if chat["messages"]:
            parse_messages(chat["messages"])  # checked as for generation
        return self.http.json({"input_tokens": await count_chat_tokens(self.http, chat)})  # no "object" here
