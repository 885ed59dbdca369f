"""Which node each rank of a group is on, and which ranks hold copies of whose shards.

A *node* is the ranks that open the same fast directory (its node id,
castore.tiers.store). Nodes are ordered by their lowest rank, which leads its
node (writes its records, uploads its shards). With ``replicas=F`` a rank's
shard is also held by the rank of the same local index on each of the F-1
next nodes (the index wraps where a node has fewer ranks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeMap:
    """Which node each rank of a group is on (nodes ordered by their lowest rank)."""

    rank: int
    node_of: tuple[str, ...]  # the node id of each rank

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(self.node_of))

    def index(self, rank: int) -> int:
        return self.names.index(self.node_of[rank])

    def ranks_on(self, node: int) -> list[int]:
        name = self.names[node]
        return [r for r, n in enumerate(self.node_of) if n == name]

    def leader(self, node: int) -> int:
        return self.ranks_on(node)[0]

    @property
    def my_node(self) -> int:
        return self.index(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.leader(self.my_node) == self.rank

    @property
    def multi(self) -> bool:
        return len(self.names) > 1

    def partners(self, rank: int, replicas: int) -> list[int]:
        """The ranks that hold copies of ``rank``'s shard: the same local index on each of
        the next ``replicas - 1`` nodes (fewer when there are fewer nodes)."""
        count = len(self.names)
        node = self.index(rank)
        local = self.ranks_on(node).index(rank)
        found = []
        for step in range(1, min(replicas, count)):
            ranks = self.ranks_on((node + step) % count)
            found.append(ranks[local % len(ranks)])
        return found

    def held_by(self, node: int, replicas: int) -> list[int]:
        """The saved ranks whose shards ``node`` holds: its own and those it copies."""
        mine = set(self.ranks_on(node))
        for rank in range(len(self.node_of)):
            if any(self.index(p) == node for p in self.partners(rank, replicas)):
                mine.add(rank)
        return sorted(mine)
