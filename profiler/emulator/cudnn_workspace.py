"""cuDNN's convolution workspace: the block a convolution takes from the caching allocator
for the call and gives back after it, estimated per convolution from what an H200 measured.

torch runs a CUDA convolution (``groups == 1``, not transposed) through cuDNN's v8 API
(``aten/src/ATen/native/cudnn/Conv_v8.cpp``): with ``torch.backends.cudnn.benchmark`` off
(its default) it asks cuDNN's heuristics for engine configurations (``get_configs_from_
heuristics``) and runs the first that works (``try_configs``), allocating that plan's
``getWorkspaceSize()`` from the caching allocator for the call (``run_conv_plan``). The size
is the chosen engine's, which cuDNN's heuristics decide inside the library: no rule in torch
gives it. What the record shows (``tests/data/h200_measured.json``, part ``cudnn``: the peak
of ``memory_allocated`` over a forward and over a backward beyond the tensors they return,
cuDNN 9.19 on an NVIDIA H200, float32 with TF32 as torch enables it for cuDNN, and bfloat16)
is that whenever an engine takes a workspace it is about the bytes of the input, the output
and the weight together: the NHWC copies cuDNN's engines work on (a bfloat16 forward with 8
input channels or more: exactly that, in every shape measured). Pointwise convolutions
(1x1, stride 1: a GEMM) take almost none, and a first layer's (fewer than 8 input
channels) forward mostly none.

So the estimate is ``ratio x (input + output + weight bytes)``, the ratio per direction
(forward; backward, which computes the input's and the weight's gradients), precision
(float32/TF32; 16-bit) and shape class (:func:`shape_class`): the median ratio over the
record's grid of shapes (:data:`RATIOS`, :func:`fit`), the built-in workloads' and a
ResNet's and a ViT's convolutions held out (``tests/test_cudnn_workspace.py`` states the
error on them). It stands for cuDNN 9.19 on compute capability 9.0; other GPUs and cuDNN
versions pick other engines. Not modelled: transposed and grouped convolutions (cuDNN or
torch's own kernels), ``CUDNN_CONV_WSCAP_DBG``, and ``benchmark=True``'s trials: the first
call of a shape times cuDNN's candidate engines with one workspace as large as the largest
of them asks, up to the memory free then (``generate_and_filter_plans``), which the record
does not isolate (its benchmark rows followed the benchmark-off ones in one process, and
torch keys its plan cache without the flag, ``ConvolutionParams``: 104 of its 126 benchmark
rows have the benchmark-off rows' exact bytes, their plans reused; ``scripts/gpu_measure.py``'s
``cudnn-benchmark`` part measures the trials in a process of its own).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "BACKWARD",
    "FORWARD",
    "MEASURED_ON",
    "RATIOS",
    "conv_workspace_bytes",
    "fit",
    "precision_of",
    "shape_class",
]

FORWARD = "forward"
BACKWARD = "backward"
POINTWISE = "pointwise"  # every kernel dim 1, stride 1
NARROW = "narrow"  # fewer than 8 input channels (an image's first layer)
SPATIAL = "spatial"
FLOAT32 = "float32"  # TF32 on, torch's default for cuDNN's convolutions
HALF = "16-bit"  # bfloat16 (measured) and float16 (taken to behave alike)

MEASURED_ON = "cuDNN 9.19 on an NVIDIA H200 (torch 2.11.0+cu130)"

# The medians of the record's grid (fit(), over tests/data/h200_measured.json's cudnn rows
# with benchmark off, the first 15 rows of each dtype, the built-ins' shapes, held out);
# tests/test_cudnn_workspace.py recomputes them from the record.
RATIOS: dict[tuple[str, str, str], float] = {
    (FORWARD, FLOAT32, POINTWISE): 0.0,
    (FORWARD, FLOAT32, NARROW): 0.008,
    (FORWARD, FLOAT32, SPATIAL): 1.0,
    (BACKWARD, FLOAT32, POINTWISE): 0.018,
    (BACKWARD, FLOAT32, NARROW): 1.012,
    (BACKWARD, FLOAT32, SPATIAL): 1.277,
    (FORWARD, HALF, POINTWISE): 0.0,
    (FORWARD, HALF, NARROW): 0.01,
    (FORWARD, HALF, SPATIAL): 1.0,
    (BACKWARD, HALF, POINTWISE): 0.026,
    (BACKWARD, HALF, NARROW): 1.13,
    (BACKWARD, HALF, SPATIAL): 1.014,
}


def shape_class(in_channels: int, kernel: Sequence[int], stride: Sequence[int]) -> str:
    """:data:`POINTWISE`, :data:`NARROW` or :data:`SPATIAL`."""
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride):
        return POINTWISE
    if in_channels < 8:
        return NARROW
    return SPATIAL


def precision_of(dtype: torch.dtype) -> str | None:
    """The precision class of a convolution's dtype (None: not estimated)."""
    if dtype == torch.float32:
        return FLOAT32
    if dtype in (torch.bfloat16, torch.float16):
        return HALF
    return None


def conv_workspace_bytes(direction: str, dtype: torch.dtype, in_channels: int,
                         kernel: Sequence[int], stride: Sequence[int], input_bytes: int,
                         output_bytes: int, weight_bytes: int,
                         ratios: Mapping[tuple[str, str, str], float] = RATIOS) -> int:
    """The workspace one convolution's cuDNN call takes (0 where not estimated)."""
    precision = precision_of(dtype)
    if precision is None:
        return 0
    ratio = ratios[(direction, precision, shape_class(in_channels, kernel, stride))]
    return int(ratio * (input_bytes + output_bytes + weight_bytes))


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def row_bytes(row: Mapping[str, Any]) -> tuple[int, int, int]:
    """A measured row's (input, output, weight) bytes."""
    item = 4 if row["dtype"] == "float32" else 2
    return int(row["x_bytes"]), _numel(row["y_shape"]) * item, int(row["w_bytes"])


def row_key(row: Mapping[str, Any], direction: str) -> tuple[str, str, str] | None:
    """The (direction, precision, shape class) a measured row falls in."""
    precision = precision_of(getattr(torch, row["dtype"]))
    if precision is None:
        return None
    k, s = int(row["kernel"]), int(row["stride"])
    return direction, precision, shape_class(int(row["c_in"]), (k, k), (s, s))


def fit(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], float]:
    """The median of measured workspace / (input + output + weight bytes) per class, over
    ``rows`` (the record's cudnn rows: ``forward_workspace_bytes_first``, ...), to 3
    decimals."""
    ratios: dict[tuple[str, str, str], list[float]] = {}
    for row in rows:
        total = sum(row_bytes(row))
        for direction in (FORWARD, BACKWARD):
            key = row_key(row, direction)
            measured = row.get(f"{direction}_workspace_bytes_first")
            if key is None or measured is None or total <= 0:
                continue
            ratios.setdefault(key, []).append(max(int(measured), 0) / total)
    return {k: round(statistics.median(v), 3) for k, v in sorted(ratios.items())}
