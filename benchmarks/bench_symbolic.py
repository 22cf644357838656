"""Speed of a formula in every size (issue 20): ``symmem trace hf:llama --symbolic ...`` against one plain trace.

The plain trace is :func:`symmem.importer.trace_module` of the same config (Llama-2-7B's defaults with 8 key/value
groups, built on the meta device, its 32 layers traced); the symbolic one fits H, F, h, G, V and L from traces at
small configurations (:mod:`symmem.importer.symbolic_sizes`) and checks them at two more.  Both leave out the
module's build and transformers' import (done once before timing).  Run::

    PYTHONPATH=. python benchmarks/bench_symbolic.py
"""

from __future__ import annotations

import time

KEYS = {"H": "hidden_size", "F": "intermediate_size", "h": "num_attention_heads", "G": "num_key_value_heads",
        "V": "vocab_size", "L": "num_hidden_layers"}
CONFIG = {"num_key_value_heads": 8}


def main() -> None:
    import symmem
    from symmem.importer import sources
    from symmem.importer.hf_sizes import hf_sizes
    from symmem.importer.trace import trace_module

    loaded = sources.load("hf:llama", config=CONFIG)
    dims = sources.parse_dims("B,S", loaded)
    wall, cpu = time.perf_counter(), time.process_time()
    trace_module(loaded.module, loaded.example_inputs, dims, check=False)
    plain = (time.perf_counter() - wall, time.process_time() - cpu)
    model = hf_sizes("hf:llama", KEYS, CONFIG, None)
    model.load({"H": 16, "F": 24, "h": 4, "G": 2, "V": 24, "L": 2})  # warm: the first build imports the model code
    wall, cpu = time.perf_counter(), time.process_time()
    d = symmem.trace(model.build, dims=dims, sizes=model.sizes, divisible=model.divisible)
    fit = (time.perf_counter() - wall, time.process_time() - cpu)
    traces = next(n for n in d.notes if n.startswith("every size symbolic")).split(" traces")[0].split()[-1]
    print(f"plain trace of hf:llama (32 layers, meta): {plain[0]:.1f} s wall, {plain[1]:.1f} s CPU")
    print(f"symbolic in {', '.join(KEYS)}: {traces} traces, {fit[0]:.1f} s wall, {fit[1]:.1f} s CPU "
          f"({fit[1] / plain[1]:.2f}x the plain trace's CPU)")


if __name__ == "__main__":
    main()
