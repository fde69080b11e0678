"""A test-only writer of ExecuTorch CUDA programs (`.pte` + `.ptd`).

It wraps a model library compiled during the test run (a CPU one in CI) in
each of the three payload layouts ExecuTorch's CudaBackend has written, with
the container structure ExecuTorch's serializer gives them: the extended
header, the segment order and 128-byte segment alignment, the library as
named data in the program, the weights in `aoti_cuda_blob.ptd`, and (from
ExecuTorch 1.4 on) host/device copy kernels around the delegate call. It is
checked against files made by ExecuTorch itself (tests/data/executorch).

Built with the `flatbuffers` package's Builder, slot by slot as in
ExecuTorch's program.fbs and flat_tensor.fbs.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import flatbuffers

SEGMENT_ALIGNMENT = 128
_TENSOR_TAG, _INT_TAG, _BOOL_TAG, _DOUBLE_TAG = 5, 2, 3, 4
_KERNEL_CALL, _DELEGATE_CALL = 1, 2


@dataclass
class TensorValue:
    dtype_code: int
    sizes: tuple[int, ...]
    dynamism: int = 0  # 0 static, 1 bound, 2 unbound
    on_cuda: bool = False


@dataclass
class Weight:
    """One ETCUDAFQN3 entry: a constant as a view of its storage bytes."""

    fqn: str
    storage: bytes
    dtype_code: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int = 0
    on_cuda: bool = False
    key: str | None = None  # default "cuda_fqn_weight:<cuda|cpu>:<fqn>"

    @property
    def storage_key(self) -> str:
        return self.key or f"cuda_fqn_weight:{'cuda' if self.on_cuda else 'cpu'}:{self.fqn}"


@dataclass
class MethodPlan:
    name: str
    library: bytes
    inputs: list[TensorValue]
    outputs: list[TensorValue]
    weights_blob: bytes | None = None  # G1 / G2
    weights: list[Weight] = field(default_factory=list)  # G3
    backend: str = "CudaBackend"
    copies: bool = True  # ExecuTorch >= 1.4 wraps the call in et_copy kernels
    extra_kernel: str | None = None  # an operator run outside the delegate (for refusal tests)
    delegate_calls: int = 1
    constant_outputs: list[int | float | bool] = field(default_factory=list)  # Int/Double/Bool values returned after the tensors


def fqn_manifest(library_key: str, weights: list[Weight]) -> bytes:
    def text(value: str) -> bytes:
        raw = value.encode()
        return struct.pack("<I", len(raw)) + raw

    out = b"ETCUDAFQN3" + text(library_key) + struct.pack("<I", len(weights))
    for weight in weights:
        out += text(weight.fqn) + text(weight.storage_key)
        out += struct.pack("<QiiqI", len(weight.storage), weight.dtype_code, 1 if weight.on_cuda else 0, weight.storage_offset, len(weight.sizes))
        out += struct.pack(f"<{len(weight.sizes)}q", *weight.sizes) + struct.pack(f"<{len(weight.strides)}q", *weight.strides)
    return out


def sha_key(data: bytes, role: str) -> str:
    return f"{hashlib.sha256(data).hexdigest()}_{role}_blob"


def write_program(methods: list[MethodPlan], layout: str) -> tuple[bytes, bytes]:
    """(pte bytes, ptd bytes) for `layout` "G1", "G2" or "G3"."""
    program_named: dict[str, bytes] = {}
    data_named: dict[str, bytes] = {}
    payloads: list[bytes] = []
    for method in methods:
        if layout == "G1":
            so_key, weights_key = f"{method.name}_so_blob", f"{method.name}_weights_blob"
            payload = b""
        else:
            so_key = sha_key(method.library, "so")
        if layout == "G2":
            assert method.weights_blob is not None
            weights_key = sha_key(method.weights_blob, "weights")
            payload = f"{so_key}\n{weights_key}".encode()
        if layout == "G3":
            payload = fqn_manifest(so_key, method.weights)
            for weight in method.weights:
                data_named[weight.storage_key] = weight.storage
        else:
            if method.weights_blob is not None:
                data_named[weights_key] = method.weights_blob
        program_named[so_key] = method.library
        payloads.append(payload)
    return _pte(methods, payloads, program_named), _ptd(data_named)


def _align(value: int, alignment: int = SEGMENT_ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def _segments_blob(blobs: list[bytes]) -> tuple[list[tuple[int, int]], bytes]:
    """ExecuTorch's placement: each segment at the next 128-byte boundary."""
    placed, data = [], b""
    for blob in blobs:
        data += b"\0" * (_align(len(data)) - len(data))
        placed.append((len(data), len(blob)))
        data += blob
    return placed, data


def vector_of_offsets(builder: flatbuffers.Builder, offsets: list[int]) -> int:
    builder.StartVector(4, len(offsets), 4)
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


def _vector_of_i32(builder: flatbuffers.Builder, values: list[int]) -> int:
    builder.StartVector(4, len(values), 4)
    for value in reversed(values):
        builder.PrependInt32(value)
    return builder.EndVector()


def _data_segments(builder: flatbuffers.Builder, placed: list[tuple[int, int]]) -> int:
    tables = []
    for offset, size in placed:
        builder.StartObject(2)
        builder.PrependUint64Slot(0, offset, 0)
        builder.PrependUint64Slot(1, size, 0)
        tables.append(builder.EndObject())
    return vector_of_offsets(builder, tables)


def _named_data(builder: flatbuffers.Builder, keys: list[str], first_segment: int) -> int:
    tables = []
    for index, key in enumerate(keys):
        name = builder.CreateString(key)
        builder.StartObject(2)
        builder.PrependUOffsetTRelativeSlot(0, name, 0)
        builder.PrependUint32Slot(1, first_segment + index, 0)
        tables.append(builder.EndObject())
    return vector_of_offsets(builder, tables)


def _tensor_value(builder: flatbuffers.Builder, tensor: TensorValue) -> int:
    sizes = _vector_of_i32(builder, list(tensor.sizes))
    builder.StartVector(1, len(tensor.sizes), 1)
    for axis in reversed(range(len(tensor.sizes))):
        builder.PrependUint8(axis)
    dim_order = builder.EndVector()
    extra = None
    if tensor.on_cuda:
        builder.StartObject(5)
        builder.PrependInt8Slot(3, 1, 0)
        extra = builder.EndObject()
    builder.StartObject(10)
    builder.PrependInt8Slot(0, tensor.dtype_code, 0)
    builder.PrependUOffsetTRelativeSlot(2, sizes, 0)
    builder.PrependUOffsetTRelativeSlot(3, dim_order, 0)
    builder.PrependInt8Slot(8, tensor.dynamism, 0)
    if extra is not None:
        builder.PrependUOffsetTRelativeSlot(9, extra, 0)
    value = builder.EndObject()
    return _evalue(builder, _TENSOR_TAG, value)


def _evalue(builder: flatbuffers.Builder, tag: int, value: int) -> int:
    builder.StartObject(2)
    builder.PrependUint8Slot(0, tag, 0)
    builder.PrependUOffsetTRelativeSlot(1, value, 0)
    return builder.EndObject()


def _int_value(builder: flatbuffers.Builder, number: int) -> int:
    builder.StartObject(1)
    builder.PrependInt64Slot(0, number, 0)
    return _evalue(builder, _INT_TAG, builder.EndObject())


def _scalar_value(builder: flatbuffers.Builder, value: int | float | bool) -> int:
    """An Int, Bool or Double EValue, as ExecuTorch's emitter writes a returned Python scalar."""
    builder.StartObject(1)
    if isinstance(value, bool):
        builder.PrependBoolSlot(0, value, False)
        tag = _BOOL_TAG
    elif isinstance(value, int):
        builder.PrependInt64Slot(0, value, 0)
        tag = _INT_TAG
    else:
        builder.PrependFloat64Slot(0, value, 0.0)
        tag = _DOUBLE_TAG
    return _evalue(builder, tag, builder.EndObject())


def _instruction(builder: flatbuffers.Builder, tag: int, index: int, args: list[int]) -> int:
    arg_vector = _vector_of_i32(builder, args)
    builder.StartObject(2)
    builder.PrependInt32Slot(0, index, 0)
    builder.PrependUOffsetTRelativeSlot(1, arg_vector, 0)
    call = builder.EndObject()
    builder.StartObject(2)
    builder.PrependUint8Slot(0, tag, 0)
    builder.PrependUOffsetTRelativeSlot(1, call, 0)
    return builder.EndObject()


def _plan(builder: flatbuffers.Builder, method: MethodPlan, delegate_ref: tuple[int, int]) -> int:
    """Values: host inputs, [device inputs], [device outputs], host outputs, [an int]."""
    host_in = list(method.inputs)
    host_out = list(method.outputs)
    values: list[TensorValue] = host_in[:]
    device_in = list(range(len(host_in)))
    if method.copies:
        device_in = list(range(len(values), len(values) + len(host_in)))
        values += [TensorValue(t.dtype_code, t.sizes, t.dynamism, True) for t in host_in]
    device_out = list(range(len(values), len(values) + len(host_out)))
    values += [TensorValue(t.dtype_code, t.sizes, t.dynamism, method.copies) for t in host_out]
    plan_out = device_out
    if method.copies:
        plan_out = list(range(len(values), len(values) + len(host_out)))
        values += host_out
    value_offsets = [_tensor_value(builder, tensor) for tensor in values]
    value_offsets.append(_int_value(builder, 0))
    constants = list(range(len(value_offsets), len(value_offsets) + len(method.constant_outputs)))
    value_offsets += [_scalar_value(builder, value) for value in method.constant_outputs]
    instructions = []
    operators = []
    if method.copies:
        operators += ["et_copy::_h2d_copy", "et_copy::_d2h_copy"]
        instructions += [_instruction(builder, _KERNEL_CALL, 0, [source, target, target]) for source, target in zip(range(len(host_in)), device_in)]
    for _ in range(method.delegate_calls):
        instructions.append(_instruction(builder, _DELEGATE_CALL, 0, device_in + device_out))
    if method.copies:
        instructions += [_instruction(builder, _KERNEL_CALL, 1, [source, target, target]) for source, target in zip(device_out, plan_out)]
    if method.extra_kernel:
        operators.append(method.extra_kernel)
        instructions.append(_instruction(builder, _KERNEL_CALL, len(operators) - 1, [plan_out[0], plan_out[0]]))
    instruction_vector = vector_of_offsets(builder, instructions)
    builder.StartObject(4)
    builder.PrependUOffsetTRelativeSlot(2, instruction_vector, 0)
    chain = builder.EndObject()
    operator_tables = []
    for qualified in operators:
        name, _, overload = qualified.partition(".")
        name_offset, overload_offset = builder.CreateString(name), builder.CreateString(overload or "out")
        builder.StartObject(2)
        builder.PrependUOffsetTRelativeSlot(0, name_offset, 0)
        builder.PrependUOffsetTRelativeSlot(1, overload_offset, 0)
        operator_tables.append(builder.EndObject())
    delegate = _delegate(builder, method, delegate_ref)
    name = builder.CreateString(method.name)
    values_vector = vector_of_offsets(builder, value_offsets)
    inputs_vector = _vector_of_i32(builder, list(range(len(host_in))))
    outputs_vector = _vector_of_i32(builder, plan_out + constants)
    chains = vector_of_offsets(builder, [chain])
    operators_vector = vector_of_offsets(builder, operator_tables)
    delegates = vector_of_offsets(builder, [delegate])
    builder.StartObject(10)
    builder.PrependUOffsetTRelativeSlot(0, name, 0)
    builder.PrependUOffsetTRelativeSlot(2, values_vector, 0)
    builder.PrependUOffsetTRelativeSlot(3, inputs_vector, 0)
    builder.PrependUOffsetTRelativeSlot(4, outputs_vector, 0)
    builder.PrependUOffsetTRelativeSlot(5, chains, 0)
    builder.PrependUOffsetTRelativeSlot(6, operators_vector, 0)
    builder.PrependUOffsetTRelativeSlot(7, delegates, 0)
    return builder.EndObject()


def _delegate(builder: flatbuffers.Builder, method: MethodPlan, reference: tuple[int, int]) -> int:
    specs = []
    for key, value in (("method_name", method.name.encode()), ("target_device", b"cuda:0")):
        key_offset, value_offset = builder.CreateString(key), builder.CreateByteVector(value)
        builder.StartObject(2)
        builder.PrependUOffsetTRelativeSlot(0, key_offset, 0)
        builder.PrependUOffsetTRelativeSlot(1, value_offset, 0)
        specs.append(builder.EndObject())
    spec_vector = vector_of_offsets(builder, specs)
    builder.StartObject(2)
    builder.PrependUint8Slot(0, reference[0], 0)
    builder.PrependUint32Slot(1, reference[1], 0)
    processed = builder.EndObject()
    backend = builder.CreateString(method.backend)
    builder.StartObject(3)
    builder.PrependUOffsetTRelativeSlot(0, backend, 0)
    builder.PrependUOffsetTRelativeSlot(1, processed, 0)
    builder.PrependUOffsetTRelativeSlot(2, spec_vector, 0)
    return builder.EndObject()


def _pte(methods: list[MethodPlan], payloads: list[bytes], named: dict[str, bytes]) -> bytes:
    # Segment order as ExecuTorch writes it: the (empty) constant segment,
    # the non-empty delegate payloads, then the named data.
    nonempty = [payload for payload in payloads if payload]
    blobs = [b"", *nonempty, *list(named.values())]
    placed, segment_data = _segments_blob(blobs)
    builder = flatbuffers.Builder(1024)
    references, inline = [], []
    for payload in payloads:
        if payload:
            references.append((1, 1 + nonempty.index(payload)))
        else:
            references.append((0, len(inline)))
            inline.append(payload)
    plans = [_plan(builder, method, reference) for method, reference in zip(methods, references)]
    inline_tables = []
    for data in inline:
        data_offset = builder.CreateByteVector(data)
        builder.StartObject(1)
        builder.PrependUOffsetTRelativeSlot(0, data_offset, 0)
        inline_tables.append(builder.EndObject())
    plan_vector = vector_of_offsets(builder, plans)
    inline_vector = vector_of_offsets(builder, inline_tables)
    segments = _data_segments(builder, placed)
    named_vector = _named_data(builder, list(named), 1 + len(nonempty))
    builder.StartObject(8)
    builder.PrependUint32Slot(0, 0, 0)
    builder.PrependUOffsetTRelativeSlot(1, plan_vector, 0)
    builder.PrependUOffsetTRelativeSlot(3, inline_vector, 0)
    builder.PrependUOffsetTRelativeSlot(4, segments, 0)
    builder.PrependUOffsetTRelativeSlot(7, named_vector, 0)
    builder.Finish(builder.EndObject(), file_identifier=b"ET12")
    flat = bytes(builder.Output())
    # The extended header goes right after the file identifier; offsets inside
    # the flatbuffer are relative, so only the root offset moves.
    header_length = 32
    program_size = len(flat) + header_length
    segment_base = _align(program_size)
    header = b"eh00" + struct.pack("<IQQQ", header_length, program_size, segment_base, len(segment_data))
    root = struct.pack("<I", struct.unpack_from("<I", flat)[0] + header_length)
    program = root + flat[4:8] + header + flat[8:]
    return program + b"\0" * (segment_base - program_size) + segment_data


def _ptd(named: dict[str, bytes]) -> bytes:
    placed, segment_data = _segments_blob(list(named.values()))
    builder = flatbuffers.Builder(1024)
    segments = _data_segments(builder, placed)
    named_vector = _named_data(builder, list(named), 0)
    builder.StartObject(3)
    builder.PrependUint32Slot(0, 0, 0)
    builder.PrependUOffsetTRelativeSlot(1, segments, 0)
    builder.PrependUOffsetTRelativeSlot(2, named_vector, 0)
    builder.Finish(builder.EndObject(), file_identifier=b"FT01")
    flat = bytes(builder.Output())
    header_length, padded = 40, 48
    segment_base = _align(len(flat) + padded)
    header = b"FH01" + struct.pack("<IQQQQ", header_length, padded, len(flat), segment_base, len(segment_data))
    header += b"\0" * (padded - len(header))  # ExecuTorch pads its 40 header bytes to 48
    root = struct.pack("<I", struct.unpack_from("<I", flat)[0] + padded)
    data = root + flat[4:8] + header + flat[8:]
    return data + b"\0" * (segment_base - len(data)) + segment_data
