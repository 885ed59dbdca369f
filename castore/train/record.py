"""The training data-order record a :class:`~castore.train.TrainState` save puts in its
root, and what a resume checks of it before anything live changes.

The record names the update boundary (``update``, ``microbatch``), the group
(``world_size``, ``cuda_devices``), what was saved (``components``,
``numpy_generators``) and, with a sampler, its position; docs/FORMAT.md lists
every field. A record read from a store is checked field by field
(:func:`check_record`); a claim compares it with the live setup (:func:`check_claim`).
"""

from __future__ import annotations

from typing import Any

from castore.errors import CorruptObjectError, ResumeMismatchError

TRAIN_FORMAT = 1  # the layout of the state tree and data-order record below

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
RNG_FIELDS = ("world_size", "numpy_generators", "cuda_devices")  # to restore RNG streams
_CONTINUATION_FIELDS = ("dataset_hash", "dataset_len", "components")


def _check_fields(saved: dict[str, Any], where: dict[str, Any]) -> None:
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


def check_record(saved: dict[str, Any], where: dict[str, Any]) -> None:
    """``saved`` is a TrainState record of this format, every field of its type."""
    if saved.get("castore_train") != TRAIN_FORMAT:
        raise ResumeMismatchError(
            "this generation was not saved by castore.train.TrainState (its root has no "
            "training data-order record): load it with Store.load, castore.dist.load or "
            "load_weights",
            **where,
        )
    _check_fields(saved, where)


def check_claim(
    saved: dict[str, Any], current: dict[str, Any], resume: str, where: dict[str, Any]
) -> None:
    """The fields the claim ``resume`` needs equal are equal in ``saved`` and ``current``.

    Else a ResumeMismatchError naming every field that differs.
    """
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
            f"resume={resume!r} cannot hold, {len(differences)} field(s) differ: {listed}{hint}",
            differences=differences,
            **where,
        )
