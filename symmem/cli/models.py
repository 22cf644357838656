"""``symmem models``: the built-in models, their symbols and defaults."""

from __future__ import annotations

import argparse

NAME = "models"
HELP = "list the built-in models"
ORDER = 10


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="also show each model's options")


def run(args: argparse.Namespace) -> int:
    from ..models import available, build

    pad = " " * 15
    if args.verbose:
        from ..options import defaults

        print("defaults every command and symmem.derive/trace/track_step share:")
        for option, said in defaults():
            print(f"  {option:<12} {said}")
        print()
    for name, e in sorted(available().items()):
        m = build(name)
        defaults = ", ".join(f"{s.name}={m.defaults[s]}" for s in m.symbols if s in m.defaults)
        print(f"{name:<14} {e.description}")
        print(f"{pad}formula in {', '.join(s.name for s in m.free)}; defaults: {defaults}")
        if args.verbose:
            for key, o in e.options.items():
                choices = f" ({'|'.join(map(str, o.choices))})" if o.choices else ""
                print(f"{pad}--{key} {o.default}{choices}: {o.help}")
    return 0
