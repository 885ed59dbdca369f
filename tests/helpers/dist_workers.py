"""Per-rank functions for tests/test_dist.py, run by tests/helpers/dist_harness.py.

Each is called as ``fn(rank, world_size, *args)`` inside a joined gloo group
and returns something picklable (numpy arrays, not torch tensors, so the parent
needs no torch to look at them). Test states are built here and in the parent
from the same seeds, so both sides know every expected byte.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

# -- harness self-test workers -------------------------------------------------------------


def all_reduce_rank(rank: int, world_size: int, scale: int) -> dict[str, Any]:
    """Sum ``scale * (rank + 1)`` over the group; report what this rank saw."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([scale * (rank + 1)], dtype=torch.int64)
    dist.all_reduce(value)
    return {
        "sum": int(value.item()),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "mark": os.environ.get("CASTORE_TEST_MARK"),
        "faults": os.environ.get("CASTORE_FAULTS"),
        "pid": os.getpid(),
    }


class HarnessProbeError(RuntimeError):
    pass


def misbehave(rank: int, world_size: int, actions: dict[int, str]) -> str:
    """Rank r does ``actions[r]``: "raise", "kill" (SIGKILL self), "hang", "unpicklable"."""
    action = actions.get(rank, "return")
    if action == "raise":
        raise HarnessProbeError(f"rank {rank} raised on purpose")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        time.sleep(3600)
    if action == "unpicklable":
        return lambda: None  # type: ignore[return-value]
    return f"rank {rank} returned"


# -- the test state --------------------------------------------------------------------------

# name (a key path in the state) -> (global shape, dtype, the dimension it is sharded along or
# None for a replicated tensor). With 128-byte chunks a row of "model/emb" is 32 bytes, so
# 8-row boxes (world size 8) and 16-row boxes (world size 4) are whole chunks.
CHUNK_SIZE = 128
TENSORS: dict[str, tuple[tuple[int, ...], str, int | None]] = {
    "model/emb": ((64, 8), "float32", 0),  # row-sharded
    "model/proj": ((6, 16), "float32", 1),  # column-sharded
    "model/bias": ((40,), "float32", 0),  # 1-D
    "model/conv": ((4, 10, 3), "int64", 1),  # 3-D, sharded along the middle dimension
    "model/norm": ((32,), "float32", None),  # replicated
    "optim/table": ((12, 12), "float64", None),  # replicated
    "optim/half": ((5, 7), "bfloat16", None),  # replicated
}
SHARDED = [name for name, (_, _, dim) in TENSORS.items() if dim is not None]
REPLICATED = [name for name, (_, _, dim) in TENSORS.items() if dim is None]
RANK_LOCAL_BYTES = 16
SENTINEL = -7


def np_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def full_tensors(seed: int) -> dict[str, np.ndarray]:
    """The whole tensors of the state saved with ``seed`` (equal seeds, equal bytes)."""
    rng = np.random.default_rng([seed, 12345])
    out = {}
    for name, (shape, dtype, _) in TENSORS.items():
        if dtype == "int64":
            array = rng.integers(-(10**9), 10**9, size=shape, dtype=np.int64)
        elif dtype == "bfloat16":  # quarters of small integers: exact in bfloat16
            array = (rng.integers(-400, 400, size=shape) / 4).astype(np_dtype(dtype))
        else:
            array = rng.standard_normal(shape).astype(dtype)
        out[name] = array
    return out


def rank_local_value(seed: int, rank: int) -> tuple[np.ndarray, int]:
    """What rank ``rank`` keeps in its RankLocal when saving with ``seed``."""
    rng = np.random.default_rng([seed, rank, 777])
    return rng.integers(0, 256, size=RANK_LOCAL_BYTES, dtype=np.uint8), seed * 1000 + rank


def hparams(seed: int) -> dict[str, Any]:
    return {"lr": 1e-3 * seed, "betas": (0.9, 0.999), "name": "adamw", "layers": [seed, 2, 3]}


def split(size: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of each part, numpy.array_split style: 8 rows in 3 -> 3, 3, 2."""
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for index in range(parts):
        length = base + (1 if index < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def box_of(name: str, rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, local shape) of ``rank``'s block of tensor ``name``."""
    shape, _, dim = TENSORS[name]
    if dim is None:
        return (0,) * len(shape), shape
    start, length = split(shape[dim], world_size)[rank]
    offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
    local = tuple(length if d == dim else s for d, s in enumerate(shape))
    return offsets, local


def box_slices(offsets: tuple[int, ...], local: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, local, strict=True))


PAD = 55  # around a view's elements in its parent buffer


def to_framework(array: np.ndarray, framework: str, view: bool = False) -> Any:
    """A contiguous copy of ``array`` as a numpy array or a torch tensor.

    With ``view``, a strided view instead: ``parent[..., 1:-1]`` of a buffer one
    element wider on each side of the last dimension, those sides filled with PAD.
    """
    array = np.ascontiguousarray(array).copy()
    if view:
        widths = [(0, 0)] * (array.ndim - 1) + [(1, 1)]
        array = np.pad(array, widths, constant_values=np.array(PAD, dtype=array.dtype))
    if framework == "numpy":
        out = array
    else:
        import torch

        if array.dtype == np_dtype("bfloat16"):
            out = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(array)
    return out[..., 1:-1] if view else out


def pads_intact(value: Any) -> bool:
    """For a view made by ``to_framework(view=True)``: is its parent's padding untouched?"""
    if hasattr(value, "_base"):  # torch: the root base may be a same-size integer view
        parent = to_numpy(value._base.view(value.dtype))
    else:
        parent = value.base
    parent = parent.astype(np.float64)
    return bool((parent[..., 0] == PAD).all() and (parent[..., -1] == PAD).all())


def to_numpy(value: Any) -> Any:
    """A torch tensor as a numpy array (bfloat16 kept exact); anything else as is."""
    if type(value).__module__.startswith("torch"):
        import torch

        if value.dtype == torch.bfloat16:
            return value.detach().contiguous().view(torch.int16).numpy().view(np_dtype("bfloat16"))
        return value.detach().contiguous().numpy().copy()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def get_path(tree: Any, path: str) -> Any:
    for key in path.split("/"):
        tree = tree[key]
    return tree


def make_state(
    rank: int,
    world_size: int,
    seed: int,
    step: int,
    framework: str = "torch",
    views: bool = False,
) -> dict[str, Any]:
    """This rank's state: Shards, replicated tensors, a RankLocal, plain values.

    With ``views``, every tensor is a strided view into a larger buffer.
    """
    import castore

    full = full_tensors(seed)
    state: dict[str, Any] = {}
    for name, (shape, _, dim) in TENSORS.items():
        if dim is None:
            set_path(state, name, to_framework(full[name], framework, views))
        else:
            offsets, local = box_of(name, rank, world_size)
            block = to_framework(full[name][box_slices(offsets, local)], framework, views)
            set_path(state, name, castore.Shard(block, shape, offsets))
    local_bytes, cursor = rank_local_value(seed, rank)
    state["rng"] = castore.RankLocal(
        {"state": to_framework(local_bytes, framework), "cursor": cursor}
    )
    state["optim"]["hparams"] = hparams(seed)
    state["step"] = step
    return state


def make_targets(
    rank: int,
    world_size: int,
    names: list[str],
    framework: str = "torch",
    dtypes: dict[str, str] | None = None,
    views: bool = False,
) -> dict[str, Any]:
    """Load targets for ``names``, filled with SENTINEL: Shards for sharded tensors.

    ``dtypes`` overrides the dtype of some targets (to make them not match); with
    ``views`` every target is a strided view into a larger buffer.
    """
    import castore

    targets: dict[str, Any] = {}
    for name in names:
        shape, dtype, dim = TENSORS[name]
        dtype = (dtypes or {}).get(name, dtype)
        offsets, local = box_of(name, rank, world_size)
        fill = np.full(local, SENTINEL, dtype=np_dtype(dtype))
        buffer = to_framework(fill, framework, views)
        set_path(targets, name, buffer if dim is None else castore.Shard(buffer, shape, offsets))
    return targets


def target_buffer(targets: dict[str, Any], name: str) -> Any:
    leaf = get_path(targets, name)
    return getattr(leaf, "local", leaf)


def unchanged(targets: dict[str, Any], names: list[str]) -> dict[str, bool]:
    """For each target: does it still hold SENTINEL in every element?"""
    return {
        name: bool(np.all(to_numpy(target_buffer(targets, name)).astype(np.float64) == SENTINEL))
        for name in names
    }


def summarize(value: Any) -> Any:
    """A loaded state made picklable without torch: tensors as numpy, Shards described."""
    import castore

    if isinstance(value, dict):
        return {key: summarize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(summarize(item) for item in value)
    if isinstance(value, castore.Shard):
        return ("Shard", value.offsets, value.global_shape)
    if isinstance(value, castore.RankLocal):
        return castore.RankLocal(summarize(value.value))
    return to_numpy(value)


# -- the script runner: one launch, many saves and loads --------------------------------------


def _error(exc: BaseException, started: float) -> dict[str, Any]:
    return {
        "error": type(exc).__name__,
        "mro": tuple(c.__name__ for c in type(exc).__mro__),
        "message": str(exc),
        "seconds": time.monotonic() - started,
    }


def _rank_local_option(option: Any) -> Any:
    """ "same"/"drop" as is, or a mapping: ("times", k), ("mod", k) or ("const", k)."""
    if isinstance(option, str):
        return option
    kind, k = option
    if kind == "times":
        return lambda new_rank: new_rank * k
    if kind == "mod":
        return lambda new_rank: new_rank % k
    if kind == "const":
        return lambda new_rank: k
    raise ValueError(f"unknown rank_local option {option!r}")


def _latest(store: Any, run: str) -> tuple[int, str] | None:
    try:
        generation = store.resolve(run)
    except Exception:
        return None
    return generation.id, generation.root


def _save(
    rank: int, world_size: int, store: Any, op: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    import castore.dist

    framework, views = op.get("framework", "torch"), op.get("views", False)
    state = make_state(rank, world_size, op["seed"], op["step"], framework, views)
    if rank == op.get("poison_rank"):
        state["rng"].value["cursor"] = object()  # no encoding for a bare object
    if rank == op.get("overlap_rank"):
        # Claim the previous rank's rows too: an overlap and (at the end) a gap.
        shard = get_path(state, "model/emb")
        shift = split(64, world_size)[rank][1]
        shard.offsets = (shard.offsets[0] - shift, 0)
    if rank == op.get("extra_tensor_rank"):  # a tensor the other ranks do not have
        state["model"]["extra"] = to_framework(np.arange(4, dtype=np.float32), framework)
    if rank == op.get("gap_rank"):
        # Leave out this rank's last row: a gap, and no overlap.
        shard = get_path(state, "model/emb")
        shard.local = shard.local[:-1]  # rows stay contiguous
    kwargs: dict[str, Any] = {"run": op["run"], "step": op["step"], **options}
    if "metadata" in op:
        kwargs["metadata"] = op["metadata"]
    if "timeout" in op:
        kwargs["timeout"] = op["timeout"]
    started = time.monotonic()
    try:
        if op.get("blocking", True):
            generation = castore.dist.save(store, state, **kwargs)
        else:  # an async save, waited for here
            generation = castore.dist.save(store, state, blocking=False, **kwargs).result()
    except BaseException as exc:
        out = _error(exc, started)
    else:
        out = {"generation": generation, "seconds": time.monotonic() - started}
    out["latest"] = _latest(store, op["run"])
    return out


def _load(
    rank: int, world_size: int, store: Any, op: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    import castore.dist

    names = op.get("names", list(TENSORS))
    framework = op.get("framework", "torch")
    wrong = op.get("wrong_dtype", {}).get(rank)  # {rank: (name, dtype)}
    views = op.get("views", False)
    dtypes = dict([wrong]) if wrong else None
    targets = make_targets(rank, world_size, names, framework, dtypes, views)
    kwargs: dict[str, Any] = {
        "rank_local": _rank_local_option(op.get("rank_local", "same")),
        **options,
    }
    if "timeout" in op:
        kwargs["timeout"] = op["timeout"]
    if "fallback" in op:
        kwargs["fallback"] = op["fallback"]
    other = None
    if "path" in op:  # load from another store than the script's
        other = store = castore.open(op["path"])
    started = time.monotonic()
    try:
        result = castore.dist.load(
            store, op["run"], targets, op.get("generation", "latest"), **kwargs
        )
    except BaseException as exc:
        out = _error(exc, started)
    else:
        report = result.report
        out = {
            "seconds": time.monotonic() - started,
            "state": summarize(result.state),
            "same_objects": {
                name: get_path(result.state, name) is get_path(targets, name) for name in names
            },
            "report": {
                "generation": report.generation,
                "bytes_read": report.bytes_read,
                "bytes_needed": report.bytes_needed,
                "chunks_read": report.chunks_read,
                "timings": dict(report.timings),
                "bytes_by_source": dict(report.bytes_by_source),
                "skipped": [s.generation for s in report.skipped],
                "resharded": report.resharded,
            },
        }
    finally:
        if other is not None:
            other.close()
    out["unchanged"] = unchanged(targets, names)
    if views:
        out["pads_intact"] = {n: pads_intact(target_buffer(targets, n)) for n in names}
    out["boxes"] = {
        name: (box_of(name, rank, world_size)[0], to_numpy(target_buffer(targets, name)))
        for name in names
    }
    out["framework_kept"] = {
        name: type(target_buffer(targets, name)).__module__.split(".")[0] for name in names
    }
    return out


def run_script(
    rank: int, world_size: int, path: str | dict[str, Any], ops: list[dict[str, Any]]
) -> list[Any]:
    """Run ``ops`` in order on one store handle; one result per op (errors caught).

    Ops:

    * {"op": "save", run, seed, step, [framework, views, metadata, timeout, poison_rank,
      overlap_rank, gap_rank, extra_tensor_rank, blocking]}
    * {"op": "load", run, [generation, names, framework, views, rank_local, timeout, path,
      wrong_dtype]}
    * {"op": "recovery_points", run}: a tiered store's collective recovery_points
    * {"op": "step", [seconds]}: a tiered store's report_step; {"op": "promotions",
      [rank]}: wait for a tiered store's promotions (on that rank only, if one is named),
      and say what it sent from staging buffers
    * {"op": "arm", rank, point, action}, {"op": "disarm"}, {"op": "sleep", rank, seconds},
      {"op": "barrier"}

    A save or load may name a ``coordinator`` and a ``group`` (global ranks, sorted): ranks
    outside it skip the op; the ranks inside build their state or targets from their rank
    and size in the group.
    """
    import castore.support.faults

    results: list[Any] = []
    # ``path``: a store's path, or the keyword arguments of castore.open_tiered, where
    # "nodes" (fast directories, one per node) splits the ranks evenly over nodes.
    if isinstance(path, dict) and "nodes" in path:
        path = dict(path)
        nodes = path.pop("nodes")
        path["fast"] = nodes[rank * len(nodes) // world_size]
    opened = castore.open_tiered(**path) if isinstance(path, dict) else castore.open(path)
    with opened as store:
        for op in ops:
            kind = op["op"]
            if kind in ("save", "load"):
                options: dict[str, Any] = {}
                if "coordinator" in op:
                    options["coordinator"] = op["coordinator"]
                me, size = rank, world_size
                if "group" in op:  # a subgroup: these global ranks, in this order
                    import torch.distributed as dist

                    options["group"] = dist.new_group(op["group"])  # every rank calls it
                    if rank not in op["group"]:
                        results.append({"skipped": True})
                        continue
                    me, size = op["group"].index(rank), len(op["group"])
                run_op = _save if kind == "save" else _load
                results.append(run_op(me, size, store, op, options))
            elif kind == "recovery_points":  # a tiered store's RPO per tier, collectively
                results.append(store.recovery_points(op["run"], collective=True))
            elif kind == "arm":
                if rank == op["rank"]:
                    castore.support.faults.arm(op["point"], op["action"])
                results.append(None)
            elif kind == "disarm":
                castore.support.faults.disarm()
                results.append(None)
            elif kind == "barrier":  # all ranks of the default group
                import torch.distributed as dist

                dist.barrier()
                results.append(None)
            elif kind == "sleep":  # one rank stalls (alive, sockets open) for a while
                if rank == op["rank"]:
                    time.sleep(op["seconds"])
                results.append(None)
            elif kind == "step":  # the training loop reports a step (castore.tiers.staged)
                store.report_step(op.get("seconds"))
                results.append(None)
            elif kind == "promotions":  # wait for them (on "rank", if named); what was sent
                promoted = store.wait_promotions() if op.get("rank", rank) == rank else []
                copied = [p.copied.chunks_copied if p.copied else None for p in promoted]
                errors = [repr(p.error) for p in promoted if p.error]
                results.append({"staged": store.staged_sends, "fast_chunks": copied,
                                "errors": errors})  # fmt: skip
            else:
                raise ValueError(f"unknown op {kind!r}")
    return results
