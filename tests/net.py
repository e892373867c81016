"""Loopback HTTP helpers for tests that start a real server."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


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
