"""``pydflash serve``: the real server on loopback, talked to with the official ``openai`` client.

SmolLM2-135M target + a tiny random DFlash2 drafter (almost nothing is accepted, so every step
drafts, verifies and rolls back; output must still be the target's own). Greedy output equals
``Engine.generate`` on the same files; 8 parallel streams are batched and each equals its own
single-request output; metrics agree with the responses' timings; bad input gets a 4xx with an
OpenAI-style error body and the server keeps serving. Last, the shipped upstream ``llama-server``
runs the same drafter with ``--spec-type draft-dflash`` and its greedy output equals its own
output without the drafter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from fixtures_tiny import smollm2_drafter_config, write_checkpoint
from net import free_port, wait_healthy

from pydflash import Engine
from pydflash._tools import tool_path
from pydflash.convert import convert

N_SLOTS = 8
N_CTX_SLOT = 256
API_KEY = "sk-test-pydflash"
ALIAS = "smol-dflash"
N_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Here is a list of fruits:\n1.",
    "Q: What is 12 times 7?\nA:",
    "Once upon a time, in a small village,",
    "import numpy as np\n\ndef mean(x):",
    "The three primary colors are",
    "1, 2, 3, 4, 5,",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _request(url: str, body: bytes | dict | None = None, *, key: str | None = API_KEY,
             method: str | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post_json(url: str, body: dict) -> dict:
    status, raw = _request(url, body)
    assert status == 200, raw
    return json.loads(raw)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _metrics(base: str) -> dict[str, float]:
    status, raw = _request(base + "/metrics")
    assert status == 200
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("server")
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=4), seed=3)
    return convert(tmp / "hf", tmp / "drafter-f16.gguf", target_gguf=smollm2_path, outtype="f16", progress=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path, drafter_path):
    port = free_port()
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pydflash.server", "-m", str(smollm2_path), "-md", str(drafter_path),
             "--spec-type", "draft-dflash", "--spec-draft-n-max", "3", "-np", str(N_SLOTS), "-c", str(N_SLOTS * N_CTX_SLOT), "-t", "2",
             "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY, "--metrics", "-a", ALIAS],
            stdout=f, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log=log)
        yield base
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(smollm2_path, drafter_path):
    """The same files and context layout as the server (n_ctx per slot, 8 sequences)."""
    with Engine(smollm2_path, drafter_path, n_ctx=N_CTX_SLOT, n_threads=2, n_seq_max=N_SLOTS, n_max=3) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine):
    """Single-request greedy results of Engine.generate, by prompt."""
    cache: dict = {}

    def get(prompt: str, chat: bool = False):
        if (prompt, chat) not in cache:
            if chat:
                cache[prompt, chat] = engine.chat(CHAT, max_tokens=N_TOKENS, temperature=0)
            else:
                cache[prompt, chat] = engine.generate(prompt, max_tokens=N_TOKENS, temperature=0)
        return cache[prompt, chat]

    return get


def test_models_health_slots(server, client):
    assert [m.id for m in client.models.list().data] == [ALIAS]
    status, raw = _request(server + "/health", key=None)  # public, like llama-server's
    assert status == 200 and json.loads(raw) == {"status": "ok"}
    status, raw = _request(server + "/slots")
    slots = json.loads(raw)
    assert status == 200 and len(slots) == N_SLOTS and all(s["n_ctx"] == N_CTX_SLOT for s in slots)


def test_completion_greedy_equals_engine(client, reference):
    ref = reference(PROMPTS[0])
    r = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.stats.stop_reason == "length" else "stop")
    assert r.usage.prompt_tokens == ref.stats.n_prompt and r.usage.completion_tokens == ref.stats.n_generated
    assert r.model == ALIAS

    pieces = [c.choices[0].text for c in client.completions.create(
        model=ALIAS, prompt=PROMPTS[1], max_tokens=N_TOKENS, temperature=0, stream=True)]
    assert "".join(pieces) == reference(PROMPTS[1]).text and len([p for p in pieces if p]) > 1


def test_chat_greedy_equals_engine(client, reference):
    ref = reference("chat", chat=True)
    r = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=N_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == ref.stats.n_generated and r.usage.prompt_tokens == ref.stats.n_prompt

    chunks = list(client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=N_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == ref.stats.n_generated


def test_native_completion_timings_and_speculative_fields(server, reference):
    ref = reference(PROMPTS[2])
    out = _post_json(server + "/completion", {"prompt": PROMPTS[2], "n_predict": N_TOKENS, "temperature": 0,
                                              "return_tokens": True, "cache_prompt": False})
    assert out["content"] == ref.text
    tokens = ref.tokens[:-1] if ref.stats.stop_reason == "eos" else ref.tokens
    assert out["tokens"] == tokens
    t = out["timings"]
    assert t["prompt_n"] == ref.stats.n_prompt and t["predicted_n"] == ref.stats.n_generated
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["draft_n"] <= 3 * t["draft_n_verif_steps"]  # block 4: at most 3 drafts per step

    # streamed: content pieces, then a final chunk with stop and timings
    status, raw = _request(server + "/completion", {"prompt": PROMPTS[2], "n_predict": N_TOKENS, "temperature": 0,
                                                    "stream": True})
    events = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and "".join(e["content"] for e in events) == ref.text
    assert events[-1]["stop"] and events[-1]["timings"]["predicted_n"] == ref.stats.n_generated
    assert not any(e["stop"] for e in events[:-1])

    # per request: llama.cpp's dotted keys and a nested object
    for spec in ({"speculative.n_max": 1}, {"speculative": {"n_max": 1, "n_min": 0, "p_min": 0.5}}):
        out = _post_json(server + "/completion", {"prompt": PROMPTS[2], "n_predict": N_TOKENS, "temperature": 0,
                                                  **spec})
        assert out["content"] == ref.text
        assert 0 < out["timings"]["draft_n"] <= out["timings"]["draft_n_verif_steps"]
        assert out["generation_settings"]["speculative.n_max"] == 1


def test_parallel_streams_are_batched_and_correct(server, client, reference):
    refs = [reference(p).text for p in PROMPTS]
    before = _metrics(server)
    barrier = threading.Barrier(N_SLOTS)
    texts: list = [None] * N_SLOTS
    failures: list = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            stream = client.completions.create(model=ALIAS, prompt=PROMPTS[i], max_tokens=N_TOKENS, temperature=0,
                                               stream=True)
            texts[i] = "".join(c.choices[0].text for c in stream)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not failures, failures
    assert texts == refs
    after = _metrics(server)
    n_batches = after["pydflash:batches_total"] - before["pydflash:batches_total"]
    assert after["pydflash:batched_requests_total"] - before["pydflash:batched_requests_total"] == N_SLOTS
    assert n_batches < N_SLOTS  # requests were served together, not one after another


def test_prompt_list_and_seeded_sampling(client, engine, reference):
    r = client.completions.create(model=ALIAS, prompt=PROMPTS[:2], max_tokens=N_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [reference(p).text for p in PROMPTS[:2]]

    ref = engine.generate(PROMPTS[4], max_tokens=12, temperature=0.8, seed=7)
    for _ in range(2):
        r = client.completions.create(model=ALIAS, prompt=PROMPTS[4], max_tokens=12, temperature=0.8, seed=7)
        assert r.choices[0].text == ref.text


def test_metrics_agree_with_timings(server):
    before = _metrics(server)
    outs = [_post_json(server + "/completion", {"prompt": p, "n_predict": 12, "temperature": 0})
            for p in PROMPTS[:3]]
    after = _metrics(server)

    def delta(name: str) -> float:
        return after[f"llamacpp:{name}"] - before[f"llamacpp:{name}"]

    def total(field: str) -> int:
        return sum(o["timings"][field] for o in outs)

    assert delta("prompt_tokens_total") == total("prompt_n")
    assert delta("tokens_predicted_total") == total("predicted_n")
    assert delta("spec_decode_num_draft_tokens_total") == total("draft_n") > 0
    assert delta("spec_decode_num_accepted_tokens_total") == total("draft_n_accepted")
    assert delta("spec_decode_num_drafts_total") == total("draft_n_verif_steps") > 0
    assert delta("prompt_seconds_total") == pytest.approx(total("prompt_ms") / 1e3, rel=1e-6)
    assert delta("tokens_predicted_seconds_total") == pytest.approx(total("predicted_ms") / 1e3, rel=1e-6)
    per_pos = sum(delta(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}') for i in range(3))
    assert per_pos == total("draft_n_accepted")


def test_client_disconnect_cancels_generation(server, client):
    before = _metrics(server)
    stream = client.completions.create(model=ALIAS, prompt="Tell me a long story.", max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(2), stream):
        pass
    stream.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        after = _metrics(server)
        if after["pydflash:requests_total"] > before["pydflash:requests_total"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the cancelled request never finished")
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < 200


BAD_BODIES = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": 42}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 * N_CTX_SLOT}, 400),
    ("/v1/completions", {"prompt": "hello " * (2 * N_CTX_SLOT), "max_tokens": 4}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/completion", {"prompt": "hi", "speculative.n_max": -1}, 400),
    ("/completion", {"prompt": "hi", "n_predict": 4, "stream": "yes"}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_BODIES, ids=[f"{i}" for i in range(len(BAD_BODIES))])
def test_bad_input_is_a_4xx_and_the_server_keeps_serving(server, path, body, status):
    got, raw = _request(server + path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) and "code" in err
    assert _request(server + "/health", key=None)[0] == 200


def test_bad_input_through_the_openai_client(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=ALIAS, prompt="hi", max_tokens=10 * N_CTX_SLOT)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi " * 2 * N_CTX_SLOT}],
                                       max_tokens=2)
    for key in ("wrong-key", None):
        status, raw = _request(server + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    r = client.completions.create(model=ALIAS, prompt="hi", max_tokens=2, temperature=0)  # still serving
    assert r.usage.completion_tokens == 2


def test_bad_input_while_another_request_streams(server, client, reference):
    stream = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                       stream=True)
    it = iter(stream)
    first = next(it).choices[0].text
    assert _request(server + "/v1/completions", b"{oops")[0] == 400
    assert _request(server + "/v1/completions", {"prompt": "hi", "model": "nope"})[0] == 404
    assert first + "".join(c.choices[0].text for c in it) == reference(PROMPTS[0]).text


def test_command_line_errors(capsys):
    from pydflash.server import main

    assert main(["--spec-type", "draft-dflash"]) == 2  # needs -md
    assert main(["--spec-type", "ngram-simple", "-md", "x.gguf"]) == 2
    assert main(["-np", "0"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# the shipped upstream llama-server with our drafter
# ------------------------------------------------------------------------------------------------


def _upstream(smollm2_path, extra: list[str], tmp: Path, prompts: list[str]) -> list[dict]:
    port = free_port()
    log = tmp / f"llama-server-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [str(tool_path("llama-server")), "-m", str(smollm2_path), "--host", "127.0.0.1", "--port", str(port),
             "-c", "1024", "-t", "2", "-np", "1", "--no-webui", "--fit", "off", "--no-warmup", *extra],
            stdout=f, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log=log)
        outs = [_post_json(base + "/completion", {"prompt": p, "n_predict": 16, "temperature": 0,
                                                  "cache_prompt": False, "return_tokens": True}, ) for p in prompts]
    finally:
        _stop(proc)
    if extra:
        assert re.search(r"draft-dflash", log.read_text()), "the drafter was not used"
    return outs


def test_upstream_llama_server_with_our_drafter(smollm2_path, drafter_path, tmp_path):
    """The shipped llama-server drafts with our converted drafter, as converted (F16) and after
    our Q4_K_M quantizer; its greedy output equals its own output without a drafter."""
    from pydflash.quantize import quantize

    prompts = PROMPTS[:2]
    plain = _upstream(smollm2_path, [], tmp_path, prompts)
    q4 = quantize(drafter_path, tmp_path / "drafter-q4_k_m.gguf", "Q4_K_M", progress=False)
    for drafter in (drafter_path, q4):
        spec = _upstream(smollm2_path, ["--spec-type", "draft-dflash", "-md", str(drafter),
                                        "--spec-draft-n-max", "3"], tmp_path, prompts)
        for a, b in zip(plain, spec):
            assert b["tokens"] == a["tokens"] and b["content"] == a["content"]
            assert b["timings"].get("draft_n", 0) > 0  # drafts were proposed and verified
            assert "draft_n" not in a["timings"]


def test_auto_n_max_server_switches_a_losing_drafter_off(smollm2_path, drafter_path, tmp_path, reference,
                                                         monkeypatch):
    """Default --spec-draft-n-max auto: the server measures costs at load, probes the random
    drafter once, then serves plainly; every answer is still the target's own greedy text."""
    monkeypatch.setenv("PYDFLASH_AUTOTUNE_CACHE", "0")
    port = free_port()
    log = tmp_path / "auto.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pydflash.server", "-m", str(smollm2_path), "-md", str(drafter_path),
             "-np", "1", "-c", str(N_CTX_SLOT), "-t", "2", "--host", "127.0.0.1", "--port", str(port)],
            stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log=log)
        outs = [_post_json(base + "/completion", {"prompt": p, "n_predict": N_TOKENS, "temperature": 0,
                                                  "cache_prompt": False}) for p in PROMPTS[:3]]
    finally:
        _stop(proc)
    assert [o["content"] for o in outs] == [reference(p).text for p in PROMPTS[:3]]
    assert outs[-1]["timings"].get("draft_n", 0) == 0  # switched off after the probe
    assert outs[-1]["generation_settings"]["speculative.n_max"] == 0
