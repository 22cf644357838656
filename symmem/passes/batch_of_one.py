"""What a tensor-parallel rank keeps otherwise at a batch of one (B = 1), DTensor's standard plan.

Two rules, each a formula that is 1 (or the bytes) at B = 1 and 0 from B = 2, so that ``fit`` solving B reaches
B = 1: funcol's asynchronous all-gather over S keeps a second copy (:func:`single_copy`), and eager attention with
one key/value head a rank keeps the cache's key and value where from B = 2 it keeps the repeated copies
(:func:`collapsed`, :func:`cache_for_repeats`).  The step's walk (:mod:`symmem.passes.tensor_step`) and the
rank's saved activations (:func:`symmem.passes.model_parallel.tensor_rank`) both read them from here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import sympy

from .unroll import template

#: eager attention's repeated key and value (``repeat_kv``), by template name, and the cache copy each repeats
REPEATS = {"layers.self_attn.k_repeat": "layers.self_attn.cache_key",
           "layers.self_attn.v_repeat": "layers.self_attn.cache_value"}


@functools.cache  # sympy works out Max(0, 2 - B) anew each time (~2 ms)
def single_copy() -> sympy.Expr:
    """1 at B = 1, 0 from B = 2: how many more copies an asynchronous all-gather over S keeps.

    funcol's ``all_gather_single`` gathers into dim 0 (``(t B, S/t, H)``) and, gathering over S, re-concatenates
    over dim 1 -- unless ``B = 1``, where the result is a view (``_maybe_view_chunk_cat``) and the collective is not
    waited on there: ``ColwiseParallel(input_layouts=Shard(1))`` redistributes with ``async_op=True``, so the
    linear keeps funcol's wrapper and, through it, the all-gather's output: two whole copies where ``B >= 2``
    keeps the one concatenation (measured).  The attention's ``PrepareModuleInput`` waits: one copy either way.

    >>> from symmem.symbols import B
    >>> single_copy().subs(B, 1), single_copy().subs(B, 2)
    (1, 0)
    """
    from ..symbols import B

    return sympy.Max(0, 2 - B)


def collapsed(names: Iterable[str]) -> sympy.Boolean:
    """Where a batch of 1 keeps the cache's key and value in place of eager attention's repeated copies, for a
    graph whose nodes are ``names`` (unrolled or not): one key/value head a rank (G = t) repeated to more
    (h > G).  ``repeat_kv`` is then a stride-0 view on the rank, which ``bmm`` folds into its batch only when
    B = 1: the matmuls make no copy of the repeated key and value and keep the cache's until their backward.
    False where the graph repeats no key or value (SDPA).

    >>> from symmem.symbols import G, h, t
    >>> collapsed(["layers.self_attn.k_repeat"]).subs({G: 2, t: 2, h: 4}), collapsed(["sdpa"])
    (True, False)
    """
    from ..symbols import G, h, t

    if not any(template(n) in REPEATS for n in names):
        return sympy.false
    return sympy.And(sympy.Eq(G, t), sympy.Ne(h, G))


def cache_for_repeats(repeats: Iterable[tuple[str, sympy.Expr]], local: Callable[[str], sympy.Expr]) -> sympy.Expr:
    """What a rank keeps more where :func:`collapsed`, at B = 1: for each repeated key or value ``(name, its
    bytes on the rank)``, the cache copy it repeats (``local(cache's name)``: its bytes on the rank) in its place.

    >>> cache_for_repeats([("layers.self_attn.k_repeat", sympy.Integer(64))], lambda name: sympy.Integer(32))
    -32
    """
    more = sympy.Integer(0)
    for name, size in repeats:
        if template(name) in REPEATS:
            cache = name.rpartition(".")[0] + "." + REPEATS[template(name)].rpartition(".")[2]
            more += local(cache) - size
    return more
