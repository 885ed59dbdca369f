"""What a tiered store promotes and what each tier keeps: the policy, its schedule, its pins.

A generation the policy selects is pinned in the fast tier by a tag until its
promotion is done, so that fast-tier retention keeps it meanwhile and a later
handle finds what is still owed: ``promoting-ID`` (on several nodes, a node's
part of it), ``publishing-ID`` (on several nodes, the coordinator's durable
publish).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from castore.gc import RetentionPolicy

PIN_PREFIX = "promoting-"  # a node's part (or, on one node, all) of a promotion is owed
PUBLISH_PREFIX = "publishing-"  # several nodes: the coordinator's durable publish is owed
PINS = (PIN_PREFIX, PUBLISH_PREFIX)


@dataclass(frozen=True)
class TierPolicy:
    """Which generations go to the durable tier, and what each tier keeps."""

    durable_every: int | None = None  # every Nth generation id (id % N == 0)
    durable_every_s: float | None = None  # a generation once this long after the last promoted
    promote: Callable[[str, int], bool] | None = None  # overrides both
    fast_keep: int = 2
    durable_retention: RetentionPolicy | None = None
    durable_rate: float | None = None  # bytes per second, for this process's promotions
    promote_on_exit: bool = True
    replicas: int = 1  # copies of each shard in the fast tiers of a job on several nodes
    upload_wait_s: float = 600.0  # how long the coordinator waits for the nodes' uploads
    durable_stagger_s: float = 0.0  # node i of N starts its uploads this * i / N late
    # The fraction of each reported step's time the staged sends may use (castore.tiers.staged)
    durable_step_budget: float = 0.02

    def __post_init__(self) -> None:
        if self.durable_every is not None and self.durable_every < 1:
            raise ValueError(f"durable_every must be at least 1, got {self.durable_every!r}")
        if self.durable_every_s is not None and not self.durable_every_s >= 0:
            raise ValueError(f"durable_every_s must be >= 0, got {self.durable_every_s!r}")
        if not isinstance(self.fast_keep, int) or self.fast_keep < 1:
            raise ValueError(f"fast_keep must be at least 1, got {self.fast_keep!r}")
        if self.durable_rate is not None and not self.durable_rate > 0:
            raise ValueError(f"durable_rate must be positive, got {self.durable_rate!r}")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas!r}")
        if not self.durable_stagger_s >= 0:
            raise ValueError(f"durable_stagger_s must be >= 0, got {self.durable_stagger_s!r}")
        if not 0 < self.durable_step_budget <= 1:
            raise ValueError(
                f"durable_step_budget must be in (0, 1], got {self.durable_step_budget!r}"
            )
        if not self.upload_wait_s > 0:
            raise ValueError(f"upload_wait_s must be positive, got {self.upload_wait_s!r}")


class PromotionSchedule:
    """Whether a policy selects a generation; keeps when it last selected one by time."""

    def __init__(self, policy: TierPolicy) -> None:
        self.policy = policy
        self._last_promoted_at = time.monotonic()

    def selects(self, run: str, generation: int) -> bool:
        policy = self.policy
        if policy.promote is not None:
            return bool(policy.promote(run, generation))
        if policy.durable_every_s is not None:
            if time.monotonic() - self._last_promoted_at >= policy.durable_every_s:
                self._last_promoted_at = time.monotonic()
                return True
            return policy.durable_every is not None and generation % policy.durable_every == 0
        return generation % (policy.durable_every or 1) == 0
