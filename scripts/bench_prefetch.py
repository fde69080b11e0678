#!/usr/bin/env python3
"""Would fetching weights into L2 while a decode step waits on latency shorten it? (GPU machine)

The 1B decoder's step (docs/benchmarks.md) spends 0.62 ms in products that
stream the weights, and 0.15 ms in kernels that barely touch the memory: the
attention over the cache, RoPE and the cache writes. The memory sits idle
through the second. A kernel that only issues prefetches (one per 128-byte
line, `prefetch.global.L2::evict_last`, nothing waits for them) launched
before the attention could have the next products' weights in L2 by the time
they run, so that the o projection, and the start of gate/up, read L2 rather
than HBM.

This times, from one CUDA graph per variant, a step built of the real
kernels a standalone bundle runs, on random weights of the 1B decoder's
shapes (16 layers and the head; bf16):

  products                the 65 fused matrix-vector launches alone
  + attention             and cuda-runner's decode attention (32 query
                          heads, 8 K/V heads, 512 cached positions) a layer
  + stand-ins             and four small kernels a layer standing in for
                          RoPE and the cache writes (ATen's, not Inductor's)
  + prefetch F MB         and, after each q/k/v launch, the prefetch kernel
                          over o's weight and F MB of gate's and up's
  prefetch alone          16 launches of the prefetch kernel over o's weight:
                          what issuing costs

Nothing here is checked against a reference: the step's values do not
depend on where a weight was read from.

    python3 scripts/bench_prefetch.py --output prefetch.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LINE_ELEMENTS = 64  # bf16 elements in a 128-byte line
LINES_PER_PROGRAM = 1024
PREFETCH_MB = (0, 8, 16, 24)


def prefetch_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_lines(base, last_line, sink, LINES: tl.constexpr):
        lines = tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)
        lines = tl.minimum(lines, last_line)  # a repeat of the last line rather than an address past the end
        issued = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                           [base + lines * 64], dtype=tl.int32, is_pure=False, pack=1)
        # The asm always yields 0, which the compiler cannot see: a store it must keep keeps the prefetches.
        tl.store(sink + tl.zeros_like(issued), issued, mask=issued != 0)

    return prefetch_lines


def prefetch_launch(kernel, tensor, nbytes: int, sink):
    """A launch that prefetches the first `nbytes` of `tensor` (bf16, contiguous)."""
    import triton

    lines = max(1, min(tensor.numel() * tensor.element_size(), nbytes) // (LINE_ELEMENTS * 2))
    return lambda: kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](tensor, lines - 1, sink, LINES=LINES_PER_PROGRAM, num_warps=4)


def step_launches(layers: list[dict], head: tuple, attention: bool, stand_ins: bool, prefetch_mb: int | None, kernel, sink) -> list:
    """A step's launches in order; `prefetch_mb` None leaves the prefetch kernel out."""
    import torch

    from cuda_runner.compile.matvec_kernel import fused_plan, launch_fused

    def fused(operands):
        x, weights, gain, added, outputs, gated = operands
        chosen = fused_plan([w.shape[0] for w in weights], x.shape[-1], gated)
        return lambda: launch_fused(x, weights, gain, 1e-5, added, gated, outputs, chosen)

    launches = []
    for layer in layers:
        launches.append(fused(layer["qkv"]))
        if prefetch_mb is not None:
            o_weight = layer["o"][1][0]
            launches.append(prefetch_launch(kernel, o_weight, o_weight.numel() * 2, sink))
            if prefetch_mb:
                for weight in layer["gate/up"][1]:
                    launches.append(prefetch_launch(kernel, weight, prefetch_mb * 2**20 // 2, sink))
        if stand_ins:
            q, k, cache, position, cos = layer["rope"]
            launches.append(lambda q=q, cos=cos: q.mul_(cos))
            launches.append(lambda k=k, cos=cos: k.mul_(cos))
            launches.append(lambda cache=cache, k=k, position=position: cache.index_copy_(2, position, k))
            launches.append(lambda cache=cache, k=k, position=position: cache.index_copy_(2, position, k))
        if attention:
            query, key, value = layer["attention"]
            launches.append(lambda query=query, key=key, value=value: torch.ops.cuda_runner.decode_attention(query, key, value, None, 0.125, 4))
        launches.extend(fused(layer[name]) for name in ("o", "gate/up", "down"))
    launches.append(fused(head))
    return launches


def decoder_operands(layer_count: int) -> tuple[list[dict], tuple]:
    """Random operands of the 1B decoder's step: per layer the four fused launches,
    the attention's query and cache, and the stand-ins' tensors; the head's launch."""
    import torch
    from bench_gemv import FUSED_CASES, fused_operands

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    names = {"qkv": "q/k/v + norm", "o": "o + residual", "gate/up": "gate/up + norm, gated", "down": "down + residual"}
    layers = []
    for _ in range(layer_count):
        layer = {name: fused_operands(FUSED_CASES[case], 1)[0] for name, case in names.items()}
        layer["attention"] = (bf16(1, 32, 1, 64), bf16(1, 8, 512, 64), bf16(1, 8, 512, 64))
        layer["rope"] = (bf16(1, 32, 1, 64), bf16(1, 8, 1, 64), bf16(1, 8, 512, 64),
                         torch.tensor([7], device="cuda"), bf16(1, 1, 1, 64))
        layers.append(layer)
    return layers, fused_operands(FUSED_CASES["head + norm"], 1)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--replays", type=int, default=50)
    options = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    import torch
    import triton
    from bench_gemv import graph_time_us, summary_us

    import cuda_runner.compile.attention_kernel  # noqa: F401  (registers cuda_runner::decode_attention)

    torch.manual_seed(0)
    kernel = prefetch_kernel()
    sink = torch.zeros(1, device="cuda", dtype=torch.int32)
    layers, head = decoder_operands(16)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                                  "date": time.strftime("%Y-%m-%d"), "replays": options.replays}
    variants: list[tuple[str, dict]] = [
        ("products", {"attention": False, "stand_ins": False, "prefetch_mb": None}),
        ("+ attention", {"attention": True, "stand_ins": False, "prefetch_mb": None}),
        ("+ stand-ins", {"attention": True, "stand_ins": True, "prefetch_mb": None}),
        *((f"+ prefetch o and {mb} MB of gate/up", {"attention": True, "stand_ins": True, "prefetch_mb": mb}) for mb in PREFETCH_MB),
    ]
    for name, variant in variants:
        times = graph_time_us(step_launches(layers, head, kernel=kernel, sink=sink, **variant), replays=options.replays)
        results[name] = summary_us(times)
        print(name, json.dumps(results[name]), flush=True)
    alone = [prefetch_launch(kernel, layer["o"][1][0], 2048 * 2048 * 2, sink) for layer in layers]
    results["prefetch alone, 16 launches"] = summary_us(graph_time_us(alone, replays=options.replays))
    print("prefetch alone", json.dumps(results["prefetch alone, 16 launches"]), flush=True)
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
