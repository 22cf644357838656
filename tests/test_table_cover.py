"""The tables thinned by coverage still keep, in the default suite, every line their deep cases run.

Each file of ``THINNED`` runs twice under ``tests/table_cover.py``'s plugin, each run in a process of its own: as the
default suite runs it, and with its tables' kept cases swapped for their deep ones; a deep case may run no line the
default run does not (``table_cover.missing`` says why the file and not the table).  A change to what a deep case runs
that the default suite no longer runs fails here, naming the lines: keep that case, or another that runs them
(docs/testing.md, "Tables thinned by coverage").  Deep: each file runs traced, a few times its plain cost; needs
``coverage`` (not a test extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.table_cover import missing

#: file -> its tables thinned by coverage (docs/testing.md's "Stop 42: ..." sections list what each keeps)
THINNED: dict[str, tuple[str, ...]] = {
    "tests/test_cuda_engines_measured.py": (
        "test_peak_allocated_equals_the_h200",
    ),
    "tests/test_cuda_measured.py": (
        "test_formula_equals_the_h100",
    ),
    "tests/test_cuda_pipeline_measured.py": (
        "test_every_stage_on_the_h200",
        "test_every_ranks_optimizer_step_on_the_h200",
    ),
    "tests/test_cuda_selective_measured.py": (
        "test_eager_attention_on_the_h200",
    ),
    "tests/test_cuda_stop37_measured.py": (
        "test_requested_bytes_every_rank",
        "test_max_memory_allocated_every_rank",
        "test_live_bytes_every_rank",
    ),
    "tests/test_cuda_world2_measured.py": (
        "test_peak_allocated_against_two_ranks_on_the_h200",
        "test_zero_redundancy_every_rank_against_two_ranks_on_the_h200",
    ),
    "tests/test_dp_walk_shortcuts.py": (
        "test_the_shortcuts_give_the_long_ways_answer",
    ),
    "tests/test_evaluator.py": (
        "test_every_quantity_and_term_equals_sympy_substitution",
        "test_peak_equals_sympy_substitution",
        "test_interpreted_first_configuration_equals_compiled",
        "test_values_over_a_grid_equal_one_at_a_time",
    ),
    "tests/test_factoring.py": (
        "test_field_form_equals_the_formula_and_reads_as_the_field_writes",
    ),
    "tests/test_fit.py": (
        "test_a_symbol_that_follows_moves_with_the_solved_one",
    ),
    "tests/test_hf_llama.py": (
        "test_llama_equals_transformers_own_on_one_device",
    ),
    "tests/test_importer.py": (
        "test_a_torch_that_pins_sizes_is_named",
    ),
    "tests/test_lm_loss.py": (
        "test_causal_lm_loss_equals_measured_bytes",
    ),
    "tests/test_lora.py": (
        "test_the_adapters_are_the_only_trainable_parameters",
        "test_the_peak_is_a_real_steps",
    ),
    "tests/test_options_effect.py": (
        "test_an_option_the_convention_does_not_see_is_refused",
        "test_checkpointing_a_model_without_a_repeated_layer_is_refused",
    ),
    "tests/test_peak.py": (
        "test_peak_equals_real_step",
    ),
    "tests/test_peak_invariants.py": (
        "test_every_way_of_asking_gives_the_largest_moment",
    ),
    "tests/test_pipeline_shortcuts.py": (
        "test_a_segment_moved_is_the_segment_walked",
        "test_an_engine_segment_moved_is_the_segment_walked",
        "test_sequence_parallel_at_one_read_alone_at_once",
    ),
    "tests/test_properties.py": (
        "test_layer_times_count_plus_the_rest_is_the_whole",
    ),
    "tests/test_pytorch_sequence.py": (
        "test_formula_equals_measured_bytes",
        "test_bfloat16_formula_equals_measured_bytes",
    ),
    "tests/test_rank_shortcuts.py": (
        "test_each_rank_at_numbers_is_its_formula_there",
    ),
    "tests/test_readme.py": (
        "test_cli_example_is_current",
    ),
    "tests/test_report_text.py": (
        "test_every_formula_parses_back_and_fits",
    ),
    "tests/test_startup.py": (
        "test_topological_order_is_networkx_order",
    ),
    "tests/test_trace_peak.py": (
        "test_a_stack_with_per_layer_types_folds_in_L",
        "test_regimes_equal_real_forwards_and_steps",
        "test_a_loss_reduces_the_first_tensor_of_any_output",
    ),
    "tests/test_traced_input.py": (
        "test_input_kept_by_block_zero_counted_once",
    ),
    "tests/test_walk_shortcuts.py": (
        "test_candidates_at_the_probes_equal_sympys_evaluation",
    ),
}


def _run(root: str, out, args: list[str]) -> dict[str, dict]:
    env = {**os.environ, "SYMMEM_TABLE_COVER": str(out), "PYTHONPATH": root}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.table_cover", "-n", "0", "-q",
                           "-p", "no:cacheprovider", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["tests"]


@pytest.mark.deep
@pytest.mark.parametrize("path", sorted(THINNED))
def test_the_kept_cases_run_every_line_of_the_moved(path: str, tmp_path) -> None:
    pytest.importorskip("coverage")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tables = {f"{path}::{table}" for table in THINNED[path]}
    default = _run(root, tmp_path / "default.json", [path])
    listed = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "--collect-only", "-q",
                             "-p", "no:cacheprovider", "-m", "deep", path], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": root}, timeout=600).stdout.splitlines()
    deep = [line for line in listed if line.split("[")[0] in tables]
    assert {line.split("[")[0] for line in deep} == tables, "a table named in THINNED has no deep case"
    swapped = [k for k in default if k.split("[")[0] not in tables] + deep
    moved = _run(root, tmp_path / "moved.json", ["-m", "deep or not deep", *swapped])
    for table in sorted(tables):
        lines = missing(default, moved, table)
        assert not lines, f"{table}: deep cases run lines the default run does not: {sorted(lines)}"
