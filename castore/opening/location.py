"""Where a store lives: a path, a ``file://`` URL, or a URL of a backend castore knows.

``castore.open`` takes a local path (``./ckpt``, ``pathlib.Path``), a
``file://`` URL, or ``s3://BUCKET/PREFIX`` (S3-protocol object storage).
The scheme is parsed here, once, so that an address castore cannot serve is
refused with one clear error instead of being taken for a directory name
(``castore.open("s3://bucket/x")`` must never create ``./s3:/bucket/x``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from castore.errors import UnsupportedBackendError

# RFC 3986: a scheme is a letter, then letters, digits, "+", "-" or ".".
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Backends the format names but this castore cannot open yet: said as such.
PLANNED_SCHEMES: dict[str, str] = {}
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class Location:
    """A parsed store address: ``"file"`` with a local ``path``, or ``"s3"`` with a bucket."""

    scheme: str
    path: Path
    bucket: str = ""
    prefix: str = ""  # "" or ends with "/"

    @property
    def url(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return str(self.path)


def parse_location(target: str | os.PathLike[str]) -> Location:
    """A store address as a Location; raises UnsupportedBackendError for other schemes."""
    if isinstance(target, os.PathLike):
        return Location("file", Path(target))
    if not isinstance(target, str):
        raise TypeError(f"a store is named by a path or a URL string, not {type(target).__name__}")
    match = _URL.match(target)
    if match is None:
        return Location("file", Path(target))
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(target)
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedBackendError(
                f"{target!r}: a file:// URL names a path on this machine (file:///abs/path), "
                f"not on host {parts.netloc!r}",
                path=target,
            )
        if not parts.path:
            raise UnsupportedBackendError(f"{target!r}: the file:// URL has no path", path=target)
        return Location("file", Path(unquote(parts.path)))
    if scheme == "s3":
        return _s3_location(target)
    if scheme in PLANNED_SCHEMES:
        raise UnsupportedBackendError(
            f"{target!r}: {PLANNED_SCHEMES[scheme]} ({scheme}://) is not supported by this "
            "castore yet; open a local path or a file:// URL",
            path=target,
        )
    raise UnsupportedBackendError(
        f"{target!r}: unknown store scheme {scheme!r}; castore opens a local path, a file:// "
        "URL or s3://BUCKET/PREFIX",
        path=target,
    )


def _s3_location(target: str) -> Location:
    parts = urlsplit(target)
    bucket = parts.netloc
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise UnsupportedBackendError(
            f"{target!r}: {bucket!r} is not an S3 bucket name (3-63 characters: lowercase "
            "letters, digits, dots and hyphens); write s3://BUCKET/PREFIX",
            path=target,
        )
    if parts.query or parts.fragment:
        raise UnsupportedBackendError(
            f"{target!r}: an s3:// URL takes no query or fragment", path=target
        )
    prefix = unquote(parts.path).strip("/")
    return Location("s3", Path(), bucket=bucket, prefix=f"{prefix}/" if prefix else "")
