"""The command after ``dpprof run --``: parsed (:func:`parse_command`: ``python train.py``,
``python -m pkg``, ``torchrun ...``, into a :class:`Launch`), the process state the script
expects while it runs in dpprof's process (:func:`script_process`), the script file run as
``python`` runs it (:func:`run_main_file`), and its traceback as Python would print it
(:func:`user_traceback`)."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import io
import logging
import os
import runpy
import sys
import traceback
import types
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.machinery import SourceFileLoader
from pathlib import Path
from typing import Any, NoReturn

from dpprof.errors import UsageError
from dpprof.script.engines import DEEPSPEED_NOT_EMULATED
from dpprof.script.installed_code import is_installed
from dpprof.script.script_error import script_frames

__all__ = ["Launch", "ProcessExit", "as_rank", "main_path", "parse_command",
           "process_exit_caught", "run_main_file", "script_process", "started_in",
           "user_traceback"]


@dataclass
class Launch:
    """What the command after ``--`` runs."""

    target: str  # a script path, or a module name
    is_module: bool
    argv: list[str]  # sys.argv[1:] of the script
    env: dict[str, str] = field(default_factory=dict)  # set for the run (torchrun's)
    launcher: str = "python"  # python | torchrun | torch.distributed.launch | accelerate launch
    nproc: int | None = None  # torchrun --nproc-per-node
    # the folder the process starts in ("": dpprof's own)
    cwd: str = ""
    # a launcher that starts each local rank with a command and folder of its own
    # (Lightning's: Hydra's job name and run folder): local rank -> its sys.argv[1:], folder
    rank_commands: dict[int, tuple[list[str], str]] = field(default_factory=dict)

    @property
    def script_file(self) -> str:
        """The script's file, resolved ("" for a module run with -m)."""
        return "" if self.is_module else str(Path(self.target).resolve())

    @property
    def code_root(self) -> str:
        """The folder of the script's own code: its file's (the working folder for -m)."""
        return os.getcwd() if self.is_module else str(Path(self.target).resolve().parent)

    @property
    def display(self) -> str:
        name = self.target if self.is_module else Path(self.target).name
        return " ".join([name, *self.argv])

    def check_script(self) -> None:
        """Raise :class:`UsageError` where the script to run is not a file (a module is
        looked for when it is imported)."""
        if not self.is_module and not Path(self.target).is_file():
            raise UsageError(f"dpprof run: {self.target}: no such file")


def parse_command(command: list[str], gpus: int, gpus_given: bool = True) -> Launch:
    """``python [-u] train.py args``, ``python -m pkg args``, ``train.py args``,
    ``torchrun [opts] train.py args``, ``python -m torch.distributed.run|launch ...``.
    ``gpus_given``: ``gpus`` is the user's --gpus, which torchrun's processes must fit (else
    the default, which the caller replaces by the processes' count)."""
    if not command:
        raise UsageError("dpprof run: give the command after --, e.g. dpprof run -- python "
                         "train.py")
    head, rest = command[0], list(command[1:])
    base = Path(head).name
    if base.endswith(".py"):
        return Launch(head, False, rest)
    if base in ("torchrun",):
        return _torchrun(rest, gpus, "torchrun", gpus_given)
    if base == "accelerate" and rest[:1] == ["launch"]:
        return _accelerate(rest[1:], gpus, gpus_given)
    if base == "accelerate-launch":
        return _accelerate(rest, gpus, gpus_given)
    if base in ("deepspeed", "ds"):
        raise UsageError(DEEPSPEED_NOT_EMULATED)
    if not base.startswith("python"):
        raise UsageError(f"dpprof run: cannot follow {head!r}: {_LAUNCHERS}")
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest.pop(0)  # interpreter flags: -u, -O, -W...
    if not rest:
        raise UsageError("dpprof run: the python command names no script")
    if rest[0] == "-c":
        raise UsageError("dpprof run: python -c is not supported; put the code in a file")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise UsageError("dpprof run: python -m needs a module name")
        mod = rest[1]
        if mod in ("torch.distributed.run", "torch.distributed.launch"):
            return _torchrun(rest[2:], gpus, mod, gpus_given)
        if mod == "deepspeed" or mod.startswith("deepspeed.launcher"):
            raise UsageError(DEEPSPEED_NOT_EMULATED)
        if mod in ("accelerate.commands.launch", "accelerate.commands.accelerate_cli"):
            args = rest[2:]
            if mod.endswith("accelerate_cli"):
                if args[:1] != ["launch"]:
                    raise UsageError(f"dpprof run: python -m {mod} {' '.join(args[:1])}: "
                                     f"only its launch command runs a script; {_LAUNCHERS}")
                args = args[1:]
            return _accelerate(args, gpus, gpus_given)
        return Launch(mod, True, rest[2:])
    return Launch(rest[0], False, rest[1:])


_LAUNCHERS = ("give a Python command (python train.py, python -m pkg.train) or a launcher "
              "dpprof follows: torchrun, python -m torch.distributed.run|launch, accelerate "
              "launch (python -m accelerate.commands.launch)")


def _accelerate(args: list[str], gpus: int, gpus_given: bool) -> Launch:
    """``accelerate launch [opts] train.py args``, read as accelerate reads it: its own
    parser, its config file (``--config_file`` or the default one ``accelerate config``
    writes), and the environment its launcher gives the script (the mixed precision, the
    dynamo backend); several processes are torchrun's ranks, as accelerate starts them."""
    try:
        # accelerate ships no type information (no py.typed)
        from accelerate.commands.config import (  # type: ignore[import-untyped]
            default_config_file,
        )
        from accelerate.commands.launch import (  # type: ignore[import-untyped]
            launch_command_parser,
        )
        from accelerate.utils.launch import (  # type: ignore[import-untyped]
            prepare_multi_gpu_env,
            prepare_simple_launcher_cmd_env,
        )
    except ImportError:
        raise UsageError("dpprof run: accelerate launch: accelerate is not installed here "
                         "(pip install accelerate)") from None
    try:
        ns = launch_command_parser().parse_args(args)
    except SystemExit:
        raise UsageError(f"dpprof run: accelerate launch: cannot parse {' '.join(args)!r}"
                         ) from None
    config = ns.config_file or (default_config_file if os.path.isfile(default_config_file)
                                else None)
    unfollowed = [flag for flag, on in (("--use_deepspeed", ns.use_deepspeed),
                                        ("--use_fsdp", ns.use_fsdp), ("--tpu", ns.tpu),
                                        ("--use_megatron_lm", ns.use_megatron_lm)) if on]
    if config is not None and not ns.cpu:
        from accelerate.commands.config import (  # type: ignore[import-untyped]
            load_config_from_file,
        )

        defaults = load_config_from_file(config)
        kind = str(getattr(defaults, "distributed_type", "") or "")
        if not (ns.multi_gpu or unfollowed):
            ns.multi_gpu = kind.endswith("MULTI_GPU")
            if kind.endswith(("DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")):
                unfollowed.append(f"distributed_type: {kind.rsplit('.', 1)[-1]} in {config}")
        if ns.num_processes is None and int(getattr(defaults, "num_processes", -1)) > 0:
            ns.num_processes = int(defaults.num_processes)
        if ns.num_machines is None:
            ns.num_machines = int(getattr(defaults, "num_machines", 1) or 1)
        if ns.mixed_precision is None:
            ns.mixed_precision = str(getattr(defaults, "mixed_precision", None) or "no")
    if unfollowed:
        raise UsageError(
            f"dpprof run: accelerate launch {', '.join(unfollowed)}: DeepSpeed, FSDP, TPU and "
            "Megatron-LM engines are not emulated; dpprof measures DDP (accelerate launch "
            "--multi_gpu) and, among its rungs, FSDP2 (dpprof run --ladder)")
    if ns.num_processes is None:
        ns.num_processes = gpus  # torch.cuda.device_count(), as accelerate counts them
    ns.num_machines = ns.num_machines or 1
    ns.mixed_precision = ns.mixed_precision or "no"
    ns.dynamo_backend = ns.dynamo_backend or "no"
    ns.debug = bool(ns.debug)
    ns.use_cpu = ns.cpu
    # more than one GPU and processes: accelerate turns multi-GPU on by itself
    ns.multi_gpu = bool(ns.multi_gpu or (ns.num_processes > 1 and gpus > 1 and not ns.cpu))
    ns.main_process_port = ns.main_process_port or 29500
    before = dict(os.environ)
    if ns.multi_gpu:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its check of the port: no rank listens here
            env = prepare_multi_gpu_env(ns)
        launch = _torchrun(["--nproc-per-node", str(ns.num_processes // ns.num_machines),
                            "--nnodes", str(ns.num_machines),
                            *(["-m"] if ns.module else []), ns.training_script,
                            *ns.training_script_args], gpus, "accelerate launch", gpus_given)
    else:
        _, env = prepare_simple_launcher_cmd_env(ns)
        launch = Launch(ns.training_script, bool(ns.module), list(ns.training_script_args),
                        launcher="accelerate launch", nproc=1)
    launch.env = {**{k: v for k, v in env.items() if before.get(k) != v}, **launch.env}
    return launch


_NPROC_FLAG = {"accelerate launch": "--num_processes"}


def _torchrun(args: list[str], gpus: int, launcher: str, gpus_given: bool = True) -> Launch:
    if launcher == "torch.distributed.launch":
        from torch.distributed.launch import get_args_parser as launch_parser

        parser = launch_parser()
    else:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit:
        raise UsageError(f"dpprof run: {launcher}: cannot parse {' '.join(args)!r}") from None
    nproc_text = str(ns.nproc_per_node)
    nproc = gpus if nproc_text in ("gpu", "auto") else int(nproc_text)
    if nproc > gpus and gpus_given:
        # rank k takes cuda:k (LOCAL_RANK) on a real node, and NCCL refuses two ranks on one
        # GPU: the ranks past the GPUs fail there, while the one rank emulated here would not
        raise UsageError(
            f"dpprof run: {launcher} starts {nproc} processes on the node, which has {gpus} "
            f"GPU(s) (--gpus): ranks {gpus} to {nproc - 1} would find no GPU of their own; "
            f"pass --gpus {nproc}, or {_NPROC_FLAG.get(launcher, '--nproc-per-node')} {gpus}")
    nnodes = str(ns.nnodes).split(":")[-1]
    world = nproc * int(nnodes or 1)
    env = {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "dpprof",
    }
    argv = list(ns.training_script_args)
    if launcher == "torch.distributed.launch" and not getattr(ns, "use_env", False):
        argv = ["--local-rank=0", *argv]
    return Launch(ns.training_script, bool(ns.module), argv, env, launcher, nproc)


def as_rank(launch: Launch, rank: int) -> Launch:
    """``launch`` as the launcher starts its rank ``rank``: the environment the launcher
    gives that process (torchrun's: its global, local and node rank; Lightning's: its local
    and node rank), ``--local-rank`` where ``torch.distributed.launch`` passes it, the
    command and folder a launcher gave that local rank (``rank_commands``). A launch
    without a launcher's environment (``mp.spawn`` under ``python``) is returned as is: the
    spawned function gets the rank."""
    if "WORLD_SIZE" not in launch.env or rank == 0:
        return launch
    per_node = launch.nproc or int(launch.env.get("LOCAL_WORLD_SIZE", "1"))
    local, node = rank % per_node, rank // per_node
    # the variables the launcher sets, each as this rank's (no other: a variable Lightning
    # does not set, RANK among them, would tell it another launcher started the process)
    own = {"RANK": rank, "LOCAL_RANK": local, "GROUP_RANK": node, "ROLE_RANK": rank,
           "NODE_RANK": node}
    env = {**launch.env, **{k: str(v) for k, v in own.items() if k in launch.env}}
    argv = [f"--local-rank={local}" if a == "--local-rank=0" else a for a in launch.argv]
    cwd = launch.cwd
    if local in launch.rank_commands:
        argv, cwd = list(launch.rank_commands[local][0]), launch.rank_commands[local][1]
    return dataclasses.replace(launch, env=env, argv=argv, cwd=cwd)


@contextlib.contextmanager
def started_in(folder: str) -> Iterator[None]:
    """The script's working folder ``folder`` for the duration, as its launcher starts the
    process there ("": dpprof's, as it is; one that cannot be entered: dpprof's too, the
    run goes on where it is)."""
    before = os.getcwd()
    moved = False
    if folder and os.path.abspath(folder) != before:
        with contextlib.suppress(OSError):
            os.chdir(folder)
            moved = True
    try:
        yield
    finally:
        if moved:
            with contextlib.suppress(OSError):
                os.chdir(before)


class ProcessExit(BaseException):
    """``os._exit(status)`` in the script: its process ends there, at once (no ``finally``,
    no ``atexit``); here it ends the run with that status and the line that called it.
    A BaseException, so that the script's ``except Exception`` does not take it."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


@contextlib.contextmanager
def process_exit_caught() -> Iterator[None]:
    """``os._exit`` in dpprof's own process raises :class:`ProcessExit` while the script
    runs (it would end dpprof with it, reporting nothing); in a process the script forked
    (a DataLoader worker) it exits as it does."""
    pid = os.getpid()
    real_exit = os._exit

    def _exit(status: int) -> NoReturn:
        if os.getpid() != pid:
            real_exit(status)
        raise ProcessExit(status)

    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real_exit


@contextlib.contextmanager
def script_process(launch: Launch) -> Iterator[None]:
    """sys.argv, sys.path[0], the environment and __main__ as the script expects them;
    all restored afterwards."""
    saved_argv = list(sys.argv)
    saved_path = list(sys.path)
    saved_env = dict(os.environ)
    saved_main = sys.modules.get("__main__")
    root = logging.getLogger()
    saved_logging = (list(root.handlers), root.level)
    saved_defaults = _torch_defaults()
    imported_before = set(sys.modules)
    code_root = launch.code_root
    try:
        _fresh_singletons()
        os.environ.update(launch.env)
        if launch.is_module:
            sys.argv = [launch.target, *launch.argv]
            sys.path.insert(0, os.getcwd())
        else:
            path = Path(launch.target).resolve()
            sys.argv = [str(launch.target), *launch.argv]
            sys.path.insert(0, str(path.parent))
        yield
    finally:
        # the script's own modules start afresh in the next run (another rank, an
        # alternative), as in a new process: their module-level state (a cache, a
        # singleton holding a stream or a device) is not the last run's
        for name in own_modules(set(sys.modules) - imported_before, code_root):
            del sys.modules[name]
        sys.argv = saved_argv
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        # logging.basicConfig in the script: the next run configures it afresh, as a new
        # process would (and an alternative's run does not log through this run's handlers)
        for handler in root.handlers:
            if handler not in saved_logging[0]:
                handler.flush()
        root.handlers[:] = saved_logging[0]
        root.setLevel(saved_logging[1])
        # torch.set_default_device("cuda") / set_default_dtype in the script: the next run
        # (an alternative, another rank) and dpprof's own work start from torch's defaults,
        # as a new process would
        _restore_torch_defaults(saved_defaults)
        _fresh_singletons()


def own_modules(names: set[str], root: str) -> list[str]:
    """Of the modules ``names``, those of the script's own code: Python source under
    ``root`` (the script's folder; the working folder for ``-m``), not an installed
    package's (site-packages) nor dpprof's. A compiled extension is left loaded: CPython
    cannot load one twice."""
    root = os.path.realpath(root)
    own = []
    for name in names:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file is None and getattr(module, "__spec__", None) is not None:
            # a namespace package (a folder without __init__.py: KAIR's utils/): kept, it
            # would hand the next run the last run's submodules, bound as its attributes
            # (``from utils import utils_option`` finds the old one, whose classes no
            # longer pickle by name)
            files = [os.path.join(p, "") for p in getattr(module, "__path__", None) or ()]
        else:
            files = [file] if isinstance(file, str) and file.endswith((".py", ".pyc")) else []
        reals = [os.path.realpath(f) for f in files]
        if (not reals or any(os.path.commonpath([r, root]) != root or is_installed(r)
                             for r in reals)
                or name == "dpprof" or name.startswith("dpprof.")):
            continue
        own.append(name)
    return own


# accelerate's process-wide singletons (their state shared by every instance): a run of the
# script starts without them, as a new process would, and leaves none behind (else the
# next run, an alternative or another script, finds the last one's devices and world size)
_SINGLETONS = {"accelerate.state": ("PartialState", "AcceleratorState", "GradientState")}


def _fresh_singletons() -> None:
    for module_name, classes in _SINGLETONS.items():
        module = sys.modules.get(module_name)
        for name in classes if module is not None else ():
            shared = getattr(getattr(module, name, None), "_shared_state", None)
            if isinstance(shared, dict):
                shared.clear()
    _fresh_distributed_tensors()


def _torch_defaults() -> tuple[object, object] | None:
    """torch's default device (the context ``set_default_device`` entered, None for none)
    and dtype now; None where torch is not imported yet (its own defaults)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return _default_device_context(torch), torch.get_default_dtype()


def _default_device_context(torch: Any) -> object:
    # the context set_default_device entered (None: none); not get_default_device(), which
    # asks the device's backend for an index
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _restore_torch_defaults(saved: tuple[object, object] | None) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    context, dtype = saved if saved is not None else (None, torch.float32)
    if _default_device_context(torch) is not context:
        torch.set_default_device(None)  # leaves the script's
        if context is not None:
            torch.set_default_device(context.device)  # type: ignore[attr-defined]
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)


def _fresh_distributed_tensors() -> None:
    """DTensor's process-wide caches emptied, as a new process has them: they are keyed by
    layout (a ``DeviceMesh`` equals another of the same shape and names), so a later run (a
    rank other than 0, whose mesh is rank 0's in layout but whose process groups are its
    own) would be handed rank 0's specs, meshes and all, and ask rank 0's groups."""
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is None:  # never imported: nothing cached
        return
    from torch.distributed import device_mesh
    from torch.distributed.tensor import _random, _redistribute, debug
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    debug._clear_sharding_prop_cache()  # the Python propagation's and the C++ fast path's
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    _random._rng_tracker = None
    mesh_env = getattr(device_mesh, "_mesh_resources", None)
    if mesh_env is not None:
        mesh_env.__init__()


def main_path(target: str) -> str:
    """The script's path as ``python path`` names it in ``__file__`` and its tracebacks:
    absolute since Python 3.9, the working directory joined to the path as typed (neither
    normalised nor resolved: ``./train.py`` is ``/cwd/./train.py``)."""
    return target if os.path.isabs(target) else os.path.join(os.getcwd(), target)


def run_main_file(target: str) -> None:
    """Run the script file ``target`` as ``python target`` runs it: as ``__main__``, its
    ``__file__`` and code named by :func:`main_path` (``os.path.dirname(__file__)`` is its
    folder, tracebacks name it as Python does), ``sys.argv[0]`` left as typed (runpy's
    ``run_path`` would set it to the path it is given). A zip application goes through
    runpy, as Python's own ``__main__.py`` lookup does."""
    path = main_path(target)
    if zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __loader__=SourceFileLoader("__main__", path),
                         __builtins__=builtins)
    sys.modules["__main__"] = main  # classes defined in the script pickle as __main__'s
    exec(code, main.__dict__)


def user_traceback(e: BaseException, launch: Launch) -> str:
    """The traceback as Python would print it for the script on a GPU: dpprof's, runpy's
    and the emulated kernels' frames left out (a script that does not compile, or a module
    not found, has none of its own)."""
    frames = script_frames(e)
    if launch.is_module and isinstance(e, ImportError) and not frames:
        return f"{sys.executable}: {e}"  # python -m no_such_module says just this
    head = ["Traceback (most recent call last):\n"] if frames else []
    last = ([f"os._exit({e.status}): the process ends here\n"] if isinstance(e, ProcessExit)
            else traceback.format_exception_only(type(e), e))
    return "".join([*head, *traceback.format_list(frames), *last])

