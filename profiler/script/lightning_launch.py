"""Lightning's own launcher played as dpprof plays torchrun's.

``Trainer(strategy="ddp", devices=4)`` or ``Fabric(strategy="ddp", devices=4).launch()`` run
by a plain ``python train.py`` start their other ranks themselves: Lightning's
``_SubprocessScriptLauncher`` (``lightning.fabric`` and ``lightning.pytorch`` each have one)
sets the DDP environment (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``) and re-runs the script once per other local rank with ``subprocess.Popen``,
each child with its own ``LOCAL_RANK``. Real processes would run outside the emulation and
outside the seal. While a run is on, the launcher's own ``_call_children_scripts`` runs as
Lightning wrote it, its ``subprocess.Popen`` alone answered by :class:`UnstartedChild`:
the command and environment of each rank are recorded (:class:`LaunchedRanks`), no
process starts, and the launcher goes on as rank 0 in dpprof's process. The ranks that
``--ranks`` names are then run as written with the environment Lightning gave each child
(:func:`ranks_launch`), as torchrun's are.

``strategy="ddp_spawn"`` / ``"ddp_notebook"`` start their ranks with
``torch.multiprocessing.start_processes``, which the run already plays in place
(:mod:`dpprof.script.wrappers`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from dpprof.emulator.patcher import Patcher
from dpprof.script.import_hook import on_each_load
from dpprof.script.launch import Launch

__all__ = ["LAUNCHER_MODULES", "LaunchedRanks", "UnstartedChild", "launched_note",
           "lightning_launcher_played", "ranks_launch"]

# the modules that hold a _SubprocessScriptLauncher: the unified package's and the
# standalone packages' (pytorch_lightning, lightning_fabric: the same code)
LAUNCHER_MODULES = {
    "lightning.fabric.strategies.launchers.subprocess_script": "Fabric",
    "lightning.pytorch.strategies.launchers.subprocess_script": "Trainer",
    "lightning_fabric.strategies.launchers.subprocess_script": "Fabric",
    "pytorch_lightning.strategies.launchers.subprocess_script": "Trainer",
}


@dataclass
class LaunchedRanks:
    """The ranks Lightning's launcher would have started: its name, the node's processes
    and nodes (the Trainer's or Fabric's ``devices`` and ``num_nodes``), and each child's
    command and the environment it changed (local rank -> ...)."""

    launcher: str  # "Lightning's Trainer (_SubprocessScriptLauncher)"
    per_node: int
    nodes: int
    commands: dict[int, list[str]] = field(default_factory=dict)
    envs: dict[int, dict[str, str]] = field(default_factory=dict)
    # the folder each child starts in: the launcher's ``cwd`` (Hydra's original working
    # directory, where Hydra runs), else the parent's at the launch, which a child inherits
    cwds: dict[int, str] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.per_node * self.nodes


class UnstartedChild:
    """A child process Lightning asked for and dpprof did not start (its rank is run as its
    own emulated process instead, where ``--ranks`` names it): it has ended, with status 0,
    for Lightning's observer of its children and its ``kill``."""

    def __init__(self, args: Sequence[str]) -> None:
        self.args = list(args)
        self.pid = 0
        self.returncode = 0

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        return None

    def terminate(self) -> None:
        return None

    def kill(self) -> None:
        return None


def _played(real: Callable[[Any], None], module: ModuleType, owner: str,
            record: Callable[[LaunchedRanks], None]) -> Callable[[Any], None]:
    """The launcher's ``_call_children_scripts``: Lightning's own, with ``Popen`` (the module's
    ``subprocess.Popen``) answered by :class:`UnstartedChild`, what it asked recorded."""

    @functools.wraps(real)
    def _call_children_scripts(self: Any) -> None:
        before = dict(os.environ)
        launched = LaunchedRanks(
            launcher=f"Lightning's {owner} (its _SubprocessScriptLauncher)",
            per_node=int(self.num_processes), nodes=int(self.num_nodes))

        def popen(args: Sequence[str], *_: Any, env: dict[str, str] | None = None,
                  cwd: Any = None, **__: Any) -> UnstartedChild:
            child_env = dict(env if env is not None else os.environ)
            local = int(child_env.get("LOCAL_RANK", len(launched.commands) + 1))
            launched.commands[local] = [str(a) for a in args]
            launched.cwds[local] = os.path.abspath(os.fspath(cwd) if cwd is not None
                                                   else os.getcwd())
            launched.envs[local] = {k: v for k, v in child_env.items() if before.get(k) != v}
            return UnstartedChild(args)

        real_subprocess = module.__dict__.get("subprocess")
        module.subprocess = SimpleNamespace(  # type: ignore[attr-defined]
            Popen=popen, **{k: getattr(real_subprocess, k) for k in ("PIPE", "DEVNULL")
                            if hasattr(real_subprocess, k)})
        try:
            real(self)
        finally:
            module.subprocess = real_subprocess  # type: ignore[attr-defined]
        record(launched)

    return _call_children_scripts


def _play(module: ModuleType, patcher: Patcher,
          record: Callable[[LaunchedRanks], None]) -> None:
    launcher = getattr(module, "_SubprocessScriptLauncher", None)
    real = getattr(launcher, "_call_children_scripts", None)
    if launcher is None or real is None:
        return
    owner = LAUNCHER_MODULES.get(module.__name__, "launcher")
    patcher.patch(launcher, "_call_children_scripts", _played(real, module, owner, record))


@contextlib.contextmanager
def lightning_launcher_played(record: Callable[[LaunchedRanks], None]) -> Iterator[None]:
    """For the duration: Lightning's subprocess launchers start no process (see the module),
    whether the script imported Lightning before or imports it during the run; ``record``
    is told what each launch asked."""
    with Patcher() as patcher, on_each_load(
            LAUNCHER_MODULES, functools.partial(_play, patcher=patcher, record=record)):
        yield


def ranks_launch(launch: Launch, launched: LaunchedRanks) -> Launch:
    """``launch`` (the script as ``python`` ran it) as Lightning starts its other ranks: the
    environment its launcher gave its first child (``as_rank`` sets each rank's own
    ``LOCAL_RANK`` and ``NODE_RANK``), and each child's arguments and folder (``as_rank``
    gives each rank its own: under Hydra, Lightning names each child's job and starts it
    in Hydra's original working directory)."""
    first = min(launched.envs) if launched.envs else None
    env = dict(launched.envs.get(first, {})) if first is not None else {}
    env.setdefault("WORLD_SIZE", str(launched.world))
    env.setdefault("NODE_RANK", "0")
    env["LOCAL_RANK"] = "0"  # rank 0's: as_rank gives each rank its own
    rank_commands = {local: (_script_args(command, launch.argv), launched.cwds.get(local, ""))
                     for local, command in launched.commands.items()}
    argv = rank_commands[first][0] if first is not None else list(launch.argv)
    return dataclasses.replace(launch, env=env, argv=argv, launcher=launched.launcher,
                               nproc=launched.per_node, rank_commands=rank_commands)


def _script_args(command: list[str], given: list[str]) -> list[str]:
    """The script's arguments in a child's command (``python [-m mod | file] ARGS``)."""
    if len(command) >= 3 and command[1] == "-m":
        return command[3:]
    if len(command) >= 2:
        return command[2:]
    return list(given)


def launched_note(launched: LaunchedRanks, launch: Launch) -> str:
    """The run's note on the launcher it followed: which, the processes it asked for (none
    started), how its ranks are played."""
    locals_ = sorted(launched.commands)
    asked = (f"local ranks {locals_[0]} to {locals_[-1]}" if len(locals_) > 2
             else "local rank(s) " + ", ".join(map(str, locals_)))
    nodes = f" on each of {launched.nodes} nodes" if launched.nodes > 1 else ""
    command = " ".join([Path(launch.target).name if not launch.is_module
                        else f"-m {launch.target}", *launch.argv])
    return (f"{launched.launcher} starts the script's other ranks itself: {launched.world} "
            f"rank(s), {launched.per_node} process(es) per node{nodes}; it asked for "
            f"{asked or 'none'} (LOCAL_RANK=k python {command}): no process started, played "
            "as torchrun's ranks are (rank 0 ran in dpprof's process, the others as --ranks "
            "says, each with the environment Lightning gave its process)")
