"""The manifest: the typed, validated description of what a bundle holds.

A model library cannot tell its real signature (input names are graph
placeholders, and dtypes and shapes are not exposed at all), so the manifest
records it at compile time. Everything here is parsed strictly: a bundle is
input from outside, and any field of the wrong type is a BundleError. The
rule for the names a file may hold (`name_problem`) is here too: compile
checks the names it writes with it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..arrays import DTYPE_NAMES, itemsize, shape_text, span_problem
from ..errors import BundleError, InputError
from .digest import DIGEST_ALGORITHM

MAX_METHODS = 64
MAX_NAME_LENGTH = 128  # of any name a bundle holds (method, segment, tensor, dim), and of an output's file stem
MAX_SEGMENTS = 65536  # 1024 in format 1.0; per-weight storages (constant tables) need more
MAX_CONSTANTS = 65536
MAX_FQN_LENGTH = 1024
MAX_TENSORS_PER_SIGNATURE = 4096
MAX_RANK = 32
MAX_METADATA_ENTRIES = 256
MAX_METADATA_VALUE_LENGTH = 4096
MAX_EXPRESSION_LENGTH = 256
# Segment names are "<method>_<role>" with roles up to 15 characters long
# ("_sample_outputs"), and every name is at most MAX_NAME_LENGTH.
MAX_METHOD_NAME_LENGTH = MAX_NAME_LENGTH - len("_sample_outputs")

_DIGEST_PATTERN = re.compile(rf"^{DIGEST_ALGORITHM}:[0-9a-f]{{32}}$")
_EXPRESSION_PATTERN = re.compile(r"^[A-Za-z0-9_.+\-*/() ]+$")
_FORBIDDEN_IN_NAMES = re.compile(r"[/\\\x00-\x1f\x7f-\x9f]")
_ABSENT = object()  # a tensor without "bounds" (null is refused, as the schema does)
# The dtypes a tensor's bounds may be given for, with the values each holds.
_BOUNDED_DTYPES = {"int32": (-(1 << 31), (1 << 31) - 1), "int64": (-(1 << 63), (1 << 63) - 1)}

# A compile_options key: nothing vouches for the signature, or it gives only
# upper bounds for its dims (ExecuTorch programs), so the runtime keeps the
# library's own input checks on.
LIBRARY_CHECKS_OPTION = "library_checks_required"
# A compile_options key: the buffers a run writes to (torch.export's
# buffers_to_mutate), recorded at compile time; [] says a run changes no state.
MUTATED_BUFFERS_OPTION = "mutated_buffers"
# A compile_options key: the program's buffers a run never writes (recorded
# beside MUTATED_BUFFERS_OPTION), so that every buffer the library has is
# accounted for: one named in neither list means the manifest does not
# describe the library.
READ_ONLY_BUFFERS_OPTION = "read_only_buffers"
# A compile_options key: the inputs a run writes into (torch.export's
# user_inputs_to_mutate); the runtime hands the library private copies of them.
MUTATED_INPUTS_OPTION = "mutated_inputs"
CONSTANT_TABLE = "constant-table"  # weights as one tensor view per constant (format 1.1)
WIRING = "wiring"  # a method's values mapped to its library's by position (format 1.3)
CONSTANT_OUTPUTS = "constant-outputs"  # a wiring output that is a scalar stored in the file (format 1.4)
CALL_HELPER = "call-helper"  # a native helper that makes each call one foreign call (format 1.2; optional)
INPUT_BOUNDS = "input-bounds"  # an integer input's accepted values (format 1.5; optional)
INPUT_SPAN_BOUNDS = "input-span-bounds"  # the span an integer input counts over (format 1.6; optional)

# Features a reader must understand to use a bundle that lists them as
# required. A bundle that requires anything else is refused.
KNOWN_FEATURES = frozenset({"samples", CONSTANT_TABLE, CALL_HELPER, WIRING, CONSTANT_OUTPUTS, INPUT_BOUNDS, INPUT_SPAN_BOUNDS})


@dataclass(frozen=True)
class SegmentEntry:
    name: str
    offset: int
    size: int
    digest: str


@dataclass(frozen=True)
class DimSpec:
    """A dynamic dimension: its bounds, and the size used at export time."""

    name: str
    min: int
    max: int | None  # None: unbounded
    example: int | None = None

    def allows(self, size: int) -> bool:
        return size >= self.min and (self.max is None or size <= self.max)


ShapeEntry = int | str  # a static size, a dim name, or an expression of dim names


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[ShapeEntry, ...]
    # Integer inputs: the lowest and highest value the method accepts (a position in a KV cache,
    # token ids in an embedding); the runtime refuses others before the library runs. None: any.
    bounds: tuple[int, int] | None = None
    # Integer inputs counted from (a prompt's positions, where the method writes its cache at first + 0..n-1):
    # the lowest first element and the highest first + n - 1, n its element count. None: any.
    span_bounds: tuple[int, int] | None = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    def shape_text(self) -> str:
        return shape_text(self.shape)


@dataclass(frozen=True)
class DeviceSpec:
    type: str  # "cpu" or "cuda"
    compute_capability: str | None = None  # cuda: "9.0"
    cpu_isa: str | None = None  # cpu: AOTI_CPU_ISA
    cpu_flags: tuple[str, ...] = ()  # cpu: ISA flags of the build machine (-march=native)


@dataclass(frozen=True)
class ConstantSpec:
    """One model constant bound by its original name (FQN) to a view of a
    storage segment, instead of being part of one weights blob."""

    fqn: str
    segment: str
    dtype: str
    device: str  # "cpu" or "cuda": where the library expects it
    storage_offset: int  # elements
    sizes: tuple[int, ...]
    strides: tuple[int, ...]  # elements


@dataclass(frozen=True)
class OutputSource:
    """Where a method output comes from: the library's output `index`, or
    (`from_input`) the method's own input `index`, returned as given, or
    (`constant` not None) a scalar stored in the file, returned as a 0-d array
    of the output's dtype (ExecuTorch methods may return an Int, Double or
    Bool beside their tensors)."""

    index: int
    from_input: bool = False
    constant: int | float | bool | None = None

    @property
    def from_constant(self) -> bool:
        return self.constant is not None


@dataclass(frozen=True)
class Wiring:
    """How a method's values reach its library, where the two differ (ExecuTorch
    programs pass values by identity, not position): the method input each
    library input takes, the library's outputs, and each method output's source.
    A library output may be returned twice, or not at all."""

    library_inputs: tuple[int, ...]
    library_outputs: tuple[TensorSpec, ...]
    outputs: tuple[OutputSource, ...]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    device: DeviceSpec
    library_segment: str
    weights_segment: str | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: Mapping[str, DimSpec]
    torch_version: str
    compile_options: Mapping[str, Any] = field(default_factory=dict)
    sample_inputs_segment: str | None = None
    sample_outputs_segment: str | None = None
    constants: tuple[ConstantSpec, ...] = ()
    call_helper_segment: str | None = None  # code: checked before loading like the library
    wiring: Wiring | None = None  # None: the library takes the inputs and gives the outputs in the method's order

    @property
    def library_signature(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """The library's inputs and outputs, in its own order."""
        if self.wiring is None:
            return self.inputs, self.outputs
        return tuple(self.inputs[index] for index in self.wiring.library_inputs), self.wiring.library_outputs

    def input(self, name: str) -> TensorSpec | None:
        return next((spec for spec in self.inputs if spec.name == name), None)

    @property
    def has_samples(self) -> bool:
        return self.sample_inputs_segment is not None


@dataclass(frozen=True)
class Manifest:
    methods: Mapping[str, MethodSpec]
    segments: tuple[SegmentEntry, ...] = ()
    build: Mapping[str, str] = field(default_factory=dict)
    metadata: Mapping[str, str] = field(default_factory=dict)
    required_features: tuple[str, ...] = ()
    optional_features: tuple[str, ...] = ()

    def segment(self, name: str) -> SegmentEntry | None:
        return self._segments_by_name.get(name)

    @functools.cached_property
    def _segments_by_name(self) -> dict[str, SegmentEntry]:
        # A dict, not a scan: constant tables have up to 65,536 segments, each looked up.
        return {entry.name: entry for entry in self.segments}

    def referenced_segments(self) -> list[str]:
        return [name for method in self.methods.values() for name in self._method_segments(method)]

    def segment_users(self) -> dict[str, list[str]]:
        """The methods that name each segment, in method order."""
        users: dict[str, list[str]] = {}
        for method in self.methods.values():
            for name in dict.fromkeys(self._method_segments(method)):
                users.setdefault(name, []).append(method.name)
        return users

    def shared_weights(self) -> dict[str, list[str]]:
        """Weight storages (constant-table segments or weights blobs) that several
        methods name: stored once, and one storage when the methods load together."""
        weights = {constant.segment for method in self.methods.values() for constant in method.constants}
        weights |= {method.weights_segment for method in self.methods.values() if method.weights_segment is not None}
        return {name: methods for name, methods in self.segment_users().items() if name in weights and len(methods) > 1}

    @staticmethod
    def _method_segments(method: MethodSpec) -> list[str]:
        names = [method.library_segment]
        names += sorted({constant.segment for constant in method.constants})
        for optional in (method.weights_segment, method.sample_inputs_segment, method.sample_outputs_segment, method.call_helper_segment):
            if optional is not None:
                names.append(optional)
        return names

    def to_json(self) -> dict[str, Any]:
        return {
            "required_features": list(self.required_features),
            "optional_features": list(self.optional_features),
            "build": dict(self.build),
            "metadata": dict(self.metadata),
            "segments": [dataclasses.asdict(entry) for entry in self.segments],
            "methods": {name: _method_to_json(method) for name, method in self.methods.items()},
        }


def _method_to_json(method: MethodSpec) -> dict[str, Any]:
    data: dict[str, Any] = {
        "device": {key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(method.device).items() if value not in (None, ())},
        "library_segment": method.library_segment,
        "weights_segment": method.weights_segment,
        "inputs": [_tensor_to_json(spec) for spec in method.inputs],
        "outputs": [_tensor_to_json(spec) for spec in method.outputs],
        "dims": {name: {"min": dim.min, "max": dim.max, "example": dim.example} for name, dim in method.dims.items()},
        "torch_version": method.torch_version,
        "compile_options": dict(method.compile_options),
    }
    if method.constants:
        data["constants"] = [
            {"fqn": item.fqn, "segment": item.segment, "dtype": item.dtype, "device": item.device,
             "storage_offset": item.storage_offset, "sizes": list(item.sizes), "strides": list(item.strides)}
            for item in method.constants
        ]
    if method.sample_inputs_segment is not None:
        data["sample_inputs_segment"] = method.sample_inputs_segment
        data["sample_outputs_segment"] = method.sample_outputs_segment
    if method.call_helper_segment is not None:
        data["call_helper_segment"] = method.call_helper_segment
    if method.wiring is not None:
        data["wiring"] = {
            "library_inputs": list(method.wiring.library_inputs),
            "library_outputs": [_tensor_to_json(spec) for spec in method.wiring.library_outputs],
            "outputs": [_source_to_json(source) for source in method.wiring.outputs],
        }
    return data


def _tensor_to_json(spec: TensorSpec) -> dict[str, Any]:
    data: dict[str, Any] = {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}
    if spec.bounds is not None:
        data["bounds"] = {"min": spec.bounds[0], "max": spec.bounds[1]}
    if spec.span_bounds is not None:
        data["span_bounds"] = {"min": spec.span_bounds[0], "max": spec.span_bounds[1]}
    return data


def choose_method(available: list[str], requested: str | None) -> str:
    """The requested method, or by default the only one there is, or 'forward'."""
    if requested is None:
        if len(available) == 1:
            return available[0]
        if "forward" in available:
            return "forward"
        raise InputError(f"the bundle has several methods ({', '.join(available)})", subject="method")
    if requested not in available:
        raise InputError(f"the bundle has no method {requested!r}; it has: {', '.join(available) or 'none'}", subject="method")
    return requested


def name_problem(name: object) -> str | None:
    """Why `name` is not acceptable as a method, segment, tensor or dim name."""
    if not isinstance(name, str):
        return "is not a string"
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"is longer than {MAX_NAME_LENGTH} characters"
    if _FORBIDDEN_IN_NAMES.search(name):
        return "contains a path separator or control character"
    if name in (".", ".."):
        return "is a relative path component"
    return None


def method_name_problem(name: object) -> str | None:
    """Why `name` cannot name a method (its segment names must stay valid names)."""
    problem = name_problem(name)
    if problem is None and isinstance(name, str) and len(name) > MAX_METHOD_NAME_LENGTH:
        return f"is longer than {MAX_METHOD_NAME_LENGTH} characters"
    return problem


# --------------------------------------------------------------------------
# Parsing. Each helper raises BundleError naming the offending field.


def manifest_from_json(data: Any) -> Manifest:
    obj = _object(data, "manifest")
    features = _features(obj)
    segments = tuple(_segment(item, f"segments[{i}]") for i, item in enumerate(_list(obj.get("segments", []), "segments", MAX_SEGMENTS)))
    methods_obj = _object(obj.get("methods"), "methods")
    if not methods_obj:
        raise BundleError("manifest field 'methods' is empty")
    if len(methods_obj) > MAX_METHODS:
        raise BundleError(f"manifest has more than {MAX_METHODS} methods")
    methods = {name: _method(_checked_method_name(name), value) for name, value in methods_obj.items()}
    manifest = Manifest(
        methods=methods,
        segments=segments,
        build=_string_map(obj.get("build", {}), "build"),
        metadata=_string_map(obj.get("metadata", {}), "metadata"),
        required_features=features[0],
        optional_features=features[1],
    )
    _check_references(manifest)
    if any(method.constants for method in methods.values()) and CONSTANT_TABLE not in manifest.required_features:
        raise BundleError(f"manifest has constant tables but does not list {CONSTANT_TABLE!r} in required_features")
    if any(method.wiring for method in methods.values()) and WIRING not in manifest.required_features:
        raise BundleError(f"manifest wires methods to their libraries but does not list {WIRING!r} in required_features")
    if any(uses_constant_outputs(method) for method in methods.values()) and CONSTANT_OUTPUTS not in manifest.required_features:
        raise BundleError(f"manifest has constant outputs but does not list {CONSTANT_OUTPUTS!r} in required_features")
    return manifest


def _features(obj: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    required = tuple(_string(item, "required_features[]") for item in _list(obj.get("required_features", []), "required_features", 64))
    optional = tuple(_string(item, "optional_features[]") for item in _list(obj.get("optional_features", []), "optional_features", 64))
    unknown = [name for name in required if name not in KNOWN_FEATURES]
    if unknown:
        raise BundleError(f"bundle requires feature {unknown[0]!r}, which this cuda-runner does not support; upgrade cuda-runner")
    return required, optional


def _check_references(manifest: Manifest) -> None:
    present = {entry.name: entry for entry in manifest.segments}
    for segment_name in manifest.referenced_segments():
        if segment_name not in present:
            raise BundleError(f"manifest refers to segment {segment_name!r}, which the bundle does not contain")
    for method in manifest.methods.values():
        for constant in method.constants:
            if constant_span_bytes(constant) > present[constant.segment].size:
                raise BundleError(f"method {method.name!r}: constant {constant.fqn[:80]!r} reaches past the end of segment {constant.segment!r}")


def constant_span_bytes(constant: ConstantSpec) -> int:
    """Bytes of its storage a constant view reaches, from the storage's start."""
    if not all(constant.sizes):
        return 0
    last = constant.storage_offset + sum((size - 1) * stride for size, stride in zip(constant.sizes, constant.strides))
    return (last + 1) * itemsize(constant.dtype)


def _segment(data: Any, where: str) -> SegmentEntry:
    obj = _object(data, where)
    digest = _string(obj.get("digest"), f"{where}.digest")
    if not _DIGEST_PATTERN.match(digest):
        raise BundleError(f"{where}.digest is not of the form '{DIGEST_ALGORITHM}:<32 hex digits>'")
    return SegmentEntry(
        name=_checked_name(obj.get("name"), f"{where}.name"),
        offset=_int(obj.get("offset"), f"{where}.offset", 0),
        size=_int(obj.get("size"), f"{where}.size", 0),
        digest=digest,
    )


def _method(name: str, data: Any) -> MethodSpec:
    where = f"methods.{name}"
    obj = _object(data, where)
    dims = _dims(obj.get("dims", {}), f"{where}.dims")
    weights = obj.get("weights_segment")
    sample_inputs = obj.get("sample_inputs_segment")
    sample_outputs = obj.get("sample_outputs_segment")
    helper = obj.get("call_helper_segment")
    if (sample_inputs is None) != (sample_outputs is None):
        raise BundleError(f"{where}: sample inputs and sample outputs must both be present or both absent")
    constants = tuple(_constant(item, f"{where}.constants[{i}]") for i, item in enumerate(_list(obj.get("constants", []), f"{where}.constants", MAX_CONSTANTS)))
    if constants and weights is not None:
        raise BundleError(f"{where}: a method has a weights segment or constants, not both")
    if len({item.fqn for item in constants}) != len(constants):
        raise BundleError(f"{where}.constants names a constant twice")
    inputs = _signature(obj.get("inputs"), f"{where}.inputs", dims)
    outputs = _signature(obj.get("outputs"), f"{where}.outputs", dims)
    wiring = None if obj.get("wiring") is None else _wiring(obj["wiring"], f"{where}.wiring", len(inputs), len(outputs), dims)
    if wiring is not None:
        _check_constant_outputs(outputs, wiring, f"{where}.wiring")
    return MethodSpec(
        name=name,
        wiring=wiring,
        device=_device(obj.get("device"), f"{where}.device"),
        library_segment=_checked_name(obj.get("library_segment"), f"{where}.library_segment"),
        weights_segment=None if weights is None else _checked_name(weights, f"{where}.weights_segment"),
        inputs=inputs,
        outputs=outputs,
        dims=dims,
        torch_version=_string(obj.get("torch_version"), f"{where}.torch_version"),
        compile_options=_object(obj.get("compile_options", {}), f"{where}.compile_options"),
        sample_inputs_segment=None if sample_inputs is None else _checked_name(sample_inputs, f"{where}.sample_inputs_segment"),
        sample_outputs_segment=None if sample_outputs is None else _checked_name(sample_outputs, f"{where}.sample_outputs_segment"),
        constants=constants,
        call_helper_segment=None if helper is None else _checked_name(helper, f"{where}.call_helper_segment"),
    )


def _wiring(data: Any, where: str, inputs: int, outputs: int, dims: Mapping[str, DimSpec]) -> Wiring:
    obj = _object(data, where)
    library_inputs = tuple(_int(item, f"{where}.library_inputs[]", 0) for item in _list(obj.get("library_inputs"), f"{where}.library_inputs", MAX_TENSORS_PER_SIGNATURE))
    if any(index >= inputs for index in library_inputs):
        raise BundleError(f"{where}.library_inputs names an input the method does not have")
    library_outputs = _signature(obj.get("library_outputs"), f"{where}.library_outputs", dims)
    sources = []
    for i, item in enumerate(_list(obj.get("outputs"), f"{where}.outputs", MAX_TENSORS_PER_SIGNATURE)):
        entry = _object(item, f"{where}.outputs[{i}]")
        kind = entry.get("from")
        if kind == "constant":
            sources.append(OutputSource(0, constant=_scalar_constant(entry.get("value"), f"{where}.outputs[{i}].value")))
            continue
        if kind not in ("input", "library"):
            raise BundleError(f"{where}.outputs[{i}].from must be 'input', 'library' or 'constant'")
        index = _int(entry.get("index"), f"{where}.outputs[{i}].index", 0)
        if index >= (inputs if kind == "input" else len(library_outputs)):
            raise BundleError(f"{where}.outputs[{i}] refers to a value that does not exist")
        sources.append(OutputSource(index, kind == "input"))
    if len(sources) != outputs:
        raise BundleError(f"{where}.outputs must give a source for each of the method's {outputs} outputs")
    return Wiring(library_inputs, library_outputs, tuple(sources))


def _source_to_json(source: OutputSource) -> dict[str, Any]:
    if source.from_constant:
        return {"from": "constant", "value": source.constant}
    return {"from": "input" if source.from_input else "library", "index": source.index}


def _scalar_constant(value: Any, where: str) -> int | float | bool:
    if isinstance(value, bool) or (isinstance(value, int) and -(1 << 63) <= value < (1 << 63)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise BundleError(f"manifest field {where!r} must be a boolean, a 64-bit integer or a finite number")


def constant_output_problem(spec: TensorSpec, value: int | float | bool) -> str | None:
    """Why a constant cannot be output `spec` (a 0-d array of its dtype), or None."""
    if spec.rank != 0:
        return f"output {spec.name!r} is a constant, so it must have rank 0, not {spec.rank}"
    # The dtypes of ExecuTorch's Bool, Int and Double values: every value of each fits.
    wanted = "bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else "float64"
    if spec.dtype != wanted:
        return f"output {spec.name!r} is a constant, so its dtype must be {wanted}, not {spec.dtype}"
    return None


def _check_constant_outputs(outputs: tuple[TensorSpec, ...], wiring: Wiring, where: str) -> None:
    for spec, source in zip(outputs, wiring.outputs):
        if source.constant is not None and (problem := constant_output_problem(spec, source.constant)) is not None:
            raise BundleError(f"{where}: {problem}")


def uses_constant_outputs(method: MethodSpec) -> bool:
    return method.wiring is not None and any(source.from_constant for source in method.wiring.outputs)


def _constant(data: Any, where: str) -> ConstantSpec:
    obj = _object(data, where)
    fqn = _string(obj.get("fqn"), f"{where}.fqn")
    if not 0 < len(fqn) <= MAX_FQN_LENGTH or any(ord(char) < 32 or 127 <= ord(char) < 160 for char in fqn):
        raise BundleError(f"manifest field {where + '.fqn'!r} must be 1 to {MAX_FQN_LENGTH} printable characters")
    dtype = _string(obj.get("dtype"), f"{where}.dtype")
    if dtype not in DTYPE_NAMES:
        raise BundleError(f"{where}.dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    device = _string(obj.get("device"), f"{where}.device")
    if device not in ("cpu", "cuda"):
        raise BundleError(f"{where}.device must be 'cpu' or 'cuda', not {device!r}")
    sizes = tuple(_int(item, f"{where}.sizes[]", 0) for item in _list(obj.get("sizes"), f"{where}.sizes", MAX_RANK))
    strides = tuple(_int(item, f"{where}.strides[]", 0) for item in _list(obj.get("strides"), f"{where}.strides", MAX_RANK))
    if len(sizes) != len(strides):
        raise BundleError(f"{where}: sizes and strides differ in length")
    return ConstantSpec(fqn, _checked_name(obj.get("segment"), f"{where}.segment"), dtype, device,
                        _int(obj.get("storage_offset"), f"{where}.storage_offset", 0), sizes, strides)


def _device(data: Any, where: str) -> DeviceSpec:
    obj = _object(data, where)
    kind = _string(obj.get("type"), f"{where}.type")
    if kind not in ("cpu", "cuda"):
        raise BundleError(f"{where}.type must be 'cpu' or 'cuda', not {kind!r}")
    capability = obj.get("compute_capability")
    if capability is not None and not re.fullmatch(r"\d{1,3}\.\d{1,3}", _string(capability, f"{where}.compute_capability")):
        raise BundleError(f"{where}.compute_capability must look like '9.0'")
    isa = obj.get("cpu_isa")
    flags = _list(obj.get("cpu_flags", []), f"{where}.cpu_flags", 512)
    return DeviceSpec(
        type=kind,
        compute_capability=capability,
        cpu_isa=None if isa is None else _string(isa, f"{where}.cpu_isa"),
        cpu_flags=tuple(_checked_name(flag, f"{where}.cpu_flags[]") for flag in flags),
    )


def _dims(data: Any, where: str) -> dict[str, DimSpec]:
    obj = _object(data, where)
    dims = {}
    for name, value in obj.items():
        _checked_name(name, f"{where} key")
        spec = _object(value, f"{where}.{name}")
        low = _int(spec.get("min"), f"{where}.{name}.min", 0)
        high = spec.get("max")
        if high is not None:
            high = _int(high, f"{where}.{name}.max", low)
        example = spec.get("example")
        if example is not None:
            example = _int(example, f"{where}.{name}.example", 0)
        dims[name] = DimSpec(name=name, min=low, max=high, example=example)
    return dims


def _signature(data: Any, where: str, dims: Mapping[str, DimSpec]) -> tuple[TensorSpec, ...]:
    items = _list(data, where, MAX_TENSORS_PER_SIGNATURE)
    specs = tuple(_tensor(item, f"{where}[{i}]") for i, item in enumerate(items))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise BundleError(f"{where} has duplicate names")
    if not where.endswith(".inputs") and any(spec.bounds is not None or spec.span_bounds is not None for spec in specs):
        raise BundleError(f"{where} gives bounds for an output; only inputs have them")
    return specs


def _tensor(data: Any, where: str) -> TensorSpec:
    obj = _object(data, where)
    dtype = _string(obj.get("dtype"), f"{where}.dtype")
    if dtype not in DTYPE_NAMES:
        raise BundleError(f"{where}.dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    shape: list[ShapeEntry] = []
    for axis, entry in enumerate(_list(obj.get("shape"), f"{where}.shape", MAX_RANK)):
        if isinstance(entry, str):
            if len(entry) > MAX_EXPRESSION_LENGTH or not _EXPRESSION_PATTERN.match(entry) or entry.lstrip().startswith("-"):
                raise BundleError(f"{where}.shape[{axis}] is not a valid dimension expression")
            shape.append(entry)
        else:
            shape.append(_int(entry, f"{where}.shape[{axis}]", 0))
    problem = span_problem([entry for entry in shape if isinstance(entry, int)], itemsize(dtype))
    if problem is not None:
        raise BundleError(f"manifest field {where + '.shape'!r} {shape_text(shape)}: {problem}")
    bounds = _bounds(obj.get("bounds", _ABSENT), f"{where}.bounds", dtype)
    span_bounds = _bounds(obj.get("span_bounds", _ABSENT), f"{where}.span_bounds", dtype)
    return TensorSpec(name=_checked_name(obj.get("name"), f"{where}.name"), dtype=dtype, shape=tuple(shape), bounds=bounds,
                      span_bounds=span_bounds)


def _bounds(data: Any, where: str, dtype: str) -> tuple[int, int] | None:
    """An integer tensor's accepted values: {"min": low, "max": high}, both held by its dtype."""
    if data is _ABSENT:
        return None
    if dtype not in _BOUNDED_DTYPES:
        raise BundleError(f"manifest field {where!r} is given for a {dtype} tensor; only int32 and int64 tensors have bounds")
    obj = _object(data, where)
    if set(obj) != {"min", "max"}:
        raise BundleError(f"manifest field {where!r} must hold exactly 'min' and 'max'")
    low, high = (_signed_int(obj.get(key), f"{where}.{key}") for key in ("min", "max"))
    lowest, highest = _BOUNDED_DTYPES[dtype]
    if not lowest <= low <= high <= highest:
        raise BundleError(f"manifest field {where!r} [{low}, {high}] is empty or outside what {dtype} holds")
    return low, high


def _signed_int(data: Any, where: str) -> int:
    if not isinstance(data, int) or isinstance(data, bool):
        raise BundleError(f"manifest field {where!r} must be an integer")
    return data


def _object(data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise BundleError(f"manifest field {where!r} must be an object")
    return data


def _list(data: Any, where: str, limit: int) -> list:
    if not isinstance(data, list):
        raise BundleError(f"manifest field {where!r} must be a list")
    if len(data) > limit:
        raise BundleError(f"manifest field {where!r} has more than {limit} entries")
    return data


def _string(data: Any, where: str) -> str:
    if not isinstance(data, str):
        raise BundleError(f"manifest field {where!r} must be a string")
    return data


def _int(data: Any, where: str, minimum: int) -> int:
    if not isinstance(data, int) or isinstance(data, bool):
        raise BundleError(f"manifest field {where!r} must be an integer")
    if data < minimum or data >= 1 << 63:
        raise BundleError(f"manifest field {where!r} is out of range")
    return data


def _checked_method_name(data: Any) -> str:
    problem = method_name_problem(data)
    if problem:
        raise BundleError(f"manifest method name {str(data)[:40]!r} {problem}")
    return str(data)


def _checked_name(data: Any, where: str) -> str:
    problem = name_problem(data)
    if problem:
        raise BundleError(f"manifest field {where!r} {problem}")
    return data


def _string_map(data: Any, where: str) -> dict[str, str]:
    obj = _object(data, where)
    if len(obj) > MAX_METADATA_ENTRIES:
        raise BundleError(f"manifest field {where!r} has more than {MAX_METADATA_ENTRIES} entries")
    for key, value in obj.items():
        _checked_name(key, f"{where} key")
        if len(_string(value, f"{where}.{key}")) > MAX_METADATA_VALUE_LENGTH:
            raise BundleError(f"manifest field {where}.{key} is longer than {MAX_METADATA_VALUE_LENGTH} characters")
    return dict(obj)
