"""The declared vocabulary of tensor roles: what a tensor *is*, for conventions that count by role.

A builder may give an op's output a role (``g.op("linear", x, role="qkv", ...)``); role conventions such as
``paper`` and ``megatron`` keep tensors by role, and breakdowns show it.  Roles are a closed vocabulary: a
typo (``mlp_hiden``) is an error naming the closest known role, never a tensor silently not counted.  Declare
a new role with :func:`declare` before using it in your own graph.

Two families share the vocabulary: **graph roles** (the output of a graph node, chosen by a builder) and
**storage roles** (a tensor only an op keeps: indices, masks, statistics; chosen by a convention's rule).

>>> check("qkv")
'qkv'
>>> check("mlp_hiden")
Traceback (most recent call last):
symmem.errors.SymmemError: unknown role 'mlp_hiden' (did you mean 'mlp_hidden'?); declare it with symmem.roles.declare
"""

from __future__ import annotations

import difflib

from .errors import SymmemError

_ROLES: dict[str, str] = {}


def declare(name: str, meaning: str) -> str:
    """Add ``name`` to the vocabulary (idempotent for the same meaning); returns the name."""
    if not isinstance(name, str) or not name.isidentifier():
        raise SymmemError(f"a role is an identifier such as 'mlp_hidden', got {name!r}")
    _ROLES.setdefault(name, meaning)
    return name


def check(name: str | None) -> str | None:
    """``name`` if it is a declared role (or None); a :class:`SymmemError` with the closest role otherwise."""
    if name is None or name in _ROLES:
        return name
    close = difflib.get_close_matches(str(name), list(_ROLES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise SymmemError(f"unknown role {name!r}{hint}; declare it with symmem.roles.declare")


def known() -> dict[str, str]:
    """Every declared role and its meaning."""
    return dict(_ROLES)


for _name, _meaning in {
    # graph inputs and the parameter side
    "input": "the batch fed to the model (reported apart from activations)",
    "target": "the loss target (labels)",
    "labels": "labels fed to a model that computes its own loss",
    "parameter": "a free-standing learned tensor (class token, position table)",
    "loss": "what a loss keeps, or its output",
    "logits": "the model's output scores over classes or a vocabulary",
    # vision
    "stem": "the stem convolution's output (ResNet conv1)",
    "stem_pool": "the stem max-pool's output",
    "main_path": "a convolution of a residual block's main path",
    "downsample": "the projection shortcut's convolution",
    "downsample_input": "the input a projection shortcut keeps",
    "conv": "a convolution's output (VGG)",
    "pool": "a pooling output (VGG)",
    "fc": "a fully connected layer's output",
    "act": "an activation function's output (MLP)",
    "hidden": "a hidden activation (examples)",
    "activations": "every activation of a model given by its counts",
    # transformers
    "residual": "a residual-stream tensor that feeds a norm",
    "attn_input": "the normalized input of the QKV projection",
    "qkv": "the QKV projection output",
    "attn_scores": "the raw attention scores Q K^T (naive attention)",
    "attn_probs": "the softmax output (naive attention)",
    "attn_dropout": "the dropout of the attention probabilities",
    "attention": "the fused scaled-dot-product attention output",
    "proj_input": "the merged heads, input of the output projection",
    "mlp_input": "the normalized input of the first MLP linear",
    "mlp_hidden": "the first MLP linear's output (input of the activation)",
    "mlp_act": "the activation's output (input of the second MLP linear)",
    "mlp_gate_act": "SwiGLU's activated gate",
    "patch_embed": "the token sequence entering the first layer (ViT)",
    "embedding": "the embedded tokens",
    # storages only an op keeps (set by convention rules)
    "indices": "max-pool indices",
    "mask": "a dropout mask (role conventions)",
    "dropout_mask": "a dropout mask or noise tensor",
    "attn_dropout_mask": "the attention dropout's mask",
    "batchnorm_stats": "batch norm's saved mean and inverse std",
    "norm_stats": "a layer norm's or RMS norm's saved statistics",
    "matmul_copy": "a contiguous copy a batched matmul keeps",
    "attn_lse": "the fused attention kernel's log-sum-exp",
    "rng_state": "a fused kernel's random seed and offset",
    "activation_gradients": "gradients of the activations (CS231n's x2 for backward)",
    "checkpoint": "a checkpointed block input",
    "recompute": "a layer's activations recomputed during backward",
    "in_flight": "activations of micro-batches in flight (pipeline)",
}.items():
    declare(_name, _meaning)
