"""Values of functional collectives over meta tensors: what one rank of ranks that all run
the same program reads (an all-reduce's sum is its own value times the group's size), never
the host's own run of the collective over the fake group (whose output held no data: the
read crashed the process, torchtitan's int() of its global token count)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dpprof.script.session import ScriptConfig, parse_command, run_command

FUNCTIONAL = """
    import os
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    tokens = torch.tensor(5, device="cuda")
    total = funcol.wait_tensor(funcol.all_reduce(tokens, "{op}", mesh))
    print("read", int(total))
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 16, device="cuda")).sum().backward()
    opt.step()
"""


@pytest.mark.parametrize(("op", "read"), [("sum", 10), ("max", 5), ("avg", 5)])
def test_a_functional_all_reduce_reads_what_equal_ranks_give(
        op: str, read: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FUNCTIONAL.format(op=op)))
    _, main = run_command(ScriptConfig(
        launch=parse_command(["torchrun", "--nproc-per-node", "2", str(script)], 2), gpus=2,
        ranks="none"), alternatives=False)
    assert main.exit_status == 0, main.script_traceback
    assert [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("read ")] == [f"read {read}"]
