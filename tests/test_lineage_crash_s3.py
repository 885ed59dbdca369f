"""The crash drill of branch and amend on an S3 (moto) store, then garbage collection.

tests/test_branch.py and tests/test_amend.py SIGKILL a branch and an amend at their
fault points on this machine's stores; here the same kill lands on a store on S3,
where the publish is create-if-absent objects and an ``If-Match`` swap of the ref,
and the killed process leaves its store lease behind. A child process branches
base@1 into ``ft`` (or amends base@2 without its optimizer state, as base@3) and
SIGKILLs itself before the root is written, before the ref's swap or after it. Then:
the run is as it was (or the new generation whole), the store verifies deep, a
retry publishes, every kept generation loads bitwise, and a collection (breaking
the dead lease) keeps exactly what the kept generations name: the chunks a branch
shares with a dropped generation stay, the killed attempt's objects and the dropped
generations' own chunks go. Control: before the collection, the killed attempt's
leftovers are in the store, so "exactly" is a check that can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import clean_env
from s3_server import store_options

import castore
from castore.chunkstore.base import Namespace
from castore.gc import RetentionPolicy, collect_garbage
from castore.verify import verify_store

CHUNK = 4096
LEASE = 3.0  # seconds this side waits before it breaks the killed child's store lease

CHILD = textwrap.dedent(
    """
    import json
    import sys

    import castore

    location, options, op = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    with castore.open(location, **options) as store:
        if op == "branch":
            castore.branch(store, "base", 1, "ft")
        else:
            castore.amend(store, "base", 2, drop=["optim/**"])
    print("published", flush=True)
    """
)


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": rng.standard_normal((64, 32)).astype(np.float32)},
        "optim": {"m": rng.standard_normal((64, 32))},
    }


def do(store: castore.Store, op: str) -> castore.Generation:
    if op == "branch":
        return castore.branch(store, "base", 1, "ft")
    return castore.amend(store, "base", 2, drop=["optim/**"])


def named(store: castore.Store) -> tuple[set[bytes], set[bytes]]:
    """(objects, chunks) the listed generations of every run name: roots, manifests and
    the chunks of every entry."""
    objects: set[bytes] = set()
    chunks: set[bytes] = set()
    for run in store.runs():
        for gen in store.generations(run):
            digest, root = store.resolve_root(run, gen.id)
            objects |= {digest.raw, *root.shards}
            for shard in store.read_shards(root):
                for entry in shard.tensors + shard.local_tensors:
                    chunks.update(entry.chunks)
    return objects, chunks


def chunks_of(store: castore.Store, run: str, generation: int) -> set[bytes]:
    _, root = store.resolve_root(run, generation)
    return {c for shard in store.read_shards(root) for e in shard.tensors for c in e.chunks}


def held(store: castore.Store, namespace: Namespace) -> set[bytes]:
    return set(store.backend.iter_keys(namespace))


@pytest.fixture
def s3_store(s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """An S3 store holding base@1 and base@2: its location and the options it opens with."""
    location = f"s3://{s3_bucket}/lineage"
    options = store_options(s3_endpoint, str(tmp_path / "cache"))
    with castore.open(location, chunk_size=CHUNK, **options) as store:
        store.save(state(1), run="base", step=10)
        store.save(state(2), run="base", step=20)
    return location, options


@pytest.mark.parametrize("op", ["branch", "amend"])
@pytest.mark.parametrize(
    "point, published",
    [
        ("lineage.before_root", False),
        ("lineage.before_ref_advance", False),
        ("lineage.after_ref_advance", True),
    ],
)
def test_sigkill_mid_branch_or_amend_on_s3_then_gc_keeps_exactly_what_is_named(
    s3_store: tuple[str, dict[str, Any]], tmp_path: Path, op: str, point: str, published: bool
) -> None:
    location, options = s3_store
    child_options = {**options, "cache_dir": str(tmp_path / "child-cache")}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, location, json.dumps(child_options), op],
        capture_output=True, text=True, timeout=120, env=clean_env(CASTORE_FAULTS=point),
    )  # fmt: skip
    assert child.returncode == -9, child.stderr
    assert "published" not in child.stdout
    with castore.open(location, store_lease=LEASE, **options) as store:
        made = ("ft", 1) if op == "branch" else ("base", 3)
        listed = {run: [g.id for g in store.generations(run)] for run in store.runs()}
        before = {"base": [1, 2]}
        after = {"base": [1, 2], "ft": [1]} if op == "branch" else {"base": [1, 2, 3]}
        assert listed == (after if published else before)
        assert verify_store(store, deep=True).ok
        objects, _ = named(store)
        leftover = held(store, Namespace.OBJECTS) - objects
        # The control: what the killed attempt wrote is in the store until a collection.
        assert bool(leftover) is not published, leftover
        if not published:
            gen = do(store, op)  # the retry publishes
            assert (gen.run, gen.id) == made and gen.stats.new_bytes == 0
        assert {run: [g.id for g in store.generations(run)] for run in store.runs()} == after
        shared = chunks_of(store, "base", 1 if op == "branch" else 2)
        base2 = chunks_of(store, "base", 2)
        collect_garbage(store, RetentionPolicy(keep_last=1))
        kept = {run: [g.id for g in store.generations(run)] for run in store.runs()}
        assert kept == ({"base": [2], "ft": [1]} if op == "branch" else {"base": [3]})
        objects, chunks = named(store)
        assert held(store, Namespace.OBJECTS) == objects  # the killed attempt's objects went
        assert held(store, Namespace.CHUNKS) == chunks
        made_chunks = chunks_of(store, *made)
        if op == "branch":  # base@1's chunks, which only ft@1 still names, stay
            assert made_chunks == shared and chunks == shared | base2
        else:  # base@2's model chunks stay under base@3; its optimizer's and base@1's go
            assert made_chunks < shared and chunks == made_chunks
        assert verify_store(store, deep=True).ok
        loaded = store.load(run=made[0])
        source = state(1 if op == "branch" else 2)
        assert loaded["model"]["w"].tobytes() == source["model"]["w"].tobytes()
        assert ("optim" in loaded) is (op == "branch")
        assert store.load(run="base")["model"]["w"].tobytes() == (state(2)["model"]["w"].tobytes())
