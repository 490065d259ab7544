"""DistributedDataParallel in place of DataParallel, as ``dpprof run`` measures it (the
``ddp`` fix's strategy, :mod:`dpprof.fixes.kinds.ddp_in_place`): the script run once more as
one emulated rank of DDP, each DataLoader's batch (and each batch the script makes by hand)
divided among the ranks as a DDP script sets it, DataParallel's forward that rank's DDP
(:meth:`dpprof.script.wrappers.VirtualDataParallel.as_ddp_rank`); its change is the DDP diff
of the script's own lines (:mod:`dpprof.script.ddp_diff`).

The rank also follows DDP's ``gradient_as_bucket_view=True`` in a ledger of its device while
it runs plain: :mod:`dpprof.script.gradient_as_bucket_view_run` reads its fix from there."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from dpprof.emulator.call_sites import relative_site
from dpprof.emulator.cuda_api import device_index
from dpprof.emulator.ddp import UNUSED_PARAMETERS
from dpprof.fixes.kinds.ddp_in_place import FIX
from dpprof.result import STATUS_ERROR
from dpprof.scenarios.names import DDP
from dpprof.scenarios.step import DdpOptions
from dpprof.script import ddp_diff
from dpprof.script.batch_shares import divide_hand_made_batches, script_line
from dpprof.script.ddp_loaders import LoaderUse
from dpprof.script.ddp_rank import built_at_the_wrap
from dpprof.script.installed_code import installed_site
from dpprof.script.losses_on_replicas import with_criteria_unwrapped, wraps_a_criterion
from dpprof.script.notes import (
    about_the_share,
    alternative_fix,
    alternative_notes,
    raised_on_a_share,
)
from dpprof.script.parallel_state import current, state_of
from dpprof.script.part_of_model import PART_OF_MODEL, WholeModel
from dpprof.script.rewrite import Rewrite, rewrite_text
from dpprof.script.runner import run_script
from dpprof.script.strategy import (
    Alternative,
    AlternativeRuns,
    AlternativeState,
    scattered_as_in,
)

if TYPE_CHECKING:
    from dpprof.emulator.patcher import Patcher
    from dpprof.emulator.virtual_cuda import VirtualCuda
    from dpprof.script.runner import ScriptConfig, ScriptRun
    from dpprof.script.wrappers import VirtualDataParallel

__all__ = ["STRATEGY", "DdpInPlace", "DdpState", "ddp_state", "diff_ddp", "library_wrap",
           "rank_output_device"]

SENTENCE = ("the same script with DistributedDataParallel in place of DataParallel (one "
            "emulated rank of {n}; each rank its share of the batch, as a DDP script makes it)")
DETAIL = ("the same script as {gpus} DDP ranks: every GPU its own parameters, gradients, "
          "optimizer state and its share of each batch.")


@dataclass
class DdpState(AlternativeState):
    """What one run of the DDP alternative follows (its record, :func:`ddp_state`)."""

    scattered_rows: int = 0  # the rows DataParallel scattered in the run as written (0: unknown)
    scattered_dim: int = 0  # the dimension it split them along
    world: int = 0  # the GPUs it split them to, the ranks (0: every GPU the script sees)
    # how each rank got its share of the batch: a DataLoader's batch_size divided, a
    # DataLoader's own batch sampler cut (each of its batches to its first share), and the
    # script's lines whose hand-made batches were cut to it ("torch.randn at file:line")
    divided_loader: bool = False
    cut_batch_sampler: bool = False
    divided_sites: list[str] = field(default_factory=list)
    # "file:line" of the loop's moves to a GPU of tensors with the batch's rows made another
    # way (numpy's, torch.arange(B)'s), each cut to the rank's share as it moved
    moved_sites: list[str] = field(default_factory=list)
    # "file:line" of the script's own calls that made each DataLoader whose batch_size the
    # alternative divided (a library's loader factory's call, where the script has one)
    loader_sites: list[str] = field(default_factory=list)
    # of those, the ones iterated with gradients on (training) and off (an evaluation's)
    trained_loader_sites: list[str] = field(default_factory=list)
    evaluated_loader_sites: list[str] = field(default_factory=list)
    # of those, the ones whose batch_size the ranks do not divide (rounded up for each rank)
    uneven_loader_sites: list[str] = field(default_factory=list)
    # how each rank got its share of the batch, in words, once the run ended ("": it did not)
    batch_division: str = ""
    # the rank's peak under gradient_as_bucket_view=True (followed in a ledger while it ran
    # plain), or why it could not be followed (the gradient-as-bucket-view fix reads them)
    bucket_view_peak_bytes: int | None = None
    bucket_view_unsure: str | None = None
    # the rows each rank's inputs were cut to at the model's call (0: not cut there)
    model_input_share: int = 0
    # the DDP call's further keyword arguments the run was measured with (a fix derived
    # from it, gradient_as_bucket_view's, writes them too: find_unused_parameters=True)
    flags: tuple[str, ...] = ()
    # DDP raised its error on parameters no loss used (whether or not the script caught it)
    unused_raised: bool = False
    # what of the script's DataParallel subclass gave the rank its inputs, in words ("":
    # DataParallel's scatter): "PerGpuBatches's own scatter", "...DataParallel's own forward"
    rank_scatter: str = ""
    # a backward after DDP had all-reduced its forward's gradients (LATE_GRADIENTS)
    late_gradients: bool = False
    # the DataParallel wraps a part of the model, and the rank's DDP the whole ("VGG's
    # features"; "": what the script calls)
    part_of_model: str = ""
    # how the rank applied a criterion the script wraps in DataParallel (no DDP), in words
    rank_criteria: tuple[str, ...] = ()
    # DataParallel's output_device where it is not its first GPU (logical; None: it is, or
    # no DataParallel was made), which the rank took for its own GPU, and "file:line" of
    # the script's lines that named it once the wrap was made (the diff rewrites them)
    output_device: int | None = None
    output_device_sites: list[str] = field(default_factory=list)

    @property
    def evaluated_only(self) -> tuple[str, ...]:
        """The divided loaders' sites iterated without gradients and never with them."""
        return tuple(s for s in self.evaluated_loader_sites
                     if s not in self.trained_loader_sites)

    @property
    def use(self) -> LoaderUse:
        """How the divided loaders were used, as the DDP diff reads it."""
        return LoaderUse(self.evaluated_only, self.unread, tuple(self.uneven_loader_sites))

    @property
    def unread(self) -> tuple[str, ...]:
        """The divided loaders' sites never iterated (the training steps' were)."""
        return tuple(s for s in self.loader_sites if s not in self.trained_loader_sites
                     and s not in self.evaluated_loader_sites)

    def ranks(self, vc: VirtualCuda) -> int:
        """A rank on each GPU DataParallel split the batch to, else on each GPU the script
        sees: asked when a batch is made, not before the script ran (CUDA reads
        CUDA_VISIBLE_DEVICES once, and the script may set it)."""
        return self.world or vc.device_count()

    def share(self, vc: VirtualCuda) -> int:
        """A rank's rows of the batch: DataParallel's first chunk, ``ceil(B / N)``."""
        return -(-self.scattered_rows // self.ranks(vc))

    @property
    def batch_sites(self) -> tuple[str, ...]:
        """``file:line`` of the script's hand-made batches cut to each rank's share."""
        return tuple(made.rpartition(" at ")[2] for made in self.divided_sites)


def ddp_state(run: ScriptRun) -> DdpState | None:
    """What ``run`` followed where it ran as the DDP alternative (or a fix that is DDP with
    other options), else None."""
    state = run.alternative_state
    return state if isinstance(state, DdpState) else None


def diff_ddp(run: ScriptRun, gpus: int, followed: DdpState, script: str,
             bucket_view: bool = False) -> str:
    """The DDP change around the script's own DataParallel line, as the DDP alternative
    whose record is ``followed`` ran it (each rank's share of the batches made by hand and
    of the DataLoaders it divided, which of those were an evaluation's, DDP's further
    keyword arguments, what made a rank's inputs where a subclass's own piece did);
    ``script``: the file the launcher runs, where the wrap may be in a file it imports."""
    flags, rank_inputs = followed.flags, followed.rank_scatter
    if not run.dp_sites:
        return ""
    library = library_wrap(run.dp_sites[0], gpus, run.batch_rows,
                           (*(("gradient_as_bucket_view=True",) if bucket_view else ()), *flags))
    if library:  # nothing of the script's to rewrite
        return rewrite_text(Rewrite(reason=library))
    rewrite = ddp_diff.ddp_at(run.dp_sites[0], gpus, bucket_view=bucket_view,
                              batch_sites=followed.batch_sites, rows=run.batch_rows,
                              flags=flags, loader_sites=tuple(followed.loader_sites),
                              script=script, use=followed.use, dim=followed.scattered_dim,
                              output_device=rank_output_device(followed))
    if followed.part_of_model and rewrite.ok:
        rewrite = Rewrite(reason=(
            f"{relative_site(run.dp_sites[0])}: DataParallel wraps a part of the model "
            f"({followed.part_of_model}), which the model's own forward calls: DDP wraps the "
            "whole model instead, where it is built (`model = DDP(model.cuda(rank), "
            "device_ids=[rank])`, as the DDP alternative ran it), the part left unwrapped: by "
            "hand"))
    if followed.moved_sites and rewrite.ok:  # cut as they moved: no line to rewrite
        rewrite = dataclasses.replace(rewrite, notes=(*rewrite.notes, *(
            f"{relative_site(site)} moves the batch's {followed.scattered_rows} rows to the "
            f"GPU, made with neither a DataLoader nor a torch factory: make each rank's "
            f"{followed.batch_rows} (rows // {gpus}) there by hand, as the DDP alternative "
            "ran it" for site in followed.moved_sites)))
    if rank_inputs and rewrite.ok:  # the change as the alternative ran it
        rewrite = dataclasses.replace(rewrite, notes=(*rewrite.notes, (
            f"{relative_site(run.dp_sites[0])}: {rank_inputs} made each GPU's input; DDP "
            "passes the model the batch as loaded: give it what that makes for one GPU (the "
            "rank's), as the DDP alternative measured")))
    return rewrite_text(with_criteria_unwrapped(rewrite, followed.rank_criteria))


def rank_output_device(followed: DdpState) -> ddp_diff.OutputDevice | None:
    """DataParallel's output_device as the DDP diff takes it, where the alternative's rank
    took it for its own GPU (None: it is DataParallel's first GPU)."""
    if followed.output_device is None:
        return None
    return ddp_diff.OutputDevice(followed.output_device, tuple(followed.output_device_sites))


def library_wrap(site: str, gpus: int, rows: int, options: tuple[str, ...] = ()) -> str:
    """Where a library's code wrapped DataParallel (``site``, its ``file:line``: Hugging
    Face's Trainer does, seeing several GPUs in one process), why there is no DDP diff and
    what to do instead: start the script under a launcher, each rank loading its share of
    DataParallel's ``rows``, DDP given ``options``; "" where ``site`` is the script's."""
    library = _library_site(site)
    if not library:
        return ""
    share = (f", each rank loading {-(-rows // gpus)} rows (DataParallel's {rows} // {gpus})"
             if rows else "")
    given = f", its DistributedDataParallel given {', '.join(options)}" if options else ""
    return (f"DataParallel is wrapped by a library's code ({library}), not by the script's "
            "lines: nothing in the script to rewrite; where the library wraps "
            "DistributedDataParallel itself once started by a launcher (Hugging Face's "
            f"Trainer does), start the script with `torchrun --nproc-per-node {gpus}`"
            f"{share}{given}; the library's DDP has options of its own (Trainer's "
            "find_unused_parameters=True, which skips DDP's bucket rebuild), so its peak is "
            "that run's: measure it with `dpprof run -- torchrun ...`")


def _library_site(site: str) -> str:
    """``site`` (``file:line``) relative to the folder its package is installed in
    (``transformers/trainer.py:1234``), or "" where it is not a library's
    (:mod:`dpprof.script.installed_code`)."""
    path, _, line = site.rpartition(":")
    relative = installed_site(path)
    return f"{relative}:{line}" if relative else ""


def script_site(frame: Any) -> str | None:
    """``file:line`` of the innermost frame from ``frame`` outwards that is the script's
    own code (:func:`dpprof.script.batch_shares.script_line`): the script's call that led to
    ``frame``, through any library's functions (a loader factory's); None where no frame is
    the script's."""
    while frame is not None:
        site = script_line(frame)
        if site is not None:
            return site
        frame = frame.f_back
    return None


def _output_device_on_the_rank(state: DdpState, vc: VirtualCuda, patcher: Patcher) -> None:
    """Once the script wraps DataParallel with an ``output_device`` other than its first GPU
    (``cuda:k``, where the script then puts its targets and computes the loss), each naming
    of cuda:k by the script's own lines (``.cuda(k)``, ``"cuda:k"``) is the rank's own GPU,
    as the DDP diff rewrites them (without it a rank's outputs meet targets on another GPU);
    those lines go into ``state``. torch's and libraries' code (DataParallel's own pieces
    among them) is not rewritten, and keeps its devices."""
    index_of = vc.index_of

    def rank_index_of(device: Any) -> int:
        moved = current().log.rank_output_device
        if moved is not None and device_index(device) == moved[0]:
            frame: FrameType | None = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(
                    "dpprof."):  # the interception of the call
                frame = frame.f_back
            # the script's own call (torch's: DataParallel's pieces, a library's: neither
            # is in the diff)
            site = script_line(frame) if frame is not None else None
            if site is not None:
                if site not in state.output_device_sites:
                    state.output_device_sites.append(site)
                device = moved[1]
        return index_of(device)

    patcher.patch(vc, "index_of", rank_index_of)


class RankShareOfBatches:
    """A DataLoader's own batch sampler as one rank of ``world`` loads it under DDP: the
    first ``ceil(len / world)`` indices of each batch (DataParallel's first chunk, the
    heaviest rank's share)."""

    def __init__(self, batches: Any, world: int) -> None:
        self.batches, self.world = batches, world

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for batch in self.batches:
            indices = list(batch)
            yield indices[:-(-len(indices) // self.world)]


def _made_from(batches: Any, divided: weakref.WeakSet[Any], depth: int = 3) -> bool:
    """Whether ``batches`` is, or wraps (through the attributes libraries keep the batch
    sampler they shard or wrap under), one of the ``divided`` batch samplers."""
    for _ in range(depth + 1):
        try:
            if batches in divided:
                return True
        except TypeError:
            return False
        inner = next((getattr(batches, a) for a in ("batch_sampler", "sampler", "batches")
                      if getattr(batches, a, None) is not None), None)
        if inner is None:
            return False
        batches = inner
    return False


def _division(state: DdpState, world: int) -> str:
    """How the alternative gave each rank its share of the batch ("": it did not)."""
    ways = []
    if state.divided_loader:
        ways.append(f"each DataLoader's batch_size divided by {world}")
    if state.cut_batch_sampler:
        ways.append(f"a DataLoader's own batch sampler: the first ceil(len / {world}) indices "
                    "of every batch it yields")
    if state.divided_sites:
        ways.append(f"the batches the script makes ({', '.join(state.divided_sites)}) "
                    f"cut to {state.batch_rows} rows of DataParallel's "
                    f"{state.scattered_rows}")
    if state.moved_sites:
        ways.append(f"what the loop moves to a GPU with the batch's rows (at "
                    f"{', '.join(relative_site(m) for m in state.moved_sites)}) cut to "
                    f"{state.batch_rows} rows of DataParallel's {state.scattered_rows} as it "
                    "moved")
    if state.model_input_share:
        ways.append(f"the model's inputs cut at its call to DataParallel's first chunk, "
                    f"{state.model_input_share} of its {state.scattered_rows} rows (the "
                    "script still makes its whole batch: the rank's GPU holds the rest of "
                    "the batch's inputs too)")
    if state.rank_scatter:
        ways.append(f"the model given what {state.rank_scatter} gives the rank's GPU alone "
                    "(a rank is DataParallel on one GPU; a DDP script passes its model that)")
    return "; ".join(ways)


LATE_GRADIENTS = (
    "the script calls backward() again on the outputs of one forward after DDP all-reduced "
    "that forward's gradients (a GAN's generator and discriminator losses from one call of "
    "the model, each with its own backward()): DDP's autograd hooks are off from the end of "
    "the first backward until the next forward (reducer.cpp's expect_autograd_hooks_), so "
    "the later gradients stay each rank's own, never averaged, and the ranks' weights drift "
    "apart; measured so (the memory is alike), but a DDP script computes each backward's "
    "losses from a forward of its own (SPADE calls its model once for the generator's "
    "losses, once for the discriminator's)")


class DdpInPlace(Alternative):
    """The DDP alternative (see the module). A fix that is DDP with other options is this
    class with its own :attr:`options`, :attr:`flags` (their words in the diff),
    :attr:`sentence` and :attr:`detail`."""

    as_ranks = True
    ladder_floor = True
    options = DdpOptions()  # DDP's reducer options the rank runs with
    flags: tuple[str, ...] = ()  # the DDP call's further keyword arguments in the diff
    sentence = SENTENCE  # the alternative's first note ({n}: the GPUs)
    detail = DETAIL  # its fix's detail ({gpus}: the GPUs)
    # DataParallel's rows, where each rank's share is cut at the model's call rather than
    # where the script makes its batches (0: where they are made); the share cut, once it was
    model_input_rows = 0
    model_input_share = 0

    def new_state(self, cfg: ScriptConfig) -> DdpState:
        return DdpState(scattered_rows=cfg.scattered_rows, scattered_dim=cfg.scattered_dim,
                        world=cfg.scattered_gpus)

    def install(self, state: AlternativeState, vc: VirtualCuda, patcher: Patcher) -> None:
        from torch.utils.data import DataLoader

        assert isinstance(state, DdpState)  # this alternative's own (new_state)

        orig_init = DataLoader.__init__
        # the batch samplers of loaders divided here: a library that makes a loader again
        # from one (accelerate's prepare: its BatchSamplerShard over the first loader's
        # batch sampler, under HF's Trainer) gets batches already divided
        divided: weakref.WeakSet[Any] = weakref.WeakSet()
        made_at: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # its site

        def loader_init(loader: Any, dataset: Any, batch_size: int | None = 1,
                        *args: Any, **kwargs: Any) -> None:
            batches = kwargs.get("batch_sampler", args[2] if len(args) > 2 else None)
            # a batch sampler of a loader divided here already is left as it is
            divides = (not _made_from(batches, divided) if batches is not None
                       else bool(batch_size))
            if divides and batches is not None:  # its own: each rank its share of each
                share = RankShareOfBatches(batches, state.ranks(vc))
                if "batch_sampler" in kwargs:
                    kwargs["batch_sampler"] = share
                else:
                    args = (*args[:2], share, *args[3:])
                state.cut_batch_sampler = True
            uneven = False
            if divides and batches is None and batch_size:
                world = state.ranks(vc)
                uneven = batch_size % world != 0
                batch_size = -(-batch_size // world)  # each rank's, as DDP sets it
                state.batch_rows = state.batch_rows or batch_size
                state.divided_loader = True
            if divides:
                # the script's call that made this loader (a library's factory, where it
                # used one): the diff divides that call's batch_size
                site = script_site(sys._getframe(1))
                if site is not None and site not in state.loader_sites:
                    state.loader_sites.append(site)
                if uneven and site is not None and site not in state.uneven_loader_sites:
                    state.uneven_loader_sites.append(site)
                if site is not None:
                    made_at[loader] = site
            orig_init(loader, dataset, batch_size, *args, **kwargs)
            if divides and getattr(loader, "batch_sampler", None) is not None:
                with contextlib.suppress(TypeError):  # one that cannot be weakly held
                    divided.add(loader.batch_sampler)

        patcher.patch(DataLoader, "__init__", loader_init)
        orig_iter = DataLoader.__iter__

        def loader_iter(loader: Any) -> Any:
            site = made_at.get(loader)
            if site is not None:  # trained on, or evaluated (no gradients)
                seen = (state.trained_loader_sites if torch.is_grad_enabled()
                        else state.evaluated_loader_sites)
                if site not in seen:
                    seen.append(site)
            return orig_iter(loader)

        patcher.patch(DataLoader, "__iter__", loader_iter)
        if state.scattered_rows > 1 and not self.model_input_rows:
            divide_hand_made_batches(state, vc, patcher)
        _output_device_on_the_rank(state, vc, patcher)

    def dp_made(self, dp: VirtualDataParallel, site: str) -> None:
        if dp.device_ids and dp.output_device != dp.device_ids[0]:
            current().log.rank_output_device = (dp.output_device, dp.device_ids[0])
        # where the fix builds DDP: at the wrap (dpprof.script.ddp_rank); none around a criterion
        where = (built_at_the_wrap(site, dp.module)
                 if dp.device_ids and not wraps_a_criterion(dp) else False)
        if where:
            dp.rank_at_wrap(self.options, where if isinstance(where, WholeModel) else None)

    def dp_forward(self, dp: VirtualDataParallel, inputs: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        rows = self.model_input_rows
        if rows and torch.is_grad_enabled():
            # DataParallel's first chunk of each input with the batch's rows (its scatter)
            share = -(-rows // len(dp.device_ids))

            def cut(t: Any) -> Any:
                if isinstance(t, torch.Tensor) and t.dim() > dp.dim and t.shape[dp.dim] == rows:
                    self.model_input_share = share
                    return t.narrow(dp.dim, 0, share)
                return t
            inputs, kwargs = tree_map(cut, (inputs, kwargs))
        return dp.as_ddp_rank(inputs, kwargs, self.options)

    def after_run(self, state: AlternativeState, vc: VirtualCuda,
                  ddp_devices: list[int]) -> None:
        assert isinstance(state, DdpState)  # this alternative's own (new_state)
        if self.model_input_share:
            state.model_input_share = state.batch_rows = self.model_input_share
        state.rank_scatter = state_of(vc).log.rank_scatter
        state.late_gradients = state_of(vc).log.ddp_late_gradients
        state.part_of_model = state_of(vc).log.part_of_model
        state.rank_criteria = tuple(state_of(vc).log.rank_criteria)
        state.batch_division = _division(state, state.ranks(vc))
        state.unused_raised = state_of(vc).log.ddp_unused_raised
        moved = state_of(vc).log.rank_output_device
        state.output_device = moved[0] if moved is not None else None
        ledger = vc.rt.ledgers.get(ddp_devices[0]) if ddp_devices else None
        if ledger is not None:
            state.bucket_view_peak_bytes = (ledger.peak_allocated if ledger.unsure is None
                                            else None)
            state.bucket_view_unsure = ledger.unsure

    def measure(self, runs: AlternativeRuns) -> None:
        cfg, main, n = runs.cfg, runs.main, runs.gpus
        alt = run_script(scattered_as_in(cfg, main, alternative=self), runs.step_cb(self.name))
        followed = ddp_state(alt)
        assert followed is not None  # run with this alternative
        followed.flags = self.flags
        failed = alt.scenario.status == STATUS_ERROR and main.scenario.status != STATUS_ERROR
        # the script may catch DDP's error and go on (a loop's try/except around its step):
        # its run then trained no further, and is no measurement of DDP either
        ended_by_it = failed and UNUSED_PARAMETERS.split(".")[0] in alt.scenario.message
        caught = followed.unused_raised and not ended_by_it
        if (ended_by_it or caught) and not self.options.find_unused_parameters:
            # DDP as a user writes it stops at its second step: the model has parameters no
            # loss uses; measured (and changed) as DDP must be given then
            unused = copy.copy(self)
            unused.options = dataclasses.replace(self.options, find_unused_parameters=True)
            unused.flags = (*self.flags, "find_unused_parameters=True")
            runs.notes.append(
                f"{self.name}: the model has parameters no loss uses (a parameter got no "
                "gradient in the first backward): DDP as a user writes it stops at its "
                "second step (\"Expected to have finished reduction in the prior "
                "iteration\")" + (", an error the script catches and goes on from, "
                                   "training no further" if caught else "")
                + "; measured with find_unused_parameters=True, which the change "
                "sets (its cost: the autograd graph searched every step, an int a parameter "
                "on the GPU)" + (
                    "; stand-in values decided shapes or branches in this run (x[mask], "
                    "bool()): on a GPU, with the real values, the loss may use them all "
                    "(--compute runs the real values)"
                    if {"shape", "bool"} & set(alt.stand_ins) else ""))
            unused.measure(runs)
            return
        if failed and followed.divided_sites and about_the_share(alt, main, n):
            # cutting the batches where the script makes them broke it (its loop indexes
            # rows up to the batch size it set): cut where the model is called instead
            at_call = copy.copy(self)
            at_call.model_input_rows = main.batch_rows
            retried = run_script(scattered_as_in(cfg, main, alternative=at_call),
                                 runs.step_cb(self.name))
            made = [f"{what} at {relative_site(site)}" for what, _, site in
                    (m.rpartition(" at ") for m in followed.divided_sites)]
            cut = (f"the DDP alternative cut the batches the script makes "
                   f"({', '.join(made)}) to each rank's share, and the "
                   f"script failed with them ({alt.scenario.message.split(';')[0]})")
            if retried.scenario.status == STATUS_ERROR:
                runs.notes.append(
                    f"no DDP alternative: {cut}; with the model's inputs cut at its call "
                    f"instead it failed too ({retried.scenario.message.split(';')[0]}): "
                    + "".join(f"{share}; " for share in [
                        raised_on_a_share(retried, main, n, "rank")] if share)
                    + "make each rank's share of the batch in the script (its size divided "
                    "by the GPUs) to measure DDP")
                return
            runs.notes.append(f"{cut}: it was measured with the model's inputs cut at its "
                              "call instead")
            alt, followed = retried, ddp_state(retried)
            assert followed is not None
            followed.flags = self.flags
        if alt.scenario.status == STATUS_ERROR:  # it never reached DDP: named for it
            alt.scenario = dataclasses.replace(alt.scenario, name=DDP)
        if not followed.batch_division:
            runs.notes.append("no DDP alternative: the script makes its batches neither with "
                              "a DataLoader nor with a torch factory (randint, randn, "
                              "rand, zeros, ones, empty, full) of "
                              f"DataParallel's {main.batch_rows} rows on its own lines, so "
                              "dpprof cannot give each rank its share")
            return
        share = (raised_on_a_share(alt, main, n, "rank")
                 if alt.scenario.status == STATUS_ERROR else None)
        late = LATE_GRADIENTS if followed.late_gradients else None
        part = PART_OF_MODEL.format(part=followed.part_of_model) if (
            followed.part_of_model) else None
        alt.scenario = dataclasses.replace(alt.scenario, notes=(
            self.sentence.format(n=n), f"each rank's share: {followed.batch_division}",
            *([share] if share else []), *([late] if late else []),
            *([part] if part else []), *followed.rank_criteria, *alt.scenario.notes,
            *alternative_notes(alt)))
        runs.runs.append((self.name, alt))
        fix = alternative_fix(self.kind, main, alt, self.detail.format(gpus=n),
                              diff_ddp(main, n, followed, runs.cfg.launch.script_file))
        if fix is not None and main.dp_sites and _library_site(main.dp_sites[0]):
            # the library wraps DDP itself once started by a launcher: nothing else to write
            fix = dataclasses.replace(fix, change=(
                f"a launcher: torchrun --nproc-per-node {n} (where the library, as Hugging "
                "Face's Trainer does, makes the process group, the sampler and DDP itself)"))
        if fix is not None:
            runs.fixes.append(fix)


STRATEGY = DdpInPlace(FIX)
