"""``--sleep-idle-seconds``, the scrape window of the throughput gauges and the generation rate,
against the shipped llama-server: both servers get the same flags and the same requests.

pydflash speculates (the shipped DFlash2 drafter) so that sleeping frees and reloads the drafter
too. What must hold on both: the server sleeps once idle and says so in ``/props``; health,
props, models and metrics answer without waking it; a completion or ``/tokenize`` wakes it;
the throughput gauges cover the window since the previous scrape; a generation's rate leaves out
its first token. pydflash's own evidence that the models are freed: the process's resident
memory falls by most of the target file's size while asleep, and the greedy answer after the
wake-up is the answer from before.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_server import _assert_same_greedy
from test_server_compat import _call, _post, both, running

import pydflash

DRAFTER = Path(pydflash.__file__).parent / "drafters" / "smollm2-135m-instruct-dflash2.gguf"
ARGS = ["-np", "1", "-c", "1024", "-t", "2", "--sleep-idle-seconds", "1", "--metrics"]
PROMPT = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory, smollm2_path):
    """{"ours" / "upstream": (base URL, process)}, pydflash with the shipped drafter."""
    args = ["-m", str(smollm2_path), "--host", "127.0.0.1", *ARGS]
    with running(tmp_path_factory.mktemp("sleep"), {"ours": ("ours", args + ["-md", str(DRAFTER)]),
                                                    "upstream": ("upstream", args)}) as up:
        yield up


def _sleeping(base: str) -> bool:
    status, _, body = _call(base, "/props")
    assert status == 200
    return body["is_sleeping"]


def _wait_asleep(base: str, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _sleeping(base):
            return
        time.sleep(0.1)
    raise AssertionError(f"{base} did not go to sleep within {timeout} s")


def _gauge(base: str, name: str) -> float:
    status, _, text = _call(base, "/metrics")
    assert status == 200
    values = [line.split()[1] for line in text.splitlines() if line.startswith(f"llamacpp:{name} ")]
    assert len(values) == 1, name
    return float(values[0])


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _greedy(base: str) -> dict:
    return _post(base, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True})


def test_sleep_and_wake_as_upstream(sleepy, smollm2_stock, smollm2_path):
    before = {name: _greedy(base) for name, (base, _) in sleepy.items()}
    for name, (base, proc) in sleepy.items():
        rss_awake = _rss_kib(proc.pid)
        _wait_asleep(base)
        # read-only endpoints answer and do not wake the server
        for path in ("/health", "/props", "/models", "/v1/models", "/metrics"):
            assert _call(base, path)[0] == 200, (name, path)
        assert _sleeping(base), name
        status, _, models = _call(base, "/v1/models")
        assert len(models["data"]) == 1
        if name == "ours" and Path("/proc").is_dir():
            freed = rss_awake - _rss_kib(proc.pid)
            assert freed > 0.5 * smollm2_path.stat().st_size / 1024, (rss_awake, freed)
        after = _greedy(base)  # wakes it
        assert not _sleeping(base), name
        assert after["tokens"] == before[name]["tokens"], name
        assert after["timings"]["cache_n"] == 0  # the KV went with the model
    prompt_tokens = smollm2_stock.tokenize(PROMPT, add_special=False)  # ours runs on stock kernels (running())
    _assert_same_greedy(smollm2_stock, prompt_tokens, before["upstream"]["tokens"], before["ours"]["tokens"])


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"content": "Hello"}),
    ("/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "Hello world"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hello world"}]}),
])
def test_engine_endpoints_wake_it_as_upstream(sleepy, path, body):
    answers = {}
    for name, (base, _) in sleepy.items():
        _wait_asleep(base)
        status, _, answers[name] = _call(base, path, body)
        assert status == 200, (name, answers[name])
        assert not _sleeping(base), name
    assert answers["ours"] == answers["upstream"]


def test_throughput_gauges_cover_the_window_since_the_last_scrape(sleepy):
    for name, (base, _) in sleepy.items():
        _gauge(base, "predicted_tokens_seconds")  # empties the window
        assert _gauge(base, "predicted_tokens_seconds") == 0, name
        _post(base, "/completion", {"prompt": "Hello", "n_predict": 8, "temperature": 0})
        _wait_asleep(base)
        assert _gauge(base, "predicted_tokens_seconds") > 0, name   # the generation before sleeping
        assert _gauge(base, "prompt_tokens_seconds") == 0, name     # emptied by the scrape before
        assert _gauge(base, "predicted_tokens_seconds") == 0, name
        assert _sleeping(base), name
        assert _call(base, "/tokenize", {"content": "Hello"})[0] == 200  # waking reports nothing
        assert _gauge(base, "predicted_tokens_seconds") == 0, name


def test_generation_rate_leaves_out_the_first_token_as_upstream(sleepy):
    for name, (base, _) in sleepy.items():
        one = _post(base, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0})["timings"]
        assert one["predicted_n"] == 1
        assert one["predicted_per_second"] == 0.0 and one["predicted_per_token_ms"] == 0.0, name
        many = _post(base, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                           "ignore_eos": True})["timings"]
        assert many["predicted_n"] == 16
        assert many["predicted_per_second"] == pytest.approx(1e3 / many["predicted_ms"] * 15, rel=1e-9), name
        assert many["predicted_per_token_ms"] == pytest.approx(many["predicted_ms"] / 15, rel=1e-9), name


def _stream(base: str, path: str, body: dict) -> list[dict]:
    import json
    import urllib.request

    req = urllib.request.Request(base + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
    return [json.loads(line[6:]) for line in raw.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_timings_per_token_as_upstream(sleepy):
    """Streamed chunks carry the timings so far: the first progress report before any prompt
    token is decoded (all zero), never going backwards, the generation part growing."""
    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 8, "n_predict": 6, "temperature": 0,
            "timings_per_token": True, "return_progress": True, "cache_prompt": False, "ignore_eos": True}
    keys = {}
    for name, (base, _) in sleepy.items():
        chunks = _stream(base, "/completion", body)
        progress = [c for c in chunks if "prompt_progress" in c]
        assert progress and all("timings" in c for c in progress), name
        first = progress[0]["timings"]
        assert (first["prompt_n"], first["prompt_ms"], first["predicted_n"], first["predicted_ms"]) == (0, 0.0, 0, 0.0)
        pieces = [c for c in chunks if "prompt_progress" not in c and not c.get("stop")]
        assert pieces and all("timings" in c for c in pieces), name
        last_prompt_ms, last_n = 0.0, 0
        for c in progress + pieces:
            t = c["timings"]
            assert all(v is not None and v >= 0 for v in t.values()), (name, t)
            assert t["prompt_ms"] >= last_prompt_ms and t["predicted_n"] >= last_n, (name, t)
            last_prompt_ms, last_n = t["prompt_ms"], t["predicted_n"]
        assert last_prompt_ms > 0 and 0 < last_n <= 6, name
        keys[name] = set(pieces[-1]["timings"])
        for c in _stream(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 4, "timings_per_token": True}):
            if c["choices"] and c["choices"][0]["delta"].get("content"):
                assert "timings" in c, name
    # the draft fields come on top where the server speculates (pydflash here)
    assert keys["upstream"] <= keys["ours"], keys


@pytest.fixture(scope="module")
def embedders(tmp_path_factory, smollm2_path):
    args = ["-m", str(smollm2_path), "--host", "127.0.0.1", "-np", "1", "-c", "512", "-t", "2", "--metrics",
            "--embedding", "--pooling", "mean"]
    with running(tmp_path_factory.mktemp("embed-metrics"), both(args)) as up:
        yield {name: base for name, (base, _) in up.items()}


def _counter(base: str, name: str) -> float:
    return _gauge(base, name)


def test_embedding_prompts_are_counted_as_upstream(embedders):
    """Embedding requests sample nothing but decode their prompt: prompt tokens and a decode count."""
    got = {}
    for name, base in embedders.items():
        before = {k: _counter(base, k) for k in ("prompt_tokens_total", "n_decode_total", "tokens_predicted_total")}
        status, _, body = _call(base, "/v1/embeddings", {"input": ["hello world", "goodbye world"]})
        assert status == 200, body
        after = {k: _counter(base, k) for k in before}
        assert after["n_decode_total"] > before["n_decode_total"], name
        assert after["tokens_predicted_total"] == before["tokens_predicted_total"], name
        got[name] = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    assert got["ours"] == got["upstream"] > 0, got
