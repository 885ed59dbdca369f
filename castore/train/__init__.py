"""Capture one training update boundary and resume from it, with a stated claim.

:class:`TrainState` names everything the next update depends on: model
parameters and buffers by fully qualified name, optimizer state by parameter
name, LR scheduler, gradient scaler, every RNG stream of every rank, the
completed update number and the data cursor of a
:class:`~castore.data.ResumableDistributedSampler`. ``save`` writes it as one
castore generation (over torch.distributed when it is initialized, else as a
group of one) and records the data order in the root; ``load`` restores it
and says which claim holds:

- ``resume="exact"``: same rank count, dataset hash, sampler seed and
  accumulation; the resumed run replays the uninterrupted one bitwise.
- ``resume="continuation"``: any rank count; the sampler continues the epoch
  from the global consumed count, so every remaining sample is used once.

:func:`load_weights` loads only the model and is never a resume.

Saves happen at an optimizer-step boundary. Between accumulated microbatches
a save is refused (:class:`~castore.errors.SaveBoundaryError`) unless asked
for with ``mid_accumulation=True``: then every rank's partial gradients and
accepted-example count are saved too, and an exact resume completes that
same update.

Nothing is pickled: a value castore cannot encode is an
:class:`~castore.errors.UnsupportedValueError` naming where it is.

Lower-level pieces: ``capture_rng()`` / ``restore_rng()`` (Python's
``random``, NumPy's global state and named ``numpy.random.Generator`` objects,
torch CPU and every CUDA device) and ``optimizer_state_by_name()`` /
``load_optimizer_state_by_name()``.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from castore import dist as castore_dist
from castore.core.background import AsyncOptions
from castore.core.history import Generation, Skipped
from castore.data import ResumableDistributedSampler
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, own_groups, raise_failures
from castore.dist.restore import LoadReport, agree_on_candidates, agree_on_root
from castore.errors import (
    CorruptObjectError,
    DataCursorWarning,
    IntegrityError,
    LayoutMismatchError,
    NoValidGenerationError,
    ResumeMismatchError,
    SaveBoundaryError,
)
from castore.format.hashing import Digest, digest_bytes
from castore.format.shard import RankLocal
from castore.format.tree import decode_tree
from castore.store import Store

RNG_VERSION = 1
TRAIN_FORMAT = 1  # the layout of the state tree and data-order record below


def capture_rng(generators: Mapping[str, np.random.Generator] | None = None) -> dict[str, Any]:
    """Every RNG stream of this process (plus the named numpy Generators)."""
    np_state: Any = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": RNG_VERSION,
        "python": random.getstate(),
        "numpy": {
            "algorithm": np_state[0],
            "keys": np.array(np_state[1], copy=True),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "numpy_generators": {
            name: gen.bit_generator.state for name, gen in (generators or {}).items()
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng(
    state: Mapping[str, Any], generators: Mapping[str, np.random.Generator] | None = None
) -> None:
    """Put back streams captured by :func:`capture_rng` (any tensor type loads).

    Checks everything first: on an error no stream has changed.
    """
    if state.get("version") != RNG_VERSION:
        raise ValueError(f"unknown RNG state version {state.get('version')!r}")
    wanted = dict(generators or {})
    missing = sorted(set(wanted) - set(state["numpy_generators"]))
    if missing:
        raise KeyError(f"no saved state for numpy generators {missing}")
    cuda = list(state["cuda"])
    if cuda and _cuda_devices() != len(cuda):
        raise RuntimeError(
            f"the saved state has {len(cuda)} CUDA generators; this process sees "
            f"{_cuda_devices()} devices"
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["algorithm"],
            np.asarray(saved["keys"], dtype=np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    for name, gen in wanted.items():
        gen.bit_generator.state = state["numpy_generators"][name]
    torch.set_rng_state(_as_byte_tensor(state["torch"]))
    if cuda:
        torch.cuda.set_rng_state_all([_as_byte_tensor(s) for s in cuda])


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _as_byte_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(torch.uint8).cpu()
    return torch.from_numpy(np.ascontiguousarray(value, dtype=np.uint8))


def optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position.

    Positions depend on the order parameters were handed to the optimizer; names
    survive a rebuilt optimizer, a reordered parameter list, or a new parameter.
    """
    names = _parameter_names(model)
    raw = optimizer.state_dict()
    positions: dict[int, str] = {}
    groups = []
    for live, saved in zip(optimizer.param_groups, raw["param_groups"], strict=True):
        group_names = [names[id(p)] for p in live["params"]]
        positions.update(zip(saved["params"], group_names, strict=True))
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": group_names})
    state = {positions[index]: value for index, value in raw["state"].items()}
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Load a state from :func:`optimizer_state_by_name` into ``optimizer``."""
    groups, by_position = _match_groups(_parameter_names(model), optimizer, state)
    optimizer.load_state_dict({"state": by_position, "param_groups": groups})


def _match_groups(
    names: dict[int, str], optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """The positional param groups and state for ``optimizer`` (ValueError if they differ)."""
    saved_groups = list(state["param_groups"])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"saved optimizer has {len(saved_groups)} param groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    position = 0
    by_position: dict[int, Any] = {}
    groups = []
    for live, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        live_names = [names[id(p)] for p in live["params"]]
        if sorted(live_names) != sorted(saved["params"]):
            raise ValueError(
                f"param group holds {sorted(live_names)[:5]}..., the saved one "
                f"{sorted(saved['params'])[:5]}..."
            )
        ids = list(range(position, position + len(live_names)))
        position += len(live_names)
        for index, name in zip(ids, live_names, strict=True):
            if name in state["state"]:
                by_position[index] = state["state"][name]
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return groups, by_position


def _parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in unwrap(model).named_parameters()}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DistributedDataParallel and ``torch.compile`` wrappers.

    Names are the inner module's, so a checkpoint loads with or without them.
    """
    while True:
        inner = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            inner = model._orig_mod  # a torch.compile OptimizedModule
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


# -- one update boundary ---------------------------------------------------------

# Fields an exact resume must find equal, and the subset a continuation needs.
_EXACT_FIELDS = (
    "world_size",
    "dataset_hash",
    "seed",
    "dataset_len",
    "shuffle",
    "drop_last",
    "accumulation_steps",
    "components",
    "numpy_generators",
    "cuda_devices",
)
# The data-order record TrainState writes: field -> its type (see docs/FORMAT.md).
_RECORD_FIELDS: dict[str, Any] = {
    "update": int,
    "microbatch": int,
    "world_size": int,
    "accumulation_steps": int,
    "components": list,
    "numpy_generators": list,
    "cuda_devices": int,
}
_SAMPLER_FIELDS: dict[str, Any] = {
    "seed": int,
    "epoch": int,
    "consumed_samples": int,
    "update_start_consumed": int,
    "dataset_len": int,
    "shuffle": bool,
    "drop_last": bool,
}


def _check_record(saved: dict[str, Any], where: dict[str, Any]) -> None:
    """A record read from a store is checked field by field before anything uses it."""
    fields = dict(_RECORD_FIELDS)
    if "seed" in saved:
        fields.update(_SAMPLER_FIELDS)
    bad = [
        name
        for name, kind in fields.items()
        if not isinstance(saved.get(name), kind)
        or (kind is int and (isinstance(saved[name], bool) or saved[name] < 0))
    ]
    if bad or saved["world_size"] < 1 or saved["accumulation_steps"] < 1:
        raise CorruptObjectError(
            f"the training data-order record has missing or malformed fields {bad or ['ranks']}",
            **where,
        )


_RNG_FIELDS = ("world_size", "numpy_generators", "cuda_devices")  # to restore RNG streams
_CONTINUATION_FIELDS = ("dataset_hash", "dataset_len", "components")


def examples_in(batch: Any) -> int:
    """The number of examples in ``batch``, as :meth:`TrainState.microbatch_done` counts them.

    A non-negative int is the count; a tensor or array has its leading
    dimension; a tuple, list or dict (nested too) the leading dimension its
    tensors share, other values in it (strings, ids) aside. Anything else, no
    tensor, a 0-d tensor, or tensors that disagree is a ``ValueError``.
    """
    if isinstance(batch, (int, np.integer)) and not isinstance(batch, (bool, np.bool_)):
        if batch < 0:
            raise ValueError(f"examples must not be negative, got {batch}")
        return int(batch)
    sizes: dict[str, int] = {}
    _leading_dims(batch, "batch", sizes)
    if not sizes:
        raise ValueError(
            f"cannot count the examples of a {type(batch).__name__}: it holds no tensor or "
            "array; pass the number of examples instead"
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{path}: {size}" for path, size in sizes.items())
        raise ValueError(
            f"the batch's tensors disagree on the number of examples ({listed}); pass the "
            "number of examples instead"
        )
    return next(iter(sizes.values()))


def _leading_dims(value: Any, path: str, sizes: dict[str, int]) -> None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise ValueError(
                f"{path} is a 0-d tensor: it has no leading dimension to count examples "
                "by; pass the number of examples instead"
            )
        sizes[path] = int(value.shape[0])
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _leading_dims(item, f"{path}[{key!r}]", sizes)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _leading_dims(item, f"{path}[{index}]", sizes)


@dataclass
class Resumed:
    """What :meth:`TrainState.load` restored, and the claim that holds for it.

    ``claim`` is ``"exact"`` (the resumed run replays the uninterrupted one
    bitwise) or ``"continuation"`` (a different rank count or sampler: each
    remaining sample of the epoch is used once, but the stream differs).
    ``rng`` is ``"restored"`` (every rank's saved streams) or ``"reseeded"``
    (new per-rank streams derived from the generation, when the rank count
    changed). ``partial_update`` is ``"restored"`` when a mid-accumulation
    save's gradients were put back, ``"discarded"`` when the update restarts
    from its first microbatch instead, else None.
    """

    claim: str
    generation: Generation
    update: int
    microbatch: int
    rng: str
    partial_update: str | None
    notes: list[str] = field(default_factory=list)
    extra: Any = None
    report: LoadReport | None = None
    skipped: list[Skipped] = field(default_factory=list)  # generations a fallback passed over


@dataclass
class WeightsLoaded:
    """What :func:`load_weights` loaded: the model only. This is not a resume."""

    generation: Generation
    tensors: int
    report: LoadReport | None = None


class TrainState:
    """The training state at one update boundary, saved and restored as a whole.

    Tell it where the loop is: :meth:`microbatch_done` after each microbatch's
    backward pass (with the number of examples it used on this rank), and
    :meth:`update_done` after the optimizer step (and the scheduler's and
    scaler's). Read :attr:`microbatch` to know which microbatch comes next,
    including after a mid-accumulation resume.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        sampler: ResumableDistributedSampler | None = None,
        dataset_hash: str | None = None,
        accumulation_steps: int = 1,
        numpy_generators: Mapping[str, np.random.Generator] | None = None,
        extra: Any = None,
    ) -> None:
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(
                f"accumulation_steps must be a positive int, got {accumulation_steps!r}"
            )
        if sampler is not None and not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(
                "sampler must be a castore.data.ResumableDistributedSampler, got "
                f"{type(sampler).__name__}: a plain sampler cannot report its position"
            )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.dataset_hash = dataset_hash
        self.accumulation_steps = accumulation_steps
        self.numpy_generators = dict(numpy_generators or {})
        self.extra = extra
        self.update = 0  # optimizer updates completed
        self.microbatch = 0  # microbatches accumulated toward the next update
        self.examples = 0  # examples this rank accepted into the next update
        self._epoch_examples = 0  # examples this rank consumed since the sampler's start
        self._largest_microbatch = 0  # since the sampler's start (see _check_finished_pass)
        self._cursor = self._sampler_cursor()
        self._update_start_examples = 0

    # -- the loop tells us where it is --------------------------------------

    def microbatch_done(self, examples: Any) -> None:
        """One microbatch's backward pass ran on this rank, on ``examples``.

        ``examples`` is the number of examples it used, or the batch itself: a
        tensor or array counts its leading dimension, a tuple, list or dict its
        tensors' common leading dimension (see :func:`examples_in`). With a
        sampler, counting more examples of an epoch than it handed out to this
        rank is a ``ValueError``.
        """
        count = examples_in(examples)
        self._follow_sampler()
        self._check_within_sampler(count)
        self.microbatch += 1
        self.examples += count
        self._epoch_examples += count
        self._largest_microbatch = max(self._largest_microbatch, count)

    def update_done(self) -> None:
        """The optimizer stepped: one more update is complete."""
        if self.microbatch == 0:
            raise SaveBoundaryError(
                "update_done() without a microbatch since the last update: call "
                "microbatch_done(examples) after each microbatch's backward pass"
            )
        self.update += 1
        self.microbatch = 0
        self.examples = 0
        self._follow_sampler()
        self._update_start_examples = self._epoch_examples

    @property
    def at_boundary(self) -> bool:
        """No microbatch is accumulated toward an unfinished update."""
        return self.microbatch == 0

    def _sampler_cursor(self) -> tuple[int, int] | None:
        return None if self.sampler is None else (self.sampler.epoch, self.sampler.start)

    def _follow_sampler(self) -> None:
        """A new epoch, or a loaded position, restarts the per-epoch count."""
        cursor = self._sampler_cursor()
        if cursor != self._cursor:
            self._check_finished_pass()
            self._cursor = cursor
            self._epoch_examples = 0
            self._largest_microbatch = 0
            self._update_start_examples = 0

    def _check_within_sampler(self, count: int) -> None:
        """No loop trains on examples its sampler never handed out to this rank.

        A loader draws ahead of the loop (prefetching), never behind it, so the
        examples counted this epoch never exceed the sampler's draws; more means
        the count is not this rank's examples (a global batch, a repeated call)
        and the saved cursor would skip unseen data.
        """
        if self.sampler is None:
            return
        handed_out = self.sampler.yielded
        if self._epoch_examples + count > handed_out:
            raise ValueError(
                f"microbatch_done({count}) would count {self._epoch_examples + count} examples "
                f"of epoch {self.sampler.epoch} on rank {self.sampler.rank}, but its sampler "
                f"has handed out only {handed_out}: pass this rank's microbatch (or its "
                "example count), once per microbatch"
            )

    def _check_finished_pass(self) -> None:
        """Warn when a pass the sampler finished was counted short by a microbatch or more.

        A warning, not an error: a loader with ``drop_last=True`` drops a last
        batch smaller than a full one, and a loop may skip examples on purpose;
        both count fewer than were drawn, correctly. A shortfall of a whole
        microbatch or more is the usual sign of ``microbatch_done(len(batch))``
        on an ``(x, y)`` batch, which counts 2; its saved cursors make a resume
        train on seen data again. Saves cannot check this (a prefetching loader
        may have finished drawing while the loop still trains), so it is checked
        once the loop has moved on to the next epoch.
        """
        sampler = self.sampler
        finished = sampler.last_pass if sampler is not None else None
        if sampler is None or finished is None or not finished.exhausted:
            return
        if (finished.epoch, finished.start) != self._cursor:
            return
        shortfall = finished.yielded - self._epoch_examples
        if shortfall >= max(1, self._largest_microbatch):
            warnings.warn(
                f"castore: epoch {finished.epoch} ended with {self._epoch_examples} examples "
                f"counted by microbatch_done() on rank {sampler.rank}, but its sampler "
                f"handed out {finished.yielded}: the saved data cursors "
                "under-count, so a resume trains on seen samples again. Pass each batch "
                "itself (microbatch_done(batch)) or its number of examples, not len() of "
                "an (x, y) tuple",
                DataCursorWarning,
                stacklevel=4,
            )

    # -- capture -------------------------------------------------------------

    def components(self) -> list[str]:
        present = {
            "model": True,
            "optimizer": self.optimizer is not None,
            "scheduler": self.scheduler is not None,
            "scaler": self.scaler is not None,
            "sampler": self.sampler is not None,
        }
        return sorted(name for name, here in present.items() if here)

    def capture(self, *, mid_accumulation: bool = False) -> dict[str, Any]:
        """The state tree of this rank (tensors are the live ones; nothing is copied)."""
        model = unwrap(self.model)
        per_rank: dict[str, Any] = {
            "rng": capture_rng(self.numpy_generators),
            "microbatch": self.microbatch,
            "examples": self.examples,
        }
        if mid_accumulation and self.microbatch:
            per_rank["grads"] = {
                name: param.grad.detach()
                for name, param in model.named_parameters()
                if param.grad is not None
            }
        state: dict[str, Any] = {
            "castore_train": TRAIN_FORMAT,
            "update": self.update,
            "model": {name: t.detach() for name, t in model.state_dict().items()},
            "rank": RankLocal(per_rank),
            "extra": self.extra,
        }
        if self.optimizer is not None:
            state["optimizer"] = optimizer_state_by_name(model, self.optimizer)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def _data_order(self, comm: Group, examples: list[int], starts: list[int]) -> dict[str, Any]:
        record: dict[str, Any] = {
            "castore_train": TRAIN_FORMAT,
            "update": self.update,
            "microbatch": self.microbatch,
            "world_size": comm.world_size,
            "accumulation_steps": self.accumulation_steps,
            "dataset_hash": self.dataset_hash,
            "components": self.components(),
            "numpy_generators": sorted(self.numpy_generators),
            "cuda_devices": _cuda_devices(),
        }
        if self.sampler is not None:
            sampler = self.sampler
            consumed = sampler.start + sum(examples)
            if consumed > sampler.epoch_size:
                raise SaveBoundaryError(
                    f"the data cursor is past the end of epoch {sampler.epoch}: {consumed} "
                    f"samples consumed of {sampler.epoch_size}; call sampler.set_epoch() "
                    "before each pass over the data"
                )
            record.update(
                seed=int(sampler.seed),
                epoch=int(sampler.epoch),
                consumed_samples=consumed,
                update_start_consumed=sampler.start + sum(starts),
                dataset_len=len(sampler.dataset),  # type: ignore[arg-type]
                shuffle=bool(sampler.shuffle),
                drop_last=bool(sampler.drop_last),
            )
        return record

    # -- save ----------------------------------------------------------------

    def save(
        self,
        store: Store,
        *,
        run: str,
        mid_accumulation: bool = False,
        metadata: dict[str, Any] | None = None,
        group: Any = None,
        coordinator: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        blocking: bool = True,
        if_busy: str = "wait",
        async_options: AsyncOptions | None = None,
    ) -> Any:
        """Save this update boundary as the next generation of ``run`` (collective).

        Refused between accumulated microbatches unless ``mid_accumulation``.
        ``blocking=False`` returns a :class:`~castore.PendingSave` once the state
        is staged (see :func:`castore.dist.save`); training may step on at once.
        """
        # An async save's checks run over castore's own group (castore.dist.comm.own_groups).
        comm = Group(group if blocking else own_groups(group, timeout)[1], coordinator, timeout)
        self._follow_sampler()

        def check() -> None:
            if self.microbatch and not mid_accumulation:
                raise SaveBoundaryError(
                    f"save requested after {self.microbatch} of {self.accumulation_steps} "
                    f"accumulated microbatches of update {self.update + 1}: save at an "
                    "optimizer-step boundary, or pass mid_accumulation=True to save the "
                    "partial gradients too"
                )

        _, failure = attempt(check)
        positions = comm.all_gather(
            {
                "error": describe(failure),
                "update": self.update,
                "microbatch": self.microbatch,
                "examples": self._epoch_examples,
                "start": self._update_start_examples,
            },
            "train.save: boundary",
        )
        raise_failures(positions, comm, failure)
        where = {(p["update"], p["microbatch"]) for p in positions}
        if len(where) != 1:
            raise SaveBoundaryError(
                "ranks are at different points of training (update, microbatch): "
                f"{[(p['update'], p['microbatch']) for p in positions]}",
                run=run,
            )
        record = self._data_order(
            comm, [p["examples"] for p in positions], [p["start"] for p in positions]
        )
        return castore_dist.save(
            store,
            self.capture(mid_accumulation=mid_accumulation),
            run=run,
            step=self.update,
            metadata=metadata,
            data_order=record,
            group=group,
            coordinator=coordinator,
            timeout=timeout,
            blocking=blocking,
            if_busy=if_busy,
            async_options=async_options,
        )

    # -- load ----------------------------------------------------------------

    def load(
        self,
        store: Store,
        *,
        run: str,
        generation: int | str = "latest",
        resume: str = "exact",
        group: Any = None,
        coordinator: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        fallback: str | None = None,
    ) -> Resumed:
        """Restore a saved boundary into the live objects, under the claim ``resume``.

        Nothing live changes unless every rank verified everything it reads and
        the claim's conditions hold; a mismatch raises
        :class:`~castore.errors.ResumeMismatchError` naming every differing field.
        ``fallback="previous"`` walks back to the newest generation that
        validates on every rank (skipped ones are in ``Resumed.skipped``).
        """
        if resume not in ("exact", "continuation"):
            raise ValueError(f"resume must be 'exact' or 'continuation', got {resume!r}")
        if fallback not in (None, "previous"):
            raise ValueError(f"fallback must be None or 'previous', got {fallback!r}")
        comm = Group(group, coordinator, timeout)
        where = (store, run, resume, comm, group, coordinator, timeout)
        if fallback is None:
            return self._load_root(*where, agree_on_root(store, run, generation, comm), [])
        candidates, skipped = agree_on_candidates(store, run, generation, comm)
        for gen_id, digest in candidates:
            try:
                return self._load_root(*where, digest, skipped)
            except Exception as exc:  # noqa: BLE001 - skipped only if every rank saw damage
                damage = isinstance(exc, IntegrityError)
                verdicts = comm.all_gather({"damage": damage}, "train.load: fallback")
                if not all(v["damage"] for v in verdicts):
                    raise
                skipped.append(Skipped(gen_id, digest.hex, type(exc).__name__, str(exc)))
        listed = "; ".join(f"{s.generation}: {s.error}" for s in skipped)
        raise NoValidGenerationError(
            f"no generation of run {run!r} validates on every rank (skipped {listed})", run=run
        )

    def _load_root(
        self,
        store: Store,
        run: str,
        resume: str,
        comm: Group,
        group: Any,
        coordinator: int,
        timeout: float,
        digest: Digest,
        skipped: list[Skipped],
    ) -> Resumed:
        def check() -> Generation:
            found = Generation.from_root(digest, store.read_root(digest, run=run))
            self._check_claim(found.data_order, resume, comm, found)
            skeleton = _skeleton(store, digest, run)
            where = {"run": run, "generation": found.id}
            _check_model_keys(unwrap(self.model), skeleton.get("model"), where)
            if self.optimizer is not None:
                _check_optimizer_groups(
                    unwrap(self.model), self.optimizer, skeleton["optimizer"], where
                )
            return found

        root_generation, failure = attempt(check)
        outcomes = comm.all_gather({"error": describe(failure)}, "train.load: claim")
        raise_failures(outcomes, comm, failure)
        assert root_generation is not None
        saved = root_generation.data_order

        same_world = saved["world_size"] == comm.world_size
        current_rng = {
            "world_size": comm.world_size,
            "numpy_generators": sorted(self.numpy_generators),
            "cuda_devices": _cuda_devices(),
        }
        rng_differs = [k for k in _RNG_FIELDS if saved.get(k) != current_rng[k]]
        model = unwrap(self.model)
        live = {name: t for name, t in model.state_dict().items()}
        loaded = castore_dist.load(
            store,
            run,
            {"model": live},
            digest.hex,
            group=group,
            coordinator=coordinator,
            timeout=timeout,
            rank_local="same" if same_world else "drop",
            framework="torch",
            load_rest=True,
        )
        state = loaded.state
        notes: list[str] = []
        # Everything below changes only host objects; every byte was verified above.
        if self.optimizer is not None:
            load_optimizer_state_by_name(model, self.optimizer, state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

        microbatch = int(saved.get("microbatch", 0))
        partial: str | None = None
        per_rank = state["rank"]
        if not rng_differs:
            restore_rng(per_rank["rng"], self.numpy_generators)
            rng = "restored"
        else:
            _reseed(digest.raw, comm.rank, self.numpy_generators)
            rng = "reseeded"
            changed = ", ".join(f"{k} {saved.get(k)!r} -> {current_rng[k]!r}" for k in rng_differs)
            notes.append(
                f"RNG streams cannot be restored ({changed}): every rank's streams were "
                "reseeded from the generation and the rank"
            )
        for param in model.parameters():
            param.grad = None
        self.microbatch = 0
        self.examples = 0
        if microbatch and same_world and saved["accumulation_steps"] == self.accumulation_steps:
            grads = per_rank.get("grads", {})
            named = dict(model.named_parameters())
            for name, grad in grads.items():
                param = named[name]
                param.grad = grad.to(device=param.device, dtype=param.dtype)
            self.microbatch = microbatch
            self.examples = int(per_rank["examples"])
            partial = "restored"
        elif microbatch:
            partial = "discarded"
            notes.append(
                f"saved after {microbatch} microbatches of update {saved['update'] + 1}: the "
                "partial gradients cannot move to another rank count or accumulation, so the "
                "update restarts from its first microbatch"
            )
        if self.sampler is not None:
            position = sampler_position(saved, rewind_partial_update=partial == "discarded")
            if resume == "continuation" and same_world and saved["seed"] != self.sampler.seed:
                notes.append(
                    f"sampler seed {self.sampler.seed} replaced by the saved {saved['seed']} "
                    "to finish the epoch"
                )
            self.sampler.load_state_dict(position)
            self._cursor = self._sampler_cursor()
            # The loaded position already counts the partial update's samples; its
            # start lies this rank's accepted examples before that position.
            self._epoch_examples = 0
            self._update_start_examples = -self.examples
        self.update = int(saved["update"])
        self.extra = state.get("extra")
        if skipped:
            notes.append(
                "fell back past "
                + "; ".join(f"generation {k.generation} ({k.error}: {k.reason})" for k in skipped)
            )
        return Resumed(
            claim=resume,
            skipped=list(skipped),
            generation=root_generation,
            update=self.update,
            microbatch=self.microbatch,
            rng=rng,
            partial_update=partial,
            notes=notes,
            extra=self.extra,
            report=loaded.report,
        )

    def _check_claim(
        self, saved: dict[str, Any], resume: str, comm: Group, generation: Generation | None
    ) -> None:
        where = {"run": generation.run, "generation": generation.id} if generation else {}
        if saved.get("castore_train") != TRAIN_FORMAT:
            raise ResumeMismatchError(
                "this generation was not saved by castore.train.TrainState (its root has no "
                "training data-order record): load it with Store.load, castore.dist.load or "
                "load_weights",
                **where,
            )
        _check_record(saved, where)
        current: dict[str, Any] = {
            "world_size": comm.world_size,
            "dataset_hash": self.dataset_hash,
            "accumulation_steps": self.accumulation_steps,
            "components": self.components(),
            "numpy_generators": sorted(self.numpy_generators),
            "cuda_devices": _cuda_devices(),
        }
        if self.sampler is not None:
            current.update(
                seed=int(self.sampler.seed),
                dataset_len=len(self.sampler.dataset),  # type: ignore[arg-type]
                shuffle=bool(self.sampler.shuffle),
                drop_last=bool(self.sampler.drop_last),
            )
        fields = _EXACT_FIELDS if resume == "exact" else _CONTINUATION_FIELDS
        differences = {
            name: (saved.get(name), current.get(name))
            for name in fields
            if saved.get(name) != current.get(name)
        }
        if differences:
            listed = "; ".join(
                f"{name}: saved {a!r}, here {b!r}" for name, (a, b) in differences.items()
            )
            hint = (
                " (resume='continuation' allows another rank count or sampler seed)"
                if resume == "exact" and set(differences) <= {"world_size", "seed"}
                else ""
            )
            raise ResumeMismatchError(
                f"resume={resume!r} cannot hold, {len(differences)} field(s) differ: "
                f"{listed}{hint}",
                differences=differences,
                **where,
            )


def _skeleton(store: Store, digest: Any, run: str) -> Any:
    """The saved tree with every tensor as None: structure and plain values only."""
    root = store.read_root(digest, run=run)
    return decode_tree(root.state, lambda _name, _framework: None, lambda _path: None)


def _check_model_keys(model: torch.nn.Module, saved: Any, where: dict[str, Any]) -> None:
    if not isinstance(saved, Mapping):
        raise LayoutMismatchError("the generation holds no model state", **where)
    live = set(model.state_dict())
    missing = sorted(live - set(saved))
    unexpected = sorted(set(saved) - live)
    if missing or unexpected:
        raise LayoutMismatchError(
            f"the model does not match the saved one: not saved {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, not in the model {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}",
            **where,
        )


def _check_optimizer_groups(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    where: dict[str, Any],
) -> None:
    try:
        _match_groups(_parameter_names(model), optimizer, saved)
    except ValueError as exc:
        raise LayoutMismatchError(
            f"the optimizer does not match the saved one: {exc}", **where
        ) from exc


def _reseed(root: bytes, rank: int, generators: Mapping[str, np.random.Generator]) -> None:
    """New, distinct, reproducible streams for ``rank`` after a change of rank count."""

    def seed(stream: str) -> int:
        return int.from_bytes(digest_bytes(root + f"/{stream}/{rank}".encode())[:8], "little")

    random.seed(seed("python"))
    np.random.seed(seed("numpy") % 2**32)
    torch.manual_seed(seed("torch"))  # also every CUDA device
    for name, gen in generators.items():
        gen.bit_generator.state = type(gen.bit_generator)(seed(f"numpy/{name}")).state


def sampler_position(
    data_order: Mapping[str, Any], *, rewind_partial_update: bool = False
) -> dict[str, Any]:
    """The ``ResumableDistributedSampler`` state a generation's data-order record names.

    ``rewind_partial_update`` puts the cursor back at the start of the update
    a mid-accumulation save was in (for partial gradients that were dropped).
    """
    consumed = "update_start_consumed" if rewind_partial_update else "consumed_samples"
    return {
        "version": 1,
        "seed": data_order["seed"],
        "epoch": data_order["epoch"],
        "consumed_samples": data_order[consumed],
        "num_replicas": data_order["world_size"],
        "dataset_len": data_order["dataset_len"],
        "shuffle": data_order["shuffle"],
        "drop_last": data_order["drop_last"],
    }


def load_weights(
    store: Store,
    run: str,
    model: torch.nn.Module,
    generation: int | str = "latest",
    *,
    prefix: str = "model",
    group: Any = None,
    coordinator: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> WeightsLoaded:
    """Load only the model's parameters and buffers, in place. Never a resume.

    The optimizer, schedulers, RNG streams and data position are untouched
    and nothing claims the next update matches any other run's. ``prefix`` is
    the key the model's state sits under in the saved tree (``"model"`` for
    :class:`TrainState` saves).
    """
    comm = Group(group, coordinator, timeout)
    digest = agree_on_root(store, run, generation, comm)
    module = unwrap(model)

    def check() -> None:
        root = store.read_root(digest, run=run)
        skeleton = _skeleton(store, digest, run)
        saved = skeleton.get(prefix) if isinstance(skeleton, dict) else None
        _check_model_keys(module, saved, {"run": run, "generation": root.generation})

    _, failure = attempt(check)
    outcomes = comm.all_gather({"error": describe(failure)}, "load_weights: check")
    raise_failures(outcomes, comm, failure)
    live = {name: t for name, t in module.state_dict().items()}
    loaded = castore_dist.load(
        store,
        run,
        {prefix: live},
        digest.hex,
        group=group,
        coordinator=coordinator,
        timeout=timeout,
        rank_local="drop",
        framework="torch",
    )
    return WeightsLoaded(loaded.report.generation, len(live), loaded.report)
