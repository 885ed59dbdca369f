"""The scale model of a tiered job on several nodes, as formulas (docs/SCALE.md,
"A model of scale"); benchmarks/bench_tiers_scale.py checks it against castore's counters.

Symbols: R ranks, N nodes (R/N ranks each; N = 1 is the one-node path, where
castore.tiers.nodes does not run), F replicas, C chunks per rank (all new each
save), P packs per node upload, K = fast_keep, g the generation, k the
promotion (1 for the first the durable tier sees). Each count's formula
follows the code path its docstring names and is checked exactly against the
counters; the byte figures take castore's own message sizes from one measured
job (:func:`calibrate`) and predict how they grow with R.

Durable requests are keyed as castore.blob.counting counts them ("create
objects": creates of blobs under ``objects/``), summed over every rank. A few
depend on timing, never on R: a lease renewal (``swap locks``: the renewal
thread renews at once when it starts and then every 15 s), the coordinator's
polls for the nodes' uploads (each one more ``list index`` and ``list packs``),
and which handle fetches a new index blob first (``get index``). For those the
model gives a floor (``FLOORS``); ``get index`` it leaves to the text.

The CPU that metadata costs (the coordinator's publish path, a rank's restore
planning) is not a formula: :func:`cpu_rows` reads it from
benchmarks/bench_metadata_scale.py's results (``METADATA_SCALE``), so the table
at 1,000 and 10,000 ranks shows whatever that benchmark last measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from castore.format.grid import writer_cell
from castore.format.objects import ShardManifest, TensorEntry, encode_object

# Durable request kinds whose count depends on timing: the model gives their floor.
FLOORS = ("swap locks", "list index", "list packs")
UNCHECKED = ("get index",)  # which process fetches a new index blob first: timing


@dataclass(frozen=True)
class Shape:
    """One job: R ranks on N nodes, F replicas, C chunks of its own per rank."""

    ranks: int
    nodes: int
    replicas: int
    chunks: int
    packs: int = 1  # per node upload (the tiny states of the benchmark: 1)
    fast_keep: int = 2

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    @property
    def multi(self) -> bool:
        return self.nodes > 1

    @property
    def copies(self) -> bool:
        return self.multi and self.replicas >= 2


# -- collective rounds ------------------------------------------------------------------


def save_calls(s: Shape) -> dict[str, int]:
    """A save: "tiers: nodes", prepare, write shards (all_gathers), propose and publish
    (broadcasts); on several nodes "publish on nodes", and with F >= 2 the peer copies
    (ask, send: exchanges; their outcome: an all_gather)."""
    if not s.multi:
        return {"all_gather": 3, "broadcast": 2}
    calls = {"all_gather": 4, "broadcast": 2}
    if s.copies:
        calls["all_gather"] += 1
        calls["exchange"] = 2
    return calls


def restore_calls(s: Shape, lost: bool = False) -> dict[str, int]:
    """A restore: on one node "tiers: nodes", resolve, agree; on several, nodes (which
    carries each node's view of its fast tier), agree, and chunks wanted unless every
    node holds every shard (F >= N, nothing lost); where a rank wants a chunk its node
    lacks (a node ``lost``), chunks offered and chunks from peers; the coordinator's
    choice (candidates) only where the newest generation is not whole in the live
    nodes' fast tiers (a node lost without peer copies); and objects where a node does
    not list the generation chosen (not in this job: see restore_objects)."""
    if not s.multi:
        return {"all_gather": 2, "broadcast": 1}
    if not lost:
        return {"all_gather": 2 if s.replicas >= s.nodes else 3}
    calls = {"all_gather": 4, "exchange": 1}
    if not s.copies:
        calls["broadcast"] = 1
    return calls


# -- objects read and verified ----------------------------------------------------------


def collect_objects(s: Shape, g: int) -> int:
    """A node leader's collection of its fast tier after save g: the chain's roots (the
    K kept and one more) and the root and R manifests of each kept generation."""
    return min(g, s.fast_keep + 1) + min(g, s.fast_keep) * (s.ranks + 1)


def promotion_objects(s: Shape) -> tuple[int, int]:
    """(the coordinator's, each other node leader's) reads of one promotion.

    A node leader's upload reads its ranks' R/N manifests and the root. The
    coordinator then reads the root and R manifests to learn every chunk, the root
    again, the root and R manifests to copy them, and the R manifests again at the
    durable tier (its publish checks): 3R + 3. On one node the promotion is one copy
    (root, root and R manifests, R manifests at the durable tier): 2R + 2.
    """
    if not s.multi:
        return 2 * s.ranks + 2, 0
    upload = s.per_node + 1
    return upload + 3 * s.ranks + 3, upload


def save_objects(s: Shape, g: int, promoted: bool) -> tuple[int, int]:
    """(the coordinator's, every rank's) reads of save g with its background work.

    The coordinator checks the R manifests and every rank reads the root at the end;
    on several nodes every rank also re-reads its own manifest to attest it. Each
    node leader then collects its fast tier, and a promotion reads what
    :func:`promotion_objects` says.
    """
    own = 2 if s.multi else 1
    coordinator = s.ranks + own
    everyone = coordinator + (s.ranks - 1) * own + s.nodes * collect_objects(s, g)
    coordinator += collect_objects(s, g)
    if promoted:
        mine, other = promotion_objects(s)
        coordinator += mine
        everyone += mine + (s.nodes - 1) * other
    return coordinator, everyone


def restore_objects(s: Shape, listed: Mapping[int, int]) -> tuple[int, int]:
    """(the coordinator's, every rank's) reads of a restore onto the saved layout: every
    rank reads the root, its own manifest and rank 0's (rank 0: one) to plan
    (castore.dist.planning), and the root of every generation its node's fast tier
    lists (``listed[node]``: the view each rank sends in the discovery round); one node:
    the coordinator resolves the root once more (a rank whose node might lack the
    chosen generation's objects, because some node does not list it, reads the root
    once more: not in this job, whose lost node takes the durable tier's newest, the
    one chosen, at open). Onto another layout a rank reads all R manifests instead of
    two."""
    views = s.per_node * sum(listed.values())  # every rank reads its node's listing
    if not s.multi:  # rank 0: root, manifest 0, the root resolved again; the others: 3
        return 3 + listed[0], 3 + 3 * (s.ranks - 1) + views
    each = 2 + 3 * (s.ranks - 1)  # rank 0: root, manifest 0; the others: 3
    return 2 + listed[0], each + views


def reopen_objects(s: Shape) -> int:
    """A node that lost its fast tier takes the durable tier's newest generation (root
    and manifests) at open: one of its ranks reads the root and R manifests and the
    root once more."""
    return s.ranks + 2


# -- durable requests ---------------------------------------------------------------


def promotion_durable(s: Shape, k: int) -> dict[str, int]:
    """Requests of the k-th promotion, every rank's (``FLOORS``: at least).

    Each of the N node leaders (several nodes): a save lease (swap, then a read of
    the collection lease), two index refreshes (``has_many``, then ``put_many``:
    each lists ``index/`` and ``packs/``), P packs and their index blobs, its R/N
    manifests, the lease deleted. The coordinator: polls until every chunk is there
    (one refresh at least), reads the durable history (its runs; from the second
    promotion its reflog from the end), a lease, a refresh, creates the R manifests
    (all there already but the coordinator's own copy path writes them) and the
    root, logs the parent as collected and advances the ref (the run lock twice:
    read and swap each), and re-reads the R manifests with one more refresh for its
    publish checks. On one node there are no uploads and no polls: one copy.
    """
    leases = s.nodes + 1 if s.multi else 1
    refreshes = 2 * s.nodes + 3 if s.multi else 3
    uploads = s.nodes * s.packs if s.multi else s.packs
    requests = {
        "create objects": (2 * s.ranks if s.multi else s.ranks) + 1,
        "get objects": s.ranks,
        "create packs": uploads,
        "create index": uploads,
        "create logs": 2,
        "swap refs": 1,
        "list index": refreshes,
        "list packs": refreshes,
        "swap locks": leases + 4,
        "delete locks": leases,
        "read_versioned locks": leases + 2,
        "list refs": 1,
        "list tags": 1,
    }
    if k == 1:  # the durable tier has no history of the run yet
        # (four lists of logs/: one more since the reflog keeps index blobs beside its
        # records, castore.repo.blobreflog)
        requests.update({"list logs": 4, "read_versioned refs": 4})
    else:
        requests.update(
            {"list logs": 1, "read_versioned refs": 5, "read_versioned logs": 6 if k == 2 else 5}
        )
    return requests


def open_durable(s: Shape, lost: int | None) -> dict[str, int]:
    """Opening the tiered store on every rank: each reads the durable store's marker and
    lists its runs. ``lost``: the node whose fast tier is new (None: the first open,
    when the durable tier has no run). Then every rank compares the run's refs
    (one read), the lost node's ranks twice more (the second under the node's lock),
    and one of them copies the newest generation's root and manifests."""
    requests = {"read_versioned castore.json": s.ranks, "list refs": s.ranks}
    if lost is None:
        return requests
    requests.update(
        {
            "read_versioned refs": s.ranks + 2 * s.per_node,
            "get objects": s.ranks + 2,
            "list logs": 1,
            "read_versioned logs": 2,
        }
    )
    return requests


def restore_durable(s: Shape, fresh: bool, lost: bool) -> dict[str, int]:
    """A restore's requests: on several nodes, where the newest generation is not whole
    in the live nodes' fast tiers (a node lost without peer copies), the coordinator
    reads the durable history to choose (a handle opened since the last promotion
    reads two reflog records more), and each of the lost node's ranks refreshes the
    index once and reads its C chunks in one ranged get (one node, a node lost: every
    rank). Otherwise nothing: every fast tier took the durable tier's newest at open."""
    requests: dict[str, int] = {}
    if s.multi and lost and not s.copies:
        requests = {
            "list refs": 1,
            "list tags": 1,
            "list logs": 2 if fresh else 1,
            "read_versioned logs": 4 if fresh else 2,
            "read_versioned refs": 1,
        }
    readers = 0
    if lost and not s.copies:
        readers = s.per_node
    if readers:
        requests.update({"list index": readers, "list packs": readers, "get packs": readers})
    return requests


def check_durable(
    predicted: Mapping[str, int], measured: Mapping[str, int]
) -> list[tuple[str, int, int, bool]]:
    """(kind, predicted, measured, agrees) for every kind either names (get index aside)."""
    rows = []
    for kind in sorted((set(predicted) | set(measured)) - set(UNCHECKED)):
        want, got = predicted.get(kind, 0), measured.get(kind, 0)
        rows.append((kind, want, got, got >= want if kind in FLOORS else got == want))
    return rows


# -- bytes over the group ----------------------------------------------------------------

SIZE = 8  # the length sent ahead of each message (castore.dist.comm)
DIGEST = 34  # a 32-byte digest in msgpack (bin 8: two header bytes)


def array_header(count: int) -> int:
    """msgpack's header of an array of ``count`` items."""
    return 1 if count < 16 else 3 if count < 1 << 16 else 5


@dataclass(frozen=True)
class Phase:
    """One collective of an operation: what one rank receives from it.

    ``per_rank``: the bytes of each other rank's message (all_gathers, and the size
    table an exchange gathers first), so R - 1 of them; ``once``: a broadcast's
    message (or an exchange's point-to-point bytes), received once; ``per_shard``:
    bytes ``once`` grows by per rank saved (the root's shard list).
    """

    per_rank: float = 0.0
    once: float = 0.0
    per_shard: float = 0.0

    def received(self, ranks: int, calibrated_at: int) -> float:
        growth = self.per_shard * (ranks - calibrated_at)
        if self.per_shard:
            growth += array_header(ranks) - array_header(calibrated_at)
        return self.per_rank * (ranks - 1) + self.once + growth


def calibrate(
    received: Mapping[str, int], kinds: Mapping[str, str], ranks: int, p2p: Mapping[str, int]
) -> dict[str, Phase]:
    """Each phase's message sizes from one rank's bytes at ``ranks`` ranks.

    ``kinds``: phase -> "all_gather", "broadcast" or "exchange"; ``p2p``: the
    point-to-point bytes of each exchange, known from the state (chunks asked for:
    32 bytes each; chunks sent: 8 + their bytes each).
    """
    phases = {}
    for phase, moved in received.items():
        kind = kinds[phase]
        if kind == "all_gather":
            phases[phase] = Phase(per_rank=moved / (ranks - 1))
        elif kind == "broadcast":
            grows = DIGEST if phase == "save: publish" else 0
            phases[phase] = Phase(once=moved, per_shard=grows)
        else:
            direct = p2p.get(phase, 0)
            phases[phase] = Phase(per_rank=(moved - direct) / (ranks - 1), once=direct)
    return phases


def predict_received(
    phases: Mapping[str, Phase], ranks: int, calibrated_at: int, p2p: Mapping[str, int]
) -> float:
    """One rank's bytes received at ``ranks`` ranks (exchanges' direct bytes from ``p2p``)."""
    total = 0.0
    for name, phase in phases.items():
        if name in p2p:
            phase = Phase(phase.per_rank, p2p[name], phase.per_shard)
        total += phase.received(ranks, calibrated_at)
    return total


def uncalibrated(phases: Mapping[str, Phase], s: Shape, op: str) -> dict[str, Phase]:
    """``phases`` with a restore's chunks-wanted round where the calibration job ran none
    (it holds every shard on every node, F >= N) and ``s`` runs one: every rank wants
    nothing, so each sends an empty message (its length and msgpack's two bytes)."""
    found = dict(phases)
    if op == "restore" and s.multi and s.replicas < s.nodes:
        found.setdefault("load: chunks wanted", Phase(per_rank=SIZE + 2))
    return found


def save_p2p(s: Shape, chunk_bytes: int) -> dict[str, int]:
    """A rank's direct bytes in a save's peer copies: its F - 1 partners ask for its C
    chunks (32 bytes each) and it receives the C chunks of the F - 1 shards it copies."""
    if not s.copies:
        return {}
    partners = min(s.replicas, s.nodes) - 1
    return {
        "save: peer copies (ask)": partners * 32 * s.chunks,
        "save: peer copies (send)": partners * s.chunks * (SIZE + chunk_bytes),
    }


def restore_p2p(s: Shape, chunk_bytes: int, lost_rank: bool) -> dict[str, int]:
    """A rank's chunks from peers: a rank of the lost node gets its C chunks from a
    peer when F >= 2 (from the durable tier otherwise); every other rank, none."""
    if not s.multi:
        return {}
    got = s.chunks * (SIZE + chunk_bytes) if lost_rank and s.copies else 0
    return {"load: chunks from peers": got}


# -- extrapolation -------------------------------------------------------------------------

PACK_BYTES = 128 << 20  # castore.chunkstore.blobpacks.DEFAULT_PACK_BYTES
LIST_PAGE = 1000  # names per ListObjectsV2 page
S3_GETS_PER_SECOND = 5500  # S3's published GET rate per prefix


def manifest_bytes(ranks: int, tensors: int, chunks: int, chunk_size: int) -> int:
    """The encoded size of one rank's shard manifest (castore.format.objects): ``tensors``
    row-sharded float32 tensors of ``ranks`` blocks, ``chunks`` chunks in all."""
    per = chunks // tensors
    rows = per * chunk_size // 4 // 1024
    shape = (rows * ranks, 1024)
    entries = tuple(
        TensorEntry(
            name=f"model/layers/{t}/weight",
            dtype="float32",
            shape=shape,
            offsets=(rows * (ranks - 1), 0),
            local_shape=(rows, 1024),
            nbytes=per * chunk_size,
            chunk_size=chunk_size,
            chunks=tuple(bytes([t % 256, c % 256]) * 16 for c in range(per)),
            cell=writer_cell(shape, 4, chunk_size),  # on the tensor's grid, as saved
        )
        for t in range(tensors)
    )
    writer = {"host": "a-host-name-of-a-cluster-node", "pid": 123456}
    shard = ShardManifest("run", 1000, ranks - 1, entries, writer=writer)
    return len(encode_object(shard))


@dataclass(frozen=True)
class Reference:
    """The job the model is extrapolated to (every chunk new at every save: the worst case)."""

    ranks: int
    per_node: int = 8
    replicas: int = 2
    rank_bytes: int = 1 << 30  # each rank's own state
    chunk_size: int = 4 << 20  # castore's default
    tensors: int = 16  # row-sharded tensors per rank
    promotions: int = 100  # promotions the durable tier holds (no durable retention)

    @property
    def shape(self) -> Shape:
        packs = math.ceil(self.per_node * self.rank_bytes / PACK_BYTES)
        chunks = self.rank_bytes // self.chunk_size
        return Shape(self.ranks, self.ranks // self.per_node, self.replicas, chunks, packs)


def extrapolate(ref: Reference, save_small: float, restore_small: float) -> dict[str, float]:
    """The model's figures for ``ref``; ``save_small`` and ``restore_small``: the bytes of
    the messages each rank receives from every other rank in a save (the manifest aside)
    and in a restore, as measured (castore's fixed-size messages, a few hundred bytes)."""
    s = ref.shape
    m = manifest_bytes(s.ranks, ref.tensors, s.chunks, ref.chunk_size)
    index_blobs = s.nodes * s.packs * ref.promotions
    refreshes = 2 * s.nodes + 3
    promotion = promotion_durable(s, 3)
    objects = promotion["create objects"] + promotion["get objects"]
    packs = promotion["create packs"] + promotion["create index"]
    others = sum(promotion.values()) - objects - packs - 2 * refreshes
    gets = s.nodes * s.packs * (s.nodes - 1)
    checked = save_objects(s, 3, False)[0] - collect_objects(s, 3)
    gathered = (s.ranks - 1) * (save_small + m)
    peer = (min(s.replicas, s.nodes) - 1) * s.chunks * (SIZE + ref.chunk_size + 32)
    wanted = SIZE + 32 * s.chunks + 3 + SIZE + s.per_node * (s.chunks + 4)
    return {
        "one rank's manifest, bytes (m)": m,
        "save: collective rounds": sum(save_calls(s).values()),
        "save: objects the coordinator reads and checks": checked,
        "save: objects each node leader's collection reads": collect_objects(s, 3),
        "save: MiB each rank receives in all_gathers (the manifests)": gathered / 2**20,
        "save: MiB each rank receives as peer copies": peer / 2**20,
        "save: MiB of manifests each node commits to its fast tier": s.ranks * m / 2**20,
        "promotion: objects the coordinator reads": promotion_objects(s)[0],
        "promotion: manifest and root requests": objects,
        "promotion: pack and index blob creates": packs,
        "promotion: leases, run lock, ref, reflog": others,
        "promotion: LIST pages of index refreshes": refreshes
        * 2
        * math.ceil(index_blobs / LIST_PAGE),
        "promotion: index blob GETs (every node fetches the others')": gets,
        "promotion: those GETs at S3's 5,500 a second, s": gets / S3_GETS_PER_SECOND,
        "restore: collective rounds": sum(restore_calls(s).values()),
        "restore, a node lost: collective rounds": sum(restore_calls(s, lost=True).values()),
        "restore: objects each rank reads (onto the saved layout)": 3,
        "restore: KiB of manifests each rank reads (onto the saved layout)": 2 * m / 2**10,
        "restore onto another layout: objects each rank reads": s.ranks + 2,
        "restore onto another layout: MiB of manifests each rank reads": s.ranks * m / 2**20,
        "restore: MiB each rank receives": (s.ranks - 1) * restore_small / 2**20,
        "restore after a node loss: MiB each rank receives": (s.ranks - 1)
        * (restore_small + wanted)
        / 2**20,
        "a cold index cache (a new node reading the durable tier): index blob GETs": index_blobs,
    }


# -- the metadata's CPU, as benchmarks/bench_metadata_scale.py measured it ---------------

METADATA_SCALE = Path(__file__).resolve().parent / "results" / "metadata-scale.json"
CPU_LAYOUT, CPU_TENSORS = "fsdp", 1024  # FSDP row blocks of 1,024 tensors
NEAR = 1.1  # a measured rank count stands for a reference within this factor
# DCP's global-plan check (_validate_global_plan) as reported in pytorch#163548:
# "200+ s" at 1,024 tensors x 1,024 ranks; no figure is reported at other sizes.
DCP_REPORTED = {1024: "200+"}


@dataclass(frozen=True)
class MeasuredCpu:
    """One row of bench_metadata_scale's results: seconds on one core."""

    ranks: int
    tensors: int
    coordinator: float  # decode the R manifests, group, check coverage and names, build the root
    planning: float  # one restoring rank: decode the R manifests, group, plan its targets
    extrapolated: bool  # per-tensor phases timed on a sample of the tensors and scaled


def measured_cpu(ranks: int, path: Path = METADATA_SCALE) -> MeasuredCpu:
    """The measured row (FSDP, 1,024 tensors) whose rank count is nearest ``ranks``;
    ValueError if none lies within ``NEAR`` of it (run bench_metadata_scale.py there)."""
    rows = [
        row
        for row in json.loads(path.read_text())["rows"]
        if row["layout"] == CPU_LAYOUT and row["tensors"] == CPU_TENSORS
    ]
    near = [row for row in rows if max(row["ranks"], ranks) / min(row["ranks"], ranks) <= NEAR]
    if not near:
        measured = sorted(row["ranks"] for row in rows)
        raise ValueError(
            f"{path.name}: no {CPU_LAYOUT} row of {CPU_TENSORS} tensors near {ranks:,} ranks "
            f"(it has {measured}); run benchmarks/bench_metadata_scale.py --ranks {ranks} "
            f"--tensors {CPU_TENSORS} --layouts {CPU_LAYOUT}"
        )
    row = min(near, key=lambda r: abs(r["ranks"] - ranks))
    seconds = row["seconds"]
    return MeasuredCpu(
        row["ranks"], row["tensors"], seconds["coordinator"],
        seconds["restore planning (one rank)"], bool(row["extrapolated"]),
    )  # fmt: skip


def cpu_rows(ranks: list[int], path: Path = METADATA_SCALE) -> dict[str, list[str]]:
    """The CPU rows of the table at ``ranks``, each cell "seconds (where measured)", beside
    DCP's reported plan check."""
    measured = [measured_cpu(r, path) for r in ranks]

    def cell(seconds: float, m: MeasuredCpu, r: int) -> str:
        notes = [f"at {m.ranks:,} ranks"] if m.ranks != r else []
        notes += ["extrapolated"] if m.extrapolated else []
        return f"{seconds:,.1f}" + (f" ({', '.join(notes)})" if notes else "")

    return {
        f"save: the coordinator's CPU, s (one core; {CPU_TENSORS:,} tensors, FSDP)": [
            cell(m.coordinator, m, r) for m, r in zip(measured, ranks, strict=True)
        ],
        "restore: a rank's planning CPU, s (one core; the same job)": [
            cell(m.planning, m, r) for m, r in zip(measured, ranks, strict=True)
        ],
        "DCP's global-plan check alone, s (pytorch#163548)": [
            f"{DCP_REPORTED[m.ranks]} (reported at {m.ranks:,} ranks)"
            if m.ranks in DCP_REPORTED
            else "not reported"
            for m in measured
        ],
    }
