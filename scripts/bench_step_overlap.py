#!/usr/bin/env python3
"""Can a decode step's launches overlap? Two ways, timed (GPU machine).

The 1B decoder's step (docs/benchmarks.md) spends 0.62 ms in products that
stream the weights, and 0.15 ms in kernels that barely touch the memory: the
attention over the cache, RoPE and the cache writes. Between launches the GPU
drains one kernel before it starts the next.

  PDL         each fused product launched as a programmatic dependent of the
              launch before it: its programs start while that launch drains,
              load their first tiles of weight, and wait for it only before
              they read the row (matvec_kernel._await_inputs)
  prefetch    a kernel that only issues `prefetch.global.L2::evict_last` (one
              per 128-byte line), launched after each q/k/v launch over o's
              weight and F MB of gate's and up's, to have them in L2 by the
              time they run

This times, from one CUDA graph per variant, a step built of the real
kernels a standalone bundle runs, on random weights of the 1B decoder's
shapes (16 layers and the head; bf16):

  products                the 65 fused matrix-vector launches alone
  + attention             and cuda-runner's decode attention (32 query
                          heads, 8 K/V heads, 512 cached positions) a layer
  + stand-ins             and four small kernels a layer standing in for
                          RoPE and the cache writes (ATen's, not Inductor's)
  prefetch alone          16 launches of the prefetch kernel over o's weight

Each launch reads operands of its own, so the timed step's values mean
nothing; --check instead chains 16 layers of q/k/v, o, gate/up and down
launches, each reading what the one before wrote, and compares the result
with PDL and without, eagerly and from a graph: equal to the bit, or the
wait lets a read overtake a write.

    python3 scripts/bench_step_overlap.py --check --output overlap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LINE_ELEMENTS = 64  # bf16 elements in a 128-byte line
LINES_PER_PROGRAM = 1024
PREFETCH_MB = (0, 16)


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


def step_launches(layers: list[dict], head: tuple, attention: bool, stand_ins: bool, prefetch_mb: int | None, kernel, sink,
                  pdl: bool = False) -> list:
    """A step's launches in order; `prefetch_mb` None leaves the prefetch kernel out."""
    import torch

    from cuda_runner.compile.matvec_kernel import fused_plan, launch_fused

    def fused(operands):
        x, weights, gain, added, outputs, gated = operands
        chosen = fused_plan([w.shape[0] for w in weights], x.shape[-1], gated)
        return lambda: launch_fused(x, weights, gain, 1e-5, added, gated, outputs, chosen, pdl=pdl, launch_pdl=pdl)

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


def chained_step(layer_count: int, pdl: bool):
    """A function running `layer_count` layers of the decoder's products, each
    launch reading what the one before wrote (q/k/v of the normed row, o of q
    plus the row, gated gate/up of the normed row, down plus the row), and every
    tensor the launches write, the last row last."""
    import torch

    from cuda_runner.compile.matvec_kernel import fused_plan, launch_fused

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) / 32

    hidden, ffn = 2048, 8192
    rows = [bf16(1, hidden) * 32]
    written: list[torch.Tensor] = []
    launches = []
    for _ in range(layer_count):
        row = rows[-1]
        gain = torch.rand(hidden, device="cuda", dtype=torch.bfloat16)
        qkv = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n in (2048, 512, 512)]
        after_o, gated, after_down = (torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n in (hidden, ffn, hidden))
        steps = [
            (row, [bf16(2048, hidden), bf16(512, hidden), bf16(512, hidden)], gain, None, False, qkv),
            (qkv[0], [bf16(hidden, 2048)], None, row, False, [after_o]),
            (after_o, [bf16(ffn, hidden), bf16(ffn, hidden)], gain, None, True, [gated]),
            (gated, [bf16(hidden, ffn)], None, after_o, False, [after_down]),
        ]
        for x, weights, norm, added, is_gated, outputs in steps:
            chosen = fused_plan([w.shape[0] for w in weights], x.shape[-1], is_gated)
            launches.append(lambda x=x, w=weights, g=norm, r=added, o=outputs, c=chosen, gate=is_gated:
                            launch_fused(x, w, g, 1e-5, r, gate, o, c, pdl=pdl, launch_pdl=pdl))
        rows.append(after_down)
        written += [*qkv, after_o, gated, after_down]
    return lambda: [launch() for launch in launches], written


def check_pdl(layer_count: int = 16) -> dict:
    """The chained step's last row with PDL and without, eagerly and replayed from a graph."""
    import torch

    results = {}
    for mode in ("eager", "graph"):
        finals = {}
        for pdl in (False, True):
            torch.manual_seed(1)
            run, written = chained_step(layer_count, pdl)
            run()  # compiles outside any capture
            if mode == "graph":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            # A read that overtook the write it depends on would read NaN.
            for tensor in written:
                tensor.fill_(float("nan"))
            graph.replay() if mode == "graph" else run()
            torch.cuda.synchronize()
            finals[pdl] = written[-1].clone()
        equal = bool(torch.equal(finals[False], finals[True]))
        results[mode] = {"equal to the bit": equal, "finite": bool(finals[True].isfinite().all()),
                         "max abs": float(finals[False].float().abs().max())}
        print(f"check {mode}", json.dumps(results[mode]), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--check", action="store_true", help="first compare a chained step with PDL and without")
    options = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    import torch
    import triton
    from bench_gemv import graph_time_us, summary_us

    import cuda_runner.compile.attention_kernel  # noqa: F401  (registers cuda_runner::decode_attention)

    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                                  "date": time.strftime("%Y-%m-%d"), "replays": options.replays}
    if options.check:
        results["check"] = check_pdl()
    torch.manual_seed(0)
    kernel = prefetch_kernel()
    sink = torch.zeros(1, device="cuda", dtype=torch.int32)
    layers, head = decoder_operands(16)
    variants: list[tuple[str, dict]] = [
        (f"{name}{', PDL' if pdl else ''}", {**variant, "pdl": pdl})
        for name, variant in (("products", {"attention": False, "stand_ins": False}), ("+ attention", {"attention": True, "stand_ins": False}),
                              ("+ stand-ins", {"attention": True, "stand_ins": True}))
        for pdl in (False, True)
    ]
    variants += [(f"+ stand-ins, prefetch o and {mb} MB of gate/up", {"attention": True, "stand_ins": True, "prefetch_mb": mb})
                 for mb in PREFETCH_MB]
    for name, variant in variants:
        launches = step_launches(layers, head, kernel=kernel, sink=sink, **{"prefetch_mb": None, **variant})
        results[name] = summary_us(graph_time_us(launches, replays=options.replays))
        print(name, json.dumps(results[name]), flush=True)
    alone = [prefetch_launch(kernel, layer["o"][1][0], 2048 * 2048 * 2, sink) for layer in layers]
    results["prefetch alone, 16 launches"] = summary_us(graph_time_us(alone, replays=options.replays))
    print("prefetch alone", json.dumps(results["prefetch alone, 16 launches"]), flush=True)
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
