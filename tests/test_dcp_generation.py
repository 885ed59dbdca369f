"""A generation saved through castore.dcp, read by castore's other readers.

DCP stores its flattened items as ``t/<fqn>`` and ``b/<fqn>`` (docs/INTEROP.md,
"The layout of a DCP generation"); export, ``load_weights``, ``castore log`` and
``castore show`` see the state dict DCP was given, in one process without a group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import castore
import castore.cli
from castore import export
from castore.dcp import CastoreWriter
from castore.errors import LayoutMismatchError
from castore.train import load_weights

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Tiny(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 3)


def dcp_saved(tmp_path: Path, model: torch.nn.Module) -> Path:
    """A store whose run "r" holds one DCP save of the model and two plain values."""
    path = tmp_path / "store"
    state = {"model": model.state_dict(), "optim": {"lr": 0.125, "betas": (0.9, 0.999)}}
    with castore.open(path, chunk_size=64) as store:
        dcp.save(state, storage_writer=CastoreWriter(store, run="r", step=5), no_dist=True)
    return path


def test_export_names_a_dcp_generations_tensors_by_their_state_dict_paths(
    tmp_path: Path,
) -> None:
    model = Tiny(seed=1)
    path = dcp_saved(tmp_path, model)
    with castore.open(path) as store:
        export.to_safetensors(store, "r", "latest", tmp_path / "all.safetensors")
    exported = load_file(tmp_path / "all.safetensors")
    # Its tensors under their own names; its non-tensor values (b/...) are no tensors.
    assert sorted(exported) == ["model/emb.weight", "model/head.bias", "model/head.weight"]
    assert castore.cli.main(
        ["export", str(path), "r", str(tmp_path / "hf.safetensors"), "--prefix", "model",
         "--strip-prefix"]
    ) == 0  # fmt: skip
    stripped = load_file(tmp_path / "hf.safetensors")
    assert stripped.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(stripped[name], tensor), name


def test_load_weights_reads_a_dcp_generations_model(tmp_path: Path) -> None:
    saved = Tiny(seed=1)
    path = dcp_saved(tmp_path, saved)
    fresh = Tiny(seed=2)
    assert not torch.equal(fresh.head.weight, saved.head.weight)
    with castore.open(path) as store:
        loaded = load_weights(store, "r", fresh)
        assert loaded.tensors == 3 and loaded.generation.step == 5
        for name, tensor in saved.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], tensor), name

        other = torch.nn.Linear(4, 3)  # names the DCP save does not hold: refused, unchanged
        before = other.weight.detach().clone()
        with pytest.raises(LayoutMismatchError, match="does not match the saved one"):
            load_weights(store, "r", other)
        assert torch.equal(other.weight, before)


def test_log_of_a_dcp_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = dcp_saved(tmp_path, Tiny(seed=1))
    with castore.open(path) as store:
        assert store.resolve("r").stats.seconds > 0  # the save's time, not 0
    capsys.readouterr()

    assert castore.cli.main(["log", str(path), "--run", "r"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()
    assert header.split()[-3:] == ["held", "root", "tags"], header  # no tags: the row ends
    # at its root. castore cannot know how long DCP held its caller: no "0 ms", nothing.
    assert row.split()[-2] == "-" and " ms" not in row, row


def test_show_of_a_dcp_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = dcp_saved(tmp_path, Tiny(seed=1))
    assert castore.cli.main(["show", str(path), "r"]) == 0
    shown = capsys.readouterr().out
    (metadata,) = [line for line in shown.splitlines() if line.startswith("metadata")]
    assert len(metadata) < 160, metadata
    assert "3 tensor item(s)" in metadata and "2 non-tensor item(s)" in metadata
    assert castore.cli.main(["show", str(path), "r", "--all"]) == 0
    assert "planner_data" in capsys.readouterr().out  # the whole record, where asked for
