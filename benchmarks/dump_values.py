"""Dump every value, expression and peak symmem gives, to diff before and after a change that must not change them.

Every built-in model under every convention (default regime), every model under the ``pytorch`` convention with
every optimizer and precision, the regimes (checkpointing, ZeRO, tensor / sequence / pipeline parallelism,
micro-batches, optimizer implementations, CPU and CUDA) on the transformer models, and the traced modules of the
tests (a user MLP and CNN, small GPT-2, BERT and Llama from ``transformers`` configs) when torch imports.

    python benchmarks/dump_values.py before.txt
    ... change ...
    python benchmarks/dump_values.py after.txt && diff before.txt after.txt

Each case is one block of lines: the JSON view, the text table, the peak formulas, and the step's timeline at the
defaults (steady and first step, CUDA's allocated counts where the device is CUDA).  A refusal is a value too: its
message is dumped in its place.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterator
from multiprocessing import Pool
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _safe(fn: Callable[[], Any]) -> str:
    try:
        out = fn()
    except Exception as e:  # a refusal is a value: dump its message
        return f"!{type(e).__name__}: {e}"
    return out if isinstance(out, str) else json.dumps(out, sort_keys=True, default=str)


def describe(d: Any) -> list[str]:
    """Every value of one derivation, one line each."""
    lines = [
        "dict " + _safe(d.to_dict),
        "table " + _safe(d.table),
        "storages " + _safe(lambda: [(s.name, s.group, s.category, str(s.expr), s.role, s.node, s.dtype,
                                      str(s.elements), str(s.count), s.keepers, str(s.born), str(s.dies),
                                      str(s.shards)) for s in d.storages]),
        "free " + _safe(lambda: [str(s) for s in d.free]),
        "domain " + _safe(lambda: str(d.domain)),
    ]
    for q in ("total", "activations", "parameter_memory", "input", "loss", "transient", "peak",
              "peak_first_step"):
        lines.append(f"{q} " + _safe(lambda q=q: str(d.expression(q))))
        lines.append(f"value {q} " + _safe(lambda q=q: d.value(q)))
    for step in ("steady", "first"):
        lines.append(f"formula {step} " + _safe(lambda step=step: str(d.peak_formula(step))))
        lines.append(f"candidates {step} " + _safe(lambda step=step: d.peak_candidates(step)))
        lines.append(f"at {step} " + _safe(lambda step=step: d.peak_at(step).where()))
        lines.append(f"live {step} " + _safe(lambda step=step: d.live_at_peak(step)))
        lines.append(f"timeline {step} " + _safe(lambda step=step: d.timeline(step)))
        lines.append(f"allocated {step} " + _safe(lambda step=step: d.peak_allocated(step)))
    return lines


def zoo_cases() -> Iterator[tuple[str, dict[str, Any]]]:
    import symmem
    from symmem.conventions import names
    from symmem.training import OPTIMIZERS, PRECISIONS

    models = list(symmem.available_models())
    conventions = [c for c in names() if c != "traced"]
    for m in models:
        for c in conventions:
            yield f"{m} {c}", {"model": m, "convention": c}
            yield f"{m} {c} per-layer", {"model": m, "convention": c, "per_layer": True}
        for o in OPTIMIZERS:
            yield f"{m} pytorch {o}", {"model": m, "optimizer": o}
        for p in PRECISIONS:
            yield f"{m} pytorch {p}", {"model": m, "precision": p}
        yield f"{m} pytorch cpu", {"model": m, "device": "cpu"}
        yield f"{m} pytorch cross-entropy", {"model": m, "loss": "cross-entropy"}
    regimes: list[dict[str, Any]] = [
        {"checkpoint": "full"}, {"checkpoint": "selective"}, {"checkpoint": "every-2"},
        {"zero": 1}, {"zero": 2}, {"zero": 3}, {"tensor_parallel": True},
        {"tensor_parallel": True, "sequence_parallel": True}, {"pipeline_parallel": True},
        {"micro_batches": 4}, {"optimizer_impl": "foreach"}, {"optimizer_impl": "fused"},
        {"optimizer_impl": "for-loop"}, {"keep_logits": True}, {"precision": "mixed", "checkpoint": "full"},
        {"device": "cpu", "micro_batches": 2}, {"attention": "sdpa"}, {"attention": "naive"},
    ]
    for m in ("gpt2", "llama", "bert-base", "vit-b16", "gpt-megatron", "resnet50", "mlp"):
        for c in ("pytorch", "megatron", "paper"):
            for r in regimes:
                key = " ".join(f"{k}={v}" for k, v in r.items())
                yield f"{m} {c} {key}", {"model": m, "convention": c, **r}


def run_zoo(case: tuple[str, dict[str, Any]]) -> str:
    import symmem

    name, kw = case
    kw = dict(kw)
    model = kw.pop("model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            d = symmem.derive(model, **kw)
        except Exception as e:
            return f"== {name}\n!{type(e).__name__}: {e}\n"
        return f"== {name}\n" + "\n".join(describe(d)) + "\n"


def traced_cases() -> list[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return []
    return ["mlp", "cnn", "gpt2-eager", "gpt2-sdpa", "bert-eager", "llama-sdpa", "llama-eager", "cnn-mixed",
            "mlp-sgd-foreach", "cnn-checkpoint"]


def run_traced(name: str) -> str:
    import torch
    import trace_helpers as th

    import symmem

    seq = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}
    ids = torch.randint(0, th.VOCAB, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if name.startswith("mlp"):
                net, x = th.mlp_with_inputs()
                kw = {"optimizer": "sgd", "optimizer_impl": "foreach"} if "sgd" in name else {}
                d = symmem.trace(net, x, {"B": [(0, 0)]}, loss="cross-entropy", **kw)
            elif name.startswith("cnn"):
                kw = ({"precision": "mixed"} if "mixed" in name else
                      {"checkpoint": "full"} if "checkpoint" in name else {})
                d = symmem.trace(th.cnn(), (torch.randn(2, 3, 8, 8),), {"B": [(0, 0)]}, **kw)
            else:
                model, attn = name.split("-")
                p = 0.1 if model != "llama" else 0.0
                module = getattr(th, model)(attn, p)
                inputs = {"input_ids": ids} if model == "bert" else {"input_ids": ids, "labels": ids.clone()}
                d = symmem.trace(module, inputs, seq, loss=None if model == "bert" else "output")
        except Exception as e:
            return f"== traced {name}\n!{type(e).__name__}: {e}\n"
        return f"== traced {name}\n" + "\n".join(describe(d)) + "\n"


def main(path: str) -> None:
    cases = list(zoo_cases())
    with Pool(2) as pool:
        blocks = pool.map(run_zoo, cases, chunksize=4)
        blocks += pool.map(run_traced, traced_cases(), chunksize=1)
    Path(path).write_text("".join(blocks))
    print(f"{len(blocks)} cases -> {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "values.txt")
