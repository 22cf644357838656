"""Analyses of a graph, one per module, run by :func:`symmem.engine.derivation` in this order:

1. :mod:`.grad` -- which outputs require grad (a graph-only fact, cached in each node's ``meta``);
2. :mod:`.storage` -- which storage each tensor is (views resolve to their base; repeated blocks' iterations);
3. :mod:`.branches` -- storage decisions that depend on the sizes (a reshape that copies for some sizes only);
4. :mod:`.saved` -- what the convention keeps, as storages with the nodes that keep them;
5. :mod:`.lifetimes` -- when each storage is born and dies on the step's schedule;
6. :mod:`.regimes` -- checkpointing, tensor/sequence/pipeline parallelism, and the parameter side (ZeRO).

Shapes are inferred when the graph is built (:mod:`symmem.ops`, :func:`symmem.graph.lint`); the accounting of
what is kept at the end of the forward pass is a view of the storages (:func:`symmem.derivation.kept_terms`).
"""
