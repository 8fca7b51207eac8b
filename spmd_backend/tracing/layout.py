"""The input/output layout of a traced step: both directions between flat graph values and the
live objects of a call.

Inputs, in placeholder order (:class:`InputGroups` names the groups)::

    params | buffers | optimizer state | lifted hyper-parameters | existing .grad
           | auxiliary state (a GradScaler's scale) | tensor arguments

Outputs, in order::

    user-returned tensors | optimizer state created or replaced by the step | final .grad values
           | new values of mutated buffers and arguments
           | values of the step's Python writes (a module attribute, an argument dict's key)
           | a GradScaler's found_inf (only when its step was traced as a select)

:func:`plan_inputs` builds the input half for a binding; :meth:`StepLayout.gather` collects the
live tensors of a later call (hyper-parameter tensors are cached by value, so an unchanged
learning rate allocates nothing); the trace fills the output half; :meth:`StepLayout.commit`
writes a run's outputs back (optimizer state entries, ``.grad``, mutated buffers and arguments,
resized in place where the step changed their shape inside an op, as torch's fused observer for
quantization-aware training does), replays the step's Python writes
(:mod:`spmd_backend.tracing.side_effects`) and rebuilds the user's return value. Parameters, optimizer
state and GradScaler state are written inside the graph (``copy_`` into placeholders, in the
optimizer region).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.hyperparams import HyperSlot, gather_hyperparameters
from spmd_backend.tracing.side_effects import AttributeEffect, BufferEffect, Effect

T = TypeVar("T")

#: (index of the auxiliary object in ``binding.aux_objects``, attribute name)
AuxSlot = tuple[int, str]


@dataclass
class InputGroups(Generic[T]):
    """Flat graph inputs split by what they are (same order as the placeholders)."""

    params: Sequence[T]
    buffers: Sequence[T]
    state: Sequence[T]
    hyper: Sequence[T]
    grads: Sequence[T]
    aux: Sequence[T]
    args: Sequence[T]


@dataclass
class StepLayout:
    """How the flat graph inputs and outputs map to the live objects of a call."""

    n_params: int
    n_buffers: int
    state_inputs: list[tuple[int, str]]
    hyper_inputs: list[HyperSlot]
    grad_inputs: list[int]
    aux_inputs: list[AuxSlot]
    arg_inputs: list[int]
    # ---- outputs, filled by the trace
    out_spec: Any = None
    out_leaves: list[tuple[str, Any]] = field(default_factory=list)
    n_user_tensors: int = 0
    state_outputs: list[tuple[int, str]] = field(default_factory=list)
    state_consts: list[tuple[int, str, Any]] = field(default_factory=list)
    state_touched: list[int] = field(default_factory=list)
    grad_outputs: list[int] = field(default_factory=list)
    creates_state: bool = False
    #: ("buffers" | "args", index in that input group) of inputs the step mutated, in output order
    mutated_outputs: list[tuple[str, int]] = field(default_factory=list)
    #: Python writes of the step replayed after each run (see tracing.side_effects): those
    #: whose value is an output, in output order, and those whose value is a constant
    effect_outputs: list[Effect] = field(default_factory=list)
    effect_consts: list[tuple[Effect, Any]] = field(default_factory=list)
    #: output position of a GradScaler's found_inf, when the optimizer step is a select on it
    skip_output: int | None = None

    # ------------------------------------------------------------------ inputs
    def _sizes(self) -> list[int]:
        return [
            self.n_params, self.n_buffers, len(self.state_inputs), len(self.hyper_inputs),
            len(self.grad_inputs), len(self.aux_inputs), len(self.arg_inputs),
        ]

    @property
    def n_inputs(self) -> int:
        return sum(self._sizes())

    @property
    def n_state_inputs(self) -> int:
        """Parameters, buffers and optimizer state: the inputs a transformation may rely on."""
        return self.n_params + self.n_buffers + len(self.state_inputs)

    def split(self, flat: Sequence[T]) -> InputGroups[T]:
        """``flat`` (placeholder order) cut into its named groups."""
        parts: list[Sequence[T]] = []
        pos = 0
        for size in self._sizes():
            parts.append(flat[pos : pos + size])
            pos += size
        return InputGroups(*parts)

    def gather(
        self,
        binding: StepBinding,
        hyper_cache: dict[HyperSlot, tuple[Any, torch.Tensor]] | None = None,
    ) -> list[torch.Tensor]:
        """The live tensors, in placeholder order, for a call that matches this layout."""
        opt = binding.optimizer
        params = binding.params
        flat: list[torch.Tensor] = list(params)
        flat.extend(binding.buffers)
        if self.state_inputs:
            state = opt.state  # type: ignore[union-attr]
            flat.extend(state[params[i]][k] for i, k in self.state_inputs)
        flat.extend(
            gather_hyperparameters(opt, self.hyper_inputs, hyper_cache, binding.unfused_groups)
        )
        flat.extend(params[i].grad for i in self.grad_inputs)  # type: ignore[misc]
        flat.extend(getattr(binding.aux_objects[o], a) for o, a in self.aux_inputs)
        args = binding.flat_args
        flat.extend(args[j] for j in self.arg_inputs)
        return flat

    # ------------------------------------------------------------------ outputs
    def refuse_aliased_writes(self, binding: StepBinding) -> None:
        """Refuse a call where a tensor argument the step writes in place shares memory with
        another tensor argument (``step(model, opt, x, x)`` for a step that scales its last
        argument in place). The graph takes each argument as an input of its own, so the other
        would not see the write that eager makes visible through it: until 2026-11-28 such a
        call replayed as if the tensors were separate, silently (hunt 45)."""
        written = {self.arg_inputs[j] for kind, j in self.mutated_outputs if kind == "args"}
        if not written:
            return
        leaves = binding.flat_args
        for w in sorted(written):
            storage = leaves[w].untyped_storage()
            for i in self.arg_inputs:
                if i != w and leaves[i].untyped_storage().data_ptr() == storage.data_ptr() \
                        and storage.nbytes():
                    paths = binding.arg_paths()
                    raise SpmdUsageError(
                        f"spmd_backend.compile: the train step writes {paths[w]} in place, and "
                        f"{paths[i]} shares its memory (the same tensor, or a view of it); the "
                        "compiled graph takes them as separate inputs, so the write would not "
                        "reach the other as it does in eager. Pass a copy (x.clone()) or one "
                        "tensor. Nothing was changed."
                    )

    def commit(self, binding: StepBinding, outs: Sequence[Any]) -> Any:
        """Write a run's outputs back (optimizer state entries, ``.grad``) and return the
        user's result rebuilt from ``outs``."""
        params = binding.params
        pos = self.n_user_tensors
        opt = binding.optimizer
        # eager GradScaler never runs a skipped step, so it never creates state in one
        skipped = (
            self.creates_state and self.skip_output is not None and bool(outs[self.skip_output])
        )
        if opt is not None and skipped:
            pos += len(self.state_outputs)
        elif opt is not None:
            for i in self.state_touched:
                opt.state[params[i]]  # defaultdict: the entry exists after a step, as in eager
            for i, k in self.state_outputs:
                opt.state[params[i]][k] = outs[pos]
                pos += 1
            for i, k, v in self.state_consts:
                opt.state[params[i]][k] = v
        grads: dict[int, torch.Tensor] = {}
        for i in self.grad_outputs:
            grads[i] = outs[pos]
            pos += 1
        for i, p in enumerate(params):
            g = grads.get(i)
            if g is None:
                p.grad = None
            elif p.grad is not g:
                p.grad = g
        with torch.no_grad():
            for kind, j in self.mutated_outputs:
                live = binding.buffers[j] if kind == "buffers" else binding.flat_args[self.arg_inputs[j]]
                new = outs[pos]
                if live.shape != new.shape:
                    # the step resized it in place (a quantization observer's per-channel
                    # min/max, FakeQuantize's scale): as eager leaves it, the same tensor object
                    live.resize_(new.shape)
                live.copy_(new)
                pos += 1
        for effect in self.effect_outputs:
            self._apply(effect, binding, outs[pos])
            pos += 1
        for effect, value in self.effect_consts:
            self._apply(effect, binding, value)
        leaves = [
            outs[v] if kind == "tensor" else outs[v].item() if kind == "item" else v
            for kind, v in self.out_leaves
        ]
        return pytree.tree_unflatten(leaves, self.out_spec)

    @staticmethod
    def _apply(effect: Effect, binding: StepBinding, value: Any) -> None:
        if isinstance(effect, (AttributeEffect, BufferEffect)):
            effect.apply(binding.modules, value)
        else:
            effect.apply(binding.original, value)


def plan_inputs(binding: StepBinding) -> tuple[StepLayout, list[torch.Tensor]]:
    """The input half of the layout and the real tensors to feed, for ``binding``."""
    opt = binding.optimizer
    state_inputs: list[tuple[int, str]] = []
    if opt is not None:
        for i, p in enumerate(binding.params):
            st = opt.state.get(p)
            if not st:
                continue
            for k in sorted(st.keys(), key=str):
                if isinstance(st[k], torch.Tensor):
                    state_inputs.append((i, k))
    aux_inputs = [
        (o, name)
        for o, obj in enumerate(binding.aux_objects)
        for name in binding.aux_attributes(o)
    ]
    layout = StepLayout(
        n_params=len(binding.params),
        n_buffers=len(binding.buffers),
        state_inputs=state_inputs,
        hyper_inputs=list(binding.hyper_slots),
        grad_inputs=[i for i, p in enumerate(binding.params) if p.grad is not None],
        aux_inputs=aux_inputs,
        arg_inputs=[j for j, a in enumerate(binding.flat_args) if isinstance(a, torch.Tensor)],
    )
    return layout, layout.gather(binding)
