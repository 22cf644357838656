"""A part of the graph the loss never reaches (BERT's pooler: the step backpropagates from the last hidden state's
sum) is freed with the output, as in an unhooked PyTorch step: the traced peak, the tracker's real step and the
allocator with no hooks at all agree to the byte."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem  # noqa: E402
from symmem.record.live_bytes import LiveTracker  # noqa: E402
from symmem.record.steps import allocator_step, track_step  # noqa: E402


def _bert(layers: int) -> Any:
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, vocab_size=24,
                                  num_hidden_layers=layers, max_position_embeddings=16, attn_implementation="eager")
    return transformers.BertModel(cfg)  # with its pooler


def test_tracker_frees_what_the_loss_never_reaches() -> None:
    """The tracker's pack hook used to hand autograd the saved output itself: the pooler's Tanh output then held
    its own grad_fn, a cycle that kept the pooler's saved tensors alive through backward."""
    net = torch.nn.Linear(4, 4)
    tracker = LiveTracker()
    with tracker, tracker.phase(1, "forward"), tracker.saving():
        y = torch.tanh(net(torch.randn(2, 4)))  # tanh saves its output
    dead = weakref.ref(y)
    del y
    assert dead() is None


def test_bert_pooler_peak_against_a_real_step() -> None:
    ids = torch.randint(0, 4, (3, 5), generator=torch.Generator().manual_seed(0))
    d = symmem.trace(_bert(2), (torch.zeros(2, 4, dtype=torch.long),), {"B": [(0, 0)], "S": [(0, 1)]},
                     optimizer="adamw", optimizer_impl="for-loop", device="cpu")
    real = track_step(_bert(3), (ids,), optimizer="adamw", impl="for-loop", allocator=True)
    assert d.at(B=3, S=5, L=3).value("peak") == real.steady.bytes  # 1,152 bytes more before the fix
    # the tracker's instrumentation changes nothing the allocator sees, against a run with no hooks at all
    assert real.allocator.peak(2) == allocator_step(_bert(3), (ids,), optimizer="adamw", impl="for-loop").peak(2)
