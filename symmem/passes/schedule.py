"""The training step op by op: every storage's birth and death, and the live bytes after every op.

The step PyTorch runs (``zero_grad(set_to_none=True)`` at the end of the previous one)::

    loss = loss_fn(model(x), y)     # forward: the graph in program order
    loss.backward()                 # backward: the graph in reverse
    optimizer.step()                # per parameter (for-loop) or all at once (foreach, fused)
    optimizer.zero_grad()           # the gradients are freed

is simulated on an unrolled graph (:mod:`.unroll`) whose shapes are symbolic.  Live memory after each op is
what exists when its outputs have been allocated and before anything it was the last to use is freed (the
most the op needs):

* **forward** -- a new output is born when its op runs; it dies after its last use, unless the convention
  says an op keeps it for backward (then it dies once the last of its keepers has run backward) or the caller
  holds it (the loss; the logits with ``keep_logits``);
* **backward** -- an op's backward allocates what its rule says (:mod:`symmem.conventions.pytorch.backward`):
  a gradient per input that requires grad (new, or an alias of the gradient it received), its parameters'
  gradients and temporaries; a value used twice sums its gradients out of place; the gradient an op received
  is freed after its backward unless an alias of it still waits; saved tensors die after their last keeper;
* **step** -- the optimizer's temporaries, and in the first step its state, which it creates lazily
  (:func:`step_events`); **zero_grad** frees the gradients.

:class:`Simulation` walks the step one phase per method; what it gives is a :class:`~symmem.timeline.Timeline`,
the one model of time (the recorded step of a traced module gives one too).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ..conventions import Convention
from ..errors import SymmemError
from ..graph import Graph, Node
from ..ops import requires_grad
from ..shapes import numel as shape_numel
from ..symbols import N
from ..tensor import TensorSpec, dtype_bytes
from ..timeline import Event, Live, Timeline, make_event, make_live
from ..training import Regime, checkpoint_every
from . import data_parallel, selective, zero_redundancy
from .fsdp1 import FSDP1, Fsdp1
from .parameters import in_registration_order, program_parameters, state_storages
from .saved import kept
from .storage import Branch, is_view

#: Micro-batches of gradient accumulation written out in a step's schedule (later ones repeat the second).
MICRO_BATCH_PASSES = 3
#: Nodes that exist before the step: neither made in the forward nor freed.
_HELD = ("input", "parameter", "buffer")


@dataclass(frozen=True)
class RuleAnswers:
    """What a walk of one graph asks the convention, asked ahead for every op (:func:`rule_answers`): which ops are
    views (``views``), what each saves (``saves``) and what the backward of each that requires grad allocates
    (``grads``).  Two walks of one graph whose answers are equal are the same walk: nothing else a walk does
    depends on the branch (the truth of a size condition) it is walked in."""

    views: tuple[str, ...]
    saves: Mapping[str, list[Any]]
    grads: Mapping[str, Any]


def rule_answers(graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime,
                 branch: Branch | None) -> RuleAnswers | None:
    """The convention's answers a walk of ``graph`` in ``branch`` gets (:class:`RuleAnswers`), or None where a rule
    refuses an op (the walk then says so, in its own words, where it asks)."""
    act = regime.activation_dtype
    rule_options = {**options, "activation_dtype": act, "branch": branch}
    order = list(graph.program_order())
    views = tuple(n for n in order if graph.node(n).view_of is not None and is_view(graph, n, act, branch))
    saves: dict[str, list[Any]] = {}
    grads: dict[str, Any] = {}
    try:
        for n in order:
            node = graph.node(n)
            saves[n] = conv.saved(graph, node, rule_options)
            if requires_grad(graph, n):
                grads[n] = conv.grads(graph, node, rule_options)
    except Exception:  # a rule that fails on an op no walk asks about must not fail the peak: no answers
        return None
    return RuleAnswers(views, saves, grads)


#: the ops whose backward runs cuBLAS matrix products on the output's gradient
_MM_KINDS = ("linear", "matmul")


def optimizer_impl(regime: Regime, device: str) -> str:
    """The implementation PyTorch's optimizers pick: for-loop on the CPU, foreach on CUDA (unless the regime
    names one)."""
    impl = getattr(regime, "optimizer_impl", "auto")
    if impl != "auto":
        return impl
    return "foreach" if device == "cuda" else "for-loop"


def simulate(graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime,
             branch: Branch | None = None, *, keep_logits: bool = False, rules: RuleAnswers | None = None
             ) -> tuple[Timeline, Timeline]:
    """The timelines (steady, first) of one training step of the (unrolled) ``graph``, from one walk: the first
    step creates the optimizer state inside the step, a steady one has it from the start; they differ only
    there.  ``rules``: the convention's answers for this graph and branch, asked already
    (:func:`rule_answers`)."""
    # ZeRO-1's ranks differ only in the optimizer's state and step: one walk of forward and backward serves them
    walks = options.get(zero_redundancy.WALKS_OPTION)
    key = None if walks is None else (None if branch is None else tuple(sorted((str(c), v) for c, v in
                                                                               branch.items())), keep_logits)
    sim = walks.get(key) if walks is not None else None
    if sim is not None:
        sim.choose(options)
        return sim.timeline(first=False), sim.timeline(first=True)
    sim = Simulation(graph, conv, options, regime, branch, keep_logits, rules)
    # From the second micro-batch on every pass starts from the same live storages (each .grad exists and takes
    # the new gradient in place), so the third and later passes repeat the second: written out up to
    # MICRO_BATCH_PASSES times, the peak is exact for any K, and K = 10**6 does not take a million passes
    # (tests/test_properties.py::test_micro_batches_repeat checks it against every pass written out).
    for _ in range(min(regime.micro_batches, MICRO_BATCH_PASSES)):
        sim.micro_batch()
    if walks is not None:
        walks[key] = sim
    return sim.timeline(first=False), sim.timeline(first=True)


class Simulation:
    """One training step of an unrolled graph, walked phase by phase: each method is one phase (a micro-batch's
    forward, loss and backward, a checkpointed segment's recomputation, the optimizer step, zero_grad), and the
    walk's state -- storages and events so far, who owns what, which gradients wait -- is fields."""

    def __init__(self, graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime,
                 branch: Branch | None, keep_logits: bool, rules: RuleAnswers | None = None) -> None:
        if regime.tensor_parallel or regime.pipeline_parallel:
            stages = ("; each pipeline stage's peak as torch.distributed.pipelining runs it: symmem stages"
                      if regime.pipeline_parallel and not (regime.tensor_parallel or regime.zero) else "")
            raise SymmemError("the peak follows one device's training step op by op; tensor and pipeline "
                              f"parallelism are not modelled there (the kept memory and total are){stages}")
        if regime.checkpoint == "selective" and not graph.graph.get("recomputed_core"):
            raise SymmemError("the peak with selective recomputation is modelled for eager attention (a checkpointed "
                              "core attention), not this model's (the kept memory and total are); full and every-K "
                              "checkpointing are")
        self.graph, self.conv, self.regime = graph, conv, regime
        self.act = regime.activation_dtype
        self.order = list(graph.program_order())
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.storages: list[Live] = []
        self.events: list[Event] = []
        self.start: list[int] = []
        self.rule_options = {**options, "activation_dtype": self.act, "branch": branch}
        self._out_sizes: dict[str, sympy.Expr] = {}
        self._sizes: dict[tuple[Any, str], sympy.Expr] = {}
        # (``rules``: asked ahead for this graph and branch, :func:`rule_answers`)
        self._saves: dict[str, list[Any]] = {} if rules is None else dict(rules.saves)
        self._grads: dict[str, Any] = {} if rules is None else dict(rules.grads)
        self._keepers(options, branch)
        self._identities(branch)
        self._parameter_side(str(options.get("device", "cpu")))
        self._plan(keep_logits)

    # -- building blocks -----------------------------------------------------------------------------------
    def new(self, name: str, category: str, nbytes: sympy.Expr, node: str | None = None, host: bool = False) -> int:
        self.storages.append(make_live(name, category, nbytes, node, host))
        return len(self.storages) - 1

    def event(self, phase: str, node: str | None, born: list[int], freed: list[int]) -> None:
        self.events.append(make_event(phase, node, tuple(born), tuple(dict.fromkeys(freed))))

    def size(self, spec: TensorSpec) -> sympy.Expr:
        # by shape and dtype: a walk asks for the same few sizes thousands of times (each a sympy product of the
        # shape, then by the bytes), and the same shape and dtype make the same size
        key = (spec.shape, spec.dtype)
        found = self._sizes.get(key)
        if found is None:
            found = self._sizes[key] = spec.numel * dtype_bytes(spec.dtype, self.act)
        return found

    # -- each op's rules and sizes, worked out once per walk ------------------------------------------------
    # every micro-batch walks the same ops with the same rule options, and a checkpointed segment's recompute walks
    # its forward again: the rules' answers and the outputs' bytes are the same each time (a sympy product per ask)
    def out_size(self, n: str) -> sympy.Expr:
        """The bytes of ``n``'s output (:meth:`size` of its spec)."""
        found = self._out_sizes.get(n)
        if found is None:
            found = self._out_sizes[n] = self.size(self.graph.node(n).out)
        return found

    def saves(self, node: Node) -> list[Any]:
        """What the convention says ``node`` saves for backward (``conv.saved`` under the walk's rule options)."""
        found = self._saves.get(node.name)
        if found is None:
            found = self._saves[node.name] = self.conv.saved(self.graph, node, self.rule_options)
        return found

    def grads_of(self, node: Node) -> Any:
        """What ``node``'s backward allocates (``conv.grads`` under the walk's rule options)."""
        found = self._grads.get(node.name, self._grads)
        if found is self._grads:
            found = self._grads[node.name] = self.conv.grads(self.graph, node, self.rule_options)
        return found

    # -- what holds what, worked out once ------------------------------------------------------------------
    def _keepers(self, options: Mapping[str, Any], branch: Branch | None) -> None:
        """What the convention keeps, and who keeps it."""
        saved = kept(self.graph, self.conv, options, self.act, self.order, False, branch, saves=self.saves)
        self.segment_of = _segments(self.graph, self.regime)  # checkpointed node -> its segment (one layer, or K)
        # selective: each layer's core attention is a segment, called with its marked inputs (passes/selective.py)
        self.calls: dict[Any, tuple[list[str], list[Any]]] = {}
        self.returned: list[tuple[str, str]] = []
        if self.regime.checkpoint == "selective":
            self.segment_of, self.calls, self.returned = selective.unrolled(self.graph)
        # inside a checkpointed segment no op keeps a tensor (checkpoint packs a handle): only keepers outside do
        self.all_keepers: dict[str, tuple[str, ...]] = {s.name: s.keepers for s in saved}
        keepers = {k: tuple(x for x in v if x not in self.segment_of) for k, v in self.all_keepers.items()}
        self.keepers = {k: v for k, v in keepers.items() if v}

    def _identities(self, branch: Branch | None) -> None:
        """The storage of every value (views lead to their base) and the ops that read each storage."""
        graph = self.graph
        self.base: dict[str, str] = {}
        for n in self.order:
            node = graph.node(n)
            if node.view_of is not None and is_view(graph, n, self.act, branch):
                self.base[n] = self.base[node.inputs[node.view_of]]
            else:
                self.base[n] = n
        self.uses: dict[str, list[str]] = defaultdict(list)
        for n in self.order:
            for i in graph.node(n).inputs:
                self.uses[self.base[i]].append(n)

    def _parameter_side(self, device: str) -> None:
        """The weights, buffers and the batch (alive from the start), and the optimizer state of each weight."""
        regime, graph = self.regime, self.graph
        parts = regime.precision_spec.parts
        weights_bytes = sum(c.bytes for c in parts if c.kind != "gradients")
        # --zero K is the papers' (and DeepSpeed's estimators') accounting: each component its stage shards is
        # divided by N, nothing else added (no all-gather buffers: --data-parallel fsdp models the engines')
        self.grad_bytes = sum(c.bytes / self.zero_shards(c.name) for c in parts if c.kind == "gradients")
        if regime.param_dtype is not None:  # FSDP2's policy: backward makes the unsharded gradients in param_dtype
            self.grad_bytes = dtype_bytes(regime.param_dtype)
        zero_weights = sum(c.bytes / self.zero_shards(c.name) for c in parts if c.kind != "gradients")
        self.impl = optimizer_impl(regime, device)
        # Adam's step counts are CPU tensors unless the fused implementation runs: host memory beside a CUDA step
        step_on_host = device == "cuda" and self.impl != "fused"
        self.owner: dict[str, int] = {}     # storage name -> id, for values alive across the step
        params = program_parameters(graph)
        for n in self.order:
            node = graph.node(n)
            if node.kind in ("input", "buffer"):
                cat = "input" if node.kind == "input" else "parameter"
                self.owner[n] = self.new(n, cat, self.size(node.out), n)
                self.start.append(self.owner[n])
            for bname, spec in node.buffers.items():
                self.start.append(self.new(f"{n}.{bname}", "parameter", self.size(spec), n))
        self.numel = {name: shape_numel(shape) for name, shape in params}
        self.params = params
        self.fsdp = self._sharding(weights_bytes)
        # what each rank's optimizer holds and steps on: the whole parameter, or under FSDP its shard
        #: FSDP1's optimizer steps on one flat shard per unit (passes/fsdp1.py), not on the parameters
        self.flat: list[tuple[str, tuple[sympy.Expr, ...]]] | None = None
        if isinstance(self.fsdp, Fsdp1):
            self.flat = [(name, (k,)) for name, k in self.fsdp.flat_params()]
            held = dict(self.flat)
        else:
            stored = data_parallel.stored_shapes(graph, params) if self.fsdp else dict(params)
            rank = self.rule_options.get(data_parallel.RANK_OPTION, 0)
            # a number, or the last rank as a formula in N (N - 1: passes/rank_formulas.py)
            rank = rank if isinstance(rank, sympy.Expr) and not rank.is_number else int(rank)
            held = {name: data_parallel.held_shape(stored[name], N, rank) if self.fsdp else shape
                    for name, shape in params}
        stepped = self.flat if self.flat is not None else params
        self.step_numel = {name: shape_numel(held[name]) for name, _ in stepped}
        for name, _ in stepped:
            each = self.fsdp.shard[name] if self.fsdp and self.flat is None else self.step_numel[name]
            self.start.append(self.new(f"{name}.weights", "parameter", each * zero_weights))
        self.state_ids: dict[str, list[int]] = {}
        for name, _ in stepped:
            self.state_ids[name] = [self.new(*s) for s in state_storages(regime, name, held[name], step_on_host)]
        self.choose(self.rule_options)
        # a data-parallel engine's buffers made when the model is wrapped (DDP's gradient buckets)
        for name, nbytes in data_parallel.buckets(regime, params, self.numel, self.grad_bytes):
            self.start.append(self.new(name, "gradient", nbytes))
        self.grads_in_buckets = data_parallel.grads_in_buckets(regime)

    def choose(self, options: Mapping[str, Any]) -> None:
        """The state alive from the start of a steady step (every parameter's), and under ZeroRedundancyOptimizer
        the rank's (the ``options`` name it) -- its local optimizer holds and steps the whole parameters it owns;
        the others' state storages are never born.  Worked out when the optimizer step is first walked
        (:attr:`owned`, :attr:`states`): ZeRO-1's ranks share a walk of forward and backward that never steps."""
        self._options, self._chosen = options, None

    def _choice(self) -> tuple[list[tuple[str, tuple[sympy.Expr, ...]]] | None, list[int]]:
        if self._chosen is None:
            owned = zero_redundancy.owned(self.regime, self._listed(), self._options)
            mine = None if owned is None else {name for name, _ in owned}
            stepped = self.flat if self.flat is not None else self.params  # FSDP1 steps its flat shards
            states = [i for name, _ in stepped for i in self.state_ids[name] if mine is None or name in mine]
            self._chosen = (owned, states)
        return self._chosen

    @property
    def owned(self) -> list[tuple[str, tuple[sympy.Expr, ...]]] | None:
        """The parameters this rank's ZeroRedundancyOptimizer steps, in its order (None: every parameter)."""
        return self._choice()[0]

    @property
    def states(self) -> list[int]:
        """The optimizer state alive from the start of a steady step."""
        return self._choice()[1]

    def zero_shards(self, component: str) -> sympy.Expr:
        """N where the regime's ZeRO stage shards ``component`` (training.ZERO_STAGE_OF_CLASS), else 1."""
        return N if self.regime.zero and self.regime.shard(component) else sympy.Integer(1)

    def _sharding(self, weights_bytes: int) -> data_parallel.Fsdp | None:
        """FSDP2's units and buffers (passes/data_parallel.py), or None under another engine."""
        engine = self.regime.data_parallel
        if engine not in data_parallel.SHARDED and engine not in FSDP1:
            return None
        # full and every-K checkpointing are walked, and FSDP2's and FSDP1's gradient accumulation (measured:
        # tests/test_data_parallel.py's CHECKPOINTED); selective too: a core attention holds no unit's first or last
        # op, so no FSDP hook runs inside its recompute (measured: tests/test_selective_engines.py)
        if self.regime.precision != "fp32":
            raise SymmemError(f"the peak under data_parallel={engine!r} is modelled in fp32: "
                              f"precision={self.regime.precision!r} is the papers' accounting of 16-bit copies, not "
                              "what an engine holds; FSDP2's own MixedPrecisionPolicy is param_dtype='bfloat16' "
                              "(--param-dtype)")
        data_parallel.refuse_policy(self.regime, self.graph)  # FSDP2's MixedPrecisionPolicy where not measured
        if engine in FSDP1:
            return Fsdp1(self, N, weights_bytes, FSDP1[engine])
        return data_parallel.Fsdp(self, N, weights_bytes, data_parallel.SHARDED[engine],
                                  data_parallel.policy_bytes(self.regime))

    def _plan(self, keep_logits: bool) -> None:
        """When forward values die, which nodes run backward, the checkpointed segments and what they hold."""
        graph, base, pos = self.graph, self.base, self.pos
        self.held_to_end: set[str] = set()
        outputs = [n for n in self.order if graph.out_degree(n) == 0
                   and graph.node(n).kind not in ("input", "parameter", "buffer", "constant")]
        self.final = outputs[-1] if outputs else self.order[-1]
        self.keep_logits = keep_logits
        self.held_to_end.add(base[self.final])
        if keep_logits:
            out = _model_output(graph)
            if out is not None:
                self.held_to_end.add(base[out])
        last_use = {s: max(pos[u] for u in us) for s, us in self.uses.items()}
        # a value a caller's local variable holds past its last use (graph.graph["held_until"]: node -> the node
        # until whose forward it lives, or "forward": until the model's forward returns -- after the loss for a
        # causal LM that takes labels; the causal LM loss's padded labels, symmem/loss.py; Llama's position ids
        # and mask, its cache's copies).  What the model's output holds ("forward": a cache) is not kept from a
        # checkpointed layer: transformers passes such layers no cache
        model = [n for n in self.order if graph.node(n).group != "loss"]
        ends = self.order[-1] if graph.graph.get("causal_lm") or not model else model[-1]
        for s, until in graph.graph.get("held_until", {}).items():
            if until == "forward" and s in self.segment_of:
                continue
            until = ends if until == "forward" else until
            if s in base and until in pos:
                last_use[base[s]] = max(last_use.get(base[s], pos[s]), pos[until])
        if self.regime.param_dtype is not None:  # FSDP2's policy: what callers hold, no longer kept by an op
            for s, until in data_parallel.caller_holds(graph, self.order).items():
                last_use[base[s]] = max(last_use.get(base[s], pos[s]), pos[until])
        for s, until in self.returned:  # attention weights a checkpointed core returned, held by the layer
            last_use[base[s]] = max(last_use.get(base[s], pos[s]), pos[until])
        self.dies_forward: dict[int, list[str]] = defaultdict(list)
        for s in set(base.values()):
            if s in self.keepers or s in self.held_to_end or graph.node(s).kind in _HELD:
                continue
            self.dies_forward[last_use.get(s, pos[s])].append(s)
        self.needs = _needs_grad(graph, self.order, self.final)
        self.segments: dict[Any, list[Node]] = defaultdict(list)
        for n in self.order:
            if n in self.segment_of:
                self.segments[self.segment_of[n]].append(graph.node(n))
        # the segment's last node to run backward: its first node in program order that runs backward
        self.segment_end = {sg: next((m.name for m in nodes if m.name in self.needs), None)
                            for sg, nodes in self.segments.items()}
        # what each segment's checkpoint holds: every storage made outside it that its ops read
        self.frame_inputs: dict[Any, list[str]] = {}
        for sg, nodes in self.segments.items():
            inside = {m.name for m in nodes}
            found = dict.fromkeys(base[x] for m in nodes for x in m.inputs if base[x] not in inside)
            self.frame_inputs[sg] = [x for x in found if graph.node(x).kind not in _HELD]
            if sg in self.calls:  # what the core is called with and reads not (Llama's position ids), extras
                names, extras = self.calls[sg]
                more = [base[x] for x in names if graph.node(base[x]).kind not in _HELD] + [e[0] for e in extras]
                self.frame_inputs[sg] += [x for x in dict.fromkeys(more) if x not in self.frame_inputs[sg]]
        self.groups = _splits(graph, self.order)
        self.tied_to = _tied(graph, self.order)
        self.param_grad: dict[str, int] = {}  # weight -> its .grad
        self.passes = 0  # micro-batches walked

    # -- the phases ----------------------------------------------------------------------------------------
    def micro_batch(self) -> None:
        """One forward and backward pass; with gradients from an earlier micro-batch, each weight's new
        gradient is added into its .grad in place and freed."""
        self.new_saved: dict[str, list[int]] = defaultdict(list)
        self.passes += 1
        if self.fsdp:  # FSDP2's no_sync (set_requires_gradient_sync(False)) on every micro-batch but the last
            self.fsdp.sync = self.passes == min(self.regime.micro_batches, MICRO_BATCH_PASSES)
        self.forward()
        if self.graph.node(self.final).group != "loss":
            self.loss()
        self.backward()

    def forward(self) -> None:
        """The graph in program order: each op's output and what it saves are born, values at their last use die
        (checkpoint keeps each segment's inputs -- the layer input, masks or tables passed to it -- until the
        segment's backward is done)."""
        graph, base = self.graph, self.base
        frame_held = {x for sg in self.segments for x in self.frame_inputs[sg]}
        fsdp = self.fsdp
        # the ops FSDP's forward hooks act at (a unit's first and last op, the root's end): called there only
        before, after = (fsdp.forward_hooks() if fsdp else ((), ()))
        if fsdp:
            fsdp.start_forward()
        # tensors the checkpointed cores are called with that the graph has no node for (GPT-2's mask)
        extras = {e[0]: e for _, more in self.calls.values() for e in more}
        if extras:
            for name, shape, dtype in extras.values():
                self.owner[name] = self.new(name, "activation", self.size(TensorSpec(tuple(shape), dtype)))
            self.event("forward", None, [self.owner[e] for e in extras], [])
        for n in self.order:
            node = graph.node(n)
            if node.kind in _HELD:
                continue
            if n in before:
                fsdp.before_forward(n)
            born = []
            if base[n] == n:
                cat = "loss" if node.group == "loss" else ("activation" if n in self.keepers else "temporary")
                self.owner[n] = self.new(n, cat, self.out_size(n), n)
                born.append(self.owner[n])
            freed = [self.owner[s] for s in self.dies_forward.get(self.pos[n], [])
                     if s in self.owner and s not in frame_held]
            for ref in self.saves(node):
                if ref.source == "new":
                    assert ref.spec is not None
                    cat = "loss" if node.group == "loss" else "activation"
                    checkpointed = n in self.segment_of
                    sid = self.new(f"{n}.{ref.label}", "temporary" if checkpointed else cat, self.size(ref.spec),
                                   n, ref.host)
                    born.append(sid)
                    if checkpointed:
                        freed.append(sid)  # not kept, recomputed in backward
                    else:
                        self.new_saved[n].append(sid)
            self.event("forward", n, born, freed)
            if n in after:
                fsdp.after_forward(n)

    def loss(self) -> None:
        """No loss in the graph: the step reduces the output with .sum(), which keeps nothing for backward."""
        total = self.new("output.sum", "loss", self.size(TensorSpec((), self.sum_dtype())))
        self.owner["output.sum"] = total
        self.held_to_end.add("output.sum")
        out = self.base[self.final]
        drop = []
        if not self.keep_logits and self.graph.node(out).kind not in _HELD:
            self.held_to_end.discard(out)  # loss = model(x).sum(): the output lives on only if an op keeps it
            if out not in self.keepers:
                drop.append(self.owner[out])
        self.event("forward", "sum", [total], drop)

    def sum_dtype(self) -> str:
        """The dtype of the loss ``.sum()`` and of its gradient: FP32, or under FSDP2's MixedPrecisionPolicy the
        output's own (a 16-bit sum of 16-bit logits, measured); a loss in the graph keeps FP32 as before."""
        if self.regime.param_dtype is None or self.graph.node(self.final).group == "loss":
            return "float32"
        return self.graph.node(self.base[self.final]).out.dtype

    def backward(self) -> None:
        """The graph in reverse, from the loss's gradient; checkpointed segments are recomputed first."""
        graph = self.graph
        self.grad_of: dict[str, int] = {}
        self.refs: Counter = Counter()
        self.freed_at: dict[str, list[int]] = defaultdict(list)  # saved storages, freed after their last keeper
        for s, ks in self.keepers.items():
            if s in self.owner and s not in self.held_to_end and graph.node(s).kind not in _HELD:
                last = min((k for k in ks if k in self.needs), key=self.pos.__getitem__, default=None)
                self.freed_at[last or ""].append(self.owner[s])
        seed = self.new("loss.grad", "activation_grad", self.size(TensorSpec((), self.sum_dtype())))
        self.grad_of[self.final] = seed
        self.refs[seed] += 2  # the engine holds the root's gradient until backward ends
        self.event("backward", None, [seed], [])
        fsdp = self.fsdp
        if fsdp:
            fsdp.plan_backward(self.needs)
            if fsdp.loss_inside:
                fsdp.at = None
                fsdp.pre_backward(None)  # the root's output is the loss
        self.param_uses = _param_uses(graph, self.order, self.needs, self.tied_to)
        self.waiting: dict[str, int] = {}  # a weight's gradients that wait for its other uses
        self.recomputed: set[Any] = set()
        self.done: set[Any] = set()  # segments whose backward has finished
        for n in reversed(self.order):
            if n not in self.grad_of or n not in self.needs:
                continue
            sg = self.segment_of.get(n)
            group = self.groups.get(n)
            split = group is not None and n != group[0]
            if sg is not None and sg not in self.recomputed:
                self.recomputed.add(sg)
                if fsdp and not split and fsdp.acts_before_backward(n):
                    # FSDP2's pre-backward hook is the checkpoint wrapper's output's: it unshards the unit (and
                    # prefetches the next) before autograd unpacks the saved handles that run the recompute
                    fsdp.before_backward(n)
                self.recompute(self.segments[sg])
            if split:
                continue  # a part of a split: the first part gathers every part's gradient
            if fsdp and fsdp.acts_before_backward(n):
                fsdp.before_backward(n)
            handoff, params_out = self._backward_op(n, sg, group)
            self._gather(n, handoff, params_out)
            if fsdp and n in fsdp.backward_ends:
                fsdp.after_backward(n)
        ended = fsdp.end_backward() if fsdp else []
        self.event("backward", None, [], [*ended, *self.freed_at.get("", []),
                                          *(self.owner[s] for s in self.held_to_end if s in self.owner)]
                   + [sid for sid, r in self.refs.items() if r > 0])

    def _backward_op(self, n: str, sg: Any, group: list[str] | None
                     ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """One op's backward formula: it allocates the inputs' gradients, the parameters' and its temporaries;
        then what it received and what it kept are freed.  Gives the gradients to hand to their values and the
        weights' gradients."""
        graph, numel = self.graph, self.numel
        node = graph.node(n)
        g = self.grads_of(node)
        if g is None:
            raise SymmemError(f"the {self.conv.name} convention does not model the backward pass, so it has no peak")
        born: list[int] = []
        handoff: list[tuple[str, int]] = []
        incoming = [self.grad_of[m] for m in (group or [n]) if m in self.grad_of]
        params_out: list[tuple[str, int]] = []
        for i, x in enumerate(node.inputs):
            xn = graph.node(x)
            if not requires_grad(graph, x) or (group is not None and i > 0):
                continue
            if xn.kind == "parameter":
                pid = self.new(f"{x}.grad", "gradient", numel[x] * self.grad_bytes, n)
                born.append(pid)
                params_out.append((x, pid))
                continue
            if group is None and g.of(i) == "alias":
                sid = self.grad_of[n]
            else:
                sid = self.new(f"{n}.grad_input{i}", "activation_grad", self.out_size(x), n)
                born.append(sid)
            self.refs[sid] += 1
            handoff.append((x, sid))
        late: list[int] = []
        for key in [f"{n}.{p}" for p in node.params] + ([self.tied_to[n]] if n in self.tied_to else []):
            pid = self.new(f"{key}.grad", "gradient", numel[key] * self.grad_bytes, n)
            # a recomputed (checkpointed) input is dropped once the weight's gradient used it, before a
            # linear's bias gradient is summed (measured): that one comes after the free
            (late if sg is not None and node.kind == "linear" and key.endswith(".bias") else born).append(pid)
            params_out.append((key, pid))
        temps = [self.new(f"{n}.temp", "temporary", self.size(spec), n) for spec in g.temps]
        if n == self.final and node.kind in _MM_KINDS and node.group != "loss" and (
                self.rule_options.get("device") == "cuda"):
            # the loss .sum()'s gradient reaches the output as a 0-dim one expanded (strides 0): cuBLAS takes no
            # such matrix, so each mm of the backward clones it dense first (prepare_matrix_for_cublas), one at a
            # time, beside the gradients it makes (an H200's allocator history, docs/cuda.md); the CPU's addmm
            # clones it inside the kernel, where no dispatcher-level tracker sees it
            temps.append(self.new(f"{n}.grad_dense", "temporary", self.size(node.out), n))
        made: list[int] = []  # temporaries an earlier node of the op made (cross-entropy's nll_loss backward)
        if node.kind == "cross_entropy" and temps and not late and self._nll_backward(n, temps):
            made, temps = temps, []
        if late:
            self.event("backward", n, born + temps, list(self.freed_at.pop(n, [])))
            born, temps = late, []
        freed = list(temps) + made
        for sid in incoming:
            self.refs[sid] -= 1
            if self.refs[sid] == 0:
                freed.append(sid)
        freed += self.freed_at.get(n, []) + self.new_saved.get(n, [])
        if sg is not None and n == self.segment_end.get(sg):
            for src in self.frame_inputs[sg]:  # the checkpoint frame lets its inputs go
                if src in self.owner and src not in self.keepers and src not in self.held_to_end and not any(
                        src in self.frame_inputs[other] for other in self.segments
                        if other != sg and other not in self.done):
                    freed.append(self.owner[src])
            self.done.add(sg)
        self.event("backward", n, born + temps, freed)
        return handoff, params_out

    def _nll_backward(self, n: str, temps: list[int]) -> bool:
        """Cross-entropy's backward is two autograd nodes: ``NllLossBackward`` makes its zero gradient, then
        releases what it saved -- the target's copy and ``total_weight`` -- before ``LogSoftmaxBackward`` makes the
        logits' gradient (measured: the log-probabilities stay, kept by ``LogSoftmaxBackward`` too).  The first
        node is an event of its own (True: it was)."""
        mine = [sid for sid in self.freed_at.get(n, []) + self.new_saved.get(n, [])
                if not self.storages[sid].name.endswith(".log_probs")]
        if not mine:
            return False
        for sid in mine:
            if sid in self.freed_at.get(n, []):
                self.freed_at[n].remove(sid)
            else:
                self.new_saved[n].remove(sid)
        self.event("backward", n, temps, mine)
        return True

    def _gather(self, n: str, handoff: list[tuple[str, int]], params_out: list[tuple[str, int]]) -> None:
        """Each gradient goes to its value's buffer; a second one there is summed out of place.  A weight used
        by several ops (tied) gathers its gradients the same way; the last sum becomes its .grad."""
        refs = self.refs
        sums: list[int] = []
        dropped: list[int] = []
        for x, sid in handoff:
            if x not in self.grad_of:
                self.grad_of[x] = sid
                continue
            total = self.new(f"{x}.grad_sum", "activation_grad", self.out_size(x), n)
            sums.append(total)
            for old in (self.grad_of[x], sid):
                refs[old] -= 1
                if refs[old] == 0:
                    dropped.append(old)
            self.grad_of[x] = total
            refs[total] += 1
        for key, pid in params_out:
            self.param_uses[key] -= 1
            if key in self.waiting:
                total = self.new(f"{key}.grad", "gradient", self.numel[key] * self.grad_bytes, n)
                sums.append(total)
                dropped += [self.waiting.pop(key), pid]
                pid = total
            if self.param_uses[key] > 0:
                self.waiting[key] = pid
            elif key in self.param_grad or self.grads_in_buckets:
                # an earlier micro-batch's .grad: added into it in place; or copied into DDP's bucket, whose view
                # becomes the .grad
                dropped.append(pid)
            else:
                self.param_grad[key] = pid
        if sums or dropped:
            self.event("backward", n, sums, dropped)

    def recompute(self, nodes: list[Node]) -> None:
        """Re-run a checkpointed segment's forward, up to the last op that saves a tensor (PyTorch stops
        there): what is saved lives until its keeper's backward, the rest dies at its last use."""
        graph, base = self.graph, self.base
        names = [m.name for m in nodes]
        inside = set(names)
        savers = [m for m in nodes if self.saves(m)]
        if not savers:
            return
        last = savers[-1]
        only_inputs = all(r.source == "input" for r in self.saves(last))
        run = names[:names.index(last.name) + (0 if only_inputs else 1)]
        seg_keep: dict[str, list[str]] = defaultdict(list)
        for st, ks in self.all_keepers.items():
            for k in ks:
                if k in inside:
                    seg_keep[st].append(k)
        local_use: dict[str, int] = {}
        for i, m in enumerate(names):
            for x in graph.node(m).inputs:
                if base[x] in inside and m in run:
                    local_use[base[x]] = i
        alive: list[str] = []
        fsdp = self.fsdp
        for i, m in enumerate(names):
            node_m = graph.node(m)
            born: list[int] = []
            freed: list[int] = []
            if fsdp and m in run and m in fsdp.first_node:
                fsdp.before_recompute(m)
            if m in run:
                if base[m] == m and node_m.kind not in _HELD:
                    self.owner[m] = self.new(m, "activation" if m in seg_keep else "temporary", self.out_size(m),
                                             m)
                    born.append(self.owner[m])
                    if m in seg_keep:
                        self.freed_at[min(seg_keep[m], key=self.pos.__getitem__)].append(self.owner[m])
                    else:
                        alive.append(m)
                for ref in self.saves(node_m):
                    if ref.source == "new":
                        assert ref.spec is not None
                        sid = self.new(f"{m}.{ref.label}", "activation", self.size(ref.spec), m, ref.host)
                        born.append(sid)
                        self.new_saved[m].append(sid)
            elif m != last.name:
                continue
            for x in list(alive):
                if local_use.get(x, -1) <= i:
                    freed.append(self.owner[x])
                    alive.remove(x)
            ends = m == last.name or m == run[-1]
            if ends:
                freed += [self.owner[x] for x in alive]  # the early stop drops the rest
                alive.clear()
            self.event("backward", f"{m}:recompute", born, freed)
            if fsdp and m in run and m in fsdp.last_node:
                fsdp.after_recompute(m)
            if ends:
                break

    def timeline(self, first: bool) -> Timeline:
        """The walk so far, then the optimizer step and zero_grad: the ``first`` step creates the optimizer state,
        a steady one has it from the start.  The walk itself is left as it was, so that both steps follow from
        one walk."""
        storages, events, start = list(self.storages), list(self.events), list(self.start)
        if not first:
            self.start += self.states
        self.optimizer_step(first)
        self.zero_grad()
        found = Timeline(tuple(self.storages), tuple(self.start), tuple(self.events))
        self.storages, self.events, self.start = storages, events, start
        return found

    def _listed(self) -> list[tuple[str, tuple[sympy.Expr, ...]]]:
        """The parameters as model.parameters() lists them (:mod:`.parameters`)."""
        if self.flat is not None:
            return self.flat
        return in_registration_order(self.graph, self.params)

    def optimizer_step(self, first: bool) -> None:
        """``optimizer.step()``: its temporaries, and in the first step the state (:func:`step_events`)."""
        stepped = self._listed() if self.owned is None else self.owned
        walk_step(self, self.regime, self.impl, stepped, self.step_numel, self.state_ids, first)

    def zero_grad(self) -> None:
        """``zero_grad(set_to_none=True)``: every weight's .grad is freed."""
        self.event("zero_grad", None, [], [self.param_grad[name] for name, _ in self._listed()
                                           if name in self.param_grad] + (self.fsdp.sharded_grads if self.fsdp else []))


def walk_step(sim: Any, regime: Regime, impl: str, stepped: list[tuple[str, tuple[sympy.Expr, ...]]],
              numel: Mapping[str, sympy.Expr], state_ids: Mapping[str, list[int]], first: bool) -> None:
    """``optimizer.step()`` over ``stepped`` as events of ``sim`` (its ``new`` and ``event``): the temporaries
    of :func:`step_events`, freed oldest first, and in the first step the state."""
    pending: list[int] = []  # optimizer temporaries not freed yet, oldest first
    for label, born_states, temp_bytes, frees in step_events(regime, impl, stepped, numel, state_ids, first):
        temps = [sim.new(f"{label}.temp", "temporary", t) for t in temp_bytes]
        pending += temps
        freed, pending = _oldest_first(pending, frees, temps)
        sim.event("step", label, [*born_states, *temps], freed)


def step_events(regime: Regime, impl: str, params: list[tuple[str, tuple[sympy.Expr, ...]]],
                numel: Mapping[str, sympy.Expr], state_ids: Mapping[str, list[int]], first_step: bool
                ) -> list[tuple[str, list[int], list[sympy.Expr], int]]:
    """(label, optimizer state born, temporaries born, how many of the earlier temporaries are freed after it)
    for each event of ``optimizer.step()``, as PyTorch 2.13 runs it on the CPU (measured; docs/peak.md).

    Every optimizer creates its state in the first step, for all parameters before the first update (the
    for-loop implementations too).  SGD, with or without momentum, updates in place (momentum's first step
    clones the gradient into the state).  Adam and AdamW, for-loop: per parameter, ``exp_avg_sq.sqrt()`` and
    its division by ``bias_correction2_sqrt`` are two temporaries of the parameter's size alive together, the
    second kept as ``denom`` until the next parameter's replaces it.  Foreach: ``_foreach_sqrt`` of every
    state at once -- one copy of every parameter, each its own tensor.  Fused: no temporaries.
    """
    adam = regime.optimizer in ("adam", "adamw")
    born = [i for p, _ in params for i in state_ids[p]] if first_step else []
    out: list[tuple[str, list[int], list[sympy.Expr], int]] = []
    if born or not (adam and impl == "for-loop"):
        # one temporary per parameter (each its own allocator block on CUDA), all alive together
        temps = [_fp32(numel[p]) for p, _ in params] if adam and impl == "foreach" else []
        out.append(("init" if impl == "for-loop" else impl, born, temps, len(temps)))
    if adam and impl == "for-loop":
        for i, (p, _) in enumerate(params):
            # sqrt and denom born; afterwards sqrt is freed, and the previous denom once denom is reassigned
            out.append((p, [], [_fp32(numel[p])] * 2, 1 if i == 0 else 2))
        if params:
            out.append(("done", [], [], 1))
    return out


@functools.lru_cache(maxsize=8192, typed=True)  # an int's size stays an int
def _fp32(numel: sympy.Expr) -> sympy.Expr:
    """An FP32 tensor's bytes of ``numel`` elements (an optimizer temporary), built once per size: a stack's layers,
    both steps of every walk and each ZeRO-1 rank's step ask for the same ones."""
    return numel * 4


def _oldest_first(pending: list[int], count: int, new: list[int]) -> tuple[list[int], list[int]]:
    """Free ``count`` temporaries: the sqrt just made first (it is freed at once), then the oldest."""
    if count == 0:
        return [], pending
    order = ([new[0]] if new else []) + [p for p in pending if p not in new[:1]]
    freed = order[:count]
    return freed, [p for p in pending if p not in freed]


def _segments(graph: Graph, regime: Regime) -> dict[str, tuple[str, int]]:
    """Checkpointed nodes of an unrolled graph -> their segment: (block, first layer) for every layer
    (``full``) or every K layers (``every-K``) of each repeated block; nothing without checkpointing."""
    if regime.checkpoint in ("none", "selective"):
        return {}
    every = checkpoint_every(regime.checkpoint) or 1
    return {n: (block, (k - 1) // every) for n, (block, k) in graph.graph.get("iterations", {}).items()}


def _needs_grad(graph: Graph, order: list[str], final: str) -> set[str]:
    """Nodes whose backward runs: they require grad and the loss depends on them."""
    found = {final}
    for n in reversed(order):
        if n in found:
            found.update(i for i in graph.node(n).inputs if requires_grad(graph, i))
    return {n for n in found if requires_grad(graph, n)}


def _splits(graph: Graph, order: list[str]) -> dict[str, list[str]]:
    """Parts of one split/unbind (``split=True`` slices or selects of one input): node -> the parts, first first."""
    parts: dict[tuple[str, str], list[str]] = defaultdict(list)
    for n in order:
        node = graph.node(n)
        if node.kind in ("slice", "select") and node.attrs.get("split"):
            parts[(node.inputs[0], node.kind)].append(n)
    return {n: group for group in parts.values() for n in group}


def _param_uses(graph: Graph, order: list[str], needs: set[str], tied_to: Mapping[str, str]) -> Counter:
    """How many backward ops produce a gradient for each weight (2 for a tied embedding)."""
    found: Counter = Counter()
    for n in order:
        if n not in needs:
            continue
        node = graph.node(n)
        found.update(f"{n}.{p}" for p in node.params)
        if n in tied_to:
            found[tied_to[n]] += 1
        found.update(x for x in node.inputs if graph.node(x).kind == "parameter")
    return found


def _tied(graph: Graph, order: list[str]) -> dict[str, str]:
    """Linear layers whose weight is an embedding's (``tied=True``): node -> that weight's parameter key."""
    found = {}
    for n in order:
        node = graph.node(n)
        if node.kind == "linear" and node.attrs.get("tied"):
            shape = (node.attrs["out_features"], graph.node(node.inputs[0]).out.shape[-1])
            owner = next((f"{e}.weight" for e in order if graph.node(e).kind == "embedding"
                          and tuple(graph.node(e).params["weight"]) == tuple(shape)), None)
            if owner is not None:
                found[n] = owner
    return found


def _model_output(graph: Graph) -> str | None:
    """The model's output: what a loss appended by :mod:`symmem.loss` scores, else the last output node."""
    if "model_output" in graph.graph:
        return graph.graph["model_output"]
    outs = [n for n in graph.program_order()
            if graph.out_degree(n) == 0 and graph.node(n).kind not in ("input", "parameter")]
    return outs[-1] if outs else None


def node_of(graph: Graph, name: str) -> Node:
    return graph.node(name)

