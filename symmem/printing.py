"""``str()`` of a formula, the same text, without sympy's float evaluation of every rational coefficient.

sympy's ``str()`` orders each sum's terms (``Expr.as_ordered_terms``, and ``Expr.sort_key`` for the sums inside
a factor), and to do so turns every term's numeric coefficient into a Python complex through
``Expr.__complex__``: an ``evalf`` to a 53-bit ``Float``, then its real and imaginary parts.  A peak's ``Max`` over
a hundred moments has thousands of terms, and those evaluations were about half of printing it (``symmem derive
llama --format json`` prints the steady and first step's peaks: printing them was ~40% of the command).

:func:`text` prints with ``complex()`` of a ``Rational`` (integers included) given as ``p / q``, Python's true
division of two integers, which is correctly rounded to the nearest double, ties to even -- as mpmath's
``from_rational`` / ``from_int`` at 53 bits with ``round_nearest`` is, which ``evalf`` calls: the same float, so
the same order and the same text (compared with ``str()`` on every formula of 40 derivations, both peaks included,
at stop 42; ``tests/test_printing.py`` keeps three models' formulas).  The shortcut is a class attribute of
sympy's ``Rational`` for the length of the print only (sympy defines ``__complex__`` on ``Expr`` alone), set and
removed under a lock; a thread printing meanwhile gets the same numbers.

>>> import sympy
>>> x, y = sympy.symbols("x y", positive=True)
>>> e = sympy.Max(3 * x / 7 + 2 * y + 5, x ** 2 - y / 3 + sympy.Rational(1, 3))
>>> text(e) == str(e), text(e)
(True, 'Max(3*x/7 + 2*y + 5, x**2 - y/3 + 1/3)')
>>> "__complex__" in sympy.Rational.__dict__, complex(sympy.Rational(1, 3)) == 1 / 3
(False, True)
"""

from __future__ import annotations

import threading

import sympy
from sympy.core.expr import Expr
from sympy.core.numbers import Rational

_LOCK = threading.RLock()


def text(e: sympy.Basic) -> str:
    """``str(e)``, the same text (see the module's note)."""
    with _LOCK:
        if "__complex__" in Rational.__dict__:  # a print inside a print
            return str(e)
        Rational.__complex__ = _complex  # type: ignore[method-assign]
        try:
            return str(e)
        finally:
            del Rational.__complex__


def _complex(self: Rational) -> complex:
    """``complex()`` of a rational: its correctly rounded quotient (sympy's ``evalf`` where beyond a double)."""
    try:
        return complex(self.p / self.q)
    except OverflowError:
        return Expr.__complex__(self)
