"""``castore verify --deep`` checks the chunk pieces each entry records (docs/FORMAT.md).

Wrong pieces are harmless to readers (they check them against the chunk's name
first and read the whole chunk otherwise) but point at a writer's fault. A
real store on disk is saved with a writer whose piece values are forged (the
save's own hashing, patched), so that the manifest carries them as a buggy
writer would publish them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cli_runner import run_cli

import castore
from castore import verify
from castore.chunkstore.base import Namespace
from castore.core import chunkio
from castore.format import pieces
from castore.format.hashing import Buffer
from castore.repair import repair_store
from castore.testing.corrupt import flipped, raw_put
from castore.verify import DAMAGE, PIECES, verify_store

pytestmark = pytest.mark.skipif(not pieces.AVAILABLE, reason="no castore.format._b3tree")

P = pieces.PIECE
# Two tensors of one chunk each, longer than a piece: 8 and 5 pieces; one of 80 bytes.
ROWS, COLS = 128, 1024


def state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((ROWS, COLS), dtype=np.float32),
        "v": rng.standard_normal((ROWS * 5 // 8, COLS), dtype=np.float32),
        "b": np.arange(10, dtype=np.int64),
    }


def wrong_value(cvs: bytes) -> bytes:
    return flipped(cvs, 3 * 32 + 5)  # piece 3's value, one byte off


def wrong_length(cvs: bytes) -> bytes:
    return cvs + bytes(32)  # one value too many


def forging(monkeypatch: pytest.MonkeyPatch, nbytes: int, forge: Callable[[bytes], bytes]) -> None:
    """Make the save record ``forge(values)`` for each chunk of ``nbytes`` (a writer's bug)."""
    honest = chunkio.hash_chunk

    def forged(view: Buffer) -> tuple[bytes, bytes]:
        digest, cvs = honest(view)
        return digest, forge(cvs) if memoryview(view).nbytes == nbytes else cvs

    monkeypatch.setattr(chunkio, "hash_chunk", forged)


def save_forged(
    path: Path, monkeypatch: pytest.MonkeyPatch, forge: Callable[[bytes], bytes] = wrong_value
) -> castore.Store:
    """Generation 1 honest; generation 2 with w's pieces forged (v and b unchanged)."""
    store = castore.open(path, create=True)
    store.save(state(1), run="r", step=1)
    with monkeypatch.context() as patch:
        forging(patch, ROWS * COLS * 4, forge)
        store.save({**state(1), "w": state(2)["w"]}, run="r", step=2)
    return store


def test_a_store_with_pieces_verifies_deep_with_every_recorded_chunk_checked(
    tmp_path: Path,
) -> None:
    with castore.open(tmp_path / "store", create=True) as store:
        store.save(state(1), run="r", step=1)
        store.save({**state(1), "w": state(2)["w"]}, run="r", step=2)
        report = verify_store(store, deep=True)
        assert report.ok, report.problems
        assert (report.pieces_checked, report.pieces_unchecked) == (4, 0)  # w, v: twice
        assert verify_store(store).pieces_checked == 0  # structural: no chunk byte read
    result = run_cli("verify", tmp_path / "store", "--deep")
    assert result.returncode == 0 and result.stdout.endswith("OK\n"), result.stdout


@pytest.mark.parametrize(
    "forge, said",
    [
        (wrong_value, "chunk 0 of tensor 'w' ({}) records 8 piece values that are not its own"),
        (wrong_length, "tensor 'w' records 288 bytes of chunk pieces where its chunks have 256"),
    ],
    ids=["value", "length"],
)
def test_forged_pieces_are_a_problem_of_their_own_kind_and_the_rest_is_still_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forge: Callable[[bytes], bytes], said: str
) -> None:
    with save_forged(tmp_path / "store", monkeypatch, forge) as store:
        _, root = store.resolve_root("r", 2)
        w, v = (store.tensor_entries(root)[name][0] for name in ("w", "v"))
        # v's chunk damaged as well: both are reported, each as what it is.
        stored = store.backend.get(Namespace.CHUNKS, v.chunks[0])
        assert stored is not None
        raw_put(store, Namespace.CHUNKS, v.chunks[0], flipped(stored, 7))
        report = verify_store(store, deep=True)
        # Gen 2: v's damage, then w's pieces; gen 1 (sharing v's chunk): the damage alone.
        assert [(p.generation, p.kind) for p in report.problems] == [
            (2, DAMAGE), (2, PIECES), (1, DAMAGE)
        ]  # fmt: skip
        problem = report.problems[1]
        assert said.format(w.chunks[0].hex()[:16]) in problem.what
        assert str(problem).startswith("r@2: wrong chunk pieces: ")
        assert "chunk 0 of tensor 'v' is damaged" in report.problems[0].what
        assert report.damaged_generations == [("r", 1), ("r", 2)]
        assert report.pieces_generations == [("r", 2)]
        # Readers are unharmed: the values do not merge to w's name, so w is read whole.
        assert np.array_equal(store.read_slice("r", 2, "w", np.s_[5:9]), state(2)["w"][5:9])
    result = run_cli("verify", tmp_path / "store", "r@2", "--deep")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "wrong chunk pieces" in line]
    assert len(lines) == 2 and lines[0].startswith("PROBLEM r@2: wrong chunk pieces: ")
    # The summary names each generation under what it has: damage, or wrong pieces only.
    assert lines[1] == "FAILED: 2 problem(s); damaged: r@2; wrong chunk pieces: r@2"
    assert "Traceback" not in result.stdout + result.stderr


def test_broken_control_without_the_pieces_check_a_forged_store_verifies_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with save_forged(tmp_path / "store", monkeypatch) as store:
        assert not verify_store(store, deep=True).ok
        monkeypatch.setattr(verify, "_check_pieces", lambda *args: [])
        assert verify_store(store, deep=True).ok


def test_repair_counts_forged_pieces_as_no_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with save_forged(tmp_path / "store", monkeypatch) as store:
        assert repair_store(store, dry_run=True).damaged == {}


def test_without_the_extension_recorded_pieces_are_left_unchecked_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with save_forged(tmp_path / "store", monkeypatch) as store:
        monkeypatch.setattr(pieces, "_b3tree", None)  # a castore built without it
        report = verify_store(store, deep=True)
        assert report.ok and (report.pieces_checked, report.pieces_unchecked) == (0, 4)


def test_chunks_stored_as_frames_have_their_pieces_checked_from_the_decoded_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame (codec) decodes to the chunk: its pieces are the decoded bytes'."""
    # Float32 with few distinct exponents: the codec keeps a frame for each chunk.
    weights = {"w": np.linspace(1, 1.5, ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)}
    with castore.open(tmp_path / "store", create=True, codec="auto") as store:
        store.save(weights, run="r", step=1)
        with monkeypatch.context() as patch:
            forging(patch, ROWS * COLS * 4, wrong_value)
            store.save({"w": weights["w"] + 1}, run="r", step=2)
        for generation in (1, 2):
            _, root = store.resolve_root("r", generation)
            [key] = store.tensor_entries(root)["w"][0].chunks
            stored = store.backend.get(Namespace.CHUNKS, key)
            assert stored is not None and len(stored) < ROWS * COLS * 4  # a frame
        report = verify_store(store, deep=True)
        assert report.pieces_checked == 2
        assert [(p.generation, p.kind) for p in report.problems] == [(2, PIECES)]
