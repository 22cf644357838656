"""Conventions: which tensors a training step keeps for backward.

A convention answers, for one op node, "which tensors does this op keep?" as a list of :class:`Saved`
references: an input of the op, its output, or a new tensor only the op holds (max-pool indices, a dropout
mask, normalization statistics).  Two families:

* **role conventions** (:class:`RoleConvention`: ``paper``, ``megatron``) are data: the tensor roles that are
  kept (from the declared vocabulary, :mod:`symmem.roles`), plus extra tensors per op kind.  They count
  tensors as the accounting they reproduce does, with no storage sharing.
* **rule conventions** (``pytorch``) apply the rule each op kind registers with its shape rule
  (:mod:`symmem.ops`) and count every storage once; a kind with no rule says why
  (:attr:`Convention.unsupported`).

A convention that needs code beyond its data is a subclass that says so in its docstring (``megatron``'s
dropout masks, ``cs231n``'s x2 for backward).  Conventions live one per module in this package and register
themselves on import; :func:`convention` finds them by name.

>>> c = convention("paper")
>>> sorted(c.keep_outputs)[:3]
['attn_probs', 'main_path', 'mlp_hidden']
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import roles
from ..errors import SymmemError
from ..ops import Saved
from ..tensor import TensorSpec

if TYPE_CHECKING:
    from ..derivation import Storage
    from ..graph import Graph, Node


@functools.lru_cache(maxsize=256)
def _saved_output(role: str | None) -> Saved:
    # one value per role: a graph of many layers keeps the same few references again and again
    return Saved("output", role=role)


class Convention:
    """Base class: a name, a description, and :meth:`saved` for one node.

    Subclasses set ``name``, ``description``, ``dedup`` (count each storage once, or each kept reference as
    the accounting it mirrors does), ``options`` (what the convention understands, with defaults) and
    ``unsupported`` (op kind -> why the convention has no rule for it; rule conventions only).
    """

    name: str
    description: str
    dedup: bool
    options: Mapping[str, Any]
    unsupported: Mapping[str, str] = {}
    #: options of a built model (builder options and ``loss``) that this accounting does not see, and why: they
    #: are refused under it rather than accepted with no effect (:func:`symmem.options.check_effect`)
    blind_to: Mapping[str, str] = {}

    @property
    def models_step(self) -> bool:
        """Whether the convention models the training step (what backward allocates), so that a derivation has a
        peak and the options of the step (``optimizer_impl``, ``keep_logits``, ``micro_batches``) mean something."""
        return type(self).grads is not Convention.grads

    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        raise NotImplementedError

    def grads(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> Any:
        """What ``node``'s backward allocates (a :class:`~symmem.ops.autograd.Grads`), or None
        for an accounting that does not model the training step (then it has no peak)."""
        return None

    def extra_storages(self, storages: list[Storage], options: Mapping[str, Any]) -> list[Storage]:
        """Storages the accounting adds on top of the kept tensors (CS231n's x2 for backward); none by
        default."""
        return []

    def finds_nothing(self, graph: Graph) -> str | None:
        """Why this convention cannot count anything in ``graph`` (None when it can); asked when a derivation
        kept no activation at all, to tell "nothing is kept" from "the convention cannot see this graph"."""
        return None


@dataclass(frozen=True)
class Extra:
    """A tensor a role convention adds for every op of a kind: shaped like the op's output."""

    label: str
    dtype: str
    role: str


@dataclass(frozen=True)
class RoleConvention(Convention):
    """A convention that is data: kept output roles, kept input roles and extra tensors per op kind."""

    name: str
    description: str
    keep_outputs: frozenset[str]
    #: role of a consumer node -> indices of its inputs that are kept (e.g. the projection shortcut's input)
    keep_inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    extras: Mapping[str, tuple[Extra, ...]] = field(default_factory=dict)
    dedup: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    blind_to: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role in (*self.keep_outputs, *self.keep_inputs):
            roles.check(role)
        for extras in self.extras.values():
            for extra in extras:
                roles.check(extra.role)

    @property
    def keyed_roles(self) -> frozenset[str]:
        """The graph roles this convention counts by."""
        return frozenset(self.keep_outputs) | frozenset(self.keep_inputs)

    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        role = node.role
        found: list[Saved] = []
        if role in self.keep_outputs:
            found.append(_saved_output(role))
        for i in self.keep_inputs.get(role or "", ()):
            found.append(Saved("input", index=i, label=f"input {i}", role=f"{role}_input"))
        for extra in self.extras.get(node.kind, ()):
            found.append(Saved("new", label=extra.label, role=extra.role,
                               spec=TensorSpec(node.out.shape, extra.dtype, extra.role)))
        return found

    def finds_nothing(self, graph: Graph) -> str | None:
        # the engine asks only when nothing was kept: extras (dropout masks) alone are no sign of sight
        if {graph.node(n).role for n in graph.order()} & self.keyed_roles:
            return None
        return (f"the {self.name} convention counts tensors by role ({', '.join(sorted(self.keyed_roles))}) and "
                f"no node of this graph has one of them, so it keeps nothing; use --convention pytorch")


_REGISTRY: dict[str, Convention | Callable[[], Convention]] = {}


def register(name: str, conv: Convention | Callable[[], Convention]) -> None:
    """Make a convention (or a zero-argument factory for one) available by name."""
    _REGISTRY[name] = conv


def convention(name: str | Convention) -> Convention:
    """The convention called ``name``; a :class:`SymmemError` lists the known ones otherwise."""
    if isinstance(name, Convention):
        return name
    if isinstance(name, str) and name not in _REGISTRY and name in _builtin_modules():
        importlib.import_module(f"{__name__}.{name}")  # only the module of the convention asked for
    if name not in _REGISTRY:
        _load_builtin()
    try:
        found = _REGISTRY[name]
    except (KeyError, TypeError):
        raise SymmemError(f"unknown convention {name!r}; known: {', '.join(names())}") from None
    if not isinstance(found, Convention):
        found = found()
        _REGISTRY[name] = found
    return found


def names() -> tuple[str, ...]:
    """Every known convention name: the built-in modules (each registers the convention of its own name; listing
    them imports none) and whatever else was registered."""
    return tuple(dict.fromkeys([*_builtin_modules(), *_REGISTRY]))


_LOADED: list[bool] = []
_MODULES: list[str] = []


def _builtin_modules() -> list[str]:
    # Every module of this package is a convention that registers itself, under its module's name, on import:
    # no list to keep.
    if not _MODULES:
        _MODULES.extend(sorted(info.name for info in pkgutil.iter_modules(__path__)))
    return _MODULES


def _load_builtin() -> None:
    if _LOADED:
        return
    _LOADED.append(True)
    for name in _builtin_modules():
        importlib.import_module(f"{__name__}.{name}")
