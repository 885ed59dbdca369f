"""castore behind the checkpoint seams of training frameworks (each an optional extra).

- :mod:`castore.integrations.lightning`: a Lightning ``CheckpointIO`` plugin
  (extra ``castore[lightning]``).

Nothing here is imported by ``import castore``: each module imports its
framework, which must be installed.
"""
