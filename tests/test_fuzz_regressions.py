"""Every input the fuzzers (fuzz/) found to crash, hang or exhaust memory, as a plain test.

Converter findings: malformed checkpoint / target input must give ``ValueError`` naming the
problem and write nothing. Native loader findings: a drafter file that loads must also draft,
and one that cannot must fail with a pydflash error, never abort the process.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from fixtures_tiny import tiny_config, write_checkpoint, write_hf_target_dir

from pydflash.formats.convert import convert, read_gguf_header


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:  # noqa: ANN001
    d = tmp_path_factory.mktemp("target")
    write_hf_target_dir(d, vocab_size=96, hidden_size=64, n_layers=4)
    return d


def _checkpoint(tmp_path: Path, **config_changes) -> Path:  # noqa: ANN003
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, tiny_config(), dtype=torch.float32)
    if config_changes:
        cfg = json.loads((ckpt / "config.json").read_text())
        for key, value in config_changes.items():
            (cfg["dflash_config"] if key in cfg["dflash_config"] else cfg)[key] = value
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def _convert_fails(ckpt: Path, target: Path, tmp_path: Path, needle: str) -> None:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    with pytest.raises(ValueError, match=needle):
        convert(ckpt, out / "d.gguf", target_model_dir=target, outtype="f32", progress=False)
    assert list(out.iterdir()) == [], "a failed conversion left files behind"


def _rewrite_safetensors_header(ckpt: Path, edit) -> None:  # noqa: ANN001
    path = ckpt / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_safetensors_entry_without_data_offsets(tmp_path, tiny_target):
    # fuzz finding: KeyError 'data_offsets' escaped from the header reader
    ckpt = _checkpoint(tmp_path)
    _rewrite_safetensors_header(ckpt, lambda h: h["fc.weight"].pop("data_offsets"))
    _convert_fails(ckpt, tiny_target, tmp_path, "needs dtype, shape and data_offsets")


@pytest.mark.parametrize("offsets", [[0, 10**12], [50, 10], "0-10", [0, -4]])
def test_safetensors_offsets_outside_the_file(tmp_path, tiny_target, offsets):
    ckpt = _checkpoint(tmp_path)
    _rewrite_safetensors_header(ckpt, lambda h: h["fc.weight"].__setitem__("data_offsets", offsets))
    _convert_fails(ckpt, tiny_target, tmp_path, "data_offsets")


def test_safetensors_header_length_beyond_the_file(tmp_path, tiny_target):
    ckpt = _checkpoint(tmp_path)
    raw = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + raw[8:])
    _convert_fails(ckpt, tiny_target, tmp_path, "header claims")


def test_safetensors_header_not_json(tmp_path, tiny_target):
    ckpt = _checkpoint(tmp_path)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff[[[" + b"\0" * 64)
    _convert_fails(ckpt, tiny_target, tmp_path, "not valid JSON")


def test_config_float_beyond_float32(tmp_path, tiny_target):
    # fuzz finding: OverflowError from the GGUF writer ("float too large to pack with f format")
    ckpt = _checkpoint(tmp_path, output_multiplier=1e308)
    _convert_fails(ckpt, tiny_target, tmp_path, "output_multiplier .* is not a finite float32")


def test_config_negative_size_stored_as_u32(tmp_path, tiny_target):
    # fuzz finding: struct.error "argument out of range" from the GGUF writer
    ckpt = _checkpoint(tmp_path, max_position_embeddings=-1)
    _convert_fails(ckpt, tiny_target, tmp_path, "max_position_embeddings -1")


def test_config_huge_layer_count_does_not_allocate(tmp_path, tiny_target):
    # fuzz finding: num_hidden_layers 2**31 with empty layer_types built a 2**31-entry list (OOM)
    ckpt = _checkpoint(tmp_path, num_hidden_layers=2**31, layer_types="")
    _convert_fails(ckpt, tiny_target, tmp_path, "num_hidden_layers")


@pytest.mark.parametrize("text", ["[1, 2]", '{"dflash_config": 5, "hidden_size": 64}', "[" * 100000, "\xff"])
def test_config_not_an_object(tmp_path, tiny_target, text):
    ckpt = _checkpoint(tmp_path)
    (ckpt / "config.json").write_text(text, encoding="latin-1")
    _convert_fails(ckpt, tiny_target, tmp_path, "not a valid DFlash config")


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_truncated_target_gguf_header(tmp_path, cut):
    import numpy as np
    from gguf import GGUFWriter

    full = tmp_path / "t.gguf"
    w = GGUFWriter(str(full), "llama")
    w.add_block_count(4)
    w.add_token_list([f"t{i}" for i in range(96)])
    w.add_tensor("token_embd.weight", np.zeros((96, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut_file = tmp_path / "cut.gguf"
    cut_file.write_bytes(full.read_bytes()[:cut])
    with pytest.raises(ValueError, match="cut.gguf"):
        read_gguf_header(cut_file)


# --- native loader findings --------------------------------------------------------------------


def test_drafter_with_only_sliding_layers_drafts_like_the_reference(tmp_path, smollm2_path):
    # fuzz seed finding: a drafter whose layers are all sliding aborted in propose (GGML_ASSERT
    # "tensor buffer not set": the full-attention mask was set although no layer read it)
    import numpy as np

    from pydflash import Drafter
    from pydflash.reference import TargetWeights
    from test_drafter_native import BLOCK, _build, nmse, random_context, reference_block

    gguf, ref = _build(tmp_path, "dflash2", smollm2_path, layer_types=("sliding_attention",) * 2)
    target = TargetWeights.from_gguf(smollm2_path, dtype=torch.float64)
    n_ctx, anchor = 30, 777
    feats = random_context(n_ctx, seed=4)
    with Drafter(gguf, smollm2_path, n_ctx=64, n_threads=1, exact_head=True) as d:
        d.inject(feats, np.arange(n_ctx))
        hidden, logits = d.forward(anchor, n_ctx, BLOCK)
        proposal = d.propose(anchor, n_ctx, BLOCK, temperature=0.0)
    ref_hidden, ref_logits = reference_block(ref, feats, np.arange(n_ctx), anchor, n_ctx, target)
    assert nmse(hidden, ref_hidden.numpy()) <= 1e-6
    assert nmse(logits, ref_logits.numpy()) <= 1e-6
    np.testing.assert_array_equal(proposal.tokens, ref.propose(ref_hidden, ref_logits, anchor).tokens.numpy())


@pytest.fixture(scope="module")
def smol_drafter(tmp_path_factory, smollm2_path) -> Path:
    from test_drafter_native import _build

    return _build(tmp_path_factory.mktemp("smol-drafter"), "dflash2", smollm2_path)[0]


def _edited_drafter_fails(smol_drafter, tmp_path, smollm2_path, key, value, vtype, needle):  # noqa: ANN001
    import gguf_edit
    import numpy as np

    import pydflash
    from pydflash import Drafter

    h = gguf_edit.load(smol_drafter)
    h.kv[key] = gguf_edit.Value(vtype, value)
    path = gguf_edit.save(h, tmp_path / "edited.gguf")
    with pytest.raises(pydflash.ModelFormatError, match=needle):
        Drafter(path, smollm2_path, n_ctx=16, n_threads=1)
    with Drafter(smol_drafter, smollm2_path, n_ctx=16, n_threads=1) as d:  # the process is fine
        d.inject(np.ones((2, d.info.n_target_layers * d.info.n_embd), np.float32), [0, 1])
        assert d.propose(3, 2).tokens.shape == (d.info.block_size - 1,)


@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), 0.0])
def test_drafter_norm_epsilon_not_positive(smol_drafter, tmp_path, smollm2_path, eps):
    # fuzz finding: a negative epsilon aborted the process in ggml (GGML_ASSERT(eps >= 0.0f) in rms_norm)
    import gguf_edit

    _edited_drafter_fails(smol_drafter, tmp_path, smollm2_path, "dflash.attention.layer_norm_rms_epsilon", eps,
                          gguf_edit.FLOAT32, "layer_norm_rms_epsilon")


@pytest.mark.parametrize("key,value,needle", [
    ("dflash.rope.freq_base", -1.0, "freq_base"),
    ("dflash.logit_scale", float("nan"), "logit_scale"),
    ("dflash.final_logit_softcapping", -3.0, "softcapping"),
])
def test_drafter_non_finite_scales(smol_drafter, tmp_path, smollm2_path, key, value, needle):
    import gguf_edit

    _edited_drafter_fails(smol_drafter, tmp_path, smollm2_path, key, value, gguf_edit.FLOAT32, needle)


@pytest.mark.parametrize("key,value,needle", [
    ("dflash.selector_rank", -1, "selector_rank"),
    ("dflash.selector_top_k", 100_000, "selector_top_k"),
])
def test_drafter_selector_and_head_sizes(smol_drafter, tmp_path, smollm2_path, key, value, needle):
    import gguf_edit

    _edited_drafter_fails(smol_drafter, tmp_path, smollm2_path, key, value, gguf_edit.INT32, needle)


def test_drafter_head_size_default_does_not_overflow(smol_drafter, tmp_path, smollm2_path):
    # fuzz finding: embedding_length INT32_MIN / head_count -1 (the default head size) raised
    # SIGFPE (UBSan: "division of -2147483648 by -1 cannot be represented in type 'int'")
    import gguf_edit

    import pydflash
    from pydflash import Drafter

    h = gguf_edit.load(smol_drafter)
    h.kv["dflash.embedding_length"] = gguf_edit.Value(gguf_edit.INT32, -2**31)
    h.kv["dflash.attention.head_count"] = gguf_edit.Value(gguf_edit.INT32, -1)
    del h.kv["dflash.attention.key_length"], h.kv["dflash.attention.value_length"]
    path = gguf_edit.save(h, tmp_path / "edited.gguf")
    with pytest.raises(pydflash.ModelFormatError, match="invalid drafter dimensions"):
        Drafter(path, smollm2_path, n_ctx=16, n_threads=1)
