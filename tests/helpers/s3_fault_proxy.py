"""A fault-injecting reverse proxy in front of the test S3 server (moto), for tests.

Every request is forwarded unchanged (headers included, so signatures still
match) on a fresh upstream connection; the client side speaks HTTP/1.1 with
keep-alive. A :class:`Rule` picks requests by method and key (a substring of
the path) and spoils the answer *after the server applied the request*:

* ``"drop_reply"``: the server's answer is read and thrown away, and the client's
  connection closed: the client cannot tell whether its write happened.
* ``"truncate"``: the status, the headers (the full ``Content-Length``) and half
  the body are sent, then the connection is closed: a short read.
* ``"count"``: nothing spoiled; ``hits`` says how many such requests passed.
* ``"hold"``: a slow server: the request is held, unanswered, until the test calls
  the rule's ``release()`` (the client meanwhile times out reading and may retry);
  then it is applied, ``applied`` counting it, and its answer thrown away.

A rule fires ``times`` times (``ALWAYS``: without end), only while its ``when``
(if any) says so; ``hits`` counts how often it fired. Its ``before`` (if any)
runs once, in the proxy, before the first request it fires on is forwarded
(another writer acting in between). Everything else passes.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ALWAYS = 1 << 30
# Hop-by-hop headers (RFC 9110 section 7.6.1) describe one connection: never forwarded.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}
_HOP_BY_HOP |= {"transfer-encoding", "expect"}


@dataclass
class Rule:
    method: str
    key: str  # a substring of the request path: "/ckpt/refs/r"
    action: str  # "drop_reply", "truncate" or "count"
    times: int = 1
    when: Callable[[], bool] | None = None
    before: Callable[[], None] | None = None  # run once, before the first hit is forwarded
    hits: int = 0
    applied: int = 0  # "hold": held requests forwarded since release()
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """A "hold" rule's held requests (and later ones) go on to the server."""
        self.released.set()

    def matches(self, method: str, path: str) -> bool:
        armed = self.when is None or self.when()
        return armed and self.hits < self.times and method == self.method and self.key in path


class _Forwarder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            pieces: list[bytes] = []
            while size := int(self.rfile.readline().split(b";", 1)[0].strip(), 16):
                pieces.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(pieces)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        rule = self.server.fire(self.command, self.path)
        if rule is not None and rule.before is not None and rule.hits == 1:
            rule.before()
        if rule is not None and rule.action == "hold":
            rule.released.wait(120)
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=120)
        try:
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        if rule is not None and rule.action in ("drop_reply", "hold"):
            if rule.action == "hold":
                with self.server.lock:
                    rule.applied += 1
            self.close_connection = True  # the write happened; its answer never arrives
            return
        self.send_response_only(answer.status, answer.reason)
        for key, value in answer.getheaders():
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                self.send_header(key, value)
        if self.command == "HEAD":
            length = answer.getheader("Content-Length")
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if rule is not None and rule.action == "truncate":
            self.wfile.write(data[: len(data) // 2])
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Forwarder)
        self.upstream = upstream
        self.rules: list[Rule] = []
        self.lock = threading.Lock()

    def fire(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.matches(method, path):
                    rule.hits += 1
                    return rule
        return None


class FaultProxy:
    """A proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``); ``endpoint``
    is its URL. A context manager: closed on exit."""

    def __init__(self, upstream: str) -> None:
        self._server = _ProxyServer(upstream.removeprefix("http://"))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(
        self,
        method: str,
        key: str,
        action: str,
        *,
        times: int = 1,
        when: Callable[[], bool] | None = None,
        before: Callable[[], None] | None = None,
    ) -> Rule:
        if action not in ("drop_reply", "truncate", "count", "hold"):
            raise ValueError(f"unknown fault {action!r}")
        rule = Rule(method, key, action, times, when, before)
        with self._server.lock:
            self._server.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._server.lock:
            for rule in self._server.rules:
                rule.release()  # nothing left held when the rules go
            self._server.rules.clear()

    def close(self) -> None:
        self.clear()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
