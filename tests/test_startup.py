"""What the command line and the zoo import, and the pieces that keep start-up light (no timings here: those are
in benchmarks/bench_startup.py).

Oracles: ``sys.modules`` of a fresh interpreter; networkx's own topological sort; the builder modules' own tables.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from symmem.conventions import _REGISTRY, _builtin_modules, _load_builtin, names
from symmem.models import available, build
from tests.kept_cases import kept

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    script = f"import sys, io, contextlib, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


RUN = "from symmem.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n    main({argv!r})"


def test_help_and_version_import_neither_sympy_nor_the_zoo():
    """``--help`` then ``--version`` in one fresh interpreter: modules only accumulate, so what neither imported
    after both, neither imported alone (one interpreter's start, ~0.1-0.2 CPU-s, fewer than one for each)."""
    code = "from symmem.cli import main\n" + "".join(
        f"try:\n    with contextlib.redirect_stdout(io.StringIO()):\n        main({argv!r})\n"
        "except SystemExit:\n    pass\n" for argv in (["--help"], ["--version"]))
    loaded = _modules_after(code)
    assert "symmem.cli" in loaded
    assert "sympy" not in loaded and "symmem.models" not in loaded and "symmem.graph" not in loaded


#: one fresh interpreter for the three tests below, in this order: ``symmem derive vit-b16`` through ``main`` (its
#: ``sys.modules``), ``main(['models'])`` (the collector's threshold before and after, the library route), every zoo
#: model built (``sys.modules`` again: only more modules than a fresh interpreter's, so its absences hold there
#: too), then the script's ``entry`` (its threshold).  Three interpreters were ~1.5 CPU-s each, mostly the imports.
ONE_INTERPRETER = (
    "import gc, sys, io, contextlib, json\nbefore = gc.get_threshold()\n"
    "from symmem.cli import main, entry\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n    main(['derive', 'vit-b16'])\n"
    "after_derive = sorted(sys.modules)\n"
    "import symmem.engine\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n    main(['models'])\n"
    "after_main = gc.get_threshold()\n"
    "from symmem.models import available, build\nfor name in available():\n    build(name)\n"
    "after_building = sorted(sys.modules)\n"
    "sys.argv = ['symmem', '--version']\nimport symmem.cli as c\n"
    "c.main = lambda: print(json.dumps([after_derive, after_building, before, after_main, gc.get_threshold()])) or 0\n"
    "entry()")


@pytest.fixture(scope="module")
def one_interpreter() -> tuple[set[str], set[str], list[int], list[int], list[int]]:
    out = subprocess.run([sys.executable, "-c", ONE_INTERPRETER], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    after_derive, after_building, *thresholds = json.loads(out.stdout)
    return set(after_derive), set(after_building), *thresholds


def test_derive_imports_one_builder_and_nothing_heavy(one_interpreter):
    loaded = one_interpreter[0]
    builders = {m for m in loaded if m.startswith("symmem.models.")}
    assert builders == {"symmem.models.vit", "symmem.models.transformer"}
    for heavy in ("networkx", "matplotlib", "torch", "numpy", "sympy.physics", "symmem.report.jupyter",
                  "symmem.conventions.paper", "symmem.conventions.cs231n", "symmem.record"):
        assert heavy not in loaded, heavy


def test_only_the_script_changes_the_garbage_collector(one_interpreter):
    """The ``symmem`` script raises the collector's young threshold; importing symmem and calling ``main`` (the
    library route, a notebook) leave the interpreter's own setting alone.  Oracle: ``gc.get_threshold()``."""
    before, after_main, in_script = one_interpreter[2:]
    assert before == after_main
    assert in_script[0] == 200_000 and in_script[0] > before[0]


def test_building_every_model_needs_no_sympy_simplify(one_interpreter):
    loaded = one_interpreter[1]
    assert "sympy.physics" not in loaded and "networkx" not in loaded


def test_zoo_table_matches_the_builders():
    from symmem.models import bert, megatron_gpt, resnet, vgg, vit

    names = set(available())
    assert {f"resnet{d}" for d in resnet._LAYOUTS} | {"resnet50-v1"} <= names
    assert {f"vgg{d}{bn}" for d in vgg.CONFIGS for bn in ("", "_bn")} <= names
    assert {f"vit-{s}16" for s in vit._SIZES} <= names and {f"bert-{s}" for s in bert._SIZES} <= names
    assert available()["gpt-megatron"].options["size"].choices == tuple(megatron_gpt.SIZES)
    for name, entry in available().items():
        # every option a builder takes, with the default the builder itself has
        import inspect

        params = inspect.signature(entry.builder).parameters
        for key, option in entry.options.items():
            assert params[key].default == option.default, (name, key)
        assert set(entry.fixed) <= set(params), name


def test_convention_names_without_importing_them():
    assert names() == tuple(_builtin_modules())
    _load_builtin()
    assert set(_builtin_modules()) <= set(_REGISTRY)  # each module registers its own name


#: the models whose graphs run every line of symmem and of this file that the whole zoo's run (line coverage, stop 42:
#: docs/testing.md, "Stop 42: thinviews42"); the other builds -m deep
ORDER_KEPT = {"bert-large", "counts", "gpt-megatron", "gpt2", "llama", "mlp", "resnet101", "resnet18", "vgg13_bn",
              "vit-s16"}


@pytest.mark.parametrize("name", kept(sorted(available()), sorted(available()), ORDER_KEPT))
def test_topological_order_is_networkx_order(name):
    import networkx as nx

    graph = build(name).graph
    assert graph.order() == tuple(nx.topological_sort(graph.to_networkx()))
    assert graph.number_of_edges() == graph.to_networkx().number_of_edges()


def _same_by_sympy(a, b):
    """symmem.shapes.same as it was: sympy's assumptions decide every difference with a function in it."""
    import sympy

    if a == b:
        return True
    d = sympy.expand(a - b)
    if d == 0:
        return True
    if d.is_number:
        return False
    if d.is_positive or d.is_negative or not d.atoms(sympy.Function):
        return False
    return None


def test_same_sizes_as_sympy_decides():
    import itertools

    import sympy

    from symmem.shapes import same
    from symmem.symbols import B, H, Hi, S, Wi, h

    f, g = sympy.floor(Hi / 16), sympy.floor(Wi / 16)
    sizes = [S, S - 1, S + 1, f * g, f * g + 1, B * H * (S - 1), B * H * f * g, f, f + 1, sympy.ceiling(Hi / 3),
             sympy.floor(Hi / 3) + 1, sympy.Min(S, 1024), S + sympy.floor(Hi / 2), S + sympy.floor(Hi / 2) + 1,
             H / h, 64 * f, sympy.floor(Hi / 2 - sympy.Rational(1, 2)) + 1, sympy.Max(S, H), 7]
    for a, b in itertools.product(sizes, repeat=2):
        assert same(a, b) is _same_by_sympy(a, b), (a, b)
