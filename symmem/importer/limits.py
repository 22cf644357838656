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
