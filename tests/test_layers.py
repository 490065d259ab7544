"""The packages are layers, read from the bottom up: each imports only the layers below it.

Read from the source with :mod:`ast`, nothing imported: every ``import`` counts, at any depth
(at module level or inside a function, where an import that dodges a cycle hides), except
those under ``if TYPE_CHECKING:``, which never run. A package here is a subpackage of
``dpprof`` (with the subpackages inside it) or a module directly under ``dpprof``; the root
(``dpprof/__init__.py``, the names ``import dpprof`` offers) sits on top.

Also held here: no module imports another's private name (``_x``), no two modules share a
file name, no module runs past :data:`MAX_LINES` lines unless it is listed with the one idea
it holds, and ``pyproject.toml`` lists every package.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the source folders and the import packages they are (pyproject.toml's package-dir)
SOURCES = {"profiler": "dpprof", "scenarios": "dpprof.scenarios", "reports": "dpprof.reports"}

# The layers, bottom up. A package imports only packages of the rows below its own; the
# packages of one row import none of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("units", "errors", "version"),  # byte sizes, the one-line errors, dpprof's version
    ("nvml", "emulator"),  # NVML through ctypes; the virtual GPUs
    ("environment",),  # `dpprof env`'s block: versions, GPUs, driver, topology
    ("result",),  # the result model, which records the environment
    ("saved_result",),  # the result as a file: strict reading, upgrades, atomic writing
    ("scenarios",),  # the scenarios, their names, the measured loop, the workloads
    ("compare_config",),  # `dpprof compare`'s options, without torch (the CLI's flags)
    ("backends",),  # where a scenario runs: emulated, cpu (gloo), cuda
    ("fixes",),  # what each fix is; measured through the trial it is handed
    ("answers",),  # pure functions of a result: comparison, attribution, verdict
    ("measure",),  # what runs scenarios for the answers: fixes, ladder, maxbatch, equivalence
    ("pipeline", "script", "watch"),  # the runs: compare, `dpprof run`, `dpprof watch`
    ("self_check",),  # `dpprof check`: a GPU measured against its emulation
    ("reports",),  # the renderers
    ("cli",),  # the command line
    ("dpprof", "__main__"),  # the names `import dpprof` offers; `python -m dpprof`
)
LEVEL = {package: level for level, row in enumerate(LAYERS) for package in row}


@dataclass(frozen=True)
class Import:
    """One imported module (or the package a name is taken from), where it is imported."""

    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    names: tuple[str, ...]  # the names taken from it (from ... import names)
    where: str  # path:line
    type_checking: bool  # under `if TYPE_CHECKING:`


def modules(repo: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Every module of the source folders: dotted name -> (file, whether a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for folder, dotted in SOURCES.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            found[".".join([dotted, *parts])] = (path, package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, path: Path, package: bool, known: set[str],
            repo: Path = REPO) -> list[Import]:
    """Every dpprof import of ``module`` (its file at ``path``), at any depth."""
    found: list[Import] = []
    where_root = path.relative_to(repo).as_posix()

    def add(node: ast.Import | ast.ImportFrom, type_checking: bool) -> None:
        where = f"{where_root}:{node.lineno}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(module, alias.name, (), where, type_checking))
            return
        base = node.module or ""
        if node.level:  # relative: from the importing module's package
            parts = module.split(".") if package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = tuple(alias.name for alias in node.names)
        submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
        for target in submodules or [base]:
            found.append(Import(module, target, names, where, type_checking))

    def visit(node: ast.AST, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, True)
                for stmt in child.orelse:
                    visit_one(stmt, type_checking)
            else:
                visit_one(child, type_checking)

    def visit_one(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            add(node, type_checking)
        else:
            visit(node, type_checking)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), False)
    return [i for i in found if i.target == "dpprof" or i.target.startswith("dpprof.")]


def layer_of(module: str) -> str:
    """The package ``module`` belongs to: ``dpprof.answers.answer`` -> ``answers``,
    ``dpprof.result`` -> ``result``, ``dpprof.scenarios.kinds.single`` -> ``scenarios``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@functools.cache
def all_imports(repo: Path = REPO) -> list[Import]:
    """Every dpprof import of every module under ``repo``."""
    found = modules(repo)
    known = set(found)
    return [i for name, (path, package) in found.items()
            for i in imports(name, path, package, known, repo)]


def between_packages(found: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """(importing package, imported package) -> the imports that make that edge; the ones
    under TYPE_CHECKING left out."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for i in found:
        a, b = layer_of(i.source), layer_of(i.target)
        if a != b and not i.type_checking:
            edges.setdefault((a, b), []).append(i)
    return edges


def cycles(edges: dict[tuple[str, str], list[Import]]) -> Iterator[tuple[list[str], set[str]]]:
    """Each group of packages that import one another (a strongly connected group of more
    than one): one cycle through it, and the whole group."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    for group in groups:  # one cycle through the group, from its first package
        start = min(group)
        path, seen = [start], {start}
        while True:
            step = min(w for w in graph[path[-1]] if w in group)
            if step in seen:
                yield [*path[path.index(step):], step], group
                break
            path.append(step)
            seen.add(step)


def _show(edges: dict[tuple[str, str], list[Import]], cycle: list[str]) -> str:
    hops = []
    for a, b in itertools.pairwise(cycle):
        i = edges[(a, b)][0]
        hops.append(f"{a} -> {b} ({i.where}: {i.target})")
    return "; ".join(hops)


# A module holds one idea; past this many lines it usually holds several.
MAX_LINES = 600
# The modules past MAX_LINES that hold one idea, each with the idea (reviewed: the idea is
# what a reader finds in it, not a list of its parts).
ONE_IDEA: dict[str, str] = {}


def long_modules(repo: Path = REPO, limit: int = MAX_LINES) -> dict[str, int]:
    """Each module of the source folders with more than ``limit`` lines: its path (from the
    repository's root) -> its lines."""
    out = {}
    for path, _ in modules(repo).values():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            out[path.relative_to(repo).as_posix()] = lines
    return out


# ---- the source ----------------------------------------------------------------------------


def test_every_package_sits_on_one_layer() -> None:
    found = {layer_of(m) for m in modules()}
    listed = [p for row in LAYERS for p in row]
    assert len(listed) == len(set(listed)), "a package listed on two layers"
    assert found == set(listed), (
        f"not on a layer: {sorted(found - set(listed))}; "
        f"on a layer but gone: {sorted(set(listed) - found)}")


def test_every_import_goes_down_the_layers() -> None:
    """An import from a package to one on its own row or above: the layers' one direction
    broken (pass the dependency down instead, or move the module to its layer)."""
    edges = between_packages(all_imports())
    upward = [f"{i.where}: {a} (layer {LEVEL[a]}) imports {i.target} ({b}, layer {LEVEL[b]})"
              for (a, b), found in sorted(edges.items()) if LEVEL[b] >= LEVEL[a]
              for i in found]
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_packages() -> None:
    """Whatever the layers say: no package imports one that imports it, at any depth."""
    edges = between_packages(all_imports())
    found = [f"{sorted(group)} import one another, e.g. {_show(edges, cycle)}"
             for cycle, group in cycles(edges)]
    assert not found, "\n".join(found)


def test_no_module_imports_a_private_name_of_another() -> None:
    private = [f"{i.where}: {name} from {i.target}" for i in all_imports()
               for name in (*i.names, *i.target.split("."))
               if name.startswith("_") and not name.startswith("__")]
    assert not private, "\n".join(private)


def test_no_two_modules_share_a_file_name() -> None:
    """``dpprof.emulator.ddp`` and ``dpprof.fixes.kinds.ddp`` read alike in a traceback and
    a search: each file name says what its module holds, once."""
    by_name: dict[str, list[str]] = {}
    for path, _ in modules().values():
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, shared


def test_no_module_past_the_line_limit_holds_more_than_one_idea() -> None:
    """A module past :data:`MAX_LINES` lines is listed with the one idea it holds; any other
    is split into modules of one idea each."""
    unlisted = {path: lines for path, lines in long_modules().items()
                if path not in ONE_IDEA}
    assert not unlisted, (
        f"over {MAX_LINES} lines and not listed with its one idea: "
        + ", ".join(f"{path} ({lines} lines)" for path, lines in sorted(unlisted.items())))


def test_the_long_module_lists_name_only_long_modules() -> None:
    """A listed module that is gone or back under the limit comes off the list, so the list
    says what is long today."""
    long = long_modules()
    stale = sorted(set(ONE_IDEA) - set(long))
    assert not stale, f"listed as over {MAX_LINES} lines but not (take them off): {stale}"
    assert all(idea.strip() for idea in ONE_IDEA.values()), "a module listed without its idea"


def test_pyproject_lists_every_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; dpprof itself runs on 3.10
    listed = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))[
        "tool"]["setuptools"]["packages"]
    on_disk = [name for name, (_, package) in modules().items() if package]
    assert sorted(listed) == sorted(on_disk)


# ---- the reader, on a small tree of its own ------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for folder in SOURCES:
        (tmp_path / folder).mkdir(exist_ok=True)
    return tmp_path


def test_the_reader_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    repo = _tree(tmp_path, {
        "profiler/__init__.py": "",
        "profiler/low/__init__.py": "",
        "profiler/low/a.py": "def f():\n    from dpprof.high.b import g\n    return g\n",
        "profiler/high/__init__.py": "",
        "profiler/high/b.py": "from ..low import a\n\ndef g():\n    return a\n",
    })
    edges = between_packages(all_imports(repo))
    assert set(edges) == {("low", "high"), ("high", "low")}
    assert list(cycles(edges)) == [(["high", "low", "high"], {"high", "low"})]
    assert edges[("low", "high")][0].where == "profiler/low/a.py:2"


def test_the_reader_leaves_out_type_checking_and_sees_private_names(tmp_path: Path) -> None:
    repo = _tree(tmp_path, {
        "profiler/__init__.py": "",
        "profiler/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from dpprof.high import Thing\nelse:\n    import dpprof.units\n",
        "profiler/high.py": "from dpprof.low import _helper, __doc__\n",
        "profiler/units.py": "",
    })
    found = all_imports(repo)
    assert {(i.source, i.target, i.type_checking) for i in found} == {
        ("dpprof.low", "dpprof.high", True), ("dpprof.low", "dpprof.units", False),
        ("dpprof.high", "dpprof.low", False)}
    assert set(between_packages(found)) == {("low", "units"), ("high", "low")}
    assert not list(cycles(between_packages(found)))
    private = [n for i in found for n in i.names if n.startswith("_") and not n.startswith("__")]
    assert private == ["_helper"]


def test_the_line_count_finds_a_long_module(tmp_path: Path) -> None:
    repo = _tree(tmp_path, {
        "profiler/__init__.py": "",
        "profiler/short.py": "x = 1\n" * 10,
        "profiler/long.py": "x = 1\n" * 11,
        "scenarios/deep/long.py": "x = 1\n" * 12,
    })
    assert long_modules(repo, limit=10) == {"profiler/long.py": 11, "scenarios/deep/long.py": 12}
