"""LaTeX through sympy's printer, with symbol names from the symbol table, laid out to paste into a paper.

Products are juxtaposed (``9 B H S``), in an order that sympy's lark LaTeX parser reads back: it reads a
run of single-symbol factors only when everything after the first power, floor or parenthesis is one more
factor (``L H^{2}``, not ``H^{2} L``).  So plain symbols come first, then the rest; a factor that opens with
``\\left`` (which the parser may also read as ``\\le ft``) and a run of several such factors are wrapped in
braces, which print nothing (``4 B V {\\left(S - 1\\right)}``, ``B L {H^{2} \\cdot S^{2}}``), and ``\\cdot``
stays only between two numbers, between factors that cannot be juxtaposed (two powers), and in the
``L \\cdot \\left(...\\right)`` of a repeated layer in :func:`align` (a parenthesis that may be broken across
lines cannot sit in braces, and ``L \\left(`` reads two ways).  Floors and
ceilings of a quotient print inline (``\\lceil H_{i}/4 \\rceil``), two of them side by side.  Every
expression symmem emits parses back to itself with :func:`parse`, which hands the text to
``sympy.parsing.latex.parse_latex(..., backend="lark")`` after renaming the two symbol names that parser
does not read (``\\Psi``, ``N_{\\mathrm{act}}``) and rejects an ambiguous reading.

:func:`align` writes a derivation as ``align*`` blocks that fit a page: by default compactly (one line per
group, a repeated layer once times its count, the parameter side in :math:`\\Psi`, the parameter count),
or one line per term (``form="terms"``); long sums are broken across lines and long blocks split, for a
text width given in points (345 pt: ``article`` at 10 pt).  :func:`read` parses such a block back.

>>> from symmem.symbols import B, S, H, Hi, h
>>> expression(9 * B * S * H)
'9 B H S'
>>> expression(B * h * S**2)
'B h S^{2}'
>>> parse(expression(Hi * B)) == Hi * B
True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy
from sympy.printing.latex import LatexPrinter

from ..errors import SymmemError
from ..symbols import dims, latex_names
from . import latex_grammar
from .factoring import in_sizes

if TYPE_CHECKING:
    from ..derivation import Derivation, Term

# Roles of the small kept tensors the seed's Table 1 puts in its own column ("Indices / Masks").
AUX_ROLES = ("indices", "mask", "dropout_mask")

#: ``\\textwidth`` of ``\\documentclass{article}`` at 10 pt, in points: the default width :func:`align` fits.
TEXT_WIDTH = 345.0
#: Lines per ``align*`` block at most (a block does not break across pages).
MAX_LINES = 40

_GREEK = ("alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|kappa|lambda|mu|nu|xi|rho|varrho|"
          "tau|upsilon|phi|varphi|chi|psi|omega")
# What the lark parser reads as one symbol: a letter or lower-case Greek letter, with a plain subscript.
_ONE_SYMBOL = re.compile(rf"(?:[a-zA-Z]|\\(?:{_GREEK}))(?:_(?:[A-Za-z0-9]|\{{(?:[A-Za-z0-9]|[a-zA-Z]+)\}}))?")


@functools.cache
def _aliases() -> dict[str, str]:
    """LaTeX names of symmem's symbols that the parser does not read -> a one-symbol name it reads."""
    out = {}
    for d in dims():
        if not _ONE_SYMBOL.fullmatch(d.latex):
            out[d.latex] = f"Y_{{{_letters(len(out))}}}"
    return out


def _letters(i: int) -> str:
    """0 -> 'a', 25 -> 'z', 26 -> 'ba': a subscript the parser reads (it takes one digit, or letters)."""
    s = ""
    while True:
        s = chr(ord("a") + i % 26) + s
        i //= 26
        if i == 0:
            return s


class _Printer(LatexPrinter):
    """sympy's LaTeX printer with juxtaposed products and inline floors (see the module docstring)."""

    def _simple(self, factor: sympy.Expr, tex: str) -> bool:
        return bool(factor.is_Symbol and (_ONE_SYMBOL.fullmatch(tex) or tex in _aliases()))

    def _product(self, factors: Sequence[sympy.Expr]) -> str:
        numbers = [f for f in factors if f.is_Number]
        symbols = [f for f in factors if f.is_Symbol and self._simple(f, self._print(f))]
        others = [f for f in factors if f not in numbers and f not in symbols]
        ordered = numbers + symbols + others
        texs = []
        for i, f in enumerate(ordered):
            tex = self._print(f)
            if self._needs_mul_brackets(f, first=(i == 0), last=(i == len(ordered) - 1)):
                tex = rf"\left({tex}\right)"
            texs.append(tex)
        if len(numbers) > 1 or any(not re.fullmatch(r"\d+", t) for t in texs[:len(numbers)]):
            return r" \cdot ".join(texs)  # several numbers, or a fraction among them: the plain, safe form
        head, tail = texs[:len(numbers) + len(symbols)], texs[len(numbers) + len(symbols):]
        if not tail:
            return " ".join(head)
        rounding = all(isinstance(f, sympy.floor | sympy.ceiling) for f in others) and not any(
            t.startswith(r"\left") for t in tail)
        if len(tail) == 1 or (len(tail) == 2 and rounding):
            rest = " ".join(tail)
            if head and tail[0].startswith((r"\left", "(")):
                rest = f"{{{rest}}}"
        else:
            rest = r" \cdot ".join(tail)
            if head:
                rest = f"{{{rest}}}"
        return " ".join([*head, rest])

    def _convert(self, expr: sympy.Expr) -> str:
        if not expr.is_Mul:
            return str(self._print(expr))
        return self._product(list(expr.as_ordered_factors()))

    def _print_Mul(self, expr: sympy.Expr) -> str:
        from sympy.simplify import fraction

        # An unevaluated product keeps its factors (a factored form; unit factors are shown as they are).
        if isinstance(expr, sympy.Mul) and (expr.args[0] is sympy.S.One or any(
                isinstance(a, sympy.Number) for a in expr.args[1:])):
            return r" \cdot ".join(self._print(a) if not self._needs_mul_brackets(a) else
                                   rf"\left({self._print(a)}\right)" for a in expr.args)
        tex = ""
        include_parens = False
        if expr.could_extract_minus_sign():
            expr = -expr
            tex = "- "
            if expr.is_Add:
                tex += "("
                include_parens = True
        numer, denom = fraction(expr, exact=True)
        if denom is sympy.S.One and sympy.Pow(1, -1, evaluate=False) not in expr.args:
            tex += self._convert(expr)
        else:
            tex += rf"\frac{{{self._convert(numer)}}}{{{self._convert(denom)}}}"
        if include_parens:
            tex += ")"
        return tex

    def _inline(self, arg: sympy.Expr) -> str | None:
        """``arg`` as ``x/n`` for a floor or ceiling, or None where it does not read well that way."""
        num, den = sympy.fraction(sympy.together(arg))
        if not (den.is_Integer and den > 0):
            return None
        if num.is_Symbol or isinstance(num, sympy.floor | sympy.ceiling):
            top = self._print(num)
        elif num.is_Add:
            top = f"({self._print(num)})"
        else:
            return None
        return top if den == 1 else f"{top}/{den}"

    def _rounding(self, expr: sympy.Expr, exp: str | None, left: str, right: str) -> str:
        inline = self._inline(expr.args[0])
        if inline is None:
            tex = rf"\left{left}{{{self._print(expr.args[0])}}}\right{right}"
        else:
            tex = rf"{left} {inline} {right}"
        return tex if exp is None else f"{tex}^{{{exp}}}"

    def _print_floor(self, expr: sympy.Expr, exp: str | None = None) -> str:
        return self._rounding(expr, exp, r"\lfloor", r"\rfloor")

    def _print_ceiling(self, expr: sympy.Expr, exp: str | None = None) -> str:
        return self._rounding(expr, exp, r"\lceil", r"\rceil")


def expression(expr: sympy.Expr) -> str:
    """LaTeX for one expression (no surrounding ``$``); parses back with :func:`parse`.

    >>> from symmem.symbols import B, H, L, S, V
    >>> expression(192 * H**2 * L + 4 * B * V * (S - 1))
    '4 B V {\\\\left(S - 1\\\\right)} + 192 L H^{2}'
    """
    return _Printer({"symbol_names": latex_names(), "mul_symbol": "dot"}).doprint(expr)


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> sympy.Expr:
    """Read LaTeX that :func:`expression` wrote back into an expression in symmem's symbols.

    The parser makes plain symbols; they are mapped back by their LaTeX name (``H_{i}`` -> ``Hi``), so
    the result compares equal to the original.  Names the parser does not read (``\\Psi``) are renamed
    first.  A text the parser reads in two ways is an error, even when both give the same value.  Results are
    cached by text (the parser takes tens of milliseconds a formula).

    >>> from symmem.symbols import B, H, S, h
    >>> e = 9 * B * S * H + B * h * S**2
    >>> sympy.expand(parse(expression(e)) - e)
    0
    """
    if len(text) > MAX_TEXT:
        raise SymmemError(f"cannot read {_cut(text)!r} as a formula: it has {len(text):,} characters, more than "
                          f"{MAX_TEXT:,}")
    if r"\begin{cases}" in text:
        return _parse_cases(text)
    if len(text) > AT_ONCE:
        return _parse_long(text)
    if len(text) > IN_TERMS:
        try:
            return _parse_long(text)
        except SymmemError:
            pass  # read whole, as before, so that the error (or a reading the pieces miss) is the whole text's
    return _read(text)


def _read(text: str) -> sympy.Expr:
    """One text (at most :data:`AT_ONCE` characters) read by the parser whole."""
    aliases = _aliases()
    for name, alias in sorted(aliases.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(name, f" {alias} ")
    # the grammar's rules for the tokens symmem writes, without the Earley parser (latex_grammar's docstring);
    # None where the parser decides
    parsed = latex_grammar.read(text)
    if parsed is None:
        parsed = _lark(text)
    if not isinstance(parsed, sympy.Basic):
        raise SymmemError(f"the LaTeX parser reads {text!r} in more than one way")
    by_latex = {d.name: d.symbol for d in dims()}
    # The parser names a symbol by its LaTeX, without the backslash of a Greek letter (\\psi -> psi).
    by_latex.update({d.latex.removeprefix("\\"): d.symbol for d in dims()})
    by_latex.update({alias: by_latex[name.removeprefix("\\")] for name, alias in aliases.items()})
    return parsed.xreplace({s: by_latex[s.name] for s in parsed.free_symbols if s.name in by_latex})


def _lark(text: str) -> object:
    """``text`` read by sympy's lark LaTeX parser: its value, or its ambiguous tree."""
    from sympy.parsing.latex import parse_latex

    try:
        return parse_latex(text, backend="lark")
    except Exception as exc:  # lark's own exceptions, which name grammar terminals: one line that names the text
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SymmemError(f"cannot read {text.strip()!r} as a formula: {first}") from None


_OPEN = re.compile(r"\{|\\left(?![a-zA-Z])|\\begin\{[a-z*]+\}|\\l(?:floor|ceil)(?![a-zA-Z])")
_CLOSE = re.compile(r"\}|\\right(?![a-zA-Z])|\\end\{[a-z*]+\}|\\r(?:floor|ceil)(?![a-zA-Z])")

#: Texts up to this many characters may go to the parser whole (every formula symmem prints is shorter: 373
#: at most in the test sample; those over IN_TERMS that split at a sign go term by term).  The parser's time
#: grows faster than the length -- a product of 80 symbols takes 0.8 s, of 320 symbols 8 s, of 1,000 about two
#: minutes -- so a longer text is read in pieces
#: (:func:`_parse_long`): a sum term by term, a parenthesised sum after a ``\cdot`` or in braces on its own.
AT_ONCE = 400
#: Texts longer than this are read term by term too when they split at a top-level sign, each term on its own
#: (the same expression: a top-level sign binds loosest), its integer coefficient apart (:func:`_term`), else
#: whole: the parser costs ~50 ms a text however short and more per character the longer the text, and the terms
#: of a derivation's formulas repeat, their coefficients aside.  0: every text (the 144 texts of the LaTeX, paper
#: and factoring tests read in 0.50x the CPU of 60 without coefficients apart, each result's ``srepr`` the same).
IN_TERMS = 0
#: The longest piece of a long text (a term that is not a sum) read at all; a longer one is refused.
MAX_PIECE = 200
#: The longest text read at all: the parser takes about 3 ms a character however the text is cut (a sum of 200
#: distinct terms, 4,649 characters: 14 to 27 s on the 2-core machine), so a longer one would take minutes.
MAX_TEXT = 10_000
# what keeps a long text from being cut into its terms: a relation or a list at the top level
_UNSPLIT = re.compile(r"[=<>,&]|\\\\|\\(?:le|ge|leq|geq|neq|ne|lt|gt|approx|equiv|sim|wedge|vee|neg|pm|mp)(?![a-zA-Z])")
# before a parenthesis that is a factor of its own (not a function's argument): the start, a sign, \cdot, {
_FACTOR_BEFORE = re.compile(r"(?:^|[+\-{(]|\\cdot)\s*$")


def _matching_right(text: str, i: int, depth: list[int]) -> int:
    """The index of the ``\\right`` that closes the ``\\left`` at ``i`` (-1: none)."""
    for j in range(i + 1, len(text)):
        if depth[j] == depth[i] and text.startswith("\\right", j):
            return j
    return -1


def _parse_long(text: str) -> sympy.Expr:
    """A text longer than :data:`AT_ONCE`, read in pieces that each parse fast: every ``\\left( ... \\right)``
    that is a factor of its own (after the start, a sign, ``\\cdot`` or ``{``) is read on its own and stands for
    a placeholder; then the text is cut at its top-level ``+`` and ``-`` and each term read on its own (the
    same expression: a top-level sign binds loosest).  A piece still longer than :data:`MAX_PIECE` (a product of
    hundreds of factors, a relation) is refused."""
    groups: dict[sympy.Symbol, sympy.Expr] = {}
    start = 0
    while (i := text.find("\\left(", start)) >= 0:
        depth = _depths(text)
        j = _matching_right(text, i, depth)
        if j < 0 or not text.startswith("\\right)", j):
            break  # unbalanced: the parser says what is wrong
        if not _FACTOR_BEFORE.search(text[:i]) or j - i < 40:
            start = i + 1
            continue
        name = f"X_{{{_letters(len(groups))}}}"  # a placeholder name no symmem symbol has
        groups[sympy.Symbol(name)] = parse(text[i + len("\\left("):j])
        text = text[:i] + f" {name} " + text[j + len(r"\right)"):]
        start = i + len(name) + 2
    depth = _depths(text)
    top = "".join(c if d == 0 else " " for c, d in zip(text, depth, strict=True))
    terms: list[tuple[int, str]] = []
    if _UNSPLIT.search(top):
        terms.append((1, text))
    else:  # signs between terms; a run of signs (``a + - b``) multiplies
        sign, begin = 1, 0
        for k, c in enumerate(top):
            if c in "+-":
                if text[begin:k].strip():
                    terms.append((sign, text[begin:k]))
                    sign = 1
                sign *= -1 if c == "-" else 1
                begin = k + 1
        terms.append((sign, text[begin:]))
    if not groups and len(terms) == 1 and terms[0][0] == 1 and terms[0][1].strip() == text.strip():
        if len(text) > AT_ONCE:  # one product or relation, too long to read whole
            raise SymmemError(f"cannot read {_cut(text)!r} as a formula: a term of {len(text.strip()):,} characters "
                              f"(a product, a relation) is more than the {MAX_PIECE} read at once")
        return _term(text.strip(), _read)  # a text up to AT_ONCE characters that does not split: whole
    total: sympy.Expr = sympy.Integer(0)
    for sign, term in terms:
        if len(text) > AT_ONCE and len(term.strip()) > MAX_PIECE:
            raise SymmemError(f"cannot read {_cut(term)!r} as a formula: a term of {len(term.strip()):,} characters "
                              f"(a product, a relation) is more than the {MAX_PIECE} read at once")
        total += sign * _term(term.strip(), parse)
    return total.xreplace(groups) if groups else total


#: a term's leading integer coefficient, then what it multiplies: a symbol, a command (not ``\cdot``) or a group
_COEFFICIENT = re.compile(r"(\d+)(?:\s+(?=[A-Za-z{]|\\(?!cdot(?![a-zA-Z])))(.*))?$", re.S)


def _term(term: str, whole: Callable[[str], sympy.Expr]) -> sympy.Expr:
    """One term of a sum (no top-level sign): a leading integer coefficient is read as the integer it is and the
    rest through :func:`parse` -- so ``28352 H`` and ``16 H`` share the parser's reading of ``H`` (each text the
    parser reads costs ~50 ms however short; the coefficients of a derivation's terms are mostly distinct, their
    products of symbols mostly not).  The same expression: an integer times the product that follows it.  A term
    without one is read ``whole`` (:func:`parse`, cached; :func:`_read` for the text ``parse`` was asked)."""
    found = _COEFFICIENT.match(term)
    if not found:
        return whole(term)
    number, rest = found.groups()
    return sympy.Integer(number) * parse(rest) if rest else sympy.Integer(number)



def _depths(text: str) -> list[int]:
    """The nesting depth (braces, ``\\left``/``\\right``, environments) before each character of ``text``."""
    out, depth, i = [], 0, 0
    while i < len(text):
        m = _OPEN.match(text, i) if text[i] in "{\\" else None
        c = _CLOSE.match(text, i) if text[i] in "}\\" else None
        if text.startswith(("\\{", "\\}"), i):  # a literal brace
            out += [depth, depth]
            i += 2
        elif m:
            out += [depth] * (m.end() - i)
            depth += 1
            i = m.end()
        elif c:
            depth -= 1
            out += [depth] * (c.end() - i)
            i = c.end()
        else:
            out.append(depth)
            i += 1
    return out


def _top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside braces, ``\\left ... \\right`` and environments."""
    depth = _depths(text)
    parts, start, i = [], 0, 0
    while i < len(text):
        if depth[i] == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            start = i = i + len(sep)
            continue
        i += 1
    return [*parts, text[start:]]


def _parse_condition(text: str) -> sympy.Basic:
    """A condition as sympy prints a ``Piecewise``'s: relations joined by ``\\vee``, ``\\wedge``, ``\\neg``."""
    text = text.strip()
    for sep, op in ((r"\vee", sympy.Or), (r"\wedge", sympy.And)):
        parts = _top_level(text, sep)
        if len(parts) > 1:
            return op(*(_parse_condition(p) for p in parts))
    if text.startswith(r"\neg"):
        return sympy.Not(_parse_condition(text.removeprefix(r"\neg")))
    if text.startswith(r"\left(") and text.endswith(r"\right)"):
        return _parse_condition(text[len(r"\left("):-len(r"\right)")])
    return parse(text)


def _unaligned(value: str) -> str:
    """A ``cases`` branch that :func:`align` broke over lines (an ``aligned`` of its own) as one line."""
    if _ALIGNED[0] not in value:
        return value
    body = value.replace(_ALIGNED[0], " ").replace(_ALIGNED[1], " ")
    return " ".join(p.strip().removeprefix("&").strip().removeprefix(r"\quad").strip().removeprefix("{}")
                    for p in body.split(r"\\"))


def _parse_cases(text: str) -> sympy.Expr:
    """LaTeX with ``\\begin{cases}`` blocks (a ``Piecewise``): each block read on its own, the rest around it."""
    begin, end = r"\begin{cases}", r"\end{cases}"
    blocks: dict[sympy.Symbol, sympy.Expr] = {}
    while begin in text:
        i = text.index(begin)
        j = text.find(end, i)
        if j < 0:
            raise SymmemError(f"cannot read {_cut(text)!r} as a formula: a \\begin{{cases}} without its \\end{{cases}}")
        pieces = []
        for row in _top_level(text[i + len(begin):j], r"\\"):
            cells = _top_level(row, "&")
            if len(cells) != 2:
                raise SymmemError(f"cannot read {_cut(row)!r} as a row of cases: expected VALUE & CONDITION")
            value, cond = cells
            value = _unaligned(value)
            cond = cond.strip()
            truth = sympy.true if cond == r"\text{otherwise}" else _parse_condition(
                cond.removeprefix(r"\text{for}\:"))
            pieces.append((parse(value), truth))
        name = f"Z_{{{_letters(len(blocks))}}}"  # a placeholder name no symmem symbol has
        blocks[sympy.Symbol(name)] = sympy.Piecewise(*pieces)
        text = f"{text[:i]} {name} {text[j + len(end):]}"
    return parse(text).xreplace(blocks)


_ESCAPES = {"\\": r"\textbackslash{}", "_": r"\_", "&": r"\&", "%": r"\%", "#": r"\#", "$": r"\$", "{": r"\{",
            "}": r"\}"}


def _cut(text: str, n: int = 80) -> str:
    """``text`` stripped, cut to ``n`` characters for an error message."""
    text = text.strip()
    return text if len(text) <= n else f"{text[:n - 3]}..."


def escape(text: str) -> str:
    """``text`` safe inside LaTeX text mode.

    >>> escape("h.attn.ln_1 {50%}")
    'h.attn.ln\\\\_1 \\\\{50\\\\%\\\\}'
    """
    return "".join(_ESCAPES.get(ch, ch) for ch in text)


#: The label of the total's row: what it is (the peak, which must fit, leads the block).
KEPT = "kept after forward + parameters"


def _label(text: str) -> str:
    return rf"\text{{{escape(text)}}}"


# -- widths -----------------------------------------------------------------------------------------------
# Rough glyph widths in points at 10 pt (Computer Modern), a little generous, so that a line estimated to
# fit does fit; tests/test_latex.py compiles the output and checks the log for overfull boxes.
_MATH_CHARS = {"+": 12.3, "-": 12.3, "=": 13.4, "<": 13.4, ">": 13.4, "/": 5.0, "(": 3.9, ")": 3.9,
               "[": 2.8, "]": 2.8, ",": 4.5, ".": 2.8, "'": 2.8, "|": 2.8, "!": 2.8, ":": 2.8, ";": 2.8}
_COMMANDS = {"cdot": 7.3, "quad": 10.0, "qquad": 20.0, ",": 1.7, ":": 2.3, ";": 2.8, "!": -1.7, " ": 3.4,
             "lfloor": 4.5, "rfloor": 4.5, "lceil": 4.5, "rceil": 4.5, "wedge": 11.2, "vee": 11.2, "neg": 6.7,
             "neq": 13.4, "ne": 13.4, "leq": 13.4, "geq": 13.4, "le": 13.4, "ge": 13.4, "times": 12.3,
             "Psi": 7.8, "_": 5.0, "%": 8.4, "&": 7.8, "#": 8.4, "{": 5.0, "}": 5.0, "infty": 10.0}
_TEXT_COMMANDS = ("text", "mathrm", "textrm", "textit", "mathit", "textbf", "mathbf", "operatorname")


def _group(tex: str, i: int) -> tuple[str, int]:
    """The argument starting at ``tex[i]`` (a ``{...}`` group or one token) and the index after it."""
    while i < len(tex) and tex[i] == " ":
        i += 1
    if i >= len(tex):
        return "", i
    if tex[i] == "{":
        depth = 0
        for j in range(i, len(tex)):
            if tex[j] == "\\":
                continue
            if tex[j] == "{" and tex[j - 1] != "\\":
                depth += 1
            elif tex[j] == "}" and tex[j - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return tex[i + 1:j], j + 1
        return tex[i + 1:], len(tex)
    m = re.match(r"\\(?:[a-zA-Z]+|.)", tex[i:])
    if m:
        return m.group(0), i + m.end()
    return tex[i], i + 1


# Computer Modern at 10 pt: roman (text) and math italic glyph widths, the latter with italic correction.
_ROMAN = dict(zip("abcdefghijklmnopqrstuvwxyz", (
    5.0, 5.6, 4.4, 5.6, 4.4, 3.1, 5.0, 5.6, 2.8, 3.1, 5.3, 2.8, 8.3, 5.6, 5.0, 5.6, 5.3, 3.9, 4.0, 3.9, 5.6, 5.3,
    7.2, 5.3, 5.3, 4.4), strict=True))
_ITALIC = dict(zip("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", (
    7.5, 7.6, 7.7, 8.3, 7.4, 7.0, 7.9, 8.9, 4.9, 6.0, 8.9, 6.8, 9.7, 8.9, 7.6, 6.9, 7.9, 7.6, 6.6, 6.4, 7.5, 6.6,
    9.9, 8.6, 6.6, 7.3, 5.3, 4.3, 4.3, 5.2, 4.7, 5.8, 4.8, 5.8, 3.5, 4.6, 5.2, 3.0, 8.8, 6.0, 4.9, 5.0, 4.6, 4.5,
    4.7, 3.6, 5.7, 4.9, 7.2, 5.7, 5.0, 4.7), strict=True))


def _text_width(text: str) -> float:
    text = re.sub(r"\\([_%&#{}$])", r"\1", text)
    text = re.sub(r"\$[^$]*\$", "xxx", text)
    w = 0.0
    for ch in text:
        w += _ROMAN.get(ch) or (7.5 if ch.isupper() else 5.0 if ch.isdigit() else 3.4 if ch == " " else 2.8 if
                               ch in ".,:;" else 3.9 if ch in "()" else 5.0)
    return w


def width(tex: str) -> float:
    """Estimated width in points of LaTeX math ``tex`` set in display style at 10 pt (generous).

    >>> 50 < width("9 B H S + B h S^{2}") < 90
    True
    """
    w, i = 0.0, 0
    while i < len(tex):
        ch = tex[i]
        if ch in " \n\t{}&":
            if ch in "{}":
                inner, i = _group(tex, i)
                w += width(inner)
                continue
            i += 1
            continue
        if ch in "^_":
            arg, i = _group(tex, i + 1)
            w += 0.75 * width(arg) + 0.6
            continue
        if ch == "\\":
            m = re.match(r"\\([a-zA-Z]+|.)", tex[i:])
            name = m.group(1) if m else ""
            i += m.end() if m else 1
            if name == "frac":
                a, i = _group(tex, i)
                b, i = _group(tex, i)
                w += max(width(a), width(b)) + 2.4
            elif name in _TEXT_COMMANDS:
                arg, i = _group(tex, i)
                w += _text_width(arg) if name.startswith("text") or name == "mathrm" else width(arg)
            elif name in ("left", "right"):
                delim, i = _group(tex, i)
                w += 1.2 if delim == "." else 6.5
            elif name == "begin":
                env, i = _group(tex, i)
                j = tex.find(rf"\end{{{env}}}", i)
                j = len(tex) if j < 0 else j
                body, i = tex[i:j], j + len(rf"\end{{{env}}}")
                rows = [_top_level(r, "&") for r in _top_level(body, r"\\")]
                cols = max(len(r) for r in rows)
                widths = [max((width(r[c]) for r in rows if c < len(r)), default=0.0) for c in range(cols)]
                w += 10.0 + sum(widths) + 10.0 * (cols - 1)
            elif name == "\\":
                pass
            else:
                w += _COMMANDS.get(name, 7.0)
            continue
        if ch.isalpha():
            w += 1.04 * _ITALIC.get(ch, 8.0)
        elif ch.isdigit():
            w += 5.0
        else:
            w += _MATH_CHARS.get(ch, 5.0)
        i += 1
    return w


def _height(tex: str) -> float:
    """Estimated height in points of one ``align*`` line holding ``tex`` (baseline skip and ``\\jot``)."""
    h = 16.0
    if r"\frac" in tex:
        h += 11.0
    if r"\begin{cases}" in tex:
        # every line of the block, a branch broken over lines (an ``aligned`` inside it) included
        block = tex[tex.index(r"\begin{cases}"):]
        rows = max(block[:block.find(r"\end{cases}")].count(r"\\") + 1, 2)
        h = max(h, 14.0 * rows + 8.0 + (10.0 if r"\frac" in tex else 0.0))
    return h


# -- rows -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Equation:
    """One equation of an :func:`align` block: ``label = tex``.

    ``expr`` is what ``tex`` says (in :math:`\\Psi` where the block defines it); ``value`` is the quantity of the
    derivation it equals (the same expression with :math:`\\Psi` replaced by the parameter count, up to
    the floor and ceiling rewriting of :func:`symmem.simplify.rounded`).  ``group`` is the derivation's group
    (a heading in the per-term form) and ``note`` a LaTeX comment written after the line (the term's full name).
    """

    label: str
    tex: str
    expr: sympy.Expr
    value: sympy.Expr
    group: str = ""
    note: str = ""


def _sum_tex(texs: Iterable[str]) -> str:
    out = ""
    for t in texs:
        if not t or t == "0":
            continue
        if not out:
            out = t
        elif t.startswith("- "):
            out += " " + t
        else:
            out += " + " + t
    return out or "0"


def _factored(expr: sympy.Expr, values: dict | None) -> tuple[str, sympy.Expr]:
    """``expr`` factored around its leading term (the part all branches share; the branches apart)."""
    from ..simplify import common_branches, factor_leading

    common, rest = common_branches(expr)
    f = factor_leading(common, values) if common != 0 else sympy.Integer(0)
    if isinstance(f, sympy.Add) and isinstance(f.args[0], sympy.Mul) and any(a.is_Add for a in f.args[0].args):
        texs = [expression(f.args[0]), expression(sympy.Add(*f.args[1:]))]
    else:
        texs = [expression(f)]
    if rest != 0:
        texs.append(expression(rest))
    return _sum_tex(texs), sympy.Add(f, rest, evaluate=False) if rest != 0 else f


def _field(expr: sympy.Expr) -> tuple[str, sympy.Expr]:
    """``expr`` the field's way (:func:`symmem.report.factoring.field`), its parentheses breakable across lines."""
    from .factoring import field

    f = field(expr)
    return f.latex(breakable=True, printer=expression), f.expr()


def _parameter_count(d: Derivation) -> sympy.Expr | None:
    """The parameter count :math:`\\Psi` stands for, or None where it cannot stand for it."""
    from ..symbols import Psi

    count = d.parameters
    if count == 0 or (Psi in count.free_symbols and count != Psi):
        return None
    return count


def _in_psi(d: Derivation, t: Term, count: sympy.Expr | None) -> sympy.Expr:
    """A parameter-side term as a multiple of :math:`\\Psi` (``16 Psi / N``) where it is one, else as it is."""
    from ..symbols import N, Psi, p
    from ..symbols import t as tp

    if count is None:
        return t.expr
    ratio = sympy.cancel(t.expr / count)
    if ratio != 0 and ratio.free_symbols <= {N, p, tp}:
        return ratio * Psi
    return t.expr


_FIRST = ("input", "stem", "embed", "embedding", "embeddings", "model")
_LAST = ("head", "pooler", "classifier", "loss", "pipeline", "backward", "parameters")


def _group_order(d: Derivation) -> list[str]:
    """Groups in the order a reader expects (input, stem/embed, layers, head, loss, parameters), else as found."""
    seen = list(dict.fromkeys(t.group for t in d.terms))

    def key(g: str) -> tuple[int, int]:
        if g in _FIRST:
            return (0, _FIRST.index(g))
        if g in _LAST:
            return (2, _LAST.index(g))
        return (1, seen.index(g))

    return sorted(seen, key=key)


def _group_row(group: str, terms: list[Term], sized: bool = False) -> Equation:
    """A group's bytes: a part kept ``c`` times (``c`` a symbol, the layer count ``L``) written once times ``c``;
    ``sized``: the field's way (:func:`_field`)."""
    from ..conditions import fold
    from ..simplify import rounded

    by_count: dict[sympy.Expr, list[sympy.Expr]] = {}
    for t in terms:
        by_count.setdefault(t.count, []).append(t.expr)
    value = fold(sympy.Add(*(t.expr for t in terms)))
    if sized:
        tex, shown = _field(rounded(value))
        return Equation(_label(group), tex, shown, value, group, f"group {group}")
    texs, exprs, rest = [], [], []
    for c, parts in by_count.items():
        s = fold(sympy.Add(*parts))
        per = sympy.expand(sympy.cancel(s / c)) if not (c.is_number or c.has(sympy.Piecewise)) else None
        if per is None or per.has(sympy.Piecewise) or len(sympy.Add.make_args(per)) < 2 or (
                sympy.denom(sympy.together(per)).free_symbols & c.free_symbols):
            rest.append(s)
            continue
        per = rounded(per)
        ctex = expression(c)
        if c.is_Add:
            ctex = rf"\left({ctex}\right)"
        texs.append(rf"{ctex} \cdot \left({expression(per)}\right)")
        exprs.append(sympy.Mul(c, per, evaluate=False))
    if rest:
        r = rounded(fold(sympy.Add(*rest)))
        texs.append(expression(r))
        exprs.append(r)
    expr = exprs[0] if len(exprs) == 1 else sympy.Add(*exprs, evaluate=False)
    return Equation(_label(group), _sum_tex(texs), expr, value, group, f"group {group}")


def labels(d: Derivation) -> dict[str, str]:
    """A short readable label per term: the end of its dotted name that no other term's name ends with.

    It keeps at least the submodule of a nested name (``h.mlp.c_fc`` -> ``mlp.c_fc``) and the node of a tensor an
    op saves besides its output (``maxpool.indices``), and terms under one parent get ends of one length
    (``scores.input0_copy``, ``scores.input1_copy``).  Labels are unique within the derivation; the group is
    what :func:`align` heads them with.

    >>> from symmem import derive
    >>> names = labels(derive("vit-b16", attention="naive"))
    >>> names["blocks.softmax"], names["pos_add"]
    ('softmax', 'pos_add')
    """
    terms = list({t.name: t for t in d.terms}.values())
    names = [t.name for t in terms]

    def unique(n: str, k: int) -> bool:
        end = ".".join(n.split(".")[-k:])
        return not any(m != n and (m == end or m.endswith("." + end)) for m in names)

    length: dict[str, int] = {}
    for t in terms:
        parts = t.name.split(".")
        k = 1 if len(parts) <= 2 else 2
        if t.node and t.name != t.node and t.name.startswith(t.node + "."):
            k = max(k, len(parts) - len(t.node.split(".")) + 1)
        k = min(k, len(parts))
        while k < len(parts) and not unique(t.name, k):
            k += 1
        length[t.name] = k
    parent: dict[str, int] = {}
    for n, k in length.items():
        key = n.rpartition(".")[0]
        parent[key] = max(parent.get(key, 0), k)
    return {n: ".".join(n.split(".")[-max(k, min(parent[n.rpartition(".")[0]], len(n.split("."))) ):])
            for n, k in length.items()}


def rows(d: Derivation, form: str = "compact") -> list[Equation]:
    """The equations :func:`align` writes, before layout: ``form`` is ``"compact"`` or ``"terms"``.

    ``compact``: one row per activation group (a part kept ``L`` times written once, times ``L``), the
    activations factored around their leading term, inputs, loss and transients where present,
    :math:`\\Psi` (the parameter count), the parameter side in :math:`\\Psi`, and the total.  ``terms``: one
    row per term under its group, with a short label (:func:`labels`), then the same totals.
    """
    from ..conditions import fold
    from ..simplify import rounded
    from ..symbols import Psi

    if form not in ("compact", "terms"):
        raise SymmemError(f"form must be 'compact' or 'terms', not {form!r}")
    count = _parameter_count(d)
    values = dict(d.numbers)
    order = _group_order(d)
    out: list[Equation] = []
    params = [t for t in d.terms if t.category == "parameter"]
    sized = in_sizes(d)  # a formula in the model's own sizes: written the field's way
    factor = _field if sized else functools.partial(_factored, values=values)
    if form == "compact":
        acts = [t for t in d.terms if t.category == "activation"]
        groups = [g for g in order if any(t.group == g for t in acts)]
        repeated = any(not t.count.is_number for t in acts)
        if len(groups) > 1 or repeated:
            out += [_group_row(g, [t for t in acts if t.group == g], sized) for g in groups]
    else:
        names = labels(d)
        for g in order:
            for t in d.terms:
                if t.group != g or t.category == "parameter":
                    continue
                e = rounded(t.expr)
                note = t.name + (f" [{t.role}]" if t.role else "")
                tex, shown = _field(e) if sized else (expression(e), e)
                out.append(Equation(_label(names[t.name]), tex, shown, t.expr, g, note))
    tex, expr = factor(rounded(d.activations))
    out.append(Equation(_label("activations"), tex, expr, d.activations, "totals", "activations"))
    for key in ("input", "loss", "transient"):
        e = d.expression(key)
        if e != 0:
            r = rounded(e)
            out.append(Equation(_label(key), expression(r), r, e, "totals", key))
    if count is not None and count != Psi:
        group = "parameters" if form == "terms" else "totals"
        tex, shown = _field(count) if sized else (expression(count), count)
        out.append(Equation(r"\Psi", tex, shown, count, group, "Psi: the parameter count"))
    if form == "terms":
        names = labels(d)
        for t in params:
            e = _in_psi(d, t, count)
            out.append(Equation(_label(names[t.name]), expression(e), e, t.expr, "parameters", t.name))
    param = sympy.Add(*(_in_psi(d, t, count) for t in params))
    out.append(Equation(_label("parameter memory"), expression(param), param, d.parameter_memory, "totals",
                   "parameter memory (weights, gradients, optimizer state)"))
    rest = fold(sympy.Add(*(t.expr for t in d.terms if t.category != "parameter")))
    tex, expr = factor(rounded(rest))
    total = sympy.Add(expr, param, evaluate=False) if param != 0 else expr
    # "total" is what is kept at the end of the forward pass + the parameter side, named so: the peak leads
    out.append(Equation(_label(KEPT), _sum_tex([tex, expression(param)]), total, d.total, "totals",
                        "kept at the end of forward + the parameter side (the total; not the peak)"))
    if form == "terms":  # the totals after the terms, parameters with the terms
        out = [r for r in out if r.group != "totals"] + [r for r in out if r.group == "totals"]
    return out


def lines(d: Derivation) -> list[tuple[str, sympy.Expr]]:
    """(name, bytes) for every term, then the totals (activations factored): the quantities of ``align``'s
    per-term form, by the terms' full names and without :math:`\\Psi`."""
    from ..simplify import factored

    out = [(t.name, t.expr) for t in d.terms]
    out.append(("activations", factored(d.activations)))
    out.append(("parameter memory", d.parameter_memory))
    for key in ("input", "loss", "transient"):
        if d.expression(key) != 0:
            out.append((key, d.expression(key)))
    out.append(("total", d.total))
    return out


# -- line breaking ---------------------------------------------------------------------------------------------
_BREAK = r"\right."
_RESUME = r"\left."


def _terms_of(tex: str) -> list[str]:
    """``tex`` cut before each binary ``+``/``-`` outside braces and delimiters: ``['a', '+ b', '- c']``."""
    depth = _depths(tex)
    cuts = [i for i in range(1, len(tex) - 1)
            if depth[i] == 0 and tex[i] in "+-" and tex[i - 1] == " " and tex[i + 1] == " "]
    bounds = [0, *cuts, len(tex)]
    return [tex[a:b].strip() for a, b in zip(bounds, bounds[1:], strict=False) if tex[a:b].strip()]


def _fill(pieces: list[str], first: float, rest: float) -> list[str]:
    """Pieces packed greedily into lines no wider than ``first`` (the first line) and ``rest`` points."""
    out: list[str] = []
    cur = ""
    for p in pieces:
        cand = f"{cur} {p}" if cur else p
        if not cur or width(cand) <= (rest if out else first):
            cur = cand
        else:
            out.append(cur)
            cur = p
    if cur:
        out.append(cur)
    return out


def _inside(line: str, first: float, rest: float) -> list[str] | None:
    """A line ending in ``\\cdot \\left( ... \\right)`` broken inside the parentheses, or None."""
    if not line.endswith(r"\right)"):
        return None
    depth = _depths(line)
    start = line.rfind(r"\left(")
    while start > 0 and depth[start] != 0:
        start = line.rfind(r"\left(", 0, start)
    if start <= 0 or not line[:start].rstrip().endswith(r"\cdot") or depth[len(line) - len(r"\right)") - 1] != 1:
        return None
    head, inner = line[:start + len(r"\left(")], line[start + len(r"\left("):-len(r"\right)")]
    pieces = _terms_of(inner)
    if len(pieces) < 2:
        return None
    pieces[0] = f"{head}{pieces[0]}"
    packed = _fill(pieces, first - 6.0, rest - 12.0)
    if len(packed) < 2:
        return None
    out = [f"{packed[0]} {_BREAK}"]
    out += [f"{_RESUME} {{}} {p} {_BREAK}" for p in packed[1:-1]]
    out.append(f"{_RESUME} {{}} {packed[-1]}\\right)")
    return out


_CASES = (r"\begin{cases}", r"\end{cases}")
_ALIGNED = (r"\begin{aligned}[t]", r"\end{aligned}")
_ROW = r" \\ "


def _cases_broken(line: str, limit: float) -> str | None:
    """A line holding a ``cases`` block too wide for ``limit`` points, each too-wide branch broken before a ``+``
    into an ``aligned`` of its own (:func:`parse` reads it back), or None where that does not help."""
    begin, end = _CASES
    if begin not in line or end not in line:
        return None
    i, j = line.index(begin), line.index(end)
    rows = [_top_level(r, "&") for r in _top_level(line[i + len(begin):j], r"\\")]
    if any(len(r) != 2 for r in rows):
        return None
    outside = width(line[:i] + line[j + len(end):])
    budget = limit - outside - max(width(c) for _, c in rows) - 24.0
    out = []
    for value, cond in rows:
        if width(value) > budget:
            pieces = _fill(_terms_of(value.strip()), budget, budget - 10.0)
            if len(pieces) > 1:
                lines = [f"& {pieces[0]}", *(f"&\\quad {{}} {p}" for p in pieces[1:])]
                value = f"{_ALIGNED[0]} {_ROW.join(lines)} {_ALIGNED[1]} "
        out.append(f"{value.strip()} & {cond.strip()}")
    return f"{line[:i]}{begin} {_ROW.join(out)} {end}{line[j + len(end):]}"


def _break_lines(tex: str, avail: float) -> list[str]:
    """The right-hand side ``tex`` as lines of at most ``avail`` points: the first after ``=``, the others
    after a ``\\quad``, each continuation starting with its ``+``/``-`` (after ``{}``, so it spaces as binary);
    a ``cases`` block wider than that has its wide branches broken inside it."""
    first, rest = avail - 13.4, avail - 10.0
    lines = _fill(_terms_of(tex), first, rest)
    out: list[str] = []
    for k, line in enumerate(lines):
        text = line if k == 0 else f"{{}} {line}"
        limit = first if k == 0 else rest
        broken = _inside(text, limit, rest) if width(text) > limit else None
        if broken is None and width(text) > limit:
            cases = _cases_broken(text, limit)
            broken = [cases] if cases is not None else None
        out += broken or [text]
    return out


@dataclass
class _Block:
    lines: list[tuple[str, str, bool]]  # (LaTeX, note, is a heading)
    height: float = 0.0
    count: int = 0

    def add(self, code: str, note: str = "", heading: bool = False, height: float = 0.0) -> None:
        self.lines.append((code, note, heading))
        self.count += 1
        self.height += height

    def text(self) -> str:
        out = []
        for k, (code, note, heading) in enumerate(self.lines):
            if not heading and k < len(self.lines) - 1:
                code += r" \\"
            out.append(f"  {code}" + (f" % {note}" if note else ""))
        return "\n".join(out)


def _heading(group: str, continued: bool) -> str:
    return rf"\intertext{{{escape(group)}{' (continued)' if continued else ''}}}"


def align(d: Derivation, form: str = "compact", width_pt: float = TEXT_WIDTH, max_lines: int = MAX_LINES,
          page_pt: float = 500.0, lead: bool = True) -> str:
    """``align*`` blocks of the derivation's equations, in bytes, ready to paste (needs ``amsmath``).

    ``form="compact"`` (the default): one line per group (a repeated layer once, times its count ``L``), the
    activations factored around their leading term, :math:`\\Psi` (the parameter count) with the parameter
    side as multiples of it (``16 \\Psi``, ``\\frac{16 \\Psi}{N}`` under ZeRO-3), and the total.
    ``form="terms"``: one line per term with a short label (:func:`labels`) under a heading per group (the
    full name in a comment after it), then the same totals.  Long right-hand sides are broken before a
    ``+`` so that no line is wider than ``width_pt`` points (345: ``article`` at 10 pt); a block longer than
    ``max_lines`` lines or about ``page_pt`` points goes on in another block (an ``align*`` does not break
    across pages).  :func:`read` parses the output back.  ``lead``: the peak of a training step (or why there is
    none) first, as a comment and a sentence (:func:`headline`); a document that says it in its own words (the
    generated paper) leaves it out.
    """
    for name, value, integer in (("width_pt", width_pt, False), ("page_pt", page_pt, False),
                                 ("max_lines", max_lines, True)):
        kinds = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < float("inf"):
            raise SymmemError(f"{name} must be a positive {'integer' if integer else 'number'}, not {value!r}")
    table = rows(d, form)
    lhs = max(width(r.label) for r in table)
    avail = 0.96 * width_pt - lhs - 4.0
    headed = form == "terms"
    blocks = [_Block([])]
    group = None
    for r in table:
        parts = _break_lines(r.tex, avail)
        new_group = headed and r.group != group
        need = len(parts) + (1 if new_group else 0)
        height = sum(_height(p) for p in parts) + (34.0 if new_group else 0.0)
        b = blocks[-1]
        if b.count and (b.count + need > max_lines or b.height + height > page_pt):
            b = _Block([])
            blocks.append(b)
            if headed and not new_group:
                b.add(_heading(r.group, True), heading=True, height=34.0)
        if new_group:
            b.add(_heading(r.group, False), heading=True, height=34.0)
        group = r.group
        for k, p in enumerate(parts):
            code = f"{r.label} &= {p}" if k == 0 else f"&\\quad {p}"
            b.add(code, r.note if k == 0 else "", height=_height(p))
    out = [f"% {d.title()}; bytes, in {', '.join(s.name for s in d.free) or 'numbers only'}"]
    out += [f"% NOTE: {n}" for n in d.notes]
    out += headline(d) if lead else []
    if any(r.label == r"\Psi" for r in table):
        out.append(r"% \Psi is the parameter count; the parameter side is written in it")
    if form == "compact" and any(r" \cdot \left(" in r.tex for r in table):
        out.append("% a part kept once per layer is written once, times its count")
    out.append(r"% needs \usepackage{amsmath}")
    for b in blocks:
        out += [r"\begin{align*}", b.text(), r"\end{align*}"]
    return "\n".join(out + where(d))


def where(d: Derivation) -> list[str]:
    """What each symbol stands for, after a formula in a model's own sizes (:func:`symmem.report.factoring.legend`):
    a comment and a paragraph in text mode (``\\sloppy``: config keys are long words), none for other formulas."""
    from .factoring import legend, meanings

    if not in_sizes(d):
        return []
    said = [rf"${latex_names().get(s, s.name)}$ " + (rf"= \texttt{{{escape(key)}}} ({escape(m)})" if key else
                                                      rf"({escape(m)})") for s, key, m in meanings(d)]
    return [f"% where {'; '.join(legend(d))}", rf"{{\sloppy\noindent where {'; '.join(said)}.\par}}"]


def headline(d: Derivation) -> list[str]:
    """The lines :func:`align` leads with: the peak of a training step, the number that must fit, and where it
    occurs (or why there is none), as a comment and as a sentence in text mode (outside the ``align*`` blocks,
    which :func:`read` parses)."""
    from ..units import format_bytes
    from .headline import PEAK_LABEL, peak_state

    found, why = peak_state(d)
    if not found:
        return [f"% {why}", rf"\noindent {escape(why or 'no peak')}."]
    _, v, moment = found[0]
    where = moment.where(step=False)
    pinned = moment.pinned() if hasattr(moment, "pinned") else ""  # a pipeline's formulas: the schedule's numbers
    where += f" (its formula {pinned})" if pinned else ""
    return [f"% {PEAK_LABEL}: {format_bytes(v)} ({v:,} bytes) at {where}",
            rf"\noindent\textbf{{{escape(PEAK_LABEL[0].upper() + PEAK_LABEL[1:])}:}} "
            rf"{escape(format_bytes(v))} at {escape(where)}."]


def equations(text: str) -> list[tuple[str, str]]:
    """The equations of :func:`align`'s output as (label, right-hand side) LaTeX, in order: comments and
    headings dropped, continuation lines joined back into the one-line right-hand side."""
    found: list[tuple[str, str]] = []
    for block in re.findall(r"\\begin\{align\*\}(.*?)\\end\{align\*\}", text, re.S):
        body = "\n".join(re.sub(r"(?<!\\)%.*$", "", ln) for ln in block.splitlines())
        body = re.sub(r"\\intertext\{(?:[^{}]|\{[^{}]*\})*\}", "", body)
        for row in _top_level(body, r"\\"):
            row = row.strip()
            if not row:
                continue
            lhs, _, rhs = row.partition("&")
            rhs = rhs.strip()
            if lhs.strip():
                found.append((lhs.strip(), rhs.removeprefix("=").strip()))
                continue
            rhs = rhs.removeprefix(r"\quad").strip()
            label, prev = found[-1]
            if rhs.startswith(_RESUME):
                prev, rhs = prev.removesuffix(_BREAK).rstrip(), rhs.removeprefix(_RESUME).strip()
            found[-1] = (label, f"{prev} {rhs.removeprefix('{}').strip()}")
    return found


def read(text: str) -> list[tuple[str, sympy.Expr]]:
    """The equations of :func:`align`'s output parsed back: (label, expression) per row, in order, with
    :math:`\\Psi` replaced by the parameter count the block defines (continuation lines re-joined)."""
    from ..symbols import Psi

    exprs = [(label, parse(rhs)) for label, rhs in equations(text)]
    count = next((e for label, e in exprs if label == r"\Psi"), None)
    if count is not None:
        exprs = [(label, e if label == r"\Psi" else e.xreplace({Psi: count})) for label, e in exprs]
    return exprs


def equation(name: str, expr: sympy.Expr, label: str | None = None) -> str:
    """One displayed equation ``name = expr``."""
    tag = f"\\label{{{label}}}" if label else ""
    return "\n".join([r"\begin{equation}" + tag, f"  {name} = {expression(expr)}", r"\end{equation}"])


def split(d: Derivation) -> dict[str, int]:
    """Bytes in the seed's Table 1 columns: saved activations, indices/masks, parameter side, total.

    The parts come from the derivation's own sums, so they add up to its total (inputs and loss, which
    the seed leaves out, and transients, are reported only when present).
    """
    aux = sympy.Add(*(d.sum(role=r) for r in AUX_ROLES))
    out = {
        "activations": d.evaluate(d.activations - aux),
        "aux": d.evaluate(aux),
        "parameter_memory": d.value("parameter_memory"),
    }
    extra = d.input + d.loss + d.transient
    if extra != 0:
        out["other"] = d.evaluate(extra)
    out["total"] = d.value("total")
    return out


def table(rows: Sequence[tuple[str, Derivation]], unit: str = "GiB", digits: int = 3,
          caption: str = "FP32 training memory comparison", label: str | None = "tab:memory") -> str:
    """A booktabs table in the style of the seed's Table 1: one row per (label, derivation).

    Columns: model, convention, saved activations, indices/masks, parameter side (weights, gradients,
    optimizer state), total, and "Other" (inputs, loss, transients) when some row has them.
    """
    from ..units import UNITS

    scale = UNITS[unit]
    splits = [(name, d, split(d)) for name, d in rows]
    other = any("other" in s for _, _, s in splits)
    cols = ["Model", "Convention", "Activations", "Indices/masks", "Param.\\ side"]
    cols += ["Other"] if other else []
    cols += ["Total"]
    body = []
    for name, d, s in splits:
        cells = [escape(name), escape(d.convention)]
        keys = ["activations", "aux", "parameter_memory"] + (["other"] if other else []) + ["total"]
        cells += [f"{s.get(k, 0) / scale:.{digits}f}" for k in keys]
        body.append("  " + " & ".join(cells) + r" \\")
    spec = "ll" + "r" * (len(cols) - 2)
    out = [r"% needs \usepackage{booktabs}", r"\begin{table}[ht]", r"  \centering",
           rf"  \caption{{{escape(caption)} ({unit})}}"]
    if label:
        out.append(rf"  \label{{{label}}}")
    out += [rf"  \begin{{tabular}}{{{spec}}}", r"  \toprule", "  " + " & ".join(cols) + r" \\", r"  \midrule",
            *body, r"  \bottomrule", r"  \end{tabular}", r"\end{table}"]
    return "\n".join(out)
