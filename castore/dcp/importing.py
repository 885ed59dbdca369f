"""Import a ``torch.distributed.checkpoint`` (DCP) directory, keeping its saved boxes.

The directory is read through DCP's own ``FileSystemReader``, except its
``.metadata`` pickle, which castore unpickles itself with only DCP's metadata
types allowed (the reader's ``pickle.load`` would run what a hostile file
names). The metadata lists every tensor's saved chunks (offsets and sizes in
the global tensor), and the reader's ``read_data`` loads each chunk with
``torch.load(weights_only=True)``.
Each saved chunk becomes one castore box (a :class:`~castore.format.objects.TensorEntry`
with the chunk's offsets and local shape) in the shard of the writer whose
``.distcp`` file held it, so the generation has the checkpoint's sharding and
world size. Chunks are read and written one at a time: memory holds one chunk.
A non-tensor item (which DCP pickles) is read with ``weights_only=True`` and
becomes a plain value. The state is nested again by the paths DCP recorded
when it flattened it (``planner_data``), as ``dcp_to_torch_save`` does.
Everything is published through castore's multi-writer commit
(:func:`castore.core.commit.publish_shards`): nothing is visible until it is complete.
"""

from __future__ import annotations

import io
import math
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from castore.core.chunkio import WriteStats, write_leaves
from castore.core.commit import build_shard, commit_objects, publish_writes
from castore.errors import ImportSourceError
from castore.format.dcplayout import DCP_METADATA
from castore.format.dtypes import name_of_torch_dtype
from castore.format.objects import TensorEntry
from castore.format.tree import TensorLeaf, encode_state, join_path, torch_bytes
from castore.store import Store, check_step
from castore.support.progress import Bar, progress_bar


class _ChunkPlanner:
    """The three calls ``FileSystemReader.read_data`` makes of a load planner.

    ``resolve_tensor`` gives the tensor a chunk is copied into; ``load_bytes``
    reads a non-tensor item with ``weights_only=True`` (DCP's default planner
    would unpickle it fully).
    """

    def __init__(self, target: Any = None) -> None:
        self.target = target
        self.value: Any = None

    def resolve_tensor(self, read_item: Any) -> Any:
        return self.target

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        pass

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        import torch

        try:
            self.value = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError:
            raise ImportSourceError(
                f"DCP item {read_item.dest_index.fqn!r} is not loadable with "
                "weights_only=True; castore never unpickles arbitrary objects"
            ) from None


# What a DCP ``.metadata`` pickle may name: its own dataclasses and the torch
# values they hold. DCP's FileSystemReader reads the file with pickle.load, which
# would run whatever a hostile file names; castore reads it with this list.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


def read_metadata(directory: Path, load_id: str) -> Any:
    """A DCP directory's ``.metadata``, unpickled with only DCP's metadata types allowed."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = directory / DCP_METADATA
    try:
        with path.open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise ImportSourceError(
            f"{path} is not DCP metadata castore reads ({exc}); castore never unpickles "
            "arbitrary objects"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise ImportSourceError(f"{path} is not DCP metadata: {exc!r}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ImportSourceError(f"{path} is not DCP metadata: it holds {type(metadata).__name__}")
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = load_id  # as FileSystemReader.read_metadata does
    metadata.storage_meta = storage_meta
    return metadata


class _DcpSource:
    """An open DCP directory: its reader, metadata and which file each item is in."""

    def __init__(self, directory: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        if not (directory / DCP_METADATA).is_file():
            raise ImportSourceError(f"{directory} is not a DCP checkpoint: no {DCP_METADATA}")
        self.directory = directory
        self.reader = FileSystemReader(str(directory))
        self.metadata = read_metadata(directory, self.reader.load_id)
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        storage = self.reader.storage_data
        files = sorted({info.relative_path for info in storage.values()})
        self.rank_of = {index: files.index(info.relative_path) for index, info in storage.items()}
        self.world_size = max(len(files), 1)
        recorded = (
            self.metadata.planner_data if isinstance(self.metadata.planner_data, dict) else {}
        )
        self.paths = {
            fqn: _path(recorded.get(fqn, (fqn,))) for fqn in self.metadata.state_dict_metadata
        }

    def tensor(self, fqn: str) -> Any:
        """The ``TensorStorageMetadata`` of the tensor saved as ``fqn``."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = self.metadata.state_dict_metadata[fqn]
        if not isinstance(meta, TensorStorageMetadata):
            raise ImportSourceError(f"DCP item {fqn!r} is not a tensor")
        return meta

    def name_of(self, fqn: str) -> str:
        """castore's tensor name (key path) for the DCP key ``fqn``."""
        name = ""
        for key in self.paths[fqn]:
            name = join_path(name, key)
        return name

    def read(self, index: Any, lengths: Any, target: Any) -> Any:
        """Read the item at ``index`` (into ``target`` for a tensor chunk); its value."""
        import torch
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        kind = LoadItemType.BYTE_IO if target is None else LoadItemType.TENSOR
        lengths = torch.Size(lengths or ())
        zeros = torch.Size([0] * len(lengths))
        item = ReadItem(kind, index, zeros, index, zeros, lengths)
        planner = _ChunkPlanner(target)
        self.reader.read_data(LoadPlan([item]), planner).wait()  # type: ignore[arg-type]
        return target if target is not None else planner.value


def from_dcp(
    store: Store,
    run: str,
    directory: str | Path,
    *,
    step: int | None = None,
    progress: bool = False,
) -> tuple[int, int, WriteStats]:
    """Import a DCP directory as the next generation of ``run``, keeping its boxes.

    Returns the generation id, the number of tensor boxes and the write stats.
    ``progress=True`` draws a bar of the saved chunks' bytes on a terminal's stderr.
    """
    started = time.perf_counter()
    source = _DcpSource(Path(directory))
    plain, tensor_names = _plain_items(source)
    flat = {fqn: _placeholder(source, fqn) for fqn in tensor_names} | plain
    encoded = encode_state(_nest(flat, source.paths))
    names = {fqn: source.name_of(fqn) for fqn in tensor_names}
    extra = [leaf for leaf in encoded.leaves if leaf.name not in set(names.values())]
    with store.save_lock():
        parent = store.refs.read(run)
        generation = parent.generation + 1 if parent else 1
        step = check_step(step if step is not None else generation)
        per_rank, stats = _write_boxes(store, source, names, extra, progress)
        writes = [
            build_shard(
                run=run,
                generation=generation,
                rank=rank,
                tensors=entries,
                local_state=b"",
                local_tensors=[],
                stats=rank_stats,
            )
            for rank, (entries, rank_stats) in enumerate(per_rank)
        ]
        commit_objects(store, [(w.digest, w.data) for w in writes])
        publish_writes(
            store,
            run=run,
            generation=generation,
            step=step,
            parent=parent,
            writes=writes,
            skeleton=encoded.skeleton,
            metadata={"imported_from": str(source.directory), "kind": "dcp"},
            seconds=time.perf_counter() - started,
        )
    return generation, sum(len(w.manifest.tensors) for w in writes), stats


def _path(recorded: Any) -> tuple[Any, ...]:
    """The key path DCP recorded for an item (a tuple or list of keys; else empty,
    which :func:`_nest` refuses)."""
    return tuple(recorded) if isinstance(recorded, tuple | list) else ()


def _nest(flat: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> dict[Any, Any]:
    """The state DCP flattened, nested again by each key's recorded path.

    As DCP's own ``set_element`` does it: a path part that is an int is a list
    index (DCP flattens lists and tuples by position, maps by their keys as
    strings), so lists come back as lists, with ``None`` in any gap.
    """
    state: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = paths[fqn]
        # A list index is below the number of items (each position holds one or
        # more), so a hostile path cannot make a list of a trillion Nones.
        if not path or not all(
            type(key) is str or (type(key) is int and 0 <= key < len(flat)) for key in path
        ):
            raise ImportSourceError(f"DCP key {fqn!r} has the path {path!r}, not one DCP writes")
        node: dict[Any, Any] | list[Any] = state
        for key, following in zip(path, path[1:], strict=False):
            node = _child(node, key, [] if type(following) is int else {}, fqn)
        _put(node, path[-1], value, fqn)
    return state


def _child(node: dict[Any, Any] | list[Any], key: Any, fresh: Any, fqn: str) -> Any:
    """The container at ``node[key]``, ``fresh`` put there if there is none yet."""
    if isinstance(node, dict):
        child = node.setdefault(key, fresh)
    else:
        _put(node, key, None, fqn, keep=True)
        if node[key] is None:
            node[key] = fresh
        child = node[key]
    if not isinstance(child, dict | list):
        raise ImportSourceError(f"DCP key {fqn!r} nests inside a value that is not a container")
    return child


def _put(
    node: dict[Any, Any] | list[Any], key: Any, value: Any, fqn: str, keep: bool = False
) -> None:
    """``node[key] = value``; a list grows to hold index ``key`` (``keep``: only grows)."""
    if isinstance(node, dict):
        node[key] = value
        return
    if type(key) is not int:
        raise ImportSourceError(f"DCP key {fqn!r} indexes a list with {key!r}")
    node.extend([None] * (key + 1 - len(node)))
    if not keep:
        node[key] = value


def _plain_items(source: _DcpSource) -> tuple[dict[str, Any], list[str]]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    plain: dict[str, Any] = {}
    tensors: list[str] = []
    for fqn, item in source.metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            index = next(i for i in source.rank_of if i.fqn == fqn)
            plain[fqn] = source.read(index, None, None)
        else:
            tensors.append(fqn)
    return plain, tensors


def _placeholder(source: _DcpSource, fqn: str) -> Any:
    """An empty tensor: it puts a torch tensor named ``fqn`` in the skeleton."""
    import torch

    return torch.empty(0, dtype=source.tensor(fqn).properties.dtype)


def _write_boxes(
    store: Store,
    source: _DcpSource,
    names: dict[str, str],
    extra: list[TensorLeaf],
    progress: bool,
) -> tuple[list[tuple[list[TensorEntry], WriteStats]], WriteStats]:
    """Write every saved chunk as a box in its writer's shard, one chunk in memory at a time."""
    per_rank: list[tuple[list[TensorEntry], WriteStats]] = [
        ([], WriteStats()) for _ in range(source.world_size)
    ]
    total = WriteStats()

    def add(rank: int, leaves: list[TensorLeaf]) -> None:
        nonlocal total
        entries, stats = write_leaves(store.backend, leaves, store.chunk_size, codec=store.codec)
        per_rank[rank][0].extend(entries)
        per_rank[rank] = (per_rank[rank][0], per_rank[rank][1] + stats)
        total += stats

    total_bytes = sum(
        math.prod(chunk.sizes) * source.tensor(fqn).properties.dtype.itemsize
        for fqn in names
        for chunk in source.tensor(fqn).chunks
    )
    with progress_bar(progress, "import", total_bytes) as bar:
        for fqn, name in names.items():
            _write_tensor(source, fqn, name, add, bar)
    if extra:
        add(0, extra)
    return per_rank, total


def _write_tensor(
    source: _DcpSource,
    fqn: str,
    name: str,
    add: Callable[[int, list[TensorLeaf]], None],
    bar: Bar,
) -> None:
    """Read each saved chunk of DCP tensor ``fqn`` and hand it to ``add`` as a box of its writer."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = source.tensor(fqn)
    dtype = name_of_torch_dtype(meta.properties.dtype, fqn)
    for chunk in meta.chunks:
        index = MetadataIndex(fqn, chunk.offsets)
        target = torch.empty(chunk.sizes, dtype=meta.properties.dtype)
        source.read(index, chunk.sizes, target)
        leaf = TensorLeaf(
            name=name,
            dtype=dtype,
            shape=tuple(meta.size),
            data=torch_bytes(target),
            framework="torch",
            offsets=tuple(chunk.offsets),
            local_shape=tuple(chunk.sizes),
            sharded=True,
        )
        add(source.rank_of.get(index, 0), [leaf])
        bar.update(target.numel() * target.element_size())
