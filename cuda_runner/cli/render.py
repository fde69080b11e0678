"""Rendering typed results for people, and JSON for scripts.

Every line is built as plain text first: tables are aligned here, with no
trailing spaces, and never wrapped (a log line stays one line at any width).
Colour is added only on a terminal, through rich.text.Text, which never
interprets markup. Every string that came from a file goes through
`printable`, so no terminal escape inside a bundle reaches the terminal.
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ..arrays import shape_text

if TYPE_CHECKING:  # the results are typed; their modules load only when a command runs
    import numpy as np

    from ..commands.bench import BenchResult
    from ..commands.inspection import InspectResult, MethodReport, SignatureReport
    from ..commands.running import RunResult
    from ..format.manifest import Manifest, MethodSpec, OutputSource, TensorSpec
    from ..format.program import ProgramMethodInfo
    from ..runtime.devices import DevicesResult
    from ..verify.compare import Comparison


def printable(text: object) -> str:
    """Escape control characters so file-derived text cannot drive the terminal.

    Rich markup is handled separately: callers render with rich.text.Text,
    which never interprets markup.
    """
    out = []
    for char in str(text):
        if unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn") or char in "\u2028\u2029":
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(char)
    return "".join(out)


class Output:
    """One stream of lines: plain off a terminal, coloured on one (unless NO_COLOR)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self._console: Any = None
        self.colour = stream.isatty() and "NO_COLOR" not in os.environ

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.colour and style:
            if self._console is None:
                from rich.console import Console

                self._console = Console(file=self.stream, highlight=False, soft_wrap=True)
            from rich.text import Text

            self._console.print(Text(text, style=style))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def lines(self, texts: Sequence[str]) -> None:
        for text in texts:
            self.line(text)


def clean(value: Any) -> str:
    return printable(value)


def json_text(document: Any) -> str:
    """One JSON document, ASCII only: any text from a file (lone surrogates
    from undecodable paths included) is escaped, never written as raw bytes."""
    return json.dumps(_escape_surrogates(document), indent=2, ensure_ascii=True, allow_nan=False)


def error_document(document: str, kind: str, exit_code: int, message: str) -> dict[str, Any]:
    """What --json prints when a command fails: the command's schema, and
    `error` {kind, exit_code, message} (docs/json.md)."""
    from ..report.schema import SCHEMAS

    return {"schema": SCHEMAS.get(document, SCHEMAS["error"]), "error": {"kind": kind, "exit_code": exit_code, "message": message}}


def _escape_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value if not any("\ud800" <= char <= "\udfff" for char in value) else printable(value)
    if isinstance(value, dict):
        return {_escape_surrogates(key): _escape_surrogates(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escape_surrogates(item) for item in value]
    return value


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Aligned columns, two spaces apart, no trailing spaces."""
    widths = [max(len(str(row[column])) for row in [headers, *rows]) for column in range(len(headers))]
    return [(indent + "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths))).rstrip() for row in [headers, *rows]]


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# ---------------------------------------------------------------------------
# inspect


def inspect_lines(result: InspectResult) -> list[str]:
    manifest = result.manifest
    kind = "program" if result.program is not None else "bundle"
    lines = [clean(f"{kind} {result.path}  (format {result.format_version}, {human_bytes(result.file_size)})")]
    if result.program is not None:
        data_file = result.program.data_path
        lines.append(clean(f"data file {data_file}" if data_file is not None else "data file: none (everything is in the program)"))
    build = ", ".join(f"{key} {value}" for key, value in manifest.build.items())
    if build:
        lines.append(clean(f"built with {build}"))
    lines += [clean(f"meta {key} = {value}") for key, value in manifest.metadata.items()]
    for name, report in result.methods.items():
        lines += _method_lines(name, report, None if result.program is not None else manifest.shared_weights())
        if result.program is not None:
            lines += _program_method_lines(result.program.methods[name], result.shim_check[name])
    if result.program is not None:
        for name, values in result.program.constant_methods.items():
            lines += ["", clean(f"constant method {name}: returns {', '.join(repr(value) for value in values)}")]
    lines += ["", "segments"]
    headers = ["name", "offset", "size", "digest"] + (["verified"] if result.segment_digests_ok is not None else [])
    rows = []
    for entry in manifest.segments:
        row = [clean(entry.name), str(entry.offset), human_bytes(entry.size), entry.digest]
        if result.segment_digests_ok is not None:
            ok = result.segment_digests_ok.get(entry.name)
            row.append("not checkable" if ok is None else "ok" if ok else "MISMATCH")
        rows.append(row)
    lines += table(headers, rows, "  ")
    lines += _shared_weight_lines(manifest)
    lines += _signature_lines(result.signature, result.segment_digests_ok is not None)
    if result.verified is not None:
        skipped = any((report.library_check or "").startswith("skipped") for report in result.methods.values())
        what = "digests only; a library was not checked" if skipped else "digests and library checks"
        lines.append(f"verified: yes ({what})" if result.verified else "verified: NO")
    lines.append(f"runnable here: {'yes' if result.runnable_here else 'no'}")
    return lines


def _program_method_lines(method: ProgramMethodInfo, shim_check: tuple[list[str] | None, str | None]) -> list[str]:
    """What an ExecuTorch program says about a method."""
    facts = method.library
    specs = ", ".join(f"{key}={value}" for key, value in method.compile_specs.items())
    lines = [
        clean(f"  executorch: payload layout {method.layout.value}, CudaBackend ({specs})"),
        clean(f"  plan: {'; '.join(method.instructions)}"),
    ]
    lines += [clean(f"  key {role}: {key}") for role, key in method.keys.items()]
    if method.weight_count:
        lines.append(clean(f"  weights: {method.weight_count} tensors by name, {human_bytes(method.weights_bytes)}"))
    lines.append(clean(f"  GPU kernels: {', '.join(facts.kernels) or 'none (a CPU library)'}"))
    missing, searched = shim_check
    scope = "this libtorch" if searched == "cuda" or not facts.uses_cuda else "this libtorch (without CUDA)"
    if missing is None:
        verdict = "libtorch is not installed here to check them"
    elif missing:
        verdict = f"{scope} lacks {len(missing)}: {', '.join(missing[:6])}"
    else:
        verdict = f"{scope} has all of them"
    lines.append(clean(f"  shim functions: {len(facts.shim_symbols)} needed, {verdict}"))
    # ExecuTorch moves mutated buffers (a KV cache) into the library without marking them in the program.
    lines.append("  state: not recorded in the program; a method whose library holds buffers keeps them between calls (one lane, no warm-up)")
    return lines


def _shared_weight_lines(manifest: Manifest) -> list[str]:
    """The weight storages several methods name: stored once, uploaded once when they load together."""
    from ..commands.inspection import shared_weights_json

    shared = shared_weights_json(manifest)
    if not shared:
        return []
    total = sum(entry["size"] for entry in shared.values())
    lines = ["", clean(f"shared weights: {len(shared)} storage(s), {human_bytes(total)}, stored once and uploaded once for the methods that name them")]
    rows = [[clean(name), human_bytes(entry["size"]), clean(", ".join(entry["fqns"]) or "(weights blob)"), clean(", ".join(entry["methods"]))]
            for name, entry in shared.items()]
    return lines + table(["segment", "size", "constants", "methods"], rows, "  ")


def _signature_lines(signature: SignatureReport | None, segments_checked: bool) -> list[str]:
    if signature is None:
        return []
    if not signature.present:
        return ["signature: none"]
    line = f"signature: {signature.path}"
    if signature.signer is not None:
        scope = "every segment checked against it" if segments_checked else "header and manifest checked; segments are checked when loaded, or with --verify"
        line += f", verified, signed by the trusted key {signature.signer[:16]}... ({scope})"
    elif signature.error is not None:
        line += f", NOT verified: {signature.error}"
    else:
        line += f", not checked (no trusted key given; key hint {str(signature.key_hint)[:16]}...)"
    return [clean(line)]


def _wiring_lines(spec: MethodSpec) -> list[str]:
    """How values reach the library where it is not in order, which inputs the
    library writes into, and what state a run changes."""
    from ..format.manifest import MUTATED_BUFFERS_OPTION
    from ..runtime.method import written_inputs

    lines = []
    if spec.wiring is not None:
        taken = ", ".join(spec.inputs[index].name for index in spec.wiring.library_inputs)
        sources = ", ".join(f"{output.name} = {_source_text(spec, source)}" for output, source in zip(spec.outputs, spec.wiring.outputs))
        lines.append(clean(f"  wiring: the library takes ({taken}); {sources}"))
    written = written_inputs(spec)
    if written:
        lines.append(clean(f"  writes into inputs: {', '.join(spec.inputs[index].name for index in sorted(written))} (each run gets private copies)"))
    mutated = spec.compile_options.get(MUTATED_BUFFERS_OPTION)
    if mutated:
        lines.append(clean(f"  state: {', '.join(str(name) for name in mutated[:8])}{' ...' if len(mutated) > 8 else ''} change on every run (kept between calls; one lane)"))
        if spec.compile_options.get("joint_graph_constant_folding") is not False:
            lines.append("  state caveat: compiled with Inductor's joint-graph constant folding on, which freezes a buffer whose new value "
                         "comes from buffers alone (a step counter): recompile with this cuda-runner to keep such a buffer")
    return lines


def _source_text(spec: MethodSpec, source: OutputSource) -> str:
    if source.constant is not None:
        return f"the constant {source.constant!r}"
    return spec.inputs[source.index].name if source.from_input else f"library output {source.index}"


def _tensor_table(tensors: tuple[TensorSpec, ...]) -> list[str]:
    """A signature's rows; a column of accepted values where a tensor has bounds (a position in a KV cache)."""
    rows = [[clean(t.name), t.dtype, clean(shape_text(t.shape))] for t in tensors]
    if not any(t.bounds is not None or t.span_bounds is not None for t in tensors):
        return table(["name", "dtype", "shape"], rows, "    ")
    values = ["; ".join(_values_text(t)) for t in tensors]
    return table(["name", "dtype", "shape", "values"], [[*row, value] for row, value in zip(rows, values)], "    ")


def _values_text(spec: TensorSpec) -> list[str]:
    texts = [] if spec.bounds is None else [f"{spec.bounds[0]} to {spec.bounds[1]}"]
    if spec.span_bounds is not None:  # a prompt's positions: the first and the count are what the method writes at
        texts.append(f"counts from its first, within {spec.span_bounds[0]} to {spec.span_bounds[1]}")
    return texts


def _method_lines(name: str, report: MethodReport, shared: dict[str, list[str]] | None = None) -> list[str]:
    from ..commands.inspection import isa_name

    spec, device = report.spec, report.spec.device
    target = device.type
    if device.compute_capability:
        target += f" (sm {device.compute_capability})"
    if device.type == "cpu":
        target += f" (vector ISA {isa_name(device.cpu_isa) or 'unknown'})"
    lines = ["", clean(f"method {name}: {target}, torch {spec.torch_version}")]
    for title, tensors in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        lines.append(f"  {title}")
        lines += _tensor_table(tensors)
    for dim_name, dim in spec.dims.items():
        upper = "unbounded" if dim.max is None else dim.max
        lines.append(clean(f"  dim {dim_name}: min {dim.min}, max {upper}, example {dim.example}"))
    for role, entry in (("library", report.library), ("weights", report.weights), ("call helper", report.call_helper)):
        if entry is not None:
            lines.append(f"  {role}: {human_bytes(entry.size)}  {entry.digest}")
    if spec.constants and shared is not None:
        own = [constant for constant in spec.constants if constant.segment not in shared]
        count = len(spec.constants)
        lines.append(clean(f"  weights: {count} constant{'s' if count != 1 else ''} by FQN, {count - len(own)} in storages shared with other methods"))
    if device.type == "cpu" and device.cpu_flags:
        lines.append(clean(f"  needs CPU flags: {' '.join(device.cpu_flags)}"))
    if report.needs_libtorch is not None:
        lines.append(clean(f"  runs on: {report.provider_note}"))
    lines += _wiring_lines(spec)
    lines.append(f"  samples: {'yes' if spec.has_samples else 'no'}")
    if report.library_check is not None:
        lines.append(clean(f"  library check: {report.library_check}"))
    if report.not_runnable_reason:
        lines.append(clean(f"  not runnable here: {report.not_runnable_reason}"))
    return lines


# ---------------------------------------------------------------------------
# run


def run_lines(result: RunResult, *, show_stats: bool, show_values: bool, full_values: bool) -> list[str]:
    stats = result.stats()
    headers = ["output", "dtype", "shape"] + (["min", "max", "mean", "nan", "inf"] if show_stats else []) + ["file"]
    rows = []
    for spec in result.method.outputs:
        array = result.outputs[spec.name]
        written = result.output_dtype(spec.name)
        row = [clean(spec.name), written if written == spec.dtype else f"{written} (model: {spec.dtype})", shape_text(array.shape)]
        if show_stats:
            summary = stats[spec.name]
            row += [number(summary.min), number(summary.max), number(summary.mean), str(summary.nan_count), str(summary.inf_count)]
        row.append(clean(", ".join(str(path) for path in result.files.get(spec.name, [])) or "-"))
        rows.append(row)
    lines = [clean(f"{result.method.name} on {result.device}"), *table(headers, rows, "  ")]
    if result.signature is not None:
        lines.append(clean(f"signature: verified before loading, by trusted key {result.signature['signer']} ({result.signature['method']})"))
    if show_values:
        for spec in result.method.outputs:
            lines += [clean(f"{spec.name} ="), *values_text(result.outputs[spec.name], full_values).splitlines()]
    return lines


def values_text(array: np.ndarray, full: bool) -> str:
    """NumPy's own printing, summarised for large arrays unless `full`."""
    import numpy as np

    values = array.astype(np.float32) if array.dtype.name == "bfloat16" else array
    threshold = sys.maxsize if full else 1000
    return np.array2string(values, threshold=threshold, edgeitems=3, max_line_width=10**6)


def comparison_lines(comparison: Comparison) -> list[tuple[str, str | None]]:
    """(line, style) per output of a comparison."""
    lines = []
    for output in comparison.outputs:
        line = f"{output.verdict} {output.name}"
        if output.max_abs_error is not None:
            line += (f"  max_abs={output.max_abs_error:.3g} mean_abs={output.mean_abs_error:.3g} "
                     f"median_abs={output.median_abs_error:.3g} max_rel={output.max_rel_error:.3g}")
        line += f"  (atol={output.atol:g}, rtol={output.rtol:g})"
        if not output.passed:
            line += f": {output.reason}"
            if output.worst_index is not None:
                line += f"; worst at {list(output.worst_index)}: got {output.worst_actual}, expected {output.worst_expected}"
        specials = (output.nan_actual, output.nan_expected, output.inf_actual, output.inf_expected)
        if any(specials):
            line += f"  [NaN {specials[0]}/{specials[1]}, Inf {specials[2]}/{specials[3]} actual/expected]"
        lines.append((clean(line), None if output.passed else "red"))
    lines += [(clean(f"SKIPPED {name}: no reference given (allowed by --allow-missing)"), None) for name in comparison.not_compared]
    return lines


# ---------------------------------------------------------------------------
# bench


def bench_lines(result: BenchResult) -> list[str]:
    if result.decode is not None:
        return _decode_lines(result)
    lines = [clean(f"{result.method} on {result.device}  ({human_bytes(result.input_bytes)} in, {human_bytes(result.output_bytes)} out)"), "load (ms)"]
    lines += table([*result.load, "first_run"], [[*(ms(value) for value in result.load.values()), ms(result.first_run)]], "  ")
    lines.append("steady state (ms per run)")
    rows = [("host to host", result.steady)]
    rows += [(f"  {name.replace('_', ' ')}", stats) for name, stats in result.split.items()]
    if result.device_resident is not None:
        rows.append(("device arrays", result.device_resident))
    headers = ["what", "n", "min", "median", "mean", "p90", "p95", "p99", "max", "cv"]
    body = [[label, str(stats.count), *(ms(getattr(stats, key)) for key in ("min", "median", "mean", "p90", "p95", "p99", "max")), f"{stats.cv:.1%}"]
            for label, stats in rows]
    lines += table(headers, body, "  ")
    lines.append(f"throughput: {result.throughput:.1f} runs/s ({result.steady.count} runs in {result.timed_wall:.3f} s)")
    lines.append(clean(f"calls: {result.call_path}; shim: {result.provider}"))
    lines.append("split: CUDA-event device time per phase on a GPU, host timers on CPU; see --json 'definitions'")
    lines += [gate.describe() for gate in result.gates]
    return lines


def _decode_lines(result: BenchResult) -> list[str]:
    decode = result.decode
    assert decode is not None
    lines = [clean(f"{result.method} on {result.device}: a decode loop of {decode.steps.count} steps, position input "
                   f"{decode.position_input} at {decode.positions[0]}..{decode.positions[1]}"), "load (ms)"]
    lines += table([*result.load, "first step"], [[*(ms(value) for value in result.load.values()), ms(result.first_run)]], "  ")
    if decode.prefill_method is not None and decode.prefill_s is not None:
        lines.append(clean(f"prefill: {decode.prefill_method} on {decode.prompt_length} tokens: {ms(decode.prefill_s)} ms"))
    headers = ["what", "n", "min", "median", "mean", "p90", "p95", "p99", "max", "cv"]
    stats = decode.steps
    lines.append("per step (ms)")
    lines += table(headers, [["decode step", str(stats.count), *(ms(getattr(stats, key)) for key in ("min", "median", "mean", "p90", "p95", "p99", "max")),
                              f"{stats.cv:.1%}"]], "  ")
    lines.append(f"tokens/s: {decode.tokens_per_s:.1f} ({stats.count} steps in {decode.timed_wall:.3f} s)")
    lines.append(clean(f"calls: {result.call_path}; shim: {result.provider}"))
    lines += [gate.describe() for gate in result.gates]
    return lines


# ---------------------------------------------------------------------------
# devices


def devices_lines(result: DevicesResult) -> list[str]:
    lines = [clean(f"cpu: {result.cpu_model}, {result.cpu_cores} cores"), clean(f"  ISA flags checked for CPU bundles: {' '.join(result.cpu_flags) or 'none found'}")]
    for gpu in result.gpus:
        lines.append(clean(f"{gpu.device}: {gpu.name}, compute capability {gpu.compute_capability}, {human_bytes(gpu.memory_bytes)}"))
    if result.cuda_driver is not None:
        lines.append(f"CUDA driver supports {result.cuda_driver}; CuPy's CUDA runtime {result.cuda_runtime or 'not installed'}")
    else:
        lines.append("no CUDA driver found")
    lines.append(f"libtorch: {result.libtorch or 'not installed'}")
    lines.append(f"cuda-runner shim: {result.own_shim or 'not built in this install'}")
    return lines
