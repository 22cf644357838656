"""Selective recomputation on a real GPU: transformers' own eager attention with its core in a checkpoint.

    PYTHONPATH=$PWD python benchmarks/check_cuda_selective.py [--json OUT.json]

The core attention (``Q K^T``, softmax, dropout, ``@ V``; Korthikanti et al. 2022, section 5) of HF GPT-2 and HF
Llama runs as ``torch.utils.checkpoint(eager_attention_forward, ..., use_reentrant=False)``, registered through
``AttentionInterface`` as a user would (tests/test_selective_recompute.py does the same on the CPU under the
live-bytes tracker).  Each case: three training steps (logits' sum, for-loop AdamW) on CUDA,
``torch.cuda.max_memory_allocated`` less what was allocated before the model was built, against
``derive(..., checkpoint="selective", device="cuda").peak_allocated()`` for the first and the steady step; the
same model without checkpointing as the control.  No convolution: no cuDNN scratch band, every row must be exact.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_cuda import allocated, warm_cublas  # noqa: E402

from symmem import derive  # noqa: E402
from symmem.record.hf_llama import logits_of  # noqa: E402

SMALL = {"B": 2, "S": 64, "H": 32, "h": 4, "L": 2, "V": 64, "F": 64}
WIDER = {"B": 4, "S": 256, "H": 256, "h": 8, "L": 2, "V": 512, "F": 1024}
#: (label, model, sizes, options)
CASES = [
    ("hf gpt2 eager, no cache", "gpt2", SMALL, {"cache": "none"}),
    ("hf gpt2 eager, no cache", "gpt2", WIDER, {"cache": "none"}),
    ("hf gpt2 eager, cache", "gpt2", WIDER, {"cache": "dynamic"}),
    ("hf llama eager G=1, cache", "llama", {**SMALL, "S": 16, "G": 1}, {"cache": "dynamic"}),
    ("hf llama eager G=2, no cache", "llama", {**SMALL, "G": 2}, {"cache": "none"}),
    ("hf llama eager G=2, cache", "llama", {**WIDER, "G": 2}, {"cache": "dynamic"}),
    ("hf llama eager G=8, no cache", "llama", {**WIDER, "G": 8}, {"cache": "none"}),
]


def register() -> None:
    """transformers' GPT-2 and Llama eager attention, each checkpointed, under names of their own."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.llama import modeling_llama

    def checkpointed(fn: Any) -> Any:
        def core(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(fn, module, query, key, value, attention_mask,
                                                     use_reentrant=False, **kwargs)
        return core

    for name, module in (("symmem_ckpt_gpt2", modeling_gpt2), ("symmem_ckpt_llama", modeling_llama)):
        AttentionInterface.register(name, checkpointed(module.eager_attention_forward))
        AttentionMaskInterface.register(name, eager_mask)


def build(model: str, v: dict[str, int], cache: str, selective: bool) -> tuple[Any, tuple[Any, ...], None]:
    import torch

    torch.manual_seed(0)
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=v["V"], n_positions=1024, n_embd=v["H"], n_layer=v["L"], n_head=v["h"],
                            n_inner=v["F"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            use_cache=cache == "dynamic", bos_token_id=0, eos_token_id=0)
        config._attn_implementation = "symmem_ckpt_gpt2" if selective else "eager"
        module = GPT2LMHeadModel(config)
        ids = torch.randint(0, v["V"], (v["B"], v["S"]))
    else:
        from symmem.record.hf_llama import hf_llama

        module, ids = hf_llama(v, "naive", cache=cache)
        if selective:
            module.config._attn_implementation = "symmem_ckpt_llama"
    return logits_of(module).to("cuda"), (ids.to("cuda"),), None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    import transformers

    register()
    warm_cublas()
    rows = []
    for label, model, v, options in CASES:
        for checkpoint in ("none", "selective"):
            asked: list[int] = []
            got = allocated(functools.partial(build, model, v, options["cache"], checkpoint == "selective"),
                            "adamw", "for-loop", loss=lambda y: y.sum(), steps=3, requested=asked)
            d = derive(model, convention="pytorch", checkpoint=checkpoint, device="cuda", loss="sum",
                       optimizer_impl="for-loop", attention="naive", dropout=0.0, values=v, **options)
            want = [d.peak_allocated("first"), d.peak_allocated("steady")]
            ok = want == [got[0], got[-1]]
            rows.append({"case": f"{label} {checkpoint}", "model": model, "values": v, "options": options,
                         "checkpoint": checkpoint, "predicted": want, "measured": got, "requested": asked, "ok": ok})
            print(f"  {label + ' ' + checkpoint:<42} {v['B']}x{v['S']} H={v['H']}  predicted {want}  measured {got}"
                  f"  {'ok' if ok else 'DIFFERS'}", flush=True)
    out = {"device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "rows": rows}
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} rows agree; {out['device']} {out['versions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
