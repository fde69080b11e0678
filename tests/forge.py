"""Build bundles byte by byte with struct.pack, valid or deliberately hostile."""

from __future__ import annotations

import json

import xxhash

from cuda_runner.format.bundle import HEADER, MAGIC

HEADER_SIZE = 64


def digest(data: bytes) -> str:
    """The spec's construction, written out independently of the reader's code."""
    chunks = [data[start:start + (16 << 20)] for start in range(0, len(data), 16 << 20)]
    return "xxh3-128-tree16m:" + xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(chunk) for chunk in chunks))


def method(library: str = "m_so", weights: str | None = "m_w", **overrides) -> dict:
    data = {
        "device": {"type": "cpu"},
        "library_segment": library,
        "weights_segment": weights,
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
        "outputs": [{"name": "output_0", "dtype": "float32", "shape": ["batch", 2]}],
        "dims": {"batch": {"min": 1, "max": 8, "example": 2}},
        "torch_version": "2.13.0",
    }
    data.update(overrides)
    return data


def forge(
    manifest: dict | bytes,
    segments: dict[str, bytes] | None = None,
    *,
    alignment: int = 64,
    header: dict | None = None,
    fix_checksum: bool = True,
    layout: list[dict] | None = None,
) -> bytes:
    """A bundle file. Segment entries are laid out (and digested) here unless
    `manifest` is raw bytes or `layout` overrides the entries."""
    segments = segments if segments is not None else {"m_so": b"\x7fELF" + b"L" * 60, "m_w": b"W" * 100}
    if isinstance(manifest, dict):
        manifest = dict(manifest)
        manifest["segments"] = layout if layout is not None else _layout(manifest, segments, alignment)
        encoded = json.dumps(manifest).encode()
        if layout is None:  # offsets depend on the manifest's own length
            manifest["segments"] = _layout(manifest, segments, alignment, len(encoded))
            encoded = json.dumps(manifest).encode()
            assert [entry["offset"] for entry in manifest["segments"]] == [entry["offset"] for entry in _layout(manifest, segments, alignment, len(encoded))]
        entries = manifest["segments"]
    else:
        encoded, entries = manifest, []
    body = bytearray(HEADER_SIZE + len(encoded))
    body[HEADER_SIZE:] = encoded
    manifest_end = len(body)
    for entry in entries:
        data = segments.get(entry["name"], b"")[: max(0, min(entry["size"], 1 << 20))]
        end = entry["offset"] + len(data)
        if end > 1 << 24:
            continue  # a hostile offset far past any real file
        if len(body) < end:
            body.extend(bytes(end - len(body)))
        start = max(entry["offset"], manifest_end)  # never overwrite the manifest itself
        body[start:end] = data[start - entry["offset"]:]
    fields = {"major": 1, "minor": 0, "header_size": 64, "manifest_offset": 64, "manifest_size": len(encoded),
              "file_size": len(body), "alignment": alignment, "reserved": 0}
    fields.update(header or {})
    packed = HEADER.pack(MAGIC, *fields.values(), bytes(16))
    checksum = xxhash.xxh3_128(packed[:48] + bytes(encoded)).digest() if fix_checksum else bytes(16)
    body[:HEADER_SIZE] = packed[:48] + checksum
    return bytes(body)


def _layout(manifest: dict, segments: dict[str, bytes], alignment: int, manifest_size: int | None = None) -> list[dict]:
    cursor = HEADER_SIZE + (manifest_size or len(json.dumps(manifest).encode()))
    entries = []
    for name, data in segments.items():
        cursor = (cursor + alignment - 1) // alignment * alignment
        entries.append({"name": name, "offset": cursor, "size": len(data), "digest": digest(data)})
        cursor += len(data)
    return entries
