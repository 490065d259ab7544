"""What rank 0 broadcast, given to the later ranks' runs.

On a machine, ``dist.broadcast_object_list(objs, src=0)`` hands every rank the objects
rank 0 put in the list: a run name, a seed, a path rank 0 chose. In ``dpprof run`` each
rank is its own emulated run and rank 0's runs first (:mod:`dpprof.script.rank_runs`), so
rank 0's objects cannot arrive while a later rank runs; they can be replayed. Rank 0's
run records each ``broadcast_object_list`` call in call order (:meth:`Broadcasts.record`):
the sending rank, how many objects, and the objects pickled where rank 0 sent them.
A later rank's run, at its k-th call, is given rank 0's k-th objects
(:meth:`Broadcasts.receive`) where the calls agree (the same sender and count) and the
objects were picklable without tensors (a tensor's values over meta tensors are stand-ins,
and its device is rank 0's). Otherwise that rank keeps its own objects, as before, counted
among the values made up, and :meth:`Broadcasts.notes` says which call and why."""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Broadcasts"]


@dataclass(frozen=True)
class _Call:
    """One of rank 0's ``broadcast_object_list`` calls."""

    sender: int  # the global rank that sent
    count: int  # objects in the list
    payload: bytes | None  # the objects pickled; None: not rank 0's, or not picklable
    why_not: str = ""  # why there is no payload


@dataclass
class _Received:
    """A later rank's calls: how many got rank 0's objects, and the others' reasons."""

    calls: int = 0
    given: int = 0
    kept: list[str] = field(default_factory=list)


class _HoldsTensor(Exception):
    pass


class _NoTensors(pickle.Pickler):
    """A pickler that refuses tensors and storages (their values are emulated)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            raise _HoldsTensor
        return NotImplemented


def _pickled(objects: Sequence[Any]) -> tuple[bytes | None, str]:
    buffer = io.BytesIO()
    try:
        _NoTensors(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(list(objects))
    except _HoldsTensor:
        return None, "rank 0's objects hold a tensor (its values are emulated)"
    except Exception as e:
        return None, f"rank 0's objects could not be pickled ({type(e).__name__}: {e})"
    return buffer.getvalue(), ""


class Broadcasts:
    """Rank 0's ``broadcast_object_list`` calls, replayed to the later ranks (see the
    module). One per ``dpprof run``; rank 0's run records, the later ranks' receive."""

    def __init__(self) -> None:
        self._calls: list[_Call] = []
        self._received: dict[int, _Received] = {}

    def record(self, sender: int, objects: Sequence[Any]) -> None:
        """Rank 0's run made a call: ``objects`` as they are after it (its own where it
        sent them)."""
        if sender != 0:
            self._calls.append(_Call(sender, len(objects), None,
                                     f"rank {sender} sent them, not rank 0"))
            return
        payload, why_not = _pickled(objects)
        self._calls.append(_Call(sender, len(objects), payload, why_not))

    def receive(self, rank: int, sender: int, object_list: list[Any]) -> bool:
        """A later rank's run made a call (``rank`` receiving from ``sender``, or sending
        where they are equal): whether ``object_list`` now holds rank 0's objects."""
        got = self._received.setdefault(rank, _Received())
        k = got.calls
        got.calls += 1
        if sender == rank:  # it sends: its own objects are what it broadcasts
            return False
        call = self._calls[k] if k < len(self._calls) else None
        where = f"call {k + 1}"
        if call is None:
            got.kept.append(f"{where}: rank 0 made {len(self._calls)} such call(s)")
            return False
        if (call.sender, call.count) != (sender, len(object_list)):
            got.kept.append(f"{where}: {len(object_list)} object(s) from rank {sender} where "
                            f"rank 0's was {call.count} from rank {call.sender}")
            return False
        if call.payload is None:
            got.kept.append(f"{where}: {call.why_not}")
            return False
        try:
            objects = pickle.loads(call.payload)
        except Exception as e:
            got.kept.append(f"{where}: rank 0's objects could not be unpickled "
                            f"({type(e).__name__}: {e})")
            return False
        object_list[:] = objects
        got.given += 1
        return True

    def notes(self, rank: int) -> list[str]:
        """What rank ``rank``'s run was given, in words (none where it made no call)."""
        got = self._received.get(rank)
        if got is None or got.calls == 0:
            return []
        received = got.given + len(got.kept)
        if not received:
            return []
        text = (f"rank {rank}'s broadcast_object_list: {got.given} of {received} call(s) "
                "received rank 0's objects as its run sent them")
        if got.kept:
            text += ("; its own objects kept (counted as values made up) at " +
                     "; ".join(got.kept[:4]) + ("; ..." if len(got.kept) > 4 else ""))
        return [text]
