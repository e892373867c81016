"""pytest plugin loaded into upstream's server test suite (``-p conformance_plugin``); no upstream file is changed.

- ``ServerPreset.load_all`` (which would start every preset once, online) becomes a no-op.
- The server start timeout is raised to ``$CONFORMANCE_START_TIMEOUT`` seconds (2 shared cores).
- ``download_file`` maps the few URLs that have a local substitute and skips the test as
  NOT-RUNNABLE for any other (no network here).
- Every HTTP response seen through ``requests`` is noted per test (method, path, status), and
  each test's outcome, first error line and non-2xx responses are written to ``$CONFORMANCE_OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests

_OUT = os.environ.get("CONFORMANCE_OUT")
_NOTRUN = os.environ.get("CONFORMANCE_NOTRUN")
_MODELS = Path(os.environ.get("PYDFLASH_MODELS_DIR", Path.home() / ".cache/pydflash/models"))

# URL -> local file with the same role
DOWNLOAD_MAP = {
    # test_speculative's draft model for stories15M_MOE; the target is SmolLM2 here, so SmolLM2 drafts
    # for itself on llama-server (pydflash's wrapper swaps in the shipped DFlash2 drafter)
    "https://huggingface.co/ggml-org/tiny-llamas/resolve/main/stories15M-q4_0.gguf":
        _MODELS / "SmolLM2-135M-Instruct-Q4_1.gguf",
}

_results: dict[str, dict] = {}
_http: dict[str, list] = {}


def _current_test() -> str | None:
    cur = os.environ.get("PYTEST_CURRENT_TEST")
    return cur.rsplit(" (", 1)[0] if cur else None


_orig_request = requests.sessions.Session.request


def _recording_request(self, method, url, *args, **kwargs):
    resp = _orig_request(self, method, url, *args, **kwargs)
    test = _current_test()
    if test is not None:
        path = urlsplit(str(url)).path
        if resp.status_code >= 300 and not path.endswith("/health"):  # /health: the start-up polling
            _http.setdefault(test, []).append([str(method).upper(), path, resp.status_code])
    return resp


requests.sessions.Session.request = _recording_request


def _fake_download(url: str, output_file_path: str | None = None) -> str:
    local = DOWNLOAD_MAP.get(url)
    if local is not None and Path(local).is_file():
        return str(local)
    pytest.skip(f"NOT-RUNNABLE: needs a download: {url}")


def pytest_collection_modifyitems(session, config, items):
    utils = sys.modules.get("utils")
    if utils is None:
        return
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    t = int(os.environ.get("CONFORMANCE_START_TIMEOUT", "240"))
    utils.ServerProcess.start.__defaults__ = (t,)
    orig = utils.download_file
    for mod in list(sys.modules.values()):
        if getattr(mod, "download_file", None) is orig:
            mod.download_file = _fake_download


def _first_error_line(report) -> str:
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple):  # skip: (path, lineno, reason)
        return str(lr[2])
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.strip().splitlines()[0][:400]
    text = str(lr).strip().splitlines()
    errs = [ln for ln in text if ln.startswith("E ")]
    return (errs[0] if errs else (text[-1] if text else ""))[:400]


def _failing_source_line(report) -> str:
    """The line of the test file (not utils.py) where it failed."""
    lr = report.longrepr
    tb = getattr(lr, "reprtraceback", None)
    if tb is None:
        return ""
    test_file = report.nodeid.split("::")[0]
    best = ""
    for entry in getattr(tb, "reprentries", []):
        loc = getattr(entry, "reprfileloc", None)
        lines = getattr(entry, "lines", None) or []
        src = [ln for ln in lines if ln.startswith(">")]
        if loc is not None and src and Path(loc.path).name == Path(test_file).name:
            best = f"{Path(loc.path).name}:{loc.lineno}: {src[0][1:].strip()}"
    return best[:300]


def pytest_runtest_logreport(report):
    r = _results.setdefault(report.nodeid, {"outcome": "passed", "error": "", "where": "", "duration": 0.0})
    r["duration"] += report.duration
    if report.failed:
        if r["outcome"] != "failed":
            r["outcome"] = "failed" if report.when == "call" else "error"
            r["phase"] = report.when
            r["error"] = _first_error_line(report)
            r["where"] = _failing_source_line(report)
    elif report.skipped and r["outcome"] == "passed":
        r["outcome"] = "skipped"
        r["error"] = _first_error_line(report)


def pytest_sessionfinish(session, exitstatus):
    if not _OUT:
        return
    notrun: dict[str, str] = {}
    if _NOTRUN and os.path.exists(_NOTRUN):
        for line in open(_NOTRUN):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            notrun.setdefault(d["test"], d["reason"])
    for nodeid, r in _results.items():
        if nodeid in notrun and r["outcome"] != "passed":
            r["outcome"] = "notrunnable"
            r["error"] = notrun[nodeid]
        elif r["outcome"] == "skipped" and r["error"].startswith("NOT-RUNNABLE"):
            r["outcome"] = "notrunnable"
        r["http_errors"] = [h for h in _http.get(nodeid, []) if h[2] >= 300][:8]
    prev = {}
    if os.path.exists(_OUT):
        try:
            prev = json.load(open(_OUT))
        except ValueError:
            prev = {}
    prev.update(_results)
    tmp = _OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(prev, f, indent=1, sort_keys=True)
    os.replace(tmp, _OUT)
