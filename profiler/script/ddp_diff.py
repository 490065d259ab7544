"""DistributedDataParallel in place of DataParallel as a rewrite of the user's own lines (the
``ddp`` fix's diff, :mod:`dpprof.script.ddp_run`, and the start of every rung of the ladder on
a DataParallel script): ``DDP(<module>.cuda(rank), device_ids=[rank])`` at the wrap (with
``gradient_as_bucket_view=True`` for ``bucket_view``), the process group and the rank's device
at the start of the wrap's function (or of the script), the imports, ``"cuda:0"`` made each
rank's own device, and each rank's share of every ``DataLoader`` (``batch_size // N``, a
``DistributedSampler``: :mod:`dpprof.script.ddp_loaders`) and of the batches made by hand.
Where the batches are made in other files of the user's than the wrap's (a model file wraps
the model, the training script loads the data), each of those files is changed too, the
process group started at the launched script's start, and the diff names every file from the
folder that holds them all, as ``patch -p0`` applies it (:func:`ddp_at`)."""

from __future__ import annotations

import ast
import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from dpprof.script.ddp_loaders import UNSEEN, LoaderUse, RankLoaders, share
from dpprof.script.installed_code import installed_site, is_installed
from dpprof.script.own_ddp_path import divided_batch, spawns
from dpprof.script.rewrite import (
    Rewrite,
    finish,
    free_name,
    read_source,
    site_of,
)
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    add_imports,
    calls_at,
    data_parallel_call,
    dim_arg,
    dotted_name,
    import_line,
    is_data_parallel,
    last_name,
    module_arg,
    parenthesized,
    start_of,
    until_scope,
)

DDP_TITLE = "DistributedDataParallel"  # and the names of its flags (gradient_as_bucket_view)


@dataclasses.dataclass(frozen=True)
class OutputDevice:
    """DataParallel's ``output_device`` where it is not its first GPU: its (logical) index,
    and ``file:line`` of the script's lines that named that GPU in the DDP alternative's run
    (which took it for the rank's own GPU, as the rewrite of those lines makes it)."""

    index: int
    sites: tuple[str, ...] = ()

# calls that only move a module or tensor between devices: dropped where DDP places the module
_MOVES = ("cuda", "to")

def _device_like(src: ScriptSource, node: ast.expr) -> bool:
    """An argument of ``.to(...)`` that names a device (not a dtype)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, int)) and not isinstance(node.value, bool)
    if isinstance(node, ast.Call):
        return dotted_name(node.func) in ("torch.device", "device")
    text = src.seg(node).lower()
    return "dev" in text or "cuda" in text or "gpu" in text or "rank" in text


def _move(src: ScriptSource, node: ast.AST) -> ast.expr | None:
    """``x`` of ``x.cuda(...)`` or ``x.to(<device>)``; None where ``node`` is not such a move."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MOVES):
        return None
    if node.func.attr == "to" and (node.keywords or len(node.args) != 1
                                   or not _device_like(src, node.args[0])):
        return None
    return node.func.value


def _init_line(src: ScriptSource, wrap: ast.stmt) -> tuple[int, str]:
    """Where the process group starts: the top of the wrap's function, of the script's
    ``if __name__ == "__main__":`` block, or of the script after its imports."""
    scope = src.scope(wrap)
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _top_of(src, scope.body)
    main = _main_guard(until_scope(src, wrap))
    return _top_of(src, main.body) if main is not None else (_after_imports(src), "")


def _main_guard(nodes: Iterable[ast.AST]) -> ast.If | None:
    """The ``if __name__ == "__main__":`` block among ``nodes``."""
    return next((n for n in nodes if isinstance(n, ast.If) and "__name__" in ast.unparse(n.test)
                 and "__main__" in ast.unparse(n.test)), None)


def _top_of(src: ScriptSource, body: list[ast.stmt]) -> tuple[int, str]:
    """The line and indent of ``body``'s first statement after its docstring."""
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str) and len(body) > 1:
        first = body[1]
    if first.lineno == start_of(src.parents[first])[0]:  # ``def f(): x`` on one line
        raise NoRewrite(f"line {first.lineno}: the body shares its line with the def")
    return first.lineno, src.indent(first.lineno)


def ddp(source: str, path: str, dp_line: int, gpus: int, bucket_view: bool = False,
        batch_lines: tuple[int, ...] = (), rows: int = 0,
        flags: tuple[str, ...] = (), loader_sites: tuple[str, ...] = (), script: str = "",
        elsewhere: bool = False, label: str = "", use: LoaderUse = UNSEEN,
        dim: int = 0, output_device: OutputDevice | None = None) -> Rewrite:
    """The script as ``gpus`` DistributedDataParallel ranks (see the module).
    ``batch_lines``: the lines where the script makes its batches by hand (a random factory
    of the scattered rows, which the DDP alternative cut to each rank's share); ``flags``:
    DDP's further keyword arguments (``"broadcast_buffers=False"``), named in the title;
    ``loader_sites``: ``file:line`` of the script's calls that made the DataLoaders whose
    batch_size the DDP alternative divided (a library's loader factory's, where it used one);
    ``script``: the file the launcher runs, where it is not ``path`` (a model file the
    script imports); ``elsewhere``: the batches are made in other files, which their own
    diffs divide (:func:`ddp_at`); ``label``: the file's name in the diff (its own name);
    ``use``: how the alternative saw the divided DataLoaders used (an evaluation's gets no
    DistributedSampler, which would shard it; a batch_size the ranks do not divide is
    rounded up); ``dim``: the dimension of the hand-made batches' size DataParallel split
    (its ``dim``); ``output_device``: DataParallel's, where it is not its first GPU (each
    naming of that GPU becomes the rank's own)."""
    try:
        return _ddp(ScriptSource(source, path), dp_line, gpus,
                    (("gradient_as_bucket_view=True",) if bucket_view else ()) + flags,
                    batch_lines, rows, loader_sites, script, elsewhere, label, use, dim,
                    output_device)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


# torch's factories a script makes a batch with in its loop (``torch.randint(0, V, (B, T))``,
# ``torch.randn(B, D)``, its targets ``torch.zeros(B, D)``, a GAN's labels ``torch.full((B,),
# 1.0)``): under DDP each rank makes its own share of the rows
BATCH_FACTORIES = ("randint", "randn", "rand", "zeros", "ones", "empty", "full")


def own_process_group(source: str, path: str, gpus: int, rows: int = 0) -> str:
    """Why the DDP change of the script in ``source`` is no diff where the script starts a
    process group itself (:func:`_refuse_own_process_group`), else ""; checked on the lines
    as written, so the reason names them (a rung's other edits move them)."""
    try:
        _refuse_own_process_group(ScriptSource(source, path), gpus, (), rows)
    except NoRewrite as e:
        return str(e)
    return ""


def _refuse_own_process_group(src: ScriptSource, gpus: int, flags: tuple[str, ...],
                              scattered: int) -> None:
    """:class:`NoRewrite` where the script starts a process group itself (its own DDP path,
    taken when a launcher starts it, as torchvision's reference does): a second
    ``init_process_group`` would fail, and the script needs no lines changed, only the
    launcher and each rank's batch, which the reason says."""
    calls = [c for c in ast.walk(src.tree)
             if isinstance(c, ast.Call) and last_name(c.func) == "init_process_group"]
    aliases = {"DistributedDataParallel"} | {
        a.asname for n in ast.walk(src.tree) if isinstance(n, ast.ImportFrom)
        for a in n.names if a.name == "DistributedDataParallel" and a.asname}
    wraps = sorted(c.lineno for c in ast.walk(src.tree)
                   if isinstance(c, ast.Call) and last_name(c.func) in aliases)
    if not calls and not wraps:
        return
    share = (f", each rank's DataLoader batch_size {-(-scattered // gpus)} (DataParallel's "
             f"{scattered} rows // {gpus}, as the DDP alternative ran it)") if scattered else ""
    options = f"; give its DistributedDataParallel {', '.join(flags)}" if flags else ""
    if not calls:
        # a DDP path of its own whose process group another file starts (KAIR's
        # model_to_device: DistributedDataParallel(...) if opt['dist'] else DataParallel(...))
        raise NoRewrite(
            f"{Path(src.path).name} wraps DistributedDataParallel itself (line {wraps[0]}) "
            "beside this DataParallel: the code has a DDP path of its own, whose process "
            f"group it starts elsewhere; run it as DDP ranks with `torchrun --nproc-per-node "
            f"{gpus}` and what the code takes to choose that path (an option such as --dist) "
            f"rather than change its lines{share}{options}")
    starts = min(c.lineno for c in calls)
    own = f" and wraps DistributedDataParallel itself (line {wraps[0]})" if wraps else ""
    name = Path(src.path).name
    divided = divided_batch(src)
    if divided and scattered:  # the path divides it: a batch of a rank's would be cut again
        share += (f"; the script divides {divided[0]} by the ranks itself (line {divided[1]}): "
                  f"give it DataParallel's {scattered}")
    started = spawns(src)
    if not started:
        raise NoRewrite(f"the script starts its own process group (line {starts}){own}: run "
                        f"it as DDP ranks with `torchrun --nproc-per-node {gpus} {name}` "
                        f"rather than change its lines{share}{options}")
    # its ranks are processes it starts itself, on a path its options choose (ImageNet's
    # mp.spawn under --multiprocessing-distributed): torchrun as it stands would run the
    # DataParallel path in every process
    spawn = started[0]
    when = f", when `{spawn.condition}`" if spawn.condition else ""
    chosen = " ".join(spawn.options)
    if spawn.options:
        when += f": the option{'s' * (len(spawn.options) > 1)} {', '.join(spawn.options)}"
    raise NoRewrite(
        f"the script starts its own process group (line {starts}){own} in processes it starts "
        f"itself ({spawn.call}, line {spawn.line}{when}): take that path rather than change its "
        f"lines or start it under torchrun{share}{options}; `dpprof run --gpus {gpus} -- "
        f"python {name} {chosen + ' ' if chosen else ''}...` measures it")


def _batch_rows_node(call: ast.Call, dim: int = 0) -> ast.expr | None:
    """The dimension ``dim`` (DataParallel's) of a batch factory's size
    (``torch.randint(0, V, (B, T))``: ``B``; ``torch.randn(B, D)``, ``torch.full((B,),
    1.0)``: ``B``; along 1, ``torch.randint(0, V, (T, B))``: ``B``), as the DDP alternative
    read it."""
    size = next((k.value for k in call.keywords if k.arg == "size"), None)
    if size is None:
        if last_name(call.func) == "randint":
            size = next((a for a in call.args if isinstance(a, (ast.Tuple, ast.List))), None)
        elif call.args and isinstance(call.args[0], (ast.Tuple, ast.List)):
            size = call.args[0]
        elif len(call.args) > dim and last_name(call.func) != "full":  # randn(T, B, D)
            size = ast.Tuple(elts=list(call.args), ctx=ast.Load())
        elif call.args:
            size = call.args[0]
    if isinstance(size, (ast.Tuple, ast.List)):
        return size.elts[dim] if len(size.elts) > dim else None
    return size if dim == 0 else None


def _divide_batches(src: ScriptSource, edits: Edits, lines: tuple[int, ...], gpus: int,
                    scattered: int, dim: int = 0) -> list[int]:
    """Each rank makes its share of a hand-made batch: ``B`` -> ``B // gpus`` in the
    factories on ``lines``; the lines edited."""
    done = []
    for line in dict.fromkeys(lines):  # a line's factories once, however many the run cut
        # every factory of the line the run could have cut (``x, y = torch.randn(B, D),
        # torch.randint(0, C, (B,))``): not one whose rows are a number other than the batch's
        for call in calls_at(src, line):
            rows = _batch_rows_node(call, dim) if last_name(call.func) in BATCH_FACTORIES \
                else None
            if rows is None or isinstance(rows, ast.Starred) or (
                    isinstance(rows, ast.Constant) and scattered and rows.value != scattered):
                continue
            edits.node(rows, share(src, rows, gpus, scattered))
            if line not in done:
                done.append(line)
    return done


def _ddp(src: ScriptSource, dp_line: int, gpus: int, flags: tuple[str, ...],
         batch_lines: tuple[int, ...] = (), scattered: int = 0,
         loader_sites: tuple[str, ...] = (), script: str = "", elsewhere: bool = False,
         label: str = "", use: LoaderUse = UNSEEN, dim: int = 0,
         output_device: OutputDevice | None = None) -> Rewrite:
    _refuse_own_process_group(src, gpus, flags, scattered)
    edits = Edits(src)
    notes: list[str] = []
    dp = data_parallel_call(src, dp_line)
    wrap = src.statement(dp)
    rank = free_name(src, "rank", "local_rank")
    replaced = []
    # the same model wrapped again on a path the run did not take (VainF's DeepLabV3+: one
    # wrap after loading a checkpoint, one without): each becomes DDP alike
    for call in [dp, *_other_wraps(src, dp)]:
        outer, text = _ddp_call(src, call, rank, flags)
        edits.node(outer, text)
        replaced.append(src.span(outer))
        if call is not dp:
            notes.append(f"line {call.lineno} wraps {src.seg(module_arg(call))} in DataParallel "
                         f"too, on a path this run did not take (line {dp.lineno} ran): DDP "
                         "there as well")
    loaders = RankLoaders(src, edits, notes, gpus, scattered, loader_sites, use=use)
    # the process group starts here: with the batches, or at the script's start, before the
    # other files' loaders (or, the script unknown, a module run with -m, at the wrap)
    starts = not elsewhere or not script or _same_file(src.path, script)
    add_imports(src, edits, ["os", *(["torch", "dist"] if starts else []), "DDP",
                             *(["DistributedSampler"] if loaders.shared else [])],
                src.scope(wrap))
    loaders.define_sampler_share()
    if not elsewhere or not script:
        line, indent = _init_line(src, wrap)
        edits.insert_lines(line, _starts(gpus, Path(script or src.path).name, rank, indent))
    elif starts:  # before the other files' loaders: at the script's start
        line, indent = _script_start(src)
        edits.insert_lines(line, _starts(gpus, Path(src.path).name, rank, indent))
    else:  # the script starts it: the rank, read here
        line, indent = _init_line(src, wrap)
        edits.insert_lines(line, [f'{indent}{rank} = int(os.environ["LOCAL_RANK"])'])
    notes += _rank_devices(src, edits, replaced, output_device)
    divided = _divide_batches(src, edits, batch_lines, gpus, scattered, dim)
    if not loaders.any and not divided and not elsewhere:
        # no DataLoader to give a sampler: the batches the loop makes, each rank its share
        edits.insert_lines(wrap.lineno, [f"{src.indent(wrap.lineno)}# DDP: each rank makes "
                                         f"its share of every batch, 1/{gpus} of its rows"])
        notes.append("the script makes its batches without a DataLoader: give each rank its "
                     f"share (1/{gpus} of the batch) by hand")
    return finish(src, edits, _title(flags), notes, label)


def _starts(gpus: int, script: str, rank: str, indent: str) -> list[str]:
    """The lines that start the process group and set the rank's device."""
    return [f"{indent}# torchrun --nproc-per-node {gpus} {script}",
            f'{indent}dist.init_process_group("nccl")',
            f'{indent}{rank} = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device({rank})']


def _script_start(src: ScriptSource) -> tuple[int, str]:
    """Where the launched script starts the process group before anything else it runs
    (its DataLoaders' samplers need it): the top of its ``if __name__ == "__main__":`` block,
    else after its imports."""
    guard = _main_guard(src.tree.body)
    if guard is None:
        return _after_imports(src), ""
    return guard.body[0].lineno, src.indent(guard.body[0].lineno)


def _after_imports(src: ScriptSource) -> int:
    """The line after the script's opening run of imports, which may set ``sys.path`` or
    ``os.environ`` between them (``sys.path.insert(0, ...)`` before the project's own)."""
    line = import_line(src)
    for stmt in src.tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            line = (stmt.end_lineno or stmt.lineno) + 1
        elif not ((isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
                  or any((dotted_name(n) or "").startswith(("sys.path", "os.environ"))
                         for n in ast.walk(stmt) if isinstance(n, ast.Attribute))):
            break
    return line


def _same_file(a: str, b: str) -> bool:
    return bool(b) and Path(a).resolve() == Path(b).resolve()


def _title(flags: tuple[str, ...]) -> str:
    return ", ".join([DDP_TITLE, *(f.partition("=")[0] for f in flags)])


def _rank_devices(src: ScriptSource, edits: Edits,
                  replaced: list[tuple[int, int]] | None = None,
                  output_device: OutputDevice | None = None) -> list[str]:
    """``"cuda:0"`` made ``"cuda"``, every rank's own device once set_device has run (outside
    ``replaced``, the spans the wraps' edits rewrite); so too DataParallel's
    ``output_device`` where it is another GPU, cuda:k: ``"cuda:k"``, ``.cuda(k)``,
    ``.to(k)``, ``torch.device("cuda", k)``. The notes: the lines changed for cuda:k, and the
    lines the run saw name it that are left to change by hand."""
    k = output_device.index if output_device is not None else None
    names = {"cuda:0"} | ({f"cuda:{k}"} if k is not None else set())
    changed: list[int] = []

    def outside(node: ast.AST) -> bool:
        return not any(start <= src.span(node)[0] < end for start, end in replaced or ())

    for node in ast.walk(src.tree):
        if isinstance(node, ast.Constant) and node.value in names and not isinstance(
                src.parents.get(node), ast.JoinedStr) and outside(node):
            edits.node(node, src.seg(node).replace(node.value, "cuda"))
            if node.value != "cuda:0":
                changed.append(node.lineno)
        elif k is not None and isinstance(node, ast.Call) and outside(node):
            line = _rank_device_call(src, edits, node, k)
            if line:
                changed.append(line)
    if output_device is None:
        return []
    lines = sorted(set(changed))
    here = Path(src.path).resolve()
    seen = sorted({int(n) for p, _, n in (s.rpartition(":") for s in output_device.sites)
                   if n.isdigit() and Path(p).resolve() == here})
    # a line that reads a name a changed line binds (``OUT = "cuda:k"``, then ``device=OUT``)
    bound = {t.id for n in ast.walk(src.tree) if isinstance(n, ast.Assign) and n.lineno in lines
             for t in n.targets if isinstance(t, ast.Name)}
    read = {n.lineno for n in ast.walk(src.tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in bound}
    by_hand = [n for n in seen if n not in lines and n not in read]
    notes = []
    if lines:
        notes.append(f"{_lines(lines)} put{'s' * (len(lines) == 1)} tensors on cuda:{k}, "
                     "DataParallel's output_device: under DDP each rank's own GPU (\"cuda\" "
                     "once set_device has run)")
    if by_hand:
        notes.append(f"{_lines(by_hand)} name{'s' * (len(by_hand) == 1)} cuda:{k}, "
                     "DataParallel's output_device, another way: make it each rank's own "
                     "GPU by hand (torch.device(\"cuda\", rank)), as the DDP alternative "
                     "ran it")
    return notes


def _lines(lines: list[int]) -> str:
    return f"line {lines[0]}" if len(lines) == 1 else \
        f"lines {', '.join(map(str, lines[:-1]))} and {lines[-1]}"


def _rank_device_call(src: ScriptSource, edits: Edits, call: ast.Call, k: int) -> int:
    """``x.cuda(k)`` -> ``x.cuda()``, ``x.to(k)`` -> ``x.to("cuda")``, ``torch.device("cuda",
    k)`` -> ``torch.device("cuda")``; the call's line, 0 where it is none of them."""
    def is_k(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int and node.value == k

    name = last_name(call.func)
    if name == "cuda" and isinstance(call.func, ast.Attribute):
        # the device alone, or first with non_blocking=True after it (``x.cuda(k, True)``:
        # positional, left as written)
        given: list[ast.AST] = [a for a in call.args[:1] if is_k(a)] + [
            kw for kw in call.keywords if kw.arg == "device" and is_k(kw.value)]
        rest = [n for n in [*call.args, *call.keywords] if n is not given[0]] if given else []
        if given and not any(isinstance(n, ast.expr) for n in rest):
            start, end = src.span(given[0])
            after = [src.span(n)[0] for n in rest if src.span(n)[0] > start]
            before = [src.span(n)[1] for n in rest if src.span(n)[0] < start]
            # with its comma: up to the next argument, or from the one before
            edits.replace(*((start, min(after)) if after else (max(before), end) if before
                            else (start, end)), "")
            return call.lineno
    elif name == "to" and isinstance(call.func, ast.Attribute):
        if call.args and is_k(call.args[0]):
            edits.node(call.args[0], '"cuda"')
            return call.lineno
    elif name == "device" and len(call.args) == 2 and not call.keywords and is_k(call.args[1]) \
            and isinstance(call.args[0], ast.Constant) and call.args[0].value == "cuda":
        edits.node(call, f'{src.seg(call.func)}("cuda")')
        return call.lineno
    return 0


def _ddp_call(src: ScriptSource, dp: ast.Call, rank: str, flags: tuple[str, ...]
              ) -> tuple[ast.AST, str]:
    """The node a DataParallel wrap's DDP replaces (with a ``.cuda()`` after it: both) and
    the DDP call's text."""
    module = module_arg(dp)
    inner = _move(src, module) or module
    args = [f"{parenthesized(src, inner)}.cuda({rank})", f"device_ids=[{rank}]"]
    dim = dim_arg(dp)  # as the loss-inside-forward diff reads it: a subclass's 4th is its own
    if dim is not None:
        args.append(f"dim={src.seg(dim)}")
    if any(kw.arg is None for kw in dp.keywords):
        raise NoRewrite(f"line {dp.lineno}: DataParallel's arguments are unpacked (**)")
    args += flags
    # DataParallel(model).cuda(): DDP's module is on its device already
    outer: ast.AST = dp
    parent = src.parents.get(dp)
    if isinstance(parent, ast.Attribute) and _move(src, src.parents.get(parent, dp)) is dp:
        outer = src.parents[parent]
    return outer, f"DDP({', '.join(args)})"


def _other_wraps(src: ScriptSource, dp: ast.Call) -> list[ast.Call]:
    """The other DataParallel wraps of the same module, as written, in the same function."""
    scope, module = src.scope(dp), src.seg(module_arg(dp))
    return sorted((n for n in ast.walk(scope) if isinstance(n, ast.Call) and n is not dp
                   and is_data_parallel(n) and (n.args or n.keywords)
                   and src.scope(n) is scope and src.seg(module_arg(n)) == module),
                  key=start_of)


def ddp_at(dp_site: str, gpus: int, bucket_view: bool = False,
           batch_sites: tuple[str, ...] = (), rows: int = 0,
           flags: tuple[str, ...] = (), loader_sites: tuple[str, ...] = (),
           script: str = "", use: LoaderUse = UNSEEN, dim: int = 0,
           output_device: OutputDevice | None = None) -> Rewrite:
    """:func:`ddp` from the wrap's ``file:line`` (and those of hand-made batches and of the
    calls that made the divided DataLoaders; ``rows``: the batch DataParallel scattered,
    along ``dim``; ``output_device``: DataParallel's, where it is another GPU than its
    first;
    ``script``: the file the launcher runs). Batches made in other files of the user's (the
    training loop's file, where a model file wraps the model) are divided there: one diff
    of every file, named from the folder that holds them all (the script's, unless one is
    outside it), as ``patch -p0`` applies it there."""
    try:
        path, line = site_of(dp_site)
        here = Path(path).resolve()
        batches: dict[str, list[int]] = {}
        loaders: dict[str, list[str]] = {}
        for site in batch_sites:
            where, n = site_of(site)
            batches.setdefault(str(Path(where).resolve()), []).append(n)
        for site in loader_sites:
            loaders.setdefault(str(Path(site_of(site)[0]).resolve()), []).append(site)
        others = sorted((set(batches) | set(loaders)) - {str(here)})  # made elsewhere
        library = next((o for o in others if is_installed(o)), None)
        if library is not None:
            raise NoRewrite(f"the batches are made in {installed_site(library)}, a library's "
                            f"file: give each rank 1/{gpus} of them there by hand")
        flags = (("gradient_as_bucket_view=True",) if bucket_view else ()) + flags
        # the paths as ``patch -p0`` applies them in the folder that holds every file (the
        # script's, unless a file is outside it)
        start = Path(script).resolve().parent if script else here.parent
        root = Path(os.path.commonpath([start, here.parent, *(Path(o).parent for o in others)]))
        main = ddp(read_source(path), path, line, gpus, False,
                   tuple(batches.get(str(here), ())), rows, flags,
                   tuple(loaders.get(str(here), ())), script, elsewhere=bool(others),
                   label=here.relative_to(root).as_posix() if others else "",
                   use=use, dim=dim, output_device=output_device)
        if not main.ok or not others:
            return main
        parts = [main]
        launched = str(Path(script).resolve()) if script else ""
        if launched and launched != str(here) and launched not in others:
            others.append(launched)  # it starts the process group
        for other in others:
            label = Path(other).relative_to(root).as_posix()
            done = _elsewhere(other, gpus, tuple(batches.get(other, ())), rows,
                              tuple(loaders.get(other, ())), flags, label,
                              starts=other == launched, use=use, dim=dim,
                              output_device=output_device)
            parts.append(dataclasses.replace(done, notes=tuple(f"{label} {n}"
                                                               for n in done.notes)))
        apply_at = ([] if root == start else [
            f"the files are named from {root}: apply the diff with `patch -p0` there"])
        return Rewrite(diff="\n".join(r.diff for r in parts), new_source=main.new_source,
                       notes=(*(n for r in parts for n in r.notes), *apply_at))
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _elsewhere(path: str, gpus: int, batch_lines: tuple[int, ...], scattered: int,
               loader_sites: tuple[str, ...], flags: tuple[str, ...], label: str,
               starts: bool, use: LoaderUse = UNSEEN, dim: int = 0,
               output_device: OutputDevice | None = None) -> Rewrite:
    """The DDP change of a file other than the wrap's where the batches are made: each
    rank's share of its DataLoaders and hand-made batches, ``"cuda:0"`` the rank's device;
    where it is the launched script (``starts``), the process group started at its start."""
    src = ScriptSource(read_source(path), path)
    edits = Edits(src)
    notes: list[str] = []
    loaders = RankLoaders(src, edits, notes, gpus, scattered, loader_sites, only_divided=True,
                          use=use)
    add_imports(src, edits, [*(["os"] if starts else []),
                             *(["torch", "dist"] if starts or loaders.own_samplers else []),
                             *(["DistributedSampler"] if loaders.shared else [])], src.tree)
    loaders.define_sampler_share()
    if starts:
        line, indent = _script_start(src)
        edits.insert_lines(line, _starts(gpus, Path(path).name,
                                         free_name(src, "rank", "local_rank"), indent))
    notes += _rank_devices(src, edits, output_device=output_device)
    _divide_batches(src, edits, batch_lines, gpus, scattered, dim)
    return finish(src, edits, _title(flags), notes, label)
