"""``trace_module``: run a module once on fake tensors with symbolic sizes and keep what autograd saves.

See ``docs/importer.md`` for the mechanism and the traps it handles.  In short:

1. check the example inputs and declared sizes (:mod:`.inputs`);
2. run one *real* eager forward at the example sizes when the weights are real: it records the values the
   forward reads from tensors (mask checks) and what it keeps, for the check at the end;
3. run the forward once on fake tensors whose declared sizes are SymInts (:mod:`.fake`), under the saved-tensor
   recorder (:mod:`symmem.record.saved_tensors`), with transformers' fake-tensor predicates switched off (:mod:`.hf`);
4. translate storage sizes and guards into the declared symbols (:mod:`.guards`); if a guard pinned a
   declared size to its example value, retrace at other sizes, and if it pins again fit the exact
   polynomial from concrete traces (:mod:`.polyfit`);
5. fold identical repeated blocks (:mod:`.structure`) and compare the formula at the example sizes with the
   real forward: a difference raises :class:`~symmem.errors.SymmemError`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sympy

from ..errors import SymmemError
from ..record.identity import dtype_name, tensors
from ..record.saved_tensors import FakeKernelFailed, Outcome, SymbolicSizesUnsupported
from .fake import check_device
from .fit_world import FitWorld
from .guards import domain_of
from .inputs import Inputs, check_inputs, sym_for
from .recording import SharedWorld
from .records import Check, Trace, TracedParameter, TracedStorage, TracedSymbol
from .runs import Run, fake_run, real_run, resized, to_storages
from .wrap import autocast_dtype, autocasting, checkpointed, find_repeat

METHODS = ("auto", "symbolic", "fit")


def _require_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise SymmemError("tracing runs PyTorch, which is not installed: pip install torch==2.13.0") from None
    return torch


@contextmanager
def training_mode(module: Any, training: bool) -> Iterator[None]:
    """Put every submodule in training (or eval) mode, and restore each one's flag afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def parameters_of(module: Any) -> tuple[tuple[TracedParameter, ...], tuple[TracedParameter, ...]]:
    """Parameters (tied ones once) and buffers: name, shape, dtype, numel."""
    ps = tuple(TracedParameter(n, tuple(int(d) for d in p.shape), dtype_name(p.dtype), int(p.numel()), p.requires_grad)
               for n, p in module.named_parameters())
    bs = tuple(TracedParameter(n, tuple(int(d) for d in b.shape), dtype_name(b.dtype), int(b.numel()), False)
               for n, b in module.named_buffers())
    return ps, bs


def _can_run_real(module: Any, inputs: Inputs, device: str) -> str | None:
    """None if a real forward can run on the example inputs, else why not."""
    import torch

    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "meta":
            return "the module's weights are on the meta device"
        if t.device.type != device.split(":")[0]:
            return f"the module is on {t.device}, the trace is for {device}"
    for t in tensors([inputs.args, inputs.kwargs]):
        if t.device.type != device.split(":")[0]:
            return f"an example input is on {t.device}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "no CUDA device here"
    return None


def _totals(storages: list[TracedStorage] | tuple[TracedStorage, ...], subs: dict[sympy.Symbol, int]) -> dict[str, int]:
    out = {"activation": 0, "input": 0}
    for s in storages:
        if s.kind in out:
            out[s.kind] += int(sympy.sympify(s.bytes).xreplace(subs))
    return out


def _differences(traced: list[TracedStorage], measured: list[TracedStorage], subs: dict[sympy.Symbol, int]) -> str:
    a = {s.name: int(sympy.sympify(s.bytes).xreplace(subs)) for s in traced if s.kind != "parameter"}
    b = {s.name: int(s.bytes) for s in measured if s.kind != "parameter"}
    rows = [f"{n}: traced {a.get(n, 0):,} vs real {b.get(n, 0):,}" for n in sorted(set(a) | set(b), key=str)
            if a.get(n, 0) != b.get(n, 0)]
    return "; ".join(rows[:6]) + (f"; … {len(rows) - 6} more" if len(rows) > 6 else "")


def trace_module(module: Any, example_inputs: Any, dims: dict[str, Any], *, device: str = "cpu",
                 training: bool = True, method: str = "auto", check: bool = True, size_one: bool = False,
                 multiple_of: dict[str, int] | None = None, autocast: str | None = None,
                 checkpoint: str | list[str] | tuple[str, ...] | None = None, fit_world: FitWorld | None = None
                 ) -> Trace:
    """The exact formula of what one eager forward keeps for backward, in the declared symbols.

    ``example_inputs`` is a tuple (positional) or dict (keyword) of tensors and plain values; ``dims``
    maps a symbol name to its (input position or keyword, dimension) pairs, e.g. ``{"B": [(0, 0)]}`` or
    ``{"B": [("input_ids", 0)], "S": [("input_ids", 1)]}``.  ``method``: ``auto`` (symbolic, retraced at
    other sizes where the module specializes on a size, fitted if it specializes again), ``symbolic`` (never
    fit) or ``fit`` (concrete sizes only: for modules fake tensors cannot run).  ``check`` runs one real
    forward at the traced sizes and raises :class:`SymmemError` if the formula disagrees there.
    ``size_one`` also traces every symbol at 1 (its own branch: PyTorch specializes size 1), given in
    ``Trace.extra["at_one"]``.  ``multiple_of`` (``{"Hi": 32, "Wi": 32}``) traces those sizes as multiples of
    a number: stride arithmetic (``(Hi - 1)//2 + 1``, Swin's window padding) then stays polynomial and the
    formula holds on those multiples (the domain says so); examples must be at least twice the multiple.
    ``autocast`` (``"bfloat16"``) runs every forward under ``torch.autocast``; ``checkpoint`` runs children
    under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: ``"full"`` the longest run of
    identical children of a ``ModuleList``/``Sequential`` (:func:`~symmem.importer.wrap.find_repeat`), a
    container's path (each of its children), or a list of child paths (``Trace.extra["checkpoint"]`` lists them).
    ``fit_world`` (a fit's :class:`~symmem.importer.fit_world.FitWorld`): the symbolic trace runs in the fake world of
    the fit's earlier traces where none of them changed it (the same values as in a fresh one, its op shapes cached).

    >>> import pytest; torch = pytest.importorskip("torch")  # the example needs PyTorch
    >>> t = trace_module(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), (torch.zeros(2, 4),),
    ...                  {"B": [(0, 0)]})
    >>> t.activations, t.input  # the ReLU's output, B*3 float32; the Linear keeps its input, B*4 float32
    (12*B, 16*B)
    """
    torch = _require_torch()
    if not isinstance(module, torch.nn.Module):
        raise SymmemError(f"trace_module needs a torch.nn.Module, got {type(module).__name__}")
    if method not in METHODS:
        raise SymmemError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    device = check_device(device)
    inputs = check_inputs(example_inputs, dims)
    symbols = {name: sym_for(name) for name in inputs.examples}
    multiple_of = _check_multiples(multiple_of, inputs.examples)
    params, buffers = parameters_of(module)
    notes: list[str] = []
    wrapped = checkpoint_children(module, checkpoint)
    autocast_dtype(autocast)

    with training_mode(module, training), checkpointed(module, wrapped), autocasting(autocast, device):
        why_not = _can_run_real(module, inputs, device) if check else "check=False"
        if why_not is not None:
            notes.append(f"no real forward to check against: {why_not}")
        real = why_not is None
        shared = SharedWorld()
        if method == "fit":
            from .polyfit import fit_trace

            result, used, at = fit_trace(module, inputs, symbols, device, real), "fitted", inputs.examples
            outcome = real_run(module, inputs) if real else None
        else:
            result, used, at, outcome = _symbolic(module, inputs, symbols, device, real, method, notes, multiple_of,
                                                  shared, fit_world)
        extra: dict[str, Any] = {"reads": list(outcome.reads) if outcome is not None else None}
        if used == "symbolic" and shared.world is not None:
            # the fake world and shape cache of the forward the formula came from: the training step of this module
            # recorded at the same sizes runs its forward in them (importer.traced.step_of), each op's first
            # occurrence computed once
            extra["fake_world"] = (weakref.ref(module), dict(at), dict(multiple_of), shared)
        if getattr(result, "limits", None):  # tables looked up past their rows at some sizes (index_ranges)
            extra["tables"] = dict(result.limits)
        if wrapped:
            extra["checkpoint"] = wrapped
        if autocast is not None:
            extra["autocast"] = autocast
        if size_one:
            extra["at_one"] = _at_one(module, inputs, symbols, device, multiple_of)

    divisible = [sympy.Eq(sympy.Mod(symbols[n], m), 0) for n, m in multiple_of.items()]
    # a table looked up past its rows raises at run time, so no guard records it: its bound joins the domain here
    # (extra["tables"] keeps which table); a fit in the module's own sizes writes it in those sizes as it does a guard
    limits = list(getattr(result, "limits", {}))
    domain = domain_of(list(symbols.values()), divisible + [g.expr for g in result.guards] + result.unified + limits)
    storages = tuple(result.storages)
    subs = {symbols[n]: v for n, v in at.items()}
    chk = None
    if outcome is not None:
        real_storages = to_storages(outcome, lambda x: sympy.Integer(int(x)))
        measured = _totals(real_storages, {})
        traced = _totals(storages, subs)
        chk = Check(tuple(sorted(at.items())), tuple(sorted(traced.items())), tuple(sorted(measured.items())))
        if not chk.exact:
            raise SymmemError(
                f"the traced formula disagrees with a real eager forward at {dict(chk.values)}: traced "
                f"{traced}, real {measured} (bytes). The fake-tensor run took another code path; "
                f"differences: {_differences(list(storages), real_storages, subs)}")
    from .structure import repeats

    reps = repeats(module, storages, subs)
    return Trace(module=type(module).__name__,
                 symbols=tuple(TracedSymbol(n, symbols[n], at[n], inputs.positions[n]) for n in inputs.examples),
                 storages=storages, parameters=params, buffers=buffers, guards=tuple(result.guards),
                 domain=domain, bounds=tuple((n, lo, hi) for n, (lo, hi) in result.bounds.items()),
                 method=used, device=device, training=training, repeats=reps, check=chk,
                 notes=tuple(notes + result.notes), ops=result.ops, extra=extra)


def checkpoint_children(module: Any, checkpoint: Any) -> tuple[str, ...]:
    """The child paths a ``checkpoint=`` option names (see :func:`trace_module`)."""
    if checkpoint is None or checkpoint == "none":
        return ()
    if checkpoint == "full":
        return find_repeat(module)[1]
    if isinstance(checkpoint, str):
        try:
            container = module.get_submodule(checkpoint)
        except AttributeError:
            raise SymmemError(f"checkpoint={checkpoint!r}: no such submodule; use 'full' (the repeated blocks), "
                              "a container's path or a list of child paths") from None
        return tuple(f"{checkpoint}.{n}" if checkpoint else n for n, _ in container.named_children())
    if isinstance(checkpoint, list | tuple) and all(isinstance(c, str) for c in checkpoint):
        return tuple(checkpoint)
    raise SymmemError(f"checkpoint must be 'full', a submodule path or a list of paths, got {checkpoint!r}")


def _check_multiples(multiple_of: Any, examples: dict[str, int]) -> dict[str, int]:
    if multiple_of is None:
        return {}
    if not isinstance(multiple_of, dict):
        raise SymmemError(f"multiple_of must map symbol names to integers, got {type(multiple_of).__name__}")
    for name, m in multiple_of.items():
        if name not in examples:
            raise SymmemError(f"multiple_of names {name!r}, which is not a declared symbol "
                              f"({', '.join(examples) or 'none'})")
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise SymmemError(f"multiple_of[{name!r}] must be a positive integer, got {m!r}")
        if examples[name] % m or examples[name] // m < 2:
            raise SymmemError(f"{name} = {examples[name]} must be a multiple of {m} and at least {2 * m} "
                              "(a multiple of 1 would be specialized)")
    return dict(multiple_of)


#: torch releases before this one answer ``at::linear`` of a 3-D input with integer sizes (it asks ``aten.size``,
#: which fake tensors can only answer by specializing): seen with 2.11 on HF GPT-2 and ``nn.TransformerEncoder``
#: (on an H100's image, docs/cuda.md), which 2.13 and 2.14 trace symbolically
SYMBOLIC_LINEAR = (2, 13)


def old_torch() -> str | None:
    """Why a module may specialize with this torch (a release before :data:`SYMBOLIC_LINEAR`), or None."""
    import torch

    try:
        release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    if release >= SYMBOLIC_LINEAR:
        return None
    return (f"torch {torch.__version__} reads the sizes of a 3-D input to linear as integers, which pins them; "
            f"torch >= {'.'.join(map(str, SYMBOLIC_LINEAR))} traces such modules symbolically")


def specializations(run: Run, symbols: dict[str, sympy.Symbol]) -> list[Any]:
    """Equalities the trace assumed on the declared sizes (not between two of them): candidate pins."""
    out = [g.expr for g in run.guards if isinstance(g.expr, sympy.Eq)
           and not all(isinstance(side, sympy.Symbol) for side in (g.expr.lhs, g.expr.rhs))]
    out += [sympy.Eq(symbols[n], v) for n, v in run.pinned.items() if sympy.Eq(symbols[n], v) not in out]
    return out


def _holds(exprs: list[Any], symbols: dict[str, sympy.Symbol], values: dict[str, int]) -> bool:
    subs = {symbols[n]: v for n, v in values.items()}
    return all(bool(sympy.sympify(e).xreplace(subs)) for e in exprs)


def _symbolic(module: Any, inputs: Inputs, symbols: dict[str, sympy.Symbol], device: str, real: bool,
              method: str, notes: list[str], multiple_of: dict[str, int], shared: SharedWorld | None = None,
              fit_world: FitWorld | None = None) -> tuple[Run, str, dict[str, int], Outcome | None]:
    """The symbolic trace; retraced at other sizes where it specialized, fitted if it specializes again.

    An equality guard on the declared sizes (``Eq(S, 8)``, ``Eq((Hi - 1)//32 + 1, 1)``: an intermediate
    size was 1) either holds everywhere that matters (``Eq(Mod(S, 4), 0)``) or pins the formula to the
    example.  The trace is repeated with those symbols doubled: guards of the first trace that fail there
    were pins; a retrace whose own equalities hold at the first sizes too is used instead.
    """
    from .polyfit import resized_real

    outcome = real_run(module, inputs) if real else None
    try:
        run = fake_run(module, inputs, inputs.examples, symbols, device, outcome.reads if outcome else None,
                       multiple_of=multiple_of, shared=shared, fit=fit_world)
    except SymbolicSizesUnsupported as e:
        if method == "symbolic":
            raise
        from .polyfit import fit_trace

        notes.append(f"no symbolic trace ({e}); the formula is fitted from traces at concrete sizes")
        return fit_trace(module, inputs, symbols, device, real), "fitted", inputs.examples, outcome
    except FakeKernelFailed as e:
        # the real forward ran (or was not tried): a failure on fake tensors only is a fake kernel's limit
        if method == "symbolic" or not real:
            why = "" if real else " (it needs a real forward: check=True, weights not on the meta device)"
            raise SymmemError(f"{str(e).rstrip('.')}; fake tensors cannot run this module here: method='fit' traces "
                              f"real tensors at concrete sizes{why}") from None
        from .polyfit import fit_trace

        notes.append(f"fake tensors cannot run the module ({e}); the formula is fitted from real traces at "
                     "concrete sizes")
        return fit_trace(module, inputs, symbols, device, real), "fitted", inputs.examples, outcome
    spec = specializations(run, symbols)
    if not spec:
        return run, "symbolic", inputs.examples, outcome
    involved = {n for n, s in symbols.items() if any(s in sympy.sympify(e).free_symbols for e in spec)}
    values = {n: (2 * v if n in involved else v) for n, v in inputs.examples.items()}
    if _holds(spec, symbols, values):  # equalities that hold at other sizes too: part of the domain
        return run, "symbolic", inputs.examples, outcome
    text = ", ".join(str(e) for e in spec)
    notes.append(f"the trace at {inputs.examples} assumed {text}; retraced at {values}")
    try:
        bigger = resized_real(inputs, values) if real else resized(inputs, values)
        outcome2 = real_run(module, bigger) if real else None
        again = fake_run(module, resized(inputs, values), values, symbols, device,
                         outcome2.reads if outcome2 else None, multiple_of=multiple_of)
    except SymmemError as e:
        notes.append(f"the retrace failed ({e}); the formula holds where its guards do")
        return run, "symbolic", inputs.examples, outcome
    spec2 = specializations(again, symbols)
    if _holds(spec2, symbols, inputs.examples):
        return again, "retraced", values, outcome2
    if method == "symbolic":
        old = old_torch()
        raise SymmemError(f"the module specializes on its sizes at every example ({text}; then "
                          f"{', '.join(str(e) for e in spec2)}): use method='auto' or method='fit'"
                          + (f" ({old})" if old else ""))
    from .polyfit import fit_trace

    notes.append("the module specializes at every example size: the formula is fitted from concrete traces")
    old = old_torch()
    if old:
        notes.append(old)
    pins = tuple(n for n in inputs.examples if n in involved)
    # both symbolic traces specialized on exactly these sizes: they are the fit's first two grid points
    seed = {tuple(inputs.examples[n] for n in pins): run, tuple(values[n] for n in pins): again} \
        if set(run.pinned) == set(pins) == set(again.pinned) else {}
    try:
        fitted = fit_trace(module, inputs, symbols, device, real, pins, multiple_of, seed)
    except SymmemError as exc:
        if old:  # the fit was only tried because this torch pinned the sizes: say so
            raise SymmemError(f"{exc} ({old})") from None
        raise
    return fitted, "fitted", inputs.examples, outcome


def _at_one(module: Any, inputs: Inputs, symbols: dict[str, sympy.Symbol], device: str,
            multiple_of: dict[str, int]) -> dict[str, Any]:
    """Activation and input bytes with one symbol at 1 (the others symbolic), per symbol; also the storages and
    the guards of that trace."""
    out: dict[str, Any] = {}
    for name in inputs.examples:
        one = resized(inputs, {**inputs.examples, name: 1})
        rest = {n: v for n, v in inputs.examples.items() if n != name}
        sub = Inputs(one.args, one.kwargs, {n: p for n, p in inputs.positions.items() if n != name}, rest)
        run = fake_run(module, sub, rest, symbols, device, None,
                       multiple_of={n: m for n, m in multiple_of.items() if n != name})
        out[name] = {k: sympy.expand(sympy.Add(*[s.bytes for s in run.storages if s.kind == k]))
                     for k in ("activation", "input")}
        out[name]["storages"] = tuple(run.storages)
        out[name]["guards"] = tuple(g.expr for g in run.guards) + tuple(run.unified)
    return out
