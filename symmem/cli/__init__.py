"""The ``symmem`` command: one module per subcommand in this package, found without a list.

A command module defines ``HELP`` (one line), ``ORDER`` (its place in ``symmem --help``), ``configure(parser)``
and ``run(args) -> int``; :func:`main` imports every module of the package whose name does not start with an
underscore (``common`` holds what commands share), and configures only the command being run, so that
``symmem --help`` and ``symmem --version`` answer without building a model or importing sympy.

Bad input (unknown model, symbol or option; values that are not positive integers) prints one line
``symmem: error: ...`` and exits with status 2.  Nothing the user types is ever evaluated: ``--set`` parses
integers.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import io
import os
import pkgutil
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from ..errors import NothingCounted, NothingFits, OutsideDomain, SymmemError, UncountedInput

VERSION = "0.1.0"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`SymmemError` (one line, exit 2).

    A value that starts with a minus sign and a digit (``--budget -3GiB``, ``--set B=-1`` written ``--set -1``) is
    a value, not an option: argparse takes only plain negative numbers for values and would otherwise say
    "expected one argument" instead of what is wrong with the value.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SymmemError(message)

    def _print_message(self, message: str, file: Any = None) -> None:
        """``--help`` and ``--version`` as argparse prints them, except that a write that fails (a closed or full
        standard output) is said, where argparse drops it silently."""
        if message:
            (file or sys.stderr).write(message)


def commands() -> dict[str, ModuleType]:
    """Every command module, by command name, in the order ``symmem --help`` lists them."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found[getattr(module, "NAME", info.name)] = module
    return dict(sorted(found.items(), key=lambda kv: (getattr(kv[1], "ORDER", 100), kv[0])))


def _chosen(chosen: str | None, argv: Sequence[str]) -> dict[str, ModuleType] | None:
    """The command module named ``chosen`` alone, where it is the one the command line runs: a module whose file
    is named for it and names itself so (``NAME``), no option before it (``symmem --help derive`` lists every
    command).  None otherwise: then every module is imported, as ``symmem --help`` and an unknown command need
    (their names and one-line helps).  The other commands' modules are not imported for a command that does not
    list them (``symmem derive``: 9 modules compiled from source, ~0.04 CPU-s)."""
    if chosen is None or chosen.startswith("_") or chosen == "common" or argv[0] != chosen:
        return None
    if chosen not in {info.name for info in pkgutil.iter_modules(__path__)}:
        return None
    module = importlib.import_module(f"{__name__}.{chosen}")
    return {chosen: module} if getattr(module, "NAME", chosen) == chosen else None


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="symmem", description="Closed-form training-memory formulas.")
    parser.add_argument("--version", action="version", version=f"symmem {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    found = _chosen(chosen, argv) or commands()
    for name, module in found.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if name == chosen:
            module.configure(p)
            p.set_defaults(run=module.run)
    return parser


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped, so that an error is one line.

    >>> print(one_line("unrecognized arguments: a" + chr(10) + "b"))
    unrecognized arguments: a\\nb
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def entry() -> None:
    """The ``symmem`` console script: :func:`main`, then exit without tearing the interpreter down.

    Tearing down frees sympy's objects one by one, about a third of a second's start-up again (0.1 s on the
    2-core machine); the operating system reclaims the memory at once.  Standard output and error are flushed
    first; no command leaves a file open or registers work to do at exit.

    The cyclic garbage collector runs a young-generation pass every 200,000 net allocations instead of every 700
    (mypy's setting): sympy allocates hundreds of thousands of small objects while it imports and while a
    formula is built, almost none of them in cycles, and the default threshold spent about 25 ms of
    ``symmem derive vit-b16`` (8%) walking them.  Only the command does this; importing symmem changes nothing.
    """
    import gc

    gc.set_threshold(200_000, 30, 30)
    _usable_streams()
    try:
        status = main()
    except SystemExit as exc:  # --help and --version
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # a reader that went away (``| head``)
        pass
    except OSError as exc:  # a full disk under the help's few lines
        if status == 0:
            print(f"symmem: error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
            status = 2
    except ValueError:  # a closed stream
        pass
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(status)


class _Closed(io.TextIOBase):
    """Standard output when the command was started with it closed (``>&-``): writing to it is an error, as
    writing to a closed descriptor is, where Python would drop the text silently (``sys.stdout`` is None)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "standard output is closed")


def _writable(fd: int) -> bool:
    """Whether descriptor ``fd`` is open for writing (a closed one may have been taken by a file opened to read
    before symmem started: a shell script's own, with ``2>&-``)."""
    try:
        import fcntl
    except ImportError:  # not Unix: whether it is open is all that can be asked
        try:
            os.fstat(fd)
        except OSError:
            return False
        return True
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError:
        return False


def _usable_streams() -> None:
    """Standard output and error as the command can use them.

    A stream started closed keeps its descriptor taken (by ``/dev/null``), so that a file the command opens
    never becomes descriptor 1 or 2; a closed standard output then fails on the first write (one line on
    standard error, exit 2) and a closed standard error drops what is written to it.  A stream whose encoding
    cannot write every character symmem prints (``PYTHONIOENCODING=ascii``: the title's em dash, the ``…`` of a
    cut formula) replaces those it cannot (``?``) instead of failing half-way through the output.
    """
    for fd in (1, 2):
        if _writable(fd):
            continue
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if fd == 1:
            sys.stdout = _Closed()
        else:
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- for the command's whole life
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None)
        if encoding and isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            try:
                "\u2014\u2026\u2248".encode(encoding)
            except (UnicodeEncodeError, LookupError):
                stream.reconfigure(errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``symmem`` command; returns the exit status."""
    import warnings

    args_in = list(sys.argv[1:] if argv is None else argv)
    if not args_in:  # `symmem` alone: the commands it has, where argparse would say only that one is required
        print(_parser(["--help"]).format_help().rstrip(), file=sys.stderr)
        print("symmem: error: name a command (symmem COMMAND --help for its options)", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NothingCounted)
            warnings.simplefilter("always", OutsideDomain)
            warnings.simplefilter("always", UncountedInput)
            args = _parser(args_in).parse_args(args_in)
            status = int(args.run(args))
            sys.stdout.flush()  # a full disk or a closed output fails here, while it can still be said
        # a convention that sees nothing in the graph: one line on stderr whatever the format (the text table says
        # so too), so that a 0 piped into a script is never silent
        # numbers outside the formulas' domain (--set B=64 on a trace that holds where B < 16): the same one line
        # a kept input selective recomputation needs and does not count: the same one line
        ours = (NothingCounted, OutsideDomain, UncountedInput)
        for note in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, ours)):
            print(f"symmem: warning: {one_line(note)}", file=sys.stderr)
        for w in caught:  # recording took every warning: the others go where they would have gone
            if not issubclass(w.category, ours):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
        return status
    except NothingFits as exc:  # an answer: exit 1, not the 2 of bad input
        print(f"symmem: {exc}", file=sys.stderr)
        return 1
    except SymmemError as exc:
        print(f"symmem: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``| head -c1``): quiet, as Unix tools are
        return 0
    except UnicodeEncodeError as exc:  # a stream main was handed (entry makes the console's replace)
        bad = exc.object[exc.start:exc.end]
        print(f"symmem: error: the output's encoding ({exc.encoding}) cannot write {bad!r}; use UTF-8 "
              "(PYTHONIOENCODING=utf-8)", file=sys.stderr)
        return 2
    except OSError as exc:  # the output cannot be written (a full disk, a closed standard output)
        where = exc.filename if exc.filename is not None else "cannot write the output"
        print(f"symmem: error: {one_line(f'{where}: {exc.strerror or exc}')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C
        print("symmem: interrupted", file=sys.stderr)
        return 130
