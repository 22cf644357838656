"""No code from text, anywhere: nothing a user types or passes as data is evaluated as Python.

sympy's ``sympify`` of a string runs ``eval``; every ``sympify`` in the package is ``strict=True`` (which refuses
strings), and no module calls ``eval``, ``exec`` or ``parse_expr``.  The LaTeX reader
(:func:`symmem.report.latex.parse`) uses sympy's lark grammar, which builds expressions from a parse tree.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest
import sympy

import symmem
from symmem import GraphBuilder, SymmemError, derive
from symmem.graph import Model
from symmem.symbols import B, H

PACKAGE = pathlib.Path(symmem.__file__).parent


class _Calls(ast.NodeVisitor):
    """Every call in a module, with the name of the function it is made in."""

    def __init__(self) -> None:
        self.stack = ["<module>"]
        self.found: list[tuple[str | None, str, ast.Call]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        self.found.append((called, self.stack[-1], node))
        self.generic_visit(node)


#: the names whose calls the tests below look for
NAMES = ("sympify", "eval", "exec", "parse_expr", "S")
#: a call of one of them in the text: the name as a whole word, then only what may stand between a called
#: expression's last token and its ``(`` -- closing parentheses, white space, line continuations, comments
CALLED = re.compile(rf"\b(?:{'|'.join(NAMES)})(?:[\s)\\]|#[^\n]*)*\(")


@functools.cache
def _all_calls() -> list[tuple[str | None, str, str, ast.Call]]:
    """Every call in the package's modules that can call one of :data:`NAMES`.  A module whose text has no
    :data:`CALLED` match cannot (a call's name is an identifier of its source), so only the others are parsed --
    parsing the whole package was ~2.5 CPU-s, paid by each worker that runs one of these tests."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if not CALLED.search(text):
            continue
        v = _Calls()
        v.visit(ast.parse(text, str(path)))
        out += [(called, str(path.relative_to(PACKAGE.parent)), fn, node) for called, fn, node in v.found]
    return out


def _calls(name: str):
    """(path, enclosing function, call node) of every call of ``name`` in the package."""
    assert name in NAMES
    return [(path, fn, node) for called, path, fn, node in _all_calls() if called == name]


#: sympify of torch's own symbolic-shape objects (ShapeEnv expressions, guard replacements, value ranges), never of
#: text: the importer converts what ``torch.fx`` traced.  Anything a user passes goes through strict conversion.
TORCH_OBJECTS = {
    ("symmem/importer/guards.py", "to_declared"), ("symmem/importer/guards.py", "pinned"),
    ("symmem/importer/guards.py", "unified"), ("symmem/importer/guards.py", "_finite"),
    ("symmem/importer/polyfit.py", "fit_trace"), ("symmem/importer/structure.py", "size"),
    ("symmem/importer/trace.py", "_totals"), ("symmem/importer/trace.py", "_differences"),
    ("symmem/importer/trace.py", "_holds"), ("symmem/importer/trace.py", "_symbolic"),
}


def test_every_sympify_is_strict():
    loose = [f"{p}:{fn}:{n.lineno}" for p, fn, n in _calls("sympify")
             if not any(k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in n.keywords)]
    unexplained = [x for x in loose if tuple(x.split(":")[:2]) not in TORCH_OBJECTS]
    assert not unexplained, unexplained
    assert TORCH_OBJECTS <= {tuple(x.split(":")[:2]) for x in loose}, "an allowance whose sympify is gone"


#: exec of code symmem generates itself: the evaluator writes an expression tree out as Python over integers, with
#: the symbols renamed a0, a1 ... (never their names) and only integer literals (test_generated_code_is_safe).
GENERATED = {("symmem/evaluator.py", "_compile")}


@pytest.mark.parametrize("name", ["eval", "exec", "parse_expr", "S"])
def test_no_evaluation_of_text(name):
    found = [f"{p}:{fn}:{n.lineno}" for p, fn, n in _calls(name) if (p, fn) not in GENERATED]
    assert not found, found


def test_generated_code_is_safe(tmp_path):
    """A symbol named like code goes into the evaluator's generated Python as a0, never by its name."""
    from symmem.evaluator import evaluator

    flag, code = _marker(tmp_path)
    x = sympy.Symbol(code, positive=True, integer=True)
    f = evaluator(3 * x**2 + x / 2 + sympy.Piecewise((x, sympy.Eq(x, 1)), (2 * x, True)))
    assert [f(**{code: v}) for v in (1, 2, 3, 4)] == [5, 17, 35, 58]  # the second call onwards is compiled
    assert code not in f.source if hasattr(f, "source") else True
    assert not flag.exists()
    with pytest.raises(SymmemError):
        evaluator(code)
    assert not flag.exists()


def _marker(tmp_path):
    flag = tmp_path / "ran"
    return flag, f"__import__('pathlib').Path({str(flag)!r}).touch()"


def test_strings_are_refused_not_run(tmp_path):
    flag, code = _marker(tmp_path)
    d = derive("mlp")
    attempts = [
        lambda: derive("mlp", values={"B": code}),
        lambda: d.values(code),
        lambda: d.evaluate(code),
        lambda: d.at(B=code),
        lambda: Model("m", GraphBuilder("m").finish(), {B: code}, (B,)),
        lambda: GraphBuilder("m").input("x", (B, code)),
        lambda: GraphBuilder("m").repeat("r", code, "x").__enter__(),
    ]
    g = GraphBuilder("m")
    x = g.input("x", (B, H))
    attempts += [lambda: g.op("linear", x, out_features=code), lambda: g.op("scale", x, factor=code),
                 lambda: g.graph.assume(x, code)]
    for attempt in attempts:
        with pytest.raises(SymmemError):
            attempt()
    assert not flag.exists()


@pytest.mark.parametrize("text", [
    r"\text{{{code}}}", r"\operatorname{{{code}}}(B)", r"{code}", r"\mathrm{{{code}}} + B",
    r"\begin{{cases}} {code} & \text{{otherwise}} \end{{cases}}", r"B \cdot \left({code}\right)",
])
def test_latex_parse_never_runs_code(tmp_path, text):
    from symmem.report.latex import parse

    flag, code = _marker(tmp_path)
    try:
        result = parse(text.format(code=code))
    except Exception:  # noqa: BLE001  (a parse error of any kind is fine; running the text is not)
        result = None
    assert result is None or isinstance(result, sympy.Basic)
    assert not flag.exists()
