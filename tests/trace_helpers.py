"""Callables for ``symmem trace package.module:callable`` in tests/test_trace_cli.py (torch imported inside)."""

from __future__ import annotations

from typing import Any


def mlp_with_inputs() -> Any:
    """A small MLP and its example batch: ``(module, (x,))``."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return net, (torch.randn(2, 16),)


def mlp() -> Any:
    """The same MLP alone (example inputs from ``--input 2x16``)."""
    return mlp_with_inputs()[0]


def not_a_module() -> Any:
    return 42


def data_dependent() -> Any:
    """A module whose output shape depends on the data: fake tensors cannot run it symbolically."""
    import torch

    class Nonzero(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            y = self.fc(x)
            return y[y > 0].sum()

    return Nonzero(), (torch.randn(2, 4),)


def broken() -> Any:
    """A module that cannot run at all on its example (a shape mismatch)."""
    import torch

    return torch.nn.Linear(4, 4), (torch.randn(2, 5),)


def cnn(n: int = 4) -> Any:
    """A small user module: conv, batch norm, ReLU, a ModuleList of ``n`` identical conv blocks, a mean pool, a
    head (tests/test_trace_derivation.py and tests/test_trace_peak.py trace it)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU())
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()) for _ in range(n))
            self.head = torch.nn.Linear(8, 10)

        def forward(self, x: Any) -> Any:
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean((2, 3)))

    return Net()
