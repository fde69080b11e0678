#!/usr/bin/env python3
"""The 1B decoder's matrix-vector products, one at a time, against the memory's speed (GPU machine).

A decode step of the 1B decoder reads 2.2 GB of weights through products of
one row: per layer q, k, v and o (2048x2048, 512x2048 twice, 2048x2048),
gate and up (8192x2048), down (2048x8192), and the vocabulary head
(32000x2048), bf16. Each shape is timed (weights out of L2 before every
call, as a step finds them) as:

  cuBLAS             torch's F.linear (libtorch's path; not standalone)
  Inductor           torch.compile of the same F.linear with the options a
                     standalone decode method compiles with (Triton only,
                     coordinate-descent tuning): the kernel cuda-runner's
                     bundles get, less what it fuses around it
  Triton GEMV        a plain matrix-vector kernel written here, over a sweep
                     of rows per program, columns per step, warps and splits
                     of the columns (split partial sums in fp32, their sum
                     not timed: the best case for a split)
  read               a kernel that only reads the weight (its sum): the
                     speed the memory gives this many bytes

It answers whether a kernel of our own would beat what Inductor generates,
per shape, before anything is built on it.

--graph times the products as a decode step runs them instead: 16 products
of a shape, each on weights of its own (a layer's), launched back to back
from one CUDA graph, so that neither the launch nor a cold start of the
timing counts; and the step's whole mix (7 products x 16 layers and the
head, 2.07 GB) in one graph. Each as:

  cuBLAS             F.linear
  cuda-runner        the matrix-vector kernel bundles get
                     (cuda_runner/compile/matvec_kernel.py), as planned
  sweep              the same kernel over rows per program, columns per
                     step and warps: the best plan for the shape

    python3 scripts/bench_gemv.py --output gemv.json
    python3 scripts/bench_gemv.py --graph --output gemv-graph.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

SHAPES = {"q/o 2048x2048": (2048, 2048), "k/v 512x2048": (512, 2048), "gate/up 8192x2048": (8192, 2048),
          "down 2048x8192": (2048, 8192), "head 32000x2048": (32000, 2048)}


def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, w_ptr, y_ptr, N, K, SPLIT_COLUMNS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for start in range(split * SPLIT_COLUMNS, (split + 1) * SPLIT_COLUMNS, BLOCK_K):
            columns = start + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + columns[None, :], mask=rows[:, None] < N, other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(x_ptr + columns)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(y_ptr + split * N + rows, tl.sum(acc, axis=1), mask=rows < N)

    @triton.jit
    def read(w_ptr, out_ptr, total, BLOCK: tl.constexpr):
        start = tl.program_id(0) * BLOCK * 8
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for step in range(8):
            offsets = start + step * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(w_ptr + offsets, mask=offsets < total, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    return gemv, read


def timed(row: dict, name: str, nbytes: int, call, check=None, want=None) -> None:
    """Median microseconds of `call` (L2 flushed before each), its GB/s, and the largest error of `check()` from `want`."""
    from triton.testing import do_bench

    microseconds = statistics.median([do_bench(call, warmup=25, rep=100) * 1000 for _ in range(3)])
    row[name] = {"us": round(microseconds, 2), "gb_per_s": round(nbytes / microseconds / 1e3, 1)}
    if check is not None:
        row[name]["max_abs_error"] = round(float((check().float() - want).abs().max()), 4)


def sweep(gemv, x, weight, partial) -> tuple:
    """The fastest configuration of the Triton GEMV for this shape: (its launch, the configuration)."""
    import triton
    from triton.testing import do_bench

    n, k = weight.shape
    best = None
    for block_n, block_k, warps, splits in itertools.product((1, 4, 16), (256, 1024), (4, 8), (1, 4)):
        if k % (splits * block_k) or block_n * block_k > 8192:
            continue

        def launch(block_n=block_n, block_k=block_k, warps=warps, splits=splits):
            gemv[(triton.cdiv(n, block_n), splits)](x, weight, partial, n, k, SPLIT_COLUMNS=k // splits, BLOCK_N=block_n,
                                                     BLOCK_K=block_k, num_warps=warps)
        launch()
        microseconds = do_bench(launch, warmup=10, rep=40) * 1000
        if best is None or microseconds < best[0]:
            best = (microseconds, launch, {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "splits": splits})
    assert best is not None
    return best[1], best[2]


def measure(shape: tuple[int, int], kernels_: tuple) -> dict:
    import torch
    import torch.nn.functional as F
    import triton

    gemv, read = kernels_
    n, k = shape
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = weight.numel() * 2
    want = F.linear(x, weight).float()
    row: dict = {"bytes": nbytes}
    timed(row, "cuBLAS", nbytes, lambda: F.linear(x, weight))
    torch._dynamo.reset()
    options = {"max_autotune": True, "max_autotune_gemm_backends": "TRITON", "coordinate_descent_tuning": True}
    compiled = torch.compile(lambda a, b: F.linear(a, b), options=options)
    compiled(x, weight)
    timed(row, "Inductor", nbytes, lambda: compiled(x, weight), lambda: compiled(x, weight), want)
    partial = torch.empty(8 * n, device="cuda", dtype=torch.float32)
    launch, config = sweep(gemv, x, weight, partial)

    def summed():
        launch()
        return partial[: config["splits"] * n].view(config["splits"], n).sum(0)
    timed(row, "Triton GEMV (best of the sweep)", nbytes, launch, summed, want[0])
    row["Triton GEMV (best of the sweep)"]["config"] = config
    sums = torch.empty(triton.cdiv(weight.numel(), 8 * 4096), device="cuda", dtype=torch.float32)
    timed(row, "read", nbytes, lambda: read[(sums.numel(),)](weight, sums, weight.numel(), BLOCK=4096, num_warps=8))
    return row


GRAPH_LAYERS = 16
# The shapes of one layer, in the order a step runs them, and the head once.
STEP_MIX = ["q/o 2048x2048", "k/v 512x2048", "k/v 512x2048", "q/o 2048x2048", "gate/up 8192x2048", "gate/up 8192x2048", "down 2048x8192"]


def graph_time_us(launches, replays: int = 30) -> list[float]:
    """Microseconds of each replay of a CUDA graph holding `launches` (called in order)."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for launch in launches:  # compile and warm up outside the capture
            launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for launch in launches:
            launch()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return times


def kernel_launch(kernel, x, weight, out, block_n: int, block_k: int, warps: int):
    import triton

    n, k = weight.shape
    return lambda: kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, out, ROWS_N=n, COLUMNS_K=k, ROW_STRIDE=weight.stride(0), HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)


def measure_in_graph(shape: tuple[int, int]) -> dict:
    """One shape, GRAPH_LAYERS products on weights of their own, from one graph."""
    import torch
    import torch.nn.functional as F

    from cuda_runner.compile.matvec_kernel import _matvec_kernel, matvec, plan

    n, k = shape
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(GRAPH_LAYERS)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    nbytes = n * k * 2 * GRAPH_LAYERS
    want = F.linear(x, weights[0]).float()
    error = (matvec(x, weights[0], None).float() - want).abs().max().item()
    row: dict = {"bytes_per_product": n * k * 2, "plan": plan(n, k), "max_abs_error": round(error, 4)}

    def record(name: str, launches) -> float:
        per_product = statistics.median(graph_time_us(launches)) / GRAPH_LAYERS
        row[name] = {"us": round(per_product, 2), "tb_per_s": round(nbytes / GRAPH_LAYERS / per_product / 1e6, 2)}
        return per_product

    record("cuBLAS", [lambda w=w: F.linear(x, w) for w in weights])
    record("cuda-runner", [lambda w=w: matvec(x, w, None) for w in weights])
    tried = []
    for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
        if block_n * block_k > 16384 or block_k > max(256, k):
            continue
        launches = [kernel_launch(_matvec_kernel, x, w, out, block_n, block_k, warps) for w in weights]
        tried.append((statistics.median(graph_time_us(launches, replays=10)) / GRAPH_LAYERS, (block_n, block_k, warps)))
    tried.sort()
    row["sweep"] = {"us": round(tried[0][0], 2), "tb_per_s": round(nbytes / GRAPH_LAYERS / tried[0][0] / 1e6, 2), "plan": tried[0][1],
                    "next best": [{"us": round(us, 2), "plan": plan_} for us, plan_ in tried[1:6]]}
    return row


def measure_step_mix() -> dict:
    """A step's products (STEP_MIX x GRAPH_LAYERS and the head) from one graph: its weights once each."""
    import torch
    import torch.nn.functional as F

    from cuda_runner.compile.matvec_kernel import matvec

    shapes = [SHAPES[label] for _ in range(GRAPH_LAYERS) for label in STEP_MIX] + [SHAPES["head 32000x2048"]]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in shapes]
    inputs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes}
    nbytes = sum(n * k * 2 for n, k in shapes)
    row: dict = {"products": len(shapes), "bytes": nbytes}
    for name, product in (("cuBLAS", lambda x, w: F.linear(x, w)), ("cuda-runner", lambda x, w: matvec(x, w, None))):
        times = graph_time_us([lambda w=w, product=product: product(inputs[w.shape[1]], w) for w in weights])
        row[name] = {**summary_us(times), "tb_per_s": round(nbytes / statistics.median(times) / 1e6, 2)}
    row["floor_us"] = round(nbytes / 4.8e6, 1)
    return row


# The launches of a step built with the fused kernel (compile/matvec_fusion.py):
# rows of each weight, columns, the RMS norm before, a residual after, gated.
FUSED_CASES = {
    "q/k/v + norm": ((2048, 512, 512), 2048, True, False, False),
    "o + residual": ((2048,), 2048, False, True, False),
    "gate/up + norm, gated": ((8192, 8192), 2048, True, False, True),
    "down + residual": ((2048,), 8192, False, True, False),
    "head + norm": ((32000,), 2048, True, False, False),
}


def fused_operands(case: tuple, layers: int) -> list:
    """`layers` sets of operands for one fused launch: (x, weights, norm weight, residual, outputs, gated)."""
    import torch

    rows, k, norm, residual, gated = case
    def bf16(*shape: int, uniform: bool = False) -> torch.Tensor:
        return (torch.rand if uniform else torch.randn)(*shape, device="cuda", dtype=torch.bfloat16)

    x = bf16(1, k)
    sets = []
    for _ in range(layers):
        weights = [bf16(n, k) / 32 for n in rows]
        outputs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n in rows[:1 if gated else len(rows)]]
        sets.append((x, weights, bf16(k, uniform=True) if norm else None, bf16(1, rows[0]) if residual else None, outputs, gated))
    return sets


def measure_fused_in_graph(case: tuple) -> dict:
    """One fused launch, GRAPH_LAYERS of them on weights of their own, from one graph:
    as planned and over a sweep of plans."""
    from cuda_runner.compile.matvec_kernel import fused_plan, launch_fused

    rows, k, _, _, gated = case
    sets = fused_operands(case, GRAPH_LAYERS)
    nbytes = sum(rows) * k * 2

    def per_launch_us(chosen: tuple, replays: int) -> float:
        launches = [lambda s=s: launch_fused(s[0], s[1], s[2], 1e-5, s[3], s[5], s[4], chosen) for s in sets]
        return statistics.median(graph_time_us(launches, replays=replays)) / GRAPH_LAYERS

    rule, shipped = _rule_plan(rows, k, gated), fused_plan(list(rows), k, gated)
    row: dict = {"bytes_per_launch": nbytes, "plan": rule, "shipped_plan": shipped}
    for name, chosen in (("plan()", rule), ("cuda-runner", shipped)):
        us = per_launch_us(chosen, 30)
        row[name] = {"us": round(us, 2), "tb_per_s": round(nbytes / us / 1e6, 2)}
    tried = []
    per_program = 2 if gated else 1
    for chosen in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
        block_n, block_k, _ = chosen
        if block_n * block_k * per_program > 16384 or block_k > max(256, k):
            continue
        tried.append((per_launch_us(chosen, 10), chosen))
    tried.sort()
    row["sweep"] = {"us": round(tried[0][0], 2), "tb_per_s": round(nbytes / tried[0][0] / 1e6, 2), "plan": tried[0][1],
                    "next best": [{"us": round(us_, 2), "plan": plan_} for us_, plan_ in tried[1:6]]}
    return row


def _rule_plan(rows: tuple, k: int, gated: bool) -> tuple[int, int, int]:
    """plan()'s choice for a fused launch, the swept table aside."""
    from cuda_runner.compile.matvec_kernel import fused_plan_key, plan

    return plan(*fused_plan_key(list(rows), k, gated))


def measure_fused_step(best_plans: dict[str, tuple]) -> dict:
    """A step's fused launches (4 a layer x GRAPH_LAYERS and the head) from one
    graph: with plan()'s choices, as shipped (the swept table) and with each case's best plan from this sweep."""
    from cuda_runner.compile.matvec_kernel import fused_plan, launch_fused

    labels = [label for _ in range(GRAPH_LAYERS) for label in list(FUSED_CASES)[:4]] + ["head + norm"]
    operands = [(label, fused_operands(FUSED_CASES[label], 1)[0]) for label in labels]
    nbytes = sum(sum(FUSED_CASES[label][0]) * FUSED_CASES[label][1] * 2 for label in labels)
    row: dict = {"launches": len(labels), "bytes": nbytes, "floor_us": round(nbytes / 4.8e6, 1)}
    rules = {label: _rule_plan(case[0], case[1], case[4]) for label, case in FUSED_CASES.items()}
    shipped = {label: fused_plan(list(case[0]), case[1], case[4]) for label, case in FUSED_CASES.items()}
    for name, plans in (("as planned", rules), ("as shipped", shipped), ("best plans", best_plans)):
        launches = [lambda s=s, chosen=plans[label]: launch_fused(s[0], s[1], s[2], 1e-5, s[3], s[5], s[4], chosen) for label, s in operands]
        times = graph_time_us(launches)
        row[name] = {**summary_us(times), "tb_per_s": round(nbytes / statistics.median(times) / 1e6, 2)}
    return row


def summary_us(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_us": round(statistics.median(ordered), 1), "p10_us": round(ordered[len(ordered) // 10], 1),
            "p90_us": round(ordered[(9 * len(ordered)) // 10], 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--graph", action="store_true", help="time the products from CUDA graphs, as a decode step runs them")
    parser.add_argument("--fused", action="store_true", help="time the fused kernel's launches of a step from CUDA graphs, over a sweep of plans")
    options = parser.parse_args()
    import torch
    import triton

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    torch.manual_seed(0)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                                  "date": time.strftime("%Y-%m-%d"), "mode": "graph" if options.graph else "one call"}
    if options.fused:
        results["mode"] = "fused, graph"
        best = {}
        for label, case in FUSED_CASES.items():
            measured = measure_fused_in_graph(case)
            best[label] = tuple(measured["sweep"]["plan"])
            results[label] = measured
            print(label, json.dumps(measured), flush=True)
        results["fused step"] = measure_fused_step(best)
        print("fused step", json.dumps(results["fused step"]), flush=True)
        if options.output is not None:
            options.output.write_text(json.dumps(results, indent=1))
        return 0
    compiled_kernels = None if options.graph else kernels()
    for label, shape in SHAPES.items():
        results[label] = measure_in_graph(shape) if options.graph else measure(shape, compiled_kernels)
        print(label, json.dumps(results[label]), flush=True)
    if options.graph:
        results["step mix"] = measure_step_mix()
        print("step mix", json.dumps(results["step mix"]), flush=True)
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
