"""The measurement harness, and the ``pytorch`` convention against real PyTorch for the vision zoo.

Oracle: what eager PyTorch (CPU) really packs for backward, measured by :func:`symmem.record.verify.measure` on the
project's reference modules.  The formula of the ``pytorch`` convention with ``device=cpu`` must give the
same bytes exactly, at two batch sizes (B >= 2) and small images.
"""

from __future__ import annotations

import json

import pytest
import sympy

torch = pytest.importorskip("torch")

from symmem import derive  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.record.verify import compare, measure, verify  # noqa: E402
from symmem.reference import reference  # noqa: E402

SMALL = {"Hi": 32, "Wi": 32}

# model, builder options, symbol values besides B, batch sizes
ZOO = [
    ("resnet18", {}, SMALL, (2, 3)),
    ("resnet50", {}, SMALL, (2, 3)),
    ("resnet50-v1", {}, SMALL, (2, 3)),
    ("vgg11", {}, SMALL, (2, 3)),
    ("vgg11_bn", {}, SMALL, (2, 3)),
    ("vgg11", {"dropout": 0.0}, SMALL, (2, 4)),
    ("mlp", {"widths": "784,256,128,10", "dropout": 0.25}, {}, (2, 5)),
    ("mlp", {"widths": "symbolic"}, {"H": 64, "L": 3, "K": 7}, (2, 3)),
]


@pytest.fixture(scope="module")
def zoo():
    """model id -> [(B, derivation, comparison)] measured once for the module.

    One reference module a row, measured at each of its batch sizes (a fresh random batch of that size): what
    autograd saves depends on the input's shape, not on the weights' values, and :func:`measure` runs one forward
    that leaves nothing saved behind.  Building the module is most of :func:`verify`'s cost (VGG's 120 M
    weights: ~0.55 CPU-s a build); :func:`verify` itself is held to a real forward below
    (test_loss_is_its_own_group_and_measured, the command line's)."""
    out = {}
    for name, opts, values, batches in ZOO:
        rows, module = [], None
        for b in batches:
            d = derive(name, convention="pytorch", options={"device": "cpu"}, values={**values, "B": b}, **opts)
            if module is None:  # the reference at the first batch size, as verify builds it
                module, (x,) = reference(d.model, {s.name: v for s, v in d.numbers.items()},
                                         {**d.options, "checkpoint": d.regime.checkpoint})
            else:
                x = torch.randn(b, *x.shape[1:], generator=torch.Generator().manual_seed(b))
            rows.append((b, d, compare(d, measure(module, x))))
        out[(name, tuple(sorted(opts.items())))] = rows
        out[("module", name, tuple(sorted(opts.items())))] = module  # its parameters: counted below
    return out


@pytest.mark.parametrize("name, opts, values, batches", ZOO, ids=[f"{z[0]}-{i}" for i, z in enumerate(ZOO)])
def test_zoo_formula_equals_measured_bytes(zoo, name, opts, values, batches):
    for b, d, c in zoo[(name, tuple(sorted(opts.items())))]:
        assert c.exact, f"B={b}\n{c.report()}"
        assert c.measured > 0 and c.differences() == []
        # the symbolic formula, evaluated at B, is the measured number (not only the per-size counts)
        assert d.evaluate(d.activations) == c.measured


@pytest.mark.parametrize("name, values", [("resnet50", SMALL), ("vgg11_bn", SMALL)])
def test_affine_in_batch(zoo, name, values):
    # Measured bytes at two batch sizes fit the formula's slope in B and its B-free part (BN statistics).
    (b1, d, c1), (b2, _, c2) = zoo[(name, ())]
    slope = (c2.measured - c1.measured) // (b2 - b1)
    expr = sympy.expand(d.activations)
    B = next(s for s in d.free if s.name == "B")
    assert expr.free_symbols == {B}
    assert expr.coeff(B, 1) == slope
    assert expr.subs(B, 0) == c1.measured - slope * b1 > 0


def test_loss_is_its_own_group_and_measured():
    d = derive("resnet18", convention="pytorch", options={"device": "cpu"}, values={**SMALL, "B": 3},
               loss="cross-entropy")
    c = verify(d)
    assert c.exact, c.report()
    assert d.value("loss") == 3 * 1000 * 4 + 4  # float32 log-probs (B, K) + the 0-dim total_weight
    assert set(d.groups()) >= {"loss"} and d.to_dict()["values"]["loss"] == d.value("loss")
    assert d.value("input") == 3 * 3 * 32 * 32 * 4 + 3 * 8  # the image and the int64 target


def test_parameter_count_matches_reference_module(zoo):
    """The reference modules the zoo rows measured (K = 1000 as the default derivation's; the image sides change no
    parameter): built once for both tests."""
    for name in ("resnet18", "resnet50"):
        d = derive(name, convention="pytorch")
        net = zoo[("module", name, ())]
        assert d.value("parameters") == sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("name, count", [
    ("resnet18", 11_689_512), ("resnet50", 25_557_032), ("resnet50-v1", 25_557_032), ("vgg16", 138_357_544),
    ("vgg11", 132_863_336), ("vgg16_bn", 138_365_992), ("resnet101", 44_549_160), ("resnet152", 60_192_808),
    ("resnet34", 21_797_672),
])
def test_parameter_counts(name, count):
    # torchvision's published parameter counts
    assert derive(name, convention="pytorch").value("parameters") == count


# -- the harness itself ---------------------------------------------------------------------------------

def test_measure_counts_storages_once_and_sets_params_and_inputs_apart():
    x = torch.randn(4, 6)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    m = measure(net, x)
    # fc1 keeps the batch (input), ReLU its output, fc2 the same storage again: one 4x5 float32 storage
    assert m.activations == 4 * 5 * 4
    assert m.input == 4 * 6 * 4
    assert {s.kind for s in m.saved} == {"input", "activation", "parameter"}
    assert len([s for s in m.saved if s.kind == "activation"]) == 2  # two saves, one storage


def test_saved_view_keeps_its_whole_base():
    class Net(torch.nn.Module):
        def forward(self, x):
            y = x * 2  # a new (4, 8) storage
            return torch.sigmoid(y[:, :2])  # sigmoid keeps its output: a new (4, 2) storage

    class Net2(torch.nn.Module):
        def forward(self, x):
            y = (x * 2)[:, :2]  # a view of a (4, 8) storage
            return y * y  # mul keeps both operands: the view, i.e. the whole base

    x = torch.randn(4, 8, requires_grad=True)
    assert measure(Net(), x).activations == 4 * 2 * 4
    assert measure(Net2(), x).activations == 4 * 8 * 4


def test_saved_info_names_op_and_module():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True))
    m = measure(net, torch.randn(2, 3, 8, 8))
    labels = {(s.module, s.op) for s in m.saved}
    assert ("0", "conv2d") in labels and ("1", "batch_norm") in labels and ("2", "relu") in labels
    assert m.by_op()["batch_norm"] == 2 * 4 * 6 * 6 * 4 + 2 * 4 * 4  # conv output + save_mean/save_invstd


def test_compare_shows_the_storages_that_differ():
    d = derive("resnet18", convention="paper", values={**SMALL, "B": 2})
    net, inputs = reference("resnet18", {s.name: v for s, v in d.numbers.items()}, {"depth": 18})
    c = compare(d, measure(net, *inputs))
    assert not c.exact and c.difference > 0
    diff = c.differences()
    assert any(r.dtype == "float32" and r.nbytes == 64 * 4 and r.measured > r.predicted for r in diff)  # BN stats
    assert "NOT EXACT" in c.report()


@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # ops and stand-ins that keep nothing
def test_cli_verify_exit_status(capsys, monkeypatch):
    assert main(["verify", "resnet18", "--set", "B=2", "--set", "Hi=32", "--set", "Wi=32", "-v"]) == 0
    out = capsys.readouterr().out
    assert "exact" in out and "activations" in out and "batch_norm" in out
    import symmem.record.verify as v

    net, inputs = reference("mlp", {"B": 2}, {})
    bad = compare(derive("mlp", convention="paper", values={"B": 2}), measure(net, *inputs))
    assert not bad.exact
    monkeypatch.setattr(v, "verify", lambda d, **kw: bad)
    assert main(["verify", "mlp", "--set", "B=2"]) == 1


def test_cli_errors():
    assert main(["verify", "mlp", "--per-layer"]) == 2  # the fixed-width MLP has no repeated layer
    assert main(["verify", "resnet18", "--dropout", "0.1"]) == 2  # ResNet has no dropout option
    assert main(["verify", "resnet18", "--checkpoint", "full"]) == 2  # the reference runs no checkpointing
    with pytest.raises(SymmemError, match="per-layer"):
        verify(derive("mlp", convention="pytorch", widths="symbolic", per_layer=True))
    with pytest.raises(SymmemError, match="no PyTorch reference"):
        reference("no-such-model", {}, {})


def test_cli_derive_device_and_loss(capsys):
    assert main(["derive", "vgg11", "--convention", "pytorch", "--device", "cpu", "--loss", "cross-entropy",
                 "--format", "json"]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert main(["derive", "vgg11", "--convention", "pytorch", "--loss", "cross-entropy", "--format", "json"]) == 0
    cuda = json.loads(capsys.readouterr().out)
    assert cpu["options"]["device"] == "cpu" and cuda["options"]["device"] == "cuda"
    assert cpu["values"]["loss"] == cuda["values"]["loss"] == 64 * 1000 * 4 + 4
    # two classifier dropouts of (B, 4096): float32 noise on CPU, bool mask on CUDA
    assert cpu["values"]["activations"] - cuda["values"]["activations"] == 2 * 64 * 4096 * (4 - 1)
    assert any(t["group"] == "loss" and t["category"] == "loss" for t in cpu["breakdown"])
    assert main(["derive", "vgg11", "--convention", "paper", "--device", "cpu"]) == 2


def test_loss_errors():
    from symmem.graph import GraphBuilder, Model
    from symmem.symbols import B

    with pytest.raises(SymmemError, match="unknown loss 'mse'"):
        derive("mlp", convention="pytorch", loss="mse")
    g = GraphBuilder("two")
    x = g.input("x", (B, 4))
    g.op("linear", x, name="a", out_features=2)
    g.op("linear", x, name="b", out_features=2)
    with pytest.raises(SymmemError, match="exactly one output node"):
        derive(Model("two", g.finish(), {B: 2}, (B,)), convention="pytorch", loss="cross-entropy")
