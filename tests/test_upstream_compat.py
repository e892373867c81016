"""Our drafter GGUFs are accepted by the pinned upstream llama.cpp, and our quantizer's output is
byte-identical to upstream ``llama-quantize``'s."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType

import pydflash
from pydflash.formats import quantize
from pydflash.tools.upstream_binaries import tool_path
from pydflash.formats.convert import convert
from pydflash.formats.inspect_gguf import summarize
from fixtures_tiny import smollm2_drafter_config, write_checkpoint


@pytest.fixture(scope="module", params=["dflash2", "dflash"])
def drafter_f16(request, tmp_path_factory, smollm2_path):
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    overrides = {} if kind == "dflash2" else dict(conv_kernel_size=None, conv_group_size=None,
                                                   selector_rank=None, selector_top_k=None)
    config = smollm2_drafter_config(num_hidden_layers=2, intermediate_size=512, **overrides)
    write_checkpoint(tmp / "hf", config)
    out = convert(tmp / "hf", tmp / "drafter-f16.gguf", target_gguf=smollm2_path, outtype="f16", progress=False)
    return config, out


def test_libllama_loads_our_drafter_as_dflash(drafter_f16):
    config, path = drafter_f16
    s = summarize(path)
    assert s.arch == "dflash"
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv) == (
        config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
    assert s.n_vocab == 49152
    assert s.token_mask == config.mask_token_id
    assert s.target_layers == tuple(i + 1 for i in config.target_layer_ids)
    assert s.selector_top_k == (config.selector_top_k or 0)


def _tensors(path):
    reader = GGUFReader(str(path))
    return {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in reader.tensors}


def test_our_q4_k_m_is_byte_identical_to_llama_quantize(drafter_f16, tmp_path):
    _, path = drafter_f16
    ours = quantize.quantize(path, tmp_path / "ours.gguf", "Q4_K_M", n_threads=2, progress=False)
    upstream = tmp_path / "upstream.gguf"
    subprocess.run([str(tool_path("llama-quantize")), str(path), str(upstream), "Q4_K_M", "2"],
                   check=True, capture_output=True, timeout=600)
    a, b = _tensors(ours), _tensors(upstream)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], f"{name}: {a[name][0]!r} vs {b[name][0]!r}"
        assert a[name][1] == b[name][1], f"{name}: data differs"
    # the rules really quantized something, and kept the norms in F32
    types = {name: t for name, (t, _) in a.items()}
    k_quants = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
    assert types["blk.0.ffn_down.weight"] in k_quants  # rows of 512: K-quants apply
    assert types["blk.0.attn_q.weight"] not in (GGMLQuantizationType.F16, GGMLQuantizationType.F32)
    assert types["output_norm.weight"] == GGMLQuantizationType.F32
    assert GGUFReader(str(ours)).get_field("general.file_type").contents() == 15  # MOSTLY_Q4_K_M
    assert summarize(ours).arch == "dflash"


def test_quantizer_refuses_quantized_input(drafter_f16, tmp_path):
    _, path = drafter_f16
    q8 = quantize.quantize(path, tmp_path / "q8.gguf", "Q8_0", progress=False)
    with pytest.raises(pydflash.InvalidArgumentError, match="already quantized"):
        quantize.quantize(q8, tmp_path / "again.gguf", "Q4_K_M")
    quantize.quantize(q8, tmp_path / "again.gguf", "Q4_K_M", allow_requantize=True, progress=False)
    assert not (tmp_path / "again.gguf.partial").exists()


def test_quantizer_bad_arguments(drafter_f16, tmp_path):
    _, path = drafter_f16
    with pytest.raises(pydflash.InvalidArgumentError, match="unknown quantization type"):
        quantize.quantize(path, tmp_path / "x.gguf", "Q3_XYZ")
    with pytest.raises(pydflash.ModelNotFoundError):
        quantize.quantize(tmp_path / "missing.gguf", tmp_path / "x.gguf", "Q8_0")
    assert not (tmp_path / "x.gguf").exists()
