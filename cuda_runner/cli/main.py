"""cuda-runner's command line. It parses strings into the library's typed
requests, calls the library and renders its typed results; the library does
the work and never imports this package. Only typer (and click) load at
start-up: torch, CuPy, NumPy and rich load inside the commands that need them.

The contract scripts rely on: one `error: ...` line on stderr and a
documented exit code for every failure (a traceback only with -v), no
wrapped lines, a final `VERDICT:` line for run and bench, and quiet exits on
a closed pipe or a signal (128+N).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import TOO_MANY_FILES, CudaRunnerError, ExitCode, Interrupted, too_many_open_files
from ..version import __version__
from . import options as parse
from .render import printable

# click's UsageError (unknown option, bad value, missing argument). typer 0.28
# vendors click and older typer re-exports it; BadParameter derives from it in both.
_ClickUsageError: type[Exception] = typer.BadParameter.__bases__[0]

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 1 outputs failed verification; 2 usage or input error; "
    "3 invalid or incompatible bundle; 4 runtime or device error; 5 performance gate not met; "
    "128+N stopped by signal N."
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
    json = False  # --json on the line: every outcome, failures too, is one JSON document on stdout
    command: str | None = None  # the subcommand on the line
    printed_document = False  # the command printed its JSON document already
    batch = False  # run --batch: its document is a batch document


# The JSON document of each command, and the commands that end with a VERDICT line.
_DOCUMENTS = {"run": "run", "bench": "bench", "inspect": "inspect", "devices": "devices"}
_VERDICT_COMMANDS = frozenset({"run", "bench"})


def _version(value: bool) -> None:
    if value:
        print(f"cuda-runner {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show progress details, warnings and tracebacks.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only results and errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    _State.verbose, _State.quiet = verbose, quiet


# ---------------------------------------------------------------------------
# Output and errors


def _out() -> Any:
    from .render import Output

    return Output(sys.stdout)


def _err() -> Any:
    from .render import Output

    return Output(_Terminal.stderr())


class _Terminal:
    """stderr as it was when the process started: library code may have fd 2
    pointed elsewhere (see _native_stderr) while we report."""

    _saved: Any = None

    @classmethod
    def stderr(cls) -> Any:
        return cls._saved or sys.stderr


def _hint(error: CudaRunnerError) -> str:
    hint = parse.SUBJECT_HINTS.get(error.subject or "")
    return f" ({hint})" if hint else ""


def handles_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Library errors become one line and the error kind's exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except CudaRunnerError as error:
            _report(f"{error}{_hint(error)}", int(error.exit_code), type(error).__name__)
        except MemoryError:
            _report("out of host memory", int(ExitCode.RUNTIME), "MemoryError")
        except Exception as error:
            if not too_many_open_files(error):
                raise  # a bug: run() reports it as one
            _report(TOO_MANY_FILES, int(ExitCode.RUNTIME), "DeviceError")

    return wrapper


def _report(message: str, code: int, kind: str) -> None:
    raise typer.Exit(_fail(message, code, kind))


def _fail(message: str, code: int, kind: str) -> int:
    """Say why the command failed: one `error:` line, the JSON error document
    with --json, and the VERDICT line for run and bench. Returns `code`."""
    if _State.verbose and sys.exc_info()[0] is not None:
        traceback.print_exc(file=_Terminal.stderr())
    _err().line(f"error: {printable(message)}", style="red")
    if _State.json and not _State.printed_document:
        from .render import error_document

        schema = _DOCUMENTS.get(_State.command or "", "error")
        if _State.command == "run" and _State.batch:
            schema = "batch"
        _print_document(error_document(schema, kind, code, printable(message)))
    if _State.command in _VERDICT_COMMANDS:
        _verdict("ERROR", _State.json)
    return code


def _print_document(document: dict[str, Any]) -> None:
    from .render import json_text

    _State.printed_document = True
    _out().line(json_text(document))


def _progress(message: str) -> None:
    if _State.verbose or (not _State.quiet and _Terminal.stderr().isatty()):
        _err().line(printable(message), style="dim")


@contextlib.contextmanager
def _native_stderr() -> Iterator[None]:
    """Native code (the model library, libtorch) prints errors and C++ stack
    frames straight to fd 2. Off -v, point fd 2 at /dev/null while the library
    works, so that the user sees one line; with -v, leave it. Our own output
    goes to the saved stderr meanwhile (_Terminal)."""
    if _State.verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        _Terminal._saved = os.fdopen(os.dup(saved), "w", buffering=1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
        finally:
            os.close(devnull)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if _Terminal._saved is not None:
            _Terminal._saved.close()
        _Terminal._saved = None


def _quiet_warnings() -> None:
    """NumPy, torch and inductor warnings are for -v; the user gets one line."""
    if _State.verbose:
        return
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.getLogger("torch").setLevel(logging.CRITICAL)


def _run_batch(bundle: str, folder: str, out_dir: str, out_format: str, method: str | None, device: str | None, devices: str | None,
               expected_dir: str | None,
               tolerances: Any, allow_missing: bool, resume: bool, fail_fast: bool, load: Any, json_output: bool, data: str | None,
               batch_size: int) -> None:
    from ..commands.batch import BatchRequest, run_batch

    request = BatchRequest(
        bundle=Path(bundle), inputs=Path(folder), out_dir=Path(out_dir), out_format=out_format, method=method, device=device,
        expected_dir=_path(expected_dir), tolerances=tolerances, allow_missing=allow_missing, resume=resume, fail_fast=fail_fast,
        devices=devices, load=load, data=_path(data), batch_size=batch_size,
    )
    _quiet_warnings()
    with _native_stderr(), _progress_bar("input sets") as bars:
        result = run_batch(request, progress=bars.advance, load_progress=bars.load)
    if json_output:
        _print_document(result.to_json())
    else:
        for failed in (entry for entry in result.sets if entry.exit_code):
            _out().line(printable(f"{'FAILED' if failed.status == 'failed' else 'ERROR'} {failed.name}: {failed.error or 'outputs outside tolerance'}"), "red")
        _out().line(printable(result.summary()))
    _verdict(result.verdict, json_output)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _verdict(verdict: str, json_output: bool) -> None:
    """The stable last line scripts can grep for (stderr with --json)."""
    line = f"VERDICT: {verdict}"
    if json_output:
        _err().line(line)
    else:
        _out().line(line)


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


# ---------------------------------------------------------------------------
# Paths are declared as str: typer converts Path parameters through pydantic
# in newer versions, whose import alone costs about 0.3 s of every start-up.


DataOption = Annotated[Optional[str], typer.Option("--data", metavar="FILE.ptd", help=(
    "An ExecuTorch program's data file (default: aoti_cuda_blob.ptd next to the program)."))]
SignKeyOption = Annotated[Optional[str], typer.Option("--sign-key", metavar="PRIVATE.pem", help="Sign the bundle as it is written (BUNDLE.sig).")]
CallHelperOption = Annotated[bool, typer.Option("--call-helper/--no-call-helper", help=(
    "Build the native call helper into the bundle (one foreign call per model call; needs a C compiler)."))]


def _check_sign_key(sign_key: str | None) -> None:
    from ..files import require_regular

    if sign_key is not None:
        require_regular(sign_key, "a PEM private key")


def _sign(output: str, sign_key: str | None) -> str:
    """Sign the written bundle if asked; the words to add to the 'wrote' line."""
    if sign_key is None:
        return ""
    from ..format.signing import sign_file

    return f", signed in {sign_file(output, sign_key)}"


def _built_call_helper() -> bytes | None:
    from ..compile.helper import build_call_helper

    built = build_call_helper()
    if built.library is None:
        _warn(built.note)
    return built.library


def _warn(message: str) -> None:
    if not _State.quiet:
        _err().line(printable(f"warning: {message}"), style="yellow")


@app.command("compile")
@handles_errors
def compile_command(
    program: Annotated[Optional[str], typer.Argument(metavar="[PROGRAM.pt2]", help="An ExportedProgram saved with torch.export.save (method 'forward').")] = None,
    output: Annotated[str, typer.Option("--output", "-o", metavar="BUNDLE", help="The bundle to write.")] = "model.bundle",
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, cuda or cuda:N.")] = "cpu",
    method: Annotated[list[str], typer.Option("--method", metavar="NAME=PROGRAM.pt2", help="More methods (repeatable).")] = [],  # noqa: B006
    meta: Annotated[list[str], typer.Option("--meta", metavar="KEY=VALUE", help="Free-form metadata (repeatable).")] = [],  # noqa: B006
    sample_inputs: Annotated[list[str], typer.Option(
        "--sample-inputs", metavar="[METHOD=]FILE.npz", help="Inputs to store with their eager outputs, for run --self-test (repeatable).")] = [],  # noqa: B006
    sign_key: SignKeyOption = None,
    option: Annotated[list[str], typer.Option("--option", metavar="KEY=VALUE", help=(
        "An Inductor option, e.g. max_autotune=true, or cuda_runner.fuse_decode_attention=false "
        "(a standalone CUDA build's decode-step attention as SDPA's math form, not cuda-runner's fused kernel), "
        "cuda_runner.fuse_cache_update=false (the step's cache writes and RoPE left to Inductor, the attention still fused), "
        "or cuda_runner.matvec=false (its products of one row as Inductor lowers them, not on cuda-runner's matrix-vector kernel); "
        "repeatable; recorded in the manifest."))] = [],  # noqa: B006
    autotune: Annotated[bool, typer.Option("--autotune", help=(
        "Let Inductor benchmark its kernel choices on this machine (max_autotune, coordinate_descent_tuning); compiles take longer."))] = False,
    quick: Annotated[bool, typer.Option("--quick", help=(
        "Compile sooner, run slower: one Triton configuration per GEMM and convolution instead of benchmarking several "
        "(single-token methods keep their matrix-vector kernels). docs/benchmarks.md has what it costs."))] = False,
    call_helper: CallHelperOption = True,
    cpu_target: Annotated[str, typer.Option("--cpu-target", metavar="TARGET", help=(
        "CPU bundles: portable (the widest of the levels below this CPU has), native (this CPU: -march=native and its best "
        "vector ISA; runs only on CPUs with all its flags), or an x86-64 level: avx512 (x86-64-v4), avx2 (x86-64-v3), "
        "scalar (x86-64, no vector code)."))] = "portable",
    standalone: Annotated[bool, typer.Option("--standalone", help=(
        "Refuse, naming the kernels, where the library would need libtorch at run time, instead of falling back to a "
        "libtorch-bound build (CUDA compiles need only cuda-runner's own shim by default: Triton GEMMs and convolutions)."))] = False,
    libtorch: Annotated[bool, typer.Option("--libtorch", help=(
        "CUDA: build the library bound to libtorch (cuBLAS, cuDNN and flash-attention kernels); it needs torch where it runs."))] = False,
    share_weights: Annotated[bool, typer.Option("--share-weights/--no-share-weights", help=(
        "Store a weight that several methods hold alike (same FQN, dtype, shape, strides and bytes, as in programs exported "
        "from one module) once; loaded together, the methods upload it once."))] = True,
) -> None:
    """Compile ExportedPrograms into a bundle with AOTInductor."""
    from ..runtime.devices import parse_device

    programs = {"forward": Path(program)} if program is not None else {}
    for name, path in parse.key_values(method, "--method").items():
        programs[name] = Path(path)
    if not programs:
        raise parse.UsageError("give a PROGRAM.pt2 or at least one --method NAME=PROGRAM.pt2")
    if standalone and libtorch:
        raise parse.UsageError("--standalone and --libtorch ask for opposite builds; give one")
    if quick and autotune:
        raise parse.UsageError("--quick and --autotune ask for opposite amounts of tuning; give one")
    metadata = parse.key_values(meta, "--meta")
    parse_device(device)
    samples = {}
    for item in sample_inputs:
        name, sep, path = item.rpartition("=")
        name = name if sep else "forward"
        if name not in programs:
            raise parse.UsageError(f"--sample-inputs {item!r}: there is no method {name!r} to attach samples to")
        if not path.endswith(".npz"):
            raise parse.UsageError(f"--sample-inputs {item!r}: samples are an .npz archive keyed by input names")
        samples[name] = Path(path)
    from ..compile import check_programs
    from ..compile.isolated import compile_in_process_group
    from ..io.npy import load_archive

    _quiet_warnings()
    arrays = {name: load_archive(path) for name, path in samples.items()}
    _check_sign_key(sign_key)
    check_programs(programs, output, device)  # before a process is started and torch imported

    def report(kind: str, text: str) -> None:
        (_warn if kind == "warning" else _progress)(text)

    # In a process group of its own, so that a signal ends the C++ compilers too (compile/isolated.py).
    with _native_stderr():
        methods = compile_in_process_group(report, programs=programs, output=output, device=device, metadata=metadata, sample_inputs=arrays,
                                           options=parse.option_values(option, autotune, quick), call_helper=call_helper, cpu_target=cpu_target,
                                           runtime="standalone" if standalone else "libtorch" if libtorch else "auto", share_weights=share_weights)
    signed = _sign(output, sign_key)
    if not _State.quiet:
        _out().line(printable(f"wrote {output}: {', '.join(methods)} for {device}{signed}"))


@app.command("sign")
@handles_errors
def sign_command(
    bundle: Annotated[str, typer.Argument(metavar="BUNDLE", help="The bundle to sign.")],
    key: Annotated[str, typer.Option("--key", metavar="PRIVATE.pem", help="An elliptic-curve private key (P-256, P-384 or P-521), PEM.")],
    whole_file: Annotated[bool, typer.Option("--whole-file", help=(
        "One SHA-256 over the whole file, as `model_signing verify key` checks it; slower to verify than the default shards."))] = False,
) -> None:
    """Write a detached signature BUNDLE.sig in the OpenSSF model-signing format (docs/provenance.md)."""
    from ..format.bundle import open_bundle
    from ..format.signing import DEFAULT_SHARD_SIZE, sign_file

    open_bundle(bundle).close()  # only bundles get signed
    path = sign_file(bundle, key, shard_size=None if whole_file else DEFAULT_SHARD_SIZE)
    if not _State.quiet:
        _out().line(printable(f"wrote {path}"))


@app.command("convert")
@handles_errors
def convert_command(
    program: Annotated[str, typer.Argument(metavar="PROGRAM.pte", help="An ExecuTorch CUDA program.")],
    data: DataOption = None,
    output: Annotated[str, typer.Option("--output", "-o", metavar="BUNDLE", help="The bundle to write.")] = "model.bundle",
    sign_key: SignKeyOption = None,
    call_helper: CallHelperOption = True,
) -> None:
    """Turn an ExecuTorch CUDA program (.pte + .ptd) into a bundle that runs exactly like it, every byte digested."""
    from ..errors import BundleError
    from ..format.program import ProgramReader, convert_program
    from ..format.source import is_program

    if not is_program(program):
        from ..files import require_regular

        require_regular(program, "an ExecuTorch program", not_regular=BundleError)  # says why it cannot be read, if so
        raise BundleError(f"{program} is not an ExecuTorch program")
    _check_sign_key(sign_key)
    helper = _built_call_helper() if call_helper else None
    with ProgramReader(program, data) as reader:
        convert_program(reader, output, helper)
        methods = ", ".join(reader.manifest.methods)
    signed = _sign(output, sign_key)
    if not _State.quiet:
        _out().line(printable(f"wrote {output}: {methods}{signed}"))


@app.command("inspect")
@handles_errors
def inspect_command(
    bundle: Annotated[str, typer.Argument(metavar="BUNDLE", help="The bundle, or an ExecuTorch program (.pte), to describe.")],
    data: DataOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (docs/json.md).")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-check every digest, and run each method once with the library's own input checks.")] = False,
    trusted_key: TrustedKeyOption = [],  # noqa: B006
    require_signature: RequireSignatureOption = False,
) -> None:
    """Show a bundle's methods, signatures, build info and whether this machine can run it."""
    from ..commands.inspection import inspect_bundle
    from .render import inspect_lines

    keys = _load_options(trusted_key, require_signature).trusted_keys
    with _native_stderr():
        result = inspect_bundle(bundle, verify=verify, trusted_keys=keys, data=data)
    if json_output:
        _print_document(result.to_json())
    else:
        _out().lines(inspect_lines(result))
    if result.signature is not None and result.signature.error is not None:
        _report(result.signature.error, int(ExitCode.BAD_BUNDLE), "BundleError")
    if verify and not result.verified:
        bad = [name for name, ok in (result.segment_digests_ok or {}).items() if not ok]
        failed = [f"{name}: {report.library_check}" for name, report in result.methods.items() if (report.library_check or "").startswith("failed")]
        detail = f"digest mismatch in segment(s): {', '.join(bad)}" if bad else "; ".join(failed)
        _report(f"verification failed: {detail}", int(ExitCode.BAD_BUNDLE), "BundleError")


# Options shared by run and bench.
BundleArgument = Annotated[str, typer.Argument(metavar="BUNDLE", help="The bundle, or an ExecuTorch program (.pte).")]
InputsOption = Annotated[list[str], typer.Option(
    "--inputs", "-i", metavar="INPUT", help="PATH.npy by position, NAME=PATH.npy, @PATH.npy, PATH.npz, or NAME=VALUE inline (repeatable).")]
MethodOption = Annotated[Optional[str], typer.Option(metavar="NAME", help="Method to run (default: the only one, or 'forward').")]
DeviceOption = Annotated[Optional[str], typer.Option("--device", metavar="DEVICE", help="cpu, cuda or cuda:N (default: the bundle's device).")]
RandomOption = Annotated[bool, typer.Option("--random-inputs", help="Generate inputs from the declared signature.")]
SeedOption = Annotated[int, typer.Option(min=0, metavar="INT", help="Seed for --random-inputs.")]
ShapeOption = Annotated[list[str], typer.Option("--shape", metavar="INPUT=DIMS", help="Sizes of an input for --random-inputs, e.g. x=4x128 (repeatable).")]
RangeOption = Annotated[list[str], typer.Option(
    "--range", metavar="INPUT=LO:HI", help="Value range for --random-inputs (default -1:1 for floats, 0:2 for integers).")]
SkipDigestOption = Annotated[bool, typer.Option("--skip-weights-digest", help="Do not re-check the weights digest (the library is always checked).")]
CudaGraphOption = Annotated[bool, typer.Option("--cuda-graph", help=(
    "Replay the method from CUDA graphs: one captured per input shape after its first calls (up to 8 shapes), state "
    "kept between replays (imports torch for libraries on libtorch)."))]
TrustedKeyOption = Annotated[list[str], typer.Option("--trusted-key", metavar="PUBLIC.pem", help=(
    "Refuse the bundle unless BUNDLE.sig was made by this key (repeatable; CUDA_RUNNER_TRUSTED_KEYS adds more)."))]
RequireSignatureOption = Annotated[bool, typer.Option("--require-signature", help="Fail if no trusted key is configured at all.")]
ProviderOption = Annotated[Optional[str], typer.Option("--provider", metavar="auto|shim|libtorch", help=(
    "Whose shim functions the model library runs on: auto (cuda-runner's own where it serves the library and no libtorch "
    "kernel is wanted), shim (no libtorch in the process), libtorch (default: CUDA_RUNNER_PROVIDER, else auto)."))]


def _start_context_early(bundle: str, device: str | None) -> None:
    """A cold run spends as long making the CUDA context as importing what it
    runs with (NumPy above all): start the context first, so the two overlap."""
    from ..runtime.context import start_context_for

    start_context_for(bundle, device)


def _load_options(trusted_key: list[str], require_signature: bool, **fields: Any) -> Any:
    """The LoadOptions of a command: its fields, and the trusted keys read from their files."""
    from ..format.signing import keys_for_loading
    from ..runtime.options import LoadOptions

    return LoadOptions(trusted_keys=tuple(keys_for_loading(trusted_key, require_signature)), **fields)


def _input_plan(inputs: list[str], random_inputs: bool, seed: int, shape: list[str], value_range: list[str], cast: bool = False) -> Any:
    from ..io.inputs import GivenInputs, RandomInputs

    parse.exclusive(inputs=inputs, random_inputs=random_inputs)
    if not random_inputs and (shape or value_range):
        raise parse.UsageError("--shape and --range apply to --random-inputs")
    if random_inputs:
        return RandomInputs(seed, parse.shapes(shape), parse.ranges(value_range))
    return GivenInputs(tuple(parse.input_entry(text) for text in inputs), cast)


@app.command("run")
@handles_errors
def run_command(
    bundle: BundleArgument,
    data: DataOption = None,
    inputs: InputsOption = [],  # noqa: B006
    method: MethodOption = None,
    device: DeviceOption = None,
    out_dir: Annotated[Optional[str], typer.Option("--out-dir", metavar="DIR", help="Write one <output>.npy per output here.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", metavar="FILE.npz", help="Write all outputs into one .npz archive.")] = None,
    bf16_as: Annotated[Optional[str], typer.Option(
        "--bf16-as", metavar="DTYPE", help="Write bfloat16 outputs as float32 (for readers without ml_dtypes).")] = None,
    random_inputs: RandomOption = False,
    seed: SeedOption = 0,
    shape: ShapeOption = [],  # noqa: B006
    value_range: RangeOption = [],  # noqa: B006
    save_inputs: Annotated[Optional[str], typer.Option("--save-inputs", metavar="DIR", help="Save the inputs used as DIR/inputs.npz, to replay a run.")] = None,
    cast: Annotated[bool, typer.Option("--cast", help=(
        "Convert inputs to the declared dtype where every value is kept (float64 to float32 rounds; a value the dtype cannot hold is refused)."))] = False,
    print_stats: Annotated[bool, typer.Option("--print", help="Show each output's values (summarised) and min/max/mean and NaN/Inf counts.")] = False,
    print_full: Annotated[bool, typer.Option("--print-full", help="Like --print, with every value.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (docs/json.md).")] = False,
    skip_weights_digest: SkipDigestOption = False,
    expected: Annotated[Optional[str], typer.Option(
        "--expected", metavar="PATH", help="Reference outputs: an .npz keyed by output name, or a directory of <output>.npy.")] = None,
    atol: Annotated[list[str], typer.Option("--atol", metavar="[OUTPUT=]NUMBER", help=(
        "Absolute tolerance, for every output or one (default by dtype: float32 1e-4, float16 1e-2, bfloat16 2e-2, "
        "float64 1e-7; integers and bool exact)."))] = [],  # noqa: B006
    rtol: Annotated[list[str], typer.Option("--rtol", metavar="[OUTPUT=]NUMBER", help=(
        "Relative tolerance, like --atol. An element passes when |actual-expected| <= atol + rtol*|expected|."))] = [],  # noqa: B006
    exact: Annotated[bool, typer.Option("--exact", help="Require exact equality for every output.")] = False,
    allow_missing: Annotated[bool, typer.Option("--allow-missing", help="Outputs with no reference value are skipped instead of failing.")] = False,
    self_test: Annotated[bool, typer.Option("--self-test", help="Run the sample inputs stored in the bundle and compare with their stored eager outputs.")] = False,
    check_inputs: Annotated[bool, typer.Option("--check-inputs", help="Also run the library's own input checks (on with --self-test).")] = False,
    cuda_graph: CudaGraphOption = False,
    trusted_key: TrustedKeyOption = [],  # noqa: B006
    require_signature: RequireSignatureOption = False,
    provider: ProviderOption = None,
    batch: Annotated[Optional[str], typer.Option("--batch", metavar="DIR", help=(
        "Run every input set in DIR (NAME.npz files, or NAME/ folders of INPUT.npy) into --out-dir OUT/NAME/."))] = None,
    out_format: Annotated[str, typer.Option("--out-format", metavar="npy|npz", help="With --batch: OUT/NAME/<output>.npy, or OUT/NAME.npz.")] = "npy",
    expected_dir: Annotated[Optional[str], typer.Option("--expected-dir", metavar="REF", help=(
        "With --batch: compare each set with REF/NAME.npz or REF/NAME/.")) ] = None,
    resume: Annotated[bool, typer.Option("--resume", help=(
        "With --batch: skip sets already written whole by a run (their hidden set record matches their files)."))] = False,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="With --batch: stop at the first set that fails.")] = False,
    lanes: Annotated[int, typer.Option(min=1, metavar="INT", help="With --batch: how many sets run at once (per device).")] = 2,
    devices: Annotated[Optional[str], typer.Option("--devices", metavar="all|0,1", help="With --batch: spread the sets over these GPUs.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, metavar="N", help=(
        "With --batch: stack up to N sets into one call along the method's dynamic batch dim."))] = 1,
) -> None:
    """Run a method of a bundle on inputs, write its outputs, and optionally compare them with a reference (exit 1 if they differ)."""
    if devices is None:
        _start_context_early(bundle, device)
    from ..commands.running import RunRequest, run_bundle
    from ..io.inputs import StoredSamples
    from ..io.outputs import OutputPlan

    load = _load_options(trusted_key, require_signature, verify_weights=not skip_weights_digest, cuda_graph=cuda_graph,
                         check_inputs=check_inputs or self_test, provider=provider, **({"lanes": lanes} if batch is not None else {}))
    if batch is not None:
        parse.exclusive(batch=True, inputs=inputs, random_inputs=random_inputs, self_test=self_test, out=out, expected=expected,
                        save_inputs=save_inputs)
        if out_dir is None:
            raise parse.UsageError("--batch needs --out-dir")
        _run_batch(bundle, batch, out_dir, out_format, method, device, devices, expected_dir, parse.tolerances(atol, rtol, exact),
                   allow_missing, resume, fail_fast, load, json_output, data, batch_size)
        return
    for value, option in ((expected_dir, "--expected-dir"), (resume, "--resume"), (fail_fast, "--fail-fast"), (devices, "--devices"),
                          (batch_size > 1, "--batch-size")):
        if value:
            raise parse.UsageError(f"{option} applies to --batch")
    if self_test:
        parse.exclusive(self_test=True, inputs=inputs, random_inputs=random_inputs, expected=expected)
        plan: Any = StoredSamples()
    else:
        plan = _input_plan(inputs, random_inputs, seed, shape, value_range, cast)
    if bf16_as not in (None, "float32"):
        raise parse.UsageError(f"--bf16-as {bf16_as!r}: only float32 is supported")
    request = RunRequest(
        bundle=Path(bundle), inputs=plan, data=_path(data), method=method, device=device,
        outputs=OutputPlan(_path(out_dir), _path(out), bf16_as), save_inputs=_path(save_inputs), expected=_path(expected),
        tolerances=parse.tolerances(atol, rtol, exact), allow_missing=allow_missing, load=load,
    )
    _quiet_warnings()
    with _native_stderr(), _progress_bar(None) as bars:
        result = run_bundle(request, progress=_progress, load_progress=bars.load)
    from .render import comparison_lines, run_lines

    if json_output:
        _print_document(result.to_json())
    else:
        if not _State.quiet:
            show = print_stats or print_full
            _out().lines(run_lines(result, show_stats=show, show_values=show, full_values=print_full))
        if result.comparison is not None:
            for line, style in comparison_lines(result.comparison):
                _out().line(line, style)
    _verdict(result.verdict, json_output)
    if result.verdict != "PASSED":
        raise typer.Exit(int(ExitCode.VERIFICATION_FAILED))


@app.command("bench")
@handles_errors
def bench_command(
    bundle: BundleArgument,
    data: DataOption = None,
    inputs: InputsOption = [],  # noqa: B006  (none: --random-inputs)
    method: MethodOption = None,
    device: DeviceOption = None,
    random_inputs: RandomOption = False,
    seed: SeedOption = 0,
    shape: ShapeOption = [],  # noqa: B006
    value_range: RangeOption = [],  # noqa: B006
    warmup: Annotated[int, typer.Option(min=0, metavar="INT", help="Untimed runs before measuring.")] = 10,
    iterations: Annotated[int, typer.Option(min=1, metavar="INT", help="Timed runs.")] = 100,
    duration: Annotated[Optional[float], typer.Option(metavar="SECONDS", help="Measure for this long instead of --iterations.")] = None,
    max_p50_ms: Annotated[Optional[float], typer.Option("--max-p50-ms", metavar="MS", help="Gate: exit 5 if the median run is slower.")] = None,
    max_p99_ms: Annotated[Optional[float], typer.Option("--max-p99-ms", metavar="MS", help="Gate: exit 5 if the 99th percentile is slower.")] = None,
    min_throughput: Annotated[Optional[float], typer.Option("--min-throughput", metavar="RUNS/S", help="Gate: exit 5 below this throughput.")] = None,
    max_load_s: Annotated[Optional[float], typer.Option("--max-load-s", metavar="SECONDS", help="Gate: exit 5 if loading takes longer.")] = None,
    skip_weights_digest: SkipDigestOption = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (docs/json.md).")] = False,
    cuda_graph: CudaGraphOption = False,
    trusted_key: TrustedKeyOption = [],  # noqa: B006
    require_signature: RequireSignatureOption = False,
    provider: ProviderOption = None,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, metavar="N", help=(
        "A stateful decode loop: N timed calls of the method, its position input advanced by one each call and its state "
        "(a KV cache) kept; reports per-step latency and tokens/s."))] = None,
    prefill: Annotated[Optional[str], typer.Option("--prefill", metavar="METHOD", help=(
        "With --steps: run METHOD once first on a prompt of --prompt-length tokens (its position input counting from 0)."))] = None,
    prompt_length: Annotated[int, typer.Option("--prompt-length", min=1, metavar="T", help="With --prefill: the prompt's length.")] = 32,
    position: Annotated[Optional[str], typer.Option("--position", metavar="NAME", help=(
        "With --steps: the input advanced each step (default: the one integer input of one element named like a position)."))] = None,
) -> None:
    """Measure load time, first run and steady-state latency, split into copies and compute (random inputs unless --inputs);
    with --steps, a stateful decode loop."""
    from ..commands.bench import BenchRequest, DecodeLoop, Gates, benchmark

    parse.positive(duration, "--duration")
    for value, option in ((max_p50_ms, "--max-p50-ms"), (max_p99_ms, "--max-p99-ms"), (min_throughput, "--min-throughput"), (max_load_s, "--max-load-s")):
        parse.positive(value, option)
    if steps is None and (prefill is not None or position is not None):
        raise parse.UsageError("--prefill and --position belong to a decode loop: give --steps N")
    if steps is not None and duration is not None:
        raise parse.UsageError("--steps and --duration both say how long to measure; give one")
    plan = _input_plan(inputs, random_inputs or not inputs, seed, shape, value_range)
    load = _load_options(trusted_key, require_signature, verify_weights=not skip_weights_digest, cuda_graph=cuda_graph, provider=provider)
    request = BenchRequest(
        bundle=Path(bundle), inputs=plan, data=_path(data), method=method, device=device, load=load,
        warmup_runs=warmup, iterations=iterations, duration=duration, gates=Gates(max_p50_ms, max_p99_ms, min_throughput, max_load_s),
        decode=None if steps is None else DecodeLoop(steps, prefill, prompt_length, position),
    )
    _quiet_warnings()
    with _native_stderr(), _progress_bar("measuring") as bars:
        result = benchmark(request, progress=bars.advance, load_progress=bars.load)
    from .render import bench_lines

    if json_output:
        _print_document(result.to_json())
    else:
        _out().lines(bench_lines(result))
    for warning in result.warnings:
        _err().line(printable(f"warning: {warning}"), style="yellow")
    missed = [gate for gate in result.gates if not gate.passed]
    if missed:
        _err().line("error: performance gate missed: " + "; ".join(gate.describe() for gate in missed), style="red")
    _verdict(result.verdict, json_output)
    if missed:
        raise typer.Exit(int(ExitCode.PERFORMANCE))


def _progress_bar(label: str | None) -> Any:
    """Progress on a terminal (the command's task, a slow load's weights); does nothing elsewhere."""
    from .progress import TerminalProgress

    if _State.quiet or not _Terminal.stderr().isatty():
        return contextlib.nullcontext(_NoProgress())
    return TerminalProgress(_Terminal.stderr(), label)


class _NoProgress:
    def advance(self, done: int, total: int) -> None:
        pass

    def load(self, method: str, done: int, total: int) -> None:
        pass


@app.command("devices")
@handles_errors
def devices_command(
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document (docs/json.md).")] = False,
) -> None:
    """Show the CPU and GPUs of this machine, the CUDA driver and runtime, and the libtorch found."""
    from ..runtime.devices import describe_devices
    from .render import devices_lines

    result = describe_devices()
    if json_output:
        _print_document(result.to_json())
    else:
        _out().lines(devices_lines(result))


# ---------------------------------------------------------------------------
# The process


_GLOBAL_FLAGS = frozenset({"-v", "--verbose", "-q", "--quiet"})


def _hoist_global_flags(argv: list[str]) -> list[str]:
    """Let -v/-q go anywhere on the line, as users of other runners expect."""
    end = argv.index("--") if "--" in argv else len(argv)
    flags = [arg for arg in argv[:end] if arg in _GLOBAL_FLAGS]
    rest = [arg for arg in argv[:end] if arg not in _GLOBAL_FLAGS]
    return flags + rest + argv[end:]


def _raise_interrupted(signal_number: int, _frame: object) -> None:
    raise Interrupted(signal_number)


def _install_signal_handlers() -> None:
    # SIGTERM and SIGHUP unwind like SIGINT: every `finally` runs, temp files go.
    for signal_number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(signal_number, _raise_interrupted)


def _quiet_exit(code: int) -> None:
    """Leave without Python complaining about a closed stdout or stderr."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
    os._exit(code)


class _StreamGone(BaseException):
    """stdout or stderr cannot be written: the reader went away (EPIPE) or the
    device failed (ENOSPC on /dev/full). A BaseException, so that click, which
    turns an EPIPE into exit 1, never sees it; run() gives it its own code."""

    def __init__(self, error: OSError, name: str):
        super().__init__(str(error))
        self.error = error
        self.name = name


class _GuardedStream:
    """A text stream whose write errors become _StreamGone. `closed`: the
    descriptor was closed when the process started (`>&-`); it now holds
    /dev/null, and a write fails as a write to the closed descriptor would."""

    def __init__(self, stream: Any, name: str, closed: bool = False):
        self._stream = stream
        self._name = name
        self._closed = closed

    def write(self, text: str) -> int:
        if self._closed:
            raise _StreamGone(OSError(errno.EBADF, os.strerror(errno.EBADF)), self._name)
        try:
            return int(self._stream.write(text))
        except OSError as error:
            raise _StreamGone(error, self._name) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise _StreamGone(error, self._name) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _standard_streams() -> None:
    """Give closed standard descriptors /dev/null, so that no file the command
    opens (an output, say) becomes fd 1 or 2 and receives its messages, and
    guard stdout and stderr (see _StreamGone). Output for a closed stdout
    fails (exit 4, as for /dev/full: what the command printed went nowhere);
    messages for a closed stderr are dropped, as its closer asked."""
    closed = set()
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  (the process's own stdout)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.stdout = _GuardedStream(sys.stdout, "standard output", closed=1 in closed)
    sys.stderr = _GuardedStream(sys.stderr, "standard error")


def _stream_gone(gone: _StreamGone) -> int:
    """A closed pipe is the reader's choice (exit 141, silently); any other
    failure to write stdout is this command's failure (exit 4), said on stderr."""
    if gone.error.errno == errno.EPIPE:
        return 128 + signal.SIGPIPE
    if gone.name == "standard output":
        with contextlib.suppress(BaseException):
            _err().line(f"error: cannot write to {gone.name}: {gone.error.strerror or gone.error}")
    return int(ExitCode.RUNTIME)


def _command_of(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


# File descriptors a command may need at once: the Python runtime, the model
# file and its memfd copies, the CUDA driver's devices, and in a batch a few
# per worker thread (an input archive, a temp output, a folder lock).
MIN_OPEN_FILES = 64


def _file_limit_short() -> str | None:
    """Why this process cannot open the files a command needs, or None. A soft
    limit below MIN_OPEN_FILES is first raised as far as the hard limit allows
    (any process may), so that only a hard limit that low is refused, before
    anything runs instead of at whichever file happens to be the last."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
            wanted = MIN_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MIN_OPEN_FILES)
            if wanted > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                soft = wanted
    except (OSError, ValueError):
        return None  # not ours to judge
    if soft >= MIN_OPEN_FILES:
        return None
    return f"this process may open only {soft} files, fewer than the {MIN_OPEN_FILES} cuda-runner needs (raise the limit: ulimit -n {MIN_OPEN_FILES})"


def run(argv: list[str]) -> int:
    """Run the command line; returns the exit code (tests call this in-process)."""
    _State.verbose = _State.quiet = _State.printed_document = False
    argv = _hoist_global_flags(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    _State.json = "--json" in argv[:end]
    _State.command = _command_of(argv[:end])
    _State.batch = any(arg == "--batch" or arg.startswith("--batch=") for arg in argv[:end])
    try:
        short = _file_limit_short()
        if short is not None:
            return _fail(short, int(ExitCode.RUNTIME), "DeviceError")
        try:
            result = app(args=argv, prog_name="cuda-runner", standalone_mode=False)
            return int(result) if isinstance(result, int) else 0
        except typer.Exit as stop:
            return int(stop.exit_code)
        except _ClickUsageError as error:
            message = error.format_message().replace("\n", " ")  # type: ignore[attr-defined]
            return _fail(message, int(ExitCode.USAGE), "UsageError")
        except (typer.Abort, KeyboardInterrupt):
            return _fail("interrupted", 128 + signal.SIGINT, "Interrupted")
        except Interrupted as stop:
            return _fail(f"interrupted by {signal.Signals(stop.signal_number).name}", 128 + stop.signal_number, "Interrupted")
        except _StreamGone:
            raise
        except Exception as error:  # a bug: still one line, and a way to report it
            if too_many_open_files(error):
                return _fail(TOO_MANY_FILES, int(ExitCode.RUNTIME), "DeviceError")
            message = f"internal error: {type(error).__name__}: {error}; please report it with the output of -v"
            return _fail(message, int(ExitCode.RUNTIME), "InternalError")
    except _StreamGone as gone:
        return _stream_gone(gone)


def main() -> None:
    _standard_streams()
    _install_signal_handlers()
    try:
        code = run(sys.argv[1:])
        sys.stdout.flush()
        sys.stderr.flush()
    except _StreamGone as gone:
        code = _stream_gone(gone)
    if code in (128 + signal.SIGPIPE, int(ExitCode.RUNTIME)) or _fast_exit_allowed():
        # Everything the command wrote is on disk (files.py syncs before it
        # renames) and flushed; what is left is tearing down the interpreter,
        # libtorch's static objects and the CUDA context: 0.3 s of a 1 s cold
        # run on the CI machine, which the operating system does at once.
        # (After a failed stdout, the interpreter's own final flush would fail again.)
        _quiet_exit(code)
    sys.exit(code)


def _fast_exit_allowed() -> bool:
    """Not under a tracer or coverage (they write their data at exit), nor when asked not to."""
    return sys.gettrace() is None and "coverage" not in sys.modules and not os.environ.get("CUDA_RUNNER_FULL_EXIT")


if __name__ == "__main__":
    main()
