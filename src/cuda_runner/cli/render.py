"""Rendering for humans. Every string that came from a file goes through
`printable` and rich.text.Text, so neither terminal escapes nor rich markup
inside a bundle can reach the terminal."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..names import printable

# Off a terminal, rich would wrap tables at 80 columns; logs and CI want whole lines.
_PIPE_WIDTH = 200
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else _PIPE_WIDTH)


def text(value: Any) -> Text:
    return Text(printable(value))


def print_json(document: Any) -> None:
    # Plain print: one JSON document on stdout, never styled or wrapped.
    sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
    sys.stdout.flush()


def shape_text(shape: list) -> str:
    return "[" + ", ".join(str(entry) for entry in shape) + "]"


def tensor_table(title: str, tensors: list[dict[str, Any]], dims: dict[str, Any]) -> Table:
    table = Table(title=text(title), title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("name")
    table.add_column("dtype")
    table.add_column("shape")
    for tensor in tensors:
        table.add_row(text(tensor["name"]), text(tensor["dtype"]), text(shape_text(tensor["shape"])))
    return table


def render_inspect(document: dict[str, Any]) -> None:
    out = stdout
    out.print(text(f"bundle {document['path']}  (format {document['format_version']}, {human_bytes(document['file_size'])})"))
    build = ", ".join(f"{key} {value}" for key, value in document["build"].items())
    if build:
        out.print(text(f"built with {build}"))
    for key, value in document["metadata"].items():
        out.print(text(f"meta {key} = {value}"))
    for name, method in document["methods"].items():
        _render_method(name, method)
    _render_segments(document["segments"])
    verdict = "yes" if document["runnable_here"] else "no"
    out.print(text(f"runnable here: {verdict}"))
    if document["verified"] is not None:
        out.print(text("digests: " + ("all verified" if document["verified"] else "MISMATCH")))


def _render_method(name: str, method: dict[str, Any]) -> None:
    out = stdout
    device = method["device"]
    target = device["type"] + (f" (sm {device['compute_capability']})" if "compute_capability" in device else "")
    target += f" (isa {device['cpu_isa']})" if "cpu_isa" in device else ""
    out.print()
    out.print(text(f"method {name}: {target}, torch {method['torch_version']}"), style="bold")
    out.print(tensor_table("inputs", method["inputs"], method["dims"]))
    out.print(tensor_table("outputs", method["outputs"], method["dims"]))
    for dim_name, dim in method["dims"].items():
        upper = "inf" if dim["max"] is None else dim["max"]
        out.print(text(f"  dim {dim_name}: [{dim['min']}, {upper}], example {dim['example']}"))
    for role in ("library", "weights"):
        segment = method[role]
        if segment:
            out.print(text(f"  {role}: {human_bytes(segment['size'])}  {segment['digest']}"))
    out.print(text(f"  samples: {'yes' if method['samples'] else 'no'}"))
    if method["not_runnable_reason"]:
        out.print(text(f"  not runnable here: {method['not_runnable_reason']}"), style="yellow")


def _render_segments(segments: list[dict[str, Any]]) -> None:
    table = Table(title="segments", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("name", "offset", "size", "digest"):
        table.add_column(column)
    verified = segments and "verified" in segments[0]
    if verified:
        table.add_column("verified")
    for segment in segments:
        row = [text(segment["name"]), str(segment["offset"]), human_bytes(segment["size"]), text(segment["digest"])]
        if verified:
            row.append("ok" if segment["verified"] else "MISMATCH")
        table.add_row(*row)
    stdout.print()
    stdout.print(table)


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def render_run(document: dict[str, Any], show_stats: bool) -> None:
    table = Table(title=text(f"{document['method']} on {document['device']}"), title_justify="left", show_edge=False, pad_edge=False)
    columns = ["output", "dtype", "shape"]
    if show_stats:
        columns += ["min", "max", "mean", "nan", "inf"]
    columns.append("file")
    for column in columns:
        table.add_column(column)
    for output in document["outputs"]:
        row = [text(output["name"]), output["dtype"], shape_text(output["shape"])]
        if show_stats:
            stats = output["stats"]
            row += [_number(stats["min"]), _number(stats["max"]), _number(stats["mean"]), str(stats["nan_count"]), str(stats["inf_count"])]
        row.append(text(output.get("file") or "-"))
        table.add_row(*row)
    stdout.print(table)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def render_comparison(comparison: dict[str, Any]) -> None:
    """One PASSED/FAILED line per output, with its error statistics."""
    for output in comparison["outputs"]:
        line = f"{output['verdict']} {output['name']}"
        if output["max_abs_error"] is not None:
            line += (f"  max_abs={output['max_abs_error']:.3g} mean_abs={output['mean_abs_error']:.3g} "
                     f"median_abs={output['median_abs_error']:.3g} max_rel={output['max_rel_error']:.3g}")
        line += f"  (atol={output['atol']:g}, rtol={output['rtol']:g})"
        if not output["passed"]:
            line += f": {output['reason']}"
            if output["worst_index"] is not None:
                line += f"; worst at {output['worst_index']}: got {output['worst_actual']}, expected {output['worst_expected']}"
        nans = (output["nan_actual"], output["nan_expected"], output["inf_actual"], output["inf_expected"])
        if any(nans):
            line += f"  [NaN {nans[0]}/{nans[1]}, Inf {nans[2]}/{nans[3]} actual/expected]"
        stdout.print(text(line), style=None if output["passed"] else "red")
    for name in comparison["not_compared"]:
        stdout.print(text(f"SKIPPED {name}: no reference given"))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def render_bench(document: dict[str, Any]) -> None:
    out = stdout
    out.print(text(f"{document['method']} on {document['device']}  ({human_bytes(document['input_bytes'])} in, {human_bytes(document['output_bytes'])} out)"))
    load = Table(title="load (ms)", title_justify="left", show_edge=False, pad_edge=False)
    for name in document["load_s"]:
        load.add_column(name)
    load.add_column("first run")
    load.add_row(*[_ms(value) for value in document["load_s"].values()], _ms(document["first_run_s"]))
    out.print(load)
    table = Table(title="steady state (ms per run)", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("what", "n", "min", "median", "mean", "p90", "p95", "p99", "max", "cv"):
        table.add_column(column)
    rows = [("host to host", document["steady_s"])]
    rows += [(f"  {name.replace('_', ' ')}", stats) for name, stats in document["split_s"].items()]
    if document["device_resident_s"] is not None:
        rows.append(("device arrays", document["device_resident_s"]))
    for label, stats in rows:
        table.add_row(label, str(stats["count"]), *[_ms(stats[key]) for key in ("min", "median", "mean", "p90", "p95", "p99", "max")], f"{stats['cv']:.1%}")
    out.print(table)
    out.print(text(f"throughput: {document['throughput_per_s']:.1f} runs/s (host to host, at the median)"))
    out.print(text("split: CUDA-event device time per phase on a GPU, host timers on CPU; see --json 'definitions'"))
