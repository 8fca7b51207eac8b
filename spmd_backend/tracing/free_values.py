"""The Python values a train-step function reads from outside its arguments.

A compile-door trace runs the step's Python once; every plain value it reads from a global, a
closure variable or an attribute of such an object (``clip``, ``args.accum_steps``,
``cfg.train.label_smoothing``) is baked into the graph. Changing one between calls must retrace,
or the replay trains with the old value (it did: a global loss scale changed after two calls was
ignored). :func:`free_values` lists those values, with a label that says where each lives, for
the step key (:class:`~spmd_backend.tracing.key.StepKey`).

Which values: the names the step's code mentions (``co_names`` and free variables, nested code
included), looked up in its globals and closure cells; objects reached that way are followed
into their own ``vars()`` entries whose names the code also mentions (``cfg.clip``: both names
appear), classes and Python modules likewise, up to :data:`MAX_DEPTH` attributes deep; Python
functions of the user's code (not torch's, not the standard library's, not installed
packages') that the step calls are read the same way, as are a bound method's ``self``, and
the hooks torch runs while the step is traced (module, global module and parameter gradient
hooks: a hook object's ``self.scale``, a hook lambda's closure). The methods
of the user's own module classes (a ``forward`` that reads a module-level flag) are read too,
and so are the plain class attributes those methods name (``self.LAMBDA`` set on the class);
a module other than the one the step is bound to (a global
``criterion = nn.CrossEntropyLoss(...)``) contributes its modes and plain attributes.

Lists, tuples and dicts reached that way (``CONFIG["temperature"]``, ``TEMP[0]``) are followed
into their entries, each keyed under its index or key, up to :data:`MAX_ITEMS` entries (a
longer one by its length and the hash of its entries, where they are hashable: walking it would
cost milliseconds per call, 4.8 ms for 4096 entries): the code names the container, not
the entry it reads, so every entry counts. A step that writes into such a container is refused
(:mod:`spmd_backend.tracing.side_effects`), so the step cannot change them itself: what changes
them is the caller, between calls, and that must retrace (until 2026-11-27 a temperature kept
in a global list and changed after two calls was ignored: 0.012 off DDP). Sets are keyed when
all their entries are plain.

What it does not follow: tensors (a captured tensor is the trace's business), the bound
module and optimizer, GradScalers and schedulers (keyed elsewhere). Only ``vars()`` is read,
never ``getattr``, so properties and ``__getattr__`` never run.

:func:`random_generators` finds, the same way, the random generator objects of the user's
(``rng = np.random.default_rng(0)``, ``self.rng = random.Random(0)``) whose draws a trace would
bake in (:mod:`spmd_backend.tracing.random_state` refuses them); :func:`mutable_objects` the
containers and objects of the user's that a step could write Python state into
(:mod:`spmd_backend.tracing.side_effects` checks them).

Guarantees: pure (reads, never writes), deterministic order, cost proportional to the names
the step's code mentions (the code analysis is cached per code object).
"""

from __future__ import annotations

import functools
import os
import random
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.amp import GradScaler
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from spmd_backend.tracing.key import user_hooks
from spmd_backend.tracing.object_state import module_state
from spmd_backend.tracing.values import hashable, is_plain

#: attribute hops followed from a global or closure variable (``cfg.train.clip`` is two; an
#: entry of a list or dict is a hop too)
MAX_DEPTH = 3

#: entries of one list, tuple or dict keyed one by one (0.4 ms per call at most)
MAX_ITEMS = 256


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this package
    roots.add(os.path.dirname(os.path.abspath(torch.__file__)))
    return tuple(sorted(os.path.abspath(r) + os.sep for r in roots if r))


_LIBRARY_ROOTS = _library_roots()


@functools.lru_cache(maxsize=4096)
def _is_user_file(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return False
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    return not path.startswith(_LIBRARY_ROOTS)


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> frozenset[str]:
    """Every global/attribute name and free variable ``code`` and its nested code mention."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return frozenset(names)


def _is_user_module(mod: types.ModuleType) -> bool:
    file = getattr(mod, "__file__", None)
    return file is not None and _is_user_file(file)


def is_user_class(cls: type) -> bool:
    """A class defined by the user's code (not torch's, the standard library's or an installed
    package's)."""
    mod = sys.modules.get(getattr(cls, "__module__", "") or "")
    return mod is None or _is_user_module(mod) or mod.__name__ == "__main__"


#: objects whose state the key covers elsewhere, or that a trace cannot bake in
_SKIPPED = (torch.Tensor, torch.optim.Optimizer, GradScaler, LRScheduler, ReduceLROnPlateau)


def is_random_generator(value: Any) -> bool:
    """A Python or numpy random generator object (``random.Random(0)``,
    ``np.random.default_rng()``, ``np.random.RandomState``)."""
    if isinstance(value, random.Random):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.random.Generator, np.random.RandomState))


class _Walk:
    def __init__(self, skip_modules: set[int]) -> None:
        self.skip_modules = skip_modules
        self.out: list[tuple[str, Any]] = []
        self.seen: set[Any] = set()
        #: random generator objects met on the way (label, generator)
        self.generators: list[tuple[str, Any]] = []
        #: containers and user objects met on the way (label, object): what the step could
        #: write Python state into (see :mod:`spmd_backend.tracing.side_effects`)
        self.mutable: list[tuple[str, Any]] = []
        self._mutable_ids: set[int] = set()

    def _note_mutable(self, label: str, value: Any) -> None:
        if id(value) not in self._mutable_ids:
            self._mutable_ids.add(id(value))
            self.mutable.append((label, value))

    def function(self, fn: Callable[..., Any], label: str, self_label: str | None = None,
                 depth: int = 0, role: str | None = None) -> None:
        """Read ``fn``'s globals and closure; a bound method's ``self`` is read like a global
        (labelled ``self_label``, by default ``<label>.__self__``). ``role`` (a hook's "forward
        hook of layer1") goes before the function's name in the labels."""
        if isinstance(fn, types.MethodType):
            code = getattr(fn.__func__, "__code__", None)
            if isinstance(code, types.CodeType) and _is_user_file(code.co_filename):
                self.value(self_label or f"{label}.__self__", fn.__self__, _code_names(code),
                           depth)
            fn = fn.__func__
        if isinstance(fn, functools.partial):
            for i, a in enumerate(fn.args):
                self.value(f"{label} (partial argument {i})", a, frozenset(), MAX_DEPTH)
            for k, a in fn.keywords.items():
                self.value(f"{label} (partial argument {k})", a, frozenset(), MAX_DEPTH)
            self.function(fn.func, label, role=role)
            return
        code = getattr(fn, "__code__", None)
        if not isinstance(fn, types.FunctionType) or not isinstance(code, types.CodeType):
            return
        if id(fn) in self.seen or not _is_user_file(code.co_filename):
            return
        self.seen.add(id(fn))
        names = _code_names(code)
        where = f"{role} ({fn.__qualname__})" if role else fn.__qualname__
        glob = fn.__globals__
        for name in sorted(names):
            if name in glob:
                self.value(f"global {name!r} (read by {where})", glob[name], names, 0)
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # not yet assigned
                continue
            self.value(f"closure variable {var!r} of {where}", contents, names, 0)

    def container(self, label: str, value: Any, names: frozenset[str], depth: int) -> None:
        """The entries of a list, tuple, dict or set (module docstring)."""
        if id(value) in self.seen:  # a container holding itself, or met twice
            return
        self.seen.add(id(value))
        if len(value) > MAX_ITEMS:
            items = tuple(value.items()) if type(value) is dict else tuple(value)
            try:
                digest: int | None = hash(items)
            except TypeError:  # an entry that is a list or dict
                digest = None
            self.out.append((f"{label} (over {MAX_ITEMS} entries: its length and hash)",
                             (len(value), digest)))
            return
        if type(value) is set:
            if all(is_plain(v) for v in value):
                self.out.append((label, hashable(frozenset(value))))
            return
        entries = value.items() if type(value) is dict else enumerate(value)
        for key, entry in entries:
            if is_plain(key):
                self.value(f"{label}[{key!r}]", entry, names, depth + 1)

    def value(self, label: str, value: Any, names: frozenset[str], depth: int) -> None:
        t = type(value)
        if is_plain(value):
            self.out.append((label, hashable(value)))
            return
        if t in (list, dict, set):
            self._note_mutable(label, value)
        if t in (list, tuple, dict, set):
            if depth < MAX_DEPTH:
                self.container(label, value, names, depth)
            return
        if isinstance(value, _SKIPPED):
            return
        if is_random_generator(value):
            if not any(g is value for _, g in self.generators):
                self.generators.append((label, value))
            return
        if isinstance(value, nn.Module):
            if id(value) not in self.skip_modules and id(value) not in self.seen:
                self.seen.add(id(value))
                self._note_mutable(label, value)
                rows = module_state(list(value.named_modules()))[0]
                self.out.append((label, tuple((name, attrs) for name, attrs, _ in rows)))
            return
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            self.function(value, label)
            return
        # an object is read once per set of names: two functions may read different attributes
        seen = (id(value), names)
        if depth >= MAX_DEPTH or seen in self.seen:
            return
        if isinstance(value, types.ModuleType):
            if not _is_user_module(value):
                return
        elif isinstance(value, type):
            if not is_user_class(value):
                return
        elif callable(value) and not hasattr(value, "__dict__"):
            return
        try:
            attrs = vars(value)
        except TypeError:
            return
        self.seen.add(seen)
        if not isinstance(value, (types.ModuleType, type)) and is_user_class(t):
            self._note_mutable(label, value)
        for name in sorted(names & attrs.keys()):
            self.value(f"{label}.{name}", attrs[name], names, depth + 1)
        if isinstance(value, (types.ModuleType, type)) or not is_user_class(t):
            return
        # an instance of a class of the user's: its class constants and the methods the code
        # calls on it (``self.WEIGHT``, ``trainer.compute_loss(...)``)
        for name in sorted(names - attrs.keys()):
            attr = _class_attribute(t, name)
            if isinstance(attr, types.FunctionType):
                self.function(types.MethodType(attr, value), f"{label}.{name}", label, depth)
            elif attr is not None and is_plain(attr):
                self.out.append((f"{label}.{name}", hashable(attr)))


def _class_attribute(cls: type, name: str) -> Any:
    """``name`` as defined on ``cls`` or a base (without running descriptors)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _user_methods(modules: Sequence[tuple[str, nn.Module]]) -> Iterator[types.FunctionType]:
    """The functions defined by the user's own module classes (``forward`` and its helpers),
    each once; torch's and installed packages' classes are not read."""
    classes: dict[type, None] = {}
    for _, mod in modules:
        for cls in type(mod).__mro__:
            if cls is nn.Module or cls is object:
                break
            classes.setdefault(cls, None)
    for cls in classes:
        if not is_user_class(cls):
            continue
        for attr in vars(cls).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, types.FunctionType):
                yield attr


#: a module's hook dicts (the ``_with_kwargs`` entries are flags, not hooks)
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _hooks(modules: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, Any]]:
    """``(label, hook)`` of every hook the trace runs for ``modules``: their module hooks, the
    global module hooks, and their parameters' gradient hooks. Runs on every call: empty hook
    dicts (almost all of them) cost one lookup each."""
    from torch.nn.modules import module as module_mod

    def kind(attr: str) -> str:
        return attr.strip("_").replace("_", " ")[:-1]

    found: list[tuple[str, Any]] = []
    for attr in _MODULE_HOOKS:
        hooks = getattr(module_mod, f"_global{attr}", None)
        if hooks:
            found.extend((f"global {kind(attr)}", h) for h in hooks.values())
    for name, mod in modules:
        state = mod.__dict__
        for attr in _MODULE_HOOKS:
            hooks = user_hooks(state.get(attr))
            if hooks:
                found.extend((f"{kind(attr)} of {name or '<root>'}", h) for h in hooks.values())
        for pname, p in state["_parameters"].items():
            if p is None:
                continue
            for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
                if hooks:
                    label = f"gradient hook of parameter {name + '.' if name else ''}{pname}"
                    found.extend((label, h) for h in hooks.values())
    return found


def _class_constants(modules: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, Any]]:
    """``(label, hashable value)`` of each plain class attribute of the user's own module
    classes that their methods' code names (``self.LAMBDA`` read in ``forward``, set on the
    class between calls): the module's keyed state holds its instance attributes only."""
    found: list[tuple[str, Any]] = []
    for cls in dict.fromkeys(type(mod) for _, mod in modules):
        for name in _method_names(cls):
            value = _class_attribute(cls, name)
            if value is not None and is_plain(value):
                found.append((f"class attribute {cls.__qualname__}.{name}", hashable(value)))
    return found


@functools.lru_cache(maxsize=1024)
def _method_names(cls: type) -> tuple[str, ...]:
    """The names the methods of a user module class (and of its user bases) mention, sorted;
    empty for torch's and installed packages' classes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is nn.Module or not is_user_class(klass):
            break
        for attr in vars(klass).values():
            func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            if isinstance(func, types.FunctionType):
                names |= _code_names(func.__code__)
    return tuple(sorted(n for n in names if not n.startswith("__")))


def _walk(fn: Callable[..., Any], modules: Sequence[tuple[str, nn.Module]]) -> _Walk:
    walk = _Walk({id(m) for _, m in modules})
    walk.function(fn, getattr(fn, "__qualname__", "the step"))
    for method in _user_methods(modules):
        walk.function(method, method.__qualname__)
    walk.out.extend(_class_constants(modules))
    for label, hook in _hooks(modules):
        # torch runs hooks, not the step's code: their values (a scale on a hook object, a
        # closure variable of a lambda) are read as the step's own
        if isinstance(hook, (types.FunctionType, types.MethodType, functools.partial)):
            walk.function(hook, label, role=label)
        elif is_user_class(type(hook)):
            call = _class_attribute(type(hook), "__call__")
            if isinstance(call, types.FunctionType):
                walk.function(types.MethodType(call, hook), label, label, role=label)
    return walk


def free_values(
    fn: Callable[..., Any], modules: Sequence[tuple[str, nn.Module]] = ()
) -> tuple[tuple[str, Any], ...]:
    """``(label, hashable value)`` of each plain value the step ``fn``, and the methods of the
    user's module classes among ``modules`` (the bound module's tree, whose own attributes are
    keyed elsewhere), read from their globals and closures; in a deterministic order."""
    return tuple(_walk(fn, modules).out)


def step_defaults(fn: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    """``(label, hashable value)`` of the step's own defaults, which a call that does not pass
    them reads like globals (until 2026-11-28 a default changed in place,
    ``def step(..., cfg=CONF)``, replayed the old value; hunt 45)."""
    inner = getattr(fn, "__func__", fn)
    return (("defaults", hashable(getattr(inner, "__defaults__", None))),
            ("kwdefaults", hashable(getattr(inner, "__kwdefaults__", None))))


def mutable_objects(
    fn: Callable[..., Any], modules: Sequence[tuple[str, nn.Module]] = ()
) -> list[tuple[str, Any]]:
    """``(label, object)`` of each list, dict and set, each instance of a user class and each
    module other than ``modules`` that the step can reach where :func:`free_values` looks:
    the Python state outside its arguments and its own module that a step could write to."""
    return _walk(fn, modules).mutable


def random_generators(
    fn: Callable[..., Any], modules: Sequence[tuple[str, nn.Module]] = ()
) -> list[tuple[str, Any]]:
    """``(label, generator)`` of each Python or numpy random generator object the step can
    reach: found where :func:`free_values` looks, or held as an attribute by one of
    ``modules`` (``self.rng = random.Random(0)``)."""
    found = _walk(fn, modules).generators
    for name, mod in modules:
        for attr, value in vars(mod).items():
            if is_random_generator(value) and not any(g is value for _, g in found):
                found.append((f"attribute {name or '<root>'}.{attr}", value))
    return found
