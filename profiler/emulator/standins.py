"""Two of torch's modules stood in for during an emulation, until something needs the real one.

An eager training step over meta tensors imports two modules whose work it never needs,
together about 1.6 CPU-seconds of a fresh ``dpprof`` process (twice the emulation itself):

* ``torch._dynamo`` (about 1.3 s): ``Optimizer.step`` (``_use_grad_for_differentiable``)
  imports it to call ``torch._dynamo.graph_break()``, and the functions torch wraps in
  ``torch._disable_dynamo`` (``Optimizer.zero_grad``, the foreach kernels' dispatcher)
  import it on their first call to wrap themselves in ``torch._dynamo.disable``. Outside a
  compiled region both are no-ops for the program: ``graph_break`` is an empty function
  that only the tracer reads, and ``disable(fn)`` runs ``fn`` with a frame callback that is
  already off.
* ``torch.fx.experimental.symbolic_shapes`` (about 0.3 s, sympy): every ``torch._check``
  (the meta kernels' argument checks) imports it for ``expect_true``, and the meta kernels
  and refs call a few of its helpers (``sym_eq``, ``guard_or_false``...). On concrete
  values (``bool``, ``int``: no shape environment, as over meta tensors) each is one line:
  the value itself, ``==``, ``&``.

While :func:`standing_in` is active (for a module not imported before) the module is a
:class:`StandIn` that answers those names itself, on the concrete values only, and hands
anything else (a symbolic value, any other name, a submodule) to the real module, which it
loads then with ``load_real`` (given by the caller: the emulation installs hooks on torch
that must not be seen by an import). The functions ``disable`` wrapped call the real
``disable`` once the real module is loaded, so nothing outlives the emulation: when it ends
the stand-ins are removed, and a later import loads the real modules.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import operator
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

DYNAMO = "torch._dynamo"
SYMBOLIC_SHAPES = "torch.fx.experimental.symbolic_shapes"
SYMPY = "sympy"
SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

LoadReal = Callable[[str], types.ModuleType]


def real_module(name: str) -> types.ModuleType | None:
    """The real module ``name`` when it is loaded, else None."""
    mod = sys.modules.get(name)
    return None if mod is None or isinstance(mod, StandIn) else mod


class StandIn(types.ModuleType):
    """A module answering some names itself; any other name loads the real module."""

    def __init__(self, name: str, load_real: LoadReal) -> None:
        super().__init__(name, __doc__)
        self._load_real = load_real
        # the module's own __getattr__ (PEP 562), not the class's: a name found in the
        # module's dict is then read as fast as from any module
        self.__dict__["__getattr__"] = self._missing
        # an import of a loaded module reads __spec__._initializing (absent on None: an
        # exception made and cleared at every ``import``)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)
        self.__spec__._initializing = False  # type: ignore[attr-defined]

    def real(self) -> types.ModuleType:
        return self._load_real(self.__name__)

    def _missing(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.real(), name)


class _Package(StandIn):
    """A stand-in for a package."""

    @property
    def __path__(self) -> list[str]:  # type: ignore[override]
        # ``import pkg.x`` and ``from pkg import x`` read the package's path first: the
        # real one's
        return list(self.real().__path__)


class DynamoStandIn(_Package):
    """``torch._dynamo``'s ``graph_break`` and ``disable``."""

    def graph_break(self, msg: str = "") -> None:
        """``torch._dynamo.graph_break``: read by the tracer only; in eager code, nothing."""
        real = real_module(DYNAMO)
        if real is not None:
            real.graph_break(msg)

    def disable(self, fn: Any = None, recursive: bool = True, **kw: Any) -> Any:
        """``torch._dynamo.disable``: ``fn`` as it is until the real module is loaded, then
        the real ``disable(fn, ...)`` (made once)."""
        if fn is None:
            return functools.partial(self.disable, recursive=recursive, **kw)
        made: list[Any] = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not made:
                real = real_module(DYNAMO)
                if real is None:
                    return fn(*args, **kwargs)
                made.append(real.disable(fn, recursive, **kw))
            return made[0](*args, **kwargs)

        return call


def _plain(x: Any) -> bool:
    """A concrete int/bool, or a (nested) list/tuple of them."""
    if isinstance(x, (list, tuple)):
        return all(map(_plain, x))
    return isinstance(x, int) and not isinstance(x, SYM_TYPES)


# symbolic_shapes' helpers that return a plain argument as it is (a bool; an int too where
# named), and ask the real module for anything symbolic
_PASS_THROUGH: dict[str, tuple[type, ...]] = {
    "guard_size_oblivious": (bool,), "guard_or_false": (bool,), "guard_or_true": (bool,),
    "statically_known_true": (bool,), "guarding_hint_or_throw": (bool, int),
}


class SymbolicShapesStandIn(StandIn):
    """``symbolic_shapes``' helpers that the meta kernels call, on concrete values; each
    is the real function's branch for a non-symbolic argument (torch 2.4-2.13)."""

    HELPERS = ("expect_true", "has_guarding_hint", "is_nested_int", "sym_eq", "sym_and",
               "sym_or")
    def __init__(self, name: str, load_real: LoadReal) -> None:
        super().__init__(name, load_real)
        for helper in self.HELPERS:  # module attributes: no method bound per lookup
            setattr(self, helper, getattr(self, helper))
        for helper, plain in _PASS_THROUGH.items():
            setattr(self, helper, self._pass_through(helper, plain))

    def _pass_through(self, helper: str, plain: tuple[type, ...]) -> Callable[[Any], Any]:
        def fn(a: Any) -> Any:
            if type(a) in plain:
                return a
            return getattr(self.real(), helper)(a)

        fn.__name__ = helper
        return fn

    def expect_true(self, a: Any, skip: int = 0) -> Any:
        if type(a) is bool:
            return a
        return self.real().expect_true(a, skip + 1)

    def has_guarding_hint(self, a: Any) -> Any:
        if not isinstance(a, SYM_TYPES):
            return True
        return self.real().has_guarding_hint(a)

    def is_nested_int(self, s: Any) -> Any:
        if not isinstance(s, torch.SymInt):
            return False
        return self.real().is_nested_int(s)

    def sym_eq(self, x: Any, y: Any) -> Any:
        if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
            if len(x) != len(y):
                return False
            if all(type(a) is int for a in x) and all(type(b) is int for b in y):
                return tuple(x) == tuple(y)  # shapes: each pair ==, joined by &
        if _plain(x) and _plain(y):
            return _sym_eq(x, y)
        return self.real().sym_eq(x, y)

    def sym_and(self, x: Any, *others: Any) -> Any:
        for y in others:
            x = operator.and_(x, y)
        return x

    def sym_or(self, x: Any, *others: Any) -> Any:
        for y in others:
            x = operator.or_(x, y)
        return x


def _sym_eq(x: Any, y: Any) -> Any:
    """``sym_eq`` on concrete values: ``==``, element-wise joined by ``&``."""
    if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return False
        return functools.reduce(operator.and_, map(_sym_eq, x, y), True)
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    raise AssertionError(f"unexpected sym_eq between {type(x)} {type(y)}")


class _NoSympyExpression:
    """Nothing is an instance: without sympy loaded, no sympy expression exists."""


class SympyStandIn(_Package):
    """``sympy.Basic`` for the ``isinstance(x, sympy.Basic)`` of torch's type promotion
    (``torch._prims_common.elementwise_dtypes``, every elementwise meta kernel): a class
    nothing is an instance of while sympy is not loaded (no sympy expression can exist),
    sympy's own once it is."""

    def __init__(self, name: str, load_real: LoadReal) -> None:
        super().__init__(name, load_real)
        self.Basic = _NoSympyExpression  # sympy's once loaded (see load_real)


STAND_INS: dict[str, type[StandIn]] = {
    DYNAMO: DynamoStandIn,
    SYMBOLIC_SHAPES: SymbolicShapesStandIn,
    SYMPY: SympyStandIn,
}


_NEEDS = {DYNAMO: (SYMBOLIC_SHAPES, SYMPY), SYMBOLIC_SHAPES: (SYMPY,)}


class _Loaded(importlib.abc.Loader):
    """A submodule the real module imported as it loaded (the import in progress asked the
    stand-in's ``__path__``, which loaded it): that module, unchanged."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__ is not self.spec:  # module_from_spec set it to ours
            with contextlib.suppress(AttributeError):
                module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        module = sys.modules.get(name)
        if module is None or not any(name.startswith(n + ".") and real_module(n) is not None
                                     for n in self.names):
            return None
        return importlib.machinery.ModuleSpec(name, _Loaded(module))


def _parent_attr(name: str) -> tuple[types.ModuleType | None, str]:
    parent, _, child = name.rpartition(".")
    return (sys.modules.get(parent) if parent else _NO_PARENT), child


_NO_PARENT = types.ModuleType("(top level)")  # a top-level module's attribute goes nowhere


@contextlib.contextmanager
def standing_in(load_real: LoadReal) -> Iterator[None]:
    """Install a stand-in for each module of :data:`STAND_INS` not loaded yet, for the
    duration."""
    installed: dict[str, StandIn] = {}
    for name, cls in STAND_INS.items():
        parent, child = _parent_attr(name)
        if name in sys.modules or parent is None:
            continue
        installed[name] = stand_in = cls(name, load_real)
        sys.modules[name] = stand_in
        setattr(parent, child, stand_in)
    if not installed:
        yield
        return
    finder = _Finder(list(installed))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        for name, stand_in in installed.items():
            _remove(name, stand_in)


def _remove(name: str, stand_in: StandIn) -> None:
    if sys.modules.get(name) is stand_in:
        del sys.modules[name]
    parent, child = _parent_attr(name)
    if parent is not None and parent.__dict__.get(child) is stand_in:
        delattr(parent, child)


def load_real(name: str) -> types.ModuleType:
    """Import the real module ``name`` in place of its stand-in."""
    real = real_module(name)
    if real is not None:
        return real
    for dependency in _NEEDS.get(name, ()):  # the names it imports from them: the real ones
        load_real(dependency)
    stand_in = sys.modules.get(name)
    if isinstance(stand_in, StandIn):
        _remove(name, stand_in)
    real = importlib.import_module(name)
    if isinstance(stand_in, SympyStandIn):  # code that kept the stand-in: sympy's class now
        stand_in.Basic = real.Basic
    return real
