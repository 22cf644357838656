"""sympy's lark LaTeX grammar on the small part of it that symmem's printer writes, read without the Earley parser.

:func:`symmem.report.latex.parse` hands LaTeX to ``sympy.parsing.latex.parse_latex(..., backend="lark")``: an
Earley parser over sympy's whole LaTeX grammar (``sympy/parsing/latex/lark/grammar/latex.lark``) that takes
~50 ms a text however short and ~3 ms a character, most of the LaTeX, paper and factoring tests' time.  The
texts symmem writes use a few of that grammar's tokens: integers, one-letter symbols (a braced subscript, a
lower-case Greek letter), ``+``, ``-``, ``\\cdot``, ``/``, ``^``, braces, parentheses (``\\left`` and ``\\right``
are ignored tokens of the grammar), ``\\frac{...}{...}``, floors, ceilings and ``=``.  :func:`read` reads such a
text by the grammar's own rules for those tokens, each built as sympy's transformer builds it (evaluated
``Add``, ``Mul``, ``Pow``, ``floor``, ``ceiling``, ``Eq``, in the same association), and counts the text's
derivations: the value is given only where there is exactly one, as the parser gives one reading.

It gives None -- the Earley parser then reads the text, and its value, refusal or error stands -- wherever the
grammar's other rules could apply:

* a token outside that set (any other command, ``*``, ``|``, ``[``, ``!``, ``'``, ``,``, ``_`` outside a
  braced subscript, a decimal point, the letter ``d``, which the grammar also reads as a differential);
* a symbol before a parenthesis (the grammar's ``function_applied``: ``B \\left(S - 1\\right)`` reads as
  ``B(S - 1)`` and as ``B (S - 1)``);
* a ``\\left`` outside every bracket after something that ends an expression, in a text without a relation:
  the dynamic lexer also reads ``\\left`` as ``\\le`` followed by ``f t``, a relation;
* no derivation or more than one.

Where it gives a value, its readings equal the Earley parser's (``srepr`` for ``srepr``): the 126 distinct texts
the LaTeX, paper and factoring tests hand the reader (checked once, 27 November 2026), ``tests/test_latex_grammar.py``
on a table of texts, and under ``-m deep`` every text of every model's LaTeX at its defaults.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import sympy

#: lower-case Greek letters of the grammar's ``GREEK_SYMBOL`` (``\\var...`` named without ``var``)
_GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "kappa",
          "lambda", "mu", "nu", "xi", "rho", "varrho", "tau", "upsilon", "phi", "varphi", "chi", "psi", "omega")
_COMMANDS = {"cdot": "*", "frac": "frac", "lfloor": "lfloor", "rfloor": "rfloor", "lceil": "lceil",
             "rceil": "rceil"}
# a letter with a braced subscript as LATIN_SYMBOL_WITH_LATIN_SUBSCRIPT matches it (one letter or digit, or letters)
_SUBSCRIPT = re.compile(r"_\{([A-Za-z0-9]|[a-zA-Z]+)\}")
_COMMAND = re.compile(r"\\([a-zA-Z]+)")
_NUMBER = re.compile(r"\d+")
#: tokens after which the text before could be a whole expression
_ENDS = frozenset({"num", "sym", ")", "}", "rfloor", "rceil"})
_OPENS = {"{": "}", "(": ")", "lfloor": "rfloor", "lceil": "rceil"}

# A token: (kind, value); a reading: a nested tuple built into sympy only for the one derivation of the text.
Token = tuple[str, Any]


class _Outside(Exception):
    """The text uses a part of the grammar this reader does not follow."""


def _tokens(text: str) -> list[Token]:
    out: list[Token] = []
    i, n = 0, len(text)
    depth, relation, loose_left = 0, False, False
    while i < n:
        c = text[i]
        before = len(out)
        if c in " \t\n\r":
            i += 1
        elif c.isdigit():
            m = _NUMBER.match(text, i)
            assert m is not None
            if text.startswith(".", m.end()):
                raise _Outside("a decimal point")
            out.append(("num", int(m.group())))
            i = m.end()
        elif c.isascii() and c.isalpha():
            if c == "d" or text.startswith("'", i + 1):
                raise _Outside("a differential or a prime")
            if text.startswith("_", i + 1):
                m = _SUBSCRIPT.match(text, i + 1)
                if m is None:
                    raise _Outside("a subscript")
                out.append(("sym", f"{c}_{{{m.group(1)}}}"))
                i = m.end()
            else:
                out.append(("sym", c))
                i += 1
        elif c == "\\":
            m = _COMMAND.match(text, i)
            if m is None:
                raise _Outside("a command")
            name = m.group(1)
            i = m.end()
            if name in ("left", "right"):  # ignored tokens of the grammar
                if name == "left" and depth == 0 and out and out[-1][0] in _ENDS:
                    loose_left = True
                continue
            if name in _GREEK:
                if text.startswith(("_", "'"), i):
                    raise _Outside("a Greek subscript or prime")
                out.append(("sym", name.replace("var", "")))
                continue
            kind = _COMMANDS.get(name)
            if kind is None:
                raise _Outside(f"\\{name}")
            out.append((kind, None))
        elif c in "+-/^{}()=":
            out.append((c, None))
            i += 1
        else:
            raise _Outside(repr(c))
        if len(out) == before:
            continue
        kind = out[-1][0]
        if kind in _OPENS:
            depth += 1
        elif kind in _OPENS.values():
            depth -= 1
        elif kind == "=":
            relation = True
    if loose_left and not relation:
        raise _Outside("\\left where it also reads as \\le")
    for (kind, _), nxt in zip(out, out[1:], strict=False):
        if kind == "sym" and nxt[0] == "(":
            raise _Outside("a symbol before a parenthesis")
    return out


# Readings by end position: {end: (derivations, capped at 2; the reading where there is one)}
Ends = dict[int, tuple[int, Any]]


def _put(ends: Ends, end: int, count: int, value: Any) -> None:
    if end in ends:
        ends[end] = (2, None)
    else:
        ends[end] = (min(count, 2), value if count == 1 else None)


def _join(a: tuple[int, Any], b: tuple[int, Any], make: Callable[[Any, Any], Any]) -> tuple[int, Any]:
    count = a[0] * b[0]
    return (count, make(a[1], b[1]) if count == 1 else None)


class _Chart:
    """The grammar's rules for those tokens (names as in ``latex.lark``), every derivation counted."""

    def __init__(self, tokens: list[Token]) -> None:
        self.t = tokens
        self.memo: dict[tuple[str, int], Ends] = {}

    def kind(self, i: int) -> str:
        return self.t[i][0] if i < len(self.t) else ""

    def _memo(self, rule: str, i: int, make: Callable[[int], Ends]) -> Ends:
        key = (rule, i)
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = make(i)
        return found

    # _expression_func: _atomic_expr | group_curly_parentheses | group_round_parentheses | fraction | floor | ceil
    def func(self, i: int) -> Ends:
        return self._memo("func", i, self._func)

    def _func(self, i: int) -> Ends:
        out: Ends = {}
        kind = self.kind(i)
        if kind == "num":
            _put(out, i + 1, 1, ("num", self.t[i][1]))
        elif kind == "sym":
            _put(out, i + 1, 1, ("sym", self.t[i][1]))
        elif kind in _OPENS:
            close = _OPENS[kind]
            for end, (count, value) in self.expression(i + 1).items():
                if self.kind(end) == close:
                    _put(out, end + 1, count, value if kind in "{(" else (kind, value))
        elif kind == "frac":  # _general_fraction: CMD_FRAC group_curly_parentheses group_curly_parentheses
            for end, num in self.func(i + 1).items() if self.kind(i + 1) == "{" else ():
                if self.kind(end) == "{":
                    for end2, den in self.func(end).items():
                        count, value = _join(num, den, lambda a, b: ("div", a, b))
                        _put(out, end2, count, value)
        return out

    # _expression_power: _expression_func | superscript (_expression_func CARET _expression_power)
    def power(self, i: int) -> Ends:
        return self._memo("power", i, self._power)

    def _power(self, i: int) -> Ends:
        out: Ends = {}
        for end, base in self.func(i).items():
            _put(out, end, *base)
            if self.kind(end) == "^":
                for end2, exp in self.power(end + 1).items():
                    _put(out, end2, *_join(base, exp, lambda a, b: ("pow", a, b)))
        return out

    # _expression_mul: _expression_power | mul | div | adjacent_expressions
    def mul(self, i: int) -> Ends:
        return self._memo("mul", i, self._mul)

    def _mul(self, i: int) -> Ends:
        out: Ends = {}
        for end, r in self.power(i).items():
            _put(out, end, *r)
        kind = self.kind(i)
        # adjacent_expressions: (_one_letter_symbol | number) _expression_mul
        #   | group_round_parentheses (group_round_parentheses | _one_letter_symbol) | _function _function
        #   | fraction _expression_mul
        if kind in ("num", "sym", "frac", "(", "lfloor", "lceil"):
            for end, first in self.func(i).items():
                nxt = self.kind(end)
                if kind in ("num", "sym", "frac"):
                    seconds = self.mul(end)
                elif kind == "(":
                    seconds = self.func(end) if nxt in ("(", "sym") else {}
                else:
                    seconds = self.func(end) if nxt in ("lfloor", "lceil") else {}
                for end2, second in seconds.items():
                    _put(out, end2, *_join(first, second, lambda a, b: ("mul", a, b)))
        # mul: _expression_mul MUL_SYMBOL _expression_power; div: _expression_mul DIV_SYMBOL _expression_power
        done: set[int] = set()
        while True:
            todo = [e for e in out if e not in done and self.kind(e) in ("*", "/")]
            if not todo:
                return out
            end = min(todo)  # every reading that ends here is known: the others end further on
            done.add(end)
            op = "mul" if self.kind(end) == "*" else "div"
            for end2, rhs in self.power(end + 1).items():
                _put(out, end2, *_join(out[end], rhs, lambda a, b, op=op: (op, a, b)))

    # _expression: _expression_mul | add | sub; add: _expression ADD _expression_mul | ADD _expression_mul
    def expression(self, i: int) -> Ends:
        return self._memo("expression", i, self._expression)

    def _expression(self, i: int) -> Ends:
        out: Ends = {}
        for end, r in self.mul(i).items():
            _put(out, end, *r)
        if self.kind(i) in "+-":
            for end, r in self.mul(i + 1).items():
                _put(out, end, r[0], r[1] if self.kind(i) == "+" else ("neg", r[1]))
        done: set[int] = set()
        while True:
            todo = [e for e in out if e not in done and self.kind(e) in ("+", "-")]
            if not todo:
                return out
            end = min(todo)
            done.add(end)
            op = "add" if self.kind(end) == "+" else "sub"
            for end2, rhs in self.mul(end + 1).items():
                _put(out, end2, *_join(out[end], rhs, lambda a, b, op=op: (op, a, b)))

    # latex_string: _relation | _expression; eq: _expression EQUAL _expression
    def whole(self) -> tuple[int, Any]:
        n = len(self.t)
        out: Ends = {}
        for end, lhs in self.expression(0).items():
            if end == n:
                _put(out, n, *lhs)
            elif self.kind(end) == "=":
                rhs = self.expression(end + 1).get(n)
                if rhs is not None:
                    _put(out, n, *_join(lhs, rhs, lambda a, b: ("eq", a, b)))
        return out.get(n, (0, None))


def _build(r: Any) -> Any:
    """A reading as the grammar's transformer builds it (``TransformToSymPyExpr``)."""
    kind = r[0]
    if kind == "num":
        return sympy.Integer(r[1])
    if kind == "sym":
        return sympy.Symbol(r[1])
    if kind == "neg":
        return -_build(r[1])
    if kind == "lfloor":
        return sympy.floor(_build(r[1]))
    if kind == "lceil":
        return sympy.ceiling(_build(r[1]))
    a, b = _build(r[1]), _build(r[2])
    if kind == "add":
        return sympy.Add(a, b)
    if kind == "sub":
        return sympy.Add(a, -b)
    if kind == "mul":
        return sympy.Mul(a, b)
    if kind == "div":
        return sympy.Mul(a, sympy.Pow(b, -1))
    if kind == "pow":
        return sympy.Pow(a, b)
    assert kind == "eq", kind
    return sympy.Eq(a, b)


def read(text: str) -> sympy.Basic | None:
    """``text`` as ``parse_latex(text, backend="lark")`` reads it, or None where this reader does not tell (the
    module docstring says where)."""
    try:
        tokens = _tokens(text)
    except _Outside:
        return None
    if not tokens:
        return None
    count, reading = _Chart(tokens).whole()
    return _build(reading) if count == 1 else None
