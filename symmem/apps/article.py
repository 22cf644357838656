"""A short LaTeX paper on the training memory of the models you name, generated from the engine.

``symmem paper --output DIR`` writes ``DIR/main.tex``, the generated equations and tables under
``DIR/generated/`` and the figures under ``DIR/figures/``, then compiles ``DIR/main.pdf`` with ``latexmk``
(or ``pdflatex``) when one is installed.  Every equation, number and table in the text is printed from the
derivations: the paper only arranges them.

By default it is the paper on the FP32 training memory of ResNet-50 and ViT-B/16 that reproduces (and corrects)
the FP32 analysis of ResNet-50 and ViT-B/16 (Bandyopadhyay, 2024).  :class:`Spec` names other models and
options (``symmem paper --model gpt2 --model bert-base --convention pytorch``): the text adapts -- a section per
model with its formulas, the comparison table, the scaling figure and, where the convention follows the training
step (``pytorch``), the peak of a step beside the total.  Rows in the analysis's own configuration (``paper``
convention, FP32, AdamW, its sizes) keep its figures beside the recomputed ones; under an accounting convention
the paper also sets the same rows beside what PyTorch's autograd keeps, with the peak of a real step.

>>> [r.label for r in rows(Spec())]
['ResNet-50', 'ViT-B/16 naive MHA', 'ViT-B/16 SDPA/Flash']
>>> [r.label for r in rows(Spec.make(["vit-b16"], ["naive", "sdpa"], convention="pytorch"))]
['ViT-B/16 (naive attention)', 'ViT-B/16 (SDPA)']
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import sympy

from .. import names
from ..errors import NothingFits, SymmemError
from ..units import UNITS

MiB, GiB = UNITS["MiB"], UNITS["GiB"]

# The analysis's printed figures, shown beside the recomputed ones (never used to compute anything).
PRINTED_SPLIT = {"stage 1": ("882.00", "49.00"), "stage 2": ("384.00", "400.00"), "stage 3": ("301.00", "238.00"),
                 "stage 4": ("88.50", "70.75")}
PRINTED_TOTALS = {"ResNet-50": "3.03", "ViT-B/16 naive MHA": "6.55", "ViT-B/16 SDPA/Flash": "5.22"}
#: The rows of the analysis, in its configuration, and the labels it gives them.
ANALYSIS_LABELS = {("resnet50-v1", None): "ResNet-50", ("vit-b16", "naive"): "ViT-B/16 naive MHA",
                   ("vit-b16", "sdpa"): "ViT-B/16 SDPA/Flash"}
ATTENTION_LABELS = {"naive": "naive attention", "sdpa": "SDPA"}


@dataclass(frozen=True)
class Spec:
    """What the paper is about: the models, the attention kernels of those that have the option, the convention,
    the training regime, symbol values (applied to the models that have the symbol), the loss, the device of the
    ``pytorch`` convention and the budget of the scaling figure.  ``Spec()`` is the default paper."""

    models: tuple[str, ...] = ("resnet50-v1", "vit-b16")
    attention: tuple[str, ...] = ("naive", "sdpa")
    convention: str = "paper"
    optimizer: str = "adamw"
    precision: str = "fp32"
    checkpoint: str = "none"
    values: Mapping[str, int] = field(default_factory=dict)
    loss: str | None = None
    device: str | None = None
    budget: str = "80GiB"
    #: modules traced from a SPEC (``symmem paper --model net.py:build --dims B``): SPEC -> its derivation, named
    #: among ``models`` (issue 21: every command takes every model)
    traced: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, models: Sequence[str] | None = None, attention: Sequence[str] | None = None,
             **options: Any) -> Spec:
        """A spec from options; without ``models`` the default models (and both attention kernels), with
        ``models`` and no ``attention`` each model's default kernel."""
        if models is None:
            return cls(attention=tuple(attention or cls.attention),
                       **{k: v for k, v in options.items() if v is not None})
        if not models:
            raise SymmemError("the paper needs at least one model")
        return cls(models=tuple(dict.fromkeys(models)), attention=tuple(attention or ()),
                   **{k: v for k, v in options.items() if v is not None})


@dataclass(frozen=True)
class ModelRow:
    """One row of the paper: a model, with an attention kernel where it has the option, and its derivation."""

    label: str
    model: str
    attention: str | None
    d: Any
    #: the row is in the FP32 analysis's own configuration (its printed figures apply)
    analysis: bool


@dataclass(frozen=True)
class Paper:
    """Where the paper was written and whether it was compiled."""

    directory: Path
    tex: Path
    pdf: Path | None
    pytorch: bool
    note: str = ""


# -- rows ---------------------------------------------------------------------------------------------------
def _entry(model: str, spec: Spec | None = None) -> Any:
    from ..models import entry

    if spec is not None and model in spec.traced:  # a traced module: described by its SPEC, no builder options
        return SimpleNamespace(description=f"The module {model}, traced from PyTorch", options={})
    return entry(model)


#: a built-in model's defaults by (name, attention): its entry (a name registered again is built again) and them
_DEFAULTS: dict[tuple[str, str | None], tuple[Any, dict[str, Any]]] = {}


def _symbols(model: str, attention: str | None, spec: Spec | None = None) -> dict[str, Any]:
    """The model's symbols by name, with their defaults.

    A paper asks a model's defaults for every row, size phrase and check (ResNet-50 and ViT-B/16: 45 times); the
    model is built once for them (a builder is a function of its options), not again each time."""
    from ..models import build, entry

    if spec is not None and model in spec.traced:
        return {s.name: v for s, v in spec.traced[model].numbers.items()}
    e = entry(model)
    found = _DEFAULTS.get((model, attention))
    if found is None or found[0] is not e:
        options = {"attention": attention} if attention else {}
        found = _DEFAULTS[(model, attention)] = (e, {s.name: v for s, v in build(model, **options).defaults.items()})
    return dict(found[1])


def _derive(spec: Spec, model: str, attention: str | None, convention: str | None = None) -> Any:
    from ..api import derive

    if model in spec.traced:  # traced with the spec's values already: what PyTorch kept, whatever the convention
        return spec.traced[model]
    known = _symbols(model, attention)
    values = {k: v for k, v in spec.values.items() if k in known}
    options = {"device": spec.device} if spec.device else {}
    extra = {"attention": attention} if attention else {}
    return derive(model, convention=convention or spec.convention, values=values, optimizer=spec.optimizer,
                  precision=spec.precision, checkpoint=spec.checkpoint, loss=spec.loss, options=options, **extra)


def _is_analysis(spec: Spec, model: str, attention: str | None) -> bool:
    """Whether a row is in the FP32 analysis's own configuration: its model, accounting, regime and sizes."""
    if (model, attention) not in ANALYSIS_LABELS:
        return False
    if (spec.convention, spec.precision, spec.optimizer, spec.checkpoint, spec.loss) != \
            ("paper", "fp32", "adamw", "none", None):
        return False
    known = _symbols(model, attention)
    return all(known.get(k, v) == v for k, v in spec.values.items())


def rows(spec: Spec) -> list[ModelRow]:
    """One row per model, or per model and attention kernel for the models that take one."""
    out = []
    unknown = set(spec.values) - {k for m in spec.models for k in _symbols(m, None, spec)}
    if unknown:
        raise SymmemError(f"no model of the paper has the symbol {sorted(unknown)[0]!r}")
    for model in spec.models:
        e = _entry(model, spec)
        kernels: Iterable[str | None] = [None]
        if "attention" in e.options:
            allowed = e.options["attention"].choices or ()
            kernels = [a for a in spec.attention if a in allowed] or [e.options["attention"].default]
        for att in kernels:
            analysis = _is_analysis(spec, model, att)
            d = _derive(spec, model, att)
            if analysis:
                label = ANALYSIS_LABELS[(model, att)]
            else:
                label = names.model(model) + (f" ({ATTENTION_LABELS.get(att, att)})" if att else "")
            out.append(ModelRow(label, model, att, d, analysis))
    return out


def _pytorch(spec: Spec, rs: list[ModelRow]) -> tuple[dict[str, Any], str]:
    """The same rows under the ``pytorch`` convention, or why they cannot be derived."""
    try:
        return {r.label: _derive(spec, r.model, r.attention, "pytorch") for r in rs}, ""
    except SymmemError as exc:
        return {}, str(exc)


# -- numbers and phrases ------------------------------------------------------------------------------------
def _gib(n: int, digits: int = 3) -> str:
    return f"{n / GiB:.{digits}f}"


def _sizes(spec: Spec, r: ModelRow) -> str:
    """``$B = 64$`` or ``$B = 8$, $S = 1024$``: the batch, a sequence length given as a number, and the symbols
    the spec sets."""
    from ..report.factoring import ORDER, in_sizes

    if in_sizes(r.d):  # a formula in the model's own sizes: every size it is evaluated at, in the customary order
        known = sorted(r.d.numbers.items(), key=lambda kv: (ORDER.index(kv[0].name) if kv[0].name in ORDER
                                                             else len(ORDER), kv[0].name))
        return ", ".join(f"${s.name} = {v}$" for s, v in known)
    shown = []
    defaults = _symbols(r.model, r.attention, spec)
    for s, v in sorted(r.d.numbers.items(), key=lambda kv: kv[0].name):
        default = defaults.get(s.name)
        plain = isinstance(default, int) or bool(getattr(default, "is_Integer", False))
        if s.name == "B" or (s.name == "S" and plain) or s.name in spec.values:
            shown.append((s.name, v))
    shown.sort(key=lambda kv: (kv[0] != "B", kv[0] != "S", kv[0]))
    return ", ".join(f"${n} = {v}$" for n, v in shown)


def _and(items: Sequence[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


_PHASES = {"forward": "the forward pass", "loss": "the loss", "backward": "the backward pass",
           "step": "the optimizer step", "zero_grad": "zero_grad"}


def _peak(d: Any) -> dict[str, Any] | None:
    """The peak of a training step, where the convention follows the step and the regime is modelled."""
    from ..report.latex import escape

    if not d.has_peak:
        return None
    try:
        at = d.peak_at()
        layer = f" (layer {at.layer})" if getattr(at, "layer", None) else ""
        during = f"{_PHASES.get(at.phase, at.phase)}" + (f", at {at.node}{layer}" if at.node else "")
        during_tex = escape(_PHASES.get(at.phase, at.phase)) + (
            f", at \\texttt{{{escape(at.node)}}}{escape(layer)}" if at.node else "")
        return {"peak": d.value("peak"), "first": d.value("peak_first_step"), "where": at.where(),
                "during": during, "during_tex": during_tex, "live": d.live_at_peak()}
    except SymmemError:
        return None


def _where(text: str) -> str:
    from ..report.latex import escape

    return escape(text.replace(", steady step", ""))


def _by_model(rs: list[ModelRow]) -> dict[str, list[ModelRow]]:
    out: dict[str, list[ModelRow]] = {}
    for r in rs:
        out.setdefault(r.model, []).append(r)
    return out


def _title(rs: list[ModelRow], model: str) -> str:
    group = _by_model(rs)[model]
    return "ResNet-50" if group[0].analysis and model == "resnet50-v1" else names.model(model)


def _bytes_phrase(d: Any) -> str:
    from ..tensor import dtype_bytes

    act = d.regime.activation_dtype
    bpp = d.regime.bytes_per_parameter
    return (f"activations are {act} ({dtype_bytes(act)} bytes per element) and "
            f"{names.optimizer(d.regime.optimizer)} costs {bpp} bytes per parameter")


# -- tables -------------------------------------------------------------------------------------------------
def _stage_table(d: Any) -> str:
    from ..report.latex import escape

    out = []
    stem = d.groups()["stem"]
    out.append(rf"  stem (conv1, max-pool, indices) & & & {d.evaluate(stem) / MiB:.2f} & \\")
    for group, (printed_main, printed_down) in PRINTED_SPLIT.items():
        main = d.evaluate(d.sum(group=group, role="main_path")) / MiB
        down = d.evaluate(d.sum(group=group, role="downsample_input")) / MiB
        total = d.evaluate(d.groups()[group]) / MiB
        out.append(rf"  {escape(group)} & {main:.2f} & {down:.2f} & {total:.2f} & {printed_main} / {printed_down} \\")
    return "\n".join([
        r"\begin{table}[ht]", r"  \centering",
        r"  \caption{ResNet-50 saved activations per stage at $B = 64$ (MiB), main path ($6PHW$ per block) and "
        r"the stage input kept for the $1\times1$ projection. The last column is the split the FP32 analysis "
        r"prints, garbled for stages 2--4; its stage totals agree.}",
        r"  \label{tab:stages}", r"  \begin{tabular}{lrrrr}", r"  \toprule",
        r"  Stage & Main path & Downsample input & Total & Printed split \\", r"  \midrule", *out,
        r"  \bottomrule", r"  \end{tabular}", r"\end{table}"])


def _fit_rows(rs: list[ModelRow], budget: str, ds: dict[str, Any] | None = None) -> list[tuple[ModelRow, Any]]:
    """The largest batch of every row under ``budget``, solved from ``ds[label]`` (the derivation whose peak
    sizes the batch) or the row's own derivation."""
    from .budget import NoneAccepted, largest

    out: list[tuple[ModelRow, Any]] = []
    for r in rs:
        try:
            out.append((r, largest((ds or {}).get(r.label, r.d), "B", budget)))
        except NoneAccepted as e:  # what fits lies outside the domain (B = 1 where the formulas hold for B >= 2)
            out.append((r, e))
        except NothingFits:
            out.append((r, None))
        except SymmemError:  # memory that does not grow with B: every batch fits, or none does
            out.append((r, "flat"))
    return out


def _fit_table(fits: list[tuple[ModelRow, Any]], budget: str) -> str:
    from ..report.latex import escape
    from .budget import LIMITS, NoneAccepted

    peak = any(hasattr(f, "quantity") and f.quantity == "peak" for _, f in fits)
    out: list[str] = []
    caps: list[str] = []
    for r, f in fits:
        if f is None:
            out.append(rf"  {escape(r.label)} & \multicolumn{{3}}{{l}}{{nothing fits at $B = 1$}} \\")
        elif isinstance(f, NoneAccepted):
            said = "$B = 1$ fits" if f.best == 1 else rf"only $B \le {f.best:,}$ fit"
            why = escape(f.why.split(", where")[0])
            out.append(rf"  {escape(r.label)} & \multicolumn{{3}}{{l}}{{{said}, {why}}} \\")
        elif isinstance(f, str) and f == "flat":
            out.append(rf"  {escape(r.label)} & \multicolumn{{3}}{{l}}{{does not grow with $B$}} \\")
        elif f.bound is not None and f.bound != f.max:  # capped below what the budget fits: say where and why
            why = f.refused or ""
            why = f"they are {why}" if why.startswith(LIMITS) else f"the model refuses them ({why})"
            caps.append(rf"{escape(r.label)}: $B = {f.max + 1:,}$ to ${f.bound:,}$ would fit, but {escape(why)}")
            out.append(rf"  {escape(r.label)} & {f.max:,}$^{{\dagger}}$ & {f.total_at_max / GiB:.3f} & capped \\")
        else:
            out.append(rf"  {escape(r.label)} & {f.max:,} & {f.total_at_max / GiB:.3f} & {f.total_above / GiB:.3f} \\")
    what = "peak of a training step (PyTorch)" if peak else "total"
    # a traced module's other sizes are its example's (S = 16), not a model's defaults: said, never held silently
    held = [f"{escape(r.label)} at " + ", ".join(f"${n} = {v:,}$" for n, v in f.held) for r, f in fits
            if getattr(f, "held", None) and r.d.convention == "traced"]
    said = rf" Other sizes held: {'; '.join(held)} (\texttt{{--set}} answers at others)." if held else ""
    if caps:
        out.append(r"  \midrule")
        out.extend(rf"  \multicolumn{{4}}{{p{{0.9\linewidth}}}}{{\footnotesize $^{{\dagger}}$ {c}}} \\" for c in caps)
    return "\n".join([
        r"\begin{table}[H]", r"  \centering",
        rf"  \caption{{Largest batch size whose {what} fits {_budget(budget)}, solved from the formulas and "
        rf"checked at the boundary (GiB).{said}}}", r"  \label{tab:fit}", r"  \begin{tabular}{lrrr}", r"  \toprule",
        r"  Model & $B_{\max}$ & $M(B_{\max})$ & $M(B_{\max}+1)$ \\", r"  \midrule", *out, r"  \bottomrule",
        r"  \end{tabular}", r"\end{table}"])


def _peak_table(items: list[tuple[str, Any, dict[str, Any]]], caption: str, label: str) -> str:
    from ..report.latex import escape

    out = [rf"  {escape(name)} & {_gib(d.value('total'))} & {_gib(p['peak'])} & {_gib(p['first'])} & "
           rf"{_where(p['where'])} \\" for name, d, p in items]
    return "\n".join([
        r"\begin{table}[ht]", r"  \centering", r"  \small",
        rf"  \caption{{{caption}}}", rf"  \label{{{label}}}", r"  \begin{tabular}{lrrrl}", r"  \toprule",
        r"  Model & Total & Peak & First step & Where the peak is \\", r"  \midrule", *out, r"  \bottomrule",
        r"  \end{tabular}", r"\end{table}"])


# -- sections -----------------------------------------------------------------------------------------------
def _analysis_numbers(rs: list[ModelRow]) -> dict[str, str]:
    """The figures the analysis's sections quote, each printed from a derivation."""
    by = {r.label: r.d for r in rs if r.analysis}
    out: dict[str, str] = {}
    r = by.get("ResNet-50")
    if r is not None:
        idx = r.sum(role="indices")
        out |= {"rparams": f"{r.value('parameters'):,}", "ract": f"{r.evaluate(r.activations - idx) / MiB:.2f}",
                "ridx": f"{r.evaluate(idx) / MiB:.2f}", "rtotal": f"{r.value('total') / GiB:.4f}",
                "rprinted": f"{(r.value('activations') + 25.6e6 * 16) / GiB:.4f}"}
    return out


def _resnet_section(r: ModelRow, n: dict[str, str]) -> list[str]:
    from ..report.latex import equation

    return [
        r"\section{ResNet-50}",
        "Under the FP32 analysis's accounting each bottleneck keeps its three main-path convolution outputs "
        "($6PHW$ elements), the first block of a stage also keeps the stage input for its $1\\times1$ "
        "projection, and the stem keeps the conv1 and max-pool outputs and the 32-bit pool indices. The graph "
        f"(torchvision v1 geometry) has {n['rparams']} parameters. In bytes, with $B$ free:",
        equation(r"M_{\mathrm{ResNet}}", r.d.total, "eq:resnet"),
        f"Table~\\ref{{tab:stages}} splits the {n['ract']}\\,MiB of saved activations (plus {n['ridx']}\\,MiB "
        "of indices) by stage. The analysis's stage totals are right, but its split of stages 2--4 into main "
        "path and downsample input does not follow from its own formulas.",
        _stage_table(r.d),
        f"The total is {n['rtotal']}\\,GiB. The analysis prints 3.03\\,GiB because it rounds the parameter count "
        f"to 25.6\\,M (which gives {n['rprinted']}\\,GiB).",
    ]


def _vit_section(group: list[ModelRow]) -> list[str]:
    from ..api import derive
    from ..report.latex import expression
    from ..simplify import factored
    from ..symbols import B, H, S

    layers = {r.attention: derive("vit-b16", convention="paper", attention=r.attention, per_layer=True) for r in group}
    first = next(iter(layers.values()))
    bsh = first.evaluate(B * S * H)
    words = {"naive": "with naive attention (softmax probabilities materialized)",
             "sdpa": "with a fused SDPA/FlashAttention kernel"}
    tags = {"naive": "naive", "sdpa": "SDPA"}
    lines = [rf"  N_{{\mathrm{{{tags[a]}}}}} &= {expression(sympy.expand(d.activations / 4))}"
             for a, d in layers.items()]
    vit = group[0].d
    kind = "naive" if group[0].attention == "naive" else "fused"
    return [
        r"\section{ViT-B/16}",
        f"With $S = 197$ tokens, $H = 768$, $h = 12$ heads and $L = 12$ layers ($BSH = {bsh:,}$ at $B = 64$), "
        f"one layer keeps, in elements, {' and '.join(words[a] for a in layers)}:",
        "\n".join([r"\begin{align}", ", \\\\\n".join(lines) + ",", r"\end{align}"]),
        "that is " + " and ".join(f"{d.value('activations') / MiB:.2f}" for d in layers.values())
        + "\\,MiB per layer. The patch-embedding output is kept once. The whole model, "
        f"{kind} attention, in bytes, is $M_{{\\mathrm{{ViT}}}} = M_{{\\mathrm{{act}}}} + M_{{\\mathrm{{par}}}}$ with",
        "\n".join([r"\begin{align}",
                   rf"  M_{{\mathrm{{act}}}} &= {expression(factored(vit.activations))}, \\",
                   rf"  M_{{\mathrm{{par}}}} &= {expression(vit.parameter_memory)}.", r"\end{align}"]),
    ]


def _peak_in_b(d: Any, fit: Any) -> str:
    """The peak as a function of the batch size, every other symbol at its value, when it is short (the formula
    the largest batch was solved from, where there is one)."""
    from ..report.latex import expression, width
    from .budget import polynomial

    if hasattr(fit, "quantity") and fit.quantity == "peak":
        f = fit.formula
    else:
        try:
            _, f = polynomial(d, "B", "peak")
        except SymmemError:
            return ""
    tex = expression(f)
    if width(tex) > 2.2 * 345:
        return ""
    pieces = (f" the largest of {len(f.args)} pieces, one per moment of the step that can be the largest:"
              if isinstance(f, sympy.Max) else "")
    return (f"As a function of $B$, every other symbol at its value, the peak is{pieces} "
            f"\\[ M_{{\\mathrm{{peak}}}}(B) = {tex}. \\]")


def _generic_section(spec: Spec, group: list[ModelRow], title: str, fits: dict[str, Any]) -> list[str]:
    from ..report.factoring import in_sizes, meanings
    from ..report.latex import align, escape

    e = _entry(group[0].model, spec)
    d0 = group[0].d
    if in_sizes(d0):  # a formula in the model's own sizes (symmem trace --symbolic): how it was found, the field's way
        free = _and([f"${s.name}$" for s, _, _ in meanings(d0)])
        lead = (f"{escape(e.description)}: {d0.value('parameters'):,} parameters at the sizes below. In bytes, in "
                f"the model's own sizes {free} (each quantity the exact polynomial through traces of its code at "
                "small configurations, checked at two configurations it was not fitted to; the repeated layer first, "
                "the common factor outside; $\\Psi$ is the parameter count):")
    else:
        lead = (f"{escape(e.description)}: {d0.value('parameters'):,} parameters. In bytes, with "
                f"{_and([f'${s.name}$' for s in d0.free]) or 'no symbol'} free (a repeated layer written once, times "
                "its count; $\\Psi$ is the parameter count):")
    out = [rf"\section{{{escape(title)}}}", lead]
    for r in group:
        if len(group) > 1:
            out.append(f"With {escape(ATTENTION_LABELS.get(r.attention, str(r.attention)))}:")
        out.append("\n".join(ln for ln in align(r.d, lead=False).splitlines() if not ln.startswith("%")))
        d = r.d
        kept = (f"{_gib(d.value('activations'))}\\,GiB of activations kept at the end of forward and "
                f"{_gib(d.value('parameter_memory'))}\\,GiB of parameter side, {_gib(d.value('total'))}\\,GiB "
                "together")
        p = _peak(d)
        if p is None:
            sentence = f"At {_sizes(spec, r)} that is {kept}."
        else:  # the number that must fit leads; the kept memory is what it is made of at the end of forward
            live = ", ".join(f"{escape(c.replace('_', ' '))} {_gib(b)}" for c, b in p["live"].items()
                             if b >= 0.0005 * GiB)
            sentence = (f"At {_sizes(spec, r)} a steady training step peaks at {_gib(p['peak'])}\\,GiB, in "
                        f"{p['during_tex']} (alive then, GiB: {live}); the first step, which creates the optimizer "
                        f"state, at {_gib(p['first'])}\\,GiB. Beside it: {kept}.")
        out.append(sentence)
        if p is not None:
            formula = _peak_in_b(d, fits.get(r.label))
            if formula:
                out.append(formula)
    return out


def _comparison(spec: Spec, rs: list[ModelRow], analysis: bool) -> list[str]:
    from ..report.latex import escape

    out = [r"\section{Side by side}"]
    if analysis:
        printed = [r for r in rs if r.analysis]
        text = ("Table~\\ref{tab:memory} is the FP32 analysis's Table~1 recomputed (the analysis prints "
                + ", ".join(f"{escape(r.label)} {PRINTED_TOTALS[r.label]}\\,GiB" for r in printed) + ").")
    else:
        text = (f"Table~\\ref{{tab:memory}} sets {_and([escape(r.label) for r in rs])} side by side, counted as "
                f"{escape(names.CONVENTION_PHRASES.get(spec.convention, spec.convention))}.")
    if len(rs) > 1:
        base = rs[0]
        if analysis and base.label == "ResNet-50":
            ratios = ", ".join(f"{r.d.value('total') / base.d.value('total'):.3f} ({escape(r.label)})"
                               for r in rs[1:])
            text += f" The ViT:ResNet ratios are {ratios}."
        else:
            ratios = ", ".join(f"{escape(r.label)} {r.d.value('total') / base.d.value('total'):.3f}" for r in rs[1:])
            text += f" Their totals relative to {escape(base.label)}: {ratios}."
    out += [text, r"\input{generated/table1.tex}"]
    if any(_peak(r.d) for r in rs):
        out += ["The total adds up everything kept at the end of the forward pass and the whole parameter side. "
                "What must fit is the \\emph{peak}: the most memory alive at any moment of a training step "
                "(forward, loss, backward, optimizer step, \\texttt{zero\\_grad}), followed op by op by the "
                "\\texttt{pytorch} convention. Table~\\ref{tab:peak} sets the two side by side; the first step "
                "creates the optimizer state.",
                r"\input{generated/peak.tex}"]
    return out


def _pytorch_section(spec: Spec, rs: list[ModelRow], torch_ds: dict[str, Any], why: str, analysis: bool) -> list[str]:
    from ..api import derive
    from ..report.latex import escape, expression

    who = "The FP32 analysis's accounting" if analysis else {
        "paper": "The FP32 analysis's accounting", "megatron": "Korthikanti et al.'s accounting",
        "cs231n": "The CS231n memory rule"}.get(spec.convention, f"The {spec.convention} convention")
    inner = who[0].lower() + who[1:] if who.startswith("The ") else who  # "the FP32 analysis's accounting"
    out = [rf"\section{{{who} versus PyTorch autograd}}"]
    if not torch_ds:
        return out + [
            f"This section compares {inner} with what PyTorch's autograd keeps (the "
            "\\texttt{pytorch} convention). It is generated automatically once that convention derives every "
            f"model; in this build it cannot yet: \\texttt{{{escape(why[:160])}}}."]
    ratios = ", ".join(f"{escape(r.label)} {torch_ds[r.label].value('total') / r.d.value('total'):.2f}" for r in rs)
    out += [
        "The \\texttt{pytorch} convention keeps what eager PyTorch's autograd saves (one rule per op, each "
        f"storage counted once, the input batch apart). Table~\\ref{{tab:pytorch}} sets it beside "
        f"{inner}; \\emph{{Other}} is the input batch, which PyTorch keeps for the first layer.",
        r"\input{generated/pytorch.tex}"]
    if analysis:
        out.append(f"PyTorch needs more than the analysis counts (total ratios: {ratios}): autograd keeps every "
                   "op's inputs, the inputs of every linear layer and normalization (with its statistics) and the "
                   "GELU input.")
    else:
        out.append(f"PyTorch's totals relative to {inner}: {ratios}.")
    if any(r.model == "vit-b16" and r.analysis for r in rs):
        layers = {att: derive("vit-b16", convention="pytorch", attention=att, per_layer=True).activations
                  for att in ("naive", "sdpa")}
        out += ["\n".join([
            "Per ViT layer it keeps, in bytes,", r"\begin{align}",
            rf"  M^{{\mathrm{{PyTorch}}}}_{{\mathrm{{naive}}}} &= {expression(layers['naive'])}, \\",
            rf"  M^{{\mathrm{{PyTorch}}}}_{{\mathrm{{SDPA}}}} &= {expression(layers['sdpa'])},", r"\end{align}",
            "against $4(9BSH + BhS^2)$ and $4 \\cdot 9BSH$ in the analysis's accounting."])]
    if any(_peak(d) for d in torch_ds.values()):
        out += ["PyTorch also tells what must fit: following the training step op by op, the \\texttt{pytorch} "
                "convention gives the \\emph{peak} of a step, the most memory alive at any moment of forward, "
                "backward and the optimizer step (equal to real steps on CPU, byte for byte). "
                "Table~\\ref{tab:pytorchpeak} sets it beside PyTorch's total.",
                r"\input{generated/pytorchpeak.tex}"]
    return out


def _budget(budget: str) -> str:
    """``80GiB`` -> ``80\\,GiB``."""
    import re

    from ..report.latex import escape

    return re.sub(r"([0-9])\s*([A-Za-z])", r"\1\\,\2", escape(budget))


def _scaling(fits: list[tuple[ModelRow, Any]], budget: str, spec: Spec, rs: list[ModelRow]) -> list[str]:
    """What fits: the largest batch solved from the peak of a PyTorch training step where there is one (the
    accounting's own answer is quoted after it, labelled), the figure beside its text (never a page of its
    own: ``[H]``, and a paragraph follows it)."""
    from ..report.latex import escape

    peak = any(hasattr(f, "quantity") and f.quantity == "peak" for _, f in fits)
    what = "peak of a training step" if peak else "training memory"
    grows = ("The peak is the largest of a few functions of $B$, each linear in it"
             if peak else "Memory grows linearly in $B$")
    if any(r.attention == "naive" for r, _ in fits):
        grows += "; with naive attention it also grows as $S^2$"
    source = ""
    if peak and spec.convention != "pytorch":
        source = (" What must fit is what is alive at once, so the batch is sized from the peak of a PyTorch "
                  "training step (the \\texttt{pytorch} convention), not from the accounting.")
    out = [
        r"\section{Scaling}",
        f"{grows}.{source} Figure~\\ref{{fig:scaling}} and Table~\\ref{{tab:fit}} give the largest batch whose "
        f"{what} fits {_budget(budget)}, solved from the formulas.",
        "\n".join([r"\begin{figure}[H]", r"  \centering",
                   r"  \includegraphics[width=0.75\linewidth]{figures/scaling.pdf}",
                   rf"  \caption{{{what[0].upper() + what[1:]} against batch size with a budget of {_budget(budget)}; "
                   r"dots mark the largest batch that fits.}", r"  \label{fig:scaling}", r"\end{figure}"]),
        r"\input{generated/fit.tex}",
    ]
    sized = [(r, f) for r, f in fits if hasattr(f, "max")]
    if peak and spec.convention != "pytorch" and sized:
        from .budget import largest

        counted, over = [], []
        for r, f in sized:
            try:
                b = largest(r.d, "B", budget, quantity="total").max
            except SymmemError:  # nothing fits, or no growth in B: no batch to quote
                continue
            counted.append(f"{b:,} for {escape(r.label)} (the peak allows {f.max:,})")
            over.append(b > f.max)
        if counted:
            who = escape(names.CONVENTION_PHRASES.get(spec.convention, spec.convention))
            why = ("more than fits: the accounting leaves out tensors autograd keeps and the temporaries of the "
                   "backward pass and the optimizer step" if all(over) else
                   "not what fits: an accounting says what is kept, not what is alive at once")
            out.append(f"Sized from the total counted as {who} instead, the largest batch would be "
                       f"{_and(counted)}; {why}.")
    else:
        out.append(f"Every batch up to these sizes fits {_budget(budget)}; the next one does not (the last two "
                   "columns of Table~\\ref{tab:fit}).")
    return out


def _intro(spec: Spec, rs: list[ModelRow], analysis: bool) -> str:
    from ..report.latex import escape

    d = rs[0].d
    models = _and([escape(_title(rs, m)) for m in _by_model(rs)])
    regime = f"{names.precision(spec.precision)} {names.optimizer(spec.optimizer)}"
    text = ("A training step keeps the parameter side (weights, gradients and optimizer state) and the activations "
            "the forward pass saves for the backward pass. ")
    if analysis:
        text += (f"We recompute the FP32 AdamW accounting of {models} (ViT-B/16 is DeiT-Base) at $224\\times224$ and "
                 "$B = 64$ from the FP32 analysis of ResNet-50 and ViT-B/16 by Bandyopadhyay (2024) exactly: every "
                 "equation, number and table below is printed by \\texttt{symmem} from a graph of the network with "
                 "symbolic shapes. ")
    else:
        text += (f"We derive the {escape(regime)} training memory of {models}, counted as "
                 f"{escape(names.CONVENTION_PHRASES.get(spec.convention, spec.convention))}: every equation, number "
                 "and table below is printed by \\texttt{symmem} from a graph of the network with symbolic shapes. ")
        if spec.checkpoint != "none":
            text += f"The repeated layers are checkpointed (\\texttt{{{escape(spec.checkpoint)}}}). "
        if spec.loss:
            text += f"A {escape(spec.loss)} loss follows each model. "
    if any(_peak(r.d) for r in rs):
        text += ("The convention follows the training step op by op, so each model also has a \\emph{peak}: the "
                 "most memory alive at any moment of the step, which is what must fit on a device. ")
    text += ("Units are binary: 1\\,MiB $= 2^{20}$ and 1\\,GiB $= 2^{30}$ bytes; "
             + ("FP32 is 4 bytes per element and AdamW costs 16 bytes per parameter." if analysis
                else escape(_bytes_phrase(d)) + "."))
    return text


def _abstract(spec: Spec, rs: list[ModelRow], analysis: bool) -> str:
    from ..report.latex import escape

    groups = _by_model(rs)
    pieces = []
    for model, group in groups.items():
        title = escape(_title(rs, model))
        digits = 4 if group[0].analysis and model == "resnet50-v1" else 3
        if len(group) == 1:
            pieces.append(f"{_gib(group[0].d.value('total'), digits)}\\,GiB for {title}")
        else:
            kinds = {"naive": "naive attention", "sdpa": "fused attention"}
            pieces.append(" or ".join(f"{_gib(r.d.value('total'), digits)}\\,GiB "
                                      f"({kinds.get(r.attention, str(r.attention))})" for r in group)
                          + f" for {title}")
    sizes = {_sizes(spec, r) for r in rs}
    at = (f"At {sizes.pop()}" if len(sizes) == 1
          else "At " + _and([f"{_sizes(spec, g[0])} ({escape(_title(rs, m))})" for m, g in groups.items()]))
    conv = "" if analysis else f", counted as {escape(names.CONVENTION_PHRASES.get(spec.convention, spec.convention))}"
    text = (f"Closed-form training-memory formulas for {_and([escape(_title(rs, m)) for m in groups])} under "
            f"{escape(names.precision(spec.precision))} and {escape(names.optimizer(spec.optimizer))}, derived from "
            f"the networks' graphs with symbolic shapes{conv}. {at} they give {_and(pieces)}.")
    peaks = [(r, _peak(r.d)) for r in rs]
    if all(p for _, p in peaks):
        text += (" A training step peaks at " + _and([f"{_gib(p['peak'])}\\,GiB for {escape(r.label)}"
                                                        for r, p in peaks]) + ".")
    return text


MAIN = r"""\documentclass[11pt]{article}
\usepackage[margin=2.5cm]{geometry}
\usepackage{amsmath}
\allowdisplaybreaks
\usepackage{booktabs}
\usepackage{graphicx}
\usepackage{float}
%% Floats sit with their text: no page of floats alone unless it is nearly full.
\renewcommand{\topfraction}{0.85}
\renewcommand{\textfraction}{0.1}
\renewcommand{\floatpagefraction}{0.8}
\title{%(title)s}
\author{Generated by symmem %(version)s}
\date{}
\begin{document}
\maketitle
\begin{abstract}
%(abstract)s
\end{abstract}
\input{generated/body.tex}
\end{document}
"""


def sources(spec: Spec | None = None) -> tuple[dict[str, str], Any, bool]:
    """Everything the paper writes, by path under its directory (LaTeX text), the scaling figure, and whether
    the ``pytorch`` comparison could be derived."""
    from .. import __version__
    from ..report.latex import escape, table
    from ..report.plots import scaling

    spec = spec or Spec()
    rs = rows(spec)
    analysis = any(r.analysis for r in rs)
    regime = names.regime(spec.precision, spec.optimizer)
    sizes = {_sizes(spec, r) for r in rs}
    at = (sizes.pop() if len(sizes) == 1
          else "; ".join(f"{_sizes(spec, g[0])} ({names.model(m)})" for m, g in _by_model(rs).items()))
    at = at.replace("$", "")
    files = {"generated/table1.tex": table([(r.label, r.d) for r in rs], caption=f"{regime} training memory, {at}")}
    peaks = [(r.label, r.d, p) for r in rs if (p := _peak(r.d))]
    if peaks:
        files["generated/peak.tex"] = _peak_table(
            peaks, f"Total and peak of a training step, {escape(regime)} (GiB); the peak of a steady step and of the "
            "first, and where the steady one occurs.", "tab:peak")
    body = [_intro(spec, rs, analysis)]
    body[0] = r"\section{Introduction}" + "\n\n" + body[0]
    numbers = _analysis_numbers(rs)
    torch_ds: dict[str, Any] = {}
    why = ""
    if spec.convention != "pytorch":
        torch_ds, why = _pytorch(spec, rs)
    # What fits is sized from the peak of a PyTorch step: the pytorch derivations where the paper counts another way.
    fits = _fit_rows(rs, spec.budget, {k: v for k, v in torch_ds.items() if _peak(v)})
    for model, group in _by_model(rs).items():
        if group[0].analysis and model == "resnet50-v1":
            body += _resnet_section(group[0], numbers)
        elif group[0].analysis and model == "vit-b16":
            body += _vit_section(group)
        else:
            body += _generic_section(spec, group, _title(rs, model), {r.label: f for r, f in fits})
    body += _comparison(spec, rs, analysis)
    if spec.convention != "pytorch":
        if torch_ds:
            pairs = [(k, v) for r in rs for k, v in ((r.label, r.d), (r.label, torch_ds[r.label]))]
            who = "The FP32 analysis's accounting" if analysis else names.convention(spec.convention)
            files["generated/pytorch.tex"] = table(pairs, caption=f"{who} vs PyTorch autograd, {at}",
                                                   label="tab:pytorch")
            tpeaks = [(k, v, p) for k, v in torch_ds.items() if (p := _peak(v))]
            if tpeaks:
                files["generated/pytorchpeak.tex"] = _peak_table(
                    tpeaks, "What PyTorch keeps at the end of the forward pass plus the parameter side (total) and "
                    "the peak of a training step under PyTorch (GiB).", "tab:pytorchpeak")
        body += _pytorch_section(spec, rs, torch_ds, why, analysis)
    files["generated/fit.tex"] = _fit_table(fits, spec.budget)
    body += _scaling(fits, spec.budget, spec, rs)
    files["generated/body.tex"] = "\n\n".join(body)
    titles = [escape(_title(rs, m)) for m in _by_model(rs)]
    if spec.precision == "fp32":
        title = f"FP32 Training Memory of {_and(titles)}, Derived"
    else:
        title = f"Training Memory of {_and(titles)} in {escape(names.precision(spec.precision))}, Derived"
    files["main.tex"] = MAIN % {"version": __version__, "title": title, "abstract": _abstract(spec, rs, analysis)}
    fig = scaling([torch_ds.get(r.label, r.d) if _peak(torch_ds.get(r.label, r.d)) else r.d for r in rs],
                  [r.label for r in rs], "B", spec.budget, fits=[f if hasattr(f, "formula") else None for _, f in fits])
    return files, fig, bool(torch_ds)


def write(directory: str | Path, spec: Spec | None = None, compile: bool = True, force: bool = False) -> Paper:
    """Write the paper's sources into ``directory`` and compile them when LaTeX is installed.

    ``spec`` names the models and options (default: the paper on ResNet-50 and ViT-B/16).  ``directory`` may not
    exist yet (its parent must).  An existing ``main.tex`` in ``directory`` is never overwritten unless
    ``force``; everything is derived and drawn before the first file is written, and each file is written whole
    or not at all (:mod:`symmem.files`).
    """
    import matplotlib.pyplot as plt

    from ..files import output_path, write_text
    from ..report.plots import save

    out = output_path(directory, what="paper's output", directory=True)
    tex = out / "main.tex"
    if not force and (tex.exists() or tex.is_symlink()):
        raise SymmemError(f"{str(tex)[:80]!r} exists: the paper would overwrite it; choose another directory or "
                          "give --force (force=True)")
    files, fig, pytorch = sources(spec)
    try:
        for sub in ("", "generated", "figures"):
            try:
                (out / sub).mkdir(exist_ok=True)
            except OSError as exc:
                raise SymmemError(f"cannot create {str(out / sub)[:80]!r}: {exc.strerror or exc}") from None
        for name, text in files.items():
            if name != "main.tex":
                write_text(out / name, text + "\n")
        save(fig, out / "figures" / "scaling.pdf")
    finally:
        plt.close(fig)
    write_text(tex, files["main.tex"])
    pdf, note = (_compile(tex) if compile else (None, "not compiled (compile=False)"))
    return Paper(out, tex, pdf, pytorch, note)


def _compile(tex: Path) -> tuple[Path | None, str]:
    if shutil.which("latexmk"):
        cmd = ["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error", tex.name]
    elif shutil.which("pdflatex"):
        cmd = ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", tex.name]
    else:
        return None, "no latexmk or pdflatex on PATH: wrote the .tex files only"
    runs = 2 if cmd[0] == "pdflatex" else 1  # pdflatex needs a second pass for the references
    for _ in range(runs):
        try:
            done = subprocess.run(cmd, cwd=tex.parent, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise SymmemError(f"{cmd[0]} ran for more than 300 s on {tex}; the sources are written, compile "
                              "them by hand") from None
        except OSError as exc:
            raise SymmemError(f"{cmd[0]} could not run on {tex}: {exc.strerror or exc}") from None
        if done.returncode != 0:
            errors = [ln for ln in done.stdout.splitlines() if ln.startswith("!")]
            first = errors[0] if errors else (done.stdout.strip().splitlines() or ["no output"])[-1]
            raise SymmemError(f"{cmd[0]} failed on {tex} (see {tex.with_suffix('.log')}): {first[:200]}")
    return tex.with_suffix(".pdf"), f"compiled with {cmd[0]}"
