"""TrainState: one update boundary saved to a real store, resumed bitwise or refused.

Every test runs in one process without torch.distributed: castore then acts as
a group of one (rank 0 of 1).
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import castore
import castore.dist
import castore.train
from castore import Store
from castore.data import ResumableDistributedSampler, dataset_hash
from castore.errors import (
    LayoutMismatchError,
    ResumeMismatchError,
    SaveBoundaryError,
    UnsupportedValueError,
)
from castore.train import Resumed, TrainState, WeightsLoaded, load_weights

SAMPLES = 32
BATCH = 4
ACCUMULATION = 2
SEED = 7  # the sampler's shuffle seed
HASH = dataset_hash(range(SAMPLES))
COMPONENTS = ["model", "optimizer", "sampler", "scaler", "scheduler"]


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(SAMPLES, 4, generator=generator)
    y = torch.randn(SAMPLES, 2, generator=generator)
    return TensorDataset(x, y)


def make_model(init_seed: int, *, extra_layer: bool = False) -> nn.Sequential:
    torch.manual_seed(init_seed)
    layers: list[nn.Module] = [nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2)]
    if extra_layer:
        layers.append(nn.Linear(2, 2))
    return nn.Sequential(*layers)


@dataclass
class Rig:
    """A small training loop and the TrainState that follows it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: ResumableDistributedSampler
    loader: DataLoader[Any]
    state: TrainState
    batches: Iterator[Any] | None = None

    def next_batch(self) -> Any:
        # The DataLoader iterator lives as long as the "process": a fresh one
        # starts the sampler over from its loaded position.
        if self.batches is None:
            self.batches = iter(self.loader)
        return next(self.batches)


def make_rig(
    *,
    init_seed: int = 0,
    sampler_seed: int = SEED,
    data_hash: str = HASH,
    accumulation_steps: int = ACCUMULATION,
    model: nn.Module | None = None,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    numpy_generators: dict[str, np.random.Generator] | None = None,
    extra: Any = None,
) -> Rig:
    model = make_model(init_seed) if model is None else model
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=0.05)
        if optimizer_factory is None
        else optimizer_factory(model)
    )
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    dataset = make_dataset()
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, seed=sampler_seed)
    # A DataLoader without its own generator draws its base seed from the global
    # torch RNG each time an iterator starts, which would shift the dropout
    # masks of a resumed run (it starts one more iterator than the original).
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    state = TrainState(
        model,
        optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=sampler,
        dataset_hash=data_hash,
        accumulation_steps=accumulation_steps,
        numpy_generators=(
            {"aug": np.random.default_rng(1)} if numpy_generators is None else numpy_generators
        ),
        extra=extra,
    )
    return Rig(model, optimizer, scheduler, scaler, sampler, loader, state)


def microbatch(rig: Rig) -> str:
    """One forward/backward; returns the loss as an exact hex string."""
    x, y = rig.next_batch()
    aug = rig.state.numpy_generators["aug"]
    noise = torch.from_numpy(aug.standard_normal(x.shape).astype(np.float32))
    loss = nn.functional.mse_loss(rig.model(x + 0.01 * noise), y)
    rig.scaler.scale(loss / rig.state.accumulation_steps).backward()
    rig.state.microbatch_done(len(x))
    return float(loss.item()).hex()


def optimizer_step(rig: Rig) -> None:
    rig.scaler.step(rig.optimizer)
    rig.scaler.update()
    rig.optimizer.zero_grad(set_to_none=True)
    rig.scheduler.step()
    rig.state.update_done()


def train(rig: Rig, updates: int) -> list[str]:
    """Finish ``updates`` updates (the first may already have microbatches done)."""
    losses = []
    for _ in range(updates):
        while rig.state.microbatch < rig.state.accumulation_steps:
            losses.append(microbatch(rig))
        optimizer_step(rig)
    return losses


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {
        index: {key: value.clone() for key, value in slots.items()}
        for index, slots in optimizer.state_dict()["state"].items()
    }


def assert_bitwise(a: dict[Any, Any], b: dict[Any, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_bitwise(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key


def saved_run(store: Store, updates: int = 2) -> tuple[Rig, castore.Generation]:
    rig = make_rig()
    train(rig, updates)
    return rig, rig.state.save(store, run="r")


# -- 1. exact resume at an update boundary ---------------------------------------


def resume_and_continue(store: Store, *, reseed_after_load: bool = False) -> tuple[Any, ...]:
    """The uninterrupted losses/params/optimizer, and the resumed run's, plus the Resumed."""
    original, generation = saved_run(store)
    expected_losses = train(original, 2)

    resumed = make_rig(init_seed=99)
    result = resumed.state.load(store, run="r")
    if reseed_after_load:
        torch.manual_seed(12345)  # a resume that forgets the saved RNG streams
    losses = train(resumed, 2)
    return (
        generation,
        result,
        (expected_losses, params(original.model), optimizer_snapshot(original.optimizer)),
        (losses, params(resumed.model), optimizer_snapshot(resumed.optimizer)),
    )


def test_exact_resume_at_a_boundary_replays_bitwise(store: Store) -> None:
    generation, result, expected, got = resume_and_continue(store)
    assert isinstance(result, Resumed)
    assert result.claim == "exact"
    assert result.rng == "restored"
    assert result.partial_update is None
    assert result.update == generation.step == 2
    assert result.microbatch == 0
    assert result.generation.root == generation.root
    assert len(got[0]) == 4
    assert got[0] == expected[0]  # every loss, as exact hex floats
    assert_bitwise(got[1], expected[1])
    assert_bitwise(got[2], expected[2])


def test_broken_control_a_resume_without_saved_rng_diverges(store: Store) -> None:
    _, result, expected, got = resume_and_continue(store, reseed_after_load=True)
    assert result.claim == "exact"
    # Only the dropout masks differ, yet the comparison above does fail then.
    assert got[0] != expected[0]
    assert not all(torch.equal(got[1][k], expected[1][k]) for k in expected[1])


def test_scheduler_scaler_and_numpy_generator_are_restored(store: Store) -> None:
    original, _ = saved_run(store)
    resumed = make_rig(init_seed=99)
    resumed.state.load(store, run="r")
    assert resumed.scheduler.state_dict() == original.scheduler.state_dict()
    assert resumed.scaler.state_dict() == original.scaler.state_dict()
    assert resumed.state.update == original.state.update == 2
    want = original.state.numpy_generators["aug"].standard_normal(3)
    got = resumed.state.numpy_generators["aug"].standard_normal(3)
    assert got.tobytes() == want.tobytes()


# -- 2, 3. the data-order record in the root ---------------------------------------


def test_generation_root_records_the_data_order(store: Store) -> None:
    saved_run(store, updates=3)
    order = store.resolve("r").data_order
    consumed = 3 * ACCUMULATION * BATCH
    assert order["castore_train"] == 1
    assert order["world_size"] == 1
    assert order["dataset_hash"] == HASH
    assert order["seed"] == SEED
    assert order["epoch"] == 0
    assert order["consumed_samples"] == consumed
    assert order["update_start_consumed"] == consumed
    assert order["update"] == 3
    assert order["microbatch"] == 0
    assert order["accumulation_steps"] == ACCUMULATION
    assert order["dataset_len"] == SAMPLES
    assert order["shuffle"] is True
    assert order["drop_last"] is False
    assert order["components"] == COMPONENTS


def test_consumed_samples_counts_reported_examples_not_sampler_draws(store: Store) -> None:
    rig = make_rig()
    drawn = iter(rig.sampler)
    for _ in range(12):  # a prefetching loader runs ahead of the training loop
        next(drawn)
    rig.state.microbatch_done(4)
    rig.state.microbatch_done(3)  # a microbatch that dropped one example
    rig.state.update_done()
    assert rig.sampler.consumed == 12
    rig.state.save(store, run="r")
    assert store.resolve("r").data_order["consumed_samples"] == 7


# -- 4, 5. saves between microbatches ---------------------------------------------


def test_save_between_microbatches_is_refused(store: Store) -> None:
    rig, _ = saved_run(store, updates=1)
    before = [g.root for g in store.generations("r")]
    microbatch(rig)
    with pytest.raises(SaveBoundaryError, match="mid_accumulation") as caught:
        rig.state.save(store, run="r")
    assert isinstance(caught.value, RuntimeError)
    assert "1 of 2" in str(caught.value)
    assert [g.root for g in store.generations("r")] == before


def test_mid_accumulation_save_restores_partial_gradients(store: Store) -> None:
    original = make_rig()
    train(original, 1)
    microbatch(original)
    original.state.save(store, run="r", mid_accumulation=True)
    saved_grads = {
        n: p.grad.clone() for n, p in original.model.named_parameters() if p.grad is not None
    }
    assert len(saved_grads) == 4
    expected_losses = train(original, 1)

    resumed = make_rig(init_seed=99)
    result = resumed.state.load(store, run="r")
    assert result.claim == "exact"
    assert result.partial_update == "restored"
    assert result.microbatch == resumed.state.microbatch == 1
    assert result.update == 1
    assert resumed.state.examples == BATCH
    assert store.resolve("r").data_order["consumed_samples"] == 3 * BATCH
    assert store.resolve("r").data_order["update_start_consumed"] == 2 * BATCH
    for name, param in resumed.model.named_parameters():
        assert param.grad is not None
        assert torch.equal(param.grad, saved_grads[name]), name
    losses = train(resumed, 1)
    assert len(losses) == 1  # only the missing microbatch ran
    assert losses == expected_losses
    assert_bitwise(params(resumed.model), params(original.model))
    assert_bitwise(optimizer_snapshot(resumed.optimizer), optimizer_snapshot(original.optimizer))


def test_saves_after_a_mid_accumulation_resume_record_the_true_position(store: Store) -> None:
    # Regression: the restored microbatch's examples were once counted twice.
    original = make_rig()
    microbatch(original)
    original.state.save(store, run="r", mid_accumulation=True)
    train(original, 1)
    original.state.save(store, run="straight")

    resumed = make_rig(init_seed=99)
    resumed.state.load(store, run="r")
    resumed.state.save(store, run="again", mid_accumulation=True)  # at once, same point
    again = store.resolve("again").data_order
    assert (again["consumed_samples"], again["update_start_consumed"]) == (BATCH, 0)
    train(resumed, 1)
    resumed.state.save(store, run="r")
    straight = store.resolve("straight").data_order
    # Both runs consumed 2 microbatches of 4 examples: 8.
    assert straight["consumed_samples"] == straight["update_start_consumed"] == 2 * BATCH
    assert store.resolve("r").data_order["consumed_samples"] == 2 * BATCH
    assert store.resolve("r").data_order["update_start_consumed"] == 2 * BATCH
    # A second resume continues where the uninterrupted sampler would.
    second = make_rig(init_seed=5)
    second.state.load(store, run="r")
    assert list(second.sampler) == original.sampler.epoch_order()[2 * BATCH :]


# -- 6, 7, 8. claims that cannot hold, and the continuation claim -----------------


def test_exact_resume_names_every_differing_field_and_changes_nothing(store: Store) -> None:
    saved_run(store)
    other_hash = dataset_hash(range(1, SAMPLES + 1))
    rig = make_rig(init_seed=99, sampler_seed=SEED + 1, data_hash=other_hash, accumulation_steps=4)
    train(rig, 1)  # give the live optimizer some state to protect
    model_before, optimizer_before = params(rig.model), optimizer_snapshot(rig.optimizer)
    with pytest.raises(ResumeMismatchError) as caught:
        rig.state.load(store, run="r")
    message = str(caught.value)
    for name in ("dataset_hash", "seed", "accumulation_steps"):
        assert name in message
    differences = caught.value.differences  # type: ignore[attr-defined]
    assert set(differences) == {"dataset_hash", "seed", "accumulation_steps"}
    assert differences["accumulation_steps"] == (ACCUMULATION, 4)
    assert differences["seed"] == (SEED, SEED + 1)
    assert differences["dataset_hash"] == (HASH, other_hash)
    assert_bitwise(params(rig.model), model_before)
    assert_bitwise(optimizer_snapshot(rig.optimizer), optimizer_before)
    assert rig.state.update == 1


def test_exact_resume_with_only_another_seed_hints_at_continuation(store: Store) -> None:
    saved_run(store)
    rig = make_rig(sampler_seed=SEED + 1)
    with pytest.raises(ResumeMismatchError, match="resume='continuation'"):
        rig.state.load(store, run="r")


def test_continuation_with_another_seed_finishes_the_saved_epoch(store: Store) -> None:
    _, generation = saved_run(store)
    rig = make_rig(init_seed=99, sampler_seed=SEED + 1)
    result = rig.state.load(store, run="r", resume="continuation")
    assert result.claim == "continuation"
    assert result.rng == "restored"
    assert rig.sampler.seed == SEED
    assert any("seed" in note and str(SEED) in note for note in result.notes)
    consumed = generation.data_order["consumed_samples"]
    order = ResumableDistributedSampler(make_dataset(), 1, 0, seed=SEED).epoch_order()
    assert list(rig.sampler) == order[consumed:]


def test_resuming_a_plain_store_save_is_refused(store: Store) -> None:
    store.save({"model": params(make_model(0))}, run="r", step=1)
    rig = make_rig(init_seed=99)
    before = params(rig.model)
    with pytest.raises(ResumeMismatchError, match="castore.train"):
        rig.state.load(store, run="r")
    assert_bitwise(params(rig.model), before)


# -- 9. layouts that do not match ---------------------------------------------------


def test_a_model_with_other_keys_is_refused_before_anything_changes(store: Store) -> None:
    saved_run(store)
    rig = make_rig(init_seed=99, model=make_model(99, extra_layer=True))
    before = params(rig.model)
    with pytest.raises(LayoutMismatchError, match="4.weight"):
        rig.state.load(store, run="r")
    assert_bitwise(params(rig.model), before)
    assert rig.optimizer.state_dict()["state"] == {}


def test_an_optimizer_with_other_param_groups_is_refused(store: Store) -> None:
    saved_run(store)

    def two_groups(model: nn.Module) -> torch.optim.Optimizer:
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return torch.optim.AdamW([{"params": weights}, {"params": biases}], lr=0.05)

    rig = make_rig(init_seed=99, optimizer_factory=two_groups)
    before = params(rig.model)
    with pytest.raises(LayoutMismatchError, match="param groups"):
        rig.state.load(store, run="r")
    assert_bitwise(params(rig.model), before)
    assert rig.state.update == 0


def test_a_numpy_generator_the_save_lacks_is_refused_before_anything_changes(
    store: Store,
) -> None:
    saved_run(store)
    generators = {"aug": np.random.default_rng(1), "noise": np.random.default_rng(2)}
    rig = make_rig(init_seed=99, numpy_generators=generators)
    before = params(rig.model)
    python_before, noise_before = random.getstate(), generators["noise"].bit_generator.state
    with pytest.raises(ResumeMismatchError, match="numpy_generators: saved \\['aug'\\]"):
        rig.state.load(store, run="r")
    assert_bitwise(params(rig.model), before)
    assert random.getstate() == python_before
    assert generators["noise"].bit_generator.state == noise_before


def test_a_continuation_reseeds_streams_it_cannot_restore(store: Store) -> None:
    saved_run(store)
    generators = {"aug": np.random.default_rng(1), "noise": np.random.default_rng(2)}
    rig = make_rig(init_seed=99, numpy_generators=generators)
    result = rig.state.load(store, run="r", resume="continuation")
    assert result.rng == "reseeded"
    assert any("numpy_generators" in note for note in result.notes)


def test_restore_rng_checks_before_it_changes_any_stream() -> None:
    state = castore.train.capture_rng({"aug": np.random.default_rng(1)})
    random.seed(5)
    before = random.getstate()
    with pytest.raises(KeyError, match="other"):
        castore.train.restore_rng(state, {"other": np.random.default_rng(2)})
    assert random.getstate() == before


def test_a_save_with_the_cursor_past_the_epoch_is_refused(store: Store) -> None:
    model = nn.Linear(2, 1)
    sampler = ResumableDistributedSampler(list(range(8)), 1, 0, shuffle=False)
    state = castore.train.TrainState(model, sampler=sampler)
    for _ in range(2):  # two passes over the data without set_epoch: misuse
        for _index in sampler:
            state.microbatch_done(1)
            state.update_done()
    with pytest.raises(SaveBoundaryError, match="16 samples consumed of 8"):
        state.save(store, run="r")
    assert store.runs() == []


# -- 10. extra values ----------------------------------------------------------------


def test_unencodable_extra_is_refused_naming_its_path(store: Store) -> None:
    rig, _ = saved_run(store, updates=1)
    before = [g.root for g in store.generations("r")]
    rig.state.extra = {"hook": lambda: 0}
    with pytest.raises(UnsupportedValueError, match="extra/hook"):
        rig.state.save(store, run="r")
    rig.state.extra = object()
    with pytest.raises(UnsupportedValueError, match="at extra"):
        rig.state.save(store, run="r")
    assert [g.root for g in store.generations("r")] == before


def test_encodable_extra_round_trips(store: Store) -> None:
    extra = {"phase": "warmup", "best": (3, "loss", 0.25), "counts": [1, 2], 7: {"n": -1}}
    rig = make_rig(extra=extra)
    train(rig, 1)
    rig.state.save(store, run="r")
    resumed = make_rig(init_seed=99)
    result = resumed.state.load(store, run="r")
    assert result.extra == extra
    assert isinstance(result.extra["best"], tuple)
    assert resumed.state.extra == extra


# -- 11. load_weights -------------------------------------------------------------


def test_load_weights_loads_only_the_model(store: Store) -> None:
    original, generation = saved_run(store)
    model = make_model(99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    rng_before = torch.get_rng_state()
    loaded = load_weights(store, "r", model)
    assert isinstance(loaded, WeightsLoaded)
    assert loaded.tensors == 4
    assert (loaded.missing_keys, loaded.unexpected_keys) == ([], [])
    assert loaded.generation.root == generation.root
    assert_bitwise(params(model), params(original.model))
    assert optimizer.state_dict()["state"] == {}
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_load_weights_into_a_model_missing_a_key_changes_nothing(store: Store) -> None:
    saved_run(store)
    torch.manual_seed(99)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2, bias=False))
    before = params(model)
    with pytest.raises(LayoutMismatchError, match="3.bias"):
        load_weights(store, "r", model)
    assert_bitwise(params(model), before)


def backbone_with(seed: int, **head: nn.Module) -> nn.Sequential:
    """A pretrained-style model: a backbone, then the named head module(s)."""
    torch.manual_seed(seed)
    backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))
    return nn.Sequential(OrderedDict(backbone=backbone, **head))


def save_pretrained(store: Store) -> nn.Sequential:
    pretrained = backbone_with(1, head=nn.Linear(8, 2))
    store.save({"model": pretrained.state_dict()}, run="pretrain", step=1)
    return pretrained


def test_load_weights_not_strict_loads_a_backbone_under_a_new_head(store: Store) -> None:
    pretrained = save_pretrained(store)
    model = backbone_with(2, classifier=nn.Linear(8, 10))  # a new head under new names
    head_before = params(model.classifier)
    loaded = load_weights(store, "pretrain", model, strict=False)
    assert loaded.tensors == 4  # the backbone's two weights and two biases
    assert loaded.missing_keys == ["classifier.weight", "classifier.bias"]
    assert loaded.unexpected_keys == ["head.weight", "head.bias"]
    assert_bitwise(params(model.backbone), params(pretrained.backbone))
    assert_bitwise(params(model.classifier), head_before)
    # The names torch's own non-strict load reports for the same two models.
    reference = copy.deepcopy(model).load_state_dict(pretrained.state_dict(), strict=False)
    assert loaded.missing_keys == reference.missing_keys
    assert loaded.unexpected_keys == reference.unexpected_keys


def test_load_weights_strict_refuses_the_new_head_and_changes_nothing(store: Store) -> None:
    save_pretrained(store)
    model = backbone_with(2, classifier=nn.Linear(8, 10))
    before = params(model)
    with pytest.raises(LayoutMismatchError, match=r"not saved \['classifier.bias'"):
        load_weights(store, "pretrain", model)  # strict=True is the default
    assert_bitwise(params(model), before)


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (lambda: nn.Linear(8, 10), r"target 'model/head.weight' is float32\[10, 8\]"),
        (lambda: nn.Linear(8, 2).double(), r"target 'model/head.weight' is float64\[2, 8\]"),
    ],
    ids=["shape", "dtype"],
)
def test_load_weights_not_strict_still_refuses_a_shared_name_that_differs(
    store: Store, head: Callable[[], nn.Module], message: str
) -> None:
    save_pretrained(store)
    model = backbone_with(2, head=head())  # the saved name, another shape or dtype
    before = params(model)
    with pytest.raises(LayoutMismatchError, match=message):
        load_weights(store, "pretrain", model, strict=False)
    assert_bitwise(params(model), before)  # the backbone too: nothing changed


# -- 12. misuse ----------------------------------------------------------------------


def test_update_done_without_a_microbatch_is_refused() -> None:
    rig = make_rig()
    with pytest.raises(SaveBoundaryError, match="microbatch_done"):
        rig.state.update_done()
    assert rig.state.update == 0


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_accumulation_steps_must_be_a_positive_int(steps: Any) -> None:
    with pytest.raises(ValueError, match="accumulation_steps"):
        TrainState(make_model(0), accumulation_steps=steps)


def test_a_plain_distributed_sampler_is_refused() -> None:
    sampler: DistributedSampler[Any] = DistributedSampler(make_dataset(), num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        TrainState(make_model(0), sampler=sampler)  # type: ignore[arg-type]


# -- 13. set_epoch and a loaded position -------------------------------------------


def test_set_epoch_keeps_a_just_loaded_position_for_the_same_epoch() -> None:
    sampler = ResumableDistributedSampler(make_dataset(), num_replicas=1, rank=0, seed=SEED)
    sampler.set_epoch(2)
    state = sampler.state_dict(consumed_samples=12)
    resumed = ResumableDistributedSampler(make_dataset(), num_replicas=1, rank=0, seed=SEED)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the usual epoch loop, on its first pass after the resume
    assert len(resumed) == SAMPLES - 12
    assert list(resumed) == sampler.epoch_order()[12:]
    resumed.set_epoch(2)  # once iterated, the same epoch starts from its beginning
    assert len(resumed) == SAMPLES


def test_set_epoch_to_another_epoch_drops_a_loaded_position() -> None:
    sampler = ResumableDistributedSampler(make_dataset(), num_replicas=1, rank=0, seed=SEED)
    sampler.load_state_dict(sampler.state_dict(consumed_samples=12))
    sampler.set_epoch(1)
    assert sampler.start == 0
    assert len(sampler) == SAMPLES


# -- 14. castore.dist without torch.distributed -------------------------------------


def test_dist_save_and_load_work_as_a_group_of_one(store: Store) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    generation = castore.dist.save(store, {"w": tensor, "n": 3}, run="d", step=5)
    assert generation.world_size == 1
    assert generation.step == 5

    full = castore.dist.load(store, "d", {}, load_rest=True)
    assert full.state["n"] == 3
    assert isinstance(full.state["w"], torch.Tensor)
    assert torch.equal(full.state["w"], tensor)
    assert full.report.generation.root == generation.root

    partial = castore.dist.load(store, "d", {}, load_rest=False)
    assert partial.state["n"] == 3
    assert partial.state["w"] == castore.NotLoaded("w", "float32", (2, 3))

    target = torch.zeros(2, 3)
    castore.dist.load(store, "d", {"w": target})
    assert torch.equal(target, tensor)


@pytest.mark.parametrize("field", ["update", "world_size", "consumed_samples", "shuffle"])
def test_a_forged_record_with_a_missing_field_is_damage_not_a_key_error(
    store: Store, field: str
) -> None:
    from hostile import forge_root

    from castore.errors import CorruptObjectError

    saved_run(store)
    forge_root(store, "r", lambda root: root["data_order"].pop(field))
    before = params(make_rig(init_seed=5).model)
    rig = make_rig(init_seed=5)
    with pytest.raises(CorruptObjectError, match=f"malformed fields \\['{field}'\\]"):
        rig.state.load(store, run="r")
    assert_bitwise(params(rig.model), before)  # nothing live changed
    result = rig.state.load(store, run="r", fallback="previous")
    assert result.generation.id == 1 and [s.generation for s in result.skipped] == [2]
