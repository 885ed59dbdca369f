"""One training update boundary, saved as a generation and resumed under a stated claim.

:class:`TrainState` follows the loop (microbatches, updates, the data cursor),
captures everything the next update depends on, writes it with its data-order
record (:mod:`castore.train.record`), and restores it after checking that the
claim asked for (``"exact"`` or ``"continuation"``) can hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from castore import dist as castore_dist
from castore.core.history import Generation, Skipped, fall_back
from castore.core.saveoptions import SaveKeywords, SaveOptions
from castore.data import ResumableDistributedSampler
from castore.dist.comm import DEFAULT_TIMEOUT, Group, attempt, describe, own_groups, raise_failures
from castore.dist.restore import LoadReport, agree_on_candidates, agree_on_root, seed_root
from castore.errors import (
    IntegrityError,
    LayoutMismatchError,
    SaveBoundaryError,
)
from castore.format.hashing import Digest
from castore.format.shard import RankLocal
from castore.store import Store
from castore.train.cursor import DataCursor, examples_in, sampler_position
from castore.train.optimizers import (
    load_optimizer_state_by_name,
    match_groups,
    optimizer_state_by_name,
    parameter_names,
    unwrap,
)
from castore.train.record import RNG_FIELDS, TRAIN_FORMAT, check_claim, check_record
from castore.train.rng import capture_rng, cuda_devices, reseed_rng, restore_rng
from castore.train.sharded import (
    local_grad,
    optimizer_targets,
    placed_grad,
    unreduced_gradients,
)
from castore.train.weights import check_model_keys, saved_skeleton

if TYPE_CHECKING:
    from typing_extensions import Unpack


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
        self._cursor = DataCursor(sampler)

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
        self._cursor.follow()
        self._cursor.check_within(count)
        self.microbatch += 1
        self.examples += count
        self._cursor.counted(count)

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
        self._cursor.follow()
        self._cursor.update_started()

    @property
    def at_boundary(self) -> bool:
        """No microbatch is accumulated toward an unfinished update."""
        return self.microbatch == 0

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
            per_rank["grads"] = {  # a DTensor's: this rank's block (rank-local)
                name: local_grad(param.grad.detach())
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
            "cuda_devices": cuda_devices(),
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
        group: Any = None,
        coordinator: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        blocking: bool = True,
        **keywords: Unpack[SaveKeywords],
    ) -> Any:
        """Save this update boundary as the next generation of ``run`` (collective).

        Refused between accumulated microbatches unless ``mid_accumulation``.
        ``blocking=False`` returns a :class:`~castore.PendingSave` once the state
        is staged (see :func:`castore.dist.save`); training may step on at once.
        ``trust_versions=True`` (blocking saves) skips hashing the tensors whose
        version counters did not move since this store handle's last save: see
        :mod:`castore.core.unchanged` for when that is safe. ``codec`` encodes
        this save's new chunks instead of the store handle's codec
        (:mod:`castore.format.codec`). ``metadata``, ``if_busy`` and
        ``async_options`` as for :func:`castore.dist.save`.
        """
        SaveOptions.of("save", blocking, keywords)  # refused here, before the ranks meet
        # An async save's checks run over castore's own group (castore.dist.comm.own_groups).
        comm = Group(group if blocking else own_groups(group, timeout)[1], coordinator, timeout)
        self._cursor.follow()

        def check() -> None:
            if self.microbatch and not mid_accumulation:
                raise SaveBoundaryError(
                    f"save requested after {self.microbatch} of {self.accumulation_steps} "
                    f"accumulated microbatches of update {self.update + 1}: save at an "
                    "optimizer-step boundary, or pass mid_accumulation=True to save the "
                    "partial gradients too"
                )
            if mid_accumulation and self.microbatch:
                held = unreduced_gradients(unwrap(self.model))
                if held:
                    raise SaveBoundaryError(
                        f"FSDP2 holds the partial gradients of {len(held)} module(s) "
                        f"({', '.join(held[:3])}) unreduced, where no checkpoint sees them "
                        "(set_requires_gradient_sync(False)): save at an optimizer-step "
                        "boundary, or keep gradient sync on while accumulating"
                    )

        _, failure = attempt(check)
        positions = comm.all_gather(
            {
                "error": describe(failure),
                "update": self.update,
                "microbatch": self.microbatch,
                "examples": self._cursor.epoch_examples,
                "start": self._cursor.update_start,
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
            data_order=record,
            group=group,
            coordinator=coordinator,
            timeout=timeout,
            blocking=blocking,
            **keywords,
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
        if fallback is None:
            digest = agree_on_root(store, run, generation, comm)
            return self._load_root(store, run, resume, comm, digest, [])
        candidates, skipped = agree_on_candidates(store, run, generation, comm)

        def load_one(gen_id: int, digest: Digest) -> Resumed:
            seed_root(store, run, digest, comm)  # tiers on several nodes: to every node
            return self._load_root(store, run, resume, comm, digest, skipped)

        def is_damage(exc: Exception) -> bool:  # skipped only if every rank saw damage
            damage = isinstance(exc, IntegrityError)
            verdicts = comm.all_gather({"damage": damage}, "train.load: fallback")
            return all(v["damage"] for v in verdicts)

        return fall_back(run, candidates, load_one, is_damage, skipped, scope=" on every rank")

    def _load_root(
        self,
        store: Store,
        run: str,
        resume: str,
        comm: Group,
        digest: Digest,
        skipped: list[Skipped],
    ) -> Resumed:
        generation = self._agree_on_claim(store, run, resume, comm, digest)
        saved = generation.data_order
        same_world = saved["world_size"] == comm.world_size
        model = unwrap(self.model)
        loaded = castore_dist.load(
            store,
            run,
            {"model": dict(model.state_dict())},
            digest.hex,
            group=comm.group,
            coordinator=comm.coordinator,
            timeout=comm.timeout,
            rank_local="same" if same_world else "drop",
            framework="torch",
            # A sharded parameter's moments into DTensors of its layout; the rest whole.
            load_rest=optimizer_targets(dict(model.named_parameters()), "optimizer"),
        )
        state = loaded.state
        notes: list[str] = []
        # Everything below changes only host objects; every byte was verified above.
        self._load_components(state)
        rng = self._restore_rng(saved, state["rank"], digest, comm, notes)
        partial = self._restore_partial_update(saved, state["rank"], same_world, notes)
        if self.sampler is not None:
            self._restore_sampler(saved, resume, same_world, partial, notes)
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
            generation=generation,
            update=self.update,
            microbatch=self.microbatch,
            rng=rng,
            partial_update=partial,
            notes=notes,
            extra=self.extra,
            report=loaded.report,
        )

    def _agree_on_claim(
        self, store: Store, run: str, resume: str, comm: Group, digest: Digest
    ) -> Generation:
        """The generation, once every rank found the claim holds and the live objects fit it."""

        def check() -> Generation:
            root = store.read_root(digest, run=run)
            found = Generation.from_root(digest, root)
            self._check_claim(found.data_order, resume, comm, found)
            skeleton = saved_skeleton(root)
            where = {"run": run, "generation": found.id}
            model = unwrap(self.model)
            check_model_keys(model, skeleton.get("model"), where)
            if self.optimizer is not None:
                _check_optimizer_groups(model, self.optimizer, skeleton["optimizer"], where)
            return found

        generation, failure = attempt(check)
        outcomes = comm.all_gather({"error": describe(failure)}, "train.load: claim")
        raise_failures(outcomes, comm, failure)
        assert generation is not None
        return generation

    def _load_components(self, state: dict[str, Any]) -> None:
        """The optimizer's, scheduler's and scaler's saved state, into the live ones."""
        if self.optimizer is not None:
            load_optimizer_state_by_name(unwrap(self.model), self.optimizer, state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def _restore_rng(
        self,
        saved: dict[str, Any],
        per_rank: dict[str, Any],
        digest: Digest,
        comm: Group,
        notes: list[str],
    ) -> str:
        """Every rank's saved streams, or new ones when they cannot be restored here."""
        current = {
            "world_size": comm.world_size,
            "numpy_generators": sorted(self.numpy_generators),
            "cuda_devices": cuda_devices(),
        }
        differs = [k for k in RNG_FIELDS if saved.get(k) != current[k]]
        if not differs:
            restore_rng(per_rank["rng"], self.numpy_generators)
            return "restored"
        reseed_rng(digest.raw, comm.rank, self.numpy_generators)
        changed = ", ".join(f"{k} {saved.get(k)!r} -> {current[k]!r}" for k in differs)
        notes.append(
            f"RNG streams cannot be restored ({changed}): every rank's streams were "
            "reseeded from the generation and the rank"
        )
        return "reseeded"

    def _restore_partial_update(
        self, saved: dict[str, Any], per_rank: dict[str, Any], same_world: bool, notes: list[str]
    ) -> str | None:
        """A mid-accumulation save's gradients and counts, where they can move; else none."""
        model = unwrap(self.model)
        microbatch = int(saved.get("microbatch", 0))
        for param in model.parameters():
            param.grad = None
        self.microbatch = 0
        self.examples = 0
        if microbatch and same_world and saved["accumulation_steps"] == self.accumulation_steps:
            named = dict(model.named_parameters())
            for name, grad in per_rank.get("grads", {}).items():
                param = named[name]
                param.grad = placed_grad(grad, param)
            self.microbatch = microbatch
            self.examples = int(per_rank["examples"])
            return "restored"
        if microbatch:
            notes.append(
                f"saved after {microbatch} microbatches of update {saved['update'] + 1}: the "
                "partial gradients cannot move to another rank count or accumulation, so the "
                "update restarts from its first microbatch"
            )
            return "discarded"
        return None

    def _restore_sampler(
        self,
        saved: dict[str, Any],
        resume: str,
        same_world: bool,
        partial: str | None,
        notes: list[str],
    ) -> None:
        """The sampler at the saved position (the partial update's start if it was dropped)."""
        assert self.sampler is not None
        position = sampler_position(saved, rewind_partial_update=partial == "discarded")
        if resume == "continuation" and same_world and saved["seed"] != self.sampler.seed:
            notes.append(
                f"sampler seed {self.sampler.seed} replaced by the saved {saved['seed']} "
                "to finish the epoch"
            )
        self.sampler.load_state_dict(position)
        self._cursor.restarted_at_loaded_position(self.examples)

    def _check_claim(
        self, saved: dict[str, Any], resume: str, comm: Group, generation: Generation | None
    ) -> None:
        where = {"run": generation.run, "generation": generation.id} if generation else {}
        check_record(saved, where)
        current: dict[str, Any] = {
            "world_size": comm.world_size,
            "dataset_hash": self.dataset_hash,
            "accumulation_steps": self.accumulation_steps,
            "components": self.components(),
            "numpy_generators": sorted(self.numpy_generators),
            "cuda_devices": cuda_devices(),
        }
        if self.sampler is not None:
            current.update(
                seed=int(self.sampler.seed),
                dataset_len=len(self.sampler.dataset),  # type: ignore[arg-type]
                shuffle=bool(self.sampler.shuffle),
                drop_last=bool(self.sampler.drop_last),
            )
        check_claim(saved, current, resume, where)


def _check_optimizer_groups(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    where: dict[str, Any],
) -> None:
    try:
        match_groups(parameter_names(model), optimizer, saved)
    except ValueError as exc:
        raise LayoutMismatchError(
            f"the optimizer does not match the saved one: {exc}", **where
        ) from exc
