"""Import checkpoints written by other tools as generations of a castore run.

Each import is one generation published through castore's normal commit, so it
deduplicates against everything already in the store: importing a series of
old checkpoints in order writes only what changed between them.

Sources:

* safetensors: a ``.safetensors`` file, a directory with
  ``model.safetensors.index.json`` and its shards, or a directory of
  ``*.safetensors`` files. The files are memory-mapped and each tensor is a
  view of its bytes, so memory holds pages, not the model.
* ``torch.save`` files: read with ``torch.load(weights_only=True)`` only;
  castore never unpickles arbitrary objects.
* ``torch.distributed.checkpoint`` directories (a ``.metadata`` file and
  ``.distcp`` files): each saved chunk stays a box (:mod:`castore.dcp.importing`).
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from castore.errors import ImportSourceError
from castore.format.dcplayout import DCP_METADATA
from castore.format.dtypes import numpy_dtype
from castore.store import Store

INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

# safetensors' dtype tags -> castore's canonical names.
_SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header


@dataclass(frozen=True)
class ImportReport:
    """What importing one source wrote."""

    source: str
    kind: str
    run: str
    generation: int
    tensors: int
    logical_bytes: int
    new_bytes: int

    @property
    def saved_bytes(self) -> int:
        """Bytes deduplication did not have to write."""
        return max(self.logical_bytes - self.new_bytes, 0)


# -- safetensors -------------------------------------------------------------------


def safetensors_files(source: Path) -> list[Path]:
    """The files of a safetensors checkpoint: one file, an indexed set, or a directory."""
    if source.is_file():
        return [source]
    index = source / INDEX_NAME
    if index.is_file():
        names = index_files(index)
        missing = [name for name in names if not (source / name).is_file()]
        if missing:
            raise ImportSourceError(f"{index} names shard(s) that are missing: {missing}")
        return [source / name for name in names]
    files = sorted(source.glob(f"*{SAFETENSORS_SUFFIX}"))
    if not files:
        raise ImportSourceError(f"{source} holds no {INDEX_NAME} and no *.safetensors files")
    return files


def index_files(index: Path) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` maps tensors to."""
    try:
        parsed = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ImportSourceError(f"{index} is not a safetensors index: {exc}") from None
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ImportSourceError(f"{index} is not a safetensors index: no weight_map of tensors")
    names = set(weight_map.values())
    for name in names:
        if not isinstance(name, str) or not name or Path(name).name != name or name == "..":
            raise ImportSourceError(f"{index} names {name!r}, not a file next to it")
    return sorted(names)


def safetensors_header_bytes(path: Path) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file, as written; a length
    over safetensors' own bound is refused before anything is read."""
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ImportSourceError(f"{path} is not a safetensors file: too short")
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT:
            raise ImportSourceError(f"{path} is not a safetensors file: header of {length} bytes")
        return head + handle.read(length)


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, as a read-only view of the mapped file."""
    raw = safetensors_header_bytes(path)
    (length,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8:])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ImportSourceError(f"{path} is not a safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise ImportSourceError(f"{path} is not a safetensors file: its header is not a map")
    start = 8 + length
    size = path.stat().st_size
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if size > start else None
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            tensors[name] = _tensor_view(path, mapped, start, name, info)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ImportSourceError(
                f"{path}: tensor {name!r} has a malformed header entry ({exc!r})"
            ) from None
    return tensors


def _tensor_view(
    path: Path, mapped: np.ndarray | None, start: int, name: str, info: dict[str, Any]
) -> np.ndarray:
    tag = info.get("dtype")
    if tag not in _SAFETENSORS_DTYPES:
        raise ImportSourceError(f"{path}: tensor {name!r} has dtype {tag!r}, which castore lacks")
    dtype = numpy_dtype(_SAFETENSORS_DTYPES[tag])
    shape = tuple(int(n) for n in info["shape"])
    begin, end = (int(n) for n in info["data_offsets"])
    if min(shape, default=0) < 0 or not 0 <= begin <= end:
        raise ImportSourceError(f"{path}: tensor {name!r} has shape {shape}, bytes {begin}-{end}")
    if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ImportSourceError(f"{path}: tensor {name!r} has {end - begin} bytes for {shape}")
    if begin == end:
        return np.zeros(shape, dtype=dtype)
    if mapped is None or start + end > mapped.size:
        raise ImportSourceError(f"{path}: tensor {name!r} runs past the end of the file")
    return mapped[start + begin : start + end].view(dtype).reshape(shape)


def from_safetensors(
    store: Store, run: str, source: str | Path, *, step: int | None = None, progress: bool = False
) -> ImportReport:
    """Import a safetensors file or directory as the next generation of ``run``."""
    path = Path(source)
    state: dict[str, np.ndarray] = {}
    for file in safetensors_files(path):
        for name, tensor in map_safetensors(file).items():
            if name in state:
                raise ImportSourceError(f"{path}: tensor {name!r} is in more than one file")
            state[name] = tensor
    return _save(store, run, path, "safetensors", state, step, progress)


# -- torch.save --------------------------------------------------------------------


def load_weights_only(path: Path) -> Any:
    """``torch.load`` of ``path`` that never unpickles arbitrary objects.

    The zip format (torch.save's default) is memory-mapped; the legacy format
    cannot be, so it is read into memory.
    """
    import torch

    try:
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        held = f"the global {found.group(1)}" if found else "objects other than tensors"
        raise ImportSourceError(
            f"{path} is not loadable with weights_only=True (it holds {held}); "
            "castore never unpickles arbitrary objects"
        ) from None
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ImportSourceError(
            f"{path} is not a torch.save file torch can read: {first}"
        ) from None


def from_torch_save(
    store: Store, run: str, path: str | Path, *, step: int | None = None, progress: bool = False
) -> ImportReport:
    """Import a ``torch.save`` file (read with ``weights_only=True``) as the next generation."""
    source = Path(path)
    if not source.is_file():
        raise ImportSourceError(f"{source} is not a file")
    return _save(store, run, source, "torch.save", load_weights_only(source), step, progress)


# -- DCP -------------------------------------------------------------------------


def from_dcp(
    store: Store,
    run: str,
    directory: str | Path,
    *,
    step: int | None = None,
    progress: bool = False,
) -> ImportReport:
    """Import a DCP checkpoint directory as the next generation, keeping its saved boxes."""
    # Here, not at the top: castore.dcp imports torch.distributed.checkpoint, which the
    # command and the other kinds of import never need.
    from castore.dcp import importing

    source = Path(directory)
    generation, boxes, stats = importing.from_dcp(store, run, source, step=step, progress=progress)
    return ImportReport(
        source=str(source),
        kind="dcp",
        run=run,
        generation=generation,
        tensors=boxes,
        logical_bytes=stats.logical_bytes,
        new_bytes=stats.new_bytes,
    )


# -- any kind ----------------------------------------------------------------------


def source_kind(source: Path) -> str:
    """``safetensors``, ``torch.save`` or ``dcp``, from the path and a file's first bytes."""
    if not source.exists():
        raise ImportSourceError(f"{source} does not exist")
    if source.is_dir() and (source / DCP_METADATA).is_file():
        return "dcp"
    if source.is_dir():
        if (source / INDEX_NAME).is_file() or any(source.glob(f"*{SAFETENSORS_SUFFIX}")):
            return "safetensors"
        raise ImportSourceError(
            f"{source} is a directory castore cannot import: no {INDEX_NAME}, no "
            f"*.safetensors files and no DCP {DCP_METADATA}"
        )
    if source.suffix == SAFETENSORS_SUFFIX:
        return "safetensors"
    with source.open("rb") as handle:
        head = handle.read(4)
    # torch.save writes a zip archive (PK..) or, in the legacy format, a pickle (0x80).
    if head[:2] == b"PK" or head[:1] == b"\x80" or source.suffix in TORCH_SUFFIXES:
        return "torch.save"
    raise ImportSourceError(
        f"{source} is of an unknown kind: not a .safetensors file and not a torch.save file"
    )


def check_source(source: Path) -> str:
    """``source``'s kind, once what can be checked without reading its tensors is:
    for safetensors, its index and every file's header."""
    kind = source_kind(source)
    if kind == "safetensors":
        for file in safetensors_files(source):
            map_safetensors(file)
    return kind


def import_checkpoint(
    store: Store, run: str, source: str | Path, *, step: int | None = None, progress: bool = False
) -> ImportReport:
    """Import ``source``, whichever supported kind it is, as the next generation of ``run``.

    ``progress=True`` draws a bar of the tensor bytes on a terminal's stderr.
    """
    store.refuse_if_readonly("import")
    path = Path(source)
    kind = source_kind(path)
    if kind == "safetensors":
        return from_safetensors(store, run, path, step=step, progress=progress)
    if kind == "dcp":
        return from_dcp(store, run, path, step=step, progress=progress)
    return from_torch_save(store, run, path, step=step, progress=progress)


def _save(
    store: Store,
    run: str,
    source: Path,
    kind: str,
    state: Any,
    step: int | None,
    progress: bool,
) -> ImportReport:
    if step is None:
        parent = store.refs.read(run)  # default: the generation id it will get
        step = parent.generation + 1 if parent else 1
    generation = store.save(
        state,
        run=run,
        step=step,
        metadata={"imported_from": str(source), "kind": kind},
        progress=progress,
    )
    return ImportReport(
        source=str(source),
        kind=kind,
        run=run,
        generation=generation.id,
        tensors=generation.stats.tensors,
        logical_bytes=generation.logical_bytes,
        new_bytes=generation.new_bytes,
    )
