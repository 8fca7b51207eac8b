"""Optimizer hyper-parameters that are graph inputs instead of baked-in constants.

A scheduler may change a param group's ``lr`` every step (and OneCycleLR/CyclicLR change
``momentum`` or ``betas[0]`` too). Such values are *lifted*: the trace sees a 0-dim float64
tensor in their place and every call feeds the current value, so a schedule never retraces.
float64 keeps eager's arithmetic: eager computes ``1 - lr * weight_decay`` and friends on Python
doubles and rounds once where they meet the parameters; a float64 tensor does the same (a fused
optimizer with a float64 tensor lr matches eager bit for bit, a float32 one does not). A fused
kernel off the CPU gets a float32 lr: CUDA's kernels read it as ``float``.

Only keys whose every use in the optimizer's code accepts a tensor can be lifted (``alpha=`` of
``add``, the base of ``_foreach_pow`` and the fused kernels' scalars must be Python numbers, for
instance), and that depends on the implementation the group is traced with
(:func:`traced_implementation`). :data:`LIFTABLE` lists them per optimizer class and
implementation, measured on torch 2.13 by ``tools/hyper_survey.py`` (lift, change every step,
no retrace, match eager); uses that would only trace through ``.item()`` (a host sync per use
on accelerators) are left out. ``if weight_decay != 0``-style tests of a lifted value are
answered while tracing (:mod:`spmd_backend.tracing.optimizer_swap`) and guard on the value's
sign. Other values are guarded: a change retraces with a log line naming the key.

A *slot* is ``(group index, key, element)``: ``element`` is ``None`` for a number and the tuple
position for tuple values such as ``betas``.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false

HyperSlot = tuple[int, str, "int | None"]


@dataclass(frozen=True)
class Lift:
    """A liftable param-group entry (``index``: the element of a tuple value), optionally only
    while a boolean group option is true (``only_if``) or false (``unless``)."""

    key: str
    index: int | None = None
    only_if: str | None = None
    unless: str | None = None

    def applies(self, group: dict[str, Any]) -> bool:
        if self.only_if is not None and not group.get(self.only_if):
            return False
        return self.unless is None or not group.get(self.unless)


_LR, _EPS = Lift("lr"), Lift("eps")
_B1, _B2 = Lift("betas", 0), Lift("betas", 1)
_WD = Lift("weight_decay")
_DECOUPLED_WD = Lift("weight_decay", only_if="decoupled_weight_decay")
# nesterov passes momentum as `alpha=` of add
_SGD_MOMENTUM = Lift("momentum", unless="nesterov")
# Rprop's lr only seeds the step sizes when its state is created (`full_like` wants a number);
# `clamp_(min, max)` takes both step sizes as tensors or neither (see _lifts)
_RPROP = (Lift("etas", 0), Lift("etas", 1), Lift("step_sizes", 0), Lift("step_sizes", 1))

#: optimizer class name -> traced implementation -> liftable entries (torch 2.13). Not listed,
#: with the call that rejects a tensor: every fused scalar but lr; ``_foreach_pow(beta, steps)``
#: (foreach beta1 of Adam/AdamW/Adamax/RAdam, beta2 of Adam/AdamW/RAdam);
#: ``add(alpha=weight_decay)`` (coupled weight decay); ``_foreach_add(alpha=lambd)`` and
#: ``_foreach_sub(steps, t0)`` (ASGD foreach); NAdam foreach beta2 (a CPU-scalar check). Only
#: through ``.item()``: ``value=1 - beta2`` (single-tensor Adam family), ``alpha=1 - dampening``
#: (SGD), RMSprop's ``alpha``, Adadelta's ``rho``, NAdam foreach beta1.
LIFTABLE: dict[str, dict[str, tuple[Lift, ...]]] = {
    "SGD": {
        "single": (_LR, _SGD_MOMENTUM, _WD),
        "foreach": (_LR, _SGD_MOMENTUM),
        "fused": (_LR,),
    },
    "Adam": {
        "single": (_LR, _B1, _EPS, _DECOUPLED_WD),
        "foreach": (_LR, _EPS, _DECOUPLED_WD),
        "fused": (_LR,),
    },
    "AdamW": {
        "single": (_LR, _B1, _EPS, _WD),
        "foreach": (_LR, _EPS, _WD),
        "fused": (_LR,),
    },
    "Adamax": {"single": (_LR, _B1, _B2, _EPS), "foreach": (_LR, _B2, _EPS)},
    "NAdam": {
        "single": (_LR, _B1, _EPS, Lift("momentum_decay"), _DECOUPLED_WD),
        "foreach": (_LR, _EPS, Lift("momentum_decay"), _DECOUPLED_WD),
    },
    "RAdam": {
        "single": (_LR, _B1, _EPS, _DECOUPLED_WD),
        "foreach": (_LR, _EPS, _DECOUPLED_WD),
    },
    "RMSprop": {"single": (_LR, _EPS, Lift("momentum")), "foreach": (_LR, Lift("momentum"))},
    "Adagrad": {
        "single": (_LR, Lift("lr_decay"), _EPS),
        "foreach": (_LR, Lift("lr_decay"), _EPS),
        "fused": (_LR,),
    },
    "Adadelta": {"single": (_LR, _EPS), "foreach": (_LR, _EPS)},
    "ASGD": {"single": (_LR, Lift("lambd"), Lift("alpha"), Lift("t0")), "foreach": (_LR,)},
    "Rprop": {"single": _RPROP, "foreach": _RPROP},
}

#: entries lifted only in a group traced for a value that moves (:func:`unfusing_lifts`): torch
#: passes a nesterov SGD's momentum as ``alpha=`` of ``add``, which the step's trace rewrites as
#: a product and a sum for a lifted tensor (optimizer_swap.py; eager's multiply-add rounds once,
#: this twice: one ulp of an update). OneCycleLR/CyclicLR with ``cycle_momentum`` on
#: ``SGD(nesterov=True)`` retraced every call until 2026-11-28 and was refused at the 9th.
MOVING_LIFTABLE: dict[str, tuple[Lift, ...]] = {"SGD": (Lift("momentum", only_if="nesterov"),)}

#: entries lifted for an optimizer class not in :data:`LIFTABLE`
DEFAULT_LIFTABLE: tuple[Lift, ...] = (_LR,)

#: optimizer classes whose fused kernel traces (meta kernels: spmd_backend.tracing.fused_optim)
FUSED_BY_DEFAULT: frozenset[str] = frozenset({"Adam", "AdamW", "SGD", "Adagrad"})


def _torch_class(optimizer: torch.optim.Optimizer) -> str | None:
    """The name of the torch.optim class whose ``step`` ``optimizer`` runs (None: another)."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in LIFTABLE:
            return cls.__name__ if type(optimizer).step is cls.step else None
    return None


def _fused_supported_devices() -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def _can_default_to_fused(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """True when a group left the implementation to torch and the fused kernel can run it.

    torch picks the single-tensor loop on CPU for eager speed; in a compiled graph one fused
    kernel is both faster and far cheaper to trace, so an unspecified implementation is traced
    as fused where the kernel supports every parameter and traces (:data:`FUSED_BY_DEFAULT`)
    and every parameter is float32 or float64 (:data:`_FUSED_DEFAULT_DTYPES`) and dense (a
    strided view, ``nn.Parameter(t[:, ::2])``, is not: the in-place kernel the passes make of
    the update walks each tensor as one flat array, and the pass manager refused the graph).
    Explicit choices are respected.
    """
    if _torch_class(optimizer) not in FUSED_BY_DEFAULT:
        return False
    if "fused" not in group or group.get("fused") is not None or group.get("foreach") is not None:
        return False
    if group.get("differentiable"):
        return False
    if _momentum_half_started(optimizer, group) or _state_dtype_differs(optimizer, group):
        return False
    supported = _fused_supported_devices()
    return all(
        p.dtype in _FUSED_DEFAULT_DTYPES and p.device.type in supported
        and is_non_overlapping_and_dense_or_false(p) for p in group["params"]
    )


#: parameter dtypes for which the fused kernel computes what the default loop does: torch
#: 2.13's CPU ``_fused_sgd_`` leaves the vectorized part of a bfloat16 or float16 parameter
#: unchanged (every full 16 elements; a bfloat16 model with plain ``SGD`` was not trained at
#: all, silently), and the fused Adam family computes in float32 where the default loop
#: rounds to the parameter's dtype each operation
_FUSED_DEFAULT_DTYPES = frozenset({torch.float32, torch.float64})


def _momentum_half_started(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """True for an SGD group with momentum where some trainable parameters hold a momentum
    buffer and others do not (a layer unfrozen after the first steps, a parameter added to the
    group later). torch's fused SGD takes the first step for all of a group's parameters or for
    none and fails on such a mix; the single-tensor loop starts each buffer on its own."""
    if _torch_class(optimizer) != "SGD" or not group.get("momentum"):
        return False
    started = {
        optimizer.state.get(p, {}).get("momentum_buffer") is not None
        for p in group["params"] if p.requires_grad
    }
    return len(started) > 1


def _state_dtype_differs(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """True where a parameter's state tensor (momentum buffer, ``exp_avg``, ...) has another
    dtype than the parameter: ``model.double()`` or ``.half()`` after some steps converts the
    parameters, not the optimizer state. torch's fused kernels take one dtype for a parameter
    and its state and failed on the mix; the single-tensor loop promotes, as eager does."""
    for p in group["params"]:
        for name, value in optimizer.state.get(p, {}).items():
            if (name != "step" and isinstance(value, torch.Tensor) and value.shape == p.shape
                    and value.dtype != p.dtype):
                return True
    return False


#: optimizers already warned by :func:`warn_untrained_by_fused_kernel`
_WARNED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def warn_untrained_by_fused_kernel(optimizer: torch.optim.Optimizer) -> None:
    """Warn (once per optimizer) when a group chose ``SGD(fused=True)`` with bfloat16/float16
    parameters on the CPU: torch 2.13's kernel leaves every full 16 elements of them unchanged,
    in eager and in a compiled step that runs the kernel (see :data:`_FUSED_DEFAULT_DTYPES`), so
    they would not train and nothing else says so; the Inductor lowering computes the update
    itself (lowering/fused_decomp.py) and does train them, unlike eager. Called while a step is
    traced (both doors)."""
    if _torch_class(optimizer) != "SGD" or optimizer in _WARNED:
        return
    for group in optimizer.param_groups:
        stuck = _stuck_in_fused_sgd(optimizer, group)
        if stuck:
            _WARNED.add(optimizer)
            warnings.warn(
                f"SGD(fused=True) on the CPU leaves {len(stuck)} {stuck[0].dtype} parameter(s) "
                f"(shape {list(stuck[0].shape)}, ...) unchanged: torch 2.13's fused kernel skips "
                "every full 16 elements of bfloat16/float16 parameters, in eager too (a step "
                "lowered with Inductor computes the update itself and does train them, so it "
                "and eager differ). Leave the implementation unspecified (or foreach=True) to "
                "train them everywhere.",
                stacklevel=2,
            )
            return


def _stuck_in_fused_sgd(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> list[torch.Tensor]:
    """The parameters of an explicitly fused SGD ``group`` that torch 2.13's CPU kernel skips
    (every full 16 elements of a bfloat16/float16 parameter): see
    :func:`warn_untrained_by_fused_kernel`."""
    if _torch_class(optimizer) != "SGD" or not group.get("fused"):
        return []
    return [p for p in group["params"] if p.device.type == "cpu" and p.numel() >= 16
            and p.dtype in (torch.bfloat16, torch.float16)]


def traced_implementation(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], unfused: bool = False
) -> str:
    """``"fused"``, ``"foreach"`` or ``"single"``: how ``group`` is traced.

    An unspecified choice is fused where :func:`_can_default_to_fused` allows, else the
    single-tensor loop (torch never picks foreach for the trace's functional tensors).
    ``unfused`` (see :func:`unfusing_lifts`) traces a fused or foreach group single-tensor.
    """
    if unfused:
        return "single"
    if group.get("fused") or _can_default_to_fused(optimizer, group):
        if group.get("fused"):
            warn_untrained_by_fused_kernel(optimizer)
        return "fused"
    return "foreach" if group.get("foreach") else "single"


def unfusing_lifts(optimizer: torch.optim.Optimizer, g: int, key: str, index: int | None) -> bool:
    """Whether group ``g``'s ``key[index]`` (any element of ``key`` for ``index=None``), baked
    into a graph with the implementation the group is traced with, would be a graph input in a
    group traced for moving values: single-tensor, with :data:`MOVING_LIFTABLE` too.

    A scheduler that changes ``betas[0]`` or ``momentum`` (OneCycleLR, CyclicLR with
    ``cycle_momentum``) would otherwise retrace every step: the fused kernels take those as
    Python numbers only, foreach Adam takes ``betas[0]`` as the base of ``_foreach_pow``, and
    nesterov SGD passes ``momentum`` as ``alpha=`` (until 2026-11-28 only fused groups were
    switched: foreach Adam and nesterov SGD were refused at the 9th call).
    """
    group = optimizer.param_groups[g]
    name = _torch_class(optimizer)
    if name is None or _stuck_in_fused_sgd(optimizer, group):
        # the kernel leaves such a group's momentum buffers partly unwritten (in eager too): a
        # single-tensor step would read that memory (NaN parameters, found in review)
        return False
    baked = traced_implementation(optimizer, group) != "single"
    lifts = (*(LIFTABLE[name].get("single", ()) if baked else ()), *MOVING_LIFTABLE.get(name, ()))
    return any(
        lift.key == key and (index is None or lift.index == index) and lift.applies(group)
        for lift in lifts
    )


def moving_value_plan(optimizer: torch.optim.Optimizer, g: int) -> str:
    """How group ``g`` will take a moving value once traced for it (:func:`unfusing_lifts`), in
    the words of the retrace log."""
    was = traced_implementation(optimizer, optimizer.param_groups[g])
    if was != "single":
        return ("is traced with its single-tensor implementation, where it is a graph input, "
                f"instead of its {was} one")
    return ("takes it as a graph input, multiplied where torch passes it as alpha= of add (one "
            "ulp of an update off eager)")


def _is_number(value: Any) -> bool:
    return isinstance(value, float) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()
    )


def _lifts(optimizer: torch.optim.Optimizer, group: dict[str, Any], unfused: bool) -> list[Lift]:
    """The entries of :data:`LIFTABLE` that apply to ``group`` and hold a number."""
    name = _torch_class(optimizer)
    table = (
        LIFTABLE[name].get(traced_implementation(optimizer, group, unfused), ())
        if name is not None else DEFAULT_LIFTABLE
    )
    if unfused and name is not None:
        table = (*table, *MOVING_LIFTABLE.get(name, ()))
    lifts = []
    for lift in table:
        value = group.get(lift.key)
        if lift.index is not None:
            value = value[lift.index] if isinstance(value, tuple) else None
        if lift.applies(group) and _is_number(value):
            lifts.append(lift)
    if sum(lift.key == "step_sizes" for lift in lifts) == 1:  # Rprop's clamp_(min, max)
        lifts = [lift for lift in lifts if lift.key != "step_sizes"]
    return lifts


def lifted_slots(
    optimizer: torch.optim.Optimizer | None, unfused_groups: frozenset[int] = frozenset()
) -> list[HyperSlot]:
    """The slots lifted for the optimizer's current param groups, in a stable order."""
    if optimizer is None:
        return []
    slots: list[HyperSlot] = []
    for g, group in enumerate(optimizer.param_groups):
        if group["params"]:
            lifts = _lifts(optimizer, group, g in unfused_groups)
            slots.extend((g, lift.key, lift.index) for lift in lifts)
    return slots


def slot_value(optimizer: torch.optim.Optimizer, slot: HyperSlot) -> Any:
    g, k, i = slot
    value = optimizer.param_groups[g][k]
    return value if i is None else value[i]


def slot_label(slot: HyperSlot) -> str:
    g, k, i = slot
    return f"param_groups[{g}][{k!r}]" + ("" if i is None else f"[{i}]")


def _as_tensor(value: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=dtype)
    return torch.tensor(float(value), dtype=dtype, device=device)


def gather_hyperparameters(
    optimizer: torch.optim.Optimizer | None,
    slots: list[HyperSlot],
    cache: dict[HyperSlot, tuple[Any, torch.Tensor]] | None = None,
    unfused_groups: frozenset[int] = frozenset(),
) -> list[torch.Tensor]:
    """The current values of ``slots`` as 0-dim tensors (cached by value for floats)."""
    out: list[torch.Tensor] = []
    for slot in slots:
        value = slot_value(optimizer, slot)  # type: ignore[arg-type]
        if cache is not None and not isinstance(value, torch.Tensor):
            hit = cache.get(slot)
            if hit is not None and hit[0] == value:
                out.append(hit[1])
                continue
        group = optimizer.param_groups[slot[0]]  # type: ignore[union-attr]
        device = group["params"][0].device
        impl = traced_implementation(optimizer, group, slot[0] in unfused_groups)  # type: ignore[arg-type]
        fused = impl == "fused"
        # CUDA's fused kernels read a tensor lr as float
        dtype = torch.float32 if fused and device.type != "cpu" else torch.float64
        t = _as_tensor(value, device, dtype)
        if cache is not None and not isinstance(value, torch.Tensor):
            cache[slot] = (value, t)
        out.append(t)
    return out


def install(group: dict, slot: HyperSlot, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in ``slot`` of a (swapped) param group."""
    _, k, i = slot
    if i is None:
        group[k] = tensor
    else:
        value = list(group[k])
        value[i] = tensor
        group[k] = tuple(value)
