"""The statement an export writes beside its files: OpenSSF model-signing's in-toto form.

An in-toto Statement v1 as the ``model-signing`` package (1.x) writes and
verifies one: predicate type ``https://model_signing/signature/v1.0``, the
``files`` serialization hashed with sha256, one resource per file (name,
algorithm, digest) sorted by name, and one subject named after the export
directory whose sha256 is taken over the resources' raw digests in that order.
Its verifier reads ``serialization`` and ``resources`` and ignores any other
predicate field, so the predicate also carries ``castore``: the generation the
files came from (its root digest, and the run, id and step that root records)
and how they were cut from it (the export's options and each file's tensors in
order). The statement itself and a signature beside it (``model.sig``) are in
``ignore_paths``. The layout is in docs/FORMAT.md, "Export statements".

Pure functions: building the statement, and parsing one that may be hostile
(every field checked; a problem raises :class:`StatementError` naming it).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from castore.errors import StatementError

STATEMENT_FILE = "castore-export.intoto.json"
SIGNATURE_FILE = "model.sig"  # model_signing's default signature path
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
HASH = "sha256"
CASTORE_STATEMENT = 1
# What model_signing's signer ignores on its own (git's files), then ours.
IGNORED = (".git", ".gitattributes", ".github", ".gitignore", STATEMENT_FILE, SIGNATURE_FILE)
MAX_STATEMENT_BYTES = 64 << 20

_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ExportOptions:
    """How the tensors were chosen and named (the options of ``castore export``)."""

    prefix: str | None = None
    strip_prefix: bool = False
    rename: tuple[str, ...] = ()
    dtype: str = "keep"


@dataclass(frozen=True)
class ExportedFile:
    """One safetensors file of an export: its name and its tensors' names, in file order."""

    name: str
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Statement:
    """A parsed statement: the files' sha256 digests, and what castore says they hold."""

    subject: str
    digests: dict[str, str]  # file name -> sha256 hex
    root: str  # the generation root's blake3 hex
    run: str
    generation: int
    step: int
    options: ExportOptions
    files: tuple[ExportedFile, ...]
    index: str | None


def subject_digest(digests: Mapping[str, str]) -> str:
    """The subject's sha256: over the raw digests of the resources, in name order."""
    hasher = hashlib.sha256()
    for name in sorted(digests):
        hasher.update(bytes.fromhex(digests[name]))
    return hasher.hexdigest()


def build_statement(
    subject: str,
    digests: Mapping[str, str],
    *,
    root: str,
    run: str,
    generation: int,
    step: int,
    options: ExportOptions,
    files: Sequence[ExportedFile],
    index: str | None,
) -> dict[str, Any]:
    """The statement of an export whose files hash to ``digests`` (name -> sha256 hex)."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": subject, "digest": {HASH: subject_digest(digests)}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": HASH,
                "allow_symlinks": False,
                "ignore_paths": list(IGNORED),
            },
            "resources": [
                {"name": name, "algorithm": HASH, "digest": digests[name]}
                for name in sorted(digests)
            ],
            "castore": {
                "statement": CASTORE_STATEMENT,
                "generation": {"root": root, "run": run, "id": generation, "step": step},
                "export": {
                    "prefix": options.prefix,
                    "strip_prefix": options.strip_prefix,
                    "rename": list(options.rename),
                    "dtype": options.dtype,
                },
                "files": [{"name": f.name, "tensors": list(f.tensors)} for f in files],
                "index": index,
            },
        },
    }


def statement_bytes(statement: Mapping[str, Any]) -> bytes:
    return (json.dumps(statement, indent=2) + "\n").encode()


# -- parsing a statement that may be hostile -------------------------------------------


def parse_statement(data: bytes, where: str) -> Statement:
    """The statement in ``data`` (read from ``where``), every field checked."""
    if len(data) > MAX_STATEMENT_BYTES:
        raise StatementError(f"{where}: {len(data)} bytes, more than a statement holds")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise StatementError(f"{where}: not JSON ({exc})") from None
    top = _object(doc, "the statement", where)
    _equal(top.get("_type"), STATEMENT_TYPE, "_type", where)
    _equal(top.get("predicateType"), PREDICATE_TYPE, "predicateType", where)
    predicate = _object(top.get("predicate"), "predicate", where)
    serialization = _object(predicate.get("serialization"), "predicate.serialization", where)
    _equal(serialization.get("method"), "files", "serialization.method", where)
    _equal(serialization.get("hash_type"), HASH, "serialization.hash_type", where)
    digests = _resources(predicate.get("resources"), where)
    subject = _subject(top.get("subject"), digests, where)
    castore = _object(predicate.get("castore"), "predicate.castore", where)
    _equal(castore.get("statement"), CASTORE_STATEMENT, "castore.statement", where)
    gen = _object(castore.get("generation"), "castore.generation", where)
    root = gen.get("root")
    if not isinstance(root, str) or not _HEX64.fullmatch(root):
        raise StatementError(f"{where}: castore.generation.root is not 64 hex digits")
    run = gen.get("run")
    if not isinstance(run, str) or not run:
        raise StatementError(f"{where}: castore.generation.run is not a run name")
    files, index = _files(castore, digests, where)
    return Statement(
        subject=subject,
        digests=digests,
        root=root,
        run=run,
        generation=_count(gen.get("id"), "castore.generation.id", where),
        step=_count(gen.get("step"), "castore.generation.step", where),
        options=_options(castore.get("export"), where),
        files=files,
        index=index,
    )


def _object(value: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise StatementError(f"{where}: {what} is not an object")
    return value


def _equal(value: Any, want: Any, what: str, where: str) -> None:
    if value != want or type(value) is not type(want):
        raise StatementError(f"{where}: {what} is {value!r}, not {want!r}")


def _count(value: Any, what: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise StatementError(f"{where}: {what} is {value!r}, not a count")
    return value


def plain_file_name(name: Any) -> bool:
    """A file directly in the export directory: no path, nothing hidden or special."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and not name.startswith(".")
    )


def _resources(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, list) or not value:
        raise StatementError(f"{where}: predicate.resources is not a list of files")
    digests: dict[str, str] = {}
    for item in value:
        resource = _object(item, "a resource", where)
        name = resource.get("name")
        if not isinstance(name, str) or not plain_file_name(name):
            raise StatementError(f"{where}: resource name {name!r} is not a plain file name")
        if name in digests:
            raise StatementError(f"{where}: resource {name!r} is listed twice")
        _equal(resource.get("algorithm"), HASH, f"resource {name!r}'s algorithm", where)
        digest = resource.get("digest")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise StatementError(f"{where}: resource {name!r}'s digest is not sha256 hex")
        digests[name] = digest
    return digests


def _subject(value: Any, digests: dict[str, str], where: str) -> str:
    if not isinstance(value, list) or len(value) != 1:
        raise StatementError(f"{where}: subject is not a list of one")
    subject = _object(value[0], "subject", where)
    digest = _object(subject.get("digest"), "subject.digest", where).get(HASH)
    if digest != subject_digest(digests):
        raise StatementError(
            f"{where}: the subject's sha256 is not the digest of the resources listed"
        )
    name = subject.get("name")
    return name if isinstance(name, str) else ""


def _options(value: Any, where: str) -> ExportOptions:
    export = _object(value, "castore.export", where)
    prefix, strip, rename, dtype = (
        export.get(k) for k in ("prefix", "strip_prefix", "rename", "dtype")
    )
    if prefix is not None and not isinstance(prefix, str):
        raise StatementError(f"{where}: castore.export.prefix is not a string")
    if not isinstance(strip, bool):
        raise StatementError(f"{where}: castore.export.strip_prefix is not true or false")
    if not isinstance(rename, list) or not all(isinstance(r, str) for r in rename):
        raise StatementError(f"{where}: castore.export.rename is not a list of FROM=TO")
    if not isinstance(dtype, str):
        raise StatementError(f"{where}: castore.export.dtype is not a string")
    return ExportOptions(prefix, strip, tuple(rename), dtype)


def _files(
    castore: dict[str, Any], digests: dict[str, str], where: str
) -> tuple[tuple[ExportedFile, ...], str | None]:
    listed = castore.get("files")
    if not isinstance(listed, list) or not listed:
        raise StatementError(f"{where}: castore.files is not a list of files")
    files, names = [], set()
    for item in listed:
        entry = _object(item, "a castore.files entry", where)
        name, tensors = entry.get("name"), entry.get("tensors")
        if name not in digests or name in names:
            raise StatementError(f"{where}: castore.files names {name!r}, not one resource")
        if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
            raise StatementError(f"{where}: castore.files {name!r} has no list of tensors")
        names.add(name)
        files.append(ExportedFile(name, tuple(tensors)))
    index = castore.get("index")
    if index is not None and (not isinstance(index, str) or index not in digests or index in names):
        raise StatementError(f"{where}: castore.index {index!r} is not a resource of its own")
    unlisted = sorted(set(digests) - names - {index})
    if unlisted:
        raise StatementError(f"{where}: resource {unlisted[0]!r} is in no castore file")
    return tuple(files), index
