"""Tiers on two nodes, and one of them lost: `make demo-tiers`.

Four ranks (real processes, gloo) on two simulated nodes (ranks 0-1 and 2-3:
a node is the ranks that open the same fast directory) train the demo's model
with DDP and AdamW and save a ZeRO-style sharded state every step through
``castore.open_tiered``: each node's fast tier holds its own ranks' shards
(with ``replicas=2`` the other node's too) and every root; every third
generation is also uploaded to the durable directory. Then node 1 is lost (its
fast directory deleted) and four fresh ranks resume, node 1's on an empty
directory as on a replacement node. Each rank restores its own blocks of the
newest generation the live nodes hold whole, checks them bit for bit against
what it saved at that step, and the job trains on.

With ``replicas=2`` the newest save comes back, node 1's shards from node 0's
copies ("peer"), not a byte from the durable tier. With ``replicas=1`` no live
node holds node 1's shards of the newest saves: the job resumes from the
newest durable generation and redoes the steps after it (the recovery point
is the durable cadence). Everything lives in ./demo-tiers (``--dir``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_child, start_workers, worker_env  # noqa: E402
from demo import VOCAB, build_model  # noqa: E402  (the model of `make demo`)
from demo_dist import block, rows_of, sharded_state  # noqa: E402  (its sharded state)

import castore  # noqa: E402
import castore.dist  # noqa: E402
from castore.core.holdings import held_shards  # noqa: E402
from castore.errors import CastoreWarning  # noqa: E402
from castore.format.hashing import Digest  # noqa: E402

RUN = "tiers-demo"
RANKS = 4
RANKS_PER_NODE = 2
NODES = RANKS // RANKS_PER_NODE
LOST = 1  # the node that is lost
MARKER = ".castore-demo-tiers"  # the directory is this demo's: it may be wiped


# -- the ranks --------------------------------------------------------------------


def open_node_store(config: dict[str, Any], rank: int) -> Any:
    """This rank's node's tiered store: its node's fast directory, the shared durable one."""
    root = Path(config["root"])
    return castore.open_tiered(
        fast=root / f"node{rank // RANKS_PER_NODE}",
        durable=root / "durable",
        durable_every=config["durable_every"],
        replicas=config["replicas"],
        promote_on_exit=False,
        uploader="thread",
    )


def blocks_digest(state: dict[str, Any]) -> str:
    """A digest of every tensor block of one rank's sharded state, in name order."""
    hasher = blake3.blake3()
    moments = state["optimizer"]["state"]
    shards = [state["model"][k] for k in sorted(state["model"])] + [
        moments[k][m] for k in sorted(moments) for m in ("exp_avg", "exp_avg_sq")
    ]
    for shard in shards:
        hasher.update(shard.local.contiguous().numpy().tobytes())
    return hasher.hexdigest()


def block_targets(model: nn.Module, rank: int, world: int) -> dict[str, Any]:
    """Empty blocks for this rank's rows of every parameter and of its AdamW moments."""

    def empty(tensor: torch.Tensor) -> castore.Shard:
        return block(torch.full_like(tensor, float("nan")), rank, world)

    moments = {
        name: {"exp_avg": empty(p), "exp_avg_sq": empty(p)}
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model_blocks = {name: empty(t) for name, t in model.state_dict().items()}
    return {"model": model_blocks, "optimizer": {"state": moments}}


def gather_rows(shard: castore.Shard, world: int) -> torch.Tensor:
    """The whole tensor from every rank's block of rows (all ranks call it)."""
    shape = tuple(shard.global_shape)
    most = max(rows_of(shape[0], r, world)[1] for r in range(world))
    padded = torch.zeros((most, *shape[1:]), dtype=shard.local.dtype)
    padded[: shard.local.shape[0]] = shard.local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: rows_of(shape[0], r, world)[1]] for r, p in enumerate(parts)])


def install(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The restored blocks, gathered whole, into the model, AdamW and this rank's RNG."""
    world = dist.get_world_size()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(gather_rows(state["model"][name], world))
    params = dict(model.named_parameters())
    for name, saved in state["optimizer"]["state"].items():
        optimizer.state[params[name]] = {
            "step": torch.tensor(saved["step"]),
            "exp_avg": gather_rows(saved["exp_avg"], world),
            "exp_avg_sq": gather_rows(saved["exp_avg_sq"], world),
        }
    torch.set_rng_state(state["rng"]["torch"])


def resume(store: Any, model: nn.Module, optimizer: Any, rank: int, world: int) -> dict[str, Any]:
    """Restore this rank's blocks of the newest generation the live nodes hold whole."""
    dist.barrier()
    started = time.perf_counter()
    loaded = castore.dist.load(store, RUN, block_targets(model, rank, world))
    seconds = time.perf_counter() - started
    state = loaded.state
    row = {
        "generation": loaded.report.generation.id,
        "step": int(state["step"]),
        "sources": loaded.report.bytes_by_source,
        "seconds": seconds,
        "digest": blocks_digest(state),
    }
    install(state, model, optimizer)
    return row


def train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    tokens = torch.randint(0, VOCAB, (16, 16))
    loss = nn.functional.cross_entropy(ddp(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


def worker(config: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank: train ``steps`` steps (after a resume, with ``resume``), saving each."""
    torch.manual_seed(1234 + rank)
    ddp = nn.parallel.DistributedDataParallel(build_model())
    model = ddp.module
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    row: dict[str, Any] = {"rank": rank, "digests": {}, "steps": [], "warnings": []}
    with open_node_store(config, rank) as store, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", CastoreWarning)
        first = 1
        if config["resume"]:
            row.update(resume(store, model, optimizer, rank, world))
            first = row["step"] + 1
        for step in range(first, first + config["steps"]):
            loss = train_step(ddp, optimizer)
            state = sharded_state(model, optimizer, step, rank, world)
            gen = castore.dist.save(store, state, run=RUN, step=step)
            row["digests"][str(step)] = blocks_digest(state)
            durable = store.selects_for_durable(RUN, gen.id)
            row["steps"].append([step, loss, gen.id, gen.stats.new_bytes, durable])
        # The job stops once its uploads are done; a node lost during one leaves the
        # durable tier at the generation before, which the restore then takes.
        store.wait_promotions(timeout=300)
        row["warnings"] = [f"{w.category.__name__}: {w.message}" for w in said]
    return row


# -- the parent -------------------------------------------------------------------


def launch(config: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Start the ranks (forked from a zygote that imported torch once); their results."""
    workers = start_workers(
        Path(__file__).resolve(),
        config,
        phase=label,
        label=label,
        world=RANKS,
        env=worker_env("DEMO_TIERS_STARTED", time.time()),
    )
    workers.wait(600)
    if workers.kill_remaining():
        raise SystemExit(f"demo-tiers: {label}: ranks still running after 600s")
    results = workers.results()
    for rank, result in enumerate(results):
        if result is None or "error" in result:
            error = "no result" if result is None else result["error"]["message"]
            tails = workers.log_tails(800)
            raise SystemExit(f"demo-tiers: {label}: rank {rank} failed: {error}\n{tails}")
    return [r["ok"] for r in results if r is not None]


def show_steps(rows: list[dict[str, Any]]) -> None:
    table = [
        [
            step,
            f"{loss:.4f}",
            gen,
            f"{new / 2**20:.1f} MiB",
            "uploaded" if durable else "-",
        ]
        for step, loss, gen, new, durable in rows[0]["steps"]
    ]
    print(tabulate(table, headers=["step", "loss", "gen", "new in fast tiers", "durable"]))
    for said in dict.fromkeys(w for r in rows for w in r["warnings"]):
        print(f"  castore warned: {said}")


def holdings(root: Path) -> list[list[Any]]:
    """Per generation: the shards each node's fast tier holds, and the durable tier's copy."""
    cells: dict[int, list[Any]] = {}
    for node in range(NODES):
        with castore.open(root / f"node{node}", create=False) as fast:
            for gen in fast.generations(RUN):
                held = held_shards(root / f"node{node}", RUN, gen.id, Digest.from_hex(gen.root))
                shards = "all" if held is None else " ".join(map(str, sorted(held))) or "none"
                cells.setdefault(gen.id, [gen.id, gen.step] + ["-"] * (NODES + 1))[2 + node] = (
                    f"shards {shards}"
                )
    with castore.open(root / "durable", create=False) as durable:
        for gen in durable.generations(RUN):
            cells.setdefault(gen.id, [gen.id, gen.step] + ["-"] * (NODES + 1))[-1] = "yes"
    return [cells[k] for k in sorted(cells)]


def show_holdings(root: Path, title: str) -> None:
    print(f"\n{title}")
    headers = ["gen", "step", *(f"node {n} fast tier" for n in range(NODES)), "durable"]
    print(tabulate(holdings(root), headers=headers))


def scenario(root: Path, replicas: int, args: argparse.Namespace) -> bool:
    """One run of the story with ``replicas``; whether its checks held."""
    config = {
        "root": str(root),
        "workdir": str(root / "launches"),
        "replicas": replicas,
        "durable_every": args.durable_every,
        "steps": args.steps,
        "resume": False,
    }
    castore.open(root / "durable", shared=True).close()  # a directory the nodes share
    (root / "launches").mkdir()
    print(
        f"\n== replicas={replicas}: {RANKS} ranks on {NODES} nodes train and save every step; "
        f"one generation in {args.durable_every} also goes to the durable tier =="
    )
    saved = launch(config, "train")
    show_steps(saved)
    show_holdings(root, "where each generation is (fast tiers keep the last 2):")
    with castore.open(root / "durable", create=False) as durable:
        newest_durable = durable.resolve(RUN)
    print(f"\n== node {LOST} is lost: {root / f'node{LOST}'} is deleted ==")
    shutil.rmtree(root / f"node{LOST}")
    print(
        f"== {RANKS} fresh ranks resume (node {LOST}'s on an empty fast directory) and train "
        f"on for {args.more_steps} step(s) =="
    )
    resumed = launch({**config, "steps": args.more_steps, "resume": True}, "resume")
    rows = []
    checks = []
    for before, after in zip(saved, resumed, strict=True):
        same = before["digests"].get(str(after["step"])) == after["digest"]
        checks.append(same)
        by = after["sources"]
        rows.append(
            [
                after["rank"],
                after["rank"] // RANKS_PER_NODE,
                after["generation"],
                after["step"],
                *(f"{by.get(k, 0) / 2**20:.2f} MiB" for k in ("fast", "peer", "durable")),
                f"{after['seconds']:.2f}s",
                "bitwise equal" if same else "DIFFERENT",
            ]
        )
    headers = ["rank", "node", "gen", "step", "fast", "peer", "durable", "restore", "blocks"]
    print(tabulate(rows, headers=headers))
    show_steps(resumed)
    return verdict(saved, resumed, replicas, newest_durable) and all(checks)


def verdict(
    saved: list[dict[str, Any]], resumed: list[dict[str, Any]], replicas: int, durable: Any
) -> bool:
    """Say which generation came back and why; whether it is the one the tiers promise."""
    last = max(int(step) for step in saved[0]["digests"])
    restored = {r["generation"] for r in resumed}
    step = resumed[0]["step"]
    from_durable = sum(r["sources"].get("durable", 0) for r in resumed)
    if replicas >= 2:
        ok = restored == {last} and from_durable == 0
        print(
            f"restored generation {last} (step {step}), the newest save: node {LOST}'s shards "
            f"came from node 0's copies, {from_durable} bytes from the durable tier"
        )
    else:
        # The redone steps start from the restored state, RNG streams included: the same
        # batches and losses as the lost job's.
        before = {row[0]: row[1] for row in saved[0]["steps"]}
        redone = [row for row in resumed[0]["steps"] if row[0] in before]
        same = bool(redone) and all(loss == before[step] for step, loss, *_ in redone)
        ok = restored == {durable.id} and same
        print(
            f"restored generation {durable.id} (step {step}), the newest in the durable tier: "
            f"no live node held node {LOST}'s shards of the generations after it; "
            f"{_steps(step + 1, last)} redone, losses bitwise the lost job's: "
            f"{'yes' if same else 'NO'}"
        )
    if not ok:
        print(f"FAILED: expected generation {last if replicas >= 2 else durable.id}")
    return ok


def _steps(first: int, last: int) -> str:
    return f"step {first} was" if first == last else f"steps {first}-{last} were"


def prepare(path: Path) -> bool:
    """An empty ./demo-tiers; an existing one only if this demo made it."""
    if path.exists():
        if not (path / MARKER).is_file():
            print(f"demo-tiers: {path} exists and is not this demo's; not touching it")
            return False
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MARKER).write_text("made by tools/demo_tiers.py; `make demo-tiers` wipes it\n")
    return True


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return run_child(Path(sys.argv[2]), int(sys.argv[3]), worker)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="./demo-tiers", help="where the stores go (wiped)")
    parser.add_argument("--steps", type=int, default=5, help="steps before the node is lost")
    parser.add_argument("--more-steps", type=int, default=2, help="steps after the resume")
    parser.add_argument("--durable-every", type=int, default=3, help="the durable cadence")
    args = parser.parse_args(argv)
    base = Path(args.dir).resolve()
    if not prepare(base):
        return 1
    started = time.perf_counter()
    held = [scenario(base / f"replicas{f}", f, args) for f in (2, 1)]
    print(
        f"\n{'all checks held' if all(held) else 'FAILED'} ({time.perf_counter() - started:.0f}s)"
    )
    return 0 if all(held) else 1


if __name__ == "__main__":
    sys.exit(main())
