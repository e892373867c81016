"""``/cors-proxy`` (``--ui-mcp-proxy``) against the shipped llama-server: the same requests through
both servers to a local HTTP server that records what reaches it.

Compared: what the target receives (only the ``x-llama-server-proxy-header-*`` headers, renamed;
never the client's API key, cookies or proxy credentials), the status and body that come back
(a 204 included), an event stream passed through chunk by chunk, and the 403 when the proxy is off.
Bad target URLs are a 4xx here (upstream answers 500 for them).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_server_compat import _call, running

KEY = "sk-proxy"
AUTH = {"Authorization": f"Bearer {KEY}"}


class _Target(BaseHTTPRequestHandler):
    """Records each request; /empty answers 204, /events an event stream in three timed chunks."""

    def _record(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        self.server.seen.append({"method": self.command, "path": self.path,
                                 "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        return body

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        if self.path.startswith("/events"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {i}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.3)
            return
        payload = json.dumps({"ok": True, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("X-Target", "yes")
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:  # noqa: N802
        body = self._record()
        if self.path == "/empty":
            self.send_response(204)
            self.end_headers()
            return
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Target)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def proxies(tmp_path_factory, smollm2_path):
    """{"ours" / "upstream": base URL} with the proxy on, and "ours-off" / "upstream-off" without."""
    common = ["-m", str(smollm2_path), "--host", "127.0.0.1", "-np", "1", "-c", "512", "-t", "1",
              "--api-key", KEY]
    specs = {"ours": ("ours", common + ["--ui-mcp-proxy"]), "upstream": ("upstream", common + ["--ui-mcp-proxy"]),
             "ours-off": ("ours", common), "upstream-off": ("upstream", common)}
    with running(tmp_path_factory.mktemp("cors-proxy"), specs) as up:
        yield {name: base for name, (base, _) in up.items()}


def _through(proxies: dict, target, name: str, method: str, path: str, body=None, headers=None):  # type: ignore[no-untyped-def]
    """(status, headers, body) of one request through a proxy, and what reached the target."""
    n = len(target.seen)
    url = f"/cors-proxy?url=http://127.0.0.1:{target.server_port}{path}"
    out = _call(proxies[name], url, body, method=method, headers={**AUTH, **(headers or {})})
    return out, target.seen[n:]


SECRET_HEADERS = {"Proxy-Authorization": "Basic secret", "X-Api-Key": KEY, "Cookie": "session=secret"}
EXPLICIT = {"x-llama-server-proxy-header-accept": "application/json",
            "x-llama-server-proxy-header-authorization": "Bearer explicit",
            "X-Llama-Server-Proxy-Header-X-Custom": "Mixed-Case"}


def test_only_explicit_headers_reach_the_target_as_upstream(proxies, target):
    got = {}
    for name in ("ours", "upstream"):
        (status, headers, body), seen = _through(proxies, target, name, "GET", "/capture?q=1",
                                                 headers={**SECRET_HEADERS, **EXPLICIT})
        assert status == 200 and body == {"ok": True, "path": "/capture?q=1"}, (name, status, body)
        assert headers.get("X-Target") == "yes"
        assert len(seen) == 1 and seen[0]["path"] == "/capture?q=1"
        h = seen[0]["headers"]
        assert h["accept"] == "application/json" and h["authorization"] == "Bearer explicit"
        assert h["x-custom"] == "Mixed-Case"
        for secret in ("proxy-authorization", "x-api-key", "cookie"):
            assert secret not in h, (name, secret)
        assert not [k for k in h if k.startswith("x-llama-server-proxy-header-")]
        got[name] = {k: v for k, v in h.items() if k in ("accept", "authorization", "x-custom")}
    assert got["ours"] == got["upstream"]


def test_post_body_status_and_no_content_as_upstream(proxies, target):
    for name in ("ours", "upstream"):
        (status, _, body), seen = _through(proxies, target, name, "POST", "/echo", {"jsonrpc": "2.0", "id": 1},
                                           headers={"x-llama-server-proxy-header-content-type": "application/json"})
        assert status == 201 and body == {"jsonrpc": "2.0", "id": 1}, (name, status, body)
        assert json.loads(seen[0]["body"]) == {"jsonrpc": "2.0", "id": 1}
        (status, _, body), _ = _through(proxies, target, name, "POST", "/empty", {})
        assert status == 204 and body in ("", None), (name, status, body)


def test_an_event_stream_is_passed_on_as_it_comes(proxies, target):
    """The three chunks arrive 0.3 s apart through the proxy, not all at the end."""
    for name in ("ours", "upstream"):
        host, port = proxies[name].removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/events", headers=AUTH)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream"), name
        t0, arrivals, data = time.monotonic(), [], b""
        while chunk := resp.read1(64):
            data += chunk
            arrivals.append(time.monotonic() - t0)
        conn.close()
        assert data == b"data: 0\n\ndata: 1\n\ndata: 2\n\n", (name, data)
        assert arrivals[0] < 0.3, (name, arrivals)  # the first chunk came before the target finished


def test_off_is_403_and_needs_the_key_as_upstream(proxies, target):
    for name in ("ours-off", "upstream-off"):
        (status, _, body), seen = _through(proxies, target, name, "GET", "/x")
        assert status == 403 and body["error"]["type"] == "feature_disabled", (name, body)
        assert seen == []
    for name in ("ours", "upstream"):
        status = _call(proxies[name], f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/x")[0]
        assert status == 401, name


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "http:///nohost", "http://user:pw@127.0.0.1:1/", "", "::"])
def test_bad_target_urls_are_refused(proxies, url):
    status, _, body = _call(proxies["ours"], f"/cors-proxy?url={url}", headers=AUTH)
    assert 400 <= status < 500 and "error" in body, (url, status, body)


def test_an_unreachable_target_is_a_502(proxies):
    status, _, body = _call(proxies["ours"], "/cors-proxy?url=http://127.0.0.1:1/", headers=AUTH)
    assert status == 502 and "127.0.0.1:1" in body["error"]["message"]
