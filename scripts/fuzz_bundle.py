"""Fuzz the bundle and ExecuTorch program readers through the CLI: mutate a valid file N times and count outcomes.

Each case runs `cuda-runner run BUNDLE --random-inputs` (which must verify the
bundle before loading its library) in a forked child of a process that has
already imported the CLI and loaded libtorch, so a case costs milliseconds
and a crash or hang is seen as a signal or a timeout of that child alone.

    python scripts/fuzz_bundle.py --cases 10000 [--bundle model.bundle] [--json out.json]
    python scripts/fuzz_bundle.py --program model.pte [--target ptd] --cases 3000

For a program (`--program`, a CPU one that runs here; its data file next to
it), only the keys that are SHA-256s protect bytes, so an unchanged exit 0 is
possible (padding, unused flatbuffer bytes, unhashed weights); crashes, hangs
and tracebacks are what must not happen.

Outcomes: exit 3 (refused as a bad bundle) is the only right answer for a
changed file. Anything else is reported: exit 0 on a changed file is an
accepted tampering; a signal is a crash; a timeout is a hang.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

BUNDLE_FIELDS = [(8, 2), (10, 2), (12, 4), (16, 8), (24, 8), (32, 8), (40, 4), (44, 4), (48, 16)]
PROGRAM_FIELDS = [(0, 4), (4, 4), (8, 4), (12, 4), (16, 8), (24, 8), (32, 8), (40, 8)]  # root, identifier, eh00/FH01 fields


def mutate(data: bytes, rng: random.Random, program: bool = False) -> bytes:
    """One random damage: bit flips, byte rewrites, truncation, extension, header rewrites, splices."""
    buffer = bytearray(data)
    # The part every reader parses first: the header and manifest, or the flatbuffer.
    manifest_end = min(len(data), 4096) if program else 64 + struct.unpack_from("<Q", data, 24)[0]
    fields = PROGRAM_FIELDS if program else BUNDLE_FIELDS
    kind = rng.choice(["flip", "flip_head", "byte", "truncate", "extend", "header_field", "zero_run", "splice", "shift"])
    if kind == "flip":
        offset = rng.randrange(len(buffer))
        buffer[offset] ^= 1 << rng.randrange(8)
    elif kind == "flip_head":
        offset = rng.randrange(manifest_end)
        buffer[offset] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        for _ in range(rng.randint(1, 8)):
            buffer[rng.randrange(len(buffer))] = rng.randrange(256)
    elif kind == "truncate":
        del buffer[rng.randrange(len(buffer)):]
    elif kind == "extend":
        buffer.extend(rng.randbytes(rng.randint(1, 5000)))
    elif kind == "header_field":
        offset, width = rng.choice(fields)
        buffer[offset:offset + width] = rng.randbytes(width)
    elif kind == "zero_run":
        start = rng.randrange(len(buffer))
        length = rng.randint(1, 4096)
        buffer[start:start + length] = bytes(len(buffer[start:start + length]))
    elif kind == "splice":
        start, other = rng.randrange(len(buffer)), rng.randrange(len(buffer))
        length = rng.randint(1, 256)
        chunk = bytes(buffer[other:other + length])
        buffer[start:start + len(chunk)] = chunk
    else:  # shift: insert bytes in the middle
        position = rng.randrange(len(buffer))
        buffer[position:position] = rng.randbytes(rng.randint(1, 64))
    return bytes(buffer)


def run_case(path: Path, timeout: float) -> str:
    """Fork, run the CLI in the child, classify the child's end."""
    pid = os.fork()
    if pid == 0:  # child
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        from cuda_runner.cli.main import main

        sys.argv = ["cuda-runner", "run", str(path), "--random-inputs"]
        try:
            main()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            code = 99  # an exception escaped the CLI's handler: a traceback
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
            return f"exit {os.WEXITSTATUS(status)}"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.0005)


def seed_bundle(work: Path) -> Path:
    import torch

    import cuda_runner

    # A small model with a dynamic batch, a dict output and stored samples:
    # every part of the format is present to be damaged.
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    batch = torch.export.Dim("batch", min=1, max=64)
    path = work / "seed.bundle"
    cuda_runner.compile_module(module, (torch.randn(4, 16),), path, device="cpu", dynamic_shapes={"input": {0: batch}},
                               sample_inputs={"input": torch.randn(2, 16).numpy()})
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--bundle", type=Path, help="a valid CPU bundle to mutate (default: compile the example model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds before a case counts as a hang")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--program", type=Path, help="fuzz this ExecuTorch program (.pte, its .ptd beside it) instead of a bundle")
    parser.add_argument("--target", choices=["pte", "ptd"], default="pte", help="with --program: which of its two files to damage")
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cuda-runner-fuzz-"))
    if options.program is not None:
        import shutil

        for path in options.program.parent.glob("*.pt[ed]"):
            shutil.copy(path, work / ("case.pte" if path.suffix == ".pte" else path.name))
        bundle = work / "case.pte"
        damaged = bundle if options.target == "pte" else next(work.glob("*.ptd"))
    else:
        bundle = options.bundle or seed_bundle(work)
        damaged = work / "case.bundle"
    original = (bundle if options.program is None else damaged).read_bytes()
    # Import and load everything once here; every forked case inherits it.
    import cuda_runner.cli.main
    import cuda_runner.cli.render
    import cuda_runner.commands.running  # noqa: F401
    from cuda_runner.runtime.shim import load_shim

    load_shim("cpu")
    baseline = run_case(bundle, options.timeout)
    if baseline != "exit 0":
        print(f"the unmutated bundle does not run: {baseline}", file=sys.stderr)
        return 2
    rng = random.Random(options.seed)
    outcomes: collections.Counter[str] = collections.Counter()
    accepted = []
    odd: list[tuple[int, str]] = []  # (case, outcome) for anything but a refusal or a run
    case_path = damaged
    started = time.perf_counter()
    for index in range(options.cases):
        data = mutate(original, rng, program=options.program is not None)
        if data == original:
            outcomes["unchanged (skipped)"] += 1
            continue
        case_path.write_bytes(data)
        outcome = run_case(bundle if options.program is not None else case_path, options.timeout)
        outcomes[outcome] += 1
        if outcome == "exit 0":
            accepted.append(index)
        elif outcome not in ("exit 3",):
            odd.append((index, outcome))
    elapsed = time.perf_counter() - started
    crashes = sum(count for outcome, count in outcomes.items() if outcome.startswith("signal"))
    allowed = ("exit 3", "unchanged (skipped)") + (("exit 0",) if options.program is not None else ())
    unexpected = {outcome: count for outcome, count in outcomes.items() if outcome not in allowed}
    report = {
        "cases": options.cases,
        "seconds": round(elapsed, 1),
        "outcomes": dict(outcomes),
        "crashes": crashes,
        "hangs": outcomes.get("timeout", 0),
        "tracebacks": outcomes.get("exit 99", 0),
        "accepted_tamperings": len(accepted),
        "unexpected_outcomes": unexpected,
        "odd_cases": odd[:50],
        "file": "bundle" if options.program is None else f"program {options.target}",
        "bytes": len(original),
    }
    print(json.dumps(report, indent=2))
    if options.json:
        options.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
