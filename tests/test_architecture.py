"""The package's shape: no import cycles among symmem's modules, counted as the shared check counts them (imports
at module level and inside functions, ``importlib.import_module`` with a literal name, a package's modules
importing their own ``__init__``; not ``if TYPE_CHECKING:``), and one registration per op kind.

Oracle: ``../shared/tools/import_cycles.py`` beside the clone (CI has a read-only copy of ``shared/`` there), run
on this checkout's ``symmem``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import types
from pathlib import Path

import pytest

from symmem import ops
from symmem.errors import SymmemError

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT.parent / "shared" / "tools" / "import_cycles.py"


def _parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, its tree shared by every reader of the same source (none of them changes a tree)."""
    try:
        return _tree(source)
    except SyntaxError:
        return ast.parse(source, filename)  # the error, naming the file


@functools.cache  # the package's every module parsed once a worker: the check's edges and the tests below read it
def _tree(source: str) -> ast.Module:
    return ast.parse(source)


def _one_parse() -> types.ModuleType:
    """``ast`` as the shared check sees it: a copy of the module's names (looked up as fast as the module's own, at
    every node the check walks), its ``parse`` the shared one above (a third of the check's CPU was parsing the
    package, which the function-length tests parse too)."""
    module = types.ModuleType("ast")
    module.__dict__.update(vars(ast))
    module.parse = _parse
    return module


def _tool():
    if not TOOL.is_file():
        pytest.skip(f"the shared import-cycle check is not beside the clone ({TOOL})")
    spec = importlib.util.spec_from_file_location("import_cycles", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ast = _one_parse()
    return module


@functools.cache  # two tests read it: the parse of every module (~1 s) made once a worker
def _edges():
    tool = _tool()
    mods = tool.modules(str(ROOT / "symmem"))
    return mods, tool.edges(mods), tool


@pytest.mark.xdist_group("architecture")  # with the next test, on one worker: _edges made once
def test_no_import_cycles():
    mods, edges, tool = _edges()
    found = tool.cycles(edges)
    assert found == [], found


#: What the core may not reach, at module level or inside a function: the zoo, the views, the applications, the
#: fronts, the CLI and the torch glue (the recorders and the importer sit above the core and read it).
ABOVE_THE_CORE = ("symmem.models", "symmem.report", "symmem.api", "symmem.options", "symmem.cli", "symmem.apps",
                  "symmem.reference", "symmem.record", "symmem.importer", "symmem.__main__")  # __main__: the CLI


#: The one way down from the core to a view: a Derivation shows itself (``table()``, ``to_dict()``, Jupyter's
#: ``_repr_*_``) by importing its printer inside that method, as sympy's ``Printable.__str__`` does.
SHOWN_BY = {"to_dict", "table", "_repr_latex_", "_repr_html_"}


def _function_of(path: Path, line: int) -> str | None:
    for node in ast.walk(_parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= node.end_lineno:
            return node.name
    return None


@pytest.mark.xdist_group("architecture")
def test_the_core_never_imports_the_zoo_the_views_or_the_fronts():
    mods, edges, _ = _edges()
    core = [m for m in mods if m != "symmem" and not m.startswith(ABOVE_THE_CORE)]
    assert {"symmem.engine", "symmem.derivation", "symmem.ledger", "symmem.timeline", "symmem.ops"} <= set(core)
    wrong = sorted((m, t, line) for m in core for t, line in edges[m] if t.startswith(ABOVE_THE_CORE)
                   if not (m == "symmem.derivation" and t.startswith("symmem.report.")
                           and _function_of(Path(mods[m]), line) in SHOWN_BY))
    assert wrong == [], wrong


def test_no_two_modules_share_a_file_name_outside_the_cli():
    """A file name says what the module holds, once: ``fit.py`` is not both the budget solver and a polynomial
    fit (the commands in ``symmem/cli/`` are named for the command, and may repeat what they run)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "symmem").rglob("*.py")):
        rel = path.relative_to(ROOT / "symmem")
        if rel.parts[0] != "cli" and path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(rel))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


def test_every_op_kind_has_its_rules():
    for kind in ops.kinds():
        entry = ops.entry(kind)
        assert callable(entry.shape), kind
        for rule in (entry.saves, entry.grads):
            assert callable(rule) or (isinstance(rule, ops.Unsupported) and rule.reason), kind


def test_an_op_kind_registers_once():
    from symmem.ops.registry import op

    with pytest.raises(SymmemError, match="op kind 'linear' is registered twice"):
        op("linear", saves=ops.Unsupported("no"), grads=ops.Unsupported("no"))(lambda ins, a: None)
    assert ops.entry("linear").shape.__module__ == "symmem.ops.layers"


def test_a_kind_without_a_rule_fails_the_check(monkeypatch):
    from symmem.ops import registry

    monkeypatch.setitem(registry._KINDS, "nothing_said", registry.OpKind("nothing_said", lambda ins, a: None, 1, {},
                                                                         None, ops.Unsupported("no")))
    with pytest.raises(SymmemError, match="op kinds without a save rule .*: nothing_said"):
        registry.check_complete()


@pytest.mark.parametrize("name", ["gpt2", "resnet18", "llama"])
def test_architectures_stay_graphs_networkx_accepts(name):
    """What the card asks for: networkx's own algorithms take the graph as it is, ``to_networkx()`` is a real
    ``nx.DiGraph``, and the nodes carry symbolic shapes (oracle: networkx itself)."""
    import networkx as nx
    import sympy

    import symmem

    graph = symmem.build(name).graph
    order = list(nx.topological_sort(graph))
    real = graph.to_networkx()
    assert type(real) is nx.DiGraph and nx.is_directed_acyclic_graph(graph)
    assert sorted(order) == sorted(real.nodes) and set(graph.edges) == set(real.edges)
    assert all(order.index(u) < order.index(v) for u, v in real.edges)
    assert any(isinstance(d, sympy.Expr) and d.free_symbols for n in order for d in graph.node(n).out.shape)


def _defined(kind: type) -> list[tuple[str, str, int]]:
    """(name, file, lines) of every ``kind`` node (function or class) in the package, nested ones included."""
    return [(name, f, n) for node_kind, name, f, n in _definitions() if issubclass(node_kind, kind)]


@functools.cache  # the two tests below read it: every module parsed and walked once a worker, not once a test
def _definitions() -> tuple[tuple[type, str, str, int], ...]:
    """(node type, name, file, lines) of every function and class in the package, nested ones included."""
    out = []
    for path in sorted((ROOT / "symmem").rglob("*.py")):
        for node in _statements(_parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                out.append((type(node), node.name, str(path.relative_to(ROOT)), node.end_lineno - node.lineno + 1))
    return tuple(out)


#: the fields that hold statements: a ``def`` or ``class`` is a statement, never part of an expression
BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _statements(tree: ast.Module):
    """Every statement of ``tree``, nested ones included (what ``ast.walk`` yields, less the expressions: a
    tenth of the nodes)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for field in BLOCKS:
            todo.extend(reversed(getattr(node, field, ())))


@pytest.mark.xdist_group("architecture")  # with the next test, on one worker: one parse of the package
def test_no_function_is_longer_than_150_lines():
    long = [(f, name, n) for name, f, n in _defined((ast.FunctionDef, ast.AsyncFunctionDef)) if n > 150]
    assert long == []


@pytest.mark.xdist_group("architecture")
def test_one_meaning_per_class_name():
    where: dict[str, list[str]] = {}
    for name, f, _ in _defined(ast.ClassDef):
        where.setdefault(name, []).append(f)
    assert {name: fs for name, fs in where.items() if len(fs) > 1} == {}
