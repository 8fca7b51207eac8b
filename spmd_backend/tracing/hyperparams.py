"""Optimizer hyper-parameters that are graph inputs instead of baked-in constants.

A scheduler may change a param group's ``lr`` every step (and OneCycleLR/CyclicLR change
``momentum`` or ``betas[0]`` too). Such values are *lifted*: the trace sees a 0-dim float64
tensor in their place and every call feeds the current value, so a schedule never retraces.
float64 keeps eager's arithmetic: eager computes ``1 - lr * weight_decay`` and friends on Python
doubles and rounds once where they meet the parameters; a float64 tensor does the same (a fused
optimizer with a float64 tensor lr matches eager bit for bit, a float32 one does not).

Only keys whose every use in the optimizer's code accepts a tensor can be lifted (``alpha=`` of
``add`` must be a Python number, for instance); :data:`LIFTABLE` lists them per optimizer class
(checked by the test suite for every class and implementation). Other values are guarded: a
change retraces with a log line naming the key.

A *slot* is ``(group index, key, element)``: ``element`` is ``None`` for a number and the tuple
position for tuple values such as ``betas``.
"""

from __future__ import annotations

from typing import Any

import torch

HyperSlot = tuple[int, str, "int | None"]

#: optimizer class name -> param-group keys lifted to graph inputs (when their value is a float)
LIFTABLE: dict[str, tuple[str, ...]] = {}

#: keys lifted for an optimizer class not in :data:`LIFTABLE`
DEFAULT_LIFTABLE: tuple[str, ...] = ("lr",)


def liftable_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    for cls in type(optimizer).__mro__:
        keys = LIFTABLE.get(cls.__name__)
        if keys is not None and cls.__module__.startswith("torch.optim"):
            return keys
    return DEFAULT_LIFTABLE


def _is_number(value: Any) -> bool:
    return isinstance(value, float) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()
    )


def lifted_slots(optimizer: torch.optim.Optimizer | None) -> list[HyperSlot]:
    """The slots lifted for the optimizer's current param groups, in a stable order."""
    if optimizer is None:
        return []
    keys = liftable_keys(optimizer)
    slots: list[HyperSlot] = []
    for g, group in enumerate(optimizer.param_groups):
        if not group["params"]:
            continue
        for k in keys:
            value = group.get(k)
            if _is_number(value):
                slots.append((g, k, None))
            elif isinstance(value, tuple):
                slots.extend((g, k, i) for i, v in enumerate(value) if _is_number(v))
    return slots


def slot_value(optimizer: torch.optim.Optimizer, slot: HyperSlot) -> Any:
    g, k, i = slot
    value = optimizer.param_groups[g][k]
    return value if i is None else value[i]


def slot_label(slot: HyperSlot) -> str:
    g, k, i = slot
    return f"param_groups[{g}][{k!r}]" + ("" if i is None else f"[{i}]")


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def gather_hyperparameters(
    optimizer: torch.optim.Optimizer | None,
    slots: list[HyperSlot],
    cache: dict[HyperSlot, tuple[Any, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """The current values of ``slots`` as float64 tensors (cached by value for floats)."""
    out: list[torch.Tensor] = []
    for slot in slots:
        value = slot_value(optimizer, slot)  # type: ignore[arg-type]
        if cache is not None and not isinstance(value, torch.Tensor):
            hit = cache.get(slot)
            if hit is not None and hit[0] == value:
                out.append(hit[1])
                continue
        params = optimizer.param_groups[slot[0]]["params"]  # type: ignore[union-attr]
        t = _as_tensor(value, params[0].device)
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
