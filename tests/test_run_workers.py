"""DataLoader workers under ``dpprof run``: a DataParallel script whose loader has worker
processes runs as on a GPU, as written and in every alternative.

The workers hand each batch to the script through shared memory whose descriptor passes over
a socket in a folder ``multiprocessing`` makes under the temporary folder; every run keeps
its writes in a private overlay (dpprof.script.seal), and were that folder moved there apart
from the worker's socket, the batch would be lost and the script wait for it forever
(pytorch/examples' ImageNet script with ``-j 4`` once hung for 40 minutes so).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAIN = textwrap.dedent("""
    import sys, torch, torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    def main(context):
        ds = TensorDataset(torch.randn(512, 64), torch.randint(0, 10, (512,)))
        loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2,
                            multiprocessing_context=context, **OPTIONS)
        model = nn.DataParallel(nn.Sequential(nn.Linear(64, 512), nn.ReLU(),
                                              nn.Linear(512, 10)).cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        crit = nn.CrossEntropyLoss()
        for epoch in range(2):
            for x, y in loader:
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
                loss = crit(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
            print("epoch", epoch, loss.item())

    if __name__ == "__main__":
        main(sys.argv[1])
""")


@pytest.mark.parametrize("options", [{}, {"persistent_workers": True, "pin_memory": True}])
def test_dataloader_workers_under_data_parallel_do_not_hang(tmp_path: Path,
                                                            options: dict[str, bool]) -> None:
    (tmp_path / "train.py").write_text(TRAIN.replace("**OPTIONS", f"**{options!r}"))
    done = subprocess.run(
        [sys.executable, "-m", "dpprof", "run", "--gpus", "4", "-o", "r.json", "--",
         "python", "train.py", "fork"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    scenarios = {s["name"]: s for s in result["scenarios"]}
    assert list(scenarios) == ["dp-loss-primary", "dp-loss-forward", "ddp"]
    assert all(s["status"] == "ok" for s in scenarios.values()), scenarios
    # the run as written stopped after its steps: every batch it asked for arrived
    assert any("stopped after 3 optimizer step(s)" in n
               for n in scenarios["dp-loss-primary"]["notes"])
    # 64 rows scattered over 4 GPUs; DDP: each rank its 16 (the global batch the same 64),
    # its own copy of the model
    assert scenarios["ddp"]["batch"] == 64
    assert all(d["batch_rows"] == 16 for d in scenarios["ddp"]["devices"])
    params_bytes = 4 * (64 * 512 + 512 + 512 * 10 + 10)
    ddp = scenarios["ddp"]["devices"]
    assert len({d["peak_allocated_bytes"] for d in ddp}) == 1
    assert ddp[0]["breakdown_bytes"]["parameters"] >= params_bytes
