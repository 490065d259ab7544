"""How a script that has a DDP path of its own takes it, read from its lines: the processes it
starts itself (``mp.spawn(main_worker, nprocs=ngpus_per_node, ...)``, as pytorch/examples'
ImageNet script does under ``--multiprocessing-distributed``), the condition that guards
them and the command-line options that condition reads, and a batch size the path divides by
the ranks itself (``args.batch_size = int(args.batch_size / ngpus_per_node)``). The DDP fix
then says to take that path, not to start the script under torchrun as it stands (which,
without the options, runs its DataParallel path in every process)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from dpprof.script.source import ScriptSource, dotted_name, last_name

# torch.multiprocessing's calls that start a function in new processes
_STARTS = ("spawn", "start_processes")


@dataclass(frozen=True)
class Spawn:
    """Where the script starts its ranks itself."""

    line: int
    call: str  # as written: "mp.spawn"
    condition: str  # the test of the ``if`` it runs under, as written ("" where none)
    options: tuple[str, ...]  # the command-line options that test reads ("--dist")


def _multiprocessing_names(src: ScriptSource) -> set[str]:
    """The names a script reaches torch.multiprocessing's spawn by: ``mp`` of ``import
    torch.multiprocessing as mp``, ``torch.multiprocessing``, a ``spawn`` imported bare."""
    names = {"torch.multiprocessing"}
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names
                      if a.name == "torch.multiprocessing" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names |= {a.asname or a.name for a in node.names if a.name == "multiprocessing"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.multiprocessing":
            names |= {f"={a.asname or a.name}" for a in node.names if a.name in _STARTS}
    return names


def _option_of(src: ScriptSource, attribute: str) -> str | None:
    """The command-line option ``parser.add_argument`` declares for the namespace attribute
    ``attribute`` (``multiprocessing_distributed``: ``--multiprocessing-distributed``)."""
    for node in ast.walk(src.tree):
        if not (isinstance(node, ast.Call) and last_name(node.func) == "add_argument"):
            continue
        flags = [a.value for a in node.args
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        dest = next((k.value.value for k in node.keywords if k.arg == "dest"
                     and isinstance(k.value, ast.Constant)), None)
        longs = [f for f in flags if f.startswith("--")]
        named = dest or (longs[0][2:].replace("-", "_") if longs else None)
        if named == attribute and (longs or flags):
            return (longs or flags)[0]
    return None


def _guard(src: ScriptSource, node: ast.AST) -> ast.expr | None:
    """The test of the innermost ``if`` whose body (not its else) holds ``node``."""
    child = node
    for parent in src.ancestors(node):
        if isinstance(parent, ast.If) and any(child is s for s in parent.body):
            return parent.test
        child = parent
    return None


def spawns(src: ScriptSource) -> list[Spawn]:
    """Every call by which the script starts processes of its own with torch.multiprocessing,
    with what guards it."""
    names = _multiprocessing_names(src)
    out = []
    for node in ast.walk(src.tree):
        if not (isinstance(node, ast.Call) and last_name(node.func) in _STARTS):
            continue
        callee = dotted_name(node.func) or ""
        owner = callee.rpartition(".")[0]
        if owner not in names and f"={callee}" not in names:
            continue
        test = _guard(src, node)
        options: list[str] = []
        for read in ast.walk(test) if test is not None else ():
            option = (_option_of(src, read.attr) if isinstance(read, ast.Attribute) else None)
            if option and option not in options:
                options.append(option)
        out.append(Spawn(node.lineno, callee, src.seg(test) if test is not None else "",
                         tuple(options)))
    return sorted(out, key=lambda s: s.line)


def divides_itself(src: ScriptSource, batch_size: str) -> int:
    """The line where the script divides ``batch_size`` (a DataLoader's ``batch_size=`` as
    written, ``args.batch_size``) by itself (``args.batch_size = int(args.batch_size /
    ngpus_per_node)``, ``args.batch_size //= world``), else 0."""
    for node in ast.walk(src.tree):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            if src.seg(node.target) == batch_size:
                return node.lineno
        elif (isinstance(node, ast.Assign)
              and any(src.seg(t) == batch_size for t in node.targets)
              and any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv))
                      and src.seg(n.left) == batch_size for n in ast.walk(node.value))):
            return node.lineno
    return 0


def loader_batch_sizes(src: ScriptSource) -> list[str]:
    """The ``batch_size=`` of every DataLoader call in the script, as written."""
    return [src.seg(k.value) for node in ast.walk(src.tree)
            if isinstance(node, ast.Call) and last_name(node.func) == "DataLoader"
            for k in node.keywords if k.arg == "batch_size"]


def divided_batch(src: ScriptSource) -> tuple[str, int] | None:
    """Where the script divides its batch size by the ranks itself, as (what, line): a
    DataLoader's ``batch_size`` it divides before making it (ImageNet's ``args.batch_size =
    int(args.batch_size / ngpus_per_node)``), else a batch size divided in a call's arguments
    (YOLOv5's ``create_dataloader(path, imgsz, batch_size // WORLD_SIZE, ...)``); None where
    neither is written."""
    for rows in loader_batch_sizes(src):
        line = divides_itself(src, rows)
        if line:
            return rows, line
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Call):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if (isinstance(arg, ast.BinOp) and isinstance(arg.op, (ast.Div, ast.FloorDiv))
                        and "batch" in src.seg(arg.left).lower()):
                    return f"{src.seg(arg.left)} (`{src.seg(arg)}`)", arg.lineno
    return None
