"""Exact evaluation of memory formulas, compiled once per expression.

``Derivation.evaluate`` used to substitute numbers into the sympy expression, which rebuilds the expression tree
for every configuration (0.1-2 ms each).  :func:`evaluator` keeps one :class:`Evaluator` per expression: its
first configuration is interpreted by one walk over the tree (microseconds: a table that shows each value once
pays no more), and from the second on it runs the expression translated into Python code over integers
(compiled once, about 0.5 ms):

* **exact**: every value is a Python int or an exact fraction held as (numerator, denominator) ints -- never a
  float; the result is the int when the value is an integer and its ceiling otherwise, as
  ``Derivation.evaluate`` has always done (:meth:`Evaluator.exact` gives the fraction itself);
* **supported**: integers and rationals, symbols, ``+``, ``*``, integer powers (negative ones are fractions),
  ``floor``, ``ceiling``, ``Max``, ``Min``, ``Mod``, ``Piecewise`` with conditions made of ``Eq``, ``Ne``,
  ``<``, ``<=``, ``>``, ``>=``, ``And``, ``Or``, ``Not``.  Anything else (a float, a square root) is evaluated
  the old way, by sympy substitution, so every expression still gets its exact answer;
* **vectorised** (:meth:`Evaluator.many`): numpy arrays of values, broadcast together, give an array of results.
  The arithmetic runs in int64 when a bound computed from the inputs' largest magnitudes proves that no
  intermediate value can overflow (the bound is the same formula with every operation replaced by one on
  absolute values); otherwise it runs on object arrays of Python ints, which are exact at any size.  The
  result is an int64 array in the first case and an object array of Python ints in the second.

>>> from symmem.symbols import B, S, H, h
>>> f = evaluator(9*B*S*H + B*h*S**2)
>>> [s.name for s in f.symbols], f(B=64, S=197, H=768, h=12)
(['B', 'H', 'S', 'h'], 116951808)
>>> g = evaluator(B*S*H / 3)
>>> g(B=1, S=1, H=10), g.exact(B=1, S=1, H=10)
(4, Fraction(10, 3))
>>> f.many(B=[1, 2, 4], S=197, H=768, h=12).tolist()
[1827372, 3654744, 7309488]
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from functools import lru_cache, reduce
from typing import Any

import sympy

from .errors import SymmemError

#: The largest magnitude an int64 holds.
INT64_MAX = 2**63 - 1

_RELATIONS = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


class NotCompilable(Exception):
    """A part of the expression that the compiler does not translate (a float, a square root ...)."""


class _Fallback(Exception):
    """At run time: a denominator that is not positive (only expressions such as 1/(S - 2) can have one)."""


class _NoBranch(Exception):
    """At run time: no condition of a ``Piecewise`` holds."""


# A compiled value: ("int", code), ("frac", numerator code, denominator) or ("bool", code).  A denominator is
# (positive int, tuple of variable names), the product of the int and the variables; every variable in a
# denominator holds a positive value (symbols are positive; computed ones are checked where they are made).
_Den = tuple[int, tuple[str, ...]]
_ONE: _Den = (1, ())


class _Codegen:
    """Python source for one expression, in one of three modes.

    ``scalar``: Python ints, a ``Piecewise`` evaluates only the branch that holds.  ``vector``: the same
    operations on numpy arrays, every branch evaluated and selected.  ``bound``: every operation on upper bounds
    of absolute values; the function returns the largest bound of any intermediate value.
    """

    def __init__(self, symbols: Sequence[sympy.Symbol], mode: str) -> None:
        self.mode = mode
        self.args = {s: f"a{i}" for i, s in enumerate(symbols)}
        self.lines: list[str] = []
        self.indent = 1
        self.count = 0
        self.memo: dict[sympy.Basic, tuple[Any, ...]] = {}
        self.temps: list[str] = []

    # -- emitting ------------------------------------------------------------------------------------
    def emit(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def tmp(self, code: str) -> str:
        name = f"t{self.count}"
        self.count += 1
        self.emit(f"{name} = {code}")
        if self.mode == "bound":
            self.temps.append(name)
        return name

    def lit(self, c: int) -> str:
        if self.mode == "bound":
            return str(max(1, abs(c)))
        return str(c) if c >= 0 else f"({c})"

    def den_code(self, den: _Den) -> str:
        c, names = den
        parts = ([self.lit(c)] if c != 1 or not names else []) + list(names)
        return parts[0] if len(parts) == 1 else "(" + " * ".join(parts) + ")"

    def product(self, codes: list[str]) -> str:
        codes = [c for c in codes if c != "1"] or ["1"]
        return codes[0] if len(codes) == 1 else self.tmp(" * ".join(codes))

    def positive(self, code: str) -> None:
        """Check at run time that a computed denominator is positive."""
        if self.mode == "scalar":
            self.emit(f"if not {code} > 0: raise _Fallback")
        elif self.mode == "vector":
            self.emit(f"if not _allpos({code}): raise _Fallback")

    # -- values --------------------------------------------------------------------------------------
    def value(self, e: sympy.Basic) -> tuple[Any, ...]:
        found = self.memo.get(e)
        if found is None:
            found = self._value(e)
            self.memo[e] = found
        return found

    def _value(self, e: sympy.Basic) -> tuple[Any, ...]:
        if e.is_Integer:
            return ("int", self.lit(int(e)))
        if e.is_Rational:
            return ("frac", self.lit(int(e.p)), (int(e.q), ()))
        if e.is_Symbol:
            if e not in self.args:
                raise SymmemError(f"no value for {e}")
            return ("int", self.args[e])
        if e.is_Add:
            return self.add([self.value(a) for a in e.args])
        if e.is_Mul:
            return self.mul([self.value(a) for a in e.args])
        if e.is_Pow:
            if not e.exp.is_Integer:
                raise NotCompilable(f"power {e.exp}")
            return self.power(self.value(e.base), int(e.exp))
        if isinstance(e, sympy.floor | sympy.ceiling):
            return self.round(self.value(e.args[0]), isinstance(e, sympy.ceiling))
        if isinstance(e, sympy.Max | sympy.Min):
            return self.extreme([self.value(a) for a in e.args], isinstance(e, sympy.Max))
        if isinstance(e, sympy.Mod):
            a, b = (self.value(x) for x in e.args)
            q = self.round(self.mul([a, self.power(b, -1)]), False)
            return self.add([a, self.neg(self.mul([b, q]))])
        if isinstance(e, sympy.Piecewise):
            return self.piecewise(e)
        if e.is_Relational:
            if e.rel_op not in _RELATIONS:
                raise NotCompilable(f"relation {e.rel_op}")
            return self.compare(self.value(e.lhs), self.value(e.rhs), e.rel_op)
        if e is sympy.true or e is sympy.false:
            return ("bool", "True" if e is sympy.true else "False")
        if isinstance(e, sympy.And | sympy.Or):
            return self.logic([self.value(a) for a in e.args], "and" if isinstance(e, sympy.And) else "or")
        if isinstance(e, sympy.Not):
            (a,) = (self.value(x) for x in e.args)
            return ("bool", self.tmp({"scalar": f"not {a[1]}", "vector": f"_not({a[1]})"}.get(self.mode, "0")))
        raise NotCompilable(type(e).__name__)

    def as_frac(self, v: tuple[Any, ...]) -> tuple[str, _Den]:
        if v[0] == "int":
            return v[1], _ONE
        if v[0] == "frac":
            return v[1], v[2]
        raise NotCompilable("a condition used as a number")

    def common(self, values: list[tuple[Any, ...]]) -> tuple[list[str], _Den]:
        """The numerators of ``values`` over one common denominator (the lcm of the constants, the union of the
        variables with their largest multiplicity)."""
        pairs = [self.as_frac(v) for v in values]
        const = math.lcm(*(d[0] for _, d in pairs))
        most: dict[str, int] = {}
        for _, (_, names) in pairs:
            for name in set(names):
                most[name] = max(most.get(name, 0), names.count(name))
        names = tuple(sorted(n for n, k in most.items() for _ in range(k)))
        nums = []
        for num, (c, mine) in pairs:
            rest = list(names)
            for name in mine:
                rest.remove(name)
            nums.append(self.product([num] + ([self.lit(const // c)] if const // c != 1 else []) + rest))
        return nums, (const, names)

    def add(self, values: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        # Terms over the same denominator are summed first, then the sums are brought over a common one.
        groups: dict[_Den, list[str]] = {}
        for v in values:
            num, den = self.as_frac(v)
            groups.setdefault(den, []).append(num)
        sums = [(den, nums[0] if len(nums) == 1 else self.tmp(" + ".join(nums))) for den, nums in groups.items()]
        if len(sums) == 1:
            den, num = sums[0]
            return self.frac(num, den)
        nums, den = self.common([self.frac(num, den) for den, num in sums])
        return self.frac(self.tmp(" + ".join(nums)), den)

    def neg(self, v: tuple[Any, ...]) -> tuple[Any, ...]:
        num, den = self.as_frac(v)
        code = num if self.mode == "bound" else self.tmp(f"-{num}")
        return ("int", code) if den == _ONE else ("frac", code, den)

    def mul(self, values: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        pairs = [self.as_frac(v) for v in values]
        num = self.product([n for n, _ in pairs])
        const = math.prod(d[0] for _, d in pairs)
        names = tuple(sorted(name for _, d in pairs for name in d[1]))
        return self.frac(num, (const, names))

    def frac(self, num: str, den: _Den) -> tuple[Any, ...]:
        return ("int", num) if den == _ONE else ("frac", num, den)

    def power(self, v: tuple[Any, ...], k: int) -> tuple[Any, ...]:
        num, (c, names) = self.as_frac(v)
        if k == 0:
            return ("int", "1")
        if k > 0:
            up = num if k == 1 else self.tmp(self.raised(num, k))
            return self.frac(up, (c ** k, tuple(sorted(names * k))))
        m = -k
        down = num if m == 1 else self.tmp(self.raised(num, m))
        if down not in self.args.values():  # a symbol is positive; a computed value is checked
            self.positive(down)
        top = self.den_code((c, names))
        if top != "1" and m != 1:
            top = self.tmp(self.raised(top, m))
        return ("frac", top, (1, (down,)))

    def raised(self, code: str, k: int) -> str:
        # numpy's integer power is slower than a few multiplications
        return " * ".join([code] * k) if self.mode == "vector" and k <= 4 else f"{code} ** {k}"

    def round(self, v: tuple[Any, ...], up: bool) -> tuple[Any, ...]:
        if v[0] == "int":
            return v
        num, den = self.as_frac(v)
        if self.mode == "bound":  # |floor(n/d)| <= |n| for a denominator >= 1
            return ("int", num)
        d = self.den_code(den)
        return ("int", self.tmp(f"-((-{num}) // {d})" if up else f"{num} // {d}"))

    def extreme(self, values: list[tuple[Any, ...]], biggest: bool) -> tuple[Any, ...]:
        nums, den = self.common(values)
        if self.mode == "scalar":
            code = f"{'max' if biggest else 'min'}({', '.join(nums)})"
        elif self.mode == "vector":
            code = f"{'_maximum' if biggest else '_minimum'}({', '.join(nums)})"
        else:
            code = f"max({', '.join(nums)})"
        return self.frac(self.tmp(code), den)

    def compare(self, a: tuple[Any, ...], b: tuple[Any, ...], op: str) -> tuple[Any, ...]:
        (x, y), _ = self.common([a, b])
        return ("bool", "0" if self.mode == "bound" else self.tmp(f"{x} {_RELATIONS[op]} {y}"))

    def logic(self, values: list[tuple[Any, ...]], op: str) -> tuple[Any, ...]:
        if any(v[0] != "bool" for v in values):
            raise NotCompilable("a number used as a condition")
        if self.mode == "bound":
            return ("bool", "0")
        if self.mode == "scalar":
            return ("bool", self.tmp(f" {op} ".join(f"({v[1]})" for v in values)))
        return ("bool", self.tmp(f"_{op}({', '.join(v[1] for v in values)})"))

    def piecewise(self, e: sympy.Piecewise) -> tuple[Any, ...]:
        pairs = list(e.args)
        if self.mode != "scalar":
            conds = [self.value(c) for _, c in pairs]
            vals = [self.value(x) for x, _ in pairs]
            if any(c[0] != "bool" for c in conds):
                raise NotCompilable("a Piecewise condition that is not a condition")
            fracs = [self.as_frac(v) for v in vals]
            if self.mode == "bound":
                num = self.tmp(f"max({', '.join(n for n, _ in fracs)})")
                if all(d == _ONE for _, d in fracs):
                    return ("int", num)
                return ("frac", num, (1, (self.tmp(f"max({', '.join(self.den_code(d) for _, d in fracs)})"),)))
            covered = pairs[-1][1] is sympy.true
            c_list = ", ".join(c[1] for c in conds)
            if not covered:
                self.emit(f"if not _all(_or({c_list})): raise _NoBranch")
            num = self.tmp(f"_select([{c_list}], [{', '.join(n for n, _ in fracs)}])")
            if all(d == _ONE for _, d in fracs):
                return ("int", num)
            den = self.tmp(f"_select([{c_list}], [{', '.join(self.den_code(d) for _, d in fracs)}])")
            return ("frac", num, (1, (den,)))
        # scalar: if / else blocks, each branch computed only when its condition holds
        result_num, result_den = f"r{self.count}n", f"r{self.count}d"
        self.count += 1
        ends: list[tuple[int, int, tuple[str, _Den]]] = []  # (line, indentation, value) where a branch ends
        saved, depth = dict(self.memo), self.indent
        for expr, cond in pairs:
            if cond is sympy.true:
                done = self.as_frac(self.value(expr))
                ends.append((len(self.lines), self.indent, done))
                break
            c = self.value(cond)
            if c[0] != "bool":
                raise NotCompilable("a Piecewise condition that is not a condition")
            self.emit(f"if {c[1]}:")
            self.indent += 1
            outside = dict(self.memo)
            done = self.as_frac(self.value(expr))
            ends.append((len(self.lines), self.indent, done))
            self.memo = outside  # what the branch computed exists only inside it
            self.indent -= 1
            self.emit("else:")
            self.indent += 1
        else:
            self.emit("raise _NoBranch")
        all_int = all(d == _ONE for _, _, (_, d) in ends)
        for position, level, (num, den) in reversed(ends):
            text = f"{result_num} = {num}" if all_int else f"{result_num}, {result_den} = {num}, {self.den_code(den)}"
            self.lines.insert(position, "    " * level + text)
        self.indent, self.memo = depth, saved
        return ("int", result_num) if all_int else ("frac", result_num, (1, (result_den,)))

    # -- the function ----------------------------------------------------------------------------------
    def function(self, e: sympy.Basic) -> str:
        v = self.value(e)
        if v[0] == "bool":
            raise NotCompilable("a condition, not a number")
        num, den = self.as_frac(v)
        if self.mode == "bound":
            # the caller rounds a fraction up as (num + den - 1) // den: that sum is bounded too
            every = [*self.args.values(), *self.temps, f"{num} + {self.den_code(den)}"]
            self.emit(f"return max([1, {', '.join(every)}])")
        elif den == _ONE:
            self.emit(f"return {num}, 1")
        else:
            self.emit(f"return {num}, {self.den_code(den)}")
        head = f"def _f({', '.join(self.args.values())}):"
        return "\n".join([head, *(_inlined(self.lines) if self.mode == "vector" else self.lines)])


_TEMP = re.compile(r"\bt\d+\b")


def _inlined(lines: list[str]) -> list[str]:
    """Straight-line vector code with every temporary used once written into its one use, and the others deleted
    after their last use.  numpy then frees each intermediate array as soon as it is consumed, as one nested
    expression does: keeping them all alive until the function returns costs 3x (fresh pages on every call)."""
    lines = list(lines)
    uses: dict[str, int] = {}
    for line in lines:
        body = line.split(" = ", 1)[1] if _is_assignment(line) else line
        for name in _TEMP.findall(body):
            uses[name] = uses.get(name, 0) + 1
    out: list[str] = []
    pending: dict[str, str] = {}  # temporaries used once, not yet written into their use
    for line in lines:
        indent = line[: len(line) - len(line.lstrip())]
        target, body = (line.strip().split(" = ", 1) if _is_assignment(line) else (None, line.strip()))
        body = _TEMP.sub(lambda m: f"({pending.pop(m.group())})" if m.group() in pending else m.group(), body)
        if target is not None and uses.get(target, 0) == 1:
            pending[target] = body
        else:
            out.append(indent + (f"{target} = {body}" if target is not None else body))
    # delete a temporary used more than once after the line that uses it last
    last: dict[str, int] = {}
    for i, line in enumerate(out):
        for name in _TEMP.findall(line.split(" = ", 1)[1] if _is_assignment(line) else line):
            last[name] = i
    final: list[str] = []
    for i, line in enumerate(out):
        final.append(line)
        gone = [n for n, j in last.items() if j == i and uses.get(n, 0) > 1]
        if gone and not line.strip().startswith("return"):
            final.append(line[: len(line) - len(line.lstrip())] + "del " + ", ".join(sorted(gone)))
    return final


def _is_assignment(line: str) -> bool:
    head = line.strip().split(" = ", 1)[0]
    return " = " in line and _TEMP.fullmatch(head) is not None


_RELATION_OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
                 ">=": operator.ge}


def interpret(e: sympy.Basic, env: Mapping[sympy.Symbol, int]) -> int | Fraction | bool:
    """``e`` at ``env``, exactly, by walking the tree once (what the first configuration uses)."""
    if e.is_Integer:
        return int(e)
    if e.is_Rational:
        return Fraction(int(e.p), int(e.q))
    if e.is_Symbol:
        return env[e]
    if e.is_Add:
        return sum((interpret(a, env) for a in e.args), 0)
    if e.is_Mul:
        return math.prod(interpret(a, env) for a in e.args)
    if e.is_Pow:
        if not e.exp.is_Integer:
            raise NotCompilable(f"power {e.exp}")
        base, k = interpret(e.base, env), int(e.exp)
        return base**k if k >= 0 else 1 / Fraction(base) ** -k
    if isinstance(e, sympy.floor | sympy.ceiling):
        v = interpret(e.args[0], env)
        return (math.ceil if isinstance(e, sympy.ceiling) else math.floor)(v)
    if isinstance(e, sympy.Max | sympy.Min):
        return (max if isinstance(e, sympy.Max) else min)(interpret(a, env) for a in e.args)
    if isinstance(e, sympy.Mod):
        a, b = (interpret(x, env) for x in e.args)
        return a - b * math.floor(Fraction(a) / b)
    if isinstance(e, sympy.Piecewise):
        for expr, cond in e.args:
            if interpret(cond, env):
                return interpret(expr, env)
        raise _NoBranch
    if e.is_Relational:
        if e.rel_op not in _RELATION_OPS:
            raise NotCompilable(f"relation {e.rel_op}")
        return _RELATION_OPS[e.rel_op](interpret(e.lhs, env), interpret(e.rhs, env))
    if e is sympy.true or e is sympy.false:
        return e is sympy.true
    if isinstance(e, sympy.And):
        return all(interpret(a, env) for a in e.args)
    if isinstance(e, sympy.Or):
        return any(interpret(a, env) for a in e.args)
    if isinstance(e, sympy.Not):
        return not interpret(e.args[0], env)
    raise NotCompilable(type(e).__name__)


def exactly(e: sympy.Basic, env: Mapping[sympy.Symbol, int]) -> int | Fraction | bool | None:
    """:func:`interpret`, or None where it gives no value -- a symbol without a number, a part it does not know (a
    float, an unknown function), no branch of a ``Piecewise``, a zero denominator -- for callers whose sympy
    substitution then decides (its answer or refusal was always the one given)."""
    try:
        return interpret(e, env)
    except (KeyError, NotCompilable, _NoBranch, ZeroDivisionError, TypeError):
        return None


def _vector_namespace() -> dict[str, Any]:
    import numpy as np

    def select(conds: list[Any], values: list[Any]) -> Any:
        return np.select([np.asarray(c, dtype=bool) for c in conds], values)

    return {
        "_select": select,
        "_maximum": lambda *xs: reduce(np.maximum, xs),
        "_minimum": lambda *xs: reduce(np.minimum, xs),
        "_and": lambda *xs: reduce(np.logical_and, xs),
        "_or": lambda *xs: reduce(np.logical_or, xs),
        "_not": np.logical_not,
        "_all": np.all,
        "_allpos": lambda x: bool(np.all(np.asarray(x) > 0)),
        "_Fallback": _Fallback,
        "_NoBranch": _NoBranch,
    }


def _compile(source: str, namespace: dict[str, Any]) -> Any:
    code = compile(source, "<symmem.evaluator>", "exec")
    exec(code, namespace)  # the source is generated from a sympy expression, never from user text
    return namespace["_f"]


class Evaluator:
    """An expression compiled for exact evaluation (see the module docstring); call it with the symbols' values
    (by name, or positionally in the order of :attr:`symbols`)."""

    def __init__(self, expr: sympy.Basic, symbols: Sequence[sympy.Symbol] | None = None) -> None:
        self.expr = _expression(expr)
        self.symbols: tuple[sympy.Symbol, ...] = tuple(
            sorted(self.expr.free_symbols, key=lambda s: s.name) if symbols is None else symbols)
        # The first configuration is interpreted (a few microseconds per node of the expression); compiling costs
        # about 0.5 ms, which pays off from the second configuration on.
        self._uses = 0
        self._compiled = False
        self._source: str | None = None
        self._scalar: Any = None
        self._vector: Any = None
        self._bound: Any = None

    @property
    def source(self) -> str | None:
        """The generated Python source of one configuration (None: evaluated by sympy substitution)."""
        self._compile()
        return self._source

    def _compile(self) -> None:
        if self._compiled:
            return
        try:
            self._source = _Codegen(self.symbols, "scalar").function(self.expr)
        except NotCompilable:
            self._source = None
        else:
            self._scalar = _compile(self._source, {"_Fallback": _Fallback, "_NoBranch": _NoBranch})
        self._compiled = True

    # -- arguments -------------------------------------------------------------------------------------
    def _args(self, args: tuple[Any, ...], values: Mapping[str, Any]) -> list[Any]:
        if args and values:
            raise TypeError("give the values by position or by name, not both")
        if args:
            if len(args) != len(self.symbols):
                raise SymmemError(f"expected {len(self.symbols)} values ({', '.join(map(str, self.symbols))}), "
                                  f"got {len(args)}")
            return list(args)
        missing = [s.name for s in self.symbols if s.name not in values]
        if missing:
            raise SymmemError(f"no value for {', '.join(missing)}; set one (e.g. --set {missing[0]}=...)")
        return [values[s.name] for s in self.symbols]

    # -- one configuration ---------------------------------------------------------------------------
    def _pair(self, args: list[Any]) -> tuple[int, int]:
        self._uses += 1
        try:
            if self._uses == 1 and not self._compiled:
                value = interpret(self.expr, dict(zip(self.symbols, args, strict=True)))
                if isinstance(value, bool):
                    raise NotCompilable("a condition, not a number")
                return (value, 1) if isinstance(value, int) else (value.numerator, value.denominator)
            self._compile()
            if self._scalar is not None:
                return self._scalar(*args)
        except (_Fallback, NotCompilable, ZeroDivisionError):
            pass
        except _NoBranch:
            raise SymmemError(f"{self.expr} did not evaluate to a number") from None
        value = sympy.sympify(self.expr.xreplace({s: sympy.Integer(v) for s, v in zip(self.symbols, args,
                                                                                        strict=True)}), strict=True)
        if not value.is_number or not value.is_finite:
            raise SymmemError(f"{self.expr} did not evaluate to a number")
        if not value.is_Rational:
            # a float or an irrational: the old way of rounding (integers stay, others go up)
            v = int(value) if value.is_integer else int(sympy.ceiling(value))
            return v, 1
        return int(value.p), int(value.q)

    def exact(self, *args: int, **values: int) -> int | Fraction:
        """The exact value: an int, or a :class:`~fractions.Fraction` where the formula has fractions."""
        num, den = self._pair(self._args(args, values))
        return num if den == 1 else Fraction(num, den)

    def __call__(self, *args: int, **values: int) -> int:
        """The value as integer bytes: exact when it is an integer, rounded up otherwise (a fraction of a byte
        is a byte)."""
        num, den = self._pair(self._args(args, values))
        return num if den == 1 else -((-num) // den)

    # -- many configurations ---------------------------------------------------------------------------
    def many(self, *args: Any, **values: Any) -> Any:
        """The values at many configurations: each argument a positive integer or an array-like of them,
        broadcast together (numpy rules).  The result is an int64 array when a bound on every intermediate value
        proves that int64 cannot overflow, an object array of Python ints otherwise."""
        import numpy as np

        inputs: list[Any] = []
        biggest: list[int] = []
        exact_objects = False
        for s, v in zip(self.symbols, self._args(args, values), strict=True):
            if isinstance(v, int | np.integer) and not isinstance(v, bool):
                if v <= 0:
                    raise SymmemError(f"{s.name}: values must be positive integers, got {v}")
                inputs.append(int(v))
                biggest.append(int(v))
                continue
            try:
                a = v if isinstance(v, np.ndarray) else np.asarray(v)
            except ValueError:  # a ragged list: rows of different lengths
                raise SymmemError(f"{s.name}: values must be an array of integers (a number, a list, or lists of "
                                  f"equal lengths), not {_shown(v)}") from None
            kind = a.dtype.kind
            if kind == "O":
                items = a.ravel().tolist()
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
                    raise SymmemError(f"{s.name}: values must be integers")
                lo, hi = (min(items), max(items)) if items else (1, 1)
                exact_objects = True
            elif kind in "iu":
                lo, hi = (int(a.min()), int(a.max())) if a.size else (1, 1)
            else:
                raise SymmemError(f"{s.name}: values must be integers, got {a.dtype}")
            if lo <= 0:
                raise SymmemError(f"{s.name}: values must be positive integers, got {lo}")
            inputs.append(a)
            biggest.append(hi)
        shapes = {a.shape for a in inputs if isinstance(a, np.ndarray)}
        try:
            shape = next(iter(shapes)) if len(shapes) == 1 else np.broadcast_shapes(*shapes) if shapes else ()
        except ValueError:
            given = [(s.name, a.shape) for s, a in zip(self.symbols, inputs, strict=True) if isinstance(a, np.ndarray)]
            raise SymmemError("the values do not broadcast together: "
                              + ", ".join(f"{name} has shape {shape}" for name, shape in given)) from None
        if self._vector is None:
            try:
                vector = _compile(_Codegen(self.symbols, "vector").function(self.expr), _vector_namespace())
                bound = _compile(_Codegen(self.symbols, "bound").function(self.expr), {})
            except NotCompilable:
                vector = bound = False
            self._vector, self._bound = vector, bound
        if self._vector is False:
            return self._elementwise(inputs, shape)
        small = not exact_objects and self._bound(*biggest) <= INT64_MAX
        dtype = np.int64 if small else object
        inputs = [a.astype(dtype, copy=False) if isinstance(a, np.ndarray) else a for a in inputs]
        try:
            num, den = self._vector(*inputs)
        except _Fallback:
            return self._elementwise(inputs, shape)
        except _NoBranch:
            raise SymmemError(f"{self.expr} did not evaluate to a number at some of the values") from None
        if not isinstance(den, int) or den != 1:
            num = (num + den - 1) // den  # the ceiling: every denominator is positive
        out = np.asarray(num, dtype=dtype)
        return out if out.shape == shape else np.broadcast_to(out, shape).copy()

    def _elementwise(self, inputs: list[Any], shape: tuple[int, ...]) -> Any:
        """One configuration at a time (an expression the compiler does not translate, a denominator that is not
        positive somewhere): slow, and exact."""
        import numpy as np

        grid = [np.broadcast_to(np.asarray(a, dtype=object), shape) for a in inputs]
        out = np.empty(shape, dtype=object)
        for index in np.ndindex(shape):
            out[index] = self(*(int(g[index]) for g in grid))
        return out


@lru_cache(maxsize=4096)
def _cached(expr: sympy.Basic, symbols: tuple[sympy.Symbol, ...] | None) -> Evaluator:
    return Evaluator(expr, symbols)


def evaluator(expr: sympy.Basic, symbols: Sequence[sympy.Symbol] | None = None) -> Evaluator:
    """The compiled evaluator of ``expr`` (cached per expression and symbols); ``symbols`` fixes the order of
    positional arguments (default: the expression's free symbols by name)."""
    return _cached(_expression(expr), None if symbols is None else tuple(symbols))


def _expression(expr: Any) -> sympy.Basic:
    """``expr`` as a sympy object; a string is refused, never parsed (sympify would run it as Python)."""
    try:
        return sympy.sympify(expr, strict=True)
    except sympy.SympifyError:
        raise SymmemError(f"a formula is a sympy expression or a number, not {expr!r}") from None


def _shown(value: Any) -> str:
    """``value`` for an error message, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
