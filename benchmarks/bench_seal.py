"""What the seal costs a run of ``dpprof run``: each script run sealed against the same run
with the seal off (``ScriptConfig(seal=False)``, for this measurement only). One command:

    python benchmarks/bench_seal.py              # prints, writes benchmarks/results_seal.json
    python benchmarks/bench_seal.py --repeat 9   # rounds (default 7)

Each line of the seal is measured in a process of its own: the kernel line needs a process
that entered its mount namespace before torch started a thread, and an audit hook, once
added, stays for the process.

* ``kernel``: Python's file calls and the mount namespace (where this machine allows one);
* ``audit-hook``: Python's file calls and the audit hook (``DPPROF_NO_NAMESPACE=1``: what a
  machine without unprivileged user namespaces gets).

Cases, each ``dpprof run`` in process (``run_command``), over meta tensors unless said:

1. ``meta_with_alternatives``: bench_run.py's DataParallel script, its DDP and
   loss-in-forward alternatives (three sealed runs), 8 steps;
2. ``compute``: bench_run.py's MLP under ``--compute``, 20 steps, no alternatives;
3. ``checkpoint_every_step``: a script that saves a checkpoint and appends to a CSV log at
   every step (8 steps): writes through the overlay, stand-in checkpoints;
4. ``meta_with_alternatives_5000_files``: case 1 in a working directory that holds 5,000
   files (noted once before the runs; the check after each run reads the kernel's record of
   what changed there, :mod:`dpprof.script.folder_watch`).

Two measures, since the cores are shared and loaded:

* **the ratio**, sealed / unsealed, of wall-clock seconds (what the user waits) and of CPU
  seconds of the process (``time.process_time``, every thread): each round measures each
  case once each way, side by side, the order alternating between rounds (sealed first in
  every other) so that a drift of the machine's load falls on both; the median over the
  rounds and the spread (min, quartiles, max). On the kernel line all rounds run in one
  process. On the audit-hook line Python never removes an audit hook, and it is called on
  every audited event of the process, so once a sealed run has added it the unsealed runs
  after it would pay for it too: each round of each case is a process of its own (a warm-up
  and the unsealed run, then a warm-up and the sealed run).
* **the seal's own seconds**, from its timers (:attr:`dpprof.script.sealed_run.SealOutcome.
  seconds`), which the load does not swamp: the census as the runs waited for it, and in
  each run the seal's set-up before it (the mounts), its work after it (the overlays off,
  what the run wrote, the check), the Python line's file calls during the run (each
  :mod:`os` call through the seal whole, an ``open`` up to the path it opens:
  :mod:`dpprof.script.sealed_calls`), and the audit hook (the seconds in its checks, and its
  call on each audited event: the events counted, each at the cost of a call of the hook
  measured in the same process); as a share of the sealed run's wall seconds.

Each case is measured twice:

* **as the command** (``--cli-repeat`` rounds, default 5): ``dpprof run`` in a process of
  its own each way, as the user runs it, the order alternating: torch's import, the census
  taken ahead by a child process while it runs (:mod:`dpprof.script.census_ahead`), the
  runs, the reports. **The goal's measure**: what the seal adds to what the user waits.
* **in process** (``--repeat`` rounds, default 7): ``run_command`` alone, in one process,
  where a run is tens of milliseconds: the seal's fixed milliseconds a run (its set-up and
  check) and the census, taken there with the run waiting for it, weigh more there than in
  any command; kept to show where the seal's time goes.

Goal <= 1.03 (the seal costs at most 3 % of a run): said met for a case where the command's
median ratio is; the timers' share says how much of that is the seal's own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GOAL = 1.03
CASES = ("meta_with_alternatives", "compute", "checkpoint_every_step",
         "meta_with_alternatives_5000_files")

CHECKPOINT_SCRIPT = """
import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(8):
    loss = model(torch.randn(64, 256, device=device)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with open("log.csv", "a") as log:
        log.write(f"{step},{loss.item()}\\n")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step}, "checkpoint.pt")
"""


def _dpprof_run(path: Path, steps: int, compute: bool, alternatives: bool,
                sealed: bool) -> Callable[[], object]:
    from dpprof.script.session import ScriptConfig, parse_command, run_command

    def go() -> object:
        cfg = ScriptConfig(launch=parse_command(["python", str(path)], 4), gpus=4,
                           steps=steps, compute=compute, seal=sealed)
        with contextlib.redirect_stdout(io.StringIO()):
            return run_command(cfg, alternatives)
    return go


def _in_folder(folder: Path, fn: Callable[[], object]) -> Callable[[], object]:
    def go() -> object:
        cwd = os.getcwd()
        os.chdir(folder)
        try:
            return fn()
        finally:
            os.chdir(cwd)
    return go


def _user_folders(tmp: Path, files: bool) -> tuple[Path, Path]:
    """A working folder with the scripts, and one that also holds 5,000 files (``files``)."""
    from bench_run import COMPUTE_SCRIPT, DP_SCRIPT  # imports torch: not before the namespace

    work, big = tmp / "work", tmp / "big"
    for folder in (work, big):
        folder.mkdir()
        (folder / "train_dp.py").write_text(DP_SCRIPT)
        (folder / "train_small.py").write_text(COMPUTE_SCRIPT)
        (folder / "train_ckpt.py").write_text(CHECKPOINT_SCRIPT)
    for k in range(5000 if files else 0):
        sub = big / "data" / f"{k // 500}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{k}.txt").write_text(str(k))
    return work, big


def _cases(work: Path, big: Path) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Each case's (unsealed, sealed) call."""
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    for name, folder, script, steps, compute, alternatives in (
            ("meta_with_alternatives", work, "train_dp.py", 8, False, True),
            ("compute", work, "train_small.py", 20, True, False),
            ("checkpoint_every_step", work, "train_ckpt.py", 8, False, False),
            ("meta_with_alternatives_5000_files", big, "train_dp.py", 8, False, True)):
        path = folder / script
        base, ours = (_in_folder(folder, _dpprof_run(path, steps, compute, alternatives, sealed))
                      for sealed in (False, True))
        cases[name] = (base, ours)
    return cases


# the seal's timers of the dpprof run under way: the census it took, each sealed run's outcome
_TIMED: dict[str, list[Any]] = {"census": [], "outcomes": []}


def _instrument() -> None:
    """The seal's timers gathered into :data:`_TIMED` (its census, each sealed run)."""
    from dpprof.script import sealed_run, session

    take = session.take_census

    def taking(*args: Any) -> Any:
        snap = take(*args)
        _TIMED["census"].append(snap)
        return snap

    session.take_census = taking  # type: ignore[assignment]
    leave = sealed_run.SealedRun.__exit__

    def leaving(self: Any, *exc: object) -> None:
        try:
            leave(self, *exc)
        finally:
            _TIMED["outcomes"].append(self.outcome)

    sealed_run.SealedRun.__exit__ = leaving  # type: ignore[method-assign]


def _seal_seconds(hook_call_s: float) -> dict[str, float]:
    """The seal's own seconds in the dpprof run just measured, by part (``hook_call_s``: one
    call of the audit hook); :data:`_TIMED` emptied."""
    snaps, outs = _TIMED["census"], _TIMED["outcomes"]

    def part(name: str) -> float:
        return sum(o.seconds.get(name, 0.0) for o in outs)

    parts = {"census_waited": sum(s.waited_s for s in snaps),
             "census_taken": sum(s.taken_s for s in snaps),
             "before": part("before"), "mount": part("mount"), "after": part("after"),
             "unmount": part("unmount"), "check": part("check"), "calls": part("calls"),
             "hook_checks": part("hook"),
             "hook_events": float(sum(o.hook_events for o in outs)), "runs": float(len(outs))}
    parts["hook_calls"] = parts["hook_events"] * hook_call_s
    parts["seal"] = (parts["census_waited"] + parts["before"] + parts["after"]
                     + parts["calls"] + parts["hook_checks"] + parts["hook_calls"])
    _TIMED["census"], _TIMED["outcomes"] = [], []
    return parts


def _audit_call_s(n: int = 200_000) -> float:
    """Seconds of one ``sys.audit`` call in this process (with whatever hooks it has)."""
    started = time.perf_counter()
    for _ in range(n):
        sys.audit("dpprof.bench_seal")
    return (time.perf_counter() - started) / n


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) of ``fn()``."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _start_child() -> None:
    from dpprof.script import namespace

    namespace.enter()  # before torch's import starts a thread
    import torch

    torch.set_num_threads(1)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)


def kernel_child(repeat: int, out: Path) -> None:
    """The kernel line's rounds (or the audit hook's, in one process, where this machine
    has no namespace), all in this process, written to ``out``."""
    _start_child()
    from dpprof.script import namespace

    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        cases = _cases(*_user_folders(Path(tmp), True))
        _instrument()
        for base, ours in cases.values():  # warm-up: imports, first calls
            base()
            ours()
        hook_call_s = 0.0 if namespace.entered() else _audit_call_s()
        _seal_seconds(0.0)
        for r in range(repeat):
            print(f"round {r + 1}/{repeat}", flush=True)
            for name, (base, ours) in cases.items():
                got: dict[bool, tuple[float, float]] = {}
                timers: dict[str, float] = {}
                for sealed in ((False, True) if r % 2 == 0 else (True, False)):
                    got[sealed] = _timed(ours if sealed else base)
                    if sealed:
                        timers = _seal_seconds(hook_call_s)
                rows[name].append({"unsealed": got[False], "sealed": got[True],
                                   "timers": timers})
    out.write_text(json.dumps({
        "line": "kernel" if namespace.entered() else "audit-hook",
        "method": "each round: each case once each way, side by side, the order alternating",
        "why_not": namespace.why_not(), "rows": rows}))


def audit_child(case: str, out: Path) -> None:
    """One round of ``case`` on the audit-hook line, in this process: a warm-up and the
    unsealed run, then a warm-up (which adds the hook) and the sealed run."""
    _start_child()
    with tempfile.TemporaryDirectory() as tmp:
        base, ours = _cases(*_user_folders(Path(tmp), case == CASES[3]))[case]
        _instrument()
        base()
        without = _audit_call_s()
        b = _timed(base)
        ours()  # adds the audit hook, which stays
        hook_call_s = max(0.0, _audit_call_s() - without)
        _seal_seconds(0.0)
        o = _timed(ours)
        out.write_text(json.dumps({"unsealed": b, "sealed": o,
                                   "timers": _seal_seconds(hook_call_s)}))


def audit_hook_line(repeat: int, env: dict[str, str]) -> dict[str, Any]:
    """The audit-hook line's rows: each round of each case in a fresh process."""
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in CASES}
    for r in range(repeat):
        print(f"round {r + 1}/{repeat}", flush=True)
        for name in CASES:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, __file__, "--child", out.name, "--case", name],
                               env=env, check=True)
                rows[name].append(json.loads(Path(out.name).read_text()))
    return {"line": "audit-hook", "method": "each round of each case in a process of its own "
            "(the audit hook, once added, stays): a warm-up and the unsealed run, then a "
            "warm-up and the sealed run", "why_not": "DPPROF_NO_NAMESPACE=1", "rows": rows}


def cli_child(sealed: bool, timers: Path, argv: list[str]) -> None:
    """``dpprof`` as its console script runs it (:mod:`dpprof.cli.entry`: the namespace
    entered and the census begun in a thread before torch is imported), the census' timers
    written to ``timers``; unsealed: the same command with the seal off."""
    import dataclasses

    sys.argv = ["dpprof", *argv]
    startup_s = 0.0
    if sealed:
        from dpprof.script import census_ahead, namespace

        started = time.perf_counter()
        namespace.enter()
        census_ahead.start_for_command(sys.argv)
        startup_s = time.perf_counter() - started
    import dpprof.script.session as session
    from dpprof.cli.app import main as app_main

    if sealed:
        _instrument()
    else:  # the CLI imports run_command from the session as it runs
        run_command = session.run_command

        def unsealed(cfg: Any, *args: Any) -> Any:
            return run_command(dataclasses.replace(cfg, seal=False), *args)

        session.run_command = unsealed  # type: ignore[assignment]
    try:
        app_main()
    finally:
        parts = _seal_seconds(0.0)
        # the process's own start: its mount namespace entered, the census's child begun
        parts["startup"] = startup_s
        parts["seal"] += startup_s
        timers.write_text(json.dumps(parts))


# each case as the user runs it: (folder, its arguments to dpprof run)
CLI_CASES = {
    "meta_with_alternatives": ("work", ["--gpus", "4", "--steps", "8", "--no-ladder", "--",
                                        "python", "train_dp.py"]),
    "compute": ("work", ["--gpus", "4", "--steps", "20", "--compute", "--no-alternatives",
                         "--", "python", "train_small.py"]),
    "checkpoint_every_step": ("work", ["--gpus", "4", "--steps", "8", "--no-alternatives",
                                       "--", "python", "train_ckpt.py"]),
    "meta_with_alternatives_5000_files": ("big", ["--gpus", "4", "--steps", "8",
                                                  "--no-ladder", "--", "python",
                                                  "train_dp.py"]),
}


def cli_line(repeat: int, env: dict[str, str], folders: dict[str, Path],
             report: Path) -> dict[str, list[dict[str, Any]]]:
    """Each case's rounds on one line: ``dpprof run`` in a process of its own each way, the
    order alternating."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CLI_CASES}
    for r in range(repeat):
        print(f"round {r + 1}/{repeat}", flush=True)
        for name, (folder, args) in CLI_CASES.items():
            command = ["run", "-o", str(report), *args]
            got: dict[bool, float] = {}
            timers: dict[str, float] = {}
            for sealed in ((False, True) if r % 2 == 0 else (True, False)):
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    started = time.perf_counter()
                    subprocess.run([sys.executable, __file__, "--cli-child",
                                    "sealed" if sealed else "unsealed", "--timers", out.name,
                                    "--", *command], env=env, cwd=folders[folder],
                                   check=True, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
                    got[sealed] = time.perf_counter() - started
                    if sealed:
                        timers = json.loads(Path(out.name).read_text())
            rows[name].append({"unsealed_wall_s": got[False], "sealed_wall_s": got[True],
                               "timers": timers})
    return rows


def _spread(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median and spread over the rounds."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"median": round(statistics.median(values), digits),
            "min": round(min(values), digits), "q1": round(q[0], digits),
            "q3": round(q[2], digits), "max": round(max(values), digits),
            "runs": [round(v, digits) for v in values]}


def _case_record(rows: list[dict[str, Any]]) -> dict[str, Any]:
    wall = [r["sealed"][0] / r["unsealed"][0] for r in rows]
    cpu = [r["sealed"][1] / r["unsealed"][1] for r in rows]
    share = [r["timers"]["seal"] / r["sealed"][0] for r in rows]
    parts = rows[0]["timers"].keys()
    return {
        "wall_ratio": _spread(wall), "cpu_ratio": _spread(cpu),
        "seal_share_of_wall": _spread(share, 4),
        "seal_ms_median": {k: round(statistics.median(r["timers"][k] for r in rows)
                                    * (1 if k in ("hook_events", "runs") else 1000), 2)
                           for k in parts},
        "wall_s": {"unsealed": [round(r["unsealed"][0], 3) for r in rows],
                   "sealed": [round(r["sealed"][0], 3) for r in rows]},
        "cpu_s": {"unsealed": [round(r["unsealed"][1], 3) for r in rows],
                  "sealed": [round(r["sealed"][1], 3) for r in rows]},
    }


def _cli_record(rows: list[dict[str, Any]]) -> dict[str, Any]:
    wall = [r["sealed_wall_s"] / r["unsealed_wall_s"] for r in rows]
    return {"wall_ratio": _spread(wall), "met": statistics.median(wall) <= GOAL,
            "seal_share_of_wall": _spread([r["timers"]["seal"] / r["sealed_wall_s"]
                                           for r in rows], 4),
            "seal_ms_median": round(statistics.median(r["timers"]["seal"] for r in rows)
                                    * 1000, 2),
            "startup_ms_median": round(statistics.median(r["timers"]["startup"] for r in rows)
                                       * 1000, 2),
            "census_taken_ms": _spread([r["timers"]["census_taken"] * 1000 for r in rows], 2),
            "census_waited_ms": _spread([r["timers"]["census_waited"] * 1000 for r in rows], 2),
            "wall_s": {"unsealed": [round(r["unsealed_wall_s"], 2) for r in rows],
                       "sealed": [round(r["sealed_wall_s"], 2) for r in rows]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7,
                    help="rounds in process (default 7)")
    ap.add_argument("--cli-repeat", type=int, default=5,
                    help="rounds of the command (default 5)")
    ap.add_argument("--no-write", action="store_true", help="do not write results_seal.json")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--cli-child", choices=("sealed", "unsealed"), help=argparse.SUPPRESS)
    ap.add_argument("--timers", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cli_child is not None:
        cli_child(args.cli_child == "sealed", args.timers, args.rest[1:])
        return
    if args.child is not None:
        if args.case is None:
            kernel_child(args.repeat, args.child)
        else:
            audit_child(args.case, args.child)
        return
    from ratios import machine

    load_before = os.getloadavg()
    lines: dict[str, Any] = {}
    env = {k: v for k, v in os.environ.items() if k != "DPPROF_NO_NAMESPACE"}
    no_ns = {**env, "DPPROF_NO_NAMESPACE": "1"}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        print("the kernel line:", flush=True)
        subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat),
                        "--child", out.name], env=env, check=True)
        lines["kernel"] = json.loads(Path(out.name).read_text())
    print("the audit-hook line (each round of each case a process of its own):", flush=True)
    lines["audit-hook"] = audit_hook_line(args.repeat, no_ns)
    cli: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work, big = _user_folders(Path(tmp), True)
        for line, line_env in (("kernel", env), ("audit-hook", no_ns)):
            print(f"the command, the {line} line:", flush=True)
            rows = cli_line(args.cli_repeat, line_env, {"work": work, "big": big},
                            Path(tmp) / "report.json")
            cli[line] = {name: _cli_record(r) for name, r in rows.items()}
    results: dict[str, Any] = {
        **machine(), "load_average_before_after": [
            [round(x, 2) for x in load_before], [round(x, 2) for x in os.getloadavg()]],
        "method": "wall and CPU seconds of the process, in process, each round each case once "
                  "each way side by side, the order alternating; median and spread over "
                  "rounds; the seal's own seconds from its timers; cores shared",
        "goal": f"<= {GOAL} (median wall ratio of the command: what the user waits)",
        "command": cli, "lines": {}}
    for line, rec in lines.items():
        said = rec["line"] + (f" (asked for {line})" if rec["line"] != line else "")
        print(f"in process, {said}:"
              + (f" no namespace: {rec['why_not']}" if rec["why_not"] else ""))
        cases = {k: _case_record(v) for k, v in rec.pop("rows").items()}
        results["lines"][line] = {**rec, "cases": cases}
        for k, c in cases.items():
            w, p, s = c["wall_ratio"], c["cpu_ratio"], c["seal_share_of_wall"]
            print(f"  {k:<34} wall {w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f})  "
                  f"cpu {p['median']:.3f} ({p['min']:.3f}-{p['max']:.3f})  "
                  f"seal's own {100 * s['median']:.2f} % of the run "
                  f"({c['seal_ms_median']['seal']:.1f} ms)")
    print("the command (dpprof run in a process of its own), the goal's measure:")
    for line, cases in cli.items():
        print(f"  {line}:")
        for k, c in cases.items():
            w, s = c["wall_ratio"], c["seal_share_of_wall"]
            print(f"    {k:<34} wall {w['median']:.3f} ({w['min']:.3f}-{w['max']:.3f})  "
                  f"seal's own {100 * s['median']:.2f} % ({c['seal_ms_median']:.1f} ms; "
                  f"census {c['census_taken_ms']['median']:.1f} ms ahead, waited "
                  f"{c['census_waited_ms']['median']:.1f} ms)  "
                  f"goal {GOAL}: {'met' if c['met'] else 'NOT MET'}")
    if not args.no_write:
        (HERE / "results_seal.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {HERE / 'results_seal.json'}")


if __name__ == "__main__":
    sys.exit(main())
