"""Each DDP rank's share of the DataLoaders a file makes, as a rewrite of its lines (the
DDP change's, :mod:`dpprof.script.ddp_diff`): ``batch_size // N`` and a
``DistributedSampler`` of the dataset, or the rank's share of a loader's own sampler
(``RankShare``, a helper the diff defines), a library's loader factory's ``batch_size``
divided; an evaluation's loader (iterated without gradients) evaluated whole by every rank."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from dpprof.script.rewrite import free_name, site_of
from dpprof.script.source import (
    Edits,
    NoRewrite,
    ScriptSource,
    calls_at,
    import_line,
    last_name,
    start_of,
)

__all__ = ["UNSEEN", "LoaderUse", "RankLoaders", "share", "share_words"]


@dataclass(frozen=True)
class LoaderUse:
    """How the DDP alternative saw the DataLoaders it divided used, each by the ``file:line``
    of the script's call that made it."""

    evaluated: tuple[str, ...] = ()  # iterated only without gradients (an evaluation's)
    unread: tuple[str, ...] = ()  # never iterated (the training steps read theirs)
    # a batch_size the ranks do not divide (an evaluation's 1 over 2 ranks): rounded up, as
    # the alternative gave each rank (rounded down it would be 0, which DataLoader refuses)
    uneven: tuple[str, ...] = ()


UNSEEN = LoaderUse()  # no use seen: every divided loader a training one, evenly divided


def share(src: ScriptSource, rows: ast.expr, gpus: int, scattered: int,
          uneven: bool = False) -> str:
    """Each rank's share of the rows ``rows`` reads: ``rows // gpus``, rounded up where the
    run saw DataParallel scatter ``scattered`` rows that ``gpus`` does not divide (its first
    chunk, the heaviest, is what the DDP alternative measured), or saw these rows
    ``uneven``."""
    text = src.seg(rows)
    simple = isinstance(rows, (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Call))
    if scattered % gpus or uneven:
        return f"({text} + {gpus - 1}) // {gpus}"
    return f"{text if simple else f'({text})'} // {gpus}"


def share_words(gpus: int) -> str:
    return (f"DDP: each rank loads its share: batch_size // {gpus}, "
            "sampler=DistributedSampler(dataset) (it shuffles: no shuffle=True)")


class RankLoaders:
    """Each rank's share of the DataLoaders a file makes (see :func:`_share_loader`,
    :func:`_share_made_loaders`), its edits made when constructed; the helper that shares a
    loader's own sampler defined after the file's imports by :meth:`define_sampler_share`."""

    def __init__(self, src: ScriptSource, edits: Edits, notes: list[str], gpus: int,
                 scattered: int, loader_sites: tuple[str, ...], only_divided: bool = False,
                 use: LoaderUse = UNSEEN) -> None:
        self.src, self.edits, self.notes, self.gpus = src, edits, notes, gpus
        # ``only_divided``: the loaders of a file other than the script's that the DDP
        # alternative divided, not its others (a library-like module's evaluation loaders)
        loaders = sorted((n for n in ast.walk(src.tree)
                          if isinstance(n, ast.Call) and last_name(n.func) == "DataLoader"
                          and (not only_divided
                               or _divided_at_run_time(src, n, loader_sites))),
                         key=start_of)
        self.shared = False  # a DistributedSampler given to one
        self.own_samplers: list[ast.Call] = []  # loaders whose own sampler each rank shares
        self.helper = ""
        # an evaluation's: iterated only without gradients, or never and unshuffled
        for loader in loaders:
            uneven = _divided_at_run_time(src, loader, use.uneven)
            if _divided_at_run_time(src, loader, use.evaluated) or (
                    _divided_at_run_time(src, loader, use.unread) and _unshuffled(loader)):
                # iterated only without gradients (an evaluation): every rank evaluates all
                # of it, as the script's metrics expect, in its share of each batch
                rows = _loader_args(loader).get("batch_size")
                if rows is not None:
                    edits.node(rows, share(src, rows, gpus, scattered, uneven))
                    notes.append(f"line {loader.lineno}: an evaluation's DataLoader: each rank "
                                 f"evaluates all of it in batches // {gpus}; a "
                                 "DistributedSampler would give each rank 1/"
                                 f"{gpus} of it, its metrics then to be reduced across ranks")
                continue
            if _own_sampler(loader) is not None and not self.helper:
                self.helper = free_name(src, *_SAMPLER_SHARE_NAMES)
            why = _share_loader(src, edits, loader, gpus, scattered, self.helper, uneven)
            if not why and _own_sampler(loader) is not None:
                self.own_samplers.append(loader)
            elif not why:
                self.shared = True
            elif why != _NO_BATCH_SIZE and _divided_at_run_time(src, loader, loader_sites):
                # applied as given, each rank would load more than the alternative measured
                by_hand = (f"1/{gpus} of each of its batches" if why == _OWN_BATCHES else
                           f"batch_size // {gpus} and a DistributedSampler")
                raise NoRewrite(f"line {loader.lineno}: the DDP alternative gave each rank its "
                                f"share of this DataLoader's batches, which the diff cannot "
                                f"({why}): give each rank {by_hand} by hand")
            else:
                at = src.statement(loader).lineno
                edits.insert_lines(at, [f"{src.indent(at)}# {share_words(gpus)}"])
                notes.append(f"line {loader.lineno}: give each rank its share of the "
                             f"DataLoader by hand ({why})")
        made = _share_made_loaders(src, edits, loader_sites, loaders, gpus, scattered,
                                   use.uneven)
        for call in made:
            at = src.statement(call).lineno
            edits.insert_lines(at, [f"{src.indent(at)}# {_shard_comment(call)}"])
            notes.append(f"line {call.lineno}: {_shard_note(call)}")
        self.any = bool(loaders or made)

    def define_sampler_share(self) -> None:
        """The helper that shares a loader's own sampler, after the file's imports (call it
        after they are added: it goes below them)."""
        src, helper, gpus = self.src, self.helper, self.gpus
        if not self.own_samplers:
            return
        at = import_line(src)
        spaced = at > len(src.lines) or not src.lines[at - 1].strip()  # a blank line follows
        self.edits.insert_lines(at, ["", "", *_sampler_share(helper),
                                     *([] if spaced else ["", ""])])
        for loader in self.own_samplers:
            self.notes.append(
                f"line {loader.lineno}: each rank takes every {_ordinal(gpus)} index of the "
                f"DataLoader's own sampler (`{helper}`, defined after the imports: every rank "
                f"draws the same order, seeded by the epoch), with batch_size // {gpus}")


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_LOADER_ARGS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler")


def _loader_args(loader: ast.Call) -> dict[str, ast.expr]:
    """``loader``'s arguments among :data:`_LOADER_ARGS`, by name (positional or keyword)."""
    given = {name: arg for name, arg in zip(_LOADER_ARGS, loader.args, strict=False)}
    return given | {kw.arg: kw.value for kw in loader.keywords if kw.arg in _LOADER_ARGS}


def _ordinal(n: int) -> str:
    """2nd, 3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _unshuffled(loader: ast.Call) -> bool:
    """``shuffle=False`` written, and no sampler of its own: an evaluation's order."""
    shuffle = _loader_args(loader).get("shuffle")
    return (isinstance(shuffle, ast.Constant) and shuffle.value is False
            and _own_sampler(loader) is None)


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
                  scattered: int, helper: str, uneven: bool = False) -> str:
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
            edits.node(rows, share(src, rows, gpus, scattered, uneven))
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
    edits.node(rows, share(src, rows, gpus, scattered, uneven))
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


def _loader_call(src: ScriptSource, line: int) -> ast.Call | None:
    """The call on ``line`` that made a DataLoader: of the calls that start there, the one
    given a ``batch_size`` keyword, else the outermost (``make(build(ds), 8)``: ``make``)."""
    starting = [c for c in calls_at(src, line) if c.lineno == line]
    named = [c for c in starting if any(kw.arg == "batch_size" for kw in c.keywords)]
    return (named or sorted(starting, key=lambda c: src.span(c)[0]))[0] if starting else None


def _share_made_loaders(src: ScriptSource, edits: Edits, loader_sites: tuple[str, ...],
                        loaders: list[ast.Call], gpus: int, scattered: int,
                        uneven: tuple[str, ...] = ()) -> list[ast.Call]:
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
        edits.node(rows, share(src, rows, gpus, scattered, site in uneven))
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
