"""FSDP x TP: one rank of an N x t mesh, FSDP2's ``fully_shard`` over a ``parallelize_module``'d Llama.

PyTorch's 2-D recipe (``init_device_mesh(device, (N, t), mesh_dim_names=("dp", "tp"))``, the standard Llama plan
over ``mesh["tp"]``, then ``fully_shard`` on every layer and the root over ``mesh["dp"]``) stores every parameter
as a DTensor on both mesh dimensions: first the tensor-parallel shard DTensor's plan gives the rank (the embedding
and the column-parallel weights -- q, k, v, gate, up, the head -- split along their first dimension, the
row-parallel o and down along their second, the norms whole), then FSDP2's padded shard of it: its first
dimension padded to a multiple of N and split evenly, so every rank stores ``ceiling(d0/N)`` rows of its
tensor-parallel shard (:func:`~symmem.passes.data_parallel.shard_rows`).  Measured per rank on gloo
(:mod:`symmem.record.fsdp_tensor_runs`, N = 2, t = 2, every rank), to the byte:

* the parameters and their sharded gradients: those padded 2-D shards, 4 bytes an element each (the embedding's
  gradient, whole on a tensor-parallel rank, is reduce-scattered to its shard like every other);
* AdamW's state: two moments of the *unpadded* rows a rank holds (``held_shape``: the last ranks of a
  data-parallel group hold fewer where N does not divide the tensor-parallel shard's first dimension) and a 4-byte
  ``step`` per parameter;
* what autograd keeps after the forward: the tensor-parallel rank's (:func:`~symmem.passes.model_parallel.
  tensor_rank`): FSDP changes which storage a saved weight lives in, not what activations are kept.

The peak of the step is not modelled (:data:`PEAK_REFUSED`): the measured step holds FSDP's all-gathered and
reduce-scattered unit buffers, at the tensor-parallel shards' sizes, beside DTensor's collectives.

>>> from symmem.api import tensor_parallel_rank
>>> values = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 66, "F": 64}
>>> r = tensor_parallel_rank("llama", values=values, attention="sdpa", device="cpu", data_parallel="fsdp")
>>> r.at({**values, "N": 2, "t": 2})
{'saved': 54336, 'parameters': 23104, 'gradients': 23104, 'optimizer_state': 46292}
>>> tensor_parallel_rank("llama", values=values, attention="sdpa", device="cpu", data_parallel="fsdp",
...                      rank=1).at({**values, "N": 2, "t": 2})["optimizer_state"]
45780
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sympy

from ..errors import SymmemError
from ..graph import Graph
from ..shapes import numel
from ..training import Regime

#: Why ``derive --data-parallel fsdp --tensor-parallel`` gives no peak (every view says it in one line).
PEAK_REFUSED = ("no peak: FSDP x TP's step (fully_shard over parallelize_module on an N x t mesh) is not modelled: "
                "FSDP's all-gather and reduce-scatter buffers at the tensor-parallel shards' sizes beside DTensor's "
                "collectives were measured, not walked; its parameters, gradients, optimizer state and saved "
                "activations per rank are (symmem ranks --data-parallel fsdp --tensor-parallel)")


def tp_shape(graph: Graph, node: str, shape: tuple[sympy.Expr, ...]) -> tuple[sympy.Expr, ...]:
    """The shape of a parameter of ``node`` on one tensor-parallel rank under the standard Llama plan.

    >>> from symmem.models import build
    >>> g = build("llama").graph
    >>> tp_shape(g, "layers.self_attn.q_proj", g.node("layers.self_attn.q_proj").params["weight"])
    (H/t, H)
    >>> tp_shape(g, "layers.mlp.down_proj", g.node("layers.mlp.down_proj").params["weight"])
    (H, F/t)
    >>> tp_shape(g, "norm.weight", g.node("norm.weight").params["value"])
    (H,)
    """
    from ..symbols import t

    n = graph.node(node)
    if len(shape) < 2:
        return tuple(shape)  # the norms: replicated
    column = n.kind == "embedding" or n.role in ("qkv", "mlp_hidden") or (n.kind == "linear" and n.block is None)
    if column:  # RowwiseParallel's embedding and ColwiseParallel's weights: Shard(0)
        return (shape[0] / t, *shape[1:])
    return (shape[0], shape[1] / t, *shape[2:])  # RowwiseParallel's linears: Shard(1)


def parameters(graph: Graph) -> Iterator[tuple[str, sympy.Expr, tuple[sympy.Expr, ...]]]:
    """Every parameter as (node, count, its tensor-parallel rank's shape), in program order."""
    for n in graph.program_order():
        node = graph.node(n)
        shapes = [tuple(node.params["value"])] if node.kind == "parameter" else [tuple(s) for s in
                                                                                  node.params.values()]
        for shape in shapes:
            yield n, node.count, tp_shape(graph, n, shape)


def mesh_rank(graph: Graph, storages: Sequence[Any], regime: Regime, rank: int = 0) -> Any:
    """One rank of the N x t mesh as a :class:`~symmem.passes.model_parallel.TensorRank` (formulas in N and t),
    from the single-device ``storages`` (the pytorch convention); ``rank`` is its place in its data-parallel group
    (the rows of the optimizer state it holds; rank 0 holds whole shards, the most)."""
    from ..symbols import N
    from .data_parallel import held_shape, shard_rows
    from .model_parallel import TensorRank, tensor_rank

    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw"):
        raise SymmemError("FSDP x TP's ranks are modelled for FP32 Adam/AdamW, as measured")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise SymmemError(f"a rank is a non-negative integer, got {rank!r}")
    stored = state = sympy.Integer(0)
    for _, count, shape in parameters(graph):
        stored += count * shard_rows(shape, N) * numel(shape[1:]) * 4
        state += count * (2 * numel(held_shape(shape, N, rank)) * 4 + 4)  # exp_avg, exp_avg_sq, step
    saved = tensor_rank(graph, storages, regime).saved
    return TensorRank(saved, stored, stored, state)
