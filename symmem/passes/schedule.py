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

:class:`Timeline` holds the storages and, after every event, the live bytes per category as exact sympy sums.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..conventions import Convention
from ..errors import SymmemError
from ..graph import Graph, Node
from ..ops import requires_grad
from ..shapes import numel as shape_numel
from ..tensor import TensorSpec, dtype_bytes
from ..training import Regime, checkpoint_every
from .saved import kept
from .storage import Branch, is_view

#: Categories of live memory, in the order breakdowns list them.
CATEGORIES = ("parameter", "optimizer_state", "gradient", "input", "activation", "loss", "activation_grad",
              "temporary")


@dataclass(frozen=True)
class Live:
    """One storage of the step: its name, category, bytes, and the (unrolled) node that made it; ``host``: held in
    host memory while the step runs on CUDA (Adam's step counts, the memory-efficient attention's Philox seed and
    offset), so not in what CUDA's allocator counts."""

    name: str
    category: str
    nbytes: sympy.Expr
    node: str | None = None
    host: bool = False


@dataclass(frozen=True)
class Event:
    """One op of the step: what it allocates and what is freed once it has run."""

    phase: str
    node: str | None
    born: tuple[int, ...]
    freed: tuple[int, ...]


@dataclass(frozen=True)
class Timeline:
    """The storages of one training step and its events, in order; ``start`` are the storages alive before
    the first event (weights, the batch, optimizer state in the steady state)."""

    storages: tuple[Live, ...]
    start: tuple[int, ...]
    events: tuple[Event, ...]

    def live(self) -> list[dict[str, sympy.Expr]]:
        """Live bytes per category after each event's allocations (before its frees)."""
        sums: dict[str, Counter] = {c: Counter() for c in CATEGORIES}
        parts = [_terms(s.nbytes) for s in self.storages]

        def add(i: int, sign: int) -> None:
            target = sums[self.storages[i].category]
            for k, v in parts[i].items():
                target[k] += sign * v

        for i in self.start:
            add(i, 1)
        out = []
        for e in self.events:
            for i in e.born:
                add(i, 1)
            out.append({c: _expr(sums[c]) for c in CATEGORIES})
            for i in e.freed:
                add(i, -1)
        return out

    def totals_at(self, numbers: Mapping[sympy.Symbol, Any], block: int = 1, device_only: bool = False
                  ) -> list[int]:
        """Live bytes after each event's allocations at ``numbers``, each storage rounded up to a multiple of
        ``block`` bytes (512: what CUDA's caching allocator hands out, so what ``max_memory_allocated``
        sees); ``device_only`` leaves out the storages in host memory."""
        sizes = []
        for st in self.storages:
            if device_only and st.host:
                sizes.append(0)
                continue
            v = sympy.sympify(st.nbytes.xreplace(dict(numbers)), strict=True)
            n = int(v) if v.is_number else 0
            sizes.append(-(-n // block) * block if n else 0)
        live = sum(sizes[i] for i in self.start)
        out = []
        for e in self.events:
            live += sum(sizes[i] for i in e.born)
            out.append(live)
            live -= sum(sizes[i] for i in e.freed)
        return out

    def alive_after(self, index: int) -> list[Live]:
        """The storages alive after event ``index``'s allocations."""
        alive = set(self.start)
        for e in self.events[:index + 1]:
            alive |= set(e.born)
            if e is not self.events[index]:
                alive -= set(e.freed)
        return [self.storages[i] for i in sorted(alive)]


#: Micro-batches of gradient accumulation written out in a step's schedule (later ones repeat the second).
MICRO_BATCH_PASSES = 3

def _terms(e: sympy.Expr) -> dict[sympy.Expr, sympy.Expr]:
    return dict(sympy.expand(e).as_coefficients_dict())


def _expr(c: Counter) -> sympy.Expr:
    return sympy.Add(*(k * v for k, v in c.items() if v != 0))


@dataclass
class _Builder:
    storages: list[Live] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    start: list[int] = field(default_factory=list)

    def new(self, name: str, category: str, nbytes: sympy.Expr, node: str | None = None, host: bool = False) -> int:
        self.storages.append(Live(name, category, nbytes, node, host))
        return len(self.storages) - 1

    def event(self, phase: str, node: str | None, born: list[int], freed: list[int]) -> None:
        self.events.append(Event(phase, node, tuple(born), tuple(dict.fromkeys(freed))))


def optimizer_impl(regime: Regime, device: str) -> str:
    """The implementation PyTorch's optimizers pick: for-loop on the CPU, foreach on CUDA (unless the regime
    names one)."""
    impl = getattr(regime, "optimizer_impl", "auto")
    if impl != "auto":
        return impl
    return "foreach" if device == "cuda" else "for-loop"


def simulate(graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime,
             branch: Branch | None = None, *, first_step: bool | None = False, keep_logits: bool = False
             ) -> Any:
    """The timeline of one training step of the (unrolled) ``graph``: ``first_step`` creates the optimizer
    state inside the step; otherwise it exists from the start (the steady state).  ``first_step=None`` gives
    both, (steady, first), from one walk: they differ only in the state alive at the start and in the step."""
    if regime.tensor_parallel or regime.pipeline_parallel or regime.zero:
        raise SymmemError("the peak follows one device's training step op by op; ZeRO and tensor and pipeline "
                          "parallelism are not modelled there (the kept memory and total are)")
    if regime.checkpoint == "selective":
        raise SymmemError("the peak with selective recomputation is not modelled (the kept memory and total are); "
                          "full and every-K checkpointing are")
    act = regime.activation_dtype
    order = list(graph.program_order())
    pos = {n: i for i, n in enumerate(order)}
    b = _Builder()

    def size(spec: TensorSpec) -> sympy.Expr:
        return spec.numel * dtype_bytes(spec.dtype, act)

    # -- what the convention keeps, and who keeps it -------------------------------------------------------
    rule_options = {**options, "activation_dtype": act, "branch": branch}
    saved = kept(graph, conv, options, act, order, False, branch)
    segment_of = _segments(graph, regime)  # checkpointed node -> its segment (one layer, or K)
    # inside a checkpointed segment no op keeps a tensor (checkpoint packs a handle): only keepers outside do
    all_keepers: dict[str, tuple[str, ...]] = {s.name: s.keepers for s in saved}
    keepers = {k: tuple(x for x in v if x not in segment_of) for k, v in all_keepers.items()}
    keepers = {k: v for k, v in keepers.items() if v}

    # -- storage identity of every value: views lead to their base ------------------------------------------
    base: dict[str, str] = {}
    for n in order:
        node = graph.node(n)
        if node.view_of is not None and is_view(graph, n, act, branch):
            base[n] = base[node.inputs[node.view_of]]
        else:
            base[n] = n
    uses: dict[str, list[str]] = defaultdict(list)
    for n in order:
        for i in graph.node(n).inputs:
            uses[base[i]].append(n)

    # -- the parameter side and the batch ------------------------------------------------------------------
    weights_bytes = sum(c.bytes for c in regime.precision_spec.parts if c.kind != "gradients")
    grad_bytes = sum(c.bytes for c in regime.precision_spec.parts if c.kind == "gradients")
    device = str(options.get("device", "cpu"))
    impl = optimizer_impl(regime, device)
    # Adam's step counts are CPU tensors unless the fused implementation runs: host memory beside a CUDA step
    step_on_host = device == "cuda" and impl != "fused"
    owner: dict[str, int] = {}     # storage name -> id, for values alive across the step
    params: list[tuple[str, tuple[sympy.Expr, ...]]] = []
    for n in order:
        node = graph.node(n)
        if node.kind == "parameter":
            params.append((n, node.params["value"]))
        else:
            params += [(f"{n}.{p}", shape) for p, shape in node.params.items()]
        if node.kind in ("input", "buffer"):
            cat = "input" if node.kind == "input" else "parameter"
            owner[n] = b.new(n, cat, size(node.out), n)
            b.start.append(owner[n])
        for bname, spec in node.buffers.items():
            b.start.append(b.new(f"{n}.{bname}", "parameter", size(spec), n))
    numel = {name: shape_numel(shape) for name, shape in params}
    for name, _ in params:
        b.start.append(b.new(f"{name}.weights", "parameter", numel[name] * weights_bytes))
    state_ids: dict[str, list[int]] = {}
    for name, shape in params:
        ids = [b.new(f"{name}.{s}", "optimizer_state", e) for s, e in regime.optimizer_spec.state_bytes(shape)]
        if regime.optimizer in ("adam", "adamw") and ids:
            ids.append(b.new(f"{name}.step", "optimizer_state", sympy.Integer(4), host=step_on_host))  # 0-dim fp32
        state_ids[name] = ids
    states = [i for name, _ in params for i in state_ids[name]]  # alive from the start in the steady state

    # -- forward -------------------------------------------------------------------------------------------
    held_to_end: set[str] = set()
    outputs = [n for n in order if graph.out_degree(n) == 0
               and graph.node(n).kind not in ("input", "parameter", "buffer", "constant")]
    final = outputs[-1] if outputs else order[-1]
    held_to_end.add(base[final])
    if keep_logits:
        out = _model_output(graph)
        if out is not None:
            held_to_end.add(base[out])
    last_use = {s: max(pos[u] for u in us) for s, us in uses.items()}
    dies_forward: dict[int, list[str]] = defaultdict(list)
    for s in set(base.values()):
        if s in keepers or s in held_to_end or graph.node(s).kind in ("input", "parameter", "buffer"):
            continue
        dies_forward[last_use.get(s, pos[s])].append(s)
    needs = _needs_grad(graph, order, final)
    segments: dict[Any, list[Node]] = defaultdict(list)
    for n in order:
        if n in segment_of:
            segments[segment_of[n]].append(graph.node(n))
    # the segment's last node to run backward: its first node in program order that runs backward
    segment_end = {sg: next((m.name for m in nodes if m.name in needs), None) for sg, nodes in segments.items()}
    # what each segment's checkpoint holds: every storage made outside it that its ops read
    frame_inputs: dict[Any, list[str]] = {}
    for sg, nodes in segments.items():
        inside = {m.name for m in nodes}
        found = dict.fromkeys(base[x] for m in nodes for x in m.inputs if base[x] not in inside)
        frame_inputs[sg] = [x for x in found if graph.node(x).kind not in ("input", "parameter", "buffer")]
    groups = _splits(graph, order)
    tied_to = _tied(graph, order)
    param_grad: dict[str, int] = {}  # weight -> its .grad

    def micro_batch() -> None:
        """One forward and backward pass; with gradients from an earlier micro-batch, each weight's new
        gradient is added into its .grad in place and freed."""
        new_saved: dict[str, list[int]] = defaultdict(list)
        # checkpoint keeps each segment's inputs (the layer input, and masks or tables passed to it) until the
        # segment's backward is done
        frame_held = {x for sg in segments for x in frame_inputs[sg]}
        for n in order:
            node = graph.node(n)
            if node.kind in ("input", "parameter", "buffer"):
                continue
            born = []
            if base[n] == n:
                cat = "loss" if node.group == "loss" else ("activation" if n in keepers else "temporary")
                owner[n] = b.new(n, cat, size(node.out), n)
                born.append(owner[n])
            freed = [owner[s] for s in dies_forward.get(pos[n], []) if s in owner and s not in frame_held]
            for ref in conv.saved(graph, node, rule_options):
                if ref.source == "new":
                    assert ref.spec is not None
                    cat = "loss" if node.group == "loss" else "activation"
                    sid = b.new(f"{n}.{ref.label}", cat if n not in segment_of else "temporary", size(ref.spec), n,
                                ref.host)
                    born.append(sid)
                    if n in segment_of:
                        freed.append(sid)  # checkpointed: not kept, recomputed in backward
                    else:
                        new_saved[n].append(sid)
            b.event("forward", n, born, freed)

        if graph.node(final).group != "loss":
            # no loss in the graph: the step reduces the output with .sum(), which keeps nothing for backward
            total = b.new("output.sum", "loss", size(TensorSpec((), "float32")))
            owner["output.sum"] = total
            held_to_end.add("output.sum")
            out = base[final]
            drop = []
            if not keep_logits and graph.node(out).kind not in ("input", "parameter", "buffer"):
                held_to_end.discard(out)  # loss = model(x).sum(): the output lives on only if an op keeps it
                if out not in keepers:
                    drop.append(owner[out])
            b.event("forward", "sum", [total], drop)

        # -- backward ------------------------------------------------------------------------------------------
        grad_of: dict[str, int] = {}
        refs: Counter = Counter()
        freed_at: dict[str, list[int]] = defaultdict(list)   # saved storages, freed after their last keeper's backward
        for s, ks in keepers.items():
            if s in owner and s not in held_to_end and graph.node(s).kind not in ("input", "parameter", "buffer"):
                last = min((k for k in ks if k in needs), key=pos.__getitem__, default=None)
                freed_at[last or ""].append(owner[s])
        def _recompute(nodes: list[Node]) -> None:
            """Re-run a checkpointed segment's forward, up to the last op that saves a tensor (PyTorch stops
            there): what is saved lives until its keeper's backward, the rest dies at its last use."""
            names = [m.name for m in nodes]
            inside = set(names)
            savers = [m for m in nodes if conv.saved(graph, m, rule_options)]
            if not savers:
                return
            last = savers[-1]
            only_inputs = all(r.source == "input" for r in conv.saved(graph, last, rule_options))
            run = names[:names.index(last.name) + (0 if only_inputs else 1)]
            seg_keep: dict[str, list[str]] = defaultdict(list)
            for st, ks in all_keepers.items():
                for k in ks:
                    if k in inside:
                        seg_keep[st].append(k)
            local_use: dict[str, int] = {}
            for i, m in enumerate(names):
                for x in graph.node(m).inputs:
                    if base[x] in inside and m in run:
                        local_use[base[x]] = i
            alive: list[str] = []
            for i, m in enumerate(names):
                node_m = graph.node(m)
                born_r: list[int] = []
                freed_r: list[int] = []
                if m in run:
                    if base[m] == m and node_m.kind not in ("input", "parameter", "buffer"):
                        cat = "activation" if m in seg_keep else "temporary"
                        owner[m] = b.new(m, cat, size(node_m.out), m)
                        born_r.append(owner[m])
                        if m in seg_keep:
                            first = min(seg_keep[m], key=pos.__getitem__)
                            freed_at[first].append(owner[m])
                        else:
                            alive.append(m)
                    for ref in conv.saved(graph, node_m, rule_options):
                        if ref.source == "new":
                            assert ref.spec is not None
                            sid = b.new(f"{m}.{ref.label}", "activation", size(ref.spec), m, ref.host)
                            born_r.append(sid)
                            new_saved[m].append(sid)
                elif m != last.name:
                    continue
                for x in list(alive):
                    if local_use.get(x, -1) <= i:
                        freed_r.append(owner[x])
                        alive.remove(x)
                if m == last.name or m == run[-1]:
                    freed_r += [owner[x] for x in alive]  # the early stop drops the rest
                    alive.clear()
                b.event("backward", f"{m}:recompute", born_r, freed_r)
                if m == last.name or m == run[-1]:
                    break

        seed = b.new("loss.grad", "activation_grad", size(TensorSpec((), "float32")))
        grad_of[final] = seed
        refs[seed] += 2  # the engine holds the root's gradient until backward ends
        b.event("backward", None, [seed], [])
        param_uses = _param_uses(graph, order, needs, tied_to)
        waiting: dict[str, int] = {}  # a weight's gradients that wait for its other uses
        recomputed: set[Any] = set()
        done: set[Any] = set()  # segments whose backward has finished
        for n in reversed(order):
            node = graph.node(n)
            if n not in grad_of or n not in needs:
                continue
            sg = segment_of.get(n)
            if sg is not None and sg not in recomputed:
                recomputed.add(sg)
                _recompute(segments[sg])
            group = groups.get(n)
            if group is not None and n != group[0]:
                continue  # a part of a split: the first part gathers every part's gradient
            g = conv.grads(graph, node, rule_options)
            if g is None:
                raise SymmemError(f"the {conv.name} convention does not model the backward pass, so it has no peak")
            # 1. the backward formula allocates the inputs' gradients, the parameters' and its temporaries
            born: list[int] = []
            handoff: list[tuple[str, int]] = []
            incoming = [grad_of[m] for m in (group or [n]) if m in grad_of]
            params_out: list[tuple[str, int]] = []
            for i, x in enumerate(node.inputs):
                xn = graph.node(x)
                if not requires_grad(graph, x) or (group is not None and i > 0):
                    continue
                if xn.kind == "parameter":
                    pid = b.new(f"{x}.grad", "gradient", numel[x] * grad_bytes, n)
                    born.append(pid)
                    params_out.append((x, pid))
                    continue
                if group is None and g.of(i) == "alias":
                    sid = grad_of[n]
                else:
                    sid = b.new(f"{n}.grad_input{i}", "activation_grad", size(xn.out), n)
                    born.append(sid)
                refs[sid] += 1
                handoff.append((x, sid))
            late: list[int] = []
            for key in [f"{n}.{p}" for p in node.params] + ([tied_to[n]] if n in tied_to else []):
                pid = b.new(f"{key}.grad", "gradient", numel[key] * grad_bytes, n)
                # a recomputed (checkpointed) input is dropped once the weight's gradient used it, before a
                # linear's bias gradient is summed (measured): that one comes after the free
                (late if sg is not None and node.kind == "linear" and key.endswith(".bias") else born).append(pid)
                params_out.append((key, pid))
            temps = [b.new(f"{n}.temp", "temporary", size(spec), n) for spec in g.temps]
            if late:
                b.event("backward", n, born + temps, list(freed_at.pop(n, [])))
                born, temps = late, []
            freed = list(temps)
            for sid in incoming:
                refs[sid] -= 1
                if refs[sid] == 0:
                    freed.append(sid)
            freed += freed_at.get(n, []) + new_saved.get(n, [])
            if sg is not None and n == segment_end.get(sg):
                for src in frame_inputs[sg]:  # the checkpoint frame lets its inputs go
                    if src in owner and src not in keepers and src not in held_to_end and not any(
                            src in frame_inputs[other] for other in segments if other != sg and other not in done):
                        freed.append(owner[src])
                done.add(sg)
            b.event("backward", n, born + temps, freed)
            # 2. then each gradient goes to its value's buffer; a second one there is summed out of place.  A weight
            # used by several ops (tied) gathers its gradients the same way; the last sum becomes its .grad.
            sums: list[int] = []
            dropped: list[int] = []
            for x, sid in handoff:
                if x not in grad_of:
                    grad_of[x] = sid
                    continue
                total = b.new(f"{x}.grad_sum", "activation_grad", size(graph.node(x).out), n)
                sums.append(total)
                for old in (grad_of[x], sid):
                    refs[old] -= 1
                    if refs[old] == 0:
                        dropped.append(old)
                grad_of[x] = total
                refs[total] += 1
            for key, pid in params_out:
                param_uses[key] -= 1
                if key in waiting:
                    total = b.new(f"{key}.grad", "gradient", numel[key] * grad_bytes, n)
                    sums.append(total)
                    dropped += [waiting.pop(key), pid]
                    pid = total
                if param_uses[key] > 0:
                    waiting[key] = pid
                elif key in param_grad:
                    dropped.append(pid)  # an earlier micro-batch's .grad: added into it in place
                else:
                    param_grad[key] = pid
            if sums or dropped:
                b.event("backward", n, sums, dropped)
        b.event("backward", None, [], [*freed_at.get("", []), *(owner[s] for s in held_to_end if s in owner)]
                + [sid for sid, r in refs.items() if r > 0])

    # From the second micro-batch on every pass starts from the same live storages (each .grad exists and takes
    # the new gradient in place), so the third and later passes repeat the second: written out up to
    # MICRO_BATCH_PASSES times, the peak is exact for any K, and K = 10**6 does not take a million passes
    # (tests/test_properties.py::test_micro_batches_repeat checks it against every pass written out).
    for _ in range(min(regime.micro_batches, MICRO_BATCH_PASSES)):
        micro_batch()

    # -- optimizer step and zero_grad ----------------------------------------------------------------------
    # model.parameters() lists a module's own parameters before its submodules': free-standing ones (a class
    # token, a position table) first, then the layers' in the order they run
    free = {n for n in order if graph.node(n).kind == "parameter"}
    params.sort(key=lambda p: p[0] not in free)
    grads = [param_grad[name] for name, _ in params if name in param_grad]
    before = (list(b.storages), list(b.events), list(b.start))

    def finish(first: bool) -> Timeline:
        b.storages, b.events, b.start = list(before[0]), list(before[1]), list(before[2])
        if not first:
            b.start += states
        pending: list[int] = []  # optimizer temporaries not freed yet, oldest first
        for label, born_states, temp_bytes, frees in step_events(regime, impl, params, numel, state_ids, first):
            temps = [b.new(f"{label}.temp", "temporary", t) for t in temp_bytes]
            pending += temps
            freed, pending = _oldest_first(pending, frees, temps)
            b.event("step", label, [*born_states, *temps], freed)
        b.event("zero_grad", None, [], grads)
        return Timeline(tuple(b.storages), tuple(b.start), tuple(b.events))

    if first_step is None:
        return finish(False), finish(True)
    return finish(first_step)


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
        temps = [numel[p] * 4 for p, _ in params] if adam and impl == "foreach" else []
        out.append(("init" if impl == "for-loop" else impl, born, temps, len(temps)))
    if adam and impl == "for-loop":
        for i, (p, _) in enumerate(params):
            # sqrt and denom born; afterwards sqrt is freed, and the previous denom once denom is reassigned
            out.append((p, [], [numel[p] * 4, numel[p] * 4], 1 if i == 0 else 2))
        if params:
            out.append(("done", [], [], 1))
    return out


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
