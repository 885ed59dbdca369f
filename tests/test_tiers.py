"""Tiers on one node: a fast local store in front of a durable one (castore.tiers).

Real stores on disk: the fast tier a local LMDB store, the durable tier a
local store or a shared directory. Promotions run on the tiered store's
background thread; each test waits for them before it looks.
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _helpers import assert_state_equal

import castore
import castore.chunkstore.tiered as tiered_module
import castore.dist
import castore.format.hashing as hashing_module
from castore.chunkstore.base import ChunkBackend, Namespace
from castore.core.commit import TierHooks
from castore.core.holdings import held_elsewhere
from castore.errors import ChecksumMismatchError, CorruptObjectError
from castore.format.hashing import Digest
from castore.gc import RetentionPolicy
from castore.testing.corrupt import flipped, raw_put
from castore.tiers import PIN_PREFIX, TieredStore, open_tiered
from castore.verify import verify_store

CHUNK = 1024


def state(step: int) -> dict[str, Any]:
    """A weight that changes every step (1 KiB of its 8 KiB) and one that never does.

    Every chunk differs from every other: 12 distinct chunks of 1 KiB."""
    weight = np.arange(2048, dtype=np.float32) + 0.5
    weight[:256] = step
    return {"weight": weight, "frozen": np.arange(1024, dtype=np.float32)}


def open_pair(tmp_path: Path, **options: Any) -> TieredStore:
    options.setdefault("chunk_size", CHUNK)
    return open_tiered(tmp_path / "fast", tmp_path / "durable", **options)


def ids(store: castore.Store, run: str = "r") -> list[int]:
    return [g.id for g in store.generations(run)] if run in store.runs() else []


def test_selected_generations_reach_the_durable_tier_with_the_same_root(tmp_path: Path) -> None:
    with open_pair(tmp_path, durable_every=2, fast_keep=5, promote_on_exit=False) as store:
        for step in range(1, 6):
            store.save(state(step), run="r", step=step)
        promoted = store.wait_promotions()
        assert [(p.generation, p.error) for p in promoted] == [(2, None), (4, None)]
        assert ids(store.durable) == [2, 4]
        for gen in (2, 4):
            assert store.durable.resolve("r", gen).root == store.fast.resolve("r", gen).root
        # The second promotion sent only what the durable tier lacked: the changed chunk.
        second = promoted[1].copied
        assert second is not None and second.bytes_copied == CHUNK
        assert second.logical_bytes == 12 * CHUNK
        assert store.fast.refs.tags("r") == {}  # pins are gone once promoted
        assert verify_store(store.durable, deep=True).ok
        assert_state_equal(store.durable.load("r", 4), state(4))


def test_the_newest_generation_is_promoted_at_close(tmp_path: Path) -> None:
    with open_pair(tmp_path, durable_every=10) as store:
        for step in range(1, 4):
            store.save(state(step), run="r", step=step)
    with castore.open(tmp_path / "durable") as durable:
        assert ids(durable) == [3]
        assert_state_equal(durable.load("r"), state(3))


def test_each_tier_keeps_what_its_own_policy_keeps(tmp_path: Path) -> None:
    with open_pair(tmp_path, fast_keep=1, durable_retention=RetentionPolicy(keep_last=2)) as store:
        for step in range(1, 6):
            store.save(state(step), run="r", step=step)
        store.wait_promotions()
        assert ids(store.fast) == [5]
        assert ids(store.durable) == [4, 5]
        assert ids(store) == [4, 5]  # the tiered view lists both tiers
        assert verify_store(store.fast, deep=True).ok
        assert verify_store(store.durable, deep=True).ok


def test_collecting_one_tier_deletes_nothing_of_the_other(tmp_path: Path) -> None:
    with open_pair(tmp_path, promote_on_exit=False) as store:
        for step in range(1, 4):
            store.save(state(step), run="r", step=step)
        store.wait_promotions()
        durable_chunks = sorted(store.durable.backend.iter_keys(Namespace.CHUNKS))
        castore.gc.collect_garbage(store.fast, RetentionPolicy(keep_last=1))
        assert sorted(store.durable.backend.iter_keys(Namespace.CHUNKS)) == durable_chunks
        fast_chunks = sorted(store.fast.backend.iter_keys(Namespace.CHUNKS))
        castore.gc.collect_garbage(store.durable, RetentionPolicy(keep_last=1))
        assert sorted(store.fast.backend.iter_keys(Namespace.CHUNKS)) == fast_chunks
        assert ids(store.durable) == [3]


def test_a_pinned_generation_outlives_fast_retention_until_promoted(tmp_path: Path) -> None:
    with open_pair(tmp_path, fast_keep=1, promote_on_exit=False, durable_every=100) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        gen = store.resolve("r")
        store.refs.write_tag("r", f"{PIN_PREFIX}1", store.refs.read("r"))  # as after_publish
        for step in range(2, 4):
            store.save(state(step), run="r", step=step)
        store.wait_promotions()
        assert ids(store.fast) == [1, 3]  # 1 pinned, 3 the newest
        promoted = store.promote("r", 1)
        assert promoted.error is None and store.durable.resolve("r", 1).root == gen.root
        store.save(state(4), run="r", step=4)
        store.wait_promotions()
        assert 1 not in ids(store.fast)


def test_a_wiped_fast_tier_restores_from_the_durable_one_and_saves_on(tmp_path: Path) -> None:
    with open_pair(tmp_path) as store:
        for step in range(1, 4):
            store.save(state(step), run="r", step=step)
    shutil.rmtree(tmp_path / "fast")  # the node is replaced
    with open_pair(tmp_path) as store:
        assert store.resolve("r").id == 3
        restored = store.restore("r")
        assert_state_equal(restored.state, state(3))
        assert restored.sources["durable"] == 12 * CHUNK == store.served_bytes["durable"]
        newest = store.fast.resolve("r")
        assert held_elsewhere(Path(store.fast.path), "r", 3, Digest.from_hex(newest.root))
        report = verify_store(store.fast, deep=True)
        assert report.ok and report.held_elsewhere == [("r", 3)], report.problems
        store.save(state(4), run="r", step=4)  # follows the durable history: id 4
        assert [(p.generation, p.error) for p in store.wait_promotions()] == [(4, None)]
        store.save(state(5), run="r", step=5)
        store.wait_promotions()  # fast retention (keep 2) dropped 3, and its record
        assert verify_store(store.fast).held_elsewhere == []
        assert not (tmp_path / "fast" / "tiers" / "elsewhere" / "r" / f"{3:012d}").exists()
    with castore.open(tmp_path / "durable") as durable:
        assert ids(durable) == [1, 2, 3, 4, 5]
        assert verify_store(durable, deep=True).ok


def test_a_damaged_fast_chunk_is_read_from_the_durable_tier(tmp_path: Path) -> None:
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        entry = store.fast.tensor_entries(store.fast.resolve_root("r")[1])["weight"][0]
        key = entry.chunks[0]
        value = store.fast.backend.get(Namespace.CHUNKS, key)
        assert value is not None
        raw_put(store.fast, Namespace.CHUNKS, key, flipped(value, 17))
        assert_state_equal(store.load("r"), state(1))
        assert store.served_bytes["durable"] == CHUNK
        assert store.tiered_backend.damaged["fast"] == 1


def test_a_chunk_damaged_in_every_tier_fails_the_generation_and_restore_falls_back(
    tmp_path: Path,
) -> None:
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.save(state(2), run="r", step=2)
        store.wait_promotions()
        entry = store.fast.tensor_entries(store.fast.resolve_root("r")[1])["weight"][0]
        key = entry.chunks[0]  # generation 2's own chunk: 1's first chunk differs
        for tier in (store.fast, store.durable):
            value = tier.backend.get(Namespace.CHUNKS, key)
            assert value is not None
            raw_put(tier, Namespace.CHUNKS, key, flipped(value, 3))
        with pytest.raises(ChecksumMismatchError):
            store.load("r")
        restored = store.restore("r", fallback="previous")
        assert restored.generation.id == 1 and len(restored.skipped) == 1
        assert_state_equal(restored.state, state(1))


def test_a_cut_off_promotion_leaves_the_durable_tier_as_it_was_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On this process's thread, where the test can cut the copy off (the uploader
    # process's deaths are tests/test_tiers_crash.py's).
    with open_pair(tmp_path, durable_every=2, promote_on_exit=False, uploader="thread") as store:
        store.save(state(1), run="r", step=1)
        store.save(state(2), run="r", step=2)
        store.wait_promotions()
        assert ids(store.durable) == [2]

        def cut(nbytes: int) -> None:
            raise ConnectionError("the uplink went away")

        monkeypatch.setattr("castore.core.background.Throttle.take", lambda self, n: cut(n))
        store.save(state(3), run="r", step=3)
        store.save(state(4), run="r", step=4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            promoted = store.wait_promotions()
        assert isinstance(promoted[-1].error, ConnectionError)
        assert any("ConnectionError" in str(w.message) for w in caught)
        assert ids(store.durable) == [2] and verify_store(store.durable, deep=True).ok
        assert f"{PIN_PREFIX}4" in store.fast.refs.tags("r")  # kept for the retry
        monkeypatch.undo()
    with open_pair(tmp_path, durable_every=2, promote_on_exit=False) as store:
        promoted = store.wait_promotions()  # the new handle retries the pinned promotion
        assert [(p.generation, p.error) for p in promoted] == [(4, None)]
        assert ids(store.durable) == [2, 4]
        assert_state_equal(store.durable.load("r"), state(4))


def test_a_damaged_held_elsewhere_record_is_a_problem_verify_reports(tmp_path: Path) -> None:
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
    shutil.rmtree(tmp_path / "fast")
    open_pair(tmp_path).close()
    record = tmp_path / "fast" / "tiers" / "elsewhere" / "r" / f"{1:012d}"
    record.write_bytes(record.read_bytes().replace(b'"r"', b'"x"'))
    with castore.open(tmp_path / "fast") as fast:
        report = verify_store(fast)
        assert not report.ok and "held-elsewhere record is damaged" in str(report.problems[0])
        with pytest.raises(CorruptObjectError):
            held_elsewhere(tmp_path / "fast", "r", 1, Digest.from_hex(fast.resolve("r").root))


def test_a_shared_directory_as_the_durable_tier(tmp_path: Path) -> None:
    castore.open(tmp_path / "durable", shared=True).close()
    with open_pair(tmp_path, durable_every=1) as store:
        for step in range(1, 3):
            store.save(state(step), run="r", step=step)
        assert [p.error for p in store.wait_promotions()] == [None, None]
    shutil.rmtree(tmp_path / "fast")
    with open_pair(tmp_path) as store:
        assert_state_equal(store.load("r"), state(2))
        sliced = store.read_slice("r", "latest", "weight", (slice(250, 260),))
        assert np.array_equal(sliced, state(2)["weight"][250:260])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_train_state_and_dcp_work_unchanged_on_a_tiered_store(tmp_path: Path) -> None:
    """TrainState.save/load and the DCP writer/reader, before and after the fast tier is lost."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from castore.dcp import CastoreReader, CastoreWriter
    from castore.train import TrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with open_pair(tmp_path) as store:
        TrainState(model, optimizer).save(store, run="train")
        dcp.save({"w": torch.arange(300.0)}, storage_writer=CastoreWriter(store, run="dcp", step=1),
                 no_dist=True)  # fmt: skip
    shutil.rmtree(tmp_path / "fast")
    with open_pair(tmp_path) as store:
        fresh = torch.nn.Linear(8, 4)
        TrainState(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)).load(store, run="train")
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, saved[name]), name
        target = {"w": torch.zeros(300)}
        dcp.load(target, storage_reader=CastoreReader(store, run="dcp"), no_dist=True)
        assert torch.equal(target["w"], torch.arange(300.0))
        assert store.served_bytes["durable"] > 0


def test_the_tiers_command_says_where_each_generation_is(tmp_path: Path) -> None:
    from cli_runner import run_cli

    with open_pair(tmp_path, durable_every=2, fast_keep=2, promote_on_exit=False) as store:
        for step in range(1, 4):
            store.save(state(step), run="r", step=step)
        store.wait_promotions()
        store.refs.write_tag("r", f"{PIN_PREFIX}3", store.refs.read("r"))  # as mid-promotion
        ages = store.recovery_points()["r"]
        assert set(ages) == {"fast", "durable"} and 0 <= ages["fast"] <= ages["durable"]
    before = run_cli("tiers", tmp_path / "fast", tmp_path / "durable").stdout.splitlines()
    assert [line.split()[5:7] for line in before[2:-2]] == [["held", "yes"], ["held", "pending"]]
    assert before[-2].startswith("r: a restore now selects generation 3 (step 3), the newest, ")
    shutil.rmtree(tmp_path / "fast")
    open_pair(tmp_path, promote_on_exit=False).close()  # a new node: takes 2 as elsewhere
    result = run_cli("tiers", tmp_path / "fast", tmp_path / "durable")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["run", "id", "step", "time", "fast", "durable", "root"]
    assert [line.split()[5:7] for line in lines[2:-2]] == [["elsewhere", "yes"]]
    assert lines[-2] == (  # the new node lists 2, holds none of it: the durable tier does
        "r: a restore now selects generation 2 (step 2), the newest, from the durable tier"
    )
    assert lines[-1].startswith("r: newest generation per tier: durable ")
    missing = run_cli("tiers", tmp_path / "fast", tmp_path / "nowhere")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "Traceback" not in missing.stderr


def test_a_capped_promotion_takes_at_least_its_bytes_over_the_rate(tmp_path: Path) -> None:
    """12 KiB at 24 KiB/s: half a second at least, in batches of a tenth of a second's bytes."""
    with open_pair(tmp_path, durable_rate=24 * 1024, promote_on_exit=False) as store:
        store.save(state(1), run="r", step=1)
        [promoted] = store.wait_promotions()
    assert promoted.error is None and promoted.copied is not None
    assert promoted.copied.bytes_copied == 12 * CHUNK
    assert promoted.seconds >= 0.4  # the bucket lends 50 ms of bytes up front


def test_a_symlinked_record_directory_is_refused_and_nothing_outside_is_touched(
    tmp_path: Path,
) -> None:
    from castore.core.holdings import forget_elsewhere, mark_elsewhere
    from castore.errors import UnsafeStoreFileError

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"{7:012d}").write_text("not castore's")
    fast = tmp_path / "fast"
    castore.open(fast).close()
    (fast / "tiers" / "elsewhere").mkdir(parents=True)
    (fast / "tiers" / "elsewhere" / "r").symlink_to(outside)
    digest = Digest(bytes(32))
    with pytest.raises(UnsafeStoreFileError):
        forget_elsewhere(fast, "r", keep=set())
    with pytest.raises(UnsafeStoreFileError):
        mark_elsewhere(fast, "r", 1, digest)
    with pytest.raises(UnsafeStoreFileError):
        held_elsewhere(fast, "r", 7, digest)
    assert sorted(p.name for p in outside.iterdir()) == [f"{7:012d}"]


@pytest.mark.parametrize("priority", ["low", "idle"])
def test_the_uploader_process_runs_below_training(tmp_path: Path, priority: str) -> None:
    """nice 10 ("low"), or Linux's SCHED_IDLE ("idle"): the copy gives training the CPU."""
    import os

    with open_tiered(tmp_path / "fast", tmp_path / "durable", uploader_priority=priority) as store:
        store.save({"w": np.arange(1000.0)}, run="r", step=1)
        store.wait_promotions()
        assert [p.generation for p in store.promoted if p.error is None] == [1]
        uploader = store._worker.pipe.process if store._worker.pipe else None
        assert uploader is not None and uploader.poll() is None
        assert os.getpriority(os.PRIO_PROCESS, uploader.pid) >= 10
        policy = os.sched_getscheduler(uploader.pid)
        idle = getattr(os, "SCHED_IDLE", None)
        if priority == "idle" and idle is not None:
            assert policy == idle
        else:
            assert policy == os.SCHED_OTHER
    with pytest.raises(ValueError, match="uploader_priority"):
        open_tiered(tmp_path / "fast", tmp_path / "durable", uploader_priority="high")


def test_the_uploader_process_exits_quietly_or_in_one_line(tmp_path: Path) -> None:
    """Its job died before sending work (stdin closed at once): exit 0, nothing said. Its
    node's fast tier is gone: one line on stderr, exit 1; never a traceback."""
    import json
    import subprocess
    import sys

    def uploader(stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "castore.tiers.uploader"],
            input=stdin, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    died = uploader("")
    assert (died.returncode, died.stdout, died.stderr) == (0, "", "")
    castore.open(tmp_path / "durable").close()
    spec = {"fast": str(tmp_path / "lost-fast"), "durable": str(tmp_path / "durable")}
    gone = uploader(json.dumps(spec) + "\n")
    assert gone.returncode == 1 and gone.stdout == "", gone.stderr
    assert gone.stderr.count("\n") == 1 and "Traceback" not in gone.stderr, gone.stderr
    assert gone.stderr.startswith("castore uploader: StoreNotFoundError: no castore store at ")


def test_a_format_2_fast_tier_is_upgraded_at_open_saying_so_once(tmp_path: Path) -> None:
    """A fast tier older than chunk frames may receive frames (a peer's copies, a save with
    a codec): open_tiered makes it format 4 first, so an older castore refuses the store
    whole (format 4: "upgrade castore") instead of calling those chunks damaged."""
    import json

    with castore.open(tmp_path / "fast", chunk_size=CHUNK) as old:
        old.save(state(1), run="r", step=1)
    marker = tmp_path / "fast" / "castore.json"
    config = json.loads(marker.read_text())
    config["format_version"] = 2
    del config["codec"]
    marker.write_text(json.dumps(config))
    with pytest.warns(castore.errors.CastoreWarning) as said:
        store = open_pair(tmp_path, promote_on_exit=False)
    with store:
        [line] = [str(w.message) for w in said]
        assert "\n" not in line and "was a format 2 store; it is now format 4" in line
        assert store.save(state(2), run="r", step=2, codec="zstd").id == 2
        assert_state_equal(store.load("r", 1), state(1))
    upgraded = json.loads(marker.read_text())
    assert (upgraded["format_version"], upgraded["codec"]) == (4, "none")
    assert {k: v for k, v in upgraded.items() if k not in ("format_version", "codec")} == {
        k: v for k, v in config.items() if k != "format_version"
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_pair(tmp_path, promote_on_exit=False).close()  # format 4 now: nothing to say


def test_the_tier_hooks_are_declared_once_and_a_tiered_store_overrides_each(
    tmp_path: Path,
) -> None:
    """The seam (castore.core.commit.TierHooks): a plain store inherits its do-nothing
    bodies, defines none of its own, and TieredStore overrides every one of them."""
    hooks = [name for name in vars(TierHooks) if not name.startswith("_")]
    assert sorted(hooks) == ["after_publish", "node_session", "report_step",
                             "selects_for_durable", "served_by_tier"]  # fmt: skip
    assert not [name for name in hooks if name in vars(castore.Store)]
    assert not [name for name in hooks if name not in vars(TieredStore)]
    with castore.open(tmp_path / "plain") as plain:
        plain.save(state(1), run="r", step=1)
        assert plain.served_by_tier() == {} and not plain.selects_for_durable("r", 1)
    with open_pair(tmp_path, promote_on_exit=False) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
    shutil.rmtree(tmp_path / "fast")
    with open_pair(tmp_path) as store:
        store.load("r")
        assert store.served_by_tier() == {"durable": 12 * CHUNK}  # chunks alone, by tier


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_every_report_names_the_tiers_fast_and_durable(tmp_path: Path) -> None:
    """One name per place (docs/TIERS.md): store.served_bytes, restore(...).sources and
    castore.dist's bytes_by_source say "fast" for the fast tier, as castore tiers does
    (they said "primary", "primary" and "local")."""
    pytest.importorskip("torch")
    import castore.dist

    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        entry = store.fast.tensor_entries(store.fast.resolve_root("r")[1])["weight"][0]
        value = store.fast.backend.get(Namespace.CHUNKS, entry.chunks[0])
        assert value is not None
        raw_put(store.fast, Namespace.CHUNKS, entry.chunks[0], flipped(value, 17))
        restored = store.restore("r")
        assert set(restored.sources) == set(store.served_bytes) == {"fast", "durable"}
        assert restored.sources["durable"] == CHUNK  # the damaged chunk alone
        target = {"weight": np.zeros(2048, dtype=np.float32)}
        report = castore.dist.load(store, "r", target).report
        assert report.bytes_by_source == {"fast": 7 * CHUNK, "durable": CHUNK}
        assert store.tiered_backend.damaged == {"fast": 2}


def test_castore_log_on_the_durable_tier_shows_what_each_promotion_wrote_there(
    tmp_path: Path,
) -> None:
    """A replaced node saves the newest state again: its fast tier writes every chunk, the
    durable tier held all of them and is sent none. Its log said the fast-tier save's 12 KiB
    new (the root is copied as is); it says what the promotion wrote, from the reflog."""
    from cli_runner import run_cli

    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
    shutil.rmtree(tmp_path / "fast")  # the node is replaced
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=2)
        [promoted] = store.wait_promotions()
        assert promoted.copied is not None and promoted.copied.bytes_copied == 0
        assert store.fast.resolve("r", 2).new_bytes == 12 * CHUNK  # the fast tier wrote all
    result = run_cli("log", tmp_path / "durable")
    assert result.returncode == 0, result.stderr
    header, _, *rows = [re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines()]
    assert header[:10] == ["id", "step", "time", "logical", "new", "stored", "written", "dedup",
                           "held", "root"]  # fmt: skip
    cells = {int(row[0]): row[3:9] for row in rows}  # logical, new, stored, written, dedup, held
    assert cells[1][:3] == ["12.0 KiB"] * 3 and cells[1][-1] == "-"  # the first: every chunk
    assert cells[2][:3] == ["12.0 KiB", "0 B", "0 B"], rows  # the second: nothing new
    assert cells[2][-2:] == ["100.0%", "-"], rows  # all held already; no caller held
    with castore.open(tmp_path / "durable") as durable:
        [advance] = [r for r in durable.refs.reflog("r") if r["generation"] == 2]
        assert advance["wrote"]["chunks"] == 0 and advance["wrote"]["objects"] > 0
        assert "wrote" not in store.fast.refs.reflog("r")[-1]  # a save records no copy


# -- each fast-tier chunk hashed once ---------------------------------------------------


class CountingBlake3:
    """Stands in for blake3.blake3 in castore.format.hashing (every digest castore makes):
    counts each digest made."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.AUTO = real.AUTO
        self.digests: Counter[bytes] = Counter()

    def __call__(self, data: Any = b"", **options: Any) -> Any:
        outer, hasher = self, self.real(data, **options)

        class Counted:
            def update(self, more: Any) -> Counted:
                hasher.update(more)
                return self

            def digest(self) -> bytes:
                found = bytes(hasher.digest())
                outer.digests[found] += 1
                return found

        return Counted()


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> CountingBlake3:
    counting = CountingBlake3(hashing_module.blake3.blake3)
    monkeypatch.setattr(hashing_module, "blake3", SimpleNamespace(blake3=counting))
    return counting


def chunks_of(store: castore.Store, run: str = "r") -> list[bytes]:
    entries = store.tensor_entries(store.resolve_root(run)[1])
    return sorted({c for boxes in entries.values() for entry in boxes for c in entry.chunks})


def test_a_load_and_a_dist_restore_from_the_fast_tier_hash_each_chunk_once(
    tmp_path: Path, hashes: CountingBlake3
) -> None:
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        chunks = chunks_of(store.fast)
        assert len(chunks) == 12
        hashes.digests.clear()
        assert_state_equal(store.load("r"), state(1))  # new arrays: castore.core.readplan
        assert [hashes.digests[c] for c in chunks] == [1] * 12
        hashes.digests.clear()
        targets = {name: np.zeros_like(value) for name, value in state(1).items()}
        result = castore.dist.load(store, "r", targets)  # live targets: verify, then deliver
        assert_state_equal(targets, state(1))
        assert [hashes.digests[c] for c in chunks] == [1] * 12
        assert result.report.bytes_by_source == {"fast": 12 * CHUNK}
        assert store.tiered_backend.damaged == {}


def test_broken_control_the_tiers_own_check_hashed_each_fast_chunk_twice(
    tmp_path: Path, hashes: CountingBlake3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count above sees a second hash: reads that check the fast tier themselves."""
    monkeypatch.setattr(
        tiered_module.TieredChunkBackend, "read_to_verify", ChunkBackend.read_to_verify
    )
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        chunks = chunks_of(store.fast)
        hashes.digests.clear()
        assert_state_equal(store.load("r"), state(1))
        assert [hashes.digests[c] for c in chunks] == [2] * 12


def damage_fast_chunk(store: TieredStore, name: str = "weight") -> bytes:
    """Flip a byte of chunk 0 of ``name`` in the fast tier's pack; return its key."""
    entry = store.fast.tensor_entries(store.fast.resolve_root("r")[1])[name][0]
    key = entry.chunks[0]
    value = store.fast.backend.get(Namespace.CHUNKS, key)
    assert value is not None
    raw_put(store.fast, Namespace.CHUNKS, key, flipped(value, 17))
    return key


def test_a_damaged_fast_chunk_restores_into_live_targets_from_the_durable_tier(
    tmp_path: Path, hashes: CountingBlake3
) -> None:
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        key = damage_fast_chunk(store)
        hashes.digests.clear()
        targets = {name: np.zeros_like(value) for name, value in state(1).items()}
        result = castore.dist.load(store, "r", targets)
        assert_state_equal(targets, state(1))
        assert result.report.bytes_by_source == {"fast": 11 * CHUNK, "durable": CHUNK}
        assert store.tiered_backend.damaged == {"fast": 1}
        assert store.tiered_backend.damaged_keys == {"fast": {key}}
        # The durable copy was hashed by the tiers (to choose it) and by the load; the
        # others once, by the load.
        assert hashes.digests[key] == 2
        assert {hashes.digests[c] for c in chunks_of(store.fast) if c != key} == {1}


def test_broken_control_without_the_second_source_a_damaged_fast_chunk_fails_the_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        tiered_module.TieredChunkBackend, "_again", lambda self, namespace, key, unchecked: None
    )
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        damage_fast_chunk(store)
        targets = {name: np.zeros_like(value) for name, value in state(1).items()}
        with pytest.raises(ChecksumMismatchError, match="chunk 0 of tensor 'weight'"):
            castore.dist.load(store, "r", targets)
        assert not targets["weight"].any()  # nothing live changed
        with pytest.raises(ChecksumMismatchError, match="chunk 0 of tensor 'weight'"):
            store.load("r")


def test_a_read_that_does_not_verify_still_gets_the_intact_copy(tmp_path: Path) -> None:
    """``read_many`` (``get``, castore copy, verify, repair) checks the fast tier itself."""
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        key = damage_fast_chunk(store)
        intact = store.durable.backend.get(Namespace.CHUNKS, key)
        assert store.backend.get(Namespace.CHUNKS, key) == intact
        assert store.tiered_backend.damaged == {"fast": 1}


def test_broken_control_without_the_tiers_check_a_read_that_does_not_verify_gets_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the tiers took the fast copy unchecked in ``read_many``, ``get`` would hand on the
    damage; a load, which verifies every chunk itself, still asks again and restores."""
    monkeypatch.setattr(tiered_module, "_intact", lambda key, value: True)
    with open_pair(tmp_path) as store:
        store.save(state(1), run="r", step=1)
        store.wait_promotions()
        key = damage_fast_chunk(store)
        assert store.backend.get(Namespace.CHUNKS, key) != store.durable.backend.get(
            Namespace.CHUNKS, key
        )
        assert_state_equal(store.load("r"), state(1))
        assert store.tiered_backend.damaged == {"fast": 1}
