"""Request constraints and extras: logit bias, GBNF grammars / JSON schemas, per-token
probabilities, embeddings, llama.cpp's chat templates, and slot files.

References: plain decoding recomputed here from the target's raw logits (numpy, float64), the
shipped upstream llama-server (same grammar, same template, same embeddings), and the grammar's
own language (a schema-constrained answer parses as JSON of that schema). Speculative decoding
under constraints is compared with plain decoding under the same constraints (tie-aware).
Comparisons with llama-server run twice: on ggml's stock kernels, bit for bit, and on the default
kernels, tie-aware and within their measured numeric distance (conftest.py).
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

import pydflash
from pydflash import Engine, SamplingOptions, Target
from pydflash.tools.upstream_server import UpstreamServer, post_json
from pydflash.runtime.chat import ChatTemplates, json_schema_to_grammar

from conftest import EMBED_COSINE, KERNELS, LOGPROB_TOL, assert_tie_aware, kernels_env, reference_logits
from test_speculative_loop import _tie_aware_equal

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, n_ctx=1024, n_threads=2) as t:
        yield t


@pytest.fixture(scope="module")
def stock(smollm2_path):
    """The same target on ggml's stock kernels: bit for bit llama-server's (same context size)."""
    with kernels_env(False):
        t = Target(smollm2_path, n_ctx=1024, n_threads=2)
    with t:
        yield t


@pytest.fixture
def on(request, target, stock):  # type: ignore[no-untyped-def]
    """The target on the kernels of the test's `kern` parameter."""
    return stock if request.node.callspec.params["kern"] == "stock" else target


@pytest.fixture(scope="module")
def upstream(smollm2_path):
    with UpstreamServer(["-m", str(smollm2_path), "-c", "1024", "-np", "1", "-t", "2", "--jinja",
                         "--embedding", "--pooling", "mean", "--temp", "0"]) as server:
        yield server


def _plain_logits_greedy(target: Target, prompt: list[int], n: int, adjust) -> list[int]:
    """Greedy decoding by hand: argmax of adjust(raw logits) one token at a time."""
    target.rollback(0)
    target.decode(prompt)
    out = []
    for _ in range(n):
        logits = adjust(np.asarray(target.logits(-1), dtype=np.float64))
        tok = int(np.argmax(logits))
        out.append(tok)
        if target.is_eog(tok):
            break
        target.decode([tok])
    target.rollback(0)
    return out


# -- logit bias -------------------------------------------------------------------------------

def test_logit_bias_matches_biased_argmax(target):
    prompt = target.tokenize(PROMPT)
    plain = target.generate(prompt, max_tokens=8, temperature=0).tokens
    banned = plain[0]
    boosted = target.tokenize(" purple", add_special=False)[0]
    bias = {banned: float("-inf"), boosted: 3.0}

    def adjust(z):
        z = z.copy()
        z[banned] = -np.inf
        z[boosted] += 3.0
        return z

    ref = _plain_logits_greedy(target, prompt, 8, adjust)
    got = target.generate(prompt, max_tokens=8, temperature=0, logit_bias=bias).tokens
    assert banned not in got
    assert got == ref


def test_logit_bias_bad_token(target):
    with pytest.raises(pydflash.InvalidArgumentError, match="outside the vocabulary"):
        target.generate(target.tokenize(PROMPT), max_tokens=2, logit_bias={10**7: 1.0})


# -- n_probs ------------------------------------------------------------------------------------

def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def test_n_probs_are_the_raw_softmax(target):
    prompt = target.tokenize(PROMPT)
    r = target.generate(prompt, max_tokens=4, temperature=0, n_probs=5)
    assert r.probs is not None and len(r.probs) == len(r.tokens)
    target.rollback(0)
    target.decode(prompt)
    for i, tp in enumerate(r.probs):
        ref = _log_softmax(np.asarray(target.logits(-1), dtype=np.float64))
        order = np.argsort(-ref, kind="stable")[:5]
        assert tp.token == r.tokens[i]
        assert abs(tp.logprob - ref[tp.token]) < 1e-4
        assert [t for t, _ in tp.top] == [int(t) for t in order]
        assert np.allclose([lp for _, lp in tp.top], ref[order], atol=1e-4)
        target.decode([r.tokens[i]])
    target.rollback(0)


def test_post_sampling_probs_sum_to_one(target):
    r = target.generate(target.tokenize(PROMPT), max_tokens=4, temperature=1.0, seed=3, n_probs=50,
                        post_sampling_probs=True)
    for tp in r.probs:
        total = sum(np.exp(lp) for _, lp in tp.top)
        assert 0.999 < total < 1.001  # top_k 40 < 50: every candidate is listed
        assert any(t == tp.token for t, _ in tp.top)


@pytest.mark.parametrize("kern", KERNELS)
def test_n_probs_against_llama_server(on, stock, upstream, kern):
    prompt = on.tokenize(PROMPT)
    ours = on.generate(prompt, max_tokens=3, temperature=0, n_probs=3)
    theirs = post_json(upstream.base + "/completion", {"prompt": prompt, "n_predict": 3, "n_probs": 3,
                                                         "temperature": 0, "cache_prompt": False})
    probs = theirs["completion_probabilities"]
    if kern == "stock":
        assert [p["id"] for p in probs] == ours.tokens
        for tp, p in zip(ours.probs, probs):
            assert abs(tp.logprob - p["logprob"]) < 2e-3
            assert [t for t, _ in tp.top] == [q["id"] for q in p["top_logprobs"]]
        return
    want = [p["id"] for p in probs]
    assert_tie_aware(want, ours.tokens, lambda i: reference_logits(stock, prompt, want[:i]), what="n_probs")
    for tp, p in zip(ours.probs, probs):  # up to the first difference: the same candidates' log-probs
        if tp.token != p["id"]:
            break
        assert abs(tp.logprob - p["logprob"]) < LOGPROB_TOL
        theirs_top = {q["id"]: q["logprob"] for q in p["top_logprobs"]}
        assert tp.top[0][0] == p["top_logprobs"][0]["id"]
        assert all(abs(lp - theirs_top[t]) < LOGPROB_TOL for t, lp in tp.top if t in theirs_top)


# -- grammars -----------------------------------------------------------------------------------

DIGITS = 'root ::= [0-9] [0-9] [0-9] "!"'


def _same_constrained(kern: str, stock, prompt: list[int], ours, theirs: dict) -> None:  # type: ignore[no-untyped-def]
    """stock: llama-server's text; default: its tokens up to a near-tie (the log-ratio of the two
    tokens where they part is the same with or without the grammar's mask)."""
    if kern == "stock":
        assert ours.text == theirs["content"]
        return
    # a final end-of-generation token left out (llama-server lists a grammar's final EOS)
    want, got = [list(x[:-1] if x and stock.is_eog(x[-1]) else x) for x in (theirs["tokens"], ours.tokens)]
    assert_tie_aware(want, got, lambda i: reference_logits(stock, prompt, want[:i]), what="constrained")


@pytest.mark.parametrize("kern", KERNELS)
def test_grammar_against_llama_server(on, stock, upstream, kern):
    prompt = on.tokenize("My favourite number is")
    ours = on.generate(prompt, max_tokens=16, temperature=0, grammar=DIGITS)
    theirs = post_json(upstream.base + "/completion", {"prompt": prompt, "n_predict": 16, "grammar": DIGITS,
                                                         "temperature": 0, "cache_prompt": False,
                                                         "return_tokens": True})
    _same_constrained(kern, stock, prompt, ours, theirs)
    assert len(ours.text) == 4 and ours.text[:3].isdigit() and ours.text.endswith("!")
    assert ours.stats.stop_reason in ("eos", "length")


def test_bad_grammar_is_an_invalid_argument(target):
    with pytest.raises(pydflash.InvalidArgumentError, match="grammar"):
        target.generate(target.tokenize(PROMPT), max_tokens=2, grammar="root ::= [0-9")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_output_parses(target):
    r = target.generate(target.tokenize("A person as JSON:"), max_tokens=64, temperature=0,
                        grammar=json_schema_to_grammar(SCHEMA))
    doc = json.loads(r.text)
    assert set(doc) == {"name", "age"} and isinstance(doc["age"], int)


@pytest.mark.parametrize("kern", KERNELS)
def test_json_schema_converter_matches_llama_server(on, stock, upstream, kern):
    # same grammar -> same greedy text as upstream's json_schema field
    prompt = on.tokenize("A person as JSON:")
    ours = on.generate(prompt, max_tokens=48, temperature=0, grammar=json_schema_to_grammar(SCHEMA))
    theirs = post_json(upstream.base + "/completion", {"prompt": prompt, "n_predict": 48, "json_schema": SCHEMA,
                                                         "temperature": 0, "cache_prompt": False,
                                                         "return_tokens": True})
    _same_constrained(kern, stock, prompt, ours, theirs)


def test_bad_schema(target):
    with pytest.raises(pydflash.InvalidArgumentError):
        json_schema_to_grammar("{not json")


@pytest.mark.parametrize("offset", [0, 1])
def test_grammar_exact_under_speculation(target, offset):
    """Drafts that break the grammar are rejected; accepted ones advance it: the replay drafter
    (always right / always wrong) gives plain decoding's constrained output."""
    grammar = json_schema_to_grammar(SCHEMA)
    prompt = target.tokenize("A person as JSON:")
    plain = target.generate(prompt, max_tokens=40, temperature=0, grammar=grammar)
    # what plain decoding without the grammar says: drafting it is mostly wrong under the grammar
    free = target.generate(prompt, max_tokens=40, temperature=0)
    continuation = plain.tokens if offset == 0 else free.tokens
    spec = target._generate_replay(prompt, continuation, offset=0, n_max=4, max_tokens=40, temperature=0,
                                   grammar=grammar)
    assert spec.tokens == plain.tokens
    assert spec.stats.n_drafted > 0


def test_grammar_with_the_shipped_drafter(smollm2_path):
    from pathlib import Path

    import pydflash.drafters

    drafter = Path(pydflash.drafters.__file__).with_name("smollm2-135m-instruct-dflash2.gguf")
    grammar = json_schema_to_grammar(SCHEMA)
    with Engine(smollm2_path, drafter, n_ctx=1024, n_threads=2, n_max=3) as engine:
        prompt = engine.target.tokenize("A person as JSON:")
        plain = engine.target.generate(prompt, max_tokens=40, temperature=0, grammar=grammar)
        spec = engine.generate(prompt, max_tokens=40, temperature=0, grammar=grammar)
        assert spec.stats.n_drafted > 0
        _tie_aware_equal(engine.target, prompt, plain.tokens, spec.tokens)
        json.loads(spec.text)


# -- embeddings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kern", KERNELS)
def test_embeddings_match_llama_server(on, upstream, kern):
    text = "Embeddings map text to vectors."
    tokens = on.tokenize(text)
    ours = on.embed(tokens, pooling="mean")[0].astype(np.float64)
    theirs = post_json(upstream.base + "/embedding", {"content": tokens})
    ref = np.asarray(theirs[0]["embedding"][0] if isinstance(theirs[0]["embedding"][0], list)
                     else theirs[0]["embedding"], dtype=np.float64)
    ours /= np.linalg.norm(ours)  # the server L2-normalises
    assert ref.shape == ours.shape
    assert float(ours @ ref / np.linalg.norm(ref)) > (0.9999 if kern == "stock" else EMBED_COSINE)


def test_embeddings_per_token_and_errors(target):
    tokens = target.tokenize("one two three")
    rows = target.embed(tokens, pooling="none")
    assert rows.shape == (len(tokens), target.info.n_embd)
    last = target.embed(tokens, pooling="last")[0]
    assert np.allclose(rows[-1], last, atol=1e-4)
    with pytest.raises(pydflash.InvalidArgumentError):
        target.embed([], pooling="mean")
    with pytest.raises(pydflash.InvalidArgumentError):
        target.embed(tokens, pooling="max")


# -- chat templates (llama.cpp's Jinja engine) -------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_chat_render_matches_llama_server_apply_template(target, upstream):
    chat = ChatTemplates(target)
    for body in ({"messages": MESSAGES}, {"messages": MESSAGES, "add_generation_prompt": False},
                 {"messages": MESSAGES + [{"role": "assistant", "content": "Hel"}]}):
        ours = chat.render(body)["prompt"]
        theirs = post_json(upstream.base + "/apply-template", body)["prompt"]
        assert ours == theirs


def test_chat_render_rejects_what_llama_server_rejects(target):
    chat = ChatTemplates(target)
    with pytest.raises(pydflash.InvalidArgumentError, match="add_generation_prompt"):
        chat.render({"messages": MESSAGES + [{"role": "assistant", "content": "x"}],
                     "continue_final_message": True, "add_generation_prompt": True})
    with pytest.raises(pydflash.InvalidArgumentError, match="2 or more assistant"):
        chat.render({"messages": MESSAGES + [{"role": "assistant", "content": "a"},
                                             {"role": "assistant", "content": "b"}]})
    with pytest.raises(pydflash.InvalidArgumentError, match="messages"):
        chat.render({"prompt": "x"})
    with pytest.raises(pydflash.InvalidArgumentError, match="chat template"):
        ChatTemplates(target, template="{% if %}")


def test_chat_template_override(target):
    chat = ChatTemplates(target, template="chatml")
    prompt = chat.render({"messages": MESSAGES})["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")


# -- slot files ---------------------------------------------------------------------------------

def test_slot_save_restore_erase(smollm2_path, tmp_path):
    with Engine(smollm2_path, None, n_ctx=1024, n_threads=2, n_seq_max=2) as engine:
        sched = engine.scheduler
        prompt = engine.target.tokenize("Once upon a time, in a quiet village by the sea,")
        opts = SamplingOptions(max_tokens=8, temperature=0)
        first = sched.run([sched.add(prompt, opts, slot=1)])[0]
        n_saved, n_bytes = sched.slot_save(1, tmp_path / "slot1.bin")
        assert n_saved == len(prompt) + len(first.tokens) - 1 and n_bytes > 0
        assert sched.slot_erase(1) == n_saved
        with pytest.raises(pydflash.ModelNotFoundError):
            sched.slot_restore(0, tmp_path / "missing.bin")
        assert sched.slot_restore(0, tmp_path / "slot1.bin")[0] == n_saved
        again = sched.run([sched.add(prompt, opts, slot=0)])[0]
        assert again.stats.n_cached == len(prompt) - 1  # the restored KV served the prompt
        assert again.tokens == first.tokens
        with pytest.raises(pydflash.InvalidArgumentError):
            sched.slot_save(5, tmp_path / "x.bin")
