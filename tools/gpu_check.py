"""castore with CUDA tensors: the paths no CPU test reaches, in one short run.

    .venv/bin/python tools/gpu_check.py [--keep DIR] [--no-dist]

Checks, each in its own try so one failure hides none of the others:

- async saves of CUDA tensors (``staging="full"`` and ``"changed"``): pinned
  staging buffers, non-blocking copies and the event the writer waits on
  (``castore.core.staging``, ``piece.ready.synchronize()`` in
  ``castore.core.background``); every tensor is changed on the GPU right after
  ``save`` returns, and what loads back must equal, bit for bit, the values
  at the call;
- a blocking save of CUDA tensors (float32, float16, bfloat16, int64) loaded
  with ``framework="torch"``, and restored by ``castore.dist.load`` into CUDA
  target tensors (device and bits checked);
- ``TrainState`` of a CUDA model: the CUDA RNG streams after a load draw what
  they drew after the save, and the parameters come back on the GPU;
- two ranks (gloo; castore's own collectives carry only metadata, so CUDA
  tensors on one GPU work): a blocking and an async ``castore.dist.save`` of
  row-sharded CUDA tensors, restored into CUDA ``Shard`` targets.

Prints one table row per check (name, ok/FAIL, seconds, detail) and exits 1
if any failed. Without CUDA it prints one line and exits 0. Meant to finish
in well under three minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

import castore
import castore.dist
from castore.train import TrainState

SKIP_LINE = "gpu_check: no CUDA device (torch.cuda.is_available() is False): skipped"
CHUNK = 256 << 10  # above hashpool.INLINE_BYTES: hashing runs on castore's shared pool
DIST_TIMEOUT_S = 150.0
# "cpu" only with --rehearse-on-cpu: the checks' own logic, run where there is no GPU.
DEVICE = "cuda"


@dataclass
class Row:
    name: str
    ok: bool
    seconds: float
    detail: str


def run_check(rows: list[Row], name: str, check: Callable[[], str]) -> None:
    started = time.perf_counter()
    try:
        detail, ok = check(), True
    except Exception as exc:  # noqa: BLE001 - a failed check is a row, not the end
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        detail = f"{type(exc).__name__}: {exc} ({Path(frame.filename).name}:{frame.lineno})"
        ok = False
    rows.append(Row(name, ok, time.perf_counter() - started, " ".join(detail.split())))


def print_table(rows: list[Row]) -> None:
    width = max(len(row.name) for row in rows)
    print(f"{'check':<{width}}  result  seconds  detail")
    for row in rows:
        result = "ok" if row.ok else "FAIL"
        print(f"{row.name:<{width}}  {result:<6}  {row.seconds:7.2f}  {row.detail}")


# -- comparing tensors bit for bit ---------------------------------------------------


def host_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` copied to the host, once the GPU has caught up."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if actual.dtype != expected.dtype or tuple(actual.shape) != tuple(expected.shape):
        return False
    left = actual.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    right = expected.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(left, right)


def require_same(loaded: dict[str, Any], expected: dict[str, torch.Tensor], what: str) -> None:
    if list(loaded) != list(expected):
        raise AssertionError(f"{what}: keys {list(loaded)}, expected {list(expected)}")
    for name, tensor in expected.items():
        if not same_bits(loaded[name], tensor):
            raise AssertionError(f"{what}: {name} differs from the value at the save call")


def cuda_state(seed: int) -> dict[str, torch.Tensor]:
    """A few MiB on the GPU, in several dtypes, one tensor on the host."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, device=DEVICE, generator=generator),
        "h": torch.randn(512, 512, device=DEVICE, generator=generator).half(),
        "bf": torch.randn(300, 77, device=DEVICE, generator=generator).bfloat16(),
        "ids": torch.randint(0, 1 << 40, (4096,), device=DEVICE, generator=generator),
        "cpu": torch.arange(1000, dtype=torch.int64) * seed,
    }


def mutate(state: dict[str, torch.Tensor]) -> None:
    """Queued on the GPU right behind the staging copies: the save must not see it."""
    for tensor in state.values():
        tensor.mul_(-3).add_(1)


# -- the checks ----------------------------------------------------------------------


def check_async(root: Path, staging: str, codec: str = "none") -> str:
    run = f"async-{staging}-{codec}"
    # Staging bound under the state's size: several pieces, pinned buffers reused.
    options = castore.AsyncOptions(staging=staging, staging_bytes=2 << 20)
    state = cuda_state(1)
    expected = []
    with castore.open(root / f"async-{codec}", chunk_size=CHUNK, codec=codec) as store:
        for step in (1, 2):
            expected.append(host_copy(state))
            pending = store.save(state, run=run, step=step, blocking=False, async_options=options)
            mutate(state)
            generation = pending.result(timeout=60)
            assert generation is not None and generation.step == step, generation
            stats = generation.stats
            if codec != "none":  # staged off the GPU, then compressed on the writer
                assert stats.stored_bytes < stats.new_bytes, stats
        for step, values in enumerate(expected, start=1):
            loaded = store.load(run, step, framework="torch")
            require_same(loaded, values, f"{run} generation {step}")
        peak = pending.peak_staging_bytes
    assert peak <= 2 << 20, f"staging peaked at {peak} bytes over a bound of {2 << 20}"
    ratio = stats.stored_bytes / stats.new_bytes
    stored = f"; stored {ratio:.2f}x of new" if codec != "none" else ""
    return (
        f"2 saves, bitwise; staged as {pending.staging!r}, peak staging {peak >> 10} KiB{stored}"
    )


def check_blocking_and_cuda_targets(root: Path) -> str:
    state = cuda_state(2)
    expected = host_copy(state)
    with castore.open(root / "blocking", chunk_size=CHUNK) as store:
        store.save(state, run="blocking", step=1)
        loaded = store.load("blocking", framework="torch")
        require_same(loaded, expected, "load(framework='torch')")
        targets = {name: torch.empty_like(tensor) for name, tensor in state.items()}
        result = castore.dist.load(store, "blocking", targets)
    for name, target in targets.items():
        assert result.state[name] is target, f"{name}: the result is not the target tensor"
        assert target.device == state[name].device, f"{name} landed on {target.device}"
    require_same(targets, expected, "dist.load into CUDA targets")
    devices = sorted({str(t.device) for t in targets.values()})
    return f"load(framework='torch') and dist.load into targets on {devices}: bitwise"


def check_train_rng(root: Path) -> str:
    torch.manual_seed(0)  # also every CUDA device
    model = torch.nn.Linear(64, 64).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = TrainState(model, optimizer)
    batch = torch.randn(8, 64, device=DEVICE)
    model(batch).square().mean().backward()
    optimizer.step()
    state.microbatch_done(batch)
    state.update_done()
    with castore.open(root / "train", chunk_size=CHUNK) as store:
        state.save(store, run="train")
        after_save = torch.rand(16, device=DEVICE), torch.randn(16, device=DEVICE)
        weights = host_copy(dict(model.state_dict()))
        torch.manual_seed(1234)  # move the streams (every CUDA one too) and the weights on
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1)
        resumed = state.load(store, run="train")
    after_load = torch.rand(16, device=DEVICE), torch.randn(16, device=DEVICE)
    assert resumed.rng == "restored", f"rng {resumed.rng!r}"
    for drawn, again in zip(after_save, after_load, strict=True):
        assert same_bits(drawn, again), "CUDA draws after the load differ from those after save"
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == DEVICE, f"{name} came back on {tensor.device}"
    require_same(dict(model.state_dict()), weights, "model weights")
    return f"claim {resumed.claim}, rng restored; CUDA draws and weights bitwise"


# -- two ranks -----------------------------------------------------------------------

ROWS, COLS = 512, 256


def global_tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(ROWS, COLS, generator=generator),
        "b": torch.randn(COLS, generator=generator).bfloat16(),
    }


def _rank_state(seed: int, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    tensors = global_tensors(seed)
    rows = ROWS // world
    block = tensors["w"][rank * rows : (rank + 1) * rows].to(device)
    return {
        "w": castore.Shard(block, (ROWS, COLS), (rank * rows, 0)),
        "b": tensors["b"].to(device),
    }


def _dist_rank(rank: int, world: int, init: str, path: str, out: str, on: str) -> None:
    """One rank: save blocking (seed 1) and async (seed 2), restore both into CUDA shards."""
    device = torch.device("cpu")
    if on == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        store = castore.open(path, chunk_size=CHUNK)
        castore.dist.save(store, _rank_state(1, rank, world, device), run="dist", step=1)
        state = _rank_state(2, rank, world, device)
        pending = castore.dist.save(store, state, run="dist", step=2, blocking=False)
        state["w"].local.mul_(-3)
        state["b"].add_(1)
        pending.result(timeout=120)
        for step in (1, 2):
            targets = _rank_state(99, rank, world, device)
            castore.dist.load(store, "dist", targets, step)
            expected = _rank_state(step, rank, world, device)
            assert targets["w"].local.device.type == on
            assert same_bits(targets["w"].local, expected["w"].local), f"step {step}: w"
            assert same_bits(targets["b"], expected["b"]), f"step {step}: b"
        store.close()
        Path(out, f"rank{rank}.ok").write_text(str(device))
    finally:
        torch.distributed.destroy_process_group()


def check_dist(root: Path) -> str:
    world = 2
    init = f"file://{root / 'dist-init'}"
    out = root / "dist-out"
    out.mkdir()
    context = torch.multiprocessing.start_processes(
        _dist_rank,
        args=(world, init, str(root / "dist"), str(out), DEVICE),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + DIST_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"2 ranks did not finish in {DIST_TIMEOUT_S:g}s")
    devices = [Path(out, f"rank{rank}.ok").read_text() for rank in range(world)]
    return f"gloo, ranks on {devices}: blocking and async save, load into CUDA shards"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="keep the stores in this directory")
    parser.add_argument("--no-dist", action="store_true", help="skip the two-rank check")
    parser.add_argument(
        "--rehearse-on-cpu",
        action="store_true",
        help="run the checks on CPU tensors: proves the script runs, nothing about CUDA",
    )
    args = parser.parse_args(argv)
    global DEVICE
    if args.rehearse_on_cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print(SKIP_LINE)
        return 0
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="castore-gpu-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU rehearsal"
        print(f"gpu_check: {name}, torch {torch.__version__}", flush=True)
        for staging in ("full", "changed"):
            run_check(rows, f"async_cuda_{staging}", partial(check_async, root, staging))
        # Compressed chunks: staged from the GPU, encoded on the writer, decoded on load.
        run_check(rows, "async_cuda_codec_auto", partial(check_async, root, "full", "auto"))
        run_check(rows, "blocking_cuda_and_targets", lambda: check_blocking_and_cuda_targets(root))
        run_check(rows, "train_state_cuda_rng", lambda: check_train_rng(root))
        if args.no_dist:
            rows.append(Row("dist_2ranks_gloo_cuda", True, 0.0, "skipped: --no-dist"))
        else:
            run_check(rows, "dist_2ranks_gloo_cuda", lambda: check_dist(root))
    print_table(rows)
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
