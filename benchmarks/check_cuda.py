"""The formulas against real CUDA: run by hand on a machine with an NVIDIA GPU (results in docs/cuda.md).

    PYTHONPATH=$PWD python benchmarks/check_cuda.py [--device cuda] [--json OUT.json] [--only SECTION ...]

Every row compares a number symmem derives with one PyTorch measures on the device, at sizes the formula was not
fitted to:

``reference``  the zoo's formula (``pytorch`` convention, ``device="cuda"``) against the project's reference module:
               bytes autograd saves in one training-mode forward (:func:`symmem.record.verify.verify`).
``third``      the zoo's formula against the third-party module it describes (torchvision's ResNet, timm's ViT, Hugging
               Face's GPT-2, BERT and Llama built from small configs), measured the same way.
``traced``     :func:`symmem.trace` on fake CUDA tensors (``device="cuda"``): its formula against a real CUDA forward at
               two sizes never traced, and symbolically against the zoo's CUDA formula (``drift``: the monomials where
               the two differ).
``peak``       the derived peak of a training step (first and steady) against two real steps under the live-bytes
               tracker (:func:`symmem.record.verify.verify_peak`; traced modules:
               :func:`symmem.record.steps.track_step`), and
               ``torch.cuda.max_memory_allocated`` of the same steps against :meth:`Derivation.peak_allocated` (storages
               rounded to the caching allocator's 512-byte blocks) plus the library workspaces' band
               (:data:`symmem.derivation.CUDA_WORKSPACES`).

With ``--device cpu`` the same script runs on the CPU (the ``third`` rows need torchvision and timm, which do not
load with this project's CPU build of torch; they are skipped where they cannot be imported).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sympy

import symmem
from symmem import derive
from symmem.derivation import CUDA_WORKSPACES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# the small Hugging Face models and the formula comparison tests/test_zoo_drift.py uses too
from trace_helpers import BERT, GPT2, LLAMA, VOCAB, at_least_two, bert, cnn, drift, gpt2, llama  # noqa: E402

ROWS: list[dict[str, Any]] = []
DEVICE = "cuda"


def row(section: str, case: str, predicted: int, measured: int, note: str = "", ok: bool | None = None,
        spec: dict[str, Any] | None = None) -> None:
    """One comparison; ``spec`` says how to derive the prediction again without a GPU (tests/test_cuda_measured.py
    reads the ``--json`` file): the zoo model, its values and options, the optimizer and the quantity."""
    exact = predicted == measured if ok is None else ok
    ROWS.append({"section": section, "case": case, "predicted": predicted, "measured": measured, "ok": exact,
                 "note": note, **({"spec": spec} if spec else {})})
    print(f"  {section:<9} {case:<44} {predicted:>14,} {measured:>14,}  {'ok' if exact else 'DIFFERS'}  {note}",
          flush=True)


def guarded(section: str, case: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # a failing case is a row, not the end of the run
        ROWS.append({"section": section, "case": case, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        print(f"  {section:<9} {case:<44} ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        traceback.print_exc(limit=3)


# -- the zoo against the project's reference modules -----------------------------------------------------------------
IMAGE = {"C": 3, "K": 1000}
REFERENCE = [
    ("mlp", {"B": 16}, {"dropout": 0.1}),
    ("resnet18", {"B": 4, "Hi": 64, "Wi": 96, **IMAGE}, {}),
    ("resnet50", {"B": 2, "Hi": 64, "Wi": 64, **IMAGE}, {}),
    ("vit-ti16", {"B": 4, "Hi": 64, "Wi": 64, "L": 2, **IMAGE}, {"attention": "naive", "dropout": 0.1}),
    ("vit-ti16", {"B": 4, "Hi": 64, "Wi": 64, "L": 2, **IMAGE}, {"attention": "sdpa", "dropout": 0.1}),
    ("gpt2", {"B": 2, "S": 64, "H": 64, "h": 4, "L": 2, "V": 100}, {"attention": "naive", "dropout": 0.1}),
    ("gpt2", {"B": 2, "S": 64, "H": 64, "h": 4, "L": 2, "V": 100}, {"attention": "sdpa", "dropout": 0.1}),
    ("bert-base", {"B": 2, "S": 40, "H": 64, "h": 4, "L": 2, "V": 100}, {"attention": "sdpa", "dropout": 0.1}),
    ("llama", {"B": 2, "S": 40, "H": 64, "h": 4, "G": 2, "L": 2, "V": 100, "F": 128}, {"attention": "sdpa"}),
    ("llama", {"B": 2, "S": 40, "H": 64, "h": 4, "G": 4, "L": 2, "V": 100, "F": 128}, {"attention": "sdpa"}),
]


def _label(model: str, options: dict[str, Any], values: dict[str, Any] | None = None) -> str:
    heads = f" G={values['G']}" if values and "G" in values else ""
    return model + heads + "".join(f" {k}={v}" for k, v in options.items())


def reference_rows() -> None:
    from symmem.record.verify import verify

    for model, values, options in REFERENCE:
        def one(model: str = model, values: dict = values, options: dict = options) -> None:
            d = derive(model, convention="pytorch", options={"device": DEVICE}, values=values, **options)
            c = verify(d)
            note = "" if c.exact else "; ".join(f"{r.dtype} {r.nbytes}B {r.predicted} vs {r.measured}"
                                                for r in c.differences()[:4])
            row("reference", _label(model, options, values), c.predicted + c.predicted_input,
                c.measured + c.measured_input, note,
                spec={"model": model, "values": values, "options": options, "quantity": "kept"})
        guarded("reference", _label(model, options, values), one)


# -- the zoo against third-party modules ---------------------------------------------------------------------------
# id, module builder, zoo model, zoo values, zoo options
LANGUAGE = [
    ("hf gpt2 eager p=0.1", lambda: gpt2("eager", 0.1), "gpt2", GPT2, {"attention": "naive", "dropout": 0.1}),
    ("hf gpt2 sdpa p=0.1", lambda: gpt2("sdpa", 0.1), "gpt2", GPT2, {"attention": "sdpa", "dropout": 0.1}),
    ("hf gpt2 sdpa p=0", lambda: gpt2("sdpa", 0.0), "gpt2", GPT2, {"attention": "sdpa", "dropout": 0.0}),
    ("hf bert sdpa p=0.1", lambda: bert("sdpa", 0.1), "bert-base", BERT, {"attention": "sdpa", "dropout": 0.1}),
    ("hf bert eager p=0.1", lambda: bert("eager", 0.1), "bert-base", BERT, {"attention": "naive", "dropout": 0.1}),
    ("hf llama gqa sdpa", lambda: llama("sdpa", 0.0), "llama", LLAMA, {"attention": "sdpa", "dropout": 0.0}),
    ("hf llama gqa eager", lambda: llama("eager", 0.0), "llama", LLAMA, {"attention": "naive", "dropout": 0.0}),
]
TEXT_SIZES = [(3, 11), (4, 24)]


def _ids(b: int, s: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(b * 100 + s)).to(DEVICE)


def _vision() -> list[tuple[str, Callable[[], Any], str, dict[str, Any], dict[str, Any], list[tuple[int, ...]]]]:
    """torchvision's ResNets and timm's ViT, where they import."""
    out = []
    try:
        import torchvision

        out += [(f"torchvision {n}", lambda n=n: torchvision.models.__dict__[n](), n, IMAGE, {},
                 [(2, 64, 96), (3, 96, 64)]) for n in ("resnet18", "resnet50")]
    except Exception as exc:  # torchvision's compiled ops do not load with every torch build
        print(f"  torchvision not importable here ({type(exc).__name__}): its rows are skipped")
    try:
        import timm

        out.append(("timm vit_tiny_patch16_224", lambda: timm.create_model("vit_tiny_patch16_224"), "vit-ti16",
                    {**IMAGE, "Hi": 224, "Wi": 224}, {"attention": "sdpa", "dropout": 0.0},
                    [(2, 224, 224), (5, 224, 224)]))
    except Exception as exc:
        print(f"  timm not importable here ({type(exc).__name__}): its rows are skipped")
    return out


def third_rows() -> None:
    import torch

    from symmem.record.verify import compare, measure

    for case, build, model, values, options in LANGUAGE:
        for b, s in TEXT_SIZES:
            def one(label: str = f"{case} B={b} S={s}", build: Callable = build, model: str = model,
                    values: dict = values, options: dict = options, b: int = b, s: int = s) -> None:
                d = derive(model, convention="pytorch", options={"device": DEVICE}, values={**values, "B": b, "S": s},
                           **options)
                c = compare(d, measure(build().to(DEVICE), input_ids=_ids(b, s)))
                row("third", label, c.predicted + c.predicted_input, c.measured + c.measured_input,
                    "; ".join(f"{r.dtype} {r.nbytes}B {r.predicted} vs {r.measured}" for r in c.differences()[:4]),
                    spec={"model": model, "values": {**values, "B": b, "S": s}, "options": options,
                          "quantity": "kept"})
            guarded("third", f"{case} B={b} S={s}", one)
    for case, build, model, values, options, sizes in _vision():
        for b, hi, wi in sizes:
            def one(label: str = f"{case} {b}x3x{hi}x{wi}", build: Callable = build, model: str = model,
                    values: dict = values, options: dict = options, b: int = b, hi: int = hi, wi: int = wi) -> None:
                d = derive(model, convention="pytorch", options={"device": DEVICE},
                           values={**values, "B": b, "Hi": hi, "Wi": wi}, **options)
                torch.manual_seed(0)
                x = torch.randn(b, 3, hi, wi, device=DEVICE)
                c = compare(d, measure(build().to(DEVICE), x))
                row("third", label, c.predicted + c.predicted_input, c.measured + c.measured_input,
                    "; ".join(f"{r.dtype} {r.nbytes}B {r.predicted} vs {r.measured}" for r in c.differences()[:4]),
                    spec={"model": model, "values": {**values, "B": b, "Hi": hi, "Wi": wi}, "options": options,
                          "quantity": "kept"})
            guarded("third", f"{case} {b}x3x{hi}x{wi}", one)


# -- the importer on fake CUDA tensors -----------------------------------------------------------------------------
TEXT = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}


def traced_rows() -> None:
    import torch

    from symmem.record.verify import measure

    B, S, L = (symmem.symbol(n) for n in ("B", "S", "L"))
    for case, build, model, values, options in LANGUAGE:
        def one(case: str = case, build: Callable = build, model: str = model, values: dict = values,
                options: dict = options) -> None:
            t0 = time.perf_counter()
            module = build().to(DEVICE)
            d = symmem.trace(module, {"input_ids": _ids(2, 8)}, TEXT, device=DEVICE)
            took = time.perf_counter() - t0
            for b, s in TEXT_SIZES:
                m = measure(module, input_ids=_ids(b, s))
                at = d.at(B=b, S=s)
                row("traced", f"{case} B={b} S={s}", at.value("activations") + at.value("input"),
                    m.activations + m.input, f"traced in {took:.1f} s" if (b, s) == TEXT_SIZES[0] else "")
            zoo = derive(model, convention="pytorch", options={"device": DEVICE}, values=values, free=("B", "S", "L"),
                         **options)
            found = drift(d.activations, at_least_two(zoo.activations), (B, S, L))
            row("traced", f"{case}: formula = zoo's (drift)", len(found), 0, str(found)[:200] if found else
                f"{sympy.expand(d.activations)}", ok=not found)
        guarded("traced", case, one)
    for case, build, _model, _values, _options, sizes in _vision():
        def one(case: str = case, build: Callable = build, sizes: list = sizes) -> None:
            module = build().to(DEVICE)
            torch.manual_seed(0)
            if "vit" in case:  # fixed image size: B alone is symbolic
                d = symmem.trace(module, (torch.randn(2, 3, 224, 224, device=DEVICE),), {"B": [(0, 0)]},
                                 device=DEVICE)
                checks = [(b, 224, 224) for b in (3, 5)]
            else:
                d = symmem.trace(module, (torch.randn(2, 3, 64, 64, device=DEVICE),),
                                 {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]}, multiple_of={"Hi": 32, "Wi": 32},
                                 device=DEVICE)
                checks = sizes
            for b, hi, wi in checks:
                m = measure(module, torch.randn(b, 3, hi, wi, device=DEVICE))
                at = d.at(**{k: v for k, v in {"B": b, "Hi": hi, "Wi": wi}.items() if k in {s.name for s in d.free}})
                row("traced", f"{case} {b}x3x{hi}x{wi}", at.value("activations") + at.value("input"),
                    m.activations + m.input, str(sympy.expand(d.activations))[:80])
        guarded("traced", case, one)


# -- the peak: live bytes and the caching allocator ----------------------------------------------------------------
PEAK = [
    ("resnet18", {"B": 8, "Hi": 64, "Wi": 64, **IMAGE}, {}),
    ("resnet50", {"B": 4, "Hi": 96, "Wi": 96, **IMAGE}, {}),
    ("vit-ti16", {"B": 8, "Hi": 64, "Wi": 64, "L": 2, **IMAGE}, {"attention": "sdpa", "dropout": 0.1}),
    ("vit-ti16", {"B": 8, "Hi": 64, "Wi": 64, "L": 2, **IMAGE}, {"attention": "naive"}),
    ("gpt2", {"B": 4, "S": 128, "H": 64, "h": 4, "L": 2, "V": 100}, {"attention": "sdpa", "dropout": 0.1}),
    ("gpt2", {"B": 4, "S": 128, "H": 64, "h": 4, "L": 2, "V": 100}, {"attention": "naive", "dropout": 0.1}),
    ("llama", {"B": 4, "S": 64, "H": 64, "h": 4, "G": 2, "L": 2, "V": 100, "F": 128}, {"attention": "sdpa"}),
    ("llama", {"B": 4, "S": 64, "H": 64, "h": 4, "G": 4, "L": 2, "V": 100, "F": 128}, {"attention": "sdpa"}),
    ("mlp", {"B": 64}, {"dropout": 0.1}),
    # added 2026-11-26: eager Llama with HF's DynamicCache at G = 1, 2 (the copies the strides decide), without it,
    # GPT-2's fused SDPA with and without the cache, full checkpointing
    ("llama", {"B": 4, "S": 64, "H": 64, "h": 4, "G": 1, "L": 2, "V": 100, "F": 128}, {"attention": "naive"}),
    ("llama", {"B": 4, "S": 64, "H": 64, "h": 4, "G": 2, "L": 2, "V": 100, "F": 128}, {"attention": "naive"}),
    ("llama", {"B": 4, "S": 64, "H": 64, "h": 4, "G": 2, "L": 2, "V": 100, "F": 128},
     {"attention": "naive", "cache": "none"}),
    ("llama", {"B": 4, "S": 64, "H": 64, "h": 4, "G": 2, "L": 2, "V": 100, "F": 128},
     {"attention": "sdpa", "checkpoint": "full"}),
    ("gpt2", {"B": 4, "S": 128, "H": 64, "h": 4, "L": 2, "V": 100}, {"attention": "sdpa", "dropout": 0.0}),
    ("gpt2", {"B": 4, "S": 128, "H": 64, "h": 4, "L": 2, "V": 100},
     {"attention": "sdpa", "dropout": 0.0, "cache": "none"}),
    ("gpt2", {"B": 4, "S": 128, "H": 64, "h": 4, "L": 2, "V": 100},
     {"attention": "naive", "dropout": 0.1, "checkpoint": "full"}),
]
#: at the FP32 analysis's sizes: one forward + backward with SGD, B = 64, 224 x 224 (the seed's verification recipe)
BIG = [("resnet50", {"B": 64}, {}), ("vit-b16", {"B": 64}, {"attention": "sdpa"}),
       ("vit-b16", {"B": 64}, {"attention": "naive"})]


def baseline() -> int:
    """CUDA bytes allocated before a model is built: whatever earlier rows left, and the cuBLAS workspaces (made
    once per thread at the first matmul, kept for the process: :func:`warm_cublas` makes them first)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def warm_cublas() -> None:
    """One linear layer's forward and backward: the forward thread's and autograd's thread's cuBLAS workspaces
    (32 MiB each) and the cuBLASLt workspace of a matmul with a bias (1 MiB), kept for the process."""
    import torch

    w = torch.randn(64, 64, device=DEVICE, requires_grad=True)
    bias = torch.randn(64, device=DEVICE, requires_grad=True)
    torch.nn.functional.linear(torch.randn(64, 64, device=DEVICE), w, bias).sum().backward()
    torch.cuda.synchronize()


def _steps(module: Any, inputs: tuple[Any, ...], target: Any, optimizer: str, impl: str,
           loss: Callable[[Any], Any] | None, steps: int, base: int | None,
           requested: list[int] | None = None) -> list[int]:
    """``max_memory_allocated`` of each step less ``base``; ``requested``: a list that gets each step's peak of the
    bytes the tensors asked for (``requested_bytes.all.peak``, before the allocator rounds them into blocks)."""
    import torch

    from symmem.record.optim import make_optimizer

    module.train()
    opt = make_optimizer([p for p in module.parameters() if p.requires_grad], optimizer, impl)
    out = []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        y = module(*inputs)
        if loss is not None:
            value = loss(y)
        elif target is None:
            value = y.sum()
        else:
            value = torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]), target.reshape(-1))
        del y
        value.backward()
        del value
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out.append(int(torch.cuda.max_memory_allocated()) - (base or 0))
        if requested is not None:
            requested.append(int(torch.cuda.memory_stats()["requested_bytes.all.peak"]))
    return out


def allocated(build: Callable[[], tuple[Any, tuple[Any, ...], Any]], optimizer: str, impl: str,
              loss: Callable[[Any], Any] | None = None, steps: int = 2, requested: list[int] | None = None
              ) -> list[int]:
    """``torch.cuda.max_memory_allocated`` in each of ``steps`` plain training steps (the tracker's step: forward,
    loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) of a fresh ``build()`` (module,
    inputs, target), less what was allocated before it was built (:func:`baseline`).  One throwaway step of
    another copy runs first, so that what libraries allocate once and keep (cuBLASLt's workspace at its first
    use) is in the baseline."""
    import torch

    _steps(*build(), optimizer, impl, loss, 1, None)
    base = baseline()
    asked = int(torch.cuda.memory_stats()["requested_bytes.all.current"])  # requested's baseline
    out = _steps(*build(), optimizer, impl, loss, steps, base, requested)
    if requested is not None:
        requested[:] = [r - asked for r in requested]
    return out


def _fresh(d: Any) -> tuple[Any, tuple[Any, ...], Any]:
    """The project's reference module of ``d`` on the device, its inputs and its loss target (if any)."""
    from symmem.record.verify import _reference

    module, inputs, _, target = _reference(d)
    return module, inputs, target


def _has_conv(model: str) -> bool:
    # cuDNN convolutions take a workspace inside the op (the band's scratch); the rest is exact
    return model.startswith(("resnet", "vit", "vgg"))


def _allocated_row(label: str, conv: bool, want: int, got: int, spec: dict[str, Any] | None = None) -> None:
    """Exact for models without convolutions; with them (``conv``), cuDNN's workspace inside a convolution (the
    band's scratch) comes on top."""
    scratch = CUDA_WORKSPACES["scratch"]
    over = got - want
    if conv:
        row("allocated", label, want, got, f"{over / 2**20:+.2f} MiB over the blocks: cuDNN scratch "
            f"({scratch[0] / 2**20:.0f}-{scratch[1] / 2**20:.0f} MiB)", ok=scratch[0] <= over <= scratch[1],
            spec=spec and {**spec, "scratch": True})
    else:
        row("allocated", label, want, got, f"{over:+,} bytes" if over else "", spec=spec)


def peak_rows(big: bool) -> None:
    from symmem.record.verify import verify_peak

    if DEVICE.startswith("cuda"):
        warm_cublas()
    for model, values, options in PEAK:
        def one(model: str = model, values: dict = values, options: dict = options) -> None:
            d = derive(model, convention="pytorch", options={"device": DEVICE}, values=values, **options)
            p = verify_peak(d)
            spec = {"model": model, "values": values, "options": options, "optimizer": d.regime.optimizer}
            row("peak", f"{_label(model, options, values)} first", p.predicted_first, p.measured_first,
                spec={**spec, "quantity": "peak_first_step"})
            row("peak", f"{_label(model, options, values)} steady", p.predicted, p.measured,
                "" if p.exact else f"predicted at {p.predicted_where}; measured at {p.measured_where}",
                spec={**spec, "quantity": "peak"})
            if DEVICE.startswith("cuda"):
                real = allocated(lambda: _fresh(d), d.regime.optimizer, "foreach")
                for step, got in zip(("first", "steady"), real, strict=True):
                    _allocated_row(f"{_label(model, options, values)} {step}", _has_conv(model),
                                   d.peak_allocated(step), got,
                                   spec={**spec, "quantity": f"allocated_{step}"})
        guarded("peak", _label(model, options, values), one)
    if not (big and DEVICE.startswith("cuda")):
        return
    for model, values, options in BIG:
        def one(model: str = model, values: dict = values, options: dict = options) -> None:
            d = derive(model, convention="pytorch", options={"device": DEVICE}, values=values, optimizer="sgd",
                       **options)
            real = allocated(lambda: _fresh(d), "sgd", "foreach")
            for step, got in zip(("first", "steady"), real, strict=True):
                want = d.peak_allocated(step)
                label = f"{_label(model, options, values)} SGD {step} ({want / 2**30:.3f} GiB)"
                spec = {"model": model, "values": values, "options": options, "optimizer": "sgd",
                        "quantity": f"allocated_{step}"}
                _allocated_row(label, _has_conv(model), want, got, spec=spec)
        guarded("allocated", f"{_label(model, options, values)} SGD", one)


def traced_peak_rows() -> None:
    """The traced step's peak (fake CUDA) against two real CUDA steps: live bytes under the tracker, and
    ``torch.cuda.max_memory_allocated``.  A trace that fell back to a fit (some torch releases specialize a
    module's sizes) has no step to compare: its row says so."""
    import torch

    from symmem.record.steps import track_step

    class LM(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
            return self.model(input_ids=ids, labels=labels)

    def gpt2_case(attn: str) -> tuple[Any, ...]:
        ids = _ids(2, 8)
        dims = {"B": [("input_ids", 0), ("labels", 0)], "S": [("input_ids", 1), ("labels", 1)]}
        sizes = [({"B": b, "S": s}, (lambda b=b, s=s: (lambda x: (x, x.clone()))(_ids(b, s)))) for b, s in TEXT_SIZES]
        return (lambda: gpt2(attn, 0.1).to(DEVICE), {"input_ids": ids, "labels": ids.clone()}, dims, "output",
                lambda m: LM(m), lambda out: out.loss, sizes)

    def cnn_case(loss: str) -> tuple[Any, ...]:
        def image(b: int, hi: int, wi: int) -> Any:
            return (torch.randn(b, 3, hi, wi, generator=torch.Generator().manual_seed(b)).to(DEVICE),)

        sizes = [({"B": b, "Hi": hi, "Wi": wi, "L": 4}, (lambda b=b, hi=hi, wi=wi: image(b, hi, wi)))
                 for b, hi, wi in ((3, 8, 12), (5, 12, 16))]
        return (lambda: (torch.manual_seed(0), cnn())[1].to(DEVICE), image(2, 16, 16)[0:1],
                {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]}, loss, lambda m: m, loss, sizes)

    if DEVICE.startswith("cuda"):
        warm_cublas()
    for name, case in (("user cnn, sum", lambda: cnn_case("sum")),
                       ("user cnn, cross-entropy", lambda: cnn_case("cross-entropy")),
                       ("hf gpt2 eager p=0.1", lambda: gpt2_case("eager")),
                       ("hf gpt2 sdpa p=0.1", lambda: gpt2_case("sdpa"))):
        def one(name: str = name, case: Callable = case) -> None:
            build, example, dims, loss, wrap, real_loss, sizes = case()
            d = symmem.trace(build(), example, dims, loss=loss, optimizer="adamw", optimizer_impl="foreach",
                             device=DEVICE)
            if d.step is None:
                row("peak", f"traced {name}", 0, 0, f"no traced step: {d.options.get('method')} "
                    f"({'; '.join(d.notes)[:160]})", ok=False)
                return
            for values, inputs in sizes:
                label = f"traced {name} {values}"
                x = inputs()
                t = track_step(wrap(build()), x, loss=real_loss, optimizer="adamw", impl="foreach",
                               keep_output=False)
                at = d.at(**{k: v for k, v in values.items() if k in {s.name for s in d.free}})
                row("peak", f"{label} first", at.value("peak_first_step"), t.first.bytes)
                row("peak", f"{label} steady", at.value("peak"), t.steady.bytes)
                if DEVICE.startswith("cuda"):
                    def fresh(wrap: Callable = wrap, build: Callable = build, x: Any = x,
                              real_loss: Any = real_loss) -> tuple[Any, Any, Any]:
                        # a copy of the batch: made after the baseline, as the formula counts it
                        model, target, batch = wrap(build()), None, tuple(t.clone() for t in x)
                        if real_loss == "cross-entropy":
                            with torch.no_grad():
                                out = model(*batch)
                            target = torch.randint(0, out.shape[-1], tuple(out.shape[:-1]),
                                                   generator=torch.Generator().manual_seed(0)).to(DEVICE)
                        return model, batch, target

                    real = allocated(fresh, "adamw", "foreach", loss=real_loss if callable(real_loss) else None)
                    for step, got in zip(("first", "steady"), real, strict=True):  # the CNN: cuDNN's scratch
                        _allocated_row(f"{label} {step}", "cnn" in name, at.peak_allocated(step), got)
        guarded("peak", f"traced {name}", one)


#: 16-bit models (cast with ``.to(torch.bfloat16)``, as the zoo's ``precision`` with bfloat16 activations means):
#: flash attention, float32 layer-norm statistics on CUDA, bool dropout masks
BF16 = [(m, v, {"attention": att, "dropout": p}) for m, v in (
    ("gpt2", {"B": 2, "S": 64, "H": 64, "h": 4, "L": 2, "V": 100}),
    ("bert-base", {"B": 2, "S": 40, "H": 64, "h": 4, "L": 2, "V": 100}),
    ("llama", {"B": 2, "S": 40, "H": 64, "h": 4, "G": 2, "L": 2, "V": 100, "F": 128}),
    ("llama", {"B": 2, "S": 40, "H": 64, "h": 4, "G": 4, "L": 2, "V": 100, "F": 128}),
    ("vit-ti16", {"B": 4, "Hi": 64, "Wi": 64, "L": 2, **IMAGE})) for att in ("naive", "sdpa") for p in (0.0, 0.1)]


def bf16_rows() -> None:
    """Bytes a bfloat16 model keeps in one forward (activations), against the zoo with bfloat16 activations."""
    import torch

    from symmem.record.verify import measure
    from symmem.reference import reference

    for model, values, options in BF16:
        def one(model: str = model, values: dict = values, options: dict = options) -> None:
            d = derive(model, convention="pytorch", options={"device": DEVICE}, values=values,
                       precision="mixed-megatron", **options)
            torch.manual_seed(0)
            module, inputs = reference(model, {s.name: v for s, v in d.numbers.items()}, options)
            module = module.to(DEVICE).to(torch.bfloat16)
            inputs = tuple((x.to(torch.bfloat16) if x.is_floating_point() else x).to(DEVICE) for x in inputs)
            m = measure(module, *inputs)
            row("bf16", _label(model, options, values), d.value("activations"), m.activations,
                spec={"model": model, "values": values, "options": options, "precision": "mixed-megatron",
                      "quantity": "activations"})
        guarded("bf16", _label(model, options, values), one)


def devices_rows() -> None:
    """Where the attention kernels keep what they save (host or GPU), and why a causal SDPA specializes."""
    import torch
    import torch.nn.functional as F

    from symmem.record.verify import measure

    class Att(torch.nn.Module):
        def __init__(self, kv_heads: int, p: float) -> None:
            super().__init__()
            self.kv, self.p = kv_heads, p
            self.q = torch.nn.Linear(32, 32)
            self.k, self.v = (torch.nn.Linear(32, 8 * kv_heads) for _ in range(2))

        def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 4, -1).transpose(1, 2)
            k, v = (f(x).view(b, s, self.kv, -1).transpose(1, 2) for f in (self.k, self.v))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=causal,
                                                 enable_gqa=self.kv != 4)
            return out.transpose(1, 2).reshape(b, s, 32)

    for kv, p, dtype in ((4, 0.0, torch.float32), (4, 0.1, torch.float32), (2, 0.1, torch.float32),
                         (4, 0.1, torch.bfloat16), (2, 0.0, torch.bfloat16)):
        m = Att(kv, p).to(DEVICE).to(dtype)
        x = torch.randn(2, 40, 32, device=DEVICE, dtype=dtype, requires_grad=True)
        saved = measure(m, x).storages("activation")
        host = [s for s in saved if not s.device.startswith("cuda")]
        print(f"  devices   sdpa kv_heads={kv} p={p} {dtype}: "
              + ", ".join(f"{s.dtype}{list(s.shape)}@{s.device}" for s in saved), flush=True)
        ROWS.append({"section": "devices", "case": f"sdpa kv={kv} p={p} {dtype}", "ok": True,
                     "host": [(s.dtype, list(s.shape)) for s in host]})
    # a causal SDPA traced on fake CUDA: what pinned B and S
    import logging

    logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(logging.INFO)
    try:
        symmem.trace(gpt2("sdpa", 0.0).to(DEVICE), {"input_ids": _ids(2, 8)}, TEXT, device=DEVICE, method="symbolic",
                     check=False)
        print("  devices   hf gpt2 sdpa traced on fake CUDA: symbolic", flush=True)
    except Exception as exc:
        print(f"  devices   hf gpt2 sdpa traced on fake CUDA: {exc}", flush=True)
    finally:
        logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(logging.WARNING)


SECTIONS = {"reference": reference_rows, "third": third_rows, "traced": traced_rows,
            "peak": lambda: peak_rows(big=True), "traced-peak": traced_peak_rows, "bf16": bf16_rows,
            "devices": devices_rows}


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    args = ap.parse_args(argv)
    DEVICE = args.device
    import torch

    where = torch.cuda.get_device_name() if DEVICE.startswith("cuda") else "cpu"
    print(f"torch {torch.__version__}, {where}; sympy {sympy.__version__}", flush=True)
    versions = {"torch": torch.__version__, "sympy": sympy.__version__}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
        print(f"transformers {transformers.__version__}", flush=True)
    except ImportError:
        pass
    t0 = time.perf_counter()
    for name in args.only:
        print(f"# {name}", flush=True)
        SECTIONS[name]()
    bad = [r for r in ROWS if not r["ok"]]
    print(f"{len(ROWS) - len(bad)} of {len(ROWS)} rows agree ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "device": where, "date": time.strftime("%Y-%m-%d"), "rows": ROWS}, f,
                      indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
