"""Reduced draft vocabulary (d2t + own output.weight): file layout, drafting over the draft
vocabulary against the float64 reference restricted to it, losslessness of the loop, and
reproducible calibration counts.

The drafters are the tiny random SmolLM2-shaped ones of test_drafter_native (converted to F32
GGUFs next to the real SmolLM2 Q4_1 GGUF); the reduced ones are made from them by our writer.
"""

from __future__ import annotations

import collections
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import pydflash
from pydflash import Drafter, Engine
from pydflash.formats.convert import read_gguf_header
from pydflash.formats.draft_vocab import TokenCounts, calibrate, choose, coverage, write_reduced_drafter
from pydflash.reference import TargetWeights

from conftest import KERNELS, kernels_for
from test_drafter_native import BLOCK, VOCAB, _build, nmse, random_context, reference_block
from test_speculative_loop import CHI2_CRIT_001, _chi2, _tie_aware_equal, exact_second_token_distribution

N_DRAFT = 3000


@pytest.fixture(scope="module")
def smol_target(smollm2_path):
    return TargetWeights.from_gguf(smollm2_path, dtype=torch.float64)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, smollm2_path):
    """(full gguf, reduced gguf, reference, ids) for DFlash2 and v1."""
    out = {}
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(VOCAB, size=N_DRAFT, replace=False)).astype(np.int64)
    for kind, seed in (("dflash2", 0), ("dflash", 1)):
        tmp = tmp_path_factory.mktemp(f"vocab-{kind}")
        full, ref = _build(tmp, kind, smollm2_path, seed=seed)
        reduced = write_reduced_drafter(full, tmp / "reduced.gguf", smollm2_path, ids)
        out[kind] = (full, reduced, ref, ids)
    return out


def _restricted(logits: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
    """The reference's logits with every token outside the draft vocabulary at -inf."""
    masked = torch.full_like(logits, float("-inf"))
    masked[:, torch.from_numpy(ids)] = logits[:, torch.from_numpy(ids)]
    return masked


# --- file layout --------------------------------------------------------------------------


def test_d2t_round_trip(drafters, smollm2_path):
    full, reduced, _, ids = drafters["dflash2"]
    src, out, tgt = read_gguf_header(full), read_gguf_header(reduced), read_gguf_header(smollm2_path)
    d2t = out.tensors["d2t"]
    assert d2t.type.name == "I64" and d2t.ne == (N_DRAFT,)
    head_src = tgt.tensors.get("output.weight") or tgt.tensors["token_embd.weight"]
    head = out.tensors["output.weight"]
    assert head.type == head_src.type and head.ne == (head_src.ne[0], N_DRAFT)
    with open(reduced, "rb") as f:
        f.seek(d2t.offset)
        np.testing.assert_array_equal(np.frombuffer(f.read(8 * N_DRAFT), dtype="<i8"), ids)
        f.seek(head.offset)
        rows = f.read(head.nbytes)
    with open(smollm2_path, "rb") as f:  # the rows are the target head's own bytes at d2t
        f.seek(head_src.offset)
        all_rows = np.frombuffer(f.read(head_src.nbytes), dtype=np.uint8).reshape(head_src.ne[1], -1)
    assert rows == all_rows[ids].tobytes()
    # everything else is copied unchanged
    assert set(out.tensors) == set(src.tensors) | {"d2t", "output.weight"}
    assert {k: v.value for k, v in src.kv.items()}.items() <= {k: v.value for k, v in out.kv.items()}.items()
    with Drafter(reduced, smollm2_path, n_ctx=64, n_threads=1) as d:
        assert d.info.n_vocab == VOCAB and d.info.n_vocab_draft == N_DRAFT
        np.testing.assert_array_equal(d.draft_vocab, ids)
    with Drafter(full, smollm2_path, n_ctx=64, n_threads=1) as d:  # files without d2t: as before
        assert d.info.n_vocab_draft == VOCAB and d.draft_vocab is None


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_upstream_libllama_loads_the_reduced_drafter(kind, drafters):
    """The pinned llama.cpp's own dflash loader accepts the layout (d2t I64 [N], output.weight [H, N])."""
    from pydflash.formats.inspect_gguf import summarize

    full, reduced, _, _ = drafters[kind]
    a, b = summarize(full), summarize(reduced)
    assert b.arch == "dflash" and b.n_vocab == VOCAB
    assert b.n_params == a.n_params + N_DRAFT * 576 + N_DRAFT  # + its own head rows + d2t


def test_writer_refuses_bad_input(drafters, smollm2_path, qwen05_path, tmp_path):
    full, reduced, _, ids = drafters["dflash2"]
    with pytest.raises(ValueError, match="already has a reduced"):
        write_reduced_drafter(reduced, tmp_path / "x.gguf", smollm2_path, ids)
    with pytest.raises(ValueError, match="within 0"):
        write_reduced_drafter(full, tmp_path / "x.gguf", smollm2_path, [0, VOCAB])
    with pytest.raises(ValueError, match="duplicates"):
        write_reduced_drafter(full, tmp_path / "x.gguf", smollm2_path, [5, 5, 7])
    with pytest.raises(ValueError, match="another target"):
        write_reduced_drafter(full, tmp_path / "x.gguf", qwen05_path, ids)
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        write_reduced_drafter(smollm2_path, tmp_path / "x.gguf", smollm2_path, ids)
    assert not (tmp_path / "x.gguf").exists()


def _with_d2t(src: Path, dst: Path, d2t: np.ndarray | None, drop_head: bool = False) -> None:
    """Rewrite a reduced drafter with another d2t payload (bad files for the loader)."""
    import gguf as gg

    header = read_gguf_header(src)
    writer = gg.GGUFWriter(str(dst), "dflash")
    for name, kv in header.kv.items():
        if name != "general.architecture":
            writer.add_key_value(kv.key, kv.value, kv.type, kv.sub_type)
    raw = np.memmap(src, dtype=np.uint8, mode="r")
    for t in header.tensors.values():
        if (t.name == "output.weight" and drop_head) or (t.name == "d2t" and d2t is not None):
            continue
        byte_shape = tuple(reversed(t.ne[1:])) + (-1,)  # gguf-py derives the element shape from bytes
        writer.add_tensor(t.name, np.asarray(raw[t.offset:t.offset + t.nbytes]).reshape(byte_shape), raw_dtype=t.type)
    if d2t is not None:
        writer.add_tensor("d2t", d2t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_loader_refuses_bad_d2t(drafters, smollm2_path, tmp_path):
    _, reduced, _, ids = drafters["dflash"]
    cases = {
        "outside the target": ids.copy(),
        "duplicate": ids.copy(),
        "I64": ids.astype(np.int32),
    }
    cases["outside the target"][-1] = VOCAB + 5
    cases["duplicate"][1] = cases["duplicate"][0]
    for why, d2t in cases.items():
        bad = tmp_path / f"bad-{len(why)}.gguf"
        _with_d2t(reduced, bad, d2t)
        with pytest.raises(pydflash.ModelFormatError, match=why):
            Drafter(bad, smollm2_path, n_ctx=32)
    no_head = tmp_path / "no-head.gguf"
    _with_d2t(reduced, no_head, None, drop_head=True)
    Drafter(no_head, smollm2_path, n_ctx=32).close()  # loads: the head rows come from the target
    wrong_rows = tmp_path / "wrong-rows.gguf"
    _with_d2t(reduced, wrong_rows, ids[:-1])
    with pytest.raises(pydflash.ModelFormatError, match="output.weight"):
        Drafter(wrong_rows, smollm2_path, n_ctx=32)


# --- drafting over the draft vocabulary ---------------------------------------------------


def _block(path, target_path, kern, seed):
    """(hidden, logits) of one block after a random 30-row context, drafter loaded under ``kern``."""
    feats = random_context(30, seed=seed)
    with kernels_for(kern):
        d = Drafter(path, target_path, n_ctx=64, n_threads=1)
    with d:
        d.inject(feats, np.arange(30))
        return d.forward(777, 30)


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
@pytest.mark.parametrize("kern", KERNELS)
def test_logits_are_the_full_head_restricted(kind, drafters, smollm2_path, kern):
    """Same context, same block: the reduced head's logits are the full head's columns at d2t.
    stock: the same ggml kernels on the same rows, so exactly equal. default: the reduced head is
    the drafter's own Q8_0 tensor, on pydflash's kernels, the full one the target's mapped head,
    on ggml's (borrowed weights stay in the target's buffer): both round the activations to Q8_0
    (each its own way), so they differ by far less than that rounding (NMSE ~1e-5 against the
    exact head, test_drafter_native)."""
    full, reduced, _, ids = drafters[kind]
    got = {name: _block(path, smollm2_path, kern, seed=4) for name, path in (("full", full), ("reduced", reduced))}
    np.testing.assert_array_equal(got["reduced"][0], got["full"][0])
    assert got["reduced"][1].shape == (BLOCK, N_DRAFT)
    if kern == "stock":
        np.testing.assert_array_equal(got["reduced"][1], got["full"][1][:, ids])
    else:
        err = nmse(got["reduced"][1], got["full"][1][:, ids])
        print(f"restricted vs full head, default kernels: logits NMSE {err:.2e}")
        assert err <= 1e-6


@pytest.mark.parametrize("kern", KERNELS)
def test_a_drafter_without_its_head_rows_takes_the_same_rows_from_the_target(drafters, smollm2_path, tmp_path, kern):
    """d2t without output.weight (--head-from-target): the engine gathers the target head's rows
    at d2t at load time, the bytes write_reduced_drafter stores, so the logits are bit for bit
    those of the file that stores them."""
    full, reduced, _, ids = drafters["dflash2"]
    slim = write_reduced_drafter(full, tmp_path / "slim.gguf", smollm2_path, ids, store_head=False)
    assert "output.weight" not in read_gguf_header(slim).tensors
    assert slim.stat().st_size < reduced.stat().st_size
    with Drafter(slim, smollm2_path, n_ctx=32, n_threads=1) as d:
        assert d.draft_vocab.tolist() == ids.tolist()
    got = {name: _block(path, smollm2_path, kern, seed=5) for name, path in (("stored", reduced), ("from target", slim))}
    np.testing.assert_array_equal(got["from target"][0], got["stored"][0])
    np.testing.assert_array_equal(got["from target"][1], got["stored"][1])


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_greedy_proposals_match_restricted_reference(kind, drafters, smollm2_path, smol_target):
    """Greedy drafts are target ids from the draft vocabulary and equal the float64 reference's
    drafts with its logits restricted to that vocabulary (selector codebooks stay full-vocab)."""
    _, reduced, ref, ids = drafters[kind]
    rng = np.random.default_rng(7)
    feats = random_context(48, seed=6)
    with Drafter(reduced, smollm2_path, n_ctx=128, n_threads=1, exact_head=True) as d:
        for round_ in range(6):
            n_ctx, anchor = int(rng.integers(1, 48)), int(rng.integers(0, VOCAB))
            d.crop(0)
            d.inject(feats[:n_ctx], np.arange(n_ctx))
            got = d.propose(anchor, n_ctx, BLOCK)
            hid, log = reference_block(ref, feats[:n_ctx], np.arange(n_ctx), anchor, n_ctx, smol_target)
            want = ref.propose(hid, _restricted(log, ids), anchor)
            np.testing.assert_array_equal(got.tokens, want.tokens.numpy(), err_msg=f"round {round_}")
            assert np.isin(got.tokens, ids).all()
            if got.candidates is not None:
                assert np.isin(got.candidates, ids).all()


def test_sampled_v1_q_lives_on_the_draft_vocabulary(drafters, smollm2_path, smol_target):
    _, reduced, ref, ids = drafters["dflash"]
    feats = random_context(20, seed=2)
    with Drafter(reduced, smollm2_path, n_ctx=64, n_threads=1, seed=5, exact_head=True) as d:
        d.inject(feats, np.arange(20))
        prop = d.propose(99, 20, BLOCK, temperature=0.7)
    _, log = reference_block(ref, feats, np.arange(20), 99, 20, smol_target)
    want = torch.softmax(log[1:, torch.from_numpy(ids)] / 0.7, dim=-1).numpy()
    assert prop.q.shape == (BLOCK - 1, N_DRAFT)
    np.testing.assert_allclose(prop.q, want, rtol=1e-4, atol=1e-7)
    for j, token in enumerate(prop.tokens):
        assert prop.q[j, np.searchsorted(ids, token)] > 0


# --- the loop stays lossless --------------------------------------------------------------


@pytest.fixture(scope="module")
def calibrated(drafters, smollm2, smollm2_path, tmp_path_factory):
    """A reduced DFlash2 drafter made the real way: counts of SmolLM2's own greedy outputs."""
    counts = calibrate(smollm2, ["def add(a, b):", "The three laws of robotics are", "Once upon a time"],
                       max_tokens=32)
    eog = [t for t in range(smollm2.info.n_vocab) if smollm2.is_eog(t)]
    ids = choose(counts, 1024, always=eog)
    out = tmp_path_factory.mktemp("calibrated") / "reduced.gguf"
    return write_reduced_drafter(drafters["dflash2"][0], out, smollm2_path, ids), ids


@pytest.mark.parametrize("n_max", [3, 7])
def test_greedy_speculative_with_reduced_vocab_equals_plain(calibrated, smollm2_path, n_max):
    path, _ = calibrated
    with Engine(smollm2_path, path, n_ctx=512, n_threads=2) as e:
        for prompt in ("def add(a, b):", "1, 2, 3, 4,", "The capital of France is"):
            tokens = e.target.tokenize(prompt)
            plain = e.target.generate(tokens, max_tokens=24, temperature=0, ignore_eos=True)
            spec = e.generate(tokens, n_max=n_max, max_tokens=24, temperature=0, ignore_eos=True)
            _tie_aware_equal(e.target, tokens, plain.tokens, spec.tokens)
            assert spec.stats.n_drafted > 0


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_sampling_with_q_zero_outside_the_draft_vocab_preserves_p(kind, drafters, smollm2, smollm2_path, tmp_path):
    """T > 0: the draft vocabulary leaves out the target's 2nd and 4th most likely tokens, so
    they are only reachable through residual resampling; the output must still follow p."""
    opts, tokens, first, top, exact = exact_second_token_distribution(smollm2)
    left_out = {int(top[1]), int(top[3])}
    ids = np.array(sorted({int(t) for t in top} - left_out | set(range(0, VOCAB, 7)) - left_out))
    path = write_reduced_drafter(drafters[kind][0], tmp_path / "r.gguf", smollm2_path, ids)
    counts: dict[int, int] = {}
    with Engine(smollm2_path, path, n_ctx=256, n_threads=2) as e:
        for seed in range(300):
            out = e.generate(tokens, n_max=3, max_tokens=2, seed=seed, **opts).tokens
            if out[0] == first:
                counts[out[1]] = counts.get(out[1], 0) + 1
    assert sum(counts.values()) > 150
    assert left_out & set(counts), "tokens outside the draft vocabulary must still be produced"
    stat, df = _chi2(counts, exact)
    assert stat < CHI2_CRIT_001[df], (stat, df, counts, exact)


# --- calibration --------------------------------------------------------------------------


def test_calibration_counts_are_reproducible_and_match_plain_decoding(smollm2):
    prompts = ["def add(a, b):", "# quicksort in python\n"]
    a = calibrate(smollm2, prompts, max_tokens=20)
    b = calibrate(smollm2, prompts, max_tokens=20)
    np.testing.assert_array_equal(a.output, b.output)
    np.testing.assert_array_equal(a.prompt, b.prompt)
    # independent count: plain greedy decoding's tokens through collections.Counter
    want = collections.Counter()
    for p in prompts:
        want.update(smollm2.generate(p, max_tokens=20, temperature=0).tokens)
    assert {int(t): int(a.output[t]) for t in np.flatnonzero(a.output)} == dict(want)
    cov = coverage(a, [1, 5, 10_000])
    top1 = max(want.values()) / sum(want.values())
    top5 = sum(sorted(want.values())[-5:]) / sum(want.values())
    assert cov[1] == pytest.approx(top1) and cov[5] == pytest.approx(top5) and cov[10_000] == 1.0
    assert coverage(b, [1, 5, 10_000]) == cov


def test_choose_ranks_outputs_then_prompt_tokens_and_forces_eog():
    counts = TokenCounts(output=np.array([0, 5, 0, 9, 1, 0], dtype=np.int64),
                         prompt=np.array([3, 0, 0, 0, 0, 7], dtype=np.int64))
    np.testing.assert_array_equal(choose(counts, 2), [1, 3])
    np.testing.assert_array_equal(choose(counts, 4), [1, 3, 4, 5])  # then the most-fed prompt token
    np.testing.assert_array_equal(choose(counts, 3, always=[2]), [1, 2, 3])
    with pytest.raises(ValueError):
        choose(counts, 0)
    with pytest.raises(ValueError):
        choose(counts, 2, always=[0, 2, 4])


def test_cli_reports_coverage_and_writes_the_drafter(drafters, smollm2_path, tmp_path, capsys):
    from pydflash.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": "Hello"}) + "\n")
    out = tmp_path / "cli.gguf"
    rc = main(["draft-vocab", str(drafters["dflash2"][0]), str(out), "--target", str(smollm2_path), "--prompts",
               str(prompts), "--n", "512", "--max-tokens", "8", "--coverage-at", "16,64", "-t", "2", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 2 and report["output_tokens"] == 16 and set(report["coverage"]) == {"16", "64", "512"}
    assert report["coverage"]["512"] == 1.0
    with Drafter(out, smollm2_path, n_ctx=32, n_threads=1) as d:
        assert d.info.n_vocab_draft == 512
    assert main(["draft-vocab", str(drafters["dflash2"][0]), "--target", str(smollm2_path),
                 "--prompts", str(tmp_path / "missing.jsonl")]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["draft-vocab", str(tmp_path / "nope.gguf"), "--target", str(smollm2_path), "--prompts",
                 str(prompts)]) == 1
    assert "drafter" in capsys.readouterr().err
