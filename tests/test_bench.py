"""``pydflash bench`` and ``pydflash profile`` end to end on SmolLM2 with a tiny random drafter.

References: the shipped llama-server (its greedy tokens must equal our plain decoding's), and the
per-sample numbers the reports are aggregated from (recomputed here). The end-to-end run pins
ggml's stock kernels (PYDFLASH_KERNELS=0), so that llama-server's tokens are ours bit for bit; the
same comparison with the default kernels, tie-aware, is test_generate's (same model, same server)."""

from __future__ import annotations

import json
import statistics

import pytest

from pydflash.fetch import prompt_sets as prompts
from pydflash.cli import main as cli
from pydflash.formats.convert import convert
from fixtures_tiny import smollm2_drafter_config, write_checkpoint


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("bench")
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=4), seed=11)
    return convert(tmp / "hf", tmp / "drafter.gguf", target_gguf=smollm2_path, outtype="f16", progress=False)


def test_humaneval_prompts_load_from_the_pinned_wheel():
    ps = prompts.load("humaneval")
    assert len(ps) == 164 and ps[0].id == "HumanEval/0" and ps[-1].id == "HumanEval/163"
    assert ps[2].text.startswith("\n\ndef truncate_number") and not ps[2].is_chat
    assert [p.id for p in prompts.load("humaneval", limit=2, offset=10)] == ["HumanEval/10", "HumanEval/11"]


def test_gsm_symbolic_prompts_are_deterministic_chats():
    a, b = prompts.load("gsm_symbolic", limit=3), prompts.load("gsm_symbolic", limit=3)
    assert a == b and all(p.is_chat and p.messages[0]["role"] == "user" for p in a)
    assert "final answer" in a[0].messages[0]["content"]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": ""}', "non-empty"), ("[1, 2]", "expected an object"), ("{oops", "not JSON"),
    ('{"messages": [{"role": "user"}]}', "messages"),
])
def test_bad_prompt_files_are_clear_errors(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        prompts.load(str(f))
    with pytest.raises(ValueError, match="unknown prompt source"):
        prompts.load("mbpp")
    with pytest.raises(FileNotFoundError):
        prompts.load(str(tmp_path / "missing.jsonl"))


def test_bench_end_to_end(tmp_path, smollm2_path, drafter, capsys, monkeypatch):
    monkeypatch.setenv("PYDFLASH_KERNELS", "0")  # our modes on ggml's kernels: bit for bit llama-server's
    out = tmp_path / "out"
    garbage = tmp_path / "not-a-model.gguf"
    garbage.write_bytes(b"GGUF" + b"\0" * 60)  # upstream draft-simple cannot load it: that mode fails alone
    rc = cli(["bench", "-m", str(smollm2_path), "-md", str(drafter), "--prompts", "humaneval", "--limit", "2",
              "-n", "12", "--n-max", "1,3", "--ignore-eos", "-t", "2", "-c", "512",
              "--draft-simple", str(garbage), "-o", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 1000
    summary = report["summary"]
    assert set(summary) == {"plain", "dflash-n1", "dflash-n3", "dflash-auto", "upstream-plain",
                            "upstream-dflash-n1", "upstream-dflash-n3"}
    assert set(report["failed"]) == {"upstream-simple-n4"}  # reported with its reason; the run went on
    assert "exited" in report["failed"]["upstream-simple-n4"]
    assert all(f"| {name} |" in md for name in summary) and "upstream-simple-n4" in md

    samples = report["samples"]
    assert all(s["n_tokens"] == 12 for s in samples) and len(samples) == 2 * len(summary)
    for name, entry in summary.items():  # aggregates recomputed from the samples
        rows = [s for s in samples if s["mode"] == name]
        assert entry["tokens"] == sum(s["n_tokens"] for s in rows)
        assert entry["tok_s_median"] == pytest.approx(statistics.median(s["n_tokens"] / s["decode_s"] for s in rows), rel=1e-2)
        plain = {s["prompt_id"]: s["n_tokens"] / s["decode_s"] for s in samples if s["mode"] == "plain"}
        ratio = statistics.median(s["n_tokens"] / s["decode_s"] / plain[s["prompt_id"]] for s in rows)
        assert entry["speedup_vs_plain"] == pytest.approx(ratio, rel=1e-2)
    assert summary["dflash-n3"]["drafted"] > 0 and 0 < summary["dflash-n3"]["draft_share"] < 1
    assert summary["upstream-dflash-n1"]["drafted"] > 0
    assert report["costs"] and len(report["costs"]["verify"]) == 4

    # independent reference: upstream llama-server's greedy tokens equal our plain decoding's, and
    # speculative modes (ours and upstream's) keep the target's output
    assert summary["upstream-plain"]["same_tokens_as_plain"] == "2/2"
    assert summary["dflash-n3"]["same_tokens_as_plain"] == "2/2"
    assert "pydflash bench" in capsys.readouterr().out


def test_bench_bad_arguments_are_messages(smollm2_path, capsys):
    assert cli(["bench", "-m", str(smollm2_path), "--n-max", "0"]) == 2
    assert cli(["bench", "-m", str(smollm2_path), "-md", "/nonexistent.gguf"]) == 2
    assert cli(["bench", "-m", str(smollm2_path), "--n-max", "x"]) == 2
    err = capsys.readouterr().err
    assert "must be >= 1" in err and "drafter not found" in err and "comma-separated" in err


def test_profile_reports_categories_and_a_verdict(tmp_path, smollm2_path, drafter):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "category": "code", "prompt": "def add(a, b):"},
        {"id": "b", "category": "code", "prompt": "import os\n"},
        {"id": "c", "category": "chat", "messages": [{"role": "user", "content": "Say hi."}]},
    ]) + "\n")
    out = tmp_path / "prof"
    assert cli(["profile", "--prompts", str(f), "-m", str(smollm2_path), "-md", str(drafter), "-n", "12", "-t", "2",
                "-c", "512", "-o", str(out)]) == 0
    report = json.loads((out / "profile.json").read_text())
    assert [r["id"] for r in report["prompts"]] == ["a", "b", "c"]
    assert set(report["categories"]) == {"code", "chat"}
    code = [r for r in report["prompts"] if r["category"] == "code"]
    assert report["categories"]["code"]["tokens"] == sum(r["tokens"] for r in code)
    assert report["categories"]["code"]["tau"] == pytest.approx(
        sum(r["tokens"] for r in code) / sum(r["steps"] for r in code), abs=1e-3)
    # a random drafter is (almost) never accepted: nothing can pay
    assert report["best_n_max"] == 0 and "does not pay" in report["verdict"]
    assert report["expected_speedup_by_n_max"][0] == 1.0 and max(report["expected_speedup_by_n_max"][1:]) < 1.0
    assert (out / "profile.png").exists() and "Verdict" in (out / "profile.md").read_text()
