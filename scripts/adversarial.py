"""An adversarial sweep of dpprof (issue 13's figures, measured the same way): prints tries and
clean counts per area.

    python scripts/adversarial.py            # every area (a few minutes on 2 cores)
    python scripts/adversarial.py cli files  # some areas: cli files control signals faults

Areas and what "clean" means:

* ``cli``: bad or unusual invocations of every command (CliRunner, in process): no traceback,
  no raw control character, an exit status of the policy (0 1 2 3), the expected one where
  the case says (2 for a value out of range, 1 when nothing is measured);
* ``files``: every saved result in tests/data with one value replaced (NaN, huge integers,
  deep nesting, lone surrogates, wrong types, markup, control sequences) rendered by
  ``dpprof report`` in the terminal, Markdown, HTML and JSON: no traceback, exit 0 or 1,
  every HTML page's figure JSON parseable (no NaN), within 60 s;
* ``control``: workload names with terminal control sequences through compare's terminal
  output and its Markdown: no raw control character;
* ``signals``: SIGTERM / SIGINT to a cpu-backend compare while its gloo ranks run: exit
  143 / 130, no process left, no ``.tmp`` file, the scenarios measured written (partial);
* ``faults``: DDP rank 1 raises, hangs, calls sys.exit, calls os._exit, crashes: the
  scenario names rank 1 (not rank 0), exit 1, within the --ddp-timeout bound.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from dpprof.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' /proc helpers: one copy
from proctree import alive, descendants  # noqa: E402

DATA = ROOT / "tests" / "data"
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
runner = CliRunner()
FAST = ["-w", "mlp", "-b", "4", "-s", "single", "--no-fixes", "-g", "2"]


class Tally:
    def __init__(self, area: str) -> None:
        self.area, self.tries, self.clean = area, 0, 0
        self.bad: list[str] = []
        self.exits: dict[int, int] = {}  # exit status -> how many (where recorded)

    def check(self, what: str, ok: bool, why: str = "") -> None:
        self.tries += 1
        if ok:
            self.clean += 1
        else:
            self.bad.append(f"{what}: {why}"[:300])

    def line(self) -> str:
        exits = ", ".join(f"exit {k}: {v}" for k, v in sorted(self.exits.items()))
        return (f"{self.area:10s} tries {self.tries:5d}  clean {self.clean:5d}  not clean "
                f"{self.tries - self.clean}" + (f"  [{exits}]" if exits else ""))


def _problem(r: Any, allowed: set[int], expect: int | None = None) -> str:
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return f"exception {type(r.exception).__name__}: {r.exception}"
    if "Traceback" in r.output:
        return "traceback in the output"
    if RAW_CONTROL.search(r.output.replace("\n", "").replace("\t", "")):
        return "raw control character in the output"
    if r.exit_code not in allowed:
        return f"exit {r.exit_code}"
    if expect is not None and r.exit_code != expect:
        return f"exit {r.exit_code}, expected {expect}"
    return ""


# ---- cli ------------------------------------------------------------------------------------

BAD_NUMBERS = ["nan", "inf", "-inf", "-1", "0", "9223372036854775808", "1e400", "x", ""]
NUMERIC = {
    "compare": ["--batch", "--gpus", "--seed", "--warmup", "--steps", "--nvml-interval",
                "--ddp-timeout", "--bucket-cap-mb", "--multiple-of", "--fail-on-imbalance"],
    "maxbatch": ["--gpus", "--multiple-of", "--seed"],
    "watch": ["--interval", "--kill-after"],
    "run": ["--gpus", "--steps"],
}
HOSTILE = ["[red]x[/red]", "[/x]", "a:b:c", ":smile:", "\x1b]0;pwned\x07", "\x1b[2J",
           "<b>x</b>", "@alice", "%%{init}%%", "\u202e", "x\ny"]


def cli_cases(tmp: Path) -> list[tuple[list[str], int | None]]:
    cases: list[tuple[list[str], int | None]] = []
    for cmd, opts in NUMERIC.items():
        for opt in opts:
            for v in BAD_NUMBERS:
                if cmd == "compare":
                    cases.append((["compare", *FAST, opt, v], None))
                elif cmd == "maxbatch":
                    cases.append((["maxbatch", "-w", "mlp", "-s", "single", opt, v], None))
                elif cmd == "watch":
                    cases.append((["watch", opt, v, "--", "true"], None))
                else:
                    cases.append((["run", opt, v, "--", "python", "-c", "pass"], None))
    big = [("--gpus", "10000"), ("--batch", "9223372036854775808"), ("--warmup", "100000"),
           ("--gpu-memory", "99999999TiB"), ("--gpu-memory", "nanGiB"), ("--seed", "-5")]
    cases += [(["compare", *FAST, o, v], 2) for o, v in big]
    cases += [(["compare", *FAST[:4], "-s", s], 2) for s in
              ("ddp,ddp", "single,single", "", ",", "bogus", "single,bogus")]
    for out in ("adir.html/", "", "r.txt", "r", "x.json/", "[/x].md/"):
        cases.append((["compare", *FAST, "-o", out], 2))
    for name in HOSTILE:
        cases.append((["compare", *FAST, "-o", str(tmp / f"{name}.md")], None))
        cases.append((["compare", *FAST[2:], "-w", name], 2))
        cases.append((["report", str(tmp / f"{name}.json")], 1))
        cases.append((["compare", *FAST, "--gpu", name], 2))
        cases.append((["compare", *FAST, "--backend", name], 2))
    exits = tmp / "exits.py"
    exits.write_text("import sys\ndef wl():\n    sys.exit(0)\n")
    cases.append((["compare", *FAST[2:], "-w", f"{exits}:wl"], 1))
    cases += [(["report"], 2), (["report", "a.json", "b.json", "c.json"], 2),
              (["report", "/dev/zero"], 1), (["report", "/dev/null"], 1), (["report", str(tmp)], 1),
              (["env", "--bogus"], 2), (["bogus"], 2), (["compare", "--bogus"], 2),
              (["watch"], 2), (["watch", "--load", str(tmp / "none.jsonl")], None)]
    return cases


def area_cli(tally: Tally) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            for args, expect in cli_cases(tmp):
                r = runner.invoke(app, args)
                tally.exits[r.exit_code] = tally.exits.get(r.exit_code, 0) + 1
                why = _problem(r, {0, 1, 2, 3}, expect)
                tally.check(" ".join(map(repr, args)), not why, why)
        finally:
            os.chdir(cwd)


# ---- files ------------------------------------------------------------------------------------

VALUES: list[Any] = [None, True, -1, 0, 2**64, 10**30, -(10**30), 1.5, float("nan"),
                     float("inf"), "", "x" * 100_000, "\ud800", "[/x]", "\x1b]0;t\x07", [], {},
                     [None], {"a": None}, "__DEEP__", 1_000_000]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
        node, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def area_files(tally: Tally, per_file: int = 48) -> None:
    rng = random.Random(13)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for base in sorted(DATA.glob("*.json")):
            data0 = json.loads(base.read_text())
            paths = _paths(data0)
            for i in range(per_file):
                path = rng.choice(paths)
                value = VALUES[i % len(VALUES)]
                data = json.loads(json.dumps(data0))
                node = data
                for k in path[:-1]:
                    node = node[k]
                node[path[-1]] = value
                text = json.dumps(data).replace('"__DEEP__"', "[" * 5000 + "]" * 5000)
                p = tmp / "m.json"
                p.write_text(text)
                for fmt in ("terminal", "md", "html", "json"):
                    args = ["report", str(p)] + ([] if fmt == "terminal" else
                                                 ["-o", str(tmp / f"out.{fmt}")])
                    t0 = time.perf_counter()
                    r = runner.invoke(app, args)
                    tally.exits[r.exit_code] = tally.exits.get(r.exit_code, 0) + 1
                    why = _problem(r, {0, 1})
                    if not why and time.perf_counter() - t0 > 60:
                        why = "slower than 60 s"
                    if not why and fmt == "html" and r.exit_code == 0:
                        page = (tmp / "out.html").read_text()
                        m = re.search(r"id=.dpprof-figures.[^>]*>(.*?)</script>", page, re.S)
                        try:
                            if m:
                                json.loads(m.group(1), parse_constant=_refuse)
                        except ValueError as e:
                            why = f"figure JSON: {e}"
                    tally.check(f"{base.name} {path} = {str(value)[:30]!r} ({fmt})", not why,
                                why)


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} in JSON")


# ---- control ----------------------------------------------------------------------------------

SEQUENCES = ["\x1b]0;pwned\x07", "\x1b]2;t\x1b\\", "\x1b[2J\x1b[H", "\x1b[31mred\x1b[0m",
             "\x1bc", "\x07", "\x08\x08x", "\rover", "\x9b31m", "\x1b[6n", "\x0c", "\x00",
             "\u202eevil", "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "\x7f", "\x1b[?1049h"]
NAMED = '''
import torch
import dpprof

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

def wl():
    return dpprof.Workload(model=lambda: torch.nn.Linear(4, 4), batch=_batch,
                           loss=torch.nn.MSELoss(), name=NAME)
'''


def area_control(tally: Tally) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for i, seq in enumerate(SEQUENCES):
            f = tmp / f"wl{i}.py"
            f.write_text(f"NAME = {seq!r}\n" + NAMED)
            out = tmp / f"r{i}.md"
            r = runner.invoke(app, ["compare", "-w", f"{f}:wl", "-b", "4", "-s", "single",
                                    "--no-fixes", "-o", str(out)])
            tally.check(f"compare {seq!r}", not _problem(r, {0}), _problem(r, {0}))
            r = runner.invoke(app, ["report", str(out.with_suffix(".json"))]) if out.with_suffix(
                ".json").exists() else None
            md = out.read_text() if out.exists() else ""
            bad = RAW_CONTROL.search(md.replace("\n", ""))
            tally.check(f"markdown {seq!r}", bool(md) and not bad, "raw control in Markdown")


# ---- signals ----------------------------------------------------------------------------------



def area_signals(tally: Tally) -> None:
    for sig, code, when in ((signal.SIGTERM, 143, "ranks"), (signal.SIGINT, 130, "ranks"),
                            (signal.SIGTERM, 143, "ranks-late"), (signal.SIGINT, 130, "early")):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            out = tmp / "run.json"
            proc = subprocess.Popen(
                [sys.executable, "-m", "dpprof", "compare", "--backend", "cpu", "-w", "mlp",
                 "-b", "8", "-g", "2", "-s", "single,ddp", "--no-fixes", "-o", str(out), "-q"],
                cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            deadline = time.monotonic() + 120
            if when.startswith("ranks"):
                while time.monotonic() < deadline and proc.poll() is None and len(
                        descendants(proc.pid)) < 3:
                    time.sleep(0.1)
                time.sleep(3.0 if when == "ranks-late" else 1.0)
            else:
                time.sleep(2.0)
            everyone = descendants(proc.pid)
            if sig == signal.SIGINT:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
            time.sleep(1.0)
            left = [p for p in everyone if alive(p)]
            tmps = list(tmp.rglob("*.tmp"))
            lines = [ln for ln in err.splitlines() if ln.strip()]
            tally.check(f"{sig.name} {when}: exit", proc.returncode == code,
                        f"exit {proc.returncode}: {err[-300:]}")
            tally.check(f"{sig.name} {when}: orphans", not left, f"{len(left)} left")
            tally.check(f"{sig.name} {when}: temporary files", not tmps, str(tmps))
            tally.check(f"{sig.name} {when}: one line", len(lines) == 1, err[-300:])
            if when.startswith("ranks"):
                ok = out.exists() and json.loads(out.read_text()).get("interrupted") == sig.name
                tally.check(f"{sig.name} {when}: partial result", ok, "no partial result")
            for p in left:
                os.kill(p, signal.SIGKILL)


# ---- faults -----------------------------------------------------------------------------------

FAULTY = '''
import os, signal, sys, time
import torch
import dpprof

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            how = HOW
            if how == "raise":
                raise RuntimeError("rank 1's own error")
            if how == "hang":
                time.sleep(3600)
            if how == "sys.exit":
                sys.exit(0)
            if how == "os._exit":
                os._exit(0)
            if how == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
        return self.lin(x)

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

def wl():
    return dpprof.Workload(model=Net, batch=_batch, loss=torch.nn.MSELoss(), name="faulty")
'''


def area_faults(tally: Tally) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for how in ("raise", "hang", "sys.exit", "os._exit", "crash"):
            f = tmp / "wl.py"
            f.write_text(FAULTY.replace("HOW", repr(how)))
            out = tmp / f"{how}.json"
            t0 = time.monotonic()
            r = runner.invoke(app, ["compare", "--backend", "cpu", "-w", f"{f}:wl", "-b", "4",
                                    "-g", "2", "-s", "ddp", "--no-fixes", "--ddp-timeout", "5",
                                    "-o", str(out)])
            took = time.monotonic() - t0
            msg = json.loads(out.read_text())["scenarios"][0]["message"] if out.exists() else ""
            ok = r.exit_code == 1 and msg.startswith("rank 1 failed") and took < 60
            tally.check(f"rank 1 {how}", ok, f"exit {r.exit_code}, {took:.0f} s: {msg[:200]}")


AREAS: dict[str, Callable[[Tally], None]] = {
    "cli": area_cli, "files": area_files, "control": area_control, "signals": area_signals,
    "faults": area_faults,
}


def main(argv: list[str]) -> int:
    names = argv or list(AREAS)
    tallies = []
    for name in names:
        t = Tally(name)
        t0 = time.perf_counter()
        AREAS[name](t)
        print(f"{t.line()}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        for b in t.bad[:20]:
            print(f"    {b}")
        tallies.append(t)
    return 0 if all(t.tries == t.clean for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
