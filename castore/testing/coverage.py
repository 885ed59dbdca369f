"""The coverage check as it was before issue 40: every pair of boxes compared.

The reference that ``tests/test_coverage.py`` holds the fast check
(``castore.core.reading.check_coverage``) against, and that
``benchmarks/bench_coverage.py`` times beside it. O(n^2) in a tensor's boxes;
it refuses exactly what the fast check must refuse, with the same messages
(an overlap may be named at another pair's offsets).
"""

from __future__ import annotations

from typing import Any

from castore.errors import CoverageError
from castore.format.layout import Box
from castore.format.objects import TensorEntry


def quadratic_check_coverage(boxes: list[TensorEntry], where: dict[str, Any]) -> None:
    """The boxes of one tensor must agree and cover it exactly once (every pair compared)."""
    first = boxes[0]
    name = first.name
    where = {**where, "tensor": name}
    for box in boxes:
        if box.shape != first.shape or box.dtype != first.dtype:
            raise CoverageError(
                f"boxes of tensor {name!r} disagree: {first.dtype}{list(first.shape)} vs "
                f"{box.dtype}{list(box.shape)}",
                **where,
            )
    spans = [Box(b.offsets, b.local_shape) for b in boxes]
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            overlap = a.intersect(b)
            if overlap is not None and overlap.numel:
                raise CoverageError(
                    f"boxes of tensor {name!r} overlap at offsets {list(overlap.offsets)}",
                    **where,
                )
    covered = sum(span.numel for span in spans)
    total = Box.whole(first.shape).numel
    if covered != total:
        raise CoverageError(
            f"boxes of tensor {name!r} cover {covered} of its {total} elements",
            **where,
        )
