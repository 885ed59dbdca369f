"""Capture one training update boundary and resume from it, with a stated claim.

:class:`TrainState` names everything the next update depends on: model
parameters and buffers by fully qualified name, optimizer state by parameter
name, LR scheduler, gradient scaler, every RNG stream of every rank, the
completed update number and the data cursor of a
:class:`~castore.data.ResumableDistributedSampler`. ``save`` writes it as one
castore generation (over torch.distributed when it is initialized, else as a
group of one) and records the data order in the root; ``load`` restores it
and says which claim holds:

- ``resume="exact"``: same rank count, dataset hash, sampler seed and
  accumulation; the resumed run replays the uninterrupted one bitwise.
- ``resume="continuation"``: any rank count; the sampler continues the epoch
  from the global consumed count, so every remaining sample is used once.

:func:`load_weights` loads only the model and is never a resume.

Saves happen at an optimizer-step boundary. Between accumulated microbatches
a save is refused (:class:`~castore.errors.SaveBoundaryError`) unless asked
for with ``mid_accumulation=True``: then every rank's partial gradients and
accepted-example count are saved too, and an exact resume completes that
same update.

Nothing is pickled: a value castore cannot encode is an
:class:`~castore.errors.UnsupportedValueError` naming where it is.

Lower-level pieces: ``capture_rng()`` / ``restore_rng()`` (Python's
``random``, NumPy's global state and named ``numpy.random.Generator`` objects,
torch CPU and every CUDA device) and ``optimizer_state_by_name()`` /
``load_optimizer_state_by_name()``.

Where each lives: :mod:`castore.train.state` (``TrainState``, ``Resumed``),
:mod:`castore.train.record` (the data-order record and the claim checks),
:mod:`castore.train.cursor` (counting examples, the sampler position),
:mod:`castore.train.rng`, :mod:`castore.train.optimizers` and
:mod:`castore.train.weights` (``load_weights``).
"""

from __future__ import annotations

from castore.errors import DataCursorWarning
from castore.train.cursor import examples_in, sampler_position
from castore.train.optimizers import load_optimizer_state_by_name, optimizer_state_by_name, unwrap
from castore.train.record import TRAIN_FORMAT
from castore.train.rng import RNG_VERSION, capture_rng, restore_rng
from castore.train.state import Resumed, TrainState
from castore.train.weights import WeightsLoaded, load_weights

__all__ = [
    "RNG_VERSION",
    "TRAIN_FORMAT",
    "DataCursorWarning",
    "Resumed",
    "TrainState",
    "WeightsLoaded",
    "capture_rng",
    "examples_in",
    "load_optimizer_state_by_name",
    "load_weights",
    "optimizer_state_by_name",
    "restore_rng",
    "sampler_position",
    "unwrap",
]
