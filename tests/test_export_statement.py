"""castore export --statement and castore verify-export: an export proven bitwise the
generation its statement names, file by file, and every tampering caught.

The generations are test_export's: one saved by one process, and one written by
4 ranks as uneven 2-D boxes (its chunks lie in the file as several runs each,
which the verifier gathers). Each tampering is a broken control: the same export
verifies before it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cli_runner import run_cli
from test_export import flat_tensors, make_state, read_exported, save_four_ranks

import castore
from castore import Store
from castore.errors import (
    ExportMismatchError,
    GenerationNotFoundError,
    StatementError,
)
from castore.export import INDEX_FILE, SINGLE_FILE, to_safetensors
from castore.export_verify import box_runs
from castore.format.statement import IGNORED, STATEMENT_FILE, subject_digest

# Small files: four of them, so the export has an index and several files.
SHARD = 600


@pytest.fixture(params=["one-process", "four-ranks"])
def saved(request: pytest.FixtureRequest, store: Store) -> Store:
    state = make_state()
    if request.param == "one-process":
        store.save(state, run="r", step=7)
    else:
        save_four_ranks(store, state)
    return store


def export(store: Store, out: Path, **options: Any) -> Path:
    options.setdefault("max_shard_size", SHARD)
    to_safetensors(store, "r", "latest", out, statement=True, buffer_size=64, **options)
    return out


def statement_of(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / STATEMENT_FILE).read_text())
    return doc


def write_statement(out: Path, doc: dict[str, Any]) -> None:
    (out / STATEMENT_FILE).write_text(json.dumps(doc, indent=2))


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def data_offset(path: Path, tensor: str) -> int:
    """Where ``tensor``'s bytes start in the safetensors file ``path``."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return 8 + length + json.loads(raw[8 : 8 + length])[tensor]["data_offsets"][0]


def file_of(out: Path, tensor: str) -> Path:
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    return out / weight_map[tensor]


def restate(out: Path, doc: dict[str, Any] | None = None) -> None:
    """Rewrite the statement's digests to match the files as they are now (a forger's edit)."""
    doc = doc or statement_of(out)
    for resource in doc["predicate"]["resources"]:
        resource["digest"] = hashlib.sha256((out / resource["name"]).read_bytes()).hexdigest()
    digests = {r["name"]: r["digest"] for r in doc["predicate"]["resources"]}
    doc["subject"][0]["digest"]["sha256"] = subject_digest(digests)
    write_statement(out, doc)


# -- the statement ------------------------------------------------------------------


def test_statement_names_each_file_its_sha256_and_the_generation(
    saved: Store, tmp_path: Path
) -> None:
    out = export(saved, tmp_path / "hf")
    doc = statement_of(out)
    files = sorted(p.name for p in out.iterdir() if p.name != STATEMENT_FILE)
    assert len(files) > 2 and INDEX_FILE in files
    assert doc["_type"] == "https://in-toto.io/Statement/v1"
    assert doc["predicateType"] == "https://model_signing/signature/v1.0"
    predicate = doc["predicate"]
    assert predicate["serialization"] == {
        "method": "files",
        "hash_type": "sha256",
        "allow_symlinks": False,
        "ignore_paths": list(IGNORED),
    }
    resources = predicate["resources"]
    assert [r["name"] for r in resources] == files  # every file, sorted, nothing else
    for resource in resources:
        assert resource["algorithm"] == "sha256"
        assert (
            resource["digest"] == hashlib.sha256((out / resource["name"]).read_bytes()).hexdigest()
        )
    joined = b"".join(bytes.fromhex(r["digest"]) for r in resources)
    assert doc["subject"] == [
        {"name": "hf", "digest": {"sha256": hashlib.sha256(joined).hexdigest()}}
    ]
    digest, root = saved.resolve_root("r")
    ours = predicate["castore"]
    assert ours["generation"] == {"root": digest.hex, "run": "r", "id": 1, "step": 7}
    assert ours["export"] == {"prefix": None, "strip_prefix": False, "rename": [], "dtype": "keep"}
    assert ours["index"] == INDEX_FILE
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    listed = {t: f["name"] for f in ours["files"] for t in f["tensors"]}
    assert listed == weight_map
    assert sorted(listed) == sorted(flat_tensors(make_state()))


def test_no_statement_unless_asked_and_none_for_one_file(saved: Store, tmp_path: Path) -> None:
    to_safetensors(saved, "r", "latest", tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [SINGLE_FILE]
    with pytest.raises(ValueError, match="name a directory instead"):
        to_safetensors(saved, "r", "latest", tmp_path / "one.safetensors", statement=True)
    assert not (tmp_path / "one.safetensors").exists()


# -- verify-export passes on what export wrote --------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_shard_size": 10**9},
        {"dtype": "bf16"},
        {"prefix": "model", "strip_prefix": True, "rename": ["w=weight_"], "dtype": "fp16"},
    ],
    ids=["sharded", "one-file", "bf16", "renamed-fp16"],
)
def test_a_fresh_export_verifies(saved: Store, tmp_path: Path, options: dict[str, Any]) -> None:
    out = export(saved, tmp_path / "hf", **options)
    check = castore.verify_export(out, saved, block_size=100)  # blocks cut chunks and runs
    digest, root = saved.resolve_root("r")
    assert (check.root, check.run, check.generation, check.step) == (digest.hex, "r", 1, 7)
    assert check.published
    names = sorted(p.name for p in out.iterdir() if p.name != STATEMENT_FILE)
    assert sorted(f.name for f in check.files) == names
    assert check.bytes == sum((out / n).stat().st_size for n in names)
    tensors = sum(f.tensors for f in check.files)
    assert tensors == len(read_exported(out))
    converted = sum(f.converted for f in check.files)
    if options.get("dtype") in (None, "keep"):
        assert converted == 0 and sum(f.chunks for f in check.files) >= tensors
    else:  # the floating-point tensors were compared converted; the others chunk by chunk
        assert 0 < converted < tensors


def test_verifies_against_a_copy_of_the_store(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    report = castore.copy(saved, tmp_path / "copy")
    assert report.copied
    with castore.open(tmp_path / "copy", create=False) as copy:
        assert castore.verify_export(out, copy).generation == 1


def test_box_runs_place_a_column_block_row_by_row(store: Store) -> None:
    save_four_ranks(store, make_state())
    entries = store.tensor_entries(store.resolve_root("r")[1])["model/w2"]  # float32 (19, 13)
    block = next(e for e in entries if e.offsets == (7, 9))  # rows 7.., columns 9..12
    run, starts = box_runs(block)
    assert run == 4 * 4
    assert starts.tolist() == [(r * 13 + 9) * 4 for r in range(7, 19)]


# -- broken controls: each tampering is caught, naming the file and the tensor ----------


def test_a_flipped_byte_in_a_tensor_is_named(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    castore.verify_export(out, saved)
    path = file_of(out, "model/w2")
    flip(path, data_offset(path, "model/w2") + 5)
    with pytest.raises(ExportMismatchError, match="tensor 'model/w2' differs") as caught:
        castore.verify_export(out, saved)
    assert caught.value.context["file"] == path.name and "\n" not in str(caught.value)


def test_a_flipped_byte_in_a_header_is_named(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    path = file_of(out, "model/w2")
    raw = bytearray(path.read_bytes())
    at = raw.index(b'"model/w2"') + 3
    raw[at : at + 1] = b"X"  # a renamed tensor, same length
    path.write_bytes(bytes(raw))
    with pytest.raises(ExportMismatchError, match="safetensors header is not the one"):
        castore.verify_export(out, saved)


@pytest.mark.parametrize("dtype", ["keep", "bf16"])
def test_a_statement_edited_to_match_a_tampered_file_is_still_caught(
    saved: Store, tmp_path: Path, dtype: str
) -> None:
    out = export(saved, tmp_path / "hf", dtype=dtype)
    path = file_of(out, "model/w2")
    flip(path, data_offset(path, "model/w2") + 3)
    restate(out)  # the sha256 digests now match the tampered file
    with pytest.raises(ExportMismatchError, match="tensor 'model/w2' differs"):
        castore.verify_export(out, saved)


def test_an_edited_index_is_caught_even_restated(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    index = json.loads((out / INDEX_FILE).read_text())
    index["metadata"]["total_size"] += 1
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    restate(out)
    with pytest.raises(ExportMismatchError, match="not the index the export writes"):
        castore.verify_export(out, saved)


def test_a_statement_digest_that_differs_is_named(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    doc = statement_of(out)
    doc["predicate"]["resources"][0]["digest"] = "0" * 64
    restate_subject_only(out, doc)
    with pytest.raises(ExportMismatchError, match="sha256 is .*, the statement says 000"):
        castore.verify_export(out, saved)


def restate_subject_only(out: Path, doc: dict[str, Any]) -> None:
    digests = {r["name"]: r["digest"] for r in doc["predicate"]["resources"]}
    doc["subject"][0]["digest"]["sha256"] = subject_digest(digests)
    write_statement(out, doc)


def test_a_file_removed_or_added_is_named(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    extra = out / "notes.txt"
    extra.write_text("hello")
    with pytest.raises(ExportMismatchError, match="notes.txt is in .* not in its statement"):
        castore.verify_export(out, saved)
    extra.unlink()
    (out / "model.sig").write_text("{}")  # a signature beside the files is expected
    castore.verify_export(out, saved)
    gone = file_of(out, "model/bias")
    gone.unlink()
    with pytest.raises(
        ExportMismatchError, match=f"{gone.name}, which the statement names, is missing"
    ):
        castore.verify_export(out, saved)


def test_a_statement_naming_a_root_the_store_lacks(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    doc = statement_of(out)
    doc["predicate"]["castore"]["generation"]["root"] = "ab" * 32
    write_statement(out, doc)  # the root is not in the subject: no digest to redo
    with pytest.raises(GenerationNotFoundError, match="does not hold root abababababab"):
        castore.verify_export(out, saved)


def test_a_statement_naming_another_generation(saved: Store, tmp_path: Path) -> None:
    out = export(saved, tmp_path / "hf")
    state = make_state()
    state["model"]["w2"] = state["model"]["w2"] + 1  # generation 2 differs in model/w2 only
    saved.save(state, run="r", step=8)
    other, _ = saved.resolve_root("r", 2)
    doc = statement_of(out)
    doc["predicate"]["castore"]["generation"]["root"] = other.hex
    write_statement(out, doc)
    with pytest.raises(ExportMismatchError, match="the root records r@2 at step 8"):
        castore.verify_export(out, saved)
    doc["predicate"]["castore"]["generation"].update(id=2, step=8)
    write_statement(out, doc)  # a consistent lie: the bytes are generation 1's
    with pytest.raises(ExportMismatchError, match="tensor 'model/w2' differs"):
        castore.verify_export(out, saved)


# -- hostile or malformed statements: one typed line each ---------------------------


def _set(path: str, value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value

    return edit


HOSTILE = {
    "wrong type": (_set("_type", "https://in-toto.io/Statement/v0.1"), "_type is"),
    "wrong predicate": (_set("predicateType", "x"), "predicateType is"),
    "shards": (_set("predicate.serialization.method", "shards"), "serialization.method"),
    "blake2": (_set("predicate.serialization.hash_type", "blake2"), "hash_type"),
    "path out": (_set("predicate.resources.0.name", "../etc/passwd"), "not a plain file name"),
    "absolute": (_set("predicate.resources.0.name", "/etc/passwd"), "not a plain file name"),
    "hidden": (_set("predicate.resources.0.name", ".bashrc"), "not a plain file name"),
    "not hex": (_set("predicate.resources.0.digest", "zz" * 32), "digest is not sha256 hex"),
    "subject": (_set("subject.0.digest.sha256", "0" * 64), "subject's sha256 is not"),
    "two subjects": (_set("subject", []), "subject is not a list of one"),
    "no castore": (_set("predicate.castore", None), "predicate.castore is not an object"),
    "bool id": (_set("predicate.castore.generation.id", True), "generation.id is True"),
    "negative step": (_set("predicate.castore.generation.step", -1), "step is -1"),
    "float step": (_set("predicate.castore.generation.step", 7.0), "step is 7.0"),
    "short root": (_set("predicate.castore.generation.root", "abc"), "not 64 hex digits"),
    "bad run": (_set("predicate.castore.generation.run", "../x"), "run"),
    "newer": (_set("predicate.castore.statement", 2), "castore.statement is 2"),
    "unknown file": (_set("predicate.castore.files.0.name", "x.safetensors"), "not one resource"),
    "tensors": (_set("predicate.castore.files.0.tensors", "model/w2"), "no list of tensors"),
    "rename": (_set("predicate.castore.export.rename", [1]), "rename is not a list"),
    "dtype": (_set("predicate.castore.export.dtype", "int4"), "export options do not apply"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_malformed_statement_is_one_typed_line(store: Store, tmp_path: Path, case: str) -> None:
    store.save(make_state(), run="r", step=7)
    out = export(store, tmp_path / "hf")
    castore.verify_export(out, store)
    edit, message = HOSTILE[case]
    doc = statement_of(out)
    edit(doc)
    write_statement(out, doc)
    with pytest.raises(castore.CastoreError, match=message) as caught:
        castore.verify_export(out, store)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, (StatementError, castore.InvalidNameError))


@pytest.mark.parametrize("content", [b"", b"{", b"[1, 2]", b"\xff\xfe", b"[" * 100000])
def test_a_statement_that_is_not_json_or_not_an_object(
    store: Store, tmp_path: Path, content: bytes
) -> None:
    store.save(make_state(), run="r", step=7)
    out = export(store, tmp_path / "hf")
    (out / STATEMENT_FILE).write_bytes(content)
    with pytest.raises(StatementError):
        castore.verify_export(out, store)


def test_no_statement_or_a_symlinked_one(store: Store, tmp_path: Path) -> None:
    store.save(make_state(), run="r", step=7)
    out = tmp_path / "plain"
    to_safetensors(store, "r", "latest", out)
    with pytest.raises(StatementError, match="no statement .* export with --statement"):
        castore.verify_export(out, store)
    signed = export(store, tmp_path / "hf")
    real = tmp_path / "elsewhere.json"
    (signed / STATEMENT_FILE).rename(real)
    os.symlink(real, signed / STATEMENT_FILE)
    with pytest.raises(StatementError, match="cannot read"):
        castore.verify_export(signed, store)


# -- the command --------------------------------------------------------------------


def test_cli_exports_with_a_statement_and_verifies(store: Store, tmp_path: Path) -> None:
    store.save(make_state(), run="r", step=7)
    store.close()
    out = tmp_path / "hf"
    made = run_cli("export", store.path, "r", out, "--statement", "--max-shard-size", "600")
    assert made.returncode == 0, made.stderr
    assert f"wrote {out / STATEMENT_FILE} (the statement to sign)" in made.stdout
    ok = run_cli("verify-export", out, store.path)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    files = sorted(p.name for p in out.iterdir() if p.name != STATEMENT_FILE)
    assert [line.split()[1].rstrip(":") for line in lines[:-1]] == files
    assert all(line.startswith("ok ") for line in lines[:-1])
    assert lines[-1].startswith(f"verified: {out} is bitwise r@1 (step 7, root ")
    path = file_of(out, "model/w2")
    flip(path, data_offset(path, "model/w2"))
    bad = run_cli("verify-export", out, store.path)
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("castore: error: ExportMismatchError: ")
    assert "tensor 'model/w2' differs" in bad.stderr and path.name in bad.stderr
    torch = run_cli(
        "export", store.path, "r", tmp_path / "m.pt", "--format", "torch", "--statement"
    )
    assert torch.returncode == 1 and "--statement are for --format safetensors" in torch.stderr
    missing = run_cli("verify-export", tmp_path / "nowhere", store.path)
    assert missing.returncode == 1 and "StatementError: no statement" in missing.stderr


# -- model-signing's own signer and verifier accept the statement ----------------------


def test_model_signing_signs_and_verifies_the_statement(saved: Store, tmp_path: Path) -> None:
    pytest.importorskip("model_signing", reason="model-signing is not installed")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from google.protobuf import json_format
    from in_toto_attestation.v1 import statement_pb2
    from model_signing import hashing, verifying
    from model_signing._signing import sign_ec_key

    key = ec.generate_private_key(ec.SECP256R1())  # a throwaway key
    private, public = tmp_path / "key.pem", tmp_path / "key.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    out = export(saved, tmp_path / "hf")
    text = (out / STATEMENT_FILE).read_text()

    class Payload:  # what the key signer signs: payload.statement.pb, as model_signing builds it
        class statement:  # noqa: N801
            pb = json_format.Parse(text, statement_pb2.Statement())

    signature = out / "model.sig"
    sign_ec_key.Signer(private).sign(Payload()).write(signature)  # type: ignore[arg-type]
    verifying.Config().use_elliptic_key_verifier(public_key=public).verify(out, signature)
    castore.verify_export(out, saved)  # the signature beside the files changes nothing
    # model_signing's own hashing of the directory gives our resources, so its own
    # signer (model_signing sign DIR) signs the subject digest we wrote.
    ours = statement_of(out)["predicate"]["resources"]
    manifest = hashing.Config().set_ignored_paths(paths=[STATEMENT_FILE, "model.sig"]).hash(out)
    theirs = [
        {"name": d.identifier, "algorithm": d.digest.algorithm, "digest": d.digest.digest_hex}
        for d in manifest.resource_descriptors()
    ]
    assert theirs == ours
    # Broken control: model_signing's verifier catches a tampered file too.
    path = file_of(out, "model/w2")
    flip(path, data_offset(path, "model/w2"))
    with pytest.raises(ValueError, match="Signature mismatch"):
        verifying.Config().use_elliptic_key_verifier(public_key=public).verify(out, signature)
