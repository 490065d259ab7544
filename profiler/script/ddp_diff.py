"""DistributedDataParallel in place of DataParallel as a rewrite of the user's own lines (the
``ddp`` fix's diff, :mod:`dpprof.script.ddp_run`, and the start of every rung of the ladder on
a DataParallel script): ``DDP(<module>.cuda(rank), device_ids=[rank])`` at the wrap (with
``gradient_as_bucket_view=True`` for ``bucket_view``), the process group and the rank's device
at the start of the wrap's function (or of the script), the imports, ``"cuda:0"`` made each
rank's own device, and each rank's share of every ``DataLoader`` (``batch_size // N``, a
``DistributedSampler``) and of the batches made by hand."""

from __future__ import annotations

import ast
from pathlib import Path

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
    dotted_name,
    import_line,
    last_name,
    module_arg,
    parenthesized,
    start_of,
    until_scope,
)

DDP_TITLE = "DistributedDataParallel"  # and the names of its flags (gradient_as_bucket_view)

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
    body: list[ast.stmt] | None = None
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = scope.body
    else:
        main = next((a for a in until_scope(src, wrap) if isinstance(a, ast.If)
                     and "__name__" in ast.unparse(a.test)
                     and "__main__" in ast.unparse(a.test)), None)
        if main is not None:
            body = main.body
    if body is None:
        return import_line(src), ""
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str) and len(body) > 1:
        first = body[1]
    if first.lineno == start_of(src.parents[first])[0]:  # ``def f(): x`` on one line
        raise NoRewrite(f"line {first.lineno}: the body shares its line with the def")
    return first.lineno, src.indent(first.lineno)


def ddp(source: str, path: str, dp_line: int, gpus: int, bucket_view: bool = False,
        batch_lines: tuple[int, ...] = (), rows: int = 0,
        flags: tuple[str, ...] = (), loader_sites: tuple[str, ...] = ()) -> Rewrite:
    """The script as ``gpus`` DistributedDataParallel ranks (see the module).
    ``batch_lines``: the lines where the script makes its batches by hand (a random factory
    of the scattered rows, which the DDP alternative cut to each rank's share); ``flags``:
    DDP's further keyword arguments (``"broadcast_buffers=False"``), named in the title;
    ``loader_sites``: ``file:line`` of the script's calls that made the DataLoaders whose
    batch_size the DDP alternative divided (a library's loader factory's, where it used one)."""
    try:
        return _ddp(ScriptSource(source, path), dp_line, gpus,
                    (("gradient_as_bucket_view=True",) if bucket_view else ()) + flags,
                    batch_lines, rows, loader_sites)
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
    raise NoRewrite(f"the script starts its own process group (line {starts}){own}: run it as "
                    f"DDP ranks with `torchrun --nproc-per-node {gpus} "
                    f"{Path(src.path).name}` rather than change its lines{share}{options}")


def _batch_rows_node(call: ast.Call) -> ast.expr | None:
    """The first dimension of a batch factory's size (``torch.randint(0, V, (B, T))``:
    ``B``; ``torch.randn(B, D)``, ``torch.full((B,), 1.0)``: ``B``), as the DDP alternative
    read it."""
    size = next((k.value for k in call.keywords if k.arg == "size"), None)
    if size is None:
        if last_name(call.func) == "randint":
            size = next((a for a in call.args if isinstance(a, (ast.Tuple, ast.List))), None)
        elif call.args:
            size = call.args[0]
    if isinstance(size, (ast.Tuple, ast.List)):
        return size.elts[0] if size.elts else None
    return size


def _share(src: ScriptSource, rows: ast.expr, gpus: int, scattered: int) -> str:
    """Each rank's share of the rows ``rows`` reads: ``rows // gpus``, rounded up where the
    run saw DataParallel scatter ``scattered`` rows that ``gpus`` does not divide (its first
    chunk, the heaviest, is what the DDP alternative measured)."""
    text = src.seg(rows)
    simple = isinstance(rows, (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Call))
    if scattered % gpus:
        return f"({text} + {gpus - 1}) // {gpus}"
    return f"{text if simple else f'({text})'} // {gpus}"


def _divide_batches(src: ScriptSource, edits: Edits, lines: tuple[int, ...], gpus: int,
                    scattered: int) -> list[int]:
    """Each rank makes its share of a hand-made batch: ``B`` -> ``B // gpus`` in the
    factories on ``lines``; the lines edited."""
    done = []
    for line in lines:
        call = next((c for c in calls_at(src, line)
                     if last_name(c.func) in BATCH_FACTORIES), None)
        rows = _batch_rows_node(call) if call is not None else None
        if rows is None or isinstance(rows, ast.Starred):
            continue
        edits.node(rows, _share(src, rows, gpus, scattered))
        done.append(line)
    return done


def _ddp(src: ScriptSource, dp_line: int, gpus: int, flags: tuple[str, ...],
         batch_lines: tuple[int, ...] = (), scattered: int = 0,
         loader_sites: tuple[str, ...] = ()) -> Rewrite:
    _refuse_own_process_group(src, gpus, flags, scattered)
    edits = Edits(src)
    notes: list[str] = []
    dp = data_parallel_call(src, dp_line)
    wrap = src.statement(dp)
    module = module_arg(dp)
    inner = _move(src, module) or module
    rank = free_name(src, "rank", "local_rank")
    args = [f"{parenthesized(src, inner)}.cuda({rank})", f"device_ids=[{rank}]"]
    if len(dp.args) > 3:
        args.append(f"dim={src.seg(dp.args[3])}")
    args += [src.seg(kw) for kw in dp.keywords if kw.arg == "dim"]
    if any(kw.arg is None for kw in dp.keywords):
        raise NoRewrite(f"line {dp.lineno}: DataParallel's arguments are unpacked (**)")
    args += flags
    # DataParallel(model).cuda(): DDP's module is on its device already
    outer: ast.AST = dp
    parent = src.parents.get(dp)
    if isinstance(parent, ast.Attribute) and _move(src, src.parents.get(parent, dp)) is dp:
        outer = src.parents[parent]
    edits.node(outer, f"DDP({', '.join(args)})")
    share = (f"DDP: each rank loads its share: batch_size // {gpus}, "
             "sampler=DistributedSampler(dataset) (it shuffles: no shuffle=True)")
    loaders = sorted((n for n in ast.walk(src.tree)
                      if isinstance(n, ast.Call) and last_name(n.func) == "DataLoader"),
                     key=start_of)
    shared = False
    own_samplers: list[ast.Call] = []  # loaders whose own sampler each rank takes a share of
    helper = ""
    for loader in loaders:
        if _own_sampler(loader) is not None and not helper:
            helper = free_name(src, *_SAMPLER_SHARE_NAMES)
        why = _share_loader(src, edits, loader, gpus, scattered, helper)
        if not why and _own_sampler(loader) is not None:
            own_samplers.append(loader)
        elif not why:
            shared = True
        elif why != _NO_BATCH_SIZE and _divided_at_run_time(src, loader, loader_sites):
            # applied as given, each rank would load more than the alternative measured
            by_hand = (f"1/{gpus} of each of its batches" if why == _OWN_BATCHES else
                       f"batch_size // {gpus} and a DistributedSampler")
            raise NoRewrite(f"line {loader.lineno}: the DDP alternative gave each rank its "
                            f"share of this DataLoader's batches, which the diff cannot ({why})"
                            f": give each rank {by_hand} by hand")
        else:
            at = src.statement(loader).lineno
            edits.insert_lines(at, [f"{src.indent(at)}# {share}"])
            notes.append(f"line {loader.lineno}: give each rank its share of the DataLoader by "
                         f"hand ({why})")
    made = _share_made_loaders(src, edits, loader_sites, loaders, gpus, scattered)
    for call in made:
        at = src.statement(call).lineno
        edits.insert_lines(at, [f"{src.indent(at)}# {_shard_comment(call)}"])
        notes.append(f"line {call.lineno}: {_shard_note(call)}")
    add_imports(src, edits, ["os", "torch", "dist", "DDP",
                             *(["DistributedSampler"] if shared else [])], src.scope(wrap))
    if own_samplers:
        at = import_line(src)
        spaced = at > len(src.lines) or not src.lines[at - 1].strip()  # a blank line follows
        edits.insert_lines(at, ["", "", *_sampler_share(helper), *([] if spaced else ["", ""])])
        for loader in own_samplers:
            notes.append(f"line {loader.lineno}: each rank takes every {gpus}th index of the "
                         f"DataLoader's own sampler (`{helper}`, defined after the imports: every "
                         "rank draws the same order, seeded by the epoch), with "
                         f"batch_size // {gpus}")
    line, indent = _init_line(src, wrap)
    name = Path(src.path).name
    edits.insert_lines(line, [
        f"{indent}# torchrun --nproc-per-node {gpus} {name}",
        f'{indent}dist.init_process_group("nccl")',
        f'{indent}{rank} = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device({rank})'])
    # "cuda:0" is every rank's own device once set_device has run
    replaced = src.span(outer)
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Constant) and node.value == "cuda:0" and not isinstance(
                src.parents.get(node), ast.JoinedStr) and not (
                replaced[0] <= src.span(node)[0] < replaced[1]):
            text = src.seg(node)
            edits.node(node, text.replace("cuda:0", "cuda"))
    divided = _divide_batches(src, edits, batch_lines, gpus, scattered)
    if not loaders and not made and not divided:
        edits.insert_lines(wrap.lineno, [f"{src.indent(wrap.lineno)}# {share}"])
        notes.append("the script makes its batches without a DataLoader: give each rank its "
                     f"share (1/{gpus} of the batch) by hand")
    return finish(src, edits, ", ".join([DDP_TITLE, *(f.partition("=")[0] for f in flags)]),
                  notes)


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_LOADER_ARGS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler")


def _loader_args(loader: ast.Call) -> dict[str, ast.expr]:
    """``loader``'s arguments among :data:`_LOADER_ARGS`, by name (positional or keyword)."""
    given = {name: arg for name, arg in zip(_LOADER_ARGS, loader.args, strict=False)}
    return given | {kw.arg: kw.value for kw in loader.keywords if kw.arg in _LOADER_ARGS}


def _own_sampler(loader: ast.Call) -> ast.expr | None:
    """The sampler ``loader`` is given (``DataLoader(ds, 8, sampler=s)``: ``s``), if any."""
    sampler = _loader_args(loader).get("sampler")
    return None if isinstance(sampler, ast.Constant) and sampler.value is None else sampler


# why a loader is left to the user where that changes nothing the alternative measured (its
# batch_size the default 1, which the alternative's division left at 1)
_NO_BATCH_SIZE = "no dataset or no batch_size given"
_OWN_BATCHES = "it has a batch sampler of its own"


def _divided_at_run_time(src: ScriptSource, loader: ast.Call, loader_sites: tuple[str, ...]
                         ) -> bool:
    """Whether the DDP alternative divided ``loader``'s batches as the script ran (a site it
    recorded is on the call's lines)."""
    first, last = loader.lineno, loader.end_lineno or loader.lineno
    return any(Path(path).resolve() == Path(src.path).resolve() and first <= line <= last
               for path, line in map(site_of, loader_sites))


# the names the helper that splits a loader's own sampler among the ranks may take
_SAMPLER_SHARE_NAMES = ("RankShare", "RankShareSampler", "DdpRankShare")


def _sampler_share(name: str) -> list[str]:
    """The helper the diff defines (as ``name``) to give each rank its share of a loader's own
    sampler as DistributedSampler shares a dataset: the sampler's order drawn alike on every
    rank (torch's random generator seeded by the epoch, for the samplers that draw from it),
    padded to a multiple of the ranks, every rank its every world-size-th index; torch has no
    such wrapper."""
    return [
        f"class {name}:",
        '    """DDP: this rank\'s share of a sampler\'s indices, as DistributedSampler shares a',
        "    dataset: every rank draws the same order (torch's generator seeded by the epoch),",
        '    padded to a multiple of the ranks, and takes every world-size-th index."""',
        "",
        "    def __init__(self, sampler):",
        "        self.sampler, self.epoch = sampler, 0",
        "",
        "    def __len__(self):",
        "        return -(-len(self.sampler) // dist.get_world_size())",
        "",
        "    def __iter__(self):",
        "        with torch.random.fork_rng(devices=[]):",
        "            torch.manual_seed(self.epoch)",
        "            order = list(self.sampler)",
        "        self.epoch += 1",
        "        world = dist.get_world_size()",
        "        order = (order * world)[:-(-len(order) // world) * world]",
        "        return iter(order[dist.get_rank()::world])",
    ]


def _share_loader(src: ScriptSource, edits: Edits, loader: ast.Call, gpus: int,
                  scattered: int, helper: str) -> str:
    """Each rank loads its share of ``loader``'s batches, as the DDP alternative divided
    them: ``batch_size`` // ``gpus`` and a ``DistributedSampler`` of its dataset (shuffling
    as the loader did, which then no longer shuffles itself), or, where the loader has a
    sampler of its own, that sampler's share (``helper``, :func:`_sampler_share`). "" where
    done, else why not."""
    if any(isinstance(a, ast.Starred) for a in loader.args) or any(
            kw.arg is None for kw in loader.keywords):
        return "its arguments are unpacked"
    given = _loader_args(loader)
    if "batch_sampler" in given:
        return _OWN_BATCHES
    own = _own_sampler(loader)
    if own is not None:
        rows = given.get("batch_size")
        if rows is not None and not (isinstance(rows, ast.Constant) and rows.value is None):
            edits.node(rows, _share(src, rows, gpus, scattered))
        edits.node(own, f"{helper}({src.seg(own)})")
        return ""
    if len(loader.args) > 2:
        return "its shuffle or sampler is given by position"
    dataset, rows = given.get("dataset"), given.get("batch_size")
    if dataset is None or rows is None:
        return _NO_BATCH_SIZE
    named = src.seg(dataset)
    if not isinstance(dataset, (ast.Name, ast.Attribute)):
        # the sampler needs the dataset too: made once, named, before the loader's statement
        stmt = src.statement(loader)
        if any(isinstance(a, (ast.Lambda, *_COMPREHENSIONS)) for a in src.ancestors(loader)
               if start_of(a) >= start_of(stmt) and a is not stmt):
            return "it is made inside a lambda or comprehension"
        try:
            src.whole_lines(stmt)
        except NoRewrite:
            return f"line {stmt.lineno} holds more than one statement"
        named = free_name(src, "dataset", "train_dataset", "loader_dataset")
        edits.insert_lines(stmt.lineno, [f"{src.indent(stmt.lineno)}{named} = "
                                         f"{src.seg(dataset)}"])
        edits.node(dataset, named)
    edits.node(rows, _share(src, rows, gpus, scattered))
    shuffle = next((kw for kw in loader.keywords if kw.arg == "shuffle"), None)
    order = src.seg(shuffle.value) if shuffle is not None else "False"
    sampler = f"sampler=DistributedSampler({named}, shuffle={order})"
    if shuffle is not None:
        edits.node(shuffle, sampler)
    else:
        last = max([*loader.args, *(kw.value for kw in loader.keywords)], key=start_of)
        end = src.span(last)[1]
        edits.replace(end, end, f", {sampler}")
    return ""


def ddp_at(dp_site: str, gpus: int, bucket_view: bool = False,
           batch_sites: tuple[str, ...] = (), rows: int = 0,
           flags: tuple[str, ...] = (), loader_sites: tuple[str, ...] = ()) -> Rewrite:
    """:func:`ddp` from the wrap's ``file:line`` (and those of hand-made batches and of the
    calls that made the divided DataLoaders; ``rows``: the batch DataParallel scattered)."""
    try:
        path, line = site_of(dp_site)
        batch_lines = tuple(n for p, n in map(site_of, batch_sites) if p == path)
        return ddp(read_source(path), path, line, gpus, bucket_view, batch_lines, rows, flags,
                   loader_sites)
    except NoRewrite as e:
        return Rewrite(reason=str(e))


def _loader_call(src: ScriptSource, line: int) -> ast.Call | None:
    """The call on ``line`` that made a DataLoader: of the calls that start there, the one
    given a ``batch_size`` keyword, else the outermost (``make(build(ds), 8)``: ``make``)."""
    starting = [c for c in calls_at(src, line) if c.lineno == line]
    named = [c for c in starting if any(kw.arg == "batch_size" for kw in c.keywords)]
    return (named or sorted(starting, key=lambda c: src.span(c)[0]))[0] if starting else None


def _share_made_loaders(src: ScriptSource, edits: Edits, loader_sites: tuple[str, ...],
                        loaders: list[ast.Call], gpus: int, scattered: int) -> list[ast.Call]:
    """Each rank's share of the DataLoaders the script made through a call of its own that
    is not ``DataLoader(...)`` (a library's factory, ``create_loader(ds, batch_size=B)``),
    as the DDP alternative divided them at run time: that call's ``batch_size`` keyword
    ``B`` -> ``B // gpus``; the calls edited. :class:`NoRewrite` where the alternative
    divided a loader whose batch_size the diff cannot divide (the diff would promise a
    per-rank peak the patched script does not have)."""
    calls: list[ast.Call] = []
    for site in loader_sites:
        path, line = site_of(site)
        where = f"{Path(path).name}:{line}"
        if Path(path).resolve() != Path(src.path).resolve():
            raise NoRewrite(f"the DataLoader made at {where} (a file other than "
                            f"{Path(src.path).name}, where the DataParallel is made) is "
                            f"divided by the DDP alternative: give its batch_size // {gpus}"
                            " there by hand")
        call = _loader_call(src, line)
        if call is None or call in loaders or call in calls:
            continue  # a literal DataLoader(...): divided with its sampler above
        rows = next((kw.value for kw in call.keywords if kw.arg == "batch_size"), None)
        if rows is None:
            callee = last_name(call.func) or "the call"
            raise NoRewrite(f"line {line}: `{callee}(...)` makes the DataLoader the DDP "
                            "alternative divided, and its batch size is not a `batch_size` "
                            f"keyword the diff can divide: give it batch_size // {gpus} by hand")
        edits.node(rows, _share(src, rows, gpus, scattered))
        calls.append(call)
    return calls


def _shard_comment(call: ast.Call) -> str:
    """The comment above a library's loader call whose batch_size the diff divided: the
    sampler the diff cannot add through that call."""
    return (f"DDP: {last_name(call.func) or 'this call'} makes the DataLoader: turn on its own "
            "distributed option (each rank its own shard of the data)")


def _shard_note(call: ast.Call) -> str:
    """The fix's note for :func:`_shard_comment`'s call."""
    return (f"`{last_name(call.func) or 'the call'}(...)` makes the DataLoader: its batch_size "
            "is divided, but every rank still reads the whole dataset; give each rank its own "
            "shard with the library's own distributed option (a DistributedSampler inside)")
