"""The buffers CUDA's ``embedding_dense_backward_cuda`` allocates and frees itself (what
``nn.Embedding``'s backward runs): it sorts the indices and sums partial segments through
buffers of its own, sized as cub's temporary storage is (:func:`embedding_backward_plan`);
meta allocates only the gradient. :class:`dpprof.emulator.kernels.GpuKernels` plays them
around the gradient, in the kernel's order."""

from __future__ import annotations

import torch

from dpprof.emulator.events import ALLOC, FREE, KernelPlan, KernelStep

# ---- embedding backward ---------------------------------------------------------------

# aten/src/ATen/native/cuda/Embedding.cu, embedding_dense_backward_cuda: up to this many
# indices (and without scale_grad_by_freq) one feature-parallel kernel writes the gradient
# directly; above it, the sort-and-segment path.
EMBEDDING_DIRECT_MAX_INDICES = 3072
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: rows one partial sum covers
CUB_ALIGN_BYTES = 256  # cub's AliasTemporaries aligns each sub-allocation to 256 B
# cub::DeviceRadixSort's onesweep pass on sm80+ (Policy800): 8 radix bits per pass, tiles of
# 384 threads x 10 items for 8-byte keys (21 items for 4-byte keys, scaled by size).
ONESWEEP_RADIX_BITS = 8
ONESWEEP_BLOCK_THREADS = 384
SCAN_TILE_MIN_ITEMS = 128  # every cub scan / select tile covers at least 128 items
SCAN_TILE_STATUS_MAX_BYTES = 32  # per tile: status + partial + inclusive values, padded
SCAN_TILE_STATUS_PADDING = 32  # cub's TILE_STATUS_PADDING (one warp)


def _align(nbytes: int, to: int = CUB_ALIGN_BYTES) -> int:
    return -(-nbytes // to) * to


def cub_temp_bytes(sizes: list[int]) -> int:
    """cub's ``AliasTemporaries``: each piece rounded up to 256 B, plus 255 B so the start
    can be aligned."""
    return sum(_align(n) for n in sizes) + CUB_ALIGN_BYTES - 1


def radix_sort_pairs_temp_bytes(num_items: int, key_bytes: int, value_bytes: int) -> int:
    """Temporary storage of ``cub::DeviceRadixSort::SortPairs`` (not the DoubleBuffer form:
    it allocates alternate key and value buffers of ``num_items`` each, exact) through the
    onesweep pass (``DispatchRadixSort::InvokeOnesweep``): bins (passes x 256 digits x an
    8-byte offset, an upper bound where cub picks 4-byte offsets), lookback (tiles x 256 x
    4 B with sm80's tile size), counters (passes x 4 B)."""
    passes = -(-key_bytes * 8 // ONESWEEP_RADIX_BITS)
    digits = 1 << ONESWEEP_RADIX_BITS
    items_per_thread = max(1, 21 * 4 // max(key_bytes, value_bytes, 4))
    tile = ONESWEEP_BLOCK_THREADS * items_per_thread
    blocks = -(-num_items // tile)
    return cub_temp_bytes([passes * digits * 8, blocks * digits * 4,
                           num_items * key_bytes, num_items * value_bytes, passes * 4])


def scan_temp_bytes_bound(num_items: int) -> int:
    """An upper bound on a cub scan's or select's temporary storage (``DeviceScan``,
    ``DeviceSelect::UniqueByKey``): its tile-status array, one entry per tile plus a
    warp's padding, at most 32 B each, tiles of at least 128 items."""
    tiles = -(-num_items // SCAN_TILE_MIN_ITEMS)
    return cub_temp_bytes([(tiles + SCAN_TILE_STATUS_PADDING) * SCAN_TILE_STATUS_MAX_BYTES])


def embedding_backward_plan(num_indices: int, index_bytes: int, num_weights: int, width: int,
                            grad_dtype: torch.dtype, scale_grad_by_freq: bool = False,
                            grad_copy_bytes: int = 0, indices_copy_bytes: int = 0
                            ) -> KernelPlan:
    """The buffers ``embedding_dense_backward_cuda`` (``Embedding.cu``) and
    ``embedding_backward_cuda_kernel`` (``EmbeddingBackwardKernel.cu``) allocate and free
    around the gradient they return, in their order. Sizes follow from the shapes alone
    (the kernel sizes its segment buffers by the worst case, ``min(numel, num_weights)``
    segments, so no value is read); the cub scratch of the sort is exact but for a few KiB
    of bins and lookback, that of the scans and the unique-by-key is an upper bound."""
    before: list[KernelStep] = []
    after: list[KernelStep] = []

    def alloc(steps: list[KernelStep], name: str, nbytes: int) -> None:
        if nbytes > 0:
            steps.append(KernelStep(ALLOC, name, nbytes))

    def free(steps: list[KernelStep], *names: str) -> None:
        held = {s.name for s in before + after if s.kind == ALLOC}
        steps.extend(KernelStep(FREE, n) for n in names if n in held)

    n, ib = num_indices, index_bytes
    # indices_.contiguous(), grad_.contiguous(): copies only when not contiguous
    alloc(before, "indices (contiguous copy)", indices_copy_bytes)
    alloc(before, "grad (contiguous copy)", grad_copy_bytes)
    if n <= EMBEDDING_DIRECT_MAX_INDICES and not scale_grad_by_freq:
        # at::zeros for the gradient, one kernel: nothing else
        free(after, "grad (contiguous copy)", "indices (contiguous copy)")
        return KernelPlan(tuple(before), tuple(after))
    alloc(before, "sorted_indices", n * ib)
    alloc(before, "orig_indices", n * ib)
    alloc(before, "range (arange)", n * ib)
    alloc(before, "radix sort scratch (cub)", radix_sort_pairs_temp_bytes(n, ib, ib))
    free(before, "radix sort scratch (cub)", "range (arange)")
    if scale_grad_by_freq:
        alloc(before, "count", n * ib)
        for scan in ("inclusive_sum_by_key", "inclusive_scan_by_key"):
            alloc(before, f"{scan} scratch (cub)", scan_temp_bytes_bound(n))
            free(before, f"{scan} scratch (cub)")
    # embedding_backward_cuda_kernel: the gradient (the op's output), then the segments
    max_segments = min(n, num_weights)
    max_partial_segments = n // NROWS_PER_THREAD + max_segments
    # grad_weight_per_segment holds acc_type: float32 for half/bfloat16 gradients
    acc_bytes = 4 if grad_dtype in (torch.float16, torch.bfloat16) else grad_dtype.itemsize
    alloc(after, "segment_offsets", n * ib)
    alloc(after, "num_of_segments", 8)
    alloc(after, "unique_by_key keys_out", n * ib)
    alloc(after, "unique_by_key scratch (cub)", scan_temp_bytes_bound(n))
    free(after, "unique_by_key scratch (cub)", "unique_by_key keys_out")
    alloc(after, "partials_per_segment", max_segments * ib)
    alloc(after, "partials_per_segment_offset", max_segments * ib)
    alloc(after, "exclusive_sum scratch (cub)", scan_temp_bytes_bound(max_segments))
    free(after, "exclusive_sum scratch (cub)")
    alloc(after, "num_of_partial_segments", 8)
    alloc(after, "partial_segment_offset", max_partial_segments * ib)
    alloc(after, "grad_weight_per_segment", max_partial_segments * width * acc_bytes)
    # destructors: the innermost scope first, each in reverse order of construction
    free(after, "grad_weight_per_segment", "partial_segment_offset", "num_of_partial_segments",
         "partials_per_segment_offset", "partials_per_segment", "num_of_segments",
         "segment_offsets", "count", "orig_indices", "sorted_indices",
         "grad (contiguous copy)", "indices (contiguous copy)")
    return KernelPlan(tuple(before), tuple(after))
