"""A DataParallel subclass that replaces a piece of DataParallel's forward (``scatter``,
``gather``, ``parallel_apply``, ``replicate``), not the forward itself, runs under ``dpprof
run`` as torch's forward runs it, calling the instance's pieces. CSAIL's
semantic-segmentation-pytorch (``UserScatteredDataParallel``: the loader makes each GPU's
batch, its ``scatter`` copies each to its GPU) failed at its first step ("list indices must
be integers or slices, not str"): dpprof's DataParallel split the list itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from script_runs import run_cli

HEAD = """
import threading

import torch
from torch import nn
from torch.nn.parallel._functions import Gather
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
ROWS = 6  # each GPU's


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 1000))
        self.crit = nn.CrossEntropyLoss()

    def forward(self, batch):
        if getattr(self, "barrier", None) is not None:  # set on replicas by a callback
            self.barrier.wait(timeout=20)
        return self.crit(self.body(batch["x"]), batch["y"])
"""

# the batch as one dict of the loader's rows, scattered by DataParallel
PLAIN = HEAD + """

class Rows(Dataset):
    def __len__(self):
        return 8 * 2 * ROWS

    def __getitem__(self, i):
        return {"x": torch.randn(256), "y": torch.randint(0, 1000, ())}


model = WRAP
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for batch in DataLoader(Rows(), batch_size=2 * ROWS):
    loss = model(batch).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# each GPU's batch made by the loader, as CSAIL's TrainDataset makes them
PER_GPU = HEAD + """

class PerGpuBatches(nn.DataParallel):
    def scatter(self, inputs, kwargs, device_ids):
        (batches,) = inputs
        assert len(batches) == len(device_ids), (len(batches), device_ids)
        return ([[{k: v.cuda(d, non_blocking=True) for k, v in b.items()}]
                 for b, d in zip(batches, device_ids)], [{} for _ in device_ids])

    def gather(self, outputs, output_device):
        return Gather.apply(output_device, self.dim, *[o.unsqueeze(0) for o in outputs])


class PerGpu(Dataset):
    def __len__(self):
        return 8 * 2

    def __getitem__(self, i):
        return {"x": torch.randn(ROWS, 256), "y": torch.randint(0, 1000, (ROWS,))}


model = PerGpuBatches(Net()).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for batches in DataLoader(PerGpu(), batch_size=torch.cuda.device_count(),
                          collate_fn=lambda b: b):
    loss = model(batches).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# replication callbacks whose replicas wait on each other in forward (a synchronized
# BatchNorm's master and its copies), on the class or patched on the instance
CALLBACK_CLASS = """
class WithCallback(nn.DataParallel):
    def replicate(self, module, device_ids):
        replicas = super().replicate(module, device_ids)
        barrier = threading.Barrier(len(replicas))
        for replica in replicas:
            replica.barrier = barrier
        return replicas
"""

PATCHED = """

def patch_replication_callback(dp):
    old = dp.replicate

    def new_replicate(module, device_ids):
        replicas = old(module, device_ids)
        barrier = threading.Barrier(len(replicas))
        for replica in replicas:
            replica.barrier = barrier
        return replicas

    dp.replicate = new_replicate
    return dp

"""

OWN_PARALLEL_APPLY = """
class Counted(nn.DataParallel):
    calls = 0

    def parallel_apply(self, replicas, inputs, kwargs):
        Counted.calls += 1
        if Counted.calls == 1:
            print("the script's parallel_apply ran")
        return super().parallel_apply(replicas, inputs, kwargs)
"""


def _run(tmp_path: Path, name: str, source: str) -> tuple[dict[str, Any], str]:
    return run_cli(tmp_path, name, source, gpus=2)


def _scenario(result: dict[str, Any], name: str) -> dict[str, Any]:
    (s,) = [s for s in result["scenarios"] if s["name"] == name]
    assert s["status"] == "ok", s["message"]
    return s  # type: ignore[no-any-return]


def _bytes(s: dict[str, Any]) -> list[int]:
    return [d["peak_allocated_bytes"] for d in s["devices"]]


def _peaks(s: dict[str, Any]) -> list[tuple[int, int]]:
    return [(d["peak_allocated_bytes"], d["batch_rows"]) for d in s["devices"]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("plain"), "plain.py",
                PLAIN.replace("WRAP", "nn.DataParallel(Net()).cuda()"))[0]


def test_a_scatter_of_its_own_gives_each_gpu_the_batch_the_script_made_for_it(
        tmp_path: Path, plain: dict[str, Any]) -> None:
    """Each GPU's batch copied there by the script's scatter, gathered by its gather: every
    GPU peaks as DataParallel's own split of the same rows; DDP's rank is DataParallel on
    its one GPU (the loader's batch of per-GPU batches divided by 2: one, scattered by the
    script's scatter), as a DDP script's rank loads its share."""
    result, _ = _run(tmp_path, "per_gpu.py", PER_GPU)
    as_written = _scenario(result, "dp-loss-forward")
    assert _peaks(as_written) == _peaks(_scenario(plain, "dp-loss-forward"))
    assert [d["batch_rows"] for d in as_written["devices"]] == [6, 6]
    assert _peaks(_scenario(result, "ddp")) == _peaks(_scenario(plain, "ddp"))
    ddp_notes = " ".join(_scenario(result, "ddp")["notes"])
    assert "each DataLoader's batch_size divided by 2" in ddp_notes
    assert "the model given what PerGpuBatches's own scatter gives the rank's GPU alone" in \
        ddp_notes


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_replicate_of_its_own_is_noted_and_its_waiting_replicas_do_not_hang_the_run(
        tmp_path: Path, plain: dict[str, Any], where: str) -> None:
    """Replicas made to wait for each other (a synchronized BatchNorm's callbacks) would
    wait forever here, where they run one after another: DataParallel's replicate makes
    them, and the report says what that leaves out."""
    if where == "class":
        source = PLAIN.replace("WRAP", "WithCallback(Net()).cuda()").replace(
            "\n\nclass Rows(", CALLBACK_CLASS + "\n\nclass Rows(")
    else:
        source = PLAIN.replace("WRAP", "patch_replication_callback(nn.DataParallel(Net()).cuda())"
                              ).replace("\n\nclass Rows(", PATCHED + "class Rows(")
    result, _ = _run(tmp_path, "callback.py", source)
    as_written = _scenario(result, "dp-loss-forward")
    assert _peaks(as_written) == _peaks(_scenario(plain, "dp-loss-forward"))
    who = ("subclass WithCallback replaces DataParallel's replicate" if where == "class"
           else "the script replaces its DataParallel's replicate on the instance")
    assert any(who in n
               and "without the callbacks" in n for n in as_written["notes"]), \
        as_written["notes"]
    plain_notes = _scenario(plain, "dp-loss-forward")["notes"]
    assert not any("replaces DataParallel's replicate" in n for n in plain_notes)


def test_a_parallel_apply_of_its_own_runs_the_replicas(tmp_path: Path,
                                                       plain: dict[str, Any]) -> None:
    source = PLAIN.replace("WRAP", "Counted(Net()).cuda()").replace(
        "\n\nclass Rows(", OWN_PARALLEL_APPLY + "\n\nclass Rows(")
    result, output = _run(tmp_path, "counted.py", source)
    assert "the script's parallel_apply ran" in output
    assert _peaks(_scenario(result, "dp-loss-forward")) == _peaks(
        _scenario(plain, "dp-loss-forward"))


# PyTorch Geometric's DataParallel: a forward of its own over a list of graphs (objects no
# scatter splits), each GPU's share batched into one; over one GPU it batches them all
GRAPH_PARALLEL = """
import torch
from torch import nn


class Graph:
    def __init__(self, x, y):
        self.x, self.y = x, y


class GraphBatch:  # one GPU's graphs batched, an object as PyG's Batch (no pytree node)
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __getitem__(self, key):
        return getattr(self, key)


def batched(graphs, device):
    return GraphBatch(torch.cat([g.x for g in graphs]).to(device),
                      torch.cat([g.y for g in graphs]).to(device))


class NAME(nn.DataParallel):
    def forward(self, graphs):
        if len(self.device_ids) == 1:
            return self.module(batched(graphs, f"cuda:{self.device_ids[0]}"))
        half = len(graphs) // len(self.device_ids)
        inputs = [(batched(graphs[i * half:(i + 1) * half], f"cuda:{d}"),)
                  for i, d in enumerate(self.device_ids)]
        replicas = self.replicate(self.module, self.device_ids)
        outputs = self.parallel_apply(replicas, inputs, None)
        return self.gather(outputs, self.output_device)
"""

GRAPHS = HEAD + """
HOW


graphs = [Graph(torch.randn(ROWS, 256), torch.randint(0, 1000, (ROWS,))) for _ in range(16)]
model = NAME(Net()).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for chunk in DataLoader(graphs, batch_size=2, collate_fn=lambda b: b):
    loss = model(chunk).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("where", ["script", "library"])
def test_a_forward_of_its_own_over_objects_no_scatter_splits_makes_a_ranks_inputs(
        tmp_path: Path, plain: dict[str, Any], where: str) -> None:
    """A DDP rank is the subclass's forward over its one GPU (PyG's batches the rank's
    graphs there), its module the rank's DDP: before, the rank's model got the list. Where
    the class is a library's of torch's own name (PyG's ``DataParallel``), the DDP change
    rewrites the wrap and says what the model must be given."""
    if where == "script":
        source = GRAPHS.replace("HOW", GRAPH_PARALLEL.replace("NAME", "GraphParallel"))
        source, named = source.replace("NAME(", "GraphParallel("), "GraphParallel"
    else:
        (tmp_path / "graph_lib.py").write_text(GRAPH_PARALLEL.replace("NAME", "DataParallel"))
        source = GRAPHS.replace("HOW", "from graph_lib import DataParallel, Graph")
        source, named = source.replace("NAME(", "DataParallel("), "graph_lib.DataParallel"
    result, _ = _run(tmp_path, "graphs.py", source)
    as_written = _scenario(result, "dp-loss-forward")
    assert _bytes(as_written) == _bytes(_scenario(plain, "dp-loss-forward"))
    # the batch: the graphs of a step (the title said "batch 0"); each GPU's, what the
    # subclass's forward gave it, not known
    assert result["batch"] == 2
    assert [d["batch_rows"] for d in as_written["devices"]] == [0, 0]
    ddp = _scenario(result, "ddp")
    assert _bytes(ddp) == _bytes(_scenario(plain, "ddp"))
    made = f"{named}'s own forward"
    assert f"the model given what {made} gives the rank's GPU alone" in " ".join(
        ddp["notes"]), ddp["notes"]
    (fix,) = [f for f in result["fixes"] if f["name"] == "ddp"]
    if where == "library":
        assert f"graphs.py:{source.splitlines().index('model = DataParallel(Net()).cuda()') + 1}" \
            f": {made} made each GPU's input" in fix["code"], fix["code"]
