"""Other vendors' APIs on the chat path: Anthropic's Messages (``/v1/messages``,
``/v1/messages/count_tokens``) and OpenAI's Responses (``/v1/responses``).

Each request is turned into an OpenAI chat body (messages + the sampling fields the chat path
reads), generated as a chat completion, and the result is written in the vendor's shape, as
llama-server does. Anthropic content blocks map as llama-server maps them: text blocks are
kept, thinking blocks become the message's ``reasoning_content``, tool-use blocks its
``tool_calls``, tool results ``tool`` messages, and tools / tool_choice their OpenAI forms (the
chat template renders them); blocks of other types are skipped, as llama-server skips them. An
image is refused with llama-server's message, as a 400 (llama-server answers 500: the request,
not the server, is at fault).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .jobs import APIError, client_input

__all__ = ["anthropic_to_chat", "responses_to_chat", "anthropic_message", "anthropic_usage",
           "responses_body", "random_id"]

IMAGE_REFUSED = "image input is not supported - hint: if this is unexpected, you may need to provide the mmproj"


def random_id() -> str:
    return uuid.uuid4().hex


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
