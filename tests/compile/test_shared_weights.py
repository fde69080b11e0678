"""Weights shared by several methods of one module, stored once (compile/sharing.py).

One compile of a tiny two-method module (two AOTInductor compiles, once per
test module); the rest works on forged blobs and manifests."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import cli
from models import PrefillDecode

import cuda_runner
from cuda_runner.arrays import SCALAR_TYPE_CODES
from cuda_runner.compile.sharing import LibraryConstant, StoredConstant, share_weights, split_blob
from cuda_runner.format.bundle import read_manifest
from cuda_runner.format.digest import segment_digest
from cuda_runner.format.manifest import ConstantSpec, DeviceSpec, MethodSpec

EXAMPLES = {"forward": (torch.randn(3, 16),), "decode": (torch.randn(1, 16),)}


@pytest.fixture(scope="session")
def two_methods(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> tuple[Path, PrefillDecode]:
    """Compiled once per session: with pytest-xdist one worker compiles it, under
    a file lock in the folder all workers share, and the others reuse it."""
    module = PrefillDecode().eval()
    base = tmp_path_factory.getbasetemp()
    folder = (base if worker_id == "master" else base.parent) / "fixture-shared-weights"
    folder.mkdir(exist_ok=True)
    path = folder / "two.bundle"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            cuda_runner.compile_methods(module, EXAMPLES, path, call_helper=False)
    return path, module


def _weight_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().numpy().tobytes()


@pytest.mark.heavy
def test_a_weight_both_methods_read_is_stored_once(two_methods):
    path, module = two_methods
    manifest = read_manifest(path)
    assert "constant-table" in manifest.required_features
    shared = manifest.shared_weights()
    fqns = {constant.fqn: constant.segment for constant in manifest.methods["decode"].constants}
    assert fqns["shared.weight"] in shared and shared[fqns["shared.weight"]] == ["forward", "decode"]
    forward_fqns = {constant.fqn for constant in manifest.methods["forward"].constants}
    assert "head.weight" in forward_fqns and not any(constant.fqn.startswith("head.") for constant in manifest.methods["decode"].constants)
    assert all(spec.weights_segment is None for spec in manifest.methods.values())
    assert path.read_bytes().count(_weight_bytes(module.shared.weight)) == 1  # once in the file, not once per method


@pytest.mark.heavy
def test_both_methods_match_eager_and_load_the_shared_weight_once(two_methods):
    path, module = two_methods
    manifest = read_manifest(path)
    segments = {constant.segment for spec in manifest.methods.values() for constant in spec.constants}
    with torch.no_grad():
        expected = {name: getattr(module, name)(*args).numpy() for name, args in EXAMPLES.items()}
    with cuda_runner.load(path, "cpu") as model:
        assert model.constant_storages == len(segments)  # a storage per segment, however many methods name it
        for name, args in EXAMPLES.items():
            result = model.run({"x": args[0].numpy()}, method=name)
            np.testing.assert_allclose(result["output_0"], expected[name], rtol=1e-5, atol=1e-6)
    apart = 0
    for name in EXAMPLES:
        with cuda_runner.load(path, "cpu", methods=[name]) as model:
            apart += model.constant_storages
    assert apart == len(segments) + len(manifest.shared_weights())


@pytest.mark.heavy
def test_load_and_close_leave_no_shim_tensor_behind(two_methods):
    """Constants bound by name (user-managed): the library takes a handle of its
    own to each and never deletes it, not even with its container; one tensor
    and one storage stayed behind per constant per load (20 cycles: 1 -> 21)."""
    import ctypes

    from cuda_runner.runtime.providers import load_own_provider, own_shim_path

    path, _ = two_methods
    load_own_provider("cpu")
    shim = ctypes.CDLL(str(own_shim_path()))
    for name in ("cudarunner_shim_live_tensors", "cudarunner_shim_live_storages"):
        getattr(shim, name).restype = ctypes.c_int64
    before = shim.cudarunner_shim_live_tensors(), shim.cudarunner_shim_live_storages()
    for _ in range(20):
        with cuda_runner.load(path, "cpu", provider="shim") as model:
            for name, args in EXAMPLES.items():
                model.run({"x": args[0].numpy()}, method=name)
    assert (shim.cudarunner_shim_live_tensors(), shim.cudarunner_shim_live_storages()) == before


@pytest.mark.heavy
def test_inspect_says_which_methods_share_a_segment(two_methods):
    path, _ = two_methods
    text = cli("inspect", str(path))
    assert text.returncode == 0, text.stderr
    assert "shared weights: " in text.stdout
    assert any("shared.weight" in line and line.rstrip().endswith("forward, decode") for line in text.stdout.splitlines())
    document = json.loads(cli("inspect", "--json", str(path)).stdout)
    shared = [entry for entry in document["shared_weights"].values() if "shared.weight" in entry["fqns"]]
    assert len(shared) == 1 and shared[0]["methods"] == ["forward", "decode"]
    by_name = {segment["name"]: segment for segment in document["segments"]}
    assert by_name["forward_so_blob"]["methods"] == ["forward"]


# ---------------------------------------------------------------------------
# Splitting a blob, on forged libraries


def _code(dtype: str) -> int:
    return SCALAR_TYPE_CODES[dtype]


def _blob(*tensors: torch.Tensor, align: int = 64) -> tuple[bytes, list[int]]:
    data, slots = b"", []
    for tensor in tensors:
        raw = _weight_bytes(tensor)
        slot = -(-len(raw) // align) * align
        data += raw + bytes(slot - len(raw))
        slots.append(slot)
    return data, slots


def test_a_blob_is_cut_at_the_library_sizes_and_described_by_the_program():
    weight, bias = torch.randn(4, 3), torch.randn(5)
    blob, slots = _blob(weight, bias)
    constants = [LibraryConstant("l.weight", _code("float32"), slots[0]), LibraryConstant("l.bias", _code("float32"), slots[1])]
    stored = split_blob(constants, blob, {"l.weight": weight, "l.bias": bias, "unused": torch.ones(2)})
    assert not isinstance(stored, str)
    assert [(item.spec.fqn, item.spec.sizes, item.spec.strides, item.data.nbytes) for item in stored] == [
        ("l.weight", (4, 3), (3, 1), 64), ("l.bias", (5,), (1,), 64)]
    assert bytes(stored[0].data[:48]) == _weight_bytes(weight)


@pytest.mark.parametrize(("program", "reason"), [
    ({"l.weight": torch.randn(4, 3)}, "not the program's"),  # the compiler transformed it
    ({"l.weight": torch.zeros(4, 3, dtype=torch.int32)}, "dtype code"),
    ({"other": torch.randn(4, 3)}, "not a tensor of the exported program"),
    ({"l.weight": torch.randn(4, 5)[:, 1:4]}, "a view into its storage"),
])
def test_a_constant_that_cannot_be_tied_to_the_program_keeps_the_blob(program, reason):
    weight = torch.randn(4, 3)
    blob, slots = _blob(weight)
    result = split_blob([LibraryConstant("l.weight", _code("float32"), slots[0])], blob, program)
    assert isinstance(result, str) and reason in result


def test_a_constant_the_compiler_renamed_is_described_by_the_one_lifted_constant_with_its_bytes():
    made = torch.arange(8.0).reshape(2, 4)
    blob, slots = _blob(made)
    renamed = [LibraryConstant("_tensor_constant0", _code("float32"), slots[0])]
    stored = split_blob(renamed, blob, {}, lifted={"lifted_tensor_0": made, "lifted_tensor_1": torch.ones(3)})
    assert not isinstance(stored, str)
    assert [(item.spec.fqn, item.spec.sizes) for item in stored] == [("_tensor_constant0", (2, 4))]  # bound by the library's name
    # the same bytes used twice alike: either describes it
    alike = split_blob(renamed, blob, {}, lifted={"a": made, "b": made.clone()})
    assert not isinstance(alike, str) and alike[0].spec.sizes == (2, 4)
    # two with those bytes but other shapes (or none) say nothing of its shape: the method keeps its blob
    twice = split_blob(renamed, blob, {}, lifted={"a": made, "b": made.reshape(8).clone()})
    assert isinstance(twice, str) and "not a tensor of the exported program" in twice


def test_state_one_method_writes_and_another_holds_apart_is_told():
    from cuda_runner.compile.sharing import state_not_shared

    def spec(name, constants):
        return dataclasses.replace(_spec(name), weights_segment=None, constants=tuple(
            ConstantSpec(fqn, segment, "float32", "cpu", 0, (1,), (1,)) for fqn, segment in constants))

    methods = {"prefill": spec("prefill", [("cache", "shared_c0"), ("count", "prefill_c1")]), "decode": spec("decode", [("cache", "shared_c0")]),
               "other": _spec("other")}
    held = {"prefill": frozenset({"cache", "count"}), "decode": frozenset({"cache", "count"}), "other": frozenset()}
    lines = state_not_shared(methods, held, frozenset({"cache", "count"}))
    # the cache is one copy; decode's library has no count of its own to bind (compiled into its code)
    assert lines == ["buffer 'count' is state of methods 'decode', 'prefill', but they do not share one copy of it (a library compiled it "
                     "into its code): what one method writes to it, the others do not read"]
    methods["decode"] = _spec("decode")  # its blob could not be split: the cache is apart too, and the line says why
    lines = state_not_shared(methods, held, frozenset({"cache", "count"}), {"decode": "its library could not be asked"})
    assert [line.split(" is state")[0] for line in lines] == ["buffer 'cache'", "buffer 'count'"]
    assert all("(method 'decode' keeps its weights blob: its library could not be asked)" in line for line in lines)


def test_bytes_past_the_constants_keep_the_blob():
    weight = torch.randn(4, 4)
    blob, slots = _blob(weight)
    assert "past the library's constants" in split_blob([LibraryConstant("w", _code("float32"), slots[0])], blob + bytes(64), {"w": weight})


def test_constants_a_build_added_to_the_program_are_described_by_what_it_added(monkeypatch):
    """The rotation tables the fused attention's build adds (compile/attention.py) are no tensor of
    the exported program: the build names them, and the method still shares its weights."""
    from types import SimpleNamespace

    from cuda_runner.compile import sharing

    weight, table = torch.randn(4, 3), torch.randn(8, 16)
    blob, slots = _blob(weight, table)
    constants = [LibraryConstant("l.weight", _code("float32"), slots[0]), LibraryConstant("cuda_runner_rotary_0", _code("float32"), slots[1])]
    monkeypatch.setattr(sharing, "library_constants", lambda library, device: constants)
    program = SimpleNamespace(state_dict={"l.weight": weight}, constants={})
    spec = _spec("decode")
    without = sharing.constant_tables({"decode": (program, b"", blob, spec, {})}, "cpu", lambda _: None)
    assert isinstance(without["decode"], str) and "not a tensor of the exported program" in without["decode"]
    added = sharing.constant_tables({"decode": (program, b"", blob, spec, {"cuda_runner_rotary_0": table})}, "cpu", lambda _: None)
    assert [stored.spec.fqn for stored in added["decode"]] == ["l.weight", "cuda_runner_rotary_0"]


# ---------------------------------------------------------------------------
# Choosing what to share, on forged tables


def _spec(name: str) -> MethodSpec:
    return MethodSpec(name=name, device=DeviceSpec("cpu"), library_segment=f"{name}_so_blob", weights_segment=f"{name}_weights_blob",
                      inputs=(), outputs=(), dims={}, torch_version="2.13.0")


def _stored(fqn: str, data: bytes, mutated: bool = False, strides: tuple[int, ...] = (1,)) -> StoredConstant:
    spec = ConstantSpec(fqn, "", "float32", "cpu", 0, (len(data) // 4,), strides)
    return StoredConstant(spec, memoryview(data), segment_digest(data), mutated)


def _segments(*names: str) -> dict[str, bytes]:
    return {segment: b"x" for name in names for segment in (f"{name}_so_blob", f"{name}_weights_blob")}


def test_storages_held_alike_get_one_segment_and_the_rest_their_own():
    weight, head, cache = bytes(range(64)), bytes(64), bytes(32)
    tables = {"prefill": [_stored("w", weight), _stored("head", head), _stored("cache", cache, mutated=True)],
              "decode": [_stored("w", weight), _stored("cache", cache, mutated=True)]}
    result = share_weights({"prefill": _spec("prefill"), "decode": _spec("decode")}, _segments("prefill", "decode"), tables)
    assert result.shared_segments == {"shared_c0": ("prefill", "decode"), "shared_c1": ("prefill", "decode")}
    prefill, decode = (result.methods[name] for name in ("prefill", "decode"))
    assert prefill.weights_segment is None and decode.weights_segment is None
    assert [(item.fqn, item.segment) for item in prefill.constants] == [("w", "shared_c0"), ("head", "prefill_c1"), ("cache", "shared_c1")]
    # The cache both write is one storage, as ExecuTorch shares state by name: what prefill writes, decode reads.
    assert [(item.fqn, item.segment) for item in decode.constants] == [("w", "shared_c0"), ("cache", "shared_c1")]
    assert "prefill_weights_blob" not in result.segments and bytes(result.segments["shared_c0"]) == weight


@pytest.mark.parametrize("other", [
    _stored("w", bytes(range(1, 65))),  # other bytes
    _stored("v", bytes(range(64))),  # another FQN
    _stored("w", bytes(range(64)), strides=(2,)),  # another layout
])
def test_storages_that_differ_in_anything_are_not_shared(other):
    tables = {"a": [_stored("w", bytes(range(64)))], "b": [other]}
    result = share_weights({"a": _spec("a"), "b": _spec("b")}, _segments("a", "b"), tables)
    assert result.shared_segments == {} and result.methods["a"].weights_segment == "a_weights_blob"


def test_a_method_that_cannot_be_split_keeps_its_blob_and_says_why():
    weight = bytes(range(64))
    tables = {"a": [_stored("w", weight)], "b": [_stored("w", weight)], "c": "its library could not be asked"}
    result = share_weights({name: _spec(name) for name in "abc"}, _segments("a", "b", "c"), tables)
    assert result.methods["c"].weights_segment == "c_weights_blob" and result.shared_segments == {"shared_c0": ("a", "b")}
    assert result.notes == ("method 'c' keeps its weights blob: its library could not be asked",)


@pytest.mark.parametrize(("flag", "expected"), [((), True), (("--no-share-weights",), False)])
def test_compile_passes_the_sharing_choice_on(monkeypatch, tmp_path, flag, expected):
    import cuda_runner.compile as compile_package
    import cuda_runner.compile.isolated as isolated
    from cuda_runner.format import Manifest

    seen = {}

    def record(programs, output, **options):
        seen.update(options)
        return Manifest(methods={})

    monkeypatch.setattr(compile_package, "compile_programs", record)
    monkeypatch.setattr(isolated, "run_in_process_group", lambda function, kwargs, report: function(report, **kwargs))
    with zipfile.ZipFile(tmp_path / "p.pt2", "w") as archive:
        archive.writestr("p/version", "1")
    result = cli("compile", "--method", f"prefill={tmp_path / 'p.pt2'}", "--method", f"decode={tmp_path / 'p.pt2'}",
                 "-o", str(tmp_path / "m.bundle"), "--no-call-helper", *flag)
    assert result.returncode == 0, result.stderr
    assert seen["share_weights"] is expected


def test_a_module_without_the_method_is_an_input_error():
    from cuda_runner.compile import export_method
    from cuda_runner.errors import InputError

    with pytest.raises(InputError, match="no method 'prefil'"):
        export_method(PrefillDecode(), "prefil", EXAMPLES["decode"])


class _FilledByPrefill(torch.nn.Module):
    """State that only prefill writes and decode only reads: a 0-d count (Inductor
    writes a buffer this small into the code as a number unless told to keep it)
    and flags written through a slice (a view: saved and loaded, the program no
    longer ties its traced value to the buffer's). Decode's weights are a
    constant its code makes, which Inductor, told to keep small tensors, keeps
    under a name of its own."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("valid", torch.ones(8))

    def forward(self, x):  # prefill
        self.count.copy_(x.sum())
        self.valid[: x.shape[0]] = 0.0
        return x * 2

    def decode(self, y):
        return y + self.count + self.valid * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])


@pytest.mark.heavy
def test_what_prefill_writes_decode_reads_through_a_bundle_compiled_from_saved_programs(tmp_path):
    from cuda_runner.compile import export_method

    module = _FilledByPrefill().eval()
    examples = {"forward": (torch.arange(3.0),), "decode": (torch.zeros(8),)}
    paths = {}
    for method, args in examples.items():
        paths[method] = tmp_path / f"{method}.pt2"
        torch.export.save(export_method(_FilledByPrefill().eval(), method, args).program, str(paths[method]))
    bundle = tmp_path / "filled.bundle"
    result = cli("compile", *(f"--method={method}={path}" for method, path in paths.items()), "-o", str(bundle), "--no-call-helper")
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(bundle)
    decode_options = manifest.methods["decode"].compile_options
    assert decode_options["always_keep_tensor_constants"] is True and decode_options["joint_graph_constant_folding"] is False
    assert sorted(manifest.shared_weights().values()) == [["forward", "decode"]] * 2  # the count and the flags: one copy each
    with torch.no_grad():
        module(*examples["forward"])
        expected = module.decode(*examples["decode"]).numpy()
    with cuda_runner.load(bundle, "cpu") as model:
        model.run({"x": examples["forward"][0].numpy()}, method="forward")
        got = model.run({"y": examples["decode"][0].numpy()}, method="decode")["output_0"]
    np.testing.assert_allclose(got, expected)  # 3 + [0, 0, 0, 4, 5, 6, 7, 8]
