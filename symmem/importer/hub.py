"""Where an ``hf:`` model's config comes from: a model type, a Hub id, a local directory or a ``config.json``.

``hf:TARGET`` is read as (first match wins):

- a local directory holding a ``config.json`` (``hf:./my-model``; a directory given with a ``/`` in its path
  must hold one), or the path of a JSON file (``hf:path/to/config.json``): its keys, read as JSON (never
  evaluated);
- a path that is not there (it ends in ``.json``, starts with ``.``, ``/`` or ``~``, or has more than one ``/``):
  an error naming it;
- a Hub id ``org/name`` (``hf:openai-community/gpt2``): its ``config.json`` from the local Hugging Face cache
  (``huggingface_hub.hf_hub_download(..., local_files_only=True)``; ``HF_HUB_CACHE`` or ``HF_HOME`` as set when
  it is read), else fetched from the Hub unless ``HF_HUB_OFFLINE`` is set.  Only the config is read: never weights;
- a model type (``hf:gpt2``): the defaults of that transformers config class (no keys of its own).

A Hub id neither cached nor reachable is a one-line :class:`~symmem.errors.SymmemError` saying the way out.

>>> kind_of("gpt2"), kind_of("openai-community/gpt2"), kind_of("configs/tiny/config.json")
('model type', 'hub', 'path')
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SymmemError

#: a config.json is a few kilobytes; a larger file is not one (a checkpoint given by mistake is not read)
MAX_CONFIG_BYTES = 4 * 2**20
#: a Hub id as the Hub spells one: ``org/name`` of letters, digits, ``-``, ``_`` and ``.``
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class HubConfig:
    """The keys of an ``hf:`` model's config and where they came from."""

    target: str
    model_type: str
    #: the config's keys (``config.json``'s, ``model_type`` left out); empty for a model type: the class's defaults
    values: dict[str, Any] = field(default_factory=dict)
    #: ``model type``, or the file the keys were read from (a local path or the Hub cache's)
    origin: str = "model type"


def kind_of(target: str) -> str:
    """``path``, ``hub`` or ``model type``: how ``hf:TARGET`` is read (module docstring)."""
    path = Path(target).expanduser()
    if path.is_file() or (path.is_dir() and ("/" in target or (path / "config.json").is_file())):
        return "path"  # a directory named like a model type (gpt2/) without a config.json is not one
    if target.endswith(".json") or target.startswith((".", "/", "~")) or target.count("/") > 1 or "\\" in target:
        return "path"
    return "hub" if "/" in target else "model type"


def locate(target: str) -> HubConfig:
    """The config ``hf:TARGET`` names (module docstring)."""
    if not target.strip():
        raise SymmemError("hf: names no model: give a model type (hf:gpt2), a Hub id (hf:openai-community/gpt2), a "
                          "directory holding a config.json or the path of one")
    kind = kind_of(target)
    if kind == "model type":
        return HubConfig(target, target)
    if kind == "hub":
        if not _HUB_ID.match(target) or ".." in target or "--" in target:
            raise SymmemError(f"hf:{target}: not a Hub id (org/name: letters, digits, '-', '_', '.') nor a file here")
        return _read(target, config_file(target))
    path = Path(target).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SymmemError(f"hf:{target}: the directory holds no config.json (a Hugging Face model directory does)")
    elif not path.is_file():
        raise SymmemError(f"hf:{target}: no such file or directory")
    return _read(target, path)


def _read(target: str, path: Path) -> HubConfig:
    """The keys of the JSON file ``path``."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise SymmemError(f"hf:{target}: {path} is {size:,} bytes, not a config.json (a few kilobytes); give "
                              "the model's config.json")
        values = json.loads(path.read_text(encoding="utf-8"))
    except SymmemError:
        raise
    except json.JSONDecodeError as exc:
        raise SymmemError(f"hf:{target}: {path} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
                          ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SymmemError(f"hf:{target}: cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(values, dict):
        raise SymmemError(f"hf:{target}: {path} holds a JSON {type(values).__name__}, not a config (an object)")
    model_type = values.pop("model_type", None)
    if not isinstance(model_type, str) or not model_type:
        raise SymmemError(f"hf:{target}: {path} has no model_type, which names the transformers config class "
                          "(e.g. \"model_type\": \"llama\")")
    return HubConfig(target, model_type, values, str(path))


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, now (its own constant is read once, at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> str | None:
    """The Hugging Face hub cache as the environment names it now (``HF_HUB_CACHE``, else ``HF_HOME/hub``), or
    None: huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def config_file(repo_id: str) -> Path:
    """The local path of ``repo_id``'s ``config.json``: from the cache, else downloaded (that file alone)."""
    try:
        from huggingface_hub import hf_hub_download
    except Exception as exc:
        raise SymmemError(f"hf:{repo_id}: huggingface_hub is not importable here ({type(exc).__name__}); download "
                          "its config.json and pass the path: hf:path/to/config.json") from None
    where = cache_dir()
    try:
        return Path(hf_hub_download(repo_id, "config.json", cache_dir=where, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache entry it cannot use
        pass
    shown = where or "the default cache"
    if _offline():
        raise SymmemError(f"hf:{repo_id}: its config.json is not in the Hugging Face cache ({shown}) and "
                          "HF_HUB_OFFLINE is set: set HF_HUB_OFFLINE=0 to fetch it, or download its config.json and "
                          "pass the path (hf:path/to/config.json)")
    from huggingface_hub import constants, errors

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    unreachable = (f"hf:{repo_id}: its config.json is not in the Hugging Face cache ({shown}) and the Hub "
                   f"({endpoint}) cannot be reached")
    way_out = "download its config.json and pass the path (hf:path/to/config.json)"
    why = _unreachable(endpoint)
    if why is not None:  # at once: huggingface_hub retries a refused connection for half a minute
        raise SymmemError(f"{unreachable} ({why}): {way_out}")
    try:
        return Path(hf_hub_download(repo_id, "config.json", cache_dir=where, endpoint=endpoint))
    except errors.LocalEntryNotFoundError as exc:  # the Hub did not answer (a subclass of EntryNotFoundError)
        raise SymmemError(f"{unreachable} ({_first_line(exc)}): {way_out}") from None
    except errors.GatedRepoError:
        raise SymmemError(f"hf:{repo_id}: the repository is gated; accept its terms on the Hub and log in "
                          f"(hf auth login), or {way_out}") from None
    except errors.RepositoryNotFoundError:
        raise SymmemError(f"hf:{repo_id}: no such repository on the Hub (or it is private: log in with hf auth "
                          "login); check the id, e.g. hf:openai-community/gpt2") from None
    except errors.EntryNotFoundError:
        raise SymmemError(f"hf:{repo_id}: the repository has no config.json (not a transformers model)") from None
    except Exception as exc:
        raise SymmemError(f"{unreachable} ({type(exc).__name__}: {_first_line(exc)}): {way_out}") from None


def _unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why a connection to ``endpoint`` cannot be opened (no network, an unknown host, a refused port), or None."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return None  # through a proxy: only the request itself can tell
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return f"HF_ENDPOINT {endpoint!r} names no host"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None


def _first_line(exc: BaseException) -> str:
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    return lines[0][:200] if lines else type(exc).__name__
