"""Bad input gives a SymmemError that names what was wrong (node, op kind, shapes), and exit code 2 on the CLI."""

from __future__ import annotations

import re

import pytest

from symmem import GraphBuilder, SymmemError, derive
from symmem.cli import main
from symmem.graph import Graph, Node, lint
from symmem.symbols import B, H, S, symbol
from symmem.tensor import TensorSpec


def _graph_error(build) -> str:
    with pytest.raises(SymmemError) as exc:
        build(GraphBuilder("t"))
    return str(exc.value)


@pytest.mark.parametrize("build, fragments", [
    (lambda g: g.op("linearr", g.input("x", (B, H))), ["unknown op kind 'linearr'", "linear"]),
    (lambda g: g.op("matmul", g.input("a", (B, S, H)), g.input("b", (B, 3, H)), name="mm"),
     ["node 'mm' (matmul)", "inner dimensions", "(B, S, H)", "(B, 3, H)"]),
    (lambda g: g.op("add", g.input("a", (B, 4)), g.input("b", (B, 5)), name="sum"),
     ["node 'sum' (add)", "do not broadcast", "(B, 4)", "(B, 5)"]),
    (lambda g: g.op("conv2d", g.input("x", (B, 3, 8)), name="c", out_channels=4, kernel=3),
     ["node 'c' (conv2d)", "rank 4", "(B, 3, 8)"]),
    (lambda g: g.op("conv2d", g.input("x", (B, 3, 8, 8)), name="c", out_channels=4, kernel=3, groups=2),
     ["node 'c' (conv2d)", "not divisible by groups=2"]),
    (lambda g: g.op("maxpool2d", g.input("x", (B, 3, 2, 2)), name="p", kernel=5),
     ["node 'p' (maxpool2d)", "leaves no output"]),
    (lambda g: g.op("reshape", g.input("x", (B, 6)), name="r", shape=(B, 4)),
     ["node 'r' (reshape)", "(B, 6) -> (B, 4)"]),
    (lambda g: g.op("linear", g.input("x", (B, H)), name="fc"), ["node 'fc' (linear)", "out_features"]),
    (lambda g: g.op("relu", "nowhere", name="act"), ["node 'act' (relu)", "'nowhere' does not exist"]),
    (lambda g: g.input("x", (B, "S")), ["not the string 'S'"]),
    (lambda g: g.input("x", (B, 0)), ["not a positive integer"]),
])
def test_graph_errors_name_node_kind_and_shapes(build, fragments):
    message = _graph_error(build)
    for fragment in fragments:
        assert fragment in message


def test_repeat_must_keep_its_shape():
    g = GraphBuilder("t")
    x = g.input("x", (B, H))
    with pytest.raises(SymmemError, match="cannot be stacked"):
        with g.repeat("layer", 3, x) as rep:
            rep.output(g.op("linear", rep.input, out_features=2 * H))


def test_cycle():
    g = Graph()
    g.add_node("a", node=Node("a", "relu", ("b",), {}, TensorSpec((B,))))
    g.add_node("b", node=Node("b", "relu", ("a",), {}, TensorSpec((B,))))
    g.add_edge("a", "b")
    g.add_edge("b", "a")
    with pytest.raises(SymmemError, match="cycle: a -> b -> a"):
        lint(g)


def test_lint_catches_a_shape_edited_after_building():
    g = GraphBuilder("t")
    x = g.input("x", (B, H))
    y = g.op("linear", x, name="fc", out_features=4)
    g.graph.nodes[y]["node"] = g.graph.node(y).with_(out=TensorSpec((B, 5)))
    with pytest.raises(SymmemError, match=r"node 'fc' \(linear\): holds \(B, 5\) but its inputs give \(B, 4\)"):
        lint(g.graph)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"model": "resnet51"}, "unknown model 'resnet51'"),
    ({"model": "vit-b16", "values": {"Q": 3}}, "no symbol 'Q'"),
    ({"model": "vit-b16", "values": {"B": 0}}, "B must be a positive integer"),
    ({"model": "vit-b16", "values": {"B": -4}}, "B must be a positive integer"),
    ({"model": "vit-b16", "values": {"B": 2.5}}, "B must be a positive integer"),
    ({"model": "vit-b16", "values": {"B": "64"}}, "B must be a positive integer"),
    ({"model": "vit-b16", "values": {"S": 100}}, "patch_embed.flatten"),
    ({"model": "vit-b16", "convention": "nope"}, "unknown convention 'nope'"),
    ({"model": "vit-b16", "optimizer": "rmsprop2"}, "unknown optimizer 'rmsprop2'"),
    ({"model": "vit-b16", "attention": "flash3"}, "not one of ['naive', 'sdpa']"),
    ({"model": "resnet50", "per_layer": True}, "several repeated blocks"),
])
def test_derive_errors(kwargs, fragment):
    with pytest.raises(SymmemError) as exc:
        derive(**kwargs)
    assert fragment in str(exc.value)


def test_unknown_symbol_lists_known():
    with pytest.raises(SymmemError, match="known symbols: B, C, F"):
        symbol("Z")


@pytest.mark.parametrize("argv, fragment", [
    (["derive", "nope"], "unknown model 'nope'"),
    (["derive", "vit-b16", "--set", "B=0"], "'0' is not a positive integer"),
    (["derive", "vit-b16", "--set", "B=-3"], "'-3' is not a positive integer"),
    (["derive", "vit-b16", "--set", "B=1.5"], "'1.5' is not a positive integer"),
    (["derive", "vit-b16", "--set", "B=1e3"], "'1e3' is not a positive integer"),
    (["derive", "vit-b16", "--set", "B=__import__('os')"], "is not a positive integer"),
    (["derive", "vit-b16", "--set", "B"], "expected NAME=VALUE"),
    (["derive", "vit-b16", "--set", "Z=3"], "no symbol 'Z'"),
    (["derive", "resnet50", "--attention", "naive"], "has no option --attention"),
    (["derive", "vit-b16", "--optimizer", "foo"], "invalid choice: 'foo'"),
    (["derive"], "the following arguments are required: model"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_cli_errors_exit_2_with_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("symmem: error: ")
    assert fragment in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_verify_without_torch_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # "import torch" now raises ImportError
    assert main(["verify", "resnet18", "--set", "B=2"]) == 2
    err = capsys.readouterr().err
    assert "pip install torch==2.13.0" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, fragments", [
    (["derive", "gpt2", "--set", "h=5"], ["node 'h.attn.query_split'", "h to divide H", "H=768, h=5"]),
    (["derive", "bert-base", "--set", "H=7"], ["layer.attention.query_split", "h to divide H", "H=7, h=12"]),
    (["derive", "vit-b16", "--set", "h=5"], ["blocks.qkv_heads", "h to divide H"]),
    (["derive", "llama", "--set", "G=3"], ["layers.self_attn.k_proj", "G to divide h", "G=3, h=32"]),
    (["derive", "gpt2", "--set", "S=2000"], ["S <= 1024", "S=2000"]),
    (["derive", "gpt2", "--tensor-parallel", "--set", "t=5"], ["t to divide h", "h=12, t=5"]),
    (["derive", "gpt2", "--tensor-parallel", "--sequence-parallel", "--set", "t=3", "--set", "S=1000"],
     ["t to divide S", "S=1000, t=3"]),
    (["derive", "gpt2", "--pipeline-parallel", "--set", "p=13"], ["p <= L", "L=12, p=13"]),
    (["derive", "gpt2", "--checkpoint", "every-13"], ["13 <= L", "L=12"]),
    (["derive", "resnet50", "--tensor-parallel"], ["tensor parallelism", "resnet50 has no such layers"]),
    (["derive", "vgg16", "--set", "Wi=1"], ["node 'features.4' (maxpool2d)", "Wi=1", "too small"]),
    (["derive", "vit-b16", "--set", "Hi=8", "--set", "Wi=8"], ["patch_embed.proj", "Hi=8", "too small"]),
    (["derive", "vit-b16", "--set", "B=1", "--set", "B=2"], ["--set B is given twice"]),
    (["derive", "vit-b16", "--set", "B=1,B=2"], ["--set B is given twice"]),
    (["derive", "vit-b16", "--set", "B=1,000"], ["'000' is not NAME=VALUE", "1_000"]),
    (["derive", "vit-b16", "--set", "B=9223372036854775808"], ["largest size PyTorch allows"]),
    (["derive", "vit-b16", "--set", "B=1" + "0" * 5000], ["largest size PyTorch allows"]),
    (["derive", "mlp", "--free", ",,"], ["--free", "symbol names"]),
    (["fit", "vit-b16", "--budget", "80GiB", "--solve", "S"], ["S follows from Hi, Wi", "patch_embed.flatten"]),
    (["derive", "vit-b16", "--set", "S=577"], ["S follows from Hi, Wi", "set Hi and Wi instead of S",
                                                "patch_embed.flatten"]),
    (["fit", "vit-b16", "--budget", "1" + "0" * 100], ["beyond the largest size"]),
    (["verify", "llama"], ["verify would allocate", "more than the limit", "--max-memory"]),
    # one rank: FSDP2 skips its all-gather buffers, FSDP1 runs NO_SHARD (measured on gloo and an H200: docs/cuda.md)
    (["fit", "gpt2", "--data-parallel", "fsdp", "--set", "N=1", "--budget", "80GiB"],
     ["data_parallel='fsdp' at N = 1", "without an all-gather buffer", "N >= 2"]),
    (["fit", "llama", "--data-parallel", "fsdp1", "--set", "N=1", "--budget", "80GiB"],
     ["data_parallel='fsdp1' at N = 1", "NO_SHARD", "N >= 2"]),
])
def test_values_the_model_refuses(argv, fragments, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("symmem: error: ") and err.count("\n") == 1
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_defaults_of_regime_sizes_fit_the_model():
    """Nobody set t: ViT-B's 12 heads take t = 4, the largest halving of the default 8 that divides them."""
    d = derive("vit-b16", tensor_parallel=True)
    assert {s.name: v for s, v in d.numbers.items()}["t"] == 4
    assert {s.name: v for s, v in derive("gpt2", tensor_parallel=True, values={"h": 16}).numbers.items()}["t"] == 8


def test_verify_refuses_before_allocating():
    pytest.importorskip("torch")
    from symmem.record.verify import check_memory, needed_memory

    d = derive("mlp", convention="pytorch", device="cpu", values={"B": 2})
    need = needed_memory(d)
    assert need == 4 * d.value("parameters") + d.value("activations") + d.value("input")
    assert check_memory(d, need) == need
    with pytest.raises(SymmemError, match="more than the limit"):
        check_memory(d, need - 1)


# -- issue 22 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("build, fragment", [
    (lambda g: None, "the graph has no op (no node at all)"),
    (lambda g: g.input("x", (B, H)), "the graph has no op (only inputs and parameters)"),
    (lambda g: g.parameter("w", (H, H)), "the graph has no op (only inputs and parameters)"),
    (lambda g: (g.input("x", (B, H)), g.parameter("w", (H, H))), "the graph has no op (only inputs and parameters)"),
])
def test_a_graph_without_ops_is_refused(build, fragment):
    """Before: derive's schedule crashed on them (IndexError: list index out of range; KeyError: 'w.value')."""
    from symmem.graph import Model

    g = GraphBuilder("empty")
    build(g)
    with pytest.raises(SymmemError, match=r"model 'empty': " + re.escape(fragment)):
        Model("empty", g.finish(), {B: 2, H: 3}, (B, H))


def test_a_graph_with_one_op_still_derives():
    """The smallest graph that computes: the peak of x -> relu at B=2, H=3 by hand.  The relu's output (24 B)
    and its gradient (24 B) are alive together in the backward, besides the input (24 B) ... the value derive gave
    before the empty graph was refused."""
    from symmem.graph import Model

    g = GraphBuilder("one")
    g.op("relu", g.input("x", (B, H)))
    d = derive(Model("one", g.finish(), {B: 2, H: 3}, (B, H)))
    assert d.value("total") == 24 and d.value("peak") == 56


def _pyerr(call) -> str:
    with pytest.raises(SymmemError) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_plain_exceptions_are_symmem_errors():
    """Issue 22, item 12: each raised TypeError, ValueError or AttributeError before."""
    from symmem.apps.budget import largest
    from symmem.models import build
    from symmem.record.verify import compare
    from symmem.report import latex, text

    d = derive("mlp")
    assert "a \\begin{cases} without its \\end{cases}" in _pyerr(lambda: latex.parse(r"\begin{cases}"))
    assert _pyerr(lambda: text.table(d, width=0)) == "width is a number of columns, a positive integer, not 0"
    g = GraphBuilder("t")
    x = g.input("x", (B, H))
    assert _pyerr(lambda: g.op((3, 3), x)) == "an op's kind is its name, a string such as 'linear', not (3, 3)"
    assert _pyerr(lambda: build("mlp", widths=5)) == \
        "model 'mlp': option widths must be a string like '784,1024,1024,10', not 5"
    assert _pyerr(lambda: build("vit-b16", patch="16")) == \
        "model 'vit-b16': option patch must be an integer like 16, not '16'"
    assert _pyerr(lambda: TensorSpec(5)) == "a shape is a tuple of sizes (ints or sympy expressions), not 5"
    assert _pyerr(lambda: d.values(B=[[1, 2], [3]])) == \
        "B: values must be an array of integers (a number, a list, or lists of equal lengths), not [[1, 2], [3]]"
    assert "compare takes a Derivation" in _pyerr(lambda: compare(None, None))
    assert _pyerr(lambda: largest(d, "B", "1GiB", accepts=5)).startswith("accepts must be a function of the value")
    assert build("mlp", widths="16,4").name == "mlp"  # the right types still build


def test_values_that_do_not_broadcast():
    d = derive("vit-b16")
    assert _pyerr(lambda: d.values("activations", B=[1, 2], S=[1, 2, 3])) == \
        "the values do not broadcast together: B has shape (2,), S has shape (3,)"


# -- output streams (issue 22, item 9): the console script, in a process of its own -------------------------
def _cli(shell: str, **env: str) -> tuple[int, bytes, bytes]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = shell.replace("SYMMEM", f"{sys.executable} -m symmem.cli")
    done = subprocess.run(["sh", "-c", cmd], capture_output=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root), **env})
    return done.returncode, done.stdout, done.stderr


def _forked(argv: list[str], stdout: str | int | None) -> tuple[int, bytes]:
    """The console script (:func:`symmem.cli.entry`, which ends the process with ``os._exit``) in a child forked
    from this process, its standard output ``stdout`` (a path, a descriptor, or None: closed) and its standard
    error a pipe: the exit status and what it wrote there.

    The streams are the ones the interpreter makes at its start for such descriptors (standard output a
    ``TextIOWrapper`` over descriptor 1, or None where it is closed; standard error UTF-8, backslashreplace, line
    buffered), so what is checked is what entry does with them, without a fresh interpreter's start and imports
    (sympy and symmem: ~1 CPU-s a command).  ``_cli`` keeps the real process for the closed output and the ASCII
    terminal."""
    import os
    import sys

    from symmem.cli import entry

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.dup2(write, 2)
            os.close(write)
            if stdout is None:
                os.close(1)
                sys.stdout = None
            else:
                fd = os.open(stdout, os.O_WRONLY) if isinstance(stdout, str) else stdout
                os.dup2(fd, 1)
                if isinstance(stdout, str):
                    os.close(fd)
                sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115 -- the process's own
            sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                              closefd=False)
            sys.argv = ["symmem", *argv]
            entry()
        except BaseException:  # said where the test reads it (the failure's message)
            import traceback

            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(99)
    os.close(write)
    with os.fdopen(read, "rb") as err:
        said = err.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), said


def test_an_ascii_terminal_gets_the_output_with_its_dashes_replaced(capsys):
    """``PYTHONIOENCODING=ascii``: before, a UnicodeEncodeError on the title's em dash."""
    assert main(["derive", "mlp"]) == 0
    utf8 = capsys.readouterr().out
    assert "\u2014" in utf8
    code, out, err = _cli("SYMMEM derive mlp", PYTHONIOENCODING="ascii")
    assert (code, err) == (0, b"")
    assert out.decode("ascii") == utf8.encode("ascii", "replace").decode("ascii")


def test_a_closed_or_full_output_is_one_line_and_exit_2():
    """``>&-`` (before: an AttributeError at exit, the output silently dropped) and ``/dev/full`` (before: an
    OSError traceback)."""
    import os

    code, out, err = _cli("SYMMEM derive mlp >&-")
    assert (code, out, err) == (2, b"", b"symmem: error: cannot write the output: standard output is closed\n")
    if os.path.exists("/dev/full"):
        code, err = _forked(["derive", "mlp"], "/dev/full")
        assert (code, err) == (2, b"symmem: error: cannot write the output: No space left on device\n"), err.decode()
        code, out, err = _cli("SYMMEM --version >/dev/full")  # argparse's own print dropped the failure
        assert (code, err) == (2, b"symmem: error: cannot write the output: No space left on device\n"), err.decode()
    code, out, err = _cli("SYMMEM --help >&-")
    assert (code, out, err) == (2, b"", b"symmem: error: cannot write the output: standard output is closed\n")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``| head -c1`` as Unix tools do: no traceback, no message, exit 0."""
    import os

    # the smallest model: the reader is gone before the command's first write, whatever it would have written
    read, write = os.pipe()
    os.close(read)  # the reader goes away before anything is written: the write meets a broken pipe
    try:
        assert _forked(["derive", "mlp"], write) == (0, b"")
    finally:
        os.close(write)


# -- issue 22, item 6: plot's sweep, the B = 1 domain, --config numbers --------------------------------------
def test_plot_refuses_the_sizes_derive_refuses(capsys, tmp_path):
    """``plot batch`` swept B up to 2**63 - 1, which derive refuses (a tensor of more elements than PyTorch
    allows): the sweep refuses it with derive's own reason."""
    out = str(tmp_path / "b.png")
    assert main(["derive", "gpt2", "--set", "B=9223372036854775800"]) == 2
    reason = capsys.readouterr().err.removeprefix("symmem: error: ")
    # the sweep 9223372036854775000, ...100, ..., ...800: its largest is refused first, as derive refuses it
    assert main(["plot", "batch", "gpt2", "--range", "9223372036854775000:9223372036854775807:100", "-o", out]) == 2
    err = capsys.readouterr().err
    assert err == f"symmem: error: the sweep's B = 9,223,372,036,854,775,800 is a size derive refuses: {reason}"
    assert err.count("\n") == 1
    from symmem.report.plots import _swept

    with pytest.raises(SymmemError, match=r"the sweep's B = 9,223,372,036,854,775,808 is a size derive refuses"):
        _swept("B", [1, 2**63], 0, 8, None)
    # the default sweep (a budget no B reaches) keeps to the values derive accepts
    from symmem.api import acceptor

    accepts = acceptor("gpt2")
    swept = _swept("B", None, 2**62, 8, lambda v: accepts("B", v))
    assert swept and all(accepts("B", v) is None for v in swept) and accepts("B", 2 * max(swept)) is not None


def test_where_pytorchs_formulas_hold_at_b_1(capsys):
    """At B = 1 a batched matmul folds a head view of a fused QKV projection into its batch without the copy the
    formulas count and keeps the projection's whole output (docs/pytorch-sequence.md, Known gaps): real PyTorch
    differs there, so derive says where the formulas hold (B >= 2) and notes it when B = 1.  Where the base is the
    copy's size (BERT, SDPA), nothing changes and no domain is added."""
    torch = pytest.importorskip("torch")  # noqa: F841
    # eager attention, one layer at a width of 64 (4 heads, a vocabulary of 128): the copy at B = 1 (the fused QKV
    # projection's whole output kept, the head view folded) is a matter of the batch's size alone, not of the
    # widths -- GPT-2's own sizes made the same verdicts at ~30x the CPU
    small = ["--set", "L=1", "--set", "S=8", "--set", "H=64", "--set", "h=4", "--set", "F=256", "--set", "V=128",
             "--device", "cpu", "--attention", "naive"]
    assert main(["verify", "gpt2", "--set", "B=1", *small]) == 1  # real PyTorch: not exact at B = 1
    assert main(["verify", "gpt2", "--set", "B=2", *small]) == 0
    assert main(["verify", "bert-base", "--set", "B=1", *small]) == 0
    capsys.readouterr()
    one = derive("gpt2", values={"B": 1}, attention="naive")
    # the domain: B >= 2 (this gap) and S <= 1024, GPT-2's position table (tests/test_position_tables.py)
    assert str(one.domain) == "(B >= 2) & (S <= 1024)" and one.notes == (
        "at these sizes the formulas count a copy PyTorch does not make (at B = 1 a batched matmul folds a head "
        "view into its batch and keeps the view's base): they hold where B >= 2 (docs/pytorch-sequence.md, "
        "Known gaps)",)
    assert derive("gpt2", attention="naive").notes == ()
    assert str(derive("gpt2", attention="naive").domain) == "(B >= 2) & (S <= 1024)"
    for model, options in (("bert-base", {}), ("gpt2", {"attention": "sdpa"}), ("llama", {"attention": "naive"})):
        d = derive(model, values={"B": 1}, **options)
        assert d.notes == (), model
    # no B >= 2 where the base is the copy's size: the position table's bound alone
    assert str(derive("bert-base").domain) == "S <= 512" and str(derive("gpt2", attention="sdpa").domain) == "S <= 1024"
    # Llama's eager attention: a copy of the repeated key/value heads only where G = 1 (< h)
    assert derive("llama", attention="naive", values={"B": 1, "G": 1, "h": 32}).notes != ()
    assert main(["derive", "gpt2", "--attention", "naive", "--set", "B=1"]) == 0
    assert "holds where: (B >= 2) & (S <= 1024)" in capsys.readouterr().out
    assert str(derive("gpt2").domain) == "S <= 1024"  # the default is transformers' own: SDPA (no B >= 2)


@pytest.mark.parametrize("value, fragment", [
    ("1e400", "1e400 is beyond the range of a float (it would be inf); give a finite number"),
    ("-1e400", "-1e400 is beyond the range of a float (it would be -inf); give a finite number"),
    ("1e-400", "1e-400 is below the smallest float (it would be 0.0); give a larger number or 0"),
    ("9" * 5000, "an integer of 5,000 characters is more than a config holds; give a smaller number"),
])
def test_config_numbers_python_cannot_hold_are_refused(capsys, value, fragment):
    assert main(["trace", "hf:gpt2", "--config", f"x={value}", "--dims", "B,S"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("symmem: error: --config x=") and err.endswith(f": {fragment}\n") and err.count("\n") == 1
