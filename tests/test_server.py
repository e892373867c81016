"""``pydflash serve``: the real server on loopback, talked to with the official ``openai`` client
and plain HTTP.

SmolLM2-135M target + a tiny random DFlash2 drafter at a fixed n_max 3 (almost nothing is
accepted, so every step drafts, verifies and rolls back; output must still be the target's own).
References: the same request run alone (``Engine.generate`` on the same files), plain decoding
(``Target.generate``), and the shipped upstream ``llama-server``. Greedy comparisons are
tie-aware (docs: testing notes): outputs are equal, or the first difference sits where plain
decoding's top two probabilities are nearly tied, since a sequence batched with others (or
prefilled after a prompt-cache hit) sees batch-shaped numerics. Continuous batching: requests
arriving at different times join the running batch at the next step, whatever their sampling
options; a short request finishes within a bounded number of steps while a long one runs; a
client that disconnects cancels only its own sequence; a prompt-cache hit gives the tokens of a
cold prefill. Bad input gets a 4xx with an OpenAI-style error body and the server keeps serving.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
from fixtures_tiny import smollm2_drafter_config, write_checkpoint
from pydflash.tools.upstream_server import free_port, wait_healthy

from pydflash import Engine, Result, Target
from pydflash.tools.upstream_binaries import tool_path
from pydflash.formats.convert import convert

N_SLOTS = 8
N_CTX_SLOT = 512
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
SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "pydflash" / "drafters" / "smollm2-135m-instruct-dflash2.gguf"
TIE_MARGIN = 0.02


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _request(url: str, body: bytes | dict | None = None, *, key: str | None = API_KEY,
             method: str | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post_json(url: str, body: dict, *, key: str | None = API_KEY) -> dict:
    status, raw = _request(url, body, key=key)
    assert status == 200, raw
    return json.loads(raw)


def _get_json(url: str, *, key: str | None = API_KEY):  # type: ignore[no-untyped-def]
    status, raw = _request(url, key=key)
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


def _in_threads(calls: list, delays: list[float] | None = None) -> list:
    """Run the callables concurrently (call i starts after delays[i] s); their results in order."""
    results: list = [None] * len(calls)
    failures: list = []

    def run(i: int) -> None:
        try:
            if delays:
                time.sleep(delays[i])
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not failures, failures
    return results


def _top2_margin(target: Target, prompt_tokens: list[int], tokens: list[int]) -> float:
    """Plain decoding's top-1 minus top-2 probability after prompt + tokens."""
    target.rollback(0)
    target.decode(prompt_tokens + tokens)
    logits = target.logits().astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top2 = np.sort(p)[-2:]
    return float(top2[1] - top2[0])


def _assert_same_greedy(target: Target, prompt_tokens: list[int], want: list[int], got: list[int],
                        what: str = "") -> None:
    """Greedy tokens equal, or the first difference sits on a near-tie of plain decoding's top 2."""
    if got == want:
        return
    n = min(len(want), len(got))
    i = next((k for k in range(n) if want[k] != got[k]), n)
    assert i < n, f"{what}: {len(got)} tokens where the reference has {len(want)} (and they agree up to there)"
    margin = _top2_margin(target, prompt_tokens, want[:i])
    assert margin < TIE_MARGIN, f"{what}: divergence at token {i} with a clear margin {margin:.4f}"


def _assert_same_greedy_text(target: Target, prompt_tokens: list[int], ref: Result, text: str,
                             what: str = "") -> None:
    """As _assert_same_greedy for a text answer (the OpenAI API returns no token ids): the token of
    the reference whose text first leaves the common prefix must sit on a near-tie."""
    if text == ref.text:
        return
    common = len(os.path.commonprefix([text, ref.text]))
    i = next((k for k in range(len(ref.tokens)) if len(target.detokenize(ref.tokens[:k + 1])) > common), None)
    assert i is not None, f"{what}: {text!r} extends the reference {ref.text!r}"
    margin = _top2_margin(target, prompt_tokens, ref.tokens[:i])
    assert margin < TIE_MARGIN, f"{what}: {text!r} != {ref.text!r} at token {i} with a clear margin {margin:.4f}"


def _returned(result: Result) -> list[int]:
    """The tokens /completion returns for a result (as llama-server: without the final EOS)."""
    return result.tokens[:-1] if result.stats.stop_reason == "eos" else list(result.tokens)


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_path(tmp_path_factory, smollm2_path):
    """SmolLM2-135M as F16 (the shipped llama-quantize, from the Q4_1 file): with the quantized
    file, a sequence decoded next to others (one unified KV cache: attention runs over a larger,
    masked window) flips greedy picks at top-2 margins up to ~0.08, as the shipped llama-server
    with -kvu does, because activations are quantized per block and small differences grow; at
    F16 only accumulation order differs, and a tie-aware comparison can be strict."""
    out = tmp_path_factory.mktemp("target") / "SmolLM2-135M-Instruct-F16.gguf"
    subprocess.run([str(tool_path("llama-quantize")), "--allow-requantize", str(smollm2_path), str(out), "F16"],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def plain(target_path):
    """Plain decoding on the same target: the reference and the tie check's logits."""
    with Target(target_path, n_ctx=2048, n_threads=2) as t:
        yield t


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory, target_path):
    tmp = tmp_path_factory.mktemp("server")
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=4), seed=3)
    return convert(tmp / "hf", tmp / "drafter-f16.gguf", target_gguf=target_path, outtype="f16", progress=False)


def _start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pydflash.server", *args, "-t", "2", "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log=log)
    except BaseException:
        _stop(proc)
        raise
    return proc, base


@pytest.fixture(scope="module")
def server(tmp_path_factory, target_path, drafter_path):
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    proc, base = _start(["-m", str(target_path), "-md", str(drafter_path), "--spec-type", "draft-dflash",
                         "--spec-draft-n-max", "3", "-np", str(N_SLOTS), "-c", str(N_SLOTS * N_CTX_SLOT),
                         "--api-key", API_KEY, "--metrics", "-a", ALIAS], log)
    try:
        yield base
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(target_path, drafter_path):
    """The same files and context layout as the server (n_ctx per slot, 8 sequences, n_max 3)."""
    with Engine(target_path, drafter_path, n_ctx=N_CTX_SLOT, n_threads=2, n_seq_max=N_SLOTS, n_max=3) as e:
        yield e


@pytest.fixture(scope="module")
def alone(engine):
    """A request run alone (Engine.generate on the same files), cached by its arguments."""
    cache: dict = {}

    def get(prompt: str, **options):  # type: ignore[no-untyped-def]
        key = (prompt, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items())))
        if key not in cache:
            cache[key] = engine.generate(prompt, **options)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(alone, engine):
    """Single-request greedy results of N_TOKENS tokens, by prompt (chat=True: the CHAT messages)."""
    cache: dict = {}

    def get(prompt: str, chat: bool = False):  # type: ignore[no-untyped-def]
        if chat:
            if "chat" not in cache:
                cache["chat"] = engine.chat(CHAT, max_tokens=N_TOKENS, temperature=0)
            return cache["chat"]
        return alone(prompt, max_tokens=N_TOKENS, temperature=0)

    return get


def _chat_tokens(target: Target) -> list[int]:
    return target.tokenize(target.apply_chat_template(CHAT), parse_special=True)


# ------------------------------------------------------------------------------------------------
# the API against single requests run alone
# ------------------------------------------------------------------------------------------------


def test_models_health_slots(server, client):
    assert [m.id for m in client.models.list().data] == [ALIAS]
    status, raw = _request(server + "/health", key=None)  # public, like llama-server's
    assert status == 200 and json.loads(raw) == {"status": "ok"}
    slots = _get_json(server + "/slots")
    assert len(slots) == N_SLOTS and [s["id"] for s in slots] == list(range(N_SLOTS))
    assert all(s["n_ctx"] == N_CTX_SLOT and s["is_processing"] is False for s in slots)


def test_completion_greedy_equals_engine(client, reference, plain):
    ref = reference(PROMPTS[0])
    r = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0)
    _assert_same_greedy_text(plain, plain.tokenize(PROMPTS[0]), ref, r.choices[0].text)
    assert r.choices[0].finish_reason == ("length" if ref.stats.stop_reason == "length" else "stop")
    assert r.usage.prompt_tokens == ref.stats.n_prompt and r.usage.completion_tokens == ref.stats.n_generated
    assert r.model == ALIAS

    pieces = [c.choices[0].text for c in client.completions.create(
        model=ALIAS, prompt=PROMPTS[1], max_tokens=N_TOKENS, temperature=0, stream=True)]
    _assert_same_greedy_text(plain, plain.tokenize(PROMPTS[1]), reference(PROMPTS[1]), "".join(pieces))
    assert len([p for p in pieces if p]) > 1


def test_chat_greedy_equals_engine(client, reference, plain):
    ref = reference("chat", chat=True)
    r = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=N_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    _assert_same_greedy_text(plain, _chat_tokens(plain), ref, r.choices[0].message.content)
    assert r.usage.completion_tokens == ref.stats.n_generated and r.usage.prompt_tokens == ref.stats.n_prompt

    chunks = list(client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=N_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _assert_same_greedy_text(plain, _chat_tokens(plain), ref, text)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == ref.stats.n_generated


def test_any_model_name_is_accepted(server, client, reference, plain):
    """As llama-server serving one model: the request's `model` is not checked; answers name ours."""
    r = client.completions.create(model="gpt-4o", prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0)
    _assert_same_greedy_text(plain, plain.tokenize(PROMPTS[0]), reference(PROMPTS[0]), r.choices[0].text)
    assert r.model == ALIAS
    c = client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4, temperature=0)
    assert c.model == ALIAS and c.usage.completion_tokens == 4
    out = _post_json(server + "/completion", {"prompt": "hi", "n_predict": 2, "model": ""})
    assert out["tokens_predicted"] == 2


def test_native_completion_timings_and_speculative_fields(server, reference, plain):
    ref = reference(PROMPTS[2])
    prompt_tokens = plain.tokenize(PROMPTS[2])
    out = _post_json(server + "/completion", {"prompt": PROMPTS[2], "n_predict": N_TOKENS, "temperature": 0,
                                              "return_tokens": True, "cache_prompt": False})
    _assert_same_greedy(plain, prompt_tokens, _returned(ref), out["tokens"])
    t = out["timings"]
    assert t["cache_n"] == 0 and t["prompt_n"] == ref.stats.n_prompt == out["tokens_evaluated"]
    assert t["predicted_n"] == ref.stats.n_generated
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["draft_n"] <= 3 * t["draft_n_verif_steps"]  # block 4: at most 3 drafts per step
    assert out["generation_settings"]["speculative.n_max"] == 3 and out["id_slot"] in range(N_SLOTS)

    # streamed: content pieces, then a final chunk with stop and timings
    status, raw = _request(server + "/completion", {"prompt": PROMPTS[2], "n_predict": N_TOKENS, "temperature": 0,
                                                    "stream": True})
    events = [json.loads(line[len("data: "):]) for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200
    _assert_same_greedy_text(plain, prompt_tokens, ref, "".join(e["content"] for e in events))
    assert events[-1]["stop"] and events[-1]["timings"]["predicted_n"] == ref.stats.n_generated
    assert not any(e["stop"] for e in events[:-1])

    # per request: llama.cpp's dotted keys and a nested object
    for spec in ({"speculative.n_max": 1}, {"speculative": {"n_max": 1, "n_min": 0, "p_min": 0.5}}):
        out = _post_json(server + "/completion", {"prompt": PROMPTS[2], "n_predict": N_TOKENS, "temperature": 0,
                                                  "return_tokens": True, **spec})
        _assert_same_greedy(plain, prompt_tokens, _returned(ref), out["tokens"])
        assert 0 < out["timings"]["draft_n"] <= out["timings"]["draft_n_verif_steps"]
        assert out["generation_settings"]["speculative.n_max"] == 1


def test_prompt_list_and_seeded_sampling(client, alone, reference, plain):
    r = client.completions.create(model=ALIAS, prompt=PROMPTS[:2], max_tokens=N_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for p, c in zip(PROMPTS[:2], r.choices):
        _assert_same_greedy_text(plain, plain.tokenize(p), reference(p), c.text)

    ref = alone(PROMPTS[4], max_tokens=12, temperature=0.8, seed=7)
    for _ in range(2):
        r = client.completions.create(model=ALIAS, prompt=PROMPTS[4], max_tokens=12, temperature=0.8, seed=7)
        assert r.choices[0].text == ref.text


# ------------------------------------------------------------------------------------------------
# continuous batching
# ------------------------------------------------------------------------------------------------


def test_parallel_streams_share_steps_and_each_equals_alone(server, client, reference, plain):
    refs = [reference(p) for p in PROMPTS]
    before = _metrics(server)
    barrier = threading.Barrier(N_SLOTS)

    def run(i: int):  # type: ignore[no-untyped-def]
        def call() -> str:
            barrier.wait()
            stream = client.completions.create(model=ALIAS, prompt=PROMPTS[i], max_tokens=N_TOKENS, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in stream)
        return call

    texts = _in_threads([run(i) for i in range(N_SLOTS)])
    for p, ref, text in zip(PROMPTS, refs, texts):
        _assert_same_greedy_text(plain, plain.tokenize(p), ref, text, what=p)
    after = _metrics(server)
    steps = after["pydflash:steps_total"] - before["pydflash:steps_total"]
    seqs = after["pydflash:sequences_per_step_sum"] - before["pydflash:sequences_per_step_sum"]
    assert after["pydflash:requests_total"] - before["pydflash:requests_total"] == N_SLOTS
    # alone, every request needs about N_TOKENS steps (the random drafter is ~never accepted)
    assert steps < 3 * N_TOKENS < N_SLOTS * N_TOKENS / 2
    assert seqs / steps > N_SLOTS / 3  # steps were shared


def test_busy_server_output_equals_alone_whatever_the_arrival_order(server, alone, plain):
    """Requests of different lengths arrive at different times (so they join and leave a running
    batch at different steps), twice in different orders; each equals the request run alone."""
    lengths = [8, 40, 16, 32, 24, 12]
    prompts = PROMPTS[:len(lengths)]
    rng = random.Random(5)
    for order in (list(range(len(prompts))), list(reversed(range(len(prompts))))):
        delays = sorted(rng.uniform(0, 0.4) for _ in order)

        def call(i: int):  # type: ignore[no-untyped-def]
            return lambda: _post_json(server + "/completion", {
                "prompt": prompts[i], "n_predict": lengths[i], "temperature": 0, "ignore_eos": True,
                "return_tokens": True})

        outs = _in_threads([call(i) for i in order], delays)
        for i, out in zip(order, outs):
            ref = alone(prompts[i], max_tokens=lengths[i], temperature=0, ignore_eos=True)
            _assert_same_greedy(plain, plain.tokenize(prompts[i]), ref.tokens, out["tokens"], what=prompts[i])
            assert out["tokens_predicted"] == lengths[i]


def test_a_short_request_is_not_held_behind_a_long_one(server, alone, plain):
    """While a 128-token generation runs, an 8-token request gets its first token at the next
    steps and finishes within a bounded number of steps (independent of the long one's length),
    long before the long one ends."""
    long_prompt, n_long = "Tell me a long story about a dragon.", 128
    short_prompt, n_short = PROMPTS[3], 8
    long_out: dict = {}

    def run_long() -> None:
        long_out["out"] = _post_json(server + "/completion", {
            "prompt": long_prompt, "n_predict": n_long, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": False})

    t = threading.Thread(target=run_long)
    t.start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # the long one is decoding
            busy = [s for s in _get_json(server + "/slots") if s["is_processing"]]
            if busy and busy[0]["next_token"][0]["n_decoded"] >= 4:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the long request never started")
        steps0 = _metrics(server)["pydflash:steps_total"]
        req = urllib.request.Request(server + "/completion", data=json.dumps({
            "prompt": short_prompt, "n_predict": n_short, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_prompt": False}).encode(), headers={"Authorization": f"Bearer {API_KEY}"})
        steps_first, events = None, []
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[len(b"data: "):]))
                    if steps_first is None:
                        steps_first = _metrics(server)["pydflash:steps_total"]
        steps_done = _metrics(server)["pydflash:steps_total"]
        long_running = "out" not in long_out
    finally:
        t.join(timeout=300)
    assert long_running, "the long request finished before the short one"
    # slack: steps the long request runs while the HTTP round trips happen
    assert steps_first - steps0 <= 1 + 6
    assert steps_done - steps0 <= n_short + 8 < n_long / 4
    ref = alone(short_prompt, max_tokens=n_short, temperature=0, ignore_eos=True)
    _assert_same_greedy_text(plain, plain.tokenize(short_prompt), ref, "".join(e["content"] for e in events))
    ref_long = alone(long_prompt, max_tokens=n_long, temperature=0, ignore_eos=True)
    _assert_same_greedy(plain, plain.tokenize(long_prompt), ref_long.tokens, long_out["out"]["tokens"])


def test_mixed_sampling_options_share_steps(server, alone, plain):
    """Greedy, sampled (temperatures, filters, seeds), a stop string and per-request n_max, all in
    the same steps: each follows its own options.

    - greedy requests equal the request run alone (tie-aware);
    - sampled requests without drafts (speculative.n_max 0) equal the request run alone with the
      same seed: each sequence samples the target's logits with its own filters and RNG;
    - sampled requests whose filters leave one candidate (top_k 1, min_p 1) are greedy, drafts
      and all;
    - a seeded sampled request that drafts is not compared token for token: its path also
      depends on the drafter's q, and the drafter's batched graph (one graph for the blocks of all
      drafting sequences) is not bit-identical to a block drafted alone, so the seed reproduces
      the path only for the same batch (seen: 1 run in 8 took another path at T 0.8). It must
      finish like the request alone, and a high temperature must leave the greedy path."""
    stop_ref = alone(PROMPTS[6], max_tokens=16, temperature=0)
    greedy = {"temperature": 0}
    cases = [
        ("greedy", {"prompt": PROMPTS[0], **greedy}),
        ("same", {"prompt": PROMPTS[4], "temperature": 0.8, "seed": 7, "speculative.n_max": 0}),
        ("same", {"prompt": PROMPTS[5], "temperature": 1.0, "top_k": 5, "top_p": 0.9, "min_p": 0.0, "seed": 3,
                  "speculative.n_max": 0}),
        ("greedy", {"prompt": PROMPTS[1], "temperature": 1.0, "top_k": 1, "seed": 11}),
        ("greedy", {"prompt": PROMPTS[2], "temperature": 0.8, "min_p": 1.0, "seed": 12}),
        ("drafted", {"prompt": PROMPTS[3], "temperature": 2.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                     "seed": 13}),
        ("greedy", {"prompt": PROMPTS[6], **greedy, "stop": [stop_ref.text[6:9]]}),
        ("greedy", {"prompt": PROMPTS[7], **greedy, "speculative.n_max": 1}),
    ]
    before = _metrics(server)
    barrier = threading.Barrier(len(cases))

    def call(body: dict):  # type: ignore[no-untyped-def]
        def run() -> dict:
            barrier.wait()
            return _post_json(server + "/completion", {**body, "n_predict": 16, "ignore_eos": True,
                                                       "return_tokens": True})
        return run

    outs = _in_threads([call(body) for _, body in cases])
    after = _metrics(server)
    for (kind, body), out in zip(cases, outs):
        prompt_tokens = plain.tokenize(body["prompt"])
        if kind == "greedy":
            ref = alone(body["prompt"], max_tokens=16, temperature=0, ignore_eos=True,
                        **{k: body[k] for k in ("stop",) if k in body})
            _assert_same_greedy(plain, prompt_tokens, _returned(ref), out["tokens"], what=str(body))
        elif kind == "same":
            ref = alone(body["prompt"], max_tokens=16, ignore_eos=True, n_max=0,
                        **{k: body[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed") if k in body})
            assert out["tokens"] == ref.tokens, body
        else:
            ref = alone(body["prompt"], max_tokens=16, temperature=0, ignore_eos=True)
            assert out["tokens_predicted"] == 16 and out["tokens"] != ref.tokens
            assert out["timings"]["draft_n"] > 0
        assert out["generation_settings"]["temperature"] == body["temperature"]
    assert outs[6]["stop_type"] == "word" and outs[6]["stopping_word"] == cases[6][1]["stop"][0]
    assert outs[7]["generation_settings"]["speculative.n_max"] == 1
    assert outs[1]["timings"]["draft_n"] == 0 and outs[1]["generation_settings"]["speculative.n_max"] == 0
    steps = after["pydflash:steps_total"] - before["pydflash:steps_total"]
    seqs = after["pydflash:sequences_per_step_sum"] - before["pydflash:sequences_per_step_sum"]
    assert seqs / steps > 3  # they decoded together


def test_prompt_cache_reuse_equals_cold_prefill(server, client, alone, plain):
    """cache_prompt (default true): a request whose prompt extends an earlier one reuses that KV
    (timings.cache_n, usage cached_tokens, the metrics) and gives the tokens of a cold prefill."""
    base = "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz"
    longer = base + " built a machine that could"
    prompt_tokens = plain.tokenize(longer)
    n_base = len(plain.tokenize(base))
    before = _metrics(server)
    first = _post_json(server + "/completion", {"prompt": base, "n_predict": 8, "temperature": 0})
    warm = _post_json(server + "/completion", {"prompt": longer, "n_predict": N_TOKENS, "temperature": 0,
                                               "ignore_eos": True, "return_tokens": True})
    cold = _post_json(server + "/completion", {"prompt": longer, "n_predict": N_TOKENS, "temperature": 0,
                                               "ignore_eos": True, "return_tokens": True, "cache_prompt": False})
    after = _metrics(server)
    t = warm["timings"]
    assert n_base - 2 <= t["cache_n"] < len(prompt_tokens)
    assert t["prompt_n"] == len(prompt_tokens) - t["cache_n"] and warm["tokens_evaluated"] == len(prompt_tokens)
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == len(prompt_tokens)
    _assert_same_greedy(plain, prompt_tokens, cold["tokens"], warm["tokens"], what="warm vs cold")
    ref = alone(longer, max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    _assert_same_greedy(plain, prompt_tokens, ref.tokens, warm["tokens"], what="warm vs alone")
    cached = sum(o["timings"]["cache_n"] for o in (first, warm, cold))
    assert after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"] == cached
    assert (after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
            == sum(o["timings"]["prompt_n"] for o in (first, warm, cold)))

    r = client.completions.create(model=ALIAS, prompt=longer, max_tokens=4, temperature=0)  # the OpenAI view
    assert r.usage.prompt_tokens == len(prompt_tokens) and r.usage.prompt_tokens_details.cached_tokens > 0


def test_client_disconnect_cancels_only_its_sequence(server, client, alone, plain):
    before = _metrics(server)
    other: dict = {}

    def run_other() -> None:
        other["out"] = _post_json(server + "/completion", {"prompt": PROMPTS[5], "n_predict": 48, "temperature": 0,
                                                           "ignore_eos": True, "return_tokens": True})

    t = threading.Thread(target=run_other)
    t.start()
    stream = client.completions.create(model=ALIAS, prompt="Tell me a long story.", max_tokens=200,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(2), stream):
        pass
    stream.close()
    t.join(timeout=300)
    deadline = time.time() + 60
    while time.time() < deadline:
        after = _metrics(server)
        if after["pydflash:requests_total"] - before["pydflash:requests_total"] >= 2:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the cancelled request never finished")
    predicted = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert predicted < 48 + 100  # the cancelled one stopped early
    ref = alone(PROMPTS[5], max_tokens=48, temperature=0, ignore_eos=True)
    _assert_same_greedy(plain, plain.tokenize(PROMPTS[5]), ref.tokens, other["out"]["tokens"])
    assert not any(s["is_processing"] for s in _get_json(server + "/slots"))


def test_metrics_agree_with_timings(server):
    before = _metrics(server)
    outs = [_post_json(server + "/completion", {"prompt": p, "n_predict": 12, "temperature": 0})
            for p in PROMPTS[:3]]
    after = _metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    def total(field: str) -> int:
        return sum(o["timings"][field] for o in outs)

    assert delta("llamacpp:prompt_tokens_total") == total("prompt_n")
    assert delta("llamacpp:prompt_tokens_cached_total") == total("cache_n")
    assert delta("llamacpp:tokens_predicted_total") == total("predicted_n")
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == total("draft_n") > 0
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == total("draft_n_accepted")
    assert delta("llamacpp:spec_decode_num_drafts_total") == total("draft_n_verif_steps") > 0
    assert delta("llamacpp:prompt_seconds_total") == pytest.approx(total("prompt_ms") / 1e3, rel=1e-6)
    assert delta("llamacpp:tokens_predicted_seconds_total") == pytest.approx(total("predicted_ms") / 1e3, rel=1e-6)
    per_pos = sum(delta(f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}')
                  for i in range(3))
    assert per_pos == total("draft_n_accepted")
    # the step counters: one request at a time, so a step drafts 3 (n_max) but in a request's last
    # 3 steps (capped by max_tokens)
    steps = delta("pydflash:steps_total")
    assert steps >= delta("llamacpp:n_decode_total") == delta("pydflash:rows_per_step_count") > 0
    assert delta('pydflash:draft_width_steps_total{width="3"}') >= total("draft_n_verif_steps") - 3 * len(outs)
    assert delta("pydflash:rows_per_step_sum") >= 4 * delta('pydflash:draft_width_steps_total{width="3"}')


def test_slots_while_busy_have_llama_servers_fields(server, target_path, tmp_path):
    """/slots as the shipped llama-server shows it, both with one request generating."""

    def busy_slots(base: str, key: str | None) -> list[dict]:
        body = {"prompt": "Once upon a time", "n_predict": 200, "temperature": 0, "ignore_eos": True}
        t = threading.Thread(target=lambda: _request(base + "/completion", body, key=key))
        t.start()
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                slots = _get_json(base + "/slots", key=key)
                busy = [s for s in slots if s["is_processing"]]
                if busy and busy[0].get("next_token", [{}])[0].get("n_decoded", 0) > 0:
                    return slots
                time.sleep(0.02)
            pytest.fail(f"{base}: no slot became busy")
        finally:
            t.join(timeout=300)

    port = free_port()
    log = tmp_path / "llama-server-slots.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(tool_path("llama-server")), "-m", str(target_path), "--host", "127.0.0.1",
                                 "--port", str(port), "-c", "1024", "-t", "2", "-np", "2", "--slots", "--no-webui",
                                 "--fit", "off", "--no-warmup"], stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log=log)
        upstream = busy_slots(base, None)
    finally:
        _stop(proc)
    ours = busy_slots(server, API_KEY)

    def split(slots: list[dict]) -> tuple[dict, dict]:
        return next(s for s in slots if not s["is_processing"]), next(s for s in slots if s["is_processing"])

    (up_idle, up_busy), (our_idle, our_busy) = split(upstream), split(ours)
    assert set(our_idle) == set(up_idle)
    # pydflash does not know a running request's cache hit (only once it finished: timings.cache_n)
    assert set(up_busy) - set(our_busy) <= {"n_prompt_tokens_cache"}
    assert set(our_busy["next_token"][0]) == set(up_busy["next_token"][0])
    common = {"n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos",
              "speculative.types"}
    assert common <= set(up_busy["params"]) and common <= set(our_busy["params"])
    for s in (up_busy, our_busy):
        nt = s["next_token"][0]
        assert nt["has_next_token"] and nt["n_decoded"] + nt["n_remain"] == 200
        assert s["params"]["n_predict"] == 200 and s["params"]["ignore_eos"] is True
    assert our_busy["n_ctx"] == N_CTX_SLOT and our_busy["n_prompt_tokens"] == 4  # "Once upon a time"


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


BAD_BODIES = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": 42}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400),
    ("/v1/completions", {"prompt": "hi", "model": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "cache_prompt": "yes"}, 400),
    ("/v1/completions", {"prompt": "hello " * (2 * N_CTX_SLOT), "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": ["hi", "hello " * (2 * N_CTX_SLOT)], "max_tokens": 4}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/completion", {"prompt": "hi", "speculative.n_max": -1}, 400),
    ("/completion", {"prompt": "hi", "speculative.n_max": 1, "speculative.n_min": 2}, 400),
    ("/completion", {"prompt": "hi", "speculative.n_min": 5}, 400),  # above the server's n_max 3
    ("/completion", {"prompt": "hi", "n_predict": 4, "stream": "yes"}, 400),
    ("/completion", {"prompt": [{"text": "a"}]}, 400),
    ("/completion", {"prompt": {"prompt_string": "a", "multimodal_data": ["iVBORw0KGgo="]}}, 400),
    ("/completion", {"n_predict": 4}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_BODIES, ids=[f"{i}" for i in range(len(BAD_BODIES))])
def test_bad_input_is_a_4xx_and_the_server_keeps_serving(server, path, body, status):
    got, raw = _request(server + path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) and "code" in err
    assert _request(server + "/health", key=None)[0] == 200


def test_bad_input_through_the_openai_client(server, client):
    # (max_tokens past the slot's context, which is not an error, is compared with llama-server in
    # test_server_compat.py::test_max_tokens_past_the_context_stops_at_the_context)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi " * 2 * N_CTX_SLOT}],
                                       max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=ALIAS, prompt="hi", max_tokens=2, top_p=3.0)
    for key in ("wrong-key", None):
        status, raw = _request(server + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    r = client.completions.create(model=ALIAS, prompt="hi", max_tokens=2, temperature=0)  # still serving
    assert r.usage.completion_tokens == 2


def test_bad_input_while_another_request_streams(server, client, reference, plain):
    stream = client.completions.create(model=ALIAS, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                       stream=True)
    it = iter(stream)
    first = next(it).choices[0].text
    assert _request(server + "/v1/completions", b"{oops")[0] == 400
    assert _request(server + "/v1/completions", {"prompt": "hello " * (2 * N_CTX_SLOT), "max_tokens": 4})[0] == 400
    assert _request(server + "/v1/completions", {"prompt": [10**9]})[0] == 400
    text = first + "".join(c.choices[0].text for c in it)
    _assert_same_greedy_text(plain, plain.tokenize(PROMPTS[0]), reference(PROMPTS[0]), text)


def test_command_line_errors(capsys):
    from pydflash.server import main

    assert main(["--spec-type", "draft-dflash"]) == 2  # needs -md
    assert main(["--spec-type", "ngram-simple", "-md", "x.gguf"]) == 2
    assert main(["-np", "0"]) == 2
    assert main(["-np", "8", "-b", "4"]) == 2
    err = capsys.readouterr().err
    assert "needs a drafter" in err and "-b 4" in err


# ------------------------------------------------------------------------------------------------
# other configurations: the shipped drafter under auto, a losing drafter under auto, upstream
# ------------------------------------------------------------------------------------------------


def test_shipped_drafter_auto_busy_server_equals_plain_decoding(target_path, plain, tmp_path, monkeypatch):
    """The shipped drafter, n_max auto (the width chosen every step for the whole batch), 4 slots
    and 6 requests arriving over time (two wait for a slot): every answer is plain decoding's."""
    from pydflash.formats.drafter_profile import write_profile

    monkeypatch.setenv("PYDFLASH_AUTOTUNE_CACHE", "0")
    # without its acceptance profile the shipped drafter is probed at once (blind prior): auto drafts
    blind = write_profile(SHIPPED_DRAFTER, tmp_path / "blind.gguf", None)
    proc, base = _start(["-m", str(target_path), "-md", str(blind), "-np", "4", "-c", str(4 * 256),
                         "--metrics"], tmp_path / "auto-shipped.log")
    prompts = PROMPTS[:6]
    try:
        def call(p: str):  # type: ignore[no-untyped-def]
            return lambda: _post_json(base + "/completion", {"prompt": p, "n_predict": 32, "temperature": 0,
                                                             "ignore_eos": True, "return_tokens": True})

        outs = _in_threads([call(p) for p in prompts], [0.0, 0.0, 0.05, 0.1, 0.1, 0.3])
        metrics = _metrics(base)
    finally:
        _stop(proc)
    for p, out in zip(prompts, outs):
        tokens = plain.tokenize(p)
        ref = plain.generate(tokens, max_tokens=32, temperature=0, ignore_eos=True)
        _assert_same_greedy(plain, tokens, ref.tokens, out["tokens"], what=p)
    widths = {k: v for k, v in metrics.items() if k.startswith("pydflash:draft_width_steps_total")}
    assert widths and sum(widths.values()) <= metrics["pydflash:steps_total"]
    # cold start: auto probed the drafter. How many of the probed blocks' drafts were then verified is
    # the trim's call: blind, against this F16 target, it kept 1 draft in most runs and none in some
    assert metrics["pydflash:probe_steps_total"] > 0
    assert metrics["pydflash:requests_total"] == len(prompts)  # the warm-up is not a request


def test_a_small_batch_truncates_drafts_and_chunks_prompts(target_path, drafter_path, alone, plain, tmp_path):
    """-b 8 with 4 slots at n_max 3: 4 blocks of 4 rows do not fit one step, so drafts are cut to
    the rows left and prompts (up to 20 tokens) are prefilled in chunks over several steps; every
    answer still equals the request run alone."""
    proc, base = _start(["-m", str(target_path), "-md", str(drafter_path), "--spec-draft-n-max", "3", "-np", "4",
                         "-c", str(4 * 256), "-b", "8", "--metrics"], tmp_path / "small-batch.log")
    prompts = [PROMPTS[0], "Write a short poem about the sea, the wind and the stars, in four lines:",
               PROMPTS[5], PROMPTS[3]]
    try:
        def call(p: str):  # type: ignore[no-untyped-def]
            return lambda: _post_json(base + "/completion", {"prompt": p, "n_predict": 16, "temperature": 0,
                                                             "ignore_eos": True, "return_tokens": True})

        outs = _in_threads([call(p) for p in prompts], [0.0, 0.0, 0.1, 0.2])
        metrics = _metrics(base)
    finally:
        _stop(proc)
    for p, out in zip(prompts, outs):
        ref = alone(p, max_tokens=16, temperature=0, ignore_eos=True)
        _assert_same_greedy(plain, plain.tokenize(p), ref.tokens, out["tokens"], what=p)
        assert out["timings"]["draft_n"] > 0
    assert len(plain.tokenize(prompts[1])) > 8
    assert metrics["pydflash:rows_per_step_sum"] <= 8 * metrics["pydflash:rows_per_step_count"]
    assert metrics["pydflash:prefill_rows_total"] == sum(len(plain.tokenize(p)) for p in prompts)


def _upstream(target_path, extra: list[str], tmp: Path, prompts: list[str]) -> list[dict]:
    port = free_port()
    log = tmp / f"llama-server-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [str(tool_path("llama-server")), "-m", str(target_path), "--host", "127.0.0.1", "--port", str(port),
             "-c", "1024", "-t", "2", "-np", "1", "--no-webui", "--fit", "off", "--no-warmup", *extra],
            stdout=f, stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log=log)
        outs = [_post_json(base + "/completion", {"prompt": p, "n_predict": 16, "temperature": 0,
                                                  "cache_prompt": False, "return_tokens": True}, key=None)
                for p in prompts]
    finally:
        _stop(proc)
    if extra:
        assert re.search(r"draft-dflash", log.read_text()), "the drafter was not used"
    return outs


def test_upstream_llama_server_with_our_drafter(target_path, drafter_path, tmp_path):
    """The shipped llama-server drafts with our converted drafter, as converted (F16) and after
    our Q4_K_M quantizer; its greedy output equals its own output without a drafter."""
    from pydflash.formats.quantize import quantize

    prompts = PROMPTS[:2]
    without = _upstream(target_path, [], tmp_path, prompts)
    q4 = quantize(drafter_path, tmp_path / "drafter-q4_k_m.gguf", "Q4_K_M", progress=False)
    for drafter in (drafter_path, q4):
        spec = _upstream(target_path, ["--spec-type", "draft-dflash", "-md", str(drafter),
                                        "--spec-draft-n-max", "3"], tmp_path, prompts)
        for a, b in zip(without, spec):
            assert b["tokens"] == a["tokens"] and b["content"] == a["content"]
            assert b["timings"].get("draft_n", 0) > 0  # drafts were proposed and verified
            assert "draft_n" not in a["timings"]


def test_auto_n_max_server_switches_a_losing_drafter_off(target_path, drafter_path, tmp_path, reference, plain,
                                                         monkeypatch):
    """Default --spec-draft-n-max auto with the random drafter: the scheduler probes it, sees it
    lose, then serves plainly; every answer is still the target's own greedy text."""
    monkeypatch.setenv("PYDFLASH_AUTOTUNE_CACHE", "0")
    proc, base = _start(["-m", str(target_path), "-md", str(drafter_path), "-np", "1", "-c", str(N_CTX_SLOT)],
                        tmp_path / "auto.log")
    try:
        outs = [_post_json(base + "/completion", {"prompt": p, "n_predict": N_TOKENS, "temperature": 0,
                                                  "cache_prompt": False}) for p in PROMPTS[:3]]
    finally:
        _stop(proc)
    for p, out in zip(PROMPTS[:3], outs):
        _assert_same_greedy_text(plain, plain.tokenize(p), reference(p), out["content"], what=p)
    # switched off after the cold-start probe: at most an occasional re-probe drafts again (probes
    # are 16+ steps apart and pick their width by timings, so a few drafted tokens, never most)
    assert outs[-1]["timings"]["draft_n"] <= N_TOKENS // 3
    assert outs[-1]["generation_settings"]["speculative.n_max"] == 0  # the width it ran with most
