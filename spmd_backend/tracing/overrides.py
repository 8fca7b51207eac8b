"""Module overrides: swap submodules make_fx cannot trace, then fix up the traced graph.

An :class:`Override` is consulted for every submodule (by FQN) before tracing. Returning a
different module swaps it in for the duration of the trace only: the user's model is restored
afterwards. The replacement must expose the same parameters and buffers (same tensors under the
same names) so that lifting stays exact; :func:`swapped_submodules` checks that. After the
data-parallel expansion, ``transform(gm, flat_state)`` may rewrite the graph (for example replace
the replacement's placeholder ops by what the original module really does).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from spmd_backend.errors import SpmdUsageError


class Override(abc.ABC):
    """Replace a submodule for tracing and transform the traced graph afterwards."""

    @abc.abstractmethod
    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module:
        """Return the module to trace instead of ``orig_submodule`` (or it, unchanged)."""

    def transform(self, gm: fx.GraphModule, flat_state: list[torch.Tensor]) -> fx.GraphModule:
        """Rewrite the traced, expanded graph; ``flat_state`` are its state inputs, in order."""
        return gm


def _set_submodule(root: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _state_signature(module: nn.Module) -> dict[str, int]:
    sig = {f"p:{n}": id(p) for n, p in module.named_parameters(remove_duplicate=False)}
    sig.update({f"b:{n}": id(b) for n, b in module.named_buffers(remove_duplicate=False)})
    return sig


@contextlib.contextmanager
def swapped_submodules(root: nn.Module, overrides: Sequence[Override]) -> Iterator[list[str]]:
    """Swap in every override's replacement; yields the swapped FQNs; always restores."""
    if not overrides:
        yield []
        return
    before = _state_signature(root)
    swapped: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            new = child
            for override in overrides:
                new = override.replacement(fqn, new)
            if new is not child:
                _set_submodule(root, fqn, new)
                swapped.append((fqn, child))
            else:
                visit(fqn, child)

    try:
        visit("", root)
        after = _state_signature(root)
        if after != before:
            changed = sorted(set(before.items()) ^ set(after.items()))
            name = changed[0][0][2:] if changed else "?"
            raise SpmdUsageError(
                "module_override: a replacement module must expose the same parameters and "
                f"buffers as the module it replaces; {name!r} differs "
                f"(swapped: {[f for f, _ in swapped]})"
            )
        yield [f for f, _ in swapped]
    finally:
        for fqn, orig in reversed(swapped):
            _set_submodule(root, fqn, orig)
