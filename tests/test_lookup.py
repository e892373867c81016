"""Drafts from the sequence's own history (lookup): verified like any draft, so greedy output is
plain decoding's; they carry the acceptance where the text repeats itself.

The drafter here is a random one (its blocks are almost never accepted), so what is accepted comes
from the history; the reference is the target's own plain decoding, compared tie-aware.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pydflash import Engine, errors
from pydflash.formats.convert import convert
from fixtures_tiny import smollm2_drafter_config, write_checkpoint
from test_speculative_loop import _tie_aware_equal

# code that repeats itself: SmolLM2 goes on with " compute(alpha, beta, gamma)" and more
REPEATING = ("x1 = compute(alpha, beta, gamma)\nx2 = compute(alpha, beta, gamma)\n"
             "x3 = compute(alpha, beta, gamma)\nx4 =")
PROSE = "The three laws of robotics are"
N = 48


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("lookup")
    write_checkpoint(tmp / "hf", smollm2_drafter_config(block_size=8), seed=3)
    return convert(tmp / "hf", tmp / "drafter.gguf", target_gguf=smollm2_path, outtype="f32", progress=False)


def _plain(target, tokens):
    return target.generate(tokens, max_tokens=N, temperature=0, ignore_eos=True).tokens


def _checked_greedy(engine):
    """(prompt, stats) of each prompt's greedy generation, its tokens checked tie-aware against
    the target's own plain decoding."""
    for prompt in (REPEATING, PROSE):
        tokens = engine.target.tokenize(prompt)
        plain = _plain(engine.target, tokens)
        spec = engine.generate(tokens, max_tokens=N, temperature=0, ignore_eos=True)
        _tie_aware_equal(engine.target, tokens, plain, spec.tokens)
        yield prompt, spec.stats


@pytest.mark.parametrize("n_max", [3, 7])
def test_lookup_drafts_keep_greedy_output_and_get_accepted(smollm2_path, drafter_path, n_max):
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, n_max=n_max, lookup=2) as engine:
        for prompt, st in _checked_greedy(engine):
            assert 0 <= st.n_lookup_accepted <= st.n_lookup_drafted <= st.n_drafted <= n_max * st.n_verify_steps
            assert st.n_lookup_accepted <= st.n_accepted
            if prompt is REPEATING:  # the repeated lines are drafted from the history and accepted
                assert st.n_lookup_accepted >= 6


def test_history_drafts_are_not_bounded_by_the_drafters_block(smollm2_path, drafter_path):
    """Under auto the drafter drafts at most block_size - 1 = 7 tokens; a repeat in the history is
    verified more at a time (as without a drafter) once its measured acceptance prices it so."""
    prompt = "def f():\n    return [" + "1, 2, 3, " * 6  # SmolLM2 goes on with "1, 2, 3, " over and over
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, lookup=2) as engine:
        tokens = engine.target.tokenize(prompt)
        plain = engine.target.generate(tokens, max_tokens=96, temperature=0, ignore_eos=True).tokens
        spec = engine.generate(tokens, max_tokens=96, temperature=0, ignore_eos=True)
        _tie_aware_equal(engine.target, tokens, plain, spec.tokens)
        assert spec.stats.n_lookup_accepted >= 48
        assert max(engine.last_widths) > 7


def test_stale_row_costs_do_not_keep_history_drafts_off(smollm2_path, monkeypatch):
    """Row costs loaded from an earlier process (the tuning cache) priced from a few bad samples
    (one cache held 4 rows at 1,185 ms) are bounded by what the loop measures now, so history
    drafts still run where the text repeats; output stays plain decoding's."""
    monkeypatch.setenv("PYDFLASH_AUTOTUNE_CACHE", "0")
    with Engine(smollm2_path, None, n_ctx=512, n_threads=2, lookup=2) as engine:
        engine.scheduler.set_tuning({"t_rows_ms": [7.0, 47.0, 113.0, 1185.0, 40.0, 91.0, 680.0, 900.0]})
        tokens = engine.target.tokenize(REPEATING)
        spec = engine.generate(tokens, max_tokens=N, temperature=0, ignore_eos=True)
        _tie_aware_equal(engine.target, tokens, _plain(engine.target, tokens), spec.tokens)
        assert spec.stats.n_lookup_accepted > 0


def test_lookup_off_sampling_and_auto(smollm2_path, drafter_path):
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, n_max=7, lookup=0) as engine:
        tokens = engine.target.tokenize(REPEATING)
        plain = _plain(engine.target, tokens)
        off = engine.generate(tokens, max_tokens=N, temperature=0, ignore_eos=True)
        _tie_aware_equal(engine.target, tokens, plain, off.tokens)
        assert off.stats.n_lookup_drafted == 0
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, n_max=7, lookup=2) as engine:
        # sampled sequences draft from the drafter only (its q is what rejection sampling needs)
        sampled = engine.generate(tokens, max_tokens=N, temperature=0.8, seed=1, ignore_eos=True)
        assert sampled.stats.n_lookup_drafted == 0 and sampled.stats.n_generated == N
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, lookup=2) as engine:  # auto width
        spec = engine.generate(tokens, max_tokens=N, temperature=0, ignore_eos=True)
        _tie_aware_equal(engine.target, tokens, plain, spec.tokens)
        assert spec.stats.n_lookup_accepted <= spec.stats.n_lookup_drafted


def test_lookup_in_a_batch_with_drafter_blocks(smollm2_path, smollm2, drafter_path):
    """Sequences drafting from their history and from the drafter share one verify batch (short
    outputs: batched plain decoding itself drifts from single-sequence decoding on near-ties)."""
    prompts = [REPEATING, "1, 2, 3,"]
    with Engine(smollm2_path, drafter_path, n_ctx=512, n_threads=2, n_max=7, n_seq_max=2, lookup=2) as engine:
        results = engine.generate_batch(prompts, max_tokens=10, temperature=0, ignore_eos=True)
    for prompt, r in zip(prompts, results):
        tokens = smollm2.tokenize(prompt)
        plain = smollm2.generate(tokens, max_tokens=10, temperature=0, ignore_eos=True).tokens
        _tie_aware_equal(smollm2, tokens, plain, r.tokens)
    assert results[0].stats.n_lookup_accepted > 0


@pytest.mark.parametrize("bad", [-1, 5, True, 2.0, "2"])
def test_bad_lookup_values_are_refused(smollm2_path, bad):
    with pytest.raises(errors.InvalidArgumentError, match="lookup"):
        Engine(smollm2_path, None, n_ctx=64, n_threads=1, lookup=bad)


def test_cli_refuses_a_bad_lookup():
    r = subprocess.run([sys.executable, "-m", "pydflash.cli", "generate", "--draft-lookup", "9", "-p", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--draft-lookup" in r.stderr


@pytest.mark.parametrize("n_max", [4, "auto"])
def test_history_drafts_without_a_drafter(smollm2_path, n_max):
    """A target loaded without a drafter, asked for history drafts (lookup=2): they are the only
    drafts, greedy output stays plain decoding's, sampled requests decode plainly."""
    with Engine(smollm2_path, None, n_ctx=512, n_threads=2, n_max=n_max, lookup=2) as engine:
        for prompt, st in _checked_greedy(engine):
            assert st.n_drafted == st.n_lookup_drafted and st.n_accepted == st.n_lookup_accepted
            if n_max == 4:
                assert st.n_drafted <= 4 * st.n_verify_steps
            if prompt is REPEATING:  # auto drafts where the measured costs price it to pay
                assert st.n_lookup_accepted >= 6 if n_max == 4 else st.n_lookup_drafted > 0
        tokens = engine.target.tokenize(REPEATING)
        sampled = engine.generate(tokens, max_tokens=N, temperature=0.8, seed=1, ignore_eos=True)
        assert sampled.stats.n_drafted == 0 and sampled.stats.n_generated == N


def test_no_drafter_decodes_plainly_unless_asked(smollm2_path):
    with Engine(smollm2_path, None, n_ctx=512, n_threads=2) as engine:  # lookup=None: 0 without a drafter
        r = engine.generate(engine.target.tokenize(REPEATING), max_tokens=N, temperature=0, ignore_eos=True)
        assert r.stats.n_drafted == 0 and r.stats.n_lookup_drafted == 0 and r.stats.n_generated == N


def test_cli_no_draft_is_plain_and_draft_lookup_turns_history_drafts_on(smollm2_path):
    base = [sys.executable, "-m", "pydflash.cli", "generate", "-m", str(smollm2_path), "-p", REPEATING, "-n", "32",
            "--temp", "0", "-t", "2", "-c", "512", "--no-draft", "--no-stream"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=300)
    history = subprocess.run(base + ["--draft-lookup", "2"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and history.returncode == 0, plain.stderr + history.stderr
    assert "from the history" not in plain.stderr
    assert "no drafter; from the history: drafted" in history.stderr
    assert history.stdout == plain.stdout  # the repeated lines are no near-ties
