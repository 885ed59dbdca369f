"""Async saves in one process: snapshots, errors, busy handling, staging memory, pacing, exit.

Saves are made slow where a test needs one in flight by pacing the writer
(``max_write_bytes_per_s``), never by sleeping. Every store is a real LMDB store
on disk with 1 KiB chunks (tests/conftest.py).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import castore
import castore.cli
import castore.core.staging
import castore.support.faults
from castore import AsyncOptions, Store
from castore.chunkstore.base import Namespace
from castore.gc import RetentionPolicy, collect_garbage
from castore.support.faults import InjectedFault
from castore.verify import verify_store

RUN = "run"
REPO = Path(__file__).resolve().parent.parent
CHUNK = 1024  # the conftest store's chunk size
# Paced so that a save of a few tens of KiB stays in flight for a few tenths of a second.
SLOW = AsyncOptions(max_write_bytes_per_s=64 << 10)


# -- states and how they compare -------------------------------------------------------------


class Bits(NamedTuple):
    """A tensor frozen as its dtype name, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def bits(array: Any) -> Bits:
    if isinstance(array, torch.Tensor):
        flat = array.detach().cpu().contiguous().reshape(-1)
        name = str(array.dtype).removeprefix("torch.")
        return Bits(name, tuple(array.shape), flat.view(torch.uint8).numpy().tobytes())
    return Bits(array.dtype.name, tuple(array.shape), np.ascontiguousarray(array).tobytes())


def frozen(value: Any) -> Any:
    """A deep copy of a state as :func:`castore.Store.load` returns it, tensors as Bits."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return bits(value)
    if isinstance(value, castore.RankLocal):
        return {0: frozen(value.value)}
    if isinstance(value, dict):
        return {key: frozen(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [frozen(item) for item in value]
    return copy.deepcopy(value)


def assert_bitwise(loaded: Any, expected: Any, where: str = "state") -> None:
    if isinstance(expected, Bits):
        assert bits(loaded) == expected, f"{where} differs, bitwise, from the state when saved"
    elif isinstance(expected, dict):
        assert list(loaded) == list(expected), where
        for key in expected:
            assert_bitwise(loaded[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list):
        assert len(loaded) == len(expected), where
        for index, item in enumerate(expected):
            assert_bitwise(loaded[index], item, f"{where}[{index}]")
    else:
        assert loaded == expected, where


def rich_state(seed: int = 0, scale: int = 1) -> dict[str, Any]:
    """numpy and torch tensors (several dtypes), a RankLocal, nested dicts; ~``scale`` * 40 KiB."""
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "embed": torch.from_numpy(rng.standard_normal((64 * scale, 64), dtype=np.float32)),
            "head": {
                "w": torch.randn(32, 16, generator=torch.Generator().manual_seed(seed)).to(
                    torch.bfloat16
                ),
                "b": rng.standard_normal(16, dtype=np.float32),
            },
        },
        "optimizer": {"moments": rng.standard_normal((32, 64)), "count": seed},
        "ids": torch.arange(1000, dtype=torch.int64) * seed,
        "strided": {  # views that are not contiguous: a transpose, every other column
            "torch": torch.from_numpy(rng.standard_normal((48, 40), dtype=np.float32)).t(),
            "numpy": rng.standard_normal((40, 64), dtype=np.float32)[:, ::2],
        },
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
        "rng": castore.RankLocal(rng.integers(0, 2**32, size=16, dtype=np.uint32)),
        "meta": {"seed": seed, "name": "rich"},
    }


def mutate_everything(value: Any) -> None:
    """Change every tensor of a state in place (RankLocal values and nested dicts included)."""
    if isinstance(value, torch.Tensor):
        value.mul_(-3).add_(1)
    elif isinstance(value, np.ndarray):
        value += 1
    elif isinstance(value, castore.RankLocal):
        mutate_everything(value.value)
    elif isinstance(value, dict):
        for item in value.values():
            mutate_everything(item)


def array_state(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One float32 tensor of ``nbytes`` bytes."""
    return {"x": np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)}


def ids(store: Store) -> list[int]:
    """The ids of the run's generations, oldest first ([] before the first)."""
    return [g.id for g in store.generations(RUN)] if RUN in store.runs() else []


def latest_id(store: Store) -> int | None:
    return (ids(store) or [None])[-1]


def assert_latest_holds(store: Store, expected: Any) -> None:
    assert_bitwise(store.load(RUN), expected)


@pytest.fixture
def faults() -> Iterator[Callable[[str], None]]:
    """Arm a fault point to raise in this process; every point is disarmed afterwards."""
    yield lambda point: castore.support.faults.arm(point, "raise")
    castore.support.faults.disarm()


@pytest.fixture
def handle(store_path: Path) -> Iterator[Callable[[], Store]]:
    """Open handles a test closes itself (to see what close raises); any left are closed."""
    opened: list[Store] = []

    def _open() -> Store:
        opened.append(castore.open(store_path, chunk_size=CHUNK))
        return opened[-1]

    yield _open
    for store in opened:
        try:
            store.close()
        except Exception:
            pass


# -- 1. the snapshot ----------------------------------------------------------------------------


@pytest.mark.parametrize("staging", ["full", "changed"])
def test_changing_every_tensor_after_an_async_save_leaves_the_generation_intact(
    store: Store, staging: str
) -> None:
    state = rich_state(seed=1)
    expected = frozen(state)
    options = AsyncOptions(staging=staging, max_write_bytes_per_s=SLOW.max_write_bytes_per_s)
    pending = store.save(state, run=RUN, step=1, blocking=False, async_options=options)
    assert not pending.done()  # paced: the writer is still at it while we change the state
    mutate_everything(state)
    assert frozen(state) != expected
    generation = pending.result(timeout=30)
    assert generation is not None and generation.id == 1
    assert_latest_holds(store, expected)


def test_train_state_async_save_holds_the_state_before_the_next_optimizer_step(
    store: Store,
) -> None:
    from castore.train import TrainState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train = TrainState(model, optimizer)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(16, 32)).square().mean().backward()
        optimizer.step()
        train.microbatch_done(16)
        train.update_done()

    step()
    expected = frozen(train.capture())
    pending = train.save(store, run=RUN, blocking=False, async_options=SLOW)
    step()  # in place: the weights, the moments, and Adam's step counters
    assert frozen(train.capture())["model"] != expected["model"]
    assert pending.result(timeout=30) is not None
    loaded = store.load(RUN)
    for part in ("model", "update"):
        assert_bitwise(loaded[part], expected[part], part)
    assert_bitwise(loaded["optimizer"]["state"], expected["optimizer"]["state"], "optimizer")


# -- 3. errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["async.mid_write", "async.before_ref_advance"])
def test_a_failed_async_save_raises_from_result_publishes_nothing_and_is_raised_once(
    handle: Callable[[], Store], faults: Callable[[str], None], point: str
) -> None:
    store = handle()
    first = frozen(array_state(8192, seed=1))
    store.save(array_state(8192, seed=1), run=RUN, step=1)
    faults(point)
    pending = store.save(array_state(8192, seed=2), run=RUN, step=2, blocking=False)
    assert pending.wait(timeout=30)  # wait() never raises
    with pytest.raises(InjectedFault):
        pending.result()
    castore.support.faults.disarm()
    assert latest_id(store) == 1 and store.background.counters["failed"] == 1
    assert_latest_holds(store, first)
    # Seen once by result(): neither the next save nor close raises it again.
    assert store.save(array_state(8192, seed=3), run=RUN, step=3).id == 2
    store.close()


def test_on_publish_runs_on_the_writer_once_published_and_its_error_is_the_handles(
    store: Store,
) -> None:
    """What follows a publish (a framework's pointer, a tag) runs on the writer thread
    right after the ref advanced, before the handle is done: nothing the training
    thread does later is needed for it. Its error is raised by result(), the
    generation published all the same; a blocking save raises it too."""
    seen: list[tuple[int, int | None, str]] = []

    def note(generation: castore.Generation) -> None:
        ref = store.refs.read(RUN)
        thread = threading.current_thread().name
        seen.append((generation.id, ref.generation if ref else None, thread))

    pending = store.save(array_state(8192), run=RUN, step=1, blocking=False, on_publish=note)
    assert pending.wait(timeout=30) and seen == [(1, 1, "castore-writer")]

    def fail(generation: castore.Generation) -> None:
        raise OSError(f"no pointer for generation {generation.id}")

    state = array_state(8192, seed=2)
    pending = store.save(state, run=RUN, step=2, blocking=False, on_publish=fail)
    said = store.background.wait_for_exit()  # what exit says if nobody asked: not "NOT published"
    assert said is not None and "published generation 2, but what was to follow it failed" in said
    with pytest.raises(OSError, match="no pointer for generation 2") as raised:
        pending.result(timeout=30)
    if sys.version_info >= (3, 11):
        assert "generation 2 of run 'run' is published" in str(raised.value.__notes__)
    assert latest_id(store) == 2 and store.background.counters["published"] == 2
    assert "published, then on_publish failed" in repr(pending)
    with pytest.raises(OSError, match="no pointer for generation 3"):
        store.save(array_state(8192, seed=3), run=RUN, step=3, on_publish=fail)
    assert latest_id(store) == 3
    store.save(array_state(8192, seed=4), run=RUN, step=4, on_publish=note)
    assert seen[-1][:2] == (4, 4)


def test_an_unobserved_failure_is_raised_by_the_next_save_which_does_not_happen(
    handle: Callable[[], Store], faults: Callable[[str], None]
) -> None:
    store = handle()
    store.save(array_state(4096), run=RUN, step=1)
    faults("async.mid_write")
    store.save(array_state(8192, seed=2), run=RUN, step=2, blocking=False).wait(timeout=30)
    castore.support.faults.disarm()
    with pytest.raises(InjectedFault):
        store.save(array_state(8192, seed=3), run=RUN, step=3, blocking=False)
    assert ids(store) == [1]
    assert store.background.counters["started"] == 1  # the raising call started nothing
    again = store.save(array_state(8192, seed=4), run=RUN, step=4, blocking=False)
    assert again.result(timeout=30).id == 2  # raised once: this one saves
    store.close()


def test_an_unobserved_failure_is_raised_by_close_once(
    handle: Callable[[], Store], faults: Callable[[str], None], store_path: Path
) -> None:
    store = handle()
    faults("async.before_ref_advance")
    store.save(array_state(8192), run=RUN, step=1, blocking=False).wait(timeout=30)
    castore.support.faults.disarm()
    with pytest.raises(InjectedFault):
        store.close()
    store.close()  # once only
    with castore.open(store_path) as fresh:
        assert ids(fresh) == []
        assert verify_store(fresh).ok


def test_a_failure_while_staging_is_raised_by_the_save_call_and_changes_nothing(
    handle: Callable[[], Store], faults: Callable[[str], None]
) -> None:
    store = handle()
    first = frozen(rich_state(seed=1))
    store.save(rich_state(seed=1), run=RUN, step=1)
    faults("async.mid_snapshot")
    with pytest.raises(InjectedFault):
        store.save(rich_state(seed=2), run=RUN, step=2, blocking=False)
    castore.support.faults.disarm()
    assert latest_id(store) == 1
    assert_latest_holds(store, first)
    assert store.save(rich_state(seed=3), run=RUN, step=3, blocking=False).result().id == 2
    store.close()  # the staging failure was raised once, by the save call


def test_buffers_of_a_batch_the_backend_failed_to_write_go_back_to_the_pool(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save fails inside put_many; the next save, with the same staging bound, finishes."""
    real_put = store.backend.put_many
    failures = iter([True])

    def failing_put(namespace: Namespace, items: Iterator[Any]) -> Any:
        if next(failures, False):
            next(iter(items))  # the disk fills after the first chunk of the batch
            raise OSError(28, "No space left on device")
        return real_put(namespace, items)

    monkeypatch.setattr(store.backend, "put_many", failing_put)
    with pytest.raises(OSError):
        store.save(array_state(32 * CHUNK), run=RUN, step=1, blocking=False).result(30)
    outcome: list[Any] = []
    saver = threading.Thread(
        target=lambda: outcome.append(
            store.save(array_state(32 * CHUNK), run=RUN, step=2, blocking=False).result(30)
        ),
        daemon=True,
    )
    saver.start()
    saver.join(timeout=10)
    stuck = saver.is_alive()
    if stuck:  # let it go, so that the test fails instead of hanging at close()
        store.background.pool.configure(1 << 30)
        saver.join()
    assert not stuck, "the save waited for staging buffers the failed save never gave back"
    assert outcome[0].id == 1


# -- 4. if_busy ----------------------------------------------------------------------------------


def test_if_busy_wait_waits_for_the_save_in_flight_and_both_publish_in_order(
    store: Store,
) -> None:
    first = store.save(
        array_state(32 << 10, 1), run=RUN, step=1, blocking=False, async_options=SLOW
    )
    second = store.save(array_state(32 << 10, 2), run=RUN, step=2, blocking=False, if_busy="wait")
    assert first.done()  # the second call returned only once the first had finished
    one, two = first.result(), second.result(timeout=30)
    assert (one.id, two.id) == (1, 2) and two.parent == one.root
    assert_latest_holds(store, frozen(array_state(32 << 10, 2)))


def test_a_blocking_save_waits_for_the_save_in_flight(store: Store) -> None:
    first = store.save(
        array_state(32 << 10, 1), run=RUN, step=1, blocking=False, async_options=SLOW
    )
    assert store.save(array_state(4096, 2), run=RUN, step=2).id == 2
    assert first.done() and first.result().id == 1


def test_if_busy_skip_returns_a_skipped_handle_and_publishes_nothing_for_it(store: Store) -> None:
    first = store.save(
        array_state(32 << 10, 1), run=RUN, step=1, blocking=False, async_options=SLOW
    )
    skipped = store.save(array_state(4096, 2), run=RUN, step=2, blocking=False, if_busy="skip")
    assert skipped.skipped and skipped.done() and skipped.result() is None
    assert not first.done()  # skipping did not wait
    assert first.result(timeout=30).id == 1
    assert [g.step for g in store.generations(RUN)] == [1]
    assert store.background.counters == {"started": 1, "published": 1, "failed": 0, "skipped": 1}


# -- 5. staging memory -----------------------------------------------------------------------------


def test_a_state_four_times_the_staging_bound_saves_bitwise_within_it(store: Store) -> None:
    bound = 16 * CHUNK
    state = {"a": array_state(3 * bound, 1)["x"], "b": array_state(bound, 2)["x"]}
    expected = frozen(state)
    options = AsyncOptions(staging_bytes=bound)
    pending = store.save(state, run=RUN, step=1, blocking=False, async_options=options)
    mutate_everything(state)
    pending.result(timeout=30)
    assert 0 < store.background.pool.peak <= bound
    assert 0 < pending.peak_staging_bytes <= bound
    assert pending.bytes is not None and pending.bytes.staged == 4 * bound
    assert_latest_holds(store, expected)


def test_staging_bytes_below_one_chunk_is_a_clear_value_error(store: Store) -> None:
    options = AsyncOptions(staging_bytes=CHUNK // 2)
    with pytest.raises(ValueError, match=rf"staging_bytes={CHUNK // 2}.*raise staging_bytes"):
        store.save(array_state(4 * CHUNK), run=RUN, step=1, blocking=False, async_options=options)
    assert ids(store) == [] and store.background.counters["started"] == 0


@pytest.mark.parametrize(
    ("make", "staging_bytes"),
    [
        (lambda: rich_state(seed=1, scale=4), None),  # the default bound: the whole state
        (lambda: array_state(64 * CHUNK), 16 * CHUNK),  # pieces of one size cycle the bound
    ],
    ids=["whole-state", "bounded"],
)
def test_a_second_save_of_the_same_state_allocates_no_staging_buffer(
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], dict[str, Any]],
    staging_bytes: int | None,
) -> None:
    allocations: list[int] = []
    allocate = castore.core.staging._allocate

    def counting(nbytes: int, pinned: bool) -> Any:
        allocations.append(nbytes)
        return allocate(nbytes, pinned)

    monkeypatch.setattr(castore.core.staging, "_allocate", counting)
    state = make()
    options = AsyncOptions(staging_bytes=staging_bytes)
    first = store.save(state, run=RUN, step=1, blocking=False, async_options=options)
    first.result(timeout=30)
    pool = store.background.pool
    allocated, first_allocations = pool.allocated, list(allocations)
    assert first_allocations
    mutate_everything(state)
    second = store.save(state, run=RUN, step=2, blocking=False, async_options=options)
    second.result(timeout=30)
    assert allocations == first_allocations, "the second save allocated new buffers"
    assert pool.allocated == allocated
    assert second.peak_staging_bytes == first.peak_staging_bytes


def test_changed_chunk_staging_copies_exactly_the_changed_chunks(store: Store) -> None:
    state = array_state(100 * CHUNK)
    changed = AsyncOptions(staging="changed")
    first = store.save(state, run=RUN, step=1, blocking=False, async_options=changed)
    first.result(timeout=30)
    assert first.bytes is not None and first.bytes.staged == 100 * CHUNK  # nothing known yet
    per_chunk = CHUNK // 4
    state["x"][np.arange(10) * 10 * per_chunk + 3] += 1.0  # one element in 10 of 100 chunks
    expected = frozen(state)
    second = store.save(state, run=RUN, step=2, blocking=False, async_options=changed)
    mutate_everything(state)
    generation = second.result(timeout=30)
    assert second.bytes is not None and second.bytes.staged == 10 * CHUNK
    assert generation.stats.new_bytes == 10 * CHUNK
    assert_latest_holds(store, expected)


def test_changed_chunk_staging_stages_whole_while_most_chunks_change_and_returns_after(
    store: Store,
) -> None:
    """Hashing on the caller's thread pays only if most chunks are unchanged (CHANGED_FALLBACK)."""
    state = array_state(20 * CHUNK)
    changed = AsyncOptions(staging="changed")

    def save(step: int) -> str:
        pending = store.save(state, run=RUN, step=step, blocking=False, async_options=changed)
        assert pending.result(timeout=30) is not None
        assert_latest_holds(store, frozen(state))
        return pending.staging

    modes = [save(1)]  # nothing known yet: whole
    state["x"] += 1.0  # every chunk changes...
    modes.append(save(2))  # ...after a save with no save before it: changed, staging all
    state["x"] += 1.0
    modes.append(save(3))  # the last save changed every chunk: whole
    state["x"][: CHUNK // 4] += 1.0  # one chunk of 20 changes
    modes.append(save(4))  # still whole: save 3 changed every chunk of save 2
    state["x"][: CHUNK // 4] += 1.0
    modes.append(save(5))  # save 4 changed 1 of 20: changed again
    assert modes == ["full", "changed", "full", "full", "changed"]


def test_a_chunk_collected_since_the_last_save_fails_a_changed_save_then_all_is_staged(
    store: Store, store_path: Path
) -> None:
    changed = AsyncOptions(staging="changed")
    state_a, state_b = array_state(20 * CHUNK, 1), array_state(20 * CHUNK, 2)
    store.save(state_a, run=RUN, step=1, blocking=False, async_options=changed).result(30)
    # Another handle saves B and collects A's chunks: this handle still knows them.
    with castore.open(store_path, chunk_size=CHUNK) as other:
        other.save(state_b, run=RUN, step=2)
        collect_garbage(other, RetentionPolicy(keep_last=1))
    failed = store.save(state_a, run=RUN, step=3, blocking=False, async_options=changed)
    with pytest.raises(castore.ChunkMissingError):
        failed.result(timeout=30)
    assert [g.step for g in store.generations(RUN)] == [2]
    retry = store.save(state_a, run=RUN, step=4, blocking=False, async_options=changed)
    assert retry.result(timeout=30).step == 4
    assert retry.bytes is not None and retry.bytes.staged == 20 * CHUNK
    assert_latest_holds(store, frozen(state_a))
    assert verify_store(store).ok


# -- 6. pacing ----------------------------------------------------------------------------------


def test_the_write_takes_at_least_its_bytes_over_the_rate(store: Store) -> None:
    nbytes, rate = 96 << 10, 256 << 10
    options = AsyncOptions(max_write_bytes_per_s=rate)
    pending = store.save(
        array_state(nbytes), run=RUN, step=1, blocking=False, async_options=options
    )
    pending.result(timeout=30)
    assert pending.timings["write"] >= 0.8 * nbytes / rate, pending.timings
    assert sum(batch for _, batch in pending.timeline) == nbytes


# -- 7. interpreter exit ---------------------------------------------------------------------

EXIT_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import castore

    path, exit_wait = sys.argv[1], float(sys.argv[2])
    store = castore.open(path, chunk_size=1024)  # never closed: exit finds the save in flight
    state = {"x": np.ones(96 << 10, dtype=np.uint8)}
    options = castore.AsyncOptions(max_write_bytes_per_s=64 << 10, exit_wait_s=exit_wait)
    store.save(state, run="run", step=2, blocking=False, async_options=options)
    print("returned", flush=True)
    """
)


def run_exiting_child(
    path: Path, exit_wait_s: float, faults: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if faults:
        env["CASTORE_FAULTS"] = faults
    return subprocess.run(
        [sys.executable, "-c", EXIT_CHILD, str(path), str(exit_wait_s)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


@pytest.mark.parametrize("exit_wait_s", [600.0, 0.1])
def test_exit_with_a_save_in_flight_waits_or_publishes_nothing(
    store_path: Path, exit_wait_s: float
) -> None:
    with castore.open(store_path, chunk_size=CHUNK) as store:
        store.save(array_state(4096), run=RUN, step=1)
    child = run_exiting_child(store_path, exit_wait_s)
    # A save the exit could not wait for is lost: the exit status says so (1, not 0).
    assert child.returncode == (0 if exit_wait_s > 1 else 1), child.stderr
    assert "returned" in child.stdout, child.stderr
    in_flight = [line for line in child.stderr.splitlines() if "still in flight" in line]
    with castore.open(store_path) as store:
        steps = [g.step for g in store.generations(RUN)]
        report = verify_store(store)
    assert report.ok, report.problems
    if exit_wait_s > 1:
        assert steps == [1, 2] and in_flight == [], child.stderr
    else:
        assert steps == [1], child.stderr
        assert len(in_flight) == 1 and "NOT published" in in_flight[0], child.stderr


@pytest.mark.parametrize("point", ["async.mid_write", "async.before_ref_advance"])
def test_a_process_killed_during_its_async_save_leaves_the_previous_generation(
    store_path: Path, point: str
) -> None:
    with castore.open(store_path, chunk_size=CHUNK) as store:
        store.save(array_state(4096), run=RUN, step=1)
    child = run_exiting_child(store_path, 600.0, faults=f"{point}=kill")
    assert child.returncode == -signal.SIGKILL, child.stderr
    with castore.open(store_path) as store:
        assert [g.step for g in store.generations(RUN)] == [1]
        report = verify_store(store)
        assert report.ok, report.problems
        assert store.save(array_state(4096, 3), run=RUN, step=3, blocking=False).result(30).id == 2


# -- 8. what a generation records ----------------------------------------------------------------


def test_an_async_generation_records_the_bytes_written_and_the_time_held(store: Store) -> None:
    pending = store.save(array_state(32 << 10), run=RUN, step=1, blocking=False, async_options=SLOW)
    pending.result(timeout=30)
    stats = store.generations(RUN)[-1].stats
    assert pending.bytes is not None and stats.written_bytes == pending.bytes.written
    assert stats.written_bytes > stats.new_bytes == 32 << 10  # and the shard manifest
    assert 0 < stats.held_seconds < stats.seconds
    assert stats.held_seconds == pytest.approx(pending.timings["held"], abs=1e-5)
    phases = ("held", "snapshot", "staging_wait", "write", "publish", "total")
    assert set(phases) <= set(pending.timings), pending.timings


def test_castore_log_shows_written_bytes_and_held_time(
    store: Store, store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store.save(array_state(8192), run=RUN, step=1, blocking=False).result(timeout=30)
    assert castore.cli.main(["log", str(store_path)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "written" in header and "held" in header, header


# -- 9. CUDA ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_changed_on_the_gpu_right_after_the_save_are_saved_as_they_were(
    store: Store,
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(256, 256, device="cuda", generator=generator),
        "h": torch.randn(64, 64, device="cuda", generator=generator).half(),
        "cpu": torch.arange(100),
    }
    expected = frozen(state)
    pending = store.save(state, run=RUN, step=1, blocking=False)
    for tensor in state.values():  # queued on the GPU right behind the staging copies
        tensor.mul_(-2).add_(1)
    pending.result(timeout=60)
    torch.cuda.synchronize()
    assert frozen(state) != expected
    assert_latest_holds(store, expected)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_on_a_closed_handle_is_refused_at_once(tmp_path: Path, blocking: bool) -> None:
    """It used to hang: an async save on a handle closed after a save never started."""
    with castore.open(tmp_path / "store") as store:
        store.save({"x": np.ones(3)}, run="r", step=1)
    started = time.monotonic()
    with pytest.raises(castore.errors.StoreError, match="handle is closed"):
        store.save({"w": np.zeros(4)}, run="r", step=2, blocking=blocking)
    assert time.monotonic() - started < 5
    with castore.open(tmp_path / "store") as again:
        assert [g.id for g in again.generations("r")] == [1]
