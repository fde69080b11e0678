"""The CUDA path, on the GPU machine: outputs against eager, several bundles,
zero-copy device arrays, memory steadiness, and unload safety."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from helpers import run_cli, to_tensor

import cuda_runner

pytestmark = pytest.mark.gpu


def _eager_cuda(compiled, *arrays):
    import torch

    module = compiled.module.to("cuda")
    with torch.no_grad():
        return module(*[to_tensor(torch, array).to("cuda") for array in arrays])


def test_device_arrays_in_and_out_without_copies(cuda_dict_mlp):
    import cupy

    x = np.random.default_rng(1).standard_normal((4, 16), dtype=np.float32)
    bias = np.zeros(8, np.float32)
    with cuda_runner.load(cuda_dict_mlp.path) as model:
        host = model.run({"x": x, "bias": bias})
        device = model.run_device({"x": cupy.asarray(x), "bias": cupy.asarray(bias)})
        model.method().stream.synchronize()
        assert isinstance(device["logits"], cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(device["logits"]), host["logits"], rtol=1e-6, atol=1e-6)


def _used_device_bytes():
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


@pytest.mark.whole_device  # the device's free memory counts other processes' too
def test_thousands_of_runs_do_not_grow_gpu_memory(cuda_dict_mlp):
    import cupy

    x, bias = np.ones((64, 16), np.float32), np.zeros(8, np.float32)
    with cuda_runner.load(cuda_dict_mlp.path) as model:
        for _ in range(50):
            model.run({"x": x, "bias": bias})
            model.run_device({"x": cupy.asarray(x), "bias": cupy.asarray(bias)})
        model.method().stream.synchronize()
        before = _used_device_bytes()
        for _ in range(3000):
            model.run({"x": x, "bias": bias})
            model.run_device({"x": cupy.asarray(x), "bias": cupy.asarray(bias)})
        model.method().stream.synchronize()
        after = _used_device_bytes()
    print(f"device memory used before {before} after {after} bytes")
    assert after - before < 4 << 20  # allocator slack, not per-run growth (6000 runs)


def test_deleting_one_container_keeps_another_models_outputs_alive(cuda_dict_mlp, cuda_embedder):
    import cupy

    first = cuda_runner.load(cuda_dict_mlp.path)
    second = cuda_runner.load(cuda_embedder.path)
    x, bias = cupy.ones((2, 16), cupy.float32), cupy.zeros(8, cupy.float32)
    outputs = first.run_device({"x": x, "bias": bias})
    first.method().stream.synchronize()
    snapshot = cupy.asnumpy(outputs["logits"])
    second.close()
    first.close()
    np.testing.assert_array_equal(cupy.asnumpy(outputs["logits"]), snapshot)
    del outputs


def test_create_run_delete_cycles_in_a_fresh_process(cuda_dict_mlp, cuda_embedder):
    script = f"""
import numpy as np, cuda_runner, sys
for cycle in range(10):
    a = cuda_runner.load({str(cuda_dict_mlp.path)!r})
    b = cuda_runner.load({str(cuda_embedder.path)!r})
    a.run({{"x": np.ones((2, 16), np.float32), "bias": np.zeros(8, np.float32)}})
    b.run([np.zeros((3, 6), np.int64), np.array(1.0, np.float32)])
    a.close(); b.close()
print("cycles ok", "torch" in sys.modules, "cupy" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["cycles", "ok", "False", "False"]  # host path: neither module


def test_cli_run_on_gpu_cold_process(cuda_dict_mlp, tmp_path):
    """The console script in a fresh process runs a CUDA bundle from .npy files:
    exit 0, the right device and provider, eager PyTorch's outputs in the files,
    and (from the interpreter's own import log) neither torch nor CuPy imported.
    Its time is printed for information only: timings come from benchmarks."""
    x = np.random.default_rng(5).standard_normal((4, 16), dtype=np.float32)
    bias = np.linspace(-1, 1, 8, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "bias.npy", bias)
    started = time.perf_counter()
    result = run_cli("run", str(cuda_dict_mlp.path), "-i", str(tmp_path / "x.npy"), "-i", str(tmp_path / "bias.npy"), "--json",
                     "--out-dir", str(tmp_path / "out"), env={"PYTHONPROFILEIMPORTTIME": "1"})
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert document["device"] == "cuda:0"
    assert document["provider"] in ("cuda-runner shim", "libtorch")
    assert [output["name"] for output in document["outputs"]] == ["logits", "aux.loss", "aux.hidden"]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "cuda_runner.cli.main" in imported  # the import log is there, so its absences mean something
    assert {name.split(".")[0] for name in imported} & {"torch", "cupy"} == set()
    print(f"cold CLI run on GPU (information only): {elapsed:.3f} s; phases {document['timings_s']}")
    expected = _eager_cuda(cuda_dict_mlp, x, bias)
    np.testing.assert_allclose(np.load(tmp_path / "out" / "logits.npy"), expected["logits"].cpu().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.load(tmp_path / "out" / "aux.hidden.npy"), expected["aux"]["hidden"].cpu().numpy(), rtol=1e-4, atol=1e-4)


def test_one_thread_keeps_one_lane_and_its_stream(cuda_dict_mlp):
    """Each lane has its own stream, and Method.stream is the one the calling
    thread's last call was ordered on: one thread calling alone stays on one lane."""
    inputs = {"x": np.ones((2, 16), np.float32), "bias": np.zeros(8, np.float32)}
    with cuda_runner.load(cuda_dict_mlp.path, lanes=2) as model:
        method = model.method()
        streams = []
        for _ in range(4):
            method.run(inputs)
            streams.append(method.stream.ptr)
    assert len(set(streams)) == 1 and streams[0]


def test_inspect_reports_cuda_bundle_runnable(cuda_dict_mlp):
    document = json.loads(run_cli("inspect", str(cuda_dict_mlp.path), "--json").stdout)
    method = document["methods"]["forward"]
    assert method["device"]["type"] == "cuda"
    assert method["runnable_here"] is True, method["not_runnable_reason"]


def test_cuda_graph_replay_matches_plain_runs_and_follows_new_inputs(cuda_bf16):
    from cuda_runner.runtime.graphs import WARMUP_CALLS

    rng = np.random.default_rng(5)
    with cuda_runner.load(cuda_bf16.path) as plain, cuda_runner.load(cuda_bf16.path, cuda_graph=True) as graphed:
        assert graphed.method().call_path == "ctypes: a CUDA graph replays its captured run without the call helper"
        executor = graphed.method()._lanes.first
        for call in range(WARMUP_CALLS + 3):
            x = rng.standard_normal((2, 32)).astype(ml_dtypes.bfloat16)
            (expected,) = plain.run([x]).values()
            (replayed,) = graphed.run([x]).values()
            np.testing.assert_array_equal(replayed.view(np.uint16), expected.view(np.uint16))
            assert executor.graphs == (1 if call >= WARMUP_CALLS else 0)  # captured after the warm-up calls, then replayed


def test_cuda_graph_of_a_dynamic_method_captures_one_graph_per_shape(cuda_dict_mlp):
    """It refused dynamic dimensions; now each shape seen gets its graph, up to a bound, and other shapes run as they are."""
    from cuda_runner.runtime.graphs import WARMUP_CALLS

    rng = np.random.default_rng(6)
    bias = np.zeros(8, np.float32)
    with cuda_runner.load(cuda_dict_mlp.path) as plain, cuda_runner.load(cuda_dict_mlp.path, cuda_graph=True) as graphed:
        executor = graphed.method()._lanes.first
        executor._max_graphs = 2
        for batch in (2, 5, 7):
            for _ in range(WARMUP_CALLS + 2):
                x = rng.standard_normal((batch, 16), dtype=np.float32)
                expected, got = plain.run({"x": x, "bias": bias}), graphed.run({"x": x, "bias": bias})
                for name in expected:
                    np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6)
        assert executor.graphs == 2  # batch 7 came after the bound: it ran without a graph


def test_cuda_graph_copies_small_inputs_itself_and_uploads_large_ones_beside_it(cuda_dict_mlp, monkeypatch):
    """The graph holds the copies of small inputs and of the outputs; an input at
    the pipelining size is uploaded before the launch. Both kinds in one graph,
    fed new values every call, give what plain calls give."""
    from cuda_runner.runtime import graphs

    monkeypatch.setattr(graphs, "PIPELINE_MIN_BYTES", 64)  # x (384 bytes) is uploaded, bias (32) copied by the graph
    rng = np.random.default_rng(11)
    with cuda_runner.load(cuda_dict_mlp.path) as plain, cuda_runner.load(cuda_dict_mlp.path, cuda_graph=True) as graphed:
        executor = graphed.method()._lanes.first
        for _ in range(graphs.WARMUP_CALLS + 3):
            x = rng.standard_normal((6, 16), dtype=np.float32)
            bias = rng.standard_normal(8).astype(">f4")  # big-endian, as a .npy may hold it: the graph's copy takes native bytes
            expected, got = plain.run({"x": x, "bias": bias}), graphed.run({"x": x, "bias": bias})
            for name in expected:
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6)
        (captured,) = executor._graphs.values()
        assert [staging is None for staging in captured.staged_inputs] == [True, False]
        # What a launch walks: the bias's copy in and each output's copy out beside the library's kernels.
        kinds = captured.graph.node_kinds()
        assert kinds["memcpy"] == 1 + sum(staging is not None for staging in captured.staged_outputs) and kinds["kernel"] >= 1, kinds
        # The run's allocations came from the graph's arena: no memory nodes between the kernels.
        assert "memory allocation" not in kinds and "memory free" not in kinds, kinds
        assert executor.arena_bytes > 0


def test_cuda_graph_replays_device_arrays_into_private_outputs_beside_host_calls(cuda_dict_mlp):
    """run_device on a graphed method: warm-up calls, then a graph of its own for device
    arrays (the host calls' graph copies from pinned memory, which would overwrite
    them), fed new arrays every call, a strided one too; each call's outputs are its
    own, unchanged by the calls after it; nothing is waited for until the caller does."""
    import cupy

    from cuda_runner.runtime.graphs import WARMUP_CALLS

    rng = np.random.default_rng(13)
    kept = []
    with cuda_runner.load(cuda_dict_mlp.path) as plain, cuda_runner.load(cuda_dict_mlp.path, cuda_graph=True) as graphed:
        method = graphed.method()
        executor = method._lanes.first
        for call in range(WARMUP_CALLS + 4):
            wide = rng.standard_normal((5, 32), dtype=np.float32)
            bias = rng.standard_normal(8).astype(np.float32)
            with method.stream.as_cupy():  # the inputs ready on the method's stream, as run_device asks
                x = cupy.asarray(wide)[:, ::2] if call % 2 else cupy.asarray(wide[:, ::2])  # every other call not row-major
                device_bias = cupy.asarray(bias)
            expected = plain.run({"x": wide[:, ::2].copy(), "bias": bias})
            got = graphed.run_device({"x": x, "bias": device_bias})
            assert executor.graphs == (1 if call >= WARMUP_CALLS else 0)
            kept.append((expected, got))
        method.stream.synchronize()
        for expected, got in kept:
            assert set(got) == set(expected)
            for name in expected:
                assert isinstance(got[name], cupy.ndarray)
                np.testing.assert_allclose(cupy.asnumpy(got[name]), expected[name], rtol=1e-6, atol=1e-6)
        # Host calls of the same shape get their own graph, whose copies from its pinned buffers
        # must not reach the device calls' inputs: each side fed values of its own, both agree.
        bias = np.zeros(8, np.float32)
        for _ in range(WARMUP_CALLS + 2):
            host_x, device_x = rng.standard_normal((2, 5, 16), dtype=np.float32)
            host = graphed.run({"x": host_x, "bias": bias})
            with method.stream.as_cupy():
                inputs = {"x": cupy.asarray(device_x), "bias": cupy.asarray(bias)}
            device = graphed.run_device(inputs)
            method.stream.synchronize()
            for name, want in plain.run({"x": host_x, "bias": bias}).items():
                np.testing.assert_allclose(host[name], want, rtol=1e-6, atol=1e-6)
            for name, want in plain.run({"x": device_x, "bias": bias}).items():
                np.testing.assert_allclose(cupy.asnumpy(device[name]), want, rtol=1e-6, atol=1e-6)
        assert executor.graphs == 2


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "memory-nodes"])
def test_cuda_graph_replays_agree_with_plain_calls_with_and_without_its_arena(cuda_dict_mlp, monkeypatch, arena):
    """The arena hands a block freed during the capture to a later request: replays
    fed new values must still give what plain calls give, and closing the model
    must leave no tensor or storage of the shim alive."""
    import ctypes

    from cuda_runner.runtime import graphs
    from cuda_runner.runtime.providers import own_shim_path

    shim = ctypes.CDLL(str(own_shim_path()))
    for name in ("cudarunner_shim_live_tensors", "cudarunner_shim_live_storages"):
        getattr(shim, name).restype = ctypes.c_int64

    def live() -> tuple[int, int]:
        return shim.cudarunner_shim_live_tensors(), shim.cudarunner_shim_live_storages()

    monkeypatch.setattr(graphs, "GRAPH_ARENA", arena)
    rng = np.random.default_rng(12)
    before = live()
    with cuda_runner.load(cuda_dict_mlp.path) as plain, cuda_runner.load(cuda_dict_mlp.path, cuda_graph=True) as graphed:
        executor = graphed.method()._lanes.first
        for _ in range(graphs.WARMUP_CALLS + 4):
            x = rng.standard_normal((3, 16), dtype=np.float32)
            bias = rng.standard_normal(8).astype(np.float32)
            expected, got = plain.run({"x": x, "bias": bias}), graphed.run({"x": x, "bias": bias})
            for name in expected:
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-6)
        (captured,) = executor._graphs.values()
        kinds = captured.graph.node_kinds()
        assert ("memory allocation" in kinds) is not arena, kinds
    assert live() == before


def test_pinned_input_skips_the_staging_copy_and_gives_the_same_result(cuda_dict_mlp, monkeypatch):
    from cuda_runner.runtime.cuda import PinnedBuffers

    x = np.random.default_rng(9).standard_normal((6, 16), dtype=np.float32)
    bias = np.ones(8, np.float32)
    staged: list[object] = []
    real_get = PinnedBuffers.get

    def spy(self, slot, nbytes):
        staged.append(slot)
        return real_get(self, slot, nbytes)

    with cuda_runner.load(cuda_dict_mlp.path) as model:
        method = model.method()
        expected = method.run({"x": x, "bias": bias})
        pinned_x = method.pinned_input("x", (6, 16))
        pinned_x[...] = x
        monkeypatch.setattr(PinnedBuffers, "get", spy)
        got = method.run({"x": pinned_x, "bias": bias})
    assert ("in", 0) not in staged and ("in", 1) in staged  # x went straight from its pinned buffer
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


def test_a_graphed_methods_pinned_input_is_replayed_like_any_array(cuda_dict_mlp):
    """It was refused as if the method were on no GPU. (The lanes that reset_state makes keep it: tests/runtime/test_graphs.py.)"""
    from cuda_runner.runtime.graphs import WARMUP_CALLS

    rng = np.random.default_rng(14)
    bias = np.ones(8, np.float32)
    with cuda_runner.load(cuda_dict_mlp.path) as plain, cuda_runner.load(cuda_dict_mlp.path, cuda_graph=True) as graphed:
        method = graphed.method()
        pinned_x = method.pinned_input("x", (6, 16))
        for _ in range(WARMUP_CALLS + 3):
            pinned_x[...] = rng.standard_normal((6, 16), dtype=np.float32)
            expected, got = plain.run({"x": pinned_x.copy(), "bias": bias}), graphed.run({"x": pinned_x, "bias": bias})
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name])


def test_self_test_passes_for_a_cuda_bundle(cuda_dict_mlp):
    result = run_cli("run", str(cuda_dict_mlp.path), "--self-test", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["device"] == "cuda:0" and document["verdict"] == "PASSED"
    print("self-test on GPU:", [(output["name"], output["max_abs_error"]) for output in document["comparison"]["outputs"]])


def test_large_copies_use_chunked_staging_and_pooled_outputs_that_stay_valid(tmp_path):
    import torch

    from cuda_runner.runtime.pinned import PinnedArrayOwner

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2.0 + 1.0

    path = tmp_path / "scale.bundle"
    cuda_runner.compile_module(Scale().eval(), (torch.randn(2048, 2048),), path, device="cuda")
    rng = np.random.default_rng(0)
    first, second = rng.standard_normal((2, 2048, 2048), dtype=np.float32)
    with cuda_runner.load(path) as model:
        (out_first,) = model.run([first]).values()
        (out_second,) = model.run([second]).values()
        base = out_first.base
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, PinnedArrayOwner)  # no second copy: the DMA wrote it
        np.testing.assert_allclose(out_first, first * 2 + 1, rtol=1e-6)  # not overwritten by the second run
        np.testing.assert_allclose(out_second, second * 2 + 1, rtol=1e-6)
        strided = np.asfortranarray(first)
        (out_strided,) = model.run([strided]).values()
        np.testing.assert_allclose(out_strided, first * 2 + 1, rtol=1e-6)
        (again,) = model.run([out_second]).values()  # a pooled output passed back in
        np.testing.assert_allclose(again, (second * 2 + 1) * 2 + 1, rtol=1e-5)


def test_the_call_helper_and_ctypes_agree_on_the_gpu(cuda_embedder):
    """Host and device arrays, several outputs (one a transposed view, one
    bfloat16), through the helper and through ctypes: bit-identical."""
    import cupy

    ids = np.random.default_rng(4).integers(0, 50, (3, 6))
    scale = np.array(0.5, np.float32)
    with cuda_runner.load(cuda_embedder.path) as fast, cuda_runner.load(cuda_embedder.path, call_helper=False) as plain:
        assert fast.method().call_path == "call helper" and plain.method().call_path.startswith("ctypes")
        host_fast, host_plain = fast.run({"ids": ids, "scale": scale}), plain.run({"ids": ids, "scale": scale})
        device_inputs = {"ids": cupy.asarray(ids), "scale": cupy.asarray(scale)}
        device_fast, device_plain = fast.run_device(device_inputs), plain.run_device(device_inputs)
        fast.method().stream.synchronize()
        plain.method().stream.synchronize()
        for name in host_plain:
            np.testing.assert_array_equal(host_fast[name], host_plain[name])
            np.testing.assert_array_equal(cupy.asnumpy(device_fast[name]), cupy.asnumpy(device_plain[name]))
            assert device_fast[name].strides == device_plain[name].strides


def test_run_device_in_c_and_in_python_agree(cuda_dict_mlp):
    """The lane's C device call (native/device_call.c) where it is built, and
    the Python path it leaves a non-row-major input to, give the same outputs;
    outputs outlive the method and free their memory after it closed."""
    import cupy

    from cuda_runner.runtime.cuda import CudaExecutor

    x = np.random.default_rng(5).standard_normal((16, 6), dtype=np.float32)
    bias = np.random.default_rng(6).standard_normal(8, dtype=np.float32)
    model = cuda_runner.load(cuda_dict_mlp.path)
    lane = model.method()._lanes.first
    assert isinstance(lane, CudaExecutor)
    row_major = model.run_device({"x": cupy.asarray(x.T.copy()), "bias": cupy.asarray(bias)})
    try:
        from cuda_runner import _device_call  # noqa: F401
    except ImportError:
        pytest.skip("the C device call is not built here")
    assert lane._device_call is not None and lane._device_call.live_keepers > 0
    transposed = cupy.asarray(x).T  # not row-major: the Python path copies it
    strided = model.run_device({"x": transposed, "bias": cupy.asarray(bias)})
    model.method().stream.synchronize()
    for name in row_major:
        np.testing.assert_array_equal(cupy.asnumpy(row_major[name]), cupy.asnumpy(strided[name]))
    expected = model.run({"x": x.T.copy(), "bias": bias})
    model.close()
    for name, value in expected.items():
        np.testing.assert_allclose(cupy.asnumpy(row_major[name]), value, rtol=1e-6, atol=1e-6)
    del row_major, strided
    assert lane._device_call.live_keepers == 0 and lane.stream.ptr == 0  # the stream went with the last output


@pytest.mark.parametrize("glue", ["c", "python"])
def test_an_output_that_views_an_input_keeps_it_alive(compiled, glue):
    """`x[1:]` returned by the model is a view of the caller's array: dropping
    the caller's last reference must not free it under the output, on either path."""
    import cupy

    with cuda_runner.load(compiled("views", "cuda").path) as model:
        lane = model.method()._lanes.first
        model.run_device({"x": cupy.zeros((4, 3), cupy.float32)})  # the lane's first call makes its C device call
        if glue == "python" and lane._device_call is not None:
            native, lane._device_call = lane._device_call, None
            native.close(lane.stream.let_go)  # as the lane's close would
        elif glue == "c" and lane._device_call is None:
            pytest.skip("the C device call is not built here")
        x = cupy.arange(12, dtype=cupy.float32).reshape(4, 3)
        doubled, again, view = model.run_device({"x": x}).values()
        del x
        reused = [cupy.full((4, 3), 7.0, cupy.float32) for _ in range(20)]  # the pool hands freed blocks out again
        model.method().stream.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(view), np.arange(3, 12, dtype=np.float32).reshape(3, 3))
        np.testing.assert_array_equal(cupy.asnumpy(doubled), np.arange(12, dtype=np.float32).reshape(4, 3) * 2)
        assert doubled.data.ptr == again.data.ptr  # one tensor returned twice: one block
        del reused


@pytest.mark.parametrize("arena", ["1", "0"], ids=["arena", "memory-nodes"])
def test_cli_batch_replayed_from_a_cuda_graph_matches_plain_calls_with_and_without_its_arena(cuda_dict_mlp, tmp_path, arena):
    """Through the console script: eight sets of one shape under --cuda-graph (the
    fourth is captured, the rest replay) against the same sets run plainly, with
    the graph's memory from its arena and, CUDA_RUNNER_GRAPH_ARENA=0, as nodes."""
    sets = tmp_path / "sets"
    sets.mkdir()
    rng = np.random.default_rng(13)
    for index in range(8):
        np.savez(sets / f"s{index}.npz", x=rng.standard_normal((5, 16), dtype=np.float32), bias=rng.standard_normal(8).astype(np.float32))
    plain = run_cli("run", str(cuda_dict_mlp.path), "--batch", str(sets), "--out-dir", str(tmp_path / "plain"), "--out-format", "npz")
    assert plain.returncode == 0, plain.stderr
    graphed = run_cli("run", str(cuda_dict_mlp.path), "--batch", str(sets), "--out-dir", str(tmp_path / "graphed"), "--cuda-graph",
                      "--expected-dir", str(tmp_path / "plain"), "--rtol", "1e-6", "--atol", "1e-6", env={"CUDA_RUNNER_GRAPH_ARENA": arena})
    assert graphed.returncode == 0, graphed.stdout + graphed.stderr
    assert graphed.stdout.strip().splitlines()[-1] == "VERDICT: PASSED"
