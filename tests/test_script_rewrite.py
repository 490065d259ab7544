"""``dpprof run``'s fixes as rewrites of the script's own lines (dpprof.script.rewrite).

Each case is a script in a style people write; the rewrite must compile, hold the exact
wrapped expression, leave every other line as it was, and its diff must give the new file
when applied to the old one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from typer.testing import CliRunner

from dpprof.cli.app import app
from dpprof.script import autocast_diff, ddp_diff, loss_in_forward_diff, rewrite
from dpprof.script.ddp_diff import OutputDevice
from dpprof.script.rung_diff import RungSites, rung_changes
from dpprof.script.runner import run_script
from dpprof.script.session import ScriptConfig, parse_command
from dpprof.script.strategy_registry import alternative_named

NET = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, d=8, v=4):
        super().__init__()
        self.fc = nn.Linear(d, v)

    def forward(self, x):
        return self.fc(x)


'''


def script(body: str) -> str:
    return NET + textwrap.dedent(body)


def line_of(source: str, text: str, nth: int = 0) -> int:
    """The line number of the ``nth`` line that holds ``text``."""
    hits = [i for i, line in enumerate(source.splitlines(), 1) if text in line]
    assert len(hits) > nth, (text, source)
    return hits[nth]


def apply_diff(old: str, diff: str) -> str:
    """A unified diff (difflib's, any context) applied to ``old``; its lines checked."""
    lines = old.splitlines()
    out: list[str] = []
    pos = 0
    body = diff.splitlines()
    assert body[0].startswith("--- ") and body[1].startswith("+++ "), diff
    for text in body[2:]:
        hunk = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", text)
        if hunk:
            start = int(hunk.group(1)) - (0 if hunk.group(2) == "0" else 1)
            out += lines[pos:start]
            pos = start
        elif text.startswith(("-", " ")):
            assert lines[pos] == text[1:], (pos, lines[pos], text)
            if text.startswith(" "):
                out.append(text[1:])
            pos += 1
        elif text.startswith("+"):
            out.append(text[1:])
        else:
            assert text.startswith("# "), text  # what rewrite_text adds after the diff
    return "\n".join(out + lines[pos:]) + "\n"


def checked(rw: rewrite.Rewrite, old: str) -> str:
    """The new file: it compiles, and the diff gives it."""
    assert rw.ok, rw.reason
    compile(rw.new_source, "train.py", "exec")
    assert apply_diff(old, rw.diff) == rw.new_source
    return rw.new_source


def lif(source: str, dp: str, call: str, loss: str) -> rewrite.Rewrite:
    return loss_in_forward_diff.loss_in_forward(source, "train.py", line_of(source, dp),
                                                line_of(source, call), line_of(source, loss))


def ddp(source: str, dp: str, bucket_view: bool = False) -> rewrite.Rewrite:
    return ddp_diff.ddp(source, "train.py", line_of(source, dp), 4, bucket_view)


LOOP = """\
criterion = nn.CrossEntropyLoss()
for x, y in [(torch.randn(6, 8), torch.randint(0, 4, (6,)))]:
    out = model(x)
    loss = criterion(out, y)
    loss.backward()
"""

WRAPS = [
    # (how the script wraps its model, the wrapped expression after the rewrite)
    ("model = nn.DataParallel(Net())\n",
     "model = nn.DataParallel(dpprof.ModelWithLoss(Net(), criterion))"),
    ("model = nn.DataParallel(Net().cuda())\n",
     "model = nn.DataParallel(dpprof.ModelWithLoss(Net().cuda(), criterion))"),
    ("device = 'cuda'\nmodel = nn.DataParallel(Net(1024, v=32000).to(device))\n",
     "model = nn.DataParallel(dpprof.ModelWithLoss(Net(1024, v=32000).to(device), criterion))"),
    ("model = Net(16, v=3)\nmodel = torch.nn.DataParallel(model, device_ids=[0,1])\n",
     "model = torch.nn.DataParallel(dpprof.ModelWithLoss(model, criterion), device_ids=[0,1])"),
    ("model = Net(1024,\n          v=32000)\nmodel = model.cuda()\nmodel = nn.DataParallel(model)\n",
     "model = nn.DataParallel(dpprof.ModelWithLoss(model, criterion))"),
    ("model = nn.DataParallel(\n    Net(1024,\n        v=32000),\n    device_ids=[0, 1],\n)\n",
     "model = nn.DataParallel(\n    dpprof.ModelWithLoss(Net(1024,\n        v=32000), criterion),\n"
     "    device_ids=[0, 1],\n)"),
    ("from torch.nn import DataParallel\nmodel = Net()\nmodel = DataParallel(model).cuda()\n",
     "model = DataParallel(dpprof.ModelWithLoss(model, criterion)).cuda()"),
]


@pytest.mark.parametrize(("wrap", "wrapped"), WRAPS)
def test_the_wrap_takes_the_loss_inside_forward(wrap: str, wrapped: str) -> None:
    old = script(LOOP.replace("criterion = nn.CrossEntropyLoss()\n",
                              "criterion = nn.CrossEntropyLoss()\n" + wrap))
    rw = lif(old, "DataParallel(", "out = model(x)", "loss = criterion")
    new = checked(rw, old)
    assert wrapped in new
    assert "    loss = dpprof.ModelWithLoss.combine(model(x, y))\n" in new
    assert "out = model(x)" not in new and "import dpprof\n" in new
    # the wrap's lines and the loop's two become the new ones; every other line as written
    old_lines = [line[1:] for line in rw_lines(rw.diff, "-")]
    assert set(old_lines) <= {*wrap.splitlines(), "    out = model(x)", "    loss = criterion(out, y)"}
    assert {"    out = model(x)", "    loss = criterion(out, y)"} <= set(old_lines)
    assert {line[1:] for line in rw_lines(rw.diff, "+")} <= {
        *wrapped.splitlines(), "import dpprof", "    loss = dpprof.ModelWithLoss.combine(model(x, y))"}


def rw_lines(diff: str, sign: str) -> list[str]:
    """The removed ("-") or added ("+") lines of a diff."""
    return [line for line in diff.splitlines()[2:] if line.startswith(sign)]


def test_a_wrap_spanning_lines_is_found_from_any_of_them() -> None:
    wrap = "model = nn.DataParallel(\n    Net(1024,\n        v=32000),\n    device_ids=[0, 1],\n)\n"
    old = script("criterion = nn.CrossEntropyLoss()\n" + wrap + LOOP)
    first = lif(old, "DataParallel(", "out = model(x)", "loss = criterion")
    inner = lif(old, "v=32000", "out = model(x)", "loss = criterion")
    assert first.ok and first.new_source == inner.new_source


@pytest.mark.parametrize(("wrap", "wrapped"), [
    ("model = nn.DataParallel(Net())", "model = DDP(Net().cuda(rank), device_ids=[rank])"),
    ("model = nn.DataParallel(Net().cuda())",
     "model = DDP(Net().cuda(rank), device_ids=[rank])"),
    ("model = nn.DataParallel(Net(1024, v=32000).to(device))",
     "model = DDP(Net(1024, v=32000).cuda(rank), device_ids=[rank])"),
    ("model = torch.nn.DataParallel(model, device_ids=[0,1], output_device=1)",
     "model = DDP(model.cuda(rank), device_ids=[rank])"),
    ("model = nn.DataParallel(model, None, None, 1)",
     "model = DDP(model.cuda(rank), device_ids=[rank], dim=1)"),
    ("model = nn.DataParallel(model).cuda()", "model = DDP(model.cuda(rank), device_ids=[rank])"),
    ("model = nn.DataParallel(Net().to(torch.float64))",
     "model = DDP(Net().to(torch.float64).cuda(rank), device_ids=[rank])"),
])
def test_ddp_in_place_of_the_wrap(wrap: str, wrapped: str) -> None:
    old = script(f"device = 'cuda:0'\nmodel = Net()\n{wrap}\n" + LOOP)
    new = checked(ddp(old, "DataParallel("), old)
    assert f"\n{wrapped}\n" in new
    head = new[: new.index("class Net")]
    assert head.index("import os\n") < head.index("import torch.distributed as dist\n") < \
        head.index("from torch.nn.parallel import DistributedDataParallel as DDP\n") < \
        head.index('dist.init_process_group("nccl")\n') < head.index(
            'rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)\n')
    assert "# torchrun --nproc-per-node 4 train.py\n" in head
    assert "device = 'cuda'\n" in new  # cuda:0 was every rank's device
    view = checked(ddp(old, "DataParallel(", bucket_view=True), old)
    assert f"\n{wrapped[:-1]}, gradient_as_bucket_view=True)\n" in view


def test_ddp_starts_the_process_group_in_the_wraps_function() -> None:
    old = textwrap.dedent('''\
        """Train."""
        import os
        import torch
        from torch import nn
        from torch.utils.data import DataLoader


        def main(rank_hint=None):
            """The entry point."""
            model = nn.Linear(8, 4).cuda()
            model = nn.DataParallel(model)
            loader = DataLoader(list(range(8)), batch_size=8,
                                shuffle=True)
            return model, loader


        if __name__ == "__main__":
            main()
        ''')
    new = checked(ddp(old, "DataParallel("), old)
    assert new.count("import os\n") == 1 and "import torch.distributed as dist\n" in new
    assert ('    """The entry point."""\n    # torchrun --nproc-per-node 4 train.py\n'
            '    dist.init_process_group("nccl")\n'
            '    rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)\n'
            "    model = nn.Linear(8, 4).cuda()\n") in new
    # each rank its share of the loader, as the DDP alternative divided it: the dataset
    # named once for the sampler, which shuffles in the loader's place
    assert ("    dataset = list(range(8))\n"
            "    loader = DataLoader(dataset, batch_size=8 // 4,\n"
            "                        sampler=DistributedSampler(dataset, shuffle=True))\n"
            ) in new
    assert "from torch.utils.data.distributed import DistributedSampler\n" in new


def test_ddp_gives_each_rank_a_share_of_a_loaders_own_sampler() -> None:
    """A DataLoader with a sampler of its own (keyword or by position): its batch_size is
    divided as the DDP alternative divided it at run time, and the sampler is wrapped in the
    helper the diff defines once, after the imports, that gives each rank its share of the
    sampler's indices; a batch sampler of its own is left to the user, and a note says so."""
    old = script("model = nn.DataParallel(Net())\n"
                 "from torch.utils.data import DataLoader, RandomSampler, SequentialSampler\n"
                 "data = list(range(8))\n"
                 "loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data))\n"
                 "ordered = DataLoader(data, 6, False, SequentialSampler(data))\n"
                 "batched = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])\n"
                 "plain = DataLoader(data, 8)\n")
    rw = ddp(old, "DataParallel(")
    new = checked(rw, old)
    assert "loader = DataLoader(data, batch_size=8 // 4, sampler=RankShare(RandomSampler(data)))" \
        in new
    assert "ordered = DataLoader(data, 6 // 4, False, RankShare(SequentialSampler(data)))" in new
    assert new.count("class RankShare:") == 1
    assert new.index("class RankShare:") < new.index("dist.init_process_group")
    at = line_of(old, "sampler=RandomSampler")
    assert any(n.startswith(f"line {at}: each rank takes every 4th index of the DataLoader's "
                            "own sampler (`RankShare`") for n in rw.notes), rw.notes
    at = line_of(old, "batch_sampler=")
    assert any(n.startswith(f"line {at}: give each rank its share of the DataLoader by hand (it "
                            "has a batch sampler of its own)") for n in rw.notes), rw.notes
    # a positional batch_size is divided as a keyword's is
    assert "plain = DataLoader(data, 8 // 4, sampler=DistributedSampler(data, shuffle=False))" \
        in new
    # where the DDP alternative divided the batch sampler's batches as the script ran, a diff
    # that leaves them whole would promise a peak the patched script does not have: no diff
    divided = ddp_diff.ddp(old, "train.py", line_of(old, "DataParallel("), 4,
                           loader_sites=(f"train.py:{at}",))
    assert not divided.ok
    assert divided.reason == (
        f"line {at}: the DDP alternative gave each rank its share of this DataLoader's batches, "
        "which the diff cannot (it has a batch sampler of its own): give each rank 1/4 of each "
        "of its batches by hand")


class _Ranks:
    """torch.distributed's rank and world size as a rank of ``world`` sees them."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world


def sampler_share_helper() -> str:
    """The helper class a DDP diff defines for a loader with a sampler of its own, as the
    diff writes it."""
    import ast

    old = script("from torch.utils.data import DataLoader, RandomSampler\n"
                 "model = nn.DataParallel(Net())\n"
                 "loader = DataLoader([0, 1], batch_size=2, sampler=RandomSampler([0, 1]))\n")
    new = checked(ddp(old, "DataParallel("), old)
    helper = next(n for n in ast.parse(new).body if isinstance(n, ast.ClassDef))
    return ast.get_source_segment(new, helper) or ""


SAMPLERS: dict[str, Any] = {
    "random": lambda rows: RandomSampler(range(rows)),
    "weighted": lambda rows: WeightedRandomSampler([1.0] * rows, rows),
    "subset": lambda rows: SubsetRandomSampler(list(range(0, 2 * rows, 2))),
    "sequential": lambda rows: SequentialSampler(range(rows))}


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 23), world=st.integers(1, 5), kind=st.sampled_from(sorted(SAMPLERS)),
       seeds=st.lists(st.integers(0, 2**31), min_size=6, max_size=6))
def test_the_sampler_share_helper_splits_as_distributed_sampler_does(
        rows: int, world: int, kind: str, seeds: list[int]) -> None:
    """The helper the diff defines, run as each rank of ``world`` whose torch generator is
    seeded differently, for two epochs: every rank's share is as long as ``len()`` says, all
    of one length, and together, woven, they are the order the sampler draws for that epoch
    (the same on every rank) padded from its start to a multiple of the ranks, as
    DistributedSampler splits a dataset."""
    import torch

    code = compile(sampler_share_helper(), "helper", "exec")

    def shares(rank: int, world: int, seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        space: dict[str, Any] = {"torch": torch, "dist": _Ranks(rank, world)}
        exec(code, space)
        share = space["RankShare"](SAMPLERS[kind](rows))
        epochs = [list(share), list(share)]
        assert [len(e) for e in epochs] == [len(share)] * 2
        return epochs

    ranks = [shares(rank, world, seeds[rank]) for rank in range(world)]
    for epoch in range(2):
        order = shares(0, 1, seeds[-1])[epoch]  # the order one rank alone draws
        per_rank = {len(r[epoch]) for r in ranks}
        assert per_rank == {-(-rows // world)}
        woven = [r[epoch][i] for i in range(per_rank.pop()) for r in ranks]
        assert woven == (order * world)[:len(woven)]


def loader_ddp(source: str, sites: list[tuple[str, str]]) -> rewrite.Rewrite:
    """:func:`ddp` of ``source`` (as ``train.py``) told that the DDP alternative divided the
    DataLoaders made by the calls on the lines holding each ``(file, text)`` of ``sites``."""
    return ddp_diff.ddp(source, "train.py", line_of(source, "DataParallel("), 4,
                        loader_sites=tuple(f"{f}:{line_of(source, t)}" for f, t in sites))


def test_ddp_divides_the_batch_size_of_the_call_that_made_a_loader_through_a_library() -> None:
    """A DataLoader the script made through a library's factory (no ``DataLoader(...)`` in
    the script): the factory call's ``batch_size`` keyword is divided where the alternative
    divided the loader it made, the call picked among those on its line (the one given a
    batch_size), and a comment and a note say the sampler is the library's own option,
    not that the script has no DataLoader."""
    old = script("model = nn.DataParallel(Net())\n"
                 "from loaders import build, make_loader\n"
                 "data = list(range(8))\n"
                 "train = make_loader(build(data), shuffle=True,\n"
                 "                    batch_size=8)\n"
                 "evaluate = make_loader(data, batch_size=len(data) + 1)\n")
    rw = loader_ddp(old, [("train.py", "train = make_loader"),
                          ("train.py", "evaluate = make_loader")])
    new = checked(rw, old)
    assert ("# DDP: make_loader makes the DataLoader: turn on its own distributed option (each "
            "rank its own shard of the data)\n"
            "train = make_loader(build(data), shuffle=True,\n"
            "                    batch_size=8 // 4)\n") in new
    assert "evaluate = make_loader(data, batch_size=(len(data) + 1) // 4)\n" in new
    assert "DistributedSampler" not in new  # nothing to pass it to
    assert [n.split(":")[0] for n in rw.notes] == [
        f"line {line_of(old, 'train = make_loader')}",
        f"line {line_of(old, 'evaluate = make_loader')}"], rw.notes
    assert all("library's own distributed option" in n for n in rw.notes), rw.notes
    assert not any("without a DataLoader" in n for n in rw.notes), rw.notes
    # told nothing of the loaders (a run that divided none), the diff says what it said
    told_nothing = ddp(old, "DataParallel(")
    assert "batch_size=8 // 4" not in told_nothing.new_source
    assert any("without a DataLoader" in n for n in told_nothing.notes)


@pytest.mark.parametrize(("call", "why"), [
    ("loader = make_loader(data, 8)\n", "is not a `batch_size` keyword"),
    ("loader = make_loader(data, **options)\n", "is not a `batch_size` keyword"),
])
def test_ddp_gives_no_diff_where_it_cannot_divide_a_library_loaders_batch(
        call: str, why: str) -> None:
    """Where the call that made a divided DataLoader gives its batch size otherwise than by
    keyword, no diff promises the alternative's per-rank peak: the reason says what to
    change by hand."""
    old = script("model = nn.DataParallel(Net())\n"
                 "from loaders import make_loader\n"
                 "data, options = list(range(8)), {'batch_size': 8}\n" + call)
    rw = loader_ddp(old, [("train.py", "loader = make_loader")])
    assert not rw.ok
    assert rw.reason.startswith(f"line {line_of(old, 'loader = ')}: `make_loader(...)` makes "
                                "the DataLoader"), rw.reason
    assert why in rw.reason and "batch_size // 4 by hand" in rw.reason


def test_ddp_gives_no_diff_where_the_file_wraps_ddp_itself_beside_the_data_parallel() -> None:
    """KAIR's model_to_device: ``DistributedDataParallel(...)`` if its option asks, else
    ``DataParallel(...)``, the process group started by the script in another file. The
    change is not a DDP wrap written into the DataParallel branch beside the code's own: it
    is running that path, which the reason says."""
    old = script("""
        from torch.nn.parallel import DataParallel, DistributedDataParallel


        def model_to_device(network, opt):
            network = network.to("cuda")
            if opt["dist"]:
                network = DistributedDataParallel(network, device_ids=[torch.cuda.current_device()])
            else:
                network = DataParallel(network)
            return network
        """)
    rw = ddp_diff.ddp(old, "/work/models/model_base.py", line_of(old, "DataParallel(network)"),
                      2)
    assert not rw.ok
    assert rw.reason.startswith(
        f"model_base.py wraps DistributedDataParallel itself (line "
        f"{line_of(old, 'DistributedDataParallel(network')}) beside this DataParallel: the "
        "code has a DDP path of its own"), rw.reason
    assert "`torchrun --nproc-per-node 2`" in rw.reason


def test_ddp_gives_no_diff_where_the_loader_is_made_in_another_file() -> None:
    """The diff edits the file that makes the DataParallel, which may not be the script the
    user ran (KAIR wraps its model in models/model_base.py, its main_train_psnr.py makes the
    loader): the reason names both files."""
    old = script("model = nn.DataParallel(Net())\n"
                 "from loaders import loader\n")
    rw = ddp_diff.ddp(old, "/work/models/model_base.py", line_of(old, "DataParallel("), 4,
                      loader_sites=("/elsewhere/loaders.py:12",))
    assert not rw.ok
    assert rw.reason == ("the DataLoader made at loaders.py:12 (a file other than "
                         "model_base.py, where the DataParallel is made) is divided by the DDP "
                         "alternative: give its batch_size // 4 there by hand"), rw.reason


def test_ddp_divides_a_literal_loader_once_when_the_run_saw_it() -> None:
    """A ``DataLoader(...)`` in the script, which the run recorded as the loader's site
    too: divided once, with its sampler, as without the site."""
    old = script("model = nn.DataParallel(Net())\n"
                 "from torch.utils.data import DataLoader\n"
                 "data = list(range(8))\n"
                 "loader = DataLoader(data, batch_size=8)\n")
    new = checked(loader_ddp(old, [("train.py", "loader = DataLoader")]), old)
    assert new == checked(ddp(old, "DataParallel("), old)
    assert "DataLoader(data, batch_size=8 // 4, sampler=DistributedSampler(data, " in new


def test_a_rung_on_ddp_divides_a_library_loaders_batch_where_its_edits_moved_it(
        tmp_path: Path) -> None:
    """A bf16 rung on a DataParallel script's DDP alternative: the autocast edit moves the
    loader factory's line down, and the DDP edit still divides that call's batch_size."""
    old = script("def train(model, loader):\n"
                 "    for x, y in loader:\n"
                 "        out = model(x)\n"
                 "        loss = out.sum()\n"
                 "        loss.backward()\n"
                 "\n"
                 "\n"
                 "from loaders import make_loader\n"
                 "model = nn.DataParallel(Net())\n"
                 "loader = make_loader(list(range(8)), batch_size=8)\n"
                 "train(model, loader)\n")
    path = tmp_path / "train.py"
    path.write_text(old)
    at = line_of(old, "loader = make_loader")
    rw = rung_changes(RungSites(str(path), line_of(old, "out = model(x)"),
                                line_of(old, "loss.backward()"), line_of(old, "DataParallel("),
                                loader_sites=(f"{path}:{at}",)),
                      4, "Bf16 autocast", "bfloat16", None)
    new = checked(rw, old)
    assert "loader = make_loader(list(range(8)), batch_size=8 // 4)\n" in new
    assert 'with torch.autocast("cuda", dtype=torch.bfloat16)' in new
    assert any("library's own distributed option" in n for n in rw.notes), rw.notes


def test_a_rung_on_ddp_keeps_dataparallels_dim_and_output_device(tmp_path: Path) -> None:
    """A bf16 rung on the DDP alternative of ``DataParallel(net, dim=1, output_device=2)``
    whose batch is made by hand, its rows along dimension 1: the autocast edit moves the
    lines down, and the DDP edit still divides the rows DataParallel split (dimension 1, not
    0) and puts the targets the script put on cuda:2 on each rank's own GPU, as the DDP
    alternative ran it."""
    old = script("model = nn.DataParallel(Net(), dim=1, output_device=2)\n"
                 "for step in range(4):\n"
                 "    x = torch.randn(3, 96, 8).cuda()\n"
                 "    y = torch.randn(3, 96, 4).cuda(2)\n"
                 "    out = model(x)\n"
                 "    loss = (out - y).pow(2).mean()\n"
                 "    loss.backward()\n")
    path = tmp_path / "train.py"
    path.write_text(old)
    x_line, y_line = line_of(old, "x = torch.randn"), line_of(old, "y = torch.randn")
    rw = rung_changes(RungSites(str(path), line_of(old, "out = model(x)"),
                                line_of(old, "loss.backward()"), line_of(old, "DataParallel("),
                                batch_lines=(x_line, y_line), rows=96, dim=1,
                                output_device=OutputDevice(2, (f"{path}:{y_line}",))),
                      4, "Bf16 autocast", "bfloat16", None)
    new = checked(rw, old)
    assert 'with torch.autocast("cuda", dtype=torch.bfloat16)' in new
    assert "DDP(Net().cuda(rank), device_ids=[rank], dim=1)" in new
    assert "x = torch.randn(3, 96 // 4, 8).cuda()\n" in new
    assert "y = torch.randn(3, 96 // 4, 4).cuda()\n" in new
    assert any("puts tensors on cuda:2, DataParallel's output_device" in n
               for n in rw.notes), rw.notes


@pytest.mark.parametrize(("written", "rewritten"), [
    ("y = t.cuda(1)", "y = t.cuda()"),
    ("y = t.cuda(1, non_blocking=True)", "y = t.cuda(non_blocking=True)"),
    ("y = t.cuda(non_blocking=True, device=1)", "y = t.cuda(non_blocking=True)"),
    ("y = t.to(1)", 'y = t.to("cuda")'),
    ('y = t.to("cuda:1")', 'y = t.to("cuda")'),
    ('y = t.to(torch.device("cuda", 1))', 'y = t.to(torch.device("cuda"))'),
    ("y = t.cuda(2)", "y = t.cuda(2)"),  # another GPU than the output device: as written
])
def test_ddp_makes_dataparallels_output_device_each_ranks_own(written: str,
                                                              rewritten: str) -> None:
    old = script(f"model = nn.DataParallel(Net(), output_device=1)\nt = torch.randn(6, 8)\n"
                 f"{written}\n")
    site = f"train.py:{line_of(old, written)}"
    rw = ddp_diff.ddp(old, "train.py", line_of(old, "DataParallel("), 4,
                      output_device=ddp_diff.OutputDevice(1, (site,)))
    new = checked(rw, old)
    assert f"\n{rewritten}\n" in new
    assert "DDP(Net().cuda(rank), device_ids=[rank])" in new
    changed = written != rewritten
    assert any("puts tensors on cuda:1" in n for n in rw.notes) == changed, rw.notes
    assert any("by hand (torch.device" in n for n in rw.notes) != changed, rw.notes


def test_ddp_takes_another_name_where_the_script_has_a_rank() -> None:
    old = script("rank = 0\nmodel = nn.DataParallel(Net())\n")
    new = checked(ddp(old, "DataParallel("), old)
    assert "local_rank = int(os.environ[\"LOCAL_RANK\"]); torch.cuda.set_device(local_rank)" in new
    assert "DDP(Net().cuda(local_rank), device_ids=[local_rank])" in new
    assert any("DataLoader" in n for n in ddp(old, "DataParallel(").notes)


def test_ddp_name_taken_is_a_reason_not_bad_code() -> None:
    old = script("DDP = 3\nmodel = nn.DataParallel(Net())\n")
    rw = ddp(old, "DataParallel(")
    assert not rw.ok and rw.new_source == "" and "`DDP`" in rw.reason


def test_the_loss_nested_on_the_models_call_and_inside_an_expression() -> None:
    old = script("model = nn.DataParallel(Net())\ncriterion = nn.CrossEntropyLoss()\n"
                 "x, y, accum = torch.randn(6, 8), torch.randint(0, 4, (6,)), 2\n"
                 "loss = criterion(model(x), y) / accum + 0.0\n")
    new = checked(lif(old, "DataParallel(", "loss = criterion", "loss = criterion"), old)
    assert "loss = dpprof.ModelWithLoss.combine(model(x, y)) / accum + 0.0\n" in new


def test_a_functional_loss_is_the_loss_function_itself() -> None:
    old = script("model = nn.DataParallel(Net())\nx, y = torch.randn(6, 8), torch.tensor([1])\n"
                 "out = model(x)\nloss = F.cross_entropy(out, y)\n"
                 "loss2 = F.cross_entropy(model(x), target=y, label_smoothing=0.1)\n")
    new = checked(lif(old, "DataParallel(", "out = model(x)", "loss = F."), old)
    assert "nn.DataParallel(dpprof.ModelWithLoss(Net(), F.cross_entropy))" in new
    smooth = checked(lif(old, "DataParallel(", "loss2", "loss2"), old)
    assert ("nn.DataParallel(dpprof.ModelWithLoss(Net(), lambda outputs, targets: "
            "F.cross_entropy(outputs, targets, label_smoothing=0.1)))") in smooth
    assert "loss2 = dpprof.ModelWithLoss.combine(model(x, y))\n" in smooth


def test_several_model_inputs_go_as_one_tuple() -> None:
    old = script("model = nn.DataParallel(Net())\ncriterion = nn.MSELoss()\n"
                 "out = model(a, mask)\nloss = criterion(out, b)\n")
    new = checked(lif(old, "DataParallel(", "out = model", "loss ="), old)
    assert "loss = dpprof.ModelWithLoss.combine(model((a, mask), b))\n" in new


def test_the_loss_defined_after_the_wrap_moves_before_it() -> None:
    old = script("""\
        model = Net()
        if torch.cuda.device_count() > 1:
            model = nn.DataParallel(model)
        weights = torch.ones(4)
        criterion = nn.CrossEntropyLoss(
            label_smoothing=0.1)
        for x, y in []:
            outputs = model(x)
            loss = criterion(outputs, y)
            _, predicted = torch.max(outputs, 1)
        """)
    rw = lif(old, "DataParallel(", "outputs = model", "loss = criterion")
    new = checked(rw, old)
    # the wrap conditional: ModelWithLoss before the condition, the wrap as written
    assert ("model = Net()\ncriterion = nn.CrossEntropyLoss(\n    label_smoothing=0.1)\n"
            "model = dpprof.ModelWithLoss(model, criterion, keep_outputs=True)\n"
            "if torch.cuda.device_count() > 1:\n    model = nn.DataParallel(model)\n") in new
    assert new.count("criterion = nn.CrossEntropyLoss(") == 1
    # the outputs used besides the loss: kept, gathered beside the loss; said in the notes
    used = line_of(old, "torch.max(outputs")
    assert "dpprof.ModelWithLoss(model, criterion, keep_outputs=True)" in new
    assert "    outputs, loss = dpprof.ModelWithLoss.split(model(x, y))\n" in new
    assert "    outputs = model(x)\n" not in new
    assert any(n.startswith(f"line {used} also uses outputs") for n in rw.notes)
    assert any("conditional" in n for n in rw.notes)
    # a loss made of what is set after the wrap moves with it, that first
    weighted = old.replace("label_smoothing=0.1", "weight=weights")
    both = lif(weighted, "DataParallel(", "outputs = model", "loss = criterion")
    new = checked(both, weighted)
    assert ("model = Net()\nweights = torch.ones(4)\ncriterion = nn.CrossEntropyLoss(\n"
            "    weight=weights)\nmodel = dpprof.ModelWithLoss(model, criterion, "
            "keep_outputs=True)\nif torch.cuda.device_count() > 1:\n") in new
    assert any(n.startswith(f"`weights` (line {line_of(weighted, 'weights = ')}) and "
                            f"`criterion` (line {line_of(weighted, 'criterion = ')}) move "
                            "before the wrap") for n in both.notes), both.notes
    # what it is made of set twice after the wrap cannot move: a reason, no code
    bad = lif(weighted.replace("weights = torch.ones(4)\n",
                               "weights = torch.ones(4)\nweights = weights * 2\n"),
              "DataParallel(", "outputs = model", "loss = criterion")
    assert not bad.ok and bad.new_source == "" and "weights" in bad.reason


def test_a_wrap_under_a_condition_is_noted() -> None:
    old = script("model = nn.DataParallel(Net()) if torch.cuda.device_count() > 1 else Net()\n"
                 + LOOP)
    rw = lif(old, "DataParallel(", "out = model", "loss = criterion")
    new = checked(rw, old)
    assert "model = nn.DataParallel(dpprof.ModelWithLoss(Net(), criterion)) if" in new
    assert any("conditional" in n for n in rw.notes)
    assert "# also: the wrap (line" in rewrite.rewrite_text(rw)


def test_the_models_call_alone_in_its_block_leaves_pass() -> None:
    old = script("model = nn.DataParallel(Net())\ncriterion = nn.MSELoss()\n"
                 "if True:\n    out = model(a)\nloss = criterion(out, b)\n")
    new = checked(lif(old, "DataParallel(", "out = model", "loss ="), old)
    assert "if True:\n    pass\nloss = dpprof.ModelWithLoss.combine(model(a, b))\n" in new


def test_a_method_wrap_and_its_loss_attribute() -> None:
    old = script("""\
        class Trainer:
            def __init__(self):
                self.model = nn.DataParallel(Net(8, v=4).cuda())
                self.criterion = nn.CrossEntropyLoss()

            def step(self, x, y):
                logits = self.model(x)
                return self.criterion(logits, y)
        """)
    rw = lif(old, "DataParallel(", "logits =", "return self.criterion")
    new = checked(rw, old)
    assert ("        self.criterion = nn.CrossEntropyLoss()\n        self.model = nn.DataParallel("
            "dpprof.ModelWithLoss(Net(8, v=4).cuda(), self.criterion))\n") in new
    assert "        return dpprof.ModelWithLoss.combine(self.model(x, y))\n" in new
    assert any("different functions" in n for n in rw.notes)


@pytest.mark.parametrize(("loss", "why"), [
    ("loss = criterion(out.view(-1, 4), y)", "no loss call whose first argument"),
    ("loss = get_loss()(out, y)", "not a name"),
    ("loss = criterion(out, y, reduction=mode)", "not constants"),
])
def test_what_cannot_move_into_forward_is_a_reason(loss: str, why: str) -> None:
    old = script(f"model = nn.DataParallel(Net())\ncriterion = nn.MSELoss()\nout = model(x)\n"
                 f"{loss}\n")
    rw = lif(old, "DataParallel(", "out = model", "loss =")
    assert not rw.ok and rw.diff == "" and why in rw.reason
    assert rewrite.rewrite_text(rw).startswith("# no rewrite of the script's lines: ")


def test_the_model_call_with_keywords_is_a_reason() -> None:
    old = script("model = nn.DataParallel(Net())\ncriterion = nn.MSELoss()\n"
                 "out = model(x, mask=m)\nloss = criterion(out, y)\n")
    assert "keyword" in lif(old, "DataParallel(", "out = model", "loss =").reason


def test_sites_dpprof_did_not_see_are_a_reason() -> None:
    assert not loss_in_forward_diff.loss_in_forward_at("?", "t.py:3", "t.py:4").ok
    assert "different files" in loss_in_forward_diff.loss_in_forward_at(
        "a.py:1", "b.py:2", "a.py:3").reason
    assert "cannot read" in ddp_diff.ddp_at("/nonexistent/t.py:3", 4).reason


def test_the_rewritten_script_runs_and_gives_the_same_loss(tmp_path: Path) -> None:
    """On a machine without GPUs DataParallel calls its module directly: the rewritten
    script runs for real, and its loss is the one the script computed."""
    old = script("""\
        torch.manual_seed(0)
        device = "cpu"
        model = nn.DataParallel(Net(8, v=4).to(device))
        criterion = nn.CrossEntropyLoss()
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        out = model(x)
        loss = criterion(out, y)
        print(f"{loss.item():.6f}")
        """)
    new = checked(lif(old, "DataParallel(", "out = model", "loss = criterion"), old)
    root = Path(__file__).resolve().parents[1]
    losses = []
    for name, text in (("old.py", old), ("new.py", new)):
        (tmp_path / name).write_text(text)
        done = subprocess.run([sys.executable, str(tmp_path / name)], capture_output=True,
                              text=True, cwd=root, check=True, env={"CUDA_VISIBLE_DEVICES": ""})
        losses.append(done.stdout.strip())
    assert losses[0] == losses[1] and losses[0]


ARGS_SCRIPT = '''\
"""DataParallel over a model built with positional and keyword arguments."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, d_in, hidden, *, classes=10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x):
        return self.body(x)


device = torch.device("cuda:0")
model = nn.DataParallel(Net(32, 64,
                            classes=100).to(device), device_ids=[0, 1, 2, 3])
data = TensorDataset(torch.randn(256, 32), torch.randint(0, 100, (256,)))
loader = DataLoader(data, batch_size=64, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for inputs, labels in loader:
    inputs, labels = inputs.to(device), labels.to(device)
    optimizer.zero_grad()
    loss = criterion(model(inputs), labels)
    loss.backward()
    optimizer.step()
'''


def test_dpprof_run_gives_fixes_that_compile_when_applied(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "train_args.py"
    path.write_text(ARGS_SCRIPT)
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["run", "-q", "-o", str(out), "--", "python", str(path)])
    assert r.exit_code == 0, r.output
    fixes = {f["name"]: f["code"] for f in json.loads(out.read_text())["fixes"]}
    assert set(fixes) == {"loss-in-forward", "ddp", "gradient-as-bucket-view"}
    new = apply_diff(ARGS_SCRIPT, fixes["loss-in-forward"])
    compile(new, str(path), "exec")
    assert ("criterion = nn.CrossEntropyLoss()\nmodel = nn.DataParallel(dpprof.ModelWithLoss("
            "Net(32, 64,\n                            classes=100).to(device), criterion), "
            "device_ids=[0, 1, 2, 3])\n") in new
    assert "    loss = dpprof.ModelWithLoss.combine(model(inputs, labels))\n" in new
    new = apply_diff(ARGS_SCRIPT, fixes["ddp"])
    compile(new, str(path), "exec")
    assert "model = DDP(Net(32, 64,\n                            classes=100).cuda(rank), " \
        "device_ids=[rank])\n" in new
    assert 'device = torch.device("cuda")\n' in new
    new = apply_diff(ARGS_SCRIPT, fixes["gradient-as-bucket-view"])
    compile(new, str(path), "exec")
    assert "device_ids=[rank], gradient_as_bucket_view=True)\n" in new


# ---- mixed precision -----------------------------------------------------------------------


def amp(source: str, call: str, loss: str, dtype: str = "bfloat16") -> rewrite.Rewrite:
    return autocast_diff.autocast(source, "train.py", line_of(source, call),
                                  line_of(source, loss), dtype)


TRAIN = """\
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for x, y in [(torch.randn(6, 8), torch.randint(0, 4, (6,)))]:
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
"""


def test_autocast_around_a_forward_and_loss_on_one_line() -> None:
    old = script(TRAIN)
    rw = amp(old, "loss = criterion", "loss = criterion")
    checked(rw, old)
    at = line_of(old, "criterion = nn.CrossEntropyLoss()")
    assert rw.diff == "\n".join([
        "--- train.py (as written)",
        "+++ train.py (mixed precision (bf16 autocast))",
        f"@@ -{at},6 +{at},7 @@",
        " criterion = nn.CrossEntropyLoss()",
        " for x, y in [(torch.randn(6, 8), torch.randint(0, 4, (6,)))]:",
        "     optimizer.zero_grad()",
        "-    loss = criterion(model(x), y)",
        '+    with torch.autocast("cuda", dtype=torch.bfloat16):',
        "+        loss = criterion(model(x), y)",
        "     loss.backward()",
        "     optimizer.step()"])
    assert rw.notes == ()


def test_autocast_takes_the_lines_between_forward_and_loss_with_their_comments() -> None:
    old = script("""\
        model = Net()
        criterion = nn.CrossEntropyLoss()
        for x, y in []:
            out = model(x)

            # flatten the logits
            out = out.view(-1, 4)
            loss = criterion(out, y)  # mean over the batch
            loss.backward()
        """)
    new = checked(amp(old, "out = model(x)", "loss = criterion"), old)
    assert new == old.replace(
        "    out = model(x)\n\n    # flatten the logits\n    out = out.view(-1, 4)\n"
        "    loss = criterion(out, y)  # mean over the batch\n",
        '    with torch.autocast("cuda", dtype=torch.bfloat16):\n        out = model(x)\n\n'
        "        # flatten the logits\n        out = out.view(-1, 4)\n"
        "        loss = criterion(out, y)  # mean over the batch\n")


def test_autocast_in_a_functions_loop_and_a_loss_over_several_lines() -> None:
    old = script('''\
        def train(model, loader, criterion):
            for x, y in loader:
                logits = model(x)
                note = """a text
        that keeps its lines"""
                loss = criterion(
                    logits,  # the outputs
                    y,
                )
            return loss, note
        ''')
    new = checked(amp(old, "logits = model(x)", "loss = criterion("), old)
    assert new == old.replace(
        '        logits = model(x)\n        note = """a text\nthat keeps its lines"""\n'
        "        loss = criterion(\n            logits,  # the outputs\n            y,\n"
        "        )\n",
        '        with torch.autocast("cuda", dtype=torch.bfloat16):\n'
        '            logits = model(x)\n            note = """a text\nthat keeps its lines"""\n'
        "            loss = criterion(\n                logits,  # the outputs\n"
        "                y,\n            )\n")
    # the loss is found from any of its lines (dpprof records the line the call runs at)
    assert amp(old, "logits = model(x)", "y,").new_source == new


def test_autocast_indents_as_the_block_does() -> None:
    old = script("for x, y in loader:\n\tloss = criterion(model(x),\n\t\t\t\t\t y)\n")
    new = checked(amp(old, "loss =", "loss ="), old)
    assert new.endswith('for x, y in loader:\n\twith torch.autocast("cuda", dtype=torch.bfloat16):'
                        "\n\t\tloss = criterion(model(x),\n\t\t\t\t\t\t y)\n")


def test_autocast_adds_import_torch_where_the_script_lacks_it() -> None:
    old = textwrap.dedent("""\
        import torch.nn as nn

        model = nn.Linear(8, 4)
        criterion = nn.MSELoss()


        def step(x, y):
            return criterion(model(x), y)
        """)
    new = checked(amp(old, "return criterion", "return criterion"), old)
    assert new == old.replace("import torch.nn as nn\n", "import torch.nn as nn\nimport torch\n"
                              ).replace("    return criterion(model(x), y)\n",
                                        '    with torch.autocast("cuda", dtype=torch.bfloat16):\n'
                                        "        return criterion(model(x), y)\n")


NANOGPT = """\
from contextlib import nullcontext
device_type = 'cuda'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}['bfloat16']
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
model = Net()
for micro_step in range(4):
    with ctx:
        logits, loss = model(X, Y)
        loss = loss / 4
    loss.backward()
"""


@pytest.mark.parametrize(("old", "call", "loss", "why"), [
    (script(NANOGPT), "logits, loss = model", "logits, loss = model",
     "the script already runs its forward under autocast (`ctx`, line "),
    (script(TRAIN.replace("    loss = criterion(model(x), y)\n",
                          "    with torch.cuda.amp.autocast():\n"
                          "        loss = criterion(model(x), y)\n")),
     "loss = criterion", "loss = criterion",
     "the script already runs its forward under autocast (`torch.cuda.amp.autocast()`, line "),
    (script("""\
        for x, y in loader:
            out = model(x)
            if y is not None:
                loss = criterion(out, y)
        """), "out = model", "loss = criterion",
     "the model's call (line {call}) and the loss (line {loss}) are in different blocks, so "
     "one `with torch.autocast(...)` cannot hold both: put each under one by hand"),
    (script("loss = criterion(out, y)\nout = model(x)\n"), "out = model", "loss = criterion",
     "the loss (line {loss}) comes before the model's call (line {call})"),
    (script("for x in loader:\n    out = model(x)\n    criterion(out, y).backward()\n"),
     "out = model", "criterion(out", "line {loss}: the backward is among the statements"),
    (script("for x in loader: loss = criterion(model(x), y)\n"), "loss =", "loss =",
     "line {loss} holds another statement beside the forward or the loss"),
    (script("for out in model(x):\n    loss = criterion(out, y)\n"), "for out", "loss =",
     "line {call}: the model's call is in the header of a `for` statement"),
])
def test_what_cannot_go_under_autocast_is_a_reason(old: str, call: str, loss: str, why: str
                                                    ) -> None:
    rw = amp(old, call, loss)
    assert not rw.ok and rw.new_source == ""
    assert rw.reason.startswith(why.format(call=line_of(old, call), loss=line_of(old, loss)))


FP16 = """\
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    for x, y in [(torch.randn(6, 8), torch.randint(0, 4, (6,)))]:
        optimizer.zero_grad()
        out = model(x)
        loss = criterion(out, y)
        loss.backward()
        optimizer.step()
    scheduler.step()
"""


def test_float16_takes_the_grad_scaler_as_torchs_recipe_has_it() -> None:
    old = script(FP16)
    rw = amp(old, "out = model", "loss = criterion", "float16")
    checked(rw, old)
    at = line_of(old, "optimizer = torch.optim.AdamW")
    assert rw.diff == "\n".join([
        "--- train.py (as written)",
        "+++ train.py (mixed precision (fp16 autocast and GradScaler))",
        f"@@ -{at},11 +{at},14 @@",
        " optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)",
        " scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)",
        " criterion = nn.CrossEntropyLoss()",
        # before the epochs: one scaler for the whole training
        '+scaler = torch.amp.GradScaler("cuda")',
        " for epoch in range(2):",
        "     for x, y in [(torch.randn(6, 8), torch.randint(0, 4, (6,)))]:",
        "         optimizer.zero_grad()",
        "-        out = model(x)",
        "-        loss = criterion(out, y)",
        "-        loss.backward()",
        "-        optimizer.step()",
        '+        with torch.autocast("cuda", dtype=torch.float16):',
        "+            out = model(x)",
        "+            loss = criterion(out, y)",
        "+        scaler.scale(loss).backward()",
        "+        scaler.step(optimizer)",
        "+        scaler.update()",
        "     scheduler.step()"])


def test_float16_with_accumulation_clipping_and_a_taken_name() -> None:
    old = script("""\
        scaler = 2.0
        model = Net()
        opt = make_optimizer(model)
        for it in range(10):
            for micro in range(accum):
                loss = criterion(model(x), y)
                (loss / accum).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        """)
    new = checked(amp(old, "loss = criterion", "loss = criterion", "float16"), old)
    # no torch.optim constructor in sight: the step of a name that says optimizer
    assert new == old.replace("for it in range(10):\n",
                              'grad_scaler = torch.amp.GradScaler("cuda")\n'
                              "for it in range(10):\n").replace(
        "        loss = criterion(model(x), y)\n        (loss / accum).backward()\n"
        "    nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    opt.step()\n",
        '        with torch.autocast("cuda", dtype=torch.float16):\n'
        "            loss = criterion(model(x), y)\n"
        "        grad_scaler.scale(loss / accum).backward()\n"
        "    grad_scaler.unscale_(opt)  # clip the true gradients\n"
        "    nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
        "    grad_scaler.step(opt)\n    grad_scaler.update()\n")


@pytest.mark.parametrize("make", ["torch.optim.SGD(model.parameters(), lr=lr)",
                                  "make_optimizer(model, lr)"])
def test_the_scaler_goes_inside_a_loop_that_makes_the_optimizer(make: str) -> None:
    old = script(f"""\
        for lr in (0.1, 0.01):
            optimizer = {make}
            for epoch in range(2):
                for x, y in loader:
                    loss = criterion(model(x), y)
                    loss.backward()
                    optimizer.step()
        """)
    new = checked(amp(old, "loss = criterion", "loss = criterion", "float16"), old)
    assert (f'    optimizer = {make}\n'
            '    scaler = torch.amp.GradScaler("cuda")\n    for epoch in range(2):\n') in new


@pytest.mark.parametrize(("body", "why"), [
    # the scheduler's step is no optimizer's, though the loop steps nothing else
    (FP16.replace("        optimizer.step()\n", ""),
     "no optimizer step (`optimizer.step()`) after the backward (line {backward}) in the loop"),
    (FP16.replace("loss.backward()", "out.sum().backward()"),
     "no `loss.backward()` after the loss (line {loss}) in its loop"),
    (FP16.replace("        loss = criterion(out, y)\n        loss.backward()\n",
                  "        losses.append(criterion(out, y))\n"),
     "the loss (line {loss}) is not assigned to a name"),
    (FP16.replace("for epoch in range(2):\n", "scaler = torch.amp.GradScaler()\n"
                  "for epoch in range(2):\n"), "the script already makes a GradScaler (line "),
    (FP16.replace("        optimizer.step()\n", "        if True: optimizer.step()\n"),
     "line {step}: the optimizer's step is not a statement of its own line"),
    # a GAN's second optimizer would step on gradients the scaler scaled
    (FP16.replace("criterion = nn", "d_opt = torch.optim.SGD(model.parameters())\ncriterion = nn"
                  ).replace("        optimizer.step()\n",
                            "        optimizer.step()\n        d_opt.step()\n"),
     "the loop steps more than one optimizer (lines {step}, {d_step}): scale each backward"),
])
def test_float16_without_its_pieces_is_a_reason_not_half_a_change(body: str, why: str) -> None:
    old = script(body)
    rw = amp(old, "out = model", "criterion(out, y)", "float16")
    assert not rw.ok and rw.new_source == ""
    lines = {"loss": line_of(old, "criterion(out, y)")}
    if "backward()" in old:
        lines["backward"] = line_of(old, "backward()")
    if "optimizer.step()" in old:
        lines["step"] = line_of(old, "optimizer.step()")
    if "d_opt.step()" in old:
        lines["d_step"] = line_of(old, "d_opt.step()")
    assert rw.reason.startswith(why.format(**lines)), rw.reason
    # the same script in bfloat16 needs none of them
    assert amp(old, "out = model", "criterion(out, y)").ok


def test_a_forward_outside_any_loop_in_float16_is_a_reason() -> None:
    old = script("def step(x, y):\n    loss = criterion(model(x), y)\n    loss.backward()\n")
    rw = amp(old, "loss =", "loss =", "float16")
    assert rw.reason.startswith(f"the forward (line {line_of(old, 'loss =')}) is in no loop")


def test_autocast_at_sites_and_a_dtype_it_does_not_know(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(script(TRAIN))
    site = f"{path}:{line_of(script(TRAIN), 'loss = criterion')}"
    assert autocast_diff.autocast_at(site, site, "bfloat16").new_source == \
        amp(script(TRAIN), "loss = criterion", "loss = criterion").new_source
    assert autocast_diff.autocast_at(site, site, "float8").reason == \
        "dtype 'float8': autocast's rewrite takes \"bfloat16\" or \"float16\""
    assert "different files" in autocast_diff.autocast_at(site, "other.py:3", "float16").reason
    assert "did not see" in autocast_diff.autocast_at("?", site, "float16").reason


def test_the_float16_script_runs_and_trains_as_before_without_a_gpu() -> None:
    """Without CUDA, autocast("cuda") and GradScaler("cuda") disable themselves: the
    rewritten script runs for real and its weights end where the script's own do."""
    import torch

    old = script(FP16.replace("for epoch", "torch.manual_seed(0)\nfor epoch"))
    new = checked(amp(old, "out = model", "loss = criterion", "float16"), old)
    weights = []
    for text in (old, new):
        torch.manual_seed(1)
        space: dict[str, Any] = {"__name__": "__main__"}
        with pytest.warns(UserWarning, match="CUDA is not available") if text is new \
                else nullcontext():
            exec(compile(text, "train.py", "exec"), space)
        weights.append(space["model"].fc.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_from_the_sites_dpprof_records_runs_under_dpprof(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """The model's call and the loss as ``dpprof run`` records them (its loss-in-forward
    run), rewritten: the new script runs on the virtual GPUs, each step under autocast."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "train_args.py"
    path.write_text(ARGS_SCRIPT)
    seen = run_script(ScriptConfig(launch=parse_command(["python", str(path)], 4), steps=3,
                                   alternative=alternative_named("loss-in-forward")))
    site = f"{path}:{line_of(ARGS_SCRIPT, 'loss = criterion(model(inputs), labels)')}"
    followed = seen.alternative_state
    assert followed.call_sites[0] == followed.loss_sites[0] == site
    new = checked(autocast_diff.autocast_at(followed.call_sites[0], followed.loss_sites[0], dtype),
                  ARGS_SCRIPT)
    assert ("scaler.step(optimizer)\n    scaler.update()\n" in new) == (dtype == "float16")
    path.write_text(new)
    run = run_script(ScriptConfig(launch=parse_command(["python", str(path)], 4), steps=3))
    assert run.scenario.status == "ok", run.scenario.message
    assert run.steps_done == 3 and run.ended == "steps"
    assert run.autocast_regions == 3


KEEPS_OUTPUTS = """\
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.DataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
correct = 0
for step in range(5):
    x, y = torch.randn(12, 8), torch.randint(0, 4, (12,))
    optimizer.zero_grad()
    outputs = model(x)
    loss = criterion(outputs, y)
    loss.backward()
    optimizer.step()
    _, predicted = torch.max(outputs, 1)
    correct += (predicted == y).sum().item()
    print(f"{loss.item():.6f} {correct}")
"""


def test_the_outputs_kept_beside_the_loss_run_and_compute_the_same(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tutorial's accuracy from the outputs: the rewritten loop keeps them
    (keep_outputs=True, ModelWithLoss.split) and prints what the original printed, on the
    CPU (DataParallel without GPUs calls its module): the same losses and accuracy."""
    import runpy

    rw = lif(KEEPS_OUTPUTS, "DataParallel(", "outputs = model", "loss = criterion")
    new = checked(rw, KEEPS_OUTPUTS)
    printed = []
    for name, text in (("original.py", KEEPS_OUTPUTS), ("rewritten.py", new)):
        path = tmp_path / name
        path.write_text(text)
        runpy.run_path(str(path), run_name="__main__")
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and len(printed[0].splitlines()) == 5


def test_outputs_read_between_the_call_and_the_loss_are_a_reason() -> None:
    old = KEEPS_OUTPUTS.replace("    loss = criterion(outputs, y)\n",
                                "    outputs = outputs.float()\n"
                                "    loss = criterion(outputs, y)\n")
    rw = lif(old, "DataParallel(", "outputs = model", "loss = criterion")
    assert not rw.ok and "between the model's call" in rw.reason
    inline = KEEPS_OUTPUTS.replace("    loss = criterion(outputs, y)\n",
                                   "    loss = criterion(outputs, y) * 2.0\n")
    rw = lif(inline, "DataParallel(", "outputs = model", "loss = criterion")
    assert not rw.ok and "part of a larger statement" in rw.reason


CONDITIONAL_WRAPS = {
    # how scripts wrap only where there are GPUs to split over: on this machine (no GPU)
    # the wrap does not run, and the model's call with its targets must still work
    "if": "if torch.cuda.device_count() > 1:\n    model = nn.DataParallel(model)\n",
    "if-else": ("if torch.cuda.device_count() > 1:\n    model = nn.DataParallel(model)\n"
                "else:\n    model = model.to('cpu')\n"),
    "branches": ("use_gpu = torch.cuda.is_available()\nif not use_gpu:\n    print('cpu')\n"
                 "elif torch.cuda.device_count() > 1:\n"
                 "    model = torch.nn.DataParallel(model).cuda()\nelse:\n    model.cuda()\n"),
    "expression": "model = nn.DataParallel(model) if torch.cuda.device_count() > 1 else model\n",
    "always": "if True:\n    model = nn.DataParallel(model)\n",  # wrapped, over no GPU
}


def test_a_conditional_wrap_gets_model_with_loss_before_its_condition(tmp_path: Path) -> None:
    """``if torch.cuda.device_count() > 1: model = nn.DataParallel(model)``: ModelWithLoss
    had replaced the wrapped model inside the branch, so that where the branch did not run
    (one GPU, the CPU) the fixed script called the plain model with its targets and failed.
    Now it wraps the model before the condition: every fixed script runs here, with no GPU,
    and prints the loss its unfixed self prints."""
    root = Path(__file__).resolve().parents[1]
    driver = ["import io, contextlib, sys", "for path in sys.argv[1:]:",
              "    out = io.StringIO()", "    with contextlib.redirect_stdout(out):",
              "        exec(compile(open(path).read(), path, 'exec'), {'__name__': '__main__'})",
              "    print(path.rsplit('/', 1)[1], out.getvalue().split()[-1])"]
    paths = []
    for name, wrap in CONDITIONAL_WRAPS.items():
        old = script("torch.manual_seed(0)\nmodel = Net(8, v=4)\n" + wrap + textwrap.dedent("""\
            criterion = nn.CrossEntropyLoss()
            x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
            out = model(x)
            loss = criterion(out, y)
            print(f"{loss.item():.6f}")
            """))
        rw = lif(old, "DataParallel(", "out = model", "loss = criterion")
        new = checked(rw, old)
        assert new.count("dpprof.ModelWithLoss(model, criterion)") == 1, new
        before = new.index("model = dpprof.ModelWithLoss(model, criterion)\n")
        assert before < new.index("DataParallel(model)") and "criterion = nn" in new[:before]
        assert any("ModelWithLoss wraps `model` before the condition" in n for n in rw.notes)
        for kind, text in (("old", old), ("new", new)):
            paths.append(tmp_path / f"{name}-{kind}.py")
            paths[-1].write_text(text)
    (tmp_path / "driver.py").write_text("\n".join(driver) + "\n")
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), *map(str, paths)],
                          capture_output=True, text=True, cwd=root,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    printed = dict(line.split() for line in done.stdout.splitlines())
    for name in CONDITIONAL_WRAPS:
        assert printed[f"{name}-old.py"] == printed[f"{name}-new.py"], (name, printed)
