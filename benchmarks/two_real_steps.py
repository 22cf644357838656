"""Two real training steps of a model, as a process: the yardstick ``symmem trace`` with its peak is timed against.

    python benchmarks/two_real_steps.py gpt2        # transformers GPT-2, 6 layers, n_embd 256, 4 heads, B=2, S=128
    python benchmarks/two_real_steps.py resnet50    # torchvision's ResNet-50 (symmem's plain-torch copy), B=2, 64x64

Each run builds the model as ``symmem trace`` builds it (``hf:gpt2 --config n_layer=6 --config n_embd=256 --config
n_head=4``; ``benchmarks/resnet50_64.py:resnet50``), then runs what the traced step runs: forward, the output's
sum as the loss, backward, ``AdamW.step()`` and ``zero_grad(set_to_none=True)``, twice.  Compare side by side,
alternating the two commands five times or more and taking the median of each process's user + system CPU time
(``/usr/bin/time -f '%U %S'``; on a shared machine wall time is noise)::

    for i in 1 2 3 4 5; do
        /usr/bin/time -f 'real steps %U %S' python benchmarks/two_real_steps.py gpt2
        /usr/bin/time -f 'trace %U %S' python -m symmem.cli trace hf:gpt2 --config n_layer=6 --config n_embd=256 \
            --config n_head=4 --dims B,S > /dev/null
    done

PyTorch runs these steps on all cores by default; where other work shares them, the waiting OpenMP threads cost
several times the steps' own CPU (the README quotes the spread).  ``OMP_NUM_THREADS=1`` gives the steps on one thread,
the yardstick that such load does not move.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

B, S = 2, 128


def gpt2() -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    import torch
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=6, n_embd=256, n_head=4)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    return model, (), {"input_ids": torch.randint(0, cfg.vocab_size, (B, S))}


def resnet50() -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # resnet50_64 builds symmem's copy of torchvision's ResNet-50
    from resnet50_64 import resnet50 as build

    model, inputs = build()
    return model, inputs, {}


def main(name: str) -> None:
    import torch

    model, args, kwargs = {"gpt2": gpt2, "resnet50": resnet50}[name]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        out = model(*args, **kwargs)
        out = out.logits if hasattr(out, "logits") else out
        out.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpt2")
