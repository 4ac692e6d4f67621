"""A pass-through HTTP proxy that records what a real client sends and what the server refuses.

Put it between a third-party client and a test server: every request's method, path and JSON body
is kept, and so is the body of every answer with status >= 400, so a failing test can name the
exact field the server rejected. Responses are relayed as they arrive (chunked), so streams
stream through it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

# Hop-by-hop headers: they describe one connection, not the message, so they are not forwarded.
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
       "content-length", "host"}


@dataclass
class Exchange:
    method: str
    path: str
    body: object  # the parsed JSON body, the raw text if it was not JSON, or None
    status: int = 0
    error_body: str | None = None  # the answer's body when status >= 400


@dataclass
class RecordingProxy:
    target: str  # the server's base URL, e.g. http://127.0.0.1:8000
    # rewrite(path, body) -> body: change a JSON body before it is forwarded (to look past a known
    # refusal while diagnosing; the tests themselves forward what the client sent).
    rewrite: Callable[[str, object], object] | None = None
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(300, connect=10))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _relay(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                ex = Exchange(self.command, self.path, body)
                with proxy._lock:
                    proxy.exchanges.append(ex)
                # .strip(): lm-eval sends "Authorization: Bearer " with no key, which h11 refuses.
                if proxy.rewrite is not None and isinstance(body, dict):
                    raw = json.dumps(proxy.rewrite(self.path, body)).encode()
                headers = {k: v.strip() for k, v in self.headers.items() if k.lower() not in HOP}
                try:
                    with proxy._client.stream(self.command, proxy.target + self.path, content=raw,
                                              headers=headers) as resp:
                        ex.status = resp.status_code
                        if ex.status >= 400:  # keep the whole refusal before the client can hang up
                            ex.error_body = resp.read().decode(errors="replace")
                        self.send_response(resp.status_code)
                        for k, v in resp.headers.items():
                            if k.lower() not in HOP and k.lower() != "content-encoding":
                                self.send_header(k, v)
                        if ex.status >= 400:
                            data = ex.error_body.encode()
                            self.send_header("Content-Length", str(len(data)))
                            self.end_headers()
                            self.wfile.write(data)
                            return
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        for chunk in resp.iter_bytes():
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                except httpx.HTTPError as e:  # the server failed to answer
                    ex.error_body = ex.error_body or f"proxy: {e!r}"
                    self.close_connection = True
                    if not ex.status:
                        self.send_error(502, f"proxy: {e!r}")
                except OSError:  # the client hung up
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _relay

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # a client resetting its connection is no news

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

    def clear(self) -> None:
        with self._lock:
            self.exchanges.clear()

    def refused(self) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.status >= 400 or e.error_body]

    def report(self, limit: int = 5) -> str:
        """The distinct refusals (path, status, error body) with one request body each."""
        seen: dict[tuple, Exchange] = {}
        counts: dict[tuple, int] = {}
        for e in self.refused():
            key = (e.method, e.path, e.status, e.error_body)
            seen.setdefault(key, e)
            counts[key] = counts.get(key, 0) + 1
        lines = []
        for key, e in list(seen.items())[:limit]:
            lines.append(f"{counts[key]} x {e.method} {e.path} -> {e.status}: {e.error_body}\n"
                         f"  request body: {json.dumps(e.body)[:1500]}")
        return "\n".join(lines) or "no refused requests"
