"""Callables for ``symmem trace package.module:callable`` in tests/test_trace_cli.py (torch imported inside), and
the small Hugging Face models and the formula comparison that tests/test_zoo_drift.py and
benchmarks/check_cuda.py share."""

from __future__ import annotations

from typing import Any

import sympy


def mlp_with_inputs() -> Any:
    """A small MLP and its example batch: ``(module, (x,))``."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return net, (torch.randn(2, 16),)


def mlp() -> Any:
    """The same MLP alone (example inputs from ``--input 2x16``)."""
    return mlp_with_inputs()[0]


def saved_bytes(module: Any, *args: Any, **kwargs: Any) -> int:
    """Every byte one real training-mode forward of ``module(*args, **kwargs)`` saves for backward, its parameters
    and buffers apart (the inputs it saves too): the truth of the position-table tests."""
    import torch

    module.train()

    def key(t: Any) -> int:
        return t.untyped_storage().data_ptr()

    own = {key(p) for p in module.parameters()} | {key(b) for b in module.buffers()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        if key(t) not in own:
            seen.setdefault(key(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    del out
    return sum(seen.values())


def not_a_module() -> Any:
    return 42


def data_dependent() -> Any:
    """A module whose output shape depends on the data: fake tensors cannot run it symbolically."""
    import torch

    class Nonzero(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            y = self.fc(x)
            return y[y > 0].sum()

    return Nonzero(), (torch.randn(2, 4),)


def broken() -> Any:
    """A module that cannot run at all on its example (a shape mismatch)."""
    import torch

    return torch.nn.Linear(4, 4), (torch.randn(2, 5),)


def cnn(n: int = 4) -> Any:
    """A small user module: conv, batch norm, ReLU, a ModuleList of ``n`` identical conv blocks, a mean pool, a
    head (tests/test_trace_derivation.py and tests/test_trace_peak.py trace it)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU())
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU()) for _ in range(n))
            self.head = torch.nn.Linear(8, 10)

        def forward(self, x: Any) -> Any:
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean((2, 3)))

    return Net()


# -- small Hugging Face models and the zoo's values for them ----------------------------------------------------------
VOCAB = 96
GPT2 = {"H": 32, "h": 4, "V": VOCAB, "L": 2}
BERT = {"H": 32, "h": 4, "V": VOCAB, "L": 2, "F": 128}
LLAMA = {"H": 32, "h": 4, "G": 2, "V": VOCAB, "L": 2, "F": 64}


def hf(cls: str, attn: str, **config: Any) -> Any:
    """``transformers.<cls>`` from its config class with ``config``, attention ``attn``, seeded."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = getattr(transformers, cls.replace("LMHeadModel", "Config").replace("ForCausalLM", "Config")
                  .replace("ForImageClassification", "Config").replace("Model", "Config"))(**config)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return getattr(transformers, cls)(cfg)


def gpt2(attn: str, p: float, use_cache: bool = True) -> Any:
    return hf("GPT2LMHeadModel", attn, n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=1024,
              resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0, use_cache=use_cache)


def bert(attn: str, p: float) -> Any:
    return hf("BertModel", attn, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              vocab_size=VOCAB, max_position_embeddings=512, hidden_dropout_prob=p, attention_probs_dropout_prob=p)


def llama(attn: str, p: float) -> Any:
    return hf("LlamaForCausalLM", attn, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
              attention_dropout=p, bos_token_id=0, eos_token_id=0)


# -- comparing two formulas -----------------------------------------------------------------------------------------
def drift(traced: sympy.Expr, zoo: sympy.Expr, symbols: tuple[sympy.Symbol, ...] | None = None
          ) -> dict[str, tuple[int, int]]:
    """Monomial -> (traced coefficient, zoo coefficient), for every term where they differ (bytes), as
    polynomials in ``symbols`` (default B, S, L).  ``ceiling(X/32)`` (CUDA's memory-efficient attention pads its
    rows to 32) is a variable of its own."""
    from symmem import symbol

    symbols = symbols or tuple(symbol(n) for n in ("B", "S", "L"))
    rows = sympy.Symbol("ceil32")
    pad = {sympy.ceiling(x / 32): rows for x in symbols}
    traced, zoo = sympy.expand(traced).xreplace(pad), sympy.expand(zoo).xreplace(pad)
    gens = (*symbols, rows)
    a = sympy.Poly(traced, *gens).as_dict()
    b = sympy.Poly(zoo, *gens).as_dict()
    out = {}
    for exps in sorted(set(a) | set(b), reverse=True):
        if a.get(exps, 0) != b.get(exps, 0):
            mono = sympy.Mul(*(s**e for s, e in zip(gens, exps, strict=True)))
            out[str(mono)] = (int(a.get(exps, 0)), int(b.get(exps, 0)))
    return out


def at_least_two(expr: sympy.Expr) -> sympy.Expr:
    """The zoo's formula for B >= 2 (a trace's domain): its ``Piecewise`` in ``Eq(B, 1)`` (the loss's labels)
    resolved to the other branch."""
    from symmem import symbol

    one = sympy.Eq(symbol("B"), 1)

    def branch(pw: sympy.Piecewise) -> sympy.Expr:
        assert all(cond == one for _, cond in pw.args[:-1]), pw
        return pw.args[-1][0]

    return sympy.piecewise_fold(expr).replace(lambda e: isinstance(e, sympy.Piecewise), branch)


def exits() -> Any:
    """A module whose forward calls ``sys.exit(3)`` (user code that exits while it is traced)."""
    import sys

    import torch

    class Exits(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            sys.exit(3)

    return Exits(), (torch.randn(2, 4),)


def interrupts() -> Any:
    """A module whose forward raises ``KeyboardInterrupt`` itself (no Ctrl-C is pressed)."""
    import torch

    class Interrupts(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            raise KeyboardInterrupt

    return Interrupts(), (torch.randn(2, 4),)


def ctrl_c() -> Any:
    """A module whose forward gets a real SIGINT (what Ctrl-C sends) while it runs.

    ``signal.pthread_kill`` sends it to this thread (``os.kill`` to the process lets the kernel pick any thread
    that does not block it) and runs the Python handler before it returns, so the ``KeyboardInterrupt`` comes out
    of the forward itself, at once, whatever the load: not in whatever Python code ran next (a collection's or a
    weak reference's callback, where it is lost: :func:`ctrl_c_in_a_finalizer`)."""
    import signal
    import threading
    import time

    import torch

    class Pressed(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(5)  # reached only where the interrupt did not come out: the forward returns, exit 0
            return x

    return Pressed(), (torch.randn(2, 4),)


def ctrl_c_in_a_finalizer() -> Any:
    """A module whose forward gets a real SIGINT while a weak reference's callback runs (as the recorder's storage
    finalizers do on every free): the handler's ``KeyboardInterrupt`` is raised in the callback, where Python
    prints it as unraisable and drops it, and the forward returns."""
    import signal
    import threading
    import weakref

    import torch

    class Freed:
        pass

    def press() -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    class Pressed(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            freed = Freed()
            weakref.finalize(freed, press)
            del freed  # the callback runs here, and the interrupt is lost in it
            return x

    return Pressed(), (torch.randn(2, 4),)


def exits_when_built() -> None:
    """A callable that calls ``sys.exit()`` instead of returning a module."""
    import sys

    sys.exit()


def embedder() -> Any:
    """Token ids -> embedding -> linear head, returned without example inputs (the hint must ask for ids)."""
    import torch

    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3))
