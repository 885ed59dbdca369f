"""The keywords every save takes, written once and checked once.

:meth:`castore.Store.save`, :func:`castore.dist.save` and
``castore.train.TrainState.save`` take the same keywords besides their own
(``metadata``, ``if_busy``, ``async_options``, ``trust_versions``,
``codec``, and ``blocking``): :class:`SaveKeywords` names them for their
signatures, and :class:`SaveOptions` carries them, checked, from the call to
the code that writes (the codec travels there as an argument; nothing sets
it on the caller's store handle or on the encoded state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from castore.core.background import AsyncOptions
from castore.format.codec import check_setting


class SaveKeywords(TypedDict, total=False):
    """The keywords of every save; each entry point adds its own."""

    metadata: dict[str, Any] | None
    if_busy: str
    async_options: AsyncOptions | None
    trust_versions: bool
    codec: str | None


@dataclass(frozen=True)
class SaveOptions:
    """How one save runs: :class:`SaveKeywords` and ``blocking``, checked."""

    blocking: bool = True
    metadata: dict[str, Any] | None = None
    if_busy: str = "wait"
    async_options: AsyncOptions = field(default_factory=AsyncOptions)
    trust_versions: bool = False
    codec: str | None = None  # None: the store handle's (Store.codec)

    def __post_init__(self) -> None:
        if self.blocking and self.if_busy != "wait":
            raise ValueError("if_busy applies to blocking=False saves; a blocking save waits")
        if self.trust_versions and not self.blocking:
            raise ValueError("trust_versions applies to blocking saves")
        if self.codec is not None:
            check_setting(self.codec)

    @classmethod
    def of(cls, call: str, blocking: bool, keywords: Mapping[str, Any]) -> SaveOptions:
        """The options ``call`` (``"save"``) was given; an unknown keyword is refused as
        Python refuses one, naming the call."""
        unknown = sorted(set(keywords) - set(SaveKeywords.__annotations__))
        if unknown:
            raise TypeError(f"{call}() got an unexpected keyword argument {unknown[0]!r}")
        return cls(
            blocking=blocking,
            metadata=keywords.get("metadata"),
            if_busy=keywords.get("if_busy", "wait"),
            async_options=keywords.get("async_options") or AsyncOptions(),
            trust_versions=keywords.get("trust_versions", False),
            codec=keywords.get("codec"),
        )
