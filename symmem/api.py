"""The fronts users call: :func:`derive` a built-in model by name (or a built one), :func:`trace` their own
``nn.Module``, :func:`show` either in a notebook.

They sit above the core: each reads its arguments -- a model's builder options, the regime's fields, the
convention's options, as keywords -- makes a :class:`~symmem.ledger.Ledger` through its front (a graph under a
convention, :func:`symmem.engine.ledger_of`; a traced module, :func:`symmem.importer.traced.ledger_of`), and hands it to
the one back half (:func:`symmem.engine.derivation_of`).  The core never imports this module, the zoo or the
views.

>>> d = derive("vit-b16", convention="paper", attention="sdpa", per_layer=True)
>>> d.activations / 4
9*B*H*S
>>> round(derive("resnet50-v1", convention="paper").value("total") / 2**30, 4)
3.0246
>>> derive("resnet50-v1").convention                   # the default: what PyTorch autograd keeps
'pytorch'
>>> derive("resnet18", convention="pytorch", device="cpu").options["device"]
'cpu'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import sympy

from .conventions import Convention
from .conventions import convention as get_convention
from .derivation import Derivation, warn_outside
from .engine import Acceptor, derivation, derivation_of
from .errors import SymmemError
from .graph import Model
from .options import check_effect, check_precision, check_step, resolve
from .step import Refused
from .training import Regime

#: The regime's fields, which :func:`derive` and :func:`trace` take as keywords.
REGIME_FIELDS = tuple(f.name for f in dataclasses.fields(Regime))


def derive(model: Model | str, convention: str | Convention = "pytorch", regime: Regime | None = None,
           values: Mapping[str, int] | None = None, *, per_layer: bool = False,
           free: tuple[str, ...] | None = None, options: Mapping[str, Any] | None = None,
           loss: str | None = "sum", **keywords: Any) -> Derivation:
    """Derive the training memory of ``model``.

    ``model`` is a :class:`~symmem.graph.Model` or a built-in name.  Keywords are, by name: a field of the
    training regime (``optimizer``, ``precision``, ``checkpoint`` (none, full, selective, every-K), ``zero``
    (0-3), ``tensor_parallel`` ...; see :class:`~symmem.training.Regime`), an option of the convention
    (``device="cpu"``), or an option of the model's builder (``attention="naive"``).  ``regime`` gives the
    regime as one value instead.  ``values`` override symbol values for evaluation (``{"B": 32}``); ``free``
    names the symbols to keep in the formula (default: the model's).  ``options`` are convention options as
    a mapping.  ``loss`` (``"cross-entropy"``) appends a loss after the model's output, as its own group; its
    kept tensors are the category ``loss``; the default, ``"sum"``, appends none (the step backpropagates from
    the output's sum).  ``device``, ``loss``, ``checkpoint``, ``precision`` and ``autocast`` mean what they mean
    in :func:`trace` and on the command line (:mod:`symmem.options`).
    """
    model, conv, regime, conv_options = _setup(model, convention, regime, options, loss, keywords, per_layer)
    d = _where_it_holds(derivation(model, conv, regime, values, options=conv_options, per_layer=per_layer,
                                   free=free), conv, model)
    limits = position_limits(model, d.free)
    if limits:  # the model's position table joins the domain: at(S=2048) is said past it, as a traced model's is
        d = dataclasses.replace(d, domain=sympy.And(d.domain, *limits), why={**d.why, **limits})
    if values:  # numbers asked for outside the formulas' domain: said, never printed silently
        warn_outside(d.domain, d.numbers)
    return d


def position_limits(model: Model, free: tuple[sympy.Symbol, ...]) -> dict[Any, str]:
    """``{condition: why}``: the bounds a built-in model's embeddings put on its free symbols (GPT-2's ``wpe``:
    ``S <= 1024``), from the graph's assumptions at its ``embedding`` nodes -- what the real model refuses past
    (an index beyond the table's rows).  :func:`derive` refuses numbers past them when it derives; the domain
    keeps them for :meth:`~symmem.derivation.Derivation.at` and ``values`` afterwards."""
    graph = model.graph
    out: dict[Any, str] = {}
    for node, cond, rhs in graph.assumptions:
        if rhs is not None or not isinstance(cond, sympy.core.relational.Relational) or isinstance(cond, sympy.Eq) \
                or not cond.free_symbols or not cond.free_symbols <= set(free):
            continue
        found = graph.node(node)
        if found.kind == "embedding":
            rows = found.attrs.get("num_embeddings")
            out[cond] = f"past the model's position table: {node} has {int(rows):,} rows"
    return out


#: What a derivation says where its numbers lie outside the convention's domain (:meth:`holds`).
OUTSIDE = ("at these sizes the formulas count a copy PyTorch does not make (at B = 1 a batched matmul folds a head "
           "view into its batch and keeps the view's base): they hold where {domain} (docs/pytorch-sequence.md, "
           "Known gaps)")


def _where_it_holds(d: Derivation, conv: Convention, model: Model) -> Derivation:
    """``d`` with the convention's own domain (:meth:`~symmem.conventions.pytorch.PytorchConvention.holds`: where
    its rules give what PyTorch keeps) added to its domain, in its free symbols, and a note where its numbers lie
    outside."""
    holds = getattr(conv, "holds", None)
    where = holds(model.graph) if holds is not None else True
    if where is True or where == sympy.true:
        return d
    others = {s: sympy.Integer(v) for s, v in d.numbers.items() if s not in d.free}
    where = where.xreplace(others)
    if where == sympy.true:
        return d
    notes = d.notes
    if where.xreplace({s: sympy.Integer(v) for s, v in d.numbers.items()}) == sympy.false:
        notes = (*notes, OUTSIDE.format(domain=where))
    domain = where if d.domain == sympy.true else sympy.And(d.domain, where)
    return dataclasses.replace(d, domain=domain, notes=notes)


def _regime(regime: Regime | None, keywords: dict[str, Any]) -> Regime:
    """The regime ``regime`` gives, or the one its fields among ``keywords`` give (taken out of them)."""
    regime_options = {k: keywords.pop(k) for k in REGIME_FIELDS if k in keywords}
    if regime is None:
        return Regime(**regime_options)
    if not isinstance(regime, Regime):
        raise SymmemError(f"regime must be a symmem Regime, got {regime!r}; give optimizer=... as a keyword")
    if regime_options:
        raise SymmemError(f"give the regime once: as regime=... or as {', '.join(sorted(regime_options))}")
    return regime


def _options(options: Mapping[str, Any] | None, known: Mapping[str, Any], keywords: dict[str, Any]
             ) -> dict[str, Any]:
    """The convention's options: ``options`` and those of ``keywords`` the convention knows (taken out)."""
    if options is not None and not isinstance(options, Mapping):
        raise SymmemError(f"options must map convention options to values, got {options!r}")
    found = dict(options or {})
    found.update({k: keywords.pop(k) for k in list(keywords) if k in known})
    return found


def _unknown(keywords: Mapping[str, Any], convention: str) -> SymmemError:
    return SymmemError(f"unknown options {sorted(keywords)}: not a regime field ({', '.join(REGIME_FIELDS)}), "
                       f"not an option of the {convention} convention, and builder options need a model name")


def _setup(model: Model | str, convention: str | Convention, regime: Regime | None,
           options: Mapping[str, Any] | None, loss: str | None, keywords: dict[str, Any], per_layer: bool = False
           ) -> tuple[Model, Convention, Regime, dict[str, Any]]:
    """What :func:`derive`'s arguments name: the model (built, with its loss), the convention, the regime and
    the convention's options; an option that would have no effect is refused (:func:`symmem.options.check_effect`)."""
    if keywords.get("autocast") is not None and keywords.get("param_dtype") is not None:
        raise SymmemError(f"autocast={keywords['autocast']!r} is torch.autocast over FP32 weights and param_dtype="
                          f"{keywords['param_dtype']!r} FSDP2's MixedPrecisionPolicy, which casts the parameters "
                          "themselves (no autocast): give param_dtype alone")
    shared = resolve("derive", device=keywords.pop("device", None), loss=loss,
                     autocast=keywords.pop("autocast", None))
    if shared.device is not None:
        keywords["device"] = shared.device  # the pytorch convention's option (another convention refuses it)
    conv = get_convention(convention)
    regime = _regime(regime, keywords)
    conv_options = _options(options, conv.options, keywords)
    builder = dict(keywords)
    if isinstance(model, str):
        from .models import build

        model = build(model, **keywords)
    elif not isinstance(model, Model):
        raise SymmemError(f"model must be a built-in model's name or a symmem Model, got {type(model).__name__}")
    elif keywords:
        raise _unknown(keywords, conv.name)
    check_effect(conv, regime, model=model.name, repeated=bool(model.graph.blocks), builder=builder,
                 loss=shared.loss, per_layer=per_layer)
    if shared.loss != "sum":
        from .loss import with_loss

        model = with_loss(model, shared.loss)
    return model, conv, regime, conv_options


def pipeline_stages(model: Model | str, *, schedule: str = "1f1b", micro_batches: int = 1,
                    values: Mapping[str, int] | None = None, loss: str | None = "sum", **keywords: Any) -> Any:
    """Each pipeline stage's memory under ``torch.distributed.pipelining`` (``schedule`` ``1f1b`` or ``gpipe``,
    ``micro_batches`` M per step, ``p`` stages: ``values={"p": 4}``), as a
    :class:`~symmem.passes.model_parallel.Pipeline`; the other arguments are :func:`derive`'s (one device: the
    stages are cut from its storages; the pytorch convention)."""
    from .passes.model_parallel import Pipeline, pipeline_peaks, requires, stages
    from .passes.regimes import DEFAULTS

    keywords = {k: v for k, v in keywords.items() if k not in ("pipeline_parallel", "pipeline_schedule")}
    if keywords.get("data_parallel"):  # FSDP on every stage: passes/fsdp_pipeline.py, through derive
        raise SymmemError(f"the stages here are one pipeline's, without an engine: with data_parallel="
                          f"{keywords['data_parallel']!r} derive gives every rank's peak (values.peak_per_rank)")
    if keywords.get("tensor_parallel"):  # TP x pipeline on a p x t mesh: passes/tensor_pipeline.py, through derive
        raise SymmemError("the stages here are one pipeline's, at whole tensors: with tensor parallelism derive gives "
                          "every rank's peak (values.peak_per_rank, values.peak_per_stage)")
    given = dict(values or {})
    p_value = given.pop("p", DEFAULTS[sympy.Symbol("p", positive=True, integer=True)])
    built, conv, regime, conv_options = _setup(model, "pytorch", None, None, loss, keywords)
    d = derivation(built, conv, regime, given, options=conv_options)
    numbers = {s.name: int(v) for s, v in d.numbers.items()}
    requires(p_value, numbers.get("L"), schedule, micro_batches)
    # the convention's options as the derivation resolved them (a built-in model's device is cuda unless given)
    resolved = {k: d.options[k] for k in conv.options if k in d.options}
    found = stages(built.graph, d.storages, regime, schedule=schedule, micro_batches=micro_batches,
                   device=str(resolved.get("device", "cpu")))
    numbers = {**numbers, "p": int(p_value)}
    peaks = tuple(pipeline_peaks(built.graph, conv, resolved, regime, numbers, found, schedule=schedule,
                                 micro_batches=micro_batches))
    return Pipeline(found, numbers, schedule, micro_batches, peaks)


def tensor_parallel_rank(model: Model | str, *, values: Mapping[str, int] | None = None, **keywords: Any) -> Any:
    """One tensor-parallel rank's memory under DTensor's standard plan (``parallelize_module``), as a
    :class:`~symmem.passes.model_parallel.TensorRank` of formulas in ``t`` (``sequence_parallel=True``: with
    DTensor's sequence parallelism); arguments are :func:`derive`'s (one
    device: the rank is worked out from its storages; the pytorch convention, FP32 AdamW)."""
    from .passes.model_parallel import tensor_rank

    if model != "llama":
        raise SymmemError(f"the standard tensor-parallel plan is Llama's (q/k/v, gate/up, o/down), measured on the "
                          f"Llama reference; not {model if isinstance(model, str) else 'this model'}")
    sequence = bool(keywords.pop("sequence_parallel", False))
    keywords = {k: v for k, v in keywords.items() if k != "tensor_parallel"}
    loss = keywords.pop("loss", "sum")
    rank = keywords.pop("rank", 0)
    built, conv, regime, conv_options = _setup(model, "pytorch", None, None, loss, keywords)
    d = derivation(built, conv, regime, values, options=conv_options)
    if regime.data_parallel is not None:  # FSDP x TP on an N x t mesh: ``rank`` in the data-parallel group
        from .passes.fsdp1 import FSDP1
        from .passes.fsdp1_tensor import mesh1_rank
        from .passes.fsdp_tensor import mesh_rank
        from .training import Regime

        Regime(data_parallel=regime.data_parallel, tensor_parallel=True, sequence_parallel=sequence)  # refusals
        world = (values or {}).get("N")
        if isinstance(world, int) and isinstance(rank, int) and not 0 <= rank < world:
            raise SymmemError(f"rank {rank} is no place in a data-parallel group of N={world} (0 to {world - 1})")
        return (mesh1_rank if regime.data_parallel in FSDP1 else mesh_rank)(built.graph, d.storages, regime, rank,
                                                                             sequence)
    if rank != 0:
        raise SymmemError("rank names a place in a data-parallel group: give data_parallel='fsdp' or 'fsdp1' (FSDP x "
                          "TP); every tensor-parallel rank alone holds the same")
    return tensor_rank(built.graph, d.storages, regime, sequence)


def acceptor(model: Model | str, values: Mapping[str, int] | None = None, *, regime: Regime | None = None,
             loss: str | None = "sum", convention: str | Convention = "pytorch", **keywords: Any) -> Acceptor:
    """A function ``accepts(name, value)`` saying why the model refuses ``value`` for the symbol ``name`` (with
    ``values`` for the others), or None when it accepts it: the checks :func:`derive` makes of numbers, without
    deriving.  Arguments are :func:`derive`'s.  :func:`symmem.apps.budget.largest` uses it to answer only with values
    the model accepts.

    >>> accepts = acceptor("gpt2")
    >>> accepts("h", 12) is None
    True
    >>> print(accepts("h", 13))
    node 'h.attn.query_split' (reshape): needs h to divide H (Mod(H, h) = 0), which fails at H=768, h=13; ...
    """
    model, conv, regime, _ = _setup(model, convention, regime, None, loss, dict(keywords))
    if values is not None and not isinstance(values, Mapping):
        raise SymmemError(f"values must map symbol names to positive integers ({{'B': 32}}), got {values!r}")
    return Acceptor(model, conv, regime, values or {})


def trace(module: Any, example_inputs: Any = None, dims: dict[str, Any] | None = None, *, method: str = "auto",
          check: bool = True, multiple_of: dict[str, int] | None = None, device: str | None = None,
          training: bool = True, name: str | None = None, loss: Any = "sum", autocast: str | None = None,
          size_one: bool = False, sizes: Mapping[str, int] | None = None,
          divisible: Mapping[str, str | int] | None = None, **options: Any) -> Derivation:
    """The training memory of ``module`` as a :class:`~symmem.derivation.Derivation`, its formula in the
    declared symbols (see :func:`symmem.importer.trace_module` for ``example_inputs``, ``dims``, ``method``,
    ``check`` and ``multiple_of``).  Keywords are :func:`derive`'s: the training regime (``optimizer``,
    ``precision``, ``zero``, ``optimizer_impl``, ``keep_logits``, ``micro_batches`` ...), ``values`` (sizes to
    evaluate at; default: the examples) and ``free``.  Precision of the activations is the module's: trace a
    ``bfloat16`` module for 16-bit ones, or give ``autocast="bfloat16"`` (``torch.autocast`` around the forward
    and the loss).  ``checkpoint="full"`` runs each repeated block under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (or name the children: a container's path
    or a list of paths); the kept storages and the peak then show it.  ``device`` is whose kernels are traced:
    by default the module's own (where its parameters are; the CPU for a module without any).

    The derivation's :attr:`~symmem.derivation.Derivation.peak` is the peak of the module's real training step,
    traced on fake tensors (:mod:`symmem.importer.traced_step`): the forward, the ``loss`` (``"sum"`` of the output,
    ``"cross-entropy"`` against a drawn target over the last dimension, ``"output"``: the module's own, e.g. a
    Hugging Face model given ``labels``, or a callable of the output), ``backward()``, ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``.  ``size_one=True`` also traces every size at 1 and makes the formulas
    exact there (a ``Piecewise`` in ``Eq(X, 1)`` where the value differs).

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    >>> d = trace(net, (torch.zeros(2, 784),), {"B": [(0, 0)]}, optimizer="adam", loss="cross-entropy")
    >>> d.activations, d.input, d.value("parameters")
    (1024*B, 3136*B, 203530)

    The peak is the module's own training step, traced on fake tensors op by op (:mod:`symmem.importer.traced_step`):

    >>> d.peak      # Adam's for-loop step: sqrt and its division of the largest weight, alive together
    Max(3144*B + 4862128, 6216*B + 2452664)
    >>> d.at(B=1024).peak_at().where()
    'backward aten.threshold_backward.default (ReluBackward0) in 1, steady step'

    **Every size symbolic** (:mod:`symmem.importer.symbolic_sizes`): give ``module`` as a callable that builds the
    module and its example inputs from keyword sizes, and ``sizes`` (name -> the value the formula is evaluated
    at; ``L`` is the count of the repeated blocks).  The module is traced at small configurations and each
    quantity recovered as the exact polynomial in the sizes, checked at two configurations never fitted;
    ``divisible`` maps a size to the size (or integer) that divides it (``{"H": "h"}``: a whole head size).
    ``peak=True`` also derives the peak of the training step in every size (:mod:`symmem.importer.sized_step`:
    the step recorded at the fit's configurations with the layers written out 4 and 5 times, each storage's
    bytes the exact polynomial in the sizes; two records per configuration, so it costs several times the fit).

    >>> def build(H, F, L):
    ...     torch.manual_seed(0)
    ...     blocks = [torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.ReLU(), torch.nn.Linear(F, H))
    ...               for _ in range(L)]
    ...     return torch.nn.Sequential(torch.nn.Linear(H, H), *blocks), (torch.zeros(2, H),)
    >>> d = trace(build, dims={"B": [(0, 0)]}, sizes={"H": 512, "F": 2048, "L": 4}, optimizer="sgd")
    >>> d.activations, d.parameters
    (4*B*F*L + 4*B*H*L, 2*F*H*L + F*L + H**2 + H*L + H)
    """
    import dataclasses

    import sympy

    from .importer import trace_module
    from .importer import traced as tracing
    from .importer.index_ranges import table_why, tightest
    from .importer.limits import model_limits

    if "convention" in options:
        raise SymmemError("a traced module is derived under the traced convention: what PyTorch itself kept")
    shared = resolve("trace", device=device, loss=loss, checkpoint=options.pop("checkpoint", "none"),
                     autocast=autocast)
    loss = shared.loss
    regime_given = options.get("regime")
    policy = options.get("param_dtype", getattr(regime_given, "param_dtype", None))
    if policy is not None:  # FSDP2's MixedPrecisionPolicy: measured for the built-in models' steps only
        also = f"; autocast={autocast!r} is torch.autocast over FP32 weights, another thing" if autocast else ""
        raise SymmemError(f"param_dtype={policy!r} (FSDP2's MixedPrecisionPolicy) is modelled for the built-in "
                          f"models (gpt2, llama ...), not a traced module's step{also}")
    checkpoint = tracing.checkpoint_option(shared.checkpoint)
    if sizes is not None or divisible is not None:  # module builds a module per configuration: no weights to read yet
        options["step"] = options.pop("peak", False)
        return _trace_sizes(module, example_inputs, dims, sizes, divisible, shared.device or "cpu", dict(
            method=method, training=training, autocast=autocast, checkpoint=checkpoint), multiple_of, size_one,
            name, loss, options)
    if not hasattr(module, "parameters"):
        raise SymmemError("trace needs an nn.Module, or a callable that builds one with sizes=: got "
                          f"{type(module).__name__}")
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    check_precision(options.get("precision", getattr(regime_given, "precision", "fp32")), autocast, dtypes)
    if dims is None:
        raise SymmemError("trace needs dims: the input sizes to keep symbolic, e.g. {'B': [(0, 0)]}")
    device = shared.device or _device_of(module)
    recorded = trace_module(module, example_inputs, dims, device=device, training=training, method=method,
                            check=check, multiple_of=multiple_of, autocast=autocast, checkpoint=checkpoint,
                            size_one=size_one)
    keywords = dict(options)
    values, per_layer, free = keywords.pop("values", None), keywords.pop("per_layer", False), keywords.pop("free", None)
    regime = _regime(keywords.pop("regime", None), keywords)
    conv_options = _options(keywords.pop("options", None), {}, keywords)  # what PyTorch kept has no options
    if keywords:
        raise _unknown(keywords, "traced")
    if conv_options:
        raise SymmemError(f"convention 'traced' has no option {next(iter(conv_options))!r}; it has none")
    shown: dict[str, Any] = {}
    if recorded.extra.get("checkpoint"):
        shown["checkpoint"] = ", ".join(recorded.extra["checkpoint"])
    if autocast is not None:
        shown["autocast"] = autocast
    if len(dtypes) == 1 and str(next(iter(dtypes))) != "torch.float32":  # the header names the module's own dtype
        shown["dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
    shown["loss"] = loss if isinstance(loss, str) else getattr(loss, "__name__", "callable")
    shown["device"] = recorded.device  # whose kernels the formula follows (verify measures there)
    attention = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if isinstance(attention, str):  # a transformers model: the attention kernel it ran (the header says it)
        shown["attention"] = attention
    ledger = tracing.ledger_of(recorded, regime, name=name, size_one=size_one, values=values, free=free,
                               per_layer=per_layer, shown=shown, split=tracing.split_of(module, regime))
    step = tracing.step_of(module, recorded, regime, ledger.numbers, example_inputs, dims, loss, autocast,
                           multiple_of, device, free)
    no_step = tracing.no_step(recorded, regime)
    check_step(regime, no_step or (step.why if isinstance(step, Refused) else None))
    ledger = tracing.rank_ledger(ledger, step, regime)  # tensor parallel: the rank's kept activations
    d = derivation_of(ledger, regime, step, no_step)
    # the model's own limits (a position table, an image size) join the domain, each said with why past it
    # a table the forward looked up at positions computed from a size (arange(S)) bounds that size too; the
    # configuration's words win where both find the same condition
    tables = {c: table_why(c, *t) for c, t in recorded.extra.get("tables", {}).items()}
    limits = tightest({**tables, **model_limits(module, example_inputs, dims, d.domain, d.free)})
    if limits:
        d = dataclasses.replace(d, domain=sympy.And(d.domain, *limits), why=limits)
    if values:  # numbers asked for outside the guards the trace recorded: said, never printed silently
        warn_outside(d.domain, d.numbers, limits)
    return d


def _trace_sizes(build: Any, example_inputs: Any, dims: Any, sizes: Any, divisible: Any, device: str,
                 trace_options: dict[str, Any], multiple_of: Any, size_one: bool, name: str | None, loss: Any,
                 options: dict[str, Any]) -> Derivation:
    """:func:`trace` with ``sizes``: the formula in the module's own sizes (:mod:`symmem.importer.symbolic_sizes`)."""
    from .importer import traced as tracing
    from .importer.index_ranges import fitted_limits, tightest
    from .importer.limits import sized_limits
    from .importer.sized_step import sized_step
    from .importer.symbolic_sizes import LAYERS, fit_sizes, no_peak, sym_for
    from .report.factoring import per_layer_note

    if sizes is None:
        raise SymmemError("divisible= goes with sizes=: the sizes the module is built from, e.g. "
                          "sizes={'H': 4096, 'h': 32}, divisible={'H': 'h'}")
    if not callable(build) or hasattr(build, "parameters"):
        raise SymmemError("with sizes=, give a callable that builds (module, example_inputs) from the sizes as "
                          "keywords, not a module: build(H=..., h=...) -> (module, inputs)")
    if example_inputs is not None:
        raise SymmemError("with sizes=, the build callable returns the example inputs: leave example_inputs out")
    if dims is None:
        raise SymmemError("trace needs dims: the input sizes to keep symbolic, e.g. {'B': [(0, 0)]}")
    if multiple_of or size_one:
        raise SymmemError("multiple_of and size_one do not go with sizes=: trace with the sizes fixed for them")
    recorded = fit_sizes(build, sizes, dims, divisible=divisible, device=device, **trace_options)
    # the model's own limits (a position table) join the fit's domain before the ledger and the sized step read it:
    # the kept tensors, the peak in every size and the views past one are said or refused as past a guard
    plan = recorded.extra["sizes"]["plan"]
    limits, said_limits = sized_limits(build, plan, dims, recorded.domain, tuple(s.symbol for s in recorded.symbols))
    # a table the forward looked up at positions (index_ranges): its bound is in the fit's domain already, written
    # in the sizes where the rows follow one (S <= R); the configuration's words win where both find it
    base = {sym_for(n): v for n, v in plan.sizes_at(plan.base).items()}
    limits = tightest({**fitted_limits(recorded.extra.get("tables", {}), recorded.domain, base), **limits})
    if limits or said_limits:
        recorded = dataclasses.replace(recorded, domain=sympy.And(recorded.domain, *limits),
                                       notes=(*recorded.notes, *said_limits),
                                       extra={**recorded.extra, "limits": limits})
    keywords = dict(options)
    values, per_layer, free = keywords.pop("values", None), keywords.pop("per_layer", False), keywords.pop("free", None)
    with_step = keywords.pop("step", False)
    if not isinstance(with_step, bool):
        raise SymmemError(f"peak must be True or False, got {with_step!r}")
    if LAYERS in sizes and recorded.layers is not None:
        values = {LAYERS: sizes[LAYERS], **dict(values or {})}  # the folded blocks' count: the sizes' L
    regime = _regime(keywords.pop("regime", None), keywords)
    if keywords:
        raise _unknown(keywords, "traced")
    shown: dict[str, Any] = {}
    if recorded.extra.get("checkpoint"):
        shown["checkpoint"] = ", ".join(recorded.extra["checkpoint"])
    if trace_options.get("autocast") is not None:
        shown["autocast"] = trace_options["autocast"]
    shown.update(_own_dtype(recorded, regime, trace_options.get("autocast")))
    shown["loss"] = loss if isinstance(loss, str) else getattr(loss, "__name__", "callable")
    shown["device"] = recorded.device
    split = None
    if regime.tensor_parallel:  # the rank's parameter side, kept activations and peak: its steps, in every size
        from .importer.symbolic_sizes import built

        plan = recorded.extra["sizes"]["plan"]
        split, with_step = tracing.split_of(built(build, plan.sizes_at(plan.base))[0], regime), True
    ledger = tracing.ledger_of(recorded, regime, name=name, values=values, free=free, per_layer=per_layer,
                               shown=shown, split=split)
    layers = next(iter(ledger.repeats.values()), None)
    if with_step and (regime.data_parallel or regime.zero):  # the step in every size is one device's
        step = Refused("the peak in every size is recorded on one device; under a data-parallel engine or --zero "
                       "it is not modelled yet: trace without sizes= (the peak in B, S, L and N)")
    else:
        step = sized_step(build, recorded, regime, ledger.numbers, dims, loss, device, layers, free) if with_step \
            else None
    why = tracing.no_step(recorded, regime) or (None if with_step else no_peak(recorded))
    check_step(regime, why or (step.why if isinstance(step, Refused) else None))
    ledger = tracing.rank_ledger(ledger, step, regime)  # tensor parallel: the rank's kept tensors
    d = derivation_of(ledger, regime, step, why)
    layer = next(iter(ledger.repeats.values()), None) if not per_layer else None
    said = per_layer_note(d.storages, layer, d.parameters) if layer is not None else None
    d = dataclasses.replace(d, notes=(*d.notes, *recorded.notes, *([said] if said else [])), why=limits)
    if values and limits:  # numbers asked for past the model's limits: said with why, never printed silently
        warn_outside(sympy.And(*limits), d.numbers, limits)
    return d


def _own_dtype(recorded: Any, regime: Regime, autocast: str | None) -> dict[str, str]:
    """``{"dtype": "bfloat16"}`` for a module built in one floating dtype other than FP32 (the header names it, as
    it does for a module given whole), after the precision check a module given whole gets; else nothing."""
    import torch

    names = {p.dtype for p in recorded.parameters}
    dtypes = {getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)}
    dtypes = {t for t in dtypes if t.is_floating_point}
    check_precision(regime.precision, autocast, dtypes)
    if len(dtypes) == 1 and next(iter(dtypes)) != torch.float32:
        return {"dtype": str(next(iter(dtypes))).removeprefix("torch.")}
    return {}


def _device_of(module: Any) -> str:
    """Where a module is: its first parameter's (or buffer's) device type; the CPU for one with neither."""
    for t in (*module.parameters(), *module.buffers()):
        return "cpu" if t.device.type == "meta" else t.device.type
    return "cpu"


def show(model: Any, **kwargs: Any) -> None:
    """Derive ``model`` (a name, a :class:`~symmem.graph.Model` or a derivation; options as for :func:`derive`)
    and display it: rich output in IPython, the text table elsewhere.

    It returns nothing, so a notebook shows the result once; ``derive`` returns the object, which displays
    itself too.
    """
    d = model if isinstance(model, Derivation) else derive(model, **kwargs)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # IPython is optional: fall back to the text table
        get_ipython = None  # type: ignore[assignment]
    if get_ipython is not None and get_ipython() is not None:
        display(d)
    else:
        print(d.table())
