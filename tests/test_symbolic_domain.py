"""A formula in every size holds only where every trace of its fit took the branches it took (stop 43).

A module that branches on an input size at a bound a model size sets (``if S <= H // 4``) takes, at each size the
fit traces, the branch its example sizes take, and PyTorch records the bound there as a guard (``S <= 6`` at
H = 24, ``S <= 8`` at H = 32).  The domain must say where the fitted formula holds: the bound in the sizes where it
is one line through every trace (``S <= H/4``), a refusal where no polynomial gives it (``S > F // 24``: no guard at
F = 40, ``S > 2`` at F = 48).  Before, the domain was the base trace's guards only: ``narrowed`` claimed S = 2 at
F = 48, where real PyTorch keeps 1,536 activation bytes and the formula said 1,920.

Truth: :func:`symmem.record.verify.measure` (autograd's saved tensors of one real training-mode forward) at sizes the
fit never traced, inside the domain (equal to the byte) and outside it (an OutsideDomain warning, and real PyTorch
takes the other branch there: it keeps the batch itself, ``input`` > 0, where the formula's branch keeps none).
"""

from __future__ import annotations

import re
import warnings

import pytest

torch = pytest.importorskip("torch")

from symmem import trace  # noqa: E402
from symmem.errors import OutsideDomain, SymmemError  # noqa: E402
from symmem.record.verify import measure  # noqa: E402


class Branching(torch.nn.Module):
    """Doubles its input (the MLP then keeps the doubled copy, not the batch) where ``takes(S, H, F)``."""

    def __init__(self, H: int, F: int, takes: object) -> None:
        super().__init__()
        self.H, self.F, self.takes = H, F, takes
        self.up, self.down = torch.nn.Linear(H, F), torch.nn.Linear(F, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes(x.shape[1], self.H, self.F):
            x = 2 * x
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Biased(torch.nn.Module):
    """Adds a bias where the hidden size exceeds 4 S (``H > 4 * S``): the MLP then keeps the biased copy."""

    def __init__(self, H: int, F: int) -> None:
        super().__init__()
        self.H = H
        self.bias = torch.nn.Parameter(torch.zeros(H))
        self.up, self.down = torch.nn.Linear(H, F), torch.nn.Linear(F, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.H > 4 * x.shape[1]:
            x = x + self.bias
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _module(case: str, H: int, F: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "biased":
        return Biased(H, F)
    takes = {"narrowed": lambda S, H, F: S > F // 24,  # tests/test_symbolic_sizes.py's Narrowed
             "capped": lambda S, H, F: S <= H // 4,
             "eighths": lambda S, H, F: S <= H // 8,  # H // 8 is 3, 4, 6 at the fit's H; 4 at 36: no line
             # two bounds on S in every trace, both moving with H (HF Mistral's sliding-window mask: S < W and
             # S < W - 1): the tighter one lifted, the other implied by it (lift43)
             "windowed": lambda S, H, F: S < H // 4 and S < H // 4 - 1,
             # two bounds on S moving with two sizes: both lifted.  F's first: PyTorch records S <= F // 4 (S <= 10
             # at F = 40), then S <= H // 4 (S <= 6); in the other order S <= 10 already holds where S <= 6 does
             # and no guard is recorded at all (see the test below)
             "crossed": lambda S, H, F: S <= F // 4 and S <= H // 4,
             "fixed": lambda S, H, F: S > 3}[case]  # a bound no size moves: the base trace's guard, as before
    return Branching(H, F, takes)


def _build(case: str, S: int) -> object:
    def build(H: int, F: int) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
        return _module(case, H, F), (torch.randn(2, S, H),)

    return build


DIMS = {"B": [(0, 0)], "S": [(0, 1)]}
#: case: (example S, the domain's guard or the refusal's words, points inside (B, S, H, F), points outside)
CASES = {
    "capped": (4, "S <= H/4", [(2, 6, 26, 30), (3, 7, 28, 50), (2, 2, 8, 30)], [(2, 7, 26, 30), (2, 3, 8, 30)]),
    "biased": (4, "4*S <= H - 1", [(2, 6, 26, 30), (3, 2, 9, 50)], [(3, 7, 28, 50), (2, 2, 8, 30)]),
    "fixed": (8, "S > 3", [(2, 4, 26, 30), (3, 9, 100, 200)], [(2, 3, 26, 30)]),
    "narrowed": (8, "F: S >= 3 at H = 24, F = 48, no such guard at H = 24, F = 40", [], [(2, 2, 24, 48)]),
    "eighths": (2, "H, F: S <= 3 at H = 24, F = 40, S <= 4 at H = 36, F = 52", [], [(2, 2, 8, 30)]),
    "windowed": (4, "S <= H/4 - 2", [(2, 6, 32, 30), (3, 2, 16, 50), (2, 4, 26, 30)], [(2, 7, 32, 30), (2, 3, 16, 30)]),
    # inside: (2, 5, 40, 20) where F's bound is the tighter one; outside: past H's bound (F's: the test below)
    "crossed": (4, "S <= H/4", [(2, 5, 40, 20), (3, 6, 28, 30)], [(2, 8, 28, 60), (3, 4, 12, 50)]),
}


def _real(case: str, B: int, S: int, H: int, F: int) -> tuple[int, int]:
    module = _module(case, H, F)
    m = measure(module, torch.randn(B, S, H))
    return m.activations, m.input


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_branch_a_size_moves_is_in_the_domain_or_refused(case: str) -> None:
    S0, said, inside, outside = CASES[case]
    if not inside:  # no line through the traces gives the bound: refused in one line, naming the size
        with pytest.raises(SymmemError) as e:
            trace(_build(case, S0), dims=DIMS, sizes={"H": 64, "F": 24}, optimizer="sgd")
        assert f"({said})" in str(e.value) and "keep that size fixed" in str(e.value)
        # the old domain (the base trace's guards) claimed these points, where real PyTorch takes the other branch:
        # it keeps the batch itself, which no trace of the fit kept
        for B, S, H, F in outside:
            assert _real(case, B, S, H, F)[1] > 0
        return
    d = trace(_build(case, S0), dims=DIMS, sizes={"H": 64, "F": 24}, optimizer="sgd")
    assert said in str(d.domain)
    for B, S, H, F in inside:  # never traced (the fit's H are 24, 32, 48, 36, 44; F 40, 48, 64, 52, 60)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OutsideDomain)
            e = d.at(B=B, S=S, H=H, F=F)
        assert (e.value("activations"), e.value("input")) == _real(case, B, S, H, F), (B, S, H, F)
    for B, S, H, F in outside:
        with pytest.warns(OutsideDomain, match=re.escape(f"outside the formulas' domain ({said} fails)")):
            e = d.at(B=B, S=S, H=H, F=F)
        real = _real(case, B, S, H, F)
        assert real[1] > 0 and e.value("input") == 0  # real PyTorch took the other branch there


# -- the peak in every size (peak=True): its step holds where the fit's guards do (stop 43, sized43) ---------------
#: the cases with a domain (CASES): the sized step's domain was the input sizes >= 2 and the plan's own conditions,
#: without the forward's guards -- the peak at a point past the guard was the formula's, unwarned by the step
PEAKED = sorted(case for case, (_, _, inside, _) in CASES.items() if inside)


def _real_peaks(case: str, B: int, S: int, H: int, F: int) -> tuple[int, int]:
    """The first and steady steps' peaks of real training steps (the live-bytes tracker), SGD as the trace's."""
    from symmem.record.steps import track_step

    module = _module(case, H, F)
    t = track_step(module, torch.randn(B, S, H), optimizer="sgd", keep_output=False)
    return t.first.bytes, t.steady.bytes


@pytest.mark.parametrize("case", PEAKED)
def test_the_peak_in_every_size_holds_in_the_fits_domain_and_is_refused_past_it(case: str) -> None:
    """Inside the fit's domain the peak is real steps' to the byte; past a guard every path refuses it in
    :meth:`Derivation.at`'s words (the step's peak at numbers, the value, the values over a grid, the views), and
    real PyTorch's peak there is not the formula's (the forward takes the other branch)."""
    S0, said, inside, outside = CASES[case]
    d = trace(_build(case, S0), dims=DIMS, sizes={"H": 64, "F": 24}, optimizer="sgd", peak=True)
    assert said in str(d.domain) and said in " & ".join(map(str, d.step.domain()))
    for B, S, H, F in inside:  # never traced
        with warnings.catch_warnings():
            warnings.simplefilter("error", OutsideDomain)
            e = d.at(B=B, S=S, H=H, F=F)
            assert (e.value("peak_first_step"), e.value("peak")) == _real_peaks(case, B, S, H, F), (B, S, H, F)
    for B, S, H, F in outside:
        at = ", ".join(f"{n} = {v}" for n, v in sorted({"S": S, "H": H}.items()) if n in said)
        words = f"{at} lie{'s' if ',' not in at else ''} outside the formulas' domain ({said} fails)"
        with pytest.warns(OutsideDomain, match=re.escape(words)):
            e = d.at(B=B, S=S, H=H, F=F)
        refused = re.escape(f"the peak in every size: {words}: they are not known to hold there (the forward takes "
                            "another branch there than at every configuration the fit traced)")
        with pytest.raises(SymmemError, match=refused):
            d.step.peak(e.numbers)
        with pytest.raises(SymmemError, match=refused):
            e.value("peak")
        with pytest.raises(SymmemError, match=refused), pytest.warns(OutsideDomain):
            d.values("peak", B=B, S=[S], H=H, F=F)  # over a grid: each point past the guard refused
        got = e.to_dict()
        assert got["values"]["peak"] is None and re.match("no peak: " + refused, got["peak_refused"])
        assert "no peak: the peak in every size:" in e.table()
        # what the step gave there before (its formula, unwarned), against real steps: the other branch's bytes
        formula = tuple(int(x.xreplace(e.numbers)) for x in (e.peak_first_step, e.peak))
        assert formula != _real_peaks(case, B, S, H, F), (B, S, H, F)


# -- several bounds on one size in one trace (lift43) -------------------------------------------------------------
def test_both_bounds_on_one_size_are_the_domain() -> None:
    """``crossed``: each trace holds S <= F // 4 and S <= H // 4; both are lifted (domain43 refused a second bound on
    S in one trace).  Past F's bound alone the formula warns, and real PyTorch takes the other branch there."""
    d = trace(_build("crossed", 4), dims=DIMS, sizes={"H": 64, "F": 24}, optimizer="sgd")
    assert "S <= F/4" in str(d.domain) and "S <= H/4" in str(d.domain)
    words = "F = 20, S = 6 lie outside the formulas' domain (S <= F/4 fails)"
    with pytest.warns(OutsideDomain, match=re.escape(words)):
        e = d.at(B=2, S=6, H=40, F=20)
    real = _real("crossed", 2, 6, 40, 20)
    assert real[1] > 0 and e.value("input") == 0


def _mistral(W: int) -> object:
    from symmem.importer.hf_sizes import hf_sizes

    return hf_sizes("hf:mistral", {"W": "sliding_window"},
                    {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 96, "sliding_window": W, "attn_implementation": "sdpa"},
                    None)


def _real_mistral(B: int, S: int, W: int) -> tuple[int, int]:
    torch.manual_seed(0)
    m = measure(_mistral(W).load({"W": W}).module, input_ids=torch.randint(0, 96, (B, S)))
    return m.activations, m.input


#: (B, S, W) inside S <= W - 2 (equal to the real model's saved bytes) and past it, where the sliding window masks
#: (S >= W: the real model keeps more than the formula, traced where S < W - 1 at every W)
MISTRAL_INSIDE = [(3, 5, 7), (2, 6, 9), (2, 30, 40)]
MISTRAL_OUTSIDE = [(2, 7, 7), (2, 9, 7), (2, 8, 4)]


def test_mistral_with_its_sliding_window_symbolic() -> None:
    """HF Mistral, ``--symbolic W=sliding_window``: every trace holds S < W and S < W - 1 (its sliding-window mask's
    branches), so domain43 refused the fit ("-S > -23 at W = 24"); stop 42's domain, the base trace's S < 23, claimed
    S >= W, where the window masks and the real model keeps more.  Now S <= W - 2.  W is in the domain only (no
    formula has it); ``at(W=)`` and ``values(W=)`` set it all the same and judge the sizes against the domain at it
    (stop 44: they refused it, "derive again with values={'W': 9}", which a traced module cannot): traced at W = 7."""
    pytest.importorskip("transformers")
    model = _mistral(7)
    d = trace(model.build, dims={"B": [("input_ids", 0)], "S": [("input_ids", 1)]}, sizes=model.sizes,
              optimizer="adamw", device="cpu")
    assert "S <= W - 2" in str(d.domain) and "W" not in {s.name for s in d.free}
    for B, S, W in MISTRAL_INSIDE:
        with warnings.catch_warnings():
            warnings.simplefilter("error", OutsideDomain)
            e = d.at(B=B, S=S, W=W)
        assert e.outside() == () and e.numbers[next(s for s in e.numbers if s.name == "W")] == W
        assert (e.value("activations"), e.value("input")) == _real_mistral(B, S, W), (B, S, W)
    for B, S, W in MISTRAL_OUTSIDE:
        words = f"S = {S}, W = {W} lie outside the formulas' domain (S <= W - 2 fails)"
        with pytest.warns(OutsideDomain, match=re.escape(words)):
            e = d.at(B=B, S=S, W=W)
        assert (e.value("activations"), e.value("input")) != _real_mistral(B, S, W), (B, S, W)
    # many sizes at once: the same numbers, each configuration outside the domain said (the first one's words)
    cases = MISTRAL_INSIDE + MISTRAL_OUTSIDE
    with pytest.warns(OutsideDomain, match=re.escape("S = 7, W = 7 lie outside")):
        many = d.values("activations", B=[b for b, _, _ in cases], S=[s for _, s, _ in cases],
                        W=[w for _, _, w in cases])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutsideDomain)
        assert many.tolist() == [d.at(B=b, S=s, W=w).value("activations") for b, s, w in cases]
