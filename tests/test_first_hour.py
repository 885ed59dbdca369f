"""Rough edges a new user meets in the first hour: each error says what and where."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import castore
import castore.dist
from castore import Store
from castore.core.history import split_address
from castore.dcp import CastoreWriter
from castore.errors import GenerationNotFoundError, InvalidNameError, UnsupportedValueError
from castore.importer import import_checkpoint


def test_loading_from_a_store_open_just_created_says_it_is_empty(tmp_path: Path) -> None:
    typo = tmp_path / "typo"
    with castore.open(typo) as store, pytest.raises(GenerationNotFoundError) as caught:
        store.load("exp1")
    message = str(caught.value)
    assert f"store at {typo} is empty" in message
    assert "create=False" in message
    with castore.open(typo) as store, pytest.raises(GenerationNotFoundError, match="is empty"):
        store.load("exp1", fallback="previous")  # the fallback's own path


def test_a_missing_run_in_a_store_with_runs_is_not_called_empty(tmp_path: Path) -> None:
    with castore.open(tmp_path / "s") as store:
        store.save({"x": 1}, run="exp1", step=1)
        with pytest.raises(GenerationNotFoundError) as caught:
            store.load("exp2")
    assert "empty" not in str(caught.value)
    assert "no run 'exp2' in the store at" in str(caught.value)
    assert str(caught.value).endswith("whose runs are exp1: did you mean 'exp1'? (run=exp2)")


def test_opening_without_create_refuses_a_missing_store(tmp_path: Path) -> None:
    with pytest.raises(castore.errors.StoreNotFoundError):
        castore.open(tmp_path / "typo", create=False)
    assert not (tmp_path / "typo").exists()


# -- values a state may hold ---------------------------------------------------------


def test_a_meta_tensor_is_refused_naming_its_key_path(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match="at model/w is on the meta device"):
        store.save({"model": {"w": torch.empty(4, device="meta")}}, run="r", step=1)
    assert store.runs() == []


def test_a_quantized_tensor_is_refused_as_quantized_not_as_a_layout(store: Store) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantize_per_tensor
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedValueError) as caught:
        store.save({"q": {"w": quantized}}, run="r", step=1)
    message = str(caught.value)
    assert "tensor at q/w is quantized" in message
    assert "dequantize first" in message
    assert "dense" not in message


def test_a_sparse_tensor_is_refused_naming_its_layout(store: Store) -> None:
    with pytest.raises(UnsupportedValueError, match=r"at s has layout torch.sparse_coo.*dense"):
        store.save({"s": torch.eye(3).to_sparse()}, run="r", step=1)


def test_numpy_text_scalars_are_stored_as_plain_text(store: Store) -> None:
    state = {"name": np.str_("hi"), "tag": np.bytes_(b"\x00yo"), "n": np.float32(1.5)}
    store.save(state, run="r", step=1)
    loaded = store.load("r")
    assert loaded == {"name": "hi", "tag": b"\x00yo", "n": np.float32(1.5)}
    assert type(loaded["name"]) is str  # a numpy text scalar comes back as plain text
    assert type(loaded["tag"]) is bytes
    assert type(loaded["n"]) is np.float32  # numeric numpy scalars keep their type


# -- step --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "error", "message"),
    [
        (-1, ValueError, "step must be a non-negative int64.*got -1"),
        (np.int64(-1), ValueError, "step must be a non-negative int64.*got -1"),
        (torch.tensor(-3), ValueError, "step must be a non-negative int64.*got -3"),
        (2**63, ValueError, "step must be a non-negative int64"),
        (2**70, ValueError, "step must be a non-negative int64"),
        (np.uint64(2**64 - 1), ValueError, "step must be a non-negative int64"),
        (1.0, TypeError, "step must be an integer .*got float"),
        (np.float64(2.0), TypeError, "step must be an integer .*got float64"),
        (torch.tensor(2.0), TypeError, "step must be an integer .*got Tensor"),
        (True, TypeError, "step must be an integer .*got bool"),
        (np.bool_(True), TypeError, "step must be an integer .*got bool"),
        (torch.tensor(True), TypeError, "step must be an integer .*got Tensor"),
        (torch.tensor([5]), TypeError, "step must be an integer .*0-d"),
        ("5", TypeError, "step must be an integer .*got str"),
    ],
    ids=["-1", "np.int64(-1)", "tensor(-3)", "2**63", "2**70", "np.uint64 max", "float",
         "np.float64", "float tensor", "True", "np.bool_", "bool tensor", "1-d tensor", "str"],
)  # fmt: skip
def test_a_step_is_a_non_negative_int64(
    store: Store, step: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        store.save({"x": 1}, run="r", step=step)
    with pytest.raises(error, match=message):
        store.save({"x": 1}, run="r", step=step, blocking=False)
    with pytest.raises(error, match=message):
        castore.dist.save(store, {"x": 1}, run="r", step=step)  # a group of one
    with pytest.raises(error, match=message):
        castore.dist.save(store, {"x": 1}, run="r", step=step, blocking=False)
    with pytest.raises(error, match=message):
        CastoreWriter(store, run="r", step=step)
    assert store.runs() == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    "step",
    [np.int64(5), np.int32(5), np.uint8(5), np.array(5), torch.tensor(5), torch.tensor(5).int()],
    ids=["np.int64", "np.int32", "np.uint8", "0-d array", "0-d tensor", "0-d int32 tensor"],
)
def test_any_integer_is_a_step_and_is_saved_as_an_int(
    store: Store, tmp_path: Path, step: Any
) -> None:
    """A loop's counter is often np.int64 or a 0-d tensor: every save path takes it."""
    saved = [
        store.save({"x": 1}, run="plain", step=step),
        store.save({"x": 1}, run="async", step=step, blocking=False).result(timeout=60),
        castore.dist.save(store, {"x": 1}, run="dist", step=step),
        castore.dist.save(store, {"x": 1}, run="dist-async", step=step, blocking=False).result(
            timeout=60
        ),
        import_checkpoint(store, "imported", one_safetensors_file(tmp_path), step=step),
    ]
    writer = CastoreWriter(store, run="dcp", step=step)
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, no_dist=True)
    assert all(gen is not None for gen in saved)
    for run in ("plain", "async", "dist", "dist-async", "imported", "dcp"):
        (gen,) = store.generations(run)
        assert gen.step == 5 and type(gen.step) is int, run
    assert type(writer.step) is int


def one_safetensors_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    pytest.importorskip("safetensors.numpy").save_file({"w": np.ones(2)}, str(path))
    return path


def test_an_empty_generation_is_refused_not_read_as_the_newest(store: Store) -> None:
    store.save({"x": 1}, run="r", step=1)
    store.save({"x": 2}, run="r", step=2)
    with pytest.raises(InvalidNameError, match="names no generation after '@'"):
        split_address("r@")
    assert split_address("r") == ("r", "latest") and split_address("r@1") == ("r", "1")
    for empty in ("", " "):
        with pytest.raises(GenerationNotFoundError, match="bad generation"):
            store.load("r", empty)
        with pytest.raises(GenerationNotFoundError, match="bad generation"):
            store.resolve("r", empty)


def test_the_largest_step_round_trips(store: Store) -> None:
    assert store.save({"x": 1}, run="r", step=2**63 - 1).step == 2**63 - 1
    store.claim_run("r")  # 0 is a step back: asked for (castore.core.fencing)
    assert store.save({"x": 1}, run="r", step=0).step == 0
    assert [g.step for g in store.generations("r")] == [2**63 - 1, 0]


# -- Ctrl-C during a save -----------------------------------------------------------------


def interrupt_advance(store: Store, monkeypatch: pytest.MonkeyPatch, *, after: bool) -> None:
    """Make the ref advance raise KeyboardInterrupt, before or after it moves the ref."""
    advance = store.refs.advance

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        if after:
            advance(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(store.refs, "advance", interrupted)


def test_ctrl_c_before_the_ref_advance_says_nothing_was_published(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = store.save({"w": np.arange(10)}, run="r", step=1)
    interrupt_advance(store, monkeypatch, after=False)
    with pytest.raises(KeyboardInterrupt) as caught:
        store.save({"w": np.arange(20)}, run="r", step=2)
    assert str(caught.value) == (
        "castore: save interrupted: nothing was published; the previous generation of "
        "'r' (1) is intact"
    )
    assert store.resolve("r").root == first.root
    np.testing.assert_array_equal(store.load("r")["w"], np.arange(10))


def test_ctrl_c_before_any_generation_says_the_run_has_none(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    interrupt_advance(store, monkeypatch, after=False)
    with pytest.raises(KeyboardInterrupt, match="nothing was published; run 'r' still has no"):
        store.save({"w": np.arange(20)}, run="r", step=2)


def test_ctrl_c_after_the_ref_advance_says_it_is_published(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save({"w": np.arange(10)}, run="r", step=1)
    interrupt_advance(store, monkeypatch, after=True)
    with pytest.raises(KeyboardInterrupt) as caught:
        store.save({"w": np.arange(20)}, run="r", step=2)
    assert "after its ref advanced: generation 2 is published" in str(caught.value)
    assert "nothing was published" not in str(caught.value)
    np.testing.assert_array_equal(store.load("r")["w"], np.arange(20))


def test_ctrl_c_in_a_dist_save_of_one_rank_says_nothing_was_published(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.save({"w": np.arange(10)}, run="r", step=1)
    interrupt_advance(store, monkeypatch, after=False)
    with pytest.raises(KeyboardInterrupt, match=r"nothing was published; .*\(1\) is intact"):
        castore.dist.save(store, {"w": np.arange(20)}, run="r", step=2)


SLOW_SAVE = """
import os, signal, sys, time
import numpy as np
import castore

# Ctrl-C as a terminal delivers it. A Python started with SIGINT ignored (a
# background job of a non-interactive shell: `make test &`) never installs this
# handler, and the signal would then do nothing at all.
signal.signal(signal.SIGINT, signal.default_int_handler)
store = castore.open(sys.argv[1], chunk_size=1 << 16)
store.save({"w": np.zeros(4)}, run="r", step=1)
writev = os.writev
writes = 0
def slow_writev(fd, buffers):  # a slow disk: the pack write waits for Ctrl-C
    global writes
    writes += 1
    if writes == 1:
        print("writing", flush=True)  # the parent sends SIGINT once it reads this
        # Short sleeps, bounded: Ctrl-C lands in the first one after it arrives;
        # without it the save goes on after 10 s and prints "saved" (a failure,
        # not a hang).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
    return writev(fd, buffers)
os.writev = slow_writev
print("saving", flush=True)
store.save({"w": np.random.default_rng(0).random(1 << 20)}, run="r", step=2)  # 128 chunks
print("saved", flush=True)
"""


def test_a_real_sigint_during_a_save_leaves_the_previous_generation(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_SAVE, str(tmp_path / "s")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "saving\n"
    # A handshake, not a guess at the save's speed: the child is inside the
    # save's first pack write (on its main thread, where Python raises
    # KeyboardInterrupt), and that write waits for the signal.
    assert child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert "saved" not in out
    last = err.strip().splitlines()[-1]
    assert last == (
        "KeyboardInterrupt: castore: save interrupted: nothing was published; "
        "the previous generation of 'r' (1) is intact"
    ), err
    with castore.open(tmp_path / "s") as store:
        assert [g.id for g in store.generations("r")] == [1]
        np.testing.assert_array_equal(store.load("r")["w"], np.zeros(4))


# -- castore.retention ---------------------------------------------------------------


def test_retention_is_castore_gc_under_a_name_that_does_not_shadow_gc() -> None:
    import gc as stdlib_gc

    from castore import gc as castore_gc
    from castore import retention

    public = {
        name
        for name, value in vars(castore_gc).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == "castore.gc"
    }
    public.add("GcAbortedError")  # defined in castore.errors; castore.gc's to raise and to export
    assert public == set(retention.__all__)
    for name in public:
        assert getattr(retention, name) is getattr(castore_gc, name)
    assert stdlib_gc.collect  # the standard library's gc is untouched
