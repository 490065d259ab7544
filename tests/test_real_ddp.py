"""What ``dpprof run`` puts in place of torch's parallel classes is torch's own.

``DistributedDataParallel`` in a script is torch's class, its ``__init__``, C++ reducer and
logger running over the emulation (:class:`dpprof.script.wrappers.VirtualDDP`); its reducer
all-reduces over :class:`dpprof.emulator.process_group.EmulatedRankGroup`. Checked here:

* the bytes: for generated models and DDP options, torch's reducer on a virtual GPU gives
  each step's live and peak bytes exactly as dpprof's re-enactment of it
  (:class:`dpprof.emulator.ddp.EmulatedDDP`, itself checked against real gloo ranks in
  ``test_fidelity.py``) gives them in ``dpprof compare``'s emulation;
* the API: every attribute torch's own classes have, class and instance, public and
  underscore, is there on what dpprof installs, and every method is torch's own but for the
  few dpprof overrides (each named below, with why);
* what frameworks reach for: Lightning's teardown (``_get_ddp_logging_data``), comm hooks,
  ``join``, ``static_graph``, a device mesh.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from dpprof.emulator.ddp import EmulatedDDP
from dpprof.emulator.process_group import EmulatedRankGroup
from dpprof.emulator.virtual_cuda import VirtualCuda
from dpprof.errors import NotEmulated
from dpprof.script import wrappers
from dpprof.script.session import ScriptConfig, parse_command, run_command

REAL_DDP = nn.parallel.DistributedDataParallel
REAL_DP = nn.DataParallel


def _layers(widths: list[int], norm: bool) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
        if norm:
            layers.append(nn.BatchNorm1d(b))
    return layers


def _steps(ddp: nn.Module, opt: torch.optim.Optimizer, width: int, steps: int,
           accumulate: bool, read: Any, device: str | None) -> list[tuple[int, int]]:
    trace = []
    for i in range(steps):
        x = torch.randn(8, width, device=device)
        skip = accumulate and i % 2 == 0
        with ddp.no_sync() if skip else contextlib.nullcontext():  # type: ignore[operator]
            ddp(x).sum().backward()
        if not skip:
            opt.step()
            opt.zero_grad()
        trace.append(read())
    return trace


def torchs_ddp(widths: list[int], norm: bool, options: dict[str, Any], steps: int,
               accumulate: bool, backend: str = "nccl") -> list[tuple[int, int]]:
    """(live, peak) bytes of cuda:0 after each step, torch's DDP in ``dpprof run``'s
    emulation (a rank of two)."""
    vc = VirtualCuda(2, base="meta", installers=[wrappers.install])
    with vc:
        dist.init_process_group(backend, rank=0, world_size=2)
        try:
            model = nn.Sequential(*_layers(widths, norm)).cuda()
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], **options)
            assert isinstance(ddp, REAL_DDP) and type(ddp) is not REAL_DDP
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            c = vc.rt.storages.counters[0]
            return _steps(ddp, opt, widths[0], steps, accumulate,
                          lambda: (c.live_allocated, c.peak_allocated), "cuda")
        finally:
            dist.destroy_process_group()


def reenacted_ddp(widths: list[int], norm: bool, options: dict[str, Any], steps: int,
                  accumulate: bool, backend: str = "nccl") -> list[tuple[int, int]]:
    """The same program through EmulatedDDP, as dpprof's DDP alternative of a DataParallel
    script builds it (on the rank's device, under the same virtual CUDA; over NCCL the
    first iteration's buckets outlive the rebuild, ``nccl_stash``)."""
    vc = VirtualCuda(2, base="meta")
    with vc:
        rt = vc.rt
        model = nn.Sequential(*_layers(widths, norm)).cuda()
        with rt.device(0), rt.category("communication"):
            ddp = EmulatedDDP(model, rt, world_size=2, nccl_stash=backend == "nccl",
                              **options)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        c = rt.storages.counters[0]
        try:
            with rt.device(0):
                return _steps(ddp, opt, widths[0], steps, accumulate,
                              lambda: (c.live_allocated, c.peak_allocated), "cuda")
        finally:
            ddp.remove_hooks()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.integers(1, 600), min_size=2, max_size=5),
       norm=st.booleans(),
       options=st.sampled_from([{}, {"bucket_cap_mb": 1}, {"gradient_as_bucket_view": True},
                                {"find_unused_parameters": True},
                                {"broadcast_buffers": False},
                                {"bucket_cap_mb": 1, "gradient_as_bucket_view": True}]),
       steps=st.integers(2, 4), accumulate=st.booleans(),
       backend=st.sampled_from(["nccl", "gloo"]))
def test_torchs_reducer_on_a_virtual_gpu_allocates_as_the_reenactment(
        widths: list[int], norm: bool, options: dict[str, Any], steps: int,
        accumulate: bool, backend: str) -> None:
    if norm and len(widths) == 2 and widths[1] == 1:
        widths = [*widths[:1], 2]  # BatchNorm1d needs more than one value per channel
    assert (torchs_ddp(widths, norm, options, steps, accumulate, backend)
            == reenacted_ddp(widths, norm, options, steps, accumulate, backend))


# ---- the API ------------------------------------------------------------------------------

# dpprof's overrides of torch's methods, and why: each runs torch's own (super()) around
# what the emulation needs
DDP_OVERRIDES = {
    "__init__": "torch's __init__ over the rank's emulated group, on the rank's device",
    "_ddp_init_helper": "the reducer's group is the emulated one (a device mesh's DDP)",
    "_pre_forward": "the rebuilt buckets are communication on the rank's device; over NCCL "
                    "the buckets the rebuild replaces live on in their all-reduce's works",
    "forward": "the rows each forward takes, for the report",
    "register_comm_hook": "a hook's state of None is the reducer's group",
}
DP_OVERRIDES = {
    "__init__": "torch's __init__, then the emulation's handle",
    "forward": "scatter, replicate, parallel_apply and gather re-enacted on virtual devices",
    "__init_subclass__": "a script's subclass with a forward of its own runs it, counted as "
                         "DataParallel's forward",
}


# what every class has of its own (type bookkeeping), not an attribute it inherits
_CLASS_BOOKKEEPING = frozenset({"__dict__", "__weakref__", "__module__", "__doc__",
                                "__abstractmethods__", "_abc_impl", "__annotations__",
                                "__parameters__", "__orig_bases__"})


def _assigned_in_init(cls: type) -> set[str]:
    """The instance attributes torch's ``__init__`` sets (``self.x = ...``), read from its
    source: what an instance of the real class has, on any machine."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


@pytest.mark.parametrize(("real", "installed", "overrides"), [
    (REAL_DDP, wrappers.VirtualDDP, DDP_OVERRIDES),
    (REAL_DP, wrappers.VirtualDataParallel, DP_OVERRIDES),
])
def test_the_installed_classes_are_torchs_own(real: type, installed: type,
                                              overrides: dict[str, str]) -> None:
    assert issubclass(installed, real) and installed.__name__ == real.__name__
    for name in dir(real):
        ours = inspect.getattr_static(installed, name)
        theirs = inspect.getattr_static(real, name)
        if name in overrides:
            assert ours is not theirs, name
            assert name in vars(installed), name
        elif name not in _CLASS_BOOKKEEPING:
            assert ours is theirs, f"{installed.__name__}.{name} is not torch's"
    extra = {n for n in vars(installed) if not n.startswith("__")} - set(dir(real))
    # names of its own are dpprof's (the DataParallel re-enactment's helpers)
    assert all(n in ("run", "_check_placement", "as_ddp_rank", "rank_at_wrap", "as_written",
                     "own_split",
                     "_own_forward", "own_piece", "_replicas", "_own_forward_as_rank",
                     "class_words", "_own_forward_running") for n in extra), extra


def test_an_instance_has_every_attribute_torchs_init_sets() -> None:
    vc = VirtualCuda(4, base="meta", installers=[wrappers.install])
    with vc:
        dist.init_process_group("nccl", rank=0, world_size=4)
        try:
            model = nn.Linear(8, 8).cuda()
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
            dp = nn.DataParallel(nn.Linear(8, 8).cuda())
            for real, instance in ((REAL_DDP, ddp), (REAL_DP, dp)):
                missing = _assigned_in_init(real) - set(dir(instance))
                # DDP sets a few only on some paths (a device mesh, a mixed precision)
                assert missing <= {"device_mesh", "_mp_stream", "_submodule_to_event",
                                   "_delay_grad_buffer", "_delay_grad_views",
                                   "_delay_all_reduce_all_params", "buffer_hook",
                                   "_comm_hooks", "param_to_hook_all_reduce"}, missing
            # what Lightning's DDPStrategy.teardown reads, and what scripts print
            data = ddp._get_ddp_logging_data()
            assert data["world_size"] == 4 and data["backend_name"] == "nccl"
            assert data["module_name"] == "Linear" and ddp.logger is not None
            assert repr(ddp).startswith("DistributedDataParallel(")
            assert ddp.process_group is dist.distributed_c10d._get_default_group()
            assert dist.get_rank(ddp.process_group) == 0
        finally:
            dist.destroy_process_group()


def test_torch_cuda_and_distributed_keep_their_signatures() -> None:
    """What VirtualCuda and the wrappers patch takes the arguments torch's own takes."""
    import torch.cuda

    before = {name: getattr(torch.cuda, name) for name in dir(torch.cuda)
              if not name.startswith("__")}
    dist_before = {name: getattr(dist, name) for name in ("init_process_group",
                                                          "is_nccl_available")}
    vc = VirtualCuda(4, base="meta", installers=[wrappers.install])
    with vc:
        missing = set(before) - set(dir(torch.cuda))
        assert not missing
        changed = []
        for name, original in {**before, **{f"dist.{k}": v for k, v in dist_before.items()}
                               }.items():
            now = (getattr(dist, name[5:]) if name.startswith("dist.")
                   else getattr(torch.cuda, name))
            if now is original or not callable(original) or isinstance(original, type):
                continue
            try:
                theirs = inspect.signature(original)
            except (TypeError, ValueError):  # a C function: no signature to compare
                continue
            ours = inspect.signature(now)
            accepts_all = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                              for p in ours.parameters.values())
            names_theirs = [p.name for p in theirs.parameters.values()
                            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            names_ours = [p.name for p in ours.parameters.values()
                          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if not accepts_all and names_ours[:len(names_theirs)] != names_theirs:
                changed.append(f"{name}{ours} vs {theirs}")
        assert not changed, changed


# ---- what frameworks reach for -------------------------------------------------------------

HOOKS_AND_JOIN = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
torch.cuda.set_device(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda(),
            device_ids=[0], static_graph=True)
model.register_comm_hook(None, default_hooks.{hook})
opt = torch.optim.AdamW(model.parameters())
with model.join():
    for _ in range(4):
        model(torch.randn(16, 64, device="cuda")).sum().backward()
        opt.step(); opt.zero_grad()
print("logged", model._get_ddp_logging_data()["comm_hook"])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook"])
def test_comm_hooks_join_and_static_graph_run_as_on_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        hook: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(HOOKS_AND_JOIN.replace("{hook}", hook))
    result, main = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", "train.py"], 2), gpus=2,
        steps=3))
    assert main.exit_status == 0, main.script_traceback
    (s,) = result.scenarios
    assert s.name == "ddp" and s.status == "ok", s.message
    assert capsys.readouterr().out.count("logged") == 0  # stopped after 3 steps
    params = 4 * (64 * 256 + 256 + 256 * 8 + 8)
    assert s.devices[0].breakdown_bytes["parameters"] >= params


def test_a_collective_the_emulated_group_lacks_is_one_line_naming_dpprof() -> None:
    group = EmulatedRankGroup(0, 2)
    with pytest.raises(NotEmulated, match=r"^dpprof: .* has no alltoall\(\)"):
        group.alltoall([torch.empty(2)], [torch.empty(2)])


@pytest.mark.parametrize("backend", ["nccl", "fake"])
def test_an_nccl_groups_all_reduce_holds_its_tensors_until_reaped(backend: str) -> None:
    # ProcessGroupNCCL's work stashes them until wait() or the watchdog; gloo's and the
    # fake group's hold nothing once done
    group = EmulatedRankGroup(0, 2, backend)
    t = torch.ones(4)
    group.allreduce([t])
    assert torch.equal(t, torch.full((4,), 2.0))  # SUM of two equal ranks
    held = weakref.ref(t)
    del t
    assert (held() is not None) == (backend == "nccl")
    group.reap()
    assert held() is None


def test_a_checkpoint_loaded_into_ddp_copies_into_the_reducers_parameters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_state_dict copies in place, as on a GPU (a swap of the tensors, which the
    emulation's .cuda() uses, fails on parameters the reducer holds)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch, torch.distributed as dist, torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("nccl")
        model = DDP(nn.Linear(10, 5).cuda(), device_ids=[0])
        model.load_state_dict({k: torch.zeros_like(v.cpu()) for k, v in
                               model.state_dict().items()})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 10).cuda()).sum().backward(); opt.step(); opt.zero_grad()
    """))
    result, main = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", "train.py"], 2), gpus=2))
    assert main.exit_status == 0, main.script_traceback
    assert result.scenarios[0].status == "ok"
