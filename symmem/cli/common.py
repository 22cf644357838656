"""What the commands that derive a formula share: their options, and the derivation those options describe.

Nothing the user types is ever evaluated: ``--set`` parses integers.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any

from ..errors import SymmemError
from ..units import MAX_SIZE

#: the forms of a SPEC, a module to trace (``symmem trace``; :mod:`symmem.importer.sources`)
SPEC_FORMS = ("package.module:callable, path/to/file.py:callable, hf:MODEL_TYPE | hf:org/name | hf:DIR | "
              "hf:path/config.json, torchvision:NAME or timm:NAME")

_SET = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")
_INT = re.compile(r"^[+]?[0-9][0-9_]*$")


def parse_assignment(text: str) -> tuple[str, int]:
    """``NAME=VALUE`` with VALUE a positive integer (underscores allowed: ``1_000``).

    >>> parse_assignment("B=32")
    ('B', 32)
    >>> parse_assignment("B=2.5")
    Traceback (most recent call last):
    symmem.errors.SymmemError: --set B=2.5: '2.5' is not a positive integer
    """
    m = _SET.match(text)
    if not m:
        raise SymmemError(f"--set {text!r}: expected NAME=VALUE, e.g. --set B=32")
    name, raw = m.groups()
    shown = raw if len(raw) <= 40 else f"{raw[:20]}...({len(raw)} characters)"
    if not _INT.match(raw):
        raise SymmemError(f"--set {name}={shown}: {shown!r} is not a positive integer")
    digits = raw.replace("_", "").lstrip("+").lstrip("0")
    if len(digits) > len(str(MAX_SIZE)) or (digits and int(digits) > MAX_SIZE):
        # checked on the digits first: Python refuses to convert more than 4300 of them
        raise SymmemError(f"--set {name}={shown}: more than the largest size PyTorch allows (2**63 - 1)")
    if not digits:
        raise SymmemError(f"--set {name}={shown}: {shown!r} is not a positive integer")
    return name, int(digits)


def assignments(items: Sequence[str] | None) -> list[tuple[str, int]]:
    """Every ``--set``'s assignments: one each, or several separated by commas (``--set N=8,t=2``).

    >>> assignments(["B=32", "N=8, t=2"])
    [('B', 32), ('N', 8), ('t', 2)]
    >>> assignments(["B=1,000"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    symmem.errors.SymmemError: --set B=1,000: '000' is not NAME=VALUE (separate assignments with commas, ...
    """
    out = []
    for item in items or ():
        parts = item.split(",") if "," in item else [item]
        for part in parts:
            if len(parts) > 1 and not _SET.match(part):
                shown = item if len(item) <= 40 else f"{item[:37]}..."
                raise SymmemError(f"--set {shown}: {part.strip()[:20]!r} is not NAME=VALUE (separate assignments "
                                  "with commas, e.g. --set N=8,t=2; write a number without commas: 1000 or 1_000)")
            out.append(parse_assignment(part))
    return out


def _parse_sets(items: Sequence[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, value in assignments(items):
        if name in out:
            raise SymmemError(f"--set {name} is given twice ({name}={out[name]} and {name}={value}); give it once")
        out[name] = value
    return out


def parse_free(text: str | None) -> tuple[str, ...] | None:
    """``--free B,S`` as names; None when the option is absent.

    >>> parse_free("B, S")
    ('B', 'S')
    """
    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(","))
    if not names or any(not n.isidentifier() for n in names):
        raise SymmemError(f"--free {text[:60]!r}: expected symbol names separated by commas, e.g. --free B,S")
    return tuple(dict.fromkeys(names))


def _option_type(key: str, defaults: list[Any]) -> Any:
    """How to read a builder option from the command line, from the type of its defaults."""
    kinds = {type(d) for d in defaults}
    if kinds <= {int} and not any(isinstance(d, bool) for d in defaults):
        return int
    if kinds <= {int, float}:
        return float
    if kinds <= {tuple}:
        def sizes(text: str) -> tuple[int, ...]:
            parts = re.split(r"[x,]", text.strip())
            if not parts or not all(_INT.match(x) and int(x) > 0 for x in parts):
                raise SymmemError(f"--{key} {text!r}: expected positive integers like 3,224,224")
            return tuple(int(x) for x in parts)

        return sizes
    return str


def add_model_options(p: argparse.ArgumentParser) -> None:
    """One option per builder option of the built-in models (``symmem models -v`` lists them)."""
    from ..models import available

    uses: dict[str, list[tuple[str, Any]]] = {}
    for name, e in sorted(available().items()):
        for key, o in e.options.items():
            uses.setdefault(key, []).append((name, o))
    group = p.add_argument_group("model options (each applies to the models named; see `symmem models -v`)")
    for key, found in sorted(uses.items()):
        options = [o for _, o in found]
        choices = None
        if all(o.choices for o in options):
            choices = list(dict.fromkeys(c for o in options for c in o.choices or ()))
        models = sorted({m for m, _ in found})
        shown = ", ".join(models) if len(models) <= 4 else f"{', '.join(models[:3])} and {len(models) - 3} more"
        defaults = sorted({str(o.default) for o in options})
        default = defaults[0] if len(defaults) == 1 else "per model"
        group.add_argument(f"--{key.replace('_', '-')}", dest=key, type=_option_type(key, [o.default for o in options]),
                           choices=choices, default=None,
                           help=f"{_help(key, options)} ({shown}; default: {default})")


def _help(key: str, options: list[Any]) -> str:
    helps = {o.help for o in options}
    return helps.pop() if len(helps) == 1 else f"the {key} of each model (`symmem models -v` says what it sets)"


def model_option_names() -> set[str]:
    from ..models import available

    return {key for e in available().values() for key in e.options}


def add_derive_options(p: argparse.ArgumentParser, *, convention: str = "pytorch", regime: bool = True,
                       optional_model: bool = False) -> None:
    """The options every command that derives a formula shares; ``regime=False`` leaves out the training regime
    (a command that measures one forward pass has none to take); ``optional_model``: the model may be left out
    (``verify --module``)."""
    from ..conventions import names as convention_names

    p.add_argument("model", help=f"a built-in model (see `symmem models`) or a module to trace: "
                   f"{SPEC_FORMS} (with --dims)", **({"nargs": "?"} if optional_model else {}))
    p.add_argument("--convention", default=convention, choices=convention_names(),
                   help="which tensors are kept (default: %(default)s; a traced module: what PyTorch kept)")
    add_formula_options(p, regime=regime)
    add_trace_options(p.add_argument_group("a module traced from a SPEC (the forms of `symmem trace`)"),
                      dims_required=False)


def add_formula_options(p: argparse.ArgumentParser, *, regime: bool = True, model_options: bool = True,
                        front: str = "derive") -> None:
    """What every command that derives shares past the model: optimizer and precision, the builder options
    (``model_options``), ``--set``/``--free``/``--per-layer``, ``--device``, ``--loss`` and the training
    regime (``regime``).  ``symmem trace`` takes them without the builder options.  ``--precision``,
    ``--device`` and ``--loss`` mean what :mod:`symmem.options` says, with its defaults, in every command."""
    from ..options import add_arguments
    from ..training import OPTIMIZERS

    if regime:
        p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS), help="default: %(default)s")
    add_arguments(p, front, ("precision",))
    if model_options:
        add_model_options(p)
    p.add_argument("--set", action="append", metavar="NAME=VALUE", default=[],
                   help="give a symbol a value, e.g. --set B=32 or --set N=8,t=2 (repeatable)")
    p.add_argument("--free", default=None, metavar="A,B,...",
                   help="symbols to keep in the formula (default: the model's)")
    p.add_argument("--per-layer", action="store_true", help="one repeated layer instead of the whole model")
    add_arguments(p, front, ("device", "loss", "autocast"))
    if not regime:
        return
    group = p.add_argument_group("training regime (docs/regimes.md); sizes are symbols N, t, p: --set t=8")
    from ..options import add_arguments

    add_arguments(group, "derive", ("checkpoint",))
    group.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                       help="ZeRO stage over N data-parallel ranks (3 = FSDP full sharding)")
    from ..training import DATA_PARALLEL

    group.add_argument("--data-parallel", default=None, choices=list(DATA_PARALLEL), metavar="ENGINE",
                       help="the data-parallel engine each of N ranks runs, per rank (docs/regimes.md): "
                            f"{', '.join(DATA_PARALLEL)}; B is one rank's batch")
    from ..training import PARAM_DTYPES, REDUCE_DTYPES

    group.add_argument("--param-dtype", default=None, choices=list(PARAM_DTYPES),
                       help="with --data-parallel fsdp or fsdp-no-reshard: FSDP2's MixedPrecisionPolicy(param_dtype="
                            "...): all-gathers, unsharded parameters, forward and backward in this dtype; shards, "
                            "sharded gradients and the optimizer stay FP32 (--precision's presets are the papers' "
                            "accounting)")
    group.add_argument("--reduce-dtype", default=None, choices=list(REDUCE_DTYPES),
                       help="with --param-dtype: the policy's reduce_dtype, the reduce-scatter's (default: float32, "
                            "as torchtitan sets it)")
    group.add_argument("--tensor-parallel", action="store_true", help="Megatron tensor parallelism over t ranks")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="with --tensor-parallel: split the remaining activations over t too")
    group.add_argument("--pipeline-parallel", nargs="?", const="1f1b", default=None, choices=["1f1b", "gpipe"],
                       metavar="SCHEDULE",
                       help="p pipeline stages, schedule 1f1b (no value) or gpipe; derive shows the first stage as "
                            "the papers count it and the peak of the largest stage as torch.distributed.pipelining "
                            "runs it (--micro-batches M per step), symmem stages every stage")
    add_step_options(group)


def add_step_options(p: Any) -> None:
    """How the training loop runs its step: what the peak depends on beyond the kept tensors."""
    from ..training import IMPLS

    p.add_argument("--optimizer-impl", default="auto", choices=list(IMPLS),
                   help="how optimizer.step() runs (default: auto = PyTorch's choice: for-loop on CPU, foreach "
                        "on CUDA)")
    p.add_argument("--keep-logits", action="store_true",
                   help="the loop holds the model's output through backward (HF output objects; out = model(x))")
    p.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="gradient accumulation: K forward/backward passes per optimizer step (default: 1)")


def derivation_from_args(args: argparse.Namespace) -> Any:
    """The derivation the shared options describe: a built-in model derived, or a SPEC traced
    (:func:`traced_derivation`)."""
    from ..api import derive

    if is_spec(args.model):
        return traced_derivation(args)
    builtin_only(args)
    return derive(args.model, **derive_arguments(args))


def sees_nothing(d: Any) -> str | None:
    """The note that says the convention sees nothing of the model (its activations are 0 because it cannot see
    the graph: the engine's ``NothingCounted``, "model: why"), or None.  Other notes (the domain at the numbers
    given, per rank, how a trace was found) inform: they do not stop a fit or a sweep, which solve for a size.

    >>> import warnings
    >>> from symmem import derive
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     sees_nothing(derive("resnet50-v1", convention="megatron"))[:51]
    'resnet50-v1: the megatron convention counts tensors'
    >>> sees_nothing(derive("gpt-megatron")) is None   # a note on B = 1, its default, outside its domain
    True
    """
    if d.activations != 0:
        return None
    return next((n for n in d.notes if n.startswith(f"{d.model}: ")), None)


def acceptor_from_args(args: argparse.Namespace) -> Any:
    """:func:`symmem.api.acceptor` for the model, values and regime the shared options describe (for a traced
    SPEC: the model's own limits, :func:`traced_derivation`)."""
    from ..api import acceptor

    if is_spec(args.model):
        return _limit_acceptor(getattr(args, "limits", {}))
    kw = derive_arguments(args)
    for key in ("per_layer", "free", "options"):
        kw.pop(key)
    return acceptor(args.model, **kw)


def derive_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`symmem.api.derive` that the shared options give."""
    from ..models import entry

    e = entry(args.model)
    model_options = {k: getattr(args, k) for k in sorted(model_option_names()) if getattr(args, k, None) is not None}
    unknown = [k for k in model_options if k not in e.options]
    if unknown:
        has = ", ".join(f"--{k.replace('_', '-')}" for k in e.options) or "none"
        raise SymmemError(f"model {args.model!r} has no option --{unknown[0].replace('_', '-')}; its options: {has}")
    conv_options = {"device": args.device} if args.device is not None else {}
    return dict(convention=args.convention, per_layer=args.per_layer, values=_parse_sets(args.set),
                free=free_from_args(args), options=conv_options, loss=args.loss,
                **regime_from_args(args), **model_options, **autocast_from_args(args))


def plan_arguments(args: argparse.Namespace, *replaced: str) -> dict[str, Any]:
    """:func:`derive_arguments` for a command that follows an engine's plan (``stages``, ``ranks``): without what
    the plan replaces -- the convention and its options, per-layer and free symbols, the pipeline flags, and
    ``replaced`` -- and with the device, where given, as a keyword."""
    kw = derive_arguments(args)
    for key in ("convention", "per_layer", "free", "options", "pipeline_parallel", "pipeline_schedule", *replaced):
        kw.pop(key, None)
    if args.device is not None:
        kw["device"] = args.device
    return kw


def autocast_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--autocast DTYPE`` as the keyword every front takes (none when it is not given)."""
    autocast = getattr(args, "autocast", None)
    return {} if autocast is None else {"autocast": autocast}


def free_from_args(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--free B,S`` as names (None: the model's own)."""
    return parse_free(args.free)


def values_from_args(args: argparse.Namespace) -> dict[str, int]:
    """``--set NAME=VALUE`` items as a dict."""
    return _parse_sets(args.set)


def regime_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The training regime's fields from their options (each field has an option of the same name)."""
    from ..api import REGIME_FIELDS

    # every regime field has an option of the same name: a new regime knob needs its option above, nothing here
    found = {f: getattr(args, f) for f in REGIME_FIELDS if hasattr(args, f)}
    if "pipeline_parallel" in found:  # --pipeline-parallel [SCHEDULE]: the flag and the schedule in one option
        schedule = found.pop("pipeline_parallel")
        found["pipeline_parallel"] = schedule is not None
        found["pipeline_schedule"] = schedule or "1f1b"
    return found


def add_output_options(p: argparse.ArgumentParser) -> None:
    """``--format`` and the text/LaTeX layout options of ``symmem derive`` (and ``symmem trace``)."""
    p.add_argument("--format", choices=["text", "latex", "json"], default="text")
    view = p.add_argument_group("text and LaTeX layout")
    view.add_argument("--width", type=_width, default=None, metavar="COLUMNS",
                      help="text table width (default: the terminal's, else 100)")
    view.add_argument("--fold", action="store_true", help="text: one row per group, without its terms")
    view.add_argument("--cut", action="store_true",
                      help="text: each formula on one line, cut with an ellipsis (information lost)")
    view.add_argument("--latex-form", choices=["compact", "terms"], default="compact",
                      help="LaTeX: one line per group, a repeated layer once times its count (compact), or one "
                           "line per kept tensor (terms)")


def _width(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--width takes a number of columns, not {text!r}") from None
    if not 40 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"--width must be between 40 and 1000 columns, not {value}")
    return value


def emit(d: Any, args: argparse.Namespace) -> None:
    """Print a derivation as the output options say: the text table, LaTeX (``align*``) or JSON."""
    import json

    if args.format == "json":
        print(json.dumps(d.to_dict(), indent=2))
    elif args.format == "latex":
        from ..report.latex import align

        print(align(d, form=args.latex_form))
    else:
        from ..report.text import summary

        print(summary(d, width=args.width, fold=args.fold, cut=args.cut))


# -- a module traced from a SPEC (symmem trace, symmem verify --module) ------------------------------------
def add_trace_options(p: Any, *, dims_required: bool = True) -> None:
    """Where the module comes from and how it is traced: ``--dims``, ``--config``, ``--example``, ``--method``,
    ``--multiple-of``, ``--no-check``."""
    p.add_argument("--dims", required=dims_required, metavar="B,S | B=INPUT:DIM,...",
                   help="the sizes to keep symbolic: conventional positions on the first tensor input (B 0; tokens "
                        "S 1; images C 1, Hi 2, Wi 3) or explicit pairs, e.g. B=input_ids:0,S=input_ids:1")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="hf: override a key of the transformers config (int, float, true/false or a string; "
                        "repeatable, or comma-separated: --config n_layer=2,n_embd=64; a string with a comma in "
                        "quotes: --config 'name=\"a,b\"'), e.g. --config n_layer=2; attn_implementation=eager|sdpa "
                        "picks the attention")
    p.add_argument("--example", action="append", default=[], metavar="SIZES[:DTYPE]",
                   help="example inputs for a callable that returns a module alone, e.g. --example 2x3x32x32 "
                        "(float, random) or --example 2x8:int64 (zeros); repeatable, positional")
    p.add_argument("--method", default="auto", choices=["auto", "symbolic", "fit"],
                   help="auto: symbolic, retraced or fitted where the module specializes on a size; symbolic: "
                        "never fit; fit: concrete sizes only (default: %(default)s)")
    p.add_argument("--multiple-of", default=None, metavar="Hi=32,Wi=32",
                   help="trace those sizes as multiples of a number (stride arithmetic stays polynomial; the "
                        "domain says so)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the real forward at the example sizes that checks the formula")
    p.add_argument("--lora", default=None, metavar="r=8,alpha=16,targets=q_proj,v_proj",
                   help="fine-tune with LoRA adapters (peft): the weights frozen, the adapters the only trainable "
                        "parameters; targets default to peft's for the model type (docs/fine-tuning.md)")


def traced_from_args(args: argparse.Namespace, **derive_options: Any) -> tuple[Any, Any, Any]:
    """The loaded module, its declared sizes and the :class:`~symmem.derivation.Derivation` of its trace."""
    from ..importer import sources

    # --loss means what it means everywhere (symmem.options); an hf: causal LM computes its cross-entropy (or its
    # own loss) from labels, which loading it with a loss gives it
    hf_loss = args.loss if args.spec.startswith("hf:") and args.loss != "sum" else None
    if hf_loss is None:
        derive_options.setdefault("loss", args.loss)
    derive_options.update(autocast_from_args(args))
    loaded = sources.load(args.spec, config=sources.parse_config(args.config), loss=hf_loss, inputs=args.example)
    loaded = loaded.to(args.device or "cpu")  # traced for a device, checked and measured there
    loaded = sources.with_lora(loaded, sources.parse_lora(getattr(args, "lora", None)))
    for note in loaded.notes:
        import sys

        print(f"symmem: note: {note}", file=sys.stderr)
    dims = sources.parse_dims(args.dims, loaded)
    d = sources.trace(loaded, dims, method=args.method, check=not args.no_check,
                      multiple_of=sources.parse_multiples(args.multiple_of), device=args.device or "cpu",
                      values=values_from_args(args), free=free_from_args(args), **derive_options)
    return loaded, dims, d


def add_symbolic_options(p: Any) -> None:
    """``--symbolic`` and ``--symbolic-peak``: config keys of an ``hf:`` model as symbols of the formula
    (:func:`symbolic_from_args`; ``symmem trace``, and a SPEC given to ``derive``, ``fit`` and ``plot``)."""
    p.add_argument("--symbolic", default=None, metavar="SYM=config_key,...",
                   help="hf: make config keys symbols of the formula too, e.g. --symbolic H=hidden_size,"
                        "F=intermediate_size,h=num_attention_heads,G=num_key_value_heads,V=vocab_size,"
                        "L=num_hidden_layers (traced at small configurations, fitted exactly, checked at two "
                        "more; --set H=5120 evaluates); one symbol for several equal keys with |, e.g. an "
                        "encoder-decoder's stacks: 'L=encoder_layers|decoder_layers'")
    p.add_argument("--symbolic-peak", action="store_true",
                   help="with --symbolic: also the peak of the training step in every size (the step recorded at "
                        "each fitted configuration, its layers written out 4 and 5 times: several times slower)")


def symbolic_from_args(args: argparse.Namespace, **derive_options: Any) -> Any:
    """The derivation of an ``hf:`` model with the ``--symbolic`` config keys as symbols; ``args.dims_symbols``
    keeps the sizes declared on the inputs."""
    import dataclasses

    from ..api import trace
    from ..importer import sources
    from ..importer.hf_sizes import hf_sizes, parse_symbolic
    from ..importer.symbolic_sizes import Plan

    if not args.spec.startswith("hf:"):
        raise SymmemError("--symbolic maps symbols to keys of a transformers config: it applies to hf:MODEL_TYPE; "
                          "from Python, symmem.trace(build, dims=..., sizes={...}) takes any module built from sizes")
    if args.multiple_of is not None:
        raise SymmemError("--multiple-of does not go with --symbolic: trace the image sides without it")
    hf_loss = args.loss if args.loss != "sum" else None
    derive_options["loss"] = "output" if hf_loss is not None else args.loss
    model = hf_sizes(args.spec, parse_symbolic(args.symbolic), sources.parse_config(args.config), hf_loss)
    plan = Plan.of(model.sizes, model.divisible)
    with sources.user_code(f"{args.spec}: building the module"):
        first = model.load(plan.sizes_at(plan.base))
    dims = sources.parse_dims(args.dims, first)
    args.dims_symbols = tuple(dims)
    args.hf_sizes = model  # verify --symbolic builds the real model at other sizes
    meaning = ", ".join(f"{s} = {k}" for s, k in model.keys.items())
    try:
        with sources.user_code(f"{args.spec}: tracing the module"):
            d = trace(model.build, dims=dims, sizes=model.sizes, divisible=model.divisible, method=args.method,
                      device=args.device or "cpu", name=args.spec, values=values_from_args(args),
                      free=free_from_args(args), **derive_options)
    except SymmemError:
        raise
    except Exception as exc:
        raise SymmemError(f"{args.spec} cannot be traced on fake tensors: {type(exc).__name__}: "
                          f"{str(exc).strip()[:200]}") from None
    inputs = ", ".join(f"{n} = {', '.join(f'{k}:{i}' for k, i in pairs)}" for n, pairs in dims.items())
    said = (f"symbols: {meaning} (config keys of {args.spec}; the config's values: "
            f"{', '.join(f'{s}={v}' for s, v in model.sizes.items())}); {inputs} (input dimensions)")
    # the config keys go with the formula, so that every view says what each symbol stands for
    return dataclasses.replace(d, notes=(said, *d.notes), options={**d.options, "config_keys": dict(model.keys)})


# -- a SPEC given where a built-in model's name goes (derive, fit, plot, verify) -------------------------------
def is_spec(text: str | None) -> bool:
    """Whether ``text`` names a module to trace (a SPEC: it has a ``:`` or names a ``.py`` file) rather than a
    built-in model, whose names are plain words.

    >>> is_spec("hf:gpt2"), is_spec("models/net.py:build"), is_spec("net.py"), is_spec("gpt2")
    (True, True, True, False)
    """
    return isinstance(text, str) and (":" in text or text.endswith(".py"))


#: the options that say how a SPEC is traced: (argument name, what it is when not given)
TRACE_ONLY = (("dims", None), ("config", []), ("example", []), ("method", "auto"), ("multiple_of", None),
              ("no_check", False), ("lora", None), ("symbolic", None), ("symbolic_peak", False))


def builtin_only(args: argparse.Namespace) -> None:
    """Refuse the trace options for a built-in model (they say how a SPEC is traced)."""
    given = [f"--{k.replace('_', '-')}" for k, unset in TRACE_ONLY if getattr(args, k, unset) != unset]
    if given:
        raise SymmemError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a module traced from a "
                          f"SPEC ({SPEC_FORMS}), not to the built-in model {args.model!r}")


def traced_derivation(args: argparse.Namespace) -> Any:
    """The derivation of the module ``args.model`` (a SPEC) names, traced as ``symmem trace`` traces it, with the
    model's own limits (a position table: :func:`symmem.importer.limits.model_limits`, and the tables the forward
    looked up at positions: :mod:`symmem.importer.index_ranges`) added to its domain; ``args.limits`` keeps them
    (condition -> why) for :func:`acceptor_from_args`."""
    if args.model.endswith(".py"):
        raise SymmemError(f"{args.model}: name the callable that builds the module, e.g. {args.model}:build")
    if getattr(args, "dims", None) is None:
        raise SymmemError(f"{args.model}: a traced module needs --dims, the sizes to keep symbolic, e.g. --dims B,S")
    if getattr(args, "convention", "pytorch") != "pytorch":
        raise SymmemError(f"--convention {args.convention}: a traced module has its own convention (what PyTorch "
                          "kept); drop --convention")
    given = [k for k in sorted(model_option_names()) if getattr(args, k, None) is not None]
    if given:
        raise SymmemError(f"--{given[0].replace('_', '-')} is an option of the built-in models; a module's own "
                          "options are its code (hf: --config key=value)")
    args.spec = args.model
    if getattr(args, "symbolic", None) is not None:  # config keys as symbols: traced as `symmem trace` does
        d = symbolic_from_args(args, per_layer=getattr(args, "per_layer", False),
                               peak=getattr(args, "symbolic_peak", False), **regime_from_args(args))
        args.limits = dict(d.why)  # the model's limits, in d's domain already (symmem.trace adds them): fit caps there
        return d
    if getattr(args, "symbolic_peak", False):
        raise SymmemError("--symbolic-peak goes with --symbolic: without it the peak is traced at the sizes given")
    _, dims, d = traced_from_args(args, per_layer=getattr(args, "per_layer", False), **regime_from_args(args))
    # the model's own limits (a config's position table, a table the forward looked up at positions), in d's domain
    # already (symmem.trace adds them) and said there: fit caps there
    args.limits = dict(d.why)
    args.dims_symbols = tuple(dims)  # the sizes declared on the inputs (fit says where each held size comes from)
    return d


def _limit_acceptor(limits: dict[Any, str]) -> Any:
    """``accepts(name, value)`` for a traced module: why ``value`` of ``name`` lies past the model's limits."""
    import sympy

    def accepts(name: str, value: int) -> str | None:
        for cond, why in limits.items():
            sym = next(iter(cond.free_symbols))
            if sym.name == name and cond.xreplace({sym: sympy.Integer(value)}) is sympy.false:
                return why
        return None

    return accepts
