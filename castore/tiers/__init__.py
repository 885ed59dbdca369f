"""Tiers: a fast node-local store in front of a durable one, with the Store API.

``castore.open_tiered(fast=PATH, durable=STORE_OR_ADDRESS, ...)`` returns a
:class:`TieredStore`: saves publish in the fast tier and never wait for the
durable one; a generation the policy selects is copied to the durable tier in
the background; reads take each chunk from the fast tier when it holds an
intact copy, else from a peer node or the durable tier. docs/TIERS.md is the
user's guide.

Where each part lives:

- :mod:`castore.tiers.opening`: ``open_tiered`` (options, both tiers opened);
- :mod:`castore.tiers.store`: ``TieredStore`` (history across the tiers, the
  hooks castore.dist calls, closing);
- :mod:`castore.tiers.policy`: ``TierPolicy``, what it selects, the pins;
- :mod:`castore.tiers.worker`: the background thread and its queue;
- :mod:`castore.tiers.promotion`: one promotion (``promote_generation``);
- :mod:`castore.tiers.staged`: a promoted generation's chunks sent from the
  async save's staging buffers, paced by the steps the job reports;
- :mod:`castore.tiers.pipe` and :mod:`castore.tiers.uploader`: the two ends
  of the uploader process that promotes outside the training process;
- :mod:`castore.tiers.report`: ``tier_report``, ``recovery_points``
  (``castore tiers``);
- :mod:`castore.tiers.nodes`, :mod:`castore.tiers.nodemap`,
  :mod:`castore.tiers.wire`: a job whose ranks span several nodes' fast
  tiers; :mod:`castore.tiers.selection`: which generation its restore selects.
"""

from __future__ import annotations

from castore.tiers.opening import open_tiered
from castore.tiers.policy import PIN_PREFIX, PUBLISH_PREFIX, TierPolicy
from castore.tiers.promotion import Promoted, promote_generation
from castore.tiers.report import TierRow, recovery_points, tier_report
from castore.tiers.store import TieredStore

__all__ = [
    "PIN_PREFIX",
    "PUBLISH_PREFIX",
    "Promoted",
    "TierPolicy",
    "TierRow",
    "TieredStore",
    "open_tiered",
    "promote_generation",
    "recovery_points",
    "tier_report",
]
