"""One case of check_cuda_selective.py with the allocator's history: the steady step's peak, what is alive there
(size, the Python frames that allocated it), for comparing with symmem's storages at its peak moment.

    PYTHONPATH=$PWD python benchmarks/cuda_history.py CASE_INDEX none|selective OUT.txt
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_cuda_selective as cs  # noqa: E402
from check_cuda import _steps, baseline, warm_cublas  # noqa: E402

#: allocations at least this large are listed with their C++ frames too
BIG = 1 << 17
#: C++ frames that say nothing about which op allocated
SKIP = ("unwind", "Captured", "gather", "Allocator", "empty_generic", "empty_cuda", "c10::impl", "std::", "boxed",
        "callBoxed")


def main() -> int:
    import torch

    index, checkpoint, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    label, model, v, options = cs.CASES[index]
    cs.register()
    warm_cublas()
    build = functools.partial(cs.build, model, v, options["cache"], checkpoint == "selective")
    _steps(*build(), "adamw", "for-loop", lambda y: y.sum(), 1, None)
    base = baseline()
    module, inputs, target = build()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="all")
    got = _steps(module, inputs, target, "adamw", "for-loop", lambda y: y.sum(), 2, base)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    live: dict[int, tuple[int, list[str]]] = {}
    now, best, at = 0, 0, None
    opt = [i for i, e in enumerate(trace) if e["action"] == "alloc" and any(
        "adam" in f["filename"] for f in e.get("frames", ())[:8])]
    start = next((i for i in opt if i > (opt[0] if opt else 0) + 50), 0)  # the second step's forward
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", ())
                      if f["filename"].endswith(".py")][:5]
            if not frames or e["size"] >= BIG:  # an autograd thread's: its C++ frames name the op
                frames = [f["name"][:90] for f in e.get("frames", ()) if "::" in f["name"] and not any(
                    w in f["name"] for w in SKIP)][:14] + frames
            live[e["addr"]] = (-(-e["size"] // 512) * 512, frames)
            now += live[e["addr"]][0]
            if i >= start and now > best:
                best, at = now, (i, dict(live))
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    peak_event = trace[at[0]]
    made = [f["name"][:90] for f in peak_event.get("frames", ()) if "::" in f["name"] and not any(
        w in f["name"] for w in SKIP)][:6]
    lines = [f"{label} {checkpoint} {v} measured {got} history peak {best} at event {at[0]}: {' < '.join(made)}"]
    for size, frames in sorted(at[1].values(), key=lambda x: -x[0]):
        lines.append(f"{size:>10} {' < '.join(frames)}")
    Path(out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
