#!/usr/bin/env python3
"""How near the 1B decoder's products are to what the memory gives them (GPU machine).

The step's 65 fused products read 2.08 GB and took about 0.585 ms from a
CUDA graph (3.56 TB/s; the floor at 4.8 TB/s is 0.433). Whether the rest is
the kernel's arithmetic and loads of the row, or the 65 launch boundaries
of a step whose every product waits for the one before, decides what to
build next. This times, from one CUDA graph each, in one run, on random
operands of the 1B decoder's shapes (16 layers and the head, bf16):

  one read          one launch reading the same bytes from one buffer: what
                    the memory gives with no boundary at all
  reads, plain      the step's 65 launches as reads alone, each with the
                    shipped plan's rows per program and columns per step,
                    launched one after another
  reads, programmatic
                    the same, each loading its first tile, then waiting for
                    the launch before (griddepcontrol.wait), launched as a
                    programmatic dependent: the products' own launch pattern
  reads, programmatic, every tile before the wait
                    the same with every tile read before the wait: whether
                    what the boundaries cost is the wait (reads held back
                    until the launch before ends) or the launches themselves
  products          the 65 fused products as shipped (norms, SwiGLU,
                    residuals), programmatic
  products and attention
                    the same and the decode attention of each layer at
                    position 255: the step's cuda-runner kernels

So products - reads (programmatic) is what the kernel's work adds to its
loads, reads (programmatic) - one read what the launch boundaries cost, and
the last row less the products what the attention costs. Medians of the
replays with p10-p90, microseconds, and the bytes' speed.

    python3 scripts/bench_read_ceiling.py --output ceiling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LAYERS = 16
STEP_POSITION = 255
# The fused launches of a layer and their operands' names in bench_step_plans.step_operands.
LAYER_LAUNCHES = ("qkv", "o", "gate/up", "down")


def read_kernel():
    """A kernel that reads rows of one weight, or of two for a gated launch, as
    the fused products do (the same tiles, eviction and, with PDL, the wait
    after the first tile), and sums them: the loads without the work."""
    import triton
    import triton.language as tl

    from cuda_runner.compile.matvec_kernel import _await_inputs

    @triton.jit
    def cudarunner_read_rows(w0, w1, out, K: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             PDL: tl.constexpr, ALL_EARLY: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        columns = tl.arange(0, BLOCK_K)
        sums = tl.load(w0 + rows[:, None] * K + columns[None, :], eviction_policy="evict_first").to(tl.float32)
        if GATED:
            sums += tl.load(w1 + rows[:, None] * K + columns[None, :], eviction_policy="evict_first").to(tl.float32)
        ready = 0
        if not ALL_EARLY:
            ready = _await_inputs(PDL)  # the products' own wait for the launch before
        elif PDL:  # the launch after may start as early as with the products' wait; only the wait moves
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        for start in range(BLOCK_K, K, BLOCK_K):
            at = start + columns
            sums += tl.load(w0 + rows[:, None] * K + at[None, :], eviction_policy="evict_first").to(tl.float32)
            if GATED:
                sums += tl.load(w1 + rows[:, None] * K + at[None, :], eviction_policy="evict_first").to(tl.float32)
        if ALL_EARLY and PDL:  # every tile read before the wait: what no dependency on the launch before would give
            ready = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(out + rows + ready, tl.sum(sums, axis=1))  # the wait's value used: kept, and ordered before the store

    return cudarunner_read_rows


def flat_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_all(data, out, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
        sums = tl.zeros([BLOCK], dtype=tl.float32)
        for step in range(STEPS):
            sums += tl.load(data + start + step * BLOCK + tl.arange(0, BLOCK), eviction_policy="evict_first").to(tl.float32)
        tl.store(out + tl.program_id(0), tl.sum(sums, axis=0))

    return read_all


def read_launches(layers: list[dict], head: tuple, plans: dict[str, tuple], pdl: bool, all_early: bool = False) -> list:
    """The step's 65 launches as reads of the same weights with the same plans."""
    import torch
    import triton

    kernel = read_kernel()
    launches = []
    named = [(name, layer[name]) for layer in layers for name in LAYER_LAUNCHES] + [("head", head)]
    for name, operands in named:
        _, weights, _, _, _, gated = operands
        block_n, block_k, warps = plans[name]
        # q, k and v are three tensors read one after another along the programs; one tensor of their rows reads alike.
        stacked = weights if gated else [torch.cat(weights)] if len(weights) > 1 else weights
        rows, k = stacked[0].shape
        out = torch.empty(rows, device="cuda", dtype=torch.float32)
        second = stacked[1] if gated else stacked[0]
        launches.append(lambda w0=stacked[0], w1=second, out=out, rows=rows, k=k, gated=gated, block_n=block_n, block_k=block_k,
                        warps=warps: kernel[(triton.cdiv(rows, block_n),)](
            w0, w1, out, K=k, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, ALL_EARLY=all_early, num_warps=warps,
            **({"launch_pdl": True} if pdl else {})))
    return launches


def step_bytes(layers: list[dict], head: tuple) -> int:
    operands = [layer[name] for layer in layers for name in LAYER_LAUNCHES] + [head]
    return sum(weight.numel() * weight.element_size() for _, weights, *_ in operands for weight in weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--replays", type=int, default=100)
    options = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    import torch
    import triton
    from bench_gemv import graph_time_us, summary_us
    from bench_step_plans import attention_plans, fused_launch, shipped_plans, step, step_operands

    torch.manual_seed(0)
    layers, head = step_operands()
    nbytes = step_bytes(layers, head)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                                  "date": time.strftime("%Y-%m-%d %H:%M"), "replays": options.replays, "bytes": nbytes,
                                  "floor_us": round(nbytes / 4.8e6, 1)}

    def record(name: str, launches) -> None:
        summary = summary_us(graph_time_us(launches, replays=options.replays))
        summary["tb_per_s"] = round(nbytes / summary["median_us"] / 1e6, 2)
        results[name] = summary
        print(name, json.dumps(summary), flush=True)

    flat = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
    read_all = flat_read_kernel()
    for block, steps, warps in ((4096, 8, 8), (8192, 8, 8), (2048, 16, 4)):
        programs = flat.numel() // (block * steps)  # what is left over, under 256 KiB, is not read
        sums = torch.empty(programs, device="cuda", dtype=torch.float32)
        record(f"one read ({block} x {steps}, {warps} warps)",
               [lambda programs=programs, sums=sums, block=block, steps=steps, warps=warps: read_all[(programs,)](
                   flat, sums, BLOCK=block, STEPS=steps, num_warps=warps)])
    plans = shipped_plans()
    results["plans"] = {name: list(chosen) for name, chosen in plans.items()}
    record("reads, plain", read_launches(layers, head, plans, pdl=False))
    record("reads, programmatic", read_launches(layers, head, plans, pdl=True))
    record("reads, programmatic, every tile before the wait", read_launches(layers, head, plans, pdl=True, all_early=True))
    products = [fused_launch(layer[name], plans[name]) for layer in layers for name in LAYER_LAUNCHES] + [fused_launch(head, plans["head"])]
    record("products", products)
    limit = torch.tensor([STEP_POSITION], device="cuda")
    record("products and attention", step(layers, head, plans, attention_plans()["shipped"], limit))
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
