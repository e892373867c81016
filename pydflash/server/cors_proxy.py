"""llama-server's ``/cors-proxy`` (``--ui-mcp-proxy``): a browser UI reaches MCP servers through us.

``GET|POST /cors-proxy?url=http(s)://host[:port]/path`` forwards the request body and only the
headers the client names explicitly, as ``x-llama-server-proxy-header-<name>: value``: the
client's own ``Authorization`` / ``X-Api-Key`` (our API key), cookies and proxy credentials must
never reach a third party. The answer (status, content type, body) is streamed back as it
arrives, so an MCP server's event stream works. Off by default (403), as upstream: it lets anyone
who can reach the server make requests from it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .jobs import APIError

__all__ = ["HEADER_PREFIX", "register"]

HEADER_PREFIX = "x-llama-server-proxy-header-"
# not forwarded to the target: set by aiohttp from the actual body / connection
_REQUEST_SKIP = frozenset({"accept-encoding", "transfer-encoding", "content-length", "host", "connection"})
# not passed back: hop-by-hop, the body's framing (re-done by us), and our own CORS answer
_RESPONSE_SKIP = frozenset({"transfer-encoding", "content-length", "content-encoding", "connection", "keep-alive",
                            "content-type"})
_TIMEOUT_S = 600  # upstream's read and write timeouts


def register(http: Any, router: Any) -> None:
    """GET and POST /cors-proxy: the proxy when ``--ui-mcp-proxy`` is on, else 403."""
    if http.config.ui_mcp_proxy:
        handler = _Proxy(http).handle
    else:
        async def handler(request):  # type: ignore[no-untyped-def]
            raise APIError(403, "this feature is disabled", "feature_disabled")
    router.add_get("/cors-proxy", handler)
    router.add_post("/cors-proxy", handler)


def target_url(url: str | None) -> str:
    """The URL to forward to, checked as upstream does (400 instead of its 500)."""
    if not url:
        raise APIError(400, "invalid target URL: missing 'url' parameter")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise APIError(400, f"invalid target URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise APIError(400, f"unsupported URL scheme in target URL: {parts.scheme}")
    if not parts.hostname:
        raise APIError(400, "invalid target URL: missing host")
    if parts.password:
        raise APIError(400, "authentication in target URL is not supported")
    return url if parts.path else parts._replace(path="/").geturl()


def forwarded_headers(headers: Any) -> dict[str, str]:
    """The request headers the client asked to forward, without their prefix."""
    out = {}
    for key, value in headers.items():
        low = key.lower()
        if low.startswith(HEADER_PREFIX):
            name = key[len(HEADER_PREFIX):]
            if name and name.lower() not in _REQUEST_SKIP:
                out[name] = value
    return out


class _Proxy:
    def __init__(self, http: Any) -> None:
        self.web = http.web

    async def handle(self, request):  # type: ignore[no-untyped-def]
        import aiohttp

        url = target_url(request.query.get("url"))
        headers = forwarded_headers(request.headers)
        body = await request.read() if request.method == "POST" else None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=_TIMEOUT_S, sock_read=_TIMEOUT_S)
        # no session-wide defaults: only what the client named (aiohttp would add its own Accept and
        # User-Agent, which the explicit ones replace)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=True) as session:
            try:
                upstream = await session.request(request.method, url, headers=headers, data=body,
                                                 allow_redirects=True, skip_auto_headers=("Accept-Encoding",))
            except aiohttp.ClientError as exc:
                raise APIError(502, f"cannot reach {url}: {type(exc).__name__}: {exc}", "proxy_error") from None
            async with upstream:
                response = self.web.StreamResponse(status=upstream.status)
                for key, value in upstream.headers.items():
                    low = key.lower()
                    if low not in _RESPONSE_SKIP and not low.startswith("access-control-"):
                        response.headers.add(key, value)
                if "Content-Type" in upstream.headers:
                    response.headers["Content-Type"] = upstream.headers["Content-Type"]
                await response.prepare(request)
                if upstream.status not in (204, 304):  # those have no body
                    async for chunk in upstream.content.iter_any():  # as it comes: event streams
                        await response.write(chunk)
                    await response.write_eof()
                return response
