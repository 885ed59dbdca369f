"""Saves that trust torch's version counters (castore.core.unchanged): what they skip,
when they hash after all, and the one case they are documented not to see."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import castore  # noqa: E402
import castore.core.chunkio as chunkio  # noqa: E402
from castore import Store  # noqa: E402
from castore.gc import RetentionPolicy, collect_garbage  # noqa: E402

RUN = "trust"


def model_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer}


def step(parts: dict[str, Any]) -> None:
    """One training step: an optimizer update changes every parameter in place."""
    model, optimizer = parts["model"], parts["optimizer"]
    loss = model(torch.randn(8, 16)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def state_of(parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": parts["model"].state_dict(), "optimizer": parts["optimizer"].state_dict()}


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each save hashed on write (through write_leaves), one number per call."""
    calls: list[int] = []
    write_leaves = chunkio.write_leaves

    def counting(backend: Any, leaves: Any, chunk_size: int, **kwargs: Any) -> Any:
        known = kwargs.get("known") or {}
        if not known:
            calls.append(sum(leaf.data.nbytes for leaf in leaves))
        return write_leaves(backend, leaves, chunk_size, **kwargs)

    monkeypatch.setattr(chunkio, "write_leaves", counting)
    import castore.core.commit as commit

    monkeypatch.setattr(commit, "write_leaves", counting)
    return calls


def assert_loads_as(store: Store, generation: int, expected: dict[str, Any]) -> None:
    loaded = store.load(RUN, generation, framework="torch")
    for part in ("model",):
        for name, value in expected[part].items():
            assert torch.equal(loaded[part][name], value), name


def test_a_trusting_resave_of_unchanged_tensors_hashes_nothing(
    store: Store, hashed: list[int]
) -> None:
    parts = model_state()
    state = state_of(parts)
    store.save(state, run=RUN, step=1, trust_versions=True)
    full = hashed[-1]
    store.save(state, run=RUN, step=2, trust_versions=True)
    assert full > 0 and hashed[-1] == 0
    latest = store.generations(RUN)[-1]
    assert latest.stats.new_chunks == 0
    assert_loads_as(store, 2, state)


def test_a_trusting_resave_hashes_what_an_optimizer_step_changed(
    store: Store, hashed: list[int]
) -> None:
    parts = model_state()
    step(parts)  # the optimizer has moments now
    store.save(state_of(parts), run=RUN, step=1, trust_versions=True)
    parts["model"][1].bias.data  # noqa: B018  (reading .data changes nothing)
    with torch.no_grad():
        parts["model"][1].bias.add_(1.0)  # one small tensor changes in place
    state = state_of(parts)
    store.save(state, run=RUN, step=2, trust_versions=True)
    assert hashed[-1] == parts["model"][1].bias.nbytes
    assert_loads_as(store, 2, state)
    step(parts)  # every parameter and moment changes
    state = state_of(parts)
    store.save(state, run=RUN, step=3, trust_versions=True)
    assert hashed[-1] > 0.9 * hashed[0]
    assert_loads_as(store, 3, state)
    # A trusting save and an ordinary one of the same state name the same chunks.
    store.save(state, run=RUN, step=4)
    a, b = (store.tensor_entries(store.resolve_root(RUN, g)[1]) for g in (3, 4))
    assert {n: [e.chunks for e in boxes] for n, boxes in a.items()} == {
        n: [e.chunks for e in boxes] for n, boxes in b.items()
    }


def test_a_new_tensor_at_a_freed_address_is_hashed(store: Store, hashed: list[int]) -> None:
    """A state rebuilt each step: new tensor objects start at version 0 again."""
    for value in range(3):
        state = {"w": torch.full((256,), float(value))}
        store.save(state, run=RUN, step=value, trust_versions=True)
        assert hashed[-1] == 1024
        np.testing.assert_array_equal(store.load(RUN)["w"], np.full(256, value, np.float32))
        del state


def test_chunks_collected_since_are_written_again(store: Store, hashed: list[int]) -> None:
    w = torch.arange(512, dtype=torch.float32).add_(0)  # its counter is 1
    store.save({"w": w}, run=RUN, step=1, trust_versions=True)
    chunks = list(store.tensor_entries(store.resolve_root(RUN, 1)[1])["w"][0].chunks)
    store.save({"other": torch.zeros(4)}, run=RUN, step=2)
    collect_garbage(store, RetentionPolicy(keep_last=1))  # generation 1 and w's chunks go
    assert not any(store.backend.has_many(chunkio.Namespace.CHUNKS, chunks))
    store.save({"w": w}, run=RUN, step=3, trust_versions=True)
    assert hashed[-1] == w.nbytes  # w's old chunks are gone: hashed and written again
    np.testing.assert_array_equal(store.load(RUN)["w"], np.arange(512, dtype=np.float32))


def test_a_write_around_pytorch_is_not_seen(store: Store) -> None:
    """What the documentation warns of: memory changed without the counter moving
    (through .data or a NumPy view) is not seen by a trusting save; an ordinary
    save sees it. Broken control for the default: hashing is what catches it."""
    w = torch.empty(256).zero_()  # changed in place once: its counter is 1
    store.save({"w": w}, run=RUN, step=1, trust_versions=True)
    w.numpy()[:] = 7.0  # around PyTorch: w._version does not move
    w.data[0] = 9.0  # .data has a counter of its own
    store.save({"w": w}, run=RUN, step=2, trust_versions=True)
    assert store.load(RUN)["w"].tolist() == [0.0] * 256  # the stale bytes, as documented
    store.save({"w": w}, run=RUN, step=3)  # the default hashes every byte
    assert store.load(RUN)["w"].tolist() == [9.0] + [7.0] * 255


def test_a_data_alias_is_never_trusted(store: Store, hashed: list[int]) -> None:
    """``p.data`` is a new tensor with a counter of its own, at 0: always hashed, so a
    change made through ``p`` is seen even though the alias's counter did not move."""
    p = torch.nn.Parameter(torch.zeros(256))
    with torch.no_grad():
        p.add_(1.0)
    store.save({"w": p.data}, run=RUN, step=1, trust_versions=True)
    with torch.no_grad():
        p.add_(1.0)
    store.save({"w": p.data}, run=RUN, step=2, trust_versions=True)
    assert hashed == [1024, 1024]
    assert store.load(RUN)["w"].tolist() == [2.0] * 256


def test_trusting_is_for_blocking_saves(store: Store) -> None:
    with pytest.raises(ValueError, match="blocking saves"):
        store.save({"w": torch.zeros(2)}, run=RUN, step=1, blocking=False, trust_versions=True)


def test_another_handle_trusts_nothing(store_path: Any, hashed: list[int]) -> None:
    w = torch.ones(256)
    with castore.open(store_path, chunk_size=1024) as first:
        first.save({"w": w}, run=RUN, step=1, trust_versions=True)
    with castore.open(store_path) as second:
        second.save({"w": w}, run=RUN, step=2, trust_versions=True)
    assert hashed == [1024, 1024]


def test_dist_save_trusts_versions_too(store: Store, hashed: list[int]) -> None:
    """castore.dist.save (a group of one without torch.distributed) takes the same path."""
    import castore.dist

    parts = model_state()
    step(parts)
    castore.dist.save(store, state_of(parts), run=RUN, step=1, trust_versions=True)
    castore.dist.save(store, state_of(parts), run=RUN, step=2, trust_versions=True)
    assert hashed[-1] == 0
    step(parts)
    state = state_of(parts)
    castore.dist.save(store, state, run=RUN, step=3, trust_versions=True)
    assert hashed[-1] > 0.9 * hashed[0]
    assert_loads_as(store, 3, state)
