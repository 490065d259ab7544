"""The loss inside forward for a loss on an expression of DataParallel's outputs
(:mod:`dpprof.script.loss_expression`), over generated losses x views.

Each example is a script: a model wrapped in ``nn.DataParallel`` whose loop computes
``criterion(<an expression of logits>, <an expression of y>)``, the criterion one of torch's
loss modules or of torch.nn.functional's losses (its settings in the call). Checked:

* offered: in the statement as it runs, the loss call is found (not a reason);
* the value: the function found, applied by ``ModelWithLoss`` to each replica's shards
  (uneven ones, with ``ignore_index`` targets in some) and combined, equals the loss the
  script computes on the whole batch (CPU tensors);
* the diff: applied to the file it compiles, and the patched script, run with plain Python
  under a DataParallel that splits the batch as torch's scatter does (there is no GPU here:
  the stand-in lives in this test), prints the same loss as the script as written.
"""

from __future__ import annotations

import contextlib
import io
import sys
import textwrap
from typing import Any

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_script_rewrite import apply_diff, line_of
from torch import nn

from dpprof.scenarios.model_with_loss import ModelWithLoss
from dpprof.script import loss_in_forward_diff
from dpprof.script.loss_expression import FoundLoss, compiled, find_in_frame

# the loss, the kind of its targets, what its call is given besides (a function of
# torch.nn.functional takes its settings in the call)
LOSSES = {
    "ce": ("nn.CrossEntropyLoss()", "index", ""),
    "ce_smooth": ("nn.CrossEntropyLoss(label_smoothing=0.1)", "index", ""),
    "ce_ignore": ("nn.CrossEntropyLoss(ignore_index=0)", "index", ""),
    "ce_ignore_smooth": ("nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.2)",
                         "index", ""),
    "ce_weight_ignore": ("nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, V), "
                         "ignore_index=0)", "index", ""),
    "nll_ignore": ("nn.NLLLoss(ignore_index=0)", "log_softmax", ""),
    "mse": ("nn.MSELoss()", "float", ""),
    "f_ce_ignore": ("F.cross_entropy", "index", ", ignore_index=0"),
    "f_ce_smooth": ("F.cross_entropy", "index", ", label_smoothing=0.1"),
    "f_ce_weight_ignore": ("F.cross_entropy", "index",
                           ", weight=torch.linspace(0.5, 2.0, V), ignore_index=0"),
    "f_nll_ignore": ("F.nll_loss", "log_softmax", ", ignore_index=0"),
    "f_mse": ("F.mse_loss", "float", ""),
    # losses that add up: the replicas' losses are summed
    "f_ce_sum": ("F.cross_entropy", "index", ", ignore_index=0, reduction='sum'"),
    "mse_sum": ("nn.MSELoss(reduction='sum')", "float", ""),
}

SCRIPT = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F

V, T, B = 7, 6, {rows}
torch.manual_seed(0)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)

    def forward(self, ids):
        return self.head(self.emb(ids))


model = nn.DataParallel(LM())
criterion = {loss}
ids = torch.randint(1, V, (B, T))
y = ids.masked_fill(torch.rand(B, T) < 0.3, 0)
z = torch.randn(B, T, V)
logits = model(ids)
loss = criterion({outputs}, {targets}{extra})
print(repr(loss.item()))
'''


def expressions(kind: str, shift: bool, layout: str, as_float: bool,
                contiguous: bool) -> tuple[str, str]:
    """(the loss's outputs argument, its targets argument)."""
    def chain(name: str, target: bool) -> str:
        text = name + ("[:, :-1]" if shift and not target else "[:, 1:]" if shift else "")
        if not target or kind == "float":
            text += ".float()" if as_float else ""
            text += ".contiguous()" if contiguous or (shift and layout == "view") else ""
            text += {"view": ".view(-1, V)", "reshape": ".reshape(-1, logits.size(-1))",
                     "transpose": ".transpose(1, 2)"}[layout]
        elif layout != "transpose":  # class indices: flattened as the logits' rows are
            text += ".reshape(-1)" if shift else ".view(-1)"
        return text

    outputs = chain("logits", target=False)
    if kind == "log_softmax":
        outputs = f"F.log_softmax({outputs}, dim=1)"
    targets = chain("z" if kind == "float" else "y", target=True)
    if kind == "float":
        targets = targets.replace("logits.size(-1)", "V")
    return outputs, targets


class _Found(Exception):
    def __init__(self, found: FoundLoss | str) -> None:
        self.found = found


class _Outputs:
    """DataParallel's outputs before any use: the first use looks for the loss call."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.model, self.rows = model, rows

    def __getattr__(self, name: str) -> Any:
        frame = sys._getframe(1)
        raise _Found(find_in_frame(frame, lambda v: v is self, self.model, self.rows, 0))

    def __getitem__(self, key: Any) -> Any:
        frame = sys._getframe(1)
        raise _Found(find_in_frame(frame, lambda v: v is self, self.model, self.rows, 0))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        outputs = next(a for a in args if isinstance(a, _Outputs))
        frame = sys._getframe(2)
        raise _Found(find_in_frame(frame, lambda v: v is outputs, outputs.model,
                                   outputs.rows, 0))


class SplittingDataParallel(nn.Module):
    """``nn.DataParallel`` on CPU tensors: the batch split into ``gpus`` chunks along dim 0
    as its scatter splits it (``Tensor.chunk``), the module run on each, the outputs
    concatenated as its gather does."""

    def __init__(self, module: nn.Module, gpus: int = 4) -> None:
        super().__init__()
        self.module, self.gpus = module, gpus

    def forward(self, *inputs: Any) -> Any:
        parts = list(zip(*(t.chunk(self.gpus) for t in inputs), strict=True))
        outs = [self.module(*p) for p in parts]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat([o[i] for o in outs]) for i in range(len(outs[0])))
        return torch.cat(outs)


def run_printed(text: str, data_parallel: type[nn.Module]) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        saved = nn.DataParallel
        nn.DataParallel = data_parallel  # type: ignore[misc]
        try:
            exec(compile(text, "train.py", "exec"), {"__name__": "__main__"})
        finally:
            nn.DataParallel = saved  # type: ignore[misc]
    return float(out.getvalue().strip())


@settings(max_examples=40, deadline=None)
@example(kind="f_ce_weight_ignore", shift=True, layout="view", as_float=False, contiguous=False,
         rows=5)
@example(kind="f_nll_ignore", shift=False, layout="transpose", as_float=True, contiguous=True,
         rows=7)
@example(kind="f_ce_sum", shift=True, layout="reshape", as_float=False, contiguous=False, rows=6)
@example(kind="mse_sum", shift=False, layout="view", as_float=True, contiguous=True, rows=9)
# V == B: a size the loss reads that equals the batch's rows is no reason to decline
@example(kind="ce", shift=False, layout="view", as_float=False, contiguous=True, rows=7)
@given(kind=st.sampled_from(sorted(LOSSES)), shift=st.booleans(),
       layout=st.sampled_from(["view", "reshape", "transpose"]), as_float=st.booleans(),
       contiguous=st.booleans(), rows=st.integers(3, 9))
def test_a_loss_on_any_view_of_the_outputs_moves_inside_forward(
        kind: str, shift: bool, layout: str, as_float: bool, contiguous: bool,
        rows: int) -> None:
    loss_text, target_kind, extra = LOSSES[kind]
    kind = target_kind
    outputs, targets = expressions(kind, shift, layout, as_float, contiguous)
    text = SCRIPT.format(rows=rows, loss=loss_text, outputs=outputs, targets=targets,
                         extra=extra)
    as_written = run_printed(text, nn.DataParallel)

    # the statement as it runs, the outputs not computed yet: the loss call is found
    lines = text.splitlines(keepends=True)
    stop = line_of(text, "loss = criterion(")
    env: dict[str, Any] = {"__name__": "__main__"}
    exec(compile("".join(lines[:stop - 2]), "train.py", "exec"), env)
    probe = _Outputs(env["model"], rows)
    env["logits"] = probe
    import linecache

    linecache.cache["train.py"] = (len(text), None, lines, "train.py")
    try:
        exec(compile("\n" * (stop - 1) + lines[stop - 1], "train.py", "exec"), env)
    except _Found as e:
        found = e.found
    else:  # pragma: no cover
        raise AssertionError("the outputs were not read")
    finally:
        linecache.cache.pop("train.py", None)
    assert isinstance(found, FoundLoss), found
    assert found.function.targets_name == ("z" if kind == "float" else "y")

    # its value: per replica on uneven shards, combined, equals the whole batch's
    model = env["model"].module
    wrapped = ModelWithLoss(model, compiled(found))
    per_replica = [wrapped(x, t) for x, t in zip(env["ids"].chunk(4), found.targets[0].chunk(4),
                                                 strict=True)]
    combined = ModelWithLoss.combine(tuple(torch.cat([r[i] for r in per_replica])
                                           for i in range(2)))
    whole = eval(f"criterion({outputs}, {targets}{extra})",
                 {**env, "logits": model(env["ids"])})
    torch.testing.assert_close(combined, whole)
    assert abs(whole.item() - as_written) <= 1e-5 * max(1.0, abs(as_written))

    # the diff: applies, compiles, and the patched script computes the same loss
    rw = loss_in_forward_diff.loss_in_forward(text, "train.py", line_of(text, "nn.DataParallel("),
                            line_of(text, "logits = model(ids)"), stop, "criterion",
                            found.function.targets_name)
    assert rw.ok, rw.reason
    patched = apply_diff(text, rw.diff)
    compile(patched, "train.py", "exec")
    assert "import dpprof" in patched
    assert f"dpprof.ModelWithLoss.combine(model(ids, {found.function.targets_name}))" in patched
    patched_loss = run_printed(patched, SplittingDataParallel)
    assert abs(patched_loss - as_written) <= 1e-5 * max(1.0, abs(as_written)), (
        patched, patched_loss, as_written)


def test_a_loss_on_several_tensors_of_the_batch_takes_them_all_as_targets() -> None:
    """``criterion(logits[mask], y[mask])``: the mask and the labels both scattered (it was
    declined: "reads mask and y, 2 tensors of the batch, and dpprof scatters one"); on
    uneven shards, each selecting its own count of rows, combined it is the whole batch's."""
    text = textwrap.dedent('''\
        import torch
        import torch.nn as nn
        criterion = nn.CrossEntropyLoss()
        y = torch.randint(0, 5, (5, 3))
        mask = y > 1
        loss = criterion(logits[mask], y[mask])
        ''')
    lines = text.splitlines(keepends=True)
    env: dict[str, Any] = {"__name__": "__main__"}
    exec(compile("".join(lines[:5]), "train.py", "exec"), env)
    env["logits"] = _Outputs(nn.Linear(2, 2), 5)
    import linecache

    linecache.cache["train.py"] = (len(text), None, lines, "train.py")
    try:
        exec(compile("\n" * 5 + lines[5], "train.py", "exec"), env)
    except _Found as e:
        found = e.found
    finally:
        linecache.cache.pop("train.py", None)
    assert isinstance(found, FoundLoss), found
    assert found.function.text == "lambda logits, mask, y: criterion(logits[mask], y[mask])"
    assert found.targets[0] is env["mask"] and found.targets[1] is env["y"]
    logits = torch.randn(5, 3, 5)
    wrapped = ModelWithLoss(nn.Identity(), compiled(found))
    per_replica = [wrapped(o, m, t) for o, m, t in zip(logits.chunk(2), env["mask"].chunk(2),
                                                      env["y"].chunk(2), strict=True)]
    combined = ModelWithLoss.combine(tuple(torch.cat([r[i] for r in per_replica])
                                           for i in range(2)))
    torch.testing.assert_close(combined, env["criterion"](logits[env["mask"]],
                                                          env["y"][env["mask"]]))
