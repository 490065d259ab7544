"""A library that took torch's parallel wrappers by name when it was imported (as
Lightning's DDP strategy takes ``DistributedDataParallel``), which may be before the run."""

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel


def wrap(model: nn.Module, local_rank: int | None) -> nn.Module:
    """DDP on ``local_rank``'s GPU under a launcher, else DataParallel over every GPU."""
    if local_rank is None:
        return DataParallel(model)
    return DistributedDataParallel(model, device_ids=[local_rank])
