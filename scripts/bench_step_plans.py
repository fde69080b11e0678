#!/usr/bin/env python3
"""Which plans make the 1B decoder's step fastest, every launch a programmatic dependent (GPU machine).

The plans the kernels ship with were swept one launch kind at a time,
without programmatic launches (scripts/bench_gemv.py --fused). In a step on
Hopper every cuda-runner launch starts while the one before it drains, which
changes what pays: a program's first tiles, a launch fewer. This times, from
one CUDA graph each, a step built of the real kernels on random operands of
the 1B decoder's shapes (16 layers and the head, bf16), all launched as
programmatic dependents:

  attention   cuda-runner's decode attention alone (16 launches, each layer a
              cache of its own, the step's position as the mask), over plans:
              the shipped split into stretches merged by a second kernel,
              and one program per query row (no merge launch) with tiles of
              64-512 keys; at positions 31, 255 and 511. Each plan's result
              is first compared with SDPA's.
  in a step   the 65 fused products and the attention a layer, each attention
              plan at position 255
  products    the same step, one launch kind's plan (q/k/v, o, gate/up, down)
              swept while the others keep the shipped ones
  early tiles the step with the attention that also writes the step's key and
              value and rotates its query and key (decode_attention_update,
              as the default build has it), its first tiles of the caches read
              before its wait and after it, alternately
  early position
              the same step with the attention reading its position and the
              rotation tables' rows before its wait (attention_kernel.
              EARLY_POSITION), as shipped, and after it, alternately
  attention-go-ahead, merge-go-ahead, both-go-ahead
              the same step with the attention, the merge or both letting the
              launch after them start before they wait for the launch before
              (attention_kernel.ATTENTION_GO_AHEAD_FIRST, MERGE_GO_AHEAD_FIRST)
              and after, alternately: the launch after a merge is the o
              product, which could then read its first weight tiles while the
              attention runs, not only while the merge does

`--update-plans` times, alone, the step with the updating attention (early
tiles and position on, as the default build has it) under each attention plan
at positions 31, 255 and 511, in two rounds, the second in the other order:
the plans above were swept with the attention that only reads, where no tile
is read before the wait, so a plan of one program a row, which then holds the
whole cache before it, was never timed so. Each plan's result is first
compared with the shipped plan's.

`--only NAME` times one of the last five alone (repeated, several).

Medians of the replays with p10-p90, microseconds.

    python3 scripts/bench_step_plans.py --output plans.json
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
import time
from pathlib import Path

LAYERS = 16
# The attention's plan before one program a row took the 1B decoder's cache: 16 stretches of 32 keys, merged.
EARLIER_ATTENTION = "split, 16 x 32 keys (the earlier plan)"
# The products' plans before the sweep in the step (compile/matvec_kernel.py's _SWEPT_PLANS then).
EARLIER_PRODUCTS = {"qkv": (4, 1024, 4), "o": (2, 2048, 4), "gate/up": (4, 1024, 4), "down": (1, 512, 8), "head": (2, 1024, 4)}
POSITIONS = (31, 255, 511)
STEP_POSITION = 255
CACHE = 512


def attention_plans() -> dict[str, object]:
    """The shipped plan and the ones tried beside it, by name."""
    from cuda_runner.compile.attention_kernel import AttentionPlan, attention_plan

    plans: dict[str, object] = {"shipped": attention_plan(32, CACHE, 64, 64), EARLIER_ATTENTION: AttentionPlan(32, 16, 32, 2)}
    for splits, block_n, warps in [(1, 64, 2), (1, 128, 4), (1, 256, 4), (1, 256, 8), (1, 512, 8), (1, 512, 16),
                                   (2, 128, 4), (4, 64, 4), (4, 128, 4)]:
        plans[f"splits {splits}, tile {block_n}, {warps} warps"] = AttentionPlan(CACHE // splits, splits, block_n, warps)
    return plans


def attention_operands(count: int) -> list[tuple]:
    import torch

    def bf16(*shape: int):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    return [(bf16(1, 32, 1, 64), bf16(1, 8, CACHE, 64), bf16(1, 8, CACHE, 64), torch.empty(1, 32, 1, 64, device="cuda", dtype=torch.bfloat16))
            for _ in range(count)]


def attention_launch(operands: tuple, limit, chosen):
    from cuda_runner.compile.attention_kernel import launch_attention

    query, key, value, out = operands
    return lambda: launch_attention(query, key, value, None, limit, out, 0.125, 4, chosen, pdl=True, launch_pdl=True)


def update_operands(count: int) -> list[tuple]:
    """A layer's operands for the attention that writes the step's key and value: as attention_operands,
    with the new key and value and RoPE tables of neighbouring pairs."""
    import torch

    angles = torch.rand(CACHE, 32, device="cuda") * 6.0
    cos, sin = angles.cos().repeat_interleave(2, 1).contiguous(), torch.stack((-angles.sin(), angles.sin()), -1).flatten(1).contiguous()
    return [(*attention_operands(1)[0], torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16),
             torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16), cos, sin) for _ in range(count)]


def update_launch(operands: tuple, position, chosen):
    from cuda_runner.compile.attention_kernel import CacheUpdate, launch_attention

    query, key, value, out, new_key, new_value, cos, sin = operands
    # nothing in the step writes them, and the products come first
    update = CacheUpdate(new_key, new_value, position, (cos, sin, 1), (cos, sin, 1), inputs_unwritten=True, after_a_launch=True)
    return lambda: launch_attention(query, key, value, None, position, out, 0.125, 4, chosen, pdl=True, launch_pdl=True, update=update)


def attention_error(chosen, position: int) -> float:
    """Max abs difference from SDPA's math form over positions 0..position."""
    import torch
    import torch.nn.functional as F

    operands = attention_operands(1)[0]
    query, key, value, out = operands
    limit = torch.tensor([position], device="cuda")
    attention_launch(operands, limit, chosen)()
    allowed = (torch.arange(CACHE, device="cuda") <= position).view(1, 1, 1, CACHE)
    want = F.scaled_dot_product_attention(query.float(), key.float().repeat_interleave(4, 1), value.float().repeat_interleave(4, 1),
                                          attn_mask=allowed, scale=0.125)
    torch.cuda.synchronize()
    return float((out.float() - want).abs().max())


def update_difference(chosen, shipped, position: int) -> float:
    """Max abs difference between the updating attention's result under `chosen` and under `shipped`
    (one layer's operands; both write the same key and value at the same position)."""
    import torch

    operands = update_operands(1)[0]
    at = torch.tensor([position], device="cuda")
    results = []
    for plan in (shipped, chosen):
        update_launch(operands, at, plan)()
        results.append(operands[3].float().clone())
    torch.cuda.synchronize()
    return float((results[0] - results[1]).abs().max())


def update_plans(record, layers: list[dict], head: tuple, products: dict[str, tuple], plans: dict[str, object]) -> dict:
    """The step with the updating attention under each attention plan, at each of POSITIONS, two rounds
    (the second in reverse order); returns each plan's difference from the shipped plan's result."""
    import torch

    differences = {name: {str(p): round(update_difference(chosen, plans["shipped"], p), 5) for p in POSITIONS} for name, chosen in plans.items()}
    print("differences from the shipped plan", json.dumps(differences), flush=True)
    for position in POSITIONS:
        at = torch.tensor([position], device="cuda")
        for round_, names in ((1, list(plans)), (2, list(plans)[::-1])):
            for name in names:
                record(f"step with the cache update, position {position}, attention plan, round {round_}", name,
                       step(layers, head, products, plans[name], at, update=True), 100)
    return differences


def fused_launch(operands: tuple, chosen: tuple):
    from cuda_runner.compile.matvec_kernel import launch_fused

    x, weights, gain, added, outputs, gated = operands
    return lambda: launch_fused(x, weights, gain, 1e-5, added, gated, outputs, chosen, pdl=True, launch_pdl=True)


def step(layers: list[dict], head: tuple, plans: dict[str, tuple], attention_plan, limit, update: bool = False) -> list:
    """A step's launches: per layer q/k/v, the attention, o, gate/up, down; the head. `update`: the
    attention that also writes the caches and rotates (each layer's "update" operands), at `limit`."""
    launches = []
    for layer in layers:
        launches.append(fused_launch(layer["qkv"], plans["qkv"]))
        launches.append(update_launch(layer["update"], limit, attention_plan) if update else attention_launch(layer["attention"], limit, attention_plan))
        launches.extend(fused_launch(layer[name], plans[name]) for name in ("o", "gate/up", "down"))
    launches.append(fused_launch(head, plans["head"]))
    return launches


CASES = {"qkv": "q/k/v + norm", "o": "o + residual", "gate/up": "gate/up + norm, gated", "down": "down + residual", "head": "head + norm"}


def step_operands() -> tuple[list[dict], tuple]:
    from bench_gemv import FUSED_CASES, fused_operands

    layers = []
    for _ in range(LAYERS):
        layer = {name: fused_operands(FUSED_CASES[case], 1)[0] for name, case in CASES.items() if name != "head"}
        layer["attention"] = attention_operands(1)[0]
        layer["update"] = update_operands(1)[0]
        layers.append(layer)
    return layers, fused_operands(FUSED_CASES[CASES["head"]], 1)[0]


def shipped_plans() -> dict[str, tuple]:
    from bench_gemv import FUSED_CASES

    from cuda_runner.compile.matvec_kernel import fused_plan

    plans = {}
    for name, case in CASES.items():
        rows, k, _, _, gated = FUSED_CASES[case]
        plans[name] = fused_plan(list(rows), k, gated)
    return plans


def candidate_plans(name: str) -> list[tuple]:
    from bench_gemv import FUSED_CASES

    _, k, _, _, gated = FUSED_CASES[CASES[name]]
    per_program = 2 if gated else 1
    return [chosen for chosen in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (4, 8))
            if chosen[0] * chosen[1] * per_program <= 16384 and chosen[1] <= k]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--no-sweep", action="store_true", help="leave out the products' plan sweep")
    parser.add_argument("--update-plans", action="store_true",
                        help="time only the step with the updating attention under each attention plan (see above)")
    parser.add_argument("--only", choices=sorted(SWITCHES), action="append", default=None,
                        help="time only this A/B of a kernel switch, on and off (repeat for several, in one set of operands)")
    options = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    import torch
    import triton
    from bench_gemv import graph_time_us, summary_us

    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                                  "date": time.strftime("%Y-%m-%d %H:%M"), "replays": options.replays}

    def record(section: str, name: str, launches, replays: int = options.replays) -> float:
        summary = summary_us(graph_time_us(launches, replays=replays))
        results.setdefault(section, {})[name] = summary  # type: ignore[union-attr]
        print(section, "|", name, json.dumps(summary), flush=True)
        return summary["median_us"]

    torch.manual_seed(0)
    plans = attention_plans()
    layers, head = step_operands()
    shipped = shipped_plans()
    for name, (module_name, switch, subject, labels) in SWITCHES.items():
        if (options.only is None and not options.update_plans) or (options.only is not None and name in options.only):
            switch_ab(record, f"step with the cache update, position {STEP_POSITION}{subject}", importlib.import_module(module_name), switch,
                      labels, layers, head, shipped, plans["shipped"])
    if options.update_plans:
        results["updating attention max abs difference from the shipped plan"] = update_plans(record, layers, head, shipped, plans)
    if options.only is not None or options.update_plans:
        return write(results, options.output)
    errors = {name: {str(p): round(attention_error(chosen, p), 5) for p in POSITIONS} for name, chosen in plans.items()}
    results["attention max abs error vs SDPA"] = errors
    print("errors", json.dumps(errors), flush=True)
    operands = attention_operands(LAYERS)
    for position in POSITIONS:
        limit = torch.tensor([position], device="cuda")
        for name, chosen in plans.items():
            record(f"attention alone, 16 launches, position {position}", name, [attention_launch(o, limit, chosen) for o in operands])
    for position in POSITIONS:
        at = torch.tensor([position], device="cuda")
        for products, chosen_products in (("shipped", shipped), ("earlier", EARLIER_PRODUCTS)):
            for attention in ("shipped", EARLIER_ATTENTION):
                record(f"step, position {position}", f"{products} products, {attention} attention",
                       step(layers, head, chosen_products, plans[attention], at), replays=100)
    limit = torch.tensor([STEP_POSITION], device="cuda")
    step_times = {name: record(f"step, position {STEP_POSITION}, attention plan", name, step(layers, head, shipped, chosen, limit))
                  for name, chosen in plans.items()}
    best_attention = min(step_times, key=lambda name: step_times[name])
    if not options.no_sweep:
        best = dict(shipped)
        for case in ("qkv", "o", "gate/up", "down"):
            tried = {}
            for chosen in candidate_plans(case):
                tried[chosen] = record(f"step, {case} plan swept", str(chosen),
                                       step(layers, head, {**shipped, case: chosen}, plans["shipped"], limit), replays=10)
            best[case] = min(tried, key=lambda plan_: tried[plan_])
        results["best plans"] = {case: list(plan_) for case, plan_ in best.items()}
        for name, chosen_plans, attention in (("shipped", shipped, "shipped"), ("best products", best, "shipped"),
                                              ("best products and attention", best, best_attention), ("shipped products, best attention", shipped, best_attention)):
            record("step, final", f"{name} ({attention})", step(layers, head, chosen_plans, plans[attention], limit), replays=100)
    return write(results, options.output)


# The kernel switches timed A B B A (--only NAME): (module, switch, what the section says of it, its labels on and off).
SWITCHES = {
    "early-tiles": ("cuda_runner.compile.attention_kernel", "EARLY_CACHE_TILES", "",
                    {True: "first tiles read before the wait", False: "read after it"}),
    "early-position": ("cuda_runner.compile.attention_kernel", "EARLY_POSITION", ", its position",
                       {True: "position and tables read before the wait", False: "after it"}),
    "attention-go-ahead": ("cuda_runner.compile.attention_kernel", "ATTENTION_GO_AHEAD_FIRST", ", the attention's go-ahead",
                           {True: "the attention lets the next launch start before its wait", False: "after it"}),
    "merge-go-ahead": ("cuda_runner.compile.attention_kernel", "MERGE_GO_AHEAD_FIRST", ", the merge's go-ahead",
                       {True: "the merge lets the next launch start before its wait", False: "after it"}),
    "both-go-ahead": ("cuda_runner.compile.attention_kernel", ("ATTENTION_GO_AHEAD_FIRST", "MERGE_GO_AHEAD_FIRST"),
                      ", the attention's and the merge's go-ahead",
                      {True: "both let the next launch start before their wait", False: "after it"}),
}


def switch_ab(record, section: str, module, switch: str | tuple[str, ...], labels: dict[bool, str], layers: list[dict], head: tuple,
              plans: dict[str, tuple], chosen) -> None:
    """The step with the updating attention, captured with a kernel module's switch (or several,
    set together) on and off, in two rounds, the second in the other order (A B B A: a drift over
    the run weighs on both alike); the switches are left as they were."""
    import torch

    position = torch.tensor([STEP_POSITION], device="cuda")
    names = switch if isinstance(switch, tuple) else (switch,)
    were = {name: getattr(module, name) for name in names}
    was = were[names[0]]
    try:
        for round_, order in ((1, (not was, was)), (2, (was, not was))):
            for setting in order:
                for name in names:
                    setattr(module, name, setting)
                record(f"{section}, round {round_}", labels[setting], step(layers, head, plans, chosen, position, update=True), 100)
    finally:
        for name, value in were.items():
            setattr(module, name, value)


def write(results: dict, output: Path | None) -> int:
    if output is not None:
        output.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
