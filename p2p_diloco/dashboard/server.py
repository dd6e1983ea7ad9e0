"""The dashboard's HTTP side: one self-contained page and the JSON endpoints it (and scripts) read.

Read-only: GET and HEAD only (anything else is 405), no state changes, no assets from the internet.
Endpoints (all JSON, parts of `Collector.view`):

| path | what |
| --- | --- |
| `/api/summary` | everything below in one object (what the page polls) |
| `/api/peers` | live peers: role, tokens/s, uptime, direct or relayed, version lag, device, bytes |
| `/api/eval` | the global eval history: time, merged tokens, fragment versions, loss, perplexity |
| `/api/versions` | fragment versions and terms over time, with failover and rotation marks |
| `/api/contributions` | merged tokens per peer (from the update records of the evaluator's ledger) |
| `/api/rejections` | rejected inputs by reason and by sender |
| `/api/bytes` | bytes sent and received per peer and in total |
| `/api/health` | the dashboard's own polls, errors and ignored records |
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from p2p_diloco.dashboard.page import render_page

ENDPOINTS = {
    "/api/summary": None,
    "/api/peers": "peers",
    "/api/eval": "eval",
    "/api/versions": "versions",
    "/api/contributions": "contributions",
    "/api/rejections": "rejections",
    "/api/bytes": "bytes",
    "/api/health": "health",
}


class DashboardServer:
    """A `ThreadingHTTPServer` on (host, port) serving `view()`; `port` 0 picks a free one."""

    def __init__(self, view: Callable[[], dict[str, Any]], host: str = "127.0.0.1", port: int = 8080):
        self.view = view
        handler = _handler(view)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(view: Callable[[], dict[str, Any]]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "p2p-diloco-dashboard"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

        def _send(self, status: HTTPStatus, body: bytes, content_type: str, head: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _get(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            try:
                if path in ("/", "/index.html"):
                    body = render_page(view()).encode()
                    self._send(HTTPStatus.OK, body, "text/html; charset=utf-8", head)
                elif path in ENDPOINTS:
                    data = view()
                    part = ENDPOINTS[path]
                    body = json.dumps(data if part is None else data[part]).encode()
                    self._send(HTTPStatus.OK, body, "application/json", head)
                else:
                    self._send(HTTPStatus.NOT_FOUND, b'{"error": "not found"}', "application/json", head)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._get(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._get(head=True)

        def _refuse(self) -> None:
            body = b'{"error": "the dashboard is read-only"}'
            self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    return Handler
