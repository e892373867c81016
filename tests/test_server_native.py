"""``pydflash serve``'s model-side features against the shipped upstream ``llama-server``: the same
request to both, the same answer.

Both serve SmolLM2-135M with ``--jinja --embedding --pooling mean``; pydflash with the shipped
DFlash2 drafter at a fixed n_max 3 (speculation on: constrained outputs and probabilities come
from verification rows and must still be the target's own), plus a plain pydflash server for
slot files (a restored slot's KV serves the next prompt; under speculation it is re-decoded
because the drafter has no features for it). Covered: ``/apply-template`` (llama.cpp's Jinja
engine, a template file from the pinned tree, its 400s), ``grammar`` / ``json_schema`` /
``response_format`` (same greedy text, valid JSON), ``n_probs`` (same candidates, log-probs
within a batch-numerics tolerance) and OpenAI ``logprobs``, ``logit_bias``, ``/embedding`` and
``/v1/embeddings`` (cosine > 0.9999), ``/slots/{id}?action=save|restore|erase``, ``/infill``
(Qwen2.5-Coder-0.5B: the FIM prompt tokens are llama-server's).

The speculative server runs twice: on ggml's stock kernels (``PYDFLASH_KERNELS=0``), where the
answers are llama-server's bit for bit (up to the batch numerics of verification rows), and on the
default kernels, where greedy texts are compared tie-aware with llama-server's own candidate
log-probabilities (``n_probs``) and numbers within the kernels' measured distance (conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import EMBED_COSINE, KERNELS, LOGPROB_TOL, assert_tie_aware, kernels_subprocess_env
from pydflash.tools.upstream_server import free_port, wait_healthy
from test_server import _stop

from pydflash.tools.upstream_binaries import tool_path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DRAFTER = ROOT / "pydflash" / "drafters" / "smollm2-135m-instruct-dflash2.gguf"
COMMON = ["-np", "2", "-c", "2048", "-t", "2", "-b", "64", "--jinja", "--embedding", "--pooling", "mean",
          "--temp", "0"]


def _call(base: str, path: str, body=None, *, method: str | None = None):  # type: ignore[no-untyped-def]
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


def _ok(base: str, path: str, body: dict):  # type: ignore[no-untyped-def]
    status, out = _call(base, path, body)
    assert status == 200, out
    return out


def _start(cmd: list[str], tmp: Path, name: str, kern: str = "default"):  # type: ignore[no-untyped-def]
    port = free_port()
    log = open(tmp / f"{name}.log", "wb")
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=kernels_subprocess_env(kern))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout=300, log=tmp / f"{name}.log")
    except BaseException:
        _stop(proc)
        raise
    return proc, base


@pytest.fixture(scope="module")
def servers(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native-servers")
    slots_up, slots_ours = tmp / "slots-upstream", tmp / "slots-ours"
    slots_up.mkdir()
    slots_ours.mkdir()
    procs, bases = [], {}
    try:
        p, upstream = _start([str(tool_path("llama-server")), "-m", str(smollm2_path), *COMMON,
                              "--slot-save-path", str(slots_up)], tmp, "upstream")
        procs.append(p)
        for kern in KERNELS:
            p, ours = _start([sys.executable, "-m", "pydflash.server", "-m", str(smollm2_path), *COMMON,
                              "-md", str(SHIPPED_DRAFTER), "--spec-draft-n-max", "3"], tmp, f"ours-{kern}", kern)
            procs.append(p)
            bases[kern] = ours
        p, plain = _start([sys.executable, "-m", "pydflash.server", "-m", str(smollm2_path), *COMMON,
                           "--slot-save-path", str(slots_ours)], tmp, "plain")
        procs.append(p)
        # "ours": the speculative server on stock kernels, "default": the same on the default ones
        yield {"upstream": upstream, "ours": bases["stock"], "default": bases["default"], "plain": plain}
    finally:
        for p in procs:
            _stop(p)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize("body", [
    {"messages": MESSAGES},
    {"messages": MESSAGES, "add_generation_prompt": False},
    {"messages": MESSAGES + [{"role": "assistant", "content": "Blu"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]},
])
def test_apply_template_same_prompt(servers, body):
    ours = _ok(servers["ours"], "/apply-template", body)
    theirs = _ok(servers["upstream"], "/apply-template", body)
    assert ours == theirs


@pytest.mark.parametrize("body", [
    {"messages": MESSAGES + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
    {"messages": MESSAGES + [{"role": "assistant", "content": "x"}], "continue_final_message": True,
     "add_generation_prompt": True},
    {"messages": "hello"},
    {"prompt": "no messages"},
])
def test_apply_template_same_refusals(servers, body):
    s_ours, _ = _call(servers["ours"], "/apply-template", body)
    s_theirs, _ = _call(servers["upstream"], "/apply-template", body)
    assert s_theirs >= 400
    assert s_ours == s_theirs


def test_chat_template_file(smollm2_path, tmp_path):
    """A template file from the pinned tree, rendered by both (llama.cpp's Jinja engine)."""
    from pydflash.tools.upstream_server import UpstreamServer

    tree = ROOT / ".cache" / "llama-cpp-python-0.3.36" / "vendor" / "llama.cpp" / "models" / "templates"
    template = tree / "Qwen-Qwen2.5-7B-Instruct.jinja"
    if not template.exists():
        pytest.skip("the pinned llama.cpp tree is not extracted here")
    args = ["-m", str(smollm2_path), "-np", "1", "-c", "512", "-t", "2", "--jinja", "--chat-template-file", str(template)]
    body = {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "get_time", "description": "the time", "parameters": {"type": "object", "properties": {}}}}]}
    with UpstreamServer(args) as up:
        theirs = _ok(up.base, "/apply-template", body)
    p, ours_base = _start([sys.executable, "-m", "pydflash.server", *args], tmp_path, "ours-template")
    try:
        ours = _ok(ours_base, "/apply-template", body)
    finally:
        _stop(p)
    assert ours == theirs
    assert "get_time" in ours["prompt"]


GRAMMAR = 'root ::= "Answer: " ("yes" | "no") "."'
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
          "required": ["colour"], "additionalProperties": False}


N_CAND = 10  # candidates llama-server lists for the default kernels' tie checks
# SmolLM2's end-of-generation tokens as ids and as the texts the chat API lists them with (ours
# "<|im_end|>", llama-server ""); llama-server's /completion also lists a grammar's final EOS
END_TOKENS = {0, 2, 4, "", "<|im_end|>", "<|endoftext|>"}


def _tie_aware(want: list, got: list, tops: list[dict], what: str) -> None:
    """got (the default kernels' tokens or token texts) against llama-server's want, tie-aware on
    llama-server's own candidate log-probabilities tops[i] ({token: logprob}, after want[:i]);
    a final end-of-generation token on either side is left out."""
    want, got = [list(x[:-1] if x and x[-1] in END_TOKENS else x) for x in (want, got)]

    def at(i: int) -> dict:
        assert i < len(tops), f"{what}: the answers part at token {i}, past llama-server's probabilities"
        return tops[i]

    assert_tie_aware(want, got, at, what=what)


def _same_completion(servers: dict, kern: str, body: dict, what: str) -> tuple[dict, dict]:
    """The same /completion to llama-server and to the speculative server on `kern`: the same
    text (stock), or the same tokens up to a near-tie of llama-server's (default). Both answers."""
    if kern == "stock":
        ours = _ok(servers["ours"], "/completion", body)
        theirs = _ok(servers["upstream"], "/completion", body)
        assert ours["content"] == theirs["content"], what
        return ours, theirs
    ours = _ok(servers["default"], "/completion", {**body, "return_tokens": True})
    theirs = _ok(servers["upstream"], "/completion", {**body, "return_tokens": True, "n_probs": N_CAND})
    tops = [{q["id"]: q["logprob"] for q in p["top_logprobs"]} for p in theirs["completion_probabilities"]]
    _tie_aware(theirs["tokens"], ours["tokens"], tops, what)
    return ours, theirs


def _same_chat(servers: dict, kern: str, body: dict, what: str) -> tuple[str, str]:
    """As _same_completion for /v1/chat/completions (token texts: the chat API has no ids)."""
    if kern == "stock":
        ours = _ok(servers["ours"], "/v1/chat/completions", body)["choices"][0]
        theirs = _ok(servers["upstream"], "/v1/chat/completions", body)["choices"][0]
        assert ours["message"]["content"] == theirs["message"]["content"], what
    else:
        probs = {**body, "logprobs": True, "top_logprobs": N_CAND}
        ours = _ok(servers["default"], "/v1/chat/completions", probs)["choices"][0]
        theirs = _ok(servers["upstream"], "/v1/chat/completions", probs)["choices"][0]
        want = [t["token"] for t in theirs["logprobs"]["content"]]
        tops = [{q["token"]: q["logprob"] for q in t["top_logprobs"]} for t in theirs["logprobs"]["content"]]
        _tie_aware(want, [t["token"] for t in ours["logprobs"]["content"]], tops, what)
    return ours["message"]["content"], theirs["message"]["content"]


@pytest.mark.parametrize("kern", KERNELS)
def test_grammar_same_text(servers, kern):
    body = {"prompt": "Is the sky blue?", "grammar": GRAMMAR, "n_predict": 12, "temperature": 0}
    ours, _ = _same_completion(servers, kern, body, "grammar")
    assert ours["content"] in ("Answer: yes.", "Answer: no.")


@pytest.mark.parametrize("kern", KERNELS)
def test_json_schema_same_text(servers, kern):
    body = {"prompt": "A colour as JSON:", "json_schema": SCHEMA, "n_predict": 24, "temperature": 0}
    ours, _ = _same_completion(servers, kern, body, "json_schema")
    assert set(json.loads(ours["content"])) == {"colour"}


@pytest.mark.parametrize("kern", KERNELS)
def test_chat_response_format(servers, kern):
    body = {"messages": MESSAGES, "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    ours, _ = _same_chat(servers, kern, body, "response_format")
    json.loads(ours)


def test_bad_grammar_is_400(servers):
    for name in ("ours", "upstream"):
        status, _ = _call(servers[name], "/completion", {"prompt": "x", "grammar": "root ::= [", "n_predict": 2})
        assert status == 400, name


@pytest.mark.parametrize("kern", KERNELS)
def test_n_probs_same_candidates(servers, kern):
    """stock: the same candidates, log-probs within the batch numerics of verification rows;
    default: the same up to a near-tie, the log-probs of the same candidates within LOGPROB_TOL."""
    body = {"prompt": "The capital of France is", "n_probs": 3, "n_predict": 4, "temperature": 0}
    ours = _ok(servers["ours" if kern == "stock" else "default"], "/completion", body)["completion_probabilities"]
    theirs = _ok(servers["upstream"], "/completion", body)["completion_probabilities"]
    if kern == "stock":
        assert [p["id"] for p in ours] == [p["id"] for p in theirs]
    else:
        tops = [{q["id"]: q["logprob"] for q in p["top_logprobs"]} for p in theirs]
        _tie_aware([p["id"] for p in theirs], [p["id"] for p in ours], tops, "n_probs")
    tol = 5e-3 if kern == "stock" else LOGPROB_TOL
    for a, b in zip(ours, theirs):
        if a["id"] != b["id"]:
            break
        assert abs(a["logprob"] - b["logprob"]) < tol
        assert a["token"] == b["token"] and a["bytes"] == b["bytes"]
        if kern == "stock":
            assert [q["id"] for q in a["top_logprobs"]] == [q["id"] for q in b["top_logprobs"]]
        else:
            theirs_top = {q["id"]: q["logprob"] for q in b["top_logprobs"]}
            assert a["top_logprobs"][0]["id"] == b["top_logprobs"][0]["id"]
            shared = [q for q in a["top_logprobs"] if q["id"] in theirs_top]
            assert all(abs(q["logprob"] - theirs_top[q["id"]]) < tol for q in shared)


@pytest.mark.parametrize("kern", KERNELS)
def test_chat_logprobs(servers, kern):
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    ours = _ok(servers["ours" if kern == "stock" else "default"], "/v1/chat/completions",
               body)["choices"][0]["logprobs"]["content"]
    theirs = _ok(servers["upstream"], "/v1/chat/completions",
                 {**body, "top_logprobs": 2 if kern == "stock" else N_CAND})["choices"][0]["logprobs"]["content"]
    if kern == "stock":
        assert [t["token"] for t in ours] == [t["token"] for t in theirs]
    else:
        tops = [{q["token"]: q["logprob"] for q in t["top_logprobs"]} for t in theirs]
        _tie_aware([t["token"] for t in theirs], [t["token"] for t in ours], tops, "chat logprobs")
    assert all(len(t["top_logprobs"]) == 2 for t in ours)


@pytest.mark.parametrize("kern", KERNELS)
def test_logit_bias_same_text(servers, kern):
    first = _ok(servers["upstream"], "/completion", {"prompt": "The capital of France is", "n_predict": 1,
                                                      "temperature": 0, "return_tokens": True})["tokens"][0]
    body = {"prompt": "The capital of France is", "n_predict": 6, "temperature": 0, "logit_bias": [[first, False]]}
    ours, _ = _same_completion(servers, kern, body, "logit_bias")
    assert first not in ours.get("tokens", [])


def _vec(x) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.asarray(x[0] if isinstance(x[0], list) else x, dtype=np.float64)


@pytest.mark.parametrize("kern", KERNELS)
def test_embeddings_match(servers, kern):
    base, cosine = (servers["ours"], 0.9999) if kern == "stock" else (servers["default"], EMBED_COSINE)
    body = {"content": "Embeddings turn text into vectors."}
    ours = _vec(_ok(base, "/embedding", body)[0]["embedding"])
    theirs = _vec(_ok(servers["upstream"], "/embedding", body)[0]["embedding"])
    assert ours.shape == theirs.shape
    assert float(ours @ theirs) > cosine  # both L2-normalised
    oai = {"input": ["one text", "another text"], "model": "x"}
    a = _ok(base, "/v1/embeddings", oai)
    b = _ok(servers["upstream"], "/v1/embeddings", oai)
    assert len(a["data"]) == len(b["data"]) == 2
    assert a["usage"] == b["usage"]
    for x, y in zip(a["data"], b["data"]):
        assert float(np.dot(x["embedding"], y["embedding"])) > cosine


def test_slot_save_restore(servers):
    ours, up = servers["plain"], servers["upstream"]
    prompt = "Once upon a time, in a quiet village by the sea, there lived"
    for base in (ours, up):
        _ok(base, "/completion", {"prompt": prompt, "id_slot": 1, "cache_prompt": True, "n_predict": 8,
                                   "temperature": 0})
    a = _ok(ours, "/slots/1?action=save", {"filename": "s1.bin"})
    b = _ok(up, "/slots/1?action=save", {"filename": "s1.bin"})
    assert a["n_saved"] == b["n_saved"]
    a = _ok(ours, "/slots/0?action=restore", {"filename": "s1.bin"})
    b = _ok(up, "/slots/0?action=restore", {"filename": "s1.bin"})
    assert a["n_restored"] == b["n_restored"]
    again = {"prompt": prompt + " a", "id_slot": 0, "cache_prompt": True, "n_predict": 4, "temperature": 0}
    ra, rb = _ok(ours, "/completion", again), _ok(up, "/completion", again)
    assert ra["timings"]["cache_n"] == rb["timings"]["cache_n"] > 0
    for name, base in (("ours", ours), ("upstream", up)):
        status, _ = _call(base, "/slots/0?action=restore", {"filename": "missing.bin"})
        assert status >= 400, name
        status, _ = _call(base, "/slots/0?action=save", {"filename": "../escape.bin"})
        assert status == 400, name
    assert _ok(ours, "/slots/1?action=erase", {})["n_erased"] == b["n_restored"]


def test_infill_same_prompt(qwen05_path, tmp_path):
    from pydflash.tools.upstream_server import UpstreamServer

    args = ["-m", str(qwen05_path), "-np", "1", "-c", "1024", "-t", "2", "--temp", "0"]
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
            "n_predict": 8, "temperature": 0}
    with UpstreamServer(args) as up:
        theirs = _ok(up.base, "/infill", {**body, "return_tokens": True, "n_probs": N_CAND})
    ours = {}
    for kern in KERNELS:  # stock: llama-server's text; default: its tokens up to a near-tie
        p, base = _start([sys.executable, "-m", "pydflash.server", *args], tmp_path, f"ours-infill-{kern}", kern)
        try:
            ours[kern] = _ok(base, "/infill", {**body, "return_tokens": True})
            status, _ = _call(base, "/infill", {"input_prefix": "x"})
            assert status == 400
        finally:
            _stop(p)
        assert ours[kern]["tokens_evaluated"] == theirs["tokens_evaluated"]
    assert ours["stock"]["content"] == theirs["content"]
    tops = [{q["id"]: q["logprob"] for q in p["top_logprobs"]} for p in theirs["completion_probabilities"]]
    _tie_aware(theirs["tokens"], ours["default"]["tokens"], tops, "infill")


@pytest.mark.parametrize("kern", KERNELS)
def test_chat_grammar_same_text(servers, kern):
    """The grammar fixes the text (not how it is split into tokens): the same on both kernel sets."""
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "grammar": 'root ::= "a"{5,5}'}
    ours = _ok(servers["ours" if kern == "stock" else "default"], "/v1/chat/completions", body)
    theirs = _ok(servers["upstream"], "/v1/chat/completions", body)
    assert ours["choices"][0]["message"]["content"] == theirs["choices"][0]["message"]["content"] == "aaaaa"


@pytest.mark.parametrize("value", [
    [12, 34, "string", 56], {"prompt_string": "string"},
    ["s1", {"prompt_string": "s2"}, {"content": [{"type": "text", "text": "s3"}]}],
    {"content": "string"}, [], {"content": [{"type": "unknown"}]},
])
def test_embedding_input_forms(servers, value):
    """The stock server: the same vectors; the default kernels' are within EMBED_COSINE of them
    (test_embeddings_match)."""
    s_ours, a = _call(servers["ours"], "/v1/embeddings", {"input": value})
    s_up, b = _call(servers["upstream"], "/v1/embeddings", {"input": value})
    assert (s_ours == 200) == (s_up == 200), (a, b)
    if s_up == 200:
        assert len(a["data"]) == len(b["data"])
        for x, y in zip(a["data"], b["data"]):
            assert float(np.dot(x["embedding"], y["embedding"])) > 0.9999


def test_gcp_predict(smollm2_path, tmp_path, monkeypatch):
    """AIP_MODE=PREDICTION: /predict runs each instance through its endpoint (llama-server's
    Vertex AI mode): the same answers as the endpoints called directly, errors per instance."""
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    args = ["-m", str(smollm2_path), "-np", "2", "-c", "1024", "-t", "2", "--temp", "0"]
    chat = {"max_tokens": 6, "messages": [{"role": "user", "content": "Say hello"}]}
    completion = {"n_predict": 4, "prompt": "The capital of France is"}
    body = {"instances": [{"@requestFormat": "chatCompletions", **chat}, {"@requestFormat": "/completion", **completion},
                          {"@requestFormat": "noSuchThing"}, "not an object"]}
    p, base = _start([sys.executable, "-m", "pydflash.server", *args], tmp_path, "ours-gcp")
    try:
        ours = _ok(base, "/predict", body)["predictions"]
        direct_chat = _ok(base, "/v1/chat/completions", chat)
        direct_completion = _ok(base, "/completion", completion)
        status, _ = _call(base, "/predict", {"instances": 3})
    finally:
        _stop(p)
    assert status == 400
    assert len(ours) == 4
    assert ours[0]["choices"][0]["message"]["content"] == direct_chat["choices"][0]["message"]["content"]
    assert ours[1]["content"] == direct_completion["content"]
    assert "error" in ours[2] and "error" in ours[3]
