"""What the bytes mean, with no I/O: hashing, manifest objects, state trees, dtypes, layout.

Pure functions and plain values. Modules here import nothing from castore but
:mod:`castore.errors` and each other (``tests/test_layers.py`` keeps it so).
"""
