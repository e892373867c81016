"""``pydflash serve`` under generated requests: no 5xx, no hang, the server alive afterwards.

One real server (SmolLM2-135M, the shipped drafter, two slots, embeddings, slots, metrics, slot
files and Vertex AI's ``/predict`` on) is started once for the module; hypothesis then drives
every POST route's request parsing with generated JSON bodies: the route's own fields with
plausible values (so requests get past the first check and reach the deeper ones) and at most
one field of arbitrary JSON (wrong types, huge and negative ints, non-finite floats, unicode and
lone surrogates, nesting thousands of levels deep), unknown fields, missing ones, and raw bodies
that are not JSON at all. Generation stays short: the server's ``--n-predict`` is 4 and every
generated ``max_tokens`` / ``n_predict`` is at most 4 unless the field itself is the arbitrary one.

Checked for every answer: a status below 500 (also for the errors inside a 200: an SSE stream's
error event, a ``/predict`` instance's error), in time; llama-server's 501 for what the model
lacks (/infill on SmolLM2, which has no FIM tokens) is the one 5xx let through. After the run: ``/health`` is OK, no slot
is left busy, and the server logged no traceback (a bug path answers a logged 500). The examples
are derandomized (the same requests on every run, as CI needs) and bounded (25 per test, about
470 requests, the count printed at the end): the module takes about 15 s on 2 cores. The requests
the issue reported (#29) are explicit examples. A longer hunt: PYDFLASH_FUZZ_EXAMPLES=300
PYDFLASH_FUZZ_RANDOM=1 (5,142 requests in 112 s, no 5xx, when this was written).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from test_server_compat import running

SHIPPED_DRAFTER = Path(__file__).resolve().parents[1] / "pydflash" / "drafters" / "smollm2-135m-instruct-dflash2.gguf"
N_SLOTS = 2
TIMEOUT_S = 60  # one request, generation included (at most a slot's context: 256 tokens)
SENT: Counter = Counter()  # answers by status

# PYDFLASH_FUZZ_EXAMPLES=N: N examples per test (a longer hunt); PYDFLASH_FUZZ_RANDOM=1: new ones every run
FUZZ = settings(max_examples=int(os.environ.get("PYDFLASH_FUZZ_EXAMPLES", "25")),
                derandomize=os.environ.get("PYDFLASH_FUZZ_RANDOM") != "1", database=None,
                deadline=None, phases=(Phase.explicit, Phase.generate), print_blob=False,
                suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------------------------------------
# JSON values: plausible ones per field, and arbitrary ones
# ------------------------------------------------------------------------------------------------


class Deep:
    """A value nested ``depth`` levels deep in lists or objects (written without recursion)."""

    def __init__(self, depth: int, kind: str, leaf: Any) -> None:
        self.depth, self.kind, self.leaf = depth, kind, leaf

    def __repr__(self) -> str:
        return f"Deep({self.depth}, {self.kind!r}, {self.leaf!r})"


def dump(value: Any) -> str:
    """JSON text (``NaN`` / ``Infinity`` as Python writes them, lone surrogates as \\u escapes)."""
    if isinstance(value, Deep):
        inner = dump(value.leaf)
        if value.kind == "list":
            return "[" * value.depth + inner + "]" * value.depth
        return '{"a": ' * value.depth + inner + "}" * value.depth
    if isinstance(value, list):
        return "[" + ", ".join(dump(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dump(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


BIG_INTS = st.sampled_from([-1, 0, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                            -2**63 - 1, 10**12, 10**30, -10**30, 10**400])
INTS = st.one_of(st.integers(-3, 8), st.integers(), BIG_INTS)
FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]))
WORDS = st.sampled_from(["", "-1", "7", "text", "user", "assistant", "system", "tool", "developer", "image",
                         "tool_use", "tool_result", "thinking", "input_text", "input_image", "input_file",
                         "function_call_output", "json_object", "json_schema", "auto", "none", "required",
                         "\U0001f917 \u5abd", "<|im_start|>", "\x00", "root ::= \"a\""])
STRINGS = st.one_of(st.text(max_size=16), WORDS)
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff"])  # lone: JSON text may hold them, UTF-8 cannot
LEAVES = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRINGS, STRINGS, STRINGS, SURROGATES)
NESTED = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(STRINGS, inner, max_size=4)), max_leaves=10)
DEEP = st.builds(Deep, st.sampled_from([8, 64, 300, 900, 1100, 5000]), st.sampled_from(["list", "dict"]), LEAVES)
ANY = st.one_of(NESTED, NESTED, NESTED, NESTED, NESTED, DEEP)

TOKEN = st.integers(0, 49151)
TEXT = st.one_of(st.text(max_size=24), st.sampled_from(["The capital of France is", "def f(x):", "Hi"]))
MAX = st.integers(0, 4)  # plausible max_tokens / n_predict: short
PROMPT = st.one_of(TEXT, st.lists(TOKEN, min_size=1, max_size=6), st.lists(st.one_of(TEXT, TOKEN), max_size=4),
                   st.lists(TEXT, min_size=1, max_size=3), st.fixed_dictionaries({"prompt_string": TEXT}))
STOP = st.one_of(TEXT, st.lists(TEXT, max_size=3))
SCHEMA = st.sampled_from([{}, {"type": "object"}, {"type": "string"}, {"type": "integer", "minimum": 3},
                          {"type": "array", "items": {"type": "boolean"}}, {"$ref": "#/nope"}, {"type": "nonsense"}])
GRAMMAR = st.sampled_from(['root ::= "yes" | "no"', 'root ::= [a-z]+', "root ::= ", "not a grammar", ""])
LOGIT_BIAS = st.one_of(st.dictionaries(st.one_of(st.integers(-5, 50000).map(str), TEXT),
                                       st.one_of(FLOATS, st.just(False)), max_size=3),
                       st.lists(st.tuples(st.one_of(TOKEN, TEXT, FLOATS), st.one_of(FLOATS, st.just(False)))
                                .map(list), max_size=3))


PLAUSIBLE: dict[int, st.SearchStrategy] = {}  # id(field(p)) -> p


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly plausible, sometimes arbitrary JSON (a request's top-level fields
    are arbitrary one at a time: ``body_of``)."""
    strategy = st.one_of(plausible, plausible, plausible, ANY)
    PLAUSIBLE[id(strategy)] = plausible
    return strategy


SAMPLING = {
    "temperature": field(st.floats(0, 2)), "top_k": field(st.integers(-1, 100)), "top_p": field(st.floats(0, 1)),
    "min_p": field(st.floats(0, 1)), "seed": field(st.integers(-1, 2**32)), "stop": field(STOP),
    "n": field(st.integers(1, 2)), "stream": field(st.booleans()), "cache_prompt": field(st.booleans()),
    "ignore_eos": field(st.booleans()), "id_slot": field(st.integers(-1, N_SLOTS)),
    "speculative": field(st.fixed_dictionaries({}, optional={"n_max": st.integers(0, 9), "n_min": st.integers(0, 9),
                                                             "p_min": st.floats(0, 1)})),
    "speculative.n_max": field(st.integers(0, 16)), "speculative.n_min": field(st.integers(0, 4)),
    "speculative.p_min": field(st.floats(0, 1)), "logit_bias": field(LOGIT_BIAS),
    "n_probs": field(st.integers(0, 5)), "post_sampling_probs": field(st.booleans()),
    "return_progress": field(st.booleans()), "timings_per_token": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "verbose": field(st.booleans()), "model": field(TEXT),
}
CONSTRAINED = {"grammar": field(GRAMMAR), "json_schema": field(SCHEMA),
               "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object",
                                                                                        "json_schema", "xml"])},
                                                              optional={"schema": SCHEMA,
                                                                        "json_schema": st.fixed_dictionaries(
                                                                            {"schema": SCHEMA})}))}
COMPLETION = {**SAMPLING, **CONSTRAINED, "prompt": field(PROMPT), "max_tokens": field(MAX), "n_predict": field(MAX),
              "logprobs": field(st.one_of(st.booleans(), st.integers(0, 3))), "return_tokens": field(st.booleans()),
              "response_fields": field(st.lists(st.sampled_from(["content", "timings/predicted_n", "x/y", ""]),
                                                max_size=3))}
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                 st.fixed_dictionaries({"type": STRINGS}, optional={"text": ANY, "image_url": ANY}), ANY)
MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "assistant", "system", "tool", "developer"]))},
    optional={"content": field(st.one_of(TEXT, st.lists(PART, max_size=3))), "name": field(TEXT),
              "tool_calls": field(st.lists(st.fixed_dictionaries({"id": TEXT, "type": st.just("function"),
                                                                  "function": st.fixed_dictionaries(
                                                                      {"name": TEXT, "arguments": TEXT})}),
                                           max_size=2)),
              "reasoning_content": field(TEXT), "tool_call_id": field(TEXT)})
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": TEXT}, optional={"description": TEXT, "parameters": SCHEMA})}), max_size=2)
CHAT = {**SAMPLING, **CONSTRAINED, "messages": field(st.lists(MESSAGE, min_size=1, max_size=3)),
        "max_tokens": field(MAX), "max_completion_tokens": field(MAX), "n_predict": field(MAX),
        "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(0, 5)), "tools": field(TOOLS),
        "tool_choice": field(st.sampled_from(["auto", "none", "required"])),
        "parallel_tool_calls": field(st.booleans()), "add_generation_prompt": field(st.booleans()),
        "continue_final_message": field(st.booleans()), "chat_template_kwargs": field(
            st.dictionaries(STRINGS, LEAVES, max_size=2)),
        "reasoning_format": field(st.sampled_from(["none", "auto", "deepseek"]))}
BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": field(TEXT)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": field(TEXT), "name": field(TEXT), "input": ANY}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": field(TEXT),
                           "content": field(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": TEXT}), max_size=2)))}),
    st.fixed_dictionaries({"type": st.just("image"), "source": ANY}),
    st.fixed_dictionaries({"type": STRINGS}, optional={"text": ANY, "x": ANY}), ANY)
ANTHROPIC = {**{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "seed", "stream", "model")},
             "max_tokens": field(MAX), "stop_sequences": field(STOP),
             "messages": field(st.lists(st.fixed_dictionaries(
                 {"role": field(st.sampled_from(["user", "assistant"]))},
                 optional={"content": field(st.one_of(TEXT, st.lists(BLOCK, max_size=3)))}), max_size=3)),
             "system": field(st.one_of(TEXT, st.lists(BLOCK, max_size=2))),
             "tools": field(st.lists(st.fixed_dictionaries({"name": TEXT}, optional={
                 "description": TEXT, "input_schema": SCHEMA}), max_size=2)),
             "tool_choice": field(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "x"])}))}
ITEM = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "x"]),
                                        "content": field(st.one_of(TEXT, st.lists(PART, max_size=2)))}),
                 st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "function_call",
                                                                 "reasoning", "message"])},
                                       optional={"output": ANY, "call_id": TEXT}), ANY)
RESPONSES = {**{k: SAMPLING[k] for k in ("temperature", "top_p", "seed", "stream", "model", "stop")},
             "input": field(st.one_of(TEXT, st.lists(ITEM, max_size=3))), "instructions": field(TEXT),
             "max_output_tokens": field(MAX), "previous_response_id": field(st.sampled_from([None, "", "resp_1"]))}
INFILL = {**COMPLETION, "input_prefix": field(st.one_of(TEXT, st.lists(st.one_of(TEXT, TOKEN), max_size=3))),
          "input_suffix": field(st.one_of(TEXT, st.lists(st.one_of(TEXT, TOKEN), max_size=3))),
          "input_extra": field(st.lists(st.fixed_dictionaries({"text": TEXT}, optional={"filename": TEXT}),
                                        max_size=2)),
          "prompt": field(TEXT)}
TOKENIZE = {"content": field(st.one_of(TEXT, st.lists(st.one_of(TEXT, TOKEN), max_size=4))),
            "add_special": field(st.booleans()), "parse_special": field(st.booleans()),
            "with_pieces": field(st.booleans())}
DETOKENIZE = {"tokens": field(st.lists(TOKEN, max_size=6))}
EMBED_INPUT = st.one_of(TEXT, st.lists(TOKEN, min_size=1, max_size=4), st.lists(TEXT, min_size=1, max_size=2),
                        st.fixed_dictionaries({"content": st.lists(st.fixed_dictionaries(
                            {"type": st.just("text"), "text": TEXT}), max_size=2)}))
EMBEDDING = {"content": field(EMBED_INPUT), "input": field(EMBED_INPUT), "embd_normalize": field(st.integers(-1, 3)),
             "encoding_format": field(st.sampled_from(["float", "base64", "hex"])), "model": field(TEXT)}
SLOT_FILE = {"filename": field(st.sampled_from(["fuzz.bin", "../x", ".hidden", "", "a/b", "fuzz2.bin"]))}

# POST route -> (its paths, its fields, the required ones); every route the server registers (GET
# ones take no body)
ROUTES = {
    "oai_completions": (["/v1/completions"], COMPLETION, ("prompt",)),
    "completion": (["/completion", "/completions"], COMPLETION, ("prompt",)),
    "infill": (["/infill"], INFILL, ("input_prefix", "input_suffix")),
    "oai_chat": (["/v1/chat/completions", "/chat/completions"], CHAT, ("messages",)),
    "chat_input_tokens": (["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"], CHAT,
                          ("messages",)),
    "apply_template": (["/apply-template"], CHAT, ("messages",)),
    "anthropic_messages": (["/v1/messages"], ANTHROPIC, ("messages", "max_tokens")),
    "anthropic_count_tokens": (["/v1/messages/count_tokens"], ANTHROPIC, ("messages",)),
    "responses": (["/v1/responses", "/responses"], RESPONSES, ("input",)),
    "responses_input_tokens": (["/v1/responses/input_tokens", "/responses/input_tokens"], RESPONSES, ("input",)),
    "tokenize": (["/tokenize"], TOKENIZE, ("content",)),
    "detokenize": (["/detokenize"], DETOKENIZE, ("tokens",)),
    "embedding": (["/embedding", "/embeddings"], EMBEDDING, ("content",)),
    "oai_embeddings": (["/v1/embeddings"], EMBEDDING, ("input",)),
}


def body_of(fields: dict, required: tuple[str, ...] = ()) -> st.SearchStrategy:
    """A body: the ``required`` fields and some others, plausible but for at most one arbitrary
    field (what is tested is then what that field does), perhaps unknown fields; sometimes a body
    of arbitrary fields only (missing required ones)."""
    plain = {k: PLAUSIBLE.get(id(v), v) for k, v in fields.items()}
    known = st.fixed_dictionaries({k: plain[k] for k in required},
                                  optional={k: v for k, v in plain.items() if k not in required})
    one = st.sampled_from(sorted(fields)).flatmap(lambda k: st.fixed_dictionaries({k: ANY}))
    fuzzed = st.one_of(st.just({}), one, one)
    extra = st.one_of(st.just({}), st.dictionaries(STRINGS, NESTED, max_size=2))
    structured = st.builds(lambda k, f, e: {**e, **k, **f}, known, fuzzed, extra)
    return st.one_of(structured, structured, structured, structured,
                     st.dictionaries(st.one_of(st.sampled_from(sorted(fields)), STRINGS), ANY, max_size=4))


# ------------------------------------------------------------------------------------------------
# the server and the checks
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _env(**values: str):  # type: ignore[no-untyped-def]
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    """(base URL, log file) of one server for the whole module."""
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "slots").mkdir()
    args = ["-m", str(smollm2_path), "-md", str(SHIPPED_DRAFTER), "--host", "127.0.0.1", "-np", str(N_SLOTS),
            "-c", str(256 * N_SLOTS), "-t", "2", "-b", "64", "--n-predict", "4", "--embeddings", "--slots",
            "--metrics", "--slot-save-path", str(tmp / "slots")]
    with _env(AIP_MODE="PREDICTION"), running(tmp, {"ours": ("ours", args)}) as up:
        yield up["ours"][0], tmp / "ours.log"


def _server_errors(value: Any) -> list:
    """Error objects with a 5xx code anywhere in an answer (a /predict instance's, an SSE event's)."""
    found, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            err = v.get("error")
            if isinstance(err, dict) and isinstance(err.get("code"), int) and err["code"] >= 500 and not (
                    err["code"] == 501 and err.get("type") == "not_supported_error"):
                found.append(err)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return found


def post(base: str, path: str, raw: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path, data=raw, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            status, out = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, out = exc.code, exc.read()
    assert time.monotonic() - t0 < TIMEOUT_S, (path, raw[:300])
    SENT[status] += 1
    return status, out


def _not_supported(out: bytes) -> bool:
    """llama-server's 501 for what this server or model does not do (/infill on a model without FIM
    tokens, as SmolLM2's): an answer about the server, not a failure, so it is let through."""
    try:
        return json.loads(out)["error"]["type"] == "not_supported_error"
    except (ValueError, KeyError, TypeError):
        return False


def check(base: str, path: str, raw: bytes) -> None:
    """No 5xx: the status, and no 5xx error inside the answer (JSON or an SSE stream)."""
    status, out = post(base, path, raw)
    assert status < 500 or status == 501 and _not_supported(out), (path, status, out[:500], raw[:1000])
    text = out.decode("utf-8", "replace")
    if text.startswith(("data: ", "event: ")):
        docs = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        docs = [text]
    for doc in docs:
        try:
            parsed = json.loads(doc)
        except ValueError:
            continue
        assert not _server_errors(parsed), (path, status, doc[:500], raw[:1000])


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", list(ROUTES))
def test_route_never_answers_5xx(server, route):
    base, _ = server
    paths, fields, required = ROUTES[route]

    @FUZZ
    @given(path=st.sampled_from(paths), body=body_of(fields, required))
    @example(path=paths[0], body={"prompt": "Hi", "max_tokens": 10**12})  # #29: an OverflowError in C
    @example(path=paths[0], body={"prompt": Deep(5000, "list", None), "n_predict": 2})  # #29: RecursionError
    @example(path=paths[0], body={"model": "m", "max_tokens": 4, "messages": [  # #29: a block of an unknown shape
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "iVBORw0KGgo="}},
                                     {"type": "weird", "x": 1}, {"text": 5}]}]})
    def run(path: str, body: dict) -> None:
        check(base, path, dump(body).encode())

    run()


SLOT_PATHS = st.sampled_from(["/slots/0", "/slots/1", "/slots/2", "/slots/-1", "/slots/x", "/slots/99999999999999999999",
                              "/slots/%F0%9F%A4%97"])
ACTIONS = st.sampled_from(["save", "restore", "erase", "", "bogus"])


@FUZZ
@given(path=SLOT_PATHS, action=ACTIONS, body=body_of(SLOT_FILE))
def test_slot_files_never_answer_5xx(server, path, action, body):
    base, _ = server
    check(base, f"{path}?action={action}", dump(body).encode())


FORMATS = st.sampled_from(["completion", "chatCompletions", "/v1/completions", "tokenize", "nope"])
INSTANCE = st.one_of(*[st.builds(lambda f, b: {"@requestFormat": f, **b}, FORMATS, body_of(fields, required))
                       for fields, required in ((COMPLETION, ("prompt",)), (CHAT, ("messages",)), (TOKENIZE, ()))],
                     ANY)


@FUZZ
@given(body=st.one_of(st.fixed_dictionaries({"instances": st.lists(INSTANCE, max_size=3)}), body_of({
    "instances": field(st.lists(INSTANCE, max_size=2))})))
def test_vertex_predict_never_answers_5xx(server, body):
    base, _ = server
    check(base, "/predict", dump(body).encode())


RAW = st.one_of(st.binary(max_size=64), st.sampled_from([
    b"", b"{", b"[]", b"null", b"1e999999", b'"x"', b"{\"prompt\": NaN}", b"\xff\xfe{\x00}\x00",
    b'{"prompt": "\\ud800"}', b'{"content": "\\udc00x"}', b'{"messages": [{"role": "user", "content": "\\ud83e"}]}',
    b"[" * 100000, b'{"prompt": ' + b"{\"a\": " * 3000 + b"1" + b"}" * 3000 + b"}",
    b'{"prompt": 1' + b"0" * 5000 + b"}", b'{"a": 1, "a": 2, "prompt": "dup"}']))


@FUZZ
@given(path=st.sampled_from(sorted({p for paths, _, _ in ROUTES.values() for p in paths}) + ["/predict", "/slots/0"]),
       raw=RAW)
def test_bodies_that_are_not_json_objects_get_4xx(server, path, raw):
    base, _ = server
    check(base, path, raw)


def test_server_alive_and_idle_after_the_run(server, capsys):
    """Last: /health answers, every slot is free again (no sequence left running for nobody), and
    the log holds no traceback."""
    base, log = server
    with urllib.request.urlopen(base + "/health", timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(base + "/slots", timeout=10) as resp:
            busy = [s["id"] for s in json.loads(resp.read()) if s["is_processing"]]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not busy, f"slots {busy} still busy after every request was answered"
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-5000:]
    with capsys.disabled():
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(SENT.items()))
        print(f"\ntest_server_fuzz: {sum(SENT.values())} requests sent, no 5xx ({statuses})")
