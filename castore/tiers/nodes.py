"""A tiered job on several nodes: each node has a fast tier of its own.

A *node* is the ranks of a job that open the same fast directory
(``open_tiered(node=...)``; by default the host name and the directory's real
path), so nodes simulated on one machine need nothing but distinct ``fast``
paths. When the ranks of a ``castore.dist`` call (or of a DCP save or load
through castore.dcp, which takes the same path: castore.dcp.nodes) span more
than one node, the tiered store works as follows; on one node nothing here
runs.

Save (``castore.dist.save``, ``TrainState.save``):

1. *Catch up.* The ranks gather each node's ref of the run. A node behind the
   newest (a replacement node, one that missed a save) is sent that
   generation's root and shard manifests by a node that has them, and
   advances its own ref to it (its parent logged as absent there, as
   ``castore copy`` does), recorded as held elsewhere: every node then
   proposes from the same parent.
2. Each rank writes its chunks into its own node's fast tier, as on one node,
   and *attests* them: while it holds its node's save lock it checks that its
   node holds every chunk its shard names, and sends its manifest's bytes in
   its ack (the coordinator cannot look into another node's store).
3. *Peer copies* (``replicas=F`` ≥ 2): each rank's shard is also held on the
   F-1 next nodes by the rank of the same local index there. The partner
   reads the shard's chunk list from the ack, asks for the chunks its node
   lacks, and writes what it receives, each chunk verified against its name,
   into its node's fast tier; only new chunks travel.
4. The coordinator commits every manifest, checks them as one store does
   (the chunk presence check is each rank's attestation), writes its node's
   holdings record, and publishes on its node. Every other node's leader
   (its lowest rank) commits the manifests and root, writes its holdings
   record (which shards the node holds: castore.core.holdings) and advances
   its node's ref. A failure on any node fails the save on every rank.

Restore (``castore.dist.load``):

1. Each node's leader reports the generations its fast tier lists and the
   shards it holds of each (in the round that finds the nodes). A generation
   is complete in the fast tier when the live nodes' holdings together cover
   every saved shard. When the newest generation any node lists is complete
   there (each writable fast tier took the durable tier's newest at its
   open), every rank chooses it alike, with no round of its own and nothing
   read from the durable tier; otherwise, and for a fallback, the candidates
   are those and the durable tier's history, newest first (the coordinator
   decides).
2. A node that lacks the chosen root or manifests gets them over the group.
3. Each rank plans its chunks, reads what its node holds, asks the other
   nodes for the rest in one exchange (the server is spread over the nodes
   that hold a chunk and their ranks), and reads what no node sent from the
   durable tier. Every byte from every source is verified against its name
   (a chunk of the node's own, once: by the restore's check); a copy that
   fails moves on to the next source. When every node lists the generation
   and holds all its shards, steps 2 and 3 ask the other nodes nothing.
4. When the ranks agree that the generation failed only because of damage,
   the same generation is tried once more with each rank's damaged chunks
   fetched from the other nodes or the durable tier, and only then, with
   ``fallback="previous"``, an older generation (all ranks together).

Promotion: a generation selected for the durable tier is uploaded by every
node's leader (the chunks of its own ranks' shards that the durable tier
lacks, throttled, on its promotion thread); the coordinator then publishes
it in the durable tier once every chunk is there, with the same root digest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from castore.chunkstore.base import Namespace
from castore.chunkstore.memory import MemoryBackend
from castore.chunkstore.tiered import TieredChunkBackend
from castore.core import fencing
from castore.core.commit import commit_objects
from castore.core.holdings import mark_elsewhere
from castore.core.reading import count_object_reads
from castore.dist.comm import Group, attempt, describe, raise_failures
from castore.errors import ChunkMissingError, CorruptObjectError
from castore.format.codec import stored_matches
from castore.format.hashing import Digest, digest_bytes
from castore.format.objects import GenerationRoot
from castore.support.faults import fault_point
from castore.tiers.nodemap import NodeMap
from castore.tiers.selection import covered_generations, node_view, restore_candidates
from castore.tiers.wire import decode_root, decode_shard, frame, read_objects, root_among, unframe

if TYPE_CHECKING:
    from castore.tiers.store import TieredStore


def discover(
    store: TieredStore, comm: Group, run: str, *, restore: bool = False
) -> NodeSession | None:
    """The node session of a collective call (a collective call itself); None on one node.

    With ``restore``, the same round carries each rank's view of its node's fast tier
    (a rank cannot know that it leads its node before this round; only the leaders'
    views are used), so that a restore of the newest generation can decide with no
    round of its own (:meth:`NodeSession.agree_candidates`).
    """

    def mine() -> dict[str, Any]:
        ref = store.fast.refs.read(run)
        found: dict[str, Any] = {"ref": None if ref is None else [ref.generation, ref.root.raw]}
        if restore:
            view = node_view(store.fast, run)
            found["view"] = [[g, r, n, _ranges(held, n)] for g, r, n, held in view]
            # A writable fast tier took the durable tier's newest generation at its open
            # (castore.tiers.store): its view lists it.
            found["caught_up"] = not store.readonly
        return found

    found, failure = attempt(mine)
    views = comm.all_gather(
        {"error": describe(failure), "node": store.node_id, **(found or {})}, "tiers: nodes"
    )
    raise_failures(views, comm, failure)
    nodes = NodeMap(comm.rank, tuple(str(v["node"]) for v in views))
    if not nodes.multi:
        return None
    refs = [None if v["ref"] is None else (int(v["ref"][0]), bytes(v["ref"][1])) for v in views]
    session = NodeSession(store, comm, nodes, refs)
    if restore:
        leaders = {nodes.leader(n) for n in range(len(nodes.names))}
        gathered: list[dict[str, Any]] = [
            {"view": [[g, r, n, _shards(held, int(n))] for g, r, n, held in v["view"]]}
            if rank in leaders
            else {"view": []}
            for rank, v in enumerate(views)
        ]
        session.gathered = (run, gathered, all(v["caught_up"] for v in views))
    return session


def _ranges(shards: Sequence[int], world_size: int) -> list[list[int]]:
    """Shard indices as ``[first, last]`` runs, the last wrapping round to the first
    (``first > last``: from ``first`` to the end, then from 0 to ``last``): a node holds
    its own ranks' shards and, with peer copies, the previous nodes', so the first
    node's two runs are one."""
    runs: list[list[int]] = []
    for shard in sorted(int(s) for s in shards):
        if runs and runs[-1][1] == shard - 1:
            runs[-1][1] = shard
        else:
            runs.append([shard, shard])
    if len(runs) > 1 and runs[0][0] == 0 and runs[-1][1] == world_size - 1:
        runs[0][0] = runs.pop()[0]
    return runs


def _shards(ranges: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """The shard indices :func:`_ranges` wrote, sorted."""
    found: list[int] = []
    for first, last in ranges:
        first, last = int(first), int(last)
        if first <= last:
            found.extend(range(first, last + 1))
        else:
            found.extend([*range(first, world_size), *range(0, last + 1)])
    return sorted(found)


class NodeSession:
    """One collective save or load of a tiered store whose ranks span several nodes."""

    def __init__(
        self,
        store: TieredStore,
        comm: Group,
        nodes: NodeMap,
        refs: list[tuple[int, bytes] | None],
    ) -> None:
        self.store = store
        self.fast = store.fast
        self.comm = comm
        self.nodes = nodes
        self.refs = refs  # each rank's view of its node's ref of the run, at the start
        self.replicas = store.replicas
        self.read_backend: TieredChunkBackend | None = None
        # From the coordinator's choice (agree_candidates), the same on every rank: the
        # roots every node lists (its root and manifests are there), and those of them
        # every node holds whole (each rank's chunks are on its node).
        self.listed_everywhere: set[bytes] = set()
        self.whole_everywhere: set[bytes] = set()
        self.reading: bytes | None = None  # the root of the last seed: the one read next
        # A restore's discovery (discover(restore=True)): the run, each rank's view as
        # _views gathers them (the leaders'), and whether every fast tier took the
        # durable tier's newest generation at its open.
        self.gathered: tuple[str, list[dict[str, Any]], bool] | None = None

    # -- save ------------------------------------------------------------------

    def catch_up(self, run: str) -> None:
        """Bring every node's ref of ``run`` to the newest any node has (step 1 above)."""
        newest = max((r for r in self.refs if r is not None), default=None)
        if newest is None:
            return
        behind = [
            n for n in range(len(self.nodes.names)) if self.refs[self.nodes.leader(n)] != newest
        ]
        if not behind:
            return
        source = next(r for r, ref in enumerate(self.refs) if ref == newest)
        objects = self._spread(Digest(newest[1]), source, "save: catch up")

        def advance() -> None:
            if self.nodes.my_node not in behind or not self.nodes.is_leader:
                return
            root = root_among(objects, Digest(newest[1]))
            mine = self.refs[self.comm.rank]
            self._advance_node_ref(run, root, Digest(newest[1]), mine, held=[])

        _, failure = attempt(advance)
        outcomes = self.comm.all_gather({"error": describe(failure)}, "save: catch up")
        raise_failures(outcomes, self.comm, failure)

    def attest(self, shard_digest: bytes) -> bytes:
        """This rank's manifest bytes, after checking that its node holds every chunk it
        names (called under the node's save lock)."""
        data = self.fast.backend.get(Namespace.OBJECTS, shard_digest)
        found = [] if data is None else [bytes(data)]
        count_object_reads(len(found), sum(map(len, found)))
        if not found or digest_bytes(found[0]) != shard_digest:
            raise CorruptObjectError(
                "this rank's shard manifest is not intact in its node's fast tier",
                rank=self.comm.rank,
            )
        manifest = decode_shard(found[0])
        chunks = sorted(set(manifest.chunk_digests()))
        present = self.fast.backend.has_many(Namespace.CHUNKS, chunks)
        for chunk, here in zip(chunks, present, strict=True):
            if not here:
                raise ChunkMissingError(
                    f"this rank's shard names chunk {chunk.hex()[:16]}, which its node's fast "
                    "tier does not hold",
                    rank=self.comm.rank,
                )
        return found[0]

    def replicate(self, acks: list[dict[str, Any]]) -> None:
        """Peer copies (step 3): a collective call; raises on every rank if any failed."""
        if self.replicas < 2:
            return
        me = self.comm.rank
        sources = [r for r in range(self.comm.world_size) if me in self.nodes.partners(r, 2)]
        sources += [
            r
            for r in range(self.comm.world_size)
            if r not in sources and me in self.nodes.partners(r, self.replicas)
        ]
        wanted: dict[int, list[bytes]] = {}

        def ask() -> dict[int, bytes]:
            for source in sources:
                manifest = decode_shard(bytes(acks[source]["manifest"]))
                chunks = sorted(set(manifest.chunk_digests()))
                present = self.fast.backend.has_many(Namespace.CHUNKS, chunks)
                wanted[source] = [c for c, here in zip(chunks, present, strict=True) if not here]
            return {s: b"".join(keys) or b"\0" for s, keys in wanted.items()}

        asks, failure = attempt(ask)
        requests = self.comm.exchange(asks or {}, "save: peer copies (ask)")
        replies: dict[int, bytearray] = {}
        if failure is None:
            _, failure = attempt(lambda: replies.update(self._serve(requests)))
        received = self.comm.exchange(replies, "save: peer copies (send)")
        if failure is None:
            _, failure = attempt(lambda: self._take(wanted, received))
        outcomes = self.comm.all_gather({"error": describe(failure)}, "save: peer copies")
        raise_failures(outcomes, self.comm, failure)

    def _serve(self, requests: dict[int, bytes]) -> dict[int, bytearray]:
        """Each requester's chunks from this node's fast tier, framed (length, bytes)."""
        replies = {}
        for peer, data in requests.items():
            if peer == self.comm.rank or data == b"\0":
                continue
            keys = [data[i : i + 32] for i in range(0, len(data), 32)]
            replies[peer] = frame(self._read_local(keys))
        return replies

    def _take(self, wanted: dict[int, list[bytes]], received: dict[int, bytes]) -> None:
        """Verify and write the chunks the partners sent."""
        for source, keys in wanted.items():
            if not keys:
                continue
            values = unframe(received.get(source, b""), len(keys))
            items = []
            for key, value in zip(keys, values, strict=True):
                if value is None or not stored_matches(key, value):
                    raise ChunkMissingError(
                        f"rank {source} did not send an intact copy of chunk {key.hex()[:16]}",
                        rank=self.comm.rank,
                    )
                items.append((key, value))
            self.fast.backend.put_many(Namespace.CHUNKS, items)

    def _read_local(self, keys: Sequence[bytes]) -> list[bytes | None]:
        present = self.fast.backend.has_many(Namespace.CHUNKS, list(keys))
        asked = [k for k, here in zip(keys, present, strict=True) if here]
        got: dict[bytes, bytes] = {}

        def keep(values: Any) -> None:
            for key, value in zip(asked, values, strict=True):
                if value is not None:
                    got[key] = bytes(value)

        if asked:
            self.fast.backend.read_many(Namespace.CHUNKS, asked, keep)
        return [got.get(bytes(k)) for k in keys]

    def held(self) -> list[int]:
        """The saved ranks whose shards this node holds after this save."""
        return self.nodes.held_by(self.nodes.my_node, self.replicas)

    def record_holdings(self, run: str, generation: int, root: Digest) -> None:
        """The coordinator's node's holdings record, before its ref names the generation."""
        mark_elsewhere(Path(self.fast.path), run, generation, root, held=self.held())

    def publish_on_node(
        self, run: str, root_bytes: bytes, acks: list[dict[str, Any]], parent: tuple | None
    ) -> None:
        """Step 4 on a node other than the coordinator's: a collective call."""

        def publish() -> None:
            if not self.nodes.is_leader or self.nodes.my_node == self.nodes.index(
                self.comm.coordinator
            ):
                return
            digest = Digest(digest_bytes(root_bytes))
            root = decode_root(root_bytes)
            commit_objects(
                self.fast,
                [(bytes(a["shard"]), bytes(a["manifest"])) for a in acks]
                + [(digest.raw, root_bytes)],
            )
            mine = None if parent is None else (int(parent[0]), bytes(parent[1]))
            self._advance_node_ref(run, root, digest, mine, held=self.held())

        _, failure = attempt(publish)
        outcomes = self.comm.all_gather({"error": describe(failure)}, "save: publish on nodes")
        raise_failures(outcomes, self.comm, failure)

    def _advance_node_ref(
        self,
        run: str,
        root: GenerationRoot,
        digest: Digest,
        mine: tuple[int, bytes] | None,
        held: list[int],
    ) -> None:
        """Advance this node's ref from ``mine`` to ``root``; its parent logged absent here
        when this node does not list it; the holdings record written first."""
        refs = self.fast.refs
        if root.parent is not None and (mine is None or mine[1] != root.parent):
            listed, collected = self.fast.logged(run)
            parent = Digest(root.parent)
            if parent.hex not in listed and parent.hex not in collected:
                with refs.locked(run):
                    refs.record_collected(run, root.generation - 1, parent)
        mark_elsewhere(Path(self.fast.path), run, root.generation, digest, held=held)
        fault_point("tiers.node_before_ref_advance")
        new = fencing.ref_for_root(digest, root)
        refs.advance(run, expected=None if mine is None else Digest(mine[1]), new=new)
        fencing.record_published(refs, run, new)

    # -- objects over the group -----------------------------------------------

    def _spread(self, root: Digest, source: int, phase: str) -> list[tuple[bytes, bytes]]:
        """The root and shard manifests of ``root``, from rank ``source`` to every rank."""
        message: dict[str, Any] = {}
        failure = None
        if self.comm.rank == source:
            found, failure = attempt(lambda: self._objects_of(root))
            message = {"error": describe(failure), "objects": found or []}
        message = self.comm.broadcast(message, phase, source=source)
        raise_failures([message], self.comm, failure if self.comm.rank == source else None)
        objects = [(bytes(k), bytes(v)) for k, v in message["objects"]]
        for key, value in objects:
            if digest_bytes(value) != key:
                raise CorruptObjectError(
                    f"rank {source} sent object {key.hex()[:16]} with other bytes",
                    rank=self.comm.rank,
                )
        missing = [
            item
            for item, here in zip(
                objects,
                self.fast.backend.has_many(Namespace.OBJECTS, [k for k, _ in objects]),
                strict=True,
            )
            if not here
        ]
        if missing:
            self.fast.backend.put_many(Namespace.OBJECTS, missing)
        return objects

    def _objects_of(self, root: Digest) -> list[tuple[bytes, bytes]]:
        keys = [root.raw]
        root_bytes = read_objects(self.fast.backend, keys)[0]
        decoded = decode_root(root_bytes)
        shards = [bytes(s) for s in decoded.shards]
        return [
            (root.raw, root_bytes),
            *zip(shards, read_objects(self.fast.backend, shards), strict=True),
        ]

    # -- restore ---------------------------------------------------------------

    def agree_candidates(
        self, run: str, below: int | None, *, newest_only: bool = False
    ) -> list[tuple[int, Digest]]:
        """The generations complete in the fast tier (by the live nodes' holdings) or in
        the durable one, newest first; decided by the coordinator (a collective call).

        ``newest_only`` (a restore of the newest generation with no fallback: only the
        first is read): when the discovery gathered the views and the newest generation
        any node lists is complete in the fast tiers, every rank chooses it alike, with
        no round and without reading the durable tier (whose newest every fast tier took
        at its open), and the list is that one generation."""
        views = self._views(run)
        if newest_only and below is None:
            newest = self._newest_here(run, views)
            if newest is not None:
                return [newest]
        message: dict[str, Any] = {}
        failure = None
        if self.comm.is_coordinator:
            chosen, failure = attempt(lambda: self._choose(run, views, below))
            listed, whole = self._everywhere(views)
            # Per candidate: 2 every node holds it whole, 1 every node lists it, else 0.
            levels = [
                2 if bytes(d) in whole else 1 if bytes(d) in listed else 0 for _, d in chosen or []
            ]
            message = {"error": describe(failure), "candidates": chosen or [], "here": levels}
        message = self.comm.broadcast(message, "load: candidates")
        raise_failures([message], self.comm, failure if self.comm.is_coordinator else None)
        found = [(int(g), Digest(bytes(d))) for g, d in message["candidates"]]
        levels = message.get("here") or [0] * len(found)
        self.listed_everywhere = {d.raw for (_, d), n in zip(found, levels, strict=True) if n}
        self.whole_everywhere = {d.raw for (_, d), n in zip(found, levels, strict=True) if n == 2}
        return found

    def _newest_here(self, run: str, views: list[dict[str, Any]]) -> tuple[int, Digest] | None:
        """The newest generation any node lists, when the discovery's views show it
        complete in the fast tiers and every fast tier caught up with the durable one;
        else None. From what every rank holds alike: the same on every rank."""
        if self.gathered is None or self.gathered[0] != run or not self.gathered[2]:
            return None
        listed = [(int(g), bytes(r)) for m in views for g, r, _, _ in m["view"]]
        if not listed:
            return None
        gen, root = max(listed)
        if self._covered(run, views).get(gen) != root:
            return None  # not whole in the fast tiers (or two roots): the coordinator's choice
        everywhere, whole = self._everywhere(views)
        self.listed_everywhere = {root} & everywhere
        self.whole_everywhere = {root} & whole
        return gen, Digest(root)

    def _everywhere(self, views: list[dict[str, Any]]) -> tuple[set[bytes], set[bytes]]:
        """The roots every node's view lists, and those every node holds every shard of."""
        listed: set[bytes] | None = None
        whole: set[bytes] | None = None
        for node in range(len(self.nodes.names)):
            view = views[self.nodes.leader(node)]["view"]
            here = {bytes(root) for _, root, _, _ in view}
            full = {
                bytes(root)
                for _, root, world_size, shards in view
                if sorted(int(s) for s in shards) == list(range(int(world_size)))
            }
            listed = here if listed is None else listed & here
            whole = full if whole is None else whole & full
        return listed or set(), whole or set()

    def _views(self, run: str) -> list[dict[str, Any]]:
        """Every node leader's generations of ``run`` and the shards it holds of each (a
        collective call, unless the discovery gathered them)."""
        if self.gathered is not None and self.gathered[0] == run:
            return self.gathered[1]
        view: list[list[Any]] = []
        failure = None
        if self.nodes.is_leader:
            view, failure = attempt(lambda: self._view(run))
        views = self.comm.all_gather(
            {"error": describe(failure), "view": view or []}, "load: tiers"
        )
        raise_failures(views, self.comm, failure)
        return views

    def _view(self, run: str) -> list[list[Any]]:
        """This node's generations of ``run``: id, root, saved world size, held shards."""
        return node_view(self.fast, run)

    def _covered(self, run: str, views: list[dict[str, Any]]) -> dict[int, bytes]:
        """The generations whose saved shards the nodes' holdings cover together."""
        return covered_generations(run, [message["view"] for message in views])

    def _choose(self, run: str, views: list[dict[str, Any]], below: int | None) -> list[list[Any]]:
        found = restore_candidates(
            run, [message["view"] for message in views], self.store.durable, below
        )
        return [[gen, root] for gen, root in found]

    def recovery_points(self, run: str) -> dict[str, float]:
        """Seconds since the newest generation the nodes' fast tiers hold whole together,
        and since the durable tier's newest (a collective call; the same on every rank)."""
        views = self._views(run)
        message: dict[str, Any] = {}
        failure = None
        if self.comm.is_coordinator:

            def ages() -> dict[str, float]:
                now, found = time.time(), {}
                fast = self._covered(run, views)
                if fast:
                    gen, digest = max(fast.items())
                    found["fast"] = now - self.fast.read_root(Digest(digest), run=run).time
                durable = self.store.durable
                newest = durable.refs.read(run) if run in durable.runs() else None
                if newest is not None:
                    found["durable"] = now - newest.time
                return found

            found, failure = attempt(ages)
            message = {"error": describe(failure), "ages": found or {}}
        message = self.comm.broadcast(message, "tiers: recovery points")
        raise_failures([message], self.comm, failure if self.comm.is_coordinator else None)
        return {str(k): float(v) for k, v in message["ages"].items()}

    def seed(self, run: str, root: Digest) -> None:
        """Give every node the root and manifests of ``root`` if one lacks them."""
        self.reading = root.raw
        if root.raw in self.listed_everywhere:
            return  # every node lists it (agree_candidates): its objects are everywhere
        has, failure = attempt(lambda: self._holds_objects(root))
        answers = self.comm.all_gather(
            {"error": describe(failure), "has": bool(has)}, "load: objects"
        )
        raise_failures(answers, self.comm, failure)
        holders = [r for r, a in enumerate(answers) if a["has"]]
        if not holders or len(holders) == self.comm.world_size:
            return  # everyone has them, or they come from the durable tier
        self._spread(root, holders[0], "load: objects")

    def _holds_objects(self, root: Digest) -> bool:
        backend = self.fast.backend
        if not backend.has_many(Namespace.OBJECTS, [root.raw])[0]:
            return False
        decoded = decode_root(read_objects(self.fast.backend, [root.raw])[0])
        return all(backend.has_many(Namespace.OBJECTS, [bytes(s) for s in decoded.shards]))

    def fetch(self, keys: list[bytes], *, recheck: bool = False) -> TieredChunkBackend:
        """The backend this rank's reads go through: its node's fast tier, the chunks the
        other nodes sent it, then the durable tier (a collective call).

        ``recheck``: hash this node's copies first, and fetch the damaged ones from
        elsewhere too (a retry after the ranks agreed that a read found damage).
        """
        peer = MemoryBackend()
        if not recheck and self.reading in self.whole_everywhere:
            # Every node holds every shard: nothing to ask the others (every rank skips
            # the exchange alike). A chunk that is not there after all fails the read as
            # missing, and the retry (recheck) asks the other nodes.
            self.read_backend = TieredChunkBackend(
                self.fast.backend, [("peer", peer), ("durable", self.store.durable.backend)]
            )
            return self.read_backend
        keys = list(dict.fromkeys(bytes(k) for k in keys))
        missing: list[bytes] = []
        distrust: set[bytes] = set()

        def find() -> None:
            here = self.fast.backend.has_many(Namespace.CHUNKS, keys) if keys else []
            held = [k for k, h in zip(keys, here, strict=True) if h]
            if recheck and held:
                values = self._read_local(held)
                distrust.update(
                    k
                    for k, v in zip(held, values, strict=True)
                    if v is None or not stored_matches(k, v)
                )
            missing.extend(k for k, h in zip(keys, here, strict=True) if not h or k in distrust)

        _, failure = attempt(find)
        wants = self.comm.all_gather(b"".join(missing), "load: chunks wanted")
        wanted = [[bytes(w[i : i + 32]) for i in range(0, len(w), 32)] for w in wants]
        if any(wanted):  # every rank sees the same wants: all skip the exchange, or none
            failure = self._from_peers(wanted, peer, failure)
        if failure is not None:
            raise failure
        self.read_backend = TieredChunkBackend(
            self.fast.backend,
            [("peer", peer), ("durable", self.store.durable.backend)],
            distrust=distrust,
        )
        return self.read_backend

    def _from_peers(
        self, wanted: list[list[bytes]], peer: MemoryBackend, failure: BaseException | None
    ) -> BaseException | None:
        """Put in ``peer`` the chunks other nodes send this rank of those it ``wanted``
        (a collective call); returns the failure to raise, this rank's first."""
        # Each node's leader says which wanted chunks of other nodes' ranks its node holds.
        offers: dict[int, bytes] = {}
        if self.nodes.is_leader and failure is None:
            offers, failure = attempt(lambda: self._offers(wanted))
        offered = self.comm.all_gather(
            {"error": describe(failure), "offers": offers or {}}, "load: chunks offered"
        )
        plan = self._assign(wanted, offered)
        replies: dict[int, bytearray] = {}
        for requester, keys_served in plan.get(self.comm.rank, {}).items():
            try:
                values = self._read_local(keys_served)
            except Exception:  # noqa: BLE001 - the requester reads them from the durable tier
                values = [None] * len(keys_served)
            replies[requester] = frame(values)
        received = self.comm.exchange(replies, "load: chunks from peers")
        for server, data in received.items():
            asked = [k for s, ks in self._served_to_me(plan) if s == server for k in ks]
            for key, value in zip(asked, unframe(data, len(asked)), strict=True):
                if value is not None:
                    peer.put_many(Namespace.CHUNKS, [(key, value)])
        return failure

    def _offers(self, wanted: list[list[bytes]]) -> dict[int, bytes]:
        """Which of the chunks other nodes' ranks want this node holds (one byte each)."""
        offers = {}
        for rank, asked in enumerate(wanted):
            if asked and self.nodes.index(rank) != self.nodes.my_node:
                offers[rank] = bytes(self.fast.backend.has_many(Namespace.CHUNKS, asked))
        return offers

    def _assign(
        self, wanted: list[list[bytes]], offered: list[dict[str, Any]]
    ) -> dict[int, dict[int, list[bytes]]]:
        """server rank -> requester rank -> the chunks it sends (the same on every rank)."""
        plan: dict[int, dict[int, list[bytes]]] = {}
        offers_by_node: dict[int, dict[int, bytes]] = {}
        for rank, message in enumerate(offered):
            if message.get("offers"):
                offers_by_node[self.nodes.index(rank)] = {
                    int(k): bytes(v) for k, v in message["offers"].items()
                }
        for requester, asked in enumerate(wanted):
            for position, key in enumerate(asked):
                holders = [
                    node
                    for node, table in sorted(offers_by_node.items())
                    if requester in table and table[requester][position]
                ]
                if not holders:
                    continue  # read from the durable tier
                spread = int.from_bytes(key[:4], "little")
                node = holders[(spread + requester) % len(holders)]
                ranks = self.nodes.ranks_on(node)
                server = ranks[spread % len(ranks)]
                plan.setdefault(server, {}).setdefault(requester, []).append(key)
        return plan

    def _served_to_me(self, plan: dict[int, dict[int, list[bytes]]]) -> list[tuple[int, list]]:
        return [
            (server, table[self.comm.rank])
            for server, table in sorted(plan.items())
            if self.comm.rank in table
        ]

    def sources(self) -> dict[str, int]:
        """The bytes each source served this rank's last fetch: fast, peer, durable."""
        if self.read_backend is None:
            return {}
        return dict(self.read_backend.served_chunk_bytes)

    # -- promotion -------------------------------------------------------------

    def after_save(self, run: str, generation: int, root: Digest, promote: bool) -> None:
        """Queue this node's collection and, when the generation is promoted, its upload
        (node leaders) and the durable publish (the coordinator)."""
        if self.nodes.is_leader:
            own = self.nodes.ranks_on(self.nodes.my_node)
            # Node i of N starts its upload stagger * i / N seconds late.
            delay = self.store.policy.durable_stagger_s * self.nodes.my_node / len(self.nodes.names)
            self.store.queue_node_work(run, generation, root, promote, own, delay=delay)
        if promote and self.comm.is_coordinator:
            self.store.queue_durable_publish(run, generation, root)
