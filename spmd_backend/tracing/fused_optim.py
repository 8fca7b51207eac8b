"""Make torch's fused optimizer kernels traceable into a functional graph.

torch 2.13 ships meta kernels only for ``_fused_adam(_).default`` and ``_fused_adamw_.default``
(none for Adagrad's). Tracing a fused optimizer with a tensor learning rate (which we need, so
the graph reads the current lr instead of baking it in) and functionalizing it needs two more
things:

1. Meta kernels for the functional variants ``_fused_adam.tensor_lr``,
   ``_fused_adamw[.tensor_lr]``, ``_fused_sgd[.tensor_lr]`` and ``_fused_adagrad[.tensor_lr]``
   (and the in-place ``_fused_adagrad_[.tensor_lr]``, which Inductor's re-trace meets after
   ``remove_copy_from_optimizer``). They are registered once, process-wide, and only where
   torch has none (a later torch that ships them wins).
2. A rewrite of the in-place kernels (``_fused_adam_`` ...) into the functional kernel followed by
   ``copy_`` into each mutated list. Functionalizing the in-place kernels directly fails when a
   list argument is empty (``max_exp_avg_sqs`` without amsgrad). :data:`INPLACE_TO_FUNCTIONAL`
   drives the rewrite; :class:`spmd_backend.tracing.dispatch.TraceMode` applies it.

Importing this module has the registration side effect and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd_backend.graph.ops import FUSED_INPLACE_TO_FUNCTIONAL

aten = torch.ops.aten

#: in-place op -> (functional op, number of leading tensor-list arguments it mutates)
INPLACE_TO_FUNCTIONAL: dict = FUSED_INPLACE_TO_FUNCTIONAL


def _empty_like_lists(lists: Sequence[Sequence[torch.Tensor]]) -> tuple:
    return tuple([torch.empty_like(t) for t in lst] for lst in lists)


def _adam_family_meta(
    self: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    **kwargs: object,
) -> tuple:
    return _empty_like_lists([self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs])


def _sgd_meta(
    self: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffer_list: list[torch.Tensor],
    **kwargs: object,
) -> tuple:
    return _empty_like_lists([self, grads, momentum_buffer_list])


def _adagrad_meta(
    self: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    **kwargs: object,
) -> tuple:
    return _empty_like_lists([self, grads, state_sums])


def _adagrad_float_lr_meta(
    self: list[torch.Tensor],
    grads: list[torch.Tensor],
    state_sums: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    **kwargs: object,
) -> tuple:
    # the float-lr schema also returns (unchanged copies of) the step counts
    return _empty_like_lists([self, grads, state_sums, state_steps])


def _inplace_meta(*args: object, **kwargs: object) -> None:
    """In-place kernels return nothing; their meta kernel has nothing to compute."""
    return None


_META_KERNELS = {
    "_fused_adam.tensor_lr": _adam_family_meta,
    "_fused_adamw": _adam_family_meta,
    "_fused_adamw.tensor_lr": _adam_family_meta,
    "_fused_sgd": _sgd_meta,
    "_fused_sgd.tensor_lr": _sgd_meta,
    "_fused_adagrad": _adagrad_float_lr_meta,
    "_fused_adagrad.tensor_lr": _adagrad_meta,
    # the in-place Adagrad kernels come back from remove_copy_from_optimizer and reach
    # Inductor's re-trace (Adam's and SGD's are decomposed first, lowering/fused_decomp.py)
    "_fused_adagrad_": _inplace_meta,
    "_fused_adagrad_.tensor_lr": _inplace_meta,
}

_LIBRARY: torch.library.Library | None = None


def register_meta_kernels() -> list[str]:
    """Register the missing meta kernels once; returns the names registered by this call."""
    global _LIBRARY
    registered: list[str] = []
    for name, kernel in _META_KERNELS.items():
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            continue
        if _LIBRARY is None:
            _LIBRARY = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kept alive here
        _LIBRARY.impl(name, kernel, "Meta")
        registered.append(name)
    return registered


def _in_layout_of(param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a new tensor laid out like ``param`` (at run time: like the real one)."""
    return torch.empty_like(param).copy_(t)


def with_parameter_layouts(args: tuple) -> tuple:
    """``args`` of a fused optimizer kernel with every per-parameter tensor (gradient, state)
    laid out like its parameter where that is not already certain.

    torch's fused CPU kernels walk a parameter and its gradient and state as flat arrays, so
    they need one layout (eager guarantees it: ``.grad`` follows its parameter's strides). In a
    traced graph it does not hold: for a channels_last convolution weight the fake tensors
    predict a channels_last gradient, the CPU kernel returns a contiguous one, and the fused
    step read the gradient in the wrong order (0.02 off eager after one SGD step). A tensor is
    copied into its parameter's layout when the parameter is not contiguous (gradient strides
    are not known before run time) or its traced strides differ; contiguous parameters with
    matching tensors (the common case) cost nothing.
    """
    params = args[0]
    out = [args[0]]
    for lst in args[1:]:
        if not isinstance(lst, (list, tuple)) or len(lst) != len(params):
            out.append(lst)
            continue
        fixed = []
        for p, t in zip(params, lst):
            if isinstance(t, torch.Tensor) and t.shape == p.shape and p.dim() > 1 and (
                not p.is_contiguous() or t.stride() != p.stride()
            ):
                t = _in_layout_of(p, t)
            fixed.append(t)
        out.append(type(lst)(fixed))
    return tuple(out)


def device_dtype_groups(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``params`` grouped by device and dtype, in first-seen order.

    torch's optimizers group their tensors this way before calling a fused kernel, except
    while compiling (``torch.compiler.is_compiling()``, true under our trace), where they leave
    it to the compiler; the trace then held one kernel call over float32 and bfloat16
    parameters together, which eager never makes. torch 2.13's CPU kernels ran such a mix
    without error in a direct check, so this restores eager's calls rather than a measured
    difference; what left bfloat16 layers untrained was the SGD kernel itself
    (:mod:`spmd_backend.tracing.hyperparams`).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    return list(groups.values())


def _take(arg: object, index: list[int], n: int) -> object:
    """The entries ``index`` of a per-parameter list argument (other arguments unchanged)."""
    if isinstance(arg, (list, tuple)) and len(arg) == n:
        return type(arg)(arg[i] for i in index)
    return arg


def functional_fused_step(func: object, args: tuple, kwargs: dict) -> None:
    """Run an in-place fused optimizer op as functional op + ``copy_`` into its mutated lists,
    one call per device and dtype (:func:`device_dtype_groups`; inputs laid out like their
    parameters: :func:`with_parameter_layouts`)."""
    functional, n_mutated = INPLACE_TO_FUNCTIONAL[func]
    n = len(args[0])
    groups = device_dtype_groups(args[0])
    for index in groups:
        part = args if len(groups) == 1 else tuple(_take(a, index, n) for a in args)
        outs = functional(*with_parameter_layouts(part), **kwargs)
        for dst_list, src_list in zip(part[:n_mutated], outs):
            for dst, src in zip(dst_list, src_list):
                dst.copy_(src)


register_meta_kernels()
