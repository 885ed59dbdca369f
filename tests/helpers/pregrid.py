"""Write as castore did before the chunk grid: for tests of stores that hold both kinds.

Inside :func:`pre_grid_saves`, every save cuts each box's buffer every
``chunk_size`` bytes and records no grid (``castore.core.chunkio.leaf_cell``
answers None), so its shard manifests are format 2, byte for byte what a
castore before the grid wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from castore.core import chunkio


@contextmanager
def pre_grid_saves() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunkio, "leaf_cell", lambda leaf, chunk_size: None)
        yield
