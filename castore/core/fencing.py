"""One writer per run: writer epochs, the step rule, and who wrote a generation.

Two copies of a job saving to one run used to interleave silently ("latest"
was whoever wrote last, possibly a lower step). In a cluster that is the
zombie job: the scheduler restarts a job whose old processes, on a
partitioned node, still run and still save. castore fences it the way
replicated systems fence a stale leader:

* **Epochs.** A run's ref records the *writer epoch* it was published under
  (0 for refs written before epochs), and each root records its writer
  (host, pid, job, epoch). A process that starts saving a run *claims* it:
  its first save, and its first save after it loaded (resumed) the run,
  publishes with the ref's epoch + 1; its later saves carry that epoch.
  The ref's compare-and-swap refuses an epoch lower than the ref's
  (:class:`~castore.errors.FencedError`), so once a newer job has saved, every
  save of the older one publishes nothing. The newest claim wins.
* **Steps.** A save whose step is lower than the step of the run's latest
  generation is refused (:class:`~castore.errors.StepOrderError`) unless this
  process resumed from an earlier point: it loaded or saved a generation of
  the run whose step is at most the new one. :meth:`Store.claim_run` lifts
  the rule for the next save, and claims the run anew.
* **Warnings.** A save that finds the run advanced by another writer since
  this process last loaded or saved it warns
  (:class:`~castore.errors.ConcurrentWriterWarning`), naming that writer.
  "Since" is by generation id: a load records the newest generation the run's
  ref named when the load began, so the generations a crashed job published
  after the one this process resumed from (a checkpoint older than the run's
  newest, a tiers restore that picked an older complete generation) are
  history it resumed over, not another writer; a zombie that publishes after
  the load is.

The common case, one job resumed after a crash, needs nothing: the restarted
job loads the latest generation, and its first save claims the run. A job that
never loads (a zombie training on) keeps its old epoch, and is fenced.

What a process knows of a run is kept per process (every thread and store
handle in it shares it: they are one writer), keyed by the store's identity
and the run; a forked child starts with nothing.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from castore.errors import CastoreError, ConcurrentWriterWarning, FencedError, StepOrderError
from castore.format.hashing import Digest
from castore.format.objects import GenerationRoot
from castore.repo.records import RefValue, Writer

# Where a job's identity comes from, first found wins: castore's own, then schedulers'.
JOB_VARIABLES = (
    "CASTORE_JOB_ID",
    "SLURM_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "PBS_JOBID",
    "LSB_JOBID",
)


class Identified(Protocol):
    """What the per-process record needs of a store's refs: a name for the store."""

    @property
    def identity(self) -> str: ...


class ReadsRefs(Identified, Protocol):
    """A store's refs that can also say what a run's ref names now."""

    def read(self, run: str) -> RefValue | None: ...


def job_identity() -> str | None:
    """The job this process belongs to, as ``VARIABLE=value`` (None: no scheduler said)."""
    for name in JOB_VARIABLES:
        value = os.environ.get(name)
        if value:
            return f"{name}={value}"
    return None


def this_writer() -> Writer:
    return Writer(socket.gethostname(), os.getpid(), job_identity())


def root_writer(epoch: int) -> dict[str, Any]:
    """The ``writer`` field of a root this process publishes under ``epoch``."""
    writer = this_writer()
    record: dict[str, Any] = {"epoch": epoch, "host": writer.host, "pid": writer.pid}
    if writer.job:
        record["job"] = writer.job
    return record


def writer_of_root(record: dict[str, Any]) -> Writer | None:
    """A root's ``writer`` field as the ref's Writer (None when it names none)."""
    host, pid, job = record.get("host"), record.get("pid"), record.get("job")
    if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool):
        return None
    return Writer(host, pid, job if isinstance(job, str) else None)


def ref_for_root(digest: Digest, root: GenerationRoot) -> RefValue:
    """The ref value that publishes ``root``: its step, and the epoch and writer it records."""
    return RefValue(
        root.run,
        root.generation,
        digest,
        root.time,
        step=root.step,
        epoch=root.epoch,
        writer=writer_of_root(root.writer),
    )


@dataclass
class _Known:
    """What this process knows of one run of one store."""

    epoch: int | None = None  # the epoch it claimed (None: it has not published)
    root: Digest | None = None  # the generation it last loaded or published
    step: int | None = None  # that generation's step
    seen: int | None = None  # the newest generation id of the run it knew of then
    claim_anew: bool = False  # claim_run(): the next save claims again, steps unchecked


_LOCK = threading.Lock()
_KNOWN: dict[tuple[str, str], _Known] = {}
_OWNER = [os.getpid()]


def _known(refs: Identified, run: str) -> _Known:
    """The record of ``run`` (the caller holds _LOCK); a forked child forgets its parent's."""
    if _OWNER[0] != os.getpid():
        _KNOWN.clear()
        _OWNER[0] = os.getpid()
    return _KNOWN.setdefault((refs.identity, run), _Known())


def claim_run(refs: Identified, run: str) -> None:
    """This process owns ``run`` from its next save: see :meth:`castore.Store.claim_run`."""
    with _LOCK:
        _known(refs, run).claim_anew = True


def newest_published(refs: ReadsRefs, run: str) -> int | None:
    """The generation id ``run``'s ref names now, read as a load begins (None: no ref,
    or it cannot be read: the load then counts only what it loaded as seen)."""
    try:
        value = refs.read(run)
    except CastoreError:
        # Only a warning's accuracy rests on it; the load says what is wrong with the
        # ref if it needs it, and the save's compare-and-swap reads it again.
        return None
    return None if value is None else value.generation


def record_loaded(
    refs: Identified, run: str, root: Digest, step: int, *, generation: int, newest: int | None
) -> None:
    """This process loaded ``root`` (generation id ``generation``) of ``run``: it resumes
    the run from there.

    Its next save claims the run anew (a new epoch), and the step rule accepts
    any step from the loaded one's on. ``newest``: the generation id the run's
    ref named when the load began (:func:`newest_published`); the generations up
    to it were published before this process resumed, by whoever wrote them, so
    its next save does not take them for another writer's.
    """
    seen = max(generation, newest or 0)
    with _LOCK:
        known = _known(refs, run)
        known.root, known.step, known.epoch, known.seen = root, step, None, seen


def record_published(refs: Identified, run: str, value: RefValue) -> None:
    """This process advanced the ref of ``run`` to ``value``: it holds that epoch now."""
    with _LOCK:
        known = _known(refs, run)
        known.epoch, known.root, known.step = value.epoch, value.root, value.step
        known.seen = value.generation
        known.claim_anew = False


def writer_epoch(
    refs: Identified,
    run: str,
    parent: RefValue | None,
    step: int,
    latest_step: int | None,
    *,
    warn: bool = True,
) -> int:
    """The epoch a save of ``run`` at ``step`` publishes under, after the run's ref ``parent``.

    Raises FencedError when a newer writer has claimed the run since this
    process did, and StepOrderError when ``step`` is below ``latest_step`` (the
    step of ``parent``'s generation) and below every resume point this process
    knows. With ``warn``, says so when another writer advanced the run since
    this process last loaded or saved it. The compare-and-swap that publishes
    checks the epoch again (:func:`castore.repo.records.check_advance`).
    """
    with _LOCK:
        known = _Known(**vars(_known(refs, run)))
    current = parent.epoch if parent is not None else 0
    if known.claim_anew or known.epoch is None:
        epoch = current + 1
    elif current > known.epoch:
        assert parent is not None
        raise FencedError(
            f"run {run!r} was taken over by a newer writer: its ref names "
            f"{parent.describe_writer()}, and this process saves under writer epoch "
            f"{known.epoch}; nothing of step {step} is published. Another job saves to "
            "this run: stop this one, or call store.claim_run() first if it should own the run",
            run=run,
        )
    else:
        epoch = known.epoch
    if parent is None:
        return epoch
    if not known.claim_anew and latest_step is not None and step < latest_step:
        resumed = known.step is not None and step >= known.step
        if not resumed:
            raise StepOrderError(
                f"step {step} is below step {latest_step} of the latest generation of run "
                f"{run!r} ({parent.describe_writer()}): another job may be saving to this run. To "
                "resume the run, load it first; to restart it from a lower step on purpose, "
                "call store.claim_run() before saving; or save to a new run",
                run=run,
            )
    if warn and _advanced_by_another(known, parent):
        warnings.warn(
            f"castore: run {run!r} was advanced by another writer since this process last "
            f"loaded or saved it (when its newest generation was {known.seen}): "
            f"{parent.describe_writer()}. This save publishes under writer epoch {epoch}; "
            "an older writer's next save fails with FencedError",
            ConcurrentWriterWarning,
            stacklevel=4,
        )
    return epoch


def _advanced_by_another(known: _Known, parent: RefValue) -> bool:
    """Whether a writer other than this process published ``parent`` after this process
    last loaded or saved the run (nothing loaded or saved: a first claim, no warning)."""
    if known.root is None or parent.root == known.root:
        return False
    if known.seen is not None and parent.generation <= known.seen:
        return False  # published before this process resumed: the job it resumed, say
    # A thread of this process that published meanwhile is no other writer.
    me, them = this_writer(), parent.writer
    return not (them is not None and (them.host, them.pid) == (me.host, me.pid))
