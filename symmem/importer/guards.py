"""The conditions PyTorch assumed while tracing, in the declared symbols, and what they imply.

Every time PyTorch branches on a symbolic size (``if S > 512``, a kernel choice, ``x.view(2, -1)``) the
ShapeEnv records a *guard*: the formula is valid only where every guard holds.  Guards are recorded with
the module and op running (the ShapeEnv's guard list is replaced by one that notes the recorder's place on
every append) and translated from ShapeEnv symbols (``s44``) into the declared ones.

- A guard that pins a declared symbol to a value (``Eq(B, 2)``, or a ShapeEnv replacement ``s44 -> 2``)
  means the module specialized on the size: the traced formula would be a constant.  :func:`pinned` finds
  those; the tracer then retraces at other sizes or fits.
- Range guards (``S <= 512``: BERT's position table) are the formula's domain; so are guards that did not
  change the formula (``B < 16``: a CPU convolution backend choice) — they are reported, not judged.
- Every symbol is also ≥ 2: PyTorch specializes sizes 0 and 1, so size 1 is its own trace.

>>> import sympy
>>> from symmem.symbols import B, S
>>> domain_of([B, S], [sympy.Le(S, 512)])
(B >= 2) & (S >= 2) & (S <= 512)
"""

from __future__ import annotations

from typing import Any

import sympy

from .records import Guard


class GuardLog(list):  # type: ignore[type-arg]
    """A list the ShapeEnv appends guards to; notes where each was appended (``site()``)."""

    def __init__(self, site: Any) -> None:
        super().__init__()
        self.site = site
        self.sites: list[tuple[str, str]] = []

    def append(self, guard: Any) -> None:  # noqa: D102
        super().append(guard)
        self.sites.append(self.site())


def standard(expr: Any) -> Any:
    """torch's own sympy functions (``FloorDiv``, ``PythonMod``, its ``Max`` …) as plain sympy ones
    (``floor``, ``Mod``, ``Max``), so formulas print, compare and lambdify like any other sympy expression."""
    try:
        import torch.utils._sympy.functions as F
    except ImportError:  # pragma: no cover - only torch makes such expressions
        return expr
    table = {
        "FloorDiv": lambda a, b: sympy.floor(a / b), "CleanDiv": lambda a, b: a / b,
        "CeilDiv": lambda a, b: sympy.ceiling(a / b), "IntTrueDiv": lambda a, b: a / b,
        "PythonMod": sympy.Mod, "Mod": sympy.Mod, "Max": sympy.Max, "Min": sympy.Min,
        "ModularIndexing": lambda x, d, m: sympy.Mod(sympy.floor(x / d), m),
        "PowByNatural": lambda a, b: a**b, "FloorToInt": sympy.floor, "CeilToInt": sympy.ceiling,
        "TruncToInt": lambda x: sympy.sign(x) * sympy.floor(abs(x)), "Identity": lambda x: x,
        "Where": lambda c, a, b: sympy.Piecewise((a, c), (b, True)),
    }
    classes = {getattr(F, n): f for n, f in table.items() if isinstance(getattr(F, n, None), type)}
    for cls, f in classes.items():
        if expr.has(cls):
            expr = expr.replace(lambda e, cls=cls: isinstance(e, cls), lambda e, f=f: f(*e.args))
    return expr


def to_declared(expr: Any, mapping: dict[Any, Any]) -> Any:
    """A ShapeEnv expression in the declared symbols (``mapping``: ShapeEnv symbol -> declared expression),
    written with plain sympy functions."""
    return unit_roundings(standard(sympy.sympify(expr)).xreplace(mapping))


def unit_roundings(expr: Any) -> Any:
    """``floor(c/x)`` as -1 for -1 <= c < 0 and ``ceiling(c/x)`` as 1 for 0 < c <= 1, where ``x`` is a positive
    integer (symmem's sizes are): ``ceil(B*S/S)`` becomes ``B + 1 + floor(-1/S)`` in sympy, which is ``B``.

    >>> S = sympy.Symbol("S", integer=True, positive=True)
    >>> unit_roundings(sympy.floor((3*S + S - 1) / S)), unit_roundings(sympy.ceiling(1 / S) + sympy.floor(-2 / S))
    (3, floor(-2/S) + 1)
    """
    if not isinstance(expr, sympy.Basic) or not expr.has(sympy.floor, sympy.ceiling):
        return expr

    def atom(e: Any) -> Any:  # floor(c/x) -> -1, ceiling(c/x) -> 1, or None
        if not isinstance(e, sympy.floor | sympy.ceiling):
            return None
        c, rest = e.args[0].as_coeff_Mul()
        x = 1 / rest
        if not (c.is_Rational and x.is_integer and x.is_positive):
            return None
        if isinstance(e, sympy.floor) and -1 <= c < 0:
            return sympy.Integer(-1)
        if isinstance(e, sympy.ceiling) and 0 < c <= 1:
            return sympy.Integer(1)
        return None

    def unit(e: Any) -> Any:  # the rounding with its integer part taken out, where that leaves a unit one
        split = e.func(sympy.expand(e.args[0]))  # floor((4*S - 1)/S) = 4 + floor(-1/S)
        done = split.replace(lambda a: atom(a) is not None, atom)
        return done if done != split else None

    # only a rounding that sheds a unit one is rewritten: every other formula prints as before
    return expr.replace(lambda e: isinstance(e, sympy.floor | sympy.ceiling) and unit(e) is not None, unit)


def collect(env: Any, mapping: dict[Any, Any], tidy: Any = None) -> list[Guard]:
    """The ShapeEnv's guards as :class:`Guard` records (duplicates and always-true ones dropped);
    ``tidy(expr, env)`` simplifies each first (``Max``/``Min`` the value ranges decide)."""
    sites = getattr(env.guards, "sites", [])
    out: list[Guard] = []
    seen: set[Any] = set()
    for i, g in enumerate(env.guards):
        expr = to_declared(tidy(g.expr, env) if tidy is not None else g.expr, mapping)
        if expr is sympy.true or expr in seen:
            continue
        seen.add(expr)
        module, op = sites[i] if i < len(sites) else ("", "")
        out.append(Guard(expr, str(expr), module, op, str(getattr(g, "sloc", ""))))
    return out


def pinned(env: Any, world: Any, symbols: dict[str, sympy.Symbol], guards: list[Guard]) -> dict[str, int]:
    """Declared symbols the trace specialized to a number: name -> value."""
    out: dict[str, int] = {}
    for sym, name in world.env_symbols.items():
        m = world.scale.get(name, 1)
        rep = env.replacements.get(sym)
        if rep is not None and sympy.sympify(rep).is_number:
            out[name] = int(rep) * m
        vr = env.var_to_range.get(sym)
        if vr is not None and _finite(vr.lower) is not None and _finite(vr.lower) == _finite(vr.upper):
            out[name] = int(vr.lower) * m
    by_symbol = {v: k for k, v in symbols.items()}
    for g in guards:
        e = g.expr
        if isinstance(e, sympy.Eq):
            for a, b in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
                if a in by_symbol and b.is_number:
                    out[by_symbol[a]] = int(b)
    return out


def unified(env: Any, world: Any, symbols: dict[str, sympy.Symbol]) -> list[Any]:
    """Equalities between declared symbols the trace assumed (``Eq(Hi, Wi)``)."""
    mapping = world.mapping(symbols)
    out = []
    for sym in world.env_symbols:
        rep = env.replacements.get(sym)
        if rep is not None and not sympy.sympify(rep).is_number:
            out.append(sympy.Eq(mapping[sym], to_declared(rep, mapping)))
    return out


def bounds(env: Any, world: Any) -> dict[str, tuple[int, int | None]]:
    """The value range the ShapeEnv ended with for every declared symbol: (lower, upper or None)."""
    out: dict[str, tuple[int, int | None]] = {}
    for sym, name in world.env_symbols.items():
        vr = env.var_to_range.get(sym)
        if vr is None:
            continue
        m = world.scale.get(name, 1)
        hi = _finite(vr.upper)
        out[name] = (max((_finite(vr.lower) or 2) * m, 2), hi * m if hi is not None else None)
    return out


def _finite(x: Any) -> int | None:
    """An int, or None for (torch's integer) infinity."""
    try:
        return int(x) if sympy.sympify(x).is_Integer else None
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def domain_of(symbols: list[sympy.Symbol], exprs: list[Any]) -> Any:
    """Where the formula holds: every symbol ≥ 2 and every guard."""
    return sympy.And(*[s >= 2 for s in symbols], *exprs)
