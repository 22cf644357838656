"""Hugging Face's own ``LlamaForCausalLM`` under DTensor's standard tensor-parallel plan: third-party truth.

The tensor-parallel runs (:mod:`symmem.record.model_parallel_runs`) train the project's Llama reference; this
builds the model people load instead -- ``transformers``' ``LlamaForCausalLM`` from a small ``LlamaConfig`` (no
weights: random initialisation, ``tie_word_embeddings=False``, the default rotary embedding, eager or SDPA
attention) -- with the same plan, named after HF's modules (``model.layers.i.mlp.gate_proj``).  Needs
``transformers``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import SymmemError


def hf_llama(values: Mapping[str, int], attention: str = "naive", dropout: float = 0.0,
             sequence: bool = False, cache: str = "dynamic") -> tuple[Any, Any]:
    """``transformers``' LlamaForCausalLM at symbol values (``B``, ``S``, ``H``, ``h``, ``G``, ``L``, ``V``,
    ``F``) in training mode, and its input ids (B, S); ``attention`` ``naive`` is HF's ``eager``; ``sequence``:
    for the sequence-parallel plan (SDPA only); ``cache`` ``dynamic`` is the config's default ``use_cache=True``,
    ``none`` is ``use_cache=False`` (the zoo's option of the same name)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if cache not in ("dynamic", "none"):
        raise SymmemError(f"HF's Llama cache is 'dynamic' (use_cache=True) or 'none' (use_cache=False), not {cache!r}")
    heads = int(values["h"])
    config = LlamaConfig(vocab_size=int(values["V"]), hidden_size=int(values["H"]),
                         intermediate_size=int(values.get("F", 4 * int(values["H"]))),
                         num_hidden_layers=int(values["L"]), num_attention_heads=heads,
                         num_key_value_heads=int(values.get("G", heads)), tie_word_embeddings=False,
                         attention_dropout=dropout, use_cache=cache == "dynamic")
    implementation = {"naive": "eager", "sdpa": "sdpa"}.get(attention)
    if implementation is None:
        raise SymmemError(f"HF's Llama runs eager ('naive') or SDPA attention, not {attention!r}")
    if sequence and implementation == "eager":
        # create_causal_mask sizes the mask from the embedding's output, which the plan splits over S: eager
        # attention's scores (B, h/t, S, S) then meet an (B, 1, S/t, S/t) mask and HF's forward fails
        raise SymmemError("HF's eager attention does not run under sequence parallelism: its causal mask follows "
                          "the S-split embedding output (use SDPA)")
    config._attn_implementation = implementation
    module = LlamaForCausalLM(config)
    module.train()
    ids = torch.randint(0, int(values["V"]), (int(values["B"]), int(values["S"])))
    return module, ids


def hf_llama_plan(module: Any, world: int, sequence: bool) -> dict[str, Any]:
    """The standard plan of the reference runs (``llama_plan``, ``llama_sequence_plan``) on HF's module names.
    With ``sequence``: the norms ``SequenceParallel``; the attention's ``hidden_states`` (a keyword argument in
    HF's decoder layer) all-gathered over S before q/k/v; gate and up each all-gather the normed input, as the
    reference's do; o and down reduce-scatter over S.  HF's attention reshapes with ``-1`` heads: nothing to
    divide.

    >>> from types import SimpleNamespace
    >>> plan = hf_llama_plan(SimpleNamespace(model=SimpleNamespace(layers=[None])), 2, sequence=False)
    >>> sorted(plan)[:4]
    ['lm_head', 'model.embed_tokens', 'model.layers.0.mlp.down_proj', 'model.layers.0.mlp.gate_proj']
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    split = Shard(1) if sequence else Replicate()
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=split),
        "lm_head": ColwiseParallel(input_layouts=split, output_layouts=Replicate())}
    if sequence:
        plan["model.norm"] = SequenceParallel()
    for i in range(len(module.model.layers)):
        at = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{at}.{name}"] = ColwiseParallel()
        for name in ("mlp.gate_proj", "mlp.up_proj"):
            plan[f"{at}.{name}"] = ColwiseParallel(input_layouts=split)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{at}.{name}"] = RowwiseParallel(output_layouts=split)
        if sequence:
            plan[f"{at}.input_layernorm"] = SequenceParallel()
            plan[f"{at}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{at}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                         desired_input_kwarg_layouts={"hidden_states": Replicate()})
    return plan


def hf_llama_forward(module: Any, sequence: bool) -> Callable[[Any], Any]:
    """HF's forward returning the logits (the output object, which holds the ``DynamicCache``, let go as it
    returns); with ``sequence`` the whole sequence's position ids given to ``LlamaModel`` (HF counts them from the
    embedding's output, which sequence parallelism splits over S; torchtitan precomputes its rotary tables) by a
    keyword pre-hook, so that they go when ``LlamaModel.forward`` returns, as HF's own do."""
    if sequence:
        whole_sequence_positions(module)

    def forward(input_ids: Any) -> Any:
        return module(input_ids).logits

    return forward


def logits_of(module: Any) -> Any:
    """A Hugging Face causal LM as a module that returns its logits: the output object, and the cache it holds, let
    go as the forward returns (what a training step keeps is then the model's, not the output object's)."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = module

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.module(ids).logits

    return Logits()


def whole_sequence_positions(module: Any) -> Any:
    """Give a Hugging Face causal LM's ``module.model`` the whole sequence's position ids, by a keyword pre-hook
    (so they are made as it starts and go when it returns, as HF's own do), and return the hook's handle."""
    import torch

    def positions(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        return args, {**kwargs, "position_ids": torch.arange(ids.shape[1]).unsqueeze(0)}

    return module.model.register_forward_pre_hook(positions, with_kwargs=True)
