"""Analyses of a graph, one per module, run by :func:`symmem.engine.derivation` in this order:

1. :mod:`.grad` -- which outputs require grad (a graph-only fact, cached in each node's ``meta``);
2. :mod:`.storage` -- which storage each tensor is (views resolve to their base; repeated blocks' iterations);
3. :mod:`.branches` -- storage decisions that depend on the sizes (a reshape that copies for some sizes only);
4. :mod:`.saved` -- what the convention keeps, as storages with the nodes that keep them;
5. :mod:`.regimes` -- checkpointing, tensor/sequence/pipeline parallelism, and the parameter side (ZeRO).

The training step, for its peak (computed on first use): :mod:`.unroll` writes repeated blocks out,
:mod:`.schedule` simulates the step op by op into a :class:`~symmem.timeline.Timeline`, and :mod:`.graph_step` folds the
timelines into the peak's formulas (:class:`~symmem.step.Step`, the algebra in :mod:`symmem.peak`).

Shapes are inferred when the graph is built (:mod:`symmem.ops`, :func:`symmem.graph.lint`); the accounting of
what is kept at the end of the forward pass is a view of the storages (:func:`symmem.derivation.kept_terms`).
"""
