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

    python3 scripts/bench_gemv.py --output gemv.json
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    options = parser.parse_args()
    import torch
    import triton

    torch.manual_seed(0)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                                  "date": time.strftime("%Y-%m-%d")}
    compiled_kernels = kernels()
    for label, shape in SHAPES.items():
        results[label] = measure(shape, compiled_kernels)
        print(label, json.dumps(results[label]), flush=True)
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
