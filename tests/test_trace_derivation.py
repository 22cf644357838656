"""symmem.trace: a user's own module becomes a Derivation whose formula equals what real forwards keep."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trace_helpers import cnn  # noqa: E402

import symmem  # noqa: E402
from symmem.record.verify import measure  # noqa: E402


@pytest.fixture(scope="module")
def traced():
    torch.manual_seed(0)
    return symmem.trace(cnn(), (torch.randn(2, 3, 8, 8),), {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]},
                        optimizer="adam")


@pytest.mark.parametrize("b, hi, wi", [(3, 10, 6), (5, 12, 16)])
def test_formula_equals_real_forwards_at_new_sizes(traced, b, hi, wi):
    torch.manual_seed(1)
    net = cnn()
    real = measure(net, torch.randn(b, 3, hi, wi))
    d = traced.at(B=b, Hi=hi, Wi=wi)
    assert (d.value("activations"), d.value("input")) == (real.activations, real.input)


def test_layers_fold_to_a_symbol_and_the_parameter_side_follows_the_regime(traced):
    L = symmem.symbol("L")
    assert L in traced.free and traced.numbers[L] == 4
    layer = traced.sum(group="layer")
    assert layer.has(L)
    params = sum(p.numel() for p in cnn().parameters())
    assert traced.value("parameters") == params
    assert traced.value("parameter_memory") == 16 * params  # fp32 + Adam: weights, gradients, two moments


def test_views_work_on_a_traced_module(traced):
    out = traced.to_dict()
    assert out["convention"] == "traced" and out["values"]["activations"] == traced.value("activations")
    assert "holds where" in traced.table()
    import warnings

    from symmem.apps.budget import largest

    fit = largest(traced, "B", "1GiB")  # the traced step's peak: what a training step needs
    with warnings.catch_warnings():  # past the domain's B < 16 (a CPU convolution's kernel choice): said, not silent
        warnings.simplefilter("ignore")
        assert fit.quantity == "peak" and traced.at(B=fit.bound).value("peak") <= 2**30 < traced.at(
            B=fit.bound + 1).value("peak")
    # the answer is capped where the formulas stop holding, and says so (issue 21)
    assert "B < 16" in str(traced.domain) and dict(fit.held) == {"Hi": 8, "Wi": 8, "L": 4}  # the example's sizes
    assert (fit.max, fit.bound > 16) == (15, True) and "outside the formulas' domain (B < 16)" in fit.refused


def test_a_traced_module_is_a_ledger_not_a_graph():
    """The trace becomes a ledger directly (no graph of stand-in nodes): its kept storages are the derivation's,
    its parameters include the frozen ones (their weights only: no gradient or optimizer state), and neither a
    ``traced`` op kind nor a ``traced`` convention exists; the derivation still says ``traced``."""
    from symmem import ops
    from symmem.conventions import names
    from symmem.engine import derivation_of
    from symmem.importer import trace_module
    from symmem.importer.traced import ledger_of
    from symmem.training import Regime

    torch.manual_seed(0)
    net = cnn()
    net.head.requires_grad_(False)
    recorded = trace_module(net, (torch.randn(2, 3, 8, 8),), {"B": [(0, 0)]})
    ledger = ledger_of(recorded, Regime())
    d = derivation_of(ledger, Regime())
    assert d.convention == "traced" and "traced" not in names() and "traced" not in ops.kinds()
    assert [s for s in d.storages if s.category != "parameter"] == list(ledger.storages)
    frozen = [p.owner for p in ledger.parameters if not p.trainable]
    assert frozen == ["head.weight:param", "head.bias:param"]
    assert sorted(s.role for s in d.storages if s.node in frozen) == ["weights", "weights"]
    assert d.value("parameters") == sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert ledger.repeats == {"layers": symmem.symbol("L")} and d.layer is None


def test_a_module_that_keeps_no_activation_says_nothing_wrong():
    """A lone Linear keeps only its input (autograd's saved tensors: the oracle): activations 0, input 4*B*4 bytes,
    and no note that the trace "was not traced" -- what PyTorch kept is the truth, not a convention's blind spot."""
    import warnings

    import torch

    import symmem

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = symmem.trace(torch.nn.Linear(4, 3), (torch.zeros(2, 4),), {"B": [(0, 0)]})
    assert d.activations == 0 and d.input == 16 * symmem.symbol("B") and d.notes == ()


@pytest.mark.parametrize("mode, options", [("mean", {}), ("sum", {}), ("max", {}), ("sum", {"padding_idx": 3}),
                                           ("mean", {"include_last_offset": True})])
def test_embedding_bag_keeps_what_the_cpu_kernel_keeps(mode, options):
    """Issue 22 item 16: the CPU ``_embedding_bag`` keeps offset2bag in a storage one element longer than the
    indices (and bag_size one per offset with include_last_offset), which its meta kernel does not: both ``auto`` and
    ``fit`` refused the module.  The traced formula now equals what autograd really keeps at other sizes."""
    import torch

    import symmem
    from symmem.record.verify import measure

    class Bags(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bags, self.fc = torch.nn.EmbeddingBag(50, 8, mode=mode, **options), torch.nn.Linear(8, 3)

        def forward(self, x, offsets):
            return self.fc(self.bags(x, offsets))

    def batch(b: int, s: int):
        last = s if "include_last_offset" in options else 0
        return torch.randint(0, 50, (b * s,)), torch.arange(0, b * s + last, s)

    # T indices in all, cut into bags by B offsets (B + 1 with include_last_offset)
    d = symmem.trace(Bags(), batch(4, 6), {"T": [(0, 0)], "B": [(1, 0)]},
                     values={"T": 35, "B": 6 if options.get("include_last_offset") else 5})
    real = measure(Bags(), *batch(5, 7))
    assert d.value("activations") + d.value("input") == real.activations + real.input


@pytest.mark.parametrize("how, says", [({"method": "fit"}, "fitted from traces at concrete sizes"),
                                       ({"optimizer": "lion"}, "optimizer='lion' is not among them"),
                                       ({"training": False}, "traced in eval mode")])
def test_a_traced_module_without_a_step_says_why(how, says):
    """Issue 22 item 18: a traced module with no step to follow pointed to --convention pytorch, which trace
    refuses; it now says why there is no peak, in one line."""
    import torch

    import symmem

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    d = symmem.trace(net, (torch.randn(2, 4),), {"B": [(0, 0)]}, **how)
    assert not d.has_peak
    with pytest.raises(symmem.SymmemError, match=says) as e:
        d.value("peak")
    assert "--convention" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(symmem.SymmemError, match=f"micro_batches=4 shapes the training step's peak.*{says}"):
        symmem.trace(net, (torch.randn(2, 4),), {"B": [(0, 0)]}, micro_batches=4, **how)


@pytest.mark.parametrize("optimizer, states", [("adamw", 2), ("sgd", 0)])
def test_a_frozen_layer_keeps_its_weights(optimizer, states):
    """A frozen layer (fine-tuning, a frozen backbone) holds its weights and no gradient or optimizer state; the
    parameter side left its weights out (issue 21: the peak counted them, the total did not).  Oracle: PyTorch's own
    sizes of the module's parameters."""
    import torch

    import symmem

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for p in net[0].parameters():
        p.requires_grad_(False)
    d = symmem.trace(net, (torch.randn(2, 16),), {"B": [(0, 0)]}, optimizer=optimizer)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    trainable = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    assert d.parameter_memory == weights + (1 + states) * trainable
    assert d.value("parameters") == sum(p.numel() for p in net.parameters() if p.requires_grad)
