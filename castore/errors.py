"""The castore exception tree.

Every error a user can hit is a :class:`CastoreError`; many also subclass the
builtin a caller would naturally catch (``FileNotFoundError``, ``LookupError``,
``ValueError``, ``TypeError``)::

    CastoreError
    ├── StoreError                       the store as a whole cannot be used
    │   ├── StoreNotFoundError           (FileNotFoundError) nothing at the path
    │   ├── NotAStoreError               the path is a file or a foreign directory
    │   ├── StoreLockedError             a lock could not be taken in time
    │   │   └── LockLostError            a lock was broken as stale before its holder wrote
    │   ├── StoreFullError               (OSError) the disk or the LMDB map is full
    │   ├── UnsafeStoreFileError         a store file is a symlink, pipe or other non-regular file
    │   ├── UnsupportedBackendError      (ValueError) a URL scheme or backend castore cannot open
    │   ├── StoreAccessDeniedError       (PermissionError) the object store refused the credentials
    │   ├── StoreUnavailableError        (ConnectionError) the endpoint is down or kept failing
    │   │   └── CommitUnknownError       a publish whose outcome could not be learned
    │   ├── ReadOnlyStoreError           (PermissionError) a write to a store opened read-only
    │   └── AllocationError              (MemoryError) a tensor too large to allocate
    ├── FormatVersionError               written by a newer castore format
    ├── IntegrityError                   stored bytes are not what was named
    │   ├── ChecksumMismatchError        digest of the bytes != the name
    │   ├── CodecError                   a compressed chunk's frame cannot be decoded safely
    │   │   └── UnknownCodecError        a codec this castore does not know (a newer one wrote it)
    │   ├── ObjectMissingError           a referenced object is absent
    │   │   └── ChunkMissingError        a referenced chunk is absent
    │   ├── CorruptObjectError           an object's bytes do not decode
    │   ├── CorruptRefError              a ref file is truncated or garbled
    │   ├── CoverageError                a tensor's boxes leave a gap, overlap or disagree
    │   ├── IndexCorruptError            the LMDB chunk index or its file is damaged
    │   ├── LostRunError                 a run has history (a reflog) but no ref
    │   ├── ExportMismatchError          an exported file is not what its statement or root says
    │   └── NoValidGenerationError       a fallback found no generation that validates
    ├── DistributedError                 a multi-rank save or load failed as a group
    │   ├── RankFailedError              another rank failed (names the rank)
    │   ├── CollectiveError              the group stopped answering (a rank died)
    │   │   └── CollectiveTimeoutError   no answer within the timeout
    │   ├── LayoutMismatchError          ranks or targets disagree with the saved layout
    │   ├── ReplicaMismatchError         a value passed as replicated differs between ranks
    │   └── RankLocalMismatchError       per-rank state asked of a different world size
    ├── RefConflictError                 the ref moved under a compare-and-swap
    │   ├── BlobConflictError            a blob's version moved under a compare-and-swap
    │   └── FencedError                  a newer writer (epoch) took the run over
    ├── StepOrderError                   (ValueError) a save's step below the run's latest
    ├── BlobError                        a blob primitive was refused
    │   ├── BlobNotFoundError            (FileNotFoundError) no blob of that name
    │   ├── BlobExistsError              (FileExistsError) a create-if-absent found one
    │   ├── BlobRangeError               (IndexError) a byte range outside the blob
    │   └── BlobTooLargeError            a mutable blob larger than any swap writes
    ├── UnsupportedOperationError        (NotImplementedError) this backend cannot do that
    ├── GenerationNotFoundError          (LookupError) no such run or generation
    ├── TensorNotFoundError              (LookupError) no such tensor in a generation
    ├── InvalidNameError                 (ValueError) an unsafe run or tag name, a bad RUN@GEN
    ├── InvalidIndexError                (IndexError) a bad read_slice index
    ├── NotAPointerError                 (ValueError) a checkpoint path without castore's pointer
    ├── UnsupportedValueError            (TypeError) a value castore cannot encode
    │   ├── UnsupportedPlacementError    a DTensor laid out in a way castore cannot hold as boxes
    │   └── ImportSourceError            (ValueError) a source to import is missing or unsafe
    ├── SaveBoundaryError                (RuntimeError) a save from where no resume can start
    ├── ResumeMismatchError              (ValueError) a resume whose claim cannot hold
    ├── AmendError                       (ValueError) an amend that cannot be made as asked
    ├── StatementError                   (ValueError) an export's statement is missing or malformed
    ├── GcAbortedError                   garbage collection stopped before deleting anything
    ├── SaveAborted                      the background writer failed while staging went on
    └── InjectedFault                    a test's fault point switched to ``raise``

Every warning castore gives is a :class:`CastoreWarning` (a ``UserWarning``)::

    CastoreWarning
    ├── ReadOnlyWarning                  a store opened read-only: its directory is not writable
    ├── ConcurrentWriterWarning          a save found its run advanced by another writer
    ├── FallbackWarning                  a fallback load skipped generations that did not validate
    ├── DurabilityWarning                a ref or tag replaced, but its directory not synced
    ├── ReflogWarning                    a generation published without its reflog record
    ├── LeaseWarning                     a store lease found broken when let go
    ├── LeaseLostWarning                 a run lease taken over while held
    ├── CacheWarning                     the per-node index cache could not be used
    └── DataCursorWarning                examples counted short of what the sampler handed out

Errors carry their context as attributes (``run``, ``generation``, ``tensor``,
``expected``/``actual`` digests) and put it in their message, so one line says
what was wrong and where.
"""

from __future__ import annotations

from typing import Any


class CastoreError(Exception):
    """Base of every error castore raises on purpose."""

    def __init__(self, message: str, **context: Any) -> None:
        self.message = message
        self.context = {k: v for k, v in context.items() if v is not None}
        for key, value in context.items():
            setattr(self, key, value)
        where = ", ".join(f"{k}={v}" for k, v in self.context.items() if k not in _UNSHOWN)
        super().__init__(f"{message} ({where})" if where else message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle-able whatever a subclass's constructor takes (DCP gathers errors by pickle).
        return (_rebuild, (type(self), self.message, self.context))

    @classmethod
    def from_remote(cls, message: str, **context: Any) -> CastoreError:
        """The same error type, rebuilt on another rank from its message.

        Subclasses' own constructors take extra fields; this bypasses them so a
        rank can raise exactly the type another rank raised.
        """
        error = cls.__new__(cls)
        CastoreError.__init__(error, message, **context)
        return error


def _rebuild(cls: type[CastoreError], message: str, context: dict[str, Any]) -> CastoreError:
    error = cls.__new__(cls)
    CastoreError.__init__(error, message, **context)
    return error


# Context keys that are already spelled out in the message.
_UNSHOWN = frozenset({"expected", "actual", "key_path", "hint", "differences", "unsent"})


class StoreError(CastoreError):
    """The store as a whole cannot be opened or used."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No store exists at the path and creation was not requested."""


class NotAStoreError(StoreError):
    """The path exists but is a file or a directory castore did not create."""


class UnsupportedBackendError(StoreError, ValueError):
    """The store's address or marker names a backend this castore cannot open."""


class StoreAccessDeniedError(StoreError, PermissionError):
    """The object store refused the request's credentials (unknown key, bad signature, 403)."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The endpoint cannot be reached, or kept answering 5xx/throttling past the retries.

    ``unsent`` is True only when the store can prove that no attempt's request
    reached the endpoint (every connection refused or timed out connecting), so
    a write it asked for did not happen and never will; a timeout or a broken
    connection after the request went out proves nothing of the kind.
    """

    unsent: bool = False


class CommitUnknownError(StoreUnavailableError):
    """A publish whose commit request failed ambiguously, and re-reading the ref could
    not tell whether it took effect (it could not be read, or it still named the
    previous generation while a slow server may apply the write later): check
    ``castore log`` before saving again."""


class ReadOnlyStoreError(StoreError, PermissionError):
    """A write (save, tag, GC, repair) to a store opened read-only; names the store.

    ``store`` names it, ``refused`` what was refused (``"save"``).
    """

    store: str
    refused: str

    @classmethod
    def refusing(cls, store: str, why: str, what: str, hint: str = "") -> ReadOnlyStoreError:
        """The error for ``what`` refused on ``store``, read-only because ``why``."""
        tail = f"; {hint}" if hint else ""
        error = cls(f"store {store} is open read-only ({why}): {what} refused{tail}")
        error.store, error.refused = store, what
        return error


class CastoreWarning(UserWarning):
    """Base of every warning castore gives."""


class ReadOnlyWarning(CastoreWarning):
    """A store was opened read-only on its own: its directory is not writable."""


class StoreLockedError(StoreError):
    """A lock on the store could not be taken within the timeout."""


class StoreFullError(StoreError, OSError):
    """The disk (or the LMDB map) is full; ``phase`` names what was being written.

    Nothing half-written is published: the last committed generation is intact.
    """


class UnsafeStoreFileError(StoreError):
    """A file or directory of the store is a symlink, a pipe or another non-regular file.

    castore never follows it (a store from an untrusted source must not make
    castore write outside it, or block on a pipe).
    """


class AllocationError(StoreError, MemoryError):
    """A tensor the manifest names is too large to allocate in this process."""


class FormatVersionError(CastoreError):
    """An object or store was written by a newer (or unknown) format version."""


class IntegrityError(CastoreError):
    """Stored bytes are not what the name or reference promised."""


class ChecksumMismatchError(IntegrityError):
    """The blake3 digest of the bytes read does not match their name."""

    def __init__(self, message: str, *, expected: str, actual: str, **context: Any) -> None:
        super().__init__(
            f"{message}: expected blake3 {expected[:16]}…, got {actual[:16]}…",
            expected=expected,
            actual=actual,
            **context,
        )


class CodecError(IntegrityError):
    """A chunk's stored frame (castore.format.codec) is damaged or hostile: it cannot be
    decoded safely."""


class UnknownCodecError(CodecError):
    """A chunk was stored with a codec this castore does not know (written by a newer one)."""


class ObjectMissingError(IntegrityError):
    """An object (manifest or root) named by a reference is not in the store."""


class ChunkMissingError(ObjectMissingError):
    """A chunk named by a tensor entry is not in the store."""


class CorruptObjectError(IntegrityError):
    """An object's bytes hash correctly but do not decode as the expected type."""


class CorruptRefError(IntegrityError):
    """A ref file is truncated, garbled or fails its checksum."""


class IndexCorruptError(IntegrityError):
    """The LMDB file holding the chunk index and the objects is damaged.

    ``castore repair`` rebuilds the chunk index from the pack files.
    """


class LostRunError(IntegrityError):
    """A run has durable history (a reflog or tags) but its ref file is gone."""


class CoverageError(IntegrityError):
    """A sharded tensor's boxes leave a gap, overlap, or disagree on shape or dtype."""


class ExportMismatchError(IntegrityError):
    """An exported file differs from what its statement says (a digest, a file missing or
    added) or from the generation it names (a header, a tensor's bytes): names the file
    and, where one is at fault, the tensor."""


class NoValidGenerationError(IntegrityError):
    """``fallback="previous"`` walked the whole history and nothing validated."""


class DistributedError(CastoreError):
    """A multi-rank save or load failed for the group as a whole."""


class RankFailedError(DistributedError):
    """Another rank of the group failed; its error is in the message."""


class CollectiveError(DistributedError):
    """A collective wait failed: a rank died or the group broke."""


class CollectiveTimeoutError(CollectiveError):
    """A collective wait got no answer from every rank within the timeout."""


class LayoutMismatchError(DistributedError):
    """Ranks disagree on a state's layout, or a target disagrees with what was saved."""


class ReplicaMismatchError(DistributedError):
    """A value every rank passes as replicated (a tensor without a Shard, a plain value),
    or a DTensor block that several ranks hold (its Replicate mesh dimensions), differs
    between ranks; nothing was published. ``keys``: the key paths that differ."""


class RankLocalMismatchError(DistributedError):
    """Per-rank state restored onto a different world size without a mapping."""


class LockLostError(StoreLockedError):
    """A holder kept a lock past its stale timeout; it was broken, and nothing was written."""


class RefConflictError(CastoreError):
    """A compare-and-swap ref advance found the ref moved since it was read."""


class BlobConflictError(RefConflictError):
    """A blob compare-and-swap found another version than expected (or a blob, or none)."""


class FencedError(RefConflictError):
    """The run was taken over by a newer writer (a higher writer epoch): this
    writer's save publishes nothing. The message names the other writer."""


class StepOrderError(CastoreError, ValueError):
    """A save's step is lower than the step of the run's latest generation, which
    this process neither loaded nor saved (``allow_step_back=True`` allows it)."""


class ConcurrentWriterWarning(CastoreWarning):
    """A save found its run advanced by another writer since this process last
    loaded or saved it; the message names that writer (castore.core.fencing)."""


class BlobError(CastoreError):
    """A blob primitive (castore.blob) was refused; ``name`` says which blob."""


class BlobNotFoundError(BlobError, FileNotFoundError):
    """No blob of that name."""


class BlobExistsError(BlobError, FileExistsError):
    """A create-if-absent found the blob already there; its content is unchanged."""


class BlobRangeError(BlobError, IndexError):
    """A byte range that is inverted, negative, or reaches past the blob's end."""


class BlobTooLargeError(BlobError):
    """A blob read as mutable is larger than any compare-and-swap writes."""


class UnsupportedOperationError(CastoreError, NotImplementedError):
    """The store's backend cannot do this (a path to a reflog file of a store in memory)."""


class GenerationNotFoundError(CastoreError, LookupError):
    """The run or the requested generation does not exist."""


class TensorNotFoundError(CastoreError, LookupError):
    """A generation has no tensor of that name."""


class InvalidNameError(CastoreError, ValueError):
    """A run or tag name is empty, too long, or contains unsafe characters; a tag
    name ``RUN@NAME`` could not address; a ``RUN@GEN`` address with nothing after ``@``."""


class InvalidIndexError(CastoreError, IndexError):
    """A ``read_slice`` index is malformed or out of bounds."""


class NotAPointerError(CastoreError, ValueError):
    """A checkpoint path a framework integration reads (castore.integrations) holds
    something other than castore's pointer file: another plugin's checkpoint."""


class UnsupportedValueError(CastoreError, TypeError):
    """A value in the state has a type castore cannot encode without pickle."""


class UnsupportedPlacementError(UnsupportedValueError):
    """A DTensor whose placements castore cannot hold as one box per rank.

    ``Partial`` (a pending reduction: no rank holds the value) and strided
    shards (FSDP2 with tensor parallelism) are refused, naming the key path and
    the placement; so is a DTensor on a mesh that does not include this rank.
    """


class ImportSourceError(UnsupportedValueError, ValueError):
    """A source to import is missing, of an unknown kind, or not readable safely
    (a hostile safetensors header, a pickle ``weights_only`` refuses)."""


class StatementError(CastoreError, ValueError):
    """An export's statement (castore.format.statement) is missing, is not JSON, or has a
    field that is absent, of the wrong type or unsafe (a resource naming a path)."""


class SaveBoundaryError(CastoreError, RuntimeError):
    """A training save was asked for at a point no resume can start from.

    Between accumulated microbatches (pass ``mid_accumulation=True`` to save the
    partial gradients too), with ranks at different updates, or with a data
    cursor past the end of its epoch.
    """


class ResumeMismatchError(CastoreError, ValueError):
    """A resume's claim cannot hold: the message names every field that differs.

    ``differences`` maps each field to ``(saved, current)``.
    """


class AmendError(CastoreError, ValueError):
    """An amend that cannot be made as asked (a pattern that matches nothing, a result
    with no tensor left): the message says which; nothing was written."""


class GcAbortedError(CastoreError):
    """Collection stopped before deleting anything; the message says why and where."""


class SaveAborted(CastoreError):
    """The background writer failed while the caller was still staging."""


class InjectedFault(CastoreError):
    """Raised by a fault point switched to ``raise`` (castore.support.faults)."""


# -- warnings -----------------------------------------------------------------------


class FallbackWarning(CastoreWarning):
    """A load with ``fallback="previous"`` skipped generations that did not validate."""


class DurabilityWarning(CastoreWarning):
    """A ref or tag was replaced (readers see it) but its directory could not be synced."""


class ReflogWarning(CastoreWarning):
    """A generation was published but its reflog record could not be written.

    The ref is the commit point, so the save stands; the next advance of the
    run appends the missing record (action ``recovered``).
    """


class LeaseWarning(CastoreWarning):
    """A store lease was found broken when its holder let it go."""


class LeaseLostWarning(CastoreWarning):
    """A run lease was taken over while held (its holder stalled past ``stale_after``).

    The ref's compare-and-swap still refused any stale advance; what may be
    out of order is the reflog of that run (docs/FORMAT_BLOBS.md, "Locks").
    """


class CacheWarning(CastoreWarning):
    """The per-node index cache could not be used; the store goes on without it."""


class DataCursorWarning(CastoreWarning):
    """The examples counted by ``microbatch_done`` fell short of what the sampler handed out."""
