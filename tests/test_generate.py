"""Plain generation: greedy output equals the shipped upstream llama-server's (bit for bit on
ggml's stock kernels, tie-aware with pydflash's default kernels); stopping rules."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pydflash.tools.upstream_binaries import tool_path
from conftest import KERNELS, TIE_LOG_RATIO, assert_tie_aware, kernels_subprocess_env, reference_logits
from pydflash.tools.upstream_server import free_port, post_json, wait_healthy

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Here is a list of fruits:\n1.",
    "Q: What is 12 times 7?\nA:",
]
N_PREDICT = 32


@pytest.fixture(scope="module")
def upstream_server(smollm2_path):
    port = free_port()
    proc = subprocess.Popen(
        [str(tool_path("llama-server")), "-m", str(smollm2_path), "--host", "127.0.0.1", "--port", str(port),
         "-c", "2048", "-t", "2", "-np", "1", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc, timeout=120)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def _upstream_greedy(base: str, prompt: str) -> dict:
    return post_json(base + "/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                            "cache_prompt": False, "return_tokens": True, "ignore_eos": False})


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_upstream_llama_server(smollm2, smollm2_stock, upstream_server, prompt, kern):
    """stock: llama-server's tokens and text exactly. default: the same, or the first difference on
    a near-tie of llama-server's distribution (smollm2_stock computes it bit for bit)."""
    ref = _upstream_greedy(upstream_server, prompt)
    target = smollm2_stock if kern == "stock" else smollm2
    ours = target.generate(prompt, max_tokens=N_PREDICT, temperature=0)
    if kern == "stock":
        assert ours.tokens[: len(ref["tokens"])] == ref["tokens"]
        assert ours.text == ref["content"]
        return
    prompt_tokens = smollm2_stock.tokenize(prompt)
    got = ours.tokens[:-1] if ours.stats.stop_reason == "eos" else ours.tokens  # as /completion returns them
    assert_tie_aware(ref["tokens"], got, lambda i: reference_logits(smollm2_stock, prompt_tokens, ref["tokens"][:i]),
                     what=prompt)


@pytest.mark.parametrize("kern", KERNELS)
def test_cli_generate_matches_upstream(smollm2_path, smollm2_stock, upstream_server, kern):
    """The CLI's text (stock: exactly llama-server's; default: up to a near-tie)."""
    prompt = PROMPTS[1]
    ref = _upstream_greedy(upstream_server, prompt)
    proc = subprocess.run(
        [sys.executable, "-m", "pydflash.cli", "generate", "-m", str(smollm2_path), "-p", prompt,
         "-n", str(N_PREDICT), "--temp", "0", "-t", "2", "-c", "2048"],
        capture_output=True, text=True, timeout=300, check=True, env=kernels_subprocess_env(kern),
    )
    assert "tok/s" in proc.stderr
    if kern == "stock":
        assert proc.stdout == ref["content"] + "\n"
        return
    text = proc.stdout[:-1]
    if text == ref["content"]:
        return
    # the token of llama-server's answer whose text first leaves the common prefix: a near-tie
    common = len(os.path.commonprefix([text, ref["content"]]))
    pieces = [smollm2_stock.detokenize(ref["tokens"][: k + 1]) for k in range(len(ref["tokens"]))]
    i = next((k for k, piece in enumerate(pieces) if len(piece) > common), len(ref["tokens"]))
    z = reference_logits(smollm2_stock, smollm2_stock.tokenize(prompt), ref["tokens"][:i])
    top = np.sort(z)[-2:]  # the CLI prints no token ids: llama-server's top 2 where the texts part
    assert top[1] - top[0] < TIE_LOG_RATIO, f"{text!r} != {ref['content']!r} at token {i}: {top}"


def test_max_tokens_and_stop_reason(smollm2):
    res = smollm2.generate("Count: one, two, three,", max_tokens=5, temperature=0, ignore_eos=True)
    assert len(res.tokens) == 5 and res.stats.stop_reason == "length"
    assert res.text == smollm2.detokenize(res.tokens)


def test_stop_string_cuts_text(smollm2):
    full = smollm2.generate("Count: one, two, three,", max_tokens=20, temperature=0)
    assert "," in full.text
    stop = full.text[full.text.index(",") :][:2]
    res = smollm2.generate("Count: one, two, three,", max_tokens=20, temperature=0, stop=[stop])
    assert res.stats.stop_reason == "stop"
    assert res.text == full.text[: full.text.index(stop)]
    assert stop not in res.text


def test_stream_equals_generate(smollm2):
    pieces = list(smollm2.stream("The capital of France is", max_tokens=16, temperature=0))
    full = smollm2.generate("The capital of France is", max_tokens=16, temperature=0)
    assert "".join(pieces) == full.text
    assert len(pieces) > 1


def test_stream_can_be_abandoned(smollm2):
    it = smollm2.stream("Tell me a story.", max_tokens=200, temperature=0, ignore_eos=True)
    first = next(it)
    it.close()  # cancels the native loop
    assert isinstance(first, str)
    assert smollm2.generate("Hi", max_tokens=2, temperature=0).stats.n_generated == 2


def test_seeded_sampling_is_reproducible(smollm2):
    a = smollm2.generate("Once upon a time", max_tokens=16, temperature=1.0, seed=7)
    b = smollm2.generate("Once upon a time", max_tokens=16, temperature=1.0, seed=7)
    c = smollm2.generate("Once upon a time", max_tokens=16, temperature=1.0, seed=8)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_chat_uses_the_model_template(smollm2):
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert "<|im_start|>user\nHello!<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    res = smollm2.chat([{"role": "user", "content": "What is 2+2?"}], max_tokens=16, temperature=0)
    assert res.stats.n_prompt > 5 and res.tokens


def test_tokenize_roundtrip(smollm2):
    text = "Hello, wörld! 🚀 def f(x): return x**2"
    toks = smollm2.tokenize(text, add_special=False)
    assert smollm2.detokenize(toks) == text


def test_cli_verbose_shows_the_llama_log(smollm2_path):
    """-v lets libllama log (it was silenced again by the drafter/target loads before)."""
    args = [sys.executable, "-m", "pydflash.cli", "generate", "-m", str(smollm2_path), "-p", "Hi", "-n", "2",
            "--temp", "0", "-t", "1"]
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=300)
    loud = subprocess.run(args + ["-v"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and loud.returncode == 0, loud.stderr[-2000:]
    assert "load_tensors" not in quiet.stderr
    assert "load_tensors" in loud.stderr and "[pydflash]" in loud.stderr
