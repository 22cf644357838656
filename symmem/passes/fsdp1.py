"""FSDP1 (``FullyShardedDataParallel``) in one rank's training step, as the schedule (:mod:`.schedule`) walks it.

``fsdp1`` is ``FullyShardedDataParallel(model, sharding_strategy=FULL_SHARD,
auto_wrap_policy=ModuleWrapPolicy({Block}))`` -- one unit per repeated block, the root holding every other
parameter -- and ``fsdp1-grad-op`` the same with ``SHARD_GRAD_OP``; every other option at its default
(``use_orig_params=False``, ``backward_prefetch=BACKWARD_PRE``, ``forward_prefetch=False``).  Measured on gloo
runs (:mod:`symmem.record.fsdp1_runs`, ``tests/test_fsdp1.py``, docs/regimes.md), per unit ``u`` with ``n_u``
the number of its parameters' elements and ``k_u = ceil(n_u / N)``:

* **FlatParameter** -- a unit's parameters are flattened and concatenated into one flat parameter of ``n_u``
  elements, padded at its end to ``N * k_u`` (no alignment padding without ``use_orig_params``) and split
  evenly: every rank stores ``k_u`` elements, padding included, and so do the optimizer's state and the sharded
  gradient -- every rank holds the same bytes (unlike FSDP2, whose per-parameter shards leave the padding out of
  the optimizer state).  The optimizer steps on one flat shard per unit, the root's first: AdamW's for-loop
  temporaries are a flat shard's size.
* **unsharded flat parameter** ``P_u`` (``N * k_u`` elements, one storage that FSDP resizes) -- allocated at the
  unit's pre-forward (the all-gather writes into it); ``FULL_SHARD`` frees it at the post-forward, except the
  root's, which stays from its pre-forward to its post-backward; ``SHARD_GRAD_OP`` keeps every unit's from
  forward to its post-backward.  In backward a unit's pre-backward all-gathers it again where it was freed and
  prefetches the next unit in backward order (``BACKWARD_PRE``).
* **gradients** -- each parameter's gradient waits (autograd's input buffer of the flat parameter's
  ``split``) until the unit's last one is made; then they are concatenated into the unsharded flat gradient
  ``F_u`` (``n_u`` elements) and freed.  The post-backward frees ``P_u``, pads ``F_u`` into a copy of ``N * k_u``
  elements where ``N`` does not divide ``n_u``, makes the sharded gradient ``G_u`` (``k_u``), reduce-scatters into
  it and drops ``F_u`` and the padded copy; ``G_u`` becomes the flat parameter's ``.grad`` at the end of backward
  and ``zero_grad`` frees it.
* **gradient accumulation** -- every micro-batch but the last under ``no_sync()``: a unit's post-backward then
  reduces nothing; the flat gradient ``F_u`` stays the flat parameter's ``.grad`` (unsharded, ``n_u`` elements),
  and a later micro-batch's ``F_u`` is added into it in place by ``AccumulateGrad`` and freed, before the hook.
  ``FULL_SHARD`` frees ``P_u`` there as with sync; ``SHARD_GRAD_OP`` keeps it unsharded (FSDP1's heuristic,
  ``_should_free_in_backward``), so its next forward gathers nothing.  The last micro-batch's post-backward
  pads, reduce-scatters and frees the accumulated ``.grad`` as a single step's does.

>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", optimizer="adamw", values={"B": 4, "N": 2},
...            widths="64,127,10", loss="cross-entropy", data_parallel="fsdp1")
>>> d.value("peak_first_step"), d.value("peak")  # both ranks of a gloo run measure the same
(121760, 159912)
"""

from __future__ import annotations

import functools
from typing import Any

import sympy

from ..shapes import numel as shape_numel
from ..symbols import N
from .data_parallel import Fsdp, ceil_div

#: The FSDP1 engines, and whether each frees a unit's unsharded flat parameter after its forward.
FSDP1 = {"fsdp1": True, "fsdp1-grad-op": False}


class Fsdp1(Fsdp):
    """FSDP1's flat parameters and buffers in one rank's step (the module's docstring); the units, their first
    and last nodes and the root are :class:`~symmem.passes.data_parallel.Fsdp`'s."""

    #: unit -> its unsharded flat gradient, the flat parameter's .grad between micro-batches under no_sync()
    held_grads: dict[Any, int]

    def _sizes(self) -> None:
        """The flat parameters' sizes (FSDP1 shards no parameter on its own)."""
        self.held_grads = {}
        numel = {name: shape_numel(shape) for name, shape in self.sim.params}
        #: elements of each unit's flat parameter, unpadded, and of one rank's shard of it (padding included)
        self.flat = {u: sympy.Add(*(numel[p] for p in ps)) for u, ps in self.params.items()}
        self.flat_shard = {u: ceil_div(n, self.world, expanded=True) for u, n in self.flat.items()}

    def flat_params(self) -> list[tuple[str, sympy.Expr]]:
        """The flat parameters as ``model.parameters()`` lists them (what the optimizer steps on): the root's
        first, then each unit's; ``(name, elements of one rank's shard)``."""
        return [(f"flat[{'root' if u is None else u}]", self.flat_shard[u]) for u in [None, *self.units]
                if self._has(u)]

    def _name(self, unit: Any) -> str:
        return "root" if unit is None else str(unit)

    def _gather(self, unit: Any, phase: str, with_params: bool = True) -> None:
        """Allocate ``P_u`` (the all-gather writes into it); FSDP1 has no separate all-gather output."""
        if unit in self.unsharded or not self._has(unit):
            return
        sid = self.sim.new(f"fsdp1.unsharded[{self._name(unit)}]", "parameter",
                           _product(self.world, self.flat_shard[unit], self.wb))
        self.unsharded[unit] = [sid]
        self.sim.event(phase, self.at, [sid], [])

    # -- forward --------------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        self.at = self.sim.order[0] if self.sim.order else None
        self._gather(None, "forward")

    def before_forward(self, n: str) -> None:
        self.at = n
        unit = self.first_node.get(n)
        if unit is not None:
            self._gather(unit, "forward")

    def end_forward(self) -> None:
        """The root's post-forward keeps the root's flat parameter unsharded (FSDP1 never frees it there)."""

    # -- recompute (every-K: a checkpoint around several units) ----------------------------------------------
    def before_recompute(self, n: str) -> None:
        """An inner unit's pre-forward in the recompute unshards it (a prefetched one is already)."""
        unit = self.first_node.get(n)
        if unit is not None and unit not in self.started_backward:
            self.at = f"{n}:recompute"
            self._gather(unit, "backward")

    def after_recompute(self, n: str) -> None:
        """Its post-forward then frees it again under ``FULL_SHARD`` (measured: FSDP1 reshards in the recompute;
        the unit's pre-backward all-gathers it once more)."""
        unit = self.last_node.get(n)
        if unit is not None and unit not in self.started_backward and self.reshard:
            self.at = f"{n}:recompute"
            self._reshard(unit, "backward")

    # -- backward -------------------------------------------------------------------------------------------
    def pre_backward(self, unit: Any) -> None:
        if unit in self.started_backward:
            return
        self.started_backward.add(unit)
        self._gather(unit, "backward")
        nxt = self._next_backward(unit)
        if nxt is not None:
            self._gather(nxt, "backward")  # BACKWARD_PRE prefetch

    def post_backward(self, unit: Any) -> None:
        if unit in self.done_backward or not self._has(unit):
            return
        self.done_backward.add(unit)
        sim, name = self.sim, self._name(unit)
        grads = [sim.param_grad.pop(p) for p in self.params[unit] if p in sim.param_grad]
        flat_bytes, pad_bytes, shard_bytes = _grad_sizes(self.flat[unit], self.flat_shard[unit], self.world,
                                                         sim.grad_bytes)
        flat = sim.new(f"fsdp1.flat_grad[{name}]", "temporary" if self.sync else "gradient", flat_bytes)
        sim.event("backward", self.at, [flat], [])
        sim.event("backward", self.at, [], grads)
        held = self.held_grads.pop(unit, None)
        if held is not None:  # an earlier micro-batch's .grad (no_sync): AccumulateGrad adds into it in place
            sim.event("backward", self.at, [], [flat])
            flat = held
        if not self.sync:  # no_sync(): the flat gradient stays the .grad; SHARD_GRAD_OP keeps P_u unsharded
            self.held_grads[unit] = flat
            if self.reshard:
                self._reshard(unit, "backward")
            return
        self._reshard(unit, "backward")
        pad = sim.new(f"fsdp1.padded_grad[{name}]", "temporary", pad_bytes)
        shard = sim.new(f"fsdp1.sharded_grad[{name}]", "gradient", shard_bytes)
        self.sharded_grads.append(shard)
        sim.event("backward", self.at, [pad], [])
        sim.event("backward", self.at, [shard], [])
        sim.event("backward", self.at, [], [flat, pad])

    def after_backward(self, n: str) -> None:
        self.at = n
        unit = self.unit_of.get(n)
        if unit is not None and self.last_backward.get(unit) == n:
            self.post_backward(unit)

    def end_backward(self) -> list[int]:
        """The root's post-backward, after every other op's backward (its flat parameter's gradient is the last
        to be complete); nothing more is freed at the backward's end."""
        self.at = None
        self.pre_backward(None)
        self.post_backward(None)
        return []


@functools.lru_cache(maxsize=1024)
def _product(*factors: Any) -> sympy.Expr:
    """The factors multiplied left to right, once per unit size (a stack's units repeat it, both walks ask)."""
    out = factors[0]
    for f in factors[1:]:
        out = out * f
    return out


@functools.lru_cache(maxsize=1024)
def _grad_sizes(flat: sympy.Expr, shard: sympy.Expr, world: sympy.Expr, grad_bytes: Any
                ) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """The bytes of a unit's unsharded flat gradient, of its padded copy and of its sharded gradient, once per unit
    size (a stack's units repeat it, both walks of the step ask)."""
    padded = world * shard
    # F.pad copies the flat gradient only where N does not divide it: Min(1, padding) is 0 or 1
    return flat * grad_bytes, _at_most_one(padded - flat) * padded * grad_bytes, shard * grad_bytes


@functools.lru_cache(maxsize=1024)
def _at_most_one(padding: sympy.Expr) -> sympy.Expr:
    """``Min(1, padding)``: the padding ``N * ceiling(n / N) - n`` is 0 for ``N = 1`` and can exceed 1, so for a
    symbolic ``N`` no comparison decides it and ``Min`` stays as written -- built without sympy's search for one
    (the most of an FSDP1 peak's time otherwise); a number is evaluated.

    >>> from symmem.symbols import N
    >>> H = sympy.Symbol("H", positive=True, integer=True)
    >>> _at_most_one(N * sympy.ceiling(H / N) - H) == sympy.Min(1, N * sympy.ceiling(H / N) - H)
    True
    >>> _at_most_one(sympy.Integer(3)), _at_most_one(sympy.Integer(0))
    (1, 0)

    Kept per padding: a stack's units have the same flat size, and every walk of the step asks again.
    """
    if padding.is_number:
        return sympy.Min(1, padding)
    # written expanded, as the peak's algebra expands every size: its expand then leaves the Min as it is, where
    # rebuilding it would search again
    return sympy.Min(1, _expanded(padding), evaluate=False)


def _expanded(padding: sympy.Expr) -> sympy.Expr:
    """``sympy.expand(padding)``, each ``ceiling(n / N)`` that :func:`~symmem.passes.data_parallel.ceil_div` leaves
    as written (``n`` symbolic, positive, without ``N``) rebuilt around its expanded argument without sympy's
    search (``expand`` rebuilds it, and the ceiling's evaluation looks for a whole part again, to keep it as it
    is: most of an FSDP1 step's walk otherwise).

    >>> from symmem.symbols import N
    >>> H = sympy.Symbol("H", positive=True, integer=True)
    >>> p = N * sympy.ceiling((12 * H**2 + 13 * H) / N) - 12 * H**2 - 13 * H
    >>> _expanded(p) == sympy.expand(p)
    True
    """
    held: dict[sympy.Expr, sympy.Dummy] = {}  # each ceiling kept as written -> its stand-in
    for c in padding.atoms(sympy.ceiling):
        size = c.args[0] * N
        if N not in size.free_symbols and not size.is_number and size.is_positive:
            held[c] = sympy.Dummy()
    if not held:
        return sympy.expand(padding)
    out = sympy.expand(padding.xreplace(held))
    return out.xreplace({d: sympy.ceiling(sympy.expand(c.args[0]), evaluate=False) for c, d in held.items()})
