"""The fused decode attention: one Triton kernel for scaled-dot-product
attention over a few query rows (a decode step), which compile/attention.py
puts in place of SDPA in standalone CUDA builds.

SDPA's math form, what a standalone build lowers SDPA to otherwise, becomes
five kernels a layer (scores, a softmax in two passes, the product with the
values, the copies that repeat grouped K/V heads); this kernel reads each
cached key and value once, keeps the softmax online (a running maximum and
sum), and indexes the K/V head of a query head directly (grouped-query
attention without copies).

The keys are split among programs (as flash-decoding does): a decode step
has one query row per head, and one program per (batch, head, row) left most
of the GPU idle while each walked the whole cache (on the H200, 15 us a layer
of the 1B decoder for 1 MB of cache). Each program reduces one stretch of
the keys to a partial maximum, sum and weighted value, and a second small
kernel merges the stretches of each row.

A decoder's mask often says only "cache positions up to p" for the step's
position p (compile/attention.py proves that of a mask before relying on
it); the kernel is then given p instead of the mask and reads no key beyond
it. On Hopper and later both kernels are launched as programmatic
dependents (docs/standalone.md): a program may start while the launch
before it finishes, and waits for it before reading or writing anything.

Importing this module needs Triton (a CUDA build of torch has it); it
registers the operator cuda_runner::decode_attention, which Inductor compiles
into the library like its own kernels (torch.library.triton_op).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .matvec_kernel import _await_inputs, waits_for_inputs

OPERATOR = "cuda_runner::decode_attention"
UPDATE_OPERATOR = "cuda_runner::decode_attention_update"

# Mask kinds, as the kernel reads them. A limit is a tensor of positions, one per
# query row: the row attends to cache positions 0 up to its own.
_NO_MASK, _BOOL_MASK, _ADDITIVE_MASK, _POSITION_LIMIT = 0, 1, 2, 3
# Elements of one tile of keys a program holds in registers (keys x head dim).
_TILE_ELEMENTS = 8192
# Programs a call aims for: a few per SM of a large GPU (132 on the H200), so that loads overlap.
_TARGET_PROGRAMS = 512
# The fewest keys a program takes: below this the merge costs more than the split saves.
_MIN_SPLIT_KEYS = 32
# Both switches below apply only to a launch that a launch of the step comes before (CacheUpdate.after_a_launch).
# Whether an updating launch reads its stretch's first tiles of the caches before it waits for the
# launch before (True), or after, as it reads everything else (scripts/bench_step_plans.py times both).
EARLY_CACHE_TILES = True
# Whether an updating launch whose position (and limit) is a graph input no launch of the step writes
# reads it, and the rotation tables' rows at it, before it waits (True), or after, taking two memory
# round trips, one after the other, into the path from the q/k/v product to its result
# (scripts/bench_step_plans.py --only early-position times both: 0.004-0.009 ms off the 1B
# decoder's step on an H100).
EARLY_POSITION = True
# Whether a launch of the attention (and of the merge) lets the launch after it start before it waits
# for the one before (True), or after, as the products do. The launch after a merge is the o product,
# which reads its first weight tiles before its wait: let go first, it reads them while the attention
# runs, not only while the merge does (scripts/bench_step_plans.py --only both-go-ahead: 0.010-0.017 ms
# off the 1B decoder's step of real kernels on an H200, the built decoder's replay 0.003-0.005 ms).
# What any launch reads before its wait stays safe. A product reads only constants so. An updating
# attention that reads its caches or position so (after_a_launch) has a product of the step before it,
# computing its query, key or value; every launch but these two, a product too, lets the launch after
# it start only after its own wait, when everything queued before it has finished. So by the time such
# an attention starts, that product has passed its wait and everything queued before the step has
# finished, whatever launches came between.
ATTENTION_GO_AHEAD_FIRST = True
MERGE_GO_AHEAD_FIRST = True


@triton.jit
def _decode_attention_kernel(
    query, key, value, mask, out, part_max, part_sum, part_acc, scale, kv_length, group, split_keys,
    q_b, q_h, q_l, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_l, m_s, o_b, o_h, o_l, o_d,
    new_key, new_value, position, query_cos, query_sin, key_cos, key_sin, table_rows, n_b, n_h, n_d, w_b, w_h, w_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASK_KIND: tl.constexpr, SPLITS: tl.constexpr,
    UPDATE: tl.constexpr, QUERY_PAIRS: tl.constexpr, KEY_PAIRS: tl.constexpr, EARLY: tl.constexpr, EARLY_POSITION: tl.constexpr,
    GO_AHEAD_FIRST: tl.constexpr,
):
    _decode_attention(query, key, value, mask, out, part_max, part_sum, part_acc, scale, kv_length, group, split_keys,
                      q_b, q_h, q_l, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_l, m_s, o_b, o_h, o_l, o_d,
                      new_key, new_value, position, query_cos, query_sin, key_cos, key_sin, table_rows, n_b, n_h, n_d, w_b, w_h, w_d,
                      HEADS, ROWS, HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, MASK_KIND, SPLITS, UPDATE, QUERY_PAIRS, KEY_PAIRS, EARLY, EARLY_POSITION,
                      GO_AHEAD_FIRST, False)


# The same, for a launch as a programmatic dependent: cuda-runner's shim launches
# kernels of this name prefix so (native/aoti_shim.cpp).
@triton.jit
def cudarunner_pdl_decode_attention(
    query, key, value, mask, out, part_max, part_sum, part_acc, scale, kv_length, group, split_keys,
    q_b, q_h, q_l, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_l, m_s, o_b, o_h, o_l, o_d,
    new_key, new_value, position, query_cos, query_sin, key_cos, key_sin, table_rows, n_b, n_h, n_d, w_b, w_h, w_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASK_KIND: tl.constexpr, SPLITS: tl.constexpr,
    UPDATE: tl.constexpr, QUERY_PAIRS: tl.constexpr, KEY_PAIRS: tl.constexpr, EARLY: tl.constexpr, EARLY_POSITION: tl.constexpr,
    GO_AHEAD_FIRST: tl.constexpr,
):
    _decode_attention(query, key, value, mask, out, part_max, part_sum, part_acc, scale, kv_length, group, split_keys,
                      q_b, q_h, q_l, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_l, m_s, o_b, o_h, o_l, o_d,
                      new_key, new_value, position, query_cos, query_sin, key_cos, key_sin, table_rows, n_b, n_h, n_d, w_b, w_h, w_d,
                      HEADS, ROWS, HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV, MASK_KIND, SPLITS, UPDATE, QUERY_PAIRS, KEY_PAIRS, EARLY, EARLY_POSITION,
                      GO_AHEAD_FIRST, True)


@triton.jit
def _decode_attention(
    query, key, value, mask, out, part_max, part_sum, part_acc, scale, kv_length, group, split_keys,
    q_b, q_h, q_l, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_l, m_s, o_b, o_h, o_l, o_d,
    new_key, new_value, position, query_cos, query_sin, key_cos, key_sin, table_rows, n_b, n_h, n_d, w_b, w_h, w_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASK_KIND: tl.constexpr, SPLITS: tl.constexpr,
    UPDATE: tl.constexpr, QUERY_PAIRS: tl.constexpr, KEY_PAIRS: tl.constexpr, EARLY: tl.constexpr, EARLY_POSITION: tl.constexpr,
    GO_AHEAD_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    if GO_AHEAD_FIRST:
        go = _go_ahead(PDL)
    program = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a layer's cache may pass 2**31 elements
    split = tl.program_id(1).to(tl.int64)
    row = program % ROWS
    head = (program // ROWS) % HEADS
    batch = program // (ROWS * HEADS)
    kv_head = head // group
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    begin = split * split_keys
    if EARLY:  # only with UPDATE
        # No launch of the step writes the caches but this one, whose own row is substituted below,
        # and a launch of the step came first, so the last call's writes are done (compile/attention.py):
        # the stretch's first tiles are read before the wait, off the path from the query's product
        # to this launch's result.
        early_keys, early_values = _first_cache_tiles(key + batch * k_b + kv_head * k_h, value + batch * v_b + kv_head * v_h, begin, kv_length,
                                                      k_s, k_d, v_s, v_d, HEAD_DIM, VALUE_DIM, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:  # never chosen below (`first` is false): the tiles are read in the loop
        early_keys = tl.zeros([BLOCK_N, BLOCK_D], dtype=key.dtype.element_ty)
        early_values = tl.zeros([BLOCK_N, BLOCK_DV], dtype=value.dtype.element_ty)
    if EARLY_POSITION:  # only with UPDATE
        # The position and the limit are graph inputs, and the tables constants, that no launch of the
        # step writes, and a product of the step came first (compile/attention.py), which let the launch
        # after it start only after its own wait: by the time this one starts everything queued
        # before the step (the inputs' copies, a caller's kernel) has finished (ATTENTION_GO_AHEAD_FIRST).
        early_step = tl.load(position).to(tl.int64)
        early_row = tl.minimum(tl.maximum(early_step, 0), table_rows - 1)
        early_key_cos, early_key_sin = _rotation_row(key_cos, key_sin, early_row, HEAD_DIM, BLOCK_D, KEY_PAIRS)
        early_query_cos, early_query_sin = _rotation_row(query_cos, query_sin, early_row, HEAD_DIM, BLOCK_D, QUERY_PAIRS)
        early_limit = tl.load(mask + batch * m_b + head * m_h + row * m_l).to(tl.int64) if MASK_KIND == 3 else early_step
    # Everything else this touches, written tensors too, is addressed through `ready`:
    # nothing of it is read or written before the launch before it is done.
    if GO_AHEAD_FIRST:  # noqa: SIM108  (Triton: branches on a constexpr, not an expression)
        ready = _await_after(go, PDL)
    else:
        ready = _await_inputs(PDL)
    key_base = key + ready + batch * k_b + kv_head * k_h
    value_base = value + ready + batch * v_b + kv_head * v_h
    if UPDATE:
        # The step's own key and value, at its position (one row): this launch writes them into
        # the caches, and reads them from here instead (see decode_attention_update).
        if EARLY_POSITION:
            step, table_row = early_step, early_row
            key_cos_row, key_sin_row = early_key_cos, early_key_sin
            query_cos_row, query_sin_row = early_query_cos, early_query_sin
        else:
            step = tl.load(position + ready).to(tl.int64)
            table_row = tl.minimum(tl.maximum(step, 0), table_rows - 1)  # a position out of range writes nothing below
            key_cos_row, key_sin_row = _rotation_row(key_cos + ready, key_sin + ready, table_row, HEAD_DIM, BLOCK_D, KEY_PAIRS)
            query_cos_row, query_sin_row = _rotation_row(query_cos + ready, query_sin + ready, table_row, HEAD_DIM, BLOCK_D, QUERY_PAIRS)
        fresh_key = _load_rotated(new_key + ready + batch * n_b + kv_head * n_h, n_d, key_cos_row, key_sin_row,
                                  HEAD_DIM, BLOCK_D, KEY_PAIRS).to(key.dtype.element_ty)
        fresh_value = tl.load(new_value + ready + batch * w_b + kv_head * w_h + value_dims * w_d, mask=value_dims < VALUE_DIM,
                              other=0.0).to(value.dtype.element_ty)
        # One program of each K/V head writes: the first query head of its group, in the stretch that holds the position.
        writer = (head % group == 0) & (split == step // split_keys) & (step >= 0) & (step < kv_length)
        tl.store(key_base + step * k_s + dims * k_d, fresh_key, mask=writer & (dims < HEAD_DIM))
        tl.store(value_base + step * v_s + value_dims * v_d, fresh_value, mask=writer & (value_dims < VALUE_DIM))
        q = _load_rotated(query + ready + batch * q_b + head * q_h + row * q_l, q_d, query_cos_row, query_sin_row,
                          HEAD_DIM, BLOCK_D, QUERY_PAIRS)
        q = q.to(query.dtype.element_ty)  # rounded as the model's rotated query was
    else:
        q = tl.load(query + ready + batch * q_b + head * q_h + row * q_l + dims * q_d, mask=dims < HEAD_DIM, other=0.0)
    # The product is cast, not the scale: Inductor passes the scale as fp64 to the
    # kernel it builds, and as a Python float to its analysis of what the kernel writes.
    q = (q.to(tl.float32) * scale).to(tl.float32)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    mask_base = mask + ready + batch * m_b + head * m_h + row * m_l
    end = tl.minimum(begin + split_keys, kv_length)
    if MASK_KIND == 3:
        # Keys past the row's position are masked: they are not read at all (a stretch wholly past it reads nothing).
        # Clamped before the + 1: a position of int64's largest value would wrap to the smallest.
        limit = early_limit if EARLY_POSITION else tl.load(mask_base).to(tl.int64)
        end = tl.minimum(end, tl.minimum(limit, kv_length - 1) + 1)
    for start in range(begin, end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N).to(tl.int64)
        inside = positions < end
        if UPDATE:
            # The step's position is not read from the cache, which this launch writes; the first tile was read early.
            fresh = positions == step
            first = (start == begin) & EARLY
            keys = tl.load(key_base + positions[:, None] * k_s + dims[None, :] * k_d,
                           mask=(inside & ~fresh & ~first)[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
            keys = tl.where(inside[:, None], tl.where(first, early_keys, keys), 0.0)
            keys = tl.where(fresh[:, None], fresh_key[None, :], keys)
        else:
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
        if UPDATE:
            values = tl.load(value_base + positions[:, None] * v_s + value_dims[None, :] * v_d,
                             mask=(inside & ~fresh & ~first)[:, None] & (value_dims[None, :] < VALUE_DIM), other=0.0)
            # Zeros past the stretch's end, not what the early tile read there: a weight of 0 times an inf is NaN.
            values = tl.where(inside[:, None], tl.where(first, early_values, values), 0.0)
            values = tl.where(fresh[:, None], fresh_value[None, :], values)
        else:
            values = tl.load(value_base + positions[:, None] * v_s + value_dims[None, :] * v_d,
                             mask=inside[:, None] & (value_dims[None, :] < VALUE_DIM), other=0.0)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * values.to(tl.float32), axis=0)
        running_max = new_max
    if SPLITS == 1:
        # A row with every position masked gives zeros, as torch's SDPA does (its safe softmax).
        result = tl.where(running_sum > 0, acc / tl.where(running_sum > 0, running_sum, 1.0), 0.0)
        tl.store(out + ready + batch * o_b + head * o_h + row * o_l + value_dims * o_d, result.to(out.dtype.element_ty),
                 mask=value_dims < VALUE_DIM)
    else:
        # This stretch's share, relative to its own maximum (-inf with a sum of 0 where all of it is masked).
        slot = program * SPLITS + split + ready
        tl.store(part_max + slot, running_max)
        tl.store(part_sum + slot, running_sum)
        tl.store(part_acc + slot * BLOCK_DV + value_dims, acc)


@triton.jit
def _go_ahead(PDL: tl.constexpr):
    """Lets the launch after this one start now (griddepcontrol.launch_dependents), before this one
    waits for the launch before it; returns the token _await_after takes, which keeps the wait after
    this. Pure asm, as in _await_inputs, kept because its value is used."""
    if PDL:  # noqa: SIM108  (Triton: branches on a constexpr, not an expression)
        token = tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    else:
        token = 0
    return token


@triton.jit
def _await_after(token, PDL: tl.constexpr):
    """0, once the launch before this one has finished and its writes are seen, as _await_inputs,
    without letting the launch after this one start (_go_ahead, whose token it takes, did)."""
    if PDL:
        ready = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32, is_pure=True, pack=1)
        ready = tl.multiple_of(ready, 16)  # as it is (0): the loads stay wide vectors
    else:
        ready = 0
    return ready


@triton.jit
def _first_cache_tiles(key_head, value_head, begin, kv_length, k_s, k_d, v_s, v_d, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The first tile of keys and of values of the stretch from `begin`, of one
    K/V head, as the caches hold them; zeros past the cache."""
    positions = begin + tl.arange(0, BLOCK_N).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    value_dims = tl.arange(0, BLOCK_DV)
    cached = positions < kv_length
    keys = tl.load(key_head + positions[:, None] * k_s + dims[None, :] * k_d, mask=cached[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    values = tl.load(value_head + positions[:, None] * v_s + value_dims[None, :] * v_d,
                     mask=cached[:, None] & (value_dims[None, :] < VALUE_DIM), other=0.0)
    return keys, values


@triton.jit
def _rotation_row(cos_table, sin_table, table_row, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAIRS: tl.constexpr):
    """Row `table_row` of the cos and sin tables [positions, HEAD_DIM] (float32),
    where PAIRS says a head is rotated (0: zeros, never used)."""
    dims = tl.arange(0, BLOCK_D)
    if PAIRS != 0:
        inside = dims < HEAD_DIM
        cos = tl.load(cos_table + table_row * HEAD_DIM + dims, mask=inside, other=0.0)
        sin = tl.load(sin_table + table_row * HEAD_DIM + dims, mask=inside, other=0.0)
    else:
        cos = tl.zeros([BLOCK_D], dtype=tl.float32)
        sin = tl.zeros([BLOCK_D], dtype=tl.float32)
    return cos, sin


@triton.jit
def _load_rotated(base, d_stride, cos, sin, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAIRS: tl.constexpr):
    """One head's vector at `base` (float32), rotated by a row of the tables
    (_rotation_row) where PAIRS says how its elements pair (compile/rotary.py):
    x[d] * cos + x[partner(d)] * sin, partner(d) = d ^ 1 (1) or d + D/2 mod D
    (2); 0: as it is."""
    dims = tl.arange(0, BLOCK_D)
    inside = dims < HEAD_DIM
    x = tl.load(base + dims * d_stride, mask=inside, other=0.0).to(tl.float32)
    if PAIRS != 0:
        partners = dims ^ 1 if PAIRS == 1 else (dims + HEAD_DIM // 2) % HEAD_DIM
        other = tl.load(base + partners * d_stride, mask=inside, other=0.0).to(tl.float32)
        x = x * cos + other * sin
    return x


@triton.jit
def _merge_splits_kernel(
    part_max, part_sum, part_acc, out, o_b, o_h, o_l, o_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, GO_AHEAD_FIRST: tl.constexpr,
):
    _merge_splits(part_max, part_sum, part_acc, out, o_b, o_h, o_l, o_d, HEADS, ROWS, VALUE_DIM, BLOCK_DV, SPLITS, BLOCK_S, GO_AHEAD_FIRST, False)


@triton.jit
def cudarunner_pdl_merge_splits(
    part_max, part_sum, part_acc, out, o_b, o_h, o_l, o_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, GO_AHEAD_FIRST: tl.constexpr,
):
    _merge_splits(part_max, part_sum, part_acc, out, o_b, o_h, o_l, o_d, HEADS, ROWS, VALUE_DIM, BLOCK_DV, SPLITS, BLOCK_S, GO_AHEAD_FIRST, True)


@triton.jit
def _merge_splits(
    part_max, part_sum, part_acc, out, o_b, o_h, o_l, o_d,
    HEADS: tl.constexpr, ROWS: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, GO_AHEAD_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    """One row's stretches brought to a common maximum and summed: the softmax over all its keys."""
    if GO_AHEAD_FIRST:  # noqa: SIM108  (Triton: branches on a constexpr, not an expression)
        ready = _await_after(_go_ahead(PDL), PDL)
    else:
        ready = _await_inputs(PDL)
    program = tl.program_id(0).to(tl.int64)
    row = program % ROWS
    head = (program // ROWS) % HEADS
    batch = program // (ROWS * HEADS)
    splits = tl.arange(0, BLOCK_S)
    value_dims = tl.arange(0, BLOCK_DV)
    real = splits < SPLITS
    slots = program * SPLITS + splits + ready
    maxima = tl.load(part_max + slots, mask=real, other=float("-inf"))
    sums = tl.load(part_sum + slots, mask=real, other=0.0)
    top = tl.max(maxima, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.where(maxima == float("-inf"), 0.0, tl.exp(maxima - shift))
    total = tl.sum(sums * weights, axis=0)
    accs = tl.load(part_acc + slots[:, None] * BLOCK_DV + value_dims[None, :], mask=real[:, None], other=0.0)
    acc = tl.sum(accs * weights[:, None], axis=0)
    # A row with every position masked gives zeros, as torch's SDPA does (its safe softmax).
    result = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out + ready + batch * o_b + head * o_h + row * o_l + value_dims * o_d, result.to(out.dtype.element_ty),
             mask=value_dims < VALUE_DIM)


def split_plan(rows_total: int, kv_length: int, tile_rows: int) -> tuple[int, int, int]:
    """How a call's keys are shared out: (keys per program, programs per row, key tile rows).
    Enough programs to fill the GPU, none with fewer than _MIN_SPLIT_KEYS keys."""
    wanted = max(1, _TARGET_PROGRAMS // max(1, rows_total))
    split_keys = max(_MIN_SPLIT_KEYS, -(-kv_length // wanted))
    split_keys = -(-split_keys // 16) * 16  # whole tiles of 16 keys, the smallest tile
    splits = max(1, -(-kv_length // split_keys))
    if splits == 1:
        split_keys = max(1, kv_length)
    block_n = max(16, min(tile_rows, triton.next_power_of_2(max(1, split_keys))))
    return split_keys, splits, block_n


@dataclass(frozen=True)
class AttentionPlan:
    """How one call is shared out: keys per program, programs per query row
    (1: no merge launch), key tile rows, and warps of the attention kernel."""

    split_keys: int
    splits: int
    block_n: int
    warps: int


def attention_plan(rows_total: int, kv_length: int, head_dim: int, value_dim: int) -> AttentionPlan:
    """The plan decode_attention takes for a call of these sizes. The keys are
    split wherever the rows leave the GPU idle, even over a cache as small as
    the 1B decoder's (512 positions of 64): one program a row, with no merge
    launch, made its step faster at position 31 and slower at 255 and 511
    (scripts/bench_step_plans.py, docs/benchmarks.md)."""
    widest = max(triton.next_power_of_2(head_dim), triton.next_power_of_2(value_dim), 1)
    # A program holds a tile of keys and one of values: the wider sets the tile's rows.
    split_keys, splits, block_n = split_plan(rows_total, kv_length, _TILE_ELEMENTS // widest)
    return AttentionPlan(split_keys, splits, block_n, 4 if block_n * widest >= 4096 else 2)


@triton_op(OPERATOR, mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, group: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(query @ key^T * scale + mask) @ value for query [B, H, L, D],
    key [B, H/group, S, D], value [B, H/group, S, Dv]; query head h reads K/V
    head h // group. A bool mask keeps the True positions; another is added.
    In place of a mask, `limit` (integers [L]) keeps, for query row l, the
    positions 0 to limit[l]."""
    batch, heads, rows, head_dim = query.shape
    out = torch.empty((batch, heads, rows, value.shape[3]), dtype=query.dtype, device=query.device)
    chosen = attention_plan(batch * heads * rows, key.shape[2], head_dim, value.shape[3])
    launch_attention(query, key, value, mask, limit, out, scale, group, chosen, pdl=waits_for_inputs(query.device))
    return out


@triton_op(UPDATE_OPERATOR, mutates_args=("key_cache", "value_cache"))
def decode_attention_update(query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, position: torch.Tensor, mask: torch.Tensor | None, scale: float, group: int,
                            limit: torch.Tensor | None, query_cos: torch.Tensor | None, query_sin: torch.Tensor | None,
                            key_cos: torch.Tensor | None, key_sin: torch.Tensor | None, query_pairs: int, key_pairs: int,
                            inputs_unwritten: bool = False, after_a_launch: bool = False) -> torch.Tensor:
    """A decode step's cache write and its attention in one launch:
    key_cache.index_copy_(2, position, rotate(new_key)), the same for the
    value (unrotated), then decode_attention of rotate(query) over the
    caches. `position` is one integer; rotate() is the identity where the
    pairs are 0 (rotary.NO_ROTATION), else x * cos[position] + x[partner] *
    sin[position] with the tables [positions, D] (float32) and the pairing of
    compile/rotary.py, computed in float32 and rounded to the tensor's dtype.
    A position outside the cache writes nothing. `after_a_launch`: a launch
    of the step comes before this one, so everything queued before the step
    has finished when it starts (it may read the caches' first tiles before
    it waits). `inputs_unwritten`: the position and the limit are graph
    inputs no launch of the step writes, and the tables are constants (with
    `after_a_launch`, it may read them before it waits too)."""
    batch, heads, rows, head_dim = query.shape
    out = torch.empty((batch, heads, rows, value_cache.shape[3]), dtype=query.dtype, device=query.device)
    chosen = attention_plan(batch * heads * rows, key_cache.shape[2], head_dim, value_cache.shape[3])
    update = CacheUpdate(new_key, new_value, position, (query_cos, query_sin, query_pairs), (key_cos, key_sin, key_pairs), inputs_unwritten,
                         after_a_launch)
    launch_attention(query, key_cache, value_cache, mask, limit, out, scale, group, chosen, pdl=waits_for_inputs(query.device), update=update)
    return out


@dataclass(frozen=True)
class CacheUpdate:
    """What decode_attention_update writes into the caches before it reads them,
    and how the query and the new key are rotated: (cos, sin, pairs) each."""

    new_key: torch.Tensor  # [B, Hk, 1, D]
    new_value: torch.Tensor  # [B, Hk, 1, Dv]
    position: torch.Tensor  # one integer
    query_rotation: tuple[torch.Tensor | None, torch.Tensor | None, int]
    key_rotation: tuple[torch.Tensor | None, torch.Tensor | None, int]
    inputs_unwritten: bool = False  # the position, the limit and the tables: nothing in the step writes them
    # A product of the step comes first, and a product lets the next launch start only after its own wait, so what was
    # queued before the step (a caller's kernel that writes the position, the last call's cache writes) is done by then.
    after_a_launch: bool = False

    def operands(self, query: torch.Tensor) -> tuple[object, ...]:
        """The kernel's update operands; the query stands in for a table not given (never read)."""
        query_cos, query_sin, _ = self.query_rotation
        key_cos, key_sin, _ = self.key_rotation
        tables = [table if table is not None else query for table in (query_cos, query_sin, key_cos, key_sin)]
        given = [table.shape[0] for table in (query_cos, key_cos) if table is not None]
        rows = min(given) if given else 1  # a position past the tables reads their last row (and writes nothing)
        new_key, new_value = self.new_key.stride(), self.new_value.stride()
        return (self.new_key, self.new_value, self.position, *tables, rows, new_key[0], new_key[1], new_key[3],
                new_value[0], new_value[1], new_value[3])

    def check(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        batch, _, rows, head_dim = query.shape
        if rows != 1 or self.position.numel() != 1 or self.position.dtype not in (torch.int32, torch.int64):
            raise ValueError("a cache update takes one query row and one integer position")
        if tuple(self.new_key.shape) != (batch, key.shape[1], 1, head_dim) or tuple(self.new_value.shape) != (batch, value.shape[1], 1, value.shape[3]):
            raise ValueError("the new key and value are one position of the caches' heads")
        for cos, sin, pairs in (self.query_rotation, self.key_rotation):
            if pairs and (cos is None or sin is None or cos.dtype != torch.float32 or cos.shape != sin.shape or cos.shape[1:] != (head_dim,)
                          or not cos.is_contiguous() or not sin.is_contiguous()):
                raise ValueError("a rotation takes float32 tables [positions, head dim], contiguous")


def launch_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     limit: torch.Tensor | None, out: torch.Tensor, scale: float, group: int, chosen: AttentionPlan,
                     pdl: bool = False, launch_pdl: bool = False, update: CacheUpdate | None = None) -> None:
    """Launch the attention (and, split, the merge) into `out` as chosen_plan says
    (scripts/bench_step_plans.py sweeps it). `pdl` (Hopper and later) takes the
    kernels that wait for the launch before them; `launch_pdl` has Triton
    launch them as programmatic dependents (in a library, the shim does).
    `update`: the step's key and value, written into `key` and `value` first."""
    batch, heads, rows, head_dim = query.shape
    kv_length, value_dim = key.shape[2], value.shape[3]
    kind, mask_view, mask_strides = _mask_operand(query, mask, limit, kv_length)
    block_d, block_dv = triton.next_power_of_2(head_dim), triton.next_power_of_2(value_dim)
    rows_total = batch * heads * rows
    # Each stretch's maximum, sum and weighted values (float32), merged by the second kernel.
    # With one stretch the first kernel writes the output itself and these are never touched.
    slots = rows_total * chosen.splits if chosen.splits > 1 else 1
    part_max = torch.empty((slots,), dtype=torch.float32, device=query.device)
    part_sum = torch.empty((slots,), dtype=torch.float32, device=query.device)
    part_acc = torch.empty((slots * block_dv,), dtype=torch.float32, device=query.device)
    extra = {"launch_pdl": True} if launch_pdl else {}
    if update is not None:
        update.check(query, key, value)
    # Without an update its operands are never read: the query stands in for each tensor.
    update_operands = update.operands(query) if update is not None else (query,) * 7 + (1,) + (0,) * 6
    wrap_triton(cudarunner_pdl_decode_attention if pdl else _decode_attention_kernel)[(rows_total, chosen.splits)](
        query, key, value, mask_view, out, part_max, part_sum, part_acc, scale, kv_length, group, chosen.split_keys,
        *query.stride(), *key.stride(), *value.stride(), *mask_strides, *out.stride(), *update_operands,
        HEADS=heads, ROWS=rows, HEAD_DIM=head_dim, VALUE_DIM=value_dim,
        BLOCK_N=chosen.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, MASK_KIND=kind, SPLITS=chosen.splits,
        UPDATE=update is not None, QUERY_PAIRS=update.query_rotation[2] if update is not None else 0,
        KEY_PAIRS=update.key_rotation[2] if update is not None else 0, EARLY=update is not None and update.after_a_launch and EARLY_CACHE_TILES,
        EARLY_POSITION=update is not None and update.after_a_launch and update.inputs_unwritten and EARLY_POSITION,
        GO_AHEAD_FIRST=pdl and ATTENTION_GO_AHEAD_FIRST, num_warps=chosen.warps, **extra,
    )
    if chosen.splits > 1:
        wrap_triton(cudarunner_pdl_merge_splits if pdl else _merge_splits_kernel)[(rows_total,)](
            part_max, part_sum, part_acc, out, *out.stride(),
            HEADS=heads, ROWS=rows, VALUE_DIM=value_dim, BLOCK_DV=block_dv, SPLITS=chosen.splits,
            BLOCK_S=triton.next_power_of_2(chosen.splits), GO_AHEAD_FIRST=pdl and MERGE_GO_AHEAD_FIRST, num_warps=1 if chosen.splits * block_dv <= 1024 else 4, **extra,
        )


def _mask_operand(query: torch.Tensor, mask: torch.Tensor | None, limit: torch.Tensor | None,
                  kv_length: int) -> tuple[int, torch.Tensor, tuple[int, ...]]:
    """(mask kind, the tensor the kernel reads for it, its [B, H, L, S] strides)."""
    batch, heads, rows, _ = query.shape
    if limit is not None:
        if mask is not None or limit.shape != (rows,) or limit.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"a limit is one integer per query row ({rows}), given without a mask")
        return _POSITION_LIMIT, limit, (0, 0, limit.stride(0), 0)
    if mask is None:
        return _NO_MASK, query, (0, 0, 0, 0)
    mask_view = mask.expand(batch, heads, rows, kv_length)
    return (_BOOL_MASK if mask.dtype == torch.bool else _ADDITIVE_MASK), mask_view, tuple(mask_view.stride())
