"""An ExecuTorch CUDA program (`.pte` + `.ptd`) seen as a bundle.

`ProgramReader` reads the program with executorch.py, checks that every
method is one CudaBackend delegate call (optionally between ExecuTorch's
host/device copies), and presents it through the same interface as
BundleReader: a Manifest, and segments by name. The runtime, `inspect`,
`run`, `bench` and `convert` then treat it like any bundle.

What the program does not record is made up in a fixed, documented way:
inputs are named `input_<i>` and outputs `output_<i>` by their position in
the method; the dims of a dynamic tensor are named `<tensor>_d<axis>` with
the program's upper bound as max and example (the program gives no minimum,
so 1), and the library's own input checks are kept on for such methods.

Integrity: the program carries no digests. Where a key is a SHA-256
(`<sha256>_so_blob`, ExecuTorch 1.4 on), the bytes are checked against it:
the library always, before it is loaded; weights while they load.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BundleError, IncompatibleBundleError, InputError
from ..files import open_regular
from . import executorch as et
from .digest import OneCheckEach, segment_digest
from .elf import LibraryFacts, read_library_facts
from .manifest import (
    CONSTANT_OUTPUTS,
    CONSTANT_TABLE,
    MUTATED_INPUTS_OPTION,
    WIRING,
    ConstantSpec,
    DeviceSpec,
    DimSpec,
    Manifest,
    MethodSpec,
    OutputSource,
    SegmentEntry,
    ShapeEntry,
    TensorSpec,
    Wiring,
    method_name_problem,
    uses_constant_outputs,
)
from .signing import SignedFile, TrustedKey

NO_DIGEST = "none"
# ExecuTorch's own CUDA kernels, which libtorch does not provide (quantized matmuls).
EXECUTORCH_ONLY_SHIMS = tuple(f"aoti_torch_cuda_int{bits}_plain_mm" for bits in (4, 5, 6, 8))


@dataclass(frozen=True)
class StoredBytes:
    """Where a segment's bytes are, and the SHA-256 its key promises (if any)."""

    span: et.Span
    key: str
    sha256: str | None = None


@dataclass
class ProgramMethodInfo:
    """What `inspect` shows about a method beyond its manifest entry."""

    layout: et.PayloadLayout
    instructions: list[str]
    compile_specs: dict[str, str]
    keys: dict[str, str]  # role -> named-data key
    library: LibraryFacts
    weights_bytes: int
    weight_count: int = 0


@dataclass
class ProgramInfo:
    data_path: Path | None
    methods: dict[str, ProgramMethodInfo] = field(default_factory=dict)
    constant_methods: dict[str, list[int | float | bool | None]] = field(default_factory=dict)  # name -> the values it returns


class ProgramReader:
    """A `.pte` (and its `.ptd`) opened for reading, memory-mapped, every method checked."""

    format_name = "ExecuTorch program"

    def __init__(self, path: str | os.PathLike[str], data: str | os.PathLike[str] | None = None):
        self.path = Path(path)
        self.signature: SignedFile | None = None  # programs carry none
        self._files: dict[str, BinaryIO] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._stored: dict[str, StoredBytes] = {}
        self._segment_of: dict[tuple[str, et.Span], str] = {}  # (key, span) -> segment name: shared storages
        self._weight_segments = 0
        self._decoded = 0  # payload bytes decoded, over all methods
        self._verified: set[str] = set()
        self._checks = OneCheckEach()
        self._identity: str | None = None
        try:
            self._open(None if data is None else Path(data))
        except BaseException:
            self.close()
            raise

    def _open(self, data_path: Path | None) -> None:
        program = et.read_program(self._map("pte", self.path))
        self.file_size = program.file_size
        if data_path is None:
            data_path = self._data_file_beside()
        data_file = None
        if data_path is not None:
            data_file = et.read_data_file(self._map("ptd", data_path))
        self.data_path = data_path
        self.info = ProgramInfo(data_path)
        lookup = _KeyLookup(program, data_file, self.path, data_path)
        methods = {name: self._method(plan, lookup) for name, plan in program.plans.items() if not plan.is_constant}
        # Constant methods (get_max_seq_len, use_kv_cache, ...) run no code: their values are shown, not run.
        self.info.constant_methods = {
            name: [plan.scalars[value] for value in plan.outputs] for name, plan in program.plans.items() if plan.is_constant
        }
        if not methods:
            raise BundleError("program: it has no method that runs code, only constant methods")
        segments = tuple(
            SegmentEntry(name, stored.span.offset, stored.span.size, f"sha256:{stored.sha256}" if stored.sha256 else NO_DIGEST)
            for name, stored in self._stored.items()
        )
        features = [name for name, used in ((CONSTANT_TABLE, any(method.constants for method in methods.values())),
                                            (WIRING, any(method.wiring for method in methods.values())),
                                            (CONSTANT_OUTPUTS, any(uses_constant_outputs(method) for method in methods.values()))) if used]
        self.manifest = Manifest(methods=methods, segments=segments, build={"source": "executorch"}, required_features=tuple(features))

    def _map(self, role: str, path: Path) -> memoryview:
        handle = open_regular(path, "an ExecuTorch program" if role == "pte" else "an ExecuTorch data file", not_regular=BundleError)
        self._files[role] = handle
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            raise BundleError(f"{path} is empty")
        self._maps[role] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(self._maps[role])

    def _data_file_beside(self) -> Path | None:
        """The program's data file when it needs one: ExecuTorch names it after the
        CUDA backend's external tag, next to the program."""
        for name in et.DATA_FILE_NAMES:
            candidate = self.path.parent / name
            if candidate.is_file():
                return candidate
        return None

    # -- building the manifest ------------------------------------------------

    def _method(self, plan: et.Plan, lookup: _KeyLookup) -> MethodSpec:
        problem = method_name_problem(plan.name)
        if problem:
            raise BundleError(f"program: method name {plan.name[:40]!r} {problem}")
        wired = _delegate_signature(plan)
        delegate = wired.delegate
        # Methods may share one payload; decoding it again and again is refused past the file's size.
        self._decoded += len(delegate.processed)
        if self._decoded > 2 * self.file_size + (1 << 20):
            raise BundleError("program: its methods decode the same delegate payload over and over")
        payload = et.decode_payload(delegate.processed, delegate.spec_text("method_name") or plan.name)
        library = self._store(f"{plan.name}_so_blob", lookup.require(payload.library_key, "model library"))
        facts = read_library_facts(self._view(library))
        _refuse_foreign_kernels(plan.name, facts)
        weights_segment: str | None = None
        constants: tuple[ConstantSpec, ...] = ()
        weights_bytes = 0
        if payload.layout is et.PayloadLayout.G3:
            constants = tuple(self._constant(plan.name, view, lookup) for view in payload.weights)
            weights_bytes = sum(self._stored[name].span.size for name in {item.segment for item in constants})
        elif payload.weights_key is not None:
            # G1 names its weights by convention, so a model without weights has no such key;
            # without any data file, though, the weights are more likely just not found.
            optional = payload.layout is et.PayloadLayout.G1 and lookup.has_data_file
            weights = lookup.find(payload.weights_key, "weights", required=not optional)
            if weights is not None:
                weights_segment = self._store(f"{plan.name}_weights_blob", weights)
                weights_bytes = weights.span.size
        dims: dict[str, DimSpec] = {}
        signature_in = tuple(_tensor_spec(f"input_{position}", tensor, dims) for position, tensor in enumerate(wired.inputs))
        label = "output" if wired.straight else "library_output"  # a straight method's outputs are the library's
        library_out = tuple(_tensor_spec(f"{label}_{index}", tensor, dims) for index, tensor in enumerate(wired.library_outputs))
        signature_out = tuple(_output_spec(f"output_{position}", source, signature_in, library_out) for position, (source, _) in enumerate(wired.outputs))
        wiring = _wiring_if_needed(wired, library_out)
        specs = {key: value.decode("utf-8", "replace") for key, value in delegate.specs.items()}
        # The library's own input checks stay off, as in ExecuTorch: they
        # compare the stride of every dim literally, so a size-1 dim exported
        # from a slice ([1, 5] of [1, 8]) refuses every contiguous input. What
        # the runner checks is what ExecuTorch checks: dtype, rank and the
        # program's upper bounds (docs/executorch.md).
        options: dict[str, Any] = {
            "executorch_payload_layout": payload.layout.value, "executorch_compile_specs": specs,
            MUTATED_INPUTS_OPTION: [],  # a delegate never writes a method input: ExecuTorch copies outside it
        }
        self.info.methods[plan.name] = ProgramMethodInfo(
            payload.layout, [item.describe(list(plan.delegates)) for item in plan.instructions], specs,
            {"library": payload.library_key, **({"weights": payload.weights_key} if weights_segment and payload.weights_key else {})},
            facts, weights_bytes, len(constants),
        )
        return MethodSpec(
            name=plan.name, device=_device(facts), library_segment=library, weights_segment=weights_segment,
            inputs=signature_in, outputs=signature_out, dims=dims, torch_version="unknown (not recorded in ExecuTorch programs)",
            compile_options=options, constants=constants, wiring=wiring,
        )

    def _constant(self, method: str, view: et.WeightView, lookup: _KeyLookup) -> ConstantSpec:
        stored = lookup.require(view.storage_key, f"weight {view.fqn!r}")
        if stored.span.size != view.storage_nbytes:
            raise BundleError(f"program: weight {view.fqn[:80]!r} should have {view.storage_nbytes} bytes of storage but its data has {stored.span.size}")
        segment = self._segment_of.get((stored.key, stored.span))
        if segment is None:
            segment = self._store(f"weight_{self._weight_segments:05d}", stored)
            self._weight_segments += 1
            self._segment_of[stored.key, stored.span] = segment
        return ConstantSpec(
            fqn=view.fqn, segment=segment, dtype=et.DTYPES_BY_CODE[view.dtype_code], device="cuda" if view.on_cuda else "cpu",
            storage_offset=view.storage_offset, sizes=view.sizes, strides=view.strides,
        )

    def _store(self, name: str, stored: StoredBytes) -> str:
        if name in self._stored:
            raise BundleError(f"program: two methods would share the segment name {name!r}")
        self._stored[name] = stored
        return name

    # -- the reader interface -------------------------------------------------

    def identity(self) -> str:
        """The digest of the program's bytes and its data file's: a program
        carries no digests of its own to name it by."""
        if self._identity is None:
            parts = [f"{role}={segment_digest(memoryview(self._maps[role]))}" for role in ("pte", "ptd") if role in self._maps]
            self._identity = f"program:{segment_digest(';'.join(parts).encode())}"
        return self._identity

    @property
    def version(self) -> str:
        return "ET12"

    def _view(self, name: str) -> memoryview:
        stored = self._stored.get(name)
        if stored is None:
            raise BundleError(f"program has no segment {name!r}")
        mapping = self._maps.get(stored.span.source)
        if mapping is None:
            raise BundleError("program is closed")
        return memoryview(mapping)[stored.span.offset:stored.span.offset + stored.span.size]

    def segment(self, name: str, *, verify: bool = True) -> memoryview:
        view = self._view(name)
        if verify and name not in self._verified:
            self._check(name, view)
        return view

    def read_verified(self, name: str) -> bytes:
        data = bytes(self._view(name))
        self._check(name, data)
        return data

    def _check(self, name: str, data: bytes | memoryview) -> None:
        expected = self._stored[name].sha256
        if expected is not None and hashlib.sha256(data).hexdigest() != expected:
            raise BundleError(f"program: {self._stored[name].key[:80]!r} is damaged: its SHA-256 does not match its key")
        self._verified.add(name)

    def verify_in_background(self, name: str) -> Future[None]:
        return self._checks.start(name, self._check, name, self._view(name))

    def verify_all(self) -> dict[str, bool]:
        """{segment: ok} for every segment whose key is a SHA-256; the others cannot be checked."""
        results = {}
        for name in (name for name, stored in self._stored.items() if stored.sha256 is not None):
            self._verified.discard(name)
            self._checks.forget(name)
            try:
                self.segment(name, verify=True)
                results[name] = True
            except BundleError:
                results[name] = False
        return results

    def require_signature(self, keys: Sequence[TrustedKey]) -> SignedFile:
        raise BundleError("ExecuTorch programs carry no signature; convert the program to a bundle and sign that (cuda-runner convert, cuda-runner sign)")

    def close(self) -> None:
        for mapping in self._maps.values():
            try:
                mapping.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
        self._maps.clear()
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> ProgramReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _KeyLookup:
    """Named data by key: the data file first, then the program, as ExecuTorch looks them up."""

    def __init__(self, program: et.Program, data_file: et.DataFile | None, path: Path, data_path: Path | None):
        self._program = program.named_data
        self._data = data_file.named_data if data_file is not None else {}
        self._path = path
        self._data_path = data_path

    @property
    def has_data_file(self) -> bool:
        return self._data_path is not None

    def find(self, key: str, role: str, *, required: bool = True) -> StoredBytes | None:
        in_data, in_program = self._data.get(key), self._program.get(key)
        if in_data is not None and in_program is not None:
            raise BundleError(f"program: the key {key[:80]!r} ({role}) is in both the program and the data file")
        span = in_data or in_program
        if span is None:
            if not required:
                return None
            if self._data_path is None:
                raise InputError(
                    f"the program keeps its {role} in a data file ({et.DEFAULT_DATA_FILE} by default), and none is next to {self._path.name}",
                    subject="data",
                )
            raise BundleError(f"program: its {role} (key {key[:80]!r}) is in neither {self._path.name} nor {self._data_path.name}")
        return StoredBytes(span, key, et.sha256_of_key(key))

    def require(self, key: str, role: str) -> StoredBytes:
        found = self.find(key, role)
        assert found is not None  # find raises for a required key
        return found


@dataclass(frozen=True)
class _DelegateSignature:
    delegate: et.Delegate
    inputs: list[et.ValueTensor]  # the method's inputs, in its order
    library_inputs: list[int]  # the method input each library input takes
    library_outputs: list[et.ValueTensor]
    outputs: list[tuple[OutputSource, et.ValueTensor | None]]  # each method output: its source, and its tensor (None: a constant)

    @property
    def straight(self) -> bool:
        """The library takes every input and gives every output in the method's order."""
        return self.library_inputs == list(range(len(self.inputs))) and [
            (source.index, source.from_input, source.from_constant) for source, _ in self.outputs] == [
            (index, False, False) for index in range(len(self.library_outputs))]


def _delegate_signature(plan: et.Plan) -> _DelegateSignature:
    """The method's one CUDA delegate, and how values flow between the method and
    it, by value: ExecuTorch passes the delegate the values it needs in its own
    order, and a method may return a delegate output twice, or one of its inputs."""
    if plan.chains != 1:
        raise BundleError(f"program: method {plan.name!r} has {plan.chains} chains; only one delegate call can run here")
    calls = [item for item in plan.instructions if item.kind == "delegate call"]
    if len(calls) != 1:
        if not calls and all(plan.values[value] is None for value in plan.outputs):
            raise BundleError(f"program: method {plan.name!r} returns constants only and runs no code (a constant method; inspect shows its values)")
        raise BundleError(f"program: method {plan.name!r} makes {len(calls)} delegate calls; only methods that are one CudaBackend call can run here")
    call = calls[0]
    if not 0 <= call.index < len(plan.delegates):
        raise BundleError(f"program: method {plan.name!r} calls delegate {call.index}, but it has {len(plan.delegates)}")
    delegate = plan.delegates[call.index]
    if delegate.backend != et.CUDA_BACKEND:
        raise BundleError(f"program: method {plan.name!r} is lowered to {delegate.backend[:60]!r}; only {et.CUDA_BACKEND} programs can run here")
    to_device, to_host = _copies(plan, calls[0])
    input_position = {value: position for position, value in enumerate(plan.inputs)}
    inputs = []
    for position, value in enumerate(plan.inputs):
        tensor = plan.values[value]
        if tensor is None:
            raise BundleError(f"program: method {plan.name!r} takes a non-tensor input {position}, which is not supported")
        inputs.append(tensor)
    # The delegate's arguments are its inputs, then its outputs: the inputs are
    # the leading arguments that are method inputs (through a host-to-device copy).
    arguments = list(call.args)
    split = 0
    while split < len(arguments) and to_device.get(arguments[split], arguments[split]) in input_position:
        split += 1
    library_inputs = [input_position[to_device.get(value, value)] for value in arguments[:split]]
    library_outputs: list[et.ValueTensor] = []
    produced: dict[int, int] = {}  # method-side value -> library output index
    for value in arguments[split:]:
        tensor = plan.values[value]
        if tensor is None:
            raise BundleError(f"program: method {plan.name!r} gives the delegate a non-tensor argument, which is not supported")
        produced.setdefault(to_host.get(value, value), len(library_outputs))
        library_outputs.append(tensor)
    outputs: list[tuple[OutputSource, et.ValueTensor | None]] = []
    for position, value in enumerate(plan.outputs):
        tensor = plan.values[value]
        if value in produced:
            outputs.append((OutputSource(produced[value]), tensor or library_outputs[produced[value]]))
        elif value in input_position and tensor is not None:
            outputs.append((OutputSource(input_position[value], from_input=True), tensor))
        elif tensor is None and plan.scalars.get(value) is not None:
            constant = plan.scalars[value]
            if isinstance(constant, float) and not math.isfinite(constant):
                raise BundleError(f"program: method {plan.name!r} returns the constant {constant} as output {position}, which a bundle cannot hold")
            outputs.append((OutputSource(0, constant=constant), None))
        else:
            what = "a None value" if tensor is None and value in plan.scalars else "a non-tensor value" if tensor is None else "a tensor the delegate does not produce"
            raise BundleError(f"program: method {plan.name!r} returns {what} as output {position}, which cannot run here")
    return _DelegateSignature(delegate, inputs, library_inputs, library_outputs, outputs)


def _copies(plan: et.Plan, call: et.Instruction) -> tuple[dict[int, int], dict[int, int]]:
    """ExecuTorch's host->device copies before the call and device->host copies
    after it; any other instruction means the method is not one delegate call."""
    to_device: dict[int, int] = {}  # device value -> host source
    to_host: dict[int, int] = {}  # device value -> host destination
    position = plan.instructions.index(call)
    for index, item in enumerate(plan.instructions):
        if item is call:
            continue
        copy = et.H2D_COPY if index < position else et.D2H_COPY
        if item.kind != "kernel call" or item.target != copy or len(item.args) < 2:
            raise BundleError(
                f"program: method {plan.name!r} runs {item.describe(list(plan.delegates))} outside the CUDA delegate; "
                "only methods that are one CudaBackend call (with ExecuTorch's host/device copies) can run here"
            )
        source, destination = item.args[0], item.args[-1]
        if copy == et.H2D_COPY:
            to_device[destination] = source
        else:
            to_host[source] = destination
    return to_device, to_host


def _output_spec(name: str, source: OutputSource, inputs: tuple[TensorSpec, ...], library_outputs: tuple[TensorSpec, ...]) -> TensorSpec:
    """A method output's spec: a constant is a 0-d array of ExecuTorch's dtype for its kind."""
    if source.constant is not None:
        constant = source.constant
        return TensorSpec(name, "bool" if isinstance(constant, bool) else "int64" if isinstance(constant, int) else "float64", ())
    return _renamed(inputs[source.index] if source.from_input else library_outputs[source.index], name)


def _tensor_spec(name: str, tensor: et.ValueTensor, dims: dict[str, DimSpec]) -> TensorSpec:
    dtype = tensor.dtype
    if dtype is None:
        raise BundleError(f"program: {name} has dtype code {tensor.dtype_code}, which is not supported")
    if tensor.dynamism is et.Dynamism.STATIC:
        return TensorSpec(name, dtype, tuple(tensor.sizes))
    shape: list[ShapeEntry] = []
    for axis, bound in enumerate(tensor.sizes):
        dim = f"{name}_d{axis}"
        unbounded = tensor.dynamism is et.Dynamism.DYNAMIC_UNBOUND
        dims[dim] = DimSpec(dim, min=min(1, bound), max=None if unbounded else bound, example=bound)
        shape.append(dim)
    return TensorSpec(name, dtype, tuple(shape))


def _renamed(spec: TensorSpec, name: str) -> TensorSpec:
    return TensorSpec(name, spec.dtype, spec.shape)


def _wiring_if_needed(wired: _DelegateSignature, library_outputs: tuple[TensorSpec, ...]) -> Wiring | None:
    if wired.straight:
        return None
    return Wiring(tuple(wired.library_inputs), library_outputs, tuple(source for source, _ in wired.outputs))


def _device(facts: LibraryFacts) -> DeviceSpec:
    if facts.uses_cuda:
        return DeviceSpec("cuda", compute_capability=facts.compute_capability)
    return DeviceSpec("cpu")


def _refuse_foreign_kernels(method: str, facts: LibraryFacts) -> None:
    foreign = [name for name in facts.shim_symbols if name in EXECUTORCH_ONLY_SHIMS]
    if foreign:
        raise IncompatibleBundleError(
            f"program: method {method!r} uses ExecuTorch-only kernels ({', '.join(foreign)}), which libtorch does not provide"
        )



def convert_program(reader: ProgramReader, destination: str | os.PathLike[str], call_helper: bytes | None = None) -> Path:
    """Write the program as a bundle: the same library and weight bytes, each
    segment digested, the signature and ExecuTorch details in the manifest.
    SHA-256 keys are checked on the way. `call_helper`: the built call helper
    to store with every method (cuda_runner.compile.helper)."""
    from ..version import __version__
    from .bundle import write_bundle
    from .manifest import CALL_HELPER

    segments: dict[str, bytes | memoryview] = {entry.name: reader.segment(entry.name, verify=True) for entry in reader.manifest.segments}
    methods = dict(reader.manifest.methods)
    optional: tuple[str, ...] = ()
    if call_helper is not None:
        name = _unused_segment_name("call_helper_so", segments)
        segments[name] = call_helper
        methods = {key: replace(spec, call_helper_segment=name) for key, spec in methods.items()}
        optional = (CALL_HELPER,)
    manifest = Manifest(
        methods=methods,
        build={"source": "executorch", "converted_by": f"cuda-runner {__version__}"},
        metadata={
            "executorch_program": reader.path.name[:4096],
            **({"executorch_data": reader.data_path.name[:4096]} if reader.data_path else {}),
            **({"executorch_constant_methods": json.dumps(reader.info.constant_methods)[:4096]} if reader.info.constant_methods else {}),
        },
        required_features=reader.manifest.required_features,
        optional_features=optional,
    )
    try:
        return write_bundle(destination, manifest, segments)
    finally:
        for view in segments.values():
            if isinstance(view, memoryview):
                view.release()


def _unused_segment_name(wanted: str, taken: Mapping[str, object]) -> str:
    name, counter = wanted, 1
    while name in taken:
        name, counter = f"{wanted}_{counter}", counter + 1
    return name
