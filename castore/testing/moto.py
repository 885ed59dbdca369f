"""A real S3 endpoint on the loopback for tests, demos and benchmarks: moto's server.

moto (``moto[server]``, the dev extra) answers on threads and checks
``If-None-Match`` / ``If-Match``, then writes, without a lock: under load two
racing conditional writes could both win, where S3 documents them as atomic.
The server here handles one request at a time, which gives the emulator S3's
atomicity; clients still race each other on the wire. It runs in a child
process, so that its memory and CPU are not the client's (a test that
measures the client's peak memory sees only the client). It remembers which
of moto's backends answers a host: moto works that out for every request,
listing its package directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SERVE = """
import sys, threading
from moto.moto_server import threaded_moto_server

one_at_a_time = threading.Lock()
backends_by_host = {}

class Atomic(threaded_moto_server.DomainDispatcherApplication):
    def __call__(self, environ, start_response):
        with one_at_a_time:
            return super().__call__(environ, start_response)

    def get_backend_for_host(self, host):
        # moto routes each request anew: it lists its own package directory (an
        # isdir per service) and tries every service's URL patterns, a third of
        # the server's time per request. The answer for a host never changes.
        if host not in backends_by_host:
            backends_by_host[host] = super().get_backend_for_host(host)
        return backends_by_host[host]

threaded_moto_server.DomainDispatcherApplication = Atomic
server = threaded_moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the parent closes it
server.stop()
"""


@contextmanager
def moto_server(*, min_part_size: int | None = None) -> Iterator[str]:
    """moto's S3 server on a free loopback port; yields its URL, ``http://127.0.0.1:PORT``.

    ``min_part_size``: the smallest multipart part the server accepts (default
    AWS's 5 MiB). Raises RuntimeError when the server does not start (is
    ``moto[server]`` installed?). Stopped, and waited for, on exit.
    """
    env = dict(os.environ)
    env.pop("S3_UPLOAD_PART_MIN_SIZE", None)
    if min_part_size is not None:
        env["S3_UPLOAD_PART_MIN_SIZE"] = str(min_part_size)
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        assert server.stdout is not None
        address = server.stdout.readline().strip()
        if not address:
            raise RuntimeError("moto's S3 server did not start (is moto[server] installed?)")
        yield f"http://{address}"
    finally:
        assert server.stdin is not None
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()  # our own child, by its handle
            server.wait()
