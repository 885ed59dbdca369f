"""castore on S3-protocol object storage: `make demo-s3`.

Starts moto's S3 server on the loopback (no cloud account, no network) and
points this process at it the way a real job is pointed at S3: through
AWS_ENDPOINT_URL and the standard credential variables. Then:

1. four ranks (real processes, gloo) train and save a sharded state every
   step to s3://demo/ckpt, each rank with its own index cache directory, as
   if each were a node of its own;
2. two fresh ranks restore the newest generation and check every element;
3. one process saves to a local store (the embedded default) and
   `castore copy` sends its latest generation to the S3 store, which is then
   loaded back and compared bit for bit; `castore log` lists the S3 store.

Exits non-zero if any check fails. The server stops at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402  (the single-process demo's model, training loop and bitwise check)
import demo_dist  # noqa: E402  (the 4-rank save and the 2-rank restore)

import castore  # noqa: E402
from castore.cli import main as castore_cli  # noqa: E402
from castore.testing.moto import moto_server  # noqa: E402

BUCKET = "demo"
STORE = f"s3://{BUCKET}/ckpt"
REGION = "us-east-1"


@contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on a free loopback port, in a child process; yields its URL.

    Requests are served one at a time, which gives the emulator S3's atomic
    conditional writes (castore.testing.moto); the ranks still race on the wire.
    """
    try:
        with moto_server() as endpoint:
            yield endpoint
    except RuntimeError as exc:
        raise SystemExit(f"demo-s3: {exc}") from None


def point_at(endpoint: str) -> None:
    """Configure S3 for this process and its children as a job's environment would."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    os.environ["AWS_ACCESS_KEY_ID"] = "demo"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "demo"
    os.environ["AWS_DEFAULT_REGION"] = REGION
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)


def create_bucket(scratch: str) -> None:
    import boto3

    boto3.session.Session().client("s3").create_bucket(Bucket=BUCKET)
    # The store itself is not made here: the 4 ranks all open s3://demo/ckpt at
    # once and one marker wins (castore.opening.blobs.marker_or_new_store).


# Each rank is a node of its own: its own per-node index cache directory.
def save_rank(
    rank: int, world: int, port: int, store: str, reference: str, caches: str, steps: int
) -> None:
    os.environ["CASTORE_CACHE_DIR"] = os.path.join(caches, f"node-{rank}")
    demo_dist.STEPS = steps  # a spawned rank imports demo_dist afresh
    demo_dist.train_and_save(rank, world, port, store, reference)


def restore_rank(
    rank: int, world: int, port: int, store: str, reference: str, out: Any, caches: str
) -> None:
    os.environ["CASTORE_CACHE_DIR"] = os.path.join(caches, f"node-{rank}")
    demo_dist.restore(rank, world, port, store, reference, out)


def save_and_restore(scratch: str, steps: int, tamper: bool) -> bool:
    """Four ranks save to S3, two restore; True if every element matches."""
    reference = os.path.join(scratch, "reference.pt")
    caches = os.path.join(scratch, "caches")
    print(f"== {demo_dist.SAVE_RANKS} ranks (gloo), one cache each, save to {STORE} ==")
    started = time.perf_counter()
    demo_dist.launch(save_rank, demo_dist.SAVE_RANKS, STORE, reference, caches, steps)
    print(f"  ({time.perf_counter() - started:.1f}s, start-up of the ranks included)")
    if tamper:
        alter_one_element(reference)
    print(f"\n== {demo_dist.RESTORE_RANKS} fresh ranks restore the newest generation ==")
    results = demo_dist.mp.get_context("spawn").Queue()
    demo_dist.launch(restore_rank, demo_dist.RESTORE_RANKS, STORE, reference, results, caches)
    rows = sorted(
        (results.get(timeout=60) for _ in range(demo_dist.RESTORE_RANKS)), key=lambda r: r["rank"]
    )
    for r in rows:
        check = "all equal" if r["mismatches"] == 0 else f"{r['mismatches']} DIFFER"
        print(
            f"  rank {r['rank']}: generation {r['generation']}, {r['tensors']} tensors, "
            f"read {r['bytes_read'] / 2**20:.2f} MiB for {r['bytes_needed'] / 2**20:.2f} MiB "
            f"needed in {r['seconds']:.2f}s: {check}"
        )
    return not any(r["mismatches"] for r in rows)


def alter_one_element(reference: str) -> None:
    """The broken control: the reference the restore is checked against no longer matches."""
    import torch

    full = torch.load(reference)
    name = sorted(full)[0]
    full[name].view(-1)[0] += 1
    torch.save(full, reference)
    print(f"  --tamper: changed one element of {name} in the reference; the check must fail")


def copy_from_local(scratch: str, steps: int) -> bool:
    """Save locally, `castore copy` to S3, load the copy back; True if it matches."""
    local = os.path.join(scratch, "local-store")
    print(f"\n== one process saves to a local store (LMDB), then copies it to {STORE} ==")
    with castore.open(local) as store:
        saved = demo.train_and_save(store, steps)
        local_root = store.resolve(demo.RUN).root
    print(f"\n$ castore copy {local} {STORE}")
    if castore_cli(["copy", local, STORE]) != 0:
        return False
    print(f"\n$ castore log {STORE}")
    if castore_cli(["log", STORE]) != 0:
        return False
    with castore.open(STORE, create=False) as store:
        copied = store.resolve(demo.RUN)
        restored = store.load(demo.RUN, framework="auto")
    differences = demo.same(saved, restored)
    if copied.root != local_root or differences:
        print(f"FAILED: the copy at {STORE} differs: root {copied.root[:12]}, at {differences[:5]}")
        return False
    print(
        f"\nloaded {demo.RUN}@{copied.id} from {STORE} (root {copied.root[:12]}, the local "
        "store's): every tensor and value matches what was saved, bit for bit"
    )
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="fewer training steps (for the test suite)"
    )
    parser.add_argument(
        "--tamper",
        action="store_true",
        help="a broken control: alter the reference after the save, so the restore check fails",
    )
    args = parser.parse_args()
    steps = 2 if args.quick else 4
    scratch = tempfile.mkdtemp(prefix="castore-demo-s3-")
    try:
        with s3_server() as endpoint:
            point_at(endpoint)
            create_bucket(scratch)
            print(f"moto S3 server at {endpoint}; AWS_ENDPOINT_URL points there; bucket {BUCKET}\n")
            ok = save_and_restore(scratch, steps, args.tamper) and copy_from_local(scratch, steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not ok:
        print("\ndemo-s3: FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
