"""The names every layer shares: the scenarios' (as results, reports and ``--scenarios``
spell them), the setups the answers name a scenario by, and the phases of the measured loop
(as timelines and reports spell them).

| name              | what runs                                       | where the loss is      |
| ----------------- | ----------------------------------------------- | ---------------------- |
| `dp-loss-primary` | ``nn.DataParallel(model)``; outputs gathered    | on cuda:0, whole batch |
| `dp-loss-forward` | ``nn.DataParallel(ModelWithLoss(model, loss))`` | on each replica        |
| `ddp`             | ``DistributedDataParallel``, one rank per GPU   | on each rank           |
| `single`          | one GPU, batch = ceil(B / N)                    | the floor to approach  |

What each scenario does (how it wraps the model, its rows, its words) is its object in
:mod:`dpprof.scenarios.registry`; these names are here for the modules that only name them.
"""

from __future__ import annotations

DP_LOSS_PRIMARY = "dp-loss-primary"
DP_LOSS_FORWARD = "dp-loss-forward"
DDP = "ddp"
SINGLE = "single"
# not a paired scenario: what `dpprof run` names a script that places its own work on
# several GPUs (no DataParallel, no DDP)
MODEL_PARALLEL = "model-parallel"
# not a paired scenario either: a script that shards its model with FSDP2's fully_shard
FSDP2 = "fsdp2"
# nor this: a script that shards its layers with tensor parallelism (parallelize_module)
TENSOR_PARALLEL = "tensor-parallel"

# how the answers name a scenario's setup (Scenario.setup; dpprof.answers.answer)
DATA_PARALLEL, DISTRIBUTED, SPLIT_MODEL, ONE_GPU = "DataParallel", "DDP", "model parallel", \
    "one GPU"

# The phases of one step of the measured loop (dpprof.scenarios.measured_loop), in the
# plain step's order; an accumulating step zeroes the gradients first, then runs inputs to
# backward once per micro-batch.
INPUTS, ZERO_GRAD, FORWARD, LOSS, BACKWARD, OPTIMIZER = (
    "inputs", "zero_grad", "forward", "loss", "backward", "optimizer")
PHASES: tuple[str, ...] = (INPUTS, ZERO_GRAD, FORWARD, LOSS, BACKWARD, OPTIMIZER)
