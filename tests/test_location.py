"""castore.open takes a path or a URL; a URL castore cannot serve is one clear error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

import castore
from castore.errors import StoreError, UnsupportedBackendError
from castore.opening.location import parse_location


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("s3://B_ucket/prefix", "is not an S3 bucket name"),
        ("s3://bucket/prefix?versionId=3", "takes no query"),
        ("gs://bucket/prefix", "unknown store scheme 'gs'"),
        ("https://example.com/ckpt", "unknown store scheme 'https'"),
        ("file://otherhost/ckpt", "not on host 'otherhost'"),
        ("file://", "has no path"),
    ],
)
def test_an_address_castore_cannot_open_is_refused_and_creates_nothing(
    url: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedBackendError, match=says) as caught:
        castore.open(url)
    assert isinstance(caught.value, StoreError) and isinstance(caught.value, ValueError)
    assert list(tmp_path.iterdir()) == []  # no ./s3:/bucket/prefix directory


def test_file_urls_and_paths_open_the_same_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "my store"
    with castore.open(path) as store:
        store.save({"x": np.arange(4)}, run="r", step=1)
    for address in (
        f"file://{path}",
        f"file://localhost{path}",
        "file://" + str(path).replace(" ", "%20"),
        str(path),
    ):
        with castore.open(address, create=False) as store:
            assert store.resolve("r").id == 1, address
    monkeypatch.chdir(tmp_path)
    with castore.open("my store", create=False) as store:  # relative, no scheme: a path
        assert store.resolve("r").id == 1
    assert parse_location("s3:/not-a-url").path == Path("s3:/not-a-url")  # one slash: a path


@pytest.mark.parametrize(
    ("url", "bucket", "prefix"),
    [
        ("s3://bucket", "bucket", ""),
        ("s3://bucket/", "bucket", ""),
        ("S3://my.bucket/a/b/", "my.bucket", "a/b/"),
        ("s3://bucket/runs%20x", "bucket", "runs x/"),
    ],
)
def test_s3_urls_name_a_bucket_and_a_prefix(url: str, bucket: str, prefix: str) -> None:
    location = parse_location(url)
    assert (location.scheme, location.bucket, location.prefix) == ("s3", bucket, prefix)
    assert location.url.startswith(f"s3://{bucket}")


def test_a_marker_naming_another_backend_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    castore.open(path).close()
    marker = path / "castore.json"
    config = json.loads(marker.read_text())
    config["backend"] = "s3"
    marker.write_text(json.dumps(config))
    with pytest.raises(UnsupportedBackendError, match="names backend 's3'"):
        castore.open(path)


def test_the_cli_says_so_in_one_line(tmp_path: Path) -> None:
    result = run_cli("log", "gs://bucket/ckpt", env=os.environ, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "UnsupportedBackendError" in result.stderr and "gs://" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_options_of_the_other_kind_of_store_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="options of stores on blobs") as caught:
        castore.open(tmp_path / "local", cache_dir=tmp_path / "cache")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "local").exists()  # refused before anything was made
    castore.open(tmp_path / "shared", shared=True).close()
    with pytest.raises(ValueError, match="map_size sizes a local store's LMDB file"):
        castore.open(tmp_path / "shared", map_size=1 << 30)
