"""The package keeps its layers (DESIGN.md, "Layers"): read from the source, nothing imported.

Every ``import`` and ``from ... import`` in ``castore/`` counts, at module
level or inside a function or an ``if TYPE_CHECKING`` block: an import hidden
in a function is still a dependency. Layers, top to bottom:

- public API: ``castore/__init__.py``, ``store``, ``data``, ``errors``
  (``errors`` and ``version`` stand under every layer: they import nothing of castore)
- operations: ``gc`` (``retention``), ``verify``, ``repair``, ``copying``,
  ``diffing``, ``export``, ``importer``
- integrations: ``dist/``, ``dcp/``, ``train/``, ``tiers/``, ``cli/``, ``data``
- the engine: ``core/``
- format: ``format/`` (what the bytes mean, no I/O)
- storage parts: ``blob/``, ``chunkstore/``, ``repo/``
- support: ``support/`` (durable writes, fault points, read-only mode, progress)
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "castore"

OPERATIONS = {"gc", "retention", "verify", "repair", "copying", "diffing", "export", "importer"}
INTEGRATIONS = {"dist", "dcp", "train", "cli", "data", "tiers"}

# Edges that break a rule below and stay for now, each with its reason.
ALLOWED = {
    # memory_store() (a documented public path, docs/DEVELOPMENT.md "castore.repo.memory")
    # builds a whole in-memory Store: the repository part reaches up to the Store it completes.
    ("castore.repo.memory", "castore.store"),
    ("castore.repo.memory", "castore.core.chunkio"),
}


@dataclass(frozen=True)
class Edge:
    source: str  # dotted module that imports
    target: str  # dotted module imported
    names: tuple[str, ...]  # names taken from it by ``from target import ...``
    line: int

    def __str__(self) -> str:
        names = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.source}:{self.line} -> {self.target}{names}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def edges_of(path: Path) -> Iterator[Edge]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "castore":
                    yield Edge(source, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, target] if target else base)
            if target.split(".")[0] != "castore":
                continue
            names = tuple(alias.name for alias in node.names)
            plain = tuple(name for name in names if not is_module(f"{target}.{name}"))
            yield Edge(source, target, plain, node.lineno)
            for name in names:
                if is_module(f"{target}.{name}"):  # ``from castore import gc``: a module
                    yield Edge(source, f"{target}.{name}", (), node.lineno)


def all_edges() -> list[Edge]:
    return [edge for path in sorted(PACKAGE.rglob("*.py")) for edge in edges_of(path)]


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(rule: str, edges: list[Edge]) -> list[str]:
    found = [str(e) for e in edges if (e.source, e.target) not in ALLOWED]
    return [f"{rule}: {line}" for line in found]


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    found = all_edges()
    assert len(found) > 300, "the import scan found almost nothing: is PACKAGE right?"
    return found


def test_every_allowed_edge_still_exists(edges: list[Edge]) -> None:
    """An allow-list entry whose edge is gone is removed with it, not left to excuse a new one."""
    present = {(e.source, e.target) for e in edges}
    assert sorted(ALLOWED - present) == []


def test_no_module_imports_another_modules_private_names(edges: list[Edge]) -> None:
    bad = [
        e
        for e in edges
        for name in e.names
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    ]
    # A package's private module (castore/testing/_values.py) serves that package alone.
    bad += [
        e
        for e in edges
        if e.target.rpartition(".")[2].startswith("_")
        and not e.target.rpartition(".")[2].startswith("__")
        and not under(e.source, e.target.rpartition(".")[0])
    ]
    assert violations("private name imported across modules", bad) == []


def test_format_imports_only_errors_and_itself(edges: list[Edge]) -> None:
    bad = [
        e
        for e in edges
        if under(e.source, "castore.format")
        and not under(e.target, "castore.format", "castore.errors")
    ]
    assert violations("format/ reaches outside format and errors", bad) == []


def test_support_imports_only_errors_and_itself(edges: list[Edge]) -> None:
    bad = [
        e
        for e in edges
        if under(e.source, "castore.support")
        and not under(e.target, "castore.support", "castore.errors")
    ]
    assert violations("support/ reaches outside support and errors", bad) == []


def test_the_engine_knows_no_operation_and_no_integration(edges: list[Edge]) -> None:
    above = [f"castore.{name}" for name in OPERATIONS | INTEGRATIONS]
    bad = [e for e in edges if under(e.source, "castore.core") and under(e.target, *above)]
    assert violations("core/ imports an operation or integration", bad) == []


def test_storage_parts_stand_below_the_engine_and_the_store(edges: list[Edge]) -> None:
    parts = ("castore.blob", "castore.chunkstore", "castore.repo")
    above = ["castore.core", "castore.store"]
    above += [f"castore.{name}" for name in OPERATIONS | INTEGRATIONS]
    bad = [e for e in edges if under(e.source, *parts) and under(e.target, *above)]
    assert violations("a storage part imports the engine or above", bad) == []


def test_below_the_public_api_nothing_imports_the_package_itself(edges: list[Edge]) -> None:
    """``import castore`` runs the whole public API: the lower layers never need it."""
    lower = ("castore.core", "castore.format", "castore.support")
    lower += ("castore.blob", "castore.chunkstore", "castore.repo")
    bad = [e for e in edges if under(e.source, *lower) and e.target == "castore"]
    assert violations("a lower layer imports the castore package", bad) == []


def test_errors_and_version_import_nothing_of_castore(edges: list[Edge]) -> None:
    """Every layer imports the error tree and the version, so they stand on nothing."""
    bad = [e for e in edges if e.source in ("castore.errors", "castore.version")]
    assert violations("errors.py or version.py imports castore", bad) == []


# Modules that keep their own exception: castore.testing.zygote runs as a script
# in an interpreter that must not have imported castore (castore reads settings such
# as CASTORE_FAULTS at import), so it cannot import castore.errors.
OWN_EXCEPTIONS = {PACKAGE / "testing" / "zygote.py"}


def exception_classes_outside_errors() -> list[str]:
    """Public classes outside errors.py that derive from an exception or warning class."""
    errors = ast.parse((PACKAGE / "errors.py").read_text())
    known = {node.name for node in ast.walk(errors) if isinstance(node, ast.ClassDef)}
    known |= {
        name
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "errors.py" or path in OWN_EXCEPTIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = [ast.unparse(base).rpartition(".")[2] for base in node.bases]
            if any(base in known for base in bases):
                found.append(f"{module_name(path)}:{node.lineno} {node.name}({', '.join(bases)})")
    return found


def test_every_exception_and_warning_is_defined_in_errors() -> None:
    """errors.py holds the whole tree; a private class kept inside one module is its own."""
    assert exception_classes_outside_errors() == []
