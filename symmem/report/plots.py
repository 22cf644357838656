"""Plots of derived memory: a stacked breakdown, memory against batch size or sequence length, a profile.

matplotlib is imported inside the functions (Agg backend) so ``import symmem`` stays light.  Sweeps
evaluate the derived total with ``sympy.lambdify``; the largest fitting value comes from :mod:`symmem.apps.budget`.
Each function returns the matplotlib figure and writes it when given ``output`` (``.png``, ``.pdf`` or
``.svg``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sympy

from .. import names
from ..errors import SymmemError
from ..files import output_path, write_atomically
from ..units import UNITS, parse_size
from .headline import peak_state

if TYPE_CHECKING:
    from ..derivation import Derivation

FORMATS = (".png", ".pdf", ".svg")
GiB, MiB = UNITS["GiB"], UNITS["MiB"]


def _plt() -> Any:
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg") and not _interactive():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _interactive() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def check_output(output: str | Path | None) -> Path | None:
    """``output`` checked before anything is drawn (a suffix of :data:`FORMATS`, a directory that exists ...)."""
    return None if output is None else output_path(output, FORMATS)


def save(fig: Any, output: str | Path | None) -> None:
    """Write ``fig`` to ``output`` (``.png``, ``.pdf`` or ``.svg``), whole or not at all."""
    if output is None:
        return
    path = output_path(output, FORMATS)
    fmt = path.suffix.lower().lstrip(".")
    # drawn into a temporary file and renamed: a failure leaves no half-written figure
    write_atomically(path, lambda tmp: fig.savefig(tmp, format=fmt, bbox_inches="tight", dpi=150,
                                                   metadata={"Date": None} if fmt == "svg" else None))


def _label(d: Derivation, sep: str = "\n") -> str:
    """``ViT-B/16 (naive)`` + ``sep`` + the convention's short name (``PyTorch autograd``)."""
    attention = d.options.get("attention")
    return (f"{names.model(d.model)}" + (f" ({attention})" if attention else "")
            + f"{sep}{names.convention(d.convention)}")


def _regime(d: Derivation) -> str:
    """``FP32 + AdamW``, with what ran where the derivation says it: ``under bfloat16 autocast``, ``on cpu``, and
    the layout over devices (``per device: fsdp N=8, gpipe p=4 M=8``), as the figure's values are one device's."""
    regime = d.regime_label()
    if d.options.get("device") and d.options["device"] != "cuda":  # cuda: the default of every plot so far
        regime += f" on {d.options['device']}"
    layout = d.layout_label()
    return f"{regime}, per device: {layout}" if layout else regime


#: One colour per kind of memory, the same in every figure: the live-memory categories (as PyTorch's memory snapshot
#: viewer groups them; the timeline), which the breakdown's parameter side and input use too, and the parts of a
#: transformer layer, kept tensors in the activations' warm hues (breakdown, profile).
COLORS = {"parameter": "#4c72b0", "optimizer_state": "#8172b2", "gradient": "#64b5cd",
          "input": "#ccb974", "activation": "#dd8452", "loss": "#c44e52", "activation_grad": "#55a868",
          "temporary": "#937860",
          "residual stream": "#e6a26b", "norms": "#f0c987", "attention": "#c0504d", "MLP": "#d9743c",
          "other": "#b08060"}
_CATEGORY_COLORS = {c: COLORS[c] for c in ("parameter", "optimizer_state", "gradient", "input", "activation", "loss",
                                            "activation_grad", "temporary")}
_CATEGORY_OF_CLASS = {"weights": "parameter", "gradients": "gradient", "optimizer": "optimizer_state"}


def _shade(color: str, k: int) -> Any:
    """The ``k``-th shade of ``color``, darkest first: each a fifth nearer white, at most 60 % (several segments of
    one category stay one hue, and the ``k``-th is the same in every figure)."""
    from matplotlib.colors import to_rgb

    mix = min(0.6, 0.2 * k)
    return tuple(c + (1 - c) * mix for c in to_rgb(color))


# Activation groups that are not a layer's parts (stem, stages, head): warm hues, dark and light in turn so that
# neighbours in a stack stay apart; the first is the activations' own colour.
_WARM = ("#dd8452", "#f3c19b", "#b5622f", "#f7dcc4", "#e39a6b", "#8f4a22", "#fae7d8", "#c97b4b")

# Copies the optimizer holds (mixed precision) come after its states, so exp_avg is the optimizer's colour itself.
_COPIES = ("master_weights", "main_weights", "gradients_fp32")


def colors_of(names: Sequence[str], kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """The colour of every segment of a breakdown (or group of a profile), from :data:`COLORS`: a parameter-side
    component by its class (``kinds``: name -> weights, gradients or optimizer), ``input`` as the input, a layer's
    part (``layer: attention``) by the part, any other activation group a shade of the activations' colour.

    >>> c = colors_of(["input", "layer: attention", "stem", "head", "weights", "exp_avg"],
    ...               {"weights": "weights", "exp_avg": "optimizer"})
    >>> c["weights"] == _shade(COLORS["parameter"], 0), c["layer: attention"] == _shade(COLORS["attention"], 0)
    (True, True)
    """
    kinds = kinds or {}
    family: dict[str, str] = {}
    for n in names:
        if n in kinds:
            family[n] = _CATEGORY_OF_CLASS.get(kinds[n], "optimizer_state")
        elif n == "input":
            family[n] = "input"
        elif ": " in n and n.split(": ", 1)[1] in PARTS:
            family[n] = n.split(": ", 1)[1]
        else:
            family[n] = "activation"
    members: dict[str, list[str]] = {}
    for n in sorted(names, key=lambda n: n in _COPIES):  # stable: the states keep their order, copies go last
        members.setdefault(family[n], []).append(n)
    return {n: _WARM[members["activation"].index(n) % len(_WARM)] if family[n] == "activation"
            else _shade(COLORS[family[n]], members[family[n]].index(n)) for n in names}


#: The parts of a transformer layer, in the order they are stacked, and the roles that belong to each.
PARTS: tuple[str, ...] = ("residual stream", "norms", "attention", "MLP", "other")
_PART_OF_ROLE = {
    "residual": "residual stream",
    "attn_input": "norms", "mlp_input": "norms", "norm_stats": "norms",
    **dict.fromkeys(("qkv", "attn_scores", "attn_probs", "attn_dropout", "attention", "proj_input",
                     "attn_dropout_mask", "attn_lse", "rng_state", "matmul_copy"), "attention"),
    **dict.fromkeys(("mlp_hidden", "mlp_act", "mlp_gate_act"), "MLP"),
}
# For a tensor without one of those roles, words of its name (module path), tried in this order.
_PART_WORDS = (("norms", ("norm", "ln_")),
               ("attention", ("attn", "attention", "rope", "scores", "softmax", "sdpa", "qkv", "proj", "repeat")),
               ("MLP", ("mlp", "fc", "intermediate", "gelu", "act", "output", "drop")),
               ("residual stream", ("add", "input")))


def part(name: str, role: str | None) -> str:
    """Which part of a transformer layer a kept tensor belongs to: ``residual stream``, ``norms``,
    ``attention``, ``MLP`` or ``other`` -- by its role, else by the words of its name.

    >>> part("blocks.softmax", "attn_probs"), part("h.mlp.gelu.tanh", None), part("layers.add2", None)
    ('attention', 'MLP', 'residual stream')
    """
    if role in _PART_OF_ROLE:
        return _PART_OF_ROLE[role]
    words = [w.lower() for w in name.split(".")[1:]] or [name.lower()]
    for found, keys in _PART_WORDS:
        if any(k in w for w in words for k in keys):
            return found
    return "other"


def segments(d: Derivation, parts: bool = True) -> list[tuple[str, int]]:
    """(label, bytes) stacked in a breakdown bar: activations per group, inputs, then the parameter side
    per component (weights, gradients, optimizer states).  With ``parts``, a group of repeated transformer
    layers is split into its parts (:func:`part`: residual stream, norms, attention, MLP), labelled
    ``layer: attention`` ...; a group whose tensors are not a transformer layer's stays whole."""
    out: list[tuple[str, int]] = []
    for group in d.groups():
        terms = [t for t in d.terms if t.group == group and t.category != "parameter"]
        split: dict[str, list[Any]] = {}
        for t in terms:
            split.setdefault(part(t.name, t.role), []).append(t.expr)
        repeated = d.per_layer or any(t.count != 1 for t in terms)
        if parts and repeated and len(set(split) - {"other"}) >= 2:
            for p in PARTS:
                if p in split:
                    value = d.evaluate(sympy.Add(*split[p]))
                    if value:
                        out.append((f"{group}: {p}", value))
            continue
        expr = sympy.Add(*(t.expr for t in terms))
        if expr != 0:
            out.append((group, d.evaluate(expr)))
    for t in d.terms:
        if t.category == "parameter":
            out.append((t.name, d.evaluate(t.expr)))
    return out


def breakdown(derivations: Sequence[Derivation], labels: Sequence[str] | None = None,
              output: str | Path | None = None, unit: str = "GiB", parts: bool = True) -> Any:
    """One stacked bar per derivation (model x convention), segments as in :func:`segments` (``parts``: a
    transformer layer split into residual stream, norms, attention and MLP)."""
    plt = _plt()
    scale = UNITS[unit]
    labels = list(labels) if labels is not None else [_label(d) for d in derivations]
    stacks = [segments(d, parts) for d in derivations]
    side = {t.name for d in derivations for t in d.terms if t.category == "parameter"}
    order: list[str] = []
    for p in stacks:  # activation groups first, the parameter side last, in the legend as in the bars
        order += [n for n, _ in p if n not in order and n not in side]
    groups = list(dict.fromkeys(n.split(": ")[0] for n in order))  # a layer's parts stacked as in PARTS
    order.sort(key=lambda n: (groups.index(n.split(": ")[0]),
                              PARTS.index(n.split(": ")[1]) if ": " in n and n.split(": ")[1] in PARTS else -1))
    for p in stacks:
        order += [n for n, _ in p if n not in order]
    colors = colors_of(order, {t.name: d.regime.kind_of(t.name) for d in derivations for t in d.terms
                               if t.category == "parameter"})
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(derivations) + 2.5), 4.5))
    for i, p in enumerate(stacks):
        bottom = 0.0
        for name, value in p:
            ax.bar(i, value / scale, bottom=bottom, color=colors[name], edgecolor="white", linewidth=0.5,
                   label=name)
            bottom += value / scale
        top = bottom
        steps, _ = peak_state(derivations[i])
        if steps:  # the number that must fit leads: a line across the bar at the peak, its value above
            peak = steps[0][1] / scale
            ax.hlines(peak, i - 0.45, i + 0.45, colors="black", linewidth=2, zorder=5)
            top = max(top, peak)
            ax.text(i, top, f"peak {peak:.2f}\n(kept {bottom:.2f})", ha="center", va="bottom", fontsize=8)
        else:
            ax.text(i, top, f"kept {bottom:.2f}\n(no peak)", ha="center", va="bottom", fontsize=8)
    found = dict(zip(*reversed(ax.get_legend_handles_labels()), strict=False))
    ordered = [n for n in reversed(order) if n in found]  # top of the stack first, as the bars read
    ax.legend([found[n] for n in ordered], ordered, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    ax.set_xticks(range(len(labels)), labels, fontsize=9)
    ax.set_ylabel(f"training memory ({unit})")
    ax.set_title(f"{_regime(derivations[0])}: training memory by part\n(bars: kept after forward + parameters; "
                 "line: peak of a training step, what must fit)", fontsize=10)
    ax.margins(y=0.1)
    fig.tight_layout()
    _no_peak_note(fig, derivations, labels)
    save(fig, output)
    return fig


def _no_peak_note(fig: Any, derivations: Sequence[Derivation], labels: Sequence[str]) -> None:
    """Under the axes (after ``tight_layout``), one line per derivation that has no peak, saying why
    (:func:`~symmem.report.text.peak_state`)."""
    import textwrap

    notes = []
    for d, label in zip(derivations, labels, strict=True):
        why = peak_state(d)[1]
        if why is not None:
            notes.append(f"{' '.join(str(label).split())}: {why}")
    if notes:
        text = "\n".join(textwrap.shorten(n, 160, placeholder=" ...") for n in notes)
        fig.subplots_adjust(bottom=fig.subplotpars.bottom + 0.04 * len(notes))
        fig.text(0.01, 0.005, text, fontsize=6.5, va="bottom", ha="left")


def _axis(name: str) -> str:
    """An axis label in words, the symbol after them: ``batch size B``, ``input image height Hi``.

    >>> _axis("B"), _axis("S"), _axis("Hi"), _axis("X")
    ('batch size B', 'sequence length S (tokens)', 'input image height Hi', 'X')
    """
    from ..symbols import dims

    words = {"B": "batch size", "S": "sequence length"}.get(name)
    if words is None:
        words = next((d.meaning.split(" (")[0] for d in dims() if d.name == name), "")
    return f"{words} {name}" + (" (tokens)" if name == "S" else "") if words else name


def _function(d: Derivation, name: str) -> tuple[Any, sympy.Expr, sympy.Expr, sympy.Expr]:
    """(symbol, what must fit, the total, the parameter side) as functions of ``name`` alone."""
    from ..apps.budget import polynomial

    sym, fits = polynomial(d, name)
    _, total = polynomial(d, name, "total")
    others = {s: v for s, v in d.numbers.items() if s != sym}
    par = sympy.expand(d.parameter_memory.xreplace(others))
    return sym, fits, total, par


def _lambdify(sym: sympy.Symbol, expr: sympy.Expr, scale: int = 1) -> Any:
    """``expr / scale`` as a numpy function of ``sym``; a peak's ``Max`` piece by piece (sympy would compare its
    pieces symbolically again on the way, for seconds)."""
    import numpy as np

    # Float coefficients: an integer beyond int64 would make numpy compute with Python objects (and fail).
    pieces = expr.args if isinstance(expr, sympy.Max) else (expr,)
    fs = [sympy.lambdify(sym, (p / scale).evalf(), "numpy") for p in pieces]
    return lambda x: np.maximum.reduce([np.broadcast_to(f(x), np.shape(x)).astype(float) for f in fs])


def sweep(d: Derivation, name: str = "B", values: Sequence[int] | None = None,
          budget: int | str | None = None, output: str | Path | None = None, unit: str = "GiB",
          accepts: Callable[[int], str | None] | None = None) -> Any:
    """Memory against ``name`` (``B`` or ``S``): the peak of a training step (where the convention models
    the step), the total (kept at the end of the forward pass + parameter side) and the parameter side, with
    the budget as a horizontal line and the largest fitting value marked -- or "nothing fits" written on it.

    ``accepts(value)`` says why the model refuses ``value`` for ``name`` (None: accepted;
    :func:`symmem.api.acceptor`): ``values`` the model refuses are refused as :func:`symmem.derive` refuses them,
    and the default sweep keeps to the values it accepts.  Without it, values are checked against PyTorch's
    largest size (2**63 - 1) only."""
    import numpy as np

    from ..apps.budget import default_quantity, largest
    from ..errors import NothingFits

    plt = _plt()
    scale = UNITS[unit]
    sym, fits, total, par = _function(d, name)
    quantity = default_quantity(d)
    cap = None if budget is None else (parse_size(budget) if isinstance(budget, str) else int(budget))
    fit, nothing = None, None
    if cap is not None:
        try:
            fit = largest(d, name, cap, accepts=accepts)
        except NothingFits as exc:
            nothing = exc
    values = _swept(name, values, fit.max if fit is not None else 0, d.numbers[sym], accepts)
    xs = np.asarray(values, dtype=float)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    from .headline import PAPERS_STAGE, papers_stage

    papers = papers_stage(d)
    curves = [(total, PAPERS_STAGE if papers else "kept after forward + parameters", "--"),
              (par, "the papers' stage: parameter side" if papers else "parameter side", ":")]
    if quantity == "peak":
        curves.insert(0, (fits, "peak of a training step", "-"))
    for expr, label, style in curves:
        f = _lambdify(sym, expr, scale)
        ax.plot(xs, np.broadcast_to(f(xs), xs.shape), style, label=label)
    if cap is not None:
        ax.axhline(cap / scale, color="crimson", lw=1, label=f"budget {cap / scale:.2f} {unit}")
    if fit is not None:
        ax.plot([fit.max], [fit.total_at_max / scale], "o", color="crimson")
        ax.annotate(f"largest {name} = {fit.max:,}", (fit.max, fit.total_at_max / scale),
                    textcoords="offset points", xytext=(-8, 10), ha="right", color="crimson")
    if nothing is not None:
        ax.text(0.5, 0.5, f"nothing fits: {name} = 1 needs more than the budget", transform=ax.transAxes,
                ha="center", color="crimson")
    ax.set_xlabel(_axis(name))
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(f"{_label(d, ', ')}, {_regime(d)}: memory vs {name}")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    _no_peak_note(fig, [d], [_label(d, ", ")])
    save(fig, output)
    return fig


def _swept(name: str, values: Sequence[int] | None, fit: int, at: int, accepts: Callable[[int], str | None] | None
           ) -> list[int]:
    """The values a sweep plots: ``values``, each one a size :func:`symmem.derive` accepts (a refused one is a
    :class:`SymmemError` with derive's reason), or by default 200 values up to twice the largest fitting value
    and the derivation's own, those the model accepts."""
    import numpy as np

    from ..units import MAX_SIZE

    def why(v: int) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 1 <= v <= MAX_SIZE:
            return f"{name} must be a positive integer up to the largest size PyTorch allows (2**63 - 1)"
        return None if accepts is None else accepts(int(v))

    if values is not None:
        values = list(values)
        for x in [*values[-1:], *values]:  # the largest first: where a size outgrows PyTorch's largest tensor
            reason = why(x)
            if reason is not None:
                shown = f"{x:,}" if isinstance(x, int | np.integer) else repr(x)
                raise SymmemError(f"the sweep's {name} = {shown} is a size derive refuses: {reason}")
        return values
    top = min(max(2 * fit, 2 * at, 8), MAX_SIZE)
    if why(top) is not None and why(1) is None:
        # beyond the sizes the model accepts (a tensor past PyTorch's largest): up to the largest it accepts
        lo, hi = 1, top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if why(mid) is None else (lo, mid)
        top = lo
    # 200 values from 1 to top (in integers where a float would round them)
    grid = np.unique(np.linspace(1, top, 200).astype(int)).tolist() if top < 2**53 else sorted(
        {1 + (top - 1) * i // 199 for i in range(200)})
    found = [v for v in grid if why(v) is None]
    if not found:
        raise SymmemError(f"no value of {name} up to {top:,} is a size the model accepts")
    return found




def timeline(d: Derivation, step: str = "steady", output: str | Path | None = None, unit: str = "GiB") -> Any:
    """Live memory over one training step, op by op, stacked by category, with the peak marked and the
    phases (forward, backward, optimizer step) shaded -- the picture of PyTorch's memory snapshots, drawn from
    the formula at the derivation's numbers (``step``: ``steady`` or ``first``, which creates the optimizer
    state)."""
    import numpy as np

    plt = _plt()
    scale = UNITS[unit]
    events = d.timeline(step)
    cats = [c for c in _CATEGORY_COLORS if any(v.get(c, 0) for _, _, v in events)]
    xs = np.arange(len(events))
    ys = np.array([[v.get(c, 0) / scale for _, _, v in events] for c in cats])
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    ax.stackplot(xs, ys, labels=[c.replace("_", " ") for c in cats], colors=[_CATEGORY_COLORS[c] for c in cats],
                 step="post", alpha=0.9, linewidth=0)
    totals = ys.sum(axis=0)
    top = int(np.argmax(totals))
    phases: list[tuple[str, int, int]] = []
    for i, (phase, _, _) in enumerate(events):
        if phases and phases[-1][0] == phase:
            phases[-1] = (phase, phases[-1][1], i)
        else:
            phases.append((phase, i, i))
    narrow = []
    for k, (phase, a, b) in enumerate(phases):
        if k % 2:
            ax.axvspan(a, b + 1, color="grey", alpha=0.08, lw=0)
        if b + 1 - a < 0.06 * len(events):  # too narrow to name on its own: named together at the end
            narrow.append(phase.replace("_", " "))
            continue
        ax.text((a + b + 1) / 2, 1.0, phase.replace("_", " "), transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=8)
    if narrow:
        ax.text(1.0, 1.0, " + ".join(narrow), transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    phase, node, _ = events[top]
    ax.plot([top], [totals[top]], "o", color="crimson")
    ax.annotate(f"peak {totals[top]:.3f} {unit}\n{phase} {node or ''}", (top, totals[top]),
                textcoords="offset points", xytext=(6, -24), color="crimson", fontsize=8)
    ax.set_xlim(0, len(events))
    ax.set_ylim(0, totals.max() * 1.12 if totals.max() > 0 else 1)
    ax.set_xlabel("ops of one training step")
    ax.set_ylabel(f"live memory ({unit})")
    which = "the first training step" if step == "first" else "a steady training step"
    ax.set_title(f"{_label(d, ', ')}, {_regime(d)}: live memory over {which}", pad=16)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    save(fig, output)
    return fig


def scaling(derivations: Sequence[Derivation], labels: Sequence[str] | None = None, name: str = "B",
            budget: int | str | None = None, values: Sequence[int] | None = None,
            output: str | Path | None = None, unit: str = "GiB", fits: Sequence[Any] | None = None) -> Any:
    """What must fit (the peak where the convention models the step, else the total) of several derivations
    against ``name`` on one axes, the budget line and each largest fit ("nothing fits" in the legend where
    ``name`` = 1 is already over the budget).  ``fits``: the :func:`symmem.apps.budget.largest` answers (None where
    nothing fits) when the caller has them already; their formulas are the curves."""
    import numpy as np

    from ..apps.budget import default_quantity, largest, polynomial
    from ..errors import NothingFits

    def fit_of(d: Derivation) -> Any:
        try:
            return largest(d, name, cap)
        except NothingFits:
            return None

    plt = _plt()
    scale = UNITS[unit]
    labels = list(labels) if labels is not None else [_label(d, ", ") for d in derivations]
    cap = None if budget is None else (parse_size(budget) if isinstance(budget, str) else int(budget))
    if fits is None:
        fits = [fit_of(d) if cap is not None else None for d in derivations]
    curves = []
    for d, fit in zip(derivations, fits, strict=True):
        if fit is not None:
            sym = next(s for s in d.numbers if s.name == name)
            curves.append((sym, fit.formula))
        else:
            curves.append(polynomial(d, name))
    if values is None:
        top = max([int(1.3 * f.max) for f in fits if f is not None]
                  + [2 * d.numbers[sym] for d, (sym, _) in zip(derivations, curves, strict=True)] + [8])
        values = np.unique(np.linspace(1, top, 200).astype(int))
    xs = np.asarray(values, dtype=float)
    fig, ax = plt.subplots(figsize=(5.2, 3.5))
    for (sym, expr), label, fit in zip(curves, labels, fits, strict=True):
        f = _lambdify(sym, expr, scale)
        nothing = cap is not None and fit is None and float(expr.subs(sym, 1)) > cap
        (line,) = ax.plot(xs, np.broadcast_to(f(xs), xs.shape), label=label + (" (nothing fits)" if nothing else ""))
        if fit is not None:
            ax.plot([fit.max], [fit.total_at_max / scale], "o", color=line.get_color())
            ax.annotate(f"{fit.max:,}", (fit.max, fit.total_at_max / scale), textcoords="offset points",
                        xytext=(4, -12), color=line.get_color(), fontsize=8)
    if cap is not None:
        ax.axhline(cap / scale, color="crimson", lw=1, label=f"budget {cap / scale:.2f} {unit}")
    quantities = {default_quantity(d) for d in derivations}
    what = {frozenset({"peak"}): "peak of a training step",
            frozenset({"total"}): "kept after forward + parameters"}.get(
        frozenset(quantities), "peak, or kept after forward + parameters")
    ax.set_xlabel(_axis(name))
    ax.set_ylabel(f"{what} ({unit})")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0, top=None if cap is None else 1.4 * cap / scale)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    _no_peak_note(fig, derivations, labels)
    save(fig, output)
    return fig


def profile(d: Derivation, output: str | Path | None = None, unit: str = "MiB") -> Any:
    """Kept memory of every activation term in graph order, coloured by group; a repeated term shows one
    layer's copy and its count (``x L``)."""
    plt = _plt()
    scale = UNITS[unit]
    terms = [t for t in d.terms if t.category != "parameter"]
    if not terms:
        raise SymmemError(f"{d.model} keeps no activations under {d.convention}: nothing to profile")
    groups = list(dict.fromkeys(t.group for t in terms))
    colors = colors_of(groups)
    fig, ax = plt.subplots(figsize=(7.0, max(3.0, 0.22 * len(terms) + 1.2)))
    for i, t in enumerate(terms):
        count = d.evaluate(t.count)
        one = d.evaluate(t.expr) / count
        ax.barh(i, one / scale, color=colors[t.group],
                label=t.group if t.group not in ax.get_legend_handles_labels()[1] else None)
        tag = "" if count == 1 else f" \u00d7{count}" if t.count.is_number else f" \u00d7{t.count} ({t.count}={count})"
        ax.text(one / scale, i, f" {one / scale:.1f}{tag}", va="center", fontsize=7)
    ax.set_yticks(range(len(terms)), [t.name for t in terms], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"kept per layer copy ({unit})")
    ax.set_title(f"{_label(d, ', ')}: activation profile")
    ax.margins(x=0.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    save(fig, output)
    return fig


def close(fig: Any) -> None:
    """Free a figure's memory (the command line writes a figure and is done with it)."""
    _plt().close(fig)
