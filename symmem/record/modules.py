"""Which module is running: the innermost in the forward (forward hooks on every submodule), and in the backward
the autograd node running and the module whose output that node made (nodes tagged in the forward).

Both recorders use it: the saved-tensor recorder names what each module saves, the live-bytes recorder where each
op of a training step runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .identity import tensors

#: autograd node metadata: the module whose output the node made
MODULE_KEY = "symmem.module"


class ModuleTracker:
    """The stack of running modules of ``module`` while entered (a context manager adding forward hooks).

    ``current`` is the innermost module's qualified name (``""`` for none).  A module that raises keeps its place
    on the stack (the post hook does not run), so an error can say where it happened.  ``tag`` also tags the
    autograd node of each module's output with the innermost module that made it (``MODULE_KEY`` in
    ``node.metadata``), for naming the backward; ``on_change(name)`` is told the innermost module whenever it
    changes.

    >>> torch = getattr(__import__("pytest"), "importorskip")("torch")
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> seen = []
    >>> with ModuleTracker(net, on_change=seen.append) as modules:
    ...     y = net(torch.ones(1, 2))
    >>> seen, modules.current
    (['', '0', '', '1', '', ''], '')
    """

    def __init__(self, module: Any, *, tag: bool = False, on_change: Callable[[str], None] | None = None) -> None:
        self.module = module
        self.tag = tag
        self.on_change = on_change
        self.stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def __enter__(self) -> ModuleTracker:
        stack = self.stack

        def pre(name: str) -> Callable[..., None]:
            def hook(mod: Any, args: Any) -> None:
                stack.append(name)
                if self.on_change is not None:
                    self.on_change(name)

            return hook

        def post(mod: Any, args: Any, out: Any) -> None:
            if not stack:
                return
            name = stack.pop()
            if self.tag:  # the innermost module whose output this node makes
                for t in tensors(out):
                    if getattr(t, "grad_fn", None) is not None:
                        t.grad_fn.metadata.setdefault(MODULE_KEY, name)
            if self.on_change is not None:
                self.on_change(self.current)

        for name, sub in self.module.named_modules():
            self._handles.append(sub.register_forward_pre_hook(pre(name)))
            self._handles.append(sub.register_forward_hook(post))  # not always_call: an error keeps its module
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def hook_backward(root: Any, enter: Callable[[str, Any, Any], None], leave: Callable[[Any], None]) -> list[Any]:
    """Hooks on every node of the autograd graph behind ``root``: ``enter(name, node, grad_outputs)`` before the
    node runs, ``leave(grad_inputs)`` after.  Returns the hook handles (remove them after backward)."""
    handles: list[Any] = []
    seen: set[int] = set()
    todo = [root.grad_fn] if root.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = node.name().removeprefix("torch::autograd::")

        def pre(grad_outputs: Any, name: str = name, node: Any = node) -> None:
            enter(name, node, grad_outputs)

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(lambda grad_inputs, grad_outputs: leave(grad_inputs)))
        todo.extend(n for n, _ in node.next_functions)
    return handles
