"""The package keeps one order of floors (docs/DEVELOPMENT.md, "Where things live").

Read from the source, nothing imported. Every module under ``castore/``
stands on one floor, through its package or its own name (``castore.dist``
holds ``castore.dist.restore`` and whatever module ``dist/`` grows), and every
import points down: to a module on a lower floor, or to one in the same
package. Every ``import`` and ``from ... import`` counts, at module level or
inside a function or an ``if TYPE_CHECKING`` block: an import hidden in a
function is still a dependency. Siblings on one floor do not import each
other. An edge that breaks the order is allowed only by name, with its reason
(``ALLOWED``).
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "castore"
DEVELOPMENT = PACKAGE.parent / "docs" / "DEVELOPMENT.md"


@dataclass(frozen=True)
class Floor:
    name: str
    parts: tuple[str, ...]  # dotted packages or modules; "castore" is castore/__init__.py alone


# Bottom to top. docs/DEVELOPMENT.md's table lists the same floors, top to bottom.
FLOORS = (
    Floor("ground: every floor raises castore's errors", ("castore.errors", "castore.version")),
    Floor("what bytes mean; durable files", ("castore.format", "castore.support")),
    Floor("blobs; the sampler", ("castore.blob", "castore.data")),
    Floor("repository parts", ("castore.repo",)),
    Floor("chunk stores", ("castore.chunkstore",)),
    Floor("the engine", ("castore.core",)),
    Floor("the store", ("castore.store",)),
    Floor("opening a store", ("castore.opening",)),
    Floor(
        "multi-rank saves; operations",
        ("castore.dist", "castore.gc", "castore.verify", "castore.copying", "castore.diffing",
         "castore.export", "castore.lineage"),  # fmt: skip
    ),
    Floor(
        "built on those",
        (
            "castore.dcp",
            "castore.train",
            "castore.repair",
            "castore.retention",
            "castore.export_verify",
        ),
    ),
    Floor("importing checkpoints", ("castore.importer",)),
    Floor("tiers", ("castore.tiers",)),
    Floor("the package face", ("castore",)),
    Floor("entry points", ("castore.cli", "castore.integrations", "castore.testing")),
)

# Edges that break the order and stay, each with its reason.
ALLOWED = {
    ("castore.repo.memory", "castore.opening.memory"): (
        "castore.repo.memory.memory_store is a documented import path (docs/DEVELOPMENT.md); "
        "the store it builds is put together on the opening floor, and repo/memory.py "
        "finds it there on first use (module __getattr__), never at import"
    ),
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
    # A compiled extension (castore/format/_b3tree) is known by its type stub.
    return (
        path.with_suffix(".py").is_file()
        or path.with_suffix(".pyi").is_file()
        or (path / "__init__.py").is_file()
    )


def edges_of(path: Path) -> Iterator[Edge]:
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "castore":
                    yield Edge(source, alias.name, (), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            yield from _from_edges(source, package, node)


def _from_edges(source: str, package: str, node: ast.ImportFrom) -> Iterator[Edge]:
    target = node.module or ""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join([*base, target] if target else base)
    if target.split(".")[0] != "castore":
        return
    names = tuple(alias.name for alias in node.names)
    plain = tuple(name for name in names if not is_module(f"{target}.{name}"))
    if plain:  # ``from castore import gc`` takes a module, not a name of the package face
        yield Edge(source, target, plain, node.lineno)
    for name in names:
        if is_module(f"{target}.{name}"):
            yield Edge(source, f"{target}.{name}", (), node.lineno)


def all_edges() -> list[Edge]:
    return [edge for path in sorted(PACKAGE.rglob("*.py")) for edge in edges_of(path)]


def all_modules() -> list[str]:
    return [module_name(path) for path in sorted(PACKAGE.rglob("*.py"))]


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def part_of(module: str) -> str | None:
    """The floor part that holds ``module``: the longest one that names it or a package above."""
    holders = [
        part
        for floor in FLOORS
        for part in floor.parts
        if module == part or (part != "castore" and module.startswith(part + "."))
    ]
    return max(holders, key=len) if holders else None


def floor_of(part: str) -> int:
    return next(level for level, floor in enumerate(FLOORS) if part in floor.parts)


def points_down(edge: Edge) -> bool:
    source, target = part_of(edge.source), part_of(edge.target)
    assert source is not None and target is not None, edge
    return source == target or floor_of(target) < floor_of(source)


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    found = all_edges()
    assert len(found) > 300, "the import scan found almost nothing: is PACKAGE right?"
    return found


def test_every_module_stands_on_one_floor() -> None:
    assert [module for module in all_modules() if part_of(module) is None] == []
    named = [part for floor in FLOORS for part in floor.parts]
    assert len(named) == len(set(named)), "a part is named on two floors"


def test_every_part_named_on_a_floor_exists() -> None:
    """A part that moved or went is taken off its floor, not left to hold a new module."""
    assert [part for floor in FLOORS for part in floor.parts if not is_module(part)] == []


def test_every_import_points_down_the_floors(edges: list[Edge]) -> None:
    bad = [
        f"{edge} (floor {floor_of(part_of(edge.source) or '')} imports "
        f"floor {floor_of(part_of(edge.target) or '')})"
        for edge in edges
        if not points_down(edge) and (edge.source, edge.target) not in ALLOWED
    ]
    assert bad == []


def test_every_allowed_edge_still_exists_and_breaks_the_order(edges: list[Edge]) -> None:
    """An allowance whose edge is gone, or now points down, is removed with it."""
    needed = {(e.source, e.target) for e in edges if not points_down(e)}
    assert sorted(set(ALLOWED) - needed) == []


def test_the_floors_catch_an_upward_import() -> None:
    """A control: the engine importing the store, or a sibling operation, is refused."""
    assert not points_down(Edge("castore.core.reading", "castore.store", ("Store",), 1))
    assert not points_down(Edge("castore.gc", "castore.verify", ("verify_store",), 1))
    assert not points_down(Edge("castore.format.tree", "castore", ("Store",), 1))
    assert points_down(Edge("castore.cli.main", "castore", ("open",), 1))
    assert points_down(Edge("castore.core.reading", "castore.core.readplan", (), 1))


def documented_floors() -> list[tuple[str, ...]]:
    """docs/DEVELOPMENT.md's floor table, bottom to top: each row's parts, as dotted names."""
    text = DEVELOPMENT.read_text()
    table = text[text.index("| floor | parts |") :].split("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        level, parts = (cell.strip() for cell in line.strip("|").split("|")[:2])
        names = re.findall(r"`([a-z_/]+(?:\.py)?)`", parts)
        dotted = [
            "castore" if name == "__init__.py" else f"castore.{name.removesuffix('.py')}"
            for name in names
        ]
        dotted = [name.rstrip("/") for name in dotted]
        rows.append((int(level), tuple(dotted)))
    return [parts for _, parts in sorted(rows)]


def test_the_development_guide_shows_the_same_floors() -> None:
    assert documented_floors() == [floor.parts for floor in FLOORS]


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
    assert [str(e) for e in bad] == []


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
