"""Which generations a fast tier lists but does not hold the chunks of ("held elsewhere").

A fast tier (castore.tiers) lists every generation of its runs, so that
history, ids and restores work from it alone. When it takes a generation's
history from another tier (a new or wiped node takes the durable tier's
newest, so that its next save follows it), it copies the root and the shard
manifests only: the chunks stay where they are, and a read finds them there.
This record says so, so that ``verify`` reports those chunks as held
elsewhere, not missing. It is a claim about where to look, never evidence:
every byte read from anywhere is still verified against its name.

A job on several nodes (each node its own fast tier) writes such a record
on every node for every generation it saves, naming the shards (saved ranks)
the node holds: its own ranks' and, with peer copies, its peers'. The rest
of the generation's chunks are on other nodes or in the durable tier.

One file per generation, ``tiers/elsewhere/RUN/<12-digit id>`` in the store
directory: one line of JSON ``{"v": 1, "run", "generation", "root"}`` (and
``"held": [shard indices]`` when the node holds some shards; absent: none),
then a tab and the blake3 hex (32 digits) of the JSON. Written to a temporary
file, fsynced, renamed, the directory fsynced. A record whose root is not the
generation's is ignored (the id was reused by another history). A generation
without a record is held whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from castore.errors import CorruptObjectError
from castore.format.hashing import Digest, digest_bytes
from castore.repo.records import validate_run_name
from castore.repo.reffile import replace_file
from castore.support.safefs import is_store_dir, make_store_dir, read_store_file

DIRECTORY = ("tiers", "elsewhere")


def _path(store_dir: Path, run: str, generation: int) -> Path:
    return store_dir.joinpath(*DIRECTORY, run, f"{generation:012d}")


def record_dir(store_dir: Path, run: str, *, create: bool) -> Path | None:
    """``tiers/elsewhere/RUN`` in ``store_dir`` (None if absent and not ``create``).

    Every level must be a real directory: a symlink or other file there raises
    UnsafeStoreFileError, so nothing is read, written or deleted outside the store.
    """
    path = store_dir
    for part in (*DIRECTORY, validate_run_name(run)):
        path = path / part
        if create:
            make_store_dir(path)
        elif not is_store_dir(path):
            return None
    return path


def _checksum(text: str) -> str:
    return digest_bytes(text.encode()).hex()[:32]


def mark_elsewhere(
    store_dir: Path, run: str, generation: int, root: Digest, held: list[int] | None = None
) -> None:
    """Record that ``run@generation`` (root ``root``) has its chunks in another tier,
    but for those of the shards ``held`` (saved rank indices; None: none)."""
    record: dict[str, object] = {"v": 1, "run": run, "generation": generation, "root": root.hex}
    if held:
        record["held"] = sorted(set(held))
    text = json.dumps(record, sort_keys=True)
    record_dir(store_dir, run, create=True)
    path = _path(store_dir, run, generation)
    replace_file(
        path, f"{text}\t{_checksum(text)}\n".encode(), phase="recording a generation held elsewhere"
    )


def held_elsewhere(store_dir: Path, run: str, generation: int, root: Digest) -> bool:
    """Whether the store at ``store_dir`` records ``run@generation`` as held elsewhere
    (some or all of its shards).

    Raises CorruptObjectError for a record that is not what this module writes.
    """
    return held_shards(store_dir, run, generation, root) is not None


def held_shards(store_dir: Path, run: str, generation: int, root: Digest) -> set[int] | None:
    """The shards of ``run@generation`` the store holds, by its record; None: no record
    (the generation is held whole).

    Raises CorruptObjectError for a record that is not what this module writes.
    """
    if record_dir(store_dir, run, create=False) is None:
        return None
    path = _path(store_dir, run, generation)
    try:
        data = read_store_file(path, limit=1 << 20)
    except (FileNotFoundError, NotADirectoryError):
        return None
    where = {"run": run, "generation": generation, "path": str(path)}
    try:
        text, _, checksum = data.decode().rstrip("\n").partition("\t")
        if checksum != _checksum(text):
            raise ValueError("its checksum does not match")
        record = json.loads(text)
        if not isinstance(record, dict) or record.get("v") != 1:
            raise ValueError("it is not a version 1 record")
        named = (record.get("run"), record.get("generation"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptObjectError(f"the held-elsewhere record is damaged: {exc}", **where) from exc
    if named != (run, generation):
        raise CorruptObjectError("the held-elsewhere record names another generation", **where)
    held = record.get("held", [])
    if not isinstance(held, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 20 for i in held
    ):
        raise CorruptObjectError("the held-elsewhere record's shard list is not one", **where)
    if record.get("root") != root.hex:
        return None
    return set(held)


def forget_elsewhere(store_dir: Path, run: str, keep: set[int]) -> list[int]:
    """Remove the records of ``run`` whose generation is not in ``keep`` (collected ones).

    Returns the ids whose records were removed.
    """
    directory = record_dir(store_dir, run, create=False)
    if directory is None:
        return []
    names = sorted(os.listdir(directory))
    removed = []
    for name in names:
        if len(name) == 12 and name.isdigit() and int(name) not in keep:
            (directory / name).unlink(missing_ok=True)
            removed.append(int(name))
    return removed
