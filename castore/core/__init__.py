"""The engine: chunk I/O, the publish sequence, reading and verification, history,
async staging and the background writer.

The engine stands below ``Store`` and everything that builds or uses one
(opening a store, the operations, the integrations): it imports only the
floors under it, which ``tests/test_layers.py`` checks (docs/DEVELOPMENT.md,
"Where things live").
"""
