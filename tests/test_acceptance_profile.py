"""A drafter's measured acceptance profile (``dflash.acceptance_profile``): written into the GGUF
and read back by the native loader, and under ``auto`` n_max the price of the first probe: a
drafter whose profile says it never pays is not probed on a cold start (nothing drafted), one
whose profile says it pays is, and one without a profile is probed blind as before."""

from __future__ import annotations

import numpy as np
import pytest

import pydflash
from conftest import fix_costs
from pydflash import Drafter, Engine
from pydflash.drafters import SHIPPED
from pydflash.formats.drafter_profile import read_profile, write_profile
from test_speculative_loop import _tie_aware_equal

SMOL = SHIPPED[0].path
PROMPT = "def add(a, b):"


def test_profile_round_trips_through_the_gguf(tmp_path, smollm2_path):
    rates = [0.75, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35]
    out = write_profile(SMOL, tmp_path / "profiled.gguf", rates, 1234)
    got, drafts = read_profile(out)
    np.testing.assert_allclose(got, rates, rtol=1e-6)
    assert drafts == 1234
    with Drafter(out, smollm2_path, n_ctx=64, n_threads=1) as d:
        np.testing.assert_allclose(d.acceptance_profile, rates, rtol=1e-6)
        assert d.acceptance_profile_drafts == 1234
    bare = write_profile(out, tmp_path / "bare.gguf", None)  # the profile removed, all else kept
    assert read_profile(bare) is None
    with Drafter(bare, smollm2_path, n_ctx=64, n_threads=1) as d:
        assert d.acceptance_profile == () and d.info.block_size == 8
    with pytest.raises(ValueError, match="probabilities"):
        write_profile(SMOL, tmp_path / "bad.gguf", [0.5, 1.5])
    too_long = write_profile(SMOL, tmp_path / "long.gguf", [0.5] * 9)  # block 8: at most 7 positions
    with pytest.raises(pydflash.ModelFormatError, match="acceptance_profile"):
        Drafter(too_long, smollm2_path, n_ctx=64, n_threads=1)


@pytest.mark.parametrize("profile", ["never-pays", "always-accepted", "none"])
def test_cold_start_probes_only_what_the_profile_prices_in(tmp_path, smollm2_path, smollm2, monkeypatch, profile):
    monkeypatch.setenv("PYDFLASH_AUTOTUNE_CACHE", "0")  # a cold process: nothing learned or cached
    rates = {"never-pays": [0.0] * 7, "always-accepted": [1.0] * 7, "none": None}[profile]
    drafter = write_profile(SMOL, tmp_path / f"{profile}.gguf", rates, 100)
    tokens = smollm2.tokenize(PROMPT)
    want = smollm2.generate(tokens, max_tokens=48, temperature=0, ignore_eos=True).tokens
    with Engine(smollm2_path, drafter, n_ctx=512, n_threads=2, lookup=0) as engine:  # the drafter's policy
        assert engine.auto_n_max
        # a profile comes with one timed drafter block (the draft's price before the loop ran one)
        assert (engine.tuning()["t_draft_ms"][6] > 0) == (rates is not None)
        fix_costs(engine)  # the verdict must not depend on how busy the machine is
        r = engine.generate(tokens, max_tokens=48, temperature=0, ignore_eos=True)
    if profile == "never-pays":
        assert r.stats.n_drafted == 0 and set(engine.last_widths) == {0}
        assert r.tokens == want  # plain steps only: plain decoding's tokens
    else:  # priced in, or blind: the cold-start probe drafts
        assert r.stats.n_drafted > 0
        _tie_aware_equal(smollm2, tokens, want, r.tokens)
