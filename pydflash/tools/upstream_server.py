"""Running the shipped upstream ``llama-server`` on loopback, for side-by-side measurements.

Used by ``pydflash bench`` (and the tests' server helpers): start a server process on a free
port, wait until it is healthy, send ``/completion`` requests, read its peak RSS, stop it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from .upstream_binaries import tool_path

__all__ = ["UpstreamServer", "free_port", "post_json", "wait_healthy", "peak_rss_mib"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 180, log: Path | None = None) -> None:
    """Poll ``base/health`` until it answers 200; raise if the process dies or time runs out
    (with the tail of the server's ``log`` file, if given)."""
    tail = (lambda: "\n" + log.read_text(errors="replace")[-3000:]) if log else (lambda: "")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}{tail()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not become healthy{tail()}")


def peak_rss_mib(pid: int | None = None) -> float:
    """Peak resident memory (VmHWM) of a process (default: this one), in MiB; 0 if unknown."""
    try:
        for line in Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class UpstreamServer:
    """The shipped ``llama-server`` with the given arguments, on a free loopback port.

    ``complete`` returns the server's ``/completion`` answer (``content``, ``tokens`` when asked,
    and ``timings`` with ``predicted_per_second``, ``draft_n``, ``draft_n_accepted``)."""

    def __init__(self, args: Sequence[str], *, startup_timeout: float = 300) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        cmd = [str(tool_path("llama-server")), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.peak_rss_mib = 0.0
        try:
            wait_healthy(self.base, self.proc, timeout=startup_timeout, log=Path(self._log.name))
        except BaseException:
            self.close()
            raise
        self.peak_rss_mib = 0.0

    def complete(self, prompt: str, n_predict: int, *, timeout: float = 600, **fields) -> dict:  # type: ignore[no-untyped-def]
        body = {"prompt": prompt, "n_predict": n_predict, "cache_prompt": False, "return_tokens": True, **fields}
        try:
            out = post_json(self.base + "/completion", body, timeout=timeout)
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"llama-server request failed ({exc}); log tail:\n{self.log_tail()}") from None
        self.peak_rss_mib = max(self.peak_rss_mib, peak_rss_mib(self.proc.pid))
        return out

    def log_tail(self, n: int = 4000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.peak_rss_mib = max(self.peak_rss_mib, peak_rss_mib(self.proc.pid))
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __enter__(self) -> "UpstreamServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
