"""Small collectives over a torch.distributed group, each bounded by a timeout.

Messages are msgpack (never pickle), carried as uint8 tensors by
``all_gather``/``broadcast`` issued with ``async_op=True`` and waited on with
a timeout, so a rank that died turns into an error on the survivors instead
of a hang. Tensors live on the GPU for NCCL groups and on the CPU otherwise.

Every call is counted (:func:`collective_counts`): the scale model of
docs/SCALE.md ("A model of scale") is written in these counts, and
benchmarks/bench_tiers_scale.py checks it against them.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from castore import errors
from castore.errors import (
    CastoreError,
    CollectiveError,
    CollectiveTimeoutError,
    DistributedError,
    RankFailedError,
)

DEFAULT_TIMEOUT = 600.0
_SIZE_BYTES = 8  # the int64 that carries each message's length ahead of it


# -- what the collectives cost -----------------------------------------------------


@dataclass(frozen=True)
class CollectiveCounts:
    """castore's collective calls in this process that completed (a snapshot; subtract
    two for a span).

    ``calls``: by kind, ``"all_gather"``, ``"broadcast"``, ``"exchange"`` (an
    exchange's own all_gather of sizes is part of it, not an all_gather call);
    ``phases``: by the phase string each call names. ``sent_by_phase`` and
    ``received_by_phase``: the bytes this rank put in and got out of them: each
    all_gather sends its message padded to the longest one and receives every
    other rank's, each broadcast the source sends once and every other rank
    receives once, and an exchange adds its point-to-point bytes; every message's
    8-byte length included. That is what the collective must move at least; a
    ring or a tree also forwards other ranks' messages. A group of one (no
    torch.distributed) moves nothing and is not counted.
    """

    calls: Mapping[str, int] = field(default_factory=dict)
    phases: Mapping[str, int] = field(default_factory=dict)
    sent_by_phase: Mapping[str, int] = field(default_factory=dict)
    received_by_phase: Mapping[str, int] = field(default_factory=dict)

    @property
    def rounds(self) -> int:
        """Collective calls of any kind: each is one time every rank waits for all."""
        return sum(self.calls.values())

    @property
    def sent(self) -> int:
        return sum(self.sent_by_phase.values())

    @property
    def received(self) -> int:
        return sum(self.received_by_phase.values())

    def __sub__(self, earlier: CollectiveCounts) -> CollectiveCounts:
        return CollectiveCounts(
            _minus(self.calls, earlier.calls),
            _minus(self.phases, earlier.phases),
            _minus(self.sent_by_phase, earlier.sent_by_phase),
            _minus(self.received_by_phase, earlier.received_by_phase),
        )


def _minus(later: Mapping[str, int], earlier: Mapping[str, int]) -> dict[str, int]:
    moved = {key: later.get(key, 0) - earlier.get(key, 0) for key in set(later) | set(earlier)}
    return {key: value for key, value in sorted(moved.items()) if value}


class _Tally:
    """The running totals behind :func:`collective_counts` (async saves count from
    their writer thread, hence the lock; a call costs microseconds beside a collective)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: tuple[Counter[str], ...] = (Counter(), Counter(), Counter(), Counter())

    def add(self, kind: str, phase: str, sent: int, received: int) -> None:
        calls, phases, sent_by_phase, received_by_phase = self._counters
        with self._lock:
            calls[kind] += 1
            phases[phase] += 1
            sent_by_phase[phase] += sent
            received_by_phase[phase] += received

    def snapshot(self) -> CollectiveCounts:
        with self._lock:
            return CollectiveCounts(*(dict(counter) for counter in self._counters))


_TALLY = _Tally()


def collective_counts() -> CollectiveCounts:
    """Every castore collective this process has taken part in since it started."""
    return _TALLY.snapshot()


class Group:
    """The ranks of one castore collective call and how long to wait for them."""

    def __init__(self, group: Any, coordinator: int, timeout: float) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        # A process without torch.distributed is a group of one: rank 0 of 1.
        self.solo = not initialized and group is None
        if not initialized and not self.solo:
            raise DistributedError(
                "torch.distributed is not initialized: call init_process_group first"
            )
        self.group = group
        self.rank = 0 if self.solo else dist.get_rank(group)
        self.world_size = 1 if self.solo else dist.get_world_size(group)
        if not 0 <= coordinator < self.world_size:
            raise ValueError(
                f"coordinator {coordinator} is not a rank of a {self.world_size}-rank group"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.coordinator = coordinator
        self.timeout = timeout
        backend = "solo" if self.solo else str(dist.get_backend(group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def _wait(self, work: Any, phase: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise collective_failure(exc, phase, self.rank, self.timeout) from exc

    def all_gather(self, message: Any, phase: str) -> list[Any]:
        """Every rank's ``message``, in rank order."""
        gathered, sent, received = self._gather(message, phase)
        if not self.solo:
            _TALLY.add("all_gather", phase, sent, received)
        return gathered

    def _gather(self, message: Any, phase: str) -> tuple[list[Any], int, int]:
        """:meth:`all_gather`, uncounted; with the bytes this rank sent and received."""
        data = msgpack.packb(message, use_bin_type=True)
        if self.solo:
            return [msgpack.unpackb(data, raw=False, strict_map_key=False)], 0, 0
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [
            torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)
        ]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True), phase)
        lengths = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        if data:
            padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(dist.all_gather(gathered, padded, group=self.group, async_op=True), phase)
        each = _SIZE_BYTES + max(lengths)
        messages = [
            msgpack.unpackb(bytes(g[:n].cpu().numpy()), raw=False, strict_map_key=False)
            for g, n in zip(gathered, lengths, strict=True)
        ]
        return messages, each, each * (self.world_size - 1)

    def broadcast(self, message: Any, phase: str, *, source: int | None = None) -> Any:
        """The coordinator's (or rank ``source``'s) ``message`` on every rank (others pass
        anything)."""
        source = self.coordinator if source is None else source
        data = msgpack.packb(message, use_bin_type=True) if self.rank == source else b""
        if self.solo:
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._wait(dist.broadcast(size, group=self.group, group_src=source, async_op=True), phase)
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == source and data:
            buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._wait(dist.broadcast(buffer, group=self.group, group_src=source, async_op=True), phase)
        moved = _SIZE_BYTES + buffer.numel()
        sending = self.rank == source
        _TALLY.add("broadcast", phase, moved if sending else 0, 0 if sending else moved)
        return msgpack.unpackb(bytes(buffer.cpu().numpy()), raw=False, strict_map_key=False)

    def exchange(self, outgoing: Mapping[int, bytes | bytearray], phase: str) -> dict[int, bytes]:
        """Send ``outgoing[rank]`` to each rank named, point to point; what each rank sent
        this one (ranks that sent nothing are absent). A collective call.

        One all_gather of the sizes, then every send and receive is posted before
        any is waited on, so no order of ranks can deadlock; each wait is bounded
        by the timeout. Bulk bytes go straight between the two ranks: no rank
        sees another pair's.
        """
        if self.solo:
            return {0: bytes(outgoing[0])} if outgoing.get(0) else {}
        sizes, sent, received = self._gather(
            {int(peer): len(data) for peer, data in outgoing.items() if data}, phase
        )
        sends, receives = [], {}
        for peer, data in sorted(outgoing.items()):
            if data and peer != self.rank:
                # A bytearray is sent from its own memory; bytes are copied once (torch
                # wants a writable buffer).
                writable = data if isinstance(data, bytearray) else bytearray(data)
                tensor = torch.frombuffer(writable, dtype=torch.uint8).to(self.device)
                sends.append((tensor, dist.isend(tensor, group=self.group, group_dst=peer)))
                sent += len(data)
        for peer, table in enumerate(sizes):
            size = table.get(self.rank, 0)
            if size and peer != self.rank:
                tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
                receives[peer] = (tensor, dist.irecv(tensor, group=self.group, group_src=peer))
                received += size
        for _, work in sends:
            self._wait(work, phase)
        arrived = {}
        for peer, (tensor, work) in receives.items():
            self._wait(work, phase)
            arrived[peer] = bytes(tensor.cpu().numpy())
        if outgoing.get(self.rank):
            arrived[self.rank] = bytes(outgoing[self.rank])
        _TALLY.add("exchange", phase, sent, received)
        return arrived


def collective_failure(exc: RuntimeError, phase: str, rank: int, timeout: float) -> CollectiveError:
    """The typed, one-line error of a collective (or a group's set-up) that failed."""
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CollectiveTimeoutError(
            f"not every rank answered within {timeout:g}s during {phase}; a rank may have died",
            rank=rank,
        )
    first_line = text.splitlines()[0] if text else repr(exc)
    return CollectiveError(f"the process group failed during {phase}: {first_line}", rank=rank)


# -- castore's own groups ---------------------------------------------------------

# Weak references: torch.distributed holds the groups until destroy_process_group;
# a strong one here kept gloo groups alive past it, and the process then aborted
# at exit now and then ("terminate called without an active exception").
_OWN_GROUPS: dict[tuple[int, ...], tuple[weakref.ref[Any], ...]] = {}


def own_groups(group: Any, timeout: float) -> tuple[Any, Any]:
    """castore's own gloo groups over the ranks of ``group`` (None: the world).

    The first is where an async save's writer thread runs its two-phase
    commit, the second where callers agree whether to skip a save; neither
    ever carries training's collectives, nor each other's. Made once per set
    of ranks and world: the first call is a collective call of those ranks,
    bounded by ``timeout`` seconds (CollectiveTimeoutError, CollectiveError)
    like every other castore collective: ``new_group`` otherwise waits for a
    dead peer's rendezvous as long as the default group's timeout (30 min).
    Without ``torch.distributed`` initialized both are None (a group of one).
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    default = dist.distributed_c10d._get_default_group()
    if group is None:
        ranks = tuple(range(dist.get_world_size()))
    else:
        ranks = tuple(dist.get_process_group_ranks(group))
    made = [ref() for ref in _OWN_GROUPS.get(ranks, ())]
    if len(made) != 3 or made[0] is not default or None in made:  # none yet, or a new world
        made = [default, *_new_gloo_groups(list(ranks), local=group is not None, timeout=timeout)]
        _OWN_GROUPS[ranks] = tuple(weakref.ref(made_group) for made_group in made)
    return made[1], made[2]


def _new_gloo_groups(ranks: list[int], *, local: bool, timeout: float) -> list[Any]:
    """Two new gloo groups of ``ranks``; ``local``: only those ranks call (a subgroup)."""
    bound = datetime.timedelta(seconds=timeout)
    try:
        return [
            dist.new_group(ranks, backend="gloo", timeout=bound, use_local_synchronization=local)
            for _ in range(2)
        ]
    except RuntimeError as exc:  # gloo's rendezvous: DistStoreError, "Socket Timeout", ...
        raise collective_failure(
            exc, "the set-up of castore's process groups", dist.get_rank(), timeout
        ) from exc


# -- failures as messages: every rank must learn of any rank's error ----------


def attempt(action: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return action(), None
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        return None, exc


def describe(exc: BaseException | None) -> dict[str, str] | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": str(exc)}


def raise_failures(messages: list[Any], comm: Group, own: BaseException | None) -> None:
    """Raise on every rank if any rank reported an error (the first, in rank order)."""
    if own is not None:
        raise own
    for rank, message in enumerate(messages):
        if message.get("error"):
            raise rebuild(message["error"], rank)


def rebuild(error: dict[str, str], rank: int) -> CastoreError:
    """Another rank's error as the same castore type (RankFailedError otherwise)."""
    cls = getattr(errors, error["type"], None)
    message = f"rank {rank} failed: {error['message']}"
    if isinstance(cls, type) and issubclass(cls, CastoreError):
        return cls.from_remote(message, failed_rank=rank)
    return RankFailedError.from_remote(f"{message} ({error['type']})", failed_rank=rank)
