"""``pydflash serve`` / ``pydflash-server``: an OpenAI- and llama-server-compatible HTTP server
running the pydflash engine (a GGUF target plus an optional DFlash2 drafter).

It speaks llama-server's flags (``-m``, ``-md``, ``--spec-type draft-dflash``, ``-c``, ``-np``,
``-b``, ...) and its API: ``/health``, ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (SSE streaming or not, with ``usage``), llama.cpp's ``/completion``
(with ``timings``), ``/slots``, ``/props`` and, with ``--metrics``, Prometheus ``/metrics``.

Scheduling is *continuous batching* on the engine's stepped scheduler: a request joins the
running batch at the next step, each step verifies one draft block of every running sequence
plus prompt chunks of new ones in one target batch (``-b`` rows at most), and requests with
different sampling options share steps (each samples with its own options and seed; a request
without a seed gets a random one). Per-slot prompt caching as llama-server's: with
``cache_prompt`` (the request field, default true; ``--no-cache-prompt`` turns it off) a new
request goes to the free slot holding the longest common prefix of its prompt and reuses that
KV (``timings.cache_n``). A client that disconnects cancels its sequence only. Under
``--spec-draft-n-max auto`` the scheduler picks the draft width every step for the whole batch
(0: the drafter is not run), so speculation backs off as the load grows. The ``model`` field is
handled as llama-server does when it serves one model: any name is accepted.

Per-request ``speculative.n_max`` / ``n_min`` / ``p_min`` (llama.cpp's dotted keys or a nested
``"speculative": {...}`` object) override the server's values for that request; n_max is capped
at the drafter's block size - 1, and every step caps drafts to the rows left in the batch.

Context: as in llama-server, ``-c`` is the total context and each of the ``-np`` slots gets
``c / np`` tokens (``-c 0``: the model's training context, split the same way).

Modules, one per API family, each holding its routes, request parsing and answer shapes, and
registering itself from ``http``: ``api_openai`` (models, completions, chat, embeddings),
``api_llama`` (llama.cpp's native routes: completion, infill, tokenize, apply-template, embedding,
slots, props, metrics), ``api_anthropic`` (messages), ``api_responses`` (OpenAI's Responses),
``api_vertex`` (Vertex AI's /predict), ``cors_proxy`` (--ui-mcp-proxy). Beside them: ``http`` (the
aiohttp app: API keys, CORS, /health, the job and SSE plumbing), ``jobs`` (every request field
parsed once into ``Job``s, before the loop), ``answers`` (timings, usage, settings, SSE framing),
``text`` (tokenizer helpers), ``loop`` (the step loop: the one thread that owns the engine),
``metrics`` (Prometheus counters), ``command_line`` (flags -> ``ServerConfig``), ``app`` (the
process).
"""

from __future__ import annotations

from .app import main
from .command_line import ServerConfig, build_parser

__all__ = ["ServerConfig", "build_parser", "main"]
