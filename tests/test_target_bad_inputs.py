"""Bad inputs give a clear exception and leave the process (and other handles) usable."""

from __future__ import annotations


import pytest

import pydflash
from pydflash import Target


def test_missing_file(tmp_path):
    with pytest.raises(pydflash.ModelNotFoundError, match="neither an existing file"):
        Target(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is not a model\n" * 100)
    with pytest.raises(pydflash.ModelFormatError, match="not a GGUF file"):
        Target(bogus)


def test_truncated_gguf(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(8 * 1024 * 1024))  # header intact, tensor data missing
    with pytest.raises(pydflash.ModelFormatError, match="truncated"):
        Target(cut)


def test_truncated_header(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(1000))  # inside the metadata
    with pytest.raises(pydflash.ModelFormatError):
        Target(cut)


def test_prompt_longer_than_context(smollm2_path):
    with Target(smollm2_path, n_ctx=64, n_threads=2) as target:
        prompt = "word " * 200
        with pytest.raises(pydflash.ContextFullError, match="context"):
            target.generate(prompt, max_tokens=4, temperature=0)
        # still usable afterwards
        assert target.generate("Hello", max_tokens=2, temperature=0).stats.n_generated == 2


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -3},
        {"min_p": 2.0},
        {"max_tokens": "ten"},
        {"max_tokens": -5},
        {"seed": -1},
        {"stop": [""]},
        {"bogus_option": 1},
    ],
)
def test_invalid_sampling_arguments(smollm2, options):
    with pytest.raises((pydflash.InvalidArgumentError, TypeError)):
        smollm2.generate("Hello", **options)
    assert smollm2.generate("Hello", max_tokens=1, temperature=0).stats.n_generated == 1


def test_invalid_tokens(smollm2):
    with pytest.raises(pydflash.InvalidArgumentError, match="outside the vocabulary"):
        smollm2.generate([1, 2, 10**9], max_tokens=1)
    with pytest.raises(pydflash.InvalidArgumentError, match="empty"):
        smollm2.generate([], max_tokens=1)


def test_closed_handle_reuse(smollm2_path):
    target = Target(smollm2_path, n_ctx=256, n_threads=2)
    target.close()
    target.close()  # idempotent
    assert target.closed
    for call in (
        lambda: target.generate("Hi", max_tokens=1),
        lambda: target.tokenize("Hi"),
        lambda: target.decode([1]),
        lambda: target.logits(),
        lambda: target.rollback(0),
    ):
        with pytest.raises(pydflash.ClosedError):
            call()


def test_bad_constructor_arguments(smollm2_path):
    with pytest.raises(pydflash.InvalidArgumentError):
        Target(smollm2_path, n_ctx=0)
    with pytest.raises(pydflash.InvalidArgumentError):
        Target(smollm2_path, tap_source="magic")


def test_layer_input_taps_refused_on_unsupported_arch(qwen05_path):
    # the pinned llama.cpp's qwen2 graph does not record layer inputs: a clear error, no abort
    with pytest.raises(pydflash.UnsupportedError, match="qwen2"):
        Target(qwen05_path, n_ctx=256, tap_source="layer_input")


def test_tap_layer_out_of_range(smollm2):
    with pytest.raises(pydflash.InvalidArgumentError, match="tap layer"):
        smollm2.set_taps([0])
    with pytest.raises(pydflash.InvalidArgumentError, match="tap layer"):
        smollm2.set_taps([smollm2.info.n_layer])
    smollm2.set_taps([])
