"""What the pipeline-mesh tests check of every real rank (FSDP, DDP and FSDP x TP on stages), in one place."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gloo_store import START


def replays_are_the_ranks(d: Any, real: list[Any], label: Any) -> None:
    """Each real rank's weights and AdamW state, its first and steady peaks and the largest moments of its schedule
    and of its optimizer step equal, to the byte, the derivation's replay of that rank's stage (``label`` names the
    case in a failure)."""
    named = {s.name: int(v) for s, v in d.numbers.items()}
    for r in real:
        mine = d.step.at_rank(r.dp)._replays(named)[r.pp]
        assert (mine.at["parameters"], mine.at["optimizer_state"]) == (r.parameters, r.optimizer_state), (label, r)
        assert (mine.peak.first, mine.peak.bytes, mine.peak.pipeline, mine.peak.step) == (
            r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak), (label, r)


def sharded_side(real: list[Any]) -> dict[str, dict[str, int]]:
    """The parameter side per rank (passes/rank_side.py) of FSDP2 on a module without buffers: the real rank's
    padded shards, as many bytes of sharded gradients, AdamW's state of its rows."""
    return {str(r.rank): {"parameters": r.parameters, "gradients": r.parameters, "buckets": 0,
                          "optimizer_state": r.optimizer_state, "total": 2 * r.parameters + r.optimizer_state}
            for r in real}


def hf_stage_buffers(spec: str, config: dict[str, Any], stage: int, p: int = 2, split: str = "LlamaSplit") -> int:
    """Bytes of the buffers of a Hugging Face model's real stage module ``stage`` of ``p``, built as the gloo runs
    build it (:mod:`symmem.record.traced_pipeline_runs`: Llama's rotary frequencies are a buffer of every stage)."""
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record import traced_pipeline_runs

    full, _ = SpecBuilder(spec, tuple(sorted(config.items())))()
    module = getattr(traced_pipeline_runs, split)().stage(full, stage, p)
    return sum(b.numel() * b.element_size() for b in module.buffers())


# -- stored measurements: MEASURED rows from real runs, REPLAYED in the default suite, all rerun under ``-m deep`` --

#: every stored case's real ranks (StageMeshRun, every field), written by the deep tests from fresh gloo runs
#: (``SYMMEM_STORE_MESHES=1 python -m pytest -m deep -k stored tests/test_fsdp_pipeline.py
#: tests/test_tensor_pipeline.py tests/test_ddp_pipeline.py``) and compared with fresh runs by them otherwise
DATA = Path(__file__).parent / "data" / "pipeline_meshes_gloo.json"
WHAT = ("every rank of the 2 x 2 pipeline meshes' real gloo runs (CPU, torch.distributed.pipelining; "
        "symmem.record.fsdp_pipeline_runs, ddp_pipeline_runs), a StageMeshRun a line, by case (its table row as "
        "JSON); written by tests/stage_ranks.py's against_stored from fresh runs")


def key(case: Any) -> str:
    """A case's name in :data:`DATA`: its table row as JSON (a traced case by its spec, config and split; a file
    module by its file's name, not its path)."""
    return json.dumps(_plain(case), separators=(",", ":"))


def _plain(x: Any) -> Any:
    if isinstance(x, str):
        path = x.split(":")[0]
        return Path(path).name + x[len(path):] if "/" in path else x
    if isinstance(x, Mapping):
        return [[k, _plain(v)] for k, v in sorted(x.items())]
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x):
        return [type(x).__name__, *(_plain(getattr(x, f.name)) for f in dataclasses.fields(x))]
    return x


def _row(run: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(run)))


def _run(row: dict[str, Any]) -> Any:
    from symmem.record.fsdp_pipeline_runs import StageMeshRun

    return StageMeshRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in row.items()})


@functools.cache
def _stored() -> dict[str, list[dict[str, Any]]]:
    return json.loads(DATA.read_text())["mesh"] if DATA.exists() else {}


def stored(cases: list[Any]) -> list[list[Any]]:
    """Per rank, the stored run of each of ``cases``, as the spawns give them."""
    table = _stored()
    missing = [c for c in cases if key(c) not in table]
    assert not missing, f"not in {DATA.name} (store them: SYMMEM_STORE_MESHES=1, -m deep): {missing}"
    rows = [table[key(c)] for c in cases]
    return [[_run(r[rank]) for r in rows] for rank in range(len(rows[0]))]


def against_stored(cases: list[Any], runs: list[list[Any]]) -> None:
    """Fresh runs of ``cases`` (per rank, per case) against :data:`DATA`'s, every field to the byte; with
    ``SYMMEM_STORE_MESHES=1`` written there instead (the file's other cases kept)."""
    fresh = {key(c): [_row(rank[k]) for rank in runs] for k, c in enumerate(cases)}
    if os.environ.get("SYMMEM_STORE_MESHES") == "1":
        table = {**_stored(), **fresh}
        lines = [f"  {json.dumps(k)}: [\n" + ",\n".join(f"   {json.dumps(r, sort_keys=True)}" for r in rows) + "]"
                 for k, rows in sorted(table.items())]
        DATA.write_text(f'{{"what": {json.dumps(WHAT)},\n "mesh": {{\n' + ",\n".join(lines) + "}}\n")
        _stored.cache_clear()
        return
    table = _stored()
    wrong = [f"{k}: stored {table.get(k)}, measured {v}" for k, v in fresh.items() if table.get(k) != v]
    assert not wrong, "\n".join(wrong)


def rerun(runner: Any, cases: list[Any]) -> list[list[Any]]:
    """``cases`` in a fresh 2 x 2 spawn of ``runner`` (each file's own: ``fsdp_pipeline_runs`` or
    ``ddp_pipeline_runs``), every rank with no late free and one first and one steady step, against
    :data:`DATA` (:func:`against_stored`); per rank, per case."""
    everything = runner(2, 2, cases, start_method=START)
    assert all((r.late, r.repeats) == (0, (1, 1)) for rank in everything for r in rank), everything
    against_stored(cases, everything)
    return everything


@functools.cache
def _live_meshes() -> dict[str, list[Any]]:
    """The 2 x 2 meshes' LIVE cases of tests/test_fsdp_pipeline.py (FSDP2), tests/test_tensor_pipeline.py (TP, SP)
    and tests/test_ddp_pipeline.py (DDP, its bucket view, ZeRO-1) in ONE spawn of four ranks (the first of those
    tests to run pays it): per case, per rank."""
    import test_ddp_pipeline as ddp
    import test_fsdp_pipeline as fsdp
    import test_tensor_pipeline as tensor

    from symmem.record.mesh_runs import mesh_runs

    cases = [c for module in (fsdp, tensor, ddp) for k, c in enumerate(module.mesh_cases()) if k in module.LIVE]
    runs = mesh_runs(2, 2, cases, start_method=START)
    return {key(c): [rank[k] for rank in runs] for k, c in enumerate(cases)}


def mesh_ranks(cases: list[Any], live: tuple[int, ...]) -> list[list[Any]]:
    """Per rank, per case of ``cases``: the ``live`` ones (indices) measured now in the meshes' one spawn, every one
    of their ranks with no late free and one first and one steady step, and equal to its stored row; the others
    :data:`DATA`'s."""
    found = _live_meshes()
    runs = stored([c for k, c in enumerate(cases) if k not in live]) if len(live) < len(cases) else []
    rest = iter(zip(*runs, strict=True)) if runs else iter(())
    columns = [found[key(c)] if k in live else list(next(rest)) for k, c in enumerate(cases)]
    table = _stored()
    for k in live:
        assert all((r.late, r.repeats) == (0, (1, 1)) for r in columns[k]), (k, columns[k])
        # the live ranks are the stored ones too (stored from each file's own spawn: the one spawn changes nothing)
        assert key(cases[k]) not in table or [_row(r) for r in columns[k]] == table[key(cases[k])], (k, columns[k])
    return [list(rank) for rank in zip(*columns, strict=True)]
