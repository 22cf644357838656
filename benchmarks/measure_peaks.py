"""Measure the peak of live memory over real training steps of the zoo's PyTorch references (CPU, FP32).

Every number comes from :func:`symmem.record.steps.track_step` (a dispatch mode counting storages op by op) and,
for the allocator table, the profiler's allocation events (:class:`symmem.record.steptrace.AllocatorPeaks`).  Prints the
Markdown of `docs/peak-measurements.md`'s tables and facts.  Run by hand from the repository root
(a few minutes on 2 cores)::

    PYTHONPATH=$PWD python benchmarks/measure_peaks.py            # everything
    PYTHONPATH=$PWD python benchmarks/measure_peaks.py --quick    # one size per model, two optimizers
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable

from symmem.record.steps import track_step
from symmem.record.steptrace import StepTrace
from symmem.reference import reference

IMAGE = {"C": 3, "K": 1000}
#: (model, label, numbers, options) -- small enough to run in seconds
CONFIGS = [
    *(("mlp", f"B={b}", {"B": b}, {}) for b in (2, 8)),
    *(("resnet18", f"B={b}, 32x32", {"B": b, "Hi": 32, "Wi": 32, **IMAGE}, {"depth": 18}) for b in (2, 4, 8)),
    *(("resnet50", f"B={b}, 64x64", {"B": b, "Hi": 64, "Wi": 64, **IMAGE}, {"depth": 50}) for b in (2, 4, 8)),
    *(("vit-ti16", f"B={b}, 64x64, L=2", {"B": b, "Hi": 64, "Wi": 64, "H": 192, "h": 3, "L": 2, **IMAGE},
       {"attention": "naive"}) for b in (2, 8)),
    *(("gpt2", f"B={b}, S=16", {"B": b, "S": 16, "H": 64, "h": 4, "L": 2, "V": 100}, {}) for b in (2, 8)),
]
#: activations larger than the parameters: where the peak sits when the batch matters (SGD with momentum)
HEAVY = [
    ("resnet18", "B=8, 128x128", {"B": 8, "Hi": 128, "Wi": 128, **IMAGE}, {"depth": 18}),
    ("resnet50", "B=4, 128x128", {"B": 4, "Hi": 128, "Wi": 128, **IMAGE}, {"depth": 50}),
    ("vit-ti16", "B=8, 224x224, L=2", {"B": 8, "Hi": 224, "Wi": 224, "H": 192, "h": 3, "L": 2, **IMAGE},
     {"attention": "naive"}),
    ("gpt2", "B=8, S=256", {"B": 8, "S": 256, "H": 64, "h": 4, "L": 2, "V": 100}, {}),
]
OPTIMIZERS = [(o, i) for o in ("sgd", "sgd-momentum", "adam", "adamw") for i in ("for-loop", "foreach")]


def run(model: str, numbers: dict, options: dict, optimizer: str, impl: str, allocator: bool = False
        ) -> tuple[StepTrace, list]:
    module, inputs = reference(model, numbers, options)
    params = [p for p in module.parameters()]
    trace = track_step(module, inputs, loss="cross-entropy", optimizer=optimizer, impl=impl, allocator=allocator,
                       keep_output=True)  # the tables were measured holding the output
    return trace, params


def where(trace: StepTrace, step: int) -> str:
    p = trace.peak_of(step)
    op = p.op.removeprefix("aten.").rsplit(".", 1)[0]
    place = p.record.module or p.where
    if p.phase == "backward" and p.where and p.where != place:
        place = f"{p.where} in {place}" if place else p.where
    return f"{p.phase}: {op}" + (f" ({place})" if place else "")


def n(x: int) -> str:
    return f"{x:,}"


def main_table(configs: Iterable, optimizers: Iterable, out: list[str], facts: dict) -> None:
    out.append("| model | size | optimizer | impl | first step: peak | where | steady: peak | where "
               "| end of forward | persistent sum | steady / sum |")
    out.append("|---|---|---|---|---:|---|---:|---|---:|---:|---:|")
    for model, label, numbers, options in configs:
        for optimizer, impl in optimizers:
            t0 = time.time()
            trace, params = run(model, numbers, options, optimizer, impl)
            print(f"  {model} {label} {optimizer} {impl}: {time.time() - t0:.1f} s", file=sys.stderr)
            first, steady = trace.first, trace.steady
            out.append(f"| {model} | {label} | {optimizer} | {impl} | {n(first.bytes)} | {where(trace, 1)} "
                       f"| {n(steady.bytes)} | {where(trace, 2)} | {n(trace.live_at(2, 'loss'))} "
                       f"| {n(trace.persistent(2))} | {trace.ratio(2):.3f} |")
            collect_facts(facts, model, label, optimizer, impl, trace, params)


def collect_facts(facts: dict, model: str, label: str, optimizer: str, impl: str, trace: StepTrace,
                  params: list) -> None:
    key = f"{model} {label}"
    sizes = [p.numel() * p.element_size() for p in params if p.requires_grad]
    total = sum(sizes)
    # with set_to_none, no gradient in any forward record
    facts.setdefault("grad_in_forward", []).append(
        max((r.bytes("gradient") for r in trace.records if r.phase in ("forward", "loss")), default=0))
    if optimizer == "sgd-momentum":
        clones = sum(s.nbytes for s in trace.storages if s.step == 1 and s.phase == "step"
                     and s.op == "aten.clone.default")
        facts.setdefault("momentum", []).append((key, impl, clones, total, trace.first.phase, trace.steady.phase))
    if optimizer in ("adam", "adamw"):
        temp = max(r.bytes("temporary") for r in trace.records if r.step == 2 and r.phase == "step")
        pairs = max(a + 2 * b for a, b in zip([0, *sizes], sizes, strict=False))
        facts.setdefault("adam", []).append((key, optimizer, impl, temp, total, 2 * max(sizes), pairs))
    if optimizer == "sgd" and impl == "foreach":
        end_loss = trace.live_at(2, "loss")
        rec = next((r for r in trace.records if r.step == 2 and r.op == "aten._log_softmax_backward_data.default"),
                   None)
        logits = next((s.nbytes for s in trace.storages if s.step == 2 and s.op == "aten._log_softmax.default"), 0)
        if rec is not None:
            facts.setdefault("ce", []).append((key, logits, rec.live - end_loss, rec.live, trace.peak_of(2).bytes))


def heavy_table(out: list[str], configs: Iterable) -> None:
    out.append("| model | size | steady peak | where | end of forward | saved at end of forward | "
               "persistent sum | steady / sum | allocator peak |")
    out.append("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for model, label, numbers, options in configs:
        t0 = time.time()
        trace, _ = run(model, numbers, options, "sgd-momentum", "foreach", allocator=True)
        print(f"  heavy {model} {label}: {time.time() - t0:.1f} s", file=sys.stderr)
        assert trace.allocator is not None
        out.append(f"| {model} | {label} | {n(trace.steady.bytes)} | {where(trace, 2)} "
                   f"| {n(trace.live_at(2, 'loss'))} | {n(trace.boundary(2, 'loss').bytes('saved'))} "
                   f"| {n(trace.persistent(2))} | {trace.ratio(2):.3f} | {n(trace.allocator.peak(2))} |")


def allocator_table(out: list[str], configs: Iterable) -> None:
    out.append("| model | size | phase | tracker peak | allocator peak | difference | ops freeing memory "
               "they allocated (most bytes held above their outputs) |")
    out.append("|---|---|---|---:|---:|---:|---|")
    for model, label, numbers, options in configs:
        trace, _ = run(model, numbers, options, "adam", "for-loop", allocator=True)
        assert trace.allocator is not None
        hidden = ", ".join(f"{op.removeprefix('aten::')} x{count}: {n(most)}"
                           for op, count, most in trace.allocator.hidden[:4])
        for i, phase in enumerate(("forward", "backward", "step")):
            try:
                ours = trace.peak_of(2, phase).bytes
            except ValueError:
                continue
            theirs = trace.allocator.peak(2, phase)
            out.append(f"| {model if i == 0 else ''} | {label if i == 0 else ''} | {phase} | {n(ours)} "
                       f"| {n(theirs)} | {theirs - ours:+,} | {hidden if i == 0 else ''} |")


def facts_text(facts: dict, out: list[str]) -> None:
    grads = facts["grad_in_forward"]
    out.append(f"- **No gradient during the forward** (`zero_grad(set_to_none=True)`): the most gradient bytes alive "
               f"in any forward or loss op over {len(grads)} runs is {max(grads):,}.")
    mom = facts.get("momentum", [])
    same = [m for m in mom if m[2] == m[3]]
    out.append(f"- **SGD with momentum clones the gradients in its first step**: bytes born in step 1's optimizer "
               f"phase by `clone` = parameter bytes in {len(same)} of {len(mom)} runs (for-loop and foreach); the "
               f"first step's peak is in the step in "
               f"{sum(m[4] == 'step' for m in mom)} of them, the steady step's in the backward in "
               f"{sum(m[5] == 'backward' for m in mom)}.")
    for key, impl, clones, total, p1, _ in mom:
        if clones != total or p1 != "step":
            out.append(f"  - {key}, {impl}: {clones:,} cloned, {total:,} parameters, first-step peak in {p1}")
    adam = facts.get("adam", [])
    each = [a for a in adam if a[2] == "foreach"]
    loop = [a for a in adam if a[2] == "for-loop"]
    out.append(f"- **Adam/AdamW foreach** holds one copy of the parameters as temporaries (`_foreach_sqrt`): most "
               f"temporary bytes in the steady step = parameter bytes in {sum(a[3] == a[4] for a in each)} of "
               f"{len(each)} runs.")
    out.append(f"- **Adam/AdamW for-loop** holds max over i of (size[i-1] + 2 size[i]) (the previous parameter's "
               f"`denom`, this one's `sqrt` and quotient): exact in {sum(a[3] == a[6] for a in loop)} of "
               f"{len(loop)} runs; twice the largest parameter is exact in {sum(a[3] == a[5] for a in loop)}:")
    seen = set()
    for key, _, _, temp, total, twice, pairs in loop:
        model = key.split()[0]
        if model not in seen:
            seen.add(model)
            out.append(f"  - {model}: {temp:,} = pairs {pairs:,}; 2 x largest {twice:,} (short by "
                       f"{temp - twice:,}); all parameters {total:,}")
    ce = facts.get("ce", [])
    two = [c for c in ce if c[2] == 2 * c[1]]
    out.append(f"- **Cross-entropy at the start of backward**: live at `_log_softmax_backward_data` minus live at "
               f"the end of the forward = 2 x logits bytes in {len(two)} of {len(ce)} runs (SGD foreach, steady); "
               f"otherwise:")
    for key, logits, delta, _, _ in ce:
        if delta != 2 * logits:
            out.append(f"  - {key}: logits {logits:,}, +{delta:,} (2 x logits - {2 * logits - delta:,})")


def timeline(model: str, label: str, phase: str, optimizer: str, modules: list[str]) -> None:
    """Print births and deaths of storages op by op (step 2), the material of the per-op rules in the docs."""
    config = next(c for c in CONFIGS + HEAVY if c[0] == model and c[1] == label)
    trace, _ = run(model, config[2], config[3], optimizer, "foreach")
    deaths: dict[int, list] = {}
    for s in trace.storages:
        if s.died is not None:
            deaths.setdefault(s.died, []).append(s)
    info = {s.sid: s for s in trace.storages}
    for r in trace.records:
        if r.step != 2 or r.phase != phase or (modules and not any(r.module.startswith(m) for m in modules)):
            continue
        gone = deaths.get(r.index, [])
        if not r.born and not gone:
            continue
        born = ", ".join(f"+{info[i].nbytes:,} {list(info[i].shape)} {info[i].category}" for i in r.born)
        dead = ", ".join(f"-{s.nbytes:,} {s.category} ({(s.op or 'start').split('.')[1 if s.op else 0]})"
                         for s in gone)
        print(f"{r.index:6} {r.op.split('.')[1]:30.30} {r.where:28.28} {r.module:24.24} {r.live:>14,}  {born}"
              + (f"  | freed before: {dead}" if dead else ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one size per model and two optimizers")
    p.add_argument("--timeline", nargs=2, metavar=("MODEL", "SIZE"),
                   help="print step 2's storage births and deaths for one configuration, e.g. resnet18 'B=2, 32x32'")
    p.add_argument("--phase", default="backward", help="with --timeline: the phase (default backward)")
    p.add_argument("--optimizer", default="sgd", help="with --timeline: the optimizer (default sgd)")
    p.add_argument("--module", action="append", default=[], help="with --timeline: only ops in modules starting so")
    args = p.parse_args(argv)
    if args.timeline:
        timeline(*args.timeline, args.phase, args.optimizer, args.module)
        return
    configs = CONFIGS if not args.quick else [c for c in CONFIGS if c[1].startswith("B=2")]
    optimizers = OPTIMIZERS if not args.quick else [("sgd", "foreach"), ("adam", "for-loop")]
    out: list[str] = []
    facts: dict = {}
    t0 = time.time()
    out.append("### Peaks by model, optimizer and implementation\n")
    main_table(configs, optimizers, out, facts)
    out.append("\n### Activation-heavy sizes (SGD with momentum, foreach)\n")
    heavy_table(out, HEAVY if not args.quick else HEAVY[:1])
    out.append("\n### What the dispatch mode cannot see (Adam, for-loop, steady step)\n")
    allocator_table(out, [c for c in CONFIGS if c[1].startswith("B=2")])
    out.append("\n### Facts\n")
    facts_text(facts, out)
    print("\n".join(out))
    import torch

    print(f"\n(torch {torch.__version__}, {time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
