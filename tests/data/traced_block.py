"""A small module with a repeated block, for tests/test_traced_engines.py: traced by symmem and trained for real by
gloo workers (symmem.importer.traced_engines.SpecBuilder loads it by path).  The head's 5 rows do not divide by 2,
so FSDP2 pads them and the last rank holds fewer (its optimizer state is smaller)."""

import torch


class Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.up = torch.nn.Linear(h, 3 * h)
        self.down = torch.nn.Linear(3 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, h: int = 24, layers: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, h)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(layers))
        self.head = torch.nn.Linear(h, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 12),)


class TiedNet(torch.nn.Module):
    """Net with one weight read by three modules: ``mix`` and ``mix2`` before the blocks (one stage: one copy) and
    the head after them (the last stage: a copy of its own), for tests/test_traced_pipeline.py."""

    def __init__(self, h: int = 24, layers: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, h)
        self.mix, self.mix2 = torch.nn.Linear(h, h), torch.nn.Linear(h, h)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(layers))
        self.head = torch.nn.Linear(h, h)
        self.mix2.weight = self.head.weight = self.mix.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mix2(self.mix(self.inp(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_tied() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return TiedNet(), (torch.randn(4, 12),)


class ReadNet(torch.nn.Module):
    """Net whose head is the module's own code reading the input layer's weight (``x @ self.inp.weight``, 24 -> 12:
    a head written with the embedding's weight rather than a module tied to it), for tests/test_traced_pipeline.py:
    over pipeline stages the last stage reads a parameter of stage 0's module."""

    def __init__(self, h: int = 24, layers: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, h)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x @ self.inp.weight


def build_reads() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return ReadNet(), (torch.randn(4, 12),)
