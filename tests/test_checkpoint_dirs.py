"""castore.integrations.checkpoint_dirs against what it reads: a stored tree from a store
that may be hostile, and a directory that may hold links."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from castore.errors import CorruptObjectError, ImportSourceError
from castore.integrations.checkpoint_dirs import (
    FORMAT,
    MARKER,
    VERSION,
    holds_marked,
    read_checkpoint_dir,
    write_checkpoint_dir,
)


def safetensors_file(path: Path, tensors: dict[str, np.ndarray]) -> bytes:
    """A safetensors file of float32 tensors, written by hand; its bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = struct.pack("<Q", len(text)) + text + b"".join(a.tobytes() for a in tensors.values())
    path.write_bytes(data)
    return data


def tree(files: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "files": files}


def test_a_directory_comes_back_byte_for_byte(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    weights = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    written = safetensors_file(source / "model.safetensors", weights)
    (source / "config.json").write_text('{"x": 1}')
    (source / "sub" / "big.bin.txt").write_bytes(os.urandom(100_000))  # stored chunked
    read = read_checkpoint_dir(source)
    assert isinstance(read["files"]["sub/big.bin.txt"]["data"], np.ndarray)
    back = write_checkpoint_dir(read, tmp_path / "back")
    assert (back / "model.safetensors").read_bytes() == written
    for name in ("config.json", "sub/big.bin.txt"):
        assert (back / name).read_bytes() == (source / name).read_bytes()


def test_a_link_in_the_directory_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (source / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ImportSourceError, match="symbolic link"):
        read_checkpoint_dir(source)


HEADER = struct.pack("<Q", 8) + b'{"a":{}}'
ONE = b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'


@pytest.mark.parametrize(
    "files",
    [
        {"../outside": {"kind": "bytes", "data": b"x"}},
        {"/etc/outside": {"kind": "bytes", "data": b"x"}},
        {"a//b": {"kind": "bytes", "data": b"x"}},
        {"a": {"kind": "bytes", "data": 5}},
        {"a": {"kind": "what", "data": b"x"}},
        {"a": {"kind": "torch"}},
        {"a": "not an entry"},
        {"a": {"kind": "safetensors", "header": b"short", "tensors": {}}},
        {"a": {"kind": "safetensors", "header": HEADER, "tensors": {}}},
        {"a": {"kind": "safetensors", "header": struct.pack("<Q", len(ONE)) + ONE, "tensors": {}}},
        {"a": {"kind": "safetensors", "header": struct.pack("<Q", 2) + b"[]", "tensors": {}}},
        {
            "a": {
                "kind": "safetensors",
                "header": struct.pack("<Q", len(ONE)) + ONE,
                "tensors": {"t": 7},
            }
        },
    ],
    ids=[
        "parent",
        "absolute",
        "empty-part",
        "bytes-not-bytes",
        "unknown-kind",
        "torch-without-value",
        "entry-not-a-map",
        "header-short",
        "header-entry-malformed",
        "header-names-other-tensors",
        "header-not-a-map",
        "tensor-not-an-array",
    ],
)
def test_a_hostile_tree_is_refused_and_nothing_is_written_outside(
    tmp_path: Path, files: dict[str, Any]
) -> None:
    destination = tmp_path / "out" / "checkpoint-1"
    with pytest.raises(CorruptObjectError):
        write_checkpoint_dir(tree(files), destination)
    assert not destination.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert list((tmp_path / "out").iterdir()) == []  # no temporary directory left


@pytest.mark.parametrize(
    "value",
    [None, [], {"format": FORMAT, "version": 99, "files": {}}, {"format": "x", "files": {}}],
    ids=["none", "list", "newer-version", "other-format"],
)
def test_a_generation_that_is_not_a_checkpoint_directory_is_refused(
    tmp_path: Path, value: Any
) -> None:
    with pytest.raises(CorruptObjectError):
        write_checkpoint_dir(value, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_marked_directory_holds_what_its_marker_lists(tmp_path: Path) -> None:
    """Files up to 1 MiB are checked by digest, larger ones by size and modification
    time: an edit that keeps a large file's size and time is the one not seen."""
    files = {
        "big.bin.txt": {"kind": "bytes", "data": np.full(2 << 20, 7, dtype=np.uint8)},
        "a.json": {"kind": "bytes", "data": b"{}"},
    }
    marker = {"run": "r", "generation": 3}
    path = write_checkpoint_dir(tree(files), tmp_path / "checkpoint-3", marker=marker)
    assert holds_marked(path, marker)
    assert not holds_marked(path, {**marker, "generation": 4})
    assert json.loads((path / MARKER).read_text())["files"]["a.json"]["size"] == 2

    def edit(name: str, *, time_kept: bool) -> None:
        before = (path / name).stat()
        with (path / name).open("r+b") as handle:
            handle.write(b"[]")  # same size
        later = before.st_mtime_ns + (0 if time_kept else 1_000_000_000)
        os.utime(path / name, ns=(before.st_atime_ns, later))

    edit("big.bin.txt", time_kept=False)  # a later edit: its time moved
    assert not holds_marked(path, marker)
    write_checkpoint_dir(tree(files), path, marker=marker)
    edit("a.json", time_kept=True)
    assert not holds_marked(path, marker)
    write_checkpoint_dir(tree(files), path, marker=marker)
    edit("big.bin.txt", time_kept=True)
    assert holds_marked(path, marker)  # the limit the module text states
    write_checkpoint_dir(tree(files), path, marker=marker)
    (path / "link").symlink_to(path / "a.json")
    assert not holds_marked(path, marker)
    (path / MARKER).write_text("not json")
    assert not holds_marked(path, marker)
