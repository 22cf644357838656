"""The anchors side by side (issue 19, item 4): DeepSpeed's estimators, Korthikanti's Table 2, the papers' ``--zero K``
accounting and symmem's per-rank peaks under the engines, one table per model, written into docs/regimes.md
between the markers ``<!-- anchors:begin -->`` and ``<!-- anchors:end -->``.

    python benchmarks/anchors.py            # rewrite the block, then review `git diff docs/regimes.md`

tests/test_anchors.py re-runs :func:`block` and compares it with the doc.  Every number is computed here, from
symmem's own graph and derivations: DeepSpeed's formulas are applied by code to the parameter count and the largest
layer the graph gives (``deepspeed/runtime/zero/stage_1_and_2.py``, ``estimate_zero2_model_states_mem_needs``;
``stage3.py``, ``estimate_zero3_model_states_mem_needs``, no offload), Korthikanti's by the ``gpt-megatron`` graph
under the ``megatron`` convention (which tests/test_megatron.py checks against the paper's Table 2).

>>> deepspeed_zero2(124439808, 8), deepspeed_zero3(124439808, 38597376, 8)
(528869652, 434378628)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy

DOC = Path(__file__).resolve().parents[1] / "docs" / "regimes.md"
BEGIN, END = "<!-- anchors:begin -->", "<!-- anchors:end -->"
ENGINES = ("ddp", "ddp-bucket-view", "zero-redundancy", "fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")


@dataclass(frozen=True)
class Case:
    """One table: a built-in model at some sizes, the data-parallel size N and the tensor-parallel size t."""

    title: str
    model: str
    values: dict[str, int] = field(default_factory=dict)
    N: int = 8
    t: int = 8
    #: where the engines' rows were measured on gloo at these sizes (a section of this doc), if they were
    measured: str = ""
    #: the model's options (the gloo runs' attention and dropout)
    options: dict[str, Any] = field(default_factory=dict)


CASES = (
    Case("GPT-2 124M (the zoo's `gpt2` at its defaults: B = 8, S = 1,024)", "gpt2", t=4),
    Case("Llama-2-7B's shape (the zoo's `llama` at its defaults: B = 1, S = 4,096)", "llama"),
    Case("GPT-2 tiny (the tests' reference: L = 2, H = 64, h = 4, S = 32, V = 100, B = 2)", "gpt2",
         {"B": 2, "S": 32, "L": 2, "H": 64, "h": 4, "V": 100}, N=4, t=2, measured="gloo",
         options={"attention": "sdpa", "dropout": 0.0}),
    Case("Llama tiny (the tests' reference: L = 2, H = 64, h = 4, G = 2, F = 128, S = 32, V = 100, B = 2)", "llama",
         {"B": 2, "S": 32, "L": 2, "H": 64, "h": 4, "G": 2, "F": 128, "V": 100}, N=4, t=2, measured="gloo",
         options={"attention": "sdpa"}),
)

#: where each engine's gloo measurement of the tiny references is in docs/regimes.md
MEASURED = {
    "ddp": "#data-parallel-the-engines-per-rank", "ddp-bucket-view": "#data-parallel-the-engines-per-rank",
    "zero-redundancy": "#zeroredundancyoptimizer-zero-1-modelled-and-measured",
    "fsdp": "#fsdp2-modelled-and-measured", "fsdp-no-reshard": "#fsdp2-modelled-and-measured",
    "fsdp1": "#fsdp1-modelled-and-measured", "fsdp1-grad-op": "#fsdp1-modelled-and-measured",
}


#: where FSDP2's MixedPrecisionPolicy was measured on the tiny references
MIXED = "#fsdp2s-mixedprecisionpolicy-param_dtype-bf16-reduce_dtype-fp32"


#: per engine: the papers' accounting its peak is compared with, and why they differ
WHY = {
    "ddp": ("one device", "DDP's gradient buckets, 4Ψ, alive the whole step; neither estimator nor paper counts them"),
    "ddp-bucket-view": ("one device", "the buckets are the gradients, alive the whole step (forward included): "
                        "where one device peaks before the optimizer step the gradients' 4Ψ are added there"),
    "zero-redundancy": ("--zero 1", "DDP's buckets stay (4Ψ) and the optimizer state follows whole parameters "
                        "(greedy by size: the rank owning the largest tensor holds most), not 8Ψ/N"),
    "fsdp": ("--zero 3", "the unsharded parameters of the root and the running block, the next block's all-gather "
             "(prefetch), the unsharded gradient and the reduce-scatter buffers: what DeepSpeed's ZeRO-3 estimator "
             "carries as 4 × largest layer"),
    "fsdp-no-reshard": ("--zero 2", "parameters sharded at rest (16Ψ/N, not 4Ψ + 12Ψ/N), but every unit's "
                        "unsharded parameters alive from its forward to its backward"),
    "fsdp1": ("--zero 3", "as `fsdp`, with one flat parameter per unit (padding, the root unsharded through forward "
              "and backward)"),
    "fsdp1-grad-op": ("--zero 2", "as `fsdp-no-reshard`, with flat parameters"),
}


def deepspeed_zero2(total_params: int, total_gpus: int) -> int:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs(..., cpu_offload=False)``, GPU bytes: 2 (16-bit
    parameters) + 18 (16-bit and 32-bit gradients, 32-bit parameters, Adam's two moments) per element / N."""
    return 2 * total_params + int(18 * total_params / total_gpus)


def deepspeed_zero3(total_params: int, largest_layer_params: int, total_gpus: int) -> int:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs(..., cpu_offload=False)``, GPU bytes:
    ``4 * largest_layer_params + int(18 * total_params / total_gpus)``."""
    return 4 * largest_layer_params + int(18 * total_params / total_gpus)


#: :func:`_sizes` by the case's repr (a case holds dicts: not hashable): a table asks them for its title and its
#: rows, the tests for their checks -- one derivation and one build a case
_SIZED: dict[str, tuple[int, int, str]] = {}


def _sizes(case: Case) -> tuple[int, int, str]:
    """Ψ (shared parameters once, as DeepSpeed's ``model_to_params``) and the largest layer: the most parameter
    elements one node of the graph owns (DeepSpeed: the most one module owns with ``recurse=False``), its name."""
    key = repr(case)
    if key not in _SIZED:
        _SIZED[key] = _sized(case)
    return _SIZED[key]


def _sized(case: Case) -> tuple[int, int, str]:
    from symmem import derive
    from symmem.models import build
    from symmem.shapes import numel

    d = derive(case.model, convention="pytorch", values=case.values, free=(), **case.options)
    graph = build(case.model, **case.options).graph
    own = {n: sum((numel(s) for s in graph.node(n).params.values()), sympy.Integer(0)) for n in graph.order()}
    own.update({n: numel(graph.node(n).params["value"]) for n in graph.order()
                if graph.node(n).kind == "parameter"})
    sized = {n: d.evaluate(e) for n, e in own.items() if e != 0}
    largest = max(sized, key=lambda n: sized[n])
    return d.evaluate(d.parameters), sized[largest], largest


def _n(x: int | None) -> str:
    return "–" if x is None else f"{x:,}"


def _gib(x: int | None, big: bool) -> str:
    return _n(x) if not big or x is None else f"{x / 2**30:.2f} GiB"


def rows(case: Case) -> list[tuple[str, str, int | None, int | None, int | None, str]]:
    """(anchor, precision, model states, activations, peak, where it differs and why) for one model."""
    from symmem import derive

    N, t = case.N, case.t
    psi, largest, where = _sizes(case)
    out: list[tuple[str, str, int | None, int | None, int | None, str]] = []

    def d_(**kw: Any) -> Any:
        extra = {"t": t} if kw.get("tensor_parallel") else {"N": N} if kw.get("zero") or kw.get("data_parallel") else {}
        # free=(): every size a number -- the same bytes as the formulas give there, several times faster
        return derive(case.model, convention="pytorch", device="cpu", optimizer="adamw", free=(),
                      values={**case.values, **extra}, **case.options, **kw)

    z2, z3 = d_(precision="mixed-full-copies", zero=2), d_(precision="mixed-full-copies", zero=3)
    out.append((f"DeepSpeed `estimate_zero2_model_states_mem_needs_all_live`, N = {N}", "mixed",
                deepspeed_zero2(psi, N), None, None,
                "2Ψ + 18Ψ/N: model states only (no activations, no buckets). Equals symmem's `--zero 2 --precision "
                f"mixed-full-copies` ({_n(z2.evaluate(z2.parameter_memory))}): the 18 are 16-bit and 32-bit "
                "gradients, 32-bit master weights, Adam's two moments"))
    out.append((f"DeepSpeed `estimate_zero3_model_states_mem_needs_all_live`, N = {N}", "mixed",
                deepspeed_zero3(psi, largest, N), None, None,
                f"4 × largest layer ({where}: {largest:,} elements) + 18Ψ/N. symmem's `--zero 3 --precision "
                f"mixed-full-copies` is {_n(z3.evaluate(z3.parameter_memory))} (20Ψ/N: it shards the 16-bit weights "
                "too, 2Ψ/N, which the estimator leaves out); the 4 × largest layer stands for the gathered "
                "parameters that the engines' rows below show as the unsharded units"))
    for k in (1, 2, 3):
        mixed = d_(precision="mixed", zero=k)
        out.append((f"the papers' `--zero {k}` (Rajbhandari et al.), N = {N}", "mixed",
                    mixed.evaluate(mixed.parameter_memory), None, None,
                    "2Ψ + 2Ψ + 12Ψ (K = 12), the sharded classes divided by N; no FP32 gradient copy (DeepSpeed "
                    "counts it: 4Ψ/N more)" if k == 2 else "the sharded classes divided by N"))
    tables = _korthikanti(case, t)
    out.append(("Korthikanti et al. Table 2, no parallelism: sbh(34 + 5as/h) × L", "16-bit", None, tables[0], None,
                "a GPT layer's activations (Megatron-LM: GELU MLP of 4h, dropout masks of 1 byte) in 16 bits; "
                "symmem's own (below) are FP32 and follow the model: " +
                ("HF GPT-2 keeps 4-byte masks and more copies" if case.model == "gpt2" else
                 "Llama has SwiGLU (F), RMSNorm, rotary, no dropout")))
    out.append((f"Korthikanti et al. Table 2, tensor parallel t = {t}: sbh(10 + 24/t + 5as/(ht)) × L", "16-bit",
                None, tables[1], None, "per rank; replicated LayerNorm inputs, dropout masks"))
    one = d_(loss="cross-entropy")
    peaks = {"one device": one.value("peak")}
    out.append(("one device (symmem, `derive`)", "fp32", one.evaluate(one.parameter_memory),
                one.evaluate(one.activations), peaks["one device"],
                f"FP32 AdamW, cross-entropy, the pytorch convention; peak at {one.peak_at().where()}"))
    for k in (1, 2, 3):
        z = d_(loss="cross-entropy", zero=k)
        peaks[f"--zero {k}"] = z.value("peak")
        out.append((f"`--zero {k}` through one device's step, N = {N}", "fp32", z.evaluate(z.parameter_memory),
                    z.evaluate(z.activations), peaks[f"--zero {k}"],
                    f"the papers' accounting carried through the step (nothing added): {z.peak_at().where()}"))
    for engine in ENGINES:
        e = d_(loss="cross-entropy", data_parallel=engine)
        peaks[engine] = e.value("peak")
        against, why = WHY[engine]
        pct = 100 * (e.value("peak") / peaks[against] - 1)
        measured = f"; derived = [measured on gloo]({MEASURED[engine]})" if case.measured else ""
        out.append((f"`--data-parallel {engine}`, N = {N}", "fp32", e.evaluate(e.parameter_memory),
                    e.evaluate(e.activations), e.value("peak"),
                    f"{pct:+.1f}% against `{against}`'s peak: {why}; peak at {e.peak_at().where()}{measured}"))
    # FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default: the engine's own
    # mixed precision, beside DeepSpeed's estimators (which count in mixed precision only)
    e = d_(loss="cross-entropy", data_parallel="fsdp", param_dtype="bfloat16")
    pct = 100 * (e.value("peak") / peaks["fsdp"] - 1)
    measured = f"; derived = [measured on gloo]({MIXED})" if case.measured else ""
    out.append((f"`--data-parallel fsdp --param-dtype bfloat16`, N = {N}", "bf16 compute",
                e.evaluate(e.parameter_memory), e.evaluate(e.activations), e.value("peak"),
                f"{pct:+.1f}% against `--data-parallel fsdp`'s peak: FSDP2's MixedPrecisionPolicy (reduce_dtype "
                "fp32): the all-gathers, unsharded parameters and gradients and the activations in bf16, the "
                "reduce-scatter input in fp32; shards, sharded gradients and AdamW stay FP32 (16Ψ/N: DeepSpeed's "
                f"18Ψ/N adds 16-bit copies the engine does not keep); peak at {e.peak_at().where()}{measured}"))
    if case.model == "llama":
        tp = d_(tensor_parallel=True)
        out.append((f"`--tensor-parallel` (DTensor's Llama plan), t = {t}, loss `sum`", "fp32",
                    tp.evaluate(tp.parameter_memory), tp.evaluate(tp.activations), tp.value("peak"),
                    "activations: Megatron-LM's split (Korthikanti's tensor-parallel row, in FP32 and Llama's "
                    "layer); the peak as DTensor runs the step, where the embedding's gradient comes back whole "
                    f"(V×H on every rank): {tp.peak_at().where()}"))
    return out


def _korthikanti(case: Case, t: int) -> tuple[int, int]:
    """Table 2's rows (no parallelism; tensor parallel t), per layer × L, at the model's B, S, H, h, L: the
    ``gpt-megatron`` layer under the ``megatron`` convention (tests/test_megatron.py: = the paper's formulas)."""
    from symmem import derive
    from symmem.models import build

    defaults = {s.name: int(v) for s, v in build(case.model).defaults.items() if getattr(v, "is_number", True)}
    sizes = {**defaults, **case.values}
    at = {k: sizes[k] for k in ("B", "S", "H", "h")}
    out = []
    for kw in ({}, {"tensor_parallel": True}):
        d = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True, free=(),
                   values={**at, **({"t": t} if kw else {})}, **kw)
        out.append(d.evaluate(d.activations) * sizes["L"])
    return out[0], out[1]


def table(case: Case) -> str:
    big = case.model in ("gpt2", "llama") and not case.values
    lines = [f"**{case.title}**, Ψ = {_sizes(case)[0]:,}", "",
             "| anchor | precision | model states | activations | peak | where it differs and why |",
             "|---|---|---:|---:|---:|---|"]
    for anchor, prec, states, acts, peak, why in rows(case):
        lines.append(f"| {anchor} | {prec} | {_gib(states, big)} | {_gib(acts, big)} | {_gib(peak, big)} | {why} |")
    return "\n".join(lines)


def block() -> str:
    """The generated block (markers excluded)."""
    return "\n\n".join(table(c) for c in CASES)


def refresh(text: str) -> str:
    """``text`` with the block between the markers replaced by :func:`block`."""
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"no {BEGIN} ... {END} block in {DOC}")
    return pattern.sub(lambda _: f"{BEGIN}\n{block()}\n{END}", text)


if __name__ == "__main__":
    DOC.write_text(refresh(DOC.read_text()))
