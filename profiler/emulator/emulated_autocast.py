"""Autocast re-enacted over meta tensors: ``torch.autocast("cuda", dtype)`` for tensors on
any device (:class:`EmulatedAutocast`, by CUDA's op lists, :mod:`dpprof.emulator.
autocast_lists`), the step's autocast regions (:class:`StepAutocast`) and the names CUDA's
autocast answers to (:class:`CudaAutocastNames`)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dpprof.emulator.autocast_lists import (
    BANNED_MESSAGE,
    ENTRY_POINT_MARK,
    FP32,
    FP32_APPEND_DTYPE,
    FP32_SET_OPT_DTYPE,
    LOWER_PRECISION_FP,
    PROMOTE,
    cuda_entry_points,
)
from dpprof.emulator.patcher import Patcher

# ---- autocast --------------------------------------------------------------------------

# CUDA's lists: dpprof.emulator.autocast_lists (all of them, table-driven). What follows is
# the part of the CPU lists (autocast_mode.cpp, KERNEL_CPU) that the re-enactment under
# ``ops="cpu"`` covers, to check it against torch's own CPU autocast on real tensors, to
# the byte (tests/test_ladder.py): the low-precision ops models reach through
# torch.nn.functional / torch / Tensor.__matmul__ (what nn.Linear and nn.Conv* call), and
# of the float32 ops the losses (softmax and the norms run in the input's dtype on CPU),
# cross_entropy_loss among them.
_LOWER = [(F, "linear"), (F, "conv1d"), (F, "conv2d"), (F, "conv3d"),
          (torch, "matmul"), (torch, "mm"), (torch, "bmm"), (torch, "addmm"),
          (torch, "baddbmm"), (torch.Tensor, "__matmul__"), (torch.Tensor, "matmul"),
          (F, "scaled_dot_product_attention")]
_FP32_CPU = [(F, "cross_entropy"), (F, "nll_loss"), (F, "mse_loss"), (F, "l1_loss"),
             (F, "binary_cross_entropy_with_logits")]
AUTOCAST_OP_LISTS = ("cuda", "cpu")
_HALF_TO_FLOAT = {"softmax": torch._softmax, "log_softmax": torch._log_softmax}


def _names_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _eligible(x: Any) -> bool:
    """autocast_mode.h's ``is_eligible``: a floating tensor, not float64 (and on the
    autocast's device, which every tensor of the emulator stands for)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _names_dims(dim: Any) -> bool:
    """Whether ``dim`` names dimensions (a Dimname overload, on no list)."""
    return isinstance(dim, str) or (isinstance(dim, (list, tuple))
                                    and any(isinstance(d, str) for d in dim))


def _tensors(values: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_tensors(v))
    return found


def _input_first(args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """A call's input, its other positional arguments and its keywords (``torch.sum(input=x,
    dim=1)`` as ``torch.sum(x, dim=1)``)."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("input", None), (), rest


def _wrap_append_dtype(fn: Any) -> Any:
    """CUDA's fp32_append_dtype (``norm.Scalar``, ``norm.ScalarOpt_dim``): an eligible
    input is not cast; the op is redispatched to its overload taking a dtype, float32."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        x, args, kwargs = _input_first(args, kwargs)
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if (not _eligible(x) or _names_dtype(args, kwargs) or _names_dims(dim)
                or kwargs.get("out") is not None):
            return fn(x, *args, **kwargs)
        if not args and "p" not in kwargs:
            args = (2,)  # norm.Scalar's default p; the dtype overloads have none
        return fn(x, *args, **{**kwargs, "dtype": torch.float32})
    return wrapped


def _banned(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(BANNED_MESSAGE)


def _sum(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """``sum`` under CUDA autocast (fp32_set_opt_dtype): float32 for an eligible input
    (floating, not float64)."""
    if t.is_floating_point() and t.dtype != torch.float64:
        return t.sum(*dims, dtype=torch.float32)
    return t.sum(*dims)


def cross_entropy_composite(input: torch.Tensor, target: torch.Tensor,
                            weight: torch.Tensor | None = None,
                            size_average: bool | None = None, ignore_index: int = -100,
                            reduce: bool | None = None, reduction: str = "mean",
                            label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` as ATen's composite ``cross_entropy_loss`` (LossNLL.cpp) runs it,
    op by op, so that autocast acts on each op as on a GPU: CUDA's lists do not name
    ``cross_entropy_loss``, so it is not cast; it calls ``log_softmax`` with the input's
    own dtype (which the fp32_set_opt_dtype policy keeps: a bfloat16 result, saved for
    backward), then ``nll_loss`` (float32 policy: a float32 copy of the log-probabilities,
    which ``nll_loss`` saves). Without autocast it computes what ``F.cross_entropy``
    computes."""
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    class_dim = 0 if input.dim() == 1 else 1
    classes = input.shape[class_dim]
    log_probs = input.log_softmax(class_dim, input.dtype)
    shape = [1] * input.dim()
    shape[class_dim] = classes
    if input.shape == target.shape:  # class probabilities: cross_entropy_loss_prob_target
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / classes
        terms = log_probs * target
        if weight is not None:
            terms = terms * weight.view(shape)
        if reduction == "none":
            return -_sum(terms, class_dim)
        total = -_sum(terms)
        return total / (input.numel() / classes) if reduction == "mean" else total
    nll = F.nll_loss(log_probs, target, weight, ignore_index=ignore_index,
                     reduction=reduction)
    if label_smoothing <= 0:
        return nll
    # cross_entropy_loss_label_smoothing
    ignored = target == ignore_index
    spread = log_probs if weight is None else log_probs * weight.view(shape)
    smooth = -_sum(spread, class_dim)
    smooth.masked_fill_(ignored, 0.0)
    if reduction == "mean":
        kept = ~ignored
        smooth = smooth.sum() / (kept.sum() if weight is None
                                 else weight.gather(0, target.masked_select(kept)).sum())
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / classes)


_REDUCTIONS = ("none", "mean", "sum")  # torch._reduction.get_enum's order


def _cross_entropy_loss(input: torch.Tensor, target: torch.Tensor,
                        weight: torch.Tensor | None = None, reduction: int = 1,
                        ignore_index: int = -100, label_smoothing: float = 0.0
                        ) -> torch.Tensor:
    """``torch._C._nn.cross_entropy_loss`` (what ``F.cross_entropy`` calls, its reduction
    as torch's enum) as :func:`cross_entropy_composite`."""
    return cross_entropy_composite(input, target, weight, ignore_index=ignore_index,
                                   reduction=_REDUCTIONS[reduction],
                                   label_smoothing=label_smoothing)


class EmulatedAutocast:
    """``torch.autocast("cuda", dtype)`` for tensors on any device (meta included).

    Autocast's dispatch keys only act on CUDA tensors, so over meta tensors the casts are
    re-enacted at the Python bindings of the listed ops (every op on CUDA's lists:
    :mod:`dpprof.emulator.autocast_lists`), by policy: floating arguments of the
    low-precision ops are cast to ``dtype`` (``.to``, recorded by autograd as on a GPU),
    those of the float32 ops to float32; the fp32_set_opt_dtype ops (softmax, sum, cumsum,
    prod, the linalg norms) are asked for a float32 result unless given a dtype, norm's
    fp32_append_dtype overloads get a float32 dtype appended, the promote ops run in the
    widest floating dtype among their arguments, and ``binary_cross_entropy`` raises as
    CUDA's autocast makes it raise; ``F.cross_entropy``'s binding runs op by op
    (:func:`cross_entropy_composite`). Casts of leaf tensors that require grad (the
    weights) are cached until :meth:`clear_cache` (autocast clears its cache when the
    outermost region exits: once per forward), so each weight is copied once per forward
    and the copy lives as long as autograd saves it. Parameters, gradients and optimizer
    state stay float32.

    ``ops``: whose op lists, ``"cuda"`` (the target GPU's) or ``"cpu"`` (torch's CPU
    autocast, to check the re-enactment against ``torch.autocast("cpu")`` on real tensors).
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, ops: str = "cuda") -> None:
        if ops not in AUTOCAST_OP_LISTS:
            raise ValueError(f"autocast op lists {ops!r}: choose from {AUTOCAST_OP_LISTS}")
        self.dtype = dtype
        self.ops = ops
        self._cache: dict[int, torch.Tensor] = {}
        self._patcher = Patcher()
        self._outer_suspended = 0
        self.casts = 0
        # Off between the region's end and the next forward (a scenario's region spans the
        # step): nothing cast in backward is kept for the next forward. A checkpointed
        # block's recompute enters a region of its own, as torch's does (checkpoint
        # recorded torch.is_autocast_enabled("cuda") and the dtype in forward), whose
        # cache dies with it: its casts live as long as the recomputed graph saves them.
        self.caching = True

    def clear_cache(self) -> None:
        self._cache.clear()

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if isinstance(x, torch.Tensor):
            if not x.is_floating_point() or x.dtype == dtype or x.dtype == torch.float64:
                return x
            if x.is_leaf and x.requires_grad and torch.is_grad_enabled() and self.caching:
                hit = self._cache.get(id(x))
                if hit is None:
                    hit = self._cache[id(x)] = x.to(dtype)
                    self.casts += 1
                return hit
            self.casts += 1
            return x.to(dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(self._cast(v, dtype) for v in x)
        return x

    def _wrap(self, fn: Any, dtype: torch.dtype | None) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            target = self.dtype if dtype is None else dtype
            # Last argument first: autocast's C++ wrapper casts its arguments in a pack
            # expansion, which GCC (torch's Linux builds) evaluates right to left. The
            # order decides the casts' autograd sequence numbers, so which weight's
            # gradient is cast back to float32 first in backward.
            cast_kwargs = {k: self._cast(kwargs[k], target) for k in reversed(kwargs)}
            cast_args = [self._cast(a, target) for a in reversed(args)][::-1]
            return fn(*cast_args, **{k: cast_kwargs[k] for k in kwargs})
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]  # what inspect.unwrap finds
        return wrapped

    @staticmethod
    def _wrap_set_opt_dtype(fn: Any, name: str) -> Any:
        half_to_float = _HALF_TO_FLOAT.get(name)
        names_dims = not name.startswith("linalg_")  # their Dimname overloads are unlisted

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            x, args, kwargs = _input_first(args, kwargs)
            dim = args[0] if args else kwargs.get("dim")
            if (not _eligible(x) or _names_dtype(args, kwargs)
                    or (names_dims and _names_dims(dim))):
                return fn(x, *args, **kwargs)
            if (half_to_float is not None and x.dtype == torch.float16
                    and isinstance(dim, int) and x.device.type != "cpu"):
                # SoftMax.cpp: a CUDA float16 input asked for float32 takes the fused
                # half_to_float kernel, no float32 copy of the input (bfloat16 gets one)
                return half_to_float(x, dim, True)
            return fn(x, *args, **{**kwargs, "dtype": torch.float32})
        return wrapped

    def _wrap_promote(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            target = self.dtype
            for t in _tensors([*args, *kwargs.values()]):
                if not _eligible(t):
                    continue
                if torch.float32 in (target, t.dtype):
                    target = torch.float32
                elif t.dtype != self.dtype:
                    raise RuntimeError("Unexpected floating ScalarType in "
                                       "at::autocast::prioritize")
            return self._wrap(fn, target)(*args, **kwargs)
        return wrapped

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """As a decorator (``torch.autocast(...)(forward)``, as accelerate wraps a prepared
        model's forward): each call in a region of its own, as torch's
        ``autocast_decorator`` enters the instance around each call."""
        dtype, ops = self.dtype, self.ops

        @functools.wraps(func)
        def in_region(*args: Any, **kwargs: Any) -> Any:
            with EmulatedAutocast(dtype, ops):
                return func(*args, **kwargs)

        return in_region

    def __enter__(self) -> EmulatedAutocast:
        # an enabled region inside a disabled one casts again, as torch's does
        self._outer_suspended = getattr(_REGION, "suspended", 0)
        _REGION.suspended = 0
        if self.ops == "cpu":
            for owner, name in _LOWER + _FP32_CPU:
                self._patcher.patch(owner, name, self._wrap(
                    getattr(owner, name), None if (owner, name) in _LOWER else torch.float32))
            return self
        for owner, name, policy in cuda_entry_points():
            self._patcher.patch(owner, name, self._policy_wrapper(
                policy, getattr(owner, name), name))
        # At the binding F.cross_entropy calls, not at F.cross_entropy: a script's
        # ``criterion = F.cross_entropy`` bound before the region reaches it too, and
        # F.cross_entropy's own __torch_function__ check still comes first.
        self._patcher.patch(torch._C._nn, "cross_entropy_loss", _cross_entropy_loss)
        _patch_autocast_state(self._patcher)
        _REGION.regions = [*getattr(_REGION, "regions", []), self]
        return self

    def _policy_wrapper(self, policy: str, fn: Any, name: str) -> Any:
        # The op itself runs outside autocast, as autocast's kernels run it (their
        # ExcludeDispatchKeyGuard): what it calls is not cast again, by this region or by
        # one outside it whose wrappers this one's call reaches.
        op = SuspendedAutocast()(fn)
        if policy == LOWER_PRECISION_FP:
            cast = self._wrap(op, None)
        elif policy == FP32:
            cast = self._wrap(op, torch.float32)
        elif policy == FP32_SET_OPT_DTYPE:
            cast = self._wrap_set_opt_dtype(op, name)
        elif policy == FP32_APPEND_DTYPE:
            cast = _wrap_append_dtype(op)
        elif policy == PROMOTE:
            cast = self._wrap_promote(op)
        else:
            cast = _banned

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if autocast_suspended():  # a torch.autocast("cuda", enabled=False) region
                return fn(*args, **kwargs)
            return cast(*args, **kwargs)
        setattr(wrapped, ENTRY_POINT_MARK, True)
        # inspect.unwrap finds the binding: which function a call is (a loss of torch's,
        # scenarios.losses) does not hang on whether a region was open when first asked
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def __exit__(self, *exc: Any) -> None:
        self._patcher.restore()
        self.clear_cache()
        _REGION.suspended = self._outer_suspended
        if self.ops == "cuda":
            _REGION.regions = [r for r in _REGION.regions if r is not self]


# The current thread's emulated CUDA regions, innermost last, and how deep it is in
# ``torch.autocast("cuda", enabled=False)`` regions inside the innermost (autocast's state
# is per thread, as torch keeps it: DataParallel's replicas each have their own).
_REGION = threading.local()


def autocast_suspended() -> bool:
    return bool(getattr(_REGION, "suspended", 0))


def emulated_autocast_dtype() -> torch.dtype | None:
    """The dtype of the current thread's innermost emulated CUDA region, None outside one."""
    regions = getattr(_REGION, "regions", [])
    return regions[-1].dtype if regions else None


def _patch_autocast_state(patcher: Patcher) -> None:
    """What torch answers about CUDA autocast, as a GPU answers it inside an emulated
    region: ``torch.is_autocast_enabled("cuda")`` (and without an argument: CUDA's, as
    torch/csrc/autograd/init.cpp reads it) True but inside a suspended region, and
    ``torch.get_autocast_dtype("cuda")`` the region's dtype (float16 outside any: CUDA's
    default in aten/src/ATen/autocast_mode.cpp). Code that asks first (Hugging Face's
    ``maybe_autocast``) then branches as on a GPU, and torch's internals that record the
    state and enter it again (checkpoint's recompute, ``_get_autocast_kwargs``;
    ``parallel_apply``'s replica threads; ``custom_bwd``) re-enter the emulated region."""
    is_enabled = torch.is_autocast_enabled
    get_dtype = torch.get_autocast_dtype

    def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
        device = kwargs.get("device_type", args[0] if args else "cuda")
        if device != "cuda":
            return bool(is_enabled(*args, **kwargs))
        return emulated_autocast_dtype() is not None and not autocast_suspended()

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        if device_type != "cuda":
            return get_dtype(device_type)
        return emulated_autocast_dtype() or torch.float16

    def get_autocast_gpu_dtype() -> torch.dtype:
        return emulated_autocast_dtype() or torch.float16

    patcher.patch(torch, "is_autocast_enabled", is_autocast_enabled)
    patcher.patch(torch, "get_autocast_dtype", get_autocast_dtype)
    patcher.patch(torch, "get_autocast_gpu_dtype", get_autocast_gpu_dtype)


class SuspendedAutocast(contextlib.ContextDecorator):
    """``torch.autocast("cuda", enabled=False)`` inside an emulated region: the listed ops
    run in the dtypes they are given until it exits (``binary_cross_entropy`` included,
    the usual way around its ban)."""

    def __enter__(self) -> SuspendedAutocast:
        _REGION.suspended = getattr(_REGION, "suspended", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _REGION.suspended -= 1


class StepAutocast:
    """``--amp`` in a real training step, as a user writes it: forward and loss under
    autocast, backward and the optimizer outside (:meth:`phase` wraps a ``StepHooks.phase``).

    On CUDA tensors it is ``torch.autocast("cuda", dtype)``; on any other device (the cpu
    backend's gloo ranks, the cuda backend's test mode) :class:`EmulatedAutocast`, CUDA's op
    lists re-enacted, so the ranks cast exactly as the emulated scenarios beside them.
    Use it as a context manager around the steps: an exception mid-step ends the region.
    """

    def __init__(self, amp: str | None, device_type: str, native: bool = False) -> None:
        self.dtype: torch.dtype | None = getattr(torch, amp) if amp else None
        self.device_type = device_type
        self.native = native  # torch.autocast(device_type) on any device (the checks)
        self._region = contextlib.ExitStack()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        assert self.dtype is not None
        if self.device_type == "cuda" or self.native:
            return torch.autocast(self.device_type, dtype=self.dtype)
        return EmulatedAutocast(self.dtype)

    def phase(
        self, inner: Callable[[str], contextlib.AbstractContextManager[None]]
    ) -> Callable[[str], contextlib.AbstractContextManager[None]]:
        def phase(name: str) -> contextlib.AbstractContextManager[None]:
            if self.dtype is not None:
                if name == "forward":
                    self._region.enter_context(self._autocast())
                elif name == "backward":
                    self._region.close()  # the region (forward + loss) ends: cache cleared
            return inner(name)
        return phase

    def __enter__(self) -> StepAutocast:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._region.close()


def _called_from_torch() -> bool:
    """Whether the code that opened an autocast region (the caller of the caller) is
    torch's own: its internals re-enter a state they recorded (checkpoint's recompute, a
    replica thread of ``parallel_apply``), a region the workload's code did not write."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "torch" or caller.startswith("torch.")


class CudaAutocastNames:
    """``torch.autocast("cuda", ...)`` in the user's code (their step, their forward), as a
    GPU would run it: a CPU build of torch disables a CUDA autocast ("CUDA is not
    available"), and over meta tensors autocast's dispatch keys never act, so while this
    context is active ``torch.autocast``, ``torch.amp.autocast`` (and the name in
    ``torch.amp.autocast_mode`` that ``custom_fwd``/``custom_bwd`` enter) and
    ``torch.cuda.amp.autocast`` with ``device_type="cuda"`` (enabled) return an
    :class:`EmulatedAutocast` of the requested dtype (float16 by default, as autocast's),
    disabled (by the user's code) a :class:`SuspendedAutocast`; other device types get
    torch's own. ``regions`` counts the enabled CUDA regions the workload's code entered
    (not torch's re-entries of them, as checkpoint's recompute)."""

    def __init__(self) -> None:
        self.regions = 0
        self._patcher = Patcher()

    def _factory(self, original: Any) -> Any:
        def autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                     cache_enabled: bool | None = None) -> Any:
            if device_type == "cuda" and enabled:
                if not _called_from_torch():
                    self.regions += 1
                # torch.autocast's default: the thread's current CUDA autocast dtype
                return EmulatedAutocast(dtype or torch.get_autocast_dtype("cuda"))
            if device_type == "cuda":
                return SuspendedAutocast()
            return original(device_type, dtype=dtype, enabled=enabled,
                            cache_enabled=cache_enabled)
        return autocast

    def _cuda_factory(self, original: Any) -> Any:
        def autocast(enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True) -> Any:
            if enabled:
                if not _called_from_torch():
                    self.regions += 1
                return EmulatedAutocast(dtype)
            return SuspendedAutocast()
        return autocast

    def __enter__(self) -> CudaAutocastNames:
        import torch.amp
        import torch.amp.autocast_mode
        import torch.cuda.amp

        # autocast_mode's own name: the one custom_fwd and custom_bwd enter
        for owner in (torch, torch.amp, torch.amp.autocast_mode):
            fn = getattr(owner, "autocast")  # noqa: B009 (torch.amp's is not in its stubs)
            self._patcher.patch(owner, "autocast", self._factory(fn))
        self._patcher.patch(torch.cuda.amp, "autocast",
                            self._cuda_factory(torch.cuda.amp.autocast))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patcher.restore()
