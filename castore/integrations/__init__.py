"""castore behind the checkpoint seams of training frameworks (each an optional extra).

- :mod:`castore.integrations.lightning`: a Lightning ``CheckpointIO`` plugin
  (extra ``castore[lightning]``).
- :mod:`castore.integrations.huggingface`: a Hugging Face ``Trainer`` callback that
  stores each ``checkpoint-*`` directory, and ``restore_checkpoint`` to resume
  from one (extra ``castore[transformers]``).
- :mod:`castore.integrations.accelerate`: Accelerate's ``save_state``/``load_state``
  into castore (extra ``castore[accelerate]``).
- :mod:`castore.integrations.checkpoint_dirs`: the shared part of the last two, a
  framework's checkpoint directory as one generation and back.

Nothing here is imported by ``import castore``: each module imports its
framework, which must be installed.
"""
