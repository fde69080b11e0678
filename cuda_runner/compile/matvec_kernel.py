"""The product of one row with a weight matrix, y = x @ W^T (+ b), as one
Triton kernel: what compile/matvec.py puts in place of a decode step's Linear
layers in standalone CUDA builds.

A decode step reads every weight once for a single row, so its speed is the
speed at which these products stream their weights from memory. Each program
takes a few whole rows of W, walks them in wide contiguous tiles that it
multiplies by the same stretch of x, keeps a tile of fp32 partial sums in
registers and reduces it once at the end; the weights are marked to be
evicted first, since nothing reads them again in the step.

The fused form (cuda_runner::matvec_fused) also computes what surrounds a
decoder's products, so that they cost no kernel of their own: the RMS norm
of the row before them, the SiLU-gated product of two weights after them
(SwiGLU), a residual added to the result, and up to three products of the
same row (q, k and v) in one launch. compile/matvec_fusion.py says which
graphs get it.

On Hopper and later GPUs the fused products take a kernel that loads its
first tiles of weight, then waits for the launch before it to finish
(griddepcontrol.wait) before it reads the row; cuda-runner's shim launches it
as a programmatic dependent, so that it starts while that launch drains.

Importing this module needs Triton (a CUDA build of torch has it); it
registers both operators, which Inductor compiles into the library like its
own kernels (torch.library.triton_op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

OPERATOR = "cuda_runner::matvec"
FUSED_OPERATOR = "cuda_runner::matvec_fused"

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
    first = _first_tile(weight, rows, ROWS_N, COLUMNS_K, ROW_STRIDE, BLOCK_N, BLOCK_K)
    # No norm: x stands in for the norm's weight, which is not read.
    result = _row_products(x, x, 1.0, weight, rows, first, ROWS_N, COLUMNS_K, ROW_STRIDE, False, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        result += tl.load(bias + rows, mask=row_inside, other=0.0).to(tl.float32)
    tl.store(out + rows, result.to(out.dtype.element_ty), mask=row_inside)


def plan(rows_n: int, columns_k: int, weights_per_program: int = 1) -> tuple[int, int, int]:
    """How a product is shared out: (rows of W per program, columns per step, warps).
    Wide steps along the rows (contiguous in memory), and as many rows per
    program as keep at least _TARGET_PROGRAMS programs; a program reading
    rows of two weights at once (the gated form) takes half as many of each."""
    block_k = min(1024, triton.next_power_of_2(max(1, columns_k)))
    block_n = 1
    while block_n * 2 * block_k * weights_per_program <= _TILE_ELEMENTS and rows_n // (block_n * 2) >= _TARGET_PROGRAMS:
        block_n *= 2
    return block_n, block_k, 4


@triton_op(OPERATOR, mutates_args=())
def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias for x [..., K] holding a single row (every leading dim
    1), weight [N, K], bias [N] or None: a tensor [..., N] of x's dtype."""
    _check_operands(OPERATOR, x, [weight], bias=bias)
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


@triton.jit
def _rms_scale(x, COLUMNS_K: tl.constexpr, EPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of the row, in fp32 as an RMS norm computes it."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, COLUMNS_K, BLOCK_K):
        columns = start + tl.arange(0, BLOCK_K)
        values = tl.load(x + columns, mask=columns < COLUMNS_K, other=0.0).to(tl.float32)
        squares += values * values
    return tl.math.rsqrt(tl.sum(squares, axis=0) / COLUMNS_K + EPS)


@triton.jit
def _vector_part(x, norm_weight, scale, columns, COLUMNS_K: tl.constexpr, NORM: tl.constexpr, MASKED: tl.constexpr):
    """A stretch of the row the products read, normed where asked, in fp32. The norm
    rounds where the graph it replaces rounds: (x * scale) to x's dtype, then times
    the norm's weight, to x's dtype again."""
    if MASKED:  # noqa: SIM108  (Triton: branches on a constexpr, not an expression)
        values = tl.load(x + columns, mask=columns < COLUMNS_K, other=0.0)
    else:
        values = tl.load(x + columns)
    if NORM:
        if MASKED:  # noqa: SIM108
            gain = tl.load(norm_weight + columns, mask=columns < COLUMNS_K, other=0.0)
        else:
            gain = tl.load(norm_weight + columns)
        normed = (values.to(tl.float32) * scale).to(values.dtype)
        values = (normed.to(tl.float32) * gain.to(tl.float32)).to(values.dtype)
    return values.to(tl.float32)


# Rows are computed in the function that stores them and passed down, never
# returned by a helper: Inductor finds which tensors a kernel writes by tracing each store's
# address back through the TTIR, and an address built from a helper's result
# counts every argument of that helper as written (the weights and the row
# then became outputs of the library).
@triton.jit
def _first_tile(weight, rows, ROWS_N: tl.constexpr, COLUMNS_K: tl.constexpr, ROW_STRIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first tile of the weight's `rows`, loaded before the program waits for
    the launch before it: weights are never written in a step, so they can be
    in flight while that launch finishes."""
    row_base = weight + rows[:, None] * ROW_STRIDE
    columns = tl.arange(0, BLOCK_K)
    if ROWS_N % BLOCK_N == 0 and COLUMNS_K % BLOCK_K == 0:
        tile = tl.load(row_base + columns[None, :], eviction_policy="evict_first")
    else:
        inside = (rows < ROWS_N)[:, None] & (columns[None, :] < COLUMNS_K)
        tile = tl.load(row_base + columns[None, :], mask=inside, other=0.0, eviction_policy="evict_first")
    return tile


@triton.jit
def _row_products(
    x, norm_weight, scale, weight, rows, first, ROWS_N: tl.constexpr, COLUMNS_K: tl.constexpr, ROW_STRIDE: tl.constexpr,
    NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The row times the weight's `rows` (BLOCK_N of them), whose first tile is
    `first` (_first_tile): their fp32 sums."""
    row_base = weight + rows[:, None] * ROW_STRIDE
    # Masks only where the shape needs them: an unmasked tile loads as wide vectors.
    masked: tl.constexpr = ROWS_N % BLOCK_N != 0 or COLUMNS_K % BLOCK_K != 0
    partial = first.to(tl.float32) * _vector_part(x, norm_weight, scale, tl.arange(0, BLOCK_K), COLUMNS_K, NORM, masked)[None, :]
    for start in range(BLOCK_K, COLUMNS_K, BLOCK_K):
        columns = start + tl.arange(0, BLOCK_K)
        if masked:
            inside = (rows < ROWS_N)[:, None] & (columns[None, :] < COLUMNS_K)
            tile = tl.load(row_base + columns[None, :], mask=inside, other=0.0, eviction_policy="evict_first")
        else:
            tile = tl.load(row_base + columns[None, :], eviction_policy="evict_first")
        partial += tile.to(tl.float32) * _vector_part(x, norm_weight, scale, columns, COLUMNS_K, NORM, masked)[None, :]
    return tl.sum(partial, axis=1)


@triton.jit
def _await_inputs(PDL: tl.constexpr):
    """0, once the launch before this one has finished and its writes are seen.

    Launched as a programmatic dependent (PDL), a program may start while the
    launch before it still runs; it must read nothing the step writes before
    this, and it then lets the launch after it start. The 0 is added to every
    address of such a read, which keeps those reads after the wait; the asm is
    marked pure because Inductor's analysis of what a kernel writes stops at
    asm that is not, and a pure asm whose value is used is never dropped."""
    if PDL:
        # No backslash anywhere in a kernel's source, comments too: Inductor pastes the source into a
        # string literal, which would read an escape in it (a newline, here).
        ready = tl.inline_asm_elementwise("griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                          dtype=tl.int32, is_pure=True, pack=1)
        ready = tl.multiple_of(ready, 16)  # as it is (0): the row's loads stay wide vectors
    else:
        ready = 0
    return ready


@triton.jit
def _norm_scale(x, COLUMNS_K: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The RMS norm's scale of the row, 1.0 without a norm."""
    if NORM:  # noqa: SIM108  (Triton: branches on a constexpr, not an expression)
        scale = _rms_scale(x, COLUMNS_K, EPS, BLOCK_K)
    else:
        scale = 1.0
    return scale


@triton.jit
def _store_rows(out, rows, sums, residual, ROWS_N: tl.constexpr, RESIDUAL: tl.constexpr):
    """The products rounded to the output's dtype, plus the residual (rounded again) where asked."""
    result = sums.to(out.dtype.element_ty)
    inside = rows < ROWS_N
    if RESIDUAL:
        added = tl.load(residual + rows, mask=inside, other=0.0)
        result = (result.to(tl.float32) + added.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + rows, result, mask=inside)


@triton.jit
def _one_weight(
    x, norm_weight, residual, weight, out, index, COLUMNS_K: tl.constexpr, ROWS_N: tl.constexpr, ROW_STRIDE: tl.constexpr,
    NORM: tl.constexpr, EPS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """A program of the fused kernel over one weight (`index` counts its programs over that weight)."""
    rows = index * BLOCK_N + tl.arange(0, BLOCK_N)
    first = _first_tile(weight, rows, ROWS_N, COLUMNS_K, ROW_STRIDE, BLOCK_N, BLOCK_K)
    ready = _await_inputs(PDL)
    scale = _norm_scale(x + ready, COLUMNS_K, NORM, EPS, BLOCK_K)
    sums = _row_products(x + ready, norm_weight + ready, scale, weight, rows, first, ROWS_N, COLUMNS_K, ROW_STRIDE, NORM, BLOCK_N, BLOCK_K)
    _store_rows(out, rows, sums, residual + ready, ROWS_N, RESIDUAL)


@triton.jit
def _matvec_fused_kernel(
    x, norm_weight, residual, weight0, weight1, weight2, out0, out1, out2,
    COLUMNS_K: tl.constexpr, ROWS0: tl.constexpr, ROWS1: tl.constexpr, ROWS2: tl.constexpr,
    STRIDE0: tl.constexpr, STRIDE1: tl.constexpr, STRIDE2: tl.constexpr, WEIGHTS: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, EPS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    _matvec_fused(x, norm_weight, residual, weight0, weight1, weight2, out0, out1, out2, COLUMNS_K, ROWS0, ROWS1, ROWS2, STRIDE0, STRIDE1,
                  STRIDE2, WEIGHTS, GATED, NORM, EPS, RESIDUAL, BLOCK_N, BLOCK_K, False)


# The same kernel for Hopper and later GPUs, to be launched as a programmatic
# dependent: it waits for the launch before it (_await_inputs). Its name says
# so to cuda-runner's shim, which launches it that way (crLaunchKernel in
# native/aoti_shim.cpp); anything else launches it plainly, and the wait is
# then a no-op.
@triton.jit
def cudarunner_pdl_matvec_fused(
    x, norm_weight, residual, weight0, weight1, weight2, out0, out1, out2,
    COLUMNS_K: tl.constexpr, ROWS0: tl.constexpr, ROWS1: tl.constexpr, ROWS2: tl.constexpr,
    STRIDE0: tl.constexpr, STRIDE1: tl.constexpr, STRIDE2: tl.constexpr, WEIGHTS: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, EPS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    _matvec_fused(x, norm_weight, residual, weight0, weight1, weight2, out0, out1, out2, COLUMNS_K, ROWS0, ROWS1, ROWS2, STRIDE0, STRIDE1,
                  STRIDE2, WEIGHTS, GATED, NORM, EPS, RESIDUAL, BLOCK_N, BLOCK_K, True)


@triton.jit
def _matvec_fused(
    x, norm_weight, residual, weight0, weight1, weight2, out0, out1, out2,
    COLUMNS_K: tl.constexpr, ROWS0: tl.constexpr, ROWS1: tl.constexpr, ROWS2: tl.constexpr,
    STRIDE0: tl.constexpr, STRIDE1: tl.constexpr, STRIDE2: tl.constexpr, WEIGHTS: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, EPS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)  # 64-bit: a vocabulary head passes 2**31 elements
    if GATED:  # silu(row @ W0^T) * (row @ W1^T), rounding as the graph does after each step
        rows = program * BLOCK_N + tl.arange(0, BLOCK_N)
        first_gate = _first_tile(weight0, rows, ROWS0, COLUMNS_K, STRIDE0, BLOCK_N, BLOCK_K)
        first_up = _first_tile(weight1, rows, ROWS0, COLUMNS_K, STRIDE1, BLOCK_N, BLOCK_K)
        ready = _await_inputs(PDL)
        scale = _norm_scale(x + ready, COLUMNS_K, NORM, EPS, BLOCK_K)
        gate = _row_products(x + ready, norm_weight + ready, scale, weight0, rows, first_gate, ROWS0, COLUMNS_K, STRIDE0, NORM, BLOCK_N,
                             BLOCK_K)
        up = _row_products(x + ready, norm_weight + ready, scale, weight1, rows, first_up, ROWS0, COLUMNS_K, STRIDE1, NORM, BLOCK_N, BLOCK_K)
        dtype = out0.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        _store_rows(out0, rows, activated * up.to(dtype).to(tl.float32), residual, ROWS0, False)
    elif WEIGHTS == 1:
        _one_weight(x, norm_weight, residual, weight0, out0, program, COLUMNS_K, ROWS0, STRIDE0, NORM, EPS, RESIDUAL, BLOCK_N, BLOCK_K, PDL)
    else:  # two or three weights, one after another along the programs (the unused are compiled out)
        first: tl.constexpr = (ROWS0 + BLOCK_N - 1) // BLOCK_N
        second: tl.constexpr = (ROWS1 + BLOCK_N - 1) // BLOCK_N
        if program < first:
            _one_weight(x, norm_weight, residual, weight0, out0, program, COLUMNS_K, ROWS0, STRIDE0, NORM, EPS, False, BLOCK_N, BLOCK_K, PDL)
        elif WEIGHTS == 2:  # noqa: SIM114  (a constexpr test, apart from the run-time one below)
            _one_weight(x, norm_weight, residual, weight1, out1, program - first, COLUMNS_K, ROWS1, STRIDE1, NORM, EPS, False, BLOCK_N, BLOCK_K,
                        PDL)
        elif program < first + second:
            _one_weight(x, norm_weight, residual, weight1, out1, program - first, COLUMNS_K, ROWS1, STRIDE1, NORM, EPS, False, BLOCK_N, BLOCK_K,
                        PDL)
        else:
            _one_weight(x, norm_weight, residual, weight2, out2, program - first - second, COLUMNS_K, ROWS2, STRIDE2, NORM, EPS, False,
                        BLOCK_N, BLOCK_K, PDL)


@triton_op(FUSED_OPERATOR, mutates_args=())
def matvec_fused(
    x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None, norm_eps: float,
    residual: torch.Tensor | None, gated: bool, read_only_weights: bool = False,
) -> list[torch.Tensor]:
    """Products of one row x [..., K] (every leading dim 1) with 1-3 weights [N_i, K]
    in one launch: one output [..., N_i] each, of x's dtype.

    norm_weight [K]: the row is RMS-normed first, (x * rsqrt(mean(x^2) + norm_eps))
    times norm_weight. gated (two weights of one N): one output, silu(x @ W0^T) *
    (x @ W1^T). residual [..., N] (one weight, not gated): added to the output.
    read_only_weights: nothing a step runs writes the weights (the model's
    parameters), so on Hopper and later the launch may fetch them before the
    launch ahead of it has finished (waits_for_inputs).
    matvec_fusion.reference computes the same in plain torch."""
    count = len(weights)
    if not 1 <= count <= 3 or (gated and count != 2) or (residual is not None and (count != 1 or gated)):
        raise ValueError(f"matvec_fused takes 1-3 weights, two when gated, one with a residual; got {count} (gated={gated})")
    _check_operands(FUSED_OPERATOR, x, weights, norm_weight, residual, gated)
    columns_k = x.shape[-1]
    vector = x if x.stride(-1) == 1 else x.contiguous()
    matrices = [weight if weight.stride(1) == 1 else weight.contiguous() for weight in weights]
    gain = None if norm_weight is None else norm_weight.contiguous()
    added = None if residual is None else residual.contiguous()
    leading = tuple(x.shape[:-1])
    outputs = [torch.empty((*leading, matrix.shape[0]), dtype=x.dtype, device=x.device) for matrix in matrices[:1 if gated else count]]
    rows = [matrix.shape[0] for matrix in matrices]
    launch_fused(vector, matrices, gain, norm_eps, added, gated, outputs, fused_plan(rows, columns_k, gated),
                 pdl=read_only_weights and waits_for_inputs(x.device))
    return outputs


# The best plans of sweeps on the H200 for the fused launches of Llama-shaped
# decoders at hidden 2048: (rows of all its weights, columns, weights a program
# reads) -> plan. Any launch of the same key gets the plan (o and a 1024+512+512
# q/k/v share one), which changes its speed, never its result. First swept one
# launch kind at a time, 16 launches from a CUDA graph (scripts/bench_gemv.py
# --fused): each beat plan()'s choice by 2-8%, and the gated plan holds twice
# plan()'s tile budget. Then swept in the whole step, every launch a programmatic
# dependent (scripts/bench_step_plans.py): q/k/v, o and down changed, 6-8 us a
# step each; gate/up's best there gained less than the spread and was not taken.
_SWEPT_PLANS = {
    (3072, 2048, 1): (2, 2048, 8),  # q, k and v
    (2048, 2048, 1): (2, 1024, 4),  # o, with the residual
    (8192, 2048, 2): (4, 1024, 4),  # gate and up, gated
    (2048, 8192, 1): (8, 2048, 8),  # down, with the residual
    (32000, 2048, 1): (2, 1024, 4),  # the vocabulary head
}


def _check_operands(
    operator: str, x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    gated: bool = False, bias: torch.Tensor | None = None,
) -> None:
    """Refuse operands the kernels would read past or compute only in part (the
    rewrite passes none; the operators are public): one row of K, weights [N, K],
    a norm weight [K], a residual or bias of N, one dtype."""
    columns_k = x.shape[-1]
    problems = []
    if x.numel() != columns_k:
        problems.append(f"x holds {x.numel() // max(1, columns_k)} rows, not one")
    for tensor in (*weights, norm_weight, residual, bias):
        if tensor is not None and tensor.dtype != x.dtype:
            problems.append(f"a {tensor.dtype} operand beside x of {x.dtype}")
    if any(weight.dim() != 2 or weight.shape[1] != columns_k for weight in weights):
        problems.append(f"weights of shapes {[tuple(weight.shape) for weight in weights]} for a row of {columns_k}")
    if norm_weight is not None and norm_weight.numel() != columns_k:
        problems.append(f"a norm weight of {norm_weight.numel()} for a row of {columns_k}")
    if gated and len({weight.shape[0] for weight in weights}) != 1:
        problems.append("gated weights of different row counts")
    for name, added in (("residual", residual), ("bias", bias)):
        if added is not None and added.numel() != weights[0].shape[0]:
            problems.append(f"a {name} of {added.numel()} for {weights[0].shape[0]} rows")
    if problems:
        raise ValueError(f"{operator}: {'; '.join(problems)}")


def fused_plan_key(rows: list[int], columns_k: int, gated: bool) -> tuple[int, int, int]:
    """What a fused launch's plan depends on: (rows a program's weights hold in
    all, columns, weights a program reads); plan() takes the same arguments."""
    return (rows[0] if gated else sum(rows), columns_k, 2 if gated else 1)


def fused_plan(rows: list[int], columns_k: int, gated: bool) -> tuple[int, int, int]:
    """How a fused launch of weights with `rows` rows each is shared out: a swept
    plan where the shape was measured, plan()'s otherwise."""
    key = fused_plan_key(rows, columns_k, gated)
    return _SWEPT_PLANS.get(key) or plan(*key)


def waits_for_inputs(device: torch.device) -> bool:
    """Whether fused products on `device` take the kernel launched as a
    programmatic dependent: a GPU that has the launch (compute capability 9,
    Hopper, and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_fused(
    vector: torch.Tensor, matrices: list[torch.Tensor], gain: torch.Tensor | None, norm_eps: float, added: torch.Tensor | None,
    gated: bool, outputs: list[torch.Tensor], chosen_plan: tuple[int, int, int], pdl: bool = False, launch_pdl: bool = False,
) -> None:
    """Launch the fused kernel on operands matvec_fused has checked and laid out,
    shared out as chosen_plan says (scripts/bench_gemv.py sweeps it). `pdl`
    (Hopper and later) takes the kernel that waits for the launch before it,
    and `launch_pdl` has Triton launch it as a programmatic dependent (in a
    library, the shim does)."""
    block_n, block_k, warps = chosen_plan
    count = len(matrices)
    rows = [matrix.shape[0] for matrix in matrices] + [0] * (3 - count)
    programs = triton.cdiv(rows[0], block_n) if gated else sum(triton.cdiv(n, block_n) for n in rows[:count])
    # Stand-ins for absent weights and outputs: the kernel is compiled without
    # reading or writing them, and x (an input) is never taken for an output.
    padded = matrices + [matrices[0]] * (3 - count)
    targets = outputs + [vector] * (3 - len(outputs))
    kernel = cudarunner_pdl_matvec_fused if pdl else _matvec_fused_kernel
    wrap_triton(kernel)[(programs,)](
        vector, gain if gain is not None else vector, added if added is not None else vector, *padded, *targets,
        COLUMNS_K=vector.shape[-1], ROWS0=rows[0], ROWS1=rows[1], ROWS2=rows[2],
        STRIDE0=padded[0].stride(0), STRIDE1=padded[1].stride(0), STRIDE2=padded[2].stride(0), WEIGHTS=count, GATED=gated,
        NORM=gain is not None, EPS=float(norm_eps), RESIDUAL=added is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps,
        **({"launch_pdl": True} if launch_pdl else {}),
    )

