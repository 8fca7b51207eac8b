"""Node metadata owned by spmd_backend, and its public accessors.

Every node of a traced step carries two annotations in ``node.meta``:

``node.meta["spmd_fqn"]``
    The state-dict style FQN of the innermost module that owns the node (``"layers.3.attn"``,
    ``""`` for the root module) or ``None`` where no module owns it (optimizer bookkeeping that
    touches no parameter, graph inputs that are not module state).
``node.meta["spmd_phase"]``
    One of :class:`Phase`: ``forward``, ``backward``, ``recompute`` (activation-checkpoint replay),
    ``optimizer``, ``comm`` (collectives and their waits), or ``input``/``output`` for
    placeholders and the output node.

``node.meta["spmd_input"]``
    On a placeholder of a traced step: what it is (``param``, ``buffer``, ``state``, ``hyper``,
    ``grad``, ``arg``).
``node.meta["spmd_bucket_params"]``
    On a gradient collective: the FQNs of the parameters whose gradients it carries (one for
    the expansion's per-gradient all_reduce, several after bucketing).

Passes that create nodes must call :func:`inherit` (the node takes over the annotation of the
node it replaces) or :func:`annotate` (the node names its own). :func:`annotated` is the
invariant check the pass manager runs.
"""

from __future__ import annotations

import enum

import torch.fx as fx

FQN_KEY = "spmd_fqn"
PHASE_KEY = "spmd_phase"
BUCKET_PARAMS_KEY = "spmd_bucket_params"
#: on a compressed gradient all_reduce: its :class:`~spmd_backend.graph.comm.Compression`
COMPRESSION_KEY = "spmd_compression"
INPUT_KIND_KEY = "spmd_input"
#: on a parameter placeholder: the parameter's FQN (the node name is sanitized, maybe suffixed)
PARAM_NAME_KEY = "spmd_param"


class Phase(str, enum.Enum):
    """The part of a training step a node belongs to."""

    INPUT = "input"
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    COMM = "comm"
    OUTPUT = "output"

    def __str__(self) -> str:  # so f-strings print "forward", not "Phase.FORWARD"
        return self.value


def annotate(node: fx.Node, *, fqn: str | None, phase: Phase | str) -> fx.Node:
    """Set the owning module FQN and phase of ``node``; returns the node for chaining."""
    node.meta[FQN_KEY] = fqn
    node.meta[PHASE_KEY] = Phase(phase)
    return node


def inherit(dst: fx.Node, src: fx.Node, *, phase: Phase | str | None = None) -> fx.Node:
    """Give ``dst`` the annotation of ``src`` (optionally overriding the phase)."""
    dst.meta[FQN_KEY] = src.meta.get(FQN_KEY)
    dst.meta[PHASE_KEY] = Phase(phase) if phase is not None else src.meta.get(PHASE_KEY)
    return dst


def get_fqn(node: fx.Node) -> str | None:
    """The owning module's FQN of ``node`` (``""`` is the root; ``None`` means no module)."""
    return node.meta.get(FQN_KEY)


def get_phase(node: fx.Node) -> Phase | None:
    """The phase of ``node``, or ``None`` when the node was never annotated."""
    phase = node.meta.get(PHASE_KEY)
    return Phase(phase) if phase is not None else None


def annotated(node: fx.Node) -> bool:
    """True when ``node`` carries a phase annotation (the FQN may legitimately be ``None``)."""
    return node.meta.get(PHASE_KEY) is not None


def bucket_params(node: fx.Node) -> list[str]:
    """Parameter FQNs whose gradients the collective ``node`` carries (may be empty)."""
    return list(node.meta.get(BUCKET_PARAMS_KEY, ()))


def owner_of(name: str) -> str:
    """The FQN of the module owning parameter/buffer ``name`` (``"a.b.weight"`` -> ``"a.b"``)."""
    return name.rpartition(".")[0]


def param_name(node: fx.Node) -> str | None:
    """The FQN of the parameter a placeholder holds (``layers.1.bias``), or None."""
    return node.meta.get(PARAM_NAME_KEY)


def get_input_kind(node: fx.Node) -> str | None:
    """What a placeholder of a traced step holds (``param``, ``state``, ``arg``...), or None."""
    return node.meta.get(INPUT_KIND_KEY)
