"""Where the crash drill's stores live: the local store, a shared directory, or S3 (moto).

The drill's processes (ranks, the reader, the collector) open the store with
:func:`open_options`, which every process reads from the environment the
drill sets (``CRASHDRILL_OPEN``): so each process stands for a node of its
own, with an index cache directory of its own, and a store lease short
enough (``STORE_LEASE``) that a SIGKILLed collector's lease is broken within
seconds rather than castore's default minute.

For ``s3``, the drill starts moto's server on the loopback, with a small
minimum part (``PART_BYTES``), and opens its stores with parts and a
multipart threshold of that size: a pack of a few chunks then goes up as a
multipart upload, and ``blob.mid_multipart`` can kill a rank between its
first part and the upload's completion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BACKENDS = ("local", "shared", "s3")
OPEN_ENV = "CRASHDRILL_OPEN"
STORE_LEASE = 2.0  # seconds before a dead holder's store lease is broken
PART_BYTES = 8 << 10  # S3 part size and multipart threshold in the drill
BUCKET = "crashdrill"
REGION = "us-east-1"
DUMMY = "testing"

_SERVE = """
import sys, threading
from moto.moto_server import threaded_moto_server

one_at_a_time = threading.Lock()

class Atomic(threaded_moto_server.DomainDispatcherApplication):
    def __call__(self, environ, start_response):
        with one_at_a_time:  # S3's conditional writes are atomic; moto's are not
            return super().__call__(environ, start_response)

threaded_moto_server.DomainDispatcherApplication = Atomic
server = threaded_moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the parent closes it
server.stop()
"""


class DrillBackend:
    """One backend of the drill: store locations, their creation and copies, the server."""

    def __init__(self, kind: str, workdir: Path) -> None:
        if kind not in BACKENDS:
            raise ValueError(f"unknown backend {kind!r}; known: {', '.join(BACKENDS)}")
        self.kind = kind
        self.workdir = workdir
        self._server: subprocess.Popen[str] | None = None
        self.endpoint: str | None = None

    def __enter__(self) -> DrillBackend:
        settings: dict[str, Any] = {}
        if self.kind != "local":
            settings = {"store_lease": STORE_LEASE}
        if self.kind == "shared":
            settings["shared"] = True
        if self.kind == "s3":
            self._start_server()
            os.environ.update(
                AWS_ENDPOINT_URL=str(self.endpoint),
                AWS_ACCESS_KEY_ID=DUMMY,
                AWS_SECRET_ACCESS_KEY=DUMMY,
                AWS_DEFAULT_REGION=REGION,
            )
            settings["s3_options"] = {
                "part_size": PART_BYTES,
                "min_part_size": PART_BYTES,
                "multipart_threshold": PART_BYTES,
            }
        os.environ[OPEN_ENV] = json.dumps(
            {"options": settings, "caches": str(self.workdir / "caches")}
        )
        return self

    def __exit__(self, *exc: object) -> None:
        os.environ.pop(OPEN_ENV, None)
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()

    def _start_server(self) -> None:
        env = dict(os.environ, S3_UPLOAD_PART_MIN_SIZE=str(PART_BYTES))
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self._server.stdout is not None
        address = self._server.stdout.readline().strip()
        if not address:
            raise SystemExit("crash drill: moto's S3 server did not start")
        self.endpoint = f"http://{address}"
        self._client().create_bucket(Bucket=BUCKET)

    def _client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=DUMMY,
            aws_secret_access_key=DUMMY,
        )

    def location(self, directory: Path) -> str:
        """Where the store of the launch or scenario kept in ``directory`` lives."""
        if self.kind == "s3":
            return f"s3://{BUCKET}/{directory.relative_to(self.workdir).as_posix()}/store"
        return str(directory / "store")

    def incomplete_uploads(self, location: str) -> int:
        """Multipart uploads begun and never completed nor aborted under ``location``."""
        if self.kind != "s3":
            return 0
        prefix = location.removeprefix(f"s3://{BUCKET}/") + "/"
        answer = self._client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
        return len(answer.get("Uploads", []))

    def copy(self, source: str, target: str) -> None:
        """A copy of the store at ``source``, byte for byte, at ``target``."""
        if self.kind != "s3":
            import shutil

            shutil.copytree(source, target)
            return
        client = self._client()
        old, new = (s.removeprefix(f"s3://{BUCKET}/") + "/" for s in (source, target))
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=old)
        for page in pages:
            for item in page.get("Contents", []):
                client.copy_object(
                    Bucket=BUCKET,
                    Key=new + item["Key"][len(old) :],
                    CopySource={"Bucket": BUCKET, "Key": item["Key"]},
                )


def open_options(role: str) -> dict[str, Any]:
    """``castore.open`` keyword arguments for this process (``role`` names its node)."""
    spec = os.environ.get(OPEN_ENV)
    if not spec:
        return {}
    settings = json.loads(spec)
    options: dict[str, Any] = dict(settings["options"])
    if options:  # a store on blobs: this process is a node with its own index cache
        options["cache_dir"] = str(Path(settings["caches"], f"{role}-{os.getpid()}"))
    return options
