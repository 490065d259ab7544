"""The environment block: collected without a GPU, rendered for issues and terminals."""

from __future__ import annotations

import ctypes
import json
import platform
from typing import Any

import pytest
import torch
from fake_nvml import FakeDevice, FakeLink, FakeNvml

from dpprof import environment as env_module
from dpprof.environment import collect_environment, environment_markdown, environment_rows
from dpprof.nvml.queries import NvmlBackend, NvmlStatus

A = "GPU-aaaa0000-1111-2222-3333-444444444444"
B = "GPU-bbbb1111-1111-2222-3333-444444444444"


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def fake_pair(**kw: Any) -> FakeNvml:
    return FakeNvml(
        [
            FakeDevice(A, name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0)),
            FakeDevice(B, name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0)),
        ],
        links={(0, 1): FakeLink(topology="SYS", nvlinks=4)},
        **kw,
    )


@pytest.mark.skipif(
    torch.cuda.is_available() or _driver_present(), reason="needs a machine without GPUs"
)
def test_collect_environment_on_this_machine_without_gpu() -> None:
    env = collect_environment()
    json.dumps(env)  # JSON-ready as it is
    assert env["python_version"] == platform.python_version()
    assert env["torch_version"] == torch.__version__
    assert env["torch_cuda_version"] == torch.version.cuda
    assert env["cuda_available"] is False
    assert env["cuda_device_count"] == 0
    assert env["nvml"]["available"] is False
    assert "Library Not Found" in env["nvml"]["reason"]
    assert env["nvml"]["hint"]
    assert env["driver_version"] is None
    assert env["reasons"]["driver_version"].startswith("NVML not available")
    assert env["gpus"] == []
    assert env["topology"] is None and "topology" in env["reasons"]
    assert env["dpprof_version"]
    # every None has a reason, apart from the unset environment variables
    for key, value in env.items():
        if value is None and key not in ("cuda_visible_devices", "cuda_device_order"):
            assert key in env["reasons"], key


def test_collect_environment_from_nvml_alone() -> None:
    env = collect_environment(fake_pair(), environ={"CUDA_VISIBLE_DEVICES": "1"}, use_cuda=False)
    assert env["nvml"] == {"available": True, "reason": "fake NVML", "hint": ""}
    assert env["driver_version"] == "550.54.15"
    assert env["cuda_driver_version"] == "12.4"
    assert env["cuda_visible_devices"] == "1"
    (gpu,) = env["gpus"]
    assert gpu["cuda_index"] == 0
    assert gpu["uuid"] == B and gpu["nvml_index"] == 1
    assert gpu["total_memory_bytes"] == 80 * 2**30
    assert gpu["compute_capability"] == "8.0"
    assert env["topology"] is None  # one GPU visible
    assert "fewer than two GPUs" in env["reasons"]["topology"]


def test_topology_matrix_and_links() -> None:
    env = collect_environment(fake_pair(), environ={}, use_cuda=False)
    topo = env["topology"]
    assert topo["devices"] == [0, 1]
    assert topo["matrix"] == [["X", "NV4"], ["NV4", "X"]]
    (link,) = topo["links"]
    assert (link["label"], link["topology"], link["nvlinks"], link["p2p_read"]) == (
        "NV4",
        "SYS",
        4,
        "ok",
    )


def test_unreadable_parts_are_none_with_reason() -> None:
    nvml = FakeNvml(
        [FakeDevice(A, compute_capability=None)], driver_version=None, cuda_driver_version=None
    )
    env = collect_environment(nvml, environ={}, use_cuda=False)
    assert env["driver_version"] is None and env["reasons"]["driver_version"] == "Not Supported"
    assert env["cuda_driver_version"] is None
    (gpu,) = env["gpus"]
    assert gpu["compute_capability"] is None
    assert gpu["reasons"]["compute_capability"] == "Not Supported"


def test_missing_torch_is_a_reason_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_torch() -> Any:
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(env_module, "_import_torch", no_torch)
    env = collect_environment(FakeNvml.unavailable("no driver"), environ={})
    assert env["torch_version"] is None
    assert "No module named 'torch'" in env["reasons"]["torch_version"]
    assert env["cuda_available"] is None and "cuda_available" in env["reasons"]
    assert env["gpus"] == []


class BrokenBackend(FakeNvml):
    def status(self) -> NvmlStatus:
        raise RuntimeError("backend bug")


def test_a_broken_backend_does_not_break_collection() -> None:
    backend: NvmlBackend = BrokenBackend()
    env = collect_environment(backend, environ={})
    assert env["nvml"]["available"] is False
    assert "backend bug" in env["nvml"]["reason"]


def test_environment_markdown_for_an_issue() -> None:
    env = collect_environment(fake_pair(), environ={"CUDA_VISIBLE_DEVICES": "0,1"}, use_cuda=False)
    env["gpus"][0]["name"] = "odd | name"
    text = environment_markdown(env)
    assert text.startswith("### Environment\n")
    assert "| CUDA | GPU | memory | compute capability | UUID | NVML index | PCI bus id |" in text
    assert f"| 0 | odd \\| name | 80.0 GiB | 8.0 | `{A}` | 0 | 00000000:10:00.0 |" in text
    assert "| cuda:0 | X | NV4 |" in text
    assert "- **NVIDIA driver**: 550.54.15" in text
    assert "- **CUDA_VISIBLE_DEVICES**: 0,1" in text
    assert "- **NVML**: available" in text
    assert environment_markdown(env, heading=None).startswith("| CUDA |")


def test_environment_markdown_without_nvml_says_why_once() -> None:
    # use_cuda=False: on a GPU machine torch would list the GPU that NVML cannot
    env = collect_environment(FakeNvml.unavailable("NVML Shared Library Not Found"), environ={},
                              use_cuda=False)
    text = environment_markdown(env)
    assert "GPUs: none (NVML not available)." in text
    assert "- **NVIDIA driver**: n/a (NVML not available)" in text
    assert text.count("NVML Shared Library Not Found") == 1  # on the NVML line only
    assert "- **CUDA_VISIBLE_DEVICES**: unset" in text


def test_environment_rows_for_a_terminal() -> None:
    env = collect_environment(fake_pair(), environ={"CUDA_VISIBLE_DEVICES": ""}, use_cuda=False)
    rows = environment_rows(env)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in rows)
    table = dict(rows)
    assert table["NVIDIA driver"] == "550.54.15"
    assert table["CUDA_VISIBLE_DEVICES"] == '"" (no GPU)'
    assert table["GPUs"].startswith("none")
    env = collect_environment(fake_pair(), environ={}, use_cuda=False)
    table = dict(environment_rows(env))
    assert table["cuda:1"] == f"NVIDIA A100-SXM4-80GB · 80.0 GiB · cc 8.0 · {B} · NVML 1"
    assert table["cuda:0 ↔ cuda:1"] == "NV4, P2P ok"
