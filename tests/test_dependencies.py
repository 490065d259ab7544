"""Every third-party module dpprof imports is a declared runtime dependency.

A fresh virtual environment (``.ci/run``) catches an undeclared import only on the paths the
tests happen to run; this catches it for every module, in any environment, by reading the
imports of the package's source and the requirements of ``pyproject.toml``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; dpprof itself runs on 3.10

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("profiler", "scenarios", "reports")
# Libraries of the user's script that dpprof follows only where the user has them: never
# dependencies of dpprof's own (a user without accelerate has no accelerate launch to follow),
# so imported only inside the functions that follow them (see the test below).
OPTIONAL_IMPORTS = {
    # dpprof run reads `accelerate launch` with accelerate's own parser; without accelerate
    # that launcher cannot be what the user runs, and it says so in one line (UsageError)
    "accelerate": "profiler/script/launch.py",
    # dpprof run's seal wraps safetensors' writers and readers where importlib finds it
    "safetensors": "profiler/script/effects.py",
}


def _distribution_name(requirement: str) -> str:
    name = re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_runtime() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {_distribution_name(r) for r in project["dependencies"]}


def _imported_top_level_modules() -> dict[str, list[str]]:
    """Top-level module -> the files that import it (absolute imports only)."""
    found: dict[str, list[str]] = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    found.setdefault(top, []).append(path.relative_to(REPO).as_posix())
    return found


def test_every_third_party_import_is_a_declared_runtime_dependency() -> None:
    declared = _declared_runtime()
    owners = importlib.metadata.packages_distributions()
    undeclared = []
    for module, files in sorted(_imported_top_level_modules().items()):
        if module in sys.stdlib_module_names or module == "dpprof" or module == "__future__":
            continue
        if module in OPTIONAL_IMPORTS:
            continue  # held to function-level imports below
        dists = {_distribution_name(d) for d in owners.get(module, [])}
        assert dists, f"{module} (imported by {files[0]}) is not installed: is it declared?"
        if not dists & declared:
            undeclared.append(f"{module} ({', '.join(sorted(dists))}) in {files[0]}")
    assert not undeclared, "imported but not in [project].dependencies: " + "; ".join(undeclared)


def _top_level_imports(path: Path) -> set[str]:
    """The top-level modules a file imports when it is itself imported: outside any function
    (a module-level ``if`` or ``try`` counts, it runs at import)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        todo += ast.iter_child_nodes(node)
    return found


def test_optional_imports_are_made_only_where_they_are_used() -> None:
    """dpprof imports, and runs every command, without the user's optional libraries: no
    module imports one at its top level, and each is imported by the module that says why."""
    imported = _imported_top_level_modules()
    for module, owner in OPTIONAL_IMPORTS.items():
        assert owner in imported.get(module, []), f"{module} no longer imported by {owner}"
    for folder in PACKAGE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            at_import = _top_level_imports(path) & set(OPTIONAL_IMPORTS)
            assert not at_import, f"{path.relative_to(REPO)} imports {at_import} at import"


def test_torch_needs_numpy_for_the_ddp_rank_layer() -> None:
    # torch.distributed.gather_object (backends/ranks.py) serialises through NumPy, and a CPU
    # torch wheel does not depend on it: a fresh venv without numpy failed every gloo test.
    uses_gather_object = "gather_object" in (REPO / "profiler/backends/ranks.py").read_text()
    assert not uses_gather_object or "numpy" in _declared_runtime()
