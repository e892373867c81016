"""``pydflash serve`` against the shipped upstream ``llama-server``: the same request to both, the
same answer (tokens, status codes, response shapes).

Both run the same SmolLM2-135M file with plain decoding, two slots, ``--seed 42 --n-predict 16``,
both with their default chat templates (llama.cpp's Jinja engine renders the GGUF's template). Covered: ``/tokenize`` / ``/detokenize``; llama.cpp's prompt forms (token ids, mixed
strings and ids, several prompts, ``{"prompt_string": ...}``); ``/completions`` as the native
endpoint; CORS (preflight, ``--cors-origins localhost``); several ``--host`` addresses; Anthropic
``/v1/messages`` (+ ``count_tokens``), OpenAI ``/v1/responses``, ``/chat/completions/input_tokens``;
the role-only first chunk of a chat stream, ``response_fields``, ``verbose``, ``return_progress``,
the server's default seed and n_predict, chat validation. Greedy texts are compared tie-aware
(as in test_server.py: equal, or the first difference sits on a near-tie of plain decoding).

pydflash's servers here run on ggml's stock CPU kernels (``PYDFLASH_KERNELS=0``): what is compared
is the API, and the texts it carries are then llama-server's bit for bit. The default kernels'
texts against llama-server's, tie-aware, are test_generate's and test_server_native's twins.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import kernels_subprocess_env
from pydflash.tools.upstream_server import free_port, wait_healthy
from test_server import _assert_same_greedy, _stop

from pydflash.tools.upstream_binaries import tool_path

N_CTX = 2048
COMMON_ARGS = ["-np", "2", "-c", str(N_CTX), "-t", "2", "--seed", "42", "--n-predict", "16", "-b", "64"]
KEY = "sk-compat"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _call(base: str, path: str, body=None, *, method: str | None = None, headers: dict | None = None,
          host: str | None = None):  # type: ignore[no-untyped-def]
    """(status, headers, parsed JSON body or text)."""
    url = base + path if host is None else f"http://{host}:{base.rsplit(':', 1)[1]}{path}"
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, raw = exc.code, dict(exc.headers), exc.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")


def _post(base: str, path: str, body: dict, **kw):  # type: ignore[no-untyped-def]
    status, _, out = _call(base, path, body, **kw)
    assert status == 200, (base, path, out)
    return out


def _events(base: str, path: str, body: dict, **kw) -> list:  # type: ignore[no-untyped-def]
    """The SSE events of a streamed answer: (event name or None, data) pairs, [DONE] left out."""
    url = base + path
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **kw.get("headers", {})})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        raw = resp.read().decode()
    out = []
    for block in raw.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[len("data: "):])
        if data is not None:
            out.append((name, data))
    return out


def _kinds(events: list) -> list:
    """Event names with runs of one name collapsed (a delta per token upstream, per text piece here)."""
    out: list = []
    for name, _ in events:
        if not out or out[-1] != name:
            out.append(name)
    return out


def _start_ours(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pydflash.server", *args, "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=kernels_subprocess_env("stock"))
    return proc, port


def _start_upstream(args: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(tool_path("llama-server")), *args, "--port", str(port),
                                 "--fit", "off", "--no-warmup"], stdout=f, stderr=subprocess.STDOUT)
    return proc, port


START = {"ours": _start_ours, "upstream": _start_upstream}


@contextlib.contextmanager
def running(tmp: Path, specs: dict[str, tuple[str, list[str]]]):  # type: ignore[no-untyped-def]
    """Start each server of ``specs`` ({label: ("ours" | "upstream", argv)}), wait until healthy;
    yields {label: (base URL, process)} and stops them all at the end."""
    procs, out = [], {}
    try:
        for label, (kind, args) in specs.items():
            proc, port = START[kind](args, tmp / f"{label}.log")
            procs.append(proc)
            out[label] = (f"http://127.0.0.1:{port}", proc)
            wait_healthy(out[label][0], proc, log=tmp / f"{label}.log")
        yield out
    finally:
        for proc in procs:
            _stop(proc)


def both(args: list[str]) -> dict[str, tuple[str, list[str]]]:
    """The same argv for pydflash and the shipped llama-server."""
    return {"ours": ("ours", args), "upstream": ("upstream", args)}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, smollm2_path):
    """{"ours": base URL, "upstream": base URL}, both on the same model and flags."""
    args = ["-m", str(smollm2_path), "--host", "127.0.0.1", *COMMON_ARGS]
    with running(tmp_path_factory.mktemp("compat"), both(args)) as up:
        yield {name: base for name, (base, _) in up.items()}


def _both(servers: dict, fn):  # type: ignore[no-untyped-def]
    return fn(servers["ours"]), fn(servers["upstream"])


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------


TOKENIZE_BODIES = [
    {"content": "What is the capital of France ?"},
    {"content": "What is the capital of France ?", "add_special": True},
    {"content": "<|im_start|>user\nhi<|im_end|>"},
    {"content": "<|im_start|>user\nhi<|im_end|>", "parse_special": False},
    {"content": "This is a test string with unicode 媽 and emoji 🤗", "with_pieces": True},
    {"content": "<|im_start|> and ü", "with_pieces": True},
    {"content": ["Hello", 42, " world", 7]},
    {"content": ""},
    {},
]


@pytest.mark.parametrize("body", TOKENIZE_BODIES)
def test_tokenize_equals_upstream(servers, body):
    ours, up = _both(servers, lambda b: _post(b, "/tokenize", body))
    assert ours == up


def test_detokenize_equals_upstream(servers):
    for text in ("What is the capital of France ?", "<|im_start|>user\n媽 🤗<|im_end|>", ""):
        tokens = _post(servers["upstream"], "/tokenize", {"content": text})["tokens"]
        ours, up = _both(servers, lambda b: _post(b, "/detokenize", {"tokens": tokens}))
        assert ours == up
    ours, up = _both(servers, lambda b: _post(b, "/detokenize", {}))
    assert ours == up == {"content": ""}
    # an id outside the vocabulary: a 400 (not sent upstream, which does not check it)
    status, _, out = _call(servers["ours"], "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and "error" in out


# ------------------------------------------------------------------------------------------------
# prompt forms
# ------------------------------------------------------------------------------------------------


PROMPT = "I believe the meaning of life is"


def _greedy(base: str, prompt, path: str = "/completion"):  # type: ignore[no-untyped-def]
    return _post(base, path, {"prompt": prompt, "n_predict": 8, "temperature": 0, "return_tokens": True})


def _same(smollm2, ours: dict, up: dict) -> None:  # type: ignore[no-untyped-def]
    assert ours["tokens_evaluated"] == up["tokens_evaluated"]
    prompt_tokens = smollm2.tokenize(up["prompt"], add_special=False, parse_special=True)
    _assert_same_greedy(smollm2, prompt_tokens, up["tokens"], ours["tokens"], what=up["prompt"])
    assert ours["prompt"] == up["prompt"]


def test_prompt_forms_equal_upstream(servers, smollm2_stock):
    smollm2 = smollm2_stock
    tokens = _post(servers["upstream"], "/tokenize", {"content": PROMPT, "add_special": True})["tokens"]
    singles = [PROMPT, tokens, {"prompt_string": PROMPT}, [1, 2, 3, PROMPT, 7, 8, PROMPT],
               [PROMPT, 42, " and"]]
    for prompt in singles:
        ours, up = _both(servers, lambda b: _greedy(b, prompt))
        assert isinstance(ours, dict) and isinstance(up, dict)
        _same(smollm2, ours, up)
    for prompts in ([tokens, tokens], [tokens, PROMPT], [tokens, {"prompt_string": PROMPT}], [PROMPT, "Hello"]):
        ours, up = _both(servers, lambda b: _greedy(b, prompts))
        assert isinstance(ours, list) and isinstance(up, list) and len(ours) == len(up) == len(prompts)
        assert [o["index"] for o in ours] == [u["index"] for u in up]
        for o, u in zip(ours, up):
            _same(smollm2, o, u)
    # /completions without /v1 is the native endpoint
    ours, up = _both(servers, lambda b: _greedy(b, PROMPT, "/completions"))
    assert set(ours) == set(up) and "content" in ours
    # the OpenAI endpoint takes the same forms
    for prompt in ([1, 2, 3, PROMPT], {"prompt_string": PROMPT}):
        ours, up = _both(servers, lambda b: _post(b, "/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                                          "temperature": 0}))
        assert ours["usage"]["prompt_tokens"] == up["usage"]["prompt_tokens"]


@pytest.mark.parametrize("prompt", [
    {"prompt_string": PROMPT, "multimodal_data": ["iVBORw0KGgo="]},  # no vision: refused
    [],
    {"text": PROMPT},
    [[1, 2], {"x": 1}],
])
def test_bad_prompt_forms_are_refused_as_upstream(servers, prompt):
    (s_ours, _, b_ours), (s_up, _, b_up) = _both(servers, lambda b: _call(b, "/completion", {"prompt": prompt}))
    assert s_up >= 400 and 400 <= s_ours < 500 and "error" in b_ours


def test_response_fields_verbose_and_server_defaults(servers):
    body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0,
            "response_fields": ["content", "generation_settings/n_predict", "prompt", "nope/x"]}
    ours, up = _both(servers, lambda b: _post(b, "/completion", body))
    assert set(ours) == set(up) == {"content", "generation_settings/n_predict", "prompt"}
    assert ours["generation_settings/n_predict"] == up["generation_settings/n_predict"] == 4
    assert ours["prompt"] == up["prompt"]
    # --seed / --n-predict are the defaults of a request
    ours, up = _both(servers, lambda b: _post(b, "/completion", {"prompt": PROMPT, "temperature": 0}))
    for out in (ours, up):
        assert out["generation_settings"]["seed"] == 42 and out["generation_settings"]["n_predict"] == 16
        assert out["tokens_predicted"] == 16
    assert set(up["generation_settings"]) - set(ours["generation_settings"]) <= {
        "grammar", "grammar_lazy", "grammar_triggers", "preserved_tokens", "chat_format",
        "reasoning_format", "reasoning_in_content", "generation_prompt", "samplers", "timings_per_token",
        "post_sampling_probs", "backend_sampling", "lora", "dry_sequence_breakers", "stream"}
    ours, up = _both(servers, lambda b: _call(b, "/props")[2])
    assert ours["default_generation_settings"]["params"]["seed"] == up["default_generation_settings"]["params"]["seed"]
    # verbose: the native object under __verbose
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "verbose": True}),
                       ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "verbose": True})):
        ours, up = _both(servers, lambda b: _post(b, path, body))
        assert ours["__verbose"]["prompt"] == up["__verbose"]["prompt"]
        assert ours["system_fingerprint"].startswith("b") and up["system_fingerprint"].startswith("b")
        ours, up = _both(servers, lambda b: _post(b, path, {**body, "verbose": False}))
        assert "__verbose" not in ours and "__verbose" not in up


def test_logit_bias_and_ignore_eos_in_generation_settings(servers):
    """generation_settings.logit_bias: the request's pairs, plus every end-of-generation token at
    -inf (JSON null) under ignore_eos, as llama-server lists them."""
    def bias(b: str, body: dict) -> list:
        out = _post(b, "/completion", {"prompt": PROMPT, "n_predict": 2, "temperature": 0, **body})
        return sorted(out["generation_settings"]["logit_bias"], key=lambda e: e["token"])

    ours, up = _both(servers, lambda b: bias(b, {"ignore_eos": True}))
    assert ours == up and ours and all(e["bias"] is None for e in ours)
    ours, up = _both(servers, lambda b: bias(b, {"ignore_eos": False}))
    assert ours == up == []
    ours, up = _both(servers, lambda b: bias(b, {"logit_bias": [[42, -3.5], [7, 1.0]]}))
    assert ours == up == [{"bias": 1.0, "token": 7}, {"bias": -3.5, "token": 42}]


def test_max_tokens_past_the_context_stops_at_the_context(tmp_path, smollm2_path):
    """n_predict beyond a slot's context is not refused (llama-server without context shift):
    generation stops when the context is full, finish_reason "length", truncated."""
    # 256: llama-server's smallest context (it pads -c up to it)
    args = ["-m", str(smollm2_path), "--host", "127.0.0.1", "-np", "1", "-c", "256", "-t", "2", "--seed", "1"]
    with running(tmp_path, both(args)) as up:
        bases = {name: base for name, (base, _) in up.items()}
        body = {"prompt": "Once", "n_predict": 300, "temperature": 0, "ignore_eos": True}
        ours, up = _both(bases, lambda b: _post(b, "/completion", body))
        for out in (ours, up):
            assert out["truncated"] is True and out["stop_type"] == "limit"
            assert out["tokens_evaluated"] + out["tokens_predicted"] <= 256 + 1
        # upstream stops with n_ctx tokens in all; pydflash also samples from the full context's
        # last logits (that token is never decoded): one more
        assert ours["tokens_predicted"] - up["tokens_predicted"] in (0, 1), (ours["tokens_predicted"], up["tokens_predicted"])
        events = _events(bases["ours"], "/v1/completions", {**body, "stream": True})
        reasons = [d["choices"][0]["finish_reason"] for _, d in events if d.get("choices")]
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        # a prompt that does not fit is still refused
        status = _call(bases["ours"], "/completion", {"prompt": "word " * 300, "n_predict": 4})[0]
        assert status == 400


def test_streamed_completion_chunks_and_progress(servers):
    body = {"prompt": PROMPT * 12, "n_predict": 6, "temperature": 0, "stream": True, "return_progress": True}
    ours, up = _both(servers, lambda b: [d for _, d in _events(b, "/completion", body)])
    for events in (ours, up):
        progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
        assert progress and progress[0]["cache"] == progress[0]["processed"]
        assert progress[-1]["processed"] == progress[-1]["total"]
        assert all(b["processed"] > a["processed"] for a, b in zip(progress, progress[1:]))
        pieces = [e for e in events if not e["stop"] and "prompt_progress" not in e]
        assert pieces and all(e["tokens"] and all(isinstance(t, int) for t in e["tokens"]) for e in pieces)
        assert events[-1]["stop"] and events[-1]["stop_type"] == "limit"
    assert [e["prompt_progress"]["total"] for e in ours if "prompt_progress" in e][-1] == \
        [e["prompt_progress"]["total"] for e in up if "prompt_progress" in e][-1]
    assert "".join(e["content"] for e in ours) == "".join(e["content"] for e in up)


# ------------------------------------------------------------------------------------------------
# chat: streaming shape, validation, token counts, Anthropic, Responses
# ------------------------------------------------------------------------------------------------


def test_chat_stream_starts_with_a_role_only_chunk(servers):
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    ours, up = _both(servers, lambda b: [d for _, d in _events(b, "/v1/chat/completions", body)])
    for events in (ours, up):
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert all("role" not in e["choices"][0]["delta"] for e in events[1:] if e["choices"])
        assert events[-1]["choices"] == [] and "timings" in events[-1] and "usage" in events[-1]
        assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] in ("stop",
                                                                                                        "length")
    text = lambda evs: "".join(e["choices"][0]["delta"].get("content") or "" for e in evs if e["choices"])  # noqa: E731
    assert text(ours) == text(up)
    # the cached part depends on what each server's slots held before (the tests run before this one)
    drop = lambda usage: {k: v for k, v in usage.items() if k != "prompt_tokens_details"}  # noqa: E731
    assert drop(ours[-1]["usage"]) == drop(up[-1]["usage"])
    for events in (ours, up):
        usage = events[-1]["usage"]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "add_generation_prompt": True, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "t"}, {"role": "assistant", "content": "t"},
                  {"role": "assistant", "content": "t"}]},
    {"messages": [{"role": "system", "content": 123}]},
    {"messages": [{"role": "system", "content": "test"}, {}]},
])
def test_chat_validation_equals_upstream(servers, body):
    (s_ours, _, b_ours), (s_up, _, _) = _both(servers, lambda b: _call(b, "/v1/chat/completions",
                                                                        {**body, "max_tokens": 2}))
    assert s_up in (400, 500) and s_ours == 400 and "error" in b_ours


def test_token_counts_equal_upstream(servers):
    ours, up = _both(servers, lambda b: _post(b, "/chat/completions/input_tokens", {"messages": CHAT}))
    assert ours == up and ours["input_tokens"] > 5
    anthropic = {"model": "x", "system": "You are terse.", "messages": [{"role": "user", "content": "Hello world"}]}
    ours, up = _both(servers, lambda b: _post(b, "/v1/messages/count_tokens", anthropic))
    assert ours == up and "output_tokens" not in ours


ANTHROPIC = {"model": "test", "max_tokens": 12, "temperature": 0, "system": "You are terse.",
             "messages": [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text",
                                                                                          "text": " hello"}]}]}


def test_anthropic_messages_equal_upstream(servers):
    single = {**ANTHROPIC, "messages": [{"role": "user", "content": "Say hello"}]}
    ours, up = _both(servers, lambda b: _post(b, "/v1/messages", single))
    assert set(ours) == set(up) and "timings" not in ours
    assert ours["type"] == "message" and ours["role"] == "assistant"
    assert ours["content"] == up["content"] and ours["usage"] == up["usage"]
    assert ours["stop_reason"] == up["stop_reason"] and ours["id"].startswith("msg")

    assert _post(servers["ours"], "/v1/messages", ANTHROPIC)["type"] == "message"  # text blocks
    ours, up = _both(servers, lambda b: _events(b, "/v1/messages", {**single, "stream": True}))
    assert _kinds(ours) == _kinds(up) and all(n == d["type"] for n, d in ours)
    start_o, start_u = ours[0][1]["message"], up[0][1]["message"]
    assert set(start_o) == set(start_u) and start_o["content"] == [] and start_o["usage"]["input_tokens"] > 0
    text = lambda evs: "".join(d["delta"]["text"] for _, d in evs if d["type"] == "content_block_delta")  # noqa: E731
    assert text(ours) == text(up)
    assert ours[-2][1] == up[-2][1]  # message_delta: stop reason and output tokens

    # tool results become tool messages; an image is refused with upstream's message (no vision), as a 400
    # where upstream answers 500: the request is what cannot be served
    tool = {"model": "test", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "What's the weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]}]}
    ours = _post(servers["ours"], "/v1/messages", tool)
    assert ours["type"] == "message"
    image = {"model": "test", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"}]}]}
    (s_ours, _, b_ours), (s_up, _, b_up) = _both(servers, lambda b: _call(b, "/v1/messages", image))
    assert s_ours == 400 and s_up == 500
    assert "image input is not supported" in b_ours["error"]["message"] and \
        "image input is not supported" in b_up["error"]["message"]
    # no messages: still a message (llama-server is permissive)
    (s_ours, _, b_ours), (s_up, _, _) = _both(servers, lambda b: _call(b, "/v1/messages", {
        "model": "x", "max_tokens": 4, "messages": []}))
    assert s_ours == s_up == 200 and b_ours["type"] == "message"
    (s_ours, _, _), (s_up, _, _) = _both(servers, lambda b: _call(b, "/v1/messages", {"max_tokens": 4}))
    assert s_ours >= 400 and s_up >= 400


RESPONSES = {"model": "gpt-4.1", "input": [{"role": "system", "content": "Book"},
                                            {"role": "user", "content": "What is the best book"}],
             "max_output_tokens": 8, "temperature": 0}


def test_responses_equal_upstream(servers):
    ours, up = _both(servers, lambda b: _post(b, "/v1/responses", RESPONSES))
    assert set(ours) == set(up) and ours["id"].startswith("resp_") and ours["output"][0]["id"].startswith("msg_")
    assert ours["output"][0]["content"] == up["output"][0]["content"]
    # the cached share depends on what each server's slots held before
    drop = lambda u: {k: v for k, v in u.items() if k != "input_tokens_details"}  # noqa: E731
    assert drop(ours["usage"]) == drop(up["usage"])

    ours, up = _both(servers, lambda b: _events(b, "/responses", {**RESPONSES, "stream": True}))
    assert _kinds(ours) == _kinds(up)
    done_o, done_u = ours[-1][1]["response"], up[-1][1]["response"]
    assert set(done_o) == set(done_u) and done_o["output"] == [
        {**done_u["output"][0], "id": done_o["output"][0]["id"]}]
    msg_id = done_o["output"][0]["id"]
    assert all(d["item_id"] == msg_id for _, d in ours if "item_id" in d)
    ours, up = _both(servers, lambda b: _post(b, "/v1/responses/input_tokens", RESPONSES))
    assert ours == up


def test_openai_clients_on_responses_and_messages(servers):
    import openai

    client = openai.OpenAI(base_url=servers["ours"] + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(**RESPONSES)
    assert r.id.startswith("resp_") and r.output_text
    text = "".join(e.delta for e in client.responses.create(**RESPONSES, stream=True)
                   if e.type == "response.output_text.delta")
    assert text == r.output_text


# ------------------------------------------------------------------------------------------------
# HTTP: CORS, several addresses, /metrics
# ------------------------------------------------------------------------------------------------


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
CORS_HEADERS = ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials", "Access-Control-Allow-Methods",
                "Access-Control-Allow-Headers")


def test_cors_default_equals_upstream(servers):
    for origin in ("localhost", "web.mydomain.fr", "http://evil.com"):
        (s_o, h_o, _), (s_u, h_u, _) = _both(servers, lambda b: _call(
            b, "/completions", method="OPTIONS", headers={"Origin": origin, **PREFLIGHT}))
        assert s_o == s_u == 200
        assert {k: h_o.get(k) for k in CORS_HEADERS} == {k: h_u.get(k) for k in CORS_HEADERS}
        assert h_o["Access-Control-Allow-Origin"] == origin
        (s_o, h_o, _), (s_u, h_u, _) = _both(servers, lambda b: _call(b, "/health", headers={"Origin": origin}))
        assert h_o.get("Access-Control-Allow-Origin") == h_u.get("Access-Control-Allow-Origin") == origin


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def strict_servers(tmp_path_factory, smollm2_path):
    """Both servers with an API key, ``--cors-origins localhost`` and, where the machine has IPv6
    loopback, two addresses."""
    tmp = tmp_path_factory.mktemp("compat-strict")
    hosts = "127.0.0.1,::1" if _ipv6() else "127.0.0.1"
    args = ["-m", str(smollm2_path), "--host", hosts, *COMMON_ARGS, "--cors-origins", "localhost",
            "--api-key", KEY, "--metrics"]
    with running(tmp, both(args)) as up:
        yield {name: base for name, (base, _) in up.items()}, hosts.split(",")


def test_cors_origins_localhost_equals_upstream(strict_servers):
    servers, _ = strict_servers
    for origin in ("http://localhost", "http://127.0.0.1:3000", "http://[::1]:3000", "http://web.mydomain.fr",
                   "http://notlocalhost", "http://localhost.evil.com"):
        (s_o, h_o, _), (s_u, h_u, _) = _both(servers, lambda b: _call(
            b, "/completions", method="OPTIONS", headers={"Origin": origin, **PREFLIGHT}))
        assert s_o == s_u == 200
        assert h_o.get("Access-Control-Allow-Origin") == h_u.get("Access-Control-Allow-Origin")
        assert h_o.get("Access-Control-Allow-Origin") in (origin, None)


def test_several_addresses_and_api_key_equal_upstream(strict_servers):
    servers, hosts = strict_servers
    for host in [f"[{h}]" if ":" in h else h for h in hosts]:
        for name in ("ours", "upstream"):
            base = servers[name]
            assert _call(base, "/health", host=host)[0] == 200
            assert _call(base, "/v1/completions", {}, host=host)[0] == 401
            status, _, out = _call(base, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4},
                                   headers={"Authorization": f"Bearer {KEY}"}, host=host)
            assert status == 200 and out["usage"]["completion_tokens"] == 4
            status, _, out = _call(base, "/completions", {"prompt": "Hi", "n_predict": 2},
                                   headers={"X-Api-Key": KEY}, host=host)
            assert status == 200 and "content" in out


def test_metrics_header_and_counters(strict_servers):
    servers, _ = strict_servers
    auth = {"Authorization": f"Bearer {KEY}"}
    (s_o, h_o, t_o), (s_u, h_u, t_u) = _both(servers, lambda b: _call(b, "/metrics", headers=auth))
    assert s_o == s_u == 200
    assert int(h_o["Process-Start-Time-Unix"]) > 0 and int(h_u["Process-Start-Time-Unix"]) > 0

    def names(text: str) -> set:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE llamacpp:")}

    assert names(t_u) <= names(t_o)


QWEN3_TEMPLATE = (Path(__file__).resolve().parents[1] / ".cache" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp"
                  / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja")


def test_anthropic_history_blocks_render_as_upstream(tmp_path, smollm2_path):
    """Thinking and tool-use blocks of an Anthropic history reach the template (as reasoning_content
    and tool_calls, tools as OpenAI functions): the same token counts as llama-server, with a
    template that renders them (Qwen3's); before, the thinking was dropped and the counts equal."""
    if not QWEN3_TEMPLATE.is_file():
        pytest.skip(f"no {QWEN3_TEMPLATE}")
    args = ["-m", str(smollm2_path), "--host", "127.0.0.1", "-np", "1", "-c", "1024", "-t", "2", "--jinja",
            "--chat-template-file", str(QWEN3_TEMPLATE)]
    tool = {"name": "list_files", "description": "List files",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    use = {"type": "tool_use", "id": "call_1", "name": "list_files", "input": {"path": "."}}
    think = {"type": "thinking", "thinking": "I should look at the project layout first."}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "main.py"}]}
    histories = {"plain": [{"role": "user", "content": "Fix the bug"}, {"role": "assistant", "content": [use]}, result],
                 "thinking": [{"role": "user", "content": "Fix the bug"},
                              {"role": "assistant", "content": [think, use]}, result]}
    with running(tmp_path, both(args)) as up:
        counts = {}
        for name, (base, _) in up.items():
            for kind, messages in histories.items():
                counts[name, kind] = _post(base, "/v1/messages/count_tokens",
                                           {"model": "m", "messages": messages, "tools": [tool]})["input_tokens"]
            assert counts[name, "thinking"] > counts[name, "plain"], counts
        assert counts["ours", "plain"] == counts["upstream", "plain"], counts
        assert counts["ours", "thinking"] == counts["upstream", "thinking"], counts
