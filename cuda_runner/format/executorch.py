"""ExecuTorch's `.pte` program and `.ptd` data files: the one module that knows them.

Both are FlatBuffers (read with flatbuffer.py, bounds-checked) followed by
segments. docs/executorch.md describes the layouts; in short:

- `.pte`: root offset, file identifier `ET12`, then (when it has segments) an
  extended header `eh00` with the program size and where the segments start.
  The Program table lists execution plans (methods), delegates, segments and
  named data (key -> segment).
- `.ptd` (FlatTensor): root offset, `FT01`, header `FH01` with the flatbuffer
  size and where the segments start; named data key -> segment.

For a method lowered to ExecuTorch's CudaBackend, the delegate's `processed`
bytes say which named-data keys hold the AOTInductor library and its weights,
in one of three layouts (PayloadLayout). Keys are looked up in the `.ptd`
first and then in the `.pte`, as ExecuTorch does.

Every count, offset and length read here is checked before it is used: a
damaged or hostile file is a BundleError, never a crash or a huge allocation.
"""

from __future__ import annotations

import enum
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..arrays import SCALAR_TYPE_CODES, itemsize
from ..errors import BundleError
from .flatbuffer import FlatBuffer, Table

PTE_IDENTIFIER = b"ET12"
PTE_HEADER_MAGIC = b"eh00"
PTD_IDENTIFIER = b"FT01"
PTD_HEADER_MAGIC = b"FH01"
CUDA_BACKEND = "CudaBackend"
FQN_MANIFEST_MAGIC = b"ETCUDAFQN3"
FQN_MANIFEST_FAMILY = b"ETCUDAFQN"
DEFAULT_DATA_FILE = "aoti_cuda_blob.ptd"  # the CUDA backend's external tag, "aoti_cuda_blob"
# ExecuTorch names the data file after its backend's device ("aoti_<device>_blob");
# CPU stand-ins of CUDA programs use "cpu".
DATA_FILE_NAMES = (DEFAULT_DATA_FILE, "aoti_cpu_blob.ptd")

MAX_PLANS = 64
MAX_VALUES = 1 << 20
MAX_INSTRUCTIONS = 1 << 20
MAX_ENTRIES = 1 << 20  # segments, named data, manifest entries (ExecuTorch's own manifest limit)
MAX_SPEC_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 64 << 20  # a delegate's processed bytes
MAX_DELEGATES = 1024
MAX_RANK = 32
MAX_KEY_LENGTH = 1 << 16

# EValue and instruction union tags (schema/program.fbs).
_TENSOR = 5
_KERNEL_CALL, _DELEGATE_CALL, _MOVE_CALL, _JUMP_FALSE_CALL, _FREE_CALL = 1, 2, 3, 4, 5
_INSTRUCTION_KINDS = {_KERNEL_CALL: "kernel call", _DELEGATE_CALL: "delegate call", _MOVE_CALL: "move",
                      _JUMP_FALSE_CALL: "jump", _FREE_CALL: "free"}
_INLINE, _SEGMENT = 0, 1

DTYPES_BY_CODE = {code: name for name, code in SCALAR_TYPE_CODES.items()}
_SHA256_KEY = re.compile(r"^([0-9a-f]{64})_(so|weights)_blob$")

H2D_COPY = "et_copy::_h2d_copy.out"
D2H_COPY = "et_copy::_d2h_copy.out"


class Dynamism(enum.IntEnum):
    STATIC = 0
    DYNAMIC_BOUND = 1  # sizes are upper bounds
    DYNAMIC_UNBOUND = 2


class PayloadLayout(enum.Enum):
    """How a CudaBackend delegate names its library and weights."""

    G1 = "G1"  # ExecuTorch 1.1-1.3: empty payload; "<method>_so_blob", "<method>_weights_blob"
    G2 = "G2"  # 1.4: payload "<so key>\n<weights key>", sha256-named keys
    G3 = "G3"  # 1.5: ETCUDAFQN3 manifest, one named entry per weight storage


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + size) of one file (`source`: "pte" or "ptd")."""

    source: str
    offset: int
    size: int


@dataclass(frozen=True)
class ValueTensor:
    dtype_code: int
    sizes: tuple[int, ...]
    dynamism: Dynamism
    on_cuda: bool

    @property
    def dtype(self) -> str | None:
        return DTYPES_BY_CODE.get(self.dtype_code)


@dataclass(frozen=True)
class Instruction:
    kind: str  # "kernel call", "delegate call", ...
    target: str = ""  # the operator name for a kernel call
    index: int = -1  # the delegate index for a delegate call
    args: tuple[int, ...] = ()

    def describe(self, delegates: list[Delegate]) -> str:
        if self.kind == "kernel call":
            return f"kernel call {self.target}"
        if self.kind == "delegate call":
            backend = delegates[self.index].backend if 0 <= self.index < len(delegates) else "?"
            return f"delegate call #{self.index} ({backend})"
        return self.kind


@dataclass(frozen=True)
class Delegate:
    backend: str
    specs: Mapping[str, bytes]
    processed: memoryview  # a view of the file: copied only for the delegate a method calls

    def spec_text(self, key: str) -> str | None:
        value = self.specs.get(key)
        return None if value is None else value.decode("utf-8", "replace")


@dataclass(frozen=True)
class Plan:
    """One execution plan (method) of a program, as the file states it."""

    name: str
    values: tuple[ValueTensor | None, ...]  # None for non-tensor values
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    instructions: tuple[Instruction, ...]
    delegates: tuple[Delegate, ...]
    chains: int
    scalars: Mapping[int, int | float | bool | None] = field(default_factory=dict)  # value index -> Int/Double/Bool/Null value

    @property
    def is_constant(self) -> bool:
        """A constant method: no instructions; it returns values stored in the program."""
        return not self.instructions and all(value in self.scalars for value in self.outputs)


@dataclass(frozen=True)
class Program:
    plans: Mapping[str, Plan]
    named_data: Mapping[str, Span]
    file_size: int


@dataclass(frozen=True)
class DataFile:
    named_data: Mapping[str, Span]
    file_size: int


@dataclass(frozen=True)
class WeightView:
    """One entry of an ETCUDAFQN3 manifest: a constant as a view of a storage."""

    fqn: str
    storage_key: str
    storage_nbytes: int
    dtype_code: int
    on_cuda: bool
    storage_offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class CudaPayload:
    layout: PayloadLayout
    library_key: str
    weights_key: str | None = None  # G1, G2
    weights: tuple[WeightView, ...] = field(default=())  # G3


# ---------------------------------------------------------------------------
# .pte


def _u64(data: memoryview, offset: int) -> int:
    return int(struct.unpack_from("<Q", data, offset)[0])


def read_program(data: memoryview) -> Program:
    """Parse a `.pte` file's bytes (the whole file, usually a memory map)."""
    file_size = len(data)
    if file_size < 8:
        raise BundleError(f"program: the file is {file_size} bytes, too short for an ExecuTorch program")
    identifier = bytes(data[4:8])
    if identifier != PTE_IDENTIFIER:
        if identifier[:2] == b"ET" and identifier[2:].isalnum():
            raise BundleError(f"program: ExecuTorch program format {identifier.decode()} is not supported (this cuda-runner reads {PTE_IDENTIFIER.decode()})")
        raise BundleError("not an ExecuTorch program (no ET12 identifier)")
    program_size, segment_base = file_size, 0
    if file_size >= 16 and bytes(data[8:12]) == PTE_HEADER_MAGIC:
        program_size, segment_base = _extended_header(data)
    root = FlatBuffer(data[:program_size], "program").root(PTE_IDENTIFIER)
    version = root.scalar(0, "u32")
    if version != 0:
        raise BundleError(f"program: schema version {version} is not supported (this cuda-runner reads 0)")
    segments = root.each(4, "segments", MAX_ENTRIES, lambda item: (item.scalar(0, "u64"), item.scalar(1, "u64")))
    spans = [_segment_span("pte", segment_base, offset, size, file_size, f"program segment {index}") for index, (offset, size) in enumerate(segments)]
    if spans and segment_base == 0:
        raise BundleError("program: it lists segments but has no extended header saying where they start")
    inline = root.each(3, "backend_delegate_data", MAX_ENTRIES, lambda item: item.bytes(0, "data", MAX_PAYLOAD_BYTES) or memoryview(b""))
    named = _named_data(root.tables(7, "named_data", MAX_ENTRIES), spans, "program")
    plans: dict[str, Plan] = {}
    for plan_table in root.tables(1, "execution_plan", MAX_PLANS):
        plan = _plan(plan_table, inline, spans, data)
        if plan.name in plans:
            raise BundleError(f"program: two methods are named {plan.name!r}")
        plans[plan.name] = plan
    if not plans:
        raise BundleError("program: it has no methods")
    return Program(plans, named, file_size)


def _extended_header(data: memoryview) -> tuple[int, int]:
    file_size = len(data)
    if file_size < 32:
        raise BundleError("program: the extended header is cut short")
    length = int(struct.unpack_from("<I", data, 12)[0])
    if length < 24 or 8 + length > file_size:
        raise BundleError(f"program: the extended header length {length} is invalid")
    program_size, segment_base = _u64(data, 16), _u64(data, 24)
    if length > 24 and file_size < 40:
        raise BundleError("program: the extended header is cut short")
    segment_data_size = _u64(data, 32) if length > 24 else None
    if not 8 + length <= program_size <= file_size:
        raise BundleError(f"program: the extended header gives a program size of {program_size} bytes for a {file_size}-byte file")
    if segment_base and not program_size <= segment_base <= file_size:
        raise BundleError(f"program: segments start at {segment_base}, outside [{program_size}, {file_size}]")
    if segment_data_size is not None and segment_base and segment_base + segment_data_size > file_size:
        raise BundleError("program: its segment data runs past the end of the file (truncated?)")
    return program_size, segment_base


def _segment_span(source: str, base: int, offset: int, size: int, file_size: int, what: str) -> Span:
    start = base + offset
    if start + size > file_size:
        raise BundleError(f"{'program' if source == 'pte' else 'data file'}: {what} runs past the end of the file (truncated?)")
    return Span(source, start, size)


def _named_data(tables: list[Table], spans: list[Span], what: str) -> dict[str, Span]:
    named: dict[str, Span] = {}
    for item in tables:
        key = item.string(0, "named data key", MAX_KEY_LENGTH)
        if not key:
            raise BundleError(f"{what}: a named data entry has no key")
        index = item.scalar(1, "u32")
        if index >= len(spans):
            raise BundleError(f"{what}: named data {key[:80]!r} refers to segment {index}, but there are {len(spans)}")
        if key in named:
            raise BundleError(f"{what}: named data key {key[:80]!r} appears twice")
        named[key] = spans[index]
    return named


def _plan(table: Table, inline: list[memoryview], spans: list[Span], data: memoryview) -> Plan:
    name = table.string(0, "method name", 1024)
    if not name:
        raise BundleError("program: a method has no name")
    value_tables = table.tables(2, "values", MAX_VALUES)
    values = tuple(_value(item) for item in value_tables)
    scalars = {index: scalar for index, item in enumerate(value_tables) if (scalar := _scalar(item)) is not _NOT_SCALAR}
    inputs = tuple(table.scalars(3, "i32", "inputs", MAX_VALUES))
    outputs = tuple(table.scalars(4, "i32", "outputs", MAX_VALUES))
    for index in inputs + outputs:
        if not 0 <= index < len(values):
            raise BundleError(f"program: method {name!r} refers to value {index}, but it has {len(values)}")
    operators = [_operator_name(item) for item in table.tables(6, "operators", MAX_INSTRUCTIONS)]
    chains = table.tables(5, "chains", MAX_INSTRUCTIONS)
    instructions = tuple(
        _instruction(item, operators, len(values), name)
        for chain in chains for item in chain.tables(2, "instructions", MAX_INSTRUCTIONS)
    )
    delegates = tuple(_delegate(item, inline, spans, data) for item in table.tables(7, "delegates", MAX_DELEGATES))
    return Plan(name, values, inputs, outputs, instructions, delegates, len(chains), scalars)


_NULL, _INT, _BOOL, _DOUBLE = 1, 2, 3, 4
_NOT_SCALAR = object()


def _scalar(table: Table) -> Any:
    """The value of an Int, Bool, Double or Null EValue; _NOT_SCALAR for others."""
    tag, value = table.union(0, "value")
    if tag == _NULL:
        return None
    if value is None or tag not in (_INT, _BOOL, _DOUBLE):
        return _NOT_SCALAR
    if tag == _INT:
        return value.scalar(0, "i64")
    if tag == _BOOL:
        return bool(value.scalar(0, "u8"))
    return value.double(0)


def _value(table: Table) -> ValueTensor | None:
    tag, value = table.union(0, "value")
    if tag != _TENSOR or value is None:
        return None
    sizes = tuple(value.scalars(2, "i32", "sizes", MAX_RANK))
    if any(size < 0 for size in sizes):
        raise BundleError(f"program: a tensor has a negative size {list(sizes)}")
    dynamism = value.scalar(8, "i8")
    if dynamism not in (0, 1, 2):
        raise BundleError(f"program: a tensor has an unknown shape dynamism {dynamism}")
    extra = value.table(9, "extra_tensor_info")
    on_cuda = extra is not None and extra.scalar(3, "i8") == 1
    return ValueTensor(value.scalar(0, "i8"), sizes, Dynamism(dynamism), on_cuda)


def _operator_name(table: Table) -> str:
    name = table.string(0, "operator name", 1024) or "?"
    overload = table.string(1, "operator overload", 1024)
    return f"{name}.{overload}" if overload else name


def _instruction(table: Table, operators: list[str], value_count: int, method: str) -> Instruction:
    tag, value = table.union(0, "instruction")
    kind = _INSTRUCTION_KINDS.get(tag)
    if kind is None or value is None:
        raise BundleError(f"program: method {method!r} has an instruction of unknown kind {tag}")
    if tag not in (_KERNEL_CALL, _DELEGATE_CALL):
        return Instruction(kind)
    index = value.scalar(0, "i32")
    args = tuple(value.scalars(1, "i32", "args", MAX_VALUES))
    if any(not 0 <= arg < value_count for arg in args):
        raise BundleError(f"program: method {method!r} has a {kind} whose arguments are not values of the method")
    if tag == _KERNEL_CALL:
        if not 0 <= index < len(operators):
            raise BundleError(f"program: method {method!r} calls operator {index}, but it lists {len(operators)}")
        return Instruction(kind, target=operators[index], args=args)
    return Instruction(kind, index=index, args=args)


def _delegate(table: Table, inline: list[memoryview], spans: list[Span], data: memoryview) -> Delegate:
    backend = table.string(0, "delegate id", 1024) or ""
    specs: dict[str, bytes] = {}
    for item in table.tables(2, "compile_specs", 4096):
        key = item.string(0, "compile spec key", 1024) or ""
        specs[key] = bytes(item.bytes(1, "compile spec value", MAX_SPEC_BYTES) or b"")
    reference = table.table(1, "processed")
    processed = memoryview(b"")
    if reference is not None:
        location, index = reference.scalar(0, "u8"), reference.scalar(1, "u32")
        if location == _INLINE:
            if index >= len(inline):
                raise BundleError(f"program: delegate {backend!r} refers to inline data {index}, but there are {len(inline)}")
            processed = inline[index]
        elif location == _SEGMENT:
            if index >= len(spans):
                raise BundleError(f"program: delegate {backend!r} refers to segment {index}, but there are {len(spans)}")
            span = spans[index]
            if span.size > MAX_PAYLOAD_BYTES:
                raise BundleError(f"program: delegate {backend!r} has {span.size} bytes of payload, over the limit")
            processed = data[span.offset:span.offset + span.size]
        else:
            raise BundleError(f"program: delegate {backend!r} has an unknown data location {location}")
    return Delegate(backend, specs, processed)


# ---------------------------------------------------------------------------
# .ptd


def read_data_file(data: memoryview) -> DataFile:
    """Parse a `.ptd` (FlatTensor) file's bytes."""
    file_size = len(data)
    if file_size < 48 or bytes(data[4:8]) != PTD_IDENTIFIER or bytes(data[8:12]) != PTD_HEADER_MAGIC:
        raise BundleError("not an ExecuTorch data file (no FT01/FH01 header)")
    length = int(struct.unpack_from("<I", data, 12)[0])
    if length < 40 or 8 + length > file_size:
        raise BundleError(f"data file: the header length {length} is invalid")
    fb_offset, fb_size, segment_base, segment_size = _u64(data, 16), _u64(data, 24), _u64(data, 32), _u64(data, 40)
    if fb_offset < 8 + length or fb_offset + fb_size > file_size:
        raise BundleError("data file: its flatbuffer runs past the end of the file")
    if segment_base < fb_offset + fb_size or segment_base + segment_size > file_size:
        raise BundleError("data file: its segment data lies outside the file (truncated?)")
    root = FlatBuffer(data[:fb_offset + fb_size], "data file").root(PTD_IDENTIFIER)
    version = root.scalar(0, "u32")
    if version != 0:
        raise BundleError(f"data file: version {version} is not supported (this cuda-runner reads 0)")
    segments = root.each(1, "segments", MAX_ENTRIES, lambda item: (item.scalar(0, "u64"), item.scalar(1, "u64")))
    spans = [_segment_span("ptd", segment_base, offset, size, file_size, f"segment {index}") for index, (offset, size) in enumerate(segments)]
    return DataFile(_named_data(root.tables(2, "named_data", MAX_ENTRIES), spans, "data file"), file_size)


# ---------------------------------------------------------------------------
# The CudaBackend payload


def decode_payload(processed: bytes | memoryview, method_name: str) -> CudaPayload:
    """Which keys hold a method's library and weights, from its delegate payload."""
    processed = bytes(processed)
    if not processed:
        return CudaPayload(PayloadLayout.G1, f"{method_name}_so_blob", f"{method_name}_weights_blob")
    if processed.startswith(FQN_MANIFEST_FAMILY):
        if not processed.startswith(FQN_MANIFEST_MAGIC):
            magic = processed[:12].decode("ascii", "replace")
            raise BundleError(f"program: the CUDA payload layout {magic!r} is not supported (this cuda-runner reads ETCUDAFQN3)")
        return _fqn_manifest(processed)
    try:
        text = processed.decode("utf-8")
    except UnicodeDecodeError:
        raise BundleError("program: the CUDA delegate payload is neither a key pair nor a weight manifest") from None
    library_key, _, weights_key = text.partition("\n")
    if not library_key or not weights_key or "\n" in weights_key:
        raise BundleError("program: the CUDA delegate payload is not '<library key>\\n<weights key>'")
    return CudaPayload(PayloadLayout.G2, library_key, weights_key)


class _Cursor:
    def __init__(self, data: bytes):
        self.data = data
        self.position = 0

    def take(self, size: int, what: str) -> bytes:
        if size < 0 or self.position + size > len(self.data):
            raise BundleError(f"program: the weight manifest is cut short in {what}")
        chunk = self.data[self.position:self.position + size]
        self.position += size
        return chunk

    def unpack(self, layout: str, what: str) -> int:
        return int(struct.unpack(layout, self.take(struct.calcsize(layout), what))[0])

    def text(self, what: str) -> str:
        length = self.unpack("<I", what)
        if length > MAX_KEY_LENGTH:
            raise BundleError(f"program: the weight manifest has a {what} of {length} bytes")
        try:
            return self.take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise BundleError(f"program: the weight manifest's {what} is not valid UTF-8") from None


def _fqn_manifest(processed: bytes) -> CudaPayload:
    cursor = _Cursor(processed)
    cursor.take(len(FQN_MANIFEST_MAGIC), "its magic")
    library_key = cursor.text("library key")
    count = cursor.unpack("<I", "entry count")
    # Each entry takes at least 38 bytes (one-character names, rank 0): a count
    # beyond that is a lie, caught before any loop.
    if count > MAX_ENTRIES or count * 38 > len(processed):
        raise BundleError(f"program: the weight manifest claims {count} entries")
    views = tuple(_weight_view(cursor, index) for index in range(count))
    names = [view.fqn for view in views]
    if len(set(names)) != len(names):
        raise BundleError("program: the weight manifest names a weight twice")
    if cursor.position != len(processed):
        raise BundleError(f"program: the weight manifest has {len(processed) - cursor.position} unexpected trailing bytes")
    if not library_key:
        raise BundleError("program: the weight manifest names no library")
    return CudaPayload(PayloadLayout.G3, library_key, None, views)


def _weight_view(cursor: _Cursor, index: int) -> WeightView:
    what = f"entry {index}"
    fqn = cursor.text(f"{what} name")
    storage_key = cursor.text(f"{what} storage key")
    nbytes = cursor.unpack("<Q", what)
    dtype_code = cursor.unpack("<i", what)
    device_type = cursor.unpack("<i", what)
    offset = cursor.unpack("<q", what)
    rank = cursor.unpack("<I", what)
    if rank > MAX_RANK:
        raise BundleError(f"program: weight {fqn[:80]!r} has rank {rank}, over the limit of {MAX_RANK}")
    sizes = tuple(cursor.unpack("<q", what) for _ in range(rank))
    strides = tuple(cursor.unpack("<q", what) for _ in range(rank))
    view = WeightView(fqn, storage_key, nbytes, dtype_code, device_type == 1, offset, sizes, strides)
    _check_weight_view(view, device_type)
    return view


def _check_weight_view(view: WeightView, device_type: int) -> None:
    name = repr(view.fqn[:80])
    if not view.fqn or not view.storage_key:
        raise BundleError("program: a weight manifest entry has an empty name or key")
    if view.dtype_code not in DTYPES_BY_CODE:
        raise BundleError(f"program: weight {name} has dtype code {view.dtype_code}, which is not supported")
    if device_type not in (0, 1):
        raise BundleError(f"program: weight {name} has device type {device_type}")
    if view.storage_offset < 0 or any(size < 0 for size in view.sizes) or any(stride < 0 for stride in view.strides):
        raise BundleError(f"program: weight {name} has a negative offset, size or stride")
    element = itemsize(DTYPES_BY_CODE[view.dtype_code])
    if view.storage_nbytes % element:
        raise BundleError(f"program: weight {name}'s storage is not a whole number of elements")
    if all(view.sizes):  # a view with any zero size touches nothing
        last = view.storage_offset + sum((size - 1) * stride for size, stride in zip(view.sizes, view.strides))
        if (last + 1) * element > view.storage_nbytes:
            raise BundleError(f"program: weight {name} reaches past the end of its storage")


def sha256_of_key(key: str) -> str | None:
    """The SHA-256 a G2/G3 key names (`<sha256>_so_blob`), if it names one."""
    match = _SHA256_KEY.match(key)
    return match.group(1) if match else None
