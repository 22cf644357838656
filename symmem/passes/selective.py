"""Selective recomputation in a storage-counting convention: what a checkpointed core attention keeps.

Korthikanti et al. 2022 (section 5) recompute the core attention -- ``Q K^T``, softmax, dropout, ``@ V`` -- in
backward.  In PyTorch that is the core wrapped in ``torch.utils.checkpoint(..., use_reentrant=False)`` (for a
Hugging Face model: its ``eager_attention_forward`` registered as a checkpointed attention function).  Nothing the
core's ops save is kept then; the checkpoint saves the core's *inputs* instead (``_NoopSaveInputs``: the tensors
it was called with, alive until the core's backward has run), and a view keeps its whole base.  Measured with the
live-bytes tracker on transformers 5.23 (``tests/test_selective_recompute.py``): GPT-2's query, key and value are
views of ``c_attn``'s output, so each layer keeps all of it (3·B·S·H) in place of the matmuls' copies; Llama's
rotary query, the cache's key and value copies (without the cache the rotary key and ``v_proj``'s output), and,
once for the model, the (B, 1, S, S) mask and the position ids HF passes along.

A builder marks each core in the graph's ``recomputed_core``: the core's output node -> (the nodes the checkpointed
function is called with, tensors it is called with that the graph has no node for: ``(name, shape, dtype)``,
whether the layer holds the attention weights the function returns until the layer returns -- HF's
``x, _ = self.attn(...)``: under the checkpoint they are no saved tensor, so that decides when they die).

>>> from symmem import derive
>>> sel = derive("gpt2", attention="naive", dropout=0.0, cache="none", checkpoint="selective", per_layer=True)
>>> [t.name for t in sel.terms if t.role == "checkpoint"]      # c_attn's output, which q, k and v view
['h.attn.c_attn']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sympy

from ..derivation import Storage
from ..graph import Graph
from ..shapes import numel
from ..tensor import dtype_bytes
from .storage import resolve

#: A tensor the checkpointed core is called with that the graph has no node for: (name, shape, dtype).
Extra = tuple[str, tuple[sympy.Expr, ...], str]


@dataclass(frozen=True)
class Cores:
    """Every marked core of a graph: the nodes inside (whose saved tensors the checkpoint drops) and what each
    core is called with."""

    nodes: frozenset[str]
    inputs: tuple[tuple[str, tuple[str, ...], tuple[Extra, ...]], ...]


def cores(graph: Graph) -> Cores:
    """The marked cores: a core's nodes are those ``output`` depends on without passing through its inputs."""
    inside: set[str] = set()
    calls = []
    for output, (inputs, extras, _) in graph.graph.get("recomputed_core", {}).items():
        block = graph.node(output).block
        stack = [output]
        while stack:
            n = stack.pop()
            if n in inside or n in inputs:
                continue
            node = graph.node(n)
            if node.block != block or node.kind in ("parameter", "buffer", "input", "constant"):
                continue  # made outside the layer, or state: not recomputed
            inside.add(n)
            stack.extend(node.inputs)
        calls.append((output, tuple(inputs), tuple(extras)))
    return Cores(frozenset(inside), tuple(calls))


def dropped(term: Storage, found: Cores) -> bool:
    """Whether the checkpoint drops ``term``: an activation every keeper of which is inside a core."""
    return (term.category == "activation" and bool(term.keepers)
            and all(k in found.nodes for k in term.keepers))


def inputs_kept(graph: Graph, found: Cores, kept: Sequence[Storage], act_dtype: str,
                per_layer: bool) -> list[Storage]:
    """The storages the checkpoints save that nothing in ``kept`` holds: each core input's base storage (per layer
    when made in the layer, else once for the model) and the extras (once)."""
    held = {x.node for x in kept if x.category in ("activation", "input") and x.name == x.node}
    out: list[Storage] = []
    for output, inputs, extras in found.inputs:
        block = graph.node(output).block
        for name in inputs:
            for storage, _ in resolve(graph, name, act_dtype=act_dtype):
                node = graph.node(storage)
                if storage in held or node.kind in ("parameter", "buffer", "input"):
                    continue
                held.add(storage)
                in_layer = node.block == block and block is not None
                if per_layer and not in_layer:
                    continue  # made once for the model: no part of one layer's memory
                count = sympy.Integer(1) if per_layer or not in_layer else node.count
                elements = node.out.numel
                out.append(Storage(storage, node.group, "activation",
                                   count * elements * dtype_bytes(node.out.dtype, act_dtype), "checkpoint", storage,
                                   node.out.dtype, elements, count, (output,), "forward", "backward"))
        for name, shape, dtype in extras:
            if per_layer or name in held:
                continue
            held.add(name)
            elements = numel(shape)
            out.append(Storage(name, graph.node(output).group, "activation", elements * dtype_bytes(dtype, act_dtype),
                               "checkpoint", None, dtype, elements, sympy.Integer(1), (output,), "forward",
                               "backward"))
    return out


def unrolled(graph: Graph) -> tuple[dict[str, tuple[str, int]], dict[tuple[str, int], tuple[list[str], list[Extra]]],
                                    list[tuple[str, str]]]:
    """The cores of an unrolled graph (``passes/unroll.py``: a layer's node ``n`` is ``n#k``): each core node ->
    its segment (the core's output, the layer), each segment -> what it is called with (nodes, extras), and the
    returned weights a layer holds -> its last node, for the step's simulation (one segment per layer's core, as
    ``torch.utils.checkpoint`` runs it)."""
    iterations = graph.graph.get("iterations", {})
    last = {layer: n for n, layer in iterations.items()}  # a layer's last node (the unrolled nodes are in order)
    segment_of: dict[str, tuple[str, int]] = {}
    calls: dict[tuple[str, int], tuple[list[str], list[Extra]]] = {}
    held: list[tuple[str, str]] = []
    for output, (inputs, extras, returns) in graph.graph.get("recomputed_core", {}).items():
        for k in range(1, len(iterations) + 1):
            end = f"{output}#{k}"
            if end not in iterations:
                break
            layer = iterations[end]
            names = [f"{x}#{k}" if iterations.get(f"{x}#{k}") == layer else x for x in inputs]
            stack = [end]
            while stack:
                n = stack.pop()
                if n in segment_of or n in names or iterations.get(n) != layer:
                    continue
                node = graph.node(n)
                if node.kind in ("parameter", "buffer", "input", "constant"):
                    continue
                segment_of[n] = (output, k)
                stack.extend(node.inputs)
            calls[(output, k)] = (names, list(extras))
            if returns:
                held.append((graph.node(end).inputs[0], last[layer]))
    return segment_of, calls, held
