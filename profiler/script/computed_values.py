"""What the numbers a script computes under ``--compute`` stand for, where they are not the
GPUs' own: a run whose parameters are sharded across ranks.

Under ``--compute`` each emulated rank computes on CPU tensors with the values it holds. A
rank of FSDP2 or of tensor parallelism holds its own shards of the parameters only, and an
all-gather over the emulated process group gives every other rank's slot this rank's own
tensor (the ranks' other shards are in their own runs), so the layers compute with this
rank's shard repeated: the losses and metrics the script prints are not what the GPUs
would print, though every shape, and so every figure of memory, is."""

from __future__ import annotations

from dpprof.scenarios.names import FSDP2, TENSOR_PARALLEL

__all__ = ["sharded_values_note"]


def sharded_values_note(compute: bool, scenario: str, world_size: int) -> list[str]:
    """The note a ``--compute`` run of a scenario with sharded parameters gets (none
    otherwise)."""
    if not compute or world_size < 2 or scenario not in (FSDP2, TENSOR_PARALLEL):
        return []
    return [f"the parameters are sharded across the {world_size} ranks ({scenario}): a rank "
            "run here holds its own shards only, and its all-gathers put them in every other "
            "rank's slot, so the numbers the script computes with --compute (its losses and "
            "metrics) are not what the GPUs would compute; the shapes, and so the memory "
            "figures, are the same"]
