"""Speed of ``symmem.importer.trace_module`` against one real forward (run by hand: ``python
benchmarks/bench_trace.py``; needs torch==2.13.0 and transformers==5.23.0; results in docs/importer.md).

Targets: GPT-2 124M (default config) and a ResNet-50-sized Hugging Face ResNet trace in < 5 s on 2 cores; a
7B Llama config built on the ``meta`` device traces in < 30 s without allocating weights.

For every configuration: the wall and CPU time of ``trace_module`` (first run, with its real check forward
at the example sizes; then again with ``check=False``), one real training-mode forward at the same example
sizes (warm, best of 3) and the ratio of CPU times trace (no check) / forward.  Wall times on a shared
machine are noisy; CPU time (this process, all threads) is the steadier number.  The first trace includes
first-run costs (the real forward's oneDNN kernels, sympy caches).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any

import torch
import transformers as tf

from symmem.importer import trace_module

TEXT = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}
IMAGE = {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]}


def timed(fn: Any) -> tuple[float, float, Any]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def forward(module: Any, inputs: Any) -> None:
    module.train()
    out = module(**inputs) if isinstance(inputs, dict) else module(*inputs)
    del out


def gpt2(attn: str) -> Any:
    cfg = tf.GPT2Config()
    cfg._attn_implementation = attn
    return tf.GPT2LMHeadModel(cfg)


def llama7b() -> Any:
    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg)


def ids(vocab: int, b: int = 2, s: int = 32) -> dict[str, Any]:
    return {"input_ids": torch.randint(0, vocab, (b, s))}


# name, builder, inputs, dims, options
CASES: list[tuple[str, Any, Any, dict[str, Any], dict[str, Any]]] = [
    ("gpt2-124M sdpa", lambda: gpt2("sdpa"), lambda: ids(50257), TEXT, {}),
    ("gpt2-124M eager", lambda: gpt2("eager"), lambda: ids(50257), TEXT, {}),
    ("bert-base", lambda: tf.BertForMaskedLM(tf.BertConfig()), lambda: ids(30522), TEXT, {}),
    ("resnet-50 (HF)", lambda: tf.ResNetForImageClassification(tf.ResNetConfig()),
     lambda: (torch.randn(2, 3, 64, 64),), IMAGE, {"multiple_of": {"Hi": 32, "Wi": 32}}),
    ("vit-base (HF)", lambda: tf.ViTForImageClassification(tf.ViTConfig()),
     lambda: (torch.randn(2, 3, 224, 224),), {"B": [(0, 0)]}, {}),
    ("mobilenetv2 (HF, fitted)", lambda: tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config()),
     lambda: (torch.randn(2, 3, 64, 64),), IMAGE, {}),
    ("llama-7B on meta", llama7b, lambda: ids(32000, 2, 16), TEXT, {}),
]


def main(argv: list[str]) -> int:
    only = set(argv)
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':<26}{'trace (wall/cpu)':>17}{'no check':>15}{'forward':>15}{'ratio':>7}  method    activations")
    for name, build, make, dims, options in CASES:
        if only and not any(o in name for o in only):
            continue
        torch.manual_seed(0)
        module = build()
        inputs = make()
        meta = any(p.device.type == "meta" for p in module.parameters())
        w, c, t = timed(partial(trace_module, module, inputs, dims, **options))
        w2, c2, _ = timed(partial(trace_module, module, inputs, dims, check=False, **options))
        fw = fc = None
        if not meta:
            forward(module, inputs)  # warm: oneDNN kernels, allocator
            fw, fc = (min(x) for x in zip(*[timed(partial(forward, module, inputs))[:2] for _ in range(3)],
                                          strict=True))
        ratio = f"{c2 / fc:6.1f}x" if fc else "   n/a"
        fws = f"{fw:6.2f}/{fc:5.2f}s" if fw else f"{'n/a':>14}"
        expr = str(t.activations)
        print(f"{name:<26}{w:>9.2f}/{c:5.2f}s{w2:>7.2f}/{c2:5.2f}s{fws:>15}{ratio}  {t.method:<9} "
              f"{expr if len(expr) < 60 else expr[:57] + '...'}")
        if t.layers is not None:
            print(f"{'':<26}{t.ops} aten ops; {t.layers.path} x {t.layers.count}: {t.layers.bytes} bytes per layer")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
