"""The sizes a Hugging Face module cannot take whatever the memory, as conditions on its traced symbols, each with
why: one place that :func:`symmem.trace` (which adds them to the derivation's domain) and the commands (which
refuse past them in ``fit`` and ``plot``) both read.

- a text model's absolute position table (an embedding with the config's ``max_position_embeddings`` rows)
  bounds the symbol on its tokens' dimension (rotary positions have no table, hence no limit);
- a vision model whose forward refuses images other than the config's ``image_size`` (ViT: its position
  embeddings are that size; the trace's own guard pins the size) holds the symbols on the image's sides there.
"""
from __future__ import annotations

from typing import Any

import sympy

from .inputs import normalize_dims


def model_limits(module: Any, example_inputs: Any, dims: Any, domain: Any, free: Any) -> dict[Any, str]:
    """``{condition: why}`` for ``module`` (a transformers model: its ``config``; any other module has none) traced
    on ``example_inputs`` with ``dims``, whose derivation has ``domain`` and the symbols ``free``."""
    import torch

    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return {}
    items = example_inputs if isinstance(example_inputs, dict) else dict(enumerate(example_inputs))
    # a size the trace pinned (a ViT's image side) is no longer free: its symbol is the domain's
    by_name = {s.name: s for s in (*getattr(domain, "free_symbols", ()), *free)}
    found: dict[Any, str] = {}
    positions = _position_table(module, cfg)
    side = getattr(cfg, "image_size", None)
    sides = (side, side) if isinstance(side, int) else tuple(side) if isinstance(side, list | tuple) else ()
    conditions = set(sympy.And(domain).args) | {domain}
    for name, pairs in normalize_dims(dims).items():
        if name not in by_name:
            continue
        sym = by_name[name]
        for key, dim in pairs:
            x = items.get(key)
            if not isinstance(x, torch.Tensor):
                continue
            if positions and dim == 1 and x.dim() == 2 and not x.is_floating_point():
                found[sympy.Le(sym, positions[1])] = positions[0]
            elif len(sides) == 2 and x.dim() == 4 and x.is_floating_point() and dim in (2, 3) \
                    and sympy.Eq(sym, sides[dim - 2]) in conditions:
                found[sympy.Eq(sym, sides[dim - 2])] = (f"the model takes {sides[0]}x{sides[1]} images only "
                                                        f"(image_size = {side}; its forward refuses others)")
    return found


def _position_table(module: Any, cfg: Any) -> tuple[str, int] | None:
    """(why, rows) of ``module``'s absolute position table, or None (no ``max_position_embeddings`` embedding)."""
    import torch

    rows = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(rows, int) or isinstance(rows, bool):
        return None
    get_tokens = getattr(module, "get_input_embeddings", None)
    tokens = get_tokens() if callable(get_tokens) else None  # the token table, whatever its rows
    tables = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Embedding)
              and m.num_embeddings == rows and m is not tokens]
    if not tables:
        return None
    key = next((k for k, v in cfg.to_dict().items() if v == rows and ("position" in k or k in ("n_ctx",))), "")
    return (f"past the model's position table: {tables[0]} has {rows:,} rows" + (f" ({key} = {rows:,})" if key else ""),
            rows)


def sized_limits(build: Any, plan: Any, dims: Any, domain: Any, free: Any) -> tuple[dict[Any, str], list[str]]:
    """:func:`model_limits` of a module fitted in its own sizes (``symmem.trace(build, sizes=...)``, the command
    line's ``--symbolic``), and notes: the module built at the plan's base and at its second point (the sizes the
    fit traced first).  A position table whose rows stay put is a number (``S <= 16``); one whose rows follow a
    size (``--symbolic P=n_positions``) bounds the tokens by that size's symbol (``S <= P``); rows that follow
    the sizes some other way bound nothing said, and a note says so.  No tracing: the module is only built."""
    from .symbolic_sizes import built, sym_for

    base = plan.sizes_at(plan.base)
    module, example = built(build, base)
    found = model_limits(module, example, dims, domain, free)
    if not found:
        return {}, []
    rows = _position_table(module, getattr(module, "config", None))
    second = tuple(v.values[1] if len(v.values) > 1 else v.values[0] for v in plan.variables)
    if rows is None or second == plan.base:
        return found, []
    other = plan.sizes_at(second)
    moved_module, _ = built(build, other)
    moved = _position_table(moved_module, getattr(moved_module, "config", None))
    if moved is not None and moved[1] == rows[1]:
        return found, []  # the table's rows are a number of the configuration, not of the sizes fitted
    out = {c: why for c, why in found.items() if not (isinstance(c, sympy.Le) and c.rhs == rows[1])}
    follows = [n for n in base if base[n] == rows[1] and moved is not None and other.get(n) == moved[1]]
    if not follows:
        return out, [f"the position table's rows ({rows[1]:,} at {base}) follow the sizes in no way found: no "
                     "bound on the tokens is said for it"]
    size = sym_for(follows[0])
    for c in found:
        if isinstance(c, sympy.Le) and c.rhs == rows[1]:
            table = rows[0].split(": ", 1)[1].split(" has ", 1)[0]
            out[sympy.Le(c.lhs, size)] = f"past the model's position table: {table} has {size} rows"
    return out, []
