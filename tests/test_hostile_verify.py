"""``verify`` passes no generation that a load refuses: hostile manifests, valid hashes.

Each forged generation is well hashed (tests/helpers/hostile.py) and lies in a field
a load decodes or checks: a rank's per-rank state nested past the decoder's
depth limit, a per-rank tensor its shard does not hold, a chunk named with a
length other than its bytes'. The load refuses it with a typed error; verify
(structural, and ``--deep`` for what needs the bytes), through the Python API
and the CLI, must report the same generation, naming where.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hostile import latest_wires, nested_tuple_payload, publish_forged
from pregrid import pre_grid_saves
from test_hostile import run_cli

from castore import Store
from castore.errors import ChecksumMismatchError, CorruptObjectError, IntegrityError
from castore.format.tree import EXT_TENSOR, MAX_DEPTH
from castore.verify import verify_store

RUN = "hostile"
# 64-byte rows: cut every 1 KiB (before the grid) or in bands of 16 rows (on it), the
# same two chunks of 1024 and 512 bytes, as the messages in CASES say.
ORIGINAL = np.arange(24 * 16, dtype=np.float32).reshape(24, 16)

ShardMutation = Callable[[dict[str, Any]], None]


def _packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def forge_shard(store: Store, mutate: ShardMutation) -> int:
    """Publish the next generation of RUN with rank 0's shard manifest mutated."""
    _, root, shards = latest_wires(store, RUN)
    root, shards = copy.deepcopy(root), copy.deepcopy(shards)
    mutate(shards[0])
    return publish_forged(store, RUN, root, shards)


def deep_local_state(shard: dict[str, Any]) -> None:
    # A per-rank value nested two levels past the limit: it hashes, it does not decode.
    shard["local_state"] = _packed({"rng": nested_tuple_payload(MAX_DEPTH + 2)})


def undecodable_local_state(shard: dict[str, Any]) -> None:
    shard["local_state"] = b"\xc1 not msgpack"


def ghost_local_tensor(shard: dict[str, Any]) -> None:
    reference = msgpack.ExtType(EXT_TENSOR, _packed(["ghost", "numpy"]))
    shard["local_state"] = _packed({"rng": _packed({"state": reference})})


def swapped_chunks(shard: dict[str, Any]) -> None:
    # Both chunks are real and intact; the 512-byte one is named where 1024 belong.
    entry = shard["tensors"][0]
    entry["chunks"] = entry["chunks"][::-1]


def repeated_chunk(shard: dict[str, Any]) -> None:
    # The 1024-byte chunk named again as the 512-byte last one.
    entry = shard["tensors"][0]
    entry["chunks"] = [entry["chunks"][0], entry["chunks"][0]]


CASES: dict[str, tuple[ShardMutation, type[IntegrityError], str, str]] = {
    # name: (mutation, what a load raises, its message, what verify's problem says)
    "per-rank state nested too deep": (
        deep_local_state,
        CorruptObjectError,
        "nests more than",
        "per-rank value 'rng' of rank 0: state nests more than",
    ),
    "per-rank state not msgpack": (
        undecodable_local_state,
        CorruptObjectError,
        "does not decode",
        "per-rank state of rank 0: rank-local state does not decode",
    ),
    "per-rank tensor not in the shard": (
        ghost_local_tensor,
        CorruptObjectError,
        "not in its shard",
        "per-rank tensor 'ghost' of rank 0 is not in its shard",
    ),
    "chunks of the wrong length": (
        swapped_chunks,
        ChecksumMismatchError,
        "is damaged",
        "chunk 0 of tensor 'w' is 512 bytes where its entry expects 1024",
    ),
    "one chunk named with two lengths": (
        repeated_chunk,
        ChecksumMismatchError,
        "is damaged",
        "is named with 512 bytes, and with 1024 as chunk 0 of 'w'",
    ),
}


@pytest.fixture(params=["pre-grid", "grid"])
def saved(store: Store, request: pytest.FixtureRequest) -> Store:
    """Generation 1 of RUN, saved as castore did before the chunk grid (format 2) or on
    it (format 3): each reader's checks must refuse the same forgeries."""
    pre_grid = request.param == "pre-grid"
    with pre_grid_saves() if pre_grid else contextlib.nullcontext():
        store.save({"w": ORIGINAL, "note": "intact"}, run=RUN, step=1)
    [entry] = store.tensor_entries(store.resolve_root(RUN)[1])["w"]
    assert (entry.cell is None) == pre_grid
    assert [entry.chunk_length(i) for i in range(len(entry.chunks))] == [1024, 512]
    return store


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_reports_what_a_load_refuses(saved: Store, store_path: Path, case: str) -> None:
    mutate, error, load_says, verify_says = CASES[case]
    forged = forge_shard(saved, mutate)
    with pytest.raises(error, match=load_says) as raised:
        saved.load(RUN)
    if error is CorruptObjectError:
        assert raised.value.context.get("rank") == 0  # the load's error names the rank too
    report = verify_store(saved, deep=True)
    problems = [p for p in report.problems if (p.run, p.generation) == (RUN, forged)]
    assert report.problems == problems, report.problems  # generation 1 stays intact
    assert problems and verify_says in problems[0].what, problems
    saved.close()
    result = run_cli("verify", store_path, "--deep")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(lines) == len(problems), result.stdout  # one line each
    assert all(line.startswith(f"PROBLEM {RUN}@{forged}: ") for line in lines), result.stdout
    assert verify_says in lines[0]


def test_a_load_refuses_the_per_rank_state_verify_flags_even_without_deep(saved: Store) -> None:
    """Decoding is structural: a plain verify reports the nesting as well."""
    forged = forge_shard(saved, deep_local_state)
    report = verify_store(saved)
    assert [(p.run, p.generation) for p in report.problems] == [(RUN, forged)]
    assert "rank=0" in report.problems[0].what


def test_an_intact_store_with_per_rank_values_verifies(saved: Store) -> None:
    """No false alarm: a real per-rank value decodes under verify's walk."""
    from castore import RankLocal

    saved.save({"w": ORIGINAL, "rng": RankLocal({"seed": 3, "v": np.ones(4)})}, run=RUN, step=2)
    assert verify_store(saved, deep=True).ok
    assert saved.load(RUN)["rng"][0]["seed"] == 3
