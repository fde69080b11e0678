"""The command line as users and CI scripts call it: exit codes, files, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, run_cli


def _inputs(tmp_path, batch=3):
    x = np.random.default_rng(0).standard_normal((batch, 16), dtype=np.float32)
    bias = np.zeros(8, np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "bias.npy", bias)
    return x, bias


def test_run_writes_one_npy_per_output_matching_eager(dict_mlp_bundle, tmp_path):
    x, bias = _inputs(tmp_path)
    result = cli("run", str(dict_mlp_bundle.path), "--inputs", str(tmp_path / "x.npy"), "--inputs", f"bias={tmp_path / 'bias.npy'}", "--out-dir", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "VERDICT: PASSED"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["aux.hidden.npy", "aux.loss.npy", "logits.npy"]
    expected = dict_mlp_bundle.eager(x, bias)
    np.testing.assert_allclose(np.load(tmp_path / "out" / "logits.npy"), expected["logits"].numpy(), rtol=1e-5, atol=1e-5)


def test_run_json_is_one_document_on_stdout(dict_mlp_bundle, tmp_path):
    _inputs(tmp_path, batch=5)
    result = cli("run", str(dict_mlp_bundle.path), "-i", str(tmp_path / "x.npy"), "-i", str(tmp_path / "bias.npy"), "--json", "--out", str(tmp_path / "all.npz"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == "cuda-runner/run/2"
    assert document["dims"] == {"batch": 5}
    assert [output["name"] for output in document["outputs"]] == ["logits", "aux.loss", "aux.hidden"]
    assert document["outputs"][0]["shape"] == [5, 8]
    assert "VERDICT: PASSED" in result.stderr
    with np.load(tmp_path / "all.npz") as archive:
        assert sorted(archive.files) == ["aux.hidden", "aux.loss", "logits"]


def test_inspect_json_schema_fields(dict_mlp_bundle):
    result = cli("inspect", str(dict_mlp_bundle.path), "--json", "--verify")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    method = document["methods"]["forward"]
    assert method["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}, {"name": "bias", "dtype": "float32", "shape": [8]}]
    assert method["dims"]["batch"] == {"min": 1, "max": 64, "example": 4}
    assert method["outputs"][1] == {"name": "aux.loss", "dtype": "float32", "shape": []}
    assert method["runnable_here"] is True
    assert document["metadata"] == {"fixture": "dict_mlp"}
    assert document["verified"] is True


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["run", "{bundle}", "-i", "{tmp}/x64.npy", "-i", "{tmp}/bias.npy"], 2, "expected dtype float32, got float64"),
        (["run", "{bundle}", "-i", "{tmp}/x.npy"], 2, "missing 'bias'"),
        (["run", "{tmp}/garbage.bundle", "--random-inputs"], 3, "bad magic number"),
        (["run", "{bundle}", "--random-inputs", "--device", "cuda"], 4, "no CUDA device"),
    ],
)
def test_failed_runs_write_nothing(dict_mlp_bundle, tmp_path, args, code, message):
    _inputs(tmp_path)
    np.save(tmp_path / "x64.npy", np.ones((2, 16)))
    (tmp_path / "garbage.bundle").write_bytes(b"not a bundle at all" * 10)
    argv = [arg.format(bundle=dict_mlp_bundle.path, tmp=tmp_path) for arg in args]
    result = cli(*argv, "--out-dir", str(tmp_path / "out")) if argv[0] == "run" else cli(*argv)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # nothing written on failure


def test_verbose_shows_the_traceback(tmp_path):
    (tmp_path / "garbage.bundle").write_bytes(b"x" * 100)
    result = cli("-v", "inspect", str(tmp_path / "garbage.bundle"))
    assert result.returncode == 3
    assert "Traceback" in result.stderr


def test_quiet_and_verbose_work_after_the_command(dict_mlp_bundle):
    result = cli("run", str(dict_mlp_bundle.path), "--random-inputs", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "VERDICT: PASSED"


def test_no_colour_escape_codes_off_a_terminal(dict_mlp_bundle):
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    result = subprocess.run([sys.executable, "-m", "cuda_runner", "inspect", str(dict_mlp_bundle.path)], capture_output=True, text=True, env=env)
    assert result.returncode == 0
    assert "\x1b[" not in result.stdout


def test_compile_reports_an_unreadable_program(tmp_path):
    (tmp_path / "bad.pt2").write_bytes(b"junk")
    result = cli("compile", str(tmp_path / "bad.pt2"), "-o", str(tmp_path / "out.bundle"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out.bundle").exists()


def test_compile_for_cuda_without_a_gpu_is_a_clear_error(tmp_path, monkeypatch):
    """Refused before the compile's child process (which imports torch) is started."""
    import torch

    import cuda_runner.compile.isolated as isolated

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    program = torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.randn(3, 4),))
    torch.export.save(program, tmp_path / "linear.pt2")
    monkeypatch.setattr(isolated, "run_in_process_group", lambda *args: pytest.fail("a child process was started"))
    result = cli("compile", str(tmp_path / "linear.pt2"), "-o", str(tmp_path / "out.bundle"), "--device", "cuda")
    assert result.returncode == 4
    assert result.error_lines == ["error: --device cuda needs a CUDA GPU visible to PyTorch, and none is; compile with --device cpu, or on a GPU machine"]
    assert not (tmp_path / "out.bundle").exists()


def test_json_documents_are_described_in_docs(dict_mlp_bundle, tmp_path):
    from pathlib import Path

    documented = (Path(__file__).resolve().parents[2] / "docs" / "json.md").read_text()
    inspect_doc = json.loads(cli("inspect", str(dict_mlp_bundle.path), "--json").stdout)
    run_doc = json.loads(cli("run", str(dict_mlp_bundle.path), "--self-test", "--json").stdout)
    bench_doc = json.loads(cli("bench", str(dict_mlp_bundle.path), "--iterations", "5", "--warmup", "1", "--json").stdout)
    assert inspect_doc["schema"] in documented and run_doc["schema"] in documented and bench_doc["schema"] in documented
    assert bench_doc["call_path"] == "call helper" and inspect_doc["methods"]["forward"]["call_helper"]["segment"] == "call_helper_so"
    fields = [*inspect_doc, *inspect_doc["methods"]["forward"], *run_doc, *run_doc["comparison"], *run_doc["comparison"]["outputs"][0], *bench_doc, *bench_doc["load_s"]]
    import re

    missing = sorted({field for field in fields if not re.search(rf"(?<!\w){re.escape(field)}(?!\w)", documented)})
    assert missing == [], f"undocumented JSON fields: {missing}"


def test_strings_from_a_bundle_cannot_drive_the_terminal_or_rich_markup(tmp_path):
    from forge import forge, method

    hostile = {"note": "\x1b[2J\x1b]0;pwned\x07[bold red]boom[/bold red]\u202e"}
    (tmp_path / "h.bundle").write_bytes(forge({"methods": {"m": method()}, "metadata": hostile}))
    result = cli("inspect", str(tmp_path / "h.bundle"))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\u202e" not in result.stdout
    assert "\\x1b[2J" in result.stdout and "[bold red]boom[/bold red]" in result.stdout  # shown, escaped, not styled


def test_json_is_ascii_even_for_paths_that_are_not_utf8(tmp_path, dict_mlp_bundle):
    import shutil

    odd = tmp_path / os.fsdecode(b"b\xffad.bundle")
    shutil.copy(dict_mlp_bundle.path, odd)
    result = cli("inspect", str(odd), "--json")
    assert result.returncode == 0, result.stderr
    result.stdout.encode("ascii")  # no raw bytes, no lone surrogates
    assert json.loads(result.stdout)["path"].endswith("ad.bundle")


def test_a_closed_pipe_exits_quietly(dict_mlp_bundle):
    for args in (["inspect", str(dict_mlp_bundle.path)], ["--help"]):
        command = [sys.executable, "-m", "cuda_runner", *args]
        result = subprocess.run(f"{' '.join(command)} | head -c1 >/dev/null", shell=True, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stderr == "", result.stderr


def test_sigterm_cleans_up_and_exits_128_plus_15(tmp_path):
    """A signal during a long operation unwinds like SIGINT: exit 143, one line, temp files removed."""
    import signal
    import time

    script = (
        "import sys, time, cuda_runner.cli.main as m\n"
        "from cuda_runner.files import write_file\n"
        "def slow(handle):\n"
        "    handle.write(b'x' * 1000); handle.flush(); print('writing', flush=True); time.sleep(60)\n"
        "def command():\n"
        "    write_file(sys.argv[1], slow)\n"
        "m._install_signal_handlers()\n"
        "try:\n"
        "    command()\n"
        "except BaseException as error:\n"
        "    sys.exit(m.run(['devices']) * 0 + 128 + error.signal_number)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out.npy")], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "writing"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.1)
    assert list(tmp_path.iterdir()) == []  # the temp file is gone, and no output appeared


def _processes() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, process group, state, name) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
            table[int(entry)] = (int(fields[1]), int(fields[2]), fields[0], name)
    return table


def _descendants(root: int, table: dict[int, tuple[int, int, str, str]]) -> set[int]:
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (parent, *_) in table.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.heavy
def test_sigterm_during_compile_ends_its_compilers_and_leaves_tmpdir_empty(tmp_path):
    """SIGTERM while Inductor's C++ compiler runs: exit 143 with one line, no
    process of the compile left (cc1plus used to run on, orphaned), nothing
    left in TMPDIR (its ccXXXXXX.s files), no bundle and no temp file beside it."""
    import signal
    import time

    import torch

    torch.export.save(torch.export.export(torch.nn.Linear(4, 2).eval(), (torch.randn(3, 4),)), tmp_path / "p.pt2")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # Inductor keeps a cache and precompiled headers in TMPDIR by default: here a fresh
    # cache elsewhere (so that the compilers do run) and no precompiled headers, so
    # that whatever is left in TMPDIR is a leftover.
    env = dict(os.environ, TMPDIR=str(scratch), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cache"))
    command = [sys.executable, "-m", "cuda_runner", "compile", str(tmp_path / "p.pt2"), "-o", str(tmp_path / "out" / "m.bundle"),
               "--option", "aot_inductor.precompile_headers=false"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    groups, compilers = {process.pid}, {}
    deadline = time.monotonic() + 240
    try:
        while True:  # until a C++ compiler has been running for a while (not a quick -E probe)
            table = _processes()
            below = _descendants(process.pid, table)
            groups |= {table[pid][1] for pid in below}
            now = time.monotonic()
            compilers = {pid: compilers.get(pid, now) for pid in below if table[pid][3] == "cc1plus"}
            if any(now - since > 0.5 for since in compilers.values()):
                break
            assert process.poll() is None and now < deadline, "compile never ran a C++ compiler"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines() == ["error: interrupted by SIGTERM"]
    survivors = {pid: name for pid, (_, group, state, name) in _processes().items() if group in groups and state != "Z"}
    assert survivors == {}
    assert list(scratch.iterdir()) == []
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def _without_bounds(path: Path, destination: Path) -> Path:
    """The bundle as a writer that records no input bounds (before format 1.5) would have written it."""
    from dataclasses import replace

    from cuda_runner.format.bundle import open_bundle, write_bundle

    with open_bundle(path) as reader:
        manifest = reader.manifest
        methods = {name: replace(spec, inputs=tuple(replace(tensor, bounds=None) for tensor in spec.inputs))
                   for name, spec in manifest.methods.items()}
        segments = {entry.name: bytes(reader.segment(entry.name)) for entry in manifest.segments}
    features = tuple(feature for feature in manifest.optional_features if feature != "input-bounds")
    return write_bundle(destination, replace(manifest, methods=methods, optional_features=features), segments)


def test_native_errors_reach_the_user_as_one_line(embedder_bundle, tmp_path):
    """An out-of-range embedding id fails inside the library, which prints C++ frames to fd 2 (a bundle
    without the ids' bounds: one with them refuses the id before the library runs)."""
    bounded = run_cli("run", str(embedder_bundle.path), "-i", "ids=3x6xi64=1000", "-i", "scale=1.0")
    assert bounded.returncode == 2 and "accepts 0 to 49" in bounded.stderr, bounded.stderr
    unbounded = _without_bounds(embedder_bundle.path, tmp_path / "unbounded.bundle")
    result = run_cli("run", str(unbounded), "-i", "ids=3x6xi64=1000", "-i", "scale=1.0")
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_a_prompt_that_would_run_past_the_cache_is_refused_before_the_library_runs(compiled, tmp_path):
    """A prefill that writes its cache at arange(n) plus a counter it copies the prompt's first position
    into (Hugging Face's static cache) is bounded as a span: `inspect` shows it, and `run` refuses a
    prompt counting past the cache with exit 2, where the library's own check stopped the call half way
    (exit 4 on the CPU; on a GPU Inductor's device-side assert stops the process)."""
    bundle = compiled("prompt_cache", "cpu").path
    document = json.loads(run_cli("inspect", str(bundle), "--json").stdout)
    (_, position) = document["methods"]["forward"]["inputs"]
    assert position["name"] == "cache_position" and position["span_bounds"] == {"min": 0, "max": 15} and "bounds" not in position
    assert "counts from its first, within 0 to 15" in run_cli("inspect", str(bundle)).stdout
    for positions, code in (([14, 15, 16], 2), ([13, 14, 15], 0), ([0], 0), ([15], 0), ([16], 2)):
        np.save(tmp_path / "positions.npy", np.array(positions, np.int64))
        result = run_cli("run", str(bundle), "-i", f"x=1x{len(positions)}x4xf32=1", "-i", f"cache_position={tmp_path / 'positions.npy'}")
        assert result.returncode == code, (positions, result.stderr)
        if code:
            last = positions[0] + len(positions) - 1
            assert result.stderr.strip().splitlines() == [
                f"error: input 'cache_position' counts {len(positions)} position(s) from {positions[0]}, to {last}; method 'forward' accepts "
                "positions 0 to 15 (the cache it writes them to)"], result.stderr


def test_a_refused_prompt_leaves_the_cache_as_it_was(compiled):
    """Refused before the library runs: the next call sees the state the last one left."""
    import cuda_runner
    from cuda_runner.errors import InputError

    bundle = compiled("prompt_cache", "cpu").path
    ones = np.ones((1, 3, 4), np.float32)
    with cuda_runner.load(bundle) as refused, cuda_runner.load(bundle) as plain:
        for model in (refused, plain):
            model.run({"x": ones, "cache_position": np.array([0, 1, 2])})
        with pytest.raises(InputError, match="counts 3 position") as error:
            refused.run({"x": 5 * ones, "cache_position": np.array([14, 15, 16])})
        assert error.value.subject == "bounds"
        after = {"x": 2 * ones, "cache_position": np.array([3, 4, 5])}
        np.testing.assert_array_equal(refused.run(after)["output_0"], plain.run(after)["output_0"])


def test_messages_say_what_to_do(dict_mlp_bundle, tmp_path):
    """From a newcomer: no inputs said only "missing 'x'", a truncated bundle what
    was wrong but not what to do, and a bundle of several methods "choose one (choose with --method)"."""
    from forge import forge, method

    no_inputs = cli("run", str(dict_mlp_bundle.path))
    assert no_inputs.returncode == 2
    assert no_inputs.error_lines == ["error: method 'forward' takes 2 input(s) (x, bias), got 0: missing 'x', 'bias' "
                                     "(give them with --inputs NAME=FILE.npy, or generate them with --random-inputs)"]
    truncated = tmp_path / "cut.bundle"
    truncated.write_bytes(dict_mlp_bundle.path.read_bytes()[:100_000])
    cut = cli("run", str(truncated), "--random-inputs")
    assert cut.returncode == 3
    assert cut.error_lines[0].endswith("it was cut short or added to on its way here (an interrupted copy or download); copy it again from where it was built")
    several = tmp_path / "two.bundle"
    several.write_bytes(forge({"methods": {"encode": method("a_so", "a_w"), "decode": method("b_so", "b_w")}},
                              {"a_so": b"\x7fELF" + bytes(60), "a_w": b"", "b_so": b"\x7fELF" + bytes(60), "b_w": b""}))
    ambiguous = cli("run", str(several), "--random-inputs", "--shape", "x=2x4")
    assert ambiguous.returncode == 2
    assert ambiguous.error_lines == ["error: the bundle has several methods (encode, decode) (choose one with --method)"]
