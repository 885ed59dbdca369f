"""Prove a castore resume: an interrupted run against an uninterrupted one.

Three launches of real processes in a real gloo group (CPU, deterministic
algorithms), training a small model with dropout, AdamW, a linear warmup
scheduler, gradient accumulation over 2 microbatches, a GradScaler and a
NumPy Generator for input noise, fed by a ResumableDistributedSampler:

1. reference: ``--updates`` updates at ``--ranks`` ranks, uninterrupted;
2. interrupted: the same job saves at update ``--save-at`` (or, with
   ``--mid-accumulation``, after the first microbatch of the next update),
   trains on past the save, and is SIGKILLed;
3. resumed: fresh processes (``--resume-ranks`` of them) restore with
   ``--resume exact|continuation`` and train on.

It prints a receipt: the first resumed update's loss and batch ids next to the
reference's, then whether every loss, the final parameters, optimizer moments,
scheduler and scaler match bitwise. A continuation onto another rank count is
instead checked for using every sample of the epoch exactly once. The exit
status is 0 when the claim holds, 1 when it does not, 2 when the resume was
refused. ``--control weights-only`` restores only the weights (and the data
position): a broken control whose comparison must fail.

Through tiers (``--tiers F``): every launch opens ``castore.open_tiered`` with
``replicas=F``, one fast directory per simulated node of ``--ranks-per-node``
ranks (``STORE/fast0``, ``STORE/fast1``, ...) and a durable directory
(``STORE/durable``) that takes every ``--durable-every``-th generation. The
interrupted run saves at every update boundary up to the save point
(generation id = update), and at its last save waits for its promotions, so
that what the durable tier holds at the kill is settled; the receipt reads it
from the durable tier after the kill. ``--lose-node K`` then deletes node K's
fast directory: its ranks resume on an empty one, as on a replacement node.

What is claimed through tiers, and why parity alone is not the claim: every
generation the interrupted run saved lies on the uninterrupted run's path, so
a resume from any of them, however old, matches the reference bitwise if it
is exact. The tool therefore also checks *which* generation was restored: the
newest the live nodes hold whole, which is the last save when no node was
lost or when another node holds a copy of the lost node's shards (F >= 2;
then with not one byte from the durable tier), and otherwise (F = 1, a node
lost) the newest durable generation: the recovery point is then up to
``--durable-every`` updates old. A resume older than the last save redoes the
updates in between; those redone microbatches, the ones after them, and the
final parameters, optimizer moments, scheduler and scaler are compared with
the uninterrupted reference, never with the interrupted run (whose work past
the restored generation is lost, not a reference). The receipt prints the
generation restored, the last save and the durable tier's newest, the updates
redone, and each rank's bytes by source (local, peer, durable).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _ranks import run_child, start_workers, worker_env

ACCUMULATION = 2
MICROBATCH = 4  # examples per rank per microbatch
DATASET = 256
FEATURES = 16
CLASSES = 4
RUN = "parity"
KILL_WAIT = 120.0  # seconds a saved, interrupted rank waits to be killed


# -- the training job (runs in each rank's process) ------------------------------


def _job(config: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Build the model, data and optimizer of one rank, identically in every launch."""
    import numpy as np
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import castore.data
    import castore.train

    torch.manual_seed(1234)  # the same initial weights on every rank and launch
    inner = nn.Sequential(
        nn.Linear(FEATURES, 64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(64, CLASSES),
    )
    if config.get("model") == "fsdp2":
        # FSDP2: every Linear's parameters (and its AdamW moments) are DTensors
        # sharded by rows over the ranks (uneven: 4 rows of the last layer at 3 ranks).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in inner:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(inner, mesh=mesh)
    else:
        # DDP re-buckets gradients by their ready order after a process's first
        # iteration; a resumed process would start with the initial layout, and a
        # different layout sums the all-reduce in another order (ulp drift on 3+
        # ranks). find_unused_parameters=True keeps one layout for the whole run.
        model = DistributedDataParallel(inner, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    data = torch.Generator().manual_seed(99)
    inputs = torch.randn(DATASET, FEATURES, generator=data)
    labels = torch.randint(0, CLASSES, (DATASET,), generator=data)
    dataset = torch.utils.data.TensorDataset(torch.arange(DATASET), inputs, labels)
    sampler = castore.data.ResumableDistributedSampler(dataset, world, rank, seed=7)
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream
    noise = np.random.default_rng(500 + rank)
    state = castore.train.TrainState(
        model,
        optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=sampler,
        dataset_hash=castore.data.dataset_hash(range(DATASET)),
        accumulation_steps=ACCUMULATION,
        numpy_generators={"noise": noise},
    )
    # Its own generator: a DataLoader otherwise draws its base seed from the global
    # torch RNG each time an iterator starts, which a mid-epoch resume would shift.
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=MICROBATCH, sampler=sampler, generator=torch.Generator()
    )
    return {
        "model": model,
        "inner": inner,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "sampler": sampler,
        "noise": noise,
        "state": state,
        "loader": loader,
    }


def _final(job: dict[str, Any]) -> dict[str, Any]:
    """Bit patterns of everything the comparison covers."""
    import castore.train

    def bits(tensor: Any) -> str:
        return _whole(tensor).contiguous().numpy().tobytes().hex()

    params = {name: bits(p) for name, p in job["inner"].named_parameters()}
    optim = castore.train.optimizer_state_by_name(job["inner"], job["optimizer"])
    moments = {
        f"{name}/{key}": bits(value)
        if hasattr(value, "to_local") or hasattr(value, "numpy")
        else repr(value)
        for name, entry in optim["state"].items()
        for key, value in entry.items()
    }
    return {
        "params": params,
        "moments": moments,
        "scheduler": repr(sorted(job["scheduler"].state_dict().items())),
        "scaler": repr(sorted(job["scaler"].state_dict().items())),
    }


def _train(
    job: dict[str, Any],
    config: dict[str, Any],
    rank: int,
    *,
    until: int | None,
    store: Any = None,
    stop_at_epoch_end: bool = False,
) -> list[dict[str, Any]]:
    """Train to update ``until`` (or the end of the current epoch); one record per microbatch."""
    import contextlib

    import torch

    model, state, sampler = job["model"], job["state"], job["sampler"]
    optimizer, scheduler, scaler = job["optimizer"], job["scheduler"], job["scaler"]
    records: list[dict[str, Any]] = []
    epoch = sampler.epoch
    saved = False
    while True:
        sampler.set_epoch(epoch)
        for ids, x, y in job["loader"]:
            if until is not None and state.update >= until:
                return records
            if saved and any("loss" in r for r in records[records.index({"saved": True}) :]):
                time.sleep(KILL_WAIT)  # trained past the save: wait here to be SIGKILLed
                raise RuntimeError("the interrupted run was not killed")
            last = state.microbatch + 1 == ACCUMULATION
            x = x + torch.from_numpy(job["noise"].normal(0.0, 0.01, x.shape).astype("float32"))
            # FSDP2 reduce-scatters every microbatch: its sharded gradients accumulate
            # where TrainState sees them (a mid-accumulation save keeps them).
            no_sync = last or config.get("model") == "fsdp2"
            sync = contextlib.nullcontext() if no_sync else model.no_sync()
            with sync:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss / ACCUMULATION).backward()
            records.append(
                {
                    "update": state.update + 1,
                    "microbatch": state.microbatch,
                    "epoch": epoch,
                    "ids": ids.tolist(),
                    "loss": float(loss.item()).hex(),
                    "weights": _weights_digest(job["inner"]),
                    "at": time.time(),
                }
            )
            state.microbatch_done(len(ids))
            if state.microbatch == ACCUMULATION:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                state.update_done()
            if store is not None and _is_interim_save(state, config):
                state.save(store, run=RUN)
            if store is not None and _is_save_point(state, config):
                generation = state.save(store, run=RUN, mid_accumulation=config["mid_accumulation"])
                if config["tiers"]:
                    # What the durable tier holds at the kill is then known: the receipt
                    # reads it from the durable tier after the kill either way.
                    store.wait_promotions(timeout=config["timeout"])
                marker = {"update": state.update, "generation": generation.id}
                Path(config["workdir"], f"saved-{rank}").write_text(json.dumps(marker))
                store = None  # saved; train one more microbatch, then wait to be killed
                saved = True
                records.append({"saved": True})
        if stop_at_epoch_end:
            return records
        epoch += 1


def _whole(tensor: Any) -> Any:
    """A tensor's whole value, detached: a DTensor's gathered from every rank (a collective)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _weights_digest(model: Any) -> str:
    """A digest of the parameters' bytes when the microbatch ran (whole, under FSDP2)."""
    import blake3

    hasher = blake3.blake3()
    for param in model.parameters():
        hasher.update(_whole(param).numpy().tobytes())
    return hasher.hexdigest()[:16]


def _is_interim_save(state: Any, config: dict[str, Any]) -> bool:
    """Through tiers, every update boundary before the save point is saved too."""
    if not config["tiers"] or state.microbatch != 0:
        return False
    before = state.update < config["save_at"] or config["mid_accumulation"]
    return 1 <= state.update <= config["save_at"] and before


def _is_save_point(state: Any, config: dict[str, Any]) -> bool:
    if config["mid_accumulation"]:
        return state.update == config["save_at"] and state.microbatch == 1
    return state.update == config["save_at"] and state.microbatch == 0


def worker(config: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank of one launch (``phase`` is reference, interrupted or resume)."""
    import torch

    import castore
    import castore.train

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    job = _job(config, rank, world)
    phase = config["phase"]
    if phase == "reference":
        records = _train(job, config, rank, until=config["updates"])
        return {"records": records, "final": _final(job)}
    store = open_store(config, rank)
    if phase == "interrupted":
        try:
            _train(job, config, rank, until=None, store=store)
        except Exception:
            if Path(config["workdir"], f"saved-{rank}").exists():
                # Saved, then a peer's collective broke: the parent's SIGKILLs reach the
                # ranks one after another, and this one noticed a killed peer first.
                # Wait for its own kill, as a rank that trained past the save does.
                time.sleep(KILL_WAIT)
            raise
        raise RuntimeError("the interrupted run was not killed")
    # phase == "resume"
    started = float(os.environ["PARITY_STARTED"])
    resumed: dict[str, Any]
    if config["control"] == "weights-only":
        loaded = castore.train.load_weights(store, RUN, job["model"])
        order = loaded.generation.data_order
        job["sampler"].load_state_dict(castore.train.sampler_position(order))
        job["state"].update = order["update"]
        resumed = {
            "claim": "weights-only",
            "rng": "fresh",
            "partial_update": None,
            "notes": [],
            "generation": loaded.generation.id,
            "bytes_by_source": loaded.report.bytes_by_source if loaded.report else {},
        }
    else:
        result = job["state"].load(
            store, run=RUN, resume=config["resume"], fallback=config.get("fallback")
        )
        if config["control"] == "drop-partial-grads":
            for param in job["inner"].parameters():
                param.grad = None  # the broken control: forget the partial update
        resumed = {
            "claim": result.claim,
            "rng": result.rng,
            "partial_update": result.partial_update,
            "notes": result.notes,
            "generation": result.generation.id,
            "root": result.generation.root,
            "timings": result.report.timings if result.report else {},
            "bytes_by_source": result.report.bytes_by_source if result.report else {},
        }
    resumed["update"] = job["state"].update
    resumed["microbatch"] = job["state"].microbatch
    if config["resume"] == "continuation" and world != config["ranks"]:
        records = _train(job, config, rank, until=None, stop_at_epoch_end=True)
    else:
        records = _train(job, config, rank, until=config["updates"])
    store.close()
    first = next((r for r in records if "loss" in r), None)
    resumed["seconds_to_first_update"] = (
        first["at"] - started if first and "at" in first else time.time() - started
    )
    return {"records": records, "final": _final(job), "resumed": resumed}


def open_store(config: dict[str, Any], rank: int) -> Any:
    """The job's store: a castore store, or through tiers this rank's node's tiered store."""
    import castore

    if not config["tiers"]:
        return castore.open(config["store"], create=True)
    return castore.open_tiered(
        fast=fast_dir(config, rank // config["ranks_per_node"]),
        durable=durable_dir(config),
        durable_every=config["durable_every"],
        replicas=config["tiers"],
        promote_on_exit=False,
        uploader="thread",
    )


def fast_dir(config: dict[str, Any], node: int) -> Path:
    return Path(config["store"], f"fast{node}")


def durable_dir(config: dict[str, Any]) -> Path:
    return Path(config["store"], "durable")


# -- the parent: launch, kill, compare -------------------------------------------


def _launch(
    config: dict[str, Any],
    world: int,
    phase: str,
    kill_when_saved: bool = False,
    label: str | None = None,
) -> Any:
    workdir = Path(config["workdir"])
    env = worker_env("PARITY_STARTED", time.time())
    workers = start_workers(
        Path(__file__).resolve(), config, phase=phase, label=label or phase, world=world, env=env
    )
    markers = [workdir / f"saved-{rank}" for rank in range(world)]
    workers.wait(
        config["timeout"], stop=lambda: kill_when_saved and all(m.exists() for m in markers)
    )
    timed_out = not kill_when_saved and workers.running()
    workers.kill_remaining()  # the interruption, or a launch past its timeout
    if timed_out:
        raise SystemExit(
            f"{phase}: ranks still running after {config['timeout']:g}s: {_logs(workdir)}"
        )
    if kill_when_saved:
        killed = [p.returncode == -signal.SIGKILL for p in workers.procs]
        if not all(killed):
            raise SystemExit(f"interrupted run: not every rank was SIGKILLed ({_logs(workdir)})")
        return None
    results = workers.results()
    for rank, result in enumerate(results):
        if result is None:
            raise SystemExit(f"{workers.label} rank {rank} died without a result: {_logs(workdir)}")
    return results


def _logs(workdir: Path) -> str:
    tails = [
        f"{p.name}: {p.read_text(errors='replace')[-800:]}"
        for p in sorted(workdir.glob("*.log"))
        if p.stat().st_size
    ]
    return "\n".join(tails) or "no output"


def _by_update(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    grouped: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        if "loss" in record:
            grouped.setdefault(record["update"], []).append(record)
    return grouped


def make_config(
    workdir: str | Path,
    *,
    store: str | Path | None = None,
    ranks: int = 4,
    updates: int = 12,
    save_at: int = 5,
    mid_accumulation: bool = False,
    timeout: float = 300.0,
    tiers: int | None = None,
    ranks_per_node: int = 2,
    durable_every: int = 3,
    model: str = "ddp",
) -> dict[str, Any]:
    """The settings every launch of one comparison shares.

    ``tiers=F``: the job saves through ``castore.open_tiered`` with ``replicas=F``,
    one fast directory per node of ``ranks_per_node`` ranks (``STORE/fastK``) and a
    durable directory (``STORE/durable``) that takes every ``durable_every``-th
    generation. ``model``: ``"ddp"`` (DistributedDataParallel) or ``"fsdp2"``
    (``fully_shard``: DTensor parameters and moments).
    """
    if model not in ("ddp", "fsdp2"):
        raise ValueError(f"model must be 'ddp' or 'fsdp2', got {model!r}")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    return {
        "workdir": str(workdir),
        "store": str(store if store is not None else Path(workdir, "store")),
        "ranks": ranks,
        "updates": updates,
        "save_at": save_at,
        "mid_accumulation": mid_accumulation,
        "resume": "exact",
        "control": None,
        "timeout": timeout,
        "tiers": tiers,
        "ranks_per_node": ranks_per_node,
        "durable_every": durable_every,
        "model": model,
    }


def run_reference(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The uninterrupted run: every rank's records and final state."""
    results = _launch(config, config["ranks"], "reference")
    _raise_errors("reference", results)
    return results  # type: ignore[no-any-return]


def run_interrupted(config: dict[str, Any]) -> dict[str, Any]:
    """Train, save at the save point, train on, and SIGKILL every rank.

    Returns what the run left: the generation and update of its last save and,
    through tiers, the newest generation the durable tier holds after the kill
    (``durable_generation``/``durable_update``, None when it holds none).
    """
    if config["tiers"]:
        import castore

        castore.open(durable_dir(config), shared=True).close()  # a directory nodes share
    _launch(config, config["ranks"], "interrupted", kill_when_saved=True)
    marker = json.loads(Path(config["workdir"], "saved-0").read_text())
    left = {"last_generation": marker["generation"], "last_update": marker["update"]}
    if config["tiers"]:
        left.update(durable_newest(config))
    return left


def durable_newest(config: dict[str, Any]) -> dict[str, Any]:
    """The newest generation of the run in the durable tier (its id and update)."""
    import castore

    with castore.open(durable_dir(config), create=False) as durable:
        if RUN not in durable.runs():
            return {"durable_generation": None, "durable_update": None}
        newest = durable.resolve(RUN)
    return {"durable_generation": newest.id, "durable_update": newest.data_order["update"]}


def lose_node(config: dict[str, Any], node: int) -> None:
    """Node ``node`` is lost: its fast directory is deleted (its ranks come back on an
    empty one, as on a replacement node)."""
    shutil.rmtree(fast_dir(config, node))


def run_resume(
    config: dict[str, Any],
    *,
    ranks: int | None = None,
    resume: str = "exact",
    control: str | None = None,
    label: str = "resume",
    fallback: str | None = None,
) -> list[dict[str, Any]]:
    """Fresh processes restore from the interrupted run's store and train on
    (``fallback``: TrainState.load's)."""
    settings = {**config, "resume": resume, "control": control, "fallback": fallback}
    return _launch(settings, ranks or config["ranks"], "resume", label=label)  # type: ignore[no-any-return]


def judge(
    config: dict[str, Any],
    reference: list[dict[str, Any]],
    resumed: list[dict[str, Any]],
    *,
    resume: str = "exact",
    interrupted: dict[str, Any] | None = None,
    lost_node: int | None = None,
) -> dict[str, Any]:
    """The receipt's verdict: bitwise parity, or epoch coverage for a continuation.

    Through tiers (``interrupted``: what :func:`run_interrupted` returned) it also
    holds only if the restored generation is the one the tiers promise
    (:func:`_tier_verdict`).
    """
    refused = [r["error"] for r in resumed if "error" in r]
    if refused:
        return {"refused": refused[0], "holds": False}
    info = resumed[0]["ok"]["resumed"]
    verdict: dict[str, Any] = {"resumed": info}
    if resume == "continuation" and len(resumed) != config["ranks"]:
        verdict.update(_coverage(reference, resumed, info))
    else:
        verdict.update(_compare(reference, resumed, info))
    if config["tiers"] and interrupted is not None:
        tiers = _tier_verdict(config, resumed, interrupted, lost_node)
        verdict["tiers"] = tiers
        verdict["holds"] = verdict["holds"] and tiers["holds"]
    return verdict


def _tier_verdict(
    config: dict[str, Any],
    resumed: list[dict[str, Any]],
    interrupted: dict[str, Any],
    lost_node: int | None,
) -> dict[str, Any]:
    """Which generation the tiers must restore, and from where.

    Every generation the interrupted run saved lies on the reference's path, so
    bitwise parity holds whichever one is restored: parity alone cannot tell a
    resume that fell back further than it had to. The tiers promise the newest
    generation the live nodes hold whole: the last save when no node was lost or
    another node holds a copy of the lost one's shards (``replicas`` >= 2; then
    not a byte from the durable tier), else the newest durable generation.
    """
    info = [r["ok"]["resumed"] for r in resumed]
    from_fast = lost_node is None or config["tiers"] >= 2
    expected = interrupted["last_generation" if from_fast else "durable_generation"]
    sources = [i.get("bytes_by_source", {}) for i in info]
    durable_bytes = sum(s.get("durable", 0) for s in sources)
    restored = {i["generation"] for i in info}
    holds = restored == {expected} and (not from_fast or durable_bytes == 0)
    return {
        "replicas": config["tiers"],
        "lost_node": lost_node,
        "expected_generation": expected,
        "expected_source": "fast tiers" if from_fast else "durable tier",
        "restored_generation": sorted(restored),
        "restored_update": info[0]["update"],
        "last_saved": [interrupted["last_generation"], interrupted["last_update"]],
        "durable_newest": [interrupted["durable_generation"], interrupted["durable_update"]],
        "updates_redone": interrupted["last_update"] - info[0]["update"],
        "bytes_by_source": sources,
        "holds": holds,
    }


def run_parity(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three launches and compare; returns the receipt as a dict."""
    resume_ranks = args.resume_ranks or args.ranks
    config = make_config(
        args.workdir or tempfile.mkdtemp(prefix="castore-parity-"),
        store=args.store,
        ranks=args.ranks,
        updates=args.updates,
        save_at=args.save_at,
        mid_accumulation=args.mid_accumulation,
        timeout=args.timeout,
        tiers=args.tiers,
        ranks_per_node=args.ranks_per_node,
        durable_every=args.durable_every,
        model=args.model,
    )
    receipt: dict[str, Any] = {
        "config": {
            **config,
            "resume": args.resume,
            "control": args.control,
            "resume_ranks": resume_ranks,
            "lose_node": args.lose_node,
        }
    }
    clock = time.perf_counter()
    reference = run_reference(config)
    receipt["reference_seconds"] = time.perf_counter() - clock
    clock = time.perf_counter()
    interrupted = run_interrupted(config)
    receipt["interrupted_seconds"] = time.perf_counter() - clock
    if args.lose_node is not None:
        lose_node(config, args.lose_node)
    clock = time.perf_counter()
    resumed = run_resume(config, ranks=resume_ranks, resume=args.resume, control=args.control)
    receipt["resume_seconds"] = time.perf_counter() - clock
    receipt.update(
        judge(
            config,
            reference,
            resumed,
            resume=args.resume,
            interrupted=interrupted,
            lost_node=args.lose_node,
        )
    )
    return receipt


def _raise_errors(phase: str, results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        if "error" in result:
            error = result["error"]
            raise SystemExit(f"{phase} rank {rank} failed: {error['type']}: {error['message']}")


def _compare(
    reference: list[dict[str, Any]], resumed: list[dict[str, Any]], info: dict[str, Any]
) -> dict[str, Any]:
    """Every resumed microbatch against the reference's, rank by rank, bitwise."""
    first_update = info["update"] + 1
    rows = []
    all_equal = True
    compared = 0
    for rank, (ref, new) in enumerate(zip(reference, resumed, strict=True)):
        ref_updates = _by_update(ref["ok"]["records"])
        new_updates = _by_update(new["ok"]["records"])
        for update, new_records in new_updates.items():
            ref_records = ref_updates.get(update, [])
            # A mid-accumulation resume starts inside the update: compare those microbatches.
            ref_records = [
                r for r in ref_records if r["microbatch"] >= new_records[0]["microbatch"]
            ]
            same = [_seen(r) for r in ref_records] == [_seen(r) for r in new_records]
            compared += len(new_records)
            all_equal &= same
            if update == first_update:
                rows.append(
                    {
                        "rank": rank,
                        "update": update,
                        "reference_ids": [r["ids"] for r in ref_records],
                        "resumed_ids": [r["ids"] for r in new_records],
                        "reference_loss": [float.fromhex(r["loss"]) for r in ref_records],
                        "resumed_loss": [float.fromhex(r["loss"]) for r in new_records],
                        "bitwise": same,
                    }
                )
    ref_final, new_final = reference[0]["ok"]["final"], resumed[0]["ok"]["final"]
    finals = {key: ref_final[key] == new_final[key] for key in ref_final}
    holds = all_equal and compared > 0 and all(finals.values())
    return {
        "mode": "bitwise",
        "first_update": rows,
        "microbatches_compared": compared,
        "losses_equal": all_equal,
        "final_equal": finals,
        "holds": holds,
    }


def _seen(record: dict[str, Any]) -> tuple[Any, ...]:
    """What one microbatch saw and produced: sample ids, weights digest, loss bits."""
    return (record["ids"], record["weights"], record["loss"])


def _coverage(
    reference: list[dict[str, Any]], resumed: list[dict[str, Any]], info: dict[str, Any]
) -> dict[str, Any]:
    """Continuation onto another rank count: the saved epoch uses every sample once."""
    saved_update = info["update"]
    after_records = [r for new in resumed for r in new["ok"]["records"] if "loss" in r]
    epoch = after_records[0]["epoch"] if after_records else None
    before_ids = [
        i
        for ref in reference
        for r in ref["ok"]["records"]
        if "loss" in r and r["update"] <= saved_update and r["epoch"] == epoch
        for i in r["ids"]
    ]
    after_ids = [i for r in after_records for i in r["ids"]]
    counts = Counter(before_ids + after_ids)
    missing = sorted(set(range(DATASET)) - set(counts))
    repeated = sorted(i for i, n in counts.items() if n > 1)
    return {
        "mode": "coverage",
        "epoch": epoch,
        "consumed_before_save": len(before_ids),
        "consumed_after_resume": len(after_ids),
        "missing": missing,
        "repeated": repeated,
        "holds": not missing and not repeated and len(before_ids) + len(after_ids) == DATASET,
    }


def print_receipt(receipt: dict[str, Any]) -> None:
    from tabulate import tabulate

    config = receipt["config"]
    where = "mid-accumulation (after microbatch 1)" if config["mid_accumulation"] else "boundary"
    print(
        f"resume parity: {config['ranks']} ranks, save at update {config['save_at']} "
        f"({where}), resume {config['resume']} onto {config['resume_ranks']} ranks"
        + (f", control {config['control']}" if config["control"] else "")
    )
    if "refused" in receipt:
        error = receipt["refused"]
        print(f"resume refused: {error['type']}: {error['message']}")
        return
    info = receipt["resumed"]
    print(
        f"claim {info['claim']}, rng {info['rng']}, partial update {info['partial_update']}, "
        f"resumed after update {info['update']} at microbatch {info['microbatch']}"
    )
    for note in info.get("notes", []):
        print(f"  note: {note}")
    if "tiers" in receipt:
        _print_tiers(config, receipt["tiers"])
    if info.get("timings"):
        phases = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in info["timings"].items())
        print(f"restore phases on rank 0: {phases}")
    if receipt["mode"] == "coverage":
        print(
            f"epoch {receipt['epoch']}: {receipt['consumed_before_save']} samples before the "
            f"save + {receipt['consumed_after_resume']} after the resume; missing "
            f"{receipt['missing'][:10]}, repeated {receipt['repeated'][:10]}"
        )
    else:
        rows = [
            [
                r["rank"],
                r["update"],
                r["reference_ids"],
                r["resumed_ids"],
                " ".join(f"{v:.9g}" for v in r["reference_loss"]),
                " ".join(f"{v:.9g}" for v in r["resumed_loss"]),
                "yes" if r["bitwise"] else "NO",
            ]
            for r in receipt["first_update"]
        ]
        print("first resumed update, per rank:")
        print(
            tabulate(
                rows,
                headers=[
                    "rank",
                    "update",
                    "reference ids",
                    "resumed ids",
                    "reference loss",
                    "resumed loss",
                    "bitwise",
                ],
            )
        )
        print(
            f"{receipt['microbatches_compared']} resumed microbatches, sample ids, weights "
            f"and losses bitwise equal: {'yes' if receipt['losses_equal'] else 'NO'}"
        )
        for key, same in receipt["final_equal"].items():
            print(f"final {key}: {'bitwise equal' if same else 'DIFFERENT'}")
    print(
        f"time: reference {receipt['reference_seconds']:.1f}s, interrupted "
        f"{receipt['interrupted_seconds']:.1f}s, resume {receipt['resume_seconds']:.1f}s "
        f"(process start to first resumed update: {info['seconds_to_first_update']:.1f}s)"
    )
    print("RESULT:", "HOLDS" if receipt["holds"] else "DOES NOT HOLD")


def _print_tiers(config: dict[str, Any], tiers: dict[str, Any]) -> None:
    from tabulate import tabulate

    nodes = config["ranks"] // config["ranks_per_node"]
    lost = "no node lost" if tiers["lost_node"] is None else f"node {tiers['lost_node']} lost"
    print(
        f"tiers: replicas={tiers['replicas']}, {nodes} nodes of {config['ranks_per_node']} "
        f"ranks, durable every {config['durable_every']} generations; {lost} after the kill"
    )
    (last, last_update), (durable, durable_update) = tiers["last_saved"], tiers["durable_newest"]
    print(
        f"the interrupted run's last save: generation {last} (update {last_update}); the "
        f"durable tier's newest: generation {durable} (update {durable_update})"
    )
    restored = tiers["restored_generation"]
    right = restored == [tiers["expected_generation"]]
    print(
        f"restored generation {', '.join(map(str, restored))} (update "
        f"{tiers['restored_update']}); expected the newest in the {tiers['expected_source']}, "
        f"generation {tiers['expected_generation']}: {'yes' if right else 'NO'}; "
        f"{tiers['updates_redone']} update(s) redone"
    )
    rows = [
        [rank, *(f"{by.get(k, 0) / 1024:.1f} KiB" for k in ("fast", "peer", "durable"))]
        for rank, by in enumerate(tiers["bytes_by_source"])
    ]
    print(tabulate(rows, headers=["rank", "fast", "peer", "durable"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="world size of the saved run")
    parser.add_argument("--updates", type=int, default=12, help="updates of the whole run")
    parser.add_argument("--save-at", type=int, default=5, help="update after which to save")
    parser.add_argument(
        "--mid-accumulation",
        action="store_true",
        help="save after the first microbatch of the next update",
    )
    parser.add_argument("--resume", choices=["exact", "continuation"], default="exact")
    parser.add_argument(
        "--resume-ranks",
        type=int,
        default=None,
        help="world size of the resumed run (default: --ranks)",
    )
    parser.add_argument(
        "--control",
        choices=["weights-only", "drop-partial-grads"],
        default=None,
        help="a broken control: restore only the weights and data position, or drop "
        "the partial gradients of a mid-accumulation save",
    )
    parser.add_argument(
        "--tiers",
        type=int,
        default=None,
        metavar="F",
        help="save through castore.open_tiered with replicas=F: a fast directory per node "
        "and a durable directory (in --store)",
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=2, help="ranks per simulated node (--tiers)"
    )
    parser.add_argument(
        "--durable-every",
        type=int,
        default=3,
        help="every Nth generation goes to the durable tier (--tiers)",
    )
    parser.add_argument(
        "--lose-node",
        type=int,
        default=None,
        metavar="K",
        help="delete node K's fast directory after the kill, before the resume (--tiers)",
    )
    parser.add_argument(
        "--model",
        choices=["ddp", "fsdp2"],
        default="ddp",
        help="the model's parallelism: DistributedDataParallel, or FSDP2 (fully_shard)",
    )
    parser.add_argument("--workdir", default=None, help="keep launches' files here")
    parser.add_argument("--store", default=None, help="castore store (default: in workdir)")
    parser.add_argument("--json", default=None, help="also write the receipt here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    args = parser.parse_args(argv)
    if args.save_at < 1 or args.save_at >= args.updates:
        parser.error("--save-at must lie in [1, --updates)")
    if args.ranks < 1 or (args.resume_ranks is not None and args.resume_ranks < 1):
        parser.error("rank counts must be positive")
    if args.tiers is None and args.lose_node is not None:
        parser.error("--lose-node needs --tiers")
    if args.tiers is not None:
        if args.tiers < 1 or args.ranks_per_node < 1 or args.durable_every < 1:
            parser.error("--tiers, --ranks-per-node and --durable-every must be positive")
        if args.ranks % args.ranks_per_node:
            parser.error("--ranks must be a multiple of --ranks-per-node")
        nodes = args.ranks // args.ranks_per_node
        if args.lose_node is not None and not 0 <= args.lose_node < nodes:
            parser.error(f"--lose-node must name one of the {nodes} nodes (0 to {nodes - 1})")
        if args.resume_ranks not in (None, args.ranks):
            parser.error("--tiers resumes at the saved rank count")
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return run_child(Path(sys.argv[2]), int(sys.argv[3]), worker)
    args = parse_args(argv)
    keep = args.workdir is not None
    receipt = run_parity(args)
    print_receipt(receipt)
    if args.json:
        Path(args.json).write_text(json.dumps(receipt, indent=1, default=str))
    if not keep:
        shutil.rmtree(receipt["config"]["workdir"], ignore_errors=True)
    if "refused" in receipt:
        return 2
    return 0 if receipt["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
