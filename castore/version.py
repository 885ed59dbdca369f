"""The castore version, in a module of its own: the engine records it in every
root without importing the package (which would run the whole public API).

pyproject.toml declares the same version for the distribution.
"""

__version__ = "0.1.0"
