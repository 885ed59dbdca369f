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
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

BACKENDS = ("local", "shared", "s3")
OPEN_ENV = "CRASHDRILL_OPEN"
STORE_LEASE = 2.0  # seconds before a dead holder's store lease is broken
PART_BYTES = 8 << 10  # S3 part size and multipart threshold in the drill
BUCKET = "crashdrill"
REGION = "us-east-1"
DUMMY = "testing"


class DrillBackend:
    """One backend of the drill: store locations, their creation and copies, the server."""

    def __init__(self, kind: str, workdir: Path, codec: str | None = None) -> None:
        if kind not in BACKENDS:
            raise ValueError(f"unknown backend {kind!r}; known: {', '.join(BACKENDS)}")
        self.kind = kind
        self.codec = codec  # every store's codec (castore.format.codec); None: its default
        self.workdir = workdir
        self._server: AbstractContextManager[str] | None = None
        self.endpoint: str | None = None

    def __enter__(self) -> DrillBackend:
        settings: dict[str, Any] = {}
        if self.kind != "local":
            settings = {"store_lease": STORE_LEASE}
        if self.kind == "shared":
            settings["shared"] = True
        if self.codec is not None:
            settings["codec"] = self.codec
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
            self._server.__exit__(None, None, None)
            self._server = None

    def _start_server(self) -> None:
        # Imported here: castore.testing brings pytest and the contract suites, and
        # every process of the drill (each rank, reader, collector) imports this module.
        from castore.testing.moto import moto_server

        self._server = moto_server(min_part_size=PART_BYTES)
        try:
            self.endpoint = self._server.__enter__()
        except RuntimeError as exc:
            self._server = None
            raise SystemExit(f"crash drill: {exc}") from None
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
    if options.keys() - {"codec"}:  # a store on blobs: a node with its own index cache
        options["cache_dir"] = str(Path(settings["caches"], f"{role}-{os.getpid()}"))
    return options
