"""The engine: chunk I/O, the publish sequence, reading and verification, history,
async staging and the background writer, opening a store by address.

The engine knows no operation (gc, verify, repair, copy, diff, export, import)
and no integration (dist, dcp, train, data, the CLI); ``tests/test_layers.py``
keeps it so.
"""
