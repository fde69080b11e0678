"""The fused decode attention: one Triton kernel for scaled-dot-product
attention over a few query rows (a decode step), which compile/attention.py
puts in place of SDPA in standalone CUDA builds.

SDPA's math form, what a standalone build lowers SDPA to otherwise, becomes
five kernels a layer (scores, a softmax in two passes, the product with the
values, the copies that repeat grouped K/V heads); this kernel reads each
cached key and value once, keeps the softmax online (a running maximum and
sum), and indexes the K/V head of a query head directly (grouped-query
attention without copies). One program per (batch, head, query row).

Importing this module needs Triton (a CUDA build of torch has it); it
registers the operator cuda_runner::decode_attention, which Inductor compiles
into the library like its own kernels (torch.library.triton_op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

OPERATOR = "cuda_runner::decode_attention"

# Mask kinds, as the kernel reads them.
_NO_MASK, _BOOL_MASK, _ADDITIVE_MASK = 0, 1, 2
# Elements of one tile of keys a program holds in registers (keys x head dim).
_TILE_ELEMENTS = 8192


@triton.jit
def _decode_attention_kernel(
    query, key, value, mask, out, scale, kv_length, group,
    q_b, q_h, q_l, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_l, m_s, o_b, o_h, o_l, o_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASK_KIND: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a layer's cache may pass 2**31 elements
    row = program % ROWS
    head = (program // ROWS) % HEADS
    batch = program // (ROWS * HEADS)
    kv_head = head // group
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    q = tl.load(query + batch * q_b + head * q_h + row * q_l + dims * q_d, mask=dims < HEAD_DIM, other=0.0)
    # The product is cast, not the scale: Inductor passes the scale as fp64 to the
    # kernel it builds, and as a Python float to its analysis of what the kernel writes.
    q = (q.to(tl.float32) * scale).to(tl.float32)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    key_base = key + batch * k_b + kv_head * k_h
    value_base = value + batch * v_b + kv_head * v_h
    mask_base = mask + batch * m_b + head * m_h + row * m_l
    for start in range(0, kv_length, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = positions < kv_length
        keys = tl.load(key_base + positions[:, None] * k_s + dims[None, :] * k_d,
                       mask=inside[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
        scores = tl.sum(keys.to(tl.float32) * q[None, :], axis=1)
        if MASK_KIND == 1:
            allowed = tl.load(mask_base + positions * m_s, mask=inside, other=0)
            scores = tl.where(allowed != 0, scores, float("-inf"))
        elif MASK_KIND == 2:
            scores += tl.load(mask_base + positions * m_s, mask=inside, other=0.0).to(tl.float32)
        scores = tl.where(inside, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        # Every position so far masked: keep exponents finite (exp(-inf - -inf) is NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - shift)
        weights = tl.exp(scores - shift)
        values = tl.load(value_base + positions[:, None] * v_s + value_dims[None, :] * v_d,
                         mask=inside[:, None] & (value_dims[None, :] < VALUE_DIM), other=0.0)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * values.to(tl.float32), axis=0)
        running_max = new_max
    # A row with every position masked gives zeros, as torch's SDPA does (its safe softmax).
    result = tl.where(running_sum > 0, acc / tl.where(running_sum > 0, running_sum, 1.0), 0.0)
    tl.store(out + batch * o_b + head * o_h + row * o_l + value_dims * o_d, result.to(out.dtype.element_ty),
             mask=value_dims < VALUE_DIM)


@triton_op(OPERATOR, mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, group: int) -> torch.Tensor:
    """softmax(query @ key^T * scale + mask) @ value for query [B, H, L, D],
    key [B, H/group, S, D], value [B, H/group, S, Dv]; query head h reads K/V
    head h // group. A bool mask keeps the True positions; another is added."""
    batch, heads, rows, head_dim = query.shape
    kv_length, value_dim = key.shape[2], value.shape[3]
    out = torch.empty((batch, heads, rows, value_dim), dtype=query.dtype, device=query.device)
    mask_strides: tuple[int, ...]
    if mask is None:
        kind, mask_view, mask_strides = _NO_MASK, query, (0, 0, 0, 0)
    else:
        kind = _BOOL_MASK if mask.dtype == torch.bool else _ADDITIVE_MASK
        mask_view = mask.expand(batch, heads, rows, kv_length)
        mask_strides = mask_view.stride()
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(value_dim)
    # A program holds a tile of keys and one of values: the wider sets the tile's rows.
    block_n = max(16, min(triton.next_power_of_2(kv_length), _TILE_ELEMENTS // max(block_d, block_dv, 1)))
    wrap_triton(_decode_attention_kernel)[(batch * heads * rows,)](
        query, key, value, mask_view, out, scale, kv_length, group,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *out.stride(),
        HEADS=heads, ROWS=rows, HEAD_DIM=head_dim, VALUE_DIM=value_dim,
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, MASK_KIND=kind,
        num_warps=4,
    )
    return out
