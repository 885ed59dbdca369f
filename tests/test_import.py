"""castore import: checkpoints written by other tools become generations, bitwise equal."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import cli_runner
import import_workers
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import describe, run_ranks
from safetensors.torch import save_file
from tqdm import tqdm

import castore
from castore.errors import ImportSourceError
from castore.format.tree import encode_state
from castore.importer import (
    from_safetensors,
    import_checkpoint,
    map_safetensors,
)

CHUNK_SIZE = 1024


def torch_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of every dtype the tests cover, several chunks each."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=gen).to(torch.bfloat16),
        "layer.0.weight": torch.randn(32, 16, generator=gen).to(torch.float16),
        "layer.0.bias": torch.randn(300, generator=gen),
        "positions": torch.randint(0, 1 << 40, (20, 10), generator=gen, dtype=torch.int64),
        "mask": torch.rand(50, generator=gen) > 0.5,
    }


def assert_bitwise(loaded: Any, expected: torch.Tensor) -> None:
    assert isinstance(loaded, torch.Tensor), type(loaded)
    assert loaded.dtype == expected.dtype
    assert loaded.shape == expected.shape
    assert torch.equal(loaded.view(torch.uint8), expected.contiguous().view(torch.uint8))


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with castore.open(tmp_path / "store", chunk_size=CHUNK_SIZE) as opened:
        yield opened


def test_safetensors_file_imports_bitwise(store: Any, tmp_path: Path) -> None:
    state = torch_state()
    source = tmp_path / "model.safetensors"
    save_file(state, source)
    report = import_checkpoint(store, "hf", source)
    assert (report.kind, report.generation, report.tensors) == ("safetensors", 1, len(state))
    assert report.logical_bytes == sum(t.numel() * t.element_size() for t in state.values())
    loaded = store.load("hf", framework="torch")
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert_bitwise(loaded[name], tensor)


def write_sharded(directory: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    """A sharded checkpoint as Hugging Face writes it: shards plus the index."""
    directory.mkdir()
    names = sorted(state)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[index::shards]}
        save_file(part, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.mark.parametrize("indexed", [True, False], ids=["index", "bare-directory"])
def test_sharded_safetensors_directory_imports_bitwise(
    store: Any, tmp_path: Path, indexed: bool
) -> None:
    state = torch_state(1)
    source = tmp_path / "sharded"
    write_sharded(source, state, shards=3)
    if not indexed:
        (source / "model.safetensors.index.json").unlink()
    report = from_safetensors(store, "hf", source)
    assert report.tensors == len(state)
    loaded = store.load("hf", framework="torch")
    for name, tensor in state.items():
        assert_bitwise(loaded[name], tensor)


def test_index_naming_a_missing_shard_is_refused(store: Any, tmp_path: Path) -> None:
    source = tmp_path / "sharded"
    write_sharded(source, torch_state(), shards=2)
    next(source.glob("model-00002-*")).unlink()
    with pytest.raises(ImportSourceError, match="missing"):
        from_safetensors(store, "hf", source)
    assert store.runs() == []


def hostile_safetensors(path: Path, header: Any, body: bytes = b"") -> Path:
    data = json.dumps(header).encode()
    path.write_bytes(len(data).to_bytes(8, "little") + data + body)
    return path


@pytest.mark.parametrize(
    "header",
    [
        [1, 2, 3],  # not a map
        {"w": "not a map"},
        {"w": {"dtype": "F32", "shape": [2]}},  # no data_offsets
        {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, -8]}},
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},  # past the end
        {"w": {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 8]}},
    ],
)
def test_a_hostile_safetensors_header_is_a_typed_error(
    store: Any, tmp_path: Path, header: Any
) -> None:
    path = hostile_safetensors(tmp_path / "bad.safetensors", header)
    with pytest.raises(ImportSourceError):
        from_safetensors(store, "hf", path)
    assert store.runs() == []


def changed_series(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` checkpoints of 10 equal tensors; each changes one tensor (10%) of the last."""
    gen = torch.Generator().manual_seed(7)
    state = {f"block.{i}.weight": torch.randn(64, 64, generator=gen) for i in range(10)}
    series = [dict(state)]
    for index in range(1, count):
        state = dict(state)
        state[f"block.{index}.weight"] = torch.randn(64, 64, generator=gen)
        series.append(state)
    return series


def test_a_series_writes_only_what_changed(store: Any, tmp_path: Path) -> None:
    reports = []
    for index, state in enumerate(changed_series(3)):
        source = tmp_path / f"ckpt-{index}.safetensors"
        save_file(state, source)
        reports.append(import_checkpoint(store, "series", source))
    assert [r.generation for r in reports] == [1, 2, 3]
    total = reports[0].logical_bytes
    assert reports[0].new_bytes == total
    for report in reports[1:]:
        assert report.new_bytes == total // 10, report
        assert report.saved_bytes == total - total // 10
    assert_bitwise(
        store.load("series", 2, framework="torch")["block.1.weight"],
        changed_series(3)[1]["block.1.weight"],
    )


# -- torch.save ----------------------------------------------------------------------


def test_torch_save_nested_state_imports_equal(store: Any, tmp_path: Path) -> None:
    tensors = torch_state(2)
    state = {
        "model": {name: tensor for name, tensor in tensors.items() if name != "mask"},
        "optimizer": {"step": 120, "lr": 3e-4, "betas": [0.9, 0.95], "name": "adamw"},
        "masks": [tensors["mask"], tensors["mask"].logical_not()],
        "epoch": 3,
    }
    source = tmp_path / "ckpt.pt"
    torch.save(state, source)
    report = import_checkpoint(store, "pt", source, step=120)
    assert (report.kind, report.generation) == ("torch.save", 1)
    assert store.resolve("pt").step == 120
    loaded = store.load("pt", framework="torch")
    for name, tensor in state["model"].items():
        assert_bitwise(loaded["model"][name], tensor)
    for got, expected in zip(loaded["masks"], state["masks"], strict=True):
        assert_bitwise(got, expected)
    assert loaded["optimizer"] == state["optimizer"]
    assert loaded["epoch"] == 3


def test_legacy_torch_save_format_imports_equal(store: Any, tmp_path: Path) -> None:
    state = torch_state(4)
    source = tmp_path / "legacy.pt"
    torch.save(state, source, _use_new_zipfile_serialization=False)
    import_checkpoint(store, "pt", source)
    loaded = store.load("pt", framework="torch")
    for name, tensor in state.items():
        assert_bitwise(loaded[name], tensor)


def test_safetensors_tensors_are_views_of_the_mapped_file(tmp_path: Path) -> None:
    """What keeps an import's memory at pages, not the model: no tensor is copied."""
    source = tmp_path / "model.safetensors"
    save_file(torch_state(), source)
    mapped = map_safetensors(source)
    encoded = encode_state(mapped)
    for leaf in encoded.leaves:
        base = mapped[leaf.name]
        while not isinstance(base, np.memmap) and base.base is not None:
            base = base.base
        assert isinstance(base, np.memmap), f"{leaf.name} was copied out of the mapping"
        assert np.shares_memory(leaf.data, base), f"{leaf.name} was copied when encoded"


class PlantsMarker:
    """Unpickling this runs ``open(marker, "w")``: what a hostile checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


@pytest.fixture
def malicious(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    source = tmp_path / "malicious.pt"
    torch.save({"weight": torch.ones(4), "payload": PlantsMarker(str(marker))}, source)
    assert not marker.exists()
    return source, marker


def test_malicious_torch_save_is_refused_and_never_runs(
    store: Any, malicious: tuple[Path, Path]
) -> None:
    source, marker = malicious
    try:
        import_checkpoint(store, "pt", source)
    except Exception as exc:  # noqa: BLE001 - the marker is checked first, whatever was raised
        raised: BaseException | None = exc
    else:
        raised = None
    assert not marker.exists(), "importing the file ran the pickle's code"
    assert isinstance(raised, ImportSourceError), raised
    message = str(raised)
    assert "\n" not in message
    assert "is not loadable with weights_only=True" in message
    assert "it holds the global io.open" in message
    assert "castore never unpickles arbitrary objects" in message
    assert store.runs() == []


def test_the_malicious_file_does_run_code_when_fully_unpickled(
    malicious: tuple[Path, Path],
) -> None:
    """Broken control: the file really is hostile, so the test above proves something."""
    source, marker = malicious
    code = f"import torch; torch.load({str(source)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=120)
    assert marker.exists()


# -- the command ---------------------------------------------------------------------


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return cli_runner.run_cli(*args, env=os.environ, timeout=120)


def test_cli_imports_a_series_and_reports_dedup(tmp_path: Path) -> None:
    sources = []
    for index, state in enumerate(changed_series(3)):
        sources.append(tmp_path / f"ckpt-{index}.safetensors")
        save_file(state, sources[-1])
    store_path = tmp_path / "store"
    done = run_cli("import", store_path, "exp", *sources, "--step", 100)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    for index, line in enumerate(lines):
        assert line.startswith(f"{sources[index]}: safetensors as exp@{index + 1}, 10 tensor(s)")
    assert "wrote 160.0 KiB, saved 0 B by dedup" in lines[0]
    assert "wrote 16.0 KiB, saved 144.0 KiB by dedup" in lines[1]
    with castore.open(store_path, create=False) as store:
        assert [g.step for g in store.generations("exp")] == [100, 101, 102]


def bad_index(tmp: Path, text: str) -> Path:
    """A directory whose model.safetensors.index.json holds ``text``."""
    directory = tmp / "indexed"
    directory.mkdir()
    (directory / "model.safetensors.index.json").write_text(text)
    return directory


@pytest.mark.parametrize(
    ("make_source", "expected"),
    [
        (lambda tmp: tmp / "absent.safetensors", "absent.safetensors does not exist"),
        (lambda tmp: tmp / "notes.txt", "notes.txt is of an unknown kind"),
        (lambda tmp: tmp / "empty-dir", "empty-dir is a directory castore cannot import"),
        (lambda tmp: bad_index(tmp, "{"), "is not a safetensors index: Expecting"),
        (lambda tmp: bad_index(tmp, "[1]"), "is not a safetensors index: no weight_map"),
        (lambda tmp: bad_index(tmp, '{"weight_map": {"a": 3}}'), "names 3, not a file next"),
        (
            lambda tmp: bad_index(tmp, '{"weight_map": {"a": "../good.safetensors"}}'),
            "names '../good.safetensors', not a file next to it",
        ),
        (
            lambda tmp: hostile_safetensors(tmp / "bad.safetensors", {"w": "no"}),
            "bad.safetensors: tensor 'w' has a malformed header entry",
        ),
    ],
    ids=[
        "missing",
        "unknown-file",
        "unknown-directory",
        "index-not-json",
        "index-not-a-map",
        "index-names-a-number",
        "index-names-a-file-elsewhere",
        "hostile-header",
    ],
)
def test_cli_bad_source_is_one_line_and_creates_nothing(
    tmp_path: Path, make_source: Any, expected: str
) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "empty-dir").mkdir()
    good = tmp_path / "good.safetensors"
    save_file(torch_state(), good)
    done = run_cli("import", tmp_path / "store", "exp", good, make_source(tmp_path))
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("castore: error: ImportSourceError: ")
    assert expected in done.stderr
    assert not (tmp_path / "store").exists()


def test_cli_refuses_a_malicious_pickle_in_one_line(
    tmp_path: Path, malicious: tuple[Path, Path]
) -> None:
    source, marker = malicious
    done = run_cli("import", tmp_path / "store", "exp", source)
    assert not marker.exists()
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1, done.stderr
    assert "castore never unpickles arbitrary objects" in done.stderr
    with castore.open(tmp_path / "store", create=False) as store:
        assert store.runs() == []


# -- DCP directories -----------------------------------------------------------------


def test_dcp_saved_by_two_ranks_keeps_its_boxes_and_loads_equal(store: Any, tmp_path: Path) -> None:
    directory = tmp_path / "dcp"
    outcomes = run_ranks(2, import_workers.save_sharded, str(directory), timeout=120)
    assert all(o.exitcode == 0 for o in outcomes), describe(outcomes)
    report = import_checkpoint(store, "dcp", directory, step=42)
    assert (report.kind, report.generation) == ("dcp", 1)
    assert report.tensors == 5  # two boxes each of w and emb, one of scale
    _, root = store.resolve_root("dcp", 1)
    assert root.world_size == 2
    boxes = store.tensor_entries(root, store.read_shards(root))
    placed = {
        name: sorted((e.offsets, e.local_shape) for e in entries) for name, entries in boxes.items()
    }
    assert placed == {
        "model/w": [((0, 0), (5, 8)), ((5, 0), (5, 8))],
        "model/emb": [((0, 0), (3, 4)), ((3, 0), (3, 4))],
        "model/scale": [((0,), (7,))],
    }
    expected = import_workers.full_state()
    loaded = store.load("dcp", framework="torch")
    for name, tensor in expected["model"].items():
        assert_bitwise(loaded["model"][name], tensor)
    assert (loaded["step"], loaded["note"]) == (42, "two ranks")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_saved_without_a_group_imports_equal(
    store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"model": torch_state(3), "epoch": 2, "lrs": [0.1, 0.01]}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    monkeypatch.setenv("CASTORE_PROGRESS", "1")
    report = import_checkpoint(store, "dcp", tmp_path / "dcp", progress=True)
    assert (report.kind, report.tensors) == ("dcp", len(state["model"]))
    total = sum(t.numel() * t.element_size() for t in state["model"].values())
    size = tqdm.format_sizeof(total, divisor=1024)  # the bar of the saved chunks' bytes
    bar = capsys.readouterr().err
    assert "import: 100%|" in bar and f"{size}/{size}" in bar, bar
    loaded = store.load("dcp", framework="torch")
    for name, tensor in state["model"].items():
        assert_bitwise(loaded["model"][name], tensor)
    assert (loaded["epoch"], loaded["lrs"]) == (2, [0.1, 0.01])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_lists_come_back_as_lists(store: Any, tmp_path: Path) -> None:
    """DCP flattens lists by position; import nests them again as lists, as DCP's
    own load does (a map's keys are strings, a list's indices ints)."""
    tensors = torch_state(4)
    first, second = list(tensors.values())[:2]
    state = {
        "buffers": [first, second],
        "optimizer": {
            "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.01, "params": [2]}],
            "state": {0: {"exp_avg": first}},
        },
    }
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    import_checkpoint(store, "lists", tmp_path / "dcp")
    loaded = store.load("lists", framework="torch")
    assert isinstance(loaded["buffers"], list) and len(loaded["buffers"]) == 2
    assert_bitwise(loaded["buffers"][0], first)
    assert_bitwise(loaded["buffers"][1], second)
    groups = loaded["optimizer"]["param_groups"]
    assert groups == [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.01, "params": [2]}]
    assert_bitwise(loaded["optimizer"]["state"]["0"]["exp_avg"], first)  # DCP keys: strings


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_item_holding_arbitrary_objects_is_refused_and_never_runs(
    store: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    state = {"w": torch.ones(4), "payload": PlantsMarker(str(marker))}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert not marker.exists()
    with pytest.raises(ImportSourceError, match="castore never unpickles arbitrary objects"):
        import_checkpoint(store, "dcp", tmp_path / "dcp")
    assert not marker.exists()
    assert store.runs() == []


def hostile_metadata(directory: Path, marker: Path) -> None:
    """A real DCP checkpoint whose ``.metadata`` also carries a pickle that plants
    ``marker`` when unpickled (DCP's FileSystemReader reads it with pickle.load)."""
    from torch.distributed.checkpoint import FileSystemReader

    dcp.save({"w": torch.ones(4)}, checkpoint_id=directory, no_dist=True)
    metadata = FileSystemReader(str(directory)).read_metadata()
    metadata.planner_data = {"w": ("w",), "payload": PlantsMarker(str(marker))}
    with open(directory / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_naming_arbitrary_objects_is_refused_and_never_runs(
    store: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    hostile_metadata(tmp_path / "dcp", marker)
    for attempt in (
        lambda: import_checkpoint(store, "dcp", tmp_path / "dcp"),
        lambda: run_cli("import", tmp_path / "cli-store", "dcp", tmp_path / "dcp"),
    ):
        try:
            done = attempt()
        except ImportSourceError as exc:
            assert "global io.open is not DCP metadata" in str(exc)
            assert "castore never unpickles arbitrary objects" in str(exc)
        else:
            assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
            assert done.stderr.startswith("castore: error: ImportSourceError: ")
        assert not marker.exists(), "importing the checkpoint ran the pickle's code"
    assert store.runs() == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_pickle_does_run_code_through_dcps_own_reader(tmp_path: Path) -> None:
    """Broken control: DCP's own reader runs the hostile metadata's code."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "pwned"
    hostile_metadata(tmp_path / "dcp", marker)
    FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_with_a_huge_list_index_is_refused(store: Any, tmp_path: Path) -> None:
    """A recorded path indexing a list far past its items would build a list of
    that many Nones; it is refused instead."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = tmp_path / "dcp"
    dcp.save({"layers": [torch.ones(4)]}, checkpoint_id=directory, no_dist=True)
    metadata = FileSystemReader(str(directory)).read_metadata()
    (fqn,) = metadata.planner_data
    metadata.planner_data = {fqn: ("layers", 10**12)}
    with open(directory / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(ImportSourceError, match="not one DCP writes"):
        import_checkpoint(store, "dcp", directory)
    assert store.runs() == []
