"""The profiler's records lined up with the emulator's events (dpprof.backends.memtrace.align),
where a CPU kernel's results come in another order than the GPU's, with its scratch between."""
from __future__ import annotations

from dpprof.backends.memtrace import Alloc, align, peak_of, relative_peak

CONV_BWD = ("aten::convolution_backward < ConvolutionBackward0 < "
            "autograd::engine::evaluate_function: ConvolutionBackward0")
NEW = "aten::empty < " + CONV_BWD
LATER = "Optimizer.zero_grad"


def test_a_result_made_before_its_neighbour_on_this_cpu_is_still_its_counterpart() -> None:
    # The GPU (and oneDNN on AVX-512) makes the weight's gradient, then the bias's; oneDNN on
    # AVX2 makes a 128 B scratch, the bias's gradient, the weight's, then frees the scratch.
    emulated = [4096, 1152, 128, -4096]
    records = [Alloc(0, 4096, "aten::mm", 1), Alloc(0, 128, CONV_BWD, 2),
               Alloc(0, 128, NEW, 3), Alloc(0, 1152, NEW, 4), Alloc(0, -128, CONV_BWD, 2),
               Alloc(0, -4096, LATER, 1)]
    al = align(emulated, records)
    assert al.missing == []
    assert al.unexplained == []
    assert al.cpu_only == {"mkldnn convolution scratch": 2}
    assert [e.ptr for e in al.kept] == [1, 3, 4, 1]
    assert peak_of(al.kept) == relative_peak(emulated) == 4096 + 1152 + 128


def test_a_scratch_freed_inside_its_kernel_is_never_taken_for_a_result() -> None:
    # The emulator expects a 128 B result the CPU never made; a 128 B scratch of the same
    # kernel must not stand in for it: the event stays missing.
    emulated = [1152, 128]
    records = [Alloc(0, 128, CONV_BWD, 2), Alloc(0, 1152, NEW, 4), Alloc(0, -128, CONV_BWD, 2)]
    al = align(emulated, records)
    assert al.missing == [128]
    assert [e.ptr for e in al.kept] == [4]
