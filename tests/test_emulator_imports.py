"""The emulator's modules import in one direction: none imports a module that imports it, at
any depth, counting imports inside functions and under ``if TYPE_CHECKING:`` (a type-only
import back is still a module that must be read before its dependency). The virtual CUDA is
on top: what it installs (``cuda_api``, ``tensor_api``) and the runtime under it
(``cuda_devices``) type it through :mod:`dpprof.emulator.emulated_cuda`; the dispatch mode's
parts (the ledger of storages, the mirrors, the op memo, the variant ledgers) never import
the mode that holds them. Read from the source with :mod:`ast`, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

EMULATOR = Path(__file__).resolve().parent.parent / "profiler" / "emulator"
PACKAGE = "dpprof.emulator"


def emulator_imports() -> dict[str, set[str]]:
    """Each emulator module -> the emulator modules it imports, anywhere in its source."""
    names = {p.stem for p in EMULATOR.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in EMULATOR.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PACKAGE:
                    found.update(a.name for a in node.names)
                elif node.module.startswith(PACKAGE + "."):
                    found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names
                             if a.name.startswith(PACKAGE + "."))
        graph[path.stem] = (found & names) - {path.stem}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_no_emulator_module_imports_one_that_imports_it() -> None:
    graph = emulator_imports()
    back = sorted(f"{m} -> ... -> {m}" for m in graph if m in reachable(graph, m))
    assert not back, "import cycles in the emulator: " + ", ".join(back)


def test_virtual_cudas_dependencies_do_not_import_it() -> None:
    graph = emulator_imports()
    below = reachable(graph, "virtual_cuda")
    assert {"cuda_api", "tensor_api", "cuda_devices", "emulated_cuda"} <= below
    assert not {m for m in below if "virtual_cuda" in graph[m]}


def test_the_dispatch_modes_parts_do_not_import_the_mode() -> None:
    graph = emulator_imports()
    for part in ("storage_ledger", "mirroring", "op_memo", "ledgers", "op_rules", "events"):
        assert "virtual_devices" not in reachable(graph, part), part
        assert "cuda_devices" not in reachable(graph, part), part
