"""The script's error as its user reads it, on virtual GPUs as on a GPU.

Over meta tensors an operator's error is raised by a meta kernel written in Python (torch's
``_meta_registrations``, ``_refs``, ``torch._check``) reached through ``torch/_ops.py``; on a
GPU, and on the CPU, the kernel is C++ and the traceback ends at the script's line. Found
on Tianxiaomo's pytorch-YOLOv4 ``train.py``: its error ended in ``torch/__init__.py``'s
``_check_with``, the script's line above four of torch's frames.

Held to plain Python: generated scripts (operators that fail x where they are called)
raise under ``dpprof run`` with the traceback plain ``python`` prints for them on the CPU:
the script's frames, and the last, the same."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dpprof.scenarios.losses
from dpprof.emulator.call_sites import in_dpprof
from dpprof.script.script_error import raised_at
from dpprof.script.session import ScriptConfig, parse_command, run_command
from dpprof.units import parse_bytes

# operators that fail on their operands' shapes, as a training script's bug does
FAILING = {
    "view": "a = torch.randn(2, 3, 6, 5, 5, device=dev).permute(0, 1, 3, 4, 2)\n"
            "b = a[..., :4].clone()[0].view(-1, 4)",
    "broadcast": "a = torch.randn(4, 3, device=dev)\nb = a + torch.randn(2, 3, device=dev)",
    "inplace": "a = torch.randn(2, 3, 8, device=dev)\na[..., 0] += torch.randn(4, 3, device=dev)",
    "matmul": "a = torch.randn(4, 3, device=dev)\nb = a @ torch.randn(4, 3, device=dev)",
    "cat": "b = torch.cat([torch.randn(4, 3, device=dev), torch.randn(2, 5, device=dev)])",
    "linear": "b = F.linear(torch.randn(4, 3, device=dev), torch.randn(8, 5, device=dev))",
    "reshape": "b = torch.randn(4, 3, device=dev).reshape(5, -1)",
}
# where the failing lines are: the script's top level, a function, a module's forward
PLACES = {
    "top": "{code}\n",
    "function": "def step():\n{indented}\n\n\nstep()\n",
    "forward": "class Net(nn.Module):\n    def forward(self, x):\n{indented2}\n        "
               "return x\n\n\nNet()(torch.zeros(1, device=dev))\n",
}
HEAD = ("import os\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
        "dev = os.environ.get('DEV', 'cuda')\n")
CASES = list(itertools.product(sorted(FAILING), sorted(PLACES)))

# each script run by plain Python, its frames from the script's first on (the driver's and
# runpy's before it left out), as Python's traceback module gives them
PLAIN = """
import json, os, runpy, sys, traceback
os.environ["DEV"] = "cpu"
out = {}
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        first = next(i for i, f in enumerate(frames) if f.filename == path)
        out[path] = [[f.filename, f.lineno, f.name] for f in frames[first:]] + [type(e).__name__]
print(json.dumps(out))
"""
FRAME = re.compile(r'^  File "(.+)", line (\d+), in (\S+)$', re.M)


def _script(op: str, place: str) -> str:
    code = FAILING[op]
    return HEAD + PLACES[place].format(code=code, indented=textwrap.indent(code, "    "),
                                       indented2=textwrap.indent(code, "        "))


@pytest.fixture(scope="module")
def plain_frames(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[object]]:
    """Every generated script's traceback under plain Python on the CPU, in one process."""
    folder = tmp_path_factory.mktemp("plain")
    paths = []
    for op, place in CASES:
        path = folder / f"{op}_{place}.py"
        path.write_text(_script(op, place))
        paths.append(str(path))
    done = subprocess.run([sys.executable, "-c", PLAIN, *paths], capture_output=True,
                          text=True, check=True)
    frames: dict[str, list[object]] = json.loads(done.stdout)
    assert len(frames) == len(CASES), "each generated script fails under plain Python"
    return {Path(p).name: f for p, f in frames.items()}


@pytest.mark.parametrize(("op", "place"), CASES)
def test_the_traceback_is_the_one_python_prints_on_a_real_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain_frames: dict[str, list[object]],
        op: str, place: str) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"{op}_{place}.py"
    (tmp_path / name).write_text(_script(op, place))
    _, main = run_command(ScriptConfig(launch=parse_command(["python", name], 1)),
                          alternatives=False)
    assert main.ended == "script raised" and main.script_traceback
    shown = [[Path(f).name, int(line), func]
             for f, line, func in FRAME.findall(main.script_traceback)]
    *plain, error = plain_frames[name]
    expected = [[Path(str(f[0])).name, f[1], f[2]] for f in plain]  # type: ignore[index]
    # the script's own frames, and the last frame (where the error is) the same; torch's
    # between them may differ (module calls take the hooked path under dpprof's hooks)
    assert [f for f in shown if f[0] == name] == [f for f in expected if f[0] == name]
    assert shown[-1] == expected[-1]
    assert main.script_traceback.rstrip().splitlines()[-1].startswith(f"{error}:")
    # the line the report names is the script's own
    assert main.raised_at is not None and not main.raised_at.in_dpprof
    assert main.raised_at.site == f"{name}:{expected[-1][1]}"  # type: ignore[index]


def test_an_error_in_dpprof_s_code_is_dpprof_s_and_one_in_torch_s_kernel_the_caller_s() -> None:
    try:
        parse_bytes("twelve")
    except Exception as e:
        at = raised_at(e)
    assert at is not None and at.in_dpprof
    try:
        torch.randn(4, 3, device="meta") @ torch.randn(4, 3, device="meta")
    except RuntimeError as e:
        at = raised_at(e)
    assert at is not None and not at.in_dpprof
    assert at.site.endswith(f"test_script_error.py:{sys._getframe().f_lineno - 4}")


def test_every_folder_of_dpprof_s_package_is_dpprof_s() -> None:
    # an editable install assembles the package from profiler/, scenarios/ and reports/
    assert in_dpprof(str(Path(dpprof.scenarios.losses.__file__).resolve()))
    assert not in_dpprof(__file__)
