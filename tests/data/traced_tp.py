"""A small module with its own tensor-parallel plan (``tp_plan``, transformers' strings), for
tests/test_traced_tensor.py: traced by symmem under ``--tensor-parallel`` and trained for real on gloo ranks under the
same plan.  Each block's ``up`` is split by columns (its bias too), ``down`` by rows (its output all-reduced, its bias
whole); the input layer stays whole on every rank; the head's output is gathered."""

import torch


class Block(torch.nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, f)
        self.down = torch.nn.Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_rep"}

    def __init__(self, h: int = 24, f: int = 64, layers: int = 2, classes: int = 8) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, h)
        self.blocks = torch.nn.ModuleList(Block(h, f) for _ in range(layers))
        self.head = torch.nn.Linear(h, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(batch: int = 4, layers: int = 2, f: int = 64) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Net(f=f, layers=layers), (torch.randn(batch, 12),)
