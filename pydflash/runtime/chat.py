"""Chat templates and structured output with llama.cpp's own machinery (its common library).

``ChatTemplates`` renders OpenAI chat requests with the Jinja engine llama-server uses (the
GGUF's template or an override, tools, reasoning, continuation) and parses generated text back
into content / reasoning / tool calls; ``json_schema_to_grammar`` is llama.cpp's converter.
Requests are passed as JSON, exactly as a client sent them.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .. import errors
from ._bindings import check, ffi, lib
from ._handle import NativeObject

__all__ = ["ChatTemplates", "json_schema_to_grammar"]


def _take_string(call) -> str:  # type: ignore[no-untyped-def]
    out = ffi.new("char **")
    check(call(out))
    try:
        return ffi.string(out[0]).decode("utf-8", "replace")
    finally:
        lib.dflash_string_free(out[0])


def _json_text(value: Any, what: str) -> bytes:
    if isinstance(value, (bytes, str)):
        return value.encode("utf-8") if isinstance(value, str) else value
    try:
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise errors.InvalidArgumentError(f"{what} is not JSON-serialisable: {exc}") from None


def json_schema_to_grammar(schema: Mapping[str, Any] | str) -> str:
    """GBNF that accepts exactly the JSON documents ``schema`` describes (llama.cpp's converter,
    what llama-server does for ``json_schema`` / ``response_format``)."""
    text = _json_text(schema, "the JSON schema")
    return _take_string(lambda out: lib.dflash_json_schema_to_grammar(text, out))


class ChatTemplates(NativeObject):
    """A target's chat templates, as llama-server's ``--jinja`` / ``--chat-template`` /
    ``--chat-template-file`` / ``--reasoning`` / ``--reasoning-format`` / ``--chat-template-kwargs``
    set them up.

    Args:
        target: the loaded Target (its GGUF's template is the default).
        template: Jinja source or a built-in template name (None: the GGUF's).
        use_jinja: False uses libllama's built-in template matcher instead of the Jinja engine.
        reasoning: "auto", "on" or "off".
        reasoning_format: e.g. "deepseek" (llama-server's default), "none", "auto".
        chat_template_kwargs: extra template variables (JSON values).
        prefill_assistant: a trailing assistant message is continued (llama-server's default).
    """

    _free = staticmethod(lib.dflash_chat_free)

    def __init__(self, target, *, template: str | None = None, use_jinja: bool = True,  # type: ignore[no-untyped-def]
                 reasoning: str = "auto", reasoning_format: str | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, prefill_assistant: bool = True) -> None:
        super().__init__()
        options: dict[str, Any] = {"template": template or "", "use_jinja": bool(use_jinja),
                                   "reasoning": reasoning, "prefill_assistant": bool(prefill_assistant)}
        if reasoning_format:
            options["reasoning_format"] = reasoning_format
        if chat_template_kwargs:
            options["chat_template_kwargs"] = dict(chat_template_kwargs)
        text = _json_text(options, "the chat options")
        out = ffi.new("dflash_chat **")
        with target._lock:
            check(lib.dflash_chat_create(target._h(), text, out))
        self._handle = out[0]
        self.use_jinja = bool(use_jinja)

    @property
    def source(self) -> str:
        """The template in use."""
        with self._lock:
            return _take_string(lambda out: lib.dflash_chat_source(self._h(), out))

    def render(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Render an OpenAI chat request: ``{"prompt", "grammar", "grammar_lazy", "additional_stops",
        "preserved_tokens", "json_schema", "format", "generation_prompt", ...}``. A request
        llama-server refuses raises InvalidArgumentError with its message."""
        text = _json_text(request, "the chat request")
        with self._lock:
            return json.loads(_take_string(lambda out: lib.dflash_chat_render(self._h(), text, out)))

    def parse(self, rendered: Mapping[str, Any], text: str, *, partial: bool = False) -> dict[str, Any]:
        """Split generated ``text`` into an OpenAI assistant message (``content``,
        ``reasoning_content``, ``tool_calls``) with the parser of ``rendered`` (what ``render``
        returned)."""
        r = _json_text(rendered, "the render result")
        t = text.encode("utf-8")
        with self._lock:
            return json.loads(_take_string(lambda out: lib.dflash_chat_parse(self._h(), r, t, bool(partial), out)))
