"""Stores on blobs for the tests: a shared directory or an S3 prefix, opened and damaged alike.

A :class:`Place` names one format-3 store: how to open it in this process,
the environment a ``castore`` subprocess needs to reach it (an S3 store's
endpoint and credentials come from boto3's chain there), and raw access to
its blobs, beneath castore, to damage them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import castore
from castore import Store

# Runs several CLI commands in one interpreter (boto3 and numpy load once, ~1 s a
# process): each is castore.cli.main, exactly what the console script calls.
_DRIVER = """
import contextlib, io, json, sys
import castore.cli
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = castore.cli.main(argv)
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
print(json.dumps(results))
"""


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


@dataclass
class Place:
    """A format-3 store's address and the ways to reach it."""

    kind: str  # "shared" or "s3"
    address: str  # a directory, or s3://BUCKET/PREFIX
    options: dict[str, Any] = field(default_factory=dict)  # castore.open keywords
    env: dict[str, str] = field(default_factory=dict)  # a subprocess's way to the store
    client: Any = None  # a boto3 client (S3 only)
    bucket: str = ""
    prefix: str = ""

    def open(self, **extra: Any) -> Store:
        return castore.open(self.address, **self.options, **extra)

    def names(self, prefix: str) -> list[str]:
        """The blob names under ``prefix``, sorted (raw: not through castore)."""
        if self.kind == "shared":
            top = Path(self.address)
            found = (top / prefix).rglob("*") if (top / prefix).is_dir() else []
            return sorted(
                str(p.relative_to(top)) for p in found if p.is_file() and not p.name.startswith(".")
            )
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + prefix)
        return sorted(e["Key"][len(self.prefix) :] for e in listed.get("Contents", []))

    def read(self, name: str) -> bytes:
        if self.kind == "shared":
            return (Path(self.address) / name).read_bytes()
        return bytes(
            self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read()
        )

    def rewrite(self, name: str, data: bytes) -> None:
        """Replace a blob's bytes behind castore's back (damage: blobs are never rewritten)."""
        if self.kind == "shared":
            path = Path(self.address) / name
            if path.exists():
                path.chmod(0o644)
            path.write_bytes(data)
        else:
            self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data)

    def cli(self, *commands: Sequence[object], timeout: float = 120) -> list[CliResult]:
        """Run each command (argv after ``castore``) in one ``python`` subprocess."""
        argvs = [[str(a) for a in command] for command in commands]
        completed = subprocess.run(
            [sys.executable, "-c", _DRIVER, json.dumps(argvs)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.cli_env(),
        )
        assert completed.returncode == 0, completed.stderr
        return [CliResult(**r) for r in json.loads(completed.stdout.splitlines()[-1])]

    def cli_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def s3_env(endpoint: str) -> dict[str, str]:
    """boto3's chain, in the environment, reaching the test server."""
    from s3_server import DUMMY_KEY, DUMMY_SECRET, REGION

    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": DUMMY_KEY,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def shared_place(path: Path) -> Place:
    return Place("shared", str(path), options={"shared": True})


def s3_place(endpoint: str, bucket: str, prefix: str = "ckpt") -> Place:
    from s3_server import s3_client, store_arguments

    arguments = store_arguments(endpoint)
    options = {
        "endpoint_url": arguments.pop("endpoint_url"),
        "region": arguments.pop("region"),
        "s3_options": arguments,
    }
    return Place(
        "s3",
        f"s3://{bucket}/{prefix}",
        options=options,
        env=s3_env(endpoint),
        client=s3_client(endpoint),
        bucket=bucket,
        prefix=f"{prefix}/",
    )
