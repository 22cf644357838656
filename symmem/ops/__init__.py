"""Op kinds: for each, in one registration (:func:`registry.op`), its output shape and strides, its parameters and
whether it is a view (the **shape rule**), the attributes it takes (its **schema**), and what eager PyTorch's
autograd keeps for its backward and allocates in it (the pytorch convention's **save** and **gradient rules**).

One small function per rule, looked up by op kind (like torch.fx's ``run_node``); one module per family of
kinds: :mod:`.tensors` (leaves, views, copies, dropout, elementwise, reductions), :mod:`.convnet` (convolution,
batch norm, pools), :mod:`.layers` (linear, matmul, attention, embeddings, norms, the loss).  The vocabulary
the save and gradient rules speak is :mod:`.autograd`; the registry and the attribute checks are
:mod:`.registry`.  Importing this package checks that every kind has all its rules, or says why not
(:class:`Unsupported`).  What a role convention (``paper``, ``megatron``) keeps is data of its own
(:mod:`symmem.conventions`).

Layouts (:mod:`symmem.strides`).  Every shape rule gives its output's strides: views rearrange their input's
(``transpose``, ``permute``, ``select``, ``slice``, ``expand``, ``identity``, ``block_input``), elementwise ops
follow their inputs' memory order as PyTorch's ``TensorIterator`` does, ``clone``/``to_dtype``/``cast`` keep it
(``empty_like``), and every other op makes a contiguous tensor.  Storage decisions come from the input strides
and are the rule's ``facts``: whether ``reshape``/``flatten``/``contiguous`` copies (``copy``), which operands a
batched ``matmul`` copies to fold into ``bmm`` (``copy_inputs``), and the layout ``attention`` sees
(``q_bshd``, ``v_contiguous``).  A builder may still state these as attributes (``copy=``, ``copy_inputs=``,
``q_layout=``, ``v_contiguous=``); a stated value wins over the derived one (graphs built before strides).

>>> from symmem.symbols import B, S, H
>>> from symmem.tensor import TensorSpec
>>> info = infer("linear", [TensorSpec((B, S, H))], {"out_features": 4 * H})
>>> info.out.shape, info.params
((B, S, 4*H), {'weight': (4*H, H), 'bias': (4*H,)})
>>> sorted(kinds())[:5]
['adaptive_avgpool2d', 'add', 'attention', 'avgpool2d', 'batchnorm']
"""

from . import convnet, layers, tensors  # noqa: F401  (each family registers its op kinds on import)
from .autograd import ALIAS, NEW, Grads, RuleContext, Saved, requires_grad
from .registry import (
    Attr,
    OpError,
    OpInfo,
    OpKind,
    Unsupported,
    check_attrs,
    check_complete,
    entry,
    infer,
    kinds,
    known,
    schema,
)

__all__ = ["ALIAS", "NEW", "Attr", "Grads", "OpError", "OpInfo", "OpKind", "RuleContext", "Saved", "Unsupported",
           "check_attrs", "entry", "infer", "kinds", "known", "requires_grad", "schema"]

check_complete()
