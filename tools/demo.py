"""The main castore job on the embedded default (LMDB): `make demo`.

Trains a small model for a few steps with AdamW, part of it frozen, and saves
the whole training state as one generation per step into ./demo-store. Then
prints the `castore log` table (the frozen part and unchanged values are
stored once), restores the newest generation and checks it bit for bit
against what was saved.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import castore
from castore.cli import main as castore_cli

RUN = "demo"
VOCAB = 4096


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, 512),  # frozen pretrained backbone
        nn.Linear(512, 2048),
        nn.GELU(),
        nn.Linear(2048, 512),
        nn.LayerNorm(512),
        nn.Linear(512, 512),  # trainable adapter
        nn.GELU(),
        nn.Linear(512, VOCAB),  # frozen output projection
    )
    for index, layer in enumerate(model):
        layer.requires_grad_(index in (5, 6))
    return model


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state()[1],
            "python_seed_state": random.getstate()[1][:8],
        },
        "data_cursor": {"epoch": 0, "consumed_samples": step * 32},
    }


def train_and_save(store: castore.Store, steps: int) -> dict[str, Any]:
    model = build_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    state: dict[str, Any] = {}
    for step in range(1, steps + 1):
        tokens = torch.randint(0, VOCAB, (32, 16))
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state = training_state(model, optimizer, step)
        # An async save: training could step on as soon as the state is staged.
        pending = store.save(
            state, run=RUN, step=step, metadata={"loss": loss.item()}, blocking=False
        )
        gen = pending.result()
        print(
            f"step {step}: loss {loss.item():.4f}  saved generation {gen.id}: "
            f"{gen.stats.logical_bytes / 2**20:.1f} MiB logical, "
            f"{gen.stats.new_bytes / 2**20:.1f} MiB new, held training "
            f"{1000 * pending.timings['held']:.0f} ms of {gen.stats.seconds:.2f}s"
        )
    return state


def same(saved: Any, loaded: Any, path: str = "") -> list[str]:
    """Paths where ``loaded`` differs from ``saved`` (tensors compared bitwise)."""
    if isinstance(saved, torch.Tensor):
        equal = (
            isinstance(loaded, torch.Tensor)
            and saved.dtype == loaded.dtype
            and saved.shape == loaded.shape
            and torch.equal(
                saved.reshape(-1).view(torch.uint8), loaded.reshape(-1).view(torch.uint8)
            )
        )
        return [] if equal else [path]
    if isinstance(saved, np.ndarray):
        return [] if np.array_equal(saved, loaded) and saved.dtype == loaded.dtype else [path]
    if isinstance(saved, dict):
        if type(saved) is not type(loaded) or list(saved) != list(loaded):
            return [path]
        return [p for k in saved for p in same(saved[k], loaded[k], f"{path}/{k}")]
    if isinstance(saved, (list, tuple)):
        if type(saved) is not type(loaded) or len(saved) != len(loaded):
            return [path]
        pairs = enumerate(zip(saved, loaded, strict=True))
        return [p for i, (a, b) in pairs for p in same(a, b, f"{path}/{i}")]
    return [] if saved == loaded and type(saved) is type(loaded) else [path]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", default="./demo-store")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="append to an existing demo store")
    args = parser.parse_args()
    path = Path(args.store)
    if path.exists() and not args.keep:
        if not (path / "castore.json").is_file():
            print(
                f"demo: {path} exists and is not a castore store; not touching it", file=sys.stderr
            )
            return 1
        shutil.rmtree(path)
    with castore.open(path) as store:
        saved = train_and_save(store, args.steps)
    print(f"\n$ castore log {args.store}")
    castore_cli(["log", str(path)])
    print(f"\n$ castore verify {args.store} --deep")
    if castore_cli(["verify", str(path), "--deep"]) != 0:
        return 1
    with castore.open(path, create=False) as store:
        newest = store.resolve(RUN)
        restored = store.load(RUN, "latest", framework="auto")
    differences = same(saved, restored)
    if differences:
        print(f"\nFAILED: restored generation {newest.id} differs at {differences[:5]}")
        return 1
    print(
        f"\nrestored generation {newest.id} (step {newest.step}, root {newest.root[:12]}): "
        "every tensor and value matches what was saved, bit for bit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
