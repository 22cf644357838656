"""One fake world for the traces of one fit: each trace starts in a world no earlier trace changed.

A fit in every size (:mod:`.symbolic_sizes`) traces the module at a dozen small configurations, each forward on fake
tensors whose input sizes B, S are the same symbols at the same hints.  In a fresh fake world a trace pays for every
op's symbolic shape arithmetic; most of them repeat the previous configuration's on the same symbolic shapes (the
``V`` probe changes only the embedding and the head, the ``F`` probe only the MLP).  One world for the fit's traces
lets the shape cache (:mod:`symmem.record.shape_cache`) and its remembered size arithmetic
(:mod:`symmem.record.sym_memo`) answer them.

What a trace reads from its world besides those caches is the ShapeEnv's state: its guards (the trace's guard list
and domain), replacements (a pinned or unified size), value ranges (``Max``/``Min`` resolved, the bounds) and
symbols.  A fresh world starts with none of them; a world another trace ran in holds that trace's.  So a trace
runs in the fit's world only where the world is still **as made**: its ShapeEnv's state equal, field by field
(PyTorch's own ``ShapeEnv.check_equal``, which leaves out caches, counters and debugging records), to that of a world
made alike and never run in.  Every trace then sees what it would in a fresh world -- no guard, no replacement,
no narrowed range -- and logs its own guards from an empty list, as a fresh world's trace does.  A trace that adds
a guard, a replacement or a symbol leaves the world changed: the next trace gets a new world (and the fit goes on
sharing that one).  A Llama fit's 14 traces add none (its B and S are never compared with a number), one world.

The training step of a configuration (:mod:`.sized_step`) records in its trace's fake world (stop 40): the step's
guards are the world's, so a world several traces ran in is lent to one step only (:meth:`Lease.claim`): the first
that asks, while the world is as made or holds only the asking trace's own changes (it was the last to run there).
Any other configuration's step records in a fresh world, as with ``sized_step.SEEDED = False``.

The world "as made" is compared with is made once a process for each set of ``make_world`` arguments
(:func:`reference`): ``check_equal`` only reads it and nothing ever runs in it, so each lease need not make a second
world of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fake import FakeWorld, make_world

#: False: every trace of a fit in a fresh world (the slow path, for comparisons)
ONE_WORLD = True
#: the ShapeEnv of a world made and never run in, by make_world's arguments (reference); a few keys a process
_REFERENCES: dict[tuple[Any, ...], Any] = {}
_MAX_REFERENCES = 64


def reference(values: dict[str, int], symbolic: bool, multiple_of: dict[str, int] | None,
              concrete: tuple[str, ...]) -> Any:
    """The ShapeEnv of a world ``make_world`` makes with these arguments, never run in: made once per arguments and
    kept, as ``check_equal`` only reads it.  The sizes in their order: it decides which symbol is ``s0``."""
    key = (tuple(values.items()), symbolic, tuple(sorted((multiple_of or {}).items())), tuple(concrete))
    env = _REFERENCES.get(key)
    if env is None:
        env = make_world(values, symbolic=symbolic, multiple_of=multiple_of, concrete=concrete).env
        if len(_REFERENCES) >= _MAX_REFERENCES:  # bounded: drop the oldest
            _REFERENCES.pop(next(iter(_REFERENCES)))
        _REFERENCES[key] = env
    return env


def as_made(env: Any, fresh: Any) -> bool:
    """Whether ShapeEnv ``env``'s state equals ``fresh``'s (a ShapeEnv made alike and never run in)."""
    try:
        env.check_equal(fresh)
    except Exception:  # NotEqualError, or a torch without check_equal: not shared
        return False
    return True


@dataclass(eq=False)
class Lease:
    """One fake world traces of one fit ran in one after another, each starting from the state it was made with."""

    world: FakeWorld
    key: tuple[Any, ...]  # make_world's arguments
    fresh: Any  # the ShapeEnv of a world made alike, never run in (reference): what "as made" compares with
    shapes: Any = None  # the shape cache of its runs (the first run's)
    last: Any = None  # the SharedWorld of the last trace that ran in it
    claimant: Any = None  # the SharedWorld whose step records in it (claim)
    runs: int = 0

    def unchanged(self) -> bool:
        return as_made(self.world.env, self.fresh)

    def claim(self, shared: Any) -> bool:
        """Whether the step of the trace ``shared`` (its :class:`~symmem.importer.recording.SharedWorld`) may record
        in this world: the first step that asks, while the world holds no trace's changes but its own."""
        if self.claimant is None and (self.last is shared or self.unchanged()):
            self.claimant = shared
        return self.claimant is shared


@dataclass
class FitWorld:
    """The fake world the traces of one fit share (module docstring); made where the fit starts."""

    lease: Lease | None = None
    worlds: int = 0  # how many worlds the fit's traces made
    runs: int = 0  # how many traces ran in a world of this fit

    def take(self, values: dict[str, int], symbolic: bool, multiple_of: dict[str, int] | None,
             concrete: tuple[str, ...], shared: Any) -> Lease:
        """The world for a trace at input sizes ``values`` (``make_world``'s arguments): the last one where it is
        still as made for the same arguments, else a new one.  ``shared``: the trace's SharedWorld (or None)."""
        key = (tuple(sorted(values.items())), symbolic, tuple(sorted((multiple_of or {}).items())), tuple(concrete))
        lease = self.lease
        if lease is None or lease.key != key or lease.claimant is not None or not lease.unchanged():
            made = make_world(values, symbolic=symbolic, multiple_of=multiple_of, concrete=concrete)
            lease = self.lease = Lease(made, key, reference(values, symbolic, multiple_of, concrete))
            self.worlds += 1
        lease.last = shared
        lease.runs += 1
        self.runs += 1
        return lease
