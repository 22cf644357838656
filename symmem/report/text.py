"""Plain views of a derivation: the JSON contract and a text table.

>>> from symmem import derive
>>> d = derive("resnet50-v1", convention="paper")
>>> out = d.to_dict()
>>> out["values"]["parameters"], out["expressions"]["activations"]
(25557032, '44355584*B')
"""

from __future__ import annotations

import functools
import textwrap
from typing import TYPE_CHECKING, Any

import sympy

from ..errors import SymmemError
from ..passes.data_parallel import rank_peaks, rank_ranges
from ..passes.rank_formulas import rank_formulas
from ..passes.rank_side import parameter_side_per_rank
from ..passes.zero_redundancy import partition_at, state_per_rank
from ..printing import text
from ..simplify import factored, rounded
from ..symbols import N
from ..units import UNITS
from .factoring import field, fields, in_sizes, legend
from .headline import LABELS, PEAK_LABEL, name_of, papers_stage, peak_state, per_device

if TYPE_CHECKING:
    from ..derivation import Derivation

KEYS = ("activations", "parameter_memory", "total")
EXTRA_KEYS = ("input", "loss", "transient")


#: the JSON contract's version: 2 added the peak, the full regime and the schema version itself
SCHEMA_VERSION = 2


def field_form(d: Derivation, e: sympy.Expr, total: bool = False) -> str:
    """A quantity factored for the table: around its leading term (``B*H*L*S*(36 + 4/L + 4*S*h/H)``); a formula in
    every size (:mod:`symmem.importer.symbolic_sizes`) the field's way (:func:`symmem.report.factoring.field`: the
    layer first, the largest common monomial outside, the sizes in the customary order: ``4*B*L*(H + F)``, not
    ``B*F*L*(4 + 4*H/F)``); the ``total``: its kept memory, then its parameter side)."""
    if in_sizes(d):
        return fields(e - d.parameter_memory, d.parameter_memory).text() if total else field(e).text()
    return _text(e, factor=True)


def _shown(d: Derivation, e: sympy.Expr, total: bool = False) -> str:
    """A formula as the table shows it: rounded, and in a model's own sizes the field's way (the ``total``: the
    kept memory, then the parameter side)."""
    if not in_sizes(d):
        return _text(e)
    return field_form(d, rounded(e), total)


def _text(e: sympy.Expr, factor: bool = False) -> str:
    """``str(rounded(e))`` (``factor``: ``str(factored(e))``), printed once per expression: a table prints the same
    formulas at every width, fold and cut, and a view prints its derivation's again (printing a large sum is most
    of a table's time).  A formula with a float (a dropout probability) is printed each time: sympy's floats of
    different precisions compare equal but print differently."""
    if e.has(sympy.Float):
        return text(factored(e)) if factor else text(rounded(e))
    return _printed(e, factor)


@functools.lru_cache(maxsize=1024)  # bounded: a long session's formulas are not all kept
def _printed(e: sympy.Expr, factor: bool) -> str:
    return text(factored(e)) if factor else text(rounded(e))


def step_peaks(d: Derivation) -> list[tuple[str, int, Any]]:
    """``(key, bytes, moment)`` of the steady (``peak``) and first step's (``peak_first_step``) peak at the
    derivation's numbers; empty where the convention has no step model or the step cannot be evaluated there
    (:func:`peak_state` says why)."""
    return peak_state(d)[0]


def peak(d: Derivation) -> dict[str, Any] | None:
    """The peak of the training step for the JSON contract (None where there is none: :func:`peak_state`): the
    steady and first step's bytes and formulas, where the steady peak occurs and what is alive then."""
    found = step_peaks(d)
    if not found:
        return None
    (_, steady, at), (_, first, _) = found
    out = {"values": {"peak": steady, "peak_first_step": first},
           "expressions": {"peak": text(d.peak), "peak_first_step": text(d.peak_first_step)},
           "peak_at": {"phase": at.phase, "node": at.node, "layer": at.layer or None, "step": at.step},
           "live_at_peak": d.live_at_peak()}
    ranks = rank_peaks(d)
    if ranks:  # FSDP's ranks differ (padding): the peak is rank 0's, the largest (passes/data_parallel.py)
        out["values"]["peak_per_rank"] = {str(r): {"peak": s, "peak_first_step": f} for r, (f, s) in ranks.items()}
        out["peak_at"]["rank"] = getattr(at, "rank", 0)  # ZeRO-1's moments say which rank (passes/zero_redundancy)
        state = state_per_rank(d)
        if state:
            out["values"]["optimizer_state_per_rank"] = {str(r): v for r, v in enumerate(state)}
            out["peak_at"]["partition_at"] = partition_at(d)  # the numbers the formulas hold at
    formulas = rank_formulas(d) if ranks else None
    if formulas:  # each distinct rank's peak as a formula in N and the sizes (passes/rank_formulas.py)
        printed = {d.peak: out["expressions"]["peak"], d.peak_first_step: out["expressions"]["peak_first_step"]}
        out["expressions"]["peak_per_rank"] = [f.as_dict(printed) for f in formulas]
    side = parameter_side_per_rank(d)
    if side:  # what each rank of the engine holds (FSDP's padding, Adam's step counts): passes/rank_side.py
        out["values"]["parameter_side_per_rank"] = {str(r): v for r, v in side.items()}
    pinned = at.pinned() if hasattr(at, "pinned") else ""
    if pinned:  # a pipeline's formulas: the schedule's numbers they hold at (passes/pipeline_formula.py)
        out["peak_at"]["formula_at"] = pinned
        stages = d.step.stage_moments(d.numbers)
        out["expressions"]["peak_per_stage"] = [text(m.total) for m in stages]
        out["peak_at"]["formula_at_per_stage"] = [m.pinned() for m in stages]
    each = getattr(d.step, "per_rank", None)
    if callable(each):  # tensor parallelism: every rank alike, the peak is rank 0's (passes/tensor_step.py)
        out["peak_at"]["rank"] = each(d.numbers)["peak_rank"]
    return out


def to_dict(d: Derivation) -> dict[str, Any]:
    """The stable JSON contract: see "JSON output" in docs/reference.md."""
    import dataclasses

    from .latex import expression  # the text table needs no LaTeX printer

    keys = KEYS + tuple(k for k in EXTRA_KEYS if d.expression(k) != 0)
    exprs = {k: d.expression(k) for k in keys}

    def tex(e: sympy.Expr, total: bool = False) -> str:  # in a model's own sizes the field's way, as every view
        if not in_sizes(d):
            return expression(e)
        form = fields(e - d.parameter_memory, d.parameter_memory) if total else field(e)
        return form.latex(printer=expression)

    values: dict[str, int | None] = {k: d.try_evaluate(e) for k, e in exprs.items()}
    values["parameters"] = d.try_evaluate(d.parameters)
    step = peak(d)
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "model": d.model,
        "convention": d.convention,
        "optimizer": d.regime.optimizer,
        "precision": d.regime.precision,
        "per_layer": d.per_layer,
        "layer": d.layer,
        "options": {k: v for k, v in d.options.items() if isinstance(v, str | int | float | bool)},
        "free": [s.name for s in d.free],
        "symbols": {s.name: v for s, v in sorted(d.numbers.items(), key=lambda kv: kv[0].name)},
        "expressions": {k: str(e) for k, e in exprs.items()} | {"parameters": str(d.parameters)},
        "factored": {k: field_form(d, e, k == "total") for k, e in exprs.items()},
        "latex": {k: tex(e, k == "total") for k, e in exprs.items()} | {"parameters": tex(d.parameters)},
        "values": values,
        "bytes_per_parameter": dict(d.regime.components()),
        "regime": dataclasses.asdict(d.regime),
        "parameter_breakdown": parameter_breakdown(d),
        "breakdown": [
            {"name": t.name, "group": t.group, "category": t.category, "role": t.role, "dtype": t.dtype,
             "count": str(t.count), "expr": str(t.expr), "latex": expression(t.expr),
             "bytes": d.try_evaluate(t.expr)}
            for t in d.terms
        ],
    }
    if d.domain is not sympy.true:
        out["domain"] = str(d.domain)
    if in_sizes(d):  # a formula in the model's own sizes: what each symbol stands for
        out["legend"] = legend(d)
    if d.notes:
        out["notes"] = list(d.notes)
    if step is None:
        # the number that must fit, absent: null, and why in one line (as every other view says it)
        out["values"].update({"peak": None, "peak_first_step": None})
        out["peak_refused"] = peak_state(d)[1]
    else:
        out["values"].update(step["values"])
        out["expressions"].update(step["expressions"])
        out["peak_at"] = step["peak_at"]
        out["live_at_peak"] = step["live_at_peak"]
        each = per_device(d)
        if each is not None:  # pipeline stages: every stage's peak, the largest is values.peak
            out["values"]["peak_per_stage"] = each["peak_per_stage"]
            out["values"]["peak_first_step_per_stage"] = each["peak_first_step_per_stage"]
            out["peak_at"]["stage"] = each["peak_stage"]
    return out


def parameter_breakdown(d: Derivation) -> list[dict[str, Any]]:
    """Per parameter-side component: nominal bytes per parameter element (None where the state is not
    elementwise: Adafactor's factored statistics, 8-bit block scales), what ZeRO shards it by, its formula,
    its bytes on one device and its bytes per model parameter."""
    nominal = dict(d.regime.components())
    params = d.try_evaluate(d.parameters)
    out = []
    for t in d.terms:
        if t.category != "parameter":
            continue
        b = d.try_evaluate(t.expr)
        out.append({"name": t.name, "class": d.regime.kind_of(t.name), "bytes_per_element": nominal.get(t.name),
                    "sharded_by": "N" if d.regime.shard(t.name) else None, "expr": str(t.expr), "bytes": b,
                    "per_parameter": None if b is None or not params else b / params})
    return out


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / UNITS['MiB']:12.2f}"


#: Width of :func:`table` when it is not written to a terminal.
WIDTH = 100
_NAME = 44  # the widest name column


def terminal_width(default: int = WIDTH) -> int:
    """The terminal's width in columns when standard output is a terminal, else ``default``."""
    import shutil
    import sys

    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size((default, 24)).columns
    except (AttributeError, ValueError, OSError):
        pass
    return default


def _breaks(text: str) -> list[tuple[int, int, int, int]]:
    """Where ``text`` (a sympy ``str``) may go on to a new line: (index the next line starts at, index this line
    ends at, bracket depth, kind): before a binary ``+``/``-`` (kind 0), after ``, `` (1) or after ``*`` (2)."""
    out, depth = [], 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch in "+-" and 0 < i < len(text) - 1 and text[i - 1] == " " and text[i + 1] == " ":
            out.append((i, i - 1, depth, 0))
        elif ch == "," and i + 1 < len(text) and text[i + 1] == " ":
            out.append((i + 2, i + 1, depth, 1))
        elif ch == "*" and text[i + 1:i + 2] != "*" and text[i - 1:i] != "*":
            out.append((i + 1, i + 1, depth, 2))
    return out


def wrap(text: str, width: int) -> list[str]:
    """``text`` (a formula) on lines of at most ``width`` characters, cut only where a new line may start:
    before a ``+``/``-`` (the line after starts with it), after ``, `` or, failing those, after ``*``; at the
    shallowest bracket depth that still fills a third of the line.  Joining the lines with single spaces gives
    a text that parses to the same formula.  A piece with no place to cut within ``width`` characters stays
    whole (longer than ``width``).

    >>> wrap("192*H**2*L + 208*H*L + 16*H*S + 28352*H + 16000", 30)
    ['192*H**2*L + 208*H*L + 16*H*S', '+ 28352*H + 16000']
    """
    width = max(width, 8)
    lines, start = [], 0
    cuts = _breaks(text)
    while len(text) - start > width:
        fits = [c for c in cuts if start < c[1] and c[1] - start <= width]
        if not fits:
            later = [c for c in cuts if c[1] > start]
            if not later:
                break
            nxt, end = later[0][:2]
        else:
            # the shallowest, best kind of cut that still fills a third of the line; the last such one
            full = [c for c in fits if 3 * (c[1] - start) >= width] or fits
            best = min((c[2], c[3]) for c in full)
            nxt, end = max(c for c in full if (c[2], c[3]) == best)[:2]
        lines.append(text[start:end].rstrip())
        start = nxt
    lines.append(text[start:].strip())
    return [ln for ln in lines if ln]


def _cell(text: str, width: int, cut: bool) -> list[str]:
    """``text`` on lines of at most ``width`` characters: :func:`wrap`, and where a piece has no place to cut
    (a long number, a note in words), that piece wrapped at its spaces, a word wider than ``width`` in pieces; with
    ``cut``, one line cut with an ellipsis."""
    if not cut:
        out: list[str] = []
        for line in wrap(text, width):
            out += [line] if len(line) <= width else textwrap.wrap(line, max(width, 1), break_on_hyphens=False)
        return out
    return [text if len(text) <= width else text[:width - 1] + "…"]


def headline(d: Derivation, width: int, state: tuple[list[Any], str | None] | None = None) -> list[str]:
    """The first line after the title: the peak of a training step, the number that must fit, and where it
    occurs; or, where there is none, why (:func:`peak_state`), in one line (wrapped at ``width``)."""
    found, why = peak_state(d) if state is None else state
    if not found:
        return textwrap.wrap(f"{why}", width, break_on_hyphens=False)  # "no peak: ..." in one line (wrapped)
    _, v, moment = found[0]
    return textwrap.wrap(f"{PEAK_LABEL}: {v / UNITS['GiB']:.3f} GiB ({v / UNITS['MiB']:.2f} MiB) at "
                         f"{moment.where(step=False)}", width, break_on_hyphens=False)


#: the width of a total's name in the table's last lines (the longest: ``kept after forward + parameters``)
_KEY = max(20, *(len(x) for x in LABELS.values()))


def table(d: Derivation, width: int | None = None, fold: bool = False, cut: bool = False,
          state: tuple[list[Any], str | None] | None = None) -> str:
    """Groups and terms with their formulas and MiB, then the totals in MiB and GiB.

    No line is wider than ``width`` columns (default: the terminal's width on a terminal, else 100): a long
    formula goes on over continuation lines (nothing is cut), and a name too long for its column gets a line
    of its own.  ``fold=True`` shows one row per group without its terms; ``cut=True`` cuts each formula to
    one line, marking the cut with ``…`` (narrow output, information lost).  Rows are in the
    derivation's order.
    """
    width = terminal_width() if width is None else width
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise SymmemError(f"width is a number of columns, a positive integer, not {width!r}")
    title = d.title()
    symbols = "symbols: " + ", ".join(f"{s.name}={v}" for s, v in sorted(d.numbers.items(),
                                                                         key=lambda kv: kv[0].name))
    rows: list[tuple[str, sympy.Expr]] = []
    for group, expr in d.groups().items():
        rows.append((group, expr))
        if fold:
            continue
        for t in d.terms:
            if t.group == group and t.category != "parameter" and group != "input":
                rows.append((f"  {t.name}" + (f" [{t.role}]" if t.role else ""), t.expr))
    name = max(len("group / term"), min(_NAME, max((len(label) for label, _ in rows), default=0), width - 14 - 20))
    formula = max(width - name - 14, 20 if width >= 46 else 14)  # 12 + 14 + 14 = 40 columns, the narrowest
    lines = textwrap.wrap(title, width) + _cell(symbols, width, False)
    if in_sizes(d):
        lines += textwrap.wrap("where " + "; ".join(legend(d)), width, break_on_hyphens=False)
    if d.domain is not sympy.true:
        lines += _cell(f"holds where: {d.domain}", width, False)
    for note in d.notes:
        lines += textwrap.wrap(f"NOTE: {note}", width)
    lines += headline(d, width, state)
    header = "formula (bytes)" if formula >= 15 else "bytes"
    lines += ["", f"{'group / term':<{name}} {header:<{formula}} {'MiB':>12}", "-" * (name + formula + 14)]
    for label, expr in rows:
        cells = _cell(_shown(d, expr), formula, cut)
        if len(label) > name:  # a long name on a line of its own (in pieces if it is wider than the table)
            lines += [label[i:i + width] for i in range(0, len(label), width)]
            label = ""
        lines.append(f"{label:<{name}} {cells[0]:<{formula}} {_mib(d.try_evaluate(expr))}")
        lines += [f"{'':<{name}} {c}" for c in cells[1:]]
    lines.append("-" * (name + formula + 14))
    short = width < _KEY + 62  # the long names leave a formula fewer than 24 columns: the short ones
    key_width = 20 if short else _KEY
    keys = KEYS + tuple(k for k in EXTRA_KEYS if d.expression(k) != 0)
    for key in keys:
        e = d.expression(key)
        v = d.try_evaluate(e)
        gib = "" if v is None else f"{v / UNITS['GiB']:10.3f} GiB"
        shown = field_form(d, rounded(e)) if key == "activations" else _shown(d, e, key == "total")
        lines += _totals(f"{name_of(key, short):<{key_width}} {_mib(v)} MiB {gib}   = ", shown, width, cut)
    params = d.try_evaluate(d.parameters)
    lines += _totals(f"{'parameters':<{key_width}} {'?' if params is None else f'{params:,}':>12}   = ",
                     _shown(d, d.parameters), width, cut)
    return "\n".join(ln.rstrip() for ln in lines)


def summary(d: Derivation, width: int | None = None, fold: bool = False, cut: bool = False) -> str:
    """:func:`table`, then the peak of a training step where the convention models the step (what
    ``symmem derive`` prints and ``str(derivation)`` shows)."""
    width = terminal_width() if width is None else width
    state = peak_state(d)  # the values and moments only: the JSON's whole Max is a tenth of a second to print
    lines = _peak_lines(d, width, cut, state)
    return table(d, width, fold, cut, state) + ("\n" + "\n".join(ln.rstrip() for ln in lines) if lines else "")


def _peak_lines(d: Derivation, width: int, cut: bool, state: tuple[list[Any], str | None]) -> list[str]:
    """The peak of the training step: its bytes, where it occurs, and the formula of that moment (the peak's
    formula is a Max over moments; the one shown is the largest at these sizes); where there is none, why."""
    found, why = state
    if not found:
        return []  # the headline said why
    short = width < _KEY + 62
    key_width = 20 if short else _KEY
    total = (f"{name_of('total', short)} = the tensors kept at the end of the forward pass + the parameter side"
             + (" as the papers count one pipeline stage (L/p layers, the micro-batches in flight, the embedding and "
                "the head both: no stage holds exactly this, and a stage's peak can be below it)"
                if papers_stage(d) else ""))
    lines = ["", *textwrap.wrap(f"{total}; peak = the most memory alive at any moment of a training step "
                                "(forward, backward, optimizer step), what must fit:", max(width, 40))]
    count = d.peak_candidates()
    for key, v, moment in found:
        name = "peak" if key == "peak" else "peak (first step)"
        lines += _totals(f"{name:<{key_width}} {_mib(v)} MiB {v / UNITS['GiB']:10.3f} GiB   at ",
                         moment.where(step=False), width, cut)
        if key == "peak":
            head, formula = f"{'':<{key_width}} {'':>12}       = ", _shown(d, moment.total)
            note = f"(the largest of {count} moments at these sizes)" if count > 1 else ""
            pinned = moment.pinned() if hasattr(moment, "pinned") else ""  # a pipeline's: the schedule's numbers
            if pinned:
                note = f"({pinned}; {note[1:]}" if note else f"({pinned})"
            room = width - len(head) if width - len(head) >= 24 else width - 4  # as _totals lays it out
            beside = not pinned or len(formula) + len(note) + 3 <= room  # a pipeline's note beside a short one
            if not note or cut or (beside and all(len(x) <= room for x in wrap(f"{formula}   {note}", room))):
                lines += _totals(head, formula + (f"   {note}" if note else ""), width, cut)
            else:
                # the note in words on lines of its own, under the formula, where it does not fit beside it
                lines += _totals(head, formula, width, cut)
                indent = " " * (width - room)
                lines += textwrap.wrap(note, width, initial_indent=indent, subsequent_indent=indent)
    ranks = rank_peaks(d)
    if ranks:  # FSDP's ranks differ (padding): the lines above are rank 0's, the largest
        lines += textwrap.wrap("peak per rank (first step / steady): " + "; ".join(
            f"rank{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: {f:,} / {v:,} B"
            for a, b, (f, v) in rank_ranges(ranks))
            + f" (the peak above is rank {getattr(d.peak_at(), 'rank', 0)}'s, the largest)" + _partition_note(d),
            max(width, 40))
        lines += _rank_formula_lines(d, width, cut)
    side = parameter_side_per_rank(d)
    if side:  # the engine's parameter side per rank, beside the papers' total (passes/rank_side.py)
        lines += textwrap.wrap("parameter side per rank (weights + gradients + optimizer state, with FSDP's padding "
                               "and Adam's step counts): " + "; ".join(
                                   f"rank{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: {v:,} B"
                                   for a, b, v in rank_ranges({r: x["total"] for r, x in side.items()})),
                               max(width, 40))
    each = per_device(d)
    if each is not None:
        for key, name in (("peak_per_stage", "peak per stage (MiB)"), ("peak_first_step_per_stage", "first step")):
            stages = ", ".join(f"{i}: {v / UNITS['MiB']:.2f}" for i, v in enumerate(each[key]))
            lines += _totals(f"{name:<{key_width}} {'':>12}           ", stages, width, cut)
    return lines


def _rank_formula_lines(d: Derivation, width: int, cut: bool) -> list[str]:
    """Each distinct rank's peak as a formula (its largest moment at these sizes), grouped in N ("ranks 0..N-2",
    "rank N-1"): passes/rank_formulas.py; nothing where the ranks have none here."""
    formulas = rank_formulas(d)
    if not formulas:
        return []
    lines = ["peak per rank as formulas (each group's largest moment at these sizes; the groups are those at "
             f"N = {d.numbers[N]}):"]
    for f in formulas:
        note = f"   ({f.held_at})" if f.held_at else ""
        lines += _totals(f"  {f.label}: ", _shown(d, f.peak if f.largest is None else f.largest) + note, width, cut)
    return lines


def _partition_note(d: Derivation) -> str:
    """Where ZeRO-1's peak holds: the numbers its partition is computed at ('' under another engine)."""
    at = partition_at(d)
    return f"; ZeroRedundancyOptimizer's partition, and these formulas, at {_listing(at)}" if at else ""


def _listing(values: dict[str, int]) -> str:
    return ", ".join(f"{k} = {v:,}" for k, v in values.items())


def _totals(head: str, formula: str, width: int, cut: bool) -> list[str]:
    """``head`` then ``formula`` on as many lines as it takes, continuation lines indented under it."""
    room = width - len(head)
    if room < 24:  # a narrow terminal: the formula on lines of its own (and the head on two, if need be)
        heads = [head.rstrip()] if len(head.rstrip()) <= width else textwrap.wrap(head, width)
        return heads + [f"    {c}" for c in _cell(formula, width - 4, cut)]
    cells = _cell(formula, room, cut)
    return [head + cells[0]] + [" " * len(head) + c for c in cells[1:]]
