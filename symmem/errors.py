"""The one exception symmem raises for bad input."""

from __future__ import annotations


class SymmemError(ValueError):
    """Bad input: an unknown model, op or symbol, shapes that do not agree, values that make no sense.

    The message names what was wrong and, for graph errors, the node, its op kind and the shapes involved.
    """


class NothingFits(SymmemError):
    """An answer, not bad input: not even the smallest size fits the budget (the command line exits 1)."""


def node_error(node: str, kind: str, message: str, shapes: object = None) -> SymmemError:
    """A :class:`SymmemError` that names the node, its op kind and (optionally) the shapes involved.

    >>> str(node_error("fc1", "linear", "width mismatch", [("B", 3), ("4", "5")]))
    "node 'fc1' (linear): width mismatch; shapes: [('B', 3), ('4', '5')]"
    """
    text = f"node {node!r} ({kind}): {message}"
    if shapes is not None:
        text += f"; shapes: {shapes}"
    return SymmemError(text)


class NothingCounted(UserWarning):
    """A convention found nothing it counts in a graph (a role convention and a graph without those roles): its
    activations are 0 because it cannot see them, not because none are kept."""


class OutsideDomain(UserWarning):
    """Numbers outside the formulas' domain (:attr:`symmem.derivation.Derivation.domain`: a traced module's guards
    such as ``B < 16``, a model's position table): the formulas are not known to hold there, so the numbers printed
    at them are an extrapolation (the command line says so in one line on standard error)."""


class UncountedInput(UserWarning):
    """Selective recomputation drops the copy a core-attention matmul keeps of its input, and nothing outside the
    recomputed core keeps that input; the recompute needs it (Korthikanti et al. keep Q and K), so the kept
    activations are low by that input's bytes per layer."""

