"""The embedded backend: chunk bytes in append-only pack files, their index and the
manifests in one LMDB environment, all inside the store directory.

``backend`` (the ChunkBackend), ``packwriter`` (a new pack, and where a chunk
lies), ``packreader`` (chunks read from packs), ``env`` (opening the
environment), ``file`` (reading its header offline), ``index_check`` (the index
against the packs), ``rebuild`` (a fresh index from the packs) and ``compact``
(dead space out of packs and the LMDB file). Pack files themselves are
:mod:`castore.chunkstore.packfile`, shared with the packs kept as blobs.
"""
