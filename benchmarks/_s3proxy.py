"""A moto S3 server behind a counting reverse proxy, for the S3 benchmarks.

``MotoServer`` runs moto's ``ThreadedMotoServer`` in a child process (as
tests/helpers/s3_server.py does: one request at a time, so that conditional writes
are atomic as S3 documents), with moto's part-size floor left at the AWS
default of 5 MiB. ``CountingProxy`` listens on 127.0.0.1, forwards every
request to it unchanged (headers included, so signatures still match) and
counts, per HTTP method, requests, request body bytes (uploaded) and response
body bytes (downloaded). Every client under test talks to the proxy, so the
counts are the same yardstick for all of them.

The proxy speaks HTTP/1.1 with keep-alive to its clients (one fresh
connection to moto per request), answers ``Expect: 100-continue`` before
reading a body, relays ``Content-Length`` bodies as they arrive, de-chunks
``Transfer-Encoding: chunked`` ones (sent on with a ``Content-Length``), and
passes Range requests and their 206 answers through untouched. A body's
bytes are counted as they cross the wire to or from the client: the payload,
not the HTTP framing or headers.
"""

from __future__ import annotations

import http.client
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from castore.testing.moto import moto_server

COPY_PIECE = 1 << 20  # bytes relayed per read while streaming a response body
# Hop-by-hop headers (RFC 9110 section 7.6.1): they describe one connection, never forwarded.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}


class MotoServer:
    """moto's S3 server in a child process (castore.testing.moto); ``address`` is its host:port.

    The part-size floor is the AWS default, 5 MiB, as real S3 has.
    """

    def __init__(self) -> None:
        self._running = moto_server()
        self.address = self._running.__enter__().removeprefix("http://")

    def close(self) -> None:
        self._running.__exit__(None, None, None)


@dataclass
class MethodCounts:
    requests: int = 0
    bytes_up: int = 0  # request bodies
    bytes_down: int = 0  # response bodies


@dataclass
class Counters:
    """What crossed the proxy since the last reset, per HTTP method."""

    by_method: dict[str, MethodCounts] = field(default_factory=lambda: defaultdict(MethodCounts))
    errors: int = 0  # answers with a status of 500 or more

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.by_method.values())

    @property
    def bytes_up(self) -> int:
        return sum(c.bytes_up for c in self.by_method.values())

    @property
    def bytes_down(self) -> int:
        return sum(c.bytes_down for c in self.by_method.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "server_errors": self.errors,
            "by_method": {m: vars(c).copy() for m, c in sorted(self.by_method.items())},
        }


class _Forwarder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive toward the client
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def _body(self) -> tuple[Any, int]:
        """The request body to send on (bytes, or pieces as they arrive) and its length."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._dechunked(), -1
        length = int(self.headers.get("Content-Length") or 0)
        return self._streamed(length), length

    def _dechunked(self) -> bytes:
        pieces: list[bytes] = []
        while True:
            size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(pieces)
            pieces.append(self.rfile.read(size))
            self.rfile.readline()  # the CRLF after each chunk

    def _streamed(self, length: int) -> Any:
        # Relayed as it arrives: store-and-forward would add a whole body's transfer
        # time to every upload (measured: a 32 MiB PUT took about twice as long).
        left = length
        while left > 0:
            piece = self.rfile.read(min(left, COPY_PIECE))
            if not piece:
                raise ConnectionError(f"the client sent {length - left} of {length} body bytes")
            left -= len(piece)
            yield piece

    def _forward(self) -> None:
        body, length = self._body()
        if length < 0:
            length = len(body)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if length or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(length)
        # A fresh upstream connection per request (cheap on the loopback): a body
        # streamed into a stale keep-alive connection could not be sent again.
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=600)
        try:
            send = body if length else None
            upstream.request(self.command, self.path, body=send, headers=headers)
            answer = upstream.getresponse()
            down = self._relay(answer)
        finally:
            upstream.close()
        self.server.count(self.command, length, down, answer.status)

    def _relay(self, answer: http.client.HTTPResponse) -> int:
        self.send_response_only(answer.status, answer.reason)
        for key, value in answer.getheaders():
            if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                self.send_header(key, value)
        no_body = self.command == "HEAD" or answer.status in (204, 304) or answer.status < 200
        length = answer.getheader("Content-Length")
        if no_body:
            if length is not None:
                self.send_header("Content-Length", length)  # HEAD: the object's size
            self.end_headers()
            answer.read()
            return 0
        if length is None:  # upstream chunked or close-delimited: buffer it, send a length
            data = answer.read()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return len(data)
        self.send_header("Content-Length", length)
        self.end_headers()
        sent = 0
        while piece := answer.read(COPY_PIECE):
            self.wfile.write(piece)
            sent += len(piece)
        return sent

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Forwarder)
        self.upstream = upstream
        self.lock = threading.Lock()
        self.counters = Counters()

    def count(self, method: str, up: int, down: int, status: int) -> None:
        with self.lock:
            counts = self.counters.by_method[method]
            counts.requests += 1
            counts.bytes_up += up
            counts.bytes_down += down
            if status >= 500:
                self.counters.errors += 1


class CountingProxy:
    """A reverse proxy on 127.0.0.1 in front of ``upstream`` (``host:port``), in threads."""

    def __init__(self, upstream: str) -> None:
        self._server = _ProxyServer(upstream)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-counting-proxy", daemon=True
        )
        self._thread.start()
        port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{port}"

    def take(self) -> Counters:
        """The counts since the last ``take`` (or the start), and start counting afresh."""
        with self._server.lock:
            counters, self._server.counters = self._server.counters, Counters()
        return counters

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
