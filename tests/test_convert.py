"""HF DFlash / DFlash2 -> GGUF: layout, round trips, tokenizer copy and validation.

Expected names, shapes, types and keys are written out literally here (from the spec's
section 3 tables), not taken from ``pydflash.formats.gguf_layout``, so a wrong table fails.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from pydflash.tools.upstream_server import free_port, post_json, wait_healthy
from fixtures_tiny import (
    REFERENCE_CONFIG,
    REFERENCE_HEADER,
    smollm2_drafter_config,
    tiny_config,
    write_checkpoint,
    write_hf_target_dir,
)
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from pydflash.formats import gguf_layout
from pydflash.formats.convert import convert, read_gguf_header, read_gguf_tensor
from pydflash.formats.convert_cli import main
from pydflash.reference.config import DFlashConfig

LAYER_TENSORS = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                 "ffn_down.weight"]
DFLASH2_LAYER_TENSORS = ["attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight"]
GLOBAL_TENSORS = ["fc.weight", "enc.output_norm.weight", "output_norm.weight"]
SELECTOR_TENSORS = ["selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight"]


def expected_names(n_layers: int, dflash2: bool) -> set[str]:
    per_layer = LAYER_TENSORS + (DFLASH2_LAYER_TENSORS if dflash2 else [])
    names = set(GLOBAL_TENSORS) | {f"blk.{i}.{t}" for i in range(n_layers) for t in per_layer}
    return names | (set(SELECTOR_TENSORS) if dflash2 else set())


def expected_type(name: str, outtype: str) -> QT:
    if name.endswith("_norm.weight") or name.endswith("conv_base"):
        return QT.F32
    if name == "fc.weight":
        return QT.BF16 if outtype == "bf16" else QT.F32
    return {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}[outtype]


def field_value(reader: GGUFReader, key: str):  # noqa: ANN201
    f = reader.fields[key]
    return f.contents(), [t for t in f.types]


def assert_no_leftovers(directory: Path, keep: set[str]) -> None:
    assert {p.name for p in directory.iterdir()} == keep, "temporary or partial output left behind"


# --- the full-size reference layout, planned from the header alone ------------------------------


def test_reference_header_maps_to_81_tensors() -> None:
    cfg = DFlashConfig.from_hf(json.loads(REFERENCE_CONFIG.read_text()))
    plan = gguf_layout.plan_from_header(cfg, json.loads(REFERENCE_HEADER.read_text()))
    assert len(plan) == 81
    shapes = {t.gguf_name: t.ggml_shape for t in plan}
    assert set(shapes) == expected_names(5, dflash2=True)
    H, F, V = 6656, 19968, 202048
    for i in range(5):
        assert shapes[f"blk.{i}.attn_norm.weight"] == (H,)
        assert shapes[f"blk.{i}.attn_q.weight"] == (H, 32 * 128)
        assert shapes[f"blk.{i}.attn_k.weight"] == (H, 8 * 128)
        assert shapes[f"blk.{i}.attn_v.weight"] == (H, 8 * 128)
        assert shapes[f"blk.{i}.attn_output.weight"] == (32 * 128, H)
        assert shapes[f"blk.{i}.attn_q_norm.weight"] == (128,)
        assert shapes[f"blk.{i}.attn_k_norm.weight"] == (128,)
        assert shapes[f"blk.{i}.ffn_gate.weight"] == (H, F)
        assert shapes[f"blk.{i}.ffn_up.weight"] == (H, F)
        assert shapes[f"blk.{i}.ffn_down.weight"] == (F, H)
        assert shapes[f"blk.{i}.attn_conv_base"] == (H, 2, 2)  # [H, T, 2]
        assert shapes[f"blk.{i}.ffn_conv_base"] == (H, 2, 2)
        assert shapes[f"blk.{i}.attn_conv_proj.weight"] == (H, 2 * 2 * (H // 16))  # [H, 2*T*G] = [6656, 1664]
        assert shapes[f"blk.{i}.ffn_conv_proj.weight"] == (H, 1664)
    assert shapes["fc.weight"] == (5 * H, H)
    assert shapes["enc.output_norm.weight"] == (H,) and shapes["output_norm.weight"] == (H,)
    assert shapes["selector_predecessor.weight"] == (256, V)
    assert shapes["selector_successor.weight"] == (256, V)
    assert shapes["selector_hidden.weight"] == (H, 256)
    for t in plan:
        assert gguf_layout.storage_type(t, "f16") == expected_type(t.gguf_name, "f16"), t.gguf_name

    meta = {kv.key: kv.value for kv in gguf_layout.drafter_metadata(cfg)}
    assert meta["dflash.target_layers"] == [2, 14, 26, 38, 50]
    assert meta["dflash.block_size"] == 16 and meta["dflash.selector_top_k"] == 16
    assert meta["dflash.attention.sliding_window"] == 2048 and meta["dflash.attention.causal"] is False


def test_q8_0_falls_back_for_rows_not_multiple_of_32() -> None:
    cfg = tiny_config(intermediate_size=48)
    plan = {t.gguf_name: t for t in gguf_layout.expected_tensors(cfg).values()}
    assert gguf_layout.storage_type(plan["blk.0.ffn_down.weight"], "q8_0") == QT.F16  # ne0 = 48
    assert gguf_layout.storage_type(plan["blk.0.ffn_up.weight"], "q8_0") == QT.Q8_0  # ne0 = 64
    assert gguf_layout.storage_type(plan["fc.weight"], "q8_0") == QT.F32


# --- tiny checkpoints through the converter ---------------------------------------------------------

TINY_KEYS = {
    "general.architecture": ("dflash", GGUFValueType.STRING),
    "dflash.block_count": (5, GGUFValueType.UINT32),
    "dflash.context_length": (4096, GGUFValueType.UINT32),
    "dflash.embedding_length": (64, GGUFValueType.UINT32),
    "dflash.feed_forward_length": (96, GGUFValueType.UINT32),
    "dflash.attention.head_count": (4, GGUFValueType.UINT32),
    "dflash.attention.head_count_kv": (2, GGUFValueType.UINT32),
    "dflash.attention.key_length": (16, GGUFValueType.UINT32),
    "dflash.attention.value_length": (16, GGUFValueType.UINT32),
    "dflash.attention.layer_norm_rms_epsilon": (pytest.approx(1e-5), GGUFValueType.FLOAT32),
    "dflash.rope.freq_base": (10000.0, GGUFValueType.FLOAT32),
    "dflash.attention.causal": (False, GGUFValueType.BOOL),
    "dflash.attention.sliding_window": (512, GGUFValueType.UINT32),
    "dflash.block_size": (4, GGUFValueType.UINT32),
    "dflash.logit_scale": (0.5, GGUFValueType.FLOAT32),
    "dflash.final_logit_softcapping": (3.0, GGUFValueType.FLOAT32),
    "dflash.embedding_scale": (1.5, GGUFValueType.FLOAT32),
    "tokenizer.ggml.mask_token_id": (95, GGUFValueType.UINT32),
}
TINY_DFLASH2_KEYS = {
    "dflash.conv_kernel_size": (2, GGUFValueType.UINT32),
    "dflash.conv_group_size": (8, GGUFValueType.UINT32),
    "dflash.selector_rank": (32, GGUFValueType.UINT32),
    "dflash.selector_top_k": (4, GGUFValueType.UINT32),
}
TINY_ARRAYS = {
    "dflash.target_layers": ([1, 3, 4], GGUFValueType.INT32),  # HF ids (0, 2, 3) + 1
    "dflash.attention.sliding_window_pattern": ([True] * 5, GGUFValueType.BOOL),
}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> tuple[Path, list[str]]:  # noqa: ANN001
    d = tmp_path_factory.mktemp("target")
    tokens = write_hf_target_dir(d, vocab_size=96, hidden_size=64, n_layers=4)
    return d, tokens


def check_keys(reader: GGUFReader, dflash2: bool) -> None:
    expected = {**TINY_KEYS, **(TINY_DFLASH2_KEYS if dflash2 else {})}
    for key, (value, vtype) in expected.items():
        got, types = field_value(reader, key)
        assert (got, types) == (value, [vtype]), key
    for key, (value, sub) in TINY_ARRAYS.items():
        got, types = field_value(reader, key)
        assert (got, types) == (value, [GGUFValueType.ARRAY, sub]), key
    written = {k for k in reader.fields if k.startswith("dflash.")}
    assert written == {k for k in (*expected, *TINY_ARRAYS) if k.startswith("dflash.")}


def check_tensors(reader: GGUFReader, written: dict[str, torch.Tensor], cfg: DFlashConfig, outtype: str) -> None:
    by_gguf = {t.gguf_name: t for t in gguf_layout.expected_tensors(cfg).values()}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == expected_names(cfg.num_hidden_layers, cfg.is_dflash2)
    for name, t in tensors.items():
        source = written[by_gguf[name].hf_name].to(torch.float32).numpy()
        assert t.tensor_type == expected_type(name, outtype), name
        assert [int(n) for n in t.shape] == list(reversed(source.shape)), name  # ggml ne = torch shape reversed
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(source.shape)
        if t.tensor_type in (QT.F32, QT.BF16):  # bf16 checkpoint values are exact in both
            np.testing.assert_array_equal(got, source, err_msg=name)
        elif t.tensor_type == QT.F16:
            np.testing.assert_allclose(got, source, rtol=1e-3, atol=1e-6, err_msg=name)
        else:  # Q8_0: half a quantisation step of each 32-block, plus the F16 rounding of its scale
            step = np.abs(source).reshape(-1, 32).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(got - source).reshape(-1, 32) <= 0.57 * step + 1e-7), name


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_dflash2_roundtrip(tmp_path: Path, tiny_target, outtype: str) -> None:  # noqa: ANN001
    cfg = tiny_config("dflash2")
    written = write_checkpoint(tmp_path / "draft", cfg, seed=1)
    names = set(written)
    header_names = set(json.loads(REFERENCE_HEADER.read_text()))
    assert names == header_names  # exactly the published naming (same 5 layers)

    out = convert(tmp_path / "draft", tmp_path / "out" / "d.gguf", target_model_dir=tiny_target[0],
                  outtype=outtype, progress=False)
    assert out == tmp_path / "out" / "d.gguf"
    assert_no_leftovers(out.parent, {"d.gguf"})
    reader = GGUFReader(str(out))
    check_keys(reader, dflash2=True)
    check_tensors(reader, written, cfg, outtype)
    assert len(reader.tensors) == 81
    file_types = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}
    assert field_value(reader, "general.file_type") == (file_types[outtype], [GGUFValueType.UINT32])

    # tokenizer from the HF directory: byte-level BPE as a gpt2 vocab
    tokens, _ = field_value(reader, "tokenizer.ggml.tokens")
    assert tokens == tiny_target[1]
    assert field_value(reader, "tokenizer.ggml.model")[0] == "gpt2"
    types, _ = field_value(reader, "tokenizer.ggml.token_type")
    assert types[:94] == [1] * 94 and types[94:] == [3, 3]
    assert field_value(reader, "tokenizer.ggml.bos_token_id")[0] == 94
    assert field_value(reader, "tokenizer.ggml.eos_token_id")[0] == 95
    assert field_value(reader, "tokenizer.ggml.merges")[0] == ["t 0", "t 1"]


def test_fast_header_reader_matches_gguf_reader(tmp_path: Path, tiny_target) -> None:  # noqa: ANN001
    """read_gguf_header / read_gguf_tensor (used for targets) agree with gguf-py's GGUFReader."""
    write_checkpoint(tmp_path / "draft", tiny_config(intermediate_size=48), seed=6)
    for outtype in ("q8_0", "bf16"):  # Q8_0 + its F16 fallback + F32, and BF16
        out = convert(tmp_path / "draft", tmp_path / f"{outtype}.gguf", target_model_dir=tiny_target[0],
                      outtype=outtype, progress=False)
        header = read_gguf_header(out)
        reader = GGUFReader(str(out))
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert list(header.kv) == list(fields)
        for key, f in fields.items():
            kv = header.kv[key]
            assert [kv.type] + ([kv.sub_type] if kv.sub_type is not None else []) == f.types, key
            value = kv.value.decode() if isinstance(kv.value, bytes) else kv.value
            if isinstance(value, list) and value and isinstance(value[0], bytes):
                value = [v.decode() for v in value]
            assert value == f.contents(), key
        assert list(header.tensors) == [t.name for t in reader.tensors]
        for t in reader.tensors:
            info = header.tensors[t.name]
            assert info.ne == tuple(int(n) for n in t.shape) and info.type == t.tensor_type
            assert info.offset == t.data_offset and info.nbytes == t.n_bytes
            expected = dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed(info.ne)))
            np.testing.assert_array_equal(read_gguf_tensor(header, t.name), expected)


def test_dflash_v1_roundtrip_and_name_variants(tmp_path: Path, tiny_target) -> None:  # noqa: ANN001
    cfg = tiny_config("dflash")
    hf = cfg.to_hf()
    hf["block_size"] = hf["dflash_config"].pop("block_size")  # v1 checkpoints keep block_size at the top
    hf["rope_theta"] = hf.pop("rope_parameters")["rope_theta"]
    written = write_checkpoint(tmp_path / "draft", hf, seed=2, rename={"fc.weight": "model.fc.weight"})
    written["fc.weight"] = written.pop("model.fc.weight")
    out = convert(tmp_path / "draft", tmp_path / "v1.gguf", target_model_dir=tiny_target[0], outtype="f16",
                  progress=False)
    reader = GGUFReader(str(out))
    check_keys(reader, dflash2=False)
    check_tensors(reader, written, cfg, "f16")
    assert len(reader.tensors) == 3 + 5 * 11


def test_smollm2_target_gguf(tmp_path: Path) -> None:
    from pydflash.fetch import registry as models

    target_path = models.path("smollm2-135m")
    cfg = smollm2_drafter_config()
    written = write_checkpoint(tmp_path / "draft", cfg, seed=3)
    out = convert(tmp_path / "draft", tmp_path / "smol.gguf", target_gguf=target_path, outtype="f16",
                  progress=False)
    reader = GGUFReader(str(out))
    target = GGUFReader(str(target_path))
    tok_keys = {k for k in target.fields if k.startswith("tokenizer.")}
    assert tok_keys <= set(reader.fields)
    for key in sorted(tok_keys):
        a, b = target.fields[key], reader.fields[key]
        assert a.types == b.types, key
        assert a.contents() == b.contents(), key
    assert field_value(reader, "tokenizer.ggml.mask_token_id") == (49151, [GGUFValueType.UINT32])
    assert field_value(reader, "dflash.target_layers")[0] == [2, 11, 28]
    assert field_value(reader, "dflash.embedding_length")[0] == 576
    assert field_value(reader, "dflash.rope.freq_base")[0] == 100000.0
    assert "dflash.attention.causal" in reader.fields and "dflash.attention.sliding_window" not in reader.fields
    check_tensors(reader, written, cfg, "f16")


def test_converted_drafter_runs_in_pinned_llama_server(tmp_path: Path) -> None:
    """End to end: the pinned llama-server loads the GGUF as DFlash2 next to SmolLM2 and drafts with it."""
    from pydflash.tools import upstream_binaries as _tools
    from pydflash.fetch import registry as models

    server = _tools.tool_path("llama-server")
    target = models.path("smollm2-135m")
    write_checkpoint(tmp_path / "draft", smollm2_drafter_config(), seed=4)
    draft = convert(tmp_path / "draft", tmp_path / "draft.gguf", target_gguf=target, outtype="q8_0", progress=False)
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(server), "-m", str(target), "--spec-type", "draft-dflash", "--spec-draft-model", str(draft),
             "--spec-draft-n-max", "3", "-c", "256", "-np", "1", "-t", "2", "--host", "127.0.0.1",
             "--port", str(port), "--fit", "off", "--no-warmup", "-v"], stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc, timeout=60)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}:\n" + log_path.read_text(errors="replace")[-3000:]) from None
        for temperature in (0.0, 0.8):
            out = post_json(base + "/completion", {"prompt": "The capital of France is", "n_predict": 6,
                                               "temperature": temperature, "seed": 1})
            assert out["content"] and out["timings"]["draft_n"] > 0, out
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log_text = log_path.read_text(errors="replace")
    assert "DFlash extract_layers = [2, 11, 28]" in log_text
    assert "DFlash2 conv kernel = 2, group = 16, selector rank = 32, top-k = 8" in log_text


def test_cli_main(tmp_path: Path, tiny_target, capsys) -> None:  # noqa: ANN001
    write_checkpoint(tmp_path / "draft", tiny_config(), seed=0)
    out = tmp_path / "cli.gguf"
    rc = main([str(tmp_path / "draft"), "--target-model-dir", str(tiny_target[0]), "-o", str(out),
               "--outtype", "bf16", "-q"])
    assert rc == 0 and out.is_file()
    assert capsys.readouterr().out.strip() == str(out)
    rc = main([str(tmp_path / "draft"), "--target-model-dir", str(tmp_path / "nowhere"), "-o",
               str(tmp_path / "x.gguf"), "-q"])
    assert rc == 1 and "config.json" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


# --- validation: each problem is named, nothing is written -------------------------------------------


def H(n: int) -> torch.Tensor:  # noqa: N802 - a random tensor of shape n
    return torch.randn(n, generator=torch.Generator().manual_seed(0))


BAD_CHECKPOINTS = {
    "missing": (dict(drop=["layers.3.mlp_conv.kernel_projection.weight"]),
                ["missing tensors", "layers.3.mlp_conv.kernel_projection.weight"]),
    "extra": (dict(extra={"layers.0.self_attn.q_proj.bias": H(64)}),
              ["unexpected tensors", "layers.0.self_attn.q_proj.bias"]),
    "shape": (dict(replace={"fc.weight": torch.zeros(64, 128)}),
              ["'fc.weight' has shape [64, 128]", "[64, 192]"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_rejected(tmp_path: Path, tiny_target, case: str) -> None:  # noqa: ANN001
    kwargs, needles = BAD_CHECKPOINTS[case]
    write_checkpoint(tmp_path / "draft", tiny_config(), **kwargs)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "d.gguf").write_bytes(b"previous")
    with pytest.raises(ValueError) as err:
        convert(tmp_path / "draft", out_dir / "d.gguf", target_model_dir=tiny_target[0], progress=False)
    for needle in needles:
        assert needle in str(err.value)
    assert (out_dir / "d.gguf").read_bytes() == b"previous"
    assert_no_leftovers(out_dir, {"d.gguf"})


BAD_TARGETS = {
    # (draft kind, target dir args, expected message parts)
    "hidden": ("dflash2", dict(vocab_size=96, hidden_size=128, n_layers=4),
               ["hidden_size 64 != target embedding_length 128"]),
    "layer-id": ("dflash2", dict(vocab_size=96, hidden_size=64, n_layers=3),
                 ["target_layer_ids [3] do not exist", "3 layers"]),
    "mask-id": ("dflash", dict(vocab_size=80, hidden_size=64, n_layers=4),
                ["mask_token_id 95 is outside the target vocabulary (80 tokens"]),
    "codebook-vocab": ("dflash2", dict(vocab_size=100, hidden_size=64, n_layers=4),
                       ["have 96 rows but", "100 tokens"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
def test_target_mismatch_is_rejected(tmp_path: Path, case: str) -> None:
    kind, target_args, needles = BAD_TARGETS[case]
    write_checkpoint(tmp_path / "draft", tiny_config(kind), seed=0)
    write_hf_target_dir(tmp_path / "target", **target_args)
    with pytest.raises(ValueError) as err:
        convert(tmp_path / "draft", tmp_path / "out.gguf", target_model_dir=tmp_path / "target", progress=False)
    for needle in needles:
        assert needle in str(err.value)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))


def test_hidden_mismatch_against_target_gguf(tmp_path: Path) -> None:
    from pydflash.fetch import registry as models

    write_checkpoint(tmp_path / "draft", tiny_config("dflash2", mask_token_id=5), seed=0)
    with pytest.raises(ValueError) as err:
        convert(tmp_path / "draft", tmp_path / "out.gguf", target_gguf=models.path("smollm2-135m"), progress=False)
    msg = str(err.value)
    assert "hidden_size 64 != target embedding_length 576 (llama.embedding_length)" in msg and "(llama)" in msg
    assert not (tmp_path / "out.gguf").exists()


def test_usage_errors(tmp_path: Path, tiny_target) -> None:  # noqa: ANN001
    write_checkpoint(tmp_path / "draft", tiny_config(), seed=0)
    with pytest.raises(ValueError, match="exactly one of"):
        convert(tmp_path / "draft", tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="outtype"):
        convert(tmp_path / "draft", tmp_path / "o.gguf", target_model_dir=tiny_target[0], outtype="q4_0")
    cfg = tiny_config(selector_top_k=8)  # K(K+1) = 72 > hidden 64: llama.cpp's lattice cannot hold it
    write_checkpoint(tmp_path / "d2", cfg, seed=0)
    with pytest.raises(ValueError, match="K\\*\\(K\\+1\\)"):
        convert(tmp_path / "d2", tmp_path / "o.gguf", target_model_dir=tiny_target[0])
    assert not (tmp_path / "o.gguf").exists()
