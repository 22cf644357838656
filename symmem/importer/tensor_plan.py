"""The tensor-parallel plan of a traced module: which of its modules DTensor splits, and how.

A plan maps module names (``fnmatch`` patterns: ``layers.*.mlp.up_proj``) to the strings transformers uses in
``config.base_model_tp_plan``, a model's ``_tp_plan`` and its resolved ``model.tp_plan``, each one of torch's
``ParallelStyle`` as transformers registers it (``transformers/distributed/tensor_parallel.py``; for embeddings
transformers has a style of its own, ``EmbeddingParallel``: torch's row- or column-wise style on the ``Embedding``
here):

============================  ============================================================================
``colwise``                   ``ColwiseParallel()`` (input replicated, output split on its last dimension)
``rowwise``                   ``RowwiseParallel()`` (input split on its last dimension, output all-reduced)
``colwise_rep``,              ``ColwiseParallel(output_layouts=Replicate())`` (the output all-gathered)
``colwise_gather_output``
``rowwise_rep``,              ``RowwiseParallel(input_layouts=Replicate())`` (the input split on the rank)
``rowwise_split_input``
``embedding_rowwise``         ``RowwiseParallel(input_layouts=Replicate())`` on an ``Embedding`` (rows split)
``embedding_colwise``         ``ColwiseParallel()`` on an ``Embedding`` (columns split)
``sequence_parallel``         ``SequenceParallel()``
============================  ============================================================================

Where the plan comes from (:func:`plan_of`): Hugging Face's ``LlamaForCausalLM`` gets the standard plan the real runs
train it under (:func:`symmem.record.hf_llama.hf_llama_plan`: the embedding row-wise, q/k/v/gate/up column-wise, o
and down row-wise, the head column-wise with its output replicated; with sequence parallelism the norms
``SequenceParallel``); another module gives a ``tp_plan`` attribute in the string format above; another Hugging Face
model its config's ``base_model_tp_plan`` (under its ``base_model_prefix``) and its class's ``_tp_plan``.

>>> sorted(styles_of({"blocks.*.up": "colwise", "head": "colwise_rep"}, ["blocks.0.up", "blocks.1.up", "head"]))
['blocks.0.up', 'blocks.1.up', 'head']
>>> styles_of({"x.*": "local"}, ["x.0"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
  ...
symmem.errors.SymmemError: tp_plan: 'x.*' is 'local', which symmem does not follow; the styles followed: colwise, ...
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError

#: the plan strings followed (transformers' names), each as (style, keyword arguments)
STYLES: dict[str, tuple[str, dict[str, str]]] = {
    "colwise": ("ColwiseParallel", {}),
    "rowwise": ("RowwiseParallel", {}),
    "colwise_rep": ("ColwiseParallel", {"output_layouts": "replicate"}),
    "colwise_gather_output": ("ColwiseParallel", {"output_layouts": "replicate"}),
    "rowwise_rep": ("RowwiseParallel", {"input_layouts": "replicate"}),
    "rowwise_split_input": ("RowwiseParallel", {"input_layouts": "replicate"}),
    "embedding_rowwise": ("RowwiseParallel", {"input_layouts": "replicate"}),
    "embedding_colwise": ("ColwiseParallel", {}),
    "sequence_parallel": ("SequenceParallel", {}),
}


def _style(text: str) -> Any:
    from torch.distributed.tensor import Replicate, parallel

    kind, kwargs = STYLES[text]
    return getattr(parallel, kind)(**{k: Replicate() for k in kwargs})


def styles_of(plan: Mapping[str, str], names: Iterable[str]) -> dict[str, Any]:
    """``plan`` (pattern -> string) over the module names ``names``: name -> ``ParallelStyle`` (the first pattern that
    matches a name wins, as transformers reads its plans); a string symmem does not follow, or a pattern that matches
    no module, is a one-line :class:`~symmem.errors.SymmemError`."""
    if not isinstance(plan, Mapping) or not plan:
        raise SymmemError("tp_plan must be a non-empty dict of module-name patterns to plan strings "
                          "({'layers.*.up': 'colwise', 'layers.*.down': 'rowwise'})")
    listed = list(names)
    out: dict[str, Any] = {}
    for pattern, text in plan.items():
        if not isinstance(pattern, str) or not isinstance(text, str):
            raise SymmemError(f"tp_plan: {pattern!r}: {text!r}: patterns and styles are strings")
        if text not in STYLES:
            raise SymmemError(f"tp_plan: {pattern!r} is {text!r}, which symmem does not follow; the styles followed: "
                              f"{', '.join(sorted(STYLES))}")
        found = [n for n in listed if fnmatch.fnmatchcase(n, pattern) and n not in out]
        if not found and not any(fnmatch.fnmatchcase(n, pattern) for n in listed):
            raise SymmemError(f"tp_plan: {pattern!r} matches no module of the model (its modules: "
                              f"{', '.join(n for n in listed[:8] if n)}{' ...' if len(listed) > 8 else ''})")
        out.update({n: _style(text) for n in found})
    return out


@dataclass(frozen=True)
class TensorPlan:
    """A module's plan: ``make(module, t)`` gives name -> ``ParallelStyle`` for the module (a copy of it, the one
    that is split) over ``t`` ranks; ``source`` says where the plan came from; ``positions``: the forward is given
    the whole sequence's position ids (a Hugging Face Llama under sequence parallelism counts them from the
    embedding's S-split output otherwise; the real runs pass them, as torchtitan precomputes its rotary tables);
    ``config``: a Hugging Face config whose heads, MLP width and vocabulary ``t`` must divide (:func:`check_heads`)."""

    source: str
    make: Callable[[Any, int], dict[str, Any]]
    positions: bool = False
    config: Any = None


def _is_hf_llama(module: Any) -> bool:
    return type(module).__name__ == "LlamaForCausalLM" and hasattr(getattr(module, "model", None), "layers")


def _hf_plan(module: Any) -> dict[str, str] | None:
    """A Hugging Face model's own plan: its config's ``base_model_tp_plan`` under the base model's prefix, and the
    class's ``_tp_plan`` (the head)."""
    config = getattr(module, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(module, "base_model_prefix", "")
    inner = f"{prefix}." if prefix and hasattr(module, prefix) else ""
    plan = {f"{inner}{k}": v for k, v in dict(base).items()}
    plan.update(dict(getattr(type(module), "_tp_plan", None) or {}))
    return plan


def plan_of(module: Any, sequence: bool) -> TensorPlan:
    """The plan the traced step splits ``module`` with (``sequence``: sequence parallelism)."""
    config = getattr(module, "config", None)  # a Hugging Face model's: t must divide its heads (check_heads)
    if _is_hf_llama(module):
        from ..record.hf_llama import hf_llama_plan

        if sequence and getattr(config, "_attn_implementation", None) == "eager":
            raise SymmemError("HF's eager attention does not run under sequence parallelism: its causal mask follows "
                              "the S-split embedding output (attn_implementation=sdpa)")
        return TensorPlan("Hugging Face Llama: the standard plan (symmem.record.hf_llama.hf_llama_plan)",
                          lambda m, world: hf_llama_plan(m, world, sequence), sequence, config)
    own = getattr(module, "tp_plan", None) or None  # transformers gives a model without a plan an empty one
    source = "the module's tp_plan"
    if own is None:
        own, source = _hf_plan(module), f"{type(module).__name__}'s config.base_model_tp_plan"
    if own is None:
        raise SymmemError(f"{type(module).__name__} has no tensor-parallel plan: give the module a tp_plan attribute, "
                          "a dict of module-name patterns to styles ({'layers.*.up': 'colwise', 'layers.*.down': "
                          "'rowwise'}; styles: " + ", ".join(sorted(STYLES)) + ")")
    if sequence and "sequence_parallel" not in dict(own).values():
        raise SymmemError(f"--sequence-parallel: {source} has no 'sequence_parallel' entry, so it splits nothing over "
                          "the sequence (sequence parallelism of a traced module follows Hugging Face Llama's "
                          "standard plan, or a plan's own 'sequence_parallel' entries)")
    plan = dict(own)
    return TensorPlan(source, lambda m, world: styles_of(plan, [n for n, _ in m.named_modules()]), config=config)


def check_heads(config: Any, world: int) -> None:
    """Refuse a ``t`` that does not divide a Hugging Face config's heads, key/value heads, MLP width or vocabulary:
    DTensor would split a head between ranks or pad a shard."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % world:
            raise SymmemError(f"t={world} does not divide {key}={value}: the plan splits it evenly over the ranks "
                              "(a split head or a padded shard is not followed)")


def split_parameters(module: Any, sequence: bool) -> frozenset[str]:
    """The names of ``module``'s parameters its plan splits over the ranks: every parameter of a column-parallel
    module (weight and bias), the weight of a row-parallel one (its bias is added once the output is reduced: whole on
    every rank); ``SequenceParallel`` modules keep theirs whole.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    >>> net.tp_plan = {"0": "colwise", "2": "rowwise"}
    >>> sorted(split_parameters(net, False))
    ['0.bias', '0.weight', '2.weight']
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    found: set[str] = set()
    for name, style in plan_of(module, sequence).make(module, 1).items():
        sub = module.get_submodule(name)
        for own, _ in sub.named_parameters(recurse=False):
            if isinstance(style, ColwiseParallel) or (isinstance(style, RowwiseParallel) and own == "weight"):
                found.add(f"{name}.{own}" if name else own)
    return frozenset(found)
