"""Values made from the script's Python data keep their values on a virtual GPU: an index
given as a list (``gain[[2, 3]]``, ``x[:, [0, 2]]``, ``y[[0, 2]] = 5``), ``new_tensor``,
and what a host kernel lays out otherwise than meta does (``ones_like`` of a view of one
element: stride 2 on the host, 1 on meta).

Found on ultralytics' YOLOv5 loss (``build_targets``): ``gain[[2, 3]] - gxy`` read back as
stand-ins, and with one target left ``torch.stack((torch.ones_like(j), j, k, l, m))`` had no
values; the next boolean mask stopped the run. torch's C++ makes a list index for a meta
tensor without copying the list's values (``internal_new_from_data``), out of sight of
dispatch modes."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

from script_runs import printed_on_the_host, run_printing

SCRIPT = """
    import torch

    dev = "cuda"
    x = torch.arange(12, device=dev).view(3, 4).float()
    print("new_tensor", x.new_tensor([1.5, 2.5]).tolist(), x.new_tensor([1, 2]).dtype)
    print("list", x[[0, 2]].tolist())
    print("tuple with a list", x[:, [0, 2]].tolist())
    print("two lists", x[[0, 1], [1, 2]].tolist())
    print("a list of bools", x[[True, False, True]].tolist())
    print("a list read as a tuple", x[[[0, 1], [2, 0]]].tolist())
    print("an int and a list", x[1, [0, 3]].tolist())
    print("a range", x[range(1, 3)].tolist())
    y = x.clone()
    y[[0, 2]] = 5.0
    y[:, [1]] += 1
    print("written", y.tolist())
    for n in (3, 1):  # YOLOv5's offsets of its targets, with three targets and with one
        g = 0.5
        t = torch.tensor([[0, 1, 6.5, 1.4, 2, 2, 0]] * n, device=dev)
        gain = torch.ones(7, device=dev)
        gain[2:6] = torch.tensor((8, 3, 4, 4))[[3, 2, 3, 2]]
        gxy = t[:, 2:4]
        gxi = gain[[2, 3]] - gxy
        j, k = ((gxy % 1 < g) & (gxy > 1)).T
        l, m = ((gxi % 1 < g) & (gxi > 1)).T
        j = torch.stack((torch.ones_like(j), j, k, l, m))
        print(n, "offsets kept", t.repeat((5, 1, 1))[j].shape[0], j.tolist())
"""


def test_tensors_made_from_python_data_keep_their_values(tmp_path: Path) -> None:
    source = textwrap.dedent(SCRIPT)
    script = tmp_path / "indices.py"
    script.write_text(source)
    expected = printed_on_the_host(tmp_path, source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, printed = run_printing(script, steps=1)
    s = result.scenarios[0]
    assert s.status == "ok", s.message
    assert printed == expected
    assert "1 offsets kept 2 [[True], [False], [True], [False], [False]]" in expected
    assert not any("stand-in" in n for n in s.notes), s.notes
    # torch's warning of a list read as a tuple is the script's line's, as without dpprof
    deprecated = [w for w in caught if "non-tuple sequence" in str(w.message)]
    assert deprecated and all(w.filename == str(script) for w in deprecated), [
        (w.filename, w.lineno) for w in deprecated]


# tensors made from lists of 0-d tensors, as a loop logs its losses and as Hugging Face's
# datasets hand a column of labels (simpletransformers: torch.tensor(dataset["labels"]))
FROM_TENSORS = """
    import torch

    dev = "cuda"
    losses = [torch.tensor(1.5), torch.tensor(2.5)]
    print("floats", torch.tensor(losses).tolist(), torch.tensor(losses).dtype)
    print("ints", torch.tensor([torch.tensor(1), torch.tensor(0)], dtype=torch.long).tolist())
    print("half", torch.tensor([torch.tensor(1.0, dtype=torch.float16)]).dtype)
    print("on the gpu", torch.tensor(losses, device=dev).tolist())
    print("as_tensor", torch.as_tensor([torch.tensor(3)]).tolist())
    x = torch.arange(6, device=dev)
    print("indexed", x[[1, 4]].tolist(), x[torch.tensor([0, 5])].tolist())
"""


def test_tensors_made_from_lists_of_tensors_as_torch_makes_them(tmp_path: Path) -> None:
    """The list index above is kept by a ``__getitem__`` of torch.Tensor's own while the
    script runs, which made a tensor a sequence to C code (CPython fills ``sq_item`` too):
    torch.tensor of a list of 0-d tensors raised "len() of a 0-d tensor", during the run and
    after it, for the rest of the process."""
    import torch

    source = textwrap.dedent(FROM_TENSORS)
    script = tmp_path / "from_tensors.py"
    script.write_text(source)
    expected = printed_on_the_host(tmp_path, source)
    result, printed = run_printing(script, steps=1)
    assert result.scenarios[0].status == "ok", result.scenarios[0].message
    assert printed == expected
    assert "floats [1.5, 2.5] torch.float32" in printed and "half torch.float16" in printed
    # the patch restored: torch's types as they were
    assert torch.tensor([torch.tensor(1), torch.tensor(0)]).tolist() == [1, 0]
