#!/usr/bin/env python3
"""Whether a CUDA graph should hold its own host copies (GPU machine).

A graphed call copies its inputs in and its outputs out. Either the capture
holds those copies (memcpy nodes reading and writing pinned buffers of the
graph's own: a replay writes the inputs' bytes, launches, waits), or each
replay queues them itself around the launch (three more CUDA calls from
Python for a decoder's token, position and logits). This times both on the
same bundle in one process, alternately: a small Llama-shaped decoder's
decode method (2 layers, the 1B decoder's inputs and output kind), compiled
standalone for the GPU here, whose call is short enough that the host's part
shows. Medians of `model.run` with p10-p90, microseconds.

    python3 scripts/bench_graph_copies.py --output copies.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def compile_decoder(path: Path) -> None:
    import scale_models
    import torch
    from bench_scale import method_of

    import cuda_runner

    config = scale_models.LLAMA_TINY
    model = scale_models.LlamaDecoder(config, torch.bfloat16).eval().cuda()
    cuda_runner.compile_module(method_of(model, "decode"), scale_models.llama_examples(config, 6, "cuda")["decode"], path, device="cuda")


def time_calls(path: Path, in_graph: bool, count: int) -> list[float]:
    import cuda_runner
    from cuda_runner.runtime import graphs

    graphs.COPIES_IN_GRAPH = in_graph
    samples = []
    with cuda_runner.load(path, "cuda", cuda_graph=True) as model:
        token = np.array([[1]], np.int64)
        positions = [np.array([6 + index], np.int64) for index in range(20)]
        for index in range(20):  # the warm-up calls, the capture, and a few replays
            model.run({"tokens": token, "input_pos": positions[index]})
        (captured,) = model.method()._lanes.first._graphs.values()
        assert (captured.staged_outputs[0] is not None) == in_graph
        for index in range(count):
            started = time.perf_counter()
            model.run({"tokens": token, "input_pos": positions[index % 20]})
            samples.append(time.perf_counter() - started)
    return samples


def summary_us(samples: list[float]) -> dict[str, float]:
    values = np.array(samples) * 1e6
    return {"median_us": round(float(np.median(values)), 1), "p10_us": round(float(np.percentile(values, 10)), 1),
            "p90_us": round(float(np.percentile(values, 90)), 1), "n": len(samples)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here.parent), str(here)]
    results: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M"), "calls": options.calls}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "decoder.bundle"
        started = time.perf_counter()
        compile_decoder(path)
        results["compile_s"] = round(time.perf_counter() - started, 1)
        for round_ in range(options.rounds):
            for name, in_graph in (("copies in the graph", True), ("copies queued each replay", False)):
                summary = summary_us(time_calls(path, in_graph, options.calls))
                results.setdefault(name, []).append(summary)  # type: ignore[union-attr]
                print(f"round {round_ + 1} | {name} | {json.dumps(summary)}", flush=True)
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
