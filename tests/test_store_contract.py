"""A whole store end to end (castore.testing.StoreTests): on disk, in memory and on blobs.

Format 3 runs it three ways, as users open it: memory blobs through
``open_blob_store``, a shared directory through ``castore.open(path,
shared=True)`` and S3 (moto on the loopback) through
``castore.open("s3://...")``, with packs of a few KiB.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import castore
from castore import Store
from castore.blob import MemoryBlobStore
from castore.errors import UnsupportedOperationError
from castore.gc import RetentionPolicy, collect_garbage
from castore.opening import memory_store, open_blob_store
from castore.repo.memory import MemoryRefStore
from castore.testing import StoreTests
from castore.verify import verify_store

try:
    import s3_server
except pytest.skip.Exception:  # boto3 or moto is not installed: the S3 store skips
    s3_server = None

CHUNK = 1024
PACK = 4096


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        with castore.open(tmp_path / "store", chunk_size=CHUNK) as opened:
            yield opened


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        with memory_store(chunk_size=CHUNK, name="contract") as opened:
            yield opened


class TestBlobStoreInMemory(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        blobs = MemoryBlobStore(list_page_size=7)
        with open_blob_store(
            blobs, "memory://test", chunk_size=CHUNK, pack_bytes=PACK, cache_dir=tmp_path
        ) as opened:
            yield opened


class TestSharedDirectoryStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        with castore.open(
            tmp_path / "shared", shared=True, chunk_size=CHUNK, pack_bytes=PACK
        ) as opened:
            yield opened


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, request: pytest.FixtureRequest) -> Iterator[Store]:
        if s3_server is None:
            pytest.skip("boto3 and moto are needed for the S3 store")
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        arguments = s3_server.store_arguments(endpoint)
        credentials = {"access_key": arguments["access_key"], "secret_key": arguments["secret_key"]}
        with castore.open(
            f"s3://{bucket}/p",
            shared=True,  # accepted: a store on S3 is always shared
            endpoint_url=endpoint,
            region=arguments["region"],
            s3_options=credentials,
            chunk_size=CHUNK,
            pack_bytes=PACK,
        ) as opened:
            yield opened


def test_a_memory_store_keeps_nothing_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = memory_store(chunk_size=64, name="scratch")
    assert isinstance(store.refs, MemoryRefStore)
    store.save({"w": np.arange(100, dtype=np.float32)}, run="r", step=1)
    store.save({"w": np.arange(100, dtype=np.float32) + 1}, run="r", step=2)
    collect_garbage(store, RetentionPolicy(keep_last=1))
    assert verify_store(store, deep=True).ok
    assert list(tmp_path.iterdir()) == []
    assert repr(store) == "<castore.Store 'memory:scratch'>"
    assert store.backend.file_bytes() == 0


def test_a_memory_store_says_in_one_line_what_it_cannot_do() -> None:
    store = memory_store()
    with pytest.raises(UnsupportedOperationError) as caught:
        store.refs.reflog_path("r")
    assert str(caught.value) == "a reflog file path is not supported by the in-memory backend"


def test_memory_store_refuses_a_bad_chunk_size() -> None:
    for bad in (0, -1, True, 1.5, 1 << 40):
        with pytest.raises(ValueError, match="chunk_size"):
            memory_store(chunk_size=bad)  # type: ignore[arg-type]


def test_castore_and_its_memory_store_import_neither_pytest_nor_torch() -> None:
    script = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import numpy as np, castore, castore.gc, castore.verify\n"
        "from castore.repo.memory import memory_store\n"  # the documented path
        "import castore.opening\n"
        "assert memory_store is castore.opening.memory_store\n"
        "store = memory_store(chunk_size=64)\n"
        "store.save({'w': np.arange(10.0)}, run='r', step=1)\n"
        "assert 'pytest' not in sys.modules, 'castore imported pytest'\n"
        "import castore.testing\n"
        "assert 'pytest' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
