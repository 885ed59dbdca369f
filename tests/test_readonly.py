"""Read-only stores: a store on a read-only mount, or in a directory the reader may
not write, is read in full and refuses every write in one line, changing nothing.

Tests run as root here, and root ignores permission bits, so a ``chmod`` alone
does not make a directory unwritable. Two real routes instead: a read-only bind
mount (``mount -o remount,ro,bind``; skipped where mounting is refused), and a
reader process run as the unprivileged user ``nobody`` over a ``chmod -R a-w``
store (skipped unless this process is root and can switch users).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import castore
from castore import cli, gc
from castore.errors import ReadOnlyStoreError, ReadOnlyWarning, StoreAccessDeniedError
from castore.export import to_safetensors
from castore.importer import import_checkpoint
from castore.repair import rebuild_index, repair_store
from castore.verify import verify_store

NOBODY = 65534
Listing = dict[str, tuple[int, int, int]]


def _state(scale: float) -> dict[str, Any]:
    return {"w": np.arange(4096, dtype=np.float32) * scale, "lr": 0.1 * scale, "step": int(scale)}


def _fill(path: Path | str, **options: Any) -> None:
    """A store with two generations of run ``r``, the first tagged ``keep``."""
    with castore.open(path, chunk_size=1024, **options) as store:
        store.save(_state(1), run="r", step=1)
        store.save(_state(2), run="r", step=2)
        gc.tag(store, "r", 1, "keep")


def listing(root: Path) -> Listing:
    """Every entry under ``root``: relative path -> (size, mtime in ns, mode)."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            info = path.lstat()
            found[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns, info.st_mode)
    return found


@contextlib.contextmanager
def read_only_mount(source: Path, target: Path) -> Iterator[Path]:
    """``source`` bind-mounted read-only at ``target``; skips the test where mount is refused."""
    target.mkdir()
    bind = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(
            f"a read-only bind mount needs mount privileges: {bind.stderr.decode().strip()}"
        )
    try:
        remount = subprocess.run(
            ["mount", "-o", "remount,ro,bind", str(target)], capture_output=True
        )
        if remount.returncode != 0:
            pytest.skip(f"remounting read-only was refused: {remount.stderr.decode().strip()}")
        yield target
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
            # A handle still open (a failed assertion's traceback holds one) keeps the
            # mount busy: detach it lazily, so no mount outlives the test.
            subprocess.run(["umount", "-l", str(target)], check=True)


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(the store seen through a read-only mount, the same store writable underneath)."""
    source = tmp_path / "source"
    source.mkdir()
    _fill(source / "local")
    _fill(source / "shared", shared=True)
    with read_only_mount(source, tmp_path / "ro") as mount:
        yield mount, source


def _writes(store: castore.Store, elsewhere: Path) -> dict[str, Any]:
    """Every write a caller can ask of an open store, by name."""
    torch_file = elsewhere / "model.safetensors"
    if not torch_file.exists():
        pytest.importorskip("safetensors.numpy").save_file({"a": np.ones(3)}, str(torch_file))
    other = elsewhere / "other"
    if not other.exists():
        _fill(other)
    return {
        "save": lambda: store.save(_state(3), run="r", step=3),
        "save a new run": lambda: store.save(_state(3), run="new", step=1),
        "tag": lambda: gc.tag(store, "r", 2, "also"),
        "untag": lambda: gc.untag(store, "r", "keep"),
        "gc": lambda: gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1)),
        "repair": lambda: repair_store(store),
        "copy into it": lambda: castore.copy(other, store),
        "import into it": lambda: import_checkpoint(store, "r", torch_file),
    }


def _check_reads(store: castore.Store, out: Path) -> None:
    np.testing.assert_array_equal(store.load("r")["w"], _state(2)["w"])
    restored = store.restore("r", "keep")
    assert restored.generation.id == 1 and restored.state["lr"] == pytest.approx(0.1)
    np.testing.assert_array_equal(
        store.read_slice("r", 2, "w", slice(10, 20)), _state(2)["w"][10:20]
    )
    assert [g.id for g in store.generations("r")] == [1, 2]
    assert store.resolve("r").id == 2
    assert verify_store(store, deep=True).problems == []
    report = to_safetensors(store, "r", "latest", out)
    assert report.tensors == 1


# -- a local store (LMDB) ---------------------------------------------------------


def test_a_local_store_on_a_read_only_mount_reads_and_refuses_every_write(
    mounted: tuple[Path, Path], tmp_path: Path
) -> None:
    mount, source = mounted
    before = listing(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = castore.open(mount / "local")
    said = [w for w in caught if issubclass(w.category, ReadOnlyWarning)]
    assert len(said) == 1 and "not writable" in str(said[0].message)
    assert said[0].filename == __file__  # points at the caller, not inside castore
    with store:
        assert store.readonly
        _check_reads(store, tmp_path / "export")
        for _what, write in _writes(store, tmp_path).items():
            with pytest.raises(ReadOnlyStoreError, match="open read-only .*not writable.*refused"):
                write()
        with pytest.raises(ReadOnlyStoreError) as refused:
            store.save(_state(3), run="r", step=3)
        assert refused.value.store == str(mount / "local") and refused.value.refused == "save"
        assert isinstance(refused.value, PermissionError)
    for offline in (gc.compact, rebuild_index):
        with pytest.raises(ReadOnlyStoreError, match="refused"):
            offline(mount / "local")
    assert listing(source) == before


def test_a_read_only_open_creates_no_file_even_where_it_could(tmp_path: Path) -> None:
    """readonly=True on a writable directory: same reads, same refusals, and the
    store's files are as they were (the mount test cannot show this: the kernel
    would refuse any write there anyway)."""
    _fill(tmp_path / "store")
    before = listing(tmp_path / "store")
    with castore.open(tmp_path / "store", readonly=True) as store:
        assert store.readonly
        _check_reads(store, tmp_path / "export")
        for _what, write in _writes(store, tmp_path).items():
            with pytest.raises(ReadOnlyStoreError, match=r"readonly=True\): .*refused"):
                write()
    after = listing(tmp_path / "store")
    # One deliberate exception: where lock.mdb is writable, a writer may exist, so the
    # reader takes its slot in LMDB's reader table (chunkstore/lmdb/env.py says why);
    # that write changes the lock file's mtime, never its size, and nothing else.
    lock = "chunks/lock.mdb"
    assert after.pop(lock)[0::2] == before.pop(lock)[0::2]
    assert after == before


def test_a_directory_with_no_store_is_not_created_read_only(tmp_path: Path) -> None:
    with pytest.raises(castore.errors.StoreNotFoundError):
        castore.open(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()


# -- a shared-directory store (format 3) ----------------------------------------------


def test_a_shared_store_on_a_read_only_mount_reads_without_a_lease(
    mounted: tuple[Path, Path], tmp_path: Path
) -> None:
    mount, source = mounted
    before = listing(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReadOnlyWarning)
        store = castore.open(mount / "shared", shared=True)
    with store:
        assert store.readonly
        _check_reads(store, tmp_path / "export")
        for _what, write in _writes(store, tmp_path).items():
            with pytest.raises(ReadOnlyStoreError, match="not writable.*refused"):
                write()
    assert listing(source) == before


# -- the command line ---------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_every_reading_command_works_on_a_read_only_mount(
    mounted: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    mount, source = mounted
    store = mount / kind
    before = listing(source)
    reads: list[list[object]] = [
        ["log", store],
        ["show", store, "r"],
        ["diff", store, "r@1", "r@2"],
        ["du", store],
        ["verify", store],
        ["verify", "--deep", store],
        ["gc", "--dry-run", store],
        ["export", store, "r", tmp_path / "out"],
        ["copy", store, tmp_path / f"copy-{kind}"],
    ]
    for command in reads:
        code, out, err = _cli(capsys, *command)
        assert code == 0, (command, err)
        assert err.count("\n") <= 1, (command, err)  # at most the one warning line
        assert "Traceback" not in err
    code, out, err = _cli(capsys, "log", store)
    assert err == (
        f"castore: warning: store {store} opened read-only (its directory is not writable): "
        "reads work, writes are refused\n"
    )
    assert listing(source) == before


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_every_writing_command_is_refused_in_one_line(
    mounted: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    mount, source = mounted
    store = mount / kind
    other = tmp_path / "other"
    _fill(other, shared=kind == "shared")
    checkpoint = tmp_path / "model.safetensors"
    pytest.importorskip("safetensors.numpy").save_file({"a": np.ones(3)}, str(checkpoint))
    before = listing(source)
    writes: list[list[object]] = [
        ["tag", store, "r@2", "also"],
        ["untag", store, "r", "keep"],
        ["gc", "--yes", store],
        ["repair", store],
        ["copy", other, store],
        ["import", store, "r", checkpoint],
    ]
    if kind == "local":  # offline tools of LMDB stores only
        writes += [["compact", store], ["repair", "--rebuild-index", store]]
    for command in writes:
        code, out, err = _cli(capsys, *command)
        assert code != 0, command
        assert err.count("\n") == 1, (command, err)
        assert err.startswith(
            f"castore: error: ReadOnlyStoreError: store {store} is open read-only"
        ), err
        assert "refused" in err
    assert listing(source) == before


# -- a reader that may not write: the user nobody ---------------------------------------


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """Stores under a directory ``nobody`` may read and not write (made by root)."""
    if os.geteuid() != 0:
        pytest.skip("switching to the user nobody needs root")
    top = Path(tempfile.mkdtemp(prefix="castore-ro-", dir="/tmp"))  # pytest's tmp is 0700
    try:
        _fill(top / "local")
        _fill(top / "shared", shared=True)
        subprocess.run(["chmod", "-R", "a-w,a+rX", str(top)], check=True)
        yield top
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(top)], check=True)
        shutil.rmtree(top)


def _reads_as_nobody(store: Path, shared: bool) -> dict[str, Any]:
    """What a process running as ``nobody`` gets from ``store``: reads, refusals, CLI lines."""
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opened = castore.open(store, shared=shared)
    result["warned"] = [str(w.message) for w in caught]
    with opened:
        result["w1"] = float(opened.load("r")["w"][1])
        result["ids"] = [g.id for g in opened.generations("r")]
        result["problems"] = len(verify_store(opened, deep=True).problems)
        for what, write in (
            ("save", lambda: opened.save({"x": 1}, run="r", step=9)),
            ("tag", lambda: gc.tag(opened, "r", 1, "other")),
        ):
            try:
                write()
            except ReadOnlyStoreError as exc:
                result[what] = str(exc)
    for command in (["log", str(store)], ["gc", "--yes", str(store)]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(command)
        result[command[0]] = [code, err.getvalue()]
    return result


def _as_nobody(work: Any, *args: Any) -> Any:
    """``work(*args)`` in a forked child that dropped to the user ``nobody``.

    Forked, not a new interpreter: this Python lives under /root (mode 0700), which
    nobody cannot reach; what the work imports lazily is imported here first.
    """
    cache = Path(tempfile.mkdtemp(prefix="castore-cache-", dir="/tmp"))
    os.chown(cache, NOBODY, NOBODY)
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(reader)
            os.environ["CASTORE_CACHE_DIR"] = str(cache)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                answer = {"result": work(*args)}
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(writer, json.dumps(answer).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(cache)
    assert os.waitstatus_to_exitcode(status) == 0 and data, "the nobody child failed"
    answer = json.loads(data)
    assert "error" not in answer, answer["error"]
    return answer["result"]


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_a_reader_without_write_permission_reads_and_is_refused_writes(
    unwritable: Path, kind: str
) -> None:
    import lmdb.verify  # noqa: F401 - imported lazily by verify --deep

    import castore.blob.posix  # noqa: F401 - imported lazily by castore.open(shared=True)

    store = unwritable / kind
    before = listing(store)
    result = _as_nobody(_reads_as_nobody, store, kind == "shared")
    assert result["w1"] == 2.0 and result["ids"] == [1, 2] and result["problems"] == 0
    assert len(result["warned"]) == 1 and "not writable" in result["warned"][0]
    for what in ("save", "tag"):
        assert result[what] == (
            f"store {store} is open read-only (its directory is not writable): {what} refused"
        )
    code, err = result["log"]
    assert code == 0 and err.startswith("castore: warning: store ") and err.count("\n") == 1
    code, err = result["gc"]
    assert code == 1 and err.count("\n") == 1 and "ReadOnlyStoreError" in err, err
    assert listing(store) == before


# -- S3 with credentials that only read -------------------------------------------------


class RefuseWrites:
    """A botocore ``before-send`` hook: 403 AccessDenied to every request that writes,
    as S3 answers credentials whose policy allows only reads (moto's IAM is partial)."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        if request.method in ("GET", "HEAD"):
            return None
        from s3_server import injected_response

        self.refused.append(f"{request.method} {request.url}")
        body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
        return injected_response(request, 403, body, {"Content-Type": "application/xml"})


def test_s3_with_read_only_credentials(s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    import s3_server

    url = f"s3://{s3_bucket}/ckpt"
    arguments = s3_server.store_arguments(s3_endpoint)
    endpoint = {"endpoint_url": arguments.pop("endpoint_url"), "region": arguments.pop("region")}
    _fill(url, **endpoint, s3_options=arguments)
    client = s3_server.s3_client(s3_endpoint)
    hook = RefuseWrites()
    client.meta.events.register("before-send.s3", hook)
    reader = {**endpoint, "s3_options": {"client": client}}

    # Reads need no write, so they work without asking for read-only.
    with castore.open(url, create=False, **reader) as store:
        _check_reads(store, tmp_path / "export")
        assert hook.refused == []
        with pytest.raises(StoreAccessDeniedError):
            store.save(_state(3), run="r", step=3)
    assert hook.refused, "the save reached the server and was refused there"

    # readonly=True: each write is refused before any request.
    hook.refused.clear()
    with castore.open(url, readonly=True, **reader) as store:
        _check_reads(store, tmp_path / "export2")
        for _what, write in _writes(store, tmp_path).items():
            with pytest.raises(ReadOnlyStoreError, match=rf"store {url} is open read-only"):
                write()
    assert hook.refused == []
    with castore.open(url, create=False, **endpoint, s3_options=arguments) as store:
        assert [g.id for g in store.generations("r")] == [1, 2]
        assert set(store.refs.tags("r")) == {"keep"}


def test_as_root_permission_bits_leave_a_store_writable_and_operations_says_so(
    tmp_path: Path,
) -> None:
    """Root passes permission bits: a ``chmod a-w`` store opens writable, unless asked."""
    if os.geteuid() != 0:
        pytest.skip("what root may write: needs root")
    path = tmp_path / "store"
    _fill(path)
    subprocess.run(["chmod", "-R", "a-w,a+rX", str(path)], check=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReadOnlyWarning)
            with castore.open(path, create=False) as store:
                assert not store.readonly
                store.save(_state(3), run="r", step=3)  # root writes through the bits
        with castore.open(path, readonly=True) as store, pytest.raises(ReadOnlyStoreError):
            store.save(_state(4), run="r", step=4)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(path)], check=True)
    operations = (Path(__file__).parent.parent / "docs" / "OPERATIONS.md").read_text()
    said = " ".join(operations[operations.index("## Read-only stores") :].split())
    assert "As root, file permissions do not make a store read-only" in said
    assert "pass `readonly=True`" in said
