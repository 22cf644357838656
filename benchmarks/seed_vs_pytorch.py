"""The FP32 analysis's accounting (``paper``) against real PyTorch (``pytorch``, CUDA and CPU kernels) at its B = 64.

Every number comes out of the engine; the ``pytorch`` convention is the one the tests check byte for byte
against measured PyTorch.  Run by hand:  ``PYTHONPATH=$PWD python benchmarks/seed_vs_pytorch.py``
(prints the Markdown tables of docs/pytorch-vs-seed.md).
"""

from __future__ import annotations

import time
from collections import defaultdict

from symmem import derive
from symmem.errors import SymmemError
from symmem.models import build

MiB = 2**20
MODELS = [("resnet50-v1", {}), ("resnet50", {}), ("vit-b16", {"attention": "naive"}),
          ("vit-b16", {"attention": "sdpa"})]
SETUPS = [("paper", {}), ("pytorch", {"device": "cuda"}), ("pytorch", {"device": "cpu"})]


def _label(name: str, opts: dict) -> str:
    return name + "".join(f" ({v})" for v in opts.values())


def kind_of_term(model, term) -> str:
    """What a kept tensor is, for the term-by-term table: the producing op kind, or the op's own tensor."""
    g = model.graph
    if term.node in g and term.name != term.node:
        kind, label = g.nodes[term.node]["kind"], term.name.rsplit(".", 1)[-1]
        if label.startswith("input"):  # a role convention keeping an op's input (the paper's shortcut input)
            return f"{kind} input [{term.role}]"
        return f"{kind} {label} ({term.dtype})"  # a tensor only the op holds (indices, mask, statistics)
    if term.node in g:
        kind = g.nodes[term.node]["kind"]
        return f"{kind} output" + (f" [{term.role}]" if term.role and kind in ("linear", "conv2d") else "")
    return term.name


def main() -> None:
    print("| model | accounting | activations at B=64 (MiB) | per-sample bytes (formula) | ratio to the analysis |")
    print("|---|---|---:|---|---:|")
    breakdowns = {}
    for name, opts in MODELS:
        base = None
        for conv, copts in SETUPS:
            label = conv + (f" {copts['device']}" if copts else "")
            try:
                t0 = time.perf_counter()
                d = derive(name, convention=conv, options=copts, **opts)
                elapsed = time.perf_counter() - t0
            except SymmemError as exc:
                print(f"| {_label(name, opts)} | {label} | TODO: {exc} | | |")
                continue
            v = d.value("activations")
            base = base or v
            print(f"| {_label(name, opts)} | {label} | {v / MiB:,.2f} | `{d.activations}` | {v / base:.2f} |"
                  f" <!-- derive {elapsed:.2f} s -->")
            parts: dict[str, int] = defaultdict(int)
            model = build(name, **opts)
            for t in d.terms:
                if t.category == "activation":
                    parts[kind_of_term(model, t)] += d.evaluate(t.expr)
            breakdowns[(_label(name, opts), label)] = parts
    for model_label in dict.fromkeys(m for m, _ in breakdowns):
        cols = [c for m, c in breakdowns if m == model_label]
        rows = sorted({k for c in cols for k in breakdowns[(model_label, c)]})
        print(f"\n#### {model_label}: MiB at B=64 by what is kept\n")
        print("| kept tensor | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for r in rows:
            vals = [breakdowns[(model_label, c)].get(r, 0) / MiB for c in cols]
            print(f"| {r} | " + " | ".join(f"{v:,.2f}" if v else "" for v in vals) + " |")


if __name__ == "__main__":
    main()
