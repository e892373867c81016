"""The bad-input matrix for drafters and engines: every case gets a specific exception and leaves
the process, and the shared engine, usable (a normal generation right after still matches plain
decoding). Target-only cases live in test_target_bad_inputs.py, HTTP cases in test_server.py.

Broken drafter files are made from a real converted drafter by editing exactly one header field
(tests/gguf_edit.py), so each test pins one check of the native loader.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import pydflash
from pydflash import Drafter, Engine, Target
from pydflash.runtime._bindings import ffi, lib
from pydflash.formats.convert import convert

import gguf_edit
from fixtures_tiny import smollm2_drafter_config, write_checkpoint

PROMPT = "The three primary colours are"
N_TOKENS = 12
BLOCK = 8


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory, smollm2_path) -> Path:
    tmp = tmp_path_factory.mktemp("bad-inputs")
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=BLOCK), seed=5, dtype=torch.float32)
    return convert(tmp / "hf", tmp / "drafter.gguf", target_gguf=smollm2_path, outtype="f32", progress=False)


@pytest.fixture(scope="module")
def plain(smollm2) -> list[int]:
    """The independent reference: plain greedy decoding of PROMPT by the target alone."""
    return smollm2.generate(PROMPT, max_tokens=N_TOKENS, temperature=0).tokens


@pytest.fixture(scope="module")
def engine(smollm2_path, drafter_path):
    with Engine(smollm2_path, drafter_path, n_ctx=256, n_threads=1) as e:
        yield e


def still_usable(engine: Engine, plain: list[int]) -> None:
    """The shared engine still generates the target's own greedy text."""
    assert engine.generate(PROMPT, max_tokens=N_TOKENS, temperature=0).tokens == plain


def edited(drafter_path: Path, tmp_path: Path, edit) -> Path:  # noqa: ANN001
    """A copy of the drafter with one header edit applied."""
    h = gguf_edit.load(drafter_path)
    edit(h)
    return gguf_edit.save(h, tmp_path / "edited.gguf")


def set_int(key: str, value: int, vtype: int = gguf_edit.UINT32):  # noqa: ANN201
    def edit(h: gguf_edit.Header) -> None:
        h.kv[key] = gguf_edit.Value(vtype, value)
    return edit


def load_fails(path: Path, target: Path, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Drafter(path, target, n_ctx=64, n_threads=1)


# --- broken or foreign drafter files ---------------------------------------------------------


def test_drafter_header_truncated(tmp_path, drafter_path, smollm2_path, engine, plain):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(drafter_path.read_bytes()[:2000])  # inside the metadata
    load_fails(cut, smollm2_path, pydflash.ModelFormatError, "not a valid GGUF")
    still_usable(engine, plain)


def test_drafter_data_one_byte_short(tmp_path, drafter_path, smollm2_path, engine, plain):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(drafter_path.read_bytes()[:-1])
    load_fails(cut, smollm2_path, pydflash.ModelFormatError, "truncated")
    still_usable(engine, plain)


def test_drafter_corrupt_tensor_type(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, lambda h: setattr(h.tensor("fc.weight"), "type", 1000))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "not a valid GGUF")
    still_usable(engine, plain)


def test_drafter_oversized_tensor(tmp_path, drafter_path, smollm2_path, engine, plain):
    # a tensor claiming 2**40 rows: its data would lie far beyond the end of the file
    path = edited(drafter_path, tmp_path, lambda h: h.tensor("blk.0.ffn_up.weight").ne.__setitem__(1, 2**40))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "truncated|not a valid GGUF")
    still_usable(engine, plain)


def test_drafter_tensor_offset_outside_file(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, lambda h: setattr(h.tensor("output_norm.weight"), "offset", 2**40))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "truncated|not a valid GGUF")
    still_usable(engine, plain)


def test_drafter_tensor_wrong_shape(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, lambda h: h.tensor("fc.weight").ne.reverse())
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "fc.weight' has shape")
    still_usable(engine, plain)


def test_drafter_missing_tensor(tmp_path, drafter_path, smollm2_path, engine, plain):
    # the last one: GGUF lays tensors out in order, so dropping it leaves the others' offsets valid
    name = gguf_edit.load(drafter_path).tensors[-1].name
    load_fails(edited(drafter_path, tmp_path, lambda h: h.tensors.pop()), smollm2_path, pydflash.ModelFormatError,
               f"missing tensor '{name}'")
    still_usable(engine, plain)


def test_drafter_wrong_arch(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path,
                  lambda h: h.kv.__setitem__("general.architecture", gguf_edit.Value(gguf_edit.STRING, b"llama")))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "not a DFlash drafter")
    still_usable(engine, plain)


def test_target_file_given_as_drafter(smollm2_path, engine, plain):
    load_fails(smollm2_path, smollm2_path, pydflash.ModelFormatError, "not a DFlash drafter")
    still_usable(engine, plain)


def test_drafter_for_another_vocabulary(tmp_path, drafter_path, smollm2_path, engine, plain):
    def shorter_vocab(h: gguf_edit.Header) -> None:
        tokens = h.kv["tokenizer.ggml.tokens"]
        tokens.value = tokens.value[:1000]  # type: ignore[index]
    load_fails(edited(drafter_path, tmp_path, shorter_vocab), smollm2_path, pydflash.MismatchError,
               "vocabulary has 1000 tokens")
    still_usable(engine, plain)


def test_drafter_for_another_target_on_qwen(drafter_path, qwen05_path, engine, plain):
    # hidden size 576 (SmolLM2) vs 896 (Qwen2.5-Coder-0.5B)
    load_fails(drafter_path, qwen05_path, pydflash.MismatchError, "hidden size 576")
    still_usable(engine, plain)


@pytest.mark.parametrize("layer", [0, 31, -5])
def test_drafter_taps_a_layer_the_target_lacks(tmp_path, drafter_path, smollm2_path, engine, plain, layer):
    path = edited(drafter_path, tmp_path, lambda h: h.kv["dflash.target_layers"].value.__setitem__(0, layer))
    load_fails(path, smollm2_path, pydflash.MismatchError, "taps target layer")
    still_usable(engine, plain)


def test_mask_id_outside_target_vocab(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, set_int("tokenizer.ggml.mask_token_id", 49152))
    load_fails(path, smollm2_path, pydflash.MismatchError, "mask token id 49152")
    still_usable(engine, plain)


def test_mask_id_negative(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, set_int("tokenizer.ggml.mask_token_id", -3, gguf_edit.INT32))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "mask_token_id")
    still_usable(engine, plain)


def test_block_size_zero(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, set_int("dflash.block_size", 0))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "block")
    still_usable(engine, plain)


@pytest.mark.parametrize("block", [2**31 - 1, 2**32 - 1, 100_000])
def test_block_size_huge(tmp_path, drafter_path, smollm2_path, engine, plain, block):
    path = edited(drafter_path, tmp_path, set_int("dflash.block_size", block))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "block")
    still_usable(engine, plain)


@pytest.mark.parametrize("layers", [0, 2**32 - 1, 2**31 - 1])
def test_block_count_out_of_range(tmp_path, drafter_path, smollm2_path, engine, plain, layers):
    # sized before any tensor is read: a huge count must not allocate per-layer state
    path = edited(drafter_path, tmp_path, set_int("dflash.block_count", layers))
    load_fails(path, smollm2_path, pydflash.ModelFormatError, "block_count")
    still_usable(engine, plain)


def test_hidden_size_key_disagrees_with_tensors(tmp_path, drafter_path, smollm2_path, engine, plain):
    path = edited(drafter_path, tmp_path, set_int("dflash.embedding_length", 2**31 - 1))
    load_fails(path, smollm2_path, (pydflash.MismatchError, pydflash.ModelFormatError), "hidden size|embd")
    still_usable(engine, plain)


def test_nan_weights_are_still_lossless(tmp_path, drafter_path, smollm2_path, plain):
    # every drafter weight NaN: drafts are garbage, the target's verification keeps the output exact
    h = gguf_edit.load(drafter_path)
    h.data = np.full(len(h.data) // 4, np.nan, dtype=np.float32).tobytes() + h.data[len(h.data) // 4 * 4:]
    path = gguf_edit.save(h, tmp_path / "nan.gguf")
    with Engine(smollm2_path, path, n_ctx=256, n_threads=1) as e:
        r = e.generate(PROMPT, max_tokens=N_TOKENS, temperature=0)
        assert r.tokens == plain
        assert r.stats.n_accepted <= r.stats.n_drafted
        sampled = e.generate(PROMPT, max_tokens=N_TOKENS, temperature=0.8, seed=3)
        assert len(sampled.tokens) == N_TOKENS and all(0 <= t < 49152 for t in sampled.tokens)


# --- bad requests to a good engine -----------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(engine, plain, prompt):
    if prompt == "" and engine.target.info.add_bos:  # BOS alone is a valid prompt
        assert engine.generate(prompt, max_tokens=2, temperature=0).stats.n_generated == 2
    else:
        with pytest.raises(pydflash.InvalidArgumentError, match="empty"):
            engine.generate(prompt, max_tokens=2, temperature=0)
    still_usable(engine, plain)


def test_prompt_over_context(engine, plain):
    with pytest.raises(pydflash.ContextFullError, match="context"):
        engine.generate("word " * 400, max_tokens=4, temperature=0)
    still_usable(engine, plain)


def test_token_ids_outside_vocab(engine, plain):
    with pytest.raises(pydflash.InvalidArgumentError, match="outside the vocabulary"):
        engine.generate([1, 2, 49152], max_tokens=2)
    with pytest.raises(pydflash.InvalidArgumentError, match="outside the vocabulary"):
        engine.generate([-1], max_tokens=2)
    still_usable(engine, plain)


def test_n_max_zero_decodes_plainly(engine, plain):
    r = engine.generate(PROMPT, max_tokens=N_TOKENS, temperature=0, n_max=0)
    assert r.tokens == plain and r.stats.n_drafted == 0
    still_usable(engine, plain)


@pytest.mark.parametrize("spec", [dict(n_max=-1), dict(n_max=-(2**40)), dict(n_max=2, n_min=3),
                                  dict(n_min=-1), dict(n_max=1.5), dict(p_min=1.5), dict(p_min=float("nan"))])
def test_invalid_spec_values(engine, plain, spec):
    with pytest.raises(pydflash.InvalidArgumentError):
        engine.generate(PROMPT, max_tokens=2, temperature=0, **spec)
    still_usable(engine, plain)


def test_n_max_over_block_is_clamped(engine, plain):
    r = engine.generate(PROMPT, max_tokens=N_TOKENS, temperature=0, n_max=10_000)
    assert r.tokens == plain
    assert r.stats.n_drafted <= r.stats.n_verify_steps * (BLOCK - 1)
    still_usable(engine, plain)


@pytest.mark.parametrize("options", [dict(temperature=float("nan")), dict(temperature=-0.1), dict(top_p=0.0),
                                     dict(top_k=-2), dict(min_p=-0.5), dict(max_tokens=-2), dict(seed=2**64),
                                     dict(stop=[""]), dict(max_tokens=2.5), dict(max_tokens=10**12),
                                     dict(top_k=2**31), dict(n_probs=2**40)])
def test_invalid_sampling_values(engine, plain, options):
    with pytest.raises(pydflash.InvalidArgumentError):
        engine.generate(PROMPT, **options)
    still_usable(engine, plain)


def test_native_spec_checks_without_python_validation(engine, plain):
    # the C API guards itself: values Python would have refused reach it directly here
    prompt = ffi.new("int32_t[]", engine.target.tokenize(PROMPT))
    params = ffi.new("dflash_generate_params *", lib.dflash_generate_default_params())
    params.max_tokens = 4
    out = ffi.new("dflash_output **")
    target, drafter = engine.target._h(), engine.drafter._h()
    cases = [({"n_max": -1, "n_min": 0}, len(prompt)), ({"n_max": 3, "n_min": -7}, len(prompt)),
             ({"n_max": 3, "n_min": 0}, 0), ({"n_max": 3, "n_min": 0}, -5), ({"n_max": 3, "n_min": 0}, 10**6)]
    with engine.target._lock:
        for spec_values, n_prompt in cases:
            spec = ffi.new("dflash_spec_params *", spec_values)
            status = lib.dflash_generate_speculative(target, drafter, prompt, n_prompt, spec, params, ffi.NULL,
                                                     ffi.NULL, out)
            assert status in (lib.DFLASH_ERR_INVALID_ARGUMENT, lib.DFLASH_ERR_CONTEXT_FULL), (spec_values, n_prompt)
            assert ffi.string(lib.dflash_last_error())
        spec = ffi.new("dflash_spec_params *", {"n_max": 2**31 - 1, "n_min": 0})  # clamped to block - 1
        assert lib.dflash_generate_speculative(target, drafter, prompt, len(prompt), spec, params, ffi.NULL,
                                               ffi.NULL, out) == lib.DFLASH_OK
        lib.dflash_output_free(out[0])
        assert lib.dflash_generate_speculative(ffi.NULL, drafter, prompt, len(prompt), spec, params, ffi.NULL,
                                               ffi.NULL, out) == lib.DFLASH_ERR_INVALID_ARGUMENT
    still_usable(engine, plain)


def test_bad_drafter_calls(drafter_path, smollm2_path, engine, plain):
    with Drafter(drafter_path, smollm2_path, n_ctx=16, n_threads=1) as d:
        width = d.info.n_target_layers * d.info.n_embd
        for call in (lambda: d.propose(0, 0, 0), lambda: d.propose(0, 0, -1), lambda: d.propose(-1, 0),
                     lambda: d.propose(0, -1), lambda: d.forward(49152, 0), lambda: d.crop(-1),
                     lambda: d.inject(np.zeros((1, width), np.float32), [-1]),
                     lambda: d.inject(np.zeros((2, width), np.float32), [0])):
            with pytest.raises(pydflash.InvalidArgumentError):
                call()
        d.inject(np.zeros((2, width), np.float32), [0, 1])  # the handle is still good
        assert d.propose(5, 2).tokens.shape == (BLOCK - 1,)
    for bad in (0, -1, 1.5):
        with pytest.raises(pydflash.InvalidArgumentError):
            Drafter(drafter_path, smollm2_path, n_ctx=bad)
    still_usable(engine, plain)


# --- threads and lifetime --------------------------------------------------------------------


def test_one_engine_from_two_threads(engine, plain):
    prompts = [PROMPT, "def fibonacci(n):"]
    expected = [engine.generate(p, max_tokens=N_TOKENS, temperature=0).tokens for p in prompts]
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                results[i].append(engine.generate(prompts[i], max_tokens=N_TOKENS, temperature=0).tokens)
                results[i].append("".join(engine.stream(prompts[i], max_tokens=N_TOKENS, temperature=0)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors and not any(t.is_alive() for t in threads)
    for i, prompt in enumerate(prompts):
        text = engine.target.detokenize(expected[i])
        assert results[i] == [expected[i], text] * 3
    assert expected[0] == plain


def test_close_while_another_thread_generates(smollm2_path, drafter_path):
    e = Engine(smollm2_path, drafter_path, n_ctx=256, n_threads=1)
    started, outcome = threading.Event(), []

    def worker() -> None:
        try:
            for piece in e.stream(PROMPT, max_tokens=64, temperature=0, ignore_eos=True):
                started.set()
            outcome.append("finished")
        except pydflash.ClosedError:
            outcome.append("closed")
        finally:
            started.set()

    t = threading.Thread(target=worker)
    t.start()
    started.wait(timeout=300)
    e.close()  # waits for the running generation or makes it fail cleanly; never frees under it
    t.join(timeout=300)
    assert not t.is_alive() and outcome in (["finished"], ["closed"])
    with pytest.raises(pydflash.ClosedError):
        e.generate(PROMPT, max_tokens=2)


def test_use_after_close(smollm2_path, drafter_path):
    e = Engine(smollm2_path, drafter_path, n_ctx=256, n_threads=1)
    drafter = e.drafter
    e.close()
    e.close()  # idempotent
    for call in (lambda: e.generate(PROMPT, max_tokens=2), lambda: list(e.stream(PROMPT, max_tokens=2)),
                 lambda: e.chat([{"role": "user", "content": "hi"}], max_tokens=2),
                 lambda: e.generate_batch([PROMPT], max_tokens=2), lambda: drafter.propose(0, 0),
                 lambda: drafter.inject(np.zeros((1, 3 * 576), np.float32), [0])):
        with pytest.raises(pydflash.ClosedError):
            call()


def test_abandoned_stream_releases_the_engine(engine, plain):
    it = engine.stream(PROMPT, max_tokens=64, temperature=0, ignore_eos=True)
    next(it)
    it.close()  # cancels the generation and frees the lock
    still_usable(engine, plain)


def test_target_loaded_from_a_drafter_file(drafter_path, engine, plain):
    # a dflash GGUF has no decoder of its own: loading it as a target must fail with a message
    with pytest.raises(pydflash.PydflashError):
        with Target(drafter_path, n_ctx=64, n_threads=1) as t:
            t.generate("Hi", max_tokens=2, temperature=0)
    still_usable(engine, plain)
