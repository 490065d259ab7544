"""The tests' seam into child processes (tests/fakehost/sitecustomize.py) and the hidden test
flags it replaced (issue 10: production code ships no fake and no flag for one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fake_cuda
from typer.testing import CliRunner

from dpprof.cli.app import app

PY = sys.executable

PROBE = """
import json, sys
from dpprof.backends.cuda_host import host
from dpprof.nvml import libnvml
from dpprof.cli import watch  # imports libnvml's names: the fake must already be there
nvml = libnvml.default_nvml()
print(json.dumps({"host": type(host()).__name__, "gpus": host().visible_gpus(),
                  "ddp": [host().ddp_backend, host().ddp_device],
                  "nvml": type(nvml).__name__, "nvml_gpus": nvml.device_count()}))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    r = subprocess.run([PY, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_the_seam_installs_the_fakes_in_a_child_and_only_there() -> None:
    fake = _probe(fake_cuda.fakehost_env(gpus=3, nvml="two_gpus"))
    assert fake == {"host": "CpuHost", "gpus": 3, "ddp": ["gloo", "cpu"],
                    "nvml": "FakeNvml", "nvml_gpus": 2}
    plain = _probe(fake_cuda.fakehost_env())  # on PYTHONPATH, nothing asked for
    assert plain["host"] == "CudaHost" and plain["ddp"] == ["nccl", "cuda"]
    assert plain["nvml"] == "RealNvml"


def test_a_process_that_never_imports_dpprof_is_untouched() -> None:
    """The command under ``dpprof watch`` inherits the environment: nothing is imported."""
    r = subprocess.run(
        [PY, "-c", "import sys; print(sorted(m for m in sys.modules "
         "if m.startswith(('dpprof', 'torch', 'fake_', 'watch_fakes'))))"],
        env=fake_cuda.fakehost_env(gpus=2, nvml="two_gpus"), capture_output=True, text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "site"
    other.mkdir()
    marker = tmp_path / "ran"
    (other / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = fake_cuda.fakehost_env(gpus=2, base={"PYTHONPATH": str(other)})
    r = subprocess.run([PY, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert marker.exists()


def test_the_hidden_test_flag_of_compare_is_gone() -> None:
    res = CliRunner().invoke(app, ["compare", "--cpu-test-mode"])
    assert res.exit_code == 2 and "No such option" in res.output, res.output
