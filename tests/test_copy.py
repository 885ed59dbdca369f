"""``castore copy``: generations copied between two real LMDB stores.

Only the chunks the destination lacks travel, each re-hashed before it is
written; each generation is published at the destination with the same root
digest; a damaged source publishes nothing; a killed copy resumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import clean_env, run_cli
from test_progress import assert_reaches_100_once, bar_frames

import castore
from castore import Store, copying, retention
from castore.chunkstore.base import Namespace
from castore.errors import (
    ChecksumMismatchError,
    NotAStoreError,
    RefConflictError,
)
from castore.format.hashing import Digest
from castore.verify import verify_store

CHUNK = 1024


def state(i: int) -> dict[str, Any]:
    """Generation i: ``frozen`` never changes, ``w`` changes every generation, ``b`` sometimes."""
    rng = np.random.default_rng(i)
    return {
        "frozen": np.arange(8192, dtype=np.float32),
        "w": rng.standard_normal(3000).astype(np.float32),
        "b": np.full(2500, i // 2, dtype=np.int16),
        "step": i,
        "note": f"gen {i}",
    }


def save_generations(store: Store, ids: range, run: str = "exp") -> None:
    for i in ids:
        store.save(state(i), run=run, step=i * 10)


def assert_bitwise(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_bitwise(actual[key], expected[key])
    elif isinstance(expected, np.ndarray):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
        assert actual.tobytes() == expected.tobytes()
    else:
        assert actual == expected


def chunk_lengths(store: Store, run: str, gen: int | str) -> dict[bytes, int]:
    """Every distinct chunk a generation names, with its length."""
    digest, root = store.resolve_root(run, gen)
    found: dict[bytes, int] = {}
    for shard in store.read_shards(root):
        for entry in shard.tensors + shard.local_tensors:
            for index, key in enumerate(entry.chunks):
                found[key] = min(entry.chunk_size, entry.nbytes - index * entry.chunk_size)
    return found


def cli(*args: object, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=clean_env(**env), timeout=120)


@pytest.fixture
def src(tmp_path: Path) -> Any:
    store = castore.open(tmp_path / "src", chunk_size=CHUNK)
    save_generations(store, range(1, 5))
    yield store
    store.close()


@pytest.fixture
def dst_path(tmp_path: Path) -> Path:
    return tmp_path / "dst"


# -- what is copied ---------------------------------------------------------------------------


def test_copy_latest_publishes_the_same_root_and_dst_history_works(
    src: Store, dst_path: Path
) -> None:
    report = castore.copy(src, dst_path)
    latest = src.resolve("exp")
    assert [(g.id, g.root, g.copied) for g in report.generations] == [(4, latest.root, True)]
    assert report.generations[0].parent_marked
    with castore.open(dst_path, create=False) as dst:
        assert dst.refs.read("exp").root.hex == latest.root
        assert [(g.id, g.root, g.step, g.parent) for g in dst.generations("exp")] == [
            (4, latest.root, latest.step, latest.parent)
        ]
        assert_bitwise(dst.load("exp"), state(4))
        report_deep = verify_store(dst, deep=True)
        assert report_deep.problems == [] and report_deep.generations == 1
        # The parent is logged as not held here, before the child's advance.
        actions = [(r["action"], r["root"]) for r in dst.refs.reflog("exp")]
        assert actions == [("collect", latest.parent), ("advance", latest.root)]
        plans = retention.collect_garbage(dst, retention.RetentionPolicy(keep_last=1)).plans
        assert [g.id for g in plans[0].generations] == [4]
    log = cli("log", dst_path)
    assert log.returncode == 0 and latest.root[:12] in log.stdout, log.stderr
    assert cli("verify", dst_path, "--deep").returncode == 0


def test_copy_all_copies_every_generation_bitwise_with_its_digest(
    src: Store, dst_path: Path
) -> None:
    report = castore.copy(src, dst_path, all_generations=True)
    assert [g.id for g in report.copied] == [1, 2, 3, 4]
    assert not any(g.parent_marked for g in report.generations)
    with castore.open(dst_path, create=False) as dst:
        assert [(g.id, g.root, g.parent) for g in dst.generations("exp")] == [
            (g.id, g.root, g.parent) for g in src.generations("exp")
        ]
        for i in range(1, 5):
            assert_bitwise(dst.load("exp", i), state(i))
        assert verify_store(dst, deep=True).problems == []
    # Shared chunks travel once: the bytes moved are the distinct chunks of all four.
    distinct: dict[bytes, int] = {}
    for i in range(1, 5):
        distinct.update(chunk_lengths(src, "exp", i))
    assert report.bytes_copied == sum(distinct.values())
    assert report.chunks_copied == len(distinct)
    assert report.bytes_copied < report.logical_bytes


def test_an_incremental_copy_transfers_only_the_new_chunks(
    src: Store, dst_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    castore.copy(src, dst_path, all_generations=True)
    save_generations(src, range(5, 6))
    old = chunk_lengths(src, "exp", 4)
    new = chunk_lengths(src, "exp", 5)
    lacking = {k: n for k, n in new.items() if k not in old}
    read: list[bytes] = []
    read_many = src.backend.read_many

    def counted(namespace: Namespace, keys: Any, sink: Any) -> None:
        if namespace is Namespace.CHUNKS:
            read.extend(keys)
        read_many(namespace, keys, sink)

    monkeypatch.setattr(src.backend, "read_many", counted)
    report = castore.copy(src, dst_path)
    assert sorted(read) == sorted(lacking)  # SRC reads only what DST lacks
    [gen] = report.generations
    assert (gen.id, gen.copied, gen.parent_marked) == (5, True, False)
    assert gen.bytes_copied == sum(lacking.values()) > 0
    assert gen.chunks_copied == len(lacking)
    assert gen.chunks_skipped == len(new) - len(lacking) > 0
    assert gen.logical_bytes == sum(new.values())
    # Nothing left to copy: a rerun transfers nothing.
    again = castore.copy(src, dst_path)
    assert [(g.id, g.copied) for g in again.generations] == [(5, False)]
    assert again.bytes_copied == 0
    with castore.open(dst_path, create=False) as dst:
        assert_bitwise(dst.load("exp"), state(5))


def test_one_generation_by_tag_and_every_run(src: Store, dst_path: Path) -> None:
    save_generations(src, range(1, 3), run="other")
    retention.tag(src, "exp", 2, "best")
    report = castore.copy(src, dst_path, run="exp", generation="best")
    assert [(g.run, g.id) for g in report.generations] == [("exp", 2)]
    report = castore.copy(src, dst_path)  # the latest of each run
    assert [(g.run, g.id) for g in report.generations] == [("exp", 4), ("other", 2)]
    with castore.open(dst_path, create=False) as dst:
        assert [g.id for g in dst.generations("exp")] == [2, 4]
        assert dst.refs.tags("exp") == {}  # tags are not copied
        assert verify_store(dst, deep=True).problems == []


# -- refusals ---------------------------------------------------------------------------------


def test_an_older_generation_than_dst_latest_is_refused_before_anything_is_written(
    src: Store, dst_path: Path
) -> None:
    castore.copy(src, dst_path)
    with pytest.raises(RefConflictError, match="generation ids only grow"):
        castore.copy(src, dst_path, run="exp", generation=2)
    with pytest.raises(RefConflictError, match="generation ids only grow"):
        castore.copy(src, dst_path, all_generations=True)
    with castore.open(dst_path, create=False) as dst:
        assert [g.id for g in dst.generations("exp")] == [4]
        assert len(dst.refs.reflog("exp")) == 2


def test_a_dst_with_another_history_of_the_run_is_refused(src: Store, dst_path: Path) -> None:
    with castore.open(dst_path, chunk_size=CHUNK) as dst:
        dst.save(state(9), run="exp", step=0)
    with pytest.raises(RefConflictError, match="history"):
        castore.copy(src, dst_path)


def test_same_store_and_a_dst_that_is_not_a_store_are_refused(src: Store, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="same store"):
        castore.copy(src, src.path)
    (tmp_path / "file").write_text("not a store")
    with pytest.raises(NotAStoreError):
        castore.copy(src, tmp_path / "file")


def flip_chunk(store: Store, gen: int) -> bytes:
    """Damage one chunk of ``w`` (only generation ``gen`` names it) under its name."""
    digest, root = store.resolve_root("exp", gen)
    [shard] = store.read_shards(root)
    [entry] = [e for e in shard.tensors if e.name == "w"]
    store.backend.raw_put(Namespace.CHUNKS, entry.chunks[1], b"\x00" * CHUNK)
    return entry.chunks[1]


def test_a_damaged_source_chunk_fails_typed_and_publishes_nothing(
    src: Store, dst_path: Path
) -> None:
    castore.copy(src, dst_path, run="exp", generation=3)
    flip_chunk(src, 4)
    with pytest.raises(ChecksumMismatchError, match="tensor 'w'"):
        castore.copy(src, dst_path)
    with castore.open(dst_path, create=False) as dst:
        assert dst.refs.read("exp").generation == 3  # the previous one, intact
        assert [g.id for g in dst.generations("exp")] == [3]
        assert verify_store(dst, deep=True).problems == []
    result = cli("copy", src.path, dst_path)
    assert result.returncode == 1
    assert result.stderr.startswith("castore: error: ChecksumMismatchError: chunk 1 of tensor")
    assert len(result.stderr.splitlines()) == 1


def test_broken_control_without_the_rehash_a_damaged_chunk_reaches_dst(
    src: Store, dst_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Proves the re-hash is what stops the damage: skip it and DST publishes it."""

    def length_only(entry: Any, index: int, value: Any, where: Any) -> np.ndarray:
        return np.frombuffer(value, dtype=np.uint8)

    monkeypatch.setattr(copying, "verify_chunk", length_only)
    flip_chunk(src, 4)
    castore.copy(src, dst_path)  # no error: the damage went through
    with castore.open(dst_path, create=False) as dst:
        assert dst.refs.read("exp").generation == 4
        with pytest.raises(ChecksumMismatchError):
            dst.load("exp")


# -- interrupted copies -----------------------------------------------------------------------

KILLED_COPY = textwrap.dedent(
    """
    import sys
    import castore
    from castore import copying
    copying.BATCH_BYTES = 4096
    castore.copy(sys.argv[1], sys.argv[2])
    """
)


def test_a_killed_copy_leaves_dst_intact_and_a_rerun_copies_only_the_rest(
    src: Store, dst_path: Path
) -> None:
    castore.copy(src, dst_path, run="exp", generation=2)
    needed = chunk_lengths(src, "exp", 4)
    with castore.open(dst_path, create=False) as dst:
        held = dst.backend.has_many(Namespace.CHUNKS, list(needed))
    lacking = sum(n for (k, n), found in zip(needed.items(), held, strict=True) if not found)
    assert lacking > 4096  # more than one batch: the kill is mid-transfer
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    env["CASTORE_FAULTS"] = "copy.mid_chunks=kill"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_COPY, str(src.path), str(dst_path)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    with castore.open(dst_path, create=False) as dst:
        assert dst.refs.read("exp").generation == 2  # nothing published
        assert_bitwise(dst.load("exp"), state(2))
        assert verify_store(dst, deep=True).problems == []
    report = castore.copy(src, dst_path)
    [gen] = report.generations
    assert gen.copied and 0 < gen.bytes_copied < lacking  # the first batch stayed
    with castore.open(dst_path, create=False) as dst:
        assert dst.refs.read("exp").root == Digest.from_hex(src.resolve("exp").root)
        assert_bitwise(dst.load("exp"), state(4))
        assert verify_store(dst, deep=True).problems == []


@pytest.mark.parametrize(
    "point", ["copy.before_root", "copy.before_ref_advance", "copy.after_ref_advance"]
)
def test_a_copy_killed_around_its_ref_advance_publishes_all_or_nothing(
    src: Store, dst_path: Path, point: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    env["CASTORE_FAULTS"] = f"{point}=kill"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_COPY, str(src.path), str(dst_path)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    published = point == "copy.after_ref_advance"
    with castore.open(dst_path, create=False) as dst:
        ref = dst.refs.read("exp")
        assert (ref is not None and ref.generation == 4) if published else ref is None
    assert castore.copy(src, dst_path).generations[0].copied is not published
    with castore.open(dst_path, create=False) as dst:
        assert_bitwise(dst.load("exp"), state(4))
        assert verify_store(dst, deep=True).problems == []


# -- the command ------------------------------------------------------------------------------


def test_cli_copy_prints_what_it_did_and_errors_in_one_line(src: Store, dst_path: Path) -> None:
    src.close()  # the CLI opens it itself
    result = cli("copy", src.path, dst_path, "--run", "exp", "--generation", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exp@3 ") and "copied 1 generation(s)" in result.stdout
    assert result.stderr == ""  # not a terminal: no bar
    for args, message in [
        (("--run", "exp", "--generation", "2"), "RefConflictError: cannot copy exp@2"),
        (("--generation", "2"), "ValueError: --generation needs --run"),
        (("--run", "nope"), "GenerationNotFoundError"),
    ]:
        result = cli("copy", src.path, dst_path, *args)
        assert result.returncode == 1
        assert result.stderr.startswith(f"castore: error: {message}"), result.stderr
        assert len(result.stderr.splitlines()) == 1
    result = cli("copy", src.path, src.path)
    assert result.returncode == 1 and "same store" in result.stderr
    result = cli("copy", src.path, dst_path, "--all", "--generation", "2")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    result = cli("copy", src.path, dst_path)
    assert result.stdout.startswith("exp@4 ") and "copied 1 generation(s)" in result.stdout
    result = cli("copy", src.path, dst_path)
    assert (
        result.returncode == 0 and "exp@4" in result.stdout and "nothing to copy" in result.stdout
    )


def test_cli_copy_shows_a_bar_per_generation(src: Store, dst_path: Path) -> None:
    src.close()
    result = cli("copy", src.path, dst_path, "--all", CASTORE_PROGRESS="1")
    assert result.returncode == 0, result.stderr
    for i in range(1, 5):
        assert_reaches_100_once(bar_frames(result.stderr, f"copy exp@{i}"))
    assert "%|" not in result.stdout
