"""What a rung reports: its code, as a diff of the typical DataParallel loop
(:func:`code`), and its detail, the words of the fix's row (:func:`detail`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from dpprof.fixes.kinds.ddp_in_place import CODE_SETUP
from dpprof.measure.ladder_rungs import Rung
from dpprof.measure.rung_models import repeated_blocks
from dpprof.scenarios.names import DDP
from dpprof.scenarios.shards import shard_sizes
from dpprof.units import fmt_bytes

CODE_SINGLE_LOOP = """\
-model = nn.DataParallel(model.cuda())
+model = model.cuda()
"""
CODE_CHECKPOINT = """\
+from torch.utils.checkpoint import checkpoint
+
+def checkpointed(block):  # its activations are recomputed in backward
+    forward = block.forward
+    block.forward = lambda *a, **k: checkpoint(forward, *a, use_reentrant=False, **k)
+
+for block in {loop}:  # the {count} repeated {kind} blocks
+    checkpointed(block)
"""
CODE_FSDP = """\
+# torchrun --nproc-per-node {gpus} train.py
+from torch.distributed.fsdp import {imports}
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+model = model.cuda(rank)
"""
# CPUOffloadPolicy requires the parameters on the host when fully_shard runs
CODE_FSDP_HOST = """\
+# torchrun --nproc-per-node {gpus} train.py
+from torch.distributed.fsdp import {imports}
+dist.init_process_group("nccl")
+rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
-model = nn.DataParallel(model.cuda())
+# the model stays on the CPU: fully_shard keeps each rank's shards in pinned host memory
"""
CODE_FSDP_SHARD = """\
+for block in {loop}:  # the {count} repeated {kind} blocks, each sharded
+    fully_shard(block, reshard_after_forward={reshard}{policy})
+fully_shard(model, reshard_after_forward={reshard}{policy})  # the rest, at the root
+optimizer = torch.optim.AdamW(model.parameters())  # yours, made after fully_shard: over the shards
+loader = DataLoader(dataset, batch_size={per_rank},
+                    sampler=DistributedSampler(dataset))  # per-rank batch
"""
# FSDP2's own mixed precision: the all-gathers cast the float32 shards, gradients are
# reduced in float32 (no autocast in the loop)
CODE_FSDP_POLICY = """\
+mp = MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype=torch.float32)
"""
CODE_LOOP_PLAIN = """\
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
     optimizer.zero_grad()
     loss.backward()
     optimizer.step()"""
CODE_LOOP_BF16 = """\
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    with torch.autocast("cuda", dtype=torch.bfloat16):  # weights stay float32
+        loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
     optimizer.zero_grad()
     loss.backward()
     optimizer.step()"""
CODE_LOOP_FP16 = """\
+scaler = torch.amp.GradScaler("cuda")
 for inputs, targets in loader:
-    loss = loss_fn(model(inputs.cuda()), targets.cuda())
+    with torch.autocast("cuda", dtype=torch.float16):  # weights stay float32
+        loss = loss_fn(model(inputs.cuda(rank)), targets.cuda(rank))
     optimizer.zero_grad()
-    loss.backward()
-    optimizer.step()
+    scaler.scale(loss).backward()
+    scaler.step(optimizer)
+    scaler.update()"""


def accumulation_loop_code(rung: Rung, gpus: int) -> str:
    """The typical loop with ``rung.micro_batches`` micro-batches per optimizer step (under
    DDP the first ones inside ``no_sync()``), with the rung's autocast if any."""
    k = rung.micro_batches
    rank = "rank" if gpus > 1 else ""
    pad = "    " if rung.amp is None else "        "
    lines = ["-for inputs, targets in loader:",
             "+for i, (inputs, targets) in enumerate(loader):",
             "-    loss = loss_fn(model(inputs.cuda()), targets.cuda())",
             "-    optimizer.zero_grad()",
             "-    loss.backward()",
             "-    optimizer.step()",
             f"+    last = (i + 1) % {k} == 0  # {k} micro-batches per optimizer step"]
    if gpus > 1:
        lines.append("+    with contextlib.nullcontext() if last else model.no_sync():  "
                     "# one all-reduce")
    else:
        lines.append("+    with contextlib.nullcontext():")
    if rung.amp is not None:
        lines.append(f'+        with torch.autocast("cuda", dtype=torch.{rung.amp}):')
    lines += [f"+    {pad}loss = loss_fn(model(inputs.cuda({rank})), "
              f"targets.cuda({rank})) / {k}",
              "+        " + ("scaler.scale(loss).backward()" if rung.amp == "float16"
                            else "loss.backward()") + "  # the gradients add up in .grad",
              "+    if last:"]
    if rung.amp == "float16":
        lines += ["+        scaler.step(optimizer)", "+        scaler.update()"]
    else:
        lines.append("+        optimizer.step()")
    lines.append("+        optimizer.zero_grad()")
    if rung.amp == "float16":
        lines.insert(0, '+scaler = torch.amp.GradScaler("cuda")')
    return "\n".join(lines)


def code(rung: Rung, gpus: int, batch: int, model: nn.Module) -> str:
    """The rung's change to the typical DataParallel loop, as a diff."""
    per_rank = shard_sizes(batch, gpus)[0]
    rows = -(-per_rank // rung.micro_batches)  # the loader's batch: one micro-batch
    head = (CODE_SETUP.format(gpus=gpus, per_rank=rows) if gpus > 1 else CODE_SINGLE_LOOP)
    if rung.micro_batches > 1:
        head = head.replace("  # per-rank batch", f"  # {per_rank} rows per rank in "
                            f"{rung.micro_batches}")
        if gpus == 1:
            head += (f"+loader = DataLoader(dataset, batch_size={rows})  # {per_rank} rows "
                     f"in {rung.micro_batches}\n")
    words = blocks_words(model)
    if rung.reshard_after_forward is not None:
        return fsdp_code(rung, gpus, rows, words) + CODE_LOOP_PLAIN
    if rung.checkpoint:
        head += CODE_CHECKPOINT.format(**words)
    if rung.micro_batches > 1:
        # the loop's micro-batches before the last skip DDP's all-reduce, the last does not
        return "+import contextlib\n" + head + accumulation_loop_code(rung, gpus)
    loop = (CODE_LOOP_PLAIN if rung.amp is None else
            CODE_LOOP_BF16 if rung.amp == "bfloat16" else CODE_LOOP_FP16)
    if gpus == 1:
        loop = loop.replace("(rank)", "()")
    return head + loop


def fsdp_code(rung: Rung, gpus: int, per_rank: int, words: dict[str, Any]) -> str:
    """An FSDP2 rung's setup: the process group, the blocks checkpointed first where the
    rung does (the wrapped blocks are then sharded, as torchtitan orders them), FSDP2's
    mixed-precision policy where it has one, ``fully_shard`` per block and at the root."""
    policy = rung.param_dtype is not None
    imports = ", ".join([*(["CPUOffloadPolicy"] if rung.offload else []),
                         *(["MixedPrecisionPolicy"] if policy else []), "fully_shard"])
    out = (CODE_FSDP_HOST if rung.offload else CODE_FSDP).format(gpus=gpus, imports=imports)
    if rung.checkpoint:
        out += CODE_CHECKPOINT.format(**words)
    if policy:
        out += CODE_FSDP_POLICY.format(dtype=rung.param_dtype)
    args = ((", mp_policy=mp" if policy else "")
            + (", offload_policy=CPUOffloadPolicy()" if rung.offload else ""))
    return out + CODE_FSDP_SHARD.format(per_rank=per_rank, reshard=rung.reshard_after_forward,
                                        policy=args, **words)


def blocks_words(model: nn.Module) -> dict[str, Any]:
    """The words of :data:`CODE_CHECKPOINT` and :data:`CODE_FSDP_SHARD` for the model's
    repeated blocks: where they are (``blocks``), how many (``count``), their type
    (``kind``)."""
    blocks = repeated_blocks(model)
    names = [n for n, _ in blocks]
    parent = names[0].rpartition(".")[0] if names else ""
    same_parent = all(n.rpartition(".")[0] == parent for n in names) and parent
    where = parent if same_parent else "modules()  # " + ", ".join(names[:3])
    # whether iterating the parent gives the blocks and nothing else (a ModuleList of them,
    # not a Sequential that also holds a norm), so the code can name the parent alone
    whole = bool(same_parent) and len(list(model.get_submodule(parent).children())) == len(names)
    # the blocks as the code iterates them: the parent where it holds them alone, else each
    # by its qualified name
    loop = (f"model.{parent}" if whole else
            f"map(model.get_submodule, ({''.join(repr(n) + ', ' for n in names).rstrip()}))")
    return {"blocks": where, "count": len(blocks), "loop": loop,
            "kind": type(blocks[0][1]).__name__ if blocks else "",
            "names": names, "whole": whole}


def offload_words(host_bytes: dict[str, int], gpus: int) -> str:
    """CPU offload's part of a rung's detail: the host memory each rank keeps (read from the
    rank's real host tensors after its step, :func:`dpprof.emulator.fsdp.host_bytes`), and
    what it costs."""
    kept = sum(host_bytes.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    pinned = host_bytes.get("pinned", 0)
    return ("; CPUOffloadPolicy: each rank keeps its shards of the parameters "
            f"({fmt_bytes(host_bytes.get('parameters', 0))}), their gradients "
            f"({fmt_bytes(host_bytes.get('gradients', 0))}) and the optimizer state "
            f"({fmt_bytes(host_bytes.get('optimizer_state', 0))}) in host memory: "
            f"{fmt_bytes(kept)} per rank, {fmt_bytes(pinned)} of it pinned (page-locked), "
            f"{fmt_bytes(kept * gpus)} for the {gpus} ranks of one machine; each all-gather "
            "first copies the rank's shards to its GPU and each reduce-scatter's gradient "
            "shards are copied back, and the optimizer step runs on the CPU, so each step "
            "is slower (an H200 measured the lm workload's ZeRO-3 step at 0.033 s, "
            "0.089 s with CPU offload)")


def detail(rung: Rung, blocks: int, floor: str, per_rank: int = 0,
           host_bytes: dict[str, int] | None = None, gpus: int = 1) -> str:
    parts = []
    if rung.reshard_after_forward is not None:
        return (f"FSDP2 (torch's own fully_shard, emulated per rank over a fake process "
                f"group): {blocks} repeated blocks and the root sharded 1/N with their "
                "gradients and optimizer state; "
                + ("each block's parameters all-gathered for its forward and again for its "
                   "backward" if rung.reshard_after_forward else
                   "each block's parameters kept unsharded from its forward to its backward")
                + (f"; MixedPrecisionPolicy(param_dtype={rung.param_dtype}, reduce_dtype="
                   f"float32): the all-gathers cast the float32 shards to {rung.param_dtype}, "
                   f"so the unsharded parameters, activations and gradients are "
                   f"{rung.param_dtype}, the gradients reduce-scattered in float32; the "
                   "sharded parameters, gradients and optimizer state stay float32"
                   if rung.param_dtype is not None else "")
                + ("; the blocks checkpointed (non-reentrant) before sharding: their "
                   "activations recomputed in backward, one more forward of the blocks"
                   if rung.checkpoint else "")
                + (offload_words(host_bytes or {}, gpus) if rung.offload else "")
                + f"; the same {per_rank} rows per GPU; its reserved memory is simulated "
                "with the blocks of FSDP2's all-gather and reduce-scatter streams pooled "
                "apart, as the caching allocator keeps them (on an H200 "
                + ("7-11 % under with CPU offload" if rung.offload else
                   "within 2 % for three FSDP2 rungs of five, 6-10 % under for two")
                + ": its need may be understated)")
    if rung.micro_batches > 1:
        rows = -(-per_rank // rung.micro_batches)
        parts.append(f"{rung.micro_batches} micro-batches of {rows} rows per optimizer step "
                     f"(the same {per_rank} rows per GPU): {rung.micro_batches} forward/"
                     "backward passes per step"
                     + (f", the first {rung.micro_batches - 1} inside no_sync() (one "
                        "all-reduce per step)" if floor == DDP else ""))
    if rung.amp is not None:
        parts.append(f"forward and loss under torch.autocast('cuda', {rung.amp}): matmuls "
                     "and convolutions and the activations they save in "
                     f"{rung.amp}; parameters (master weights), gradients, optimizer state "
                     "and the loss stay float32"
                     + ("; GradScaler's scale and found-inf scalars (a few bytes) are not "
                        "emulated" if rung.amp == "float16" else ""))
    if rung.checkpoint:
        parts.append(f"{blocks} repeated blocks checkpointed (non-reentrant): their "
                     "activations are recomputed in backward, one more forward of the blocks")
    return f"on {floor}: " + "; ".join(parts)
