"""Stored real measurements of the tensor-parallel and FSDP x TP gloo runs (the replay pattern of
tests/test_selective_engines.py): every rank's bytes of each case, as the real ranks measured them, in
``tests/data/tensor_parallel_gloo.json``; and the pipeline stages' runs of tests/test_model_parallel.py
(``stages``: every field of each rank's StageRun but its lists of storages).

The default suite runs ONE live case per regime (tensor parallelism, sequence parallelism, B = 1, four ranks, HF
Llama, FSDP2 x TP, FSDP1 x TP, ...) and checks it against derive AND against its stored row (:func:`differences`);
the other cases are REPLAYED: derive held to the stored row, to the byte, in the same checks.  The ``deep`` tests
(``python -m pytest -m deep``) rerun every stored case in fresh gloo spawns and compare with the file.  The file is
written by this module from real runs only (``python -m tests.tensor_stored``: every case measured anew, the whole
file rewritten); no number in it is typed in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "tensor_parallel_gloo.json"
#: the fields stored per rank: a tensor-parallel rank's (:class:`~symmem.record.model_parallel_runs.TensorRun`) and
#: an FSDP x TP rank's (:class:`~symmem.record.fsdp_tensor_runs.MeshRun`)
FIELDS = {"tensor": ("rank", "saved", "parameters", "gradients", "optimizer_state", "first_peak", "steady_peak"),
          "mesh": ("rank", "dp", "tp", "parameters", "gradients", "optimizer_state", "saved", "first_peak",
                   "steady_peak"),
          "split": ("rank", "first_peak", "steady_peak", "parameters", "saved")}

#: a pipeline stage's run is stored whole but for its lists of storages (what was live at the peak, the saved ones),
#: which no replayed check reads: every other field of its StageRun
STAGE_LISTS = ("at_peak", "saved_storages", "peak_storages")


def key(world: int | str, values: Mapping[str, int], options: Mapping[str, Any]) -> str:
    """A case's name in the file: its world (or mesh), sizes and options, sorted."""
    return json.dumps([world, dict(values), dict(options)], sort_keys=True)


@cache
def _file() -> dict[str, Any]:
    return json.loads(DATA.read_text()) if DATA.exists() else {}


def row(section: str, run: Any) -> Any:
    """One rank's stored fields (a pipeline stage's, ``stages``: its
    :class:`~symmem.record.model_parallel_runs.StageRun`'s but :data:`STAGE_LISTS`, tuples as lists)."""
    if section == "stages":
        from dataclasses import asdict

        return json.loads(json.dumps({k: v for k, v in asdict(run).items() if k not in STAGE_LISTS}))
    return [int(getattr(run, f)) for f in FIELDS[section]]


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def stage_key(world: int, model: str, values: Mapping[str, int], case: Sequence[Any]) -> tuple[str, dict, dict]:
    """A pipeline job's (world, values, options) for :func:`key`: its model with the world, its case as options."""
    return f"{world} {model}", dict(values), {"case": list(case)}


def stored(section: str, world: int | str, values: Mapping[str, int], options: Mapping[str, Any]) -> list[Any]:
    """The stored ranks of a case, as the run's own records (no late free: the live run asserted none)."""
    from symmem.record.fsdp_tensor_runs import MeshRun
    from symmem.record.model_parallel_runs import TensorRun
    from symmem.record.traced_tensor_runs import SplitRun

    rows = _file()[section][key(world, values, options)]
    if section == "stages":
        from symmem.record.model_parallel_runs import StageRun

        return [StageRun(**dict.fromkeys(STAGE_LISTS, ()), **{k: _tuples(v) for k, v in r.items()}) for r in rows]
    if section in ("mesh", "split"):
        kind = MeshRun if section == "mesh" else SplitRun
        return [kind(**dict(zip(FIELDS[section], r, strict=True))) for r in rows]
    return [TensorRun(saved_storages=(), **dict(zip(FIELDS[section], r, strict=True))) for r in rows]


def differences(section: str, world: int | str, values: Mapping[str, int], options: Mapping[str, Any],
                ranks: Sequence[Any]) -> list[str]:
    """What differs between a live case's ranks and its stored row (empty: every rank to the byte)."""
    want = _file()[section][key(world, values, options)]
    got = [row(section, r) for r in ranks]
    return [] if got == want else [f"{section} {key(world, values, options)}: stored {want}, measured {got}"]


def measure_stages() -> dict[str, Any]:
    """The stored pipeline jobs (``test_model_parallel.STAGES``, by world) measured anew, one spawn a world."""
    import test_model_parallel as tensor

    from symmem.record.model_parallel_runs import runs

    out: dict[str, Any] = {}
    for world, jobs in tensor.STAGES.items():
        everything = runs(world, jobs)
        for k, (_, model, values, case) in enumerate(jobs):
            out[key(*stage_key(world, model, values, case))] = [row("stages", rank[k]) for rank in everything]
    return out


def measure_all() -> dict[str, dict[str, Any]]:
    """Every stored case measured anew, in one spawn per world and one 2 x 2 mesh spawn (``deep``; the writer)."""
    import test_fsdp_tensor as mesh
    import test_model_parallel as tensor
    import test_traced_tensor as traced

    from symmem.record.fsdp_tensor_runs import fsdp_tensor_runs
    from symmem.record.model_parallel_runs import forked_ranks, runs
    from tests.hf_tensor_runs import HF, job

    out: dict[str, dict[str, Any]] = {"tensor": {}, "mesh": {}, "split": {}, "stages": measure_stages()}
    everything = forked_ranks(2, traced.split_work(traced.SPLIT), "the tensor-parallel runs")
    for k, case in enumerate(traced.SPLIT):
        out["split"][key(2, dict(zip("BLF", case, strict=True)), {})] = [row("split", r[k]) for r in everything]
    for world, cases in tensor.STORED.items():
        everything = runs(world, [("tensor", "llama", values, options) for values, options in cases])
        for k, (values, options) in enumerate(cases):
            out["tensor"][key(world, values, options)] = [row("tensor", rank[k]) for rank in everything]
    hf = [job(case) for case in range(len(HF))]
    everything = runs(2, [("tensor", "llama", values, options) for values, options in hf])
    for k, (values, options) in enumerate(hf):
        out["tensor"][key(2, values, options)] = [row("tensor", r[k]) for r in everything]
    cases = [*mesh.CASES, *mesh.DEEP_CASES]
    everything = fsdp_tensor_runs(2, 2, [(values, mesh._job(engine, options)) for engine, values, options, _ in cases])
    for k, (engine, values, options, _) in enumerate(cases):
        out["mesh"][key(f"2x2 {engine}", values, options)] = [row("mesh", rank[k]) for rank in everything]
    return out


def main() -> None:
    """Measure every stored case anew and write the file (run from the repository root:
    ``PYTHONPATH=.:tests python -m tests.tensor_stored``)."""
    found = measure_all()
    text = {"what": "per-rank bytes of real gloo runs on the CPU, torch " + _torch() + ": Llama (and transformers' "
            "LlamaForCausalLM, 'hf') under DTensor's standard or sequence-parallel plan ('tensor': saved after the "
            "forward, parameters, gradients, AdamW state, first and steady step peak, one recorded step each), "
            "FSDP2 / FSDP1 x TP on the 2 x 2 mesh ('mesh'), tests/data/traced_tp.py's module under its own "
            "plan ('split': B, blocks L, width F), the reference's pipeline stages ('stages': every field of a "
            "stage's run; keys ['WORLD MODEL', values, {case}]); keys [world, values, options]; written by "
            "tests/tensor_stored.py from fresh runs", **found}
    DATA.write_text(json.dumps(text, indent=1, sort_keys=True) + "\n")


def _torch() -> str:
    import torch

    return torch.__version__.split("+")[0]


if __name__ == "__main__":
    main()
