"""A short LaTeX paper on the FP32 training memory of ResNet-50 and ViT-B/16, generated from the engine.

``symmem paper --output DIR`` writes ``DIR/main.tex``, the generated equations and tables under
``DIR/generated/`` and the figures under ``DIR/figures/``, then compiles ``DIR/main.pdf`` with ``latexmk``
(or ``pdflatex``) when one is installed.  Every equation, number and table in the text is printed from the
derivations: the paper only arranges them.  The comparison with PyTorch autograd appears by itself once the
``pytorch`` convention derives both models.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import sympy

from .errors import SymmemError
from .units import UNITS

MiB, GiB = UNITS["MiB"], UNITS["GiB"]

# The seed's printed figures, shown beside the recomputed ones (never used to compute anything).
SEED_SPLIT = {"stage 1": ("882.00", "49.00"), "stage 2": ("384.00", "400.00"), "stage 3": ("301.00", "238.00"),
              "stage 4": ("88.50", "70.75")}
SEED_TOTALS = {"ResNet-50": "3.03", "ViT-B/16 naive MHA": "6.55", "ViT-B/16 SDPA/Flash": "5.22"}


@dataclass(frozen=True)
class Paper:
    """Where the paper was written and whether it was compiled."""

    directory: Path
    tex: Path
    pdf: Path | None
    pytorch: bool
    note: str = ""


def _derivations() -> dict[str, object]:
    from .engine import derive

    return {
        "ResNet-50": derive("resnet50-v1", convention="paper"),
        "ViT-B/16 naive MHA": derive("vit-b16", convention="paper", attention="naive"),
        "ViT-B/16 SDPA/Flash": derive("vit-b16", convention="paper", attention="sdpa"),
    }


def _pytorch() -> tuple[dict[str, object], str]:
    """The same three rows under the ``pytorch`` convention, or why they cannot be derived yet."""
    from .engine import derive

    try:
        return {
            "ResNet-50": derive("resnet50-v1", convention="pytorch"),
            "ViT-B/16 naive MHA": derive("vit-b16", convention="pytorch", attention="naive"),
            "ViT-B/16 SDPA/Flash": derive("vit-b16", convention="pytorch", attention="sdpa"),
        }, ""
    except SymmemError as exc:
        return {}, str(exc)


def _stage_table(d) -> str:  # type: ignore[no-untyped-def]
    from .report.latex import escape

    rows = []
    stem = d.groups()["stem"]
    rows.append(rf"  stem (conv1, max-pool, indices) & & & {d.evaluate(stem) / MiB:.2f} & \\")
    for group, (seed_main, seed_down) in SEED_SPLIT.items():
        main = d.evaluate(d.sum(group=group, role="main_path")) / MiB
        down = d.evaluate(d.sum(group=group, role="downsample_input")) / MiB
        total = d.evaluate(d.groups()[group]) / MiB
        rows.append(rf"  {escape(group)} & {main:.2f} & {down:.2f} & {total:.2f} & {seed_main} / {seed_down} \\")
    return "\n".join([
        r"\begin{table}[ht]", r"  \centering",
        r"  \caption{ResNet-50 saved activations per stage at $B = 64$ (MiB), main path ($6PHW$ per block) and "
        r"the stage input kept for the $1\times1$ projection. The last column is the seed's split, garbled for "
        r"stages 2--4; its stage totals agree.}",
        r"  \label{tab:stages}", r"  \begin{tabular}{lrrrr}", r"  \toprule",
        r"  Stage & Main path & Downsample input & Total & Seed's split \\", r"  \midrule", *rows,
        r"  \bottomrule", r"  \end{tabular}", r"\end{table}"])


def _fit_table(ds: dict[str, object], budget: str) -> str:
    from .fit import largest
    from .report.latex import escape

    rows = []
    for label, d in ds.items():
        r = largest(d, "B", budget)  # type: ignore[arg-type]
        rows.append(rf"  {escape(label)} & {r.max:,} & {r.total_at_max / GiB:.3f} & {r.total_above / GiB:.3f} \\")
    return "\n".join([
        r"\begin{table}[ht]", r"  \centering",
        rf"  \caption{{Largest batch size that fits {escape(budget)}, solved from the formulas and checked at the "
        r"boundary (GiB).}", r"  \label{tab:fit}", r"  \begin{tabular}{lrrr}", r"  \toprule",
        r"  Model & $B_{\max}$ & $M(B_{\max})$ & $M(B_{\max}+1)$ \\", r"  \midrule", *rows, r"  \bottomrule",
        r"  \end{tabular}", r"\end{table}"])


def _numbers(ds: dict[str, object]) -> dict[str, str]:
    """The figures the prose quotes, each printed from a derivation."""
    r, naive, sdpa = ds["ResNet-50"], ds["ViT-B/16 naive MHA"], ds["ViT-B/16 SDPA/Flash"]
    idx = r.sum(role="indices")  # type: ignore[attr-defined]
    return {
        "rparams": f"{r.value('parameters'):,}",  # type: ignore[attr-defined]
        "vparams": f"{naive.value('parameters'):,}",  # type: ignore[attr-defined]
        "ract": f"{r.evaluate(r.activations - idx) / MiB:.2f}",  # type: ignore[attr-defined]
        "ridx": f"{r.evaluate(idx) / MiB:.2f}",  # type: ignore[attr-defined]
        "rtotal": f"{r.value('total') / GiB:.4f}",  # type: ignore[attr-defined]
        "rseedrule": f"{(r.value('activations') + 25.6e6 * 16) / GiB:.4f}",  # type: ignore[attr-defined]
        "ntotal": f"{naive.value('total') / GiB:.3f}",  # type: ignore[attr-defined]
        "stotal": f"{sdpa.value('total') / GiB:.3f}",  # type: ignore[attr-defined]
        "nratio": f"{naive.value('total') / r.value('total'):.3f}",  # type: ignore[attr-defined]
        "sratio": f"{sdpa.value('total') / r.value('total'):.3f}",  # type: ignore[attr-defined]
    }


def _pytorch_prose(ds: dict[str, object], torch_ds: dict[str, object]) -> str:
    """Ratios of the two accountings and PyTorch's per-layer ViT formulas, all from derivations."""
    from .engine import derive
    from .report.latex import escape, expression

    ratios = ", ".join(f"{escape(k)} {torch_ds[k].value('total') / ds[k].value('total'):.2f}"  # type: ignore[attr-defined]
                       for k in ds)
    layers = {att: derive("vit-b16", convention="pytorch", attention=att, per_layer=True).activations
              for att in ("naive", "sdpa")}
    return "\n".join([
        f"PyTorch needs more than the seed counts (total ratios: {ratios}): autograd keeps every op's inputs, "
        "the inputs of every linear layer and normalization (with its statistics) and the GELU input. "
        "Per ViT layer it keeps, in bytes,",
        r"\begin{align}",
        rf"  M^{{\mathrm{{PyTorch}}}}_{{\mathrm{{naive}}}} &= {expression(layers['naive'])}, \\",
        rf"  M^{{\mathrm{{PyTorch}}}}_{{\mathrm{{SDPA}}}} &= {expression(layers['sdpa'])},",
        r"\end{align}",
        "against $4(9BSH + BhS^2)$ and $4 \\cdot 9BSH$ in the seed's accounting."])


def _body(ds: dict[str, object], torch_ds: dict[str, object], why: str) -> str:
    from .engine import derive
    from .report.latex import equation, escape, expression
    from .simplify import factored
    from .symbols import B, H, S

    n = _numbers(ds)
    r = ds["ResNet-50"]
    layer_naive = derive("vit-b16", attention="naive", per_layer=True)
    layer_sdpa = derive("vit-b16", attention="sdpa", per_layer=True)
    naive_el = sympy.expand(layer_naive.activations / 4)
    sdpa_el = sympy.expand(layer_sdpa.activations / 4)
    bsh = layer_naive.evaluate(B * S * H)
    vit = ds["ViT-B/16 naive MHA"]
    parts = [
        r"\section{Introduction}",
        "A training step keeps the parameter side (weights, gradients and optimizer state) and the activations "
        "the forward pass saves for the backward pass. We recompute the FP32 AdamW accounting of ResNet-50 and "
        "ViT-B/16 (DeiT-Base) at $224\\times224$ and $B = 64$ from the seed note exactly: every equation, "
        "number and table below is printed by \\texttt{symmem} from a graph of the network with symbolic "
        "shapes. Units are binary: 1\\,MiB $= 2^{20}$ and 1\\,GiB $= 2^{30}$ bytes; FP32 is 4 bytes per element "
        "and AdamW costs 16 bytes per parameter.",
        r"\section{ResNet-50}",
        "Under the seed's accounting each bottleneck keeps its three main-path convolution outputs ($6PHW$ "
        "elements), the first block of a stage also keeps the stage input for its $1\\times1$ projection, and the "
        "stem keeps the conv1 and max-pool outputs and the 32-bit pool indices. The graph (torchvision v1 "
        f"geometry) has {n['rparams']} parameters. In bytes, with $B$ free:",
        equation(r"M_{\mathrm{ResNet}}", r.total, "eq:resnet"),  # type: ignore[attr-defined]
        f"Table~\\ref{{tab:stages}} splits the {n['ract']}\\,MiB of saved activations (plus {n['ridx']}\\,MiB "
        "of indices) by stage. The seed's stage totals are right, but its split of stages 2--4 into main path "
        "and downsample input does not follow from its own formulas.",
        _stage_table(r),
        f"The total is {n['rtotal']}\\,GiB. The seed prints 3.03\\,GiB because it rounds the parameter count "
        f"to 25.6\\,M (which gives {n['rseedrule']}\\,GiB).",
        r"\section{ViT-B/16}",
        f"With $S = 197$ tokens, $H = 768$, $h = 12$ heads and $L = 12$ layers ($BSH = {bsh:,}$ at $B = 64$), "
        "one layer keeps, in elements, with naive attention (softmax probabilities materialized) and with a "
        "fused SDPA/FlashAttention kernel:",
        "\n".join([r"\begin{align}", rf"  N_{{\mathrm{{naive}}}} &= {expression(naive_el)}, \\",
                   rf"  N_{{\mathrm{{SDPA}}}} &= {expression(sdpa_el)},", r"\end{align}"]),
        f"that is {layer_naive.value('activations') / MiB:.2f} and {layer_sdpa.value('activations') / MiB:.2f}"
        "\\,MiB per layer. The patch-embedding output is kept once. The whole model, naive attention, in bytes, "
        "is $M_{\\mathrm{ViT}} = M_{\\mathrm{act}} + M_{\\mathrm{par}}$ with",
        "\n".join([r"\begin{align}",
                   rf"  M_{{\mathrm{{act}}}} &= {expression(factored(vit.activations))}, \\",
                   rf"  M_{{\mathrm{{par}}}} &= {expression(vit.parameter_memory)}.", r"\end{align}"]),
        r"\section{Side by side}",
        "Table~\\ref{tab:memory} is the seed's Table~1 recomputed (the seed prints "
        + ", ".join(f"{escape(k)} {v}\\,GiB" for k, v in SEED_TOTALS.items())
        + f"). The ViT:ResNet ratios are {n['nratio']} (naive) and {n['sratio']} (SDPA).",
        r"\input{generated/table1.tex}",
        r"\section{Seed accounting versus PyTorch autograd}",
    ]
    if torch_ds:
        parts += [
            "The \\texttt{pytorch} convention keeps what eager PyTorch's autograd saves (one rule per op, each "
            "storage counted once, the input batch apart). Table~\\ref{tab:pytorch} sets it beside the seed's "
            "accounting; \\emph{Other} is the input batch, which PyTorch keeps for the first layer.",
            r"\input{generated/pytorch.tex}",
            _pytorch_prose(ds, torch_ds),
        ]
    else:
        parts += [
            "This section compares the seed's accounting with what PyTorch's autograd keeps (the "
            "\\texttt{pytorch} convention). It is generated automatically once that convention derives both "
            f"models; in this build it cannot yet: \\texttt{{{escape(why[:160])}}}.",
        ]
    parts += [
        r"\section{Scaling}",
        "Memory grows linearly in $B$ for both models; with naive attention the ViT also grows as $S^2$. "
        "Figure~\\ref{fig:scaling} and Table~\\ref{tab:fit} give the largest batch that fits an 80\\,GiB card, "
        "solved from the formulas.",
        "\n".join([r"\begin{figure}[ht]", r"  \centering",
                   r"  \includegraphics[width=0.8\linewidth]{figures/scaling.pdf}",
                   r"  \caption{Training memory against batch size with an 80\,GiB budget; dots mark the largest "
                   r"batch that fits.}", r"  \label{fig:scaling}", r"\end{figure}"]),
        r"\input{generated/fit.tex}",
    ]
    return "\n\n".join(parts)


MAIN = r"""\documentclass[11pt]{article}
\usepackage[margin=2.5cm]{geometry}
\usepackage{amsmath}
\usepackage{booktabs}
\usepackage{graphicx}
\title{FP32 Training Memory of ResNet-50 and ViT-B/16, Derived}
\author{Generated by symmem %(version)s}
\date{}
\begin{document}
\maketitle
\begin{abstract}
Closed-form training-memory formulas for ResNet-50 and ViT-B/16 under FP32 and AdamW, derived from the
networks' graphs with symbolic shapes. At $B = 64$ they give %(rtotal)s\,GiB for ResNet-50 and %(ntotal)s\,GiB
(naive attention) or %(stotal)s\,GiB (fused attention) for ViT-B/16.
\end{abstract}
\input{generated/body.tex}
\end{document}
"""


def write(directory: str | Path, compile: bool = True, force: bool = False) -> Paper:
    """Write the paper's sources into ``directory`` and compile them when LaTeX is installed.

    ``directory`` may not exist yet (its parent must).  An existing ``main.tex`` there is never overwritten
    unless ``force``; everything is derived and drawn before the first file is written, and each file is
    written whole or not at all (:mod:`symmem.files`).
    """
    from . import __version__
    from .files import output_path, write_text
    from .report.latex import table
    from .report.plots import save, scaling

    out = output_path(directory, what="paper's output", directory=True)
    tex = out / "main.tex"
    if not force and (tex.exists() or tex.is_symlink()):
        raise SymmemError(f"{str(tex)[:80]!r} exists: the paper would overwrite it; choose another directory or "
                          "give --force (force=True)")
    ds = _derivations()
    torch_ds, why = _pytorch()
    files = {
        "generated/table1.tex": table(list(ds.items()), caption="FP32 training memory, B = 64, AdamW"),  # type: ignore[arg-type]
        "generated/fit.tex": _fit_table(ds, "80GiB"),
    }
    if torch_ds:
        rows = [(k, v) for k in ds for v in (ds[k], torch_ds[k])]
        files["generated/pytorch.tex"] = table(rows, caption="Seed accounting vs PyTorch autograd, B = 64",  # type: ignore[arg-type]
                                               label="tab:pytorch")
    files["generated/body.tex"] = _body(ds, torch_ds, why)
    fig = scaling(list(ds.values()), list(ds), "B", "80GiB")  # type: ignore[arg-type]
    import matplotlib.pyplot as plt

    try:
        for sub in ("", "generated", "figures"):
            try:
                (out / sub).mkdir(exist_ok=True)
            except OSError as exc:
                raise SymmemError(f"cannot create {str(out / sub)[:80]!r}: {exc.strerror or exc}") from None
        for name, text in files.items():
            write_text(out / name, text + "\n")
        save(fig, out / "figures" / "scaling.pdf")
    finally:
        plt.close(fig)
    write_text(tex, MAIN % ({"version": __version__} | _numbers(ds)))
    pdf, note = (_compile(tex) if compile else (None, "not compiled (compile=False)"))
    return Paper(out, tex, pdf, bool(torch_ds), note)


def _compile(tex: Path) -> tuple[Path | None, str]:
    if shutil.which("latexmk"):
        cmd = ["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error", tex.name]
    elif shutil.which("pdflatex"):
        cmd = ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", tex.name]
    else:
        return None, "no latexmk or pdflatex on PATH: wrote the .tex files only"
    runs = 2 if cmd[0] == "pdflatex" else 1  # pdflatex needs a second pass for the references
    for _ in range(runs):
        try:
            done = subprocess.run(cmd, cwd=tex.parent, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise SymmemError(f"{cmd[0]} ran for more than 300 s on {tex}; the sources are written, compile "
                              "them by hand") from None
        except OSError as exc:
            raise SymmemError(f"{cmd[0]} could not run on {tex}: {exc.strerror or exc}") from None
        if done.returncode != 0:
            errors = [ln for ln in done.stdout.splitlines() if ln.startswith("!")]
            first = errors[0] if errors else (done.stdout.strip().splitlines() or ["no output"])[-1]
            raise SymmemError(f"{cmd[0]} failed on {tex} (see {tex.with_suffix('.log')}): {first[:200]}")
    return tex.with_suffix(".pdf"), f"compiled with {cmd[0]}"
