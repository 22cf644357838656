"""``symmem trace hf:TYPE --symbolic H=hidden_size,...``: a transformers model's sizes as the symbols of its formula.

Each symbol names a key of the model's config; the model is built (:func:`symmem.importer.sources.load`) at the
small configurations :mod:`symmem.importer.symbolic_sizes` chooses, every other key at its value (the config's
default, or ``--config``).  The keys' meanings give the divisibility the fit needs: the hidden size is a multiple of
the heads (a whole head size) and the heads of the key/value groups, where both are symbols.  The layer count
(``num_hidden_layers``, ``n_layer`` ...) is always traced at 2 and 3 layers and is the symbol ``L``.

One symbol may stand for several keys that are the same size, joined by ``|``: an encoder-decoder's two stacks
(``L=encoder_layers|decoder_layers``, ``F=encoder_ffn_dim|decoder_ffn_dim``, T5's ``L=num_layers|num_decoder_layers``).
The keys must hold the same value in the config; each configuration sets them all.  Where the layer count is
implied, an encoder-decoder's decoder layers (``decoder_layers``, ``num_decoder_layers``) join it when the config
has them equal, so ``L`` counts both stacks, each folded to ``L`` layers.

>>> parse_symbolic("H=hidden_size, h=num_attention_heads")
{'H': 'hidden_size', 'h': 'num_attention_heads'}
>>> parse_symbolic("L=encoder_layers|decoder_layers,H=d_model")
{'L': 'encoder_layers|decoder_layers', 'H': 'd_model'}
>>> parse_symbolic("H=a b")
Traceback (most recent call last):
symmem.errors.SymmemError: --symbolic 'H=a b': expected SYMBOL=config_key,... e.g. H=hidden_size,L=num_hidden_layers
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError

_PAIR = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=([A-Za-z_][A-Za-z0-9_]*(?:\|[A-Za-z_][A-Za-z0-9_]*)*)$")
#: what a config key means, by transformers' canonical attribute name
HIDDEN = ("hidden_size", "d_model", "n_embd", "dim")
HEADS = ("num_attention_heads",)
GROUPS = ("num_key_value_heads",)
#: config keys that say the attention rotates its queries and keys (the head size must be even)
ROTARY = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct", "partial_rotary_factor")
LAYERS_KEYS = ("num_hidden_layers",)
#: an encoder-decoder's decoder layer count, joining the implied layer count where it equals it
DECODER_LAYERS = ("decoder_layers", "num_decoder_layers")


def parse_symbolic(text: str) -> dict[str, str]:
    """``--symbolic H=hidden_size,...`` as symbol -> config key."""
    out: dict[str, str] = {}
    usage = "expected SYMBOL=config_key,... e.g. H=hidden_size,L=num_hidden_layers"
    for part in (x.strip() for x in text.split(",")):
        m = _PAIR.match(part)
        if not m:
            raise SymmemError(f"--symbolic {text[:80]!r}: {usage}")
        sym, key = m.groups()
        if sym in out:
            raise SymmemError(f"--symbolic names {sym} twice ({sym}={out[sym]} and {sym}={key}); give it once")
        used = {k: s for s, ks in out.items() for k in ks.split("|")}
        for k in key.split("|"):
            if k in used or key.split("|").count(k) > 1:
                raise SymmemError(f"--symbolic gives the config key {k} two symbols; give it one")
        out[sym] = key
    return out


@dataclass(frozen=True)
class HfSizes:
    """A transformers model as a build callable of its sizes."""

    spec: str
    keys: dict[str, str]  # symbol -> config key
    sizes: dict[str, int]  # symbol -> the config's value
    divisible: dict[str, str]
    config: dict[str, Any]
    loss: str | None

    def load(self, sizes: Mapping[str, int]) -> Any:
        from .sources import load

        keyed = {k: v for s, v in sizes.items() for k in self.keys[s].split("|")}
        return load(self.spec, config={**self.config, **keyed}, loss=self.loss)

    @property
    def build(self) -> Callable[..., Any]:
        """``build(**sizes) -> (module, example_inputs)``: a bound method, whose ``__self__`` says which model it
        builds (a closure would hide it: the tests share one process's traces of the same model by it)."""
        return self._built

    def _built(self, **sizes: int) -> tuple[Any, Any]:
        loaded = self.load(sizes)
        return loaded.module, loaded.example_inputs


def hf_sizes(spec: str, keys: Mapping[str, str], config: Mapping[str, Any], loss: str | None) -> HfSizes:
    """The build callable, sizes (their defaults: the config's values) and divisibility of ``spec``'s model."""
    from .sources import load

    model_type = spec.partition(":")[2]
    keys = dict(keys)
    for s in keys:
        if s in ("B", "S"):
            raise SymmemError(f"--symbolic {s}={keys[s]}: {s} is an input size (--dims); name the config's size "
                              "another symbol")
    import transformers

    if model_type not in transformers.CONFIG_MAPPING:
        load(spec, config=dict(config), loss=loss)  # says what is wrong with the model type
        raise SymmemError(f"{spec}: unknown model type")
    try:
        default = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items()
                                                                   if k != "attn_implementation"})
    except Exception as exc:
        lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()] or [type(exc).__name__]
        first = (" ".join(lines[:2]) if lines[0].endswith(":") else lines[0])[:300]
        raise SymmemError(f"--config: the {model_type} config refuses {dict(config)}: {first}") from None
    canonical = {s: [_canonical(default, model_type, s, k) for k in key.split("|")] for s, key in keys.items()}
    for s, key in keys.items():
        values = {k: getattr(default, k) for k in key.split("|")}
        if len(set(values.values())) > 1:
            raise SymmemError(f"--symbolic {s}={key}: one symbol stands for equal sizes, but the {model_type} config "
                              f"has {', '.join(f'{k} = {v}' for k, v in values.items())}; set them equal with --config "
                              "or give each its own symbol")
    layer_key = "num_hidden_layers" if hasattr(default, "num_hidden_layers") else None
    layer_syms = [s for s, cs in canonical.items() if any(c in LAYERS_KEYS for c in cs)]
    if layer_syms and layer_syms[0] != "L":
        raise SymmemError(f"--symbolic {layer_syms[0]}={keys[layer_syms[0]]}: the layer count is the symbol L "
                          f"(the folded blocks): write L={keys[layer_syms[0]]}")
    if "L" in keys and not layer_syms:
        raise SymmemError(f"--symbolic L={keys['L']}: L is the layer count; name {keys['L']} another symbol")
    if not layer_syms and layer_key is not None and isinstance(getattr(default, layer_key), int):
        used = {k for ks in keys.values() for k in ks.split("|")}
        joined = [k for k in DECODER_LAYERS
                  if k not in used and getattr(default, k, None) == getattr(default, layer_key)]
        keys["L"] = "|".join([layer_key, *joined])  # traced at 2 and 3 layers, evaluated at its own
        canonical["L"] = ["num_hidden_layers", *joined]
    sizes = {s: int(getattr(default, k.split("|")[0])) for s, k in keys.items()}
    role = {c: s for s, cs in canonical.items() for c in cs}
    hidden = next((role[c] for c in HIDDEN if c in role), None)
    heads = next((role[c] for c in HEADS if c in role), None)
    groups = next((role[c] for c in GROUPS if c in role), None)
    divisible: dict[str, str] = {}
    head_dim = getattr(default, "head_dim", None)
    if head_dim is not None and hidden:  # a head size of its own (T5's d_kv) does not follow the hidden size
        try:
            wider = transformers.AutoConfig.for_model(model_type, **{
                **{k: v for k, v in config.items() if k != "attn_implementation"},
                keys[hidden].split("|")[0]: 2 * sizes[hidden]})
            head_dim = head_dim if getattr(wider, "head_dim", None) != head_dim else -1
        except Exception:  # a config that validates its sizes: the head size as it says
            pass
    # a divisor held at the config's value (h when only H is symbolic) is a number: every traced H a multiple of it
    n_heads = sizes[heads] if heads else _config_int(default, HEADS)
    n_groups = sizes[groups] if groups else _config_int(default, GROUPS)
    if hidden and n_heads and (head_dim is None or head_dim * n_heads == sizes[hidden]) and "head_dim" not in config:
        # a held head count: the traced head sizes H/h are its multiples 2, 3, 5...; rotary embeddings need them even
        rotary = any(getattr(default, k, None) is not None for k in ROTARY)
        divisible[hidden] = heads or (2 * n_heads if rotary else n_heads)
    if heads and n_groups:
        divisible[heads] = groups or n_groups
    return HfSizes(spec, keys, sizes, divisible, dict(config), loss)


def _canonical(default: Any, model_type: str, symbol: str, key: str) -> str:
    """transformers' canonical name of a config key (gpt2's ``n_embd`` is ``hidden_size``), which must be a size."""
    if not hasattr(default, key):
        from .sources import key_hint

        raise SymmemError(f"--symbolic {symbol}={key}: the {model_type} config ({type(default).__name__}) has no key "
                          f"{key!r}; {key_hint(default, key)}")
    value = getattr(default, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SymmemError(f"--symbolic {symbol}={key}: {key} is {value!r} in the {model_type} config, not a size (a "
                          "positive integer); set it with --config or name another key")
    aliases = getattr(default, "attribute_map", {})  # alias -> the key it stands for (gpt2: hidden_size -> n_embd)
    return key if key in aliases else {v: a for a, v in aliases.items()}.get(key, key)


def _config_int(config: Any, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` the config holds as a positive integer (None: none)."""
    for k in keys:
        v = getattr(config, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None
