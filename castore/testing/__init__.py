"""Contract suites: reusable pytest classes that every backend of castore must pass.

One class per interface. Subclass it in a test module, override its fixture
to build a fresh, empty implementation, and pytest runs every contract test
against it::

    from castore.repo.memory import MemoryLocks, MemoryRefTable
    from castore.testing import RefTableTests

    class TestMemoryRefs(RefTableTests):
        @pytest.fixture
        def refs(self):
            return MemoryRefTable(MemoryLocks())

=========================  =========  ==============================================
suite                      fixture    builds
=========================  =========  ==============================================
``RefTableTests``          ``refs``   a :class:`castore.repo.base.RefTable`
``ReflogTests``            ``reflog`` a :class:`castore.repo.base.Reflog`
``TagTableTests``          ``tags``   a :class:`castore.repo.base.TagTable`
``StoreLocksTests``        ``locks``  a :class:`castore.repo.base.StoreLocks`
``ChunkBackendTests``      ``backend`` a :class:`castore.chunkstore.base.ChunkBackend`
``StoreTests``             ``store``  a whole :class:`castore.Store` (end to end)
``BlobStoreTests``         ``blobs``  a :class:`castore.blob.base.BlobStore`
=========================  =========  ==============================================

Importing this package imports pytest; ``import castore`` never does.
"""

from castore.testing.blobs import BlobStoreTests
from castore.testing.chunks import ChunkBackendTests
from castore.testing.locks import StoreLocksTests
from castore.testing.reflog import ReflogTests
from castore.testing.refs import RefTableTests
from castore.testing.store import StoreTests
from castore.testing.tags import TagTableTests

__all__ = [
    "BlobStoreTests",
    "ChunkBackendTests",
    "RefTableTests",
    "ReflogTests",
    "StoreLocksTests",
    "StoreTests",
    "TagTableTests",
]
