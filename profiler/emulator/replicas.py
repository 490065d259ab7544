"""DataParallel replicas on equal shards, emulated once and replayed onto the other devices.

Each device's memory depends only on its own allocation sequence, and DataParallel's
replicas 1..m that see the same shard shapes run the same program on their devices: the
same forward (one after another in ``parallel_apply``) and the same backward (the autograd
engine runs them in reverse creation order, m first, each to completion, since every node
of replica k has a higher sequence number than every node of replica k - 1). So replica 1
runs for real and replicas 2..m are its event log with the device and the storages renamed,
emitted where the real run would have put them. Meta tensors only: with real numbers every
replica must compute (its gradient differs).

The group is one autograd node (:class:`_ReplicaGroup`) standing where replicas 1..m were:

* forward: replica 1 runs inside it on detached aliases of its parameters and inputs
  (an inner graph), saved-tensor hooks noting which outside storages that graph keeps;
  then each other member's events are replayed: fresh serials for storages internal to
  the replica, the member's own tensors for its parameters and inputs, new (meta) tensors
  for its outputs; a member's tensor that the template's graph keeps is held until the
  replayed backward frees it;
* backward: replica 1's inner backward runs first with the runtime recording its events
  aside (its output gradients handed over through stand-ins, so that they die where the
  real node drops them); the members' copies are emitted m..2, then replica 1's own.

Anything the replay cannot stand for (an event on another device, an output that aliases an
input, a storage of the template dying outside the replayed windows) sets
``rt.dedupe_failure`` and raises :class:`ReplayUnsafe`; the emulated backend then runs the
scenario again without the replay.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dpprof.emulator.vdevice import VirtualDevices

Ev = tuple[int, int, int, int]  # (device, serial, requested, allocated), signed


class ReplayUnsafe(RuntimeError):
    """The replay cannot stand for a replica; run the scenario without it."""


def _fail(rt: VirtualDevices, why: str) -> ReplayUnsafe:
    rt.dedupe_failure = why
    return ReplayUnsafe(why)


def _slots(replica: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(module, attribute, is_buffer) of every tensor ``replicate`` installed."""
    out = []
    for m in replica.modules():
        for key in getattr(m, "_former_parameters", {}) or {}:
            out.append((m, key, False))
        for key, b in m._buffers.items():
            if b is not None:
                out.append((m, key, True))
    return out


def _get(slot: tuple[nn.Module, str, bool]) -> torch.Tensor:
    m, key, is_buf = slot
    return m._buffers[key] if is_buf else m.__dict__[key]  # type: ignore[return-value]


def _set(slot: tuple[nn.Module, str, bool], t: torch.Tensor) -> None:
    m, key, is_buf = slot
    if is_buf:
        m._buffers[key] = t
    else:
        m.__dict__[key] = t
        former = getattr(m, "_former_parameters", None)
        if former is not None:
            former[key] = t


def _tensor_key(t: torch.Tensor) -> Any:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset(), t.requires_grad,
            t.device.type, t.layout)


class _Member:
    """One replica of the group: its module, its tensors (unique, in slot order), inputs."""

    def __init__(self, module: nn.Module, inp: tuple[Any, ...], kwargs: dict[str, Any],
                 device: int, index: int) -> None:
        self.module = module
        self.device = device
        self.index = index  # among DataParallel's replicas
        self.slots = _slots(module)
        uniq: dict[int, int] = {}
        self.slot_index: list[int] = []
        self.tensors: list[torch.Tensor] = []
        for s in self.slots:
            t = _get(s)
            i = uniq.setdefault(id(t), len(self.tensors))
            if i == len(self.tensors):
                self.tensors.append(t)
            self.slot_index.append(i)
        leaves, self.spec = tree_flatten((tuple(inp), dict(kwargs)))
        self.leaves = leaves
        self.input_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.tensors += [leaves[i] for i in self.input_pos]

    def release(self) -> None:
        """Drop the references to the replica (the real run holds none past forward)."""
        self.module = None  # type: ignore[assignment]
        self.slots, self.tensors, self.leaves = [], [], []

    def key(self) -> Any:
        storages: dict[int, int] = {}
        pattern = tuple(storages.setdefault(id(t.untyped_storage()), len(storages))
                        for t in self.tensors)
        others = []
        for x in self.leaves:
            if isinstance(x, torch.Tensor):
                others.append(_tensor_key(x))
            elif isinstance(x, (int, float, bool, str, type(None), torch.dtype)):
                others.append((type(x), x))
            else:
                others.append(("id", id(x)))
        return (self.spec, tuple(self.slot_index), tuple(_tensor_key(t) for t in self.tensors),
                pattern, tuple(others))


def group_replicas(
    rt: VirtualDevices, modules: Sequence[nn.Module], inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]], devices: Sequence[int], alone: Sequence[int] = (),
) -> list[list[_Member]]:
    """Groups of replicas (from index 1 on) to emulate as replayed groups, each a run of
    at least two consecutive replicas with equal shards, none on a device in ``alone``
    (DataParallel's output device: its share of the gradient is a view, not a copy)."""
    if not (rt.dedupe_replicas and rt.base.type == "meta" and torch.is_grad_enabled()
            and len(modules) >= 3 and hasattr(torch.autograd.graph, "get_gradient_edge")):
        return []
    members: list[_Member | None] = [None]
    keys: list[Any] = [None]
    for k in range(1, len(modules)):
        if devices[k] in alone:
            members.append(None)
            keys.append(None)
            continue
        inp = inputs[k] if isinstance(inputs[k], (list, tuple)) else (inputs[k],)
        m = _Member(modules[k], tuple(inp), kwargs_tup[k], devices[k], k)
        members.append(m)
        keys.append(m.key())
    groups = []
    k = 1
    while k < len(keys):
        stop = k + 1
        while keys[k] is not None and stop < len(keys) and keys[stop] == keys[k]:
            stop += 1
        if stop - k >= 2:
            groups.append([m for m in members[k:stop] if m is not None])
        k = stop
    return groups


class _Plan:
    """One walk of a window (:meth:`_Group._walk`): the template serials known before it,
    the new storages in order (with their labels), the steps on real tensors, the
    phantoms it added and dropped, and the window's columns."""

    def __init__(self, window: list[Ev], known: set[int], real_known: set[int]) -> None:
        self.window = window
        self.known = known
        self.real_known = real_known
        self.new: list[int] = []
        self.new_labels: list[str] = []
        self.real_steps: list[tuple[bool, int]] = []  # (a new tensor, else a free), serial
        self.phantom_add: set[int] = set()
        self.phantom_discard: set[int] = set()
        self.serials: list[int] = []
        self.requested: list[int] = []
        self.allocated: list[int] = []


class _Group:
    """The state the group's autograd node keeps between forward and backward."""

    def __init__(self, rt: VirtualDevices, members: list[_Member]) -> None:
        self.rt = rt
        self.members = members
        self.n_in = len(members[0].tensors)
        self.maps: list[dict[int, int]] = [{} for _ in members]  # template -> member serial
        # template serial -> the member's own storage (weakly: it dies as the real one would)
        self.real: list[dict[int, weakref.ref[Any]]] = [{} for _ in members]
        self.holds: list[dict[int, torch.Tensor]] = [{} for _ in members]
        self.phantoms: list[set[int]] = [set() for _ in members]  # template serials
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_tensor_pos: list[int] = []
        self.edges: list[Any] = []
        self.mask: list[bool] = []  # which outputs need a gradient
        self.leaves_in: list[torch.Tensor | None] = []
        self.watched: set[int] = set()
        self._plan: _Plan | None = None  # the last window's walk, for the other members

    # ---- forward ----------------------------------------------------------------------

    def forward(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        rt = self.rt
        first = self.members[0]
        own = list(flat[: self.n_in])
        # Replica 1's tensors as the inner graph's inputs: not leaves (an AccumulateGrad
        # would keep them alive until the graph dies) but outputs of a pass-through node
        # over an untracked stand-in leaf, which is what the gradients are taken against.
        self.leaves_in = []
        aliases = []
        for t in own:
            if t.requires_grad:
                with torch._C._DisableTorchDispatch():
                    leaf = torch.empty((), dtype=t.dtype, device="meta").expand(t.shape)
                leaf.requires_grad_(True)
                self.leaves_in.append(leaf)
                with torch.enable_grad():
                    aliases.append(_Bind.apply(leaf, t.detach()))
            else:
                self.leaves_in.append(None)
                aliases.append(t.detach())
        n_slots_t = len(own) - len(first.input_pos)
        for s, i in zip(first.slots, first.slot_index, strict=True):
            _set(s, aliases[i])
        leaves = list(first.leaves)
        for j, pos in enumerate(first.input_pos):
            leaves[pos] = aliases[n_slots_t + j]
        inp, kwargs = tree_unflatten(leaves, first.spec)
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(id(t.untyped_storage()))
            with torch._C._DisableTorchDispatch():
                return t.detach()

        start = len(rt.events)
        counts_before = [dict(c) for c in rt.replayed_counts]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack), \
                rt.device(first.device), rt.category("activations"):
            out = first.module(*inp, **kwargs)
        window: list[Ev] = list(rt.events[start:])
        _scale_counts(counts_before, rt.replayed_counts, len(self.members))
        out_leaves, self.out_spec = tree_flatten(out)
        del out
        self.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        self.out_tensor_pos = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        outs1 = [out_leaves[i] for i in self.out_tensor_pos]
        del out_leaves
        allocated = {ev[1] for ev in window if ev[2] > 0 or ev[3] > 0}
        out_serials: dict[int, torch.Tensor] = {}
        for o in outs1:
            rec = rt.record_of(o)
            if (rec is None or rec[0] not in allocated or rec[0] in out_serials
                    or o.storage_offset() != 0 or o.layout != torch.strided):
                raise _fail(rt, "a replica's output is not a fresh storage of its own")
            out_serials[rec[0]] = o
        self.edges = [torch.autograd.graph.get_gradient_edge(o) if o.requires_grad else None
                      for o in outs1]
        self.mask = [e is not None for e in self.edges]
        # the outside storages (parameters, inputs) of the template and of each member
        results: list[list[torch.Tensor]] = [
            [o.detach() for o in outs1]]
        for k in range(1, len(self.members)):
            mine = list(flat[k * self.n_in: (k + 1) * self.n_in])
            smap, real, holds = self.maps[k], self.real[k], self.holds[k]
            for t1, tk in zip(own, mine, strict=True):
                r1, rk = rt.record_of(t1), rt.record_of(tk)
                if r1 is None or rk is None:
                    continue
                smap[r1[0]] = rk[0]
                real[r1[0]] = weakref.ref(tk.untyped_storage())
                if id(t1.untyped_storage()) in saved:
                    holds[r1[0]] = tk
            outs_k: dict[int, torch.Tensor] = {}

            def make_output(serial1: int, serial_k: int, device: int,
                            outs_k: dict[int, torch.Tensor] = outs_k) -> torch.Tensor | None:
                o = out_serials.get(serial1)
                if o is None:
                    return None
                with torch._C._DisableTorchDispatch():
                    t = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype,
                                            device="meta")
                rec = rt.record_of(o)
                assert rec is not None
                rt.adopt(t, device, serial_k, rec[2])
                outs_k[serial1] = t
                return t

            self._replay(window, k, make_output)
            produced = []
            for o in outs1:
                rec = rt.record_of(o)
                assert rec is not None
                t = outs_k[rec[0]]
                if id(o.untyped_storage()) in saved:
                    holds[rec[0]] = t
                produced.append(t)
            results.append(produced)
        # the template's storages that members mirror as phantoms must die in the backward
        self.watched = set().union(*self.phantoms[1:])
        rt.watch(self.watched)
        for m in self.members:
            m.release()
        return [t for r in results for t in r]

    def _replay(self, window: list[Ev], k: int, make: Any) -> None:
        """Emit ``window`` (the template's events) as member ``k``'s.

        What the replay does at each event depends only on the template's serials (known to
        the member or new, a real tensor of the member's or a phantom), and every member
        starts a window knowing the same template serials: the first member's walk is kept
        as a :class:`_Plan` that the others follow (their new storages numbered as one
        block, the window's serials mapped in one pass, a Python step only where a storage
        is a real tensor). A member whose known serials differ walks the window itself.
        """
        smap, real = self.maps[k], self.real[k]
        plan = self._plan
        if (plan is not None and plan.window is window and smap.keys() == plan.known
                and real.keys() == plan.real_known):
            self._follow(plan, k, make)
            return
        self._plan = self._walk(window, k, make)

    def _walk(self, window: list[Ev], k: int, make: Any) -> _Plan:
        rt = self.rt
        dev1 = self.members[0].device
        dev = self.members[k].device
        smap, real, holds, phantoms = self.maps[k], self.real[k], self.holds[k], self.phantoms[k]
        plan = _Plan(window, set(smap), set(real))
        serials: list[int] = []
        for d, s, req, alloc in window:
            if d != dev1:
                raise _fail(rt, f"a replica touched device {d} besides its own")
            sk = smap.get(s)
            if sk is None:  # a new storage
                if req < 0 or alloc < 0:
                    raise _fail(rt, "a replica freed a storage the replay does not know")
                sk = rt.new_serial()
                smap[s] = sk
                label = rt.label_of(s)
                rt.set_label(sk, label)
                plan.new.append(s)
                plan.new_labels.append(label)
                t = make(s, sk, dev)
                if t is None:
                    phantoms.add(s)
                    plan.phantom_add.add(s)
                else:
                    real[s] = weakref.ref(t.untyped_storage())
                    plan.real_steps.append((True, s))
            elif req < 0 or alloc < 0 or (req == 0 and alloc == 0):
                if s in real:
                    st = real.pop(s)()
                    holds.pop(s, None)
                    if st is None or not rt.disown_storage(st):
                        raise _fail(rt, "a replica's storage died before its replay")
                    plan.real_steps.append((False, s))
                else:
                    phantoms.discard(s)
                    plan.phantom_discard.add(s)
            else:
                raise _fail(rt, "a replica resized a storage")
            serials.append(sk)
        plan.serials = [ev[1] for ev in window]
        plan.requested = [ev[2] for ev in window]
        plan.allocated = [ev[3] for ev in window]
        # nothing above emits (no storage of the runtime dies in the loop): emit at once
        rt.emit_many(dev, serials, plan.requested, plan.allocated)
        return plan

    def _follow(self, plan: _Plan, k: int, make: Any) -> None:
        """:meth:`_walk`'s steps for member ``k``, taken from ``plan``."""
        rt = self.rt
        dev = self.members[k].device
        smap, real, holds, phantoms = self.maps[k], self.real[k], self.holds[k], self.phantoms[k]
        fresh = rt.new_serials(len(plan.new))
        smap.update(zip(plan.new, fresh, strict=True))
        rt.set_labels(zip(fresh, plan.new_labels, strict=True))
        for is_new, s in plan.real_steps:
            if is_new:
                t = make(s, smap[s], dev)
                if t is None:
                    raise _fail(rt, "a replica's storage is a tensor for one member only")
                real[s] = weakref.ref(t.untyped_storage())
            else:
                st = real.pop(s)()
                holds.pop(s, None)
                if st is None or not rt.disown_storage(st):
                    raise _fail(rt, "a replica's storage died before its replay")
        phantoms |= plan.phantom_add
        phantoms -= plan.phantom_discard
        rt.emit_many(dev, list(map(smap.__getitem__, plan.serials)), plan.requested,
                     plan.allocated)

    # ---- backward ---------------------------------------------------------------------

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        rt = self.rt
        rt.unwatch(self.watched)
        if any(s in self.watched for s in rt.watched_freed):
            raise _fail(rt, "a replica's storage died outside its forward and backward")
        n_out = len(self.out_tensor_pos)
        g1 = list(grads[:n_out])
        # replica 1's output gradients through stand-ins handed over by a pre-hook, so that
        # they die where the real node drops them
        roots, root_grads, standins = [], [], []
        by_node: dict[Any, dict[int, list[torch.Tensor]]] = {}
        for edge, g in zip(self.edges, g1, strict=True):
            if edge is None:
                continue
            if g is None:
                raise _fail(rt, "a replica's output got no gradient")
            with torch._C._DisableTorchDispatch():
                s = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device="meta")
                placeholder = torch.empty((), dtype=g.dtype, device="meta").expand(g.shape)
            rec = rt.record_of(g)
            if rec is None or g.storage_offset() != 0:
                raise _fail(rt, "a replica's output gradient is not a storage of its own")
            rt.transfer(g, s)
            standins.append(rec[0])
            by_node.setdefault(edge.node, {})[edge.output_nr] = [s]
            del s
            roots.append(edge)
            root_grads.append(placeholder)
        del g1, g
        handles = []
        for node, holders in by_node.items():
            def hook(grad_outputs: tuple[Any, ...],
                     holders: dict[int, list[torch.Tensor]] = holders) -> tuple[Any, ...]:
                out = list(grad_outputs)
                for nr, holder in holders.items():
                    if holder:
                        out[nr] = holder.pop()
                return tuple(out)
            handles.append(node.register_prehook(hook))
        wanted = [i for i, a in enumerate(self.leaves_in) if a is not None]
        leaves = [a for a in self.leaves_in if a is not None]
        counts_before = [dict(c) for c in rt.replayed_counts]
        rt.start_recording()
        try:
            got = torch.autograd.grad(roots, leaves, root_grads,
                                      allow_unused=True) if roots else ()
        finally:
            window = rt.stop_recording()
            for h in handles:
                h.remove()
        _scale_counts(counts_before, rt.replayed_counts, len(self.members))
        del root_grads, roots, leaves
        self.edges = []
        got_by_serial: dict[int, torch.Tensor] = {}
        for g in got:
            if g is None:
                continue
            rec = rt.record_of(g)
            if rec is None or rec[0] in got_by_serial or g.storage_offset() != 0:
                raise _fail(rt, "a replica's parameter gradient is not a storage of its own")
            got_by_serial[rec[0]] = g
        result: list[list[torch.Tensor | None]] = [[None] * self.n_in for _ in self.members]
        for i, g in zip(wanted, got, strict=True):
            result[0][i] = g
        got_serial = {id(g): serial for serial, g in got_by_serial.items()}
        for k in range(len(self.members) - 1, 0, -1):
            gk = grads[k * n_out: (k + 1) * n_out]
            smap, real = self.maps[k], self.real[k]
            grads_k = [g for g, m in zip(gk, self.mask, strict=True) if m]
            del gk
            if any(g is None for g in grads_k):
                raise _fail(rt, "a replica's output got no gradient")
            for s1, g in zip(standins, grads_k, strict=True):
                assert g is not None
                rec = rt.record_of(g)
                if rec is None or g.storage_offset() != 0:
                    raise _fail(rt, "a replica's output gradient is not a storage of its own")
                smap[s1] = rec[0]
                real[s1] = weakref.ref(g.untyped_storage())
            del grads_k
            made: dict[int, torch.Tensor] = {}

            def make_grad(serial1: int, serial_k: int, device: int,
                          made: dict[int, torch.Tensor] = made) -> torch.Tensor | None:
                g = got_by_serial.get(serial1)
                if g is None:
                    return None
                with torch._C._DisableTorchDispatch():
                    t = torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device="meta")
                rec = rt.record_of(g)
                requested = rec[2] if rec is not None else int(g.untyped_storage().nbytes())
                rt.adopt(t, device, serial_k, requested)
                made[serial1] = t
                return t

            self._replay(window, k, make_grad)
            if self.phantoms[k] or self.holds[k]:
                raise _fail(rt, "a replica's storage outlived its backward")
            for i, g in zip(wanted, got, strict=True):
                if g is not None:
                    result[k][i] = made[got_serial[id(g)]]
            self.real[k] = {}
        rt.publish(window)
        self.leaves_in = []
        return [g for r in result for g in r]


def _scale_counts(before: list[dict[str, int]], counts: list[dict[str, int]],
                  members: int) -> None:
    """Choices the template made (kernel counters) count once per member replayed."""
    for was, now in zip(before, counts, strict=True):
        for name, n in list(now.items()):
            now[name] = n + (n - was.get(name, 0)) * (members - 1)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _Bind(torch.autograd.Function):
    """``tensor`` (a detached alias) as a differentiable function of ``leaf``: gradients
    pass through unchanged; the node keeps neither."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        ctx.mark_non_differentiable()
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ReplicaGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: _Group, *flat: torch.Tensor):  # type: ignore[no-untyped-def]
        ctx.set_materialize_grads(False)
        outs = group.forward(flat)
        ctx.group = group
        needs = group.mask * len(group.members)
        ctx.mark_non_differentiable(*[o for o, n in zip(outs, needs, strict=True) if not n])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):  # type: ignore[no-untyped-def]
        group: _Group = ctx.group
        ctx.group = None
        return (None, *group.backward(grads))


def run_group(rt: VirtualDevices, members: list[_Member]) -> list[Any]:
    """A group from :func:`group_replicas` as one replayed node; the replicas' outputs, in
    order."""
    group = _Group(rt, members)
    flat = [t for m in members for t in m.tensors]
    outs = _ReplicaGroup.apply(group, *flat)
    rt.replayed_replicas += len(members) - 1
    n_out = len(group.out_tensor_pos)
    results = []
    for k in range(len(members)):
        leaves = list(group.out_leaves)
        for pos, t in zip(group.out_tensor_pos, outs[k * n_out: (k + 1) * n_out], strict=True):
            leaves[pos] = t
        results.append(tree_unflatten(leaves, group.out_spec))
    return results
