"""A model of one's own, as a newcomer has it: a file with a module and a function that builds it.

``symmem trace examples/encoder.py:build --dims B,S`` traces it: ``build`` returns the module and example inputs
(token ids of shape batch x sequence), and ``--dims B,S`` names their dimensions 0 and 1.
"""

from __future__ import annotations

import torch


class Encoder(torch.nn.Module):
    """Token embedding, a stack of identical pre-norm transformer layers, a classifier on the first token."""

    def __init__(self, vocab: int = 8000, width: int = 256, heads: int = 4, depth: int = 2, classes: int = 10):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x[:, 0])


def build() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The module and example inputs: 2 sequences of 16 token ids."""
    return Encoder(), (torch.randint(0, 8000, (2, 16)),)
