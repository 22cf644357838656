"""The peak per rank under tensor parallelism as DTensor runs it, behind :class:`symmem.step.Step`.

``parallelize_module`` with the standard Llama plan (:func:`symmem.passes.model_parallel.tensor_rank`: the
embedding row-wise, q/k/v/gate/up column-wise, o/down row-wise, the head column-wise with its output replicated)
gives every rank the same shapes, so every rank has the same peak.  Measured per rank on gloo
(``symmem.record.model_parallel_runs``, torch 2.13, the loss ``sum``, for-loop AdamW), the steady step's largest
moment is one of four (docs/regimes.md, "The step's peak per rank"):

* **the forward's end**, at the head's all-gather: what lives between steps (the local parameter shards, Adam's
  state, the buffers, the batch), every activation autograd keeps on the rank (:class:`TensorRank.saved`), the
  embedding's all-reduce output beside its saved wrapper, the ``DynamicCache``'s key and value copies no op keeps
  (:func:`held_cache`; the position ids and eager attention's mask went with ``LlamaModel.forward``, as in HF's),
  the head's local logits (``V/t`` wide) and the replicated logits twice (the all-gather's output and its wrapper,
  then the concatenated logits beside the all-gather's);
* **the final norm's backward**: the same less what the head and the final norm kept, their weights' gradients
  and five temporaries of the norm's input;
* **the layers' largest moment** (:class:`_LayerWalk`; the final norm's forward among its candidates, where eager
  attention's whole mask and the cache's copies are still held): the single-device step written out at the
  numbers, each storage at the rank's size, with the collectives' outputs (a row-parallel all-reduce's output
  beside funcol's wrapper and the partial sum; a column-parallel input gradient's likewise);
* **the optimizer step** (for-loop Adam on the local shards): every gradient (the embedding's whole: ``V x H``,
  replicated), one parameter's ``sqrt`` and ``denom`` beside the previous parameter's ``denom`` (the embedding's
  replicated gradient is redistributed to its shard by copies as large), in the order the module lists them.

The first step: no optimizer state exists before AdamW's step, which makes all of it before the update (its
step's moment is the steady one's).  Under sequence parallelism (torchtitan's plan) the layers' walk is
:class:`_SequenceWalk`: the all-gathers over S before the column-parallel linears (and the head), the
reduce-scatters after the row-parallel ones (and the embedding), their backward counterparts, what eager attention
holds until it returns; its candidates add the head's input all-gather, the head's backward and the embedding's
backward.  At B = 1 funcol's all-gather over S is a view (no concatenation) and the asynchronous ones keep two
copies (:func:`single_copy`); with eager attention and one key/value head a rank, a batch of 1 keeps the cache's
key and value instead of repeated copies (:func:`~symmem.passes.batch_of_one.collapsed`; in the rank's saved
activations, :class:`TensorRank.saved`, too).  What gloo's worker thread
holds past a collective's wait is outside tensor accounting; the measurement lets it go and takes each moment's
fewest bytes over repeated steps.

>>> from symmem import derive
>>> d = derive("llama", tensor_parallel=True, attention="naive", device="cpu",
...            values={"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64, "t": 2})
>>> d.value("peak"), d.peak_at().where(step=False)
(126992, "rank 0 of 2 (every rank alike): forward's end (the head's all-gather)")
>>> d.step.per_rank(d.numbers)["peak_rank"]
0
>>> d = derive("llama", tensor_parallel=True, sequence_parallel=True, attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 256, "t": 2})
>>> d.value("peak"), d.peak_at().where(step=False)
(321496, 'rank 0 of 2 (every rank alike): backward layers.mlp.gate_up (layer 1)')
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import cached_property
from typing import Any

import sympy
from sympy.core.sympify import CantSympify

from ..errors import SymmemError
from ..graph import Graph
from ..peak import Moment, Peak
from ..shapes import numel
from ..symbols import at_least, equals, t
from ..training import Regime, checkpoint_every
from .batch_of_one import REPEATS, collapsed, single_copy
from .parameters import node_parameters
from .rank_step import WalkedStep
from .unroll import iteration, template


@dataclass(frozen=True)
class TensorRankMoment(Moment):
    """A moment of one tensor-parallel rank's step (every rank has the same)."""

    ranks: int | sympy.Expr = 1
    what: str = ""

    def where(self, step: bool = True) -> str:
        return f"rank 0 of {self.ranks} (every rank alike): {self.what}" + (f", {self.step} step" if step else "")


@dataclass(frozen=True)
class RankMoments:
    """One rank's step as formulas: what lives between steps, the forward's end and the optimizer step's largest
    moment (steady), and the first step's forward end (no optimizer state yet)."""

    at_rest: sympy.Expr
    forward_end: sympy.Expr
    step: sympy.Expr
    optimizer_state: sympy.Expr
    #: the final norm's backward, the first of the head's (steady; the first step's is lower by the state)
    backward: sympy.Expr = sympy.Integer(0)


def rank_peak(graph: Graph, storages: Sequence[Any], rank: Any, sequence: bool, checkpoint: bool = False
              ) -> RankMoments:
    """The moments of one rank's step (see the module's note) from its :class:`TensorRank` ``rank``; with
    ``checkpoint`` (the layers checkpointed) what the checkpoint frames hold in place of the cache's copies
    (:func:`~symmem.passes.tensor_checkpoint.frame_held`)."""
    from .model_parallel import _bytes, _module_buffers, local_saved

    act = "float32"
    nodes = list(graph.program_order())
    outside = [n for n in nodes if graph.node(n).block is None]
    ids = sum((_bytes(graph, n, act) for n in outside if graph.node(n).kind == "input"), sympy.Integer(0))
    buffers = sympy.Add(*_module_buffers(graph, act).values())
    cache = held_cache(graph, storages)
    embedding = next(n for n in outside if graph.node(n).kind == "embedding")
    head = next(n for n in reversed(outside) if graph.node(n).kind == "linear")
    hidden, logits = _bytes(graph, embedding, act), _bytes(graph, head, act)
    at_rest = rank.parameters + rank.optimizer_state + buffers + ids
    # the embedding's all-reduce (sequence parallel: reduce-scatter) output beside its saved wrapper; with
    # sequence parallelism also the final norm's S-split output, held until the forward ends
    kept = 2 * hidden / t if sequence else hidden
    # the DynamicCache's copies, held to the forward's end; at B = 1 where eager attention keeps them in place of
    # the repeated ones they are in the rank's saved activations already (model_parallel.at_one)
    held = cache / t - single_copy() * sympy.Piecewise((cache / t, collapsed(nodes)), (0, True))
    if checkpoint:  # no cache in checkpointed layers; the frames' inputs and the last layer's output instead
        from .tensor_checkpoint import frame_held

        held = frame_held(graph, sequence)
    forward_end = at_rest + rank.saved + kept + held + logits / t + 2 * logits
    step = at_rest + rank.gradients + _step_temporaries(graph)
    # the final norm's backward: what the head and the final norm kept is gone, their weights' gradients made (the
    # head's local), five temporaries of the norm's input (S split under sequence parallelism), the loss and its
    # gradient seed (4 bytes each); the embedding's all-reduce (reduce-scatter) output beside its wrapper still
    head_saved = sum((local_saved(graph, s, sequence) for s in storages
                      if s.category in ("activation", "loss") and s.group == "head"), sympy.Integer(0))
    stream = hidden / t if sequence else hidden
    head_grads = sympy.Integer(0)
    for n in outside:
        node = graph.node(n)
        if node.group == "head":
            for _, shape in node_parameters(n, node):
                head_grads += numel(shape) * 4 / (t if len(shape) >= 2 else 1)
    backward = at_rest + rank.saved - head_saved + stream + 5 * stream + 8 + head_grads + (held if checkpoint else 0)
    if sequence:
        # at B = 1 the asynchronous all-gathers (gate's, up's, the head's) keep two copies each (see single_copy)
        seconds = [s for s in storages if s.category == "activation" and _async_gathers(graph, s.keepers)]
        forward_end += single_copy() * sum((_async_gathers(graph, s.keepers) * s.expr for s in seconds),
                                           sympy.Integer(0))
        backward += single_copy() * sum((_async_gathers(graph, s.keepers) * s.expr for s in seconds
                                         if s.group != "head"), sympy.Integer(0))
    return RankMoments(at_rest, forward_end, step, rank.optimizer_state, backward)


def held_cache(graph: Graph, storages: Sequence[Any]) -> sympy.Expr:
    """The bytes of the ``DynamicCache``'s key and value copies (every layer's, whole) that no op keeps: HF holds
    them until ``LlamaForCausalLM.forward`` returns (the zoo's ``held_until``), past eager attention's
    ``repeat_kv`` copies of them (1 < h/G); the SDPA kernels and eager attention at G = h keep them anyway.

    >>> from symmem import derive, symbol
    >>> from symmem.models import build
    >>> d = derive("llama", attention="naive", convention="pytorch", device="cpu")
    >>> held = held_cache(build("llama", attention="naive").graph, d.storages)
    >>> at = {symbol(k): v for k, v in {"B": 2, "S": 8, "H": 32, "h": 4, "L": 1}.items()}
    >>> [held.subs({**at, symbol("G"): g}) for g in (1, 2, 4)]  # 2 L B G S (H/h) 4 where h/G > 1
    [1024, 2048, 0]
    """
    total = sympy.Integer(0)
    for n in graph.program_order():
        if n.endswith((".cache_key", ".cache_value")) and graph.node(n).block is not None:
            node = graph.node(n)
            kept = sum((s.expr for s in storages if s.node == n and s.category == "activation"), sympy.Integer(0))
            total += node.count * node.out.numel * 4 - kept
    return total


def _async_gathers(graph: Graph, keepers: Sequence[str]) -> int:
    """How many of ``keepers`` all-gather their input asynchronously under sequence parallelism: the column-parallel
    linears outside the attention (the MLP's gate and up, the head)."""
    return sum(1 for k in keepers if k in graph and graph.node(k).kind == "linear" and (
        graph.node(k).role == "mlp_hidden" or graph.node(k).group == "head"))


def _step_temporaries(graph: Graph, local: Callable[[str, tuple[sympy.Expr, ...]], sympy.Expr] | None = None
                      ) -> sympy.Expr:
    """For-loop Adam's largest temporaries on the local shards: ``Max`` over the parameters, in the order the
    Llama reference lists them (the embedding; each layer's linears, then its norms; the final norm; the head),
    of two of a parameter's size beside the previous parameter's ``denom``.  ``local(node, shape)``: a
    parameter's bytes on the rank (default: a tensor-parallel shard's, a matrix split over ``t``)."""
    if local is None:
        def local(n: str, shape: tuple[sympy.Expr, ...]) -> sympy.Expr:
            return numel(shape) * 4 / (t if len(shape) >= 2 else 1)

    first: list[sympy.Expr] = []
    layer: list[sympy.Expr] = []
    norms: list[sympy.Expr] = []
    last: list[sympy.Expr] = []
    count: sympy.Expr = sympy.Integer(1)
    for n in graph.program_order():
        node = graph.node(n)
        for _, shape in node_parameters(n, node):
            size = local(n, shape)
            if node.block is not None:
                count = node.count
                (layer if len(shape) >= 2 else norms).append(size)
            else:
                (first if node.kind == "embedding" else last).append(size)
    if len(first) != 1 or not layer or not last:
        raise SymmemError("the tensor-parallel step follows the Llama reference's parameters (an embedding, "
                          "repeated layers, a head)")
    order = first + layer + norms + last
    # each candidate's terms from its two sizes' (expanded once each: the sizes repeat, layer by layer)
    expanded: dict[sympy.Expr, dict[sympy.Expr, Any] | None] = {}
    for size in order:
        if size not in expanded:
            expanded[size] = _terms(sympy.expand(size))
    candidates = [2 * order[0]] + [a + 2 * b for a, b in zip(order, order[1:], strict=False)]
    terms = [_sum_terms({}, expanded[order[0]])] + [_sum_terms(expanded[a], expanded[b])
                                                      for a, b in zip(order, order[1:], strict=False)]
    # with two or more layers a layer's first parameter follows the last of the layer before
    again = (norms or layer)[-1] + 2 * layer[0]
    candidates.append(sympy.Piecewise((again, at_least(count, 2)), (0, True)))
    terms.append(None)
    return largest_of(candidates, terms)


def largest_of(candidates: Sequence[sympy.Expr], terms: Sequence[dict[sympy.Expr, Any] | None] | None = None
               ) -> sympy.Expr:
    """``sympy.Max`` of ``candidates`` without its pairwise proofs (a second each on the default sizes): those
    another candidate bounds term by term (their difference, expanded, has no negative coefficient: every size is
    positive) are left out, the rest kept unevaluated -- the arguments ``Max`` itself keeps.  ``terms``: each
    candidate's :func:`_terms` of it expanded, where the caller has them (None: worked out here).

    >>> from symmem.symbols import H, V
    >>> largest_of([2 * H, H + V, H, H + V])
    Max(2*H, H + V)
    """
    if terms is None:
        unique = list(dict.fromkeys(candidates))
        found = [_terms(sympy.expand(c)) for c in unique]
    else:
        first: dict[sympy.Expr, Any] = {}
        for c, x in zip(candidates, terms, strict=True):
            first.setdefault(c, x)
        unique, found = list(first), list(first.values())
    kept = [c for i, c in enumerate(unique)
            if not any(_bounds(found[j], found[i]) and (j < i or not _bounds(found[i], found[j]))
                       for j in range(len(unique)) if j != i)]
    return kept[0] if len(kept) == 1 else sympy.Max(*kept, evaluate=False)


def _terms(e: sympy.Expr) -> dict[sympy.Expr, Any] | None:
    """An expanded formula's coefficient by monomial, as Python numbers (None where it holds a ``Piecewise``: no
    term-by-term comparison)."""
    return None if e.has(sympy.Piecewise) else {m: _number(c) for m, c in e.as_coefficients_dict().items()}


def _sum_terms(a: dict[sympy.Expr, Any] | None, b: dict[sympy.Expr, Any] | None) -> dict[sympy.Expr, Any] | None:
    """:func:`_terms` of ``a + 2 b`` expanded, from the terms of ``a`` and ``b`` expanded (None where either holds
    a ``Piecewise``): expanding is linear, and like monomials collect (a coefficient 0 leaves its monomial out, as
    the expanded sum does)."""
    if a is None or b is None:
        return None
    out = {m: 2 * c for m, c in b.items()}
    for m, c in a.items():
        out[m] = out.get(m, 0) + c
    return {m: c for m, c in out.items() if c != 0}


def _bounds(a: dict[sympy.Expr, Any] | None, b: dict[sympy.Expr, Any] | None) -> bool:
    """Whether ``a >= b`` (:func:`_terms` of expanded formulas) for every positive size, term by term: no
    monomial's coefficient in ``a - b`` negative (False where it cannot tell: a ``Piecewise``).  The difference's
    coefficients are the terms' (an expanded sum collects like monomials), without building it."""
    if a is None or b is None:
        return False
    return all(c - b.get(m, 0) >= 0 for m, c in a.items()) and all(m in a or -c >= 0 for m, c in b.items())


def ceiling_at(x: sympy.Expr, env: Mapping[sympy.Symbol, sympy.Integer], memo: dict[sympy.Expr, Any]) -> int:
    """``int(sympy.ceiling(x.xreplace(env)))`` (``env``: every symbol of ``x`` a number), its parts' exact values
    kept in ``memo``: the collectives' bytes repeat the same sizes under an ``Add`` or a ``Max`` that ``xreplace``
    would build anew, and evaluate, at every op.

    >>> from symmem.symbols import B, t
    >>> x = sympy.Max(0, 3 * B / t - 4, evaluate=False) + B / t
    >>> ceiling_at(x, {B: sympy.Integer(3), t: sympy.Integer(2)}, {}) == int(sympy.ceiling(x.subs({B: 3, t: 2})))
    True
    """
    try:
        return math.ceil(_exact(x, env, memo))
    except _Inexact:
        return int(sympy.ceiling(x.xreplace(env)))


class _Inexact(Exception):
    """A part :func:`_exact` does not work out as a rational number."""


def _exact(x: sympy.Expr, env: Mapping[sympy.Symbol, sympy.Integer], memo: dict[sympy.Expr, Any]) -> int | Fraction:
    """``x``'s exact value at ``env`` (sums, products, whole powers, ``Max``/``Min``, ``ceiling``/``floor`` of
    rational numbers; any other part as ``xreplace`` evaluates it), each part's kept in ``memo``."""
    found = memo.get(x)
    if found is not None:
        return found
    if x.is_Integer:
        v: int | Fraction = int(x)
    elif x.is_Rational:
        v = Fraction(int(x.p), int(x.q))
    elif x.is_Symbol:
        if x not in env:
            raise _Inexact
        v = int(env[x])
    elif x.is_Add:
        v = sum((_exact(a, env, memo) for a in x.args), 0)
    elif x.is_Mul:
        v = 1
        for a in x.args:
            v *= _exact(a, env, memo)
    elif x.is_Pow and x.exp.is_Integer:
        b = _exact(x.base, env, memo)
        if b == 0 and x.exp < 0:
            raise _Inexact
        v = b ** int(x.exp) if x.exp >= 0 else Fraction(b) ** int(x.exp)
    elif isinstance(x, (sympy.Max, sympy.Min)):
        values = [_exact(a, env, memo) for a in x.args]
        v = max(values) if isinstance(x, sympy.Max) else min(values)
    elif isinstance(x, (sympy.ceiling, sympy.floor)):  # FSDP's shard rows: ceiling(d0 / N)
        inner = _exact(x.args[0], env, memo)
        v = math.ceil(inner) if isinstance(x, sympy.ceiling) else math.floor(inner)
    else:
        y = x.xreplace(env)
        if not y.is_Rational:
            raise _Inexact
        v = int(y.p) if y.q == 1 else Fraction(int(y.p), int(y.q))
    if isinstance(v, Fraction) and v.denominator == 1:
        v = int(v)
    memo[x] = v
    return v


def chosen(values: Sequence[Sequence[int]]) -> list[int]:
    """The candidates kept: at each probe the first of the largest, in the step's order."""
    if not values:
        return []
    return sorted({max(range(len(values)), key=lambda j: values[j][n]) for n in range(len(values[0]))})


class AtProbes(tuple, CantSympify):
    """A formula's exact values at each probe of :meth:`_LayerWalk.candidates` (ints; Fractions where not whole),
    in place of the formula: the collectives' rules (:meth:`_LayerWalk._collectives`) run on these for the ~500
    candidate moments (sums, differences, products, division by a number, ``max`` elementwise: what
    :func:`ceiling_at` works out of the formula, without building it), and on formulas for the few moments kept.
    Never turned into a formula (``CantSympify``): sympy's operators hand a mixed operation to these, which take
    numbers only."""

    __slots__ = ()

    def __add__(self, o: Any) -> AtProbes:
        if type(o) is AtProbes:
            return AtProbes([a + b for a, b in zip(self, o, strict=True)])
        o = _number(o)
        return AtProbes([a + o for a in self])

    __radd__ = __add__

    def __sub__(self, o: Any) -> AtProbes:
        if type(o) is AtProbes:
            return AtProbes([a - b for a, b in zip(self, o, strict=True)])
        o = _number(o)
        return AtProbes([a - o for a in self])

    def __rsub__(self, o: Any) -> AtProbes:
        o = _number(o)
        return AtProbes([o - a for a in self])

    def __neg__(self) -> AtProbes:
        return AtProbes([-a for a in self])

    def __mul__(self, o: Any) -> AtProbes:  # type: ignore[override]
        if type(o) is AtProbes:
            return AtProbes([a * b for a, b in zip(self, o, strict=True)])
        o = _number(o)
        return AtProbes([a * o for a in self])

    __rmul__ = __mul__  # type: ignore[assignment]

    def __truediv__(self, o: Any) -> AtProbes:
        o = _number(o)  # exact: an int where it divides, a Fraction where not
        return AtProbes([a // o if type(a) is int and not a % o else Fraction(a, o) for a in self])


@functools.lru_cache(maxsize=1024)
def _evaluated_max(args: tuple[Any, ...]) -> sympy.Expr:
    """``sympy.Max(*args)``, evaluated once for the same ``args``: its proofs cost thousands of calls each, and the
    kept moments of the two folded walks (:func:`layer_moments`) repeat the same ones (a pure function of its
    arguments: formulas, whose symbols carry their assumptions)."""
    return sympy.Max(*args)


def _number(o: Any) -> int | Fraction:
    """A number beside :class:`AtProbes` (the same at every probe): an int, a Fraction or a sympy rational; a
    formula here is a mistake (a rule's part not worked out on the probes)."""
    if type(o) is int or type(o) is Fraction:
        return o
    if isinstance(o, sympy.Rational):
        return int(o.p) if o.q == 1 else Fraction(int(o.p), int(o.q))
    raise TypeError(f"a formula beside values at the probes: {o!r}")


def _ceilings(x: Any, n: int) -> list[int]:
    """The ceiling of exact values at ``n`` probes (``x``: :class:`AtProbes`, or a number the same at each)."""
    if type(x) is AtProbes:
        return [v if type(v) is int else math.ceil(v) for v in x]
    return [math.ceil(_number(x))] * n


def on_probes(collectives: Callable[..., Any]) -> Callable[..., Any]:
    """Marks a walk's ``_collectives`` as written for both modes (:class:`AtProbes` or formulas, through
    :meth:`_LayerWalk._n`, ``_sum``, ``_max``, ``local`` and ``tv``): :meth:`_LayerWalk.candidates` works a walk's
    candidates out on the probes where its ``_collectives`` says so, as formulas where not (a subclass's own)."""
    collectives.on_probes = True  # type: ignore[attr-defined]
    return collectives


#: From how many layers the layers' moments are folded from two short walks (:func:`layer_moments`)
FOLD_FROM = 8


def layer_moments(walk: type[_LayerWalk], graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime,
                  numbers: Mapping[str, int], base: int = 2) -> list[tuple[sympy.Expr, str, str]]:
    """The layers' moments that can be the largest, (formula, phase, where in words), of ``walk`` at ``numbers``.

    From :data:`FOLD_FROM` layers on, where every size is a whole number of bytes (``t`` divides S as it divides
    the heads, F and V), the walk is not written out layer by layer: at every candidate -- an op of the first or
    the last layer, or outside them -- the layers between are all in one state (before the first layer's
    backward: forward done; at it: backward done), so each moment is linear in L.  Walks of 2 and 3 layers give
    it: ``f(L) = f(2) + (L - 2) (f(3) - f(2))``, the same bytes as the walk of L layers, in a fraction of the time.
    ``base``: the shorter walk's layers (a walk whose candidates hold more layers than the first and the last, as
    FSDP x TP's last but one, folds from longer ones: ``base`` and ``base + 1``).
    """
    layers = int(numbers["L"])
    # every-K checkpointing (K > 1): the layers between are not all in one state (their segments), no fold
    if layers < FOLD_FROM or int(numbers.get("S", 1)) % int(numbers["t"]) or (checkpoint_every(regime.checkpoint)
                                                                                or 1) > 1:
        w = walk(graph, conv, options, regime, numbers)
        return [(f, phase, w.label(phase, node)) for f, phase, node in w.largest()]
    two, three = (walk(graph, conv, options, regime, {**numbers, "L": n}) for n in (base, base + 1))
    at_two = {key: (values, k) for key, values, k in two.candidates()}
    found = []
    for key, values, k in three.candidates():
        before, k2 = at_two[key]
        found.append(([a + (layers - base) * (b - a) for a, b in zip(before, values, strict=True)], k2, k))
    out = []
    for j in chosen([f[0] for f in found]):
        _, k2, k = found[j]
        a, b = two.formula(k2), three.formula(k)
        e = three.tl.events[k]
        out.append((a + (layers - base) * (b - a), e.phase, three.label(e.phase, str(e.node), layers)))
    return out


@dataclass(eq=False)
class TensorStep(WalkedStep):
    """The step of one tensor-parallel rank (DTensor's standard plan; ``numbers`` the derivation's, ``t``
    included): the peak per device is every rank's, the ``Max`` of the forward's end, the final norm's backward,
    the optimizer step and the layers' largest moment (:class:`_LayerWalk` of the single-device step of
    ``graph`` under ``conv``, ``options`` and ``regime``, without tensor parallelism)."""

    moments: RankMoments
    numbers: Mapping[sympy.Symbol, int]
    graph: Graph
    conv: Any
    options: Mapping[str, Any]
    regime: Regime
    sequence: bool = False
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    refused_as = "tensor-parallel"
    needs = ("L", "t")
    not_drawn = ("a tensor-parallel rank's timeline is not drawn op by op: its peak is the largest of the forward's "
                 "end, the final norm's backward, the layers' largest moment and the optimizer step (symmem ranks "
                 "gives each rank's parts)")

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        return self._walked_peak(at, None, self._peak)

    def _peak(self, named: Mapping[str, int]) -> Peak:
        r, ranks = self.moments, named["t"]
        layers = layer_moments(_SequenceWalk if self.sequence else _LayerWalk, self.graph, self.conv,
                                     self.options, self.regime, named)
        made = []
        for step, less in (("steady", sympy.Integer(0)), ("first", r.optimizer_state)):
            # at B = 1 eager attention with one key/value head a rank keeps the cache's copies instead: in
            # TensorRank.saved (model_parallel.at_one)
            moments = [("forward", "forward's end (the head's all-gather)", r.forward_end),
                       ("backward", "the final norm's backward", r.backward)]
            moments += [(phase, what, r.at_rest + live) for live, phase, what in layers]
            for ph, what, live in moments:
                made.append(TensorRankMoment(ph, what, "", step, {"live": live - less}, ranks=ranks, what=what))
            made.append(TensorRankMoment("step", None, "", step, {"live": r.step}, ranks=ranks,
                                         what="the optimizer step"))
        others = tuple(equals(sympy.Symbol(n, positive=True, integer=True), v) for n, v in sorted(named.items())
                       if n in ("L",))
        return Peak(None, None, tuple(made), others)

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak at ``numbers`` (all alike), and the rank named as the largest."""
        merged = {**self.numbers, **numbers}
        value = self.peak(numbers).value(merged)
        return {"peak_per_rank": [value] * self._named(numbers).get("t", 1), "peak_rank": 0}


def refusal(model_name: str, regime: Regime, loss: str | None, device: str = "cpu") -> str | None:
    """Why the tensor-parallel peak is not modelled for this derivation (None: it is)."""
    from .schedule import optimizer_impl

    if model_name != "llama":
        return f"the tensor-parallel peak follows DTensor's standard plan, which is Llama's; not {model_name}"
    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw"):
        return "the tensor-parallel peak is modelled for FP32 Adam/AdamW (what was measured)"
    if regime.checkpoint != "none":
        from .tensor_checkpoint import checkpoint_refusal

        why = checkpoint_refusal(regime)
        if why is not None:
            return why
    if regime.zero or regime.pipeline_parallel or regime.micro_batches != 1:
        return ("the tensor-parallel peak is modelled alone or on pipeline stages (a p x t mesh): no ZeRO, nor "
                "micro-batches without stages")
    if loss not in (None, "sum"):
        return f"the tensor-parallel peak is modelled for the loss 'sum' (what was measured), not {loss!r}"
    impl = optimizer_impl(regime, device)
    if device != "cpu" or impl != "for-loop":
        # measured: PyTorch itself refuses foreach over the standard plan, whose norms stay plain tensors beside
        # DTensors ("aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor"); sequence parallelism makes
        # every parameter a DTensor and it runs (benchmarks/check_cuda_parallel.py, docs/cuda.md)
        engine = ("; torch.optim's foreach AdamW itself raises on this plan: its norms stay plain tensors beside "
                  "DTensors" if impl == "foreach" and not regime.sequence_parallel else "")
        return ("the tensor-parallel peak is measured on CPU ranks (gloo) with the for-loop AdamW: give --device "
                f"cpu (here {device}, {impl} AdamW{engine}); NCCL's buffers are not modelled")
    return None


def storages_rank(graph: Graph, storages: Sequence[Any], regime: Regime, sequence: bool) -> RankMoments:
    """:func:`rank_peak` from the single-device ``storages`` (the pytorch convention)."""
    from .model_parallel import tensor_rank

    return rank_peak(graph, storages, tensor_rank(graph, storages, regime, sequence), sequence,
                     regime.checkpoint != "none")


# -- the layers' forward and backward, op by op --------------------------------------------------------------
class _LayerWalk:
    """The single-device step of ``graph`` written out at ``numbers`` (:class:`~symmem.passes.schedule.Simulation`),
    each storage at one rank's size, with what DTensor adds: the largest moment inside the layers (see
    :func:`layer_moment`)."""

    #: under checkpointing, the norms' no-op casts followed as PyTorch runs them
    #: (:class:`~symmem.passes.tensor_checkpoint.CastsInPlace`); a walk that merges the norms' gradients itself
    #: (FSDP x TP's) says False
    casts_in_place = True
    #: defaults for walks built without :meth:`__init__` (the pipeline stages' sizes): no checkpointing
    checkpointed = False
    segments = 1
    #: under checkpointing (:class:`_SequenceWalk`): each recomputation event -> its op's forward event, and the
    #: storages the recomputations make
    again: Mapping[int, int] = {}
    recomputed: frozenset[int] | set[int] = frozenset()
    #: the collectives' mode: None, formulas; in :meth:`candidates`, the probes' numbers (:class:`AtProbes`), with
    #: ``tv`` t's number there (the symbol t for formulas)
    _probes: list[dict[sympy.Symbol, sympy.Integer]] | None = None
    tv: Any = t

    def __init__(self, graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime,
                 numbers: Mapping[str, int]) -> None:
        from . import branches as size_branches
        from .tensor_checkpoint import simulation
        from .unroll import unroll

        block = next(iter(graph.blocks.values()))
        self.original = graph
        self.g = g = unroll(graph, {block.name: int(numbers["L"])})
        self.subs = {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in numbers.items()}
        open_, decided = size_branches.conditions(g, g.program_order(), self.subs)
        branch = {**decided, **{c: bool(c.xreplace(self.subs)) for c in open_}}
        sim = simulation(regime, self.casts_in_place)(g, conv, options, regime, branch, False)
        sim.micro_batch()
        self.tl = sim.timeline(first=False)
        order = list(g.program_order())
        self.head = next(n for n in reversed(order) if g.node(n).kind == "linear" and g.node(n).block is None)
        self.embedding = next(n for n in order if g.node(n).kind == "embedding")
        linears = [n for n in order if g.node(n).kind == "linear"]
        self.column = {n for n in linears if g.node(n).role in ("qkv", "mlp_hidden") or n == self.head}
        self.final_norm = {n for n in order if g.node(n).group == "head" and g.node(n).block is None
                           and n != self.head and g.node(n).kind not in ("parameter", "buffer", "constant")}
        self.row = {n for n in linears if n not in self.column}
        # the forward's constants (the position ids, eager attention's mask) are storages of the walk, held until
        # the final norm returns (graph.graph["held_until"]: LlamaModel.forward's locals), as the cache's copies
        # to the forward's end: nothing beside them
        self.keepers = sim.all_keepers  # who keeps each saved storage (sequence parallelism's gathered copies)
        self._splits: dict[str, bool] = {}
        self._locals: dict[int, sympy.Expr] = {}
        #: whether the collectives' Max are simplified (the kept moments' formulas) or not (the candidates' bytes)
        self.evaluate = False
        self.once = single_copy()
        # eager attention with one key/value head a rank (G = t) repeated to h/t heads: at B = 1 the repeated key
        # and value are views of the cache's copies (bmm folds the batch of 1 with the stride-0 repeat), which the
        # matmuls keep in place of the copies they make from B = 2
        # (asked of the graph before unrolling: the same templates, each once)
        self.collapsed = collapsed(graph.program_order()).xreplace(self.subs) is sympy.true
        #: layers a checkpointed segment holds (every-K: K): where K > 1, a middle layer's backward holds the layers
        #: before it in its segment recomputed, so every layer's ops are candidates
        self.segments = checkpoint_every(regime.checkpoint) or 1
        self.checkpointed = regime.checkpoint != "none"

    @cached_property
    def cache_kept(self) -> list[tuple[int, int, sympy.Expr]]:
        """At B = 1 where :attr:`collapsed`, the cache's key and value copies past the single-device step's
        frees (its ``repeat_kv`` copies them) until the matmuls' backward lets go of the repeated views: (from,
        to, bytes), the bytes 0 from B = 2."""
        if not self.collapsed:
            return []
        tl = self.tl
        kept = []
        # each copy paired with the repeat made from it: under checkpointing a layer's forward and its
        # recomputation each make both (storages of the same names)
        pending: dict[str, tuple[int, int]] = {}  # the repeat's name -> (the copy, the event that let it go)
        for k, e in enumerate(tl.events):
            for i in e.freed:
                name = tl.storages[i].name
                if template(name) in ("layers.self_attn.cache_key", "layers.self_attn.cache_value"):
                    pending[name.replace("cache_key", "k_repeat").replace("cache_value", "v_repeat")] = (i, k)
                elif name in pending:
                    copy, at = pending.pop(name)
                    kept.append((at + 1, k, self.once * self.local(copy)))
        return kept

    def local(self, i: int) -> Any:
        """Storage ``i``'s bytes on one rank (:meth:`_local`), worked out once (on the probes: its values there)."""
        if i not in self._locals:
            self._locals[i] = self._local(i)
        if self._probes is None:
            return self._locals[i]
        found = self._locals_at.get(i)
        if found is None:
            found = self._locals_at[i] = self._n(self._locals[i])
        return found

    def _n(self, x: Any) -> Any:
        """A formula in the collectives' mode: itself, or on the probes its exact values there (:class:`AtProbes`,
        each worked out once)."""
        if self._probes is None or type(x) is int:
            return x
        found = self._probe_values.get(x)
        if found is None:
            parts = zip(self._probes, self._probe_parts, strict=True)
            found = self._probe_values[x] = AtProbes([_exact(x, p, part) for p, part in parts])
        return found

    def _bytes(self, i: int) -> Any:
        """Storage ``i``'s whole bytes (the single device's) in the collectives' mode."""
        return self._n(self.tl.storages[i].nbytes)

    def _sum(self, xs: Sequence[Any]) -> Any:
        """``sympy.Add(*xs)`` in the collectives' mode (on the probes: elementwise; nothing: 0)."""
        if self._probes is None:
            return sympy.Add(*xs)
        total: Any = 0
        for x in xs:
            total = x + total
        return total

    def _local(self, i: int) -> sympy.Expr:
        """Storage ``i``'s bytes on one rank: split over ``t`` where it has a head or MLP-width dimension (the
        logits: the vocabulary), twice where a row-parallel all-reduce makes it (its output beside funcol's
        wrapper), the replicated logits beside the local ones; parameters' gradients as :class:`TensorRank`; at
        B = 1 no repeated key or value where :attr:`collapsed`."""
        s = self.tl.storages[i]
        if s.category in ("parameter", "optimizer_state", "input", "buffer"):
            return sympy.Integer(0)  # what lives between steps: counted apart (RankMoments.at_rest)
        size = s.nbytes
        if self.collapsed and template(s.name) in REPEATS:
            return (1 - self.once) * size / t  # at B = 1 a view of the cache's copy (_cache_kept)
        if s.category == "gradient":
            return size / t if s.node in self.g and self.g.node(s.node).kind == "linear" else size
        if s.name in self.row or s.name == self.embedding:
            return 2 * size
        if s.name == self.head:
            return size + size / t
        return size / t if self._split(s.node, s.name) else size

    def _split(self, node: str | None, name: str) -> bool:
        if node is None or node not in self.g:
            return False
        n = self.g.node(node)
        source = node
        suffix = name[len(node):] if name.startswith(node) else ""
        for before, after in ((".input", "_copy"), (".grad_input", "")):
            index = suffix[len(before):len(suffix) - len(after)] if suffix.endswith(after) else ""
            if suffix.startswith(before) and index.isdigit():
                source = n.inputs[int(index)]
        if source == self.head:
            return True
        if not iteration(source):
            return False
        # the layers' copies of one node share its role and shape: decided once
        key = template(source)
        if key not in self._splits:
            from .model_parallel import SPLIT_DIMS
            from .regimes import TP_ROLES

            src = self.g.node(source)
            # a symbol's name is what str() prints of it (printing each was most of this)
            names = {x.name if type(x) is sympy.Symbol else str(x) for d in src.out.shape
                     for x in sympy.sympify(d, strict=True).free_symbols}
            self._splits[key] = src.role in TP_ROLES or bool(names & set(SPLIT_DIMS))
        return self._splits[key]

    def largest(self) -> list[tuple[sympy.Expr, str, str]]:
        """The layers' forward and backward moments that can be the largest: (the bytes beside what lives between
        steps, as a formula; the phase; the op).  Every op of the first and the last layer is a candidate (the
        first holds the fewest kept tensors and the most gradients in the backward, the last the reverse); those
        kept are the largest at the numbers with the batch B scaled from 1 to 256 times (``fit`` solves in B)."""
        found = self.candidates()
        out = []
        for j in chosen([values for _, values, _ in found]):
            _, _, k = found[j]
            e = self.tl.events[k]
            out.append((self.formula(k), e.phase, str(e.node)))
        return out

    @property
    def layers(self) -> int:
        """How many layers the walk writes out."""
        return int(max((iteration(n) for n in self.g.program_order()), default=0))

    def candidates(self) -> list[tuple[tuple[str, str, str, int], list[int], int]]:
        """Every candidate moment of :meth:`largest`, in the step's order: (its key -- the phase, the op's template,
        ``first``, ``last`` or ``outside`` the layers, and how many such came before --, its live bytes at each
        probe, its event)."""
        tl, subs, layers = self.tl, self.subs, self.layers
        batch = sympy.Symbol("B", positive=True, integer=True)
        b = int(subs.get(batch, 1))
        probes = [{**subs, batch: sympy.Integer(x)} for x in sorted({1, b, 4 * b, 16 * b, 256 * b})]
        # the layers repeat the same few formulas: each evaluated once at each probe, its parts too
        memo: dict[sympy.Expr, tuple[int, ...]] = {}
        parts: list[dict[sympy.Expr, Any]] = [{} for _ in probes]

        def at_probes(x: sympy.Expr) -> tuple[int, ...]:
            if x not in memo:
                memo[x] = tuple(ceiling_at(x, p, part) for p, part in zip(probes, parts, strict=True))
            return memo[x]

        values = [at_probes(self.local(i)) for i in range(len(tl.storages))]
        # the collectives on the probes' numbers where the walk's rules are written for both modes (on_probes)
        numeric = getattr(type(self)._collectives, "on_probes", False)
        if numeric:
            self.cache_kept  # noqa: B018 -- made as formulas (it holds local's) before the mode changes
            self._probe_values: dict[Any, AtProbes] = {}
            self._locals_at: dict[int, AtProbes] = {}
            self._probe_parts = parts
        alive = set(tl.start)
        # the live bytes at each probe, kept as storages are born and freed
        totals = [sum(values[i][n] for i in alive) for n in range(len(probes))]
        found: list[tuple[tuple[str, str, str, int], list[int], int]] = []
        seen: Counter[tuple[str, str, str]] = Counter()
        for k, e in enumerate(tl.events):
            for i in e.born:
                if i not in alive:
                    alive.add(i)
                    totals = [a + v for a, v in zip(totals, values[i], strict=True)]
            if e.phase in ("forward", "backward") and e.node and self._candidate(e, layers):
                at = self._on_probes(e, alive, k, probes) if numeric else None
                if at is None:
                    at = at_probes(self._collectives(e, alive, k))
                layer = iteration(e.node)
                where = (e.phase, template(e.node), "outside" if not layer else "first" if layer == 1 else "last")
                found.append(((*where, seen[where]), [a + v for a, v in zip(totals, at, strict=True)], k))
                seen[where] += 1
            for i in e.freed:
                if i in alive:
                    alive.discard(i)
                    totals = [a - v for a, v in zip(totals, values[i], strict=True)]
        return found

    def _on_probes(self, e: Any, alive: set[int], k: int, probes: list[dict[sympy.Symbol, sympy.Integer]]
                   ) -> list[int] | None:
        """What the collectives add at event ``k``, at each probe: :func:`ceiling_at` of their formula, worked out
        on the probes' numbers (None where a part is not a rational number there: the formula's route)."""
        self._probes, self.tv = probes, int(self.subs[t])
        try:
            return _ceilings(self._collectives(e, alive, k), len(probes))
        except _Inexact:
            return None
        finally:
            self._probes, self.tv = None, t

    def formula(self, k: int) -> sympy.Expr:
        """The bytes at event ``k`` beside what lives between steps, what the collectives add included (its
        ``Max`` simplified, as :meth:`candidates` does not)."""
        alive = self._alive_at(k)
        e = self.tl.events[k]
        self.evaluate = True
        try:
            extra = self._collectives(e, alive, k)
        finally:
            self.evaluate = False
        live = Counter(self.local(i) for i in alive)
        return sympy.Add(*(n * x for x, n in live.items())) + extra

    def _max(self, *args: Any) -> Any:
        """``sympy.Max``, left unevaluated (its proofs take most of the walk's time) unless :attr:`evaluate`:
        evaluated at numbers it is the same; on the probes the largest at each."""
        if self._probes is None:
            return _evaluated_max(args) if self.evaluate else sympy.Max(*args, evaluate=False)
        n = len(self._probes)
        columns = [a if type(a) is AtProbes else (_number(a),) * n for a in args]
        return AtProbes([max(c) for c in zip(*columns, strict=True)])

    def _alive_at(self, k: int) -> set[int]:
        """The storages alive at event ``k`` of the walk (born by it, not freed before it)."""
        alive = set(self.tl.start)
        for e in self.tl.events[:k]:
            alive |= set(e.born)
            alive -= set(e.freed)
        return alive | set(self.tl.events[k].born)

    def label(self, phase: str, node: str, layers: int | None = None) -> str:
        """Where a moment of :meth:`largest` is, in words (its last layer called ``layers`` where given)."""
        layer = iteration(node)
        if not layer:
            return f"the final norm's {phase} ({template(node)})"
        return f"{phase} {template(node)} (layer {layers if layers and layer == self.layers else layer})"

    def _candidate(self, e: Any, layers: int) -> bool:
        """Whether op ``e`` can be the largest moment: an op of the first or the last layer, or of the final
        norm's forward (where eager attention's whole mask and the cache's copies are still held)."""
        return (iteration(e.node) in (1, layers) or (e.phase == "forward" and e.node in self.final_norm)
                or (self.segments > 1 and bool(iteration(e.node))))

    @on_probes
    def _collectives(self, e: Any, alive: set[int], k: int) -> Any:
        """What a collective adds at this op: a row-parallel output's partial sum beside the all-reduce's two;
        a column-parallel linear's input gradient, the all-reduce's output and wrapper beside the partial."""
        tl = self.tl
        kept = self._kept(k)
        if e.phase == "backward" and str(e.node).endswith(":recompute"):
            # a checkpointed layer's forward run again: its all-reduces as in the forward
            e = replace(e, phase="forward", node=str(e.node)[:-len(":recompute")])
        if e.phase == "forward" and e.node in self.row:
            return kept + self._sum([self._bytes(i) for i in e.born if tl.storages[i].name == e.node])
        if e.phase == "backward" and e.node in self.column:
            grads = [self._bytes(i) for i in e.born if tl.storages[i].name.endswith(".grad_input0")]
            if grads:
                return kept + self._max(0, 2 * grads[0] - self._sum([self.local(i) for i in e.freed]))
        return kept

    def _kept(self, k: int) -> Any:
        """What :meth:`_cache_kept` holds at event ``k``."""
        return self._sum([self._n(size) for start, end, size in self.cache_kept if start <= k <= end])


class _SequenceWalk(_LayerWalk):
    """:class:`_LayerWalk` under sequence parallelism (torchtitan's plan, ``model_parallel_runs.llama_sequence_plan``):
    the hidden stream split over S between the row-parallel outputs' reduce-scatter and the column-parallel
    inputs' all-gather, each storage at one rank's size with what the collectives add (measured op by op on gloo):

    * a norm's output kept by column-parallel linears is one all-gathered whole copy per gather (the attention
      gathers once for q, k and v, the MLP's gate and up each once), born at the gather (its output beside funcol's
      wrapper for a moment), released at the last backward of its linears; the S-split output lives on until the
      attention returns (the input norm's) or the layer returns (the post-attention norm's: the reference's ``x``);
    * a row-parallel output (and the embedding's) is the reduce-scatter's output beside its wrapper, S-split, with
      the whole partial sum and its concatenated copy at its birth; in backward its incoming gradient is
      all-gathered whole (beside the all-gather's output and wrapper for a moment);
    * the MLP's column-parallel input gradients are each reduce-scattered (the whole partial and its copy at the
      birth, the S-split output beside its wrapper kept until summed); the attention's q, k and v input gradients
      are summed whole, then reduce-scattered once.
    """

    def __init__(self, graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime,
                 numbers: Mapping[str, int]) -> None:
        super().__init__(graph, conv, options, regime, numbers)
        g, tl = self.g, self.tl
        forward: dict[str, int] = {}
        backward: dict[str, int] = {}
        for k, e in enumerate(tl.events):
            if e.node is not None:
                if e.phase == "forward":
                    forward.setdefault(e.node, k)
                elif e.phase == "backward":
                    backward[e.node] = k
        self.qkv = {n for n in self.column if g.node(n).role == "qkv"}
        rows = sorted(forward[n] for n in self.row if n in forward)
        #: storage -> (the event after which its S-split output dies, [(gather event, release event, copies)] by
        #: gather)
        self.copies: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        for i, s in enumerate(tl.storages):
            linears = [n for n in self.keepers.get(s.name, ()) if n in self.column and n in forward]
            if s.category != "activation" or not linears:
                continue
            attention = [n for n in linears if n in self.qkv]
            # at B = 1 what a checkpointed layer's recomputation all-gathers is kept once (funcol's wrapper let go)
            recomputed = regime.checkpoint != "none" and bool(iteration(linears[0]))
            groups = ([tuple(attention)] if attention else []) + [(n,) for n in linears if n not in self.qkv]
            # (gather, release, copies): at B = 1 an asynchronous gather (outside the attention) keeps two
            spans = sorted(((min(forward[n] for n in grp), max(backward.get(n, len(tl.events)) for n in grp),
                             1 + (0 if grp[0] in self.qkv or recomputed else self.once)) for grp in groups),
                           key=lambda x: x[:2])
            after = [r for r in rows if r > spans[-1][0]]
            dies = (after[0] if attention else after[0] + 1) if after else len(tl.events)
            self.copies[i] = (dies, spans)
        self.gathered_grads = {i for i, s in enumerate(tl.storages) if s.name.endswith(".grad_sum")
                               and s.node in self.qkv}
        #: under checkpointing: each recomputation event -> its op's forward event, and the storages the
        #: recomputations make (their gathers stand where the forward's did)
        self.again = {k: forward[str(e.node)[:-len(":recompute")]] for k, e in enumerate(tl.events)
                      if e.phase == "backward" and str(e.node).endswith(":recompute")
                      and str(e.node)[:-len(":recompute")] in forward}
        self.recomputed = {i for k in self.again for i in tl.events[k].born}
        self.held = self._held(forward, rows)

    def _candidate(self, e: Any, layers: int) -> bool:
        """An op of the first or the last layer, or the head's (its input's all-gather, its input gradient's
        reduce-scatter)."""
        return super()._candidate(e, layers) or e.node == self.head or (e.node == self.embedding and
                                                                        e.phase == "backward")

    def label(self, phase: str, node: str, layers: int | None = None) -> str:
        if node == self.head:
            return ("the head's input all-gather" if phase == "forward" else
                    "the head's backward (its input gradient's reduce-scatter)")
        if node == self.embedding:
            return "the embedding's backward (its output gradient's all-gather)"
        return super().label(phase, node, layers)

    def _held(self, forward: Mapping[str, int], rows: Sequence[int]) -> list[tuple[int, int, sympy.Expr]]:
        """What eager attention's forward holds past the walk's frees until the attention returns (after the
        output projection's reduce-scatter): the key/value cache copies (the reference's ``key_states`` and
        ``value_states``) and ``attn_weights @ value_states``'s copy of the values: (from, to, bytes)."""
        tl, g = self.tl, self.g
        # made when first read (the cache copies' ops alone read it), once for the walk's passes over one step
        kept = self.__dict__.get("_freed_at")
        freed_at: dict[int, int] | None = kept[1] if kept is not None and kept[0] is tl else None
        # at B = 1 where collapsed the cache's copies are kept longer (_cache_kept), and attn @ V copies nothing
        once = self.once if self.collapsed else sympy.Integer(0)
        held = []
        for k, e in enumerate(tl.events):
            if e.phase != "forward" or e.node is None:
                continue
            name = template(e.node)
            cache = name in ("layers.self_attn.cache_key", "layers.self_attn.cache_value")
            if not cache and name != "layers.self_attn.attn_v":
                continue  # the rows after an op are read for these ops alone (the walk's every op read them)
            after = [r for r in rows if r > k]
            if not after:
                continue
            if cache:
                if freed_at is None:
                    freed_at = {i: j for j, x in enumerate(tl.events) for i in x.freed if x.phase == "forward"}
                    self.__dict__["_freed_at"] = (tl, freed_at)
                held += [(freed_at[i] + 1, after[0], (1 - once) * self.local(i)) for i in e.born
                         if freed_at.get(i, after[0]) < after[0]]
            else:
                held.append((k, after[0], (1 - once) * g.node(g.node(e.node).inputs[1]).out.numel * 4 / t))
        return held

    def _whole(self, node: str) -> Any:
        """``node``'s whole output in bytes (the single device's), in the collectives' mode."""
        return self._n(self.g.node(node).out.numel * 4)

    def _local(self, i: int) -> sympy.Expr:
        s = self.tl.storages[i]
        if s.category in ("parameter", "optimizer_state", "input", "buffer", "gradient") or (
                self.collapsed and template(s.name) in REPEATS):
            return super()._local(i)
        size = s.nbytes
        if s.name in self.row or s.name == self.embedding:
            return 2 * size / t  # the reduce-scatter's output beside funcol's wrapper
        if s.name == self.head:
            return size + size / t
        if i in self.copies:
            return sympy.Add(*(n for _, _, n in self.copies[i][1])) * size
        if s.node in self.column and s.name.endswith(".grad_input0"):
            return size if s.node in self.qkv else 2 * size / t
        if i in self.gathered_grads:
            return size
        if self._split(s.node, s.name):
            return size / t
        return size / t if self._stream(s.node, s.name) else size

    @cached_property
    def _streams(self) -> dict[str, bool]:
        """:meth:`_stream`'s answers by template (made on first use: the pipeline's sizes walk without
        :meth:`__init__`)."""
        return {}

    def _stream(self, node: str | None, name: str) -> bool:
        """Whether the storage holds a (B, S, ...) tensor (an input's gradient or copy: that input's)."""
        if node is None or node not in self.g:
            return False
        source = node
        suffix = name[len(node):] if name.startswith(node) else ""
        if suffix.startswith(".grad_input") and suffix[len(".grad_input"):].isdigit():
            source = self.g.node(node).inputs[int(suffix[len(".grad_input"):])]
        elif name.endswith(".grad_sum") and name[:-len(".grad_sum")] in self.g:
            source = name[:-len(".grad_sum")]
        # the layers' copies of one node share its shape: decided once (printing the sizes was most of the walk's
        # storages' time)
        key = template(source)
        found = self._streams.get(key)
        if found is None:
            found = self._streams[key] = [str(d) for d in self.g.node(source).out.shape[:2]] == ["B", "S"]
        return found

    @on_probes
    def _collectives(self, e: Any, alive: set[int], k: int) -> Any:
        found = self._sequence_collectives(e, alive, k)
        if self.ahead:  # checkpointed layers (passes/tensor_checkpoint.py)
            from .tensor_checkpoint import recompute_gathers

            found += recompute_gathers(self, e, k)
        return found

    @cached_property
    def ahead(self) -> dict[int, str]:
        """Under checkpointing, each recomputation's events -> the row-parallel linear whose output gradient was
        all-gathered before it (:func:`~symmem.passes.tensor_checkpoint.gathered_ahead`); empty without."""
        from .tensor_checkpoint import gathered_ahead

        return gathered_ahead(self.tl.events, self.row) if self.checkpointed else {}

    def _sequence_collectives(self, e: Any, alive: set[int], k: int) -> Any:
        tl = self.tl
        extra = self._sum([])
        released = self._sum([])  # gathered copies let go inside this event
        # a recomputation's event stands for its forward one where the storage is the recomputation's own
        again = self.again.get(k)
        for i, (dies, spans) in self.copies.items():
            if i not in alive:
                continue
            size = self._bytes(i)
            # (an empty sum adds nothing: not built)
            redone = again is not None and i in self.recomputed
            if e.phase == "forward" or redone:
                at = again if redone else k
                later = [self._n(n) for f, _, n in spans if f > at]
                if later:
                    extra -= self._sum(later) * size
                if at <= dies:
                    extra += size / self.tv
                for f, _, n in spans:
                    if f == at:  # the all-gather's output beside its wrapper (at B = 1 both kept: counted)
                        born = self._sum([self.local(j) for j in e.born])
                        if redone:  # recomputed at B = 1: the wrapper kept past the linear's mm, then let go
                            once = self._n(self.once)
                            extra += once * size + (1 - once) * self._max(0, size - born)
                        else:
                            extra += (2 - self._n(n)) * self._max(0, size - born)
            elif e.phase == "backward":
                done = [self._n(n) for _, r, n in spans if r < k]
                if done:
                    extra -= self._sum(done) * size
                if i not in e.freed:
                    gone = [self._n(n) for _, r, n in spans if r == k]
                    if gone:
                        released += self._sum(gone) * size
        freed = self._sum([self.local(j) for j in e.freed]) + released
        extra += self._sum([self._n(size) for start, end, size in self.held if start <= k <= end]) + self._kept(k)
        if e.phase == "forward" and e.node in self.row:
            return extra + 2 * self._sum([self._bytes(i) for i in e.born if tl.storages[i].name == e.node])
        if e.phase == "backward" and e.node == self.embedding:
            # the stream's gradient all-gathered whole (beside the all-gather's output for a moment), then the
            # embedding's gradient made (V x H, whole) and the S-split gradient let go
            whole = self._whole(self.embedding)
            born = self._sum([self.local(j) for j in e.born])
            return extra + self._max(2 * whole - born, whole - freed)
        if e.phase == "backward" and e.node in self.row:
            whole = self._whole(e.node)  # the all-gathered output gradient
            born = self._sum([self.local(j) for j in e.born])
            return extra + whole + self._max(0, whole - born)
        if e.phase == "backward" and e.node in self.column and e.node not in self.qkv:
            grads = [self._bytes(i) for i in e.born if tl.storages[i].name.endswith(".grad_input0")]
            # the head's output gradient: the replicated one's local shard, made contiguous (the logits / t)
            logits = self._whole(self.head) / self.tv if e.node == self.head else 0
            if grads:
                return extra + self._max(logits + grads[0] - 2 * grads[0] / self.tv, 2 * grads[0] - freed)
        return extra
