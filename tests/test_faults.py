"""DDP faults are attributed to the rank that caused them and bounded by --ddp-timeout.

When rank 1 raises, hangs, exits or crashes, rank 0 only sees its connection to rank 1
close (or time out): the outcome names rank 1 with its own error, every report shows it,
and the run exits 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from dpprof.backends.ranks import Group, RankInfo, RankOutcome, blame
from dpprof.backends.ranks_spawn import spawn_ranks
from dpprof.cli.app import app

runner = CliRunner()


@dataclass
class FaultyBody:
    """Rank ``rank`` misbehaves (``how``) before the all_reduce rank 0 waits in."""

    how: str
    rank: int = 1

    def __call__(self, info: RankInfo, device_index: int) -> Any:
        if info.rank == self.rank:
            if self.how == "raise":
                raise RuntimeError("rank 1's own error")
            if self.how == "hang":
                time.sleep(3600)
            if self.how == "sys.exit":
                sys.exit(0)
            if self.how == "os._exit":
                os._exit(0)
            if self.how == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t.item())

    def succeeded(self, value: Any) -> bool:
        return True


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        # raising and os._exit: tests/test_ranks.py; here what remains
        ("hang", "rank 1 did not report"),
        ("sys.exit", "the workload called sys.exit(0) in rank 1"),
        ("crash", "rank 1 died of SIGSEGV"),
    ],
)
def test_the_faulty_rank_is_blamed_not_rank_0(how: str, needle: str) -> None:
    t0 = time.monotonic()
    # the hang waits out the whole collective timeout, then the grace for rank 1's outcome
    group = Group(backend="gloo", device="cpu", timeout_s=5, grace_s=1, join_timeout_s=120)
    outcomes = spawn_ranks(group, FaultyBody(how), 2)
    elapsed = time.monotonic() - t0
    assert not outcomes[1].ok and needle in outcomes[1].message, outcomes
    assert outcomes[1].first_failure and not outcomes[0].first_failure, outcomes
    assert elapsed < 90, elapsed  # bounded by the 5 s timeout, not the default 300 s


def test_blame_prefers_an_own_error_over_peer_errors_and_silence() -> None:
    peer = RankOutcome(0, False, message="RuntimeError: [pair.cc:534] Connection closed by peer",
                       traceback="Traceback ...\nRuntimeError: Connection closed by peer",
                       reported_first=True)
    own = RankOutcome(1, False, message="ValueError: bad shape",
                      traceback="Traceback ...\nValueError: bad shape")
    silent = RankOutcome(2, False, message="rank 2 did not report")
    assert [o.first_failure for o in blame([peer, own, silent])] == [False, True, False]
    assert [o.first_failure for o in blame([peer, silent])] == [False, True]
    timeout = RankOutcome(0, False, message="Timed out waiting 4000ms", traceback="...",
                          reported_first=True)
    assert [o.first_failure for o in blame([timeout, RankOutcome(1, True)])] == [True, False]


RANK1_RAISES = '''
import os
import torch
import dpprof

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank 1 cannot go on")
        return self.lin(x)

def _batch(n, device):
    return torch.randn(n, 4, device=device), torch.randn(n, 4, device=device)

def wl():
    return dpprof.Workload(model=Net, batch=_batch, loss=torch.nn.MSELoss(), name="r1")
'''


@pytest.mark.slow
def test_cpu_backend_names_rank_1_in_every_report_and_exits_1(tmp_path: Path) -> None:
    f = tmp_path / "wl.py"
    f.write_text(RANK1_RAISES)
    outs = [tmp_path / f"r.{ext}" for ext in ("md", "html", "json")]
    r = runner.invoke(app, ["compare", "--backend", "cpu", "-w", f"{f}:wl", "-b", "4", "-g", "2",
                            "-s", "ddp", "--no-fixes", "--ddp-timeout", "20",
                            *[a for o in outs for a in ("-o", str(o))]])
    assert r.exit_code == 1, r.output
    assert "rank 1 failed: RuntimeError: rank 1 cannot go on" in r.output
    assert "Connection closed by peer" not in r.output.split("then:")[0]
    for o in outs:
        text = o.read_text()
        assert "rank 1 failed: RuntimeError: rank 1 cannot go on" in text, o
        assert "raise RuntimeError" in text, o  # rank 1's own traceback


class SlowStore:
    """A c10d store whose ``check`` takes a while (a loaded machine, a far store)."""

    def __init__(self) -> None:
        self.calls = 0

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        time.sleep(0.5)
        return False


def test_the_store_watcher_is_joined_when_stopped() -> None:
    """The watcher thread polls the c10d store; left running, it can still be inside a store
    call when the interpreter finalizes, and the rank dies of SIGABRT ("terminate called
    without an active exception"). stop() joins it."""
    from dpprof.backends.ranks import StoreWatcher

    store = SlowStore()
    w = StoreWatcher(store, "dpprof/x/failed", "gloo").start()
    deadline = time.monotonic() + 60
    while store.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.calls > 0, "the watcher never polled the store"
    w.stop()
    assert not w.thread.is_alive()
