"""The catalog of transformers models in their own sizes (issue 20): regenerates ``docs/catalog.md``.

For each model type, the config's sizes that exist among hidden_size (H), intermediate_size (F),
num_attention_heads (h), num_key_value_heads (G), vocab_size (V) and num_hidden_layers (L) become symbols
(:mod:`symmem.importer.hf_sizes`; an encoder-decoder's two stacks share each symbol: ``F=encoder_ffn_dim|
decoder_ffn_dim``, ``L`` its encoder and decoder layers); the model is traced at small configurations and every
kept storage and parameter fitted exactly, then checked at two configurations never fitted
(:mod:`symmem.importer.symbolic_sizes`: the fit refuses when they disagree).

The steady-step peak per layer: the ordinary traced peak of a training step (AdamW, for-loop) at the fit's base
configuration, symbolic in B, S and the layer count L (the layers written out 4 and 5 times and folded,
:mod:`symmem.importer.traced_step`), is a ``Max`` of moments each ``a*L + b``: the column is ``a`` of the moments
that win for many layers (those whose ``a`` no other's exceeds for every B, S).  When generated it is checked at two
configurations never traced (other B, S and 7 and 9 layers) against a real step's live bytes
(:func:`symmem.record.steps.track_step`).  A model type that cannot be built from its config's defaults or traced on
fake tensors is listed with the reason, in one line.  Run (about half an hour on two cores; given model types,
their rows replace those of the page; ``--render`` rewrites the page from ``docs/catalog.json``)::

    PYTHONPATH=. python benchmarks/catalog.py [MODEL_TYPE ... | --render]
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
               "vit", "deit", "dinov2", "t5", "bart", "mbart", "pegasus", "marian", "blenderbot", "m2m_100")
#: config values a tiny configuration needs: a padding id inside a small vocabulary, rotary within the smallest head
OVERRIDES: dict[str, dict[str, object]] = {"phi3": {"pad_token_id": 0}, "gptj": {"rotary_dim": 4},
                                           "codegen": {"rotary_dim": 4},
                                           # as many decoder layers as encoder layers, so L counts both stacks
                                           "blenderbot": {"decoder_layers": 2},
                                           # every layer runs (layerdrop skips layers at random in training)
                                           "m2m_100": {"encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0},
                                           "marian": {"pad_token_id": 0, "decoder_start_token_id": 0}}
CANONICAL = {"H": "hidden_size", "F": "intermediate_size", "h": "num_attention_heads", "G": "num_key_value_heads",
             "V": "vocab_size", "L": "num_hidden_layers"}
#: where the canonical key is missing or one stack's: the keys that stand for the same size (the first that exists)
ALTERNATIVES = {"F": (("intermediate_size",), ("encoder_ffn_dim", "decoder_ffn_dim"), ("d_ff",)),
                "h": (("num_attention_heads", "decoder_attention_heads"),),
                "L": (("num_hidden_layers", "decoder_layers", "num_decoder_layers"),),
                "V": (("vocab_size", "decoder_vocab_size"),)}
#: the configurations the peak per layer is checked at: (B, S, layers), never traced
PEAK_CHECKS = ((3, 5, 7), (2, 6, 9))
MEANING = {"H": "hidden size", "F": "MLP size", "h": "attention heads", "G": "key/value groups", "V": "vocabulary",
           "L": "layers", "B": "batch", "S": "tokens (or image patches + 1)"}


def symbols_of(model_type: str) -> tuple[dict[str, str], dict[str, object]]:
    """The symbols the config has (as a positive integer; one symbol for keys of the same size, ``a|b``) and the
    config overrides tracing needs."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {}))

    def size(key: str) -> object:
        value = getattr(cfg, key, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    keys = {}
    for s, key in CANONICAL.items():
        for group in ALTERNATIVES.get(s, ((key,),)):
            if size(group[0]) is not None:
                keys[s] = "|".join(k for k in group if size(k) == size(group[0]))
                break
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
    row = {"type": model_type, "class": first.extra.get("class", ""), "keys": {**model.keys},
           "divisible": model.divisible, "layer": layer.activations, "layer_params": layer.parameters,
           "params": whole.parameters, "traces": note.split(" traces")[0].split()[-1], "seconds": seconds,
           "domain": recorded.domain}
    start = time.perf_counter()
    from symmem.importer.symbolic_sizes import Stacks

    try:
        if isinstance(recorded.layers, Stacks):
            raise RuntimeError(f"L counts {' and '.join(r.path for r in recorded.layers.runs)}"
                               f"{' (a first block keeping more)' if recorded.layers.extras else ''}; a traced peak "
                               "folds one run of identical layers")
        row["peak"], row["peak_at"] = peak_per_layer(model, plan.sizes_at(plan.base), "B" if vision else "B,S")
    except Exception as e:  # the row stands without its peak; the reason is listed
        row["peak"], row["peak_at"] = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    row["peak_seconds"] = time.perf_counter() - start
    return row


def per_layer(peak: object, layers: object) -> object:
    """``a`` of the moments ``a*L + b`` of a peak that win for many layers: the ``L`` coefficients no other's
    exceeds for every size (a difference with no negative coefficient in B, S), one formula or their ``Max``."""
    import sympy

    moments = peak.args if isinstance(peak, sympy.Max) else (peak,)
    slopes = {sympy.expand(sympy.expand(m).coeff(layers)) for m in moments}

    def below(a: object, b: object) -> bool:  # a <= b for every B, S >= 2 (the domain): no negative coefficient
        d = sympy.expand(b - a)   # in B - 2, S - 2
        d = sympy.expand(d.xreplace({x: x + 2 for x in d.free_symbols}))
        return d != 0 and all(c >= 0 for c in sympy.Poly(d, *sorted(d.free_symbols, key=str) or [layers]).coeffs())

    top = [a for a in slopes if not any(below(a, b) for b in slopes)]
    return top[0] if len(top) == 1 else sympy.Max(*top)


def peak_per_layer(model: object, sizes: dict[str, int], dims_text: str) -> tuple[object, str]:
    """The steady-step peak per layer at ``sizes`` (module docstring), checked against real steps at
    :data:`PEAK_CHECKS`; and where it holds (the sizes)."""
    import sympy

    import symmem
    from symmem.importer import sources
    from symmem.record.steps import track_step

    loaded = model.load(sizes)
    dims = sources.parse_dims(dims_text, loaded)
    d = symmem.trace(loaded.module, loaded.example_inputs, dims=dims, optimizer="adamw", optimizer_impl="for-loop",
                     device="cpu")
    peak = d.peak
    layers = next((s for s in peak.free_symbols if s.name == "L"), None)
    if layers is None:
        raise RuntimeError("the traced peak has no layer count L (no repeated layers folded)")
    for b, n_tokens, n_layers in PEAK_CHECKS:
        real_module = model.load({**sizes, "L": n_layers})
        inputs = _resized(real_module.example_inputs, dims, {"B": b, "S": n_tokens})
        names = list(inputs) if isinstance(inputs, dict) else None
        module = _Keywords(real_module.module, names) if names else real_module.module
        args = tuple(inputs.values()) if names else tuple(inputs)
        real = track_step(module, args, optimizer="adamw", impl="for-loop", keep_output=False).steady.bytes
        at = {"L": n_layers, "B": b, **({"S": n_tokens} if "S" in dims else {})}
        want = d.at(**at).value("peak")
        if want != real:
            raise RuntimeError(f"the traced peak {want} misses the real step's {real} at {at}")
    return sympy.expand(per_layer(peak, layers)), ", ".join(f"{k}={v}" for k, v in sizes.items() if k != "L")


def _resized(example: object, dims: dict[str, list[tuple[object, int]]], at: dict[str, int]) -> object:
    """The example inputs with the declared dimensions at ``at`` (token ids drawn below 4, the rest normal)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    items = dict(example) if isinstance(example, dict) else dict(enumerate(example))
    out = {}
    for key, t in items.items():
        if not isinstance(t, torch.Tensor):
            out[key] = t
            continue
        shape = list(t.shape)
        for name, places in dims.items():
            for where, axis in places:
                if where == key and name in at:
                    shape[axis] = at[name]
        out[key] = (torch.randint(0, 4, shape, generator=gen, dtype=t.dtype) if not t.dtype.is_floating_point
                    else torch.randn(shape, generator=gen, dtype=t.dtype))
    return out if isinstance(example, dict) else tuple(out.values())


class _Keywords(__import__("torch").nn.Module):
    """A module taking keyword inputs, called with them in order (track_step passes positional inputs)."""

    def __init__(self, module: object, names: list[str]) -> None:
        super().__init__()
        self.module, self.names = module, names

    def forward(self, *values: object) -> object:
        return self.module(**dict(zip(self.names, values, strict=True)))


def render(rows: list[dict[str, object]], failed: list[tuple[str, str]], seconds: float = 0.0) -> str:
    import platform

    import sympy
    import torch
    import transformers

    def cell(e: object) -> str:
        text = str(sympy.factor_terms(sympy.sympify(e)))
        return f"`{text}`".replace("|", "\\|")

    out = ["# Catalog: transformers models in their own sizes", "",
           "Generated by `benchmarks/catalog.py` (do not edit by hand) with torch "
           f"{torch.__version__}, transformers {transformers.__version__}, sympy {sympy.__version__}, Python "
           f"{platform.python_version()}, in {seconds / 60:.0f} minutes on two shared CPU cores.", "",
           "Each row: the model built by `symmem trace hf:TYPE` (its config's defaults; grouped key/value heads "
           "where the config has them), its sizes as symbols (`--symbolic`; an encoder-decoder's two stacks share "
           "each symbol, `F=encoder_ffn_dim|decoder_ffn_dim`, and `L` counts the layers of each stack), fitted "
           "exactly from traces at small configurations and **checked at two configurations never fitted** (the fit "
           "refuses otherwise); bytes in FP32, the CPU's kernels (sdpa where transformers picks it), the step "
           "backpropagating from the output's sum.  Per layer: what one repeated layer keeps for backward (for an "
           "encoder-decoder one encoder and one decoder layer), and its parameters.", "",
           "**Steady-step peak per layer**: the peak of a training step (AdamW, for-loop implementation) traced at "
           "the small configuration in the last column, symbolic in B, S and the layer count L, is a `Max` of moments "
           "`a*L + b`; the column is `a` of the moments that win for many layers (parameters, gradients and AdamW's "
           "two states of one layer, and what its backward holds).  Each was **checked when generated against a "
           "real step's live bytes** (`symmem.record.steps.track_step`) at two configurations never traced: "
           + ", ".join(f"B={b}, S={t}, {n} layers" for b, t, n in PEAK_CHECKS) + ".  The peak in every size is "
           "`symmem trace hf:TYPE --symbolic ... --symbolic-peak` (minutes a model, so not in this table).", "",
           "Symbols: " + ", ".join(f"{s} = {m}" for s, m in MEANING.items()) + "; the domain of every row includes "
           "each divisibility it needs (H by h, h by G) and each size at least 2; *G = h too*: fitted at G < h and "
           "checked at G = h at two more configurations, one formula for multi-head and grouped-query attention (the "
           "others hold for h >= 2G: their head size is a key of its own, so h divides no symbol).", "",
           "| type | class | symbols | activations per layer (bytes) | parameters per layer | parameters | traces "
           "| steady-step peak per layer (bytes) | peak traced at |",
           "|---|---|---|---|---|---|---|---|---|"]
    no_peak = []
    for r in rows:
        syms = ", ".join(f"{s}={k}" for s, k in r["keys"].items()).replace("|", "\\|")  # type: ignore[union-attr]
        if "h >= G" in str(r.get("domain", "")):  # fitted at G < h, checked at G = h: one formula for both
            syms += " (G = h too)"
        peak = cell(r["peak"]) if r.get("peak") is not None else "—"
        where = r["peak_at"] if r.get("peak") is not None else "—"
        if r.get("peak") is None:
            no_peak.append((r["type"], r.get("peak_at", "")))
        out.append(f"| {r['type']} | {r['class']} | {syms} | {cell(r['layer'])} | {cell(r['layer_params'])} | "
                   f"{cell(r['params'])} | {r['traces']} ({r['seconds']:.0f} s) | {peak} | "
                   f"{where} ({r.get('peak_seconds', 0):.0f} s) |")
    if no_peak:
        out += ["", "## No peak per layer", "", "| type | why |", "|---|---|"]
        out += [f"| {t} | {str(why).replace('|', '/')} |" for t, why in no_peak]
    if failed:
        out += ["", "## Not in the catalog", "", "| type | why |", "|---|---|"]
        out += [f"| {t} | {why.replace('|', '/')} |" for t, why in failed]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    import json

    from symmem.errors import SymmemError

    if argv == ["--render"]:  # the page again from docs/catalog.json, tracing nothing
        return write(**json.loads((ROOT / "docs" / "catalog.json").read_text()))
    rows, failed = [], []
    start = time.perf_counter()
    for t in argv or MODEL_TYPES:
        try:
            rows.append(one(t))
            print(f"{t}: {rows[-1]['traces']} traces, {rows[-1]['seconds']:.1f} s; peak per layer "
                  f"{rows[-1]['peak'] if rows[-1]['peak'] is not None else rows[-1]['peak_at']}", flush=True)
        except SymmemError as e:
            failed.append((t, str(e)[:300]))
            print(f"{t}: not catalogued: {str(e)[:200]}", flush=True)
        except Exception as e:  # a model's own code on fake tensors: listed with its reason, the rest goes on
            failed.append((t, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:250] if str(e).strip() else ''}"))
            print(f"{t}: failed: {failed[-1][1][:200]}", flush=True)
    text = [{k: (str(v) if k in ("layer", "layer_params", "params", "peak", "domain") else v) for k, v in r.items()}
            for r in rows]
    seconds = time.perf_counter() - start
    if argv:  # some types again: their rows and failures replace those of the page, in the catalog's order
        old = json.loads((ROOT / "docs" / "catalog.json").read_text())
        order = {t: i for i, t in enumerate(MODEL_TYPES)}
        text = sorted([r for r in old["rows"] if r["type"] not in argv] + text, key=lambda r: order.get(r["type"], 99))
        failed = sorted([tuple(f) for f in old["failed"] if f[0] not in argv] + failed,
                        key=lambda f: order.get(f[0], 99))
        seconds += old["seconds"]
    # the rows as text (notebook 06 reads them rather than tracing forty models again; --render rewrites the page)
    (ROOT / "docs" / "catalog.json").write_text(json.dumps(
        {"rows": text, "failed": failed, "seconds": seconds}, indent=1, default=str) + "\n")
    return write(text, failed, seconds)


def write(rows: list[dict[str, object]], failed: list[tuple[str, str]], seconds: float) -> int:
    """docs/catalog.md from the rows as text (docs/catalog.json: our own output, parsed with the symbols' names)."""
    import sympy

    names = {n: sympy.Symbol(n, positive=True, integer=True) for n in MEANING}
    parsed = [{**r, **{k: (sympy.parse_expr(r[k], local_dict=names) if r.get(k) not in (None, "None") else None)
                       for k in ("layer", "layer_params", "params", "peak")}} for r in rows]
    (ROOT / "docs" / "catalog.md").write_text(render(parsed, [tuple(f) for f in failed], seconds))
    print(f"docs/catalog.md: {len(rows)} model types, {len(failed)} not catalogued")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
