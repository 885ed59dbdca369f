"""Lightning's checkpointing against castore's CheckpointIO: bytes written, time held per save.

Run from the repository root (needs the ``lightning`` extra)::

    .venv/bin/python benchmarks/bench_lightning.py [--saves 10] [--every 5] [--no-codec-run]
                                                   [--workdir DIR] [--json OUT] [--quick]

A fine-tuning run with a frozen backbone on CPU (issue 28: dedup where
frameworks write full copies). The model is a ``torch.nn.TransformerEncoder``
(d_model 256, 4 heads, feed-forward 1024, 4 layers, dropout 0: 3.16 M fp32
parameters, 12.6 MB) with ``requires_grad_(False)``, mean-pooled into a
trainable ``Linear(256, 10)`` head; AdamW on the head only, so only the head's
weights and its two moments change between saves. The encoder's layers are
deep copies of one, so every parameter first gets its own noise (``randn *
0.02``): else castore would dedup identical layers, which a pretrained
backbone does not have. The data is synthetic (random features and labels,
fixed seed); every run is seeded the same.

``Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
enable_model_summary=False, max_steps=saves * every)`` with
``ModelCheckpoint(dirpath=ckpts, every_n_train_steps=every, save_top_k=-1)``:
every checkpoint is kept, as a user keeping history would. The runs:

  lightning       Lightning's default ``TorchCheckpointIO`` (one ``.ckpt`` file per save)
  castore         ``CastoreCheckpointIO(store)`` (a generation per save, a JSON pointer
                  file at each path)
  castore-auto    ``CastoreCheckpointIO(store, codec="auto")`` (compression on)

Each plugin is subclassed to time its ``save_checkpoint`` call (``perf_counter``
around it): the time the save holds training once Lightning has built the
checkpoint dict. castore's store is opened lazily inside the first save, so
that open is part of the first save's time. Bytes per save are each ``.ckpt``
file's size for Lightning and ``Generation.stats.written_bytes`` for castore
(new chunk bytes and manifests as stored). Totals are ``tree_bytes`` of the
checkpoint directory (Lightning) or of the store plus the pointer files'
directory (castore), after ``os.sync()``: apparent (sum of file sizes) and
allocated (``st_blocks * 512``, as ``du``). Ratios are castore over Lightning
from the same invocation. Medians of the saves after the first.

Note: ``TorchCheckpointIO`` writes without ``fsync``; castore's saves are
durable (fsynced) when they return. Afterwards the last checkpoint is loaded
through each plugin and compared bitwise with the Lightning run's last
``.ckpt`` (same seed, same steps): the benchmark fails if they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from _common import add_ratios, mb, median_later, same_state, tree_bytes  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

import castore  # noqa: E402
from castore.integrations.lightning import CastoreCheckpointIO  # noqa: E402

D_MODEL, HEADS, FF, LAYERS, CLASSES = 256, 4, 1024, 4, 10
SEQ, BATCH = 16, 8
RUN = "lightning"


class FrozenBackboneClassifier(L.LightningModule):  # type: ignore[misc]
    def __init__(self, layers: int) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(
            D_MODEL, HEADS, dim_feedforward=FF, dropout=0.0, batch_first=True
        )
        self.backbone = torch.nn.TransformerEncoder(
            layer, num_layers=layers, enable_nested_tensor=False
        )
        with torch.no_grad():  # the clones start equal: make each layer's weights its own
            for param in self.backbone.parameters():
                param.add_(torch.randn_like(param) * 0.02)
        self.backbone.requires_grad_(False)
        self.head = torch.nn.Linear(D_MODEL, CLASSES)
        self.save_hyperparameters({"layers": layers, "d_model": D_MODEL})

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        logits = self.head(self.backbone(x).mean(dim=1))
        return torch.nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.head.parameters(), lr=1e-3)


class TimedTorchIO(TorchCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.times.append(time.perf_counter() - start)


class TimedCastoreIO(CastoreCheckpointIO):
    def __init__(self, store: Path, **options: Any) -> None:
        super().__init__(store, run=RUN, **options)
        self.times: list[float] = []

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.times.append(time.perf_counter() - start)


def _data(steps: int) -> Any:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * BATCH, SEQ, D_MODEL, generator=generator)
    y = torch.randint(0, CLASSES, (steps * BATCH,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _fit(io: Any, ckpts: Path, saves: int, every: int, layers: int) -> float:
    L.seed_everything(0, verbose=False)
    model = FrozenBackboneClassifier(layers)
    checkpoints = ModelCheckpoint(dirpath=ckpts, every_n_train_steps=every, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=saves * every,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[checkpoints],
    )
    start = time.perf_counter()
    trainer.fit(model, _data(saves * every))
    return time.perf_counter() - start


def _last(ckpts: Path) -> Path:
    return max(ckpts.glob("*.ckpt"), key=lambda p: int(p.stem.rsplit("step=", 1)[1]))


def run_lightning(work: Path, saves: int, every: int, layers: int) -> dict[str, Any]:
    ckpts = work / "lightning-ckpts"
    io = TimedTorchIO()
    fit_s = _fit(io, ckpts, saves, every, layers)
    os.sync()
    files = sorted(ckpts.glob("*.ckpt"), key=lambda p: int(p.stem.rsplit("step=", 1)[1]))
    per_save = [p.stat().st_size for p in files]
    apparent, allocated = tree_bytes(ckpts)
    return _result("lightning", io.times, per_save, apparent, allocated, fit_s)


def run_castore(work: Path, name: str, saves: int, every: int, layers: int, **options: Any) -> Any:
    store, ckpts = work / f"{name}-store", work / f"{name}-ckpts"
    io = TimedCastoreIO(store, **options)
    fit_s = _fit(io, ckpts, saves, every, layers)
    os.sync()
    with castore.open(store) as opened:
        generations = opened.generations(RUN)
    per_save = [g.stats.written_bytes for g in generations]
    store_bytes = tree_bytes(store)
    pointer_bytes = tree_bytes(ckpts)
    apparent, allocated = (s + p for s, p in zip(store_bytes, pointer_bytes, strict=True))
    result = _result(name, io.times, per_save, apparent, allocated, fit_s)
    result["store_bytes"] = {"apparent": store_bytes[0], "allocated": store_bytes[1]}
    result["pointer_bytes"] = {"apparent": pointer_bytes[0], "allocated": pointer_bytes[1]}
    result["logical_bytes_per_save"] = generations[-1].stats.logical_bytes
    result["castore_held_s_per_save"] = [g.stats.held_seconds for g in generations]
    return result


def _result(
    name: str, times: list[float], per_save: list[int], apparent: int, allocated: int, fit_s: float
) -> dict[str, Any]:
    if len(times) != len(per_save):
        raise RuntimeError(f"{name}: {len(times)} timed saves but {len(per_save)} checkpoints")
    return {
        "name": name,
        "saves": len(times),
        "fit_s": fit_s,
        "save_s": times,
        "first_save_s": times[0],
        "median_later_save_s": median_later(times),
        "bytes_per_save": per_save,
        "first_save_bytes": per_save[0],
        "median_later_save_bytes": median_later([float(b) for b in per_save]),
        "total_apparent": apparent,
        "total_allocated": allocated,
    }


def check_last(work: Path, names: list[str]) -> None:
    """The last checkpoint of every castore run loads bitwise equal to Lightning's last .ckpt."""
    reference = torch.load(_last(work / "lightning-ckpts"), weights_only=False)
    for name in names:
        io = CastoreCheckpointIO(work / f"{name}-store", run=RUN)
        try:
            loaded = io.load_checkpoint(_last(work / f"{name}-ckpts"))
        finally:
            io.teardown()
        for key in ("state_dict", "optimizer_states", "global_step", "epoch"):
            if not same_state(reference[key], loaded[key]):
                raise RuntimeError(f"{name}: last checkpoint's {key} differs from Lightning's")


def print_table(results: list[dict[str, Any]]) -> None:
    base = results[0]
    print(
        "| run | saves | total on disk (allocated) | total (apparent) | first save bytes "
        "| later save bytes (median) | first save time | later save time (median) "
        "| bytes ratio | save time ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ratio_b = r["total_allocated"] / base["total_allocated"]
        ratio_t = r["median_later_save_s"] / base["median_later_save_s"]
        print(
            f"| {r['name']} | {r['saves']} | {mb(r['total_allocated'])} "
            f"| {mb(r['total_apparent'])} | {mb(r['first_save_bytes'])} "
            f"| {mb(r['median_later_save_bytes'])} | {r['first_save_s'] * 1e3:.1f} ms "
            f"| {r['median_later_save_s'] * 1e3:.1f} ms | {ratio_b:.3f} | {ratio_t:.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saves", type=int, default=10, help="checkpoints per run (default 10)")
    parser.add_argument("--every", type=int, default=5, help="train steps between saves (5)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="encoder layers (4)")
    parser.add_argument("--no-codec-run", action="store_true", help="skip castore codec=auto")
    parser.add_argument("--workdir", type=Path, default=None, help="where the scratch dir goes")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path("benchmarks/results/lightning-ckpt.json"),
        help="JSON output",
    )
    parser.add_argument("--quick", action="store_true", help="3 saves every 2 steps, 2 layers")
    args = parser.parse_args()
    if args.quick:
        args.saves, args.every, args.layers = 3, 2, 2
    if args.saves < 2 or args.every < 1 or args.layers < 1:
        parser.error("--saves must be at least 2, --every and --layers at least 1")

    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    work = Path(tempfile.mkdtemp(prefix="castore-bench-lightning-", dir=args.workdir))
    start = time.perf_counter()
    try:
        results = [run_lightning(work, args.saves, args.every, args.layers)]
        results.append(run_castore(work, "castore", args.saves, args.every, args.layers))
        names = ["castore"]
        if not args.no_codec_run:
            results.append(
                run_castore(work, "castore-auto", args.saves, args.every, args.layers, codec="auto")
            )
            names.append("castore-auto")
        check_last(work, names)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - start

    params = sum(p.numel() for p in FrozenBackboneClassifier(args.layers).parameters())
    print(
        f"frozen TransformerEncoder ({args.layers} layers, d_model {D_MODEL}) + Linear head: "
        f"{params / 1e6:.2f} M fp32 parameters ({mb(params * 4)}); "
        f"{args.saves} saves every {args.every} steps; ratios against lightning"
    )
    print_table(results)
    print(f"last checkpoints equal bitwise; ran {elapsed:.1f} s")
    if args.json:
        add_ratios(results)
        payload = {
            "benchmark": "bench_lightning",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": {"layers": args.layers, "d_model": D_MODEL, "ff": FF, "parameters": params},
            "platform": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "lightning": L.__version__,
                "castore": getattr(castore, "__version__", "?"),
                "cpus": os.cpu_count(),
            },
            "elapsed_s": elapsed,
            "results": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
