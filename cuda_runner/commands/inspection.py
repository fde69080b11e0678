"""What a bundle holds and whether this machine can run it (`cuda-runner inspect`).

Opening a bundle checks its header, manifest checksum and layout. `verify`
adds every segment digest and, for each method this machine can run, loads
the library and runs it once on generated inputs with the library's own input
checks on: that catches a manifest that lies about its library, which digests
alone cannot (a rewritten bundle has correct digests).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BundleError, CudaRunnerError
from ..format.bundle import BundleReader
from ..format.manifest import DimSpec, Manifest, MethodSpec, SegmentEntry, TensorSpec
from ..format.program import ProgramInfo, ProgramReader
from ..format.signing import TrustedKey, read_signature_file, signature_path
from ..format.source import ModelReader, open_model
from ..report.schema import SCHEMAS
from ..runtime.devices import Device, incompatibility

# AOTI_CPU_ISA values, as people know them.
_ISA_NAMES = {"INVALID_VEC_ISA": "none (scalar code)", "AVX512": "AVX-512", "AVX512 AVX512_VNNI": "AVX-512 VNNI",
              "AVX512 AVX512_VNNI AMX_TILE": "AVX-512 VNNI AMX", "AVX2": "AVX2", "ASIMD": "NEON or SVE", "VSX": "VSX", "ZVECTOR": "z/Vector",
              "VecAVX512": "AVX-512", "VecAVX2": "AVX2", "VecNEON": "NEON", "VecSVE256": "SVE-256"}


def isa_name(value: str | None) -> str | None:
    return None if value is None else _ISA_NAMES.get(value, value)


def tensor_json(spec: TensorSpec) -> dict[str, Any]:
    data: dict[str, Any] = {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}
    if spec.bounds is not None:
        data["bounds"] = {"min": spec.bounds[0], "max": spec.bounds[1]}
    if spec.span_bounds is not None:
        data["span_bounds"] = {"min": spec.span_bounds[0], "max": spec.span_bounds[1]}
    return data


def dim_json(dim: DimSpec) -> dict[str, Any]:
    return {"min": dim.min, "max": dim.max, "example": dim.example}


def shared_weights_json(manifest: Manifest) -> dict[str, Any]:
    """Each weight segment several methods name: its size, the methods, and the FQNs bound to it."""
    shared = {}
    for name, methods in manifest.shared_weights().items():
        entry = manifest.segment(name)
        fqns = sorted({constant.fqn for method in manifest.methods.values() for constant in method.constants if constant.segment == name})
        shared[name] = {"size": 0 if entry is None else entry.size, "methods": methods, "fqns": fqns}
    return shared


@dataclass
class MethodReport:
    spec: MethodSpec
    library: SegmentEntry | None
    weights: SegmentEntry | None
    not_runnable_reason: str | None
    library_check: str | None = None  # with verify: "passed", "skipped: ...", or why it failed
    call_helper: SegmentEntry | None = None
    needs_libtorch: bool | None = None  # under provider auto; None where the library could not be read
    provider_note: str = ""  # why

    def to_json(self) -> dict[str, Any]:
        spec, device = self.spec, self.spec.device
        device_json: dict[str, Any] = {"type": device.type}
        if device.compute_capability:
            device_json["compute_capability"] = device.compute_capability
        if device.type == "cpu":
            device_json["cpu_isa"] = isa_name(device.cpu_isa)
            device_json["cpu_flags"] = list(device.cpu_flags)
        return {
            "device": device_json,
            "inputs": [tensor_json(tensor) for tensor in spec.inputs],
            "outputs": [tensor_json(tensor) for tensor in spec.outputs],
            "dims": {name: dim_json(dim) for name, dim in spec.dims.items()},
            "library": _segment_json(self.library),
            "weights": _segment_json(self.weights),
            "call_helper": _segment_json(self.call_helper),
            "samples": spec.has_samples,
            "torch_version": spec.torch_version,
            "compile_options": dict(spec.compile_options),
            "runnable_here": self.not_runnable_reason is None,
            "not_runnable_reason": self.not_runnable_reason,
            "library_check": self.library_check,
            "needs_libtorch": self.needs_libtorch,
            "provider_note": self.provider_note,
        }


def _segment_json(entry: SegmentEntry | None) -> dict[str, Any] | None:
    return None if entry is None else {"segment": entry.name, "size": entry.size, "digest": entry.digest}


@dataclass
class SignatureReport:
    """The detached signature beside the bundle, and whether a trusted key made it."""

    path: Path
    present: bool
    key_hint: str | None = None  # what the signature says about its key (SHA-256 of the public key PEM)
    signer: str | None = None  # fingerprint of the trusted key that verified it
    error: str | None = None  # why it did not verify, when trusted keys were given

    @property
    def verified(self) -> bool | None:
        return None if self.signer is None and self.error is None else self.signer is not None

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "present": self.present, "key_hint": self.key_hint, "signer": self.signer,
                "verified": self.verified, "error": self.error}


def _signature_report(reader: BundleReader, keys: Sequence[TrustedKey]) -> SignatureReport:
    path = signature_path(reader.path)
    present = path.exists() or path.is_symlink()
    report = SignatureReport(path, present, _key_hint(path) if present else None)
    if keys:
        try:
            report.signer = reader.require_signature(keys).signer
        except BundleError as error:
            report.error = str(error)
    return report


def _program_signature_report(reader: ProgramReader, keys: Sequence[TrustedKey]) -> SignatureReport:
    report = SignatureReport(signature_path(reader.path), False)
    try:
        reader.require_signature(keys)
    except BundleError as error:
        report.error = str(error)
    return report


def _key_hint(path: Path) -> str | None:
    try:
        hint = json.loads(read_signature_file(path))["verificationMaterial"]["publicKey"]["hint"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError, BundleError):
        return None
    return str(hint)[:128]


@dataclass
class InspectResult:
    path: Path
    format_version: str
    file_size: int
    manifest: Manifest
    methods: dict[str, MethodReport]
    signature: SignatureReport | None = None
    segment_digests_ok: dict[str, bool] | None = None  # with verify; a segment that cannot be checked is absent
    warnings: list[str] = field(default_factory=list)
    program: ProgramInfo | None = None  # for an ExecuTorch program
    # per program method: (shim functions this libtorch lacks, or None without libtorch; libraries searched)
    shim_check: dict[str, tuple[list[str] | None, str | None]] = field(default_factory=dict)

    @property
    def verified(self) -> bool | None:
        """None without verify; else whether every digest and every library check passed."""
        if self.segment_digests_ok is None:
            return None
        checks = [report.library_check for report in self.methods.values() if report.library_check is not None]
        return all(self.segment_digests_ok.values()) and all(check == "passed" or check.startswith("skipped") for check in checks)

    @property
    def runnable_here(self) -> bool:
        signature_ok = self.signature is None or self.signature.verified is not False
        return all(report.not_runnable_reason is None for report in self.methods.values()) and self.verified is not False and signature_ok

    def to_json(self) -> dict[str, Any]:
        segments = []
        users = self.manifest.segment_users()
        for entry in self.manifest.segments:
            segment: dict[str, Any] = {"name": entry.name, "offset": entry.offset, "size": entry.size, "digest": entry.digest,
                                       "methods": users.get(entry.name, [])}
            if self.segment_digests_ok is not None:
                segment["verified"] = self.segment_digests_ok.get(entry.name)
            segments.append(segment)
        document = {
            "schema": SCHEMAS["inspect"],
            "path": str(self.path),
            "format_version": self.format_version,
            "file_size": self.file_size,
            "build": dict(self.manifest.build),
            "metadata": dict(self.manifest.metadata),
            "required_features": list(self.manifest.required_features),
            "optional_features": list(self.manifest.optional_features),
            "methods": {name: report.to_json() for name, report in self.methods.items()},
            "segments": segments,
            "shared_weights": shared_weights_json(self.manifest),
            "signature": None if self.signature is None else self.signature.to_json(),
            "runnable_here": self.runnable_here,
            "verified": self.verified,
        }
        if self.program is not None:
            document["executorch"] = program_json(self.program, self.shim_check)
        return document


def program_json(info: ProgramInfo, shim_check: dict[str, tuple[list[str] | None, str | None]]) -> dict[str, Any]:
    methods = {}
    for name, method in info.methods.items():
        facts = method.library
        missing, searched = shim_check[name]
        methods[name] = {
            "payload_layout": method.layout.value,
            "instructions": method.instructions,
            "compile_specs": method.compile_specs,
            "keys": method.keys,
            "weights_bytes": method.weights_bytes,
            "weight_count": method.weight_count,
            "library": {
                "needed": list(facts.needed),
                "gpu_kernels": list(facts.kernels),
                "shim_symbols": list(facts.shim_symbols),
                "missing_here": missing,
                "searched_libtorch": searched,
            },
        }
    return {"data_file": None if info.data_path is None else str(info.data_path), "methods": methods, "constant_methods": dict(info.constant_methods)}


def _provider_needs(reader: Any, spec: MethodSpec) -> tuple[bool | None, str]:
    """Which shim provider the method's library would run on, read from its file (nothing is loaded)."""
    from ..runtime.providers import runs_on

    try:
        return runs_on(reader.segment(spec.library_segment, verify=False))
    except (BundleError, OSError) as error:
        return None, f"the library cannot be read: {error}"


def runnable_problem(spec: MethodSpec) -> str | None:
    """Why this machine cannot run `spec` on the device it was built for, or None."""
    problem = incompatibility(spec, Device(spec.device.type))
    return None if problem is None else str(problem)


def inspect_bundle(
    path: str | os.PathLike[str], *, verify: bool = False, trusted_keys: Sequence[TrustedKey] = (), data: str | os.PathLike[str] | None = None,
) -> InspectResult:
    """Describe a bundle, or an ExecuTorch program (with its data file)."""
    with open_model(path, data) as reader:
        manifest = reader.manifest
        reports = {
            name: MethodReport(spec, manifest.segment(spec.library_segment), manifest.segment(spec.weights_segment) if spec.weights_segment else None,
                               runnable_problem(spec),
                               call_helper=manifest.segment(spec.call_helper_segment) if spec.call_helper_segment else None)
            for name, spec in manifest.methods.items()
        }
        for report in reports.values():
            report.needs_libtorch, report.provider_note = _provider_needs(reader, report.spec)
        if isinstance(reader, ProgramReader):  # no signature; only SHA-256-named keys can be checked
            # Trusted keys make a signature the policy, which a program cannot meet: refused, and nothing loads.
            signature = _program_signature_report(reader, trusted_keys) if trusted_keys else None
            result = InspectResult(reader.path, f"ExecuTorch {reader.version}", reader.file_size, manifest, reports, signature,
                                   program=reader.info, shim_check=_shim_check(reader.info))
        else:
            assert isinstance(reader, BundleReader)  # open_model gives one of the two
            result = InspectResult(reader.path, reader.version, reader.file_size, manifest, reports, _signature_report(reader, trusted_keys))
        if verify and (result.signature is None or result.signature.verified is not False):
            result.segment_digests_ok = reader.verify_all()
            for report in reports.values():
                report.library_check = _check_library(reader, report, all(result.segment_digests_ok.values()))
        return result


def _shim_check(info: ProgramInfo) -> dict[str, tuple[list[str] | None, str | None]]:
    from ..runtime.shim import missing_symbols

    return {
        name: missing_symbols(method.library.shim_symbols, "cuda" if method.library.uses_cuda else "cpu")
        for name, method in info.methods.items()
    }


def _check_library(reader: ModelReader, report: MethodReport, digests_ok: bool) -> str:
    """Load the method and run it once with the library's own input checks."""
    if not digests_ok:
        return "skipped: digests do not match"
    if report.not_runnable_reason is not None:
        return "skipped: not runnable here"
    from ..io.inputs import RandomInputs, resolve_inputs
    from ..runtime.devices import choose_device
    from ..runtime.method import Method
    from ..runtime.options import LoadOptions

    spec = report.spec
    try:
        # Inputs made from the manifest: if it lies, the library's checks say so.
        inputs = resolve_inputs(spec, RandomInputs())
        with Method.load(reader, spec, choose_device([spec], None), LoadOptions(check_inputs=True)) as method:
            method.run(inputs.arrays)
    except CudaRunnerError as error:
        return f"failed: {error}"
    return "passed"
