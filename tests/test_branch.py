"""castore.branch and ``castore branch``: a new run from any generation, in O(metadata).

On a local (LMDB) store, a shared-directory store and S3 (moto): the new run's
generation 1 restores the source's values bitwise, writes a manifest per rank and
a root and no chunk, records where it came from (``castore log`` shows it), and
saves continue from it. Refusals are typed and change nothing (an existing run, a
missing source, a bad name). Garbage collection keeps the shared chunks while
either run names them. A SIGKILL at each of the branch's fault points leaves the
store as it was (or the branch whole, after the ref advance); that drill and the
CLI run on this machine's two kinds of store. Broken control: a collection that
marks only the source run's generations frees chunks the branch still needs,
which the branch's verify and load then refuse.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import clean_env, run_cli
from s3_server import kind_of_store

import castore
from castore.chunkstore.base import Namespace
from castore.errors import GenerationNotFoundError, InvalidNameError, RefConflictError
from castore.gc import RetentionPolicy, collect_garbage
from castore.verify import verify_store

CHUNK = 4096


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": np.arange(7.0) + seed}


@pytest.fixture(params=["lmdb", "shared", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """A store holding base@1 and base@2: its location and the options it opens with."""
    location, options = kind_of_store(request, tmp_path, request.param, "branches")
    with castore.open(location, chunk_size=CHUNK, **options) as store:
        store.save(state(1), run="base", step=10)
        store.save(state(2), run="base", step=20)
    options.pop("shared", None)
    return location, options


@pytest.fixture(params=["lmdb", "shared"])
def path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A store on this machine (for the child processes and the CLI)."""
    where = tmp_path / "store"
    with castore.open(where, chunk_size=CHUNK, shared=request.param == "shared") as store:
        store.save(state(1), run="base", step=10)
        store.save(state(2), run="base", step=20)
    return where


def chunks_of(store: castore.Store) -> set[bytes]:
    return set(store.backend.iter_keys(Namespace.CHUNKS))


def test_a_branch_restores_the_source_and_writes_no_chunk(
    where: tuple[str, dict[str, Any]],
) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        before = chunks_of(store)
        made = castore.branch(store, "base", 1, "ft")
        assert (made.run, made.id, made.step) == ("ft", 1, 10)
        assert made.lineage["op"] == "branch"
        assert made.lineage["from"] == [
            {"run": "base", "generation": 1, "root": store.resolve("base", 1).root}
        ]
        assert made.stats.new_bytes == 0 and 0 < made.stats.written_bytes < 1 << 20
        assert chunks_of(store) == before
        loaded = store.load(run="ft")
        for name, value in state(1).items():
            assert loaded[name].tobytes() == value.tobytes()
        store.save(state(3), run="ft", step=11)  # saves continue from it
        assert [g.id for g in store.generations("ft")] == [1, 2]
        assert store.resolve("base").id == 2  # the source run is untouched
        assert verify_store(store, deep=True).ok


def test_refusals_are_typed_and_change_nothing(where: tuple[str, dict[str, Any]]) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        castore.branch(store, "base", "latest", "ft")
        objects = set(store.backend.iter_keys(Namespace.OBJECTS))
        with pytest.raises(RefConflictError, match="run 'ft' exists"):
            castore.branch(store, "base", 1, "ft")
        with pytest.raises(GenerationNotFoundError):
            castore.branch(store, "nope", "latest", "ft2")
        with pytest.raises(GenerationNotFoundError):
            castore.branch(store, "base", 9, "ft2")
        with pytest.raises(InvalidNameError):
            castore.branch(store, "base", 1, "../ft2")
        assert set(store.backend.iter_keys(Namespace.OBJECTS)) == objects
        assert sorted(store.runs()) == ["base", "ft"]


def test_gc_keeps_shared_chunks_while_any_run_names_them(where: tuple[str, dict[str, Any]]) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        castore.branch(store, "base", 1, "ft")
        store.save(state(4), run="base", step=30)
        collect_garbage(store, RetentionPolicy(keep_last=1))  # base@1 dropped
        with pytest.raises(GenerationNotFoundError):
            store.load(run="base", generation=1)
        loaded = store.load(run="ft")  # its chunks were base@1's: kept by the branch
        assert loaded["w"].tobytes() == state(1)["w"].tobytes()
        assert verify_store(store, deep=True).ok


def test_broken_control_a_collection_that_ignores_the_branch_loses_its_chunks(
    where: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    location, options = where
    with castore.open(location, **options) as store:
        castore.branch(store, "base", 1, "ft")
        store.save(state(4), run="base", step=30)
        real = store.runs
        monkeypatch.setattr(store, "runs", lambda: [r for r in real() if r != "ft"])
        collect_garbage(store, RetentionPolicy(keep_last=1))
        monkeypatch.setattr(store, "runs", real)
        assert not verify_store(store, deep=True).ok
        with pytest.raises(castore.IntegrityError):
            store.load(run="ft")


BRANCH_SRC = textwrap.dedent(
    """
    import sys
    import castore

    with castore.open(sys.argv[1]) as store:
        castore.branch(store, "base", 1, "ft")
    print("branched", flush=True)
    """
)


@pytest.mark.parametrize(
    "point, published",
    [
        ("lineage.before_root", False),
        ("lineage.before_ref_advance", False),
        ("lineage.after_ref_advance", True),
    ],
)
def test_sigkill_mid_branch_leaves_the_store_as_it_was_or_the_branch_whole(
    path: Path, point: str, published: bool
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", BRANCH_SRC, str(path)],
        capture_output=True, text=True, timeout=60, env=clean_env(CASTORE_FAULTS=point),
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    with castore.open(path) as store:
        assert ("ft" in store.runs()) is published
        assert verify_store(store, deep=True).ok
        if not published:
            castore.branch(store, "base", 1, "ft")  # the retry works
        assert store.load(run="ft")["b"].tobytes() == state(1)["b"].tobytes()


def test_the_cli_branches_and_log_shows_where_it_came_from(path: Path) -> None:
    done = run_cli("branch", path, "base@1", "ft")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("started run ft at base@1 (step 10, root ")
    assert done.stdout.strip().endswith("no chunk written")
    again = run_cli("branch", path, "base@1", "ft")
    assert again.returncode != 0 and again.stdout == ""
    assert again.stderr.count("\n") == 1 and "run 'ft' exists" in again.stderr
    log = run_cli("log", path)
    assert log.returncode == 0, log.stderr
    rows = {tuple(line.split()[:2]): line for line in log.stdout.splitlines()[2:]}
    assert rows[("ft", "1")].rstrip().endswith("branch of base@1")
    assert not rows[("base", "1")].rstrip().endswith("base@1")
