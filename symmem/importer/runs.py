"""One recorded forward turned into storages: a real eager run (the check's truth) or a fake run with symbolic
sizes, and the translation of what the recorder saw into :class:`~symmem.importer.records.Storage` values.

Used by :mod:`.trace` (the symbolic trace) and :mod:`.polyfit` (traces at concrete sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy

from ..record.identity import storage_key, tensors
from ..record.saved_tensors import Outcome, SavedRecorder
from .fake import fake_inputs, fake_state, make_world, opaque_ops, overrides, quiet_meta_errors
from .fit_world import FitWorld
from .guards import GuardLog, bounds, collect, pinned, to_declared, unified
from .hf import eager_predicates
from .index_ranges import index_ranges
from .inputs import Inputs
from .records import Save, TracedStorage


# --- one recorded forward -> storages -----------------------------------------------------------------
@dataclass
class Run:
    """One forward (fake or real) turned into storages, with what the ShapeEnv learned."""

    storages: list[TracedStorage]
    ops: int
    guards: list[Any]
    pinned: dict[str, int]
    unified: list[Any]  # conditions for the domain besides the guards: equalities between symbols, a fit's multiples
    bounds: dict[str, tuple[int, int | None]]
    notes: list[str]
    #: conditions no guard records (a table looked up at positions past its rows raises at run time), each with
    #: the table and its offset (:meth:`.index_ranges.IndexRanges.limits`), from a symbolic fake run
    limits: dict[Any, tuple[str, Any]] = field(default_factory=dict)


def to_storages(outcome: Outcome, convert: Any) -> list[TracedStorage]:
    """Kept storages as :class:`TracedStorage` records with stable names (``module:op``, ``#2`` … for repeats)."""
    import torch

    op_modules = outcome.op_modules
    counts: dict[str, int] = {}
    out: list[TracedStorage] = []
    for k in outcome.kept:
        p = k.first
        if p.label is not None:  # a parameter, buffer or input: its own name
            name = p.label
        else:
            base = f"{p.module}:{p.op}"
            counts[base] = counts.get(base, 0) + 1
            name = base if counts[base] == 1 else f"{base}#{counts[base]}"
        nbytes = convert(p.nbytes)
        itemsize = getattr(torch, p.dtype).itemsize
        saves = tuple(Save(seq, node, aseq, op_modules[seq] if seq is not None and seq < len(op_modules) else "")
                      for seq, node, aseq in k.savers)
        birth = p.birth if p.kind == "activation" else None
        out.append(TracedStorage(name=name, module=p.module, op=p.op, dtype=p.dtype,
                           shape=tuple(convert(d) for d in p.shape), elements=sympy.expand(nbytes / itemsize),
                           bytes=nbytes, kind=p.kind, producer=birth[1] if birth else None,
                           producer_module=birth[2] if birth else "", born=birth[0] if birth else None,
                           saved_by=saves))
    return out


def _keys(named: Any) -> dict[int, str]:
    """storage key -> name for (name, tensor-or-nested) pairs (first name wins)."""
    keys: dict[int, str] = {}
    for name, value in named:
        for t in tensors(value):
            try:
                keys.setdefault(storage_key(t), str(name))
            except (RuntimeError, NotImplementedError):
                pass
    return keys


def _input_names(inputs: Inputs, values: dict[Any, Any] | None = None) -> list[tuple[str, Any]]:
    return [(f"input:{k}", (values or {}).get(k, v)) for k, v in inputs.items()]


def real_run(module: Any, inputs: Inputs) -> Outcome:
    """One real eager forward on the example inputs (RNG state and buffers restored afterwards), on one CPU thread:
    what it keeps does not depend on the thread count, and OpenMP's waiting threads cost many times the forward's CPU
    on a busy machine (GPT-2 with 6 layers, B = 2, S = 128, on 2 shared cores: 0.6-0.8 s of CPU with 2 threads, 0.03 s
    with one).  Example sizes only need to be small: the formula holds at every size."""
    import torch

    params = _keys([*module.named_parameters(), *module.named_buffers()])
    rec = SavedRecorder(module, params=params, inputs=_keys(_input_names(inputs)))
    saved_buffers = [(b, b.detach().clone()) for b in module.buffers()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        try:
            outcome = rec.run(lambda: module(*inputs.args, **inputs.kwargs))
        finally:
            with torch.no_grad():
                for b, v in saved_buffers:
                    b.copy_(v)
            torch.set_num_threads(threads)
    return outcome


def fake_run(module: Any, inputs: Inputs, values: dict[str, int], symbols: dict[str, sympy.Symbol], device: str,
             replay: list[tuple[str, Any]] | None, symbolic: bool = True,
             multiple_of: dict[str, int] | None = None, concrete: tuple[str, ...] = (), shared: Any = None,
             fit: FitWorld | None = None) -> Run:
    """One forward on fake tensors: declared sizes symbolic (those in ``concrete``, or all if not ``symbolic``,
    at their ``values``).  ``shared`` (a :class:`~symmem.importer.recording.SharedWorld` without a world yet) keeps
    the run's fake world and shape cache for the training step recorded at the same sizes: its forward repeats these
    ops on these shapes.  ``fit`` (a :class:`~symmem.importer.fit_world.FitWorld`): the run takes the fit's world
    and shape cache where no earlier trace changed the world, else a new one the fit keeps."""
    import torch

    lease = fit.take(values, symbolic, multiple_of, concrete, shared) if fit is not None else None
    world = lease.world if lease is not None else make_world(values, symbolic=symbolic, multiple_of=multiple_of,
                                                             concrete=concrete)
    if shared is not None:
        shared.world = world
        shared.lease = lease
    mapping = world.mapping(symbols)
    at = resized(inputs, values) if not symbolic or concrete else inputs
    with world.mode:
        fin = fake_inputs(world, at, device)
        params, buffers = fake_state(module, device)
    pkeys = _keys([*params.items(), *buffers.items()])
    rec = SavedRecorder(module, params=pkeys, inputs=_keys(_input_names(at, fin)), overrides=overrides(),
                   replay=replay if replay is not None else [], default_read=True if replay is None else None,
                   shape_env=world.env, opaque=opaque_ops())
    if lease is not None and rec.shapes is not None:  # the fit's cache: its entries are this ShapeEnv's
        if lease.shapes is None:
            lease.shapes = rec.shapes
        rec.shapes = lease.shapes
    if shared is not None:
        shared.shapes = rec.shapes
    # the tensors of known values (arange over a traced size, a position-ids buffer) and the tables they index
    ranges = index_ranges(module, params, buffers, fin) if symbolic else None
    rec.observe = ranges
    world.env.guards = GuardLog(lambda: (rec.current, f"{rec.fn} ({rec.aten})"))
    args, kwargs = at.rebuild(fin)

    def call() -> Any:
        with world.mode, eager_predicates(), quiet_meta_errors():
            return torch.func.functional_call(module, {**params, **buffers}, args, kwargs, tie_weights=True)

    outcome = rec.run(call)
    env = world.env
    convert = converter(env, mapping)
    storages = to_storages(outcome, convert)
    guards = collect(env, mapping, tidy) if symbolic else []
    notes = list(rec.assumed)
    return Run(storages, outcome.ops, guards, pinned(env, world, symbols, guards) if symbolic else {},
               unified(env, world, symbols) if symbolic else [], bounds(env, world) if symbolic else {}, notes,
               ranges.limits(convert) if ranges is not None else {})


def converter(env: Any, mapping: dict[Any, Any]) -> Any:
    """A function from a size (an int, a SymInt, or a ShapeEnv sympy expression) to an expanded sympy
    expression in the declared symbols, after the ShapeEnv's replacements (``mapping``: ShapeEnv symbol ->
    declared expression)."""
    import torch

    def convert(x: Any) -> Any:
        if isinstance(x, torch.SymInt):
            x = x.node.expr
        if isinstance(x, sympy.Basic):
            return sympy.expand(to_declared(tidy(env.replace(x), env), mapping))
        return sympy.Integer(int(x))

    return convert


def tidy(expr: Any, env: Any) -> Any:
    """Resolve ``Max``/``Min`` the ShapeEnv's value ranges decide (``Max(1, Hi//4)`` once ``Hi >= 4``)."""
    from torch.utils._sympy.functions import Max, Min
    from torch.utils._sympy.value_ranges import bound_sympy

    def resolve(e: Any) -> Any:
        args = list(e.args)
        ranges = [bound_sympy(a, env.var_to_range) for a in args]
        pick_max = isinstance(e, sympy.Max | Max)
        for i, r in enumerate(ranges):
            others = [o for j, o in enumerate(ranges) if j != i]
            if pick_max and all(r.lower >= o.upper for o in others):
                return args[i]
            if not pick_max and all(r.upper <= o.lower for o in others):
                return args[i]
        return e

    if not expr.has(sympy.Max, sympy.Min, Max, Min):
        return expr
    return expr.replace(lambda e: isinstance(e, sympy.Max | sympy.Min | Max | Min), resolve)


def resized(inputs: Inputs, values: dict[str, int]) -> Inputs:
    """The example inputs with every declared dimension at ``values`` (shapes only matter on fake tensors)."""
    import torch

    new: dict[Any, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            where = inputs.sizes_at(key)
            if where:
                shape = [values[where[d]] if d in where else n for d, n in enumerate(value.shape)]
                new[key] = torch.empty(shape, dtype=value.dtype, device="meta").requires_grad_(value.requires_grad)
    args, kwargs = inputs.rebuild(new)
    return Inputs(args, kwargs, inputs.positions, dict(values))
