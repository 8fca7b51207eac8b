"""Fused optimizer kernels whose tensors differ in dtype or device from their parameter.

torch's fused optimizer kernels (``_fused_adam(w)``, ``_fused_sgd``, ``_fused_adagrad``,
functional or in place) need, per parameter, its gradient and state in the parameter's dtype and
on its device. Their fake (meta) implementations do not check, so a trace succeeds and the real
kernel raises when the graph runs, after the step counts it increments first were written (as
eager's ``optimizer.step()`` leaves them). It happens when the model's dtype or device changes
after the optimizer created its state (``model.double()``, ``model.to(...)``).
:func:`fused_operand_mismatch` finds the first such operand from the nodes' fake values, so a
door can refuse the step before anything runs.

Analysis only (never mutates). Requires ``meta["val"]`` on the kernel's operands; nodes without
it are not checked. Step counts (``state_steps``) are not compared: they are float32 scalars
whatever the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from spmd_backend.graph import ops


@dataclass(frozen=True)
class FusedOperandMismatch:
    """One operand of a fused optimizer kernel unlike its parameter."""

    kernel: str  #: the op's name (``aten._fused_adamw``)
    argument: str  #: the schema name of the list (``exp_avgs``, ``grads``)
    index: int  #: the parameter's position in the kernel's lists
    param: str  #: the parameter's node name
    operand: str  #: the operand's node name
    param_kind: str  #: "float64 on cpu"
    operand_kind: str

    def describe(self) -> str:
        return (f"{self.kernel}'s {self.argument}[{self.index}] ({self.operand}) is "
                f"{self.operand_kind} but its parameter ({self.param}) is {self.param_kind}")


def _kind(value: torch.Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')} on {value.device}"


def fused_operand_mismatch(graph: fx.Graph) -> FusedOperandMismatch | None:
    """The first operand of a fused optimizer kernel in ``graph`` whose dtype or device is not
    its parameter's, or None."""
    for node in graph.nodes:
        if not ops.is_fused_optimizer_kernel(node):
            continue
        lists = ops.list_arguments(node)
        if not lists:
            continue
        params = lists[0][1]
        for name, items in lists[1:]:
            if name == "state_steps":
                continue
            for index, (param, item) in enumerate(zip(params, items)):
                pv = getattr(param, "meta", {}).get("val")
                v = getattr(item, "meta", {}).get("val")
                if not isinstance(pv, torch.Tensor) or not isinstance(v, torch.Tensor):
                    continue
                if v.dtype != pv.dtype or v.device != pv.device:
                    return FusedOperandMismatch(
                        kernel=ops.op_name(node), argument=name, index=index,
                        param=getattr(param, "name", str(param)),
                        operand=getattr(item, "name", str(item)),
                        param_kind=_kind(pv), operand_kind=_kind(v))
    return None


#: what to do about a mismatch (both doors' refusals end with it)
MISMATCH_ADVICE = (
    "torch's fused optimizer kernels need each parameter's gradient and state in its dtype and "
    "on its device, and would fail after writing the step counts. Did the model's dtype or "
    "device change after the optimizer created its state (model.double(), model.to(...))? "
    "Create the optimizer again, or call optimizer.load_state_dict(optimizer.state_dict()) "
    "after the change (it casts the state to each parameter's dtype and device). Nothing was "
    "changed."
)


__all__ = ["MISMATCH_ADVICE", "FusedOperandMismatch", "fused_operand_mismatch"]
