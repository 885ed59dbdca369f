"""castore as a torch.distributed.checkpoint (DCP) backend: castore.dcp.

Multi-process tests (``slow``) run real gloo groups through tests/helpers/dist_harness.py, one
launch per world size, each running a whole script (tests/helpers/dcp_workers.py) so the torch
import is paid once per process:

* ``saved_at_4``: a model sharded with FSDP2 (``fully_shard`` works on CPU/gloo in this
  torch) and its Adam optimizer, through ``get_state_dict``, saved by 4 ranks with
  ``CastoreWriter`` and with DCP's own ``FileSystemWriter`` (the reference); both loaded
  at 4; the unchanged state saved again; loads with a damaged chunk; an ``async_save``
  whose upload the test holds until it has looked at the store;
* ``loaded_at_2``: generation 1 loaded by 2 ranks from castore and from the reference;
  a load of "latest" while another writer publishes; a lone ``no_dist`` load on rank 0.

Loading at 1 rank (a plain, unsharded model, ``no_dist=True``) and the single-process
API tests run in this process, without a process group.

Every comparison is between snapshots (each state-dict leaf; DTensors as full tensors,
taken after ``set_state_dict`` from the live model and optimizer), bit for bit, and types
of non-tensor values included. Load targets start filled with a sentinel.
"""

from __future__ import annotations

import gc
import os
import pickle
from pathlib import Path
from typing import Any

import dcp_workers as w
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import describe, run_ranks
from torch.distributed.checkpoint.api import CheckpointException

import castore
import castore.cli
import castore.gc
from castore.dcp import CastoreReader, CastoreWriter, parse_checkpoint_id
from castore.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    GenerationNotFoundError,
    InvalidNameError,
    UnsupportedValueError,
)
from castore.format.tree import decode_tree
from castore.verify import verify_store

# One worker runs the module: its module-scoped fixtures are built once.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.xdist_group("dcp"),
]

LAUNCH_TIMEOUT = 150.0


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Same leaves; tensors equal bit for bit (dtype and shape too); other values equal
    and of the same type (a tuple stays a tuple)."""
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual.keys() ^ expected.keys())}"
    for key, want in expected.items():
        got = actual[key]
        if torch.is_tensor(want):
            assert torch.is_tensor(got), f"{what}: {key} is {type(got).__name__}"
            assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{what}: {key}"
            same = torch.equal(
                got.contiguous().reshape(-1).view(torch.uint8),
                want.contiguous().reshape(-1).view(torch.uint8),
            )
            assert same, f"{what}: {key} differs\n{got}\n!=\n{want}"
        else:
            assert type(got) is type(want) and got == want, f"{what}: {key}: {got!r} != {want!r}"


def new_store(path: Path) -> str:
    castore.open(path, chunk_size=w.CHUNK_SIZE).close()
    return str(path)


def rank_values(outcomes: list[Any], world_size: int) -> list[dict[str, Any]]:
    assert len(outcomes) == world_size
    assert all(o.ok for o in outcomes), describe(outcomes)
    return [o.value for o in outcomes]


# -- the multi-process fixtures ---------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("dcp4")
    path, ref = new_store(base / "store"), str(base / "reference")
    outcomes = run_ranks(4, w.world4_script, path, ref, timeout=LAUNCH_TIMEOUT)
    return {"path": path, "reference": ref, "ranks": rank_values(outcomes, 4)}


@pytest.fixture(scope="module")
def loaded_at_2(saved_at_4: dict[str, Any]) -> list[dict[str, Any]]:
    flag = str(Path(saved_at_4["reference"]).parent / "race-flag")
    args = (saved_at_4["path"], saved_at_4["reference"], flag)
    return rank_values(run_ranks(2, w.world2_script, *args, timeout=LAUNCH_TIMEOUT), 2)


@pytest.fixture(scope="module")
def loaded_at_1(saved_at_4: dict[str, Any]) -> dict[str, Any]:
    """Generation 1 into a plain (unsharded) model in this process: no process group."""
    assert not torch.distributed.is_initialized()
    with castore.open(saved_at_4["path"]) as store:
        reader = CastoreReader(store, run=w.RUN, generation=1)
        loaded = w.load_snapshot(None, reader, no_dist=True)
        generation = reader.generation
    reference = w.load_snapshot(None, dcp.FileSystemReader(saved_at_4["reference"]), no_dist=True)
    return {"castore": loaded, "reference": reference, "generation": generation}


# -- 1. FSDP2 state saved at 4, loaded at 4, 2 and 1 ------------------------------------------


@pytest.mark.slow
def test_the_saved_state_is_fsdp2_sharded_with_uneven_and_empty_shards(
    saved_at_4: dict[str, Any],
) -> None:
    ranks = saved_at_4["ranks"]
    assert [r["locals"]["model.fc1.weight"] for r in ranks] == [(6, 16)] * 4
    assert [r["locals"]["model.fc2.weight"][0] for r in ranks] == [3, 3, 3, 1]
    assert [r["locals"]["model.head.weight"][0] for r in ranks] == [1, 1, 0, 0]
    assert [r["locals"]["optim.state.fc1.weight.exp_avg"] for r in ranks] == [(6, 16)] * 4
    saved = ranks[0]["saved"]
    assert saved["model.scale"].dtype == torch.bfloat16  # a plain, replicated buffer
    assert saved["optim.state.fc1.weight.step"].item() == 1.0  # the optimizer has state
    assert saved["optim.param_groups.0.betas"] == (0.9, 0.999)
    for rank, result in enumerate(ranks):  # full tensors: every rank sees the same state
        assert_same_state(result["saved"], saved, f"rank {rank} vs rank 0")
    generation = ranks[0]["generation"]
    assert generation.id == 1 and generation.step == 1 and generation.world_size == 4
    assert [r["generation"] for r in ranks[1:]] == [None] * 3  # set on the coordinator only


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 2, 1])
def test_fsdp2_state_saved_at_4_loads_equal_to_dcp_file_system_reference(
    world_size: int, request: pytest.FixtureRequest
) -> None:
    coordinator = request.getfixturevalue("saved_at_4")["ranks"][0]
    saved, root = coordinator["saved"], coordinator["generation"].root
    if world_size == 1:
        result = request.getfixturevalue("loaded_at_1")
        pairs = [(result["castore"], result["reference"])]
        generations = [result["generation"]]
    else:
        fixture = "saved_at_4" if world_size == 4 else "loaded_at_2"
        value = request.getfixturevalue(fixture)
        ranks = value["ranks"] if world_size == 4 else value
        pairs = [(r[f"castore@{world_size}"], r[f"reference@{world_size}"]) for r in ranks]
        generations = [r["reader_generation"] for r in ranks]
    for rank, (castore_state, reference) in enumerate(pairs):
        assert_same_state(reference, saved, f"DCP reference at {world_size}, rank {rank}")
        assert_same_state(castore_state, reference, f"castore at {world_size}, rank {rank}")
    assert {(g.id, g.root) for g in generations} == {(1, root)}  # generation 1, pinned


# -- 2. an unchanged re-save writes no chunk --------------------------------------------------


@pytest.mark.slow
def test_saving_unchanged_state_again_writes_no_new_chunk(saved_at_4: dict[str, Any]) -> None:
    coordinator = saved_at_4["ranks"][0]
    first, again = coordinator["generation"], coordinator["resave"]["generation"]
    assert first.stats.new_bytes > 0 and first.stats.new_chunks > 0  # the premise
    assert again.id == 2 and again.step == 2 and again.parent == first.root
    assert again.stats.logical_bytes == first.stats.logical_bytes
    assert again.stats.new_bytes == 0 and again.stats.new_chunks == 0, again.stats
    assert again.stats.reused_chunks == first.stats.new_chunks + first.stats.reused_chunks
    assert coordinator["resave"]["keys_unchanged"] is True  # the store's chunk keys
    assert [r["resave"]["generation"] for r in saved_at_4["ranks"][1:]] == [None] * 3


# -- 3. a damaged chunk fails dcp.load on every rank and changes nothing -----------------------

DAMAGE = {
    # (who reads the chunk, what is done to it): the castore error the reading rank raises
    ("all", "flip"): ("t/model.scale", "ChecksumMismatchError"),  # the replicated buffer
    ("rank0", "flip"): ("t/model.fc1.weight", "ChecksumMismatchError"),  # rows 0-5
    ("rank0", "delete"): ("t/model.fc1.weight", "ChunkMissingError"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE), ids="-".join)
def test_a_damaged_chunk_fails_every_rank_and_changes_no_live_tensor(
    saved_at_4: dict[str, Any], case: tuple[str, str]
) -> None:
    tensor, _ = DAMAGE[case]
    ranks = [r[case] for r in saved_at_4["ranks"]]
    assert ranks[0]["users"] == [tensor]  # no other tensor shares the damaged chunk
    for rank, result in enumerate(ranks):
        assert "error" in result, f"rank {rank} loaded a damaged checkpoint"
        # every tensor and the SENTINEL hyperparameters (lr, eps, betas) of the target
        assert len(result["untouched"]) == 24
        assert all(result["untouched"].values()), (rank, result["untouched"])
        assert result["live_untouched"], rank  # the model's and optimizer's own tensors
    # Control: the same targets, loaded after the chunk was put back, do change.
    assert_same_state(saved_at_4["ranks"][0]["after_repair"], saved_at_4["ranks"][0]["saved"], "")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            marks=(),
        )
        if DAMAGE[case][1] == "ChecksumMismatchError"
        else case
        for case in DAMAGE
    ],
    ids="-".join,
)
def test_the_error_of_a_damaged_chunk_names_the_damage_on_every_rank(
    saved_at_4: dict[str, Any], case: tuple[str, str]
) -> None:
    _, error = DAMAGE[case]
    for rank, result in enumerate(r[case] for r in saved_at_4["ranks"]):
        raised = result["error"]
        assert raised["type"] == "CheckpointException", (rank, raised["message"][-500:])
        assert set(raised["causes"]) == {0, 1, 2, 3}
        for name, mro in raised["causes"].values():
            assert name == error and "IntegrityError" in mro, (rank, raised["causes"])


def test_castore_errors_survive_pickle() -> None:
    """Every castore error pickles, whatever its constructor takes."""
    error = CorruptObjectError("bad", run="m")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
    damaged = ChecksumMismatchError("chunk damaged", expected="a" * 64, actual="b" * 64)
    copy = pickle.loads(pickle.dumps(damaged))  # DCP gathers each rank's error by pickle
    assert type(copy) is ChecksumMismatchError and str(copy) == str(damaged)
    assert copy.expected == "a" * 64


# -- 4. async_save publishes only after the upload --------------------------------------------


@pytest.mark.slow
def test_async_save_publishes_only_after_the_upload_completes(
    saved_at_4: dict[str, Any],
) -> None:
    ranks = saved_at_4["ranks"]
    for rank, result in enumerate(ranks):
        info = result["async"]
        during = info["during"]
        assert during["entered"], rank  # the upload was in write_data when we looked
        assert during["ids"] == during["still_ids"] == info["before"] == [1, 2], (rank, info)
        assert not during["done"] and not during["still_done"], (rank, during)
        assert info["after"] == [1, 2, 3], (rank, info)
    coordinator = ranks[0]["async"]
    assert coordinator["generation"].id == 3 and coordinator["generation"].step == 3
    assert {r["async"]["latest"].root for r in ranks} == {coordinator["generation"].root}
    ok, problems = coordinator["verify"]
    assert ok, problems
    saved, newer = ranks[0]["saved"], ranks[0]["async_saved"]
    assert not torch.equal(saved["model.fc1.weight"], newer["model.fc1.weight"])  # premise
    for rank, result in enumerate(ranks):
        assert_same_state(result["async_loaded"], newer, f"async generation at rank {rank}")


# -- castore bugs found with process groups ---------------------------------------------------


@pytest.mark.slow
def test_ranks_that_resolved_different_generations_refuse_together(
    saved_at_4: dict[str, Any], loaded_at_2: list[dict[str, Any]]
) -> None:
    """A generation published between two ranks' read_metadata: never a mixed load."""
    assert [r["race_ids"] for r in loaded_at_2] == [[1, 2, 3, 4]] * 2  # the premise
    loaded = [r["race"] for r in loaded_at_2]
    if all("type" in state for state in loaded):  # refused on every rank, by name
        assert all("RefConflictError" in state["message"] for state in loaded), loaded
        return
    assert all("type" not in state for state in loaded), loaded
    assert [r["race_generation"] for r in loaded_at_2] in ([3, 3], [4, 4])
    expected = {3: saved_at_4["ranks"][0]["async_saved"], 4: loaded_at_2[1]["race_published"]}
    want = expected[loaded_at_2[0]["race_generation"]]
    for rank, state in enumerate(loaded):
        assert_same_state(state, want, f"rank {rank}")


@pytest.mark.slow
def test_a_no_dist_load_on_one_rank_of_a_group(
    saved_at_4: dict[str, Any], loaded_at_2: list[dict[str, Any]]
) -> None:
    coordinator = loaded_at_2[0]
    saved = saved_at_4["ranks"][0]["saved"]
    assert_same_state(coordinator["solo_reference"], saved, "DCP reference, rank 0 alone")
    assert "type" not in coordinator["solo"], coordinator["solo"]["message"][-600:]
    assert_same_state(coordinator["solo"], saved, "castore, rank 0 alone")


# -- single process: no process group ---------------------------------------------------------


def plain_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(20, 9, generator=generator),
            "ids": torch.arange(-3, 40, dtype=torch.int64),
            "half": torch.randn(13, generator=generator).to(torch.bfloat16),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        },
        "extra": {
            "epoch": 3,
            "lr": 0.125,
            "name": "exp",
            "betas": (0.9, 0.999),
            "flags": [True, None, "x", 2],
            "nothing": None,
        },
        "step": 7,
    }


def blank(state: dict[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``state``: SENTINEL tensors, different plain values."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = blank(value)
        elif torch.is_tensor(value):
            out[key] = torch.full_like(value, w.SENTINEL)
        else:
            out[key] = "sentinel"
    return out


def flat(state: dict[str, Any]) -> dict[str, Any]:
    return w.leaves(state)


def test_round_trip_without_a_process_group(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    state = plain_state()
    path = tmp_path / "store"
    with castore.open(path, chunk_size=w.CHUNK_SIZE) as store:
        writer = CastoreWriter(store, run="r", step=42)
        dcp.save(state, storage_writer=writer, no_dist=True)
        target = blank(state)
        reader = CastoreReader(store, run="r")
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_same_state(flat(target), flat(state), "no_dist round trip")

        # an ordinary castore generation
        (listed,) = store.generations("r")
        assert listed == writer.generation == store.resolve("r") == reader.generation
        assert listed.id == 1 and listed.step == 42 and listed.world_size == 1
        assert listed.stats.new_bytes > 0
        report = verify_store(store, deep=True)
        assert report.ok, report.problems

        # castore's own load sees DCP's tensors and, as msgpack (never pickle), its values
        native = store.load("r", framework="torch")
        assert torch.equal(native["t"]["model.w"], state["model"]["w"])
        stored = native["b"]["extra.betas"]
        raw = stored.numpy().tobytes()
        assert not raw.startswith((b"\x80", b"PK")), raw[:8]  # neither pickle nor torch.save
        assert decode_tree(raw) == (0.9, 0.999)
        assert decode_tree(native["b"]["step"].numpy().tobytes()) == 7
    assert castore.cli.main(["log", str(path), "--run", "r"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["id", "step"]
    assert [line.split()[:2] for line in table[2:]] == [["1", "42"]]


class Opaque:
    """A custom class: DCP's planner pickles it; torch.load(weights_only=True) refuses it."""

    def __init__(self) -> None:
        self.x = 1


def test_a_value_that_is_not_plain_data_is_refused_and_nothing_is_published(
    store: castore.Store,
) -> None:
    state: dict[str, Any] = {"w": torch.ones(10), "extra": {"obj": Opaque()}}
    writer = CastoreWriter(store, run="r", step=1)
    with pytest.raises(CheckpointException) as raised:
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert "UnsupportedValueError" in str(raised.value)
    ((cause, _),) = raised.value.failures.values()
    assert isinstance(cause, UnsupportedValueError)
    assert "extra.obj" in str(cause) and "no pickle" in str(cause)
    assert writer.generation is None
    assert store.runs() == [] and store.refs.read("r") is None
    with pytest.raises(GenerationNotFoundError):
        store.resolve("r")
    # the same run then saves fine without the value
    state["extra"]["obj"] = {"x": 1}
    dcp.save(state, storage_writer=CastoreWriter(store, run="r", step=1), no_dist=True)
    assert [g.id for g in store.generations("r")] == [1]


def test_checkpoint_ids() -> None:
    for cls in (CastoreWriter, CastoreReader):
        assert cls.validate_checkpoint_id("castore://x/run") is True
        assert cls.validate_checkpoint_id("castore:///abs/store/run@3") is True
        assert cls.validate_checkpoint_id("/tmp/checkpoints/step-100") is False
        assert cls.validate_checkpoint_id(Path("relative/dir")) is False
    assert parse_checkpoint_id("castore://./ckpt/exp1") == ("./ckpt", "exp1", "latest")
    assert parse_checkpoint_id("castore:///a/b/exp1@12") == ("/a/b", "exp1", "12")
    for bad in ("castore://run-only", "/a/b/exp1", "castore://store/", "castore://a/@3"):
        with pytest.raises(InvalidNameError):
            parse_checkpoint_id(bad)
    # RUN@ with nothing after the @ is refused, not read as the newest.
    with pytest.raises(InvalidNameError, match="names no generation after '@'"):
        parse_checkpoint_id("castore:///a/b/exp1@")
    with pytest.raises(InvalidNameError, match="names no generation after '@'"):
        CastoreReader.from_checkpoint_id("castore:///a/b/exp1@")


def test_reader_from_checkpoint_id_and_reset(tmp_path: Path) -> None:
    """castore://STORE/RUN@GEN through from_checkpoint_id, reset, and DCP's checkpoint_id."""
    path = new_store(tmp_path / "store")
    first, second = plain_state(), plain_state()
    second["model"]["w"] = second["model"]["w"] * 2
    second["step"] = 8
    for index, state in enumerate((first, second), start=1):
        writer = CastoreWriter.from_checkpoint_id(f"castore://{path}/r", step=index)
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.generation is not None and writer.generation.id == index
        del writer
        gc.collect()  # the writer opened the store by path; let it go before the next one

    reader = CastoreReader.from_checkpoint_id(f"castore://{path}/r@1")
    target = blank(first)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same_state(flat(target), flat(first), "r@1 via from_checkpoint_id")
    assert reader.generation is not None and reader.generation.id == 1

    reader.reset(f"castore://{path}/r@2")
    target = blank(first)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert_same_state(flat(target), flat(second), "r@2 after reset")
    assert reader.generation is not None and reader.generation.id == 2

    # dcp.load resets the reader with its checkpoint_id argument
    for checkpoint_id, want, gen in (
        (f"castore://{path}/r", second, 2),
        (f"castore://{path}/r@1", first, 1),
    ):
        target = blank(first)
        dcp.load(target, checkpoint_id=checkpoint_id, storage_reader=reader, no_dist=True)
        assert_same_state(flat(target), flat(want), checkpoint_id)
        assert reader.generation is not None and reader.generation.id == gen


def test_loading_a_generation_not_written_through_castore_dcp_raises(
    store: castore.Store,
) -> None:
    store.save({"w": torch.ones(4)}, run="plain", step=1)
    reader = CastoreReader(store, run="plain")
    with pytest.raises(CorruptObjectError, match="not saved through castore.dcp"):
        reader.read_metadata()
    target = {"w": torch.zeros(4)}
    with pytest.raises(CheckpointException, match="not saved through castore.dcp"):
        dcp.load(target, storage_reader=CastoreReader(store, run="plain"), no_dist=True)
    assert torch.equal(target["w"], torch.zeros(4))


def test_a_writer_given_a_path_does_not_keep_the_store_open(tmp_path: Path) -> None:
    path = new_store(tmp_path / "store")
    writer = CastoreWriter(path, run="r", step=1)
    dcp.save(plain_state(), storage_writer=writer, no_dist=True)
    assert writer.generation is not None and writer.generation.id == 1
    with castore.open(path) as store:  # while the caller still holds the writer
        assert [g.id for g in store.generations("r")] == [1]


def test_a_collected_writer_given_a_path_leaves_no_lock_behind(tmp_path: Path) -> None:
    path = new_store(tmp_path / "store")
    assert _fds_under(tmp_path) == []
    writer = CastoreWriter.from_checkpoint_id(f"castore://{path}/r", step=1)
    dcp.save(plain_state(), storage_writer=writer, no_dist=True)
    del writer
    gc.collect()
    with castore.open(path) as store:  # the writer's LMDB environment is gone with it
        assert [g.id for g in store.generations("r")] == [1]
    castore.gc.compact(path)
    assert _fds_under(tmp_path) == []


def _fds_under(root: Path) -> list[str]:
    """This process's open files under root (the process's other files come and go)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listing (the listing's own descriptor)
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def _forge_dcp_metadata(store: castore.Store, change: Any) -> None:
    """Publish the next generation with its stored DCP metadata changed (hashes valid)."""
    from hostile import forge_root

    from castore.store import encode_metadata

    def mutate(root: dict[str, Any]) -> None:
        metadata = decode_tree(root["metadata"])
        change(metadata["dcp"])
        root["metadata"] = encode_metadata(metadata)

    forge_root(store, "r", mutate)


@pytest.mark.parametrize(
    "case, change",
    [
        ("a dtype that is not one", lambda md: md["tensors"]["m"].update(dtype="save")),
        ("chunks that are not pairs", lambda md: md["tensors"]["m"].update(chunks="xy")),
        ("no tensors field", lambda md: md.pop("tensors")),
        # The read region runs past the box that was saved: never read outside it.
        (
            "a chunk larger than its saved box",
            lambda md: md["tensors"]["m"].update(size=[16], chunks=[[[0], [12]]]),
        ),
    ],
)
def test_forged_dcp_metadata_is_a_typed_error_and_changes_nothing(
    tmp_path: Path, case: str, change: Any
) -> None:
    with castore.open(tmp_path / "store", chunk_size=16) as store:
        writer = CastoreWriter(store, run="r")
        dcp.save({"m": torch.arange(8.0)}, storage_writer=writer, no_dist=True)
        _forge_dcp_metadata(store, change)
        target = torch.full((16,), -1.0)
        # DCP wraps a storage reader's errors in its own; castore's names the damage.
        with pytest.raises(CheckpointException, match="DCP metadata") as info:
            dcp.load({"m": target}, storage_reader=CastoreReader(store, run="r"), no_dist=True)
        assert "IndexError" not in repr(info.value), case  # the untyped error it replaced
        assert torch.equal(target, torch.full((16,), -1.0)), case
