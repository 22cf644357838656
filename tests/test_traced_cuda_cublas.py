"""Traced modules on CUDA count cuBLAS's dense copy of a broadcast operand (``symmem.importer.kernel_temporaries``).

Under the loss ``sum`` the logits' gradient is a 0-dim one expanded with strides 0; cuBLAS takes no such matrix, so
each ``mm`` of the head's backward clones it dense first (``prepare_matrix_for_cublas``), inside the kernel, where
a traced step's dispatch-mode recorder cannot see it.  Truth: the H200's allocator (tests/data/cuda_h200_pipeline.json,
Llama's last stage under 1F1B, the clone located with C++ frames; the built-in graph's rule is checked against it
in tests/test_cuda_pipeline_measured.py).  A CPU build of torch makes no fake CUDA tensors, so the kernel's rule is run
on CPU fakes standing in for CUDA's: every moment of the step is the CPU's (itself equal to a real CPU step) except
the head's two backward products, each one (B·S, V) FP32 tensor more.  HF Llama's traced step with the rule equals
the built-in graph's CUDA step where that moment is its peak (``tests/test_traced_cuda_softmax.py``'s ``ZOO``).
"""

from __future__ import annotations

import pytest
import sympy

torch = pytest.importorskip("torch")

import symmem  # noqa: E402
from symmem.importer import kernel_temporaries  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

DIMS = {"B": [(0, 0)], "S": [(0, 1)]}
STEP = {"loss": "sum", "optimizer": "adamw", "optimizer_impl": "for-loop"}


class Head(torch.nn.Module):
    """An embedding and a linear head over a vocabulary V = 96: logits (B, S, 96)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 16)
        self.head = torch.nn.Linear(16, 96, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_the_head_backward_gains_one_logits_sized_copy_per_product(monkeypatch):
    torch.manual_seed(0)
    net = Head()
    plain = symmem.trace(net, (torch.randint(0, 96, (2, 8)),), DIMS, device="cpu", **STEP)
    sizes = ((3, 24), (2, 40))
    for b, s in sizes:
        real = track_step(net, (torch.randint(0, 96, (b, s)),), loss="sum", optimizer="adamw", impl="for-loop")
        got = plain.at(B=b, S=s)
        assert [got.value("peak_first_step"), got.value("peak")] == [real.first.bytes, real.steady.bytes]
    cpu = plain.step.record()
    monkeypatch.setattr(kernel_temporaries, "DEVICES", ("cuda", "cpu"))
    cuda = symmem.trace(net, (torch.randint(0, 96, (2, 8)),), DIMS, device="cpu", **STEP).step.record()
    products = [i for i, o in enumerate(cuda.ops) if o.op in kernel_temporaries.MATRIX_PRODUCTS]
    assert [o.op for o in cuda.ops] == [o.op for o in cpu.ops]
    symbols = {str(x): x for s in cuda.storages for x in sympy.sympify(s.nbytes).free_symbols}
    for b, s in sizes:
        values = {symbols["B"]: b, symbols["S"]: s}
        for step in ("first", "steady"):
            more = [{c: n - was[c] for c, n in now.items() if n != was[c]}
                    for (_, _, was), (_, _, now) in zip(cpu.timeline(step, values), cuda.timeline(step, values),
                                                        strict=True)]
            gained = [i for i, d in enumerate(more) if d]
            # the forward's product has dense operands; the backward's two each clone the expanded gradient
            assert len(gained) == 2 and set(gained) < set(products), gained
            assert all(more[i] == {"temporary": b * s * 96 * 4} for i in gained)
