"""Plain views of a derivation: the JSON contract and a text table.

>>> from symmem import derive
>>> d = derive("resnet50-v1")
>>> out = d.to_dict()
>>> out["values"]["parameters"], out["expressions"]["activations"]
(25557032, '44355584*B')
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..simplify import factored
from ..units import UNITS
from .latex import expression

if TYPE_CHECKING:
    from ..derivation import Derivation

KEYS = ("activations", "parameter_memory", "total")
EXTRA_KEYS = ("input", "loss", "transient")


def _safe_value(d: Derivation, expr: Any) -> int | None:
    from ..errors import SymmemError

    try:
        return d.evaluate(expr)
    except SymmemError:
        return None


def to_dict(d: Derivation) -> dict[str, Any]:
    """The stable JSON contract: see "JSON output" in the README."""
    keys = KEYS + tuple(k for k in EXTRA_KEYS if d.expression(k) != 0)
    exprs = {k: d.expression(k) for k in keys}
    values: dict[str, int | None] = {k: _safe_value(d, e) for k, e in exprs.items()}
    values["parameters"] = _safe_value(d, d.parameters)
    return {
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
        "factored": {k: str(factored(e)) for k, e in exprs.items()},
        "latex": {k: expression(e) for k, e in exprs.items()} | {"parameters": expression(d.parameters)},
        "values": values,
        "bytes_per_parameter": dict(d.regime.components()),
        "regime": {"precision": d.regime.precision, "optimizer": d.regime.optimizer,
                   "checkpoint": d.regime.checkpoint, "zero": d.regime.zero,
                   "tensor_parallel": d.regime.tensor_parallel, "sequence_parallel": d.regime.sequence_parallel,
                   "pipeline_parallel": d.regime.pipeline_parallel},
        "parameter_breakdown": parameter_breakdown(d),
        "breakdown": [
            {"name": t.name, "group": t.group, "category": t.category, "role": t.role, "dtype": t.dtype,
             "count": str(t.count), "expr": str(t.expr), "latex": expression(t.expr),
             "bytes": _safe_value(d, t.expr)}
            for t in d.terms
        ],
    }


def parameter_breakdown(d: Derivation) -> list[dict[str, Any]]:
    """Per parameter-side component: nominal bytes per parameter element (None where the state is not
    elementwise: Adafactor's factored statistics, 8-bit block scales), what ZeRO shards it by, its formula,
    its bytes on one device and its bytes per model parameter."""
    nominal = dict(d.regime.components())
    params = _safe_value(d, d.parameters)
    out = []
    for t in d.terms:
        if t.category != "parameter":
            continue
        b = _safe_value(d, t.expr)
        out.append({"name": t.name, "class": d.regime.kind_of(t.name), "bytes_per_element": nominal.get(t.name),
                    "sharded_by": "N" if d.regime.shard(t.name) else None, "expr": str(t.expr), "bytes": b,
                    "per_parameter": None if b is None or not params else b / params})
    return out


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / UNITS['MiB']:12.2f}"


def table(d: Derivation) -> str:
    """Groups and terms with their formulas and MiB, then the totals in MiB and GiB."""
    scope = f" (one layer: {d.layer})" if d.per_layer else ""
    lines = [f"{d.model} - convention {d.convention}, {d.regime.precision} + {d.regime.optimizer}{scope}",
             "symbols: " + ", ".join(f"{s.name}={v}" for s, v in sorted(d.numbers.items(),
                                                                           key=lambda kv: kv[0].name)),
             "", f"{'group / term':<44} {'formula (bytes)':<34} {'MiB':>12}", "-" * 92]
    for group, expr in d.groups().items():
        lines.append(f"{group:<44} {str(expr)[:34]:<34} {_mib(_safe_value(d, expr))}")
        for t in d.terms:
            if t.group == group and t.category != "parameter" and group != "input":
                label = f"  {t.name}" + (f" [{t.role}]" if t.role else "")
                lines.append(f"{label[:44]:<44} {str(t.expr)[:34]:<34} {_mib(_safe_value(d, t.expr))}")
    lines.append("-" * 92)
    keys = KEYS + tuple(k for k in EXTRA_KEYS if d.expression(k) != 0)
    for key in keys:
        e = d.expression(key)
        v = _safe_value(d, e)
        gib = "" if v is None else f"{v / UNITS['GiB']:10.3f} GiB"
        shown = factored(e) if key == "activations" else e
        lines.append(f"{key:<20} {_mib(v)} MiB {gib}   = {shown}")
    lines.append(f"{'parameters':<20} {_safe_value(d, d.parameters):>12,}   = {d.parameters}")
    return "\n".join(lines)
