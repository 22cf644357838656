"""``symmem trace SPEC`` and ``symmem verify --module SPEC``: the forms of SPEC, the output formats, and bad input.

Oracle for the formulas: ``verify --module`` measures one real forward (``symmem.record.verify.measure``) at sizes the
module was not traced at and compares; the tiny GPT-2 is ``hf:gpt2`` with ``--config`` overrides.  Every bad
input is one line ``symmem: error: ...`` and exit status 2.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import symmem  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.importer import sources  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HELPERS = "tests/trace_helpers.py"
TINY_GPT2 = ["--config", "n_layer=2", "--config", "n_embd=64", "--config", "n_head=4", "--config", "vocab_size=128",
             "--config", "n_positions=64"]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    """SPECs name tests/trace_helpers.py relative to the repository root, and tests.trace_helpers as a module."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def tf():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_json():
    """The tiny hf:gpt2 traced once, as JSON, at B=8, S=64 (module-scoped: shared by the tests below)."""
    tf()
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["trace", "hf:gpt2", *TINY_GPT2, "--dims", "B,S", "--set", "B=8", "--set", "S=64",
                     "--format", "json"])
    assert code == 0
    return json.loads(out.getvalue())


@pytest.mark.deep  # stop 42: ~10 CPU-s, most of it the peak's fold (three GPT-2 step records) that nothing here asks
# for; the lines it runs are run by test_lora.py's command line (an hf: model's JSON, its peak against a real step),
# test_loss_means_what_it_means_in_python (a traced module's JSON is symmem.trace's to_dict) and the verify below
# (this model's formula against a real forward at other sizes)
def test_hf_gpt2_json_is_the_derive_contract(gpt2_json):
    d = gpt2_json
    assert d["model"] == "hf:gpt2" and d["convention"] == "traced"
    assert d["symbols"] == {"B": 8, "L": 2, "S": 64}
    # SDPA with the config's dropout 0.1 runs the math kernel on the CPU: the S^2 terms are kept
    assert d["expressions"]["activations"] == "48*B*L*S**2 + 7696*B*L*S + 776*B*S + 8*S"
    assert d["expressions"]["input"] == "8*B*S"
    assert d["values"]["parameters"] == 112384
    assert "S >= 2" in d["domain"] and {"expressions", "values", "breakdown", "latex"} <= set(d)


def test_formula_equals_a_real_forward_at_other_sizes(capsys):
    tf()
    code, out, err = run(capsys, "verify", "--module", "hf:gpt2", *TINY_GPT2, "--dims", "B,S", "--set", "B=3",
                         "--set", "S=13")
    assert code == 0 and out.rstrip().endswith("exact") and err == ""
    assert "activations          679,328         679,328" in out


def test_causal_lm_loss_and_explicit_dims(capsys):
    tf()
    code, out, _ = run(capsys, "verify", "--module", "hf:llama", "--config", "num_hidden_layers=2",
                       "--config", "hidden_size=32", "--config", "intermediate_size=48", "--config",
                       "num_attention_heads=4", "--config", "num_key_value_heads=2", "--config", "vocab_size=50",
                       "--loss", "cross-entropy", "--dims", "B=input_ids:0,B=labels:0,S=input_ids:1,S=labels:1",
                       "--set", "B=3", "--set", "S=5")
    assert code == 0 and out.rstrip().endswith("exact"), out


@pytest.mark.parametrize("spec", ["tests.trace_helpers:mlp_with_inputs", f"{HELPERS}:mlp_with_inputs"])
def test_a_callable_by_module_path_or_file(capsys, spec):
    code, out, _ = run(capsys, "trace", spec, "--dims", "B", "--optimizer", "sgd")
    assert code == 0
    assert " ".join(out.split("symbols:")[0].split()) == \
        f"{spec} — traced from PyTorch (traced convention), FP32 + SGD, symbolic formula; on cpu"
    # the ReLU keeps its (B, 32) output; the first Linear keeps the (B, 16) batch (input)
    assert "activations" in out and "= 128*B" in out and "input" in out and "= 64*B" in out
    assert re.search(r"^parameters +676   = 676$", out, re.M)


def test_loss_means_what_it_means_in_python(capsys):
    """--loss cross-entropy on a module of one's own is symmem.trace(..., loss="cross-entropy"): one meaning of the
    option in every front (symmem.options)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import trace_helpers as th

    code, out, _ = run(capsys, "trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--loss",
                       "cross-entropy", "--format", "json")
    net, x = th.mlp_with_inputs()
    d = symmem.trace(net, x, {"B": [(0, 0)]}, loss="cross-entropy")
    assert code == 0 and json.loads(out)["expressions"] == d.to_dict()["expressions"]
    assert d.peak != symmem.trace(net, x, {"B": [(0, 0)]}).peak  # the cross-entropy's log-softmax, not a sum


def test_a_module_alone_takes_example_inputs(capsys):
    code, out, _ = run(capsys, "trace", "tests.trace_helpers:mlp", "--example", "2x16", "--dims", "B=0:0",
                       "--format", "latex")
    assert code == 0 and "\\begin{align*}" in out


def test_meta_device_for_big_configs(capsys, monkeypatch):
    """Above REAL_WEIGHTS_MAX parameters a model is built on meta: traced without weights and without a check."""
    tf()
    monkeypatch.setattr(sources, "REAL_WEIGHTS_MAX", 10_000)
    code, out, err = run(capsys, "trace", "hf:llama", "--config", "num_hidden_layers=2", "--config",
                         "hidden_size=32", "--config", "intermediate_size=48", "--config", "num_attention_heads=4",
                         "--config", "vocab_size=50", "--dims", "B,S")
    assert code == 0 and "built on the meta device" in err and "no check forward" in err
    assert "symbols: B=2, L=2, S=8" in out


BAD = [
    (["trace", "resnet18", "--dims", "B"], "unknown SPEC 'resnet18'"),
    (["trace", "no_such_package.models:net", "--dims", "B"], "module 'no_such_package.models' does not import"),
    (["trace", "tests/no_such_file.py:net", "--dims", "B"], "no file tests/no_such_file.py"),
    (["trace", "tests.trace_helpers:not_a_module", "--dims", "B"], "returned int, not a torch.nn.Module"),
    (["trace", "tests.trace_helpers:nothing_here", "--dims", "B"], "has no 'nothing_here'"),
    (["trace", "tests.trace_helpers:mlp", "--dims", "B"], "without example inputs"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B=x:0"], "unknown input 'x'"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B=0:2"], "dimension 2 is out of range"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "Hi"], "Hi is a position of images"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "T"], "T has no conventional position"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--multiple-of", "B=x"], "--multiple-of"),
    (["trace", "tests.trace_helpers:data_dependent", "--dims", "B"], "size depends on the data"),
    (["trace", "tests.trace_helpers:broken", "--dims", "B"], "mat1 and mat2 shapes cannot be multiplied"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--checkpoint", "full"],
     "no run of identical children"),
    (["trace", "hf:gpt3", "--dims", "B,S"], "unknown model type 'gpt3'"),
    (["trace", "hf:gpt2", "--config", "n_layers=2", "--dims", "B,S"], "has no key 'n_layers'; did you mean n_layer"),
    (["trace", "hf:gpt2", "--config", "n_layer=two", "--dims", "B,S"], "the gpt2 config refuses"),
    (["trace", "hf:bert", "--config", "num_hidden_layers=1", "--dims", "B,S", "--loss", "cross-entropy"],
     "not as a causal language model"),
    (["trace", "hf:vit", "--config", "num_hidden_layers=1", "--dims", "B,S"], "S is a position of tokens"),
    (["trace", "hf:gpt2", *TINY_GPT2, "--loss", "cross-entropy", "--dims", "B=input_ids:0,S=input_ids:1"],
     "declare it on 'labels' too"),
    (["trace", "hf:gpt2", "--config", "n_layer=100000", "--dims", "B,S"], "--set L=100000 evaluates the formula"),
    (["verify", "--module", "tests.trace_helpers:mlp_with_inputs"], "--module needs --dims"),
    (["verify", "gpt2", "--dims", "B"], "--dims applies to a module traced from a SPEC"),
    (["verify", "--module", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--set", "L=3"], "--set L"),
]


@pytest.mark.parametrize("argv, fragment", BAD, ids=[" ".join(a[:3]) + f"-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    if argv[1].startswith("hf:"):
        tf()
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("symmem: error: ") and err.count("\n") == 1, err
    assert fragment in err


@pytest.mark.parametrize("package", ["torchvision", "timm"])
def test_vision_zoos_that_do_not_import_say_so(capsys, package):
    try:
        __import__(package)
    except Exception:
        pass
    else:
        pytest.skip(f"{package} imports here")
    code, _, err = run(capsys, "trace", f"{package}:resnet18", "--dims", "B")
    assert code == 2 and f"{package} is not importable here" in err and err.count("\n") == 1


def test_specs_never_evaluate_text(capsys, tmp_path):
    """A SPEC is a module path and an attribute name: an expression is refused before anything runs."""
    marker = tmp_path / "ran"
    code, _, err = run(capsys, "trace", f"os:system('touch {marker}')", "--dims", "B")
    assert code == 2 and "unknown SPEC" in err and not marker.exists()
    assert sources.parse_value("__import__('os')") == "__import__('os')"


def test_a_run_of_too_many_ops_is_refused_with_the_way_out(capsys, monkeypatch):
    """Tracing grows with the ops a pass runs: beyond MAX_OPS it stops, naming where and what to do."""
    from symmem.record import saved_tensors as saved

    monkeypatch.setattr(saved, "MAX_OPS", 3)
    code, out, err = run(capsys, "trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B")
    assert code == 2 and err.startswith("symmem: error: the module runs more than 3 ops in one pass")
    assert "--set L=N" in err and err.count("\n") == 1


def test_a_module_is_measured_on_the_device_its_formula_is_for():
    """``--device cuda`` moves the module and its example inputs to the GPU where there is one; without one they
    stay, and measuring a CUDA formula on the CPU's kernels is refused rather than compared.  Oracle: where the
    module's parameters are, and the refusal."""
    import dataclasses

    import symmem

    torch = pytest.importorskip("torch")
    moved = sources.load("tests.trace_helpers:mlp_with_inputs").to("cuda")  # nn.Module.to: in place
    assert {p.device.type for p in moved.module.parameters()} == ({"cuda"} if torch.cuda.is_available() else {"cpu"})
    loaded = sources.load("tests.trace_helpers:mlp_with_inputs")
    assert loaded.to("cpu") is loaded
    dims = sources.parse_dims("B", loaded)
    d = symmem.trace(loaded.module, loaded.example_inputs, dims)
    assert d.options["device"] == "cpu"
    as_cuda = dataclasses.replace(d, options={**d.options, "device": "cuda"})
    with pytest.raises(symmem.SymmemError, match="the formula is for cuda and the module is on cpu"):
        sources.verify_module(loaded, as_cuda, dims)
    assert sources.verify_module(loaded, d, dims).exact


# -- issue 22: numbers that are not numbers, sizes that overflow, user code that exits, modules that keep nothing
OVERSIZED = [
    (["--dims", "B=0:0_"], "--dims 'B=0:0_': expected NAME=INPUT:DIMENSION"),
    (["--dims", "B=0:1__0"], "--dims 'B=0:1__0': expected NAME=INPUT:DIMENSION"),
    (["--dims", "B=0:" + "9" * 5000], "the dimension: 99999999999999999999...(5000 characters) is more than 63"),
    (["--dims", "B", "--multiple-of", "B=32_"], "--multiple-of 'B=32_': expected NAME=POSITIVE_INT pairs"),
    (["--dims", "B", "--multiple-of", "B=" + "9" * 5000], "--multiple-of B: 9999"),
    (["--dims", "B", "--example", "99999999999999999999999x16"],
     "--example 99999999999999999999999x16: a size: 99999999999999999999999 is more than 9,223,372,036,854,775,807"),
    (["--dims", "B", "--example", "2_x16"], "--example 2_x16: expected sizes like 2x3x32x32"),
    (["--dims", "B", "--example", "4611686018427387904x4"], "more than this machine's memory"),
]


@pytest.mark.parametrize("argv, fragment", OVERSIZED, ids=[" ".join(a)[:40] for a, _ in OVERSIZED])
def test_malformed_and_oversized_numbers_are_one_line(capsys, argv, fragment):
    code, out, err = run(capsys, "trace", "tests.trace_helpers:mlp", *(["--example", "2x16"] if "--example" not in
                                                                      argv else []), *argv)
    assert (code, out) == (2, "") and err.startswith("symmem: error: ") and err.count("\n") == 1, err
    assert fragment in err, err


def test_underscores_between_digits_are_numbers(capsys):
    """``1_6`` is 16 where Python reads it so: the same trace as ``16``."""
    a = run(capsys, "trace", "tests.trace_helpers:mlp", "--example", "2x1_6", "--dims", "B=0:0_0", "--no-check")
    b = run(capsys, "trace", "tests.trace_helpers:mlp", "--example", "2x16", "--dims", "B=0:0", "--no-check")
    assert a[0] == 0 and a[1] == b[1]


def test_an_example_the_machine_cannot_allocate(capsys, monkeypatch):
    real = torch.randn

    def refuse(*args, **kwargs):  # the example's tensor (drawn from its own generator) fails, as a huge one does
        if "generator" not in kwargs:
            return real(*args, **kwargs)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 640 GB")

    monkeypatch.setattr(torch, "randn", refuse)
    code, out, err = run(capsys, "trace", "tests.trace_helpers:mlp", "--example", "2x16", "--dims", "B")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("symmem: error: --example 2x16: cannot allocate a tensor of 128 bytes: RuntimeError: "
                          "DefaultCPUAllocator: can't allocate memory"), err


EXITS = [
    ("sys:exit", "sys:exit: calling exit(): the code called sys.exit(None)"),
    ("tests.trace_helpers:exits_when_built", "calling exits_when_built(): the code called sys.exit(None)"),
    ("tests.trace_helpers:exits", "tests.trace_helpers:exits: tracing the module: the code called sys.exit(3)"),
    ("tests.trace_helpers:interrupts", "tests.trace_helpers:interrupts: tracing the module: the code raised "
                                       "KeyboardInterrupt itself (no Ctrl-C was pressed)"),
]


@pytest.mark.parametrize("spec, fragment", EXITS, ids=[s for s, _ in EXITS])
def test_user_code_that_exits_is_one_line(capsys, spec, fragment):
    """Before: ``sys:exit`` exited 0 without a word, a forward's sys.exit(3) exited 3, a KeyboardInterrupt
    printed a traceback."""
    code, out, err = run(capsys, "trace", spec, "--dims", "B")
    assert (code, out) == (2, "") and err.startswith("symmem: error: ") and err.count("\n") == 1, err
    assert fragment in err, err


@pytest.fixture
def ctrl_c_heard():
    """Python's own SIGINT handler for the test: a process started in the background by a non-interactive shell
    inherits SIGINT ignored (POSIX), and symmem rightly leaves an ignored Ctrl-C ignored -- which such a test run
    (`pytest ... &`) would read as a failure."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_real_ctrl_c_still_interrupts(capsys, ctrl_c_heard):
    code, out, err = run(capsys, "trace", "tests.trace_helpers:ctrl_c", "--dims", "B")
    assert (code, out, err) == (130, "", "symmem: interrupted\n")


def test_a_real_ctrl_c_lost_in_a_finalizer_still_interrupts(capsys, monkeypatch, ctrl_c_heard):
    """The handler's KeyboardInterrupt raised inside a weak reference's callback is unraisable: Python drops it
    and the forward returns (before: exit 0, the trace printed as if no Ctrl-C had been pressed)."""
    lost: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type))
    code, out, err = run(capsys, "trace", "tests.trace_helpers:ctrl_c_in_a_finalizer", "--dims", "B")
    assert lost and set(lost) == {KeyboardInterrupt}  # lost where the recorder's finalizers run (each forward)
    assert (code, out, err) == (130, "", "symmem: interrupted\n")


def test_a_module_that_keeps_nothing_prints_its_zeros(capsys):
    """A lone ReLU on an input that needs no gradient: nothing requires grad, so autograd saves nothing and there
    are no parameters (before: the text table crashed on its empty rows, ``max() arg is an empty sequence``)."""
    net, x = torch.nn.ReLU(), torch.randn(2, 3)
    assert not x.requires_grad and not list(net.parameters())
    code, out, err = run(capsys, "trace", "torch.nn:ReLU", "--dims", "B", "--example", "2x3")
    assert code == 0 and "Traceback" not in err
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    for key in ("activations", "parameter_memory", "kept"):  # kept: what is kept after forward + parameters
        assert lines[key].split("=")[-1].strip() == "0", lines[key]
    assert lines["parameters"].split() == ["parameters", "0", "=", "0"]


def test_a_module_without_parameters_has_no_step_peak():
    """Before: 'cannot run on fake tensors: ValueError: optimizer got an empty parameter list'."""
    d = symmem.trace(torch.nn.ReLU(), (torch.randn(2, 3),), {"B": [(0, 0)]})
    assert d.value("total") == 0
    with pytest.raises(symmem.SymmemError, match=r"^the module has no parameter: a training step has nothing to "
                                                 r"update"):
        _ = d.peak


@pytest.mark.parametrize("name, flags, what", [
    ("N", ["--zero", "3"], "the data-parallel size N (ZeRO: --zero 1|2|3)"),
    ("t", ["--tensor-parallel"], "the tensor-parallel size t (tensor parallelism: --tensor-parallel)"),
    ("p", ["--pipeline-parallel"], "the number of pipeline stages p (pipeline parallelism: --pipeline-parallel)"),
])
def test_a_dimension_named_like_a_parallel_size_does_not_merge_with_it(capsys, name, flags, what):
    """``--dims N=0:0 --zero 3`` gave ``parameter_memory = 10816/N`` with N the batch: the user's dimension and the
    regime's size were one symbol.  N, t and p mean the regime's sizes in every formula and option, so the
    dimension is refused with the way out; under no regime that brings the name, N is the batch as declared."""
    code, out, err = run(capsys, "trace", "tests.trace_helpers:mlp_with_inputs", "--dims", f"{name}=0:0", *flags)
    assert code == 2 and out == ""
    assert err == (f"symmem: error: dimension {name!r} of tests.trace_helpers:mlp_with_inputs is named like {what}, "
                   "and the formula would merge the two: give the dimension another name (--dims B=..., "
                   "dims={'B': ...} in Python)\n")
    from tests.trace_helpers import mlp_with_inputs

    net, inputs = mlp_with_inputs()
    with pytest.raises(symmem.SymmemError, match=f"dimension {name!r} of Sequential is named like"):
        symmem.trace(net, inputs, {name: [(0, 0)]}, zero=3 if name == "N" else 0,
                     tensor_parallel=name == "t", pipeline_parallel=name == "p")
    # without the regime the name is the user's: 16 inputs of 4 bytes a sample; 16*32 + 32 + 32*4 + 4 = 676
    # parameters of 16 bytes (FP32 + AdamW), none divided by anything
    d = symmem.trace(net, inputs, {name: [(0, 0)]})
    sym = d.free[0]
    assert sym.name == name and d.input == 64 * sym and d.parameter_memory == 676 * 16


@pytest.mark.parametrize("spec, hint", [
    ("tests.trace_helpers:mlp", "--example 2x16 (float; Linear takes 16 features)"),
    ("tests.trace_helpers:cnn", "--example 2x3x32x32 (float; Conv2d takes 3 channels)"),
    ("tests.trace_helpers:embedder", "--example 2x8:int64 (token ids)"),
])
def test_a_module_without_inputs_gets_an_example_it_runs_on(capsys: pytest.CaptureFixture[str], spec: str,
                                                          hint: str) -> None:
    """The refusal names an input the module's first layer takes (its width read from the module), and pasting
    that hint makes the trace run."""
    code, _, err = run(capsys, "trace", spec, "--dims", "B")
    assert code == 2 and hint in err.splitlines()[-1], err
    code, out, err = run(capsys, "trace", spec, "--dims", "B", "--example", hint.split()[1])
    assert code == 0 and "symbols: B=2" in out, err
