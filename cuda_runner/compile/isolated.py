"""`cuda-runner compile` in a child process that leads a process group of its own.

AOTInductor runs the C++ compiler as subprocesses (g++, which runs cc1plus
and as), and they write temp files (`ccXXXXXX.s`) into TMPDIR. A signal to
cuda-runner alone unwound Python, which killed the g++ it was waiting on, but
not g++'s own children: cc1plus ran on, orphaned, and the killed g++ never
removed its temp files. So the command line runs the compile here:

- in a child process that starts a session, and so a process group, of its
  own (the compilers it runs join that group); the parent takes the signals
  (Ctrl-C reaches only the terminal's foreground group) and forwards them to
  the whole group;
- with TMPDIR pointed at a private folder for the processes it starts (the
  compilers' temp files go there), removed once the group is gone. Python's
  own temp files stay where the user has them (each is removed as the work
  unwinds), and so do torch's caches: Inductor keeps its cache and
  precompiled headers in TMPDIR by default, and losing them would make
  every compile rebuild them;
- and whatever way the compile ends, every process still in the group is
  ended: SIGTERM, then SIGKILL after a grace period (at once on a second
  signal), and waited for.

The child is a fresh interpreter (not a fork: the parent may hold threads,
OpenMP pools or a CUDA context that a fork would break), given the parent's
`sys.path`, so it imports the same cuda-runner. The work and its arguments
are pickled to its stdin; progress, warnings and the result or the error
come back over a pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import CompileError, CudaRunnerError, Interrupted

# (kind, text) from the child: kind "progress" or "warning".
Report = Callable[[str, str], None]

GRACE_S = 10.0  # for the child to unwind after a signal, before SIGKILL
LEFTOVER_GRACE_S = 2.0  # for processes still in the group once the child is gone
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1

_CHILD_CODE = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from cuda_runner.compile.isolated import _child\n"
    "_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])\n"
)


def run_in_process_group(function: Callable[..., Any], kwargs: Mapping[str, Any], report: Report) -> Any:
    """`function(report, **kwargs)` in a child process leading its own process
    group, whose subprocesses get a private TMPDIR; returns its result or raises its error.
    `function` is pickled by name: a module-level function."""
    request = pickle.dumps((function, dict(kwargs)))
    private_tmp = tempfile.mkdtemp(prefix="cuda-runner-tmp-")
    process: subprocess.Popen[bytes] | None = None
    try:
        read_fd, write_fd = os.pipe()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, json.dumps(sys.path), str(write_fd), str(os.getpid()), private_tmp],
                stdin=subprocess.PIPE, stdout=2,  # what the compile prints is not the command's output
                pass_fds=(write_fd,), start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        try:
            outcome = _exchange(process, request, read_fd, report)
        except BaseException as error:
            _stop(process, error.signal_number if isinstance(error, Interrupted) else signal.SIGINT if isinstance(error, KeyboardInterrupt) else signal.SIGTERM)
            raise
    finally:
        if process is not None:
            _stop(process, signal.SIGTERM)  # leftovers of a child that ended: none, usually
        shutil.rmtree(private_tmp, ignore_errors=True)
    assert process is not None
    if outcome is None:
        raise CompileError(f"the compile process ended without a result ({_how_it_ended(process.returncode)})")
    kind, value = outcome
    if kind == "error":
        raise value
    return value


def _exchange(process: subprocess.Popen[bytes], request: bytes, read_fd: int, report: Report) -> tuple[str, Any] | None:
    """Send the request, relay the child's reports; the child's ("result" or
    "error", value), or None if it ended without one."""
    outcome = None
    with os.fdopen(read_fd, "rb") as messages:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: said by the missing outcome
            process.stdin.write(request)
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
        while len(header := messages.read(8)) == 8:
            kind, value = pickle.loads(messages.read(struct.unpack("<Q", header)[0]))
            if kind in ("result", "error"):
                outcome = (kind, value)
            else:
                report(kind, value)
    process.wait()
    return outcome


def _how_it_ended(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


# ---------------------------------------------------------------------------
# Ending the group


def _stop(process: subprocess.Popen[bytes], first: int) -> None:
    """End the child (`first`, then SIGKILL after GRACE_S) and every process
    left in its group (SIGTERM, then SIGKILL), and wait until none is left."""
    group = process.pid
    with _second_signal_kills(group):
        if process.poll() is None:
            _signal_group(group, first)
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(group, signal.SIGKILL)
                process.wait()
        if _group_alive(group):
            _signal_group(group, signal.SIGTERM)
            if not _wait_group(group, LEFTOVER_GRACE_S):
                _signal_group(group, signal.SIGKILL)
                _wait_group(group, LEFTOVER_GRACE_S)


@contextlib.contextmanager
def _second_signal_kills(group: int) -> Iterator[None]:
    """While the group is being ended, another signal means: no more grace."""
    previous = {}
    try:
        for number in _SIGNALS:
            previous[number] = signal.signal(number, lambda *_: _signal_group(group, signal.SIGKILL))
    except ValueError:  # not the main thread: signals stay as they are
        pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _signal_group(group: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, number)


def _group_alive(group: int) -> bool:
    """Whether a process of the group still runs (zombies, which no one here
    may reap, do not count)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == group and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _wait_group(group: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _group_alive(group):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---------------------------------------------------------------------------
# The child


def _child(message_fd: int, parent: int, private_tmp: str) -> None:
    messages = os.fdopen(message_fd, "wb")
    tempfile.tempdir = tempfile.gettempdir()  # this process's temp files and torch's caches: the user's TMPDIR
    os.environ["TMPDIR"] = private_tmp  # the processes it starts: the private folder

    def send(kind: str, value: Any) -> None:
        data = pickle.dumps((kind, value))
        messages.write(struct.pack("<Q", len(data)) + data)
        messages.flush()

    for number in _SIGNALS:
        signal.signal(number, _child_interrupted)
    with contextlib.suppress(OSError, AttributeError):  # Linux: a parent killed outright ends the compile too
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    try:
        if os.getppid() != parent:
            raise Interrupted(signal.SIGTERM)  # the parent died before the line above
        function, kwargs = pickle.load(sys.stdin.buffer)
        outcome: tuple[str, Any] = ("result", function(send, **kwargs))
    except BaseException as error:  # everything goes back to the parent, which reports it
        if not isinstance(error, (CudaRunnerError, Interrupted)):
            traceback.print_exc()  # reaches the user with -v (stderr is /dev/null otherwise)
        outcome = ("error", _portable(error))
    with contextlib.suppress(BaseException):
        send(*outcome)
        messages.close()
    os._exit(0)


def _child_interrupted(number: int, _frame: object) -> None:
    """A signal, from the parent or sent to this process alone: end the
    compilers of the group too, and unwind."""
    for each in _SIGNALS:
        signal.signal(each, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGTERM)
    raise Interrupted(number)


def _portable(error: BaseException) -> BaseException:
    """The error, if it survives pickling; else one that says what it was."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------
# The compile


def compile_in_process_group(report: Report, *, output: str | os.PathLike[str], **request: Any) -> list[str]:
    """`compile_bundle` in its own process group (see the module docstring);
    returns the names of the methods written. On failure, temp files the
    child left beside `output` (it may have been killed while writing) go."""
    from ..files import remove_stale_temps

    try:
        return run_in_process_group(compile_bundle, {**request, "output": output}, report)
    except BaseException:
        folder = Path(output).parent
        if folder.is_dir():
            remove_stale_temps(folder)
        raise


def compile_bundle(report: Report, *, programs: Mapping[str, Path], output: str | os.PathLike[str], call_helper: bool = True,
                   **options: Any) -> list[str]:
    """What `cuda-runner compile` does, run in the child: build the call helper
    (a warning if it cannot be), compile the programs and write the bundle."""
    from . import compile_programs
    from .helper import build_call_helper

    if call_helper:
        built = build_call_helper()
        if built.library is None:
            report("warning", built.note)
            call_helper = False
    manifest = compile_programs(programs, output, call_helper=call_helper, progress=lambda message: report("progress", message),
                                warn=lambda note: report("warning", note), **options)
    return list(manifest.methods)
