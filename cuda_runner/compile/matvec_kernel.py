"""The product of one row with a weight matrix, y = x @ W^T (+ b), as one
Triton kernel: what compile/matvec.py puts in place of a decode step's Linear
layers in standalone CUDA builds.

A decode step reads every weight once for a single row, so its speed is the
speed at which these products stream their weights from memory. Each program
takes a few whole rows of W, walks them in wide contiguous tiles that it
multiplies by the same stretch of x, keeps a tile of fp32 partial sums in
registers and reduces it once at the end; the weights are marked to be
evicted first, since nothing reads them again in the step.

Importing this module needs Triton (a CUDA build of torch has it); it
registers the operator cuda_runner::matvec, which Inductor compiles into the
library like its own kernels (torch.library.triton_op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

OPERATOR = "cuda_runner::matvec"

# Elements of W one program holds per step (rows x columns): 32 fp32 partial sums a thread of 4 warps.
# Measured on the H200, each product from a CUDA graph as in a decode step (scripts/bench_gemv.py --graph).
_TILE_ELEMENTS = 4096
# Programs a product aims for at least: several per SM of a large GPU (132 on the H200), so that loads overlap.
_TARGET_PROGRAMS = 1024


# The shape is compiled in (constexpr), not passed: Inductor names one kernel
# per set of integer arguments it sees, and AOTInductor embeds each name's
# binary apart; two names whose binaries were the same (the same specialisation
# of runtime integers) failed to link (the tiny decoder's products on the H200).
@triton.jit
def _matvec_kernel(
    x, weight, bias, out, ROWS_N: tl.constexpr, COLUMNS_K: tl.constexpr, ROW_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # 64-bit: a vocabulary head passes 2**31 elements
    row_inside = rows < ROWS_N
    row_base = weight + rows[:, None] * ROW_STRIDE
    partial = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, COLUMNS_K, BLOCK_K):
        columns = start + tl.arange(0, BLOCK_K)
        # Masks only where the shape needs them: an unmasked tile loads as wide vectors.
        if ROWS_N % BLOCK_N == 0 and COLUMNS_K % BLOCK_K == 0:
            tile = tl.load(row_base + columns[None, :], eviction_policy="evict_first")
            vector = tl.load(x + columns)
        else:
            inside = row_inside[:, None] & (columns[None, :] < COLUMNS_K)
            tile = tl.load(row_base + columns[None, :], mask=inside, other=0.0, eviction_policy="evict_first")
            vector = tl.load(x + columns, mask=columns < COLUMNS_K, other=0.0)
        partial += tile.to(tl.float32) * vector.to(tl.float32)[None, :]
    result = tl.sum(partial, axis=1)
    if HAS_BIAS:
        result += tl.load(bias + rows, mask=row_inside, other=0.0).to(tl.float32)
    tl.store(out + rows, result.to(out.dtype.element_ty), mask=row_inside)


def plan(rows_n: int, columns_k: int) -> tuple[int, int, int]:
    """How a product is shared out: (rows of W per program, columns per step, warps).
    Wide steps along the rows (contiguous in memory), and as many rows per
    program as keep at least _TARGET_PROGRAMS programs."""
    block_k = min(1024, triton.next_power_of_2(max(1, columns_k)))
    block_n = 1
    while block_n * 2 * block_k <= _TILE_ELEMENTS and rows_n // (block_n * 2) >= _TARGET_PROGRAMS:
        block_n *= 2
    return block_n, block_k, 4


@triton_op(OPERATOR, mutates_args=())
def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias for x [..., K] holding a single row (every leading dim
    1), weight [N, K], bias [N] or None: a tensor [..., N] of x's dtype."""
    rows_n, columns_k = weight.shape
    # The kernel reads x and each row of W as contiguous runs; the rewrite only
    # passes tensors laid out so, and anything else is packed first.
    vector = x if x.stride(-1) == 1 else x.contiguous()
    matrix = weight if weight.stride(1) == 1 else weight.contiguous()
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    out = torch.empty((*x.shape[:-1], rows_n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = plan(rows_n, columns_k)
    # Without a bias the kernel reads none; W stands in for the pointer (an input, never the output).
    wrap_triton(_matvec_kernel)[(triton.cdiv(rows_n, block_n),)](
        vector, matrix, bias if bias is not None else matrix, out, ROWS_N=rows_n, COLUMNS_K=columns_k, ROW_STRIDE=matrix.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return out
