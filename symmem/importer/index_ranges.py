"""A table looked up at positions the code computes from a traced size: the size's bound, found in the fake run.

A plain module with its own ``nn.Embedding(R, H)`` looked up at ``torch.arange(S)`` has no configuration that names
the table (:mod:`.limits` reads a transformers config); past ``R`` rows the real module raises an index error, while
the fake run (meta kernels check no index values) records no guard, so the formula would answer silently there.

Here the fake run follows the integer tensors whose values it can tell exactly: ``arange(start, end, step)`` with
an integer step (the values ``start + step * i``), a registered integer buffer whose real values are such a
sequence along one dimension (``position_ids``, ``arange(R).expand((1, -1))``) or a constant, ``ones``/``zeros``/
``full`` (and their ``_like``/``new_`` forms), and ``ids != pad`` on an integer input and an ``attention_mask``
input (all true, all ones, on the unpadded inputs every trace assumes: RoBERTa's and OPT's masks); each kept as
``a + b * i_d`` (``d`` the dimension it runs along, None for a constant) through the ops that keep that form:
views that only add or drop size-1 dimensions, ``unsqueeze``/``squeeze``/``expand``/``permute``/``transpose``/
``repeat``, a ``slice`` or ``select`` (a shifted, strided or single position), copies and dtype casts, adding,
subtracting or multiplying by a number (a traced size too: ``arange(past, past + S)``) or by a constant tensor,
``cumsum`` of a constant (OPT's and RoBERTa's position count).  Any other op forgets the tensor, and so does an op
that writes it or a view of its storage: its values cannot be told, and nothing is said (token ids, ``% R``, a
clamp).  Where such a tensor indexes a parameter or buffer (``embedding``, ``index_select``, ``gather``, advanced
indexing ``weight[idx]``), its largest value must be below the rows there: that condition, in the declared
symbols, with why (``past the model's position table: pos has 64 rows``), joins the derivation's domain as a
model's own limit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import sympy

from ..record.identity import storage_key

#: the form of a followed tensor: (a, b, d), value ``a + b * i_d`` (a an int or SymInt, b an int, d a dim or None)
Form = tuple[Any, int, int | None]


def _int(x: Any) -> bool:
    """An integer size or number: an int (not a bool) or a SymInt."""
    import torch

    return (isinstance(x, int) and not isinstance(x, bool)) or isinstance(x, torch.SymInt)


def _one(size: Any) -> bool:
    """A dimension that is 1 for certain (a SymInt is never compared: that would add a guard)."""
    return isinstance(size, int) and size == 1


def buffer_form(t: Any) -> Form | None:
    """The form of a real integer buffer: a constant, or ``a + b * i_d`` along one dimension; None otherwise (or
    where reading it would cost more than the small tables positions live in)."""
    import torch

    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.device.type == "meta" \
            or t.numel() == 0 or t.numel() > 1 << 20:
        return None
    flat = t.reshape(-1)
    a = int(flat[0])
    if bool((flat == a).all()):
        return a, 0, None
    for d in range(t.dim()):
        if t.shape[d] < 2:
            continue
        b = int(t.narrow(d, 1, 1).reshape(-1)[0]) - a
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        expected = a + b * torch.arange(t.shape[d], dtype=t.dtype).reshape(shape)
        if torch.equal(t, expected.expand(t.shape)):
            return a, b, d
    return None


class IndexRanges:
    """The fake run's observer (``SavedRecorder.observe``): follows the tensors of known values, notes each lookup
    of a named parameter or buffer at one.  ``names`` maps ``id`` of a fake parameter or buffer to its name;
    ``seeds`` maps ``id`` of a fake buffer to its real values' form (:func:`buffer_form`)."""

    def __init__(self, names: dict[int, str], seeds: dict[int, tuple[Any, Form]],
                 ids: tuple[Any, ...] = ()) -> None:
        self.names = names
        #: the integer inputs (token ids): ``ids != pad`` is all true on the unpadded inputs symmem assumes
        self.ids = {id(t): weakref.ref(t) for t in ids}
        self.forms: dict[int, tuple[Any, Form]] = {}  # id -> (weakref, form): a dead id's entry is never read
        for key, (t, form) in seeds.items():
            self.forms[key] = (weakref.ref(t), form)
        #: (table, rows, largest index) of each lookup at a followed tensor, sizes as ints or SymInts
        self.lookups: list[tuple[str, Any, Any]] = []
        self.rules = _rules()

    def __call__(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        rule = self.rules.get(func)
        if rule is not None:
            try:
                rule(self, args, kwargs, out)
            except Exception:  # noqa: BLE001 -- an argument in a form not followed: its values are not told, and
                pass  # following values must never break the trace (it only adds conditions where it can tell)
        elif self.forms:
            written = _WRITES.get(func)
            if written is None:
                written = _written(func)
            if written:  # an op that writes its arguments (clamp_, add_, copy_): their values are no longer known
                for where in written:
                    t = args[where] if isinstance(where, int) and where < len(args) else kwargs.get(where)
                    self.forget(t)

    def form(self, t: Any) -> Form | None:
        found = self.forms.get(id(t))
        if found is None or found[0]() is not t:
            return None
        return found[1]

    def keep(self, t: Any, form: Form | None) -> None:
        import torch

        if form is not None and isinstance(t, torch.Tensor) and not t.is_complex():
            self.forms[id(t)] = (weakref.ref(t), form)

    def forget(self, t: Any) -> None:
        """Forget every followed tensor that shares ``t``'s storage (a view of it sees the write too)."""
        import torch

        for x in t if isinstance(t, list | tuple) else (t,):
            if not isinstance(x, torch.Tensor):
                continue
            try:
                key = storage_key(x)
            except (RuntimeError, NotImplementedError):
                continue
            for i, (ref, _) in list(self.forms.items()):
                y = ref()
                if y is None or storage_key(y) == key:
                    del self.forms[i]

    def largest(self, t: Any, form: Form) -> Any:
        a, b, d = form
        if d is None or b <= 0:
            return a
        return a + b * (t.shape[d] - 1)

    def lookup(self, weight: Any, dim: int, index: Any) -> None:
        import torch

        name = self.names.get(id(weight))
        form = self.form(index)
        if name is None or form is None or index.dtype == torch.bool:  # a bool index is a mask, not positions
            return
        self.lookups.append((name, weight.shape[dim], self.largest(index, form)))

    def limits(self, convert: Callable[[Any], Any]) -> dict[Any, tuple[str, Any]]:
        """``{condition: (table, offset)}``: each lookup's largest index below its rows, in the declared symbols
        (``convert``: a size to a sympy expression in them; :func:`table_why` words it); lookups that no size moves
        say nothing.  The offset is the rows less the condition's right side (0 for ``S <= rows``)."""
        out: dict[Any, tuple[str, Any]] = {}
        for name, rows, top in self.lookups:
            cond = _below(convert(top), convert(rows))
            if cond is not None and cond not in out:
                out[cond] = (name.removesuffix(".weight"), sympy.expand(convert(rows) - cond.rhs))
        return tightest(out)  # one table at arange(S) and at arange(S) + 2: the second's bound only


def table_why(cond: Any, table: str, offset: Any) -> str:
    """Why ``cond`` (from :meth:`IndexRanges.limits`, or the same bound written in a fit's sizes) is a limit:
    ``past the model's position table: pos has 64 rows`` (and where the largest position is not the tokens' size
    less one, that position: ``arange(S) + 2`` is looked up at ``S + 1``)."""
    rows = sympy.expand(cond.rhs + offset)
    shown = f"{int(rows):,}" if rows.is_Integer else str(rows)
    top = sympy.expand(cond.lhs + offset - 1)
    plain = isinstance(cond.lhs, sympy.Symbol) and offset == 0
    return (f"past the model's position table: {table} has {shown} rows"
            + ("" if plain else f" (looked up at positions up to {top})"))


def tightest(limits: dict[Any, Any]) -> dict[Any, Any]:
    """``limits`` without a bound another one implies (``S <= 24`` from a config where the forward looks the table
    up at ``S + 1``: ``S <= 22``), so that past both one warning says the tighter one."""
    def implied(c: Any) -> bool:
        return isinstance(c, sympy.LessThan) and c.rhs.is_number and any(
            isinstance(o, sympy.LessThan) and o is not c and o.lhs == c.lhs and o.rhs.is_number and o.rhs < c.rhs
            for o in limits)

    return {c: why for c, why in limits.items() if not implied(c)}


def fitted_limits(tables: dict[Any, tuple[str, Any]], domain: Any, base: dict[Any, int]) -> dict[Any, str]:
    """The limits of a fit in the module's own sizes, ``{condition: why}``: each of the base trace's ``tables``
    (:meth:`IndexRanges.limits`) as the fit's ``domain`` holds it -- the same condition where the rows stay put, or
    the bound the fit wrote in the sizes (``S <= R``), which is the base's at the base sizes (``base``: symbol ->
    number)."""
    held = sympy.And.make_args(domain)
    out: dict[Any, str] = {}
    for cond, (table, offset) in tables.items():
        if cond in held:
            out[cond] = table_why(cond, table, offset)
            continue
        for c in held:
            if isinstance(c, sympy.LessThan) and c.lhs == cond.lhs and c.rhs.free_symbols \
                    and sympy.expand(c.rhs.xreplace(base) - cond.rhs) == 0:
                out[c] = table_why(c, table, offset)
                break
    return out


_WRITES: dict[Any, tuple[int | str, ...]] = {}


def _written(func: Any) -> tuple[int | str, ...]:
    """The arguments ``func`` writes (positions, or names for keyword-only ones such as ``out``), read once per
    overload from its schema."""
    found = _WRITES.get(func)
    if found is None:
        found = ()
        schema = getattr(func, "_schema", None)
        for i, arg in enumerate(getattr(schema, "arguments", ())):
            info = arg.alias_info
            if info is not None and info.is_write:
                found += (arg.name if arg.kwarg_only else i,)
        _WRITES[func] = found
    return found


def _below(top: Any, rows: Any) -> Any:
    """``top < rows`` as ``sum of positive terms <= the rest`` (``S <= 64``, ``P + S <= 64``, ``S <= P``), or None
    where it holds or fails whatever the sizes."""
    e = sympy.expand(top + 1 - rows)
    if not e.free_symbols:
        return None
    const, rest = e.as_coeff_Add()
    terms = sympy.Add.make_args(rest)
    lhs = sympy.Add(*[t for t in terms if t.as_coeff_Mul()[0] > 0])
    rhs = -const - sympy.Add(*[t for t in terms if t.as_coeff_Mul()[0] < 0])
    cond = sympy.Le(lhs, rhs)
    return None if cond in (sympy.true, sympy.false) else cond


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _arange(r: IndexRanges, start: Any, end: Any, step: Any, out: Any) -> None:
    if _int(start) and isinstance(step, int) and not isinstance(step, bool) and step != 0 and _int(end):
        r.keep(out, (start, step, 0))


def _arange_end(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    _arange(r, 0, args[0], 1, out)


def _arange_start(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    _arange(r, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("step", 1), out)


def _same(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    """A copy, a cast, an alias: the same values."""
    r.keep(out, r.form(args[0]))


def _reshaped(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    """A view that only adds or drops size-1 dimensions."""
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    if d is None or _one(args[0].shape[d]):
        r.keep(out, (a, 0, None))
        return
    if any(not _one(n) for i, n in enumerate(args[0].shape) if i != d):
        return
    left = [i for i, n in enumerate(out.shape) if not _one(n)]
    if len(left) == 1:
        r.keep(out, (a, b, left[0]))


def _unsqueeze(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    at = _dim(args[1], out.dim())
    r.keep(out, (a, b, None if d is None else d + (at <= d)))


def _squeeze(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    shape = args[0].shape
    if len(args) == 1:
        asked = range(len(shape))
    else:
        asked = args[1] if isinstance(args[1], list | tuple) else [args[1]]
    gone = {_dim(i, len(shape)) for i in asked if _one(shape[_dim(i, len(shape))])}
    if d is None or d in gone:
        r.keep(out, (a, 0, None))
    else:
        r.keep(out, (a, b, d - sum(1 for i in gone if i < d)))


def _expand(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    if d is None or _one(args[0].shape[d]):  # a broadcast single position: one value everywhere
        r.keep(out, (a, 0, None))
        return
    r.keep(out, (a, b, d + out.dim() - args[0].dim()))


def _permute(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    order = [_dim(i, out.dim()) for i in args[1]]
    r.keep(out, (a, b, None if d is None else order.index(d)))


def _transpose(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    n = out.dim()
    x, y = (0, 1) if len(args) == 1 else (_dim(args[1], n), _dim(args[2], n))
    r.keep(out, (a, b, y if d == x else x if d == y else d))


def _slice(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    dim = _dim(args[1] if len(args) > 1 else 0, args[0].dim())
    if dim != d:
        r.keep(out, form)
        return
    start = args[2] if len(args) > 2 else None
    step = args[4] if len(args) > 4 else 1
    start = 0 if start is None else start
    if not isinstance(step, int) or isinstance(step, bool) or not _int(start):
        return
    if isinstance(start, int):
        if start < 0:
            size = args[0].shape[d]
            if not isinstance(size, int):
                return
            start = max(start + size, 0)
    elif not sympy.sympify(start.node.expr, strict=True).is_nonnegative:
        return  # a size that may be negative counts from the end: not followed
    r.keep(out, (a + b * start, b * step, d))


def _select(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    dim, index = _dim(args[1], args[0].dim()), args[2]
    if dim != d:
        r.keep(out, (a, b, None if d is None else d - (dim < d)))
        return
    if isinstance(index, int) and not isinstance(index, bool):
        if index < 0:
            size = args[0].shape[d]
            if not isinstance(size, int):
                return
            index += size
        r.keep(out, (a + b * index, 0, None))


def _aligned(r: IndexRanges, x: Any, n: int) -> Form | None:
    """x (a followed tensor or a number) as a form of an ``n``-dimensional broadcast result."""
    import torch

    if isinstance(x, torch.Tensor):
        form = r.form(x)
        if form is None:
            return None
        a, b, d = form
        if d is None or _one(x.shape[d]):
            return a, 0, None
        return a, b, d + n - x.dim()
    return (x, 0, None) if _int(x) else None


def _constant(r: IndexRanges, value: Any, out: Any) -> None:
    """ones, zeros, full: every element the one number."""
    if _int(value):
        r.keep(out, (value, 0, None))


def _ones(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    """ones(size), ones_like(t), new_ones(t, size)."""
    _constant(r, 1, out)


def _zeros(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    _constant(r, 0, out)


def _full(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    """full(size, v), full_like(t, v), new_full(t, size, v)."""
    _constant(r, args[-1], out)


def _unpadded(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    # ``input_ids != pad`` (RoBERTa's, fairseq's position mask): all true on the unpadded inputs every trace
    # assumes (the recorder says so for transformers' mask checks); padding only lowers the positions after it,
    # so the bound from all-true is the one an unpadded batch meets
    ref = r.ids.get(id(args[0]))
    if ref is not None and ref() is args[0] and _int(args[1]):
        r.keep(out, (1, 0, None))


def _cumsum(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    """Of a constant c along a dimension: c, 2c, 3c ..."""
    form = r.form(args[0])
    if form is not None and form[2] is None:
        r.keep(out, (form[0], form[0], _dim(args[1], out.dim())))


def _combine(sign: int, swapped: bool = False) -> Rule:
    """``add`` (sign 1) or ``sub`` (-1): ``x + sign * alpha * y``, each a followed tensor, a number or a size;
    ``swapped``: ``rsub``, ``y - alpha * x``."""
    def rule(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if not isinstance(alpha, int) or isinstance(alpha, bool):
            return
        x, y = _aligned(r, args[0], out.dim()), _aligned(r, args[1], out.dim())
        if x is None or y is None or (x[2] is not None and y[2] is not None and x[2] != y[2]):
            return
        if swapped:
            x, y = y, x
        k = sign * alpha
        r.keep(out, (x[0] + k * y[0], x[1] + k * y[1], x[2] if x[2] is not None else y[2]))
    return rule


_rsub = _combine(-1, swapped=True)  # other - alpha * self


def _repeat(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    """Whole copies along the dimensions it does not run along."""
    form = r.form(args[0])
    if form is None:
        return
    a, b, d = form
    new = len(args[1]) - args[0].dim()
    if d is None or _one(args[0].shape[d]):
        r.keep(out, (a, 0, None))
    elif _one(args[1][new + d]):
        r.keep(out, (a, b, d + new))


def _mul(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    import torch

    for x, k in ((args[0], args[1]), (args[1], args[0])):
        form = _aligned(r, x, out.dim()) if isinstance(x, torch.Tensor) else None
        if isinstance(k, torch.Tensor):  # a constant tensor (a mask of ones) is its number
            by = _aligned(r, k, out.dim())
            k = by[0] if by is not None and by[2] is None else None
        if form is not None and isinstance(k, int) and not isinstance(k, bool):  # a whole number: still exact
            a, b, d = form
            r.keep(out, (a * k, b * k, d))
            return


def _embedding(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    r.lookup(args[0], 0, args[1])


def _index_select(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    r.lookup(args[0], _dim(args[1], args[0].dim()), args[2])


def _index(r: IndexRanges, args: Any, kwargs: Any, out: Any) -> None:
    for dim, idx in enumerate(args[1]):
        if idx is not None:
            r.lookup(args[0], dim, idx)


#: how the form of an op's output follows from its inputs' (or the lookup it is): ``rule(ranges, args, kwargs, out)``
Rule = Callable[[Any, Any, Any, Any], None]
_TABLE: dict[Any, Rule] = {}


def _rules() -> dict[Any, Rule]:
    """aten op -> its rule, made once."""
    import torch

    if _TABLE:
        return _TABLE
    aten = torch.ops.aten

    def add(op: str, overload: str, rule: Rule) -> None:
        packet = getattr(aten, op, None)
        found = getattr(packet, overload, None) if packet is not None else None
        if found is not None:
            _TABLE[found] = rule

    for op in ("ones", "ones_like", "new_ones"):
        add(op, "default", _ones)
    for op in ("zeros", "zeros_like", "new_zeros"):
        add(op, "default", _zeros)
    for op in ("full", "full_like", "new_full"):
        add(op, "default", _full)
    add("ne", "Scalar", _unpadded)
    add("cumsum", "default", _cumsum)
    add("arange", "default", _arange_end)
    add("arange", "start", _arange_start)
    add("arange", "start_step", _arange_start)
    for op, overload in (("clone", "default"), ("alias", "default"), ("detach", "default"),
                         ("_to_copy", "default"), ("lift_fresh", "default"), ("lift_fresh_copy", "default"),
                         ("contiguous", "default")):
        add(op, overload, _same)
    for op in ("view", "_unsafe_view", "reshape"):
        add(op, "default", _reshaped)
    add("unsqueeze", "default", _unsqueeze)
    for overload in ("default", "dim", "dims"):
        add("squeeze", overload, _squeeze)
    add("expand", "default", _expand)
    add("permute", "default", _permute)
    add("transpose", "int", _transpose)
    add("t", "default", _transpose)
    add("slice", "Tensor", _slice)
    add("select", "int", _select)
    for overload in ("Tensor", "Scalar"):
        add("add", overload, _combine(1))
        add("sub", overload, _combine(-1))
        add("mul", overload, _mul)
        add("rsub", overload, _rsub)
    add("repeat", "default", _repeat)
    add("embedding", "default", _embedding)
    add("index_select", "default", _index_select)
    add("gather", "default", _index_select)
    add("index", "Tensor", _index)
    return _TABLE


def index_ranges(module: Any, params: dict[str, Any], buffers: dict[str, Any],
                 inputs: dict[Any, Any] | None = None) -> IndexRanges:
    """The observer for one fake run of ``module`` on the fake ``params`` and ``buffers`` (by name) and ``inputs``
    (the fake inputs by position or keyword): the names of both, the forms of the buffers whose real values are a
    sequence or a constant, the integer inputs (token ids), and an ``attention_mask`` input as all ones (the
    unpadded inputs every trace assumes: OPT counts its positions from it)."""
    import torch

    from ..record.identity import tensors

    names: dict[int, str] = {}
    for name, t in (*params.items(), *buffers.items()):
        names.setdefault(id(t), name)
    real = dict(module.named_buffers())
    seeds: dict[int, tuple[Any, Form]] = {}
    for name, fake in buffers.items():
        b = real.get(name)
        form = buffer_form(b) if b is not None else None
        if form is not None:
            seeds[id(fake)] = (fake, form)
    given = dict(inputs or {})
    mask = given.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not mask.is_complex():
        seeds[id(mask)] = (mask, (1, 0, None))
    ids = tuple(t for t in tensors(list(given.values())) if not t.is_floating_point() and not t.is_complex()
                and t.dtype != torch.bool and t is not mask)
    return IndexRanges(names, seeds, ids)
