"""Reading ExecuTorch programs: real files, the test writer checked against
them, refusals with exit 3, and hostile mutations that must never crash."""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from et_writer import MethodPlan, TensorValue, Weight, fqn_manifest, vector_of_offsets, write_program
from helpers import ROOT, cli

from cuda_runner.errors import BundleError, IncompatibleBundleError, InputError
from cuda_runner.format import executorch as et
from cuda_runner.format.elf import read_library_facts
from cuda_runner.format.program import ProgramReader, convert_program
from cuda_runner.format.source import open_model

DATA = ROOT / "tests" / "data" / "executorch"
REAL = {"G1": DATA / "g1_et120_torch211", "G2": DATA / "g2_et141_torch211", "G3": DATA / "g3_et151_torch211"}
STANDINS = {"G2": DATA / "standin_g2", "G3": DATA / "standin_g3"}


def _program(folder: Path) -> et.Program:
    return et.read_program(memoryview((folder / "model.pte").read_bytes()))


@pytest.mark.parametrize("layout", ["G1", "G2", "G3"])
def test_real_programs_read_as_one_cuda_delegate_call(layout):
    with ProgramReader(REAL[layout] / "model.pte") as reader:
        spec = reader.manifest.methods["forward"]
        info = reader.info.methods["forward"]
        assert info.layout.value == layout
        assert [(t.name, t.dtype, t.shape) for t in spec.inputs] == [("input_0", "float32", (4, 16))]
        assert [(t.name, t.dtype, t.shape) for t in spec.outputs] == [("output_0", "float32", (4, 8))]
        assert spec.device.type == "cuda" and spec.device.compute_capability == "9.0"
        assert info.library.kernels == ("sm_90 (ptx)", "sm_90 (sass)")
        assert len(info.library.shim_symbols) == 23 and "libcuda.so.1" in info.library.needed
        if layout == "G3":
            assert [c.fqn for c in spec.constants] == ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight"]
            assert spec.weights_segment is None and reader.manifest.required_features == ("constant-table",)
        else:
            assert spec.weights_segment is not None and reader.segment(spec.weights_segment).nbytes == 3456
        expected_checks = {"G1": set(), "G2": {"forward_so_blob", "forward_weights_blob"}, "G3": {"forward_so_blob"}}[layout]
        assert set(reader.verify_all()) == expected_checks and all(reader.verify_all().values())


def test_a_dynamic_two_input_program_from_the_gpu_machine():
    with ProgramReader(DATA / "g3_two_io_et151_torch211" / "model.pte") as reader:
        spec = reader.manifest.methods["forward"]
    assert [t.name for t in spec.inputs] == ["input_0", "input_1"] and [t.name for t in spec.outputs] == ["output_0", "output_1"]
    assert spec.inputs[0].shape == ("input_0_d0", "input_0_d1") and spec.dims["input_0_d0"].max == 32
    assert spec.outputs[1].shape == ("output_1_d0",) and "library_checks_required" not in spec.compile_options
    assert len(spec.constants) == 5


def _as_plan(folder: Path, copies: bool) -> tuple[MethodPlan, str]:
    """The test writer's description of a real program: its own library, weights and signature."""
    program = _program(folder)
    plan = program.plans["forward"]
    payload = et.decode_payload(plan.delegates[0].processed, "forward")
    data = et.read_data_file(memoryview(next(folder.glob("*.ptd")).read_bytes()))
    pte, ptd = (folder / "model.pte").read_bytes(), next(folder.glob("*.ptd")).read_bytes()

    def blob(key: str) -> bytes:
        span = data.named_data.get(key) or program.named_data[key]
        return (ptd if span.source == "ptd" else pte)[span.offset:span.offset + span.size]

    values = [plan.values[index] for index in plan.inputs + plan.outputs]
    tensors = [TensorValue(v.dtype_code, v.sizes, int(v.dynamism)) for v in values if v is not None]
    weights = [Weight(w.fqn, blob(w.storage_key), w.dtype_code, w.sizes, w.strides, w.storage_offset, w.on_cuda, w.storage_key) for w in payload.weights]
    method = MethodPlan("forward", blob(payload.library_key), tensors[:1], tensors[1:],
                        weights_blob=blob(payload.weights_key) if payload.weights_key else None, weights=weights, copies=copies)
    return method, payload.layout.value


def _structure(pte: bytes, ptd: bytes) -> dict:
    """Everything a reader takes from a program, down to the bytes of every named entry."""
    program = et.read_program(memoryview(pte))
    data = et.read_data_file(memoryview(ptd))
    plan = program.plans["forward"]
    delegate = plan.delegates[0]
    return {
        "instructions": [(i.kind, i.target) for i in plan.instructions],
        "values": plan.values, "inputs": [plan.values[i] for i in plan.inputs], "outputs": [plan.values[i] for i in plan.outputs],
        "delegate": (delegate.backend, bytes(delegate.processed), delegate.specs.get("method_name")),
        "program_data": {key: pte[s.offset:s.offset + s.size] for key, s in program.named_data.items()},
        "data": {key: ptd[s.offset:s.offset + s.size] for key, s in data.named_data.items()},
        "aligned": all(s.offset % 128 == 0 for s in [*program.named_data.values(), *data.named_data.values()]),
    }


@pytest.mark.parametrize("name", ["G1", "G2", "G3", "standin G2", "standin G3"])
def test_the_test_writer_reproduces_real_programs(name):
    folder = STANDINS[name.split()[1]] if name.startswith("standin") else REAL[name]
    real = _structure((folder / "model.pte").read_bytes(), next(folder.glob("*.ptd")).read_bytes())
    copies = any(kind == "kernel call" for kind, _ in real["instructions"])
    method, layout = _as_plan(folder, copies)
    written = _structure(*write_program([method], layout))
    if not copies:  # ExecuTorch 1.2 and the CPU stand-ins have no device values
        assert all(not v.on_cuda for v in real["values"] if v is not None)
    assert written["instructions"] == real["instructions"]
    assert written["inputs"] == real["inputs"] and written["outputs"] == real["outputs"]
    assert written["delegate"] == real["delegate"]  # the payload bytes too: G2 keys, the ETCUDAFQN3 encoding
    assert written["program_data"] == real["program_data"] and written["data"] == real["data"]
    assert written["aligned"] and real["aligned"]


def test_fqn_manifest_encoding_matches_executorch():
    real = bytes(_program(REAL["G3"]).plans["forward"].delegates[0].processed)
    payload = et.decode_payload(real, "forward")
    weights = [Weight(w.fqn, b"\0" * w.storage_nbytes, w.dtype_code, w.sizes, w.strides, w.storage_offset, w.on_cuda, w.storage_key) for w in payload.weights]
    assert fqn_manifest(payload.library_key, weights) == real


def test_library_facts_of_a_cpu_library(compiled):
    from cuda_runner.format.bundle import open_bundle

    with open_bundle(compiled("dict_mlp", "cpu").path) as reader:
        facts = read_library_facts(reader.segment("forward_so_blob"))
    assert not facts.uses_cuda and facts.kernels == () and facts.compute_capability is None
    assert "aoti_torch_create_tensor_from_blob_v2" in facts.shim_symbols


@pytest.mark.parametrize("layout", ["G1", "G2", "G3"])
def test_convert_keeps_every_byte_and_the_signature(tmp_path, layout):
    with ProgramReader(REAL[layout] / "model.pte") as reader:
        path = convert_program(reader, tmp_path / "m.bundle")
        program_manifest = reader.manifest
        program_bytes = {entry.name: bytes(reader.segment(entry.name)) for entry in program_manifest.segments}
    with open_model(path) as bundle:
        assert bundle.manifest.methods == program_manifest.methods
        assert all(bundle.verify_all().values())
        assert {entry.name: bytes(bundle.segment(entry.name)) for entry in bundle.manifest.segments} == program_bytes
        assert bundle.manifest.build["source"] == "executorch"


def test_inspect_cli_describes_a_program():
    result = cli("inspect", str(REAL["G3"] / "model.pte"))
    assert result.returncode == 0, result.stderr
    for expected in ("program ", "payload layout G3", "et_copy::_h2d_copy.out", "sm_90 (sass)", "shim functions: 23 needed", "5 tensors by name"):
        assert expected in result.stdout
    import json

    document = json.loads(cli("inspect", str(REAL["G2"] / "model.pte"), "--json").stdout)
    method = document["executorch"]["methods"]["forward"]
    assert method["payload_layout"] == "G2" and method["library"]["gpu_kernels"] == ["sm_90 (ptx)", "sm_90 (sass)"]
    assert document["methods"]["forward"]["device"]["type"] == "cuda"


def test_convert_cli(tmp_path):
    result = cli("convert", str(REAL["G2"] / "model.pte"), "-o", str(tmp_path / "g2.bundle"))
    assert result.returncode == 0, result.stderr
    assert cli("inspect", str(tmp_path / "g2.bundle")).returncode == 0


# ---------------------------------------------------------------------------
# Refusals


def _write(tmp_path: Path, methods: list[MethodPlan], layout: str, name: str = "model.pte") -> Path:
    pte, ptd = write_program(methods, layout)
    (tmp_path / name).write_bytes(pte)
    (tmp_path / "aoti_cuda_blob.ptd").write_bytes(ptd)
    return tmp_path / name


def _library() -> bytes:
    return (REAL["G1"] / "model.pte").read_bytes()[1152:1152 + 2379608]


def _tensor(*sizes: int) -> TensorValue:
    return TensorValue(6, sizes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"backend": "XnnpackBackend"}, "lowered to 'XnnpackBackend'"),
        ({"extra_kernel": "aten::add.out"}, "runs kernel call aten::add.out outside the CUDA delegate"),
        ({"delegate_calls": 2}, "makes 2 delegate calls"),
    ],
)
def test_programs_that_are_not_one_cuda_call_are_refused(tmp_path, change, message):
    method = MethodPlan("forward", _library(), [_tensor(4, 16)], [_tensor(4, 8)], weights_blob=b"\0" * 3456, **change)
    path = _write(tmp_path, [method], "G2")
    with pytest.raises(BundleError, match=message):
        ProgramReader(path)
    result = cli("run", str(path), "--random-inputs")
    assert result.returncode == 3 and message in result.error_lines[0]


def test_executorch_only_kernels_are_refused(tmp_path):
    library = _library().replace(b"aoti_torch_clone_preserve_strides\0", b"aoti_torch_cuda_int4_plain_mm\0\0\0\0\0")
    path = _write(tmp_path, [MethodPlan("forward", library, [_tensor(4, 16)], [_tensor(4, 8)], weights_blob=b"\0" * 3456)], "G2")
    with pytest.raises(IncompatibleBundleError, match="ExecuTorch-only kernels"):
        ProgramReader(path)


def test_a_missing_data_file_is_a_usage_error(tmp_path):
    path = _write(tmp_path, [MethodPlan("forward", _library(), [_tensor(4, 16)], [_tensor(4, 8)], weights_blob=b"\0" * 3456)], "G1")
    (tmp_path / "aoti_cuda_blob.ptd").unlink()
    with pytest.raises(InputError, match="data file"):
        ProgramReader(path)
    result = cli("inspect", str(path))
    assert result.returncode == 2 and "--data FILE.ptd" in result.error_lines[0]


def test_a_damaged_sha256_keyed_library_is_refused(tmp_path):
    pte = bytearray((REAL["G2"] / "model.pte").read_bytes())
    pte[1920 + 100_000] ^= 0xFF
    (tmp_path / "model.pte").write_bytes(bytes(pte))
    with ProgramReader(tmp_path / "model.pte", REAL["G2"] / "aoti_cuda_blob.ptd") as reader, pytest.raises(BundleError, match="SHA-256 does not match"):
        reader.read_verified("forward_so_blob")


@pytest.mark.parametrize(
    "payload",
    [b"ETCUDAFQN4\0\0\0\0", b"ETCUDAFQN3" + struct.pack("<I", 1 << 30), b"only-one-key", fqn_manifest("k_so_blob", []) + b"x"],
)
def test_bad_payloads_are_refused(payload):
    with pytest.raises(BundleError):
        et.decode_payload(payload, "forward")


def test_a_weight_view_past_its_storage_is_refused():
    weight = Weight("w", b"\0" * 16, 6, (4, 4), (4, 1))  # 64 bytes of view over 16 bytes of storage
    with pytest.raises(BundleError, match="past the end of its storage"):
        et.decode_payload(fqn_manifest("k_so_blob", [weight]), "forward")


def test_a_dynamic_program_names_its_dims_and_leaves_the_library_checks_off(tmp_path):
    """As ExecuTorch does: the checks compare size-1 strides literally and refuse valid inputs."""
    method = MethodPlan("forward", _library(), [TensorValue(6, (64, 16), 1)], [TensorValue(6, (64, 8), 1)], weights_blob=b"\0" * 3456)
    with ProgramReader(_write(tmp_path, [method], "G2")) as reader:
        spec = reader.manifest.methods["forward"]
    assert spec.inputs[0].shape == ("input_0_d0", "input_0_d1")
    assert spec.dims["input_0_d0"].max == 64 and spec.dims["input_0_d0"].min == 1
    assert "library_checks_required" not in spec.compile_options


# ---------------------------------------------------------------------------
# Hostile files


@pytest.mark.parametrize("folder", ["G1", "G2", "G3"])
def test_mutated_programs_are_refused_or_read_never_crash(tmp_path, folder):
    """Flip, truncate and overwrite bytes of the flatbuffers and headers; every
    outcome must be a clean read or a BundleError/InputError (never another
    exception, a hang, or a huge allocation)."""
    pte = (REAL[folder] / "model.pte").read_bytes()
    ptd = (REAL[folder] / "aoti_cuda_blob.ptd").read_bytes()
    head = min(len(pte), 2400)  # the program flatbuffer, extended header and first segments
    rng = random.Random(1234)
    outcomes = {"read": 0, "refused": 0}
    for case in range(150):
        target_is_pte = case % 3 != 0
        data = bytearray(pte if target_is_pte else ptd)
        limit = head if target_is_pte else len(ptd)
        kind = case % 5
        if kind == 0:
            del data[rng.randrange(8, limit):]
        elif kind in (1, 2):
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(limit)] ^= 1 << rng.randrange(8)
        else:
            position = rng.randrange(0, limit - 8)
            data[position:position + 4] = struct.pack("<I", rng.choice([0, 0xFFFFFFFF, 0x7FFFFFFF, len(data), rng.randrange(1 << 32)]))
        (tmp_path / "model.pte").write_bytes(bytes(data) if target_is_pte else pte)
        (tmp_path / "aoti_cuda_blob.ptd").write_bytes(ptd if target_is_pte else bytes(data))
        try:
            with ProgramReader(tmp_path / "model.pte") as reader:
                reader.verify_all()
            outcomes["read"] += 1
        except (BundleError, InputError):
            outcomes["refused"] += 1
    assert outcomes["refused"] > 40 and sum(outcomes.values()) == 150


def test_not_a_program_or_bundle(tmp_path):
    path = tmp_path / "x.pte"
    path.write_bytes(np.arange(64, dtype=np.uint8).tobytes())
    assert cli("inspect", str(path)).returncode == 3
    assert cli("run", str(path), "--data", str(path), "--random-inputs").returncode == 3


# ---------------------------------------------------------------------------
# Crafted files from a review: each must be a clean refusal, and quick.


def test_a_cut_short_extended_header_is_refused():
    data = bytearray(36)
    data[4:8], data[8:12] = b"ET12", b"eh00"
    data[12:16] = struct.pack("<I", 25)
    with pytest.raises(BundleError, match="cut short"):
        et.read_program(memoryview(bytes(data)))


def test_tables_referred_to_over_and_over_are_refused_quickly():
    """2,000 chains that all point at one chain of 2,000 references to one
    instruction: a small file describing four million instructions."""
    import flatbuffers

    builder = flatbuffers.Builder(0)
    builder.StartObject(2)
    move = builder.EndObject()  # a MoveCall
    builder.StartObject(2)
    builder.PrependUint8Slot(0, 3, 0)
    builder.PrependUOffsetTRelativeSlot(1, move, 0)
    instruction = builder.EndObject()
    instructions = vector_of_offsets(builder, [instruction] * 2000)
    builder.StartObject(4)
    builder.PrependUOffsetTRelativeSlot(2, instructions, 0)
    chain = builder.EndObject()
    chains = vector_of_offsets(builder, [chain] * 2000)
    name = builder.CreateString("forward")
    builder.StartObject(10)
    builder.PrependUOffsetTRelativeSlot(0, name, 0)
    builder.PrependUOffsetTRelativeSlot(5, chains, 0)
    plan = builder.EndObject()
    plans = vector_of_offsets(builder, [plan])
    builder.StartObject(8)
    builder.PrependUOffsetTRelativeSlot(1, plans, 0)
    builder.Finish(builder.EndObject(), file_identifier=b"ET12")
    started = time.perf_counter()
    with pytest.raises(BundleError, match="referred to"):
        et.read_program(memoryview(bytes(builder.Output())))
    assert time.perf_counter() - started < 5


def test_a_weight_named_twice_is_refused_and_short_entries_are_counted_right():
    twice = [Weight("w", b"\0" * 4, 6, (), ()), Weight("w", b"\0" * 4, 6, (), (), key="other")]
    with pytest.raises(BundleError, match="twice"):
        et.decode_payload(fqn_manifest("k_so_blob", twice), "forward")
    many = [Weight(chr(ord("a") + index), b"\0" * 4, 6, (), (), key=chr(ord("A") + index)) for index in range(10)]
    assert len(et.decode_payload(fqn_manifest("k_so_blob", many), "forward").weights) == 10


def test_inputs_given_to_the_delegate_out_of_order_are_wired_by_value(tmp_path):
    pte, ptd = write_program([MethodPlan("forward", _library(), [_tensor(4, 16), _tensor(4, 16)], [_tensor(4, 8)], weights_blob=b"\0" * 3456)], "G2")
    program = et.read_program(memoryview(pte))
    plan = program.plans["forward"]
    call = next(item for item in plan.instructions if item.kind == "delegate call")
    swapped = (call.args[1], call.args[0], *call.args[2:])  # the delegate's first input is the method's second
    args_at = pte.find(struct.pack("<3i", *call.args))
    assert args_at > 0
    (tmp_path / "model.pte").write_bytes(pte[:args_at] + struct.pack("<3i", *swapped) + pte[args_at + 12:])
    (tmp_path / "aoti_cuda_blob.ptd").write_bytes(ptd)
    with ProgramReader(tmp_path / "model.pte") as reader:
        wiring = reader.manifest.methods["forward"].wiring
    assert wiring is not None and wiring.library_inputs == (1, 0)


def test_a_programs_segment_is_checked_in_the_background_once_for_every_method():
    with ProgramReader(REAL["G2"] / "model.pte") as reader:
        first = reader.verify_in_background("forward_weights_blob")
        assert reader.verify_in_background("forward_weights_blob") is first
        first.result()
        assert reader.verify_all()["forward_weights_blob"]
        again = reader.verify_in_background("forward_weights_blob")  # the re-check forgot the finished one
        assert again is not first and again.result() is None
