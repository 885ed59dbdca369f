"""The public surface is small and pinned; the core works without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import castore
from castore import errors


def test_public_names_are_pinned() -> None:
    assert sorted(castore.__all__) == sorted(
        [
            "AsyncOptions",
            "CastoreError",
            "ChecksumMismatchError",
            "ChunkMissingError",
            "CodecError",
            "CopyReport",
            "ExportCheck",
            "FormatVersionError",
            "Generation",
            "GenerationNotFoundError",
            "IntegrityError",
            "InvalidNameError",
            "NotLoaded",
            "PendingSave",
            "RankLocal",
            "RefConflictError",
            "SaveBytes",
            "SaveStats",
            "Shard",
            "Store",
            "StoreError",
            "TieredStore",
            "UnsupportedValueError",
            "__version__",
            "amend",
            "branch",
            "copy",
            "errors",
            "open",
            "open_tiered",
            "verify_export",
        ]
    )
    for name in castore.__all__:
        assert hasattr(castore, name), name


def test_error_tree_matches_its_docstring() -> None:
    doc = errors.__doc__ or ""
    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, errors.CastoreError)
    ]
    assert len(classes) >= 22
    for cls in classes:
        assert cls.__name__ in doc, f"{cls.__name__} is missing from the drawn tree"
    assert issubclass(errors.ChunkMissingError, errors.IntegrityError)
    assert issubclass(errors.StoreNotFoundError, FileNotFoundError)
    assert issubclass(errors.InvalidNameError, ValueError)
    assert issubclass(errors.UnsupportedValueError, TypeError)
    assert issubclass(errors.GenerationNotFoundError, LookupError)


def test_core_saves_and_loads_without_torch(tmp_path: object) -> None:
    # Make `import torch` fail in a fresh interpreter, then use the core.
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None
        import numpy as np
        import castore
        store = castore.open({str(tmp_path)!r} + "/store", chunk_size=64)
        state = {{"w": np.arange(100, dtype=np.float32), "step": 3}}
        gen = store.save(state, run="r", step=3)
        back = store.load("r")
        assert np.array_equal(back["w"], state["w"]) and back["step"] == 3
        assert "torch" not in gen.frameworks
        try:
            import torch
        except ImportError:
            print("no torch, ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "no torch, ok" in result.stdout


def test_importing_castore_does_not_import_torch() -> None:
    code = "import sys, castore, castore.store, castore.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_save_keywords_are_checked_once_for_every_save(tmp_path: object) -> None:
    """Store.save's keywords travel as one SaveOptions: known ones work, others are refused."""
    import numpy as np
    import pytest

    from castore.core.saveoptions import SaveOptions

    with castore.open(f"{tmp_path}/store", chunk_size=64) as store:
        state = {"w": np.arange(100, dtype=np.float32)}
        with pytest.raises(TypeError, match=r"save\(\) got an unexpected keyword argument 'codex'"):
            store.save(state, run="r", step=1, codex="zstd")  # type: ignore[call-arg]
        with pytest.raises(ValueError, match="if_busy applies to blocking=False saves"):
            store.save(state, run="r", step=1, if_busy="skip")
        gen = store.save(state, run="r", step=1, codec="zstd", metadata={"note": "x"})
        assert gen.metadata == {"note": "x"} and store.codec == "none"  # the handle's, unchanged
    with pytest.raises(ValueError, match="trust_versions applies to blocking saves"):
        SaveOptions(blocking=False, trust_versions=True)
