"""``castore log --graph``: generations and their parents across runs, as text.

The layout first, without a store: every edge a reader can follow in the drawing
(a lane from a generation's ``*`` down to the ``*`` it reaches, through the rows
where lanes branch off and join) is exactly an edge of the graph given, for random
graphs and for a 100-generation history over four runs, which stays four lanes wide.
Broken control: a drawing without its branch-off rows is caught by that reading.

Then a real store (LMDB on disk) holding an import, saves, a branch, an amend to a
new run and an amend with a graft donor: each line names how its generation was made, the edges
are the parents, an import shows its file's name and never the machine's path, and
``--run``, ``-n``, garbage collection and ``castore copy`` name the parents not drawn
and why. A hostile root's lineage (any shape, control characters, ten thousand
sources) prints as bounded one-line text, never a traceback; broken control: without
the escaping, a forged lineage writes a line of its own into the output.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_runner import run_cli
from hostile import forge_root
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import castore
from castore import gc
from castore.cli import graph, main, origins
from castore.cli.graph import Row, display_order, draw
from castore.importer import import_checkpoint

CHUNK = 4096
EDGE_GLYPHS = set("|/\\- ")


# -- reading a drawing back ---------------------------------------------------------------


def read_edges(rows: list[Row]) -> set[tuple[str, str]]:
    """The (child, parent) edges a reader follows in ``rows``: from a ``*`` down its lane,
    through branch-off rows (right after a generation's row) and joining rows (right
    before one), to the ``*`` the lane reaches. Raises AssertionError on a drawing that
    cannot be read: a lane that stops short of a ``*``, a glyph on the wrong side."""
    carry: dict[int, set[str]] = {}  # column -> the children whose edges run down it
    edges: set[tuple[str, str]] = set()
    fresh: int | None = None  # the lane just started under a generation
    for index, row in enumerate(rows):
        cells = row.graph
        if fresh is not None and (fresh >= len(cells) or cells[fresh] not in "|*/\\"):
            del carry[fresh]  # that generation has no parent drawn: its lane ends at it
        fresh = None
        for column in carry:
            assert column < len(cells) and cells[column] in "|*/\\", f"row {index}: lane cut"
        lanes = {at for at, glyph in enumerate(cells) if glyph in "|*"}
        if row.key is not None:
            assert cells.count("*") == 1, cells
            assert lanes <= set(carry) | {cells.index("*")}, f"row {index}: a lane from nowhere"
            column = cells.index("*")
            edges |= {(child, row.key) for child in carry.pop(column, set())}
            assert all(c in EDGE_GLYPHS for c in cells.replace("*", "")), cells
            carry[column], fresh = {row.key}, column
            continue
        ends = [at for at, glyph in enumerate(cells) if glyph in "/\\"]
        joining = [end in carry for end in ends]
        assert ends and len(set(joining)) == 1, f"row {index}: lanes both join and branch off"
        if joining[0]:  # lanes that come from above join the next generation's column
            column = rows[index + 1].graph.index("*")
        else:  # new lanes branch off the generation just above
            assert index > 0 and rows[index - 1].key is not None, f"row {index}: from nowhere"
            column = rows[index - 1].graph.index("*")
        assert lanes <= set(carry) | {column}, f"row {index}: a lane from nowhere"
        for end in ends:
            right = end > column
            low, high = sorted((column, end))
            assert all(cells[at] in "-|/\\" for at in range(low + 1, high)), cells
            if joining[0]:
                assert cells[end] == ("/" if right else "\\"), cells
                carry.setdefault(column, set()).update(carry.pop(end))
            else:
                assert cells[end] == ("\\" if right else "/"), cells
                carry[end] = {rows[index - 1].key or ""}
    if fresh is not None:
        carry.pop(fresh, None)
    assert not carry, f"lanes left open at the end: {carry}"
    return edges


def edges_of(parents: dict[str, list[str]]) -> set[tuple[str, str]]:
    return {(key, p) for key, named in parents.items() for p in named if p in parents}


def laid_out(parents: dict[str, list[str]], rank: Any) -> tuple[list[str], list[Row]]:
    order = display_order(parents, rank)
    return order, draw(order, parents)


# -- the layout ---------------------------------------------------------------------------


def test_a_single_run_is_one_lane_newest_first() -> None:
    parents = {f"g{i}": [f"g{i - 1}"] if i > 1 else [] for i in range(1, 6)}
    order, rows = laid_out(parents, lambda key: int(key[1:]))
    assert order == ["g5", "g4", "g3", "g2", "g1"]
    assert [row.graph for row in rows] == ["*"] * 5
    assert read_edges(rows) == edges_of(parents)


def test_a_branch_joins_its_source_and_a_graft_branches_off() -> None:
    parents = {
        "base1": [],
        "base2": ["base1"],
        "ft1": ["base1"],
        "ft2": ["ft1"],
        "teacher1": [],
        "amended": ["ft2", "teacher1"],  # an amend of ft2 with a graft from teacher1
    }
    rank = list(parents).index
    order, rows = laid_out(parents, rank)
    assert [(row.graph, row.key) for row in rows] == [
        ("*", "amended"),
        ("|-\\", None),  # the donor's lane branches off
        ("* |", "ft2"),
        ("* |", "ft1"),
        ("| *", "teacher1"),
        ("|   *", "base2"),  # not under teacher1: "*" under "*" reads as its parent
        ("|---/", None),  # ft's and base's lines join at base1
        ("*", "base1"),
    ]
    assert read_edges(rows) == edges_of(parents)


def test_broken_control_a_drawing_without_its_branch_off_rows_is_misread() -> None:
    parents = {"a1": [], "t1": [], "a2": ["a1", "t1"]}
    _, rows = laid_out(parents, list(parents).index)
    assert read_edges(rows) == edges_of(parents)
    forgetful = [row for row in rows if row.key is not None]  # the "|-\" row dropped
    with pytest.raises(AssertionError):
        assert read_edges(forgetful) == edges_of(parents)


@st.composite
def histories(draw_from: Any) -> dict[str, list[str]]:
    """Random histories, oldest first: each generation names up to three older ones,
    sometimes one that is not in the mapping (collected, another store's)."""
    count = draw_from(st.integers(1, 30))
    parents: dict[str, list[str]] = {}
    for i in range(count):
        older = draw_from(st.lists(st.integers(0, max(i - 1, 0)), max_size=3, unique=True))
        named = [f"n{j}" for j in older if j < i]
        if draw_from(st.booleans()):
            named.insert(draw_from(st.integers(0, len(named))), f"gone{i}")
        parents[f"n{i}"] = named
    return parents


@settings(max_examples=200, deadline=None)
@given(histories())
def test_every_edge_drawn_is_read_back_and_no_other(parents: dict[str, list[str]]) -> None:
    order, rows = laid_out(parents, lambda key: int(key[1:]))
    assert sorted(order) == sorted(parents)
    seen: set[str] = set()
    for key in order:  # children above their parents
        assert not any(p in seen for p in parents[key] if p in parents), (key, order)
        seen.add(key)
    assert [row.key for row in rows if row.key is not None] == order
    assert read_edges(rows) == edges_of(parents)


def test_a_hundred_generations_over_four_runs_stay_four_lanes_wide() -> None:
    parents: dict[str, list[str]] = {}
    times: dict[str, float] = {}
    clock = iter(range(10_000))

    def add(key: str, named: list[str]) -> None:
        parents[key], times[key] = named, next(clock)

    for i in range(1, 41):
        add(f"base@{i}", [f"base@{i - 1}"] if i > 1 else [])
        if i in (10, 20, 30):
            run = f"ft{i}"
            add(f"{run}@1", [f"base@{i}"])
    for i in range(2, 21):  # the fine-tunes save in turn, as jobs running side by side
        for run in ("ft10", "ft20", "ft30"):
            add(f"{run}@{i}", [f"{run}@{i - 1}"])
    add("ft30@21", ["ft30@20", "ft10@20"])  # an amend grafting from ft10
    assert len(parents) == 101
    order, rows = laid_out(parents, times.__getitem__)
    assert read_edges(rows) == edges_of(parents)
    assert max(len(row.graph) for row in rows) <= 7  # four lanes: "| | | |"
    assert len(rows) - len(parents) <= 6  # few rows that are edges only
    for run in ("ft10", "ft20"):  # each fine-tune's generations one block, newest first
        at = [order.index(f"{run}@{i}") for i in range(20, 0, -1)]
        assert at == list(range(at[0], at[0] + 20))


# -- a store ------------------------------------------------------------------------------


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {"w": rng.standard_normal((16, 8)).astype(np.float32)},
        "optim": {"m": rng.standard_normal(8)},
    }


@pytest.fixture
def lineage_store(tmp_path: Path) -> Path:
    """base@1 imported from a file, base@2 saved; ft@1 a branch of base@1, ft@2 saved;
    release@1 base@2 less its optimizer; release@2 an amend of release@1 with a graft
    from ft@2, a tensor replaced and metadata set."""
    source = tmp_path / "downloads" / "model.safetensors"
    source.parent.mkdir()
    save_file({"model/w": np.ones((16, 8), np.float32)}, str(source.resolve()))
    path = tmp_path / "store"
    with castore.open(path, chunk_size=CHUNK) as store:
        import_checkpoint(store, "base", source.resolve())
        store.save(state(2), run="base", step=2)
        castore.branch(store, "base", 1, "ft")
        store.save(state(3), run="ft", step=3)
        castore.amend(store, "base", 2, drop=["optim/**"], to_run="release")
        castore.amend(
            store,
            "release",
            graft=["ft@2:model/=model/"],
            replace={"model/w": np.eye(16, 8, dtype=np.float32)},
            metadata={"lr": 0.1},
        )
    return path


def graph_of(*args: object) -> tuple[list[Row], dict[str, str]]:
    """``castore log --graph ARGS``: its rows (a generation's keyed by run@id) and each
    generation's text after its root prefix."""
    done = run_cli("log", "--graph", *args)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    rows, texts = [], {}
    for line in done.stdout.splitlines():
        cells = line.rstrip()
        if set(cells) <= EDGE_GLYPHS:
            rows.append(Row(cells, None))
            continue
        width = next(i for i, c in enumerate(line) if c.isalnum())
        label, _, step, _root, text = line[width:].split(maxsplit=4)
        assert step.isdigit() and _ == "step"
        rows.append(Row(line[:width].rstrip(), label))
        texts[label] = text
    return rows, texts


def test_each_line_says_how_its_generation_was_made_and_the_edges_are_its_parents(
    lineage_store: Path, tmp_path: Path
) -> None:
    rows, texts = graph_of(lineage_store)
    assert texts == {
        "release@2": "amend of release@1, ft@2 (replace model/w; graft ft@2:model/=model/; "
        "set metadata lr)",
        "release@1": "amend of base@2 (drop optim/**)",
        "ft@2": "save",
        "ft@1": "branch of base@1",
        "base@2": "save",
        "base@1": "import safetensors model.safetensors",
    }
    assert read_edges(rows) == {
        ("release@2", "release@1"),
        ("release@2", "ft@2"),  # the graft donor
        ("release@1", "base@2"),
        ("ft@2", "ft@1"),
        ("ft@1", "base@1"),
        ("base@2", "base@1"),
    }
    done = run_cli("log", "--graph", lineage_store)
    assert str(tmp_path) not in done.stdout  # the import's file name, not the machine's path
    show = run_cli("show", lineage_store, "base@1")
    assert "from       import safetensors model.safetensors" in show.stdout.splitlines()
    show = run_cli("show", lineage_store, "release@2")
    assert "from       amend of release@1, ft@2 (replace model/w; graft" in show.stdout


def test_a_run_is_drawn_with_what_it_descends_from_in_any_run(lineage_store: Path) -> None:
    rows, texts = graph_of(lineage_store, "--run", "ft")
    assert list(texts) == ["ft@2", "ft@1", "base@1"]  # not base@2, nor release
    assert read_edges(rows) == {("ft@2", "ft@1"), ("ft@1", "base@1")}
    _, texts = graph_of(lineage_store, "--run", "release")
    assert sorted(texts) == ["base@1", "base@2", "ft@1", "ft@2", "release@1", "release@2"]


def test_parents_not_drawn_are_named_with_why(lineage_store: Path, tmp_path: Path) -> None:
    rows, texts = graph_of(lineage_store, "-n", "1")
    assert texts["release@2"].endswith(" lr); release@1 not shown (-n)")
    assert texts["ft@2"] == "save; parent ft@1 not shown (-n)"
    assert texts["base@2"] == "save; parent base@1 not shown (-n)"
    assert read_edges(rows) == {("release@2", "ft@2")}  # the donor is shown: drawn
    with castore.open(lineage_store) as store:  # base@1 dropped; ft@1 still holds its chunks
        gc.tag(store, "ft", 1, "kept")
        gc.collect_garbage(store, gc.RetentionPolicy(keep_last=1))
        assert [g.id for g in store.generations("base")] == [2]
    rows, texts = graph_of(lineage_store)
    assert texts["ft@1"] == "branch of base@1; base@1 collected  [tag kept]"
    assert texts["base@2"] == "save; parent base@1 collected"
    assert texts["release@2"].endswith(" lr); release@1 collected")
    assert read_edges(rows) == {("release@2", "ft@2"), ("ft@2", "ft@1")}
    backup = tmp_path / "backup"
    castore.copy(lineage_store, backup, run="ft", all_generations=True)
    castore.copy(lineage_store, backup, run="base")  # its latest only
    rows, texts = graph_of(backup)
    assert texts == {  # a copy's root is its source's: so is its lineage
        "ft@2": "copied here: save",
        "ft@1": "copied here: branch of base@1; base@1 collected",  # base@2's parent, not copied
        "base@2": "copied here: save; parent base@1 collected",
    }
    assert read_edges(rows) == {("ft@2", "ft@1")}


HOSTILE = {
    "shapes": {"op": ["x"], "from": "nope", "graft": {"a": 1}, "metadata": [1, 2]},
    "items": {
        "op": "amend",
        "from": [1, None, {"run": 7, "generation": "x", "root": "zz"}, {"root": "0" * 64}],
        "graft": [{"from": 99}, "x", {"from": -1, "source": b"\x00\xff"}, {"from": True}],
        "replace": {"a": 1},
        "rename": ["a", ["b"], ["c", "d", "e"]],
    },
    "control characters": {
        "op": "branch\nfake line",
        "from": [{"run": "a\x1b[31m\r", "generation": 1, "root": "ab" * 32}],
        "note\n": "\x00",
    },
    "huge": {
        "op": "amend",
        "from": [{"run": "x", "generation": i, "root": f"{i:064x}"} for i in range(10_000)],
        "drop": ["p" * 10_000] * 20,
    },
    "names a real generation under another run": {"op": "branch", "from": []},
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_lineage_prints_bounded_lines_never_a_traceback(
    lineage_store: Path, case: str
) -> None:
    lineage = dict(HOSTILE[case])
    with castore.open(lineage_store) as store:
        if case.startswith("names a real"):  # base@2's root, said to be ft's
            lineage["from"] = [{"run": "ft", "generation": 2, "root": store.resolve("base").root}]
        forge_root(store, "ft", lambda root: root.update(lineage=lineage))
    done = run_cli("log", "--graph", lineage_store)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 7 + sum(set(line.rstrip()) <= EDGE_GLYPHS for line in lines)
    assert all(line.isprintable() and len(line) < 1200 for line in lines), lines
    forged = next(line for line in lines if "ft@3" in line)
    if case.startswith("names a real"):
        assert forged.endswith("branch of ft@2; ft@2 not in this store")
    for command in (["show", lineage_store, "ft"], ["log", lineage_store]):
        other = run_cli(*command)
        assert other.returncode == 0 and other.stderr == "", other.stderr
        assert all(line.isprintable() for line in other.stdout.splitlines())


def test_broken_control_without_escaping_a_lineage_forges_a_line(
    lineage_store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lineage = HOSTILE["control characters"]
    with castore.open(lineage_store) as store:
        forge_root(store, "ft", lambda root: root.update(lineage=lineage))
    assert main(["log", "--graph", str(lineage_store)]) == 0
    honest = capsys.readouterr().out.splitlines()
    monkeypatch.setattr(origins, "printable", lambda value, limit=0: str(value))
    assert main(["log", "--graph", str(lineage_store)]) == 0
    raw = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("fake line") for line in honest)
    assert any(line.startswith("fake line") for line in raw)  # a line the root wrote
    assert len(raw) > len(honest)


def test_an_empty_store_and_a_shuffled_history_read_back(tmp_path: Path) -> None:
    with castore.open(tmp_path / "empty"):
        pass
    done = run_cli("log", "--graph", tmp_path / "empty")
    assert done.returncode == 0 and done.stdout == "no generations\n"
    rng = random.Random(5)
    parents = {f"n{i}": [f"n{j}" for j in rng.sample(range(i), min(i, 2))] for i in range(40)}
    keys = list(parents)
    rng.shuffle(keys)  # the mapping's order is not the drawing's
    shuffled = {key: parents[key] for key in keys}
    _, rows = laid_out(shuffled, lambda key: int(key[1:]))
    assert read_edges(rows) == edges_of(parents)
    assert graph.display_order({}, str) == []
