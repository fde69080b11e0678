"""cuda-runner's command line. It parses, calls the library and renders; the
library does the work. Only typer and rich are imported at start-up: torch,
CuPy and NumPy load inside the commands that need them."""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from .. import __version__
from ..errors import CudaRunnerError, ExitCode
from ..names import printable

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 outputs failed verification; 2 usage or input error; "
    "3 invalid or incompatible bundle; 4 runtime or device error; 5 performance gate not met."
)

app = typer.Typer(
    name="cuda-runner",
    help=f"Run PyTorch models compiled ahead of time with AOTInductor.\n\n{EXIT_CODES_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class _State:
    verbose = False
    quiet = False


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cuda-runner {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show progress details and tracebacks.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only results and errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    _State.verbose, _State.quiet = verbose, quiet


def _fail(message: str, code: int) -> None:
    from .render import stderr, text

    stderr.print(text(f"error: {message}"), style="red")
    raise typer.Exit(code)


def handles_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr and the documented exit code; a traceback only with -v."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except CudaRunnerError as error:
            if _State.verbose:
                traceback.print_exc()
            _fail(str(error), int(error.exit_code))
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except MemoryError:
            _fail("out of host memory", int(ExitCode.RUNTIME))
        except (typer.Exit, typer.Abort):
            raise
        except Exception as error:  # a bug or an unexpected failure: still one line
            if _State.verbose:
                traceback.print_exc()
            _fail(f"unexpected {type(error).__name__}: {printable(error)} (run with -v for the traceback)", int(ExitCode.RUNTIME))

    return wrapper


def _progress(message: str) -> None:
    if _State.verbose or (not _State.quiet and sys.stderr.isatty()):
        from .render import stderr, text

        stderr.print(text(message), style="dim")


def _status(message: str):
    """A spinner on a terminal; nothing when stderr is not a TTY."""
    import contextlib

    if _State.quiet or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from .render import stderr

    return stderr.status(message)


def _key_values(items: list[str], option: str) -> dict[str, str]:
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint=option)
        result[key] = value
    return result


# ---------------------------------------------------------------------------
# Paths are declared as str: typer converts Path parameters through pydantic,
# whose import alone costs about 0.3 s of every command's start-up.


@app.command("compile")
@handles_errors
def compile_command(
    program: Annotated[Optional[str], typer.Argument(help="An ExportedProgram saved with torch.export.save (method 'forward').")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="The bundle to write.")] = "model.bundle",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    method: Annotated[list[str], typer.Option("--method", help="More methods: NAME=PROGRAM.pt2 (repeatable).")] = [],  # noqa: B006
    meta: Annotated[list[str], typer.Option("--meta", help="Free-form metadata KEY=VALUE (repeatable).")] = [],  # noqa: B006
    sample_inputs: Annotated[list[str], typer.Option("--sample-inputs", help="An .npz of inputs to store with their eager outputs, for run --self-test: FILE for 'forward', or METHOD=FILE (repeatable).")] = [],  # noqa: B006
) -> None:
    """Compile ExportedPrograms into a bundle with AOTInductor."""
    programs = {"forward": Path(program)} if program is not None else {}
    for name, path in _key_values(method, "--method").items():
        programs[name] = Path(path)
    if not programs:
        raise typer.BadParameter("give a PROGRAM.pt2 or at least one --method NAME=PROGRAM.pt2")
    from ..compile import compile_programs
    from ..io.npy import load_archive

    if not _State.verbose:
        _silence_torch_logs()

    samples = {}
    for item in sample_inputs:
        name, sep, path = item.rpartition("=")
        name = name if sep else "forward"
        if name not in programs:
            raise typer.BadParameter(f"{item!r}: there is no method {name!r} to attach samples to", param_hint="--sample-inputs")
        samples[name] = load_archive(path)
    with _status("compiling") as status:
        def progress(message: str) -> None:
            if status is not None:
                status.update(message)
            elif _State.verbose:
                _progress(message)

        manifest = compile_programs(programs, output, device=device, metadata=_key_values(meta, "--meta"), sample_inputs=samples, progress=progress)
    if not _State.quiet:
        from .render import stdout, text

        stdout.print(text(f"wrote {output}: {', '.join(manifest.methods)} for {device}"))


def _silence_torch_logs() -> None:
    """torch and inductor log warnings with tracebacks; errors reach the user as one line instead."""
    import logging
    import warnings

    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


@app.command("inspect")
@handles_errors
def inspect_command(
    bundle: Annotated[str, typer.Argument(help="The bundle to describe.")],
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (schema cuda-runner/inspect/1).")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-check every segment digest and report each.")] = False,
) -> None:
    """Show a bundle's methods, signatures, build info and whether this machine can run it."""
    from ..inspection import inspect_bundle
    from .render import print_json, render_inspect

    document = inspect_bundle(bundle, verify=verify)
    if json_output:
        print_json(document)
    else:
        render_inspect(document)
    if verify and not document["verified"]:
        bad = [segment["name"] for segment in document["segments"] if not segment["verified"]]
        _fail(f"digest mismatch in segment(s): {', '.join(printable(name) for name in bad)}", int(ExitCode.BAD_BUNDLE))


# Options shared by run and bench.
InputsOption = Annotated[list[str], typer.Option("--inputs", "-i", help="PATH.npy by position, NAME=PATH.npy, @PATH.npy, PATH.npz, or NAME=VALUE inline (repeatable).")]
MethodOption = Annotated[Optional[str], typer.Option(help="Method to run (default: the only one, or 'forward').")]
DeviceOption = Annotated[Optional[str], typer.Option(help="cpu, cuda or cuda:N (default: the bundle's device, if present).")]
RandomOption = Annotated[bool, typer.Option("--random-inputs", help="Generate inputs from the declared signature.")]
SeedOption = Annotated[int, typer.Option(help="Seed for --random-inputs.")]
ShapeOption = Annotated[list[str], typer.Option("--shape", help="Sizes for dynamic dims, NAME=4x128 (with --random-inputs).")]
RangeOption = Annotated[list[str], typer.Option("--range", help="Value range NAME=LO:HI for --random-inputs (default -1:1 for floats, 0:2 for integers).")]
SkipDigestOption = Annotated[bool, typer.Option("--skip-weights-digest", help="Do not re-check the weights digest (faster for huge weights; the library is always checked).")]
CudaGraphOption = Annotated[bool, typer.Option("--cuda-graph", help="Capture the (static-shape) method into a CUDA graph and replay it; imports torch.")]


@app.command("run")
@handles_errors
def run_command(
    bundle: Annotated[str, typer.Argument(help="The bundle to run.")],
    inputs: InputsOption = [],  # noqa: B006
    method: MethodOption = None,
    device: DeviceOption = None,
    out_dir: Annotated[Optional[str], typer.Option("--out-dir", help="Write one <output>.npy per output here.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write all outputs into one .npz archive.")] = None,
    random_inputs: RandomOption = False,
    seed: SeedOption = 0,
    shape: ShapeOption = [],  # noqa: B006
    value_range: RangeOption = [],  # noqa: B006
    save_inputs: Annotated[Optional[str], typer.Option("--save-inputs", help="Save the inputs used as DIR/inputs.npz, to replay a run.")] = None,
    cast: Annotated[bool, typer.Option("--cast", help="Allow same-kind dtype conversion of inputs (e.g. float64 to float32).")] = False,
    print_stats: Annotated[bool, typer.Option("--print", help="Show per-output min/max/mean and NaN/Inf counts.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (schema cuda-runner/run/1).")] = False,
    skip_weights_digest: SkipDigestOption = False,
    expected: Annotated[Optional[str], typer.Option("--expected", help="Reference outputs to compare with: an .npz keyed by output name, or a directory of <output>.npy.")] = None,
    atol: Annotated[list[str], typer.Option("--atol", help="Absolute tolerance, for all outputs or NAME=VALUE for one (default by dtype: float32 1e-4, float16 1e-2, bfloat16 2e-2, float64 1e-7; integers and bool exact).")] = [],  # noqa: B006
    rtol: Annotated[list[str], typer.Option("--rtol", help="Relative tolerance, like --atol. An element passes when |actual-expected| <= atol + rtol*|expected|. Reported relative error is |actual-expected| / (|expected| + 1e-12), so a zero reference gives no NaN.")] = [],  # noqa: B006
    exact: Annotated[bool, typer.Option("--exact", help="Require exact equality for every output.")] = False,
    self_test: Annotated[bool, typer.Option("--self-test", help="Run the sample inputs stored in the bundle and compare with the eager outputs stored with them.")] = False,
    cuda_graph: CudaGraphOption = False,
) -> None:
    """Run a method of a bundle on inputs, write its outputs, and optionally compare them with a reference (exit 1 if they differ)."""
    from ..running import RunRequest, run_bundle
    from ..verify.compare import parse_tolerances

    request = RunRequest(
        bundle=bundle, inputs=inputs, method=method, device=device, random_inputs=random_inputs, seed=seed,
        shapes=shape, ranges=value_range, cast=cast, save_inputs=save_inputs, out_dir=out_dir, out_file=out,
        verify_weights=not skip_weights_digest, expected=expected, self_test=self_test,
        tolerances=parse_tolerances(atol, rtol, exact), cuda_graph=cuda_graph,
    )
    with _status("loading") as status:
        result = run_bundle(request, progress=(status.update if status is not None else _progress))
    from ..report.documents import run_document
    from .render import print_json, render_comparison, render_run

    document = run_document(result)
    if json_output:
        print_json(document)
    else:
        if not _State.quiet:
            render_run(document, show_stats=print_stats)
        if document["comparison"] is not None:
            render_comparison(document["comparison"])
    _verdict(document["verdict"], json_output)
    if document["verdict"] != "PASSED":
        raise typer.Exit(int(ExitCode.VERIFICATION_FAILED))


def _verdict(verdict: str, json_output: bool) -> None:
    """The stable last line scripts can grep for."""
    line = f"VERDICT: {verdict}"
    if json_output:
        print(line, file=sys.stderr)
    else:
        print(line)


@app.command("bench")
@handles_errors
def bench_command(
    bundle: Annotated[str, typer.Argument(help="The bundle to benchmark.")],
    inputs: InputsOption = [],  # noqa: B006  (none: --random-inputs)
    method: MethodOption = None,
    device: DeviceOption = None,
    random_inputs: RandomOption = False,
    seed: SeedOption = 0,
    shape: ShapeOption = [],  # noqa: B006
    value_range: RangeOption = [],  # noqa: B006
    warmup: Annotated[int, typer.Option(help="Untimed runs before measuring.")] = 10,
    iterations: Annotated[int, typer.Option(help="Timed runs.")] = 100,
    duration: Annotated[Optional[float], typer.Option(help="Measure for this many seconds instead of --iterations.")] = None,
    skip_weights_digest: SkipDigestOption = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (schema cuda-runner/bench/1).")] = False,
    cuda_graph: CudaGraphOption = False,
) -> None:
    """Measure load time, first run and steady-state latency, split into copies and compute (random inputs unless --inputs)."""
    from ..bench import BenchRequest, benchmark
    from ..running import RunRequest
    from .render import print_json, render_bench

    if warmup < 0 or iterations < 1 or (duration is not None and duration <= 0):
        raise typer.BadParameter("--warmup must be >= 0, --iterations >= 1 and --duration > 0")
    run = RunRequest(
        bundle=bundle, inputs=inputs, method=method, device=device, random_inputs=random_inputs or not inputs,
        seed=seed, shapes=shape, ranges=value_range, verify_weights=not skip_weights_digest, cuda_graph=cuda_graph,
    )
    with _progress_bar("measuring") as advance:
        result = benchmark(BenchRequest(run, warmup=warmup, iterations=iterations, duration=duration), progress=advance)
    document = result.to_json()
    if json_output:
        print_json(document)
    else:
        render_bench(document)
    from .render import stderr, text

    for warning in result.warnings:
        stderr.print(text(f"warning: {warning}"), style="yellow")


def _progress_bar(label: str):
    """A progress bar on a terminal; a no-op callback elsewhere."""
    import contextlib

    if _State.quiet or not sys.stderr.isatty():
        return contextlib.nullcontext(lambda done, total: None)
    from rich.progress import Progress

    from .render import stderr

    @contextlib.contextmanager
    def bar():
        with Progress(console=stderr, transient=True) as progress:
            task = progress.add_task(label, total=None)
            yield lambda done, total: progress.update(task, completed=done, total=total)

    return bar()


@app.command("devices")
@handles_errors
def devices_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
) -> None:
    """List the devices this machine offers."""
    from ..report.documents import DEVICES_SCHEMA
    from ..runtime.devices import available_devices, compute_capability, device_name
    from .render import print_json, stdout, text

    devices = []
    for device in available_devices():
        entry = {"device": str(device), "name": device_name(device)}
        if device.type == "cuda":
            entry["compute_capability"] = compute_capability(device.index)
        devices.append(entry)
    if json_output:
        print_json({"schema": DEVICES_SCHEMA, "devices": devices})
        return
    for entry in devices:
        extra = f" (sm {entry['compute_capability']})" if "compute_capability" in entry else ""
        stdout.print(text(f"{entry['device']}: {entry['name']}{extra}"))


_GLOBAL_FLAGS = frozenset({"-v", "--verbose", "-q", "--quiet"})


def _hoist_global_flags(argv: list[str]) -> list[str]:
    """Let -v/-q go anywhere on the line, as users of other runners expect."""
    end = argv.index("--") if "--" in argv else len(argv)
    flags = [arg for arg in argv[:end] if arg in _GLOBAL_FLAGS]
    rest = [arg for arg in argv[:end] if arg not in _GLOBAL_FLAGS]
    return flags + rest + argv[end:]


def main() -> None:
    app(args=_hoist_global_flags(sys.argv[1:]), prog_name="cuda-runner")


if __name__ == "__main__":
    main()
