"""Crash safety with real processes and a real SIGKILL.

A child interpreter saves generation 2 of a store whose generation 1 the test
wrote, with a fault point armed through ``CASTORE_FAULTS`` so that the child
SIGKILLs itself at an exact point of the write order. The parent then checks
what survived: readers must see either the old generation or the new one,
never a reference to something missing, and the next save must just work.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import assert_state_equal
from cli_runner import clean_env, run_cli

import castore
from castore.chunkstore.base import Namespace
from castore.format.objects import decode_object
from castore.support.faults import POINTS, InjectedFault

pytestmark = pytest.mark.slow

RUN = "run"

# Shared by the parent and the child so both build byte-identical states.
STATE_SRC = textwrap.dedent(
    """
    import numpy as np

    def make_state(seed):
        rng = np.random.default_rng(seed)
        return {
            "w": rng.standard_normal((64, 64), dtype=np.float32),  # 16 KiB: 16 chunks
            "b": rng.standard_normal(64, dtype=np.float32),  # 256 B: 1 chunk
            "meta": {"seed": seed},
        }
    """
)
CHUNKS_PER_STATE = 17
CHUNK_SIZE = 1024

SAVE_ONCE_SRC = STATE_SRC + textwrap.dedent(
    """
    import sys
    import castore
    import castore.core.chunkio

    path, seed, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if batch:
        castore.core.chunkio.WRITE_BATCH_BYTES = batch
    with castore.open(path) as store:
        gen = store.save(make_state(seed), run="run", step=seed)
    print(f"published {gen.id}", flush=True)
    """
)

SAVE_FOREVER_SRC = STATE_SRC + textwrap.dedent(
    """
    import itertools, sys
    import castore

    with castore.open(sys.argv[1]) as store:
        # Resume where the run is: a step below its latest would be refused.
        for seed in itertools.count(store.resolve("run").step + 1):
            gen = store.save(make_state(seed), run="run", step=seed)
            print(gen.id, flush=True)
    """
)

_namespace: dict[str, Any] = {}
exec(STATE_SRC, _namespace)
make_state = _namespace["make_state"]


def save_in_child(
    path: Path, seed: int, *, faults: str = "", batch: int = 0
) -> subprocess.CompletedProcess[str]:
    env = clean_env(CASTORE_FAULTS=faults) if faults else clean_env()
    return subprocess.run(
        [sys.executable, "-c", SAVE_ONCE_SRC, str(path), str(seed), str(batch)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def cli_verify_deep(path: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("verify", path, "--deep")


def snapshot(path: Path) -> dict[str, Any]:
    """What the store holds now, read by a fresh handle that is closed again."""
    with castore.open(path) as store:
        return {
            "chunks": set(store.backend.iter_keys(Namespace.CHUNKS)),
            "objects": {
                key: store.backend.get(Namespace.OBJECTS, key)
                for key in store.backend.iter_keys(Namespace.OBJECTS)
            },
            "latest": store.resolve(RUN),
            "reflog": store.refs.reflog(RUN),
        }


@pytest.fixture
def gen1_store(tmp_path: Path) -> Path:
    """A store holding generation 1 of RUN (make_state(1)); no handle left open."""
    path = tmp_path / "store"
    with castore.open(path, chunk_size=CHUNK_SIZE) as store:
        assert store.save(make_state(1), run=RUN, step=1).id == 1
    return path


def assert_healthy_and_next_save_works(path: Path, latest_id: int) -> None:
    result = cli_verify_deep(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "OK"
    with castore.open(path) as store:
        latest = store.resolve(RUN)
        assert latest.id == latest_id
        assert_state_equal(store.load(RUN), make_state(latest.step))
        following = store.save(make_state(50), run=RUN, step=50)
        assert following.id == latest_id + 1
        assert following.parent == latest.root
        assert_state_equal(store.load(RUN), make_state(50))
        records = store.refs.reflog(RUN)
        assert [r["generation"] for r in records] == list(range(1, latest_id + 2))
        assert all(r["action"] == "advance" for r in records)
        assert sorted(p.name for p in (path / "refs").iterdir()) == [RUN]  # no temp left
    assert cli_verify_deep(path).returncode == 0


# -- controls -------------------------------------------------------------------


@pytest.mark.parametrize("batch", [0, 4096])
def test_child_without_faults_publishes_generation_2(gen1_store: Path, batch: int) -> None:
    result = save_in_child(gen1_store, seed=2, batch=batch)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "published 2"
    after = snapshot(gen1_store)
    assert after["latest"].id == 2 and after["latest"].step == 2
    assert_healthy_and_next_save_works(gen1_store, latest_id=2)


def test_an_unknown_fault_point_is_harmless(gen1_store: Path) -> None:
    result = save_in_child(gen1_store, seed=2, faults="save.nowhere=kill")
    assert result.returncode == 0, result.stderr
    assert snapshot(gen1_store)["latest"].id == 2


# -- SIGKILL at each fault point ------------------------------------------------


@pytest.mark.parametrize(
    "point, batch, new_chunks, new_objects",
    [
        # A 4 KiB write batch: killed after the first batch (4 chunks of w) commits.
        ("save.mid_chunks", 4096, 4, 0),
        ("save.before_objects", 0, CHUNKS_PER_STATE, 0),
        ("save.before_ref_advance", 0, CHUNKS_PER_STATE, 2),
    ],
)
def test_sigkill_before_the_ref_advance_keeps_generation_1(
    gen1_store: Path, point: str, batch: int, new_chunks: int, new_objects: int
) -> None:
    before = snapshot(gen1_store)
    assert len(before["chunks"]) == CHUNKS_PER_STATE and len(before["objects"]) == 2

    result = save_in_child(gen1_store, seed=2, faults=f"{point}=kill", batch=batch)

    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "published" not in result.stdout
    after = snapshot(gen1_store)
    assert after["latest"] == before["latest"]  # still generation 1, same root
    assert after["reflog"] == before["reflog"]
    # Exactly what the write order says had been committed when the kill came.
    assert len(after["chunks"] - before["chunks"]) == new_chunks
    assert before["chunks"] <= after["chunks"]
    new_keys = set(after["objects"]) - set(before["objects"])
    assert len(new_keys) == new_objects
    if point == "save.before_ref_advance":
        # The killed save's root IS stored (the kill came after the manifest
        # commit) but nothing refers to it.
        roots = [
            obj
            for obj in (decode_object(after["objects"][key]) for key in new_keys)
            if type(obj).__name__ == "GenerationRoot"
        ]
        assert len(roots) == 1
        assert roots[0].generation == 2 and roots[0].parent.hex() == before["latest"].root
        assert after["latest"].root not in {key.hex() for key in new_keys}

    assert_healthy_and_next_save_works(gen1_store, latest_id=1)


def test_sigkill_after_the_ref_advance_publishes_generation_2(gen1_store: Path) -> None:
    before = snapshot(gen1_store)
    result = save_in_child(gen1_store, seed=2, faults="save.after_ref_advance=kill")

    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "published" not in result.stdout  # killed before save() returned
    after = snapshot(gen1_store)
    assert after["latest"].id == 2 and after["latest"].parent == before["latest"].root
    assert [r["generation"] for r in after["reflog"]] == [1, 2]
    assert_healthy_and_next_save_works(gen1_store, latest_id=2)


def test_sigkill_at_a_random_moment_of_repeated_saves(gen1_store: Path) -> None:
    rng = random.Random(1234)
    for _ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", SAVE_FOREVER_SRC, str(gen1_store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline()  # at least one save went through
            assert line.strip().isdigit(), child.stderr.read() if child.stderr else ""
            time.sleep(rng.uniform(0.0, 0.05))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
        assert child.returncode == -signal.SIGKILL

        # Whatever the moment: the latest generation is complete and correct.
        with castore.open(gen1_store) as store:
            gens = store.generations(RUN)
            assert [g.id for g in gens] == list(range(1, len(gens) + 1))
            latest = gens[-1]
            assert_state_equal(store.load(RUN), make_state(latest.step))
            # One more advance reconciles the reflog if the kill hit between the
            # ref replace and the reflog append.
            store.save(make_state(7), run=RUN, step=latest.step + 1)
            records = store.refs.reflog(RUN)
            assert [r["generation"] for r in records] == list(range(1, len(gens) + 2))
        result = cli_verify_deep(gen1_store)
        assert result.returncode == 0, result.stdout + result.stderr


# -- the same points with action "raise", in process ----------------------------


@pytest.mark.parametrize("point", [p for p in POINTS if p.startswith("save.")])
def test_injected_exception_at_each_point(
    gen1_store: Path, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import castore.core.chunkio
    import castore.support.faults

    monkeypatch.setattr(castore.core.chunkio, "WRITE_BATCH_BYTES", 4096)
    monkeypatch.setitem(castore.support.faults._ARMED, point, "raise")
    with castore.open(gen1_store) as store:
        with pytest.raises(InjectedFault) as info:
            store.save(make_state(2), run=RUN, step=2)
        assert info.value.point == point
        expected_latest = 2 if point == "save.after_ref_advance" else 1
        assert store.resolve(RUN).id == expected_latest
    monkeypatch.delitem(castore.support.faults._ARMED, point)
    assert_healthy_and_next_save_works(gen1_store, latest_id=expected_latest)
