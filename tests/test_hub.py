"""Models from the Hugging Face Hub (``pydflash.fetch.hub``, ``-hf`` / ``-hfd``), with no real Hub.

Two ways in, both through ``huggingface_hub`` itself:

* a Hugging Face cache laid out by hand (``models--ORG--NAME/{blobs,snapshots/<commit>,refs/main}``)
  holding the real SmolLM2 GGUF and a random DFlash2 checkpoint in the published naming, used
  with ``HF_HUB_OFFLINE=1``: generation with ``-hf``/``-hfd`` equals generation with the local
  files, the drafter is converted once (equal to ``convert()`` of the same checkpoint) and reused;
* a local HTTP server answering the Hub endpoints huggingface_hub calls (model info, file HEAD and
  GET with ETag / X-Repo-Commit / Content-Length / Range), set with ``HF_ENDPOINT``: a connection
  dropped mid-file is resumed with a Range request, a process killed mid-file leaves nothing a
  later run would load, a missing repo is 404, a gated one 401/403.

Every CLI failure must be one line on stderr and exit status 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pydflash import errors
from pydflash.fetch import hub

pytest.importorskip("huggingface_hub")

GGUF_REPO = "acme/SmolLM2-135M-Instruct-GGUF"
DRAFT_REPO = "acme/SmolLM2-135M-DFlash2"
COMMIT_GGUF = "1" * 40
COMMIT_DRAFT = "2" * 40
PROMPT = "The capital of France is"
_LLAMA_ENV = ("LLAMA_CACHE", "LLAMA_OFFLINE", "LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE", "LLAMA_ARG_SPEC_DRAFT_HF_REPO")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _cache_repo(hf_home: Path, repo_id: str, commit: str, files: dict[str, Path]) -> Path:
    """``files`` (repo path -> local file) as huggingface_hub lays a downloaded snapshot out: blobs named
    by their sha256 (LFS) or git sha1, snapshot entries as relative symlinks, refs/main."""
    folder = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    for name, src in files.items():
        if name.endswith((".gguf", ".safetensors")):  # LFS files: named by their sha256
            h = hashlib.sha256()
            with open(src, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            blob_name = h.hexdigest()
        else:
            blob_name = _git_sha1(src.read_bytes())
        blob = folder / "blobs" / blob_name
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(src.resolve())
        entry = snapshot / name
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.symlink_to(os.path.relpath(blob, entry.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def _run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pydflash.cli", *args], env)


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    """A CLI failure as required: exit status 1, no traceback, one line on stderr."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pydflash: error: "), proc.stderr
    return lines[0]


# --- choosing files (llama.cpp's rules), no network ----------------------------------------------------------


def test_parse_references() -> None:
    assert hub.parse("hf:acme/X-GGUF:q4_k_m") == hub.HubRef("acme/X-GGUF", "q4_k_m")
    assert hub.parse("acme/X@v1.0:Q8_0") == hub.HubRef("acme/X", "Q8_0", revision="v1.0")
    assert hub.parse("hf:acme/X/sub/x-Q4_0.gguf") == hub.HubRef("acme/X", filename="sub/x-Q4_0.gguf")
    assert hub.parse("acme/X:Q4_0", filename="x.gguf") == hub.HubRef("acme/X", filename="x.gguf")
    for bad in ("hf:acme", "hf:/x", "acme/x:Q4 K", "hf:acme/x/f.gguf:Q4_0", ""):
        with pytest.raises(errors.InvalidArgumentError):
            hub.parse(bad)


def test_pick_gguf_as_llama_cpp() -> None:
    files = ["README.md", "m-f16.gguf", "m-q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-Q4_K_M.gguf",
             "m-Q6_K-00002-of-00003.gguf", "m-Q6_K-00001-of-00003.gguf", "m-Q6_K-00003-of-00003.gguf",
             "dflash-m-Q8_0.gguf", "imatrix.gguf"]
    assert hub.pick_gguf(files) == ["m-Q4_K_M.gguf"]                      # default Q4_K_M
    assert hub.pick_gguf([f for f in files if "Q4_K_M" not in f]) == ["m-q8_0.gguf"]   # then Q8_0
    assert hub.pick_gguf(["b-f16.gguf", "a-bf16.gguf", "mmproj-a.gguf"]) == ["a-bf16.gguf"]  # then the first model
    assert hub.pick_gguf(files, "Q8_0") == ["m-q8_0.gguf"]               # case-insensitive, sidecars left out
    assert hub.pick_gguf(files, "q6_k") == [f"m-Q6_K-0000{i}-of-00003.gguf" for i in (1, 2, 3)]  # every part
    assert hub.pick_gguf(files, "Q8_0", drafter=True) == ["dflash-m-Q8_0.gguf"]  # a drafter takes the dflash- file
    assert hub.pick_gguf(files, "F16", drafter=True) == ["m-f16.gguf"]
    with pytest.raises(errors.HubFileNotFoundError, match=r"no GGUF file matching 'Q2_K'; GGUF files: .*m-q8_0.gguf"):
        hub.pick_gguf(files, "Q2_K", repo="acme/m")
    with pytest.raises(errors.HubFileNotFoundError, match="lacks part"):
        hub.pick_gguf(["m-Q4_0-00001-of-00002.gguf"], "Q4_0")
    with pytest.raises(errors.HubFileNotFoundError, match="has no GGUF files"):
        hub.pick_gguf(["model.safetensors"])


def test_pick_sidecar_as_llama_cpp() -> None:
    files = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "dflash-m-Q8_0.gguf", "dflash-m-Q4_K_M.gguf", "dflash-m-F16.gguf",
             "sub/dflash-m-Q4_K_M.gguf"]
    assert hub.pick_sidecar(files, "m-Q4_K_M.gguf") == "dflash-m-Q4_K_M.gguf"        # the model's bits
    assert hub.pick_sidecar(files, "m-Q8_0.gguf", "q8_0") == "dflash-m-Q8_0.gguf"    # the tag's
    assert hub.pick_sidecar(["m-Q5_K_M.gguf", "dflash-m-F16.gguf", "dflash-m-Q4_0.gguf"], "m-Q5_K_M.gguf") \
        == "dflash-m-Q4_0.gguf"                                                       # the closest bits
    assert hub.pick_sidecar(["a/m-Q5_K_M.gguf", "dflash-m-Q5_K_M.gguf", "a/dflash-m-F16.gguf", "b/dflash-m.gguf"],
                            "a/m-Q5_K_M.gguf") == "a/dflash-m-F16.gguf"              # the model's directory first
    assert hub.pick_sidecar(["m-Q4_K_M.gguf", "mmproj-m.gguf"], "m-Q4_K_M.gguf") is None


def test_missing_huggingface_hub_is_one_clear_error(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    with pytest.raises(errors.HubNotInstalledError, match=r"pip install 'pydflash\[hub\]'"):
        hub.model_file("hf:acme/x")


# --- a Hugging Face cache filled by hand, offline ------------------------------------------------------------


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory, smollm2_path) -> dict:  # noqa: ANN001
    """HF_HOME with the SmolLM2 GGUF repo and a random SmolLM2-shaped DFlash2 checkpoint repo
    (plus one shaped for another target), and the environment that runs pydflash offline on it."""
    from fixtures_tiny import smollm2_drafter_config, tiny_config, write_checkpoint

    root = tmp_path_factory.mktemp("hub-offline")
    ckpt = root / "src" / "SmolLM2-135M-DFlash2"
    write_checkpoint(ckpt, smollm2_drafter_config(), seed=5)
    wrong = root / "src" / "wrong"
    write_checkpoint(wrong, tiny_config(), seed=1)
    hf_home = root / "hf"
    _cache_repo(hf_home, GGUF_REPO, COMMIT_GGUF, {"SmolLM2-135M-Instruct-Q4_1.gguf": Path(smollm2_path)})
    _cache_repo(hf_home, DRAFT_REPO, COMMIT_DRAFT,
                {"config.json": ckpt / "config.json", "model.safetensors": ckpt / "model.safetensors"})
    _cache_repo(hf_home, "acme/Other-DFlash2", "3" * 40,
                {"config.json": wrong / "config.json", "model.safetensors": wrong / "model.safetensors"})
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYDFLASH_CACHE": str(root / "pyd"),
           "PYDFLASH_AUTOTUNE_CACHE": "0"}
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_ENDPOINT", *_LLAMA_ENV):
        env.pop(key, None)
    return {"root": root, "env": env, "ckpt": ckpt, "target": Path(smollm2_path)}


GEN = ["generate", "-p", PROMPT, "-n", "16", "--temp", "0", "-t", "2", "-c", "256", "--spec-draft-n-max", "3",
       "--no-stream"]


def _converted(root: Path) -> list[Path]:
    return sorted((root / "pyd" / "drafters").rglob("*.gguf"))


def test_generate_from_offline_cache_converts_once(offline_cache) -> None:  # noqa: ANN001
    root, env = offline_cache["root"], offline_cache["env"]
    first = _cli(*GEN, "-hf", f"{GGUF_REPO}:Q4_1", "-hfd", DRAFT_REPO, env=env)
    assert first.returncode == 0, first.stderr
    assert "converted drafter acme/SmolLM2-135M-DFlash2" in first.stderr
    [drafter] = _converted(root)
    assert drafter.parent.name == "acme--SmolLM2-135M-DFlash2" and drafter.name.startswith(COMMIT_DRAFT[:12])
    before = drafter.stat()

    second = _cli(*GEN, "-hf", f"{GGUF_REPO}:q4_1", "-hfd", DRAFT_REPO, env=env)
    assert second.returncode == 0, second.stderr
    assert "converted" not in second.stderr and "cached" in second.stderr
    assert _converted(root) == [drafter]
    after = drafter.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not converted again
    assert not [p for p in drafter.parent.iterdir() if p.name.endswith(".tmp")]

    # the same generation from the local files: same text
    local = _cli(*GEN, "-m", str(offline_cache["target"]), "-md", str(drafter), env=env)
    assert local.returncode == 0, local.stderr
    assert first.stdout == second.stdout == local.stdout and first.stdout.strip()
    assert "drafter " in first.stderr  # speculation ran with it

    # the cached drafter is what the converter makes of the same checkpoint for the same target
    from pydflash.formats.convert import convert

    reference = convert(offline_cache["ckpt"], root / "reference.gguf", target_gguf=offline_cache["target"],
                        outtype="f16", progress=False)
    assert drafter.read_bytes() == reference.read_bytes()


def test_python_api_and_convert_command_offline(offline_cache) -> None:  # noqa: ANN001
    root, env = offline_cache["root"], offline_cache["env"]
    script = f"""
import json, pydflash
from pydflash import errors
out = {{}}
with pydflash.Engine("hf:{GGUF_REPO}:Q4_1", "hf:{DRAFT_REPO}:q4_k_m", n_ctx=256, n_threads=2, n_max=3) as e:
    out["target"], out["drafter"] = e.target.path, e.drafter.path
    out["text"] = e.generate("{PROMPT}", max_tokens=8, temperature=0).text
with pydflash.Target("{offline_cache['target']}", n_ctx=256, n_threads=2) as t:
    out["plain"] = t.generate("{PROMPT}", max_tokens=8, temperature=0).text
for spec, exc in (("hf:acme/nope", errors.HubOfflineError), ("hf:{GGUF_REPO}:Q8_0", errors.HubFileNotFoundError)):
    try:
        pydflash.Target(spec)
    except exc as err:
        out[spec] = str(err)
from pydflash.server.command_line import build_parser, config_from_args
args, _ = build_parser().parse_known_args(["-hf", "{GGUF_REPO}:Q4_1", "-hfd", "{DRAFT_REPO}", "--draft-type", "Q4_K_M"])
config = config_from_args(args)
out["serve"] = [config.model, config.drafter]
print(json.dumps(out))
"""
    proc = _run([sys.executable, "-c", script], env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["target"].endswith(f"snapshots/{COMMIT_GGUF}/SmolLM2-135M-Instruct-Q4_1.gguf")
    assert Path(out["drafter"]).name.endswith("-Q4_K_M.gguf") and str(root / "pyd" / "drafters") in out["drafter"]
    assert out["text"] == out["plain"]  # greedy speculation is lossless
    assert out["serve"] == [out["target"], out["drafter"]]  # pydflash serve -hf / -hfd: the same local files
    assert "not in the Hugging Face cache" in out["hf:acme/nope"]
    assert "SmolLM2-135M-Instruct-Q4_1.gguf" in out[f"hf:{GGUF_REPO}:Q8_0"]  # lists what is there

    # pydflash convert REPO: the checkpoint from the cache, the target as hf:...
    proc = _cli("convert", DRAFT_REPO, "--target-gguf", f"hf:{GGUF_REPO}:Q4_1", "--outtype", "f16",
                "-o", str(root / "cli.gguf"), "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    from pydflash.formats.convert import convert

    ref = convert(offline_cache["ckpt"], root / "ref-cli.gguf", target_gguf=offline_cache["target"], outtype="f16",
                  progress=False)
    assert (root / "cli.gguf").read_bytes() == ref.read_bytes()


def test_offline_cli_errors_are_one_line(offline_cache) -> None:  # noqa: ANN001
    root, env = offline_cache["root"], offline_cache["env"]
    line = _one_line_error(_cli("generate", "-hf", "acme/nope", "-p", "x", "-n", "1", env=env))
    assert "acme/nope is not in the Hugging Face cache" in line and "offline" in line
    line = _one_line_error(_cli("generate", "-hf", f"{GGUF_REPO}:Q2_K", "-p", "x", "-n", "1", env=env))
    assert "no GGUF file matching 'Q2_K'" in line and "SmolLM2-135M-Instruct-Q4_1.gguf" in line
    # LLAMA_CACHE (llama.cpp's cache override) comes first, as in llama.cpp
    hf_cache = Path(env["HF_HOME"]) / "hub"
    proc = _run([sys.executable, "-c", f"from pydflash.fetch import hub; print(hub.model_file('hf:{GGUF_REPO}:Q4_1'))"],
                {**env, "HF_HOME": str(root / "elsewhere"), "LLAMA_CACHE": str(hf_cache)})
    assert proc.returncode == 0 and Path(proc.stdout.strip()).is_relative_to(hf_cache), proc.stderr
    # a drafter that does not fit the target: what does not fit, and nothing left in the cache
    line = _one_line_error(_cli("generate", "-hf", f"{GGUF_REPO}:Q4_1", "-hfd", "acme/Other-DFlash2",
                                "-p", "x", "-n", "1", env=env))
    assert "acme/Other-DFlash2 does not fit SmolLM2-135M-Instruct-Q4_1.gguf" in line
    assert "hidden_size 64 != target embedding_length 576" in line
    other = root / "pyd" / "drafters" / "acme--Other-DFlash2"
    assert not [p for p in other.iterdir() if not p.name.endswith(".lock")]


# --- a local server answering the Hub's endpoints ------------------------------------------------------------


class _Repo:
    def __init__(self, commit: str, files: dict[str, bytes], gated: bool = False) -> None:
        self.commit, self.files, self.gated = commit, files, gated


class FakeHub(ThreadingHTTPServer):
    """The endpoints huggingface_hub uses to download: ``GET /api/models/ORG/NAME[/revision/REV]`` and
    ``HEAD``/``GET /ORG/NAME/resolve/REV/PATH`` (ETag, X-Repo-Commit, Content-Length, Range), errors
    with the Hub's ``X-Error-Code``. ``drop[path] = n``: the first full GET of that file sends n bytes
    and closes the connection; ``stall[path] = n``: sends n bytes, then waits for ``release``."""

    daemon_threads = True

    def __init__(self, repos: dict[str, _Repo]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.drop: dict[str, int] = {}
        self.stall: dict[str, int] = {}
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:  # noqa: ANN002 - quiet
        pass

    def _error(self, status: int, code: str, commit: str | None = None) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", code)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _route(self, head: bool) -> None:
        path = self.path.split("?", 1)[0]
        self.server.log.append((self.command, path, self.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            repo = self.server.repos.get(m.group(1))
            if repo is None:
                return self._error(404, "RepoNotFound")
            body = json.dumps({"id": m.group(1), "sha": repo.commit, "private": False,
                               "gated": "manual" if repo.gated else False,
                               "siblings": [{"rfilename": f} for f in sorted(repo.files)]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = self.server.repos.get(m.group(1)) if m else None
        if repo is None:
            return self._error(404, "RepoNotFound")
        if repo.gated and self.headers.get("Authorization") != "Bearer hf_good":
            return self._error(403 if self.headers.get("Authorization") else 401, "GatedRepo")
        name = m.group(3)
        if name not in repo.files:
            return self._error(404, "EntryNotFound", repo.commit)
        data = repo.files[name]
        start = 0
        rng = self.headers.get("Range")
        if rng and not head:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{_sha256(data)}"')
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return None
        cut = None if start else (self.server.drop.pop(name, None) or self.server.stall.get(name))
        if cut is None:
            self.wfile.write(data[start:])
            return None
        self.wfile.write(data[:cut])
        self.wfile.flush()
        if name in self.server.stall:
            self.server.stalled.set()
            self.server.release.wait(60)
        self.close_connection = True
        try:
            self.connection.shutdown(2)  # the connection drops mid-file
        except OSError:  # the client is gone already
            pass
        return None

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._route(head=False)


@contextmanager
def fake_hub(repos: dict[str, _Repo]) -> Iterator[FakeHub]:
    server = FakeHub(repos)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def _blob(seed: int, n: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture()
def online(tmp_path: Path) -> Iterator[tuple[FakeHub, dict[str, str], dict[str, bytes]]]:
    files = {"README.md": b"# big\n", "big-Q4_K_M-00001-of-00002.gguf": _blob(1, 24 << 20),
             "big-Q4_K_M-00002-of-00002.gguf": _blob(2, 1 << 20), "big-Q8_0.gguf": _blob(3, 1 << 20),
             "dflash-big-Q4_K_M.gguf": _blob(6, 1 << 16)}
    repos = {"acme/Big-GGUF": _Repo("a" * 40, files),
             "acme/Draft-GGUF": _Repo("b" * 40, {"dflash-d-Q4_K_M.gguf": _blob(4, 1 << 16), "d-f16.gguf": b"x"}),
             "acme/Gated-GGUF": _Repo("c" * 40, {"g-Q4_K_M.gguf": _blob(5, 1 << 16)}, gated=True)}
    with fake_hub(repos) as server:
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"),
               "PYDFLASH_CACHE": str(tmp_path / "pyd"), "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5", "NO_PROXY": "127.0.0.1"}
        for key in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", *_LLAMA_ENV):
            env.pop(key, None)
        yield server, env, files


def _py(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", f"from pydflash import errors\nfrom pydflash.fetch import hub\n{code}"], env, timeout=120)


def test_download_resumes_after_a_dropped_connection(online, tmp_path: Path) -> None:  # noqa: ANN001
    server, env, files = online
    part1 = "big-Q4_K_M-00001-of-00002.gguf"
    # 16 of 24 MiB, then the connection closes (huggingface_hub writes what it got in 10 MiB chunks)
    server.drop[part1] = 16 << 20
    proc = _py("first = hub.model_file('hf:acme/Big-GGUF')\nprint(first)\n"
               "print(hub.drafter_file('hf:acme/Draft-GGUF', 'unused.gguf'))\n"
               "print(hub.sidecar_drafter('hf:acme/Big-GGUF', first))", env)
    assert proc.returncode == 0, proc.stderr
    first, drafter, sidecar = (Path(line) for line in proc.stdout.split())
    assert sidecar == first.parent / "dflash-big-Q4_K_M.gguf" and sidecar.read_bytes() == files[sidecar.name]
    assert first.name == part1 and first.parent.name == "a" * 40  # Q4_K_M by default, the first part to load
    for name in (part1, "big-Q4_K_M-00002-of-00002.gguf"):
        assert _sha256((first.parent / name).read_bytes()) == _sha256(files[name])
    assert not (first.parent / "big-Q8_0.gguf").exists()
    resumed = [int(r[6:-1]) for m, p, r in server.log if m == "GET" and p.endswith(part1) and r]
    assert resumed and 0 < resumed[0] <= 16 << 20, server.log  # a Range request from what it had (10 MiB in 2.4)
    blobs = tmp_path / "hf" / "hub" / "models--acme--Big-GGUF" / "blobs"
    assert not [p for p in blobs.iterdir() if "incomplete" in p.name]
    # a GGUF drafter repository: its dflash- file, as is
    assert drafter.name == "dflash-d-Q4_K_M.gguf" and drafter.read_bytes() == server.repos["acme/Draft-GGUF"].files[
        drafter.name]

    # later, offline: from the cache, no request
    n_requests = len(server.log)
    proc = _py("print(hub.model_file('hf:acme/Big-GGUF'))", {**env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and Path(proc.stdout.strip()) == first, proc.stderr
    assert len(server.log) == n_requests


def test_killed_download_leaves_nothing_loadable(online, tmp_path: Path) -> None:  # noqa: ANN001
    server, env, files = online
    name = "big-Q8_0.gguf"
    server.stall[name] = 300_000
    proc = subprocess.Popen([sys.executable, "-c", "from pydflash.fetch import hub\nhub.model_file('hf:acme/Big-GGUF:Q8_0')"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert server.stalled.wait(60)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        server.release.set()
    folder = tmp_path / "hf" / "hub" / "models--acme--Big-GGUF"
    assert not (folder / "snapshots" / ("a" * 40) / name).exists()
    assert not [p for p in (folder / "blobs").iterdir() if not p.name.endswith(".incomplete")]
    # --offline now: nothing usable is cached, one clear error, no request
    n_requests = len(server.log)
    line = _one_line_error(_cli("generate", "-hf", "acme/Big-GGUF:Q8_0", "--offline", "-p", "x", env=env))
    assert "not in the Hugging Face cache" in line and len(server.log) == n_requests
    # online again: a full, correct download
    del server.stall[name]
    proc2 = _py("print(hub.model_file('hf:acme/Big-GGUF:q8_0'))", env)
    assert proc2.returncode == 0, proc2.stderr
    assert _sha256(Path(proc2.stdout.strip()).read_bytes()) == _sha256(files[name])


def test_hub_errors_are_one_line(online, tmp_path: Path) -> None:  # noqa: ANN001
    server, env, _ = online
    line = _one_line_error(_cli("generate", "-hf", "acme/Missing-GGUF:Q4_K_M", "-p", "x", env=env))
    assert "repository acme/Missing-GGUF not found on " + server.url in line
    line = _one_line_error(_cli("generate", "-hf", "acme/Gated-GGUF", "-p", "x", env=env))  # no token
    assert "gated repository and no token was given" in line
    line = _one_line_error(_cli("generate", "-hf", "acme/Gated-GGUF", "-hft", "hf_other", "-p", "x", env=env))
    assert "gated repository and the token given has no access" in line
    assert ("HEAD", "/acme/Gated-GGUF/resolve/main/g-Q4_K_M.gguf", None) in server.log  # answered 403
    assert not list((tmp_path / "hf" / "hub").rglob("*.gguf"))  # nothing half-written
    # typed exceptions in Python
    proc = _py("import json\nout = {}\n"
               "for spec in ('hf:acme/Missing-GGUF', 'hf:acme/Gated-GGUF', 'hf:acme/Big-GGUF:Q2_K',\n"
               "             'hf:acme/Big-GGUF/nope.gguf'):\n"
               "    try:\n        hub.model_file(spec)\n"
               "    except errors.HubError as exc:\n        out[spec] = [type(exc).__name__, str(exc)]\n"
               "print(json.dumps(out))", env)
    out = json.loads(proc.stdout)
    assert {k: v[0] for k, v in out.items()} == {
        "hf:acme/Missing-GGUF": "HubRepoNotFoundError", "hf:acme/Gated-GGUF": "HubAccessError",
        "hf:acme/Big-GGUF:Q2_K": "HubFileNotFoundError", "hf:acme/Big-GGUF/nope.gguf": "HubFileNotFoundError"}
    assert "no GGUF file matching 'Q2_K'" in out["hf:acme/Big-GGUF:Q2_K"][1] and "big-Q8_0.gguf" in out[
        "hf:acme/Big-GGUF:Q2_K"][1]
    assert "has no file nope.gguf" in out["hf:acme/Big-GGUF/nope.gguf"][1]
    # with a token that has access, from HF_TOKEN
    proc = _py("print(hub.model_file('hf:acme/Gated-GGUF'))", {**env, "HF_TOKEN": "hf_good"})
    assert proc.returncode == 0 and Path(proc.stdout.strip()).name == "g-Q4_K_M.gguf", proc.stderr
