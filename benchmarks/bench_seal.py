"""What the seal costs a run of ``dpprof run``: each script run sealed / the same run with the
seal off (``ScriptConfig(seal=False)``, for this measurement only). One command:

    python benchmarks/bench_seal.py              # prints, writes benchmarks/results_seal.json
    python benchmarks/bench_seal.py --repeat 7   # min-max over 7 rounds (default 5)

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
   files (walked once before the runs; the check after each run reads the kernel's record of
   what changed there, :mod:`dpprof.script.folder_watch`, or walks it again where there is
   none).

Cost is CPU time of the process (``time.process_time``, the kernel's time for the mounts
included), one warm-up of each first, each figure the least of two runs, min-max over the
rounds, torch on one intra-op thread. On the kernel line every ratio is measured side by
side in a round. On the audit-hook line Python never removes an audit hook, and the hook
is called on every audited event of the process -- ``id()`` is one (the emulator no longer
calls it per op: 90,432 events of case 1's sealed run -> 2,482) -- so once a sealed run has
added it, the unsealed runs after it would pay for it too. There each round of each case is
a fresh process of its own: a warm-up and the unsealed runs, then a warm-up and the sealed
runs (the first adds the hook), side by side in time as the kernel line's are. (Measuring
every unsealed round first, as before, let any change of the machine's load between the
halves land in the ratio: the same run read 0.96-1.17.) Goal <= 1.03 (the seal costs at
most 3 % of a run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GOAL = 1.03

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


CASES = ("meta_with_alternatives", "compute", "checkpoint_every_step",
         "meta_with_alternatives_5000_files")


def child(repeat: int, out: Path, only: str | None = None) -> None:
    """One line's rounds, in this process (entered into the namespace unless
    DPPROF_NO_NAMESPACE is set), written to ``out``; ``only``: one round of that case alone
    (the audit-hook line's unsealed then sealed runs, in a process of their own)."""
    from dpprof.script import namespace

    namespace.enter()  # before torch's import starts a thread
    import torch

    sys.path.insert(0, str(HERE))
    from bench_run import COMPUTE_SCRIPT, DP_SCRIPT
    from ratios import cpu_s, rounds, summary

    torch.set_num_threads(1)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    with tempfile.TemporaryDirectory() as tmp:
        work, big = Path(tmp) / "work", Path(tmp) / "big"
        for folder in (work, big):
            folder.mkdir()
            (folder / "train_dp.py").write_text(DP_SCRIPT)
            (folder / "train_small.py").write_text(COMPUTE_SCRIPT)
            (folder / "train_ckpt.py").write_text(CHECKPOINT_SCRIPT)
        for k in range(5000 if only in (None, CASES[3]) else 0):
            sub = big / "data" / f"{k // 500}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"{k}.txt").write_text(str(k))
        cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
        for name, folder, script, steps, compute, alternatives in (
                ("meta_with_alternatives", work, "train_dp.py", 8, False, True),
                ("compute", work, "train_small.py", 20, True, False),
                ("checkpoint_every_step", work, "train_ckpt.py", 8, False, False),
                ("meta_with_alternatives_5000_files", big, "train_dp.py", 8, False, True)):
            path = folder / script
            cases[name] = tuple(  # type: ignore[assignment]
                _in_folder(folder, _dpprof_run(path, steps, compute, alternatives, sealed))
                for sealed in (False, True))
        if only is not None:
            base, ours = cases[only]
            base()  # warm-up: imports, first calls
            b = cpu_s(base)
            ours()  # adds the audit hook, which stays
            out.write_text(json.dumps([b, cpu_s(ours)]))
            return
        for base, ours in cases.values():  # warm-up: imports, first calls
            base()
            ours()
        raw, secs = rounds(cases, repeat)
    record = {
        "line": "kernel" if namespace.entered() else "audit-hook",
        "method": "side by side in each round",
        "why_not": namespace.why_not(),
        "ratios": {k: summary(v, GOAL) for k, v in raw.items()},
        "cpu_s": {k: {"unsealed": [round(b, 3) for b, _ in v],
                      "sealed": [round(o, 3) for _, o in v]} for k, v in secs.items()},
    }
    out.write_text(json.dumps(record))


def audit_hook_line(repeat: int, env: dict[str, str]) -> dict[str, Any]:
    """The audit-hook line's record: each round of each case in a fresh process."""
    from ratios import summary

    raw: dict[str, list[float]] = {k: [] for k in CASES}
    secs: dict[str, list[tuple[float, float]]] = {k: [] for k in CASES}
    for r in range(repeat):
        print(f"round {r + 1}/{repeat}", flush=True)
        for name in CASES:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, __file__, "--child", out.name, "--case", name],
                               env=env, check=True)
                b, o = json.loads(Path(out.name).read_text())
            raw[name].append(o / b)
            secs[name].append((b, o))
    return {"line": "audit-hook", "method": "side by side in each round, each round of each "
            "case in a process of its own (the audit hook, once added, stays)",
            "why_not": "DPPROF_NO_NAMESPACE=1",
            "ratios": {k: summary(v, GOAL) for k, v in raw.items()},
            "cpu_s": {k: {"unsealed": [round(b, 3) for b, _ in v],
                          "sealed": [round(o, 3) for _, o in v]} for k, v in secs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="rounds (min-max over them)")
    ap.add_argument("--no-write", action="store_true", help="do not write results_seal.json")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.repeat, args.child, args.case)
        return
    sys.path.insert(0, str(HERE))
    from ratios import record_head

    lines: dict[str, Any] = {}
    env = {k: v for k, v in os.environ.items() if k != "DPPROF_NO_NAMESPACE"}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        print("the kernel line:", flush=True)
        subprocess.run([sys.executable, __file__, "--repeat", str(args.repeat),
                        "--child", out.name], env=env, check=True)
        lines["kernel"] = json.loads(Path(out.name).read_text())
    print("the audit-hook line (each round of each case a process of its own):", flush=True)
    lines["audit-hook"] = audit_hook_line(args.repeat, {**env, "DPPROF_NO_NAMESPACE": "1"})
    results = {**record_head(), "goal": f"<= {GOAL}", "lines": lines}
    for line, rec in lines.items():
        said = rec["line"] + (f" (asked for {line})" if rec["line"] != line else "")
        print(f"{said}:" + (f" no namespace: {rec['why_not']}" if rec["why_not"] else ""))
        for k, s in rec["ratios"].items():
            mark = "met" if s["met"] else "NOT MET"
            print(f"  {k:<36} {s['median']:.3f}  (min {s['min']:.3f} - max {s['max']:.3f}, "
                  f"{len(s['runs'])} rounds; goal {GOAL}: {mark})")
    if not args.no_write:
        (HERE / "results_seal.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {HERE / 'results_seal.json'}")


if __name__ == "__main__":
    sys.exit(main())
