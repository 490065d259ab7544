"""Built-in workloads run under every scenario; users' own load from a module or a file."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dpprof.backends.emulated import EmulationConfig, run_scenario
from dpprof.errors import WorkloadError
from dpprof.scenarios.registry import SCENARIOS
from dpprof.scenarios.step import StepConfig
from dpprof.scenarios.workloads import BUILTINS, Workload, load_workload

USER = '''
import torch
from torch import nn
import dpprof

def workload():
    return dpprof.Workload(
        name="user-mlp",
        model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
        batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                    torch.randint(0, 4, (rows,), device=device)),
        loss=nn.functional.cross_entropy,
    )
'''


@pytest.mark.parametrize("name", sorted(BUILTINS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_builtins_run_under_every_scenario(name: str, scenario: str) -> None:
    r = run_scenario(scenario, load_workload(name),
                     EmulationConfig(
                         gpus=2, gpu_memory_bytes=2**40, debug=True, step=StepConfig(batch=8),
                     ))
    assert r.status == "ok", r.message + "".join(r.notes)
    assert r.devices[0].peak_allocated_bytes > 0
    assert "parameters" in r.devices[0].breakdown_bytes


def test_load_from_a_file_and_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "my_workload.py"
    f.write_text(USER)
    wl = load_workload(f"{f}:workload")
    assert isinstance(wl, Workload) and wl.name == "user-mlp"
    monkeypatch.syspath_prepend(str(tmp_path))
    wl2 = load_workload("my_workload:workload")
    assert wl2.name == "user-mlp"
    r = run_scenario("dp-loss-primary", wl2, EmulationConfig(
        gpus=2, gpu_memory_bytes=2**31,
        step=StepConfig(batch=8),
    ))
    assert r.status == "ok"
    sys.modules.pop("my_workload", None)


def test_unknown_builtin_lists_the_known_ones() -> None:
    with pytest.raises(WorkloadError, match="built-ins are lm, mlp, convnet, classifier"):
        load_workload("resnet")


def test_a_failing_model_is_an_error_result_not_a_crash() -> None:
    def boom():
        raise RuntimeError("CUDA kernel missing")

    wl = Workload(name="boom", model=boom, batch=lambda r, d: (None, None), loss=lambda o, t: o)
    r = run_scenario("single", wl, EmulationConfig(
        gpus=2, gpu_memory_bytes=2**31, step=StepConfig(batch=8),
    ))
    assert r.status == "error" and "CUDA kernel missing" in r.message


def test_a_workload_file_imports_a_module_beside_it(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``path/to/file.py:fn`` makes the file's folder importable, as ``python file.py``
    does, wherever dpprof is started (even when the import is inside ``model()``)."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "mynet_beside.py").write_text(
        "from torch import nn\n"
        "def build():\n    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n")
    (folder / "train.py").write_text(USER.replace(
        'model=lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),',
        'model=lambda: __import__("mynet_beside").build(),'))
    monkeypatch.chdir(tmp_path)  # not the file's folder
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(folder))])
    wl = load_workload("proj/train.py:workload")
    r = run_scenario("single", wl, EmulationConfig(
        gpus=2, gpu_memory_bytes=2**40, step=StepConfig(batch=4),
    ))
    assert r.status == "ok", r.message


class _Mismatch(nn.Module):
    """A shape bug in forward: (rows, 16) @ (8, 4) fails in aten::mm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) @ self.w  # the user's line


@pytest.mark.parametrize("compute", [False, True])
def test_an_error_names_the_users_line_and_the_op(compute: bool) -> None:
    wl = Workload(name="mismatch", model=_Mismatch,
                  batch=lambda rows, device: (torch.randn(rows, 16, device=device),
                                              torch.randn(rows, 4, device=device)),
                  loss=nn.functional.mse_loss)
    for name in SCENARIOS:
        r = run_scenario(name, wl, EmulationConfig(
            gpus=2, gpu_memory_bytes=2**31, compute=compute,
            step=StepConfig(batch=4),
        ))
        assert r.status == "error"
        assert "aten::mm" in r.message, r.message
        assert f"{__file__}:" in r.message and "in forward: return self.fc(x) @ self.w" \
            in r.message, r.message
        assert "\n" not in r.message.split(" (aten::")[-1]
