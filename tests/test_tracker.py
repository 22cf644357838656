"""The live-bytes tracker against cases small enough to count by hand.

The hand counts below hold the output through backward (``keep_output=True``, a loop with ``out = module(x)`` in
scope); the default lets it go (tests/test_defaults.py counts that case).

Every oracle below is arithmetic on float32 (4 bytes) shapes, written out in the comments; the tracker has to
agree to the byte.  Conventions used in the comments: ``x`` the batch, ``y`` the module output, ``W``/``b``
weights and biases, ``dW`` a weight gradient, ``seed`` the 4-byte ``ones_like(loss)`` that ``backward()`` starts
from.  With ``loss.sum()`` the gradient of ``y`` is ``seed.expand(y.shape)``: a view, 0 bytes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from symmem.categories import RECORDED  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.record.live_bytes import LiveTracker  # noqa: E402
from symmem.record.steps import allocator_step, track_step  # noqa: E402

F = 4  # bytes per float32


def linear(n_in: int = 4, n_out: int = 3, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(n_in, n_out, bias=bias)


def allocations(trace, step: int, phase: str) -> list[tuple[str, int]]:
    """(op, bytes) of every op that allocated, in one phase of one step."""
    return [(r.op, r.allocated) for r in trace.records if r.step == step and r.phase == phase and r.allocated]


def test_linear_sgd_every_byte():
    t = track_step(linear(), torch.zeros(2, 4), optimizer="sgd", keep_output=True)
    W, b, x, y = 3 * 4 * F, 3 * F, 2 * 4 * F, 2 * 3 * F          # 48, 12, 32, 24
    start = W + b + x                                              # 92
    assert (t.start.live, t.start.bytes("parameter"), t.start.bytes("input")) == (start, W + b, x)
    for step in (1, 2):                                            # set_to_none: step 2 starts where step 1 did
        assert allocations(t, step, "forward") == [("aten.addmm.default", y)]
        assert allocations(t, step, "loss") == [("aten.sum.default", F)]
        # the seed; dW = dy^T x (3x4); db = dy summed over the batch (1x3, viewed as 3); no dx: x needs no grad
        assert allocations(t, step, "backward") == [("aten.ones_like.default", F), ("aten.mm.default", W),
                                                    ("aten.sum.dim_IntList", b)]
        assert allocations(t, step, "step") == []                   # p.add_(grad, alpha=-lr): in place
        assert t.live_at(step, "forward") == start + y              # 116
        assert t.live_at(step, "loss") == start + y + F             # 120
        assert t.live_at(step, "backward") == start + W + b         # 152: y, loss, seed die with the caller's refs
        assert t.live_at(step, "step") == start + W + b             # 152
        assert t.live_at(step, "zero_grad") == start                # 92: set_to_none frees the gradients
        peak = t.peak_of(step)
        assert peak.bytes == start + y + F + F + W + b              # 184, when db is born
        assert (peak.phase, peak.op, peak.where) == ("backward", "aten.sum.dim_IntList", "AddmmBackward0")
        assert dict(peak.by_category) == {"parameter": W + b, "input": x, "gradient": W + b,
                                          "output": y + F, "activation_grad": F}
        assert sorted(s.nbytes for s in peak.alive) == sorted([W, b, x, y, F, F, W, b])
    assert t.first.bytes == t.steady.bytes == t.peak.bytes == 184
    assert t.persistent(2) == start + W + b                         # weights + input + gradients: nothing saved
    assert t.ratio(2) == 184 / 152
    assert t.leaked == ()


def test_sgd_momentum_first_step_clones_the_gradient():
    t = track_step(linear(), torch.zeros(2, 4), optimizer="sgd-momentum", keep_output=True)
    W, b, x, y = 48, 12, 32, 24
    start = W + b + x
    # step 1: buf = grad.detach().clone() for W then b, inside the step
    assert allocations(t, 1, "step") == [("aten.clone.default", W), ("aten.clone.default", b)]
    clones = [s for s in t.storages if s.op == "aten.clone.default"]
    assert [s.category for s in clones] == ["optimizer_state", "optimizer_state"]  # state from its birth
    assert [(s.step, s.phase, s.died) for s in clones] == [(1, "step", None)] * 2
    first = t.first
    assert first.bytes == start + (W + b) + (W + b)                 # 212: grads and their clones
    assert (first.phase, first.op, first.where) == ("step", "aten.clone.default", "bias")
    # step 2: buf.mul_(0.9).add_(grad); p.add_(buf): no allocation; the buffers are live from the start
    assert allocations(t, 2, "step") == []
    steady = t.steady
    assert steady.bytes == start + (W + b) + y + F + F + (W + b)    # 244: state + step 1's backward peak
    assert (steady.phase, steady.op) == ("backward", "aten.sum.dim_IntList")
    assert t.live_at(2, "zero_grad") == start + W + b               # parameters, input, momentum buffers


def test_two_layer_mlp_with_relu():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    t = track_step(net, torch.zeros(2, 4), optimizer="sgd", steps=1, keep_output=True)
    W1, b1, W2, b2 = 8 * 4 * F, 8 * F, 3 * 8 * F, 3 * F             # 128, 32, 96, 12
    P = W1 + b1 + W2 + b2                                             # 268
    x, h, y = 2 * 4 * F, 2 * 8 * F, 2 * 3 * F                         # 32, 64, 24
    start = P + x                                                     # 300
    # forward: h = addmm (dies after the ReLU: nobody saves it), r = relu(h) (saved by the ReLU and by the
    # second linear: one storage), y = addmm
    assert allocations(t, 1, "forward") == [("aten.addmm.default", h), ("aten.relu.default", h),
                                            ("aten.addmm.default", y)]
    end_forward = t.boundary(1, "forward")
    assert end_forward.live == start + h + y                          # 388
    assert (end_forward.bytes("saved"), end_forward.bytes("output")) == (h, y)
    # backward: seed; layer 2: dr = dy W2 (2x8), dW2, db2; ReLU: dh = threshold_backward(dr, r);
    # then dr and r die (128 freed); layer 1: dW1, db1 (no dx)
    assert allocations(t, 1, "backward") == [
        ("aten.ones_like.default", F), ("aten.mm.default", h), ("aten.mm.default", W2), ("aten.sum.dim_IntList", b2),
        ("aten.threshold_backward.default", h), ("aten.mm.default", W1), ("aten.sum.dim_IntList", b1)]
    relu_back = next(r for r in t.records if r.op == "aten.threshold_backward.default")
    assert relu_back.live == start + y + F + F + h + (W2 + b2) + h + h   # 632: r, dr and dh live together
    assert t.records[relu_back.index + 1].freed == 2 * h                  # dr and the saved r are released
    peak = t.peak
    assert peak.bytes == start + y + F + F + P + h                        # 664: all gradients + dh
    assert (peak.phase, peak.op, peak.where) == ("backward", "aten.sum.dim_IntList", "AddmmBackward0")
    assert dict(peak.by_category) == {"parameter": P, "input": x, "gradient": P, "output": y + F,
                                      "activation_grad": F + h}


def test_adam_states_and_for_loop_temporaries():
    t = track_step(linear(), torch.zeros(2, 4), optimizer="adam", impl="for-loop", keep_output=True)
    W, b, x = 48, 12, 32
    start, state = W + b + x, 2 * (W + b) + 2 * F                    # exp_avg, exp_avg_sq, float32 step each
    # step 1, _init_group: per parameter torch.tensor(0.) (lift_fresh) and two zeros_like
    init = [("aten.lift_fresh.default", F), ("aten.zeros_like.default", W), ("aten.zeros_like.default", W),
            ("aten.lift_fresh.default", F), ("aten.zeros_like.default", b), ("aten.zeros_like.default", b)]
    # then per parameter: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): sqrt and div
    update = [("aten.sqrt.default", W), ("aten.div.Tensor", W), ("aten.sqrt.default", b), ("aten.div.Tensor", b)]
    assert allocations(t, 1, "step") == init + update
    assert allocations(t, 2, "step") == update
    assert t.live_at(1, "step") == t.live_at(2, "step") == start + (W + b) + state   # 280
    for peak in (t.first, t.steady):                                 # 376: sqrt(W) and sqrt(W)/c live together
        assert peak.bytes == start + (W + b) + state + 2 * W
        assert (peak.phase, peak.op, peak.where) == ("step", "aten.div.Tensor", "weight")
        assert peak.record.bytes("temporary") == 2 * W


def test_adam_foreach_allocates_one_copy_of_the_parameters():
    t = track_step(linear(), torch.zeros(2, 4), optimizer="adam", impl="foreach", keep_output=True)
    W, b, x = 48, 12, 32
    start, state = W + b + x, 2 * (W + b) + 2 * F
    # steps += torch.tensor(1.0) (4 bytes, gone before the update), then _foreach_sqrt(exp_avg_sqs): W + b
    assert allocations(t, 2, "step") == [("aten.lift_fresh.default", F), ("aten._foreach_sqrt.default", W + b)]
    for peak in (t.first, t.steady):
        assert peak.bytes == start + (W + b) + state + (W + b)      # 340, less than the for-loop's 376 here
        assert (peak.op, peak.where, peak.record.bytes("temporary")) == ("aten._foreach_sqrt.default", "foreach",
                                                                         W + b)


def test_adam_for_loop_keeps_the_previous_denominator():
    """Not "twice the largest parameter": ``denom`` of parameter i-1 lives until ``denom`` of i is assigned."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    P = 128                                                           # both weights are 32 floats
    loop = track_step(net, torch.zeros(2, 4), optimizer="adam", impl="for-loop", steps=1, keep_output=True)
    assert loop.peak.record.bytes("temporary") == 3 * P               # denom(W1) + sqrt(W2) + sqrt(W2)/c
    assert (loop.peak.op, loop.peak.where) == ("aten.div.Tensor", "1.weight")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    each = track_step(net, torch.zeros(2, 4), optimizer="adam", impl="foreach", steps=1, keep_output=True)
    assert each.peak.record.bytes("temporary") == 2 * P               # one copy of all parameters
    assert loop.peak.bytes - each.peak.bytes == P


def test_fused_adam_needs_no_temporaries():
    t = track_step(linear(), torch.zeros(2, 4), optimizer="adam", impl="fused", keep_output=True)
    W, b, x, y = 48, 12, 32, 24
    state = 2 * (W + b) + 2 * F
    assert allocations(t, 2, "step") == []                           # _fused_adam_ updates in place
    assert t.steady.bytes == W + b + x + state + y + F + F + W + b   # 312: the backward, with the state
    assert t.steady.phase == "backward"


def test_adamw_decays_in_place():
    loop = track_step(linear(), torch.zeros(2, 4), optimizer="adamw", impl="for-loop", keep_output=True)
    adam = track_step(linear(), torch.zeros(2, 4), optimizer="adam", impl="for-loop", keep_output=True)
    assert [r.live for r in loop.records if r.allocated] == [r.live for r in adam.records if r.allocated]
    def muls(t):  # exp_avg_sq.mul_(beta2), and for AdamW first p.mul_(1 - lr * wd)
        return [r.op for r in t.records if r.step == 2 and r.where == "weight" and r.op.startswith("aten.mul_")]

    assert (muls(adam), muls(loop)) == (["aten.mul_.Tensor"], ["aten.mul_.Tensor"] * 2)


def test_cross_entropy_holds_four_logits_at_the_start_of_backward():
    torch.manual_seed(0)
    B, K = 4, 50
    t = track_step(torch.nn.Linear(2, K), torch.zeros(B, 2), loss="cross-entropy", optimizer="sgd", steps=1,
                   keep_output=True)
    W, b, x, target, logits = K * 2 * F, K * F, B * 2 * F, B * 8, B * K * F   # 400, 200, 32, 32 (int64), 800
    start = W + b + x + target                                        # 664
    assert allocations(t, 1, "loss") == [("aten._log_softmax.default", logits),
                                         ("aten.nll_loss_forward.default", 2 * F)]  # loss and total_weight
    assert t.boundary(1, "loss").bytes("saved") == logits + F         # log-softmax output, total_weight
    peak = t.peak
    # logits (held by the caller), log-softmax output (saved), d log-softmax (nll_loss_backward) and d logits
    # (_log_softmax_backward_data): four logits-sized tensors; plus the loss and the seed
    assert peak.bytes == start + 4 * logits + F + F                   # 3872
    assert (peak.phase, peak.op) == ("backward", "aten._log_softmax_backward_data.default")
    assert sorted(s.nbytes for s in peak.alive if s.nbytes == logits) == [logits] * 4
    assert t.records[peak.index + 1].freed == 2 * logits              # d log-softmax and the saved output die


def test_residual_fork_sums_two_gradients():
    class Res(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(4, 4, bias=False) for _ in range(3))

        def forward(self, x):
            h = self.a(x)
            return self.c(torch.relu(self.b(h))) + h

    torch.manual_seed(0)
    t = track_step(Res(), torch.zeros(2, 4), optimizer="sgd", steps=1, keep_output=True)
    W, act = 64, 32                                                    # 4x4 weights; 2x4 activations
    add = next(r for r in t.records if r.phase == "backward" and r.op == "aten.add.Tensor")
    # h's gradient from the branch (dh_b = dr W_b, 32 B) meets the identity path's gradient (the seed expanded:
    # 0 bytes) in h's input buffer.  When b's MmBackward0 ends, its saved input h and its incoming dr die (64 B);
    # the engine's out-of-place add makes dh (32 B); then the addend dh_b dies (32 B)
    assert (add.where, add.allocated, add.freed) == ("MmBackward0", act, 2 * act)
    assert t.records[add.index - 1].op == "aten.mm.default" and t.records[add.index - 1].allocated == act
    assert t.records[add.index + 1].freed == act
    # peak when dh_b is born: 3 W + x, h (saved by b's mm), y, loss, seed, dW_c, dW_b, dr (ReLU's), dh_b
    assert t.peak.bytes == 3 * W + act + act + act + F + F + W + W + act + act   # 488
    assert t.peak.index == add.index - 1


def test_zero_grad_set_to_none_or_not():
    t = track_step(linear(), torch.zeros(2, 4), optimizer="sgd", keep_output=True)
    assert all(r.bytes("gradient") == 0 for r in t.records if r.phase == "forward")
    kept = track_step(linear(), torch.zeros(2, 4), optimizer="sgd", zero_grad_set_to_none=False, keep_output=True)
    W, b = 48, 12
    assert all(r.bytes("gradient") == W + b for r in kept.records if r.step == 2 and r.phase == "forward")
    # step 2's backward makes dW and db as before, then AccumulateGrad adds them into the zeroed .grad in place
    assert [op for op, _ in allocations(kept, 2, "backward")] == ["aten.ones_like.default", "aten.mm.default",
                                                                  "aten.sum.dim_IntList"]
    assert kept.steady.bytes == t.steady.bytes + W + b               # 244: the old gradients stay
    assert kept.live_at(2, "zero_grad") == kept.start.live + W + b
    assert any(r.op.startswith("aten.add_") and r.phase == "backward" for r in kept.records)


def test_backward_runs_under_the_mode_and_storages_die_in_it():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    t = track_step(net, torch.zeros(2, 4), optimizer="sgd", steps=1, keep_output=True)
    back = [r for r in t.records if r.phase == "backward"]
    assert {r.where for r in back} >= {"SumBackward0", "AddmmBackward0", "ReluBackward0", "AccumulateGrad"}
    saved = [s for s in t.storages if s.category == "saved"]
    assert saved and all(t.records[s.died].phase == "backward" for s in saved)   # released by the engine
    for r in t.records:                                               # categories partition the live bytes
        assert sum(n for _, n in r.by_category) == r.live
        assert {c for c, _ in r.by_category} <= set(RECORDED)
    assert not [s for s in t.storages if s.category == "external"]


def test_tracker_views_and_explicit_registration():
    x = torch.ones(8)
    tracker = LiveTracker()
    tracker.register([x, x.view(2, 4)], "input")                      # one storage
    with tracker, tracker.phase(1, "forward"):
        y = x.mul(2)                                                  # +32
        v = y[1:]                                                     # a view: +0
        del y                                                         # the view keeps the storage
        z = x.add(1)                                                  # +32
        del v                                                         # -32, seen before the next op
        w = torch.empty(0)                                            # a zero-byte storage
        z.resize_(16)                                                 # +32: storage growth, in place
    del z, w
    t = tracker.trace()
    assert t.start.live == 32
    assert [(r.op, r.allocated, r.freed, r.live) for r in t.records] == [
        ("aten.mul.Tensor", 32, 0, 64), ("aten.slice.Tensor", 0, 0, 64), ("aten.add.Tensor", 32, 0, 96),
        ("aten.empty.memory_format", 0, 32, 64), ("aten.resize_.default", 32, 0, 96)]
    assert t.boundary(1, "forward").live == 96
    assert [s.nbytes for s in t.storages] == [32, 32, 64, 0]


def test_instrumentation_leaves_the_allocator_alone():
    """The profiler's allocator events are the same with and without the tracker's mode and hooks."""
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    kw = dict(loss="cross-entropy", optimizer="adam", impl="foreach")
    tracked = track_step(net(), torch.zeros(4, 16), allocator=True, **kw)
    bare = allocator_step(net(), torch.zeros(4, 16), **kw)
    assert tracked.allocator.peaks == bare.peaks
    assert tracked.allocator.live_at_start == bare.live_at_start == tracked.start.live
    for step in (1, 2):                                               # no op here allocates inside itself
        for phase in ("forward", "loss", "backward"):
            assert tracked.allocator.peak(step, phase) == tracked.peak_of(step, phase).bytes


def test_a_zoo_language_model_computes_its_own_loss():
    from symmem.reference import reference

    module, inputs = reference("gpt2", {"B": 2, "S": 8, "H": 16, "h": 2, "L": 1, "V": 50})
    t = track_step(module, inputs, loss="cross-entropy", optimizer="sgd", keep_output=True)
    ids = 2 * 8 * 8                                                   # int64 input ids and labels
    assert t.start.bytes("input") == 2 * ids
    wte, wpe = 50 * 16 * F, 1024 * 16 * F                              # lm_head is tied to wte: counted once
    assert t.start.bytes("parameter") == sum(p.numel() for p in module.parameters()) * F
    assert t.start.bytes("parameter") > wte + wpe
    assert t.start.bytes("buffer") == 0                               # transformers 5.23: no causal-mask buffer
    assert not [r for r in t.records if r.phase == "loss"]            # the loss is part of the forward
    assert t.live_at(2, "zero_grad") == t.start.live and t.leaked == ()


def test_bad_arguments():
    with pytest.raises(SymmemError, match="unknown optimizer"):
        track_step(linear(), torch.zeros(2, 4), optimizer="lion")
    with pytest.raises(SymmemError, match="implementation"):
        track_step(linear(), torch.zeros(2, 4), impl="jit")
    with pytest.raises(SymmemError, match="unknown loss"):
        track_step(linear(), torch.zeros(2, 4), loss="mse")
    with pytest.raises(SymmemError, match="steps"):
        track_step(linear(), torch.zeros(2, 4), steps=0)
    with pytest.raises(SymmemError, match="nn.Module"):
        track_step(lambda x: x, torch.zeros(2, 4))
    with pytest.raises(SymmemError, match="no boundary"):
        track_step(linear(), torch.zeros(2, 4), steps=1).boundary(2, "forward")
    with pytest.raises(SymmemError, match="unknown category"):
        LiveTracker().register([torch.zeros(1)], "weights")
