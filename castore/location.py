"""Where a store lives: a path, a ``file://`` URL, or a URL of a backend castore knows.

``castore.open`` takes a local path (``./ckpt``, ``pathlib.Path``) or a URL.
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
PLANNED_SCHEMES = {
    "s3": "S3-protocol object storage",
}


@dataclass(frozen=True)
class Location:
    """A parsed store address: ``scheme`` ``"file"`` with a local ``path``."""

    scheme: str
    path: Path


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
    if scheme in PLANNED_SCHEMES:
        raise UnsupportedBackendError(
            f"{target!r}: {PLANNED_SCHEMES[scheme]} ({scheme}://) is not supported by this "
            "castore yet; open a local path or a file:// URL",
            path=target,
        )
    raise UnsupportedBackendError(
        f"{target!r}: unknown store scheme {scheme!r}; castore opens a local path or a file:// URL",
        path=target,
    )
