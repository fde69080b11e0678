"""The bundle format: one module reads and writes it (bundle.py), one knows the manifest."""

from .bundle import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    BundleReader,
    open_bundle,
    read_manifest,
    write_bundle,
)
from .digest import segment_digest
from .manifest import DeviceSpec, DimSpec, Manifest, MethodSpec, SegmentEntry, TensorSpec

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "BundleReader",
    "DeviceSpec",
    "DimSpec",
    "Manifest",
    "MethodSpec",
    "SegmentEntry",
    "TensorSpec",
    "open_bundle",
    "read_manifest",
    "segment_digest",
    "write_bundle",
]
