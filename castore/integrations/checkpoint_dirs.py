"""A framework's checkpoint directory as one castore generation, and back.

Hugging Face's ``Trainer`` and Accelerate's ``save_state`` write a checkpoint
as a directory of files: safetensors weights, ``torch.save`` pickles of the
optimizer, scheduler and RNG states, JSON. :func:`read_checkpoint_dir` turns
such a directory into a state castore stores without pickle, each file by its
kind, so its tensors are chunked and deduplicated against every earlier save:

* ``*.safetensors``: the file's header, verbatim, and every tensor it holds,
  memory-mapped (:func:`castore.importer.map_safetensors` checks the header);
  written back, the file is byte for byte the one read.
* ``*.pt``, ``*.pth``, ``*.bin``, ``*.pkl``: read only with
  ``torch.load(weights_only=True)`` and the safe globals the framework itself
  allows when it loads them (numpy's RNG state); stored as the tree they hold
  (tensors, numpy arrays, plain values). A file that loader refuses raises
  :class:`~castore.errors.ImportSourceError` naming it; castore never
  unpickles an arbitrary object. Written back with ``torch.save``.
* anything else (JSON, text, a tokenizer's files): its bytes.

:func:`write_checkpoint_dir` materialises a stored tree as the directory the
framework reads, into a temporary sibling renamed into place, so a directory
at the destination is always whole. Its marker file names the generation and
lists every file it wrote (size, modification time, and the blake3 digest of
each file up to 1 MiB); :func:`holds_marked` checks a directory still holds
exactly that, so one changed, truncated or removed since is restored again.
A file over 1 MiB edited with its size and modification time kept is the one
change not seen: it is not read, so that a check costs no pass over the weights.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from castore.errors import CommitUnknownError, CorruptObjectError, ImportSourceError
from castore.format.hashing import digest_of
from castore.importer import load_weights_only, map_safetensors, safetensors_header_bytes
from castore.support.safefs import fsync_dir, write_all

FORMAT = "castore-checkpoint-dir"
VERSION = 1
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# A materialised directory names the generation it holds in this file (never stored).
MARKER = ".castore-checkpoint.json"
# Files at most this large have their digest in the marker: checked at every restore
# for the cost of reading them (the RNG states, the scheduler, JSON); larger ones
# (weights, optimizer) by size and modification time.
_DIGESTED_LIMIT = 1 << 20
# Files at most this large are stored as plain bytes in the state; larger ones as a
# uint8 tensor, chunked and deduplicated like every other tensor.
_INLINE_LIMIT = 64 << 10


def read_checkpoint_dir(
    directory: Path,
    *,
    safe_globals: Iterable[Any] = (),
    skip: Callable[[str], bool] = lambda name: False,
) -> dict[str, Any]:
    """The state castore stores for ``directory``: every file under it, by its kind.

    ``safe_globals`` are added to torch's ``weights_only`` allowlist while the
    pickled files load; ``skip(relative_path)`` leaves a file out.
    """
    if not directory.is_dir():
        raise ImportSourceError(f"{directory} is not a checkpoint directory")
    files: dict[str, Any] = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_symlink():  # checked first: a link to a directory is not walked
            raise ImportSourceError(f"{path} is a symbolic link: castore stores only files")
        if path.is_dir() or path.name == MARKER or skip(relative):
            continue
        if not path.is_file():
            raise ImportSourceError(f"{path} is not a regular file: castore stores only files")
        files[relative] = _read_file(path, list(safe_globals))
    return {"format": FORMAT, "version": VERSION, "files": files}


def _read_file(path: Path, safe_globals: list[Any]) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        return {
            "kind": "safetensors",
            "header": safetensors_header_bytes(path),
            "tensors": map_safetensors(path),
        }
    if path.suffix in PICKLE_SUFFIXES:
        import torch

        with torch.serialization.safe_globals(safe_globals):
            return {"kind": "torch", "value": load_weights_only(path)}
    data = path.read_bytes()
    if len(data) > _INLINE_LIMIT:
        return {"kind": "bytes", "data": np.frombuffer(data, dtype=np.uint8)}
    return {"kind": "bytes", "data": data}


class Background:
    """One store of a checkpoint directory on a thread of its own; ``result()`` joins it and
    raises what it raised. Not a daemon: a process that ends while it runs waits for
    the save to publish, and if it failed and nobody asked, says so on stderr at exit."""

    def __init__(self, work: Callable[[], Any], name: str) -> None:
        self._work = work
        self.name = name
        self._outcome: tuple[bool, Any] = (False, None)
        self._collected = False
        self._thread = threading.Thread(target=self._run, name=name)
        _UNCOLLECTED.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome = (True, self._work())
        except BaseException as exc:  # handed to result()
            self._outcome = (False, exc)

    def result(self) -> Any:
        self._thread.join()
        _UNCOLLECTED.discard(self)
        done, value = self._outcome
        if not done:
            raise value
        return value


_UNCOLLECTED: set[Background] = set()


@atexit.register
def _say_what_failed() -> None:
    """Runs after the interpreter joined every non-daemon thread: a store nobody waited
    for (training ended by an exception) that failed did not publish; say so."""
    for job in list(_UNCOLLECTED):
        done, value = job._outcome
        if not done:
            # A commit whose answer was lost may yet be published: never say it was not.
            outcome = (
                "may or may not be published"
                if isinstance(value, CommitUnknownError)
                else "was not published"
            )
            print(
                f"castore: {job.name} failed and {outcome}: {type(value).__name__}: {value}",
                file=sys.stderr,
            )


def write_checkpoint_dir(
    tree: Any, destination: Path, *, marker: dict[str, Any] | None = None
) -> Path:
    """Write a tree :func:`read_checkpoint_dir` made as ``destination``, replacing
    whatever is there; ``marker`` (plain values) goes to its :data:`MARKER` file."""
    files = _files_of(tree)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temp = destination.with_name(f".{destination.name}.castore-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        for relative, entry in files.items():
            target = temp / _safe_relative(relative)
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_file(target, relative, entry)
        if marker is not None:
            marker = {**marker, "files": inventory(temp)}
            _write_bytes(temp / MARKER, (json.dumps(marker, indent=2) + "\n").encode())
        fsync_dir(temp)
        if destination.exists():
            old = destination.with_name(f".{destination.name}.replaced-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(destination, old)
            os.replace(temp, destination)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(temp, destination)
        fsync_dir(destination.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return destination


def holds_marked(directory: Path, marker: dict[str, Any]) -> bool:
    """Whether ``directory`` is one :func:`write_checkpoint_dir` wrote with ``marker``
    and still holds exactly the files it wrote there (none changed, added or removed)."""
    try:
        found = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(found, dict) or {k: found.get(k) for k in marker} != marker:
        return False
    try:
        return inventory(directory) == found.get("files")
    except OSError:  # removed or replaced while we looked: not what was written
        return False


def inventory(directory: Path) -> dict[str, Any] | None:
    """Each file under ``directory`` but the marker: its size, modification time and, up
    to :data:`_DIGESTED_LIMIT` bytes, blake3 digest; None if it holds anything but
    directories and regular files (a link)."""
    files: dict[str, Any] = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode) or path == directory / MARKER:
            continue
        if not stat.S_ISREG(info.st_mode):
            return None
        entry: dict[str, Any] = {"size": info.st_size, "mtime_ns": info.st_mtime_ns}
        if info.st_size <= _DIGESTED_LIMIT:
            entry["blake3"] = digest_of(path.read_bytes()).hex
        files[path.relative_to(directory).as_posix()] = entry
    return files


def _files_of(tree: Any) -> dict[str, Any]:
    if (
        not isinstance(tree, dict)
        or tree.get("format") != FORMAT
        or not isinstance(tree.get("files"), dict)
    ):
        raise CorruptObjectError("this generation is not a checkpoint directory castore stored")
    if tree.get("version") != VERSION:
        raise CorruptObjectError(
            f"checkpoint directory version {tree.get('version')!r}, this castore reads {VERSION}"
        )
    return tree["files"]


def _safe_relative(relative: Any) -> str:
    parts = relative.split("/") if isinstance(relative, str) else []
    if not parts or any(part in ("", ".", "..") for part in parts) or "\\" in relative:
        raise CorruptObjectError(f"checkpoint file name {relative!r} is not a relative path")
    return relative


def _write_file(target: Path, relative: str, entry: Any) -> None:
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind == "safetensors":
        _write_safetensors(target, relative, entry.get("header"), entry.get("tensors"))
    elif kind == "torch" and "value" in entry:
        import torch

        torch.save(entry["value"], target)  # by path: the archive is named as the original
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    elif kind == "bytes" and isinstance(entry.get("data"), (bytes, np.ndarray)):
        data = entry["data"]
        _write_bytes(target, data if isinstance(data, bytes) else _raw(data))
    else:
        raise CorruptObjectError(f"checkpoint file {relative!r} is of unknown kind {kind!r}")


def _write_safetensors(target: Path, relative: str, header: Any, tensors: Any) -> None:
    """The file as read: its header verbatim, then each tensor at the offsets it names."""
    try:
        (length,) = struct.unpack("<Q", header[:8])
        entries = json.loads(header[8:])
        placed = sorted(
            (int(info["data_offsets"][0]), int(info["data_offsets"][1]), name)
            for name, info in entries.items()
            if name != "__metadata__"
        )
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, struct.error) as exc:
        raise CorruptObjectError(f"checkpoint file {relative!r}: a bad header ({exc!r})") from None
    if (
        length != len(header) - 8
        or not isinstance(tensors, dict)
        or set(tensors) != {name for _, _, name in placed}
    ):
        raise CorruptObjectError(f"checkpoint file {relative!r}: header and tensors disagree")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, header)
        written = 0
        for begin, end, name in placed:
            data = _raw(tensors[name])
            if begin != written or end - begin != data.nbytes:
                raise CorruptObjectError(
                    f"checkpoint file {relative!r}: tensor {name!r} is not bytes {begin}-{end}"
                )
            write_all(fd, data.data)
            written = end
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw(array: Any) -> np.ndarray:
    """The bytes of a numpy array or a torch tensor, as a flat uint8 array."""
    if not isinstance(array, np.ndarray):
        if not hasattr(array, "contiguous"):  # a stored tree with a plain value here
            raise CorruptObjectError(f"a checkpoint tensor is a {type(array).__name__}")
        array = array.contiguous().view(-1).view(dtype=_torch_uint8()).numpy()
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


def _write_bytes(target: Path, data: bytes | np.ndarray) -> None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data.data if isinstance(data, np.ndarray) else data)
        os.fsync(fd)
    finally:
        os.close(fd)
