"""Weights shared by several methods of one bundle, stored once (docs/bundle-format.md, "Shared weights").

Each method is compiled on its own, so each library gets its own weights
blob, even where the methods were exported from one module and read the same
parameters. Here the blobs are split into one storage per constant, bound by
its original name (FQN) with the `constant-table` feature, and a storage that
several methods hold alike becomes one segment that every one of them names:
the bundle stores it once, and the runtime, which keeps one copy of each
segment per loaded Model, uploads it once.

What the library holds is not guessed from the module. The library itself
says which constants it has, in which order, under which FQN, with which
dtype and how many bytes each takes in the blob (it is loaded here, on the
compile device, to be asked); the blob is cut at those sizes; and the
exported program supplies the sizes, strides and storage offset of the
tensor of that FQN, used only where its dtype matches, its storage fits the
library's slot, and its storage bytes have the digest of the blob's slice.
AOTInductor may rename a constant, fold it into the code (it is then not a
constant and not in the blob), or make new ones (folded or transformed
weights, which have no FQN in the program): a method whose library has a
constant that cannot be tied to the program that way keeps its blob and
shares nothing. A buffer several methods hold alike (a KV cache that a
prefill and a decode method both write and read) is one storage too, as
ExecuTorch programs share their mutable buffers by name: what one method
writes the next reads, and a reset puts it back for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..arrays import SCALAR_TYPE_CODES, torch_dtype_name
from ..errors import CudaRunnerError
from ..format.digest import segment_digest
from ..format.manifest import CONSTANT_TABLE, MUTATED_BUFFERS_OPTION, ConstantSpec, MethodSpec

_DTYPES_BY_CODE = {code: name for name, code in SCALAR_TYPE_CODES.items()}


@dataclass(frozen=True)
class LibraryConstant:
    """What a model library says about one constant it takes from its blob."""

    fqn: str
    dtype_code: int
    nbytes: int  # its slot in the blob (the storage, padded as AOTInductor pads it)


@dataclass(frozen=True)
class StoredConstant:
    """One constant of a method as it will be bound: a view of its own storage bytes."""

    spec: ConstantSpec  # `segment` is filled in when segments are named
    data: memoryview  # the blob's slice for it
    digest: str
    mutated: bool  # a buffer the method writes to (shared like any constant held alike: state shared by name)

    @property
    def key(self) -> tuple[Any, ...]:
        """What must agree for two methods to hold one storage."""
        spec = self.spec
        return (spec.fqn, spec.dtype, spec.device, spec.storage_offset, spec.sizes, spec.strides, self.data.nbytes, self.digest)


def library_constants(library: bytes, device: str) -> list[LibraryConstant]:
    """The blob constants of a compiled library, in blob order: the library is
    loaded (on the compile device) and asked."""
    with _asked(library, device) as container:
        return [LibraryConstant(info.fqn, info.dtype_code, info.nbytes) for info in container.constants() if not info.folded]


def library_buffers(library: bytes, device: str) -> frozenset[str] | None:
    """The original names of a compiled library's buffer constants (module
    buffers, and those the compiler makes, such as frozen parameters); None
    where the library cannot say."""
    with _asked(library, device) as container:
        return container.buffer_fqns()


@contextlib.contextmanager
def _asked(library: bytes, device: str) -> Iterator[Any]:
    """A container of the library, loaded on the compile device, to be asked about its constants."""
    from ..runtime.container import Container
    from ..runtime.library import lease_library
    from ..runtime.providers import bind_library

    provider, bound = bind_library(library, "cpu" if device == "cpu" else "cuda")
    lease = lease_library(bound, "compile-time constant query", bound_to=provider.name)
    try:
        container = Container(lease.library, device)
        try:
            yield container
        finally:
            container.delete()
    finally:
        lease.release()


def program_tensors(program: Any) -> dict[str, Any]:
    """The exported program's parameters, buffers and lifted constants by FQN."""
    tensors = dict(program.state_dict)
    for name, value in getattr(program, "constants", {}).items():
        if hasattr(value, "untyped_storage"):  # not script objects
            tensors.setdefault(name, value)
    return tensors


def lifted_constants(program: Any) -> dict[str, Any]:
    """The exported program's lifted constants (tensors its code made, torch.tensor([...]))."""
    return {name: value for name, value in getattr(program, "constants", {}).items() if hasattr(value, "untyped_storage")}


def split_blob(constants: Sequence[LibraryConstant], blob: bytes | memoryview, tensors: Mapping[str, Any], mutated: frozenset[str] = frozenset(),
               lifted: Mapping[str, Any] | None = None) -> list[StoredConstant] | str:
    """The blob cut into one storage per constant, each described by the
    program's tensor of that FQN; or why it cannot be (the method keeps its blob).
    A constant the compiler renamed (Inductor calls the program's lifted
    constants _tensor_constant0, ...) is described by the one tensor of
    `lifted` whose bytes it holds, where exactly one has them."""
    view = memoryview(blob).cast("B")
    stored = []
    cursor = 0
    for constant in constants:
        name = repr(constant.fqn[:80])
        if cursor + constant.nbytes > len(view):
            return f"the library's constants run past the end of its weights blob at {name}"
        tensor = tensors.get(constant.fqn)
        if tensor is None:
            tensor = _holding_the_bytes(view[cursor:cursor + constant.nbytes], constant.dtype_code, (lifted or {}).values())
        if tensor is None:
            return f"the library's constant {name} is not a tensor of the exported program (renamed or made by the compiler)"
        try:
            dtype = torch_dtype_name(tensor.dtype)
        except CudaRunnerError:
            return f"constant {name} has dtype {tensor.dtype}"
        if _DTYPES_BY_CODE.get(constant.dtype_code) != dtype:
            return f"constant {name} is {dtype} in the program but has dtype code {constant.dtype_code} in the library"
        if getattr(tensor, "is_mkldnn", False) or str(tensor.layout) != "torch.strided":
            return f"constant {name} is not a plain strided tensor"
        if tensor.storage_offset():
            return f"constant {name} is a view into its storage (the library reads its slot from the view's first element)"
        storage = tensor.detach().untyped_storage()
        size = storage.nbytes()
        if size > constant.nbytes or tensor.numel() == 0:
            return f"constant {name}: its storage does not fill the library's slot of {constant.nbytes} bytes"
        piece = view[cursor:cursor + constant.nbytes]
        cursor += constant.nbytes
        if segment_digest(_storage_bytes(tensor, storage)) != segment_digest(piece[:size]) or piece[size:].tobytes().count(0) != constant.nbytes - size:
            return f"constant {name}: the library's bytes are not the program's (the compiler transformed it)"
        spec = ConstantSpec(
            fqn=constant.fqn, segment="", dtype=dtype, device="cpu" if tensor.device.type == "cpu" else "cuda",
            storage_offset=0, sizes=tuple(int(size) for size in tensor.shape), strides=tuple(int(stride) for stride in tensor.stride()),
        )
        stored.append(StoredConstant(spec, piece, segment_digest(piece), constant.fqn in mutated))
    if cursor != len(view):
        return f"the weights blob holds {len(view) - cursor} bytes past the library's constants"
    return stored


def _holding_the_bytes(piece: memoryview, dtype_code: int, candidates: Iterable[Any]) -> Any:
    """The candidate tensor (plain, at the start of its storage) whose storage
    is `piece`'s bytes, zero-padded; None where none is, or where those that
    are differ in what they would describe (their shapes, say: the same
    bytes used twice in the code are two lifted constants alike)."""
    found = []
    for tensor in candidates:
        storage = tensor.detach().untyped_storage()
        size = storage.nbytes()
        try:
            same_dtype = _DTYPES_BY_CODE.get(dtype_code) == torch_dtype_name(tensor.dtype)
        except CudaRunnerError:
            continue
        if (same_dtype and not tensor.storage_offset() and 0 < size <= len(piece) and piece[size:].tobytes().count(0) == len(piece) - size
                and bytes(_storage_bytes(tensor, storage)) == bytes(piece[:size])):
            found.append(tensor)
    described = {(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.untyped_storage().nbytes()) for tensor in found}
    return found[0] if len(described) == 1 else None


def _storage_bytes(tensor: Any, storage: Any) -> memoryview:
    """A tensor's whole storage as host bytes."""
    import torch

    flat = torch.empty(0, dtype=torch.uint8).set_(storage.cpu() if tensor.device.type != "cpu" else storage)
    return memoryview(flat.numpy().data).cast("B")


@dataclass(frozen=True)
class Sharing:
    """The outcome: the methods (some now with constant tables), the segments, and what was shared."""

    methods: dict[str, MethodSpec]
    segments: dict[str, Any]
    shared_segments: dict[str, tuple[str, ...]]  # segment -> the methods that name it
    notes: tuple[str, ...]  # why a method shares nothing
    kept_blobs: dict[str, str] = dataclasses.field(default_factory=dict)  # method -> why it keeps its blob


def share_weights(methods: Mapping[str, MethodSpec], segments: Mapping[str, Any], tables: Mapping[str, list[StoredConstant] | str]) -> Sharing:
    """Give every storage that two or more methods hold alike one segment.

    A method with at least one such storage trades its weights blob for a
    constant table (its other constants get segments of their own); methods
    that share nothing keep their blobs, so older readers see what they did."""
    kept = {name: table for name, table in tables.items() if isinstance(table, str)}
    notes = [f"method {name!r} keeps its weights blob: {why}" for name, why in kept.items()]
    usable = {name: table for name, table in tables.items() if not isinstance(table, str)}
    holders: dict[tuple[Any, ...], list[str]] = {}
    for name, table in usable.items():
        for stored in table:
            holders.setdefault(stored.key, [])
            if name not in holders[stored.key]:
                holders[stored.key].append(name)
    shared_keys = [key for key, names in holders.items() if len(names) > 1]
    if not shared_keys:
        return Sharing(dict(methods), dict(segments), {}, tuple(notes), kept)
    shared_names = {key: f"shared_c{index}" for index, key in enumerate(shared_keys)}
    converting = [name for name, table in usable.items() if any(stored.key in shared_names for stored in table)]
    out_methods = dict(methods)
    out_segments = dict(segments)
    shared_segments: dict[str, tuple[str, ...]] = {shared_names[key]: tuple(holders[key]) for key in shared_keys}
    for name in converting:
        spec = methods[name]
        if spec.weights_segment is not None:
            out_segments.pop(spec.weights_segment, None)
        bound: list[ConstantSpec] = []
        for index, stored in enumerate(usable[name]):
            segment = shared_names.get(stored.key)
            if segment is None:
                segment = f"{name}_c{index}"
                out_segments[segment] = stored.data
            else:
                out_segments.setdefault(segment, stored.data)
            bound.append(dataclasses.replace(stored.spec, segment=segment))
        out_methods[name] = dataclasses.replace(spec, weights_segment=None, constants=tuple(bound))
    return Sharing(out_methods, out_segments, shared_segments, tuple(notes), kept)


def state_not_shared(methods: Mapping[str, MethodSpec], held: Mapping[str, frozenset[str]], written: frozenset[str],
                     kept_blobs: Mapping[str, str] | None = None) -> list[str]:
    """One line for each buffer in `written` (one method writes it) that
    several methods hold (`held`: each method's buffers) but do not name one
    segment for: a method whose blob could not be split, or whose library
    compiled the buffer into its code, reads its compile-time value, not what
    the other wrote. `kept_blobs`: why a method kept its blob, where it did."""
    lines = []
    for fqn in sorted(written):
        holders = sorted(name for name in methods if fqn in held.get(name, frozenset()))
        segments = {name: next((constant.segment for constant in methods[name].constants or () if constant.fqn == fqn), None)
                    for name in holders}
        if len(holders) > 1 and (None in segments.values() or len(set(segments.values())) > 1):
            reasons = [f"method {name!r} keeps its weights blob: {(kept_blobs or {})[name]}" for name in holders if name in (kept_blobs or {})]
            why = "; ".join(reasons) if reasons else "a library compiled it into its code"
            lines.append(f"buffer {fqn!r} is state of methods {', '.join(map(repr, holders))}, but they do not share one copy of it ({why}): "
                         "what one method writes to it, the others do not read")
    return lines


def required_features(methods: Mapping[str, MethodSpec]) -> tuple[str, ...]:
    return (CONSTANT_TABLE,) if any(spec.constants for spec in methods.values()) else ()


def mutated_buffers(spec: MethodSpec) -> frozenset[str]:
    return frozenset(spec.compile_options.get(MUTATED_BUFFERS_OPTION, ()))


def constant_tables(
    sources: Mapping[str, tuple[Any, bytes, bytes, MethodSpec, Mapping[str, Any]]], device: str, progress: Callable[[str], None],
) -> dict[str, list[StoredConstant] | str]:
    """For each method (program, library, blob, spec, the constants its build
    added to the program by name): its blob split by FQN, or why not."""
    tables: dict[str, list[StoredConstant] | str] = {}
    for name, (program, library, blob, spec, added) in sources.items():
        progress(f"reading the constants of {name!r} from its library")
        try:
            constants = library_constants(library, device)
        except (CudaRunnerError, OSError) as error:
            tables[name] = f"its library could not be asked for its constants here ({error})"
            continue
        tensors = {**program_tensors(program), **added}
        tables[name] = split_blob(constants, blob, tensors, mutated_buffers(spec), lifted_constants(program))
    return tables
