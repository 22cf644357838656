"""Writing the files symmem makes (plots, the paper): checked paths, and nothing half-written.

:func:`output_path` checks a path before any work is done: not empty, the right suffix, a directory that
exists, a name the file system takes.  :func:`write_atomically` writes through a temporary file in the same
directory and renames it over the target only once it is complete, so a failure (a full disk, a directory
that cannot be written) leaves the target as it was; every ``OSError`` becomes a :class:`SymmemError`.

>>> output_path("")
Traceback (most recent call last):
symmem.errors.SymmemError: the output path is empty
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import SymmemError


def _limit(directory: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(directory, name))
    except (OSError, ValueError, AttributeError):
        return default


def output_path(path: str | os.PathLike[str], suffixes: Sequence[str] | None = None, what: str = "output",
                directory: bool = False) -> Path:
    """``path`` as a :class:`~pathlib.Path` that can be written, or a :class:`SymmemError` saying why not.

    ``suffixes`` are the allowed suffixes of a file (``.png`` ...); ``directory`` says ``path`` is a directory
    that may not exist yet (its parent must).
    """
    if not isinstance(path, str | os.PathLike):
        raise SymmemError(f"the {what} path must be text or a path, got {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise SymmemError(f"the {what} path is empty")
    if "\x00" in text:
        raise SymmemError(f"the {what} path {text!r} contains a NUL character")
    p = Path(text)
    shown = text if len(text) <= 80 else text[:60] + "..."
    if suffixes is not None and not directory and p.suffix.lower() not in suffixes:
        raise SymmemError(f"cannot write {p.name[:60]!r}: use one of {', '.join(suffixes)}")
    parent = p.parent
    if not parent.exists():
        raise SymmemError(f"cannot write {shown!r}: the directory {str(parent)[:80]!r} does not exist")
    if not parent.is_dir():
        raise SymmemError(f"cannot write {shown!r}: {str(parent)[:80]!r} is not a directory")
    if len(p.name.encode()) > _limit(parent, "PC_NAME_MAX", 255):
        raise SymmemError(f"cannot write {shown!r}: the name is {len(p.name)} characters, more than the file "
                          "system allows")
    if len(os.fsencode(p.absolute())) >= _limit(parent, "PC_PATH_MAX", 4096):
        raise SymmemError(f"cannot write {shown!r}: the path is longer than the file system allows")
    if directory:
        if p.exists() and not p.is_dir():
            raise SymmemError(f"cannot write into {shown!r}: it is a file, not a directory")
    elif p.is_dir():
        raise SymmemError(f"cannot write {shown!r}: it is a directory")
    if not os.access(parent if not (directory and p.exists()) else p, os.W_OK | os.X_OK):
        raise SymmemError(f"cannot write {shown!r}: the directory is not writable")
    return p


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` to write a temporary file beside ``path``, then rename it to ``path``.

    If ``write`` fails, or the file system refuses, the temporary file is removed, ``path`` is left as it was,
    and an ``OSError`` becomes a :class:`SymmemError` naming ``path``.
    """
    target = Path(path)
    tmp: Path | None = None
    try:
        fd, name = tempfile.mkstemp(prefix=".symmem-", suffix=target.suffix, dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # a file's usual mode, not the temporary file's private one
        write(tmp)
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise SymmemError(f"cannot write {str(target)[:80]!r}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return target


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """``text`` written to ``path`` atomically (see :func:`write_atomically`)."""
    return write_atomically(path, lambda tmp: tmp.write_text(text))
