"""What every layer may use: durable file writes, fault points, read-only mode, progress.

The bottom of the tree: modules here import nothing from castore but
:mod:`castore.errors` and each other, so the storage parts (``blob/``,
``chunkstore/``, ``repo/``) can use them without reaching up into the engine.
"""
