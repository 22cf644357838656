"""Start-up of the command line against ``python -c "import sympy"`` (run by hand from the repository root:
``python benchmarks/bench_startup.py [ROUNDS]``; results in the README).

Targets: ``symmem --help`` and ``symmem --version`` <= 0.6x the time of ``python -c "import sympy"`` (they need
neither sympy nor the zoo); ``symmem derive vit-b16`` <= 1.3x.

Each round runs every command once, in a rotating order, each in a fresh interpreter; a command's ratio is the
median over rounds of (its time / the sympy import's time in the same round), so that a noisy machine moves
both sides of a ratio together.  The ``symmem`` script (``symmem.cli:entry``) leaves without tearing the
interpreter down, and with the garbage collector's young-generation threshold raised (which also makes its own
import of sympy faster: ``import sympy, symmem's GC`` shows by how much); ``derive vit-b16, torn down`` is the
same command through ``sys.exit(main())`` with the default collector, for comparison (``import sympy`` is torn
down as usual).  The commands run this checkout's code (``python -c`` puts
the current directory first on ``sys.path``), with bytecode caching on, as an installed package has it.
``-X importtime`` lists what a command imports; ``--imports`` prints the modules ``derive vit-b16`` loads beyond
``import sympy``.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*argv: str) -> list[str]:
    # what the installed ``symmem`` script runs (pyproject.toml: symmem.cli:entry)
    code = f"import sys; sys.argv = ['symmem', *{list(argv)!r}]; from symmem.cli import entry; entry()"
    return [sys.executable, "-c", code]


COMMANDS = {
    "python -c 'import sympy'": [sys.executable, "-c", "import sympy"],
    "python -c 'pass'": [sys.executable, "-c", "pass"],
    # the same import under the garbage-collector setting the ``symmem`` script uses (symmem.cli.entry)
    "import sympy, symmem's GC": [sys.executable, "-c", "import gc; gc.set_threshold(200_000, 30, 30); "
                                  "import sympy"],
    "symmem --help": _cli("--help"),
    "symmem --version": _cli("--version"),
    "symmem models": _cli("models"),
    "symmem derive vit-b16": _cli("derive", "vit-b16"),
    "symmem derive llama": _cli("derive", "llama"),
    # the same through main() and sys.exit: the interpreter torn down as usual
    "derive vit-b16, torn down": [sys.executable, "-c", "import sys; from symmem.cli import main; "
                                  "sys.exit(main(['derive', 'vit-b16']))"],
}
TARGETS = {"symmem --help": 0.6, "symmem --version": 0.6, "symmem derive vit-b16": 1.3}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode compiled
    env.pop("PYTHONPATH", None)
    return env


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child: user + system, which other work on the machine barely moves)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports() -> list[str]:
    """Modules ``symmem derive vit-b16`` imports beyond ``import sympy``."""
    code = ("import sys, io, contextlib; from symmem.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['derive', 'vit-b16'])\n"
            "print('\\n'.join(sorted(sys.modules)))")
    env = _env()
    base = subprocess.run([sys.executable, "-c", "import sympy, sys; print('\\n'.join(sorted(sys.modules)))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.split()
    used = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout.split()
    return sorted(set(used) - set(base))


def main(rounds: int = 15) -> int:
    env = _env()
    for cmd in COMMANDS.values():  # warm the file cache and write bytecode
        _run(cmd, env)
    names = list(COMMANDS)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            w, c = _run(COMMANDS[name], env)
            wall[name].append(w)
            cpu[name].append(c)
    base = "python -c 'import sympy'"
    print(f"{rounds} rounds; medians of wall and CPU time (user + system), and of the ratio to python -c 'import "
          f"sympy' in the same round")
    print(f"  {'command':<28} {'wall':>8} {'ratio':>6} {'CPU':>8} {'ratio':>6}  target")
    for name in names:
        ratios = [statistics.median(t / b for t, b in zip(times[name], times[base], strict=True))
                  for times in (wall, cpu)]
        target = TARGETS.get(name)
        verdict = "" if target is None else f"<= {target}  {'ok' if max(ratios) <= target else 'MISSED'}"
        print(f"  {name:<28} {statistics.median(wall[name]) * 1000:5.0f} ms {ratios[0]:6.2f} "
              f"{statistics.median(cpu[name]) * 1000:5.0f} ms {ratios[1]:6.2f}  {verdict}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--imports"]:
        print(" ".join(imports()))
        sys.exit(0)
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 15))
