"""The catalog of transformers models in their own sizes (issue 20): regenerates ``docs/catalog.md``.

For each model type, the config's sizes that exist among hidden_size (H), intermediate_size (F),
num_attention_heads (h), num_key_value_heads (G), vocab_size (V) and num_hidden_layers (L) become symbols
(:mod:`symmem.importer.hf_sizes`); the model is traced at small configurations and every kept storage and
parameter fitted exactly, then checked at two configurations never fitted (:mod:`symmem.importer.symbolic_sizes`:
the fit refuses when they disagree).  A model type that cannot be built from its config's defaults or traced on fake
tensors is listed with the reason, in one line.  Run (a few minutes on two cores)::

    PYTHONPATH=. python benchmarks/catalog.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: decoder-only, MoE, encoder-only, vision, encoder-decoder: each built as symmem trace hf:TYPE builds it
MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "gpt_neox", "opt",
               "bloom", "falcon", "gptj", "codegen", "olmo", "olmo2", "stablelm", "starcoder2", "granite", "cohere",
               "gpt_bigcode", "gpt_neo", "biogpt", "xglm", "helium", "glm", "smollm3", "mixtral", "qwen2_moe", "bert",
               "roberta", "xlm-roberta", "camembert", "distilbert", "albert", "electra", "ernie", "megatron-bert",
               "vit", "deit", "dinov2", "t5", "bart")
#: config values a tiny configuration needs: a padding id inside a small vocabulary, rotary within the smallest head
OVERRIDES: dict[str, dict[str, object]] = {"phi3": {"pad_token_id": 0}, "gptj": {"rotary_dim": 4},
                                           "codegen": {"rotary_dim": 4}}
CANONICAL = {"H": "hidden_size", "F": "intermediate_size", "h": "num_attention_heads", "G": "num_key_value_heads",
             "V": "vocab_size", "L": "num_hidden_layers"}
MEANING = {"H": "hidden size", "F": "MLP size", "h": "attention heads", "G": "key/value groups", "V": "vocabulary",
           "L": "layers", "B": "batch", "S": "tokens (or image patches + 1)"}


def symbols_of(model_type: str) -> tuple[dict[str, str], dict[str, object]]:
    """The symbols the config has (as a positive integer) and the config overrides tracing needs."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    keys = {}
    for s, key in CANONICAL.items():
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            keys[s] = key
    config: dict[str, object] = dict(OVERRIDES.get(model_type, {}))
    if "G" in keys and "h" in keys and cfg.num_key_value_heads == cfg.num_attention_heads:
        config["num_key_value_heads"] = max(1, cfg.num_attention_heads // 4)  # grouped, so G is a symbol of its own
    return keys, config


def one(model_type: str) -> dict[str, object]:
    """One row: the per-layer activations and parameters, the parameters in all, the symbols, the time."""
    from symmem import Regime
    from symmem.engine import derivation_of
    from symmem.importer import sources
    from symmem.importer import traced as tracing
    from symmem.importer.hf_sizes import hf_sizes
    from symmem.importer.symbolic_sizes import Plan, fit_sizes

    keys, config = symbols_of(model_type)
    model = hf_sizes(f"hf:{model_type}", keys, config, None)
    plan = Plan.of(model.sizes, model.divisible)
    first = model.load(plan.sizes_at(plan.base))
    vision = "pixel_values" in (first.example_inputs if isinstance(first.example_inputs, dict) else {})
    dims = sources.parse_dims("B" if vision else "B,S", first)
    start = time.perf_counter()
    recorded = fit_sizes(model.build, model.sizes, dims, divisible=model.divisible, device="cpu")
    seconds = time.perf_counter() - start
    regime = Regime(optimizer="adamw")
    values = {"L": model.sizes["L"]} if "L" in model.sizes else None
    whole = derivation_of(tracing.ledger_of(recorded, regime, name=model_type, values=values), regime)
    layer = derivation_of(tracing.ledger_of(recorded, regime, name=model_type, values=values, per_layer=True), regime)
    note = next(n for n in recorded.notes if n.startswith("every size symbolic"))
    return {"type": model_type, "class": first.extra.get("class", ""), "keys": {**model.keys},
            "divisible": model.divisible, "layer": layer.activations, "layer_params": layer.parameters,
            "params": whole.parameters, "traces": note.split(" traces")[0].split()[-1], "seconds": seconds,
            "domain": recorded.domain}


def render(rows: list[dict[str, object]], failed: list[tuple[str, str]]) -> str:
    import platform

    import sympy
    import torch
    import transformers

    def cell(e: object) -> str:
        text = str(sympy.factor_terms(sympy.sympify(e)))
        return f"`{text}`".replace("|", "\\|")

    out = ["# Catalog: transformers models in their own sizes", "",
           "Generated by `benchmarks/catalog.py` (do not edit by hand) with torch "
           f"{torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}.", "",
           "Each row: the model built by `symmem trace hf:TYPE` (its config's defaults; grouped key/value heads "
           "where the config has them), its sizes as symbols (`--symbolic`), fitted exactly from traces at small "
           "configurations and **checked at two configurations never fitted** (the fit refuses otherwise); bytes "
           "in FP32, the CPU's kernels (sdpa where transformers picks it), the step backpropagating from the "
           "output's sum.  Per layer: what one repeated layer keeps for backward, and its parameters.  The peak "
           "of a training step in every size is `symmem trace hf:TYPE --symbolic ... --symbolic-peak` (the step "
           "recorded at every fitted configuration, its layers written out 4 and 5 times: minutes for all these "
           "sizes, so not in this table); `symmem trace hf:TYPE` without `--symbolic` gives it at one "
           "configuration.", "",
           "Symbols: " + ", ".join(f"{s} = {m}" for s, m in MEANING.items()) + "; the domain of every row includes "
           "each divisibility it needs (H by h, h by G) and each size at least 2.", "",
           "| type | class | symbols | activations per layer (bytes) | parameters per layer | parameters | traces |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        syms = ", ".join(f"{s}={k}" for s, k in r["keys"].items())  # type: ignore[union-attr]
        out.append(f"| {r['type']} | {r['class']} | {syms} | {cell(r['layer'])} | {cell(r['layer_params'])} | "
                   f"{cell(r['params'])} | {r['traces']} ({r['seconds']:.0f} s) |")
    if failed:
        out += ["", "## Not in the catalog", "", "| type | why |", "|---|---|"]
        out += [f"| {t} | {why.replace('|', '/')} |" for t, why in failed]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    from symmem.errors import SymmemError

    rows, failed = [], []
    for t in argv or MODEL_TYPES:
        try:
            rows.append(one(t))
            print(f"{t}: {rows[-1]['traces']} traces, {rows[-1]['seconds']:.1f} s", flush=True)
        except SymmemError as e:
            failed.append((t, str(e)[:300]))
            print(f"{t}: not catalogued: {str(e)[:200]}", flush=True)
        except Exception as e:  # a model's own code on fake tensors: listed with its reason, the rest goes on
            failed.append((t, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:250] if str(e).strip() else ''}"))
            print(f"{t}: failed: {failed[-1][1][:200]}", flush=True)
    (ROOT / "docs" / "catalog.md").write_text(render(rows, failed))
    print(f"docs/catalog.md: {len(rows)} model types, {len(failed)} not catalogued")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
